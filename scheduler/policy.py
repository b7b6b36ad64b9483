"""The placement policy: pure functions over plain data, no ORM, no datetimes.

All times are floats in seconds (epoch seconds in production, simulated seconds in
scheduler.simulator); datetimes are built only for the texts users read. The scheduler command,
`predict` and the simulator call the same `plan()`.

`plan(queue, nodes, running, now, policy=...)` decides, in one pass over the queue:

- which jobs start now and on which devices (`Plan.placements`);
- which preemptible allocations give their devices back (`Plan.preempt`, each with a reason);
- which job has devices reserved from when (`Plan.reservations`);
- which jobs can no longer meet their deadline (`Plan.infeasible`: flagged, still run);
- and, for every other job, why it waits, in words a user understands (`Plan.waiting`).

Rules every policy keeps:

- a job never starts before its not-before time, and such a job holds no one back;
- a job whose data is not staged on a node (`staged_on` a set without it) is not placed there,
  and a job still staging holds no one back;
- a gang of up to one node's devices goes on one node, best fit: the node left with the fewest
  free devices, partly used nodes before whole free ones, so whole nodes stay free for large
  jobs. A job larger than any node takes whole free nodes (largest first) and puts what is left
  over on one more node, best fit;
- preemptible jobs queue behind the others (`queue_order`); a job that is not preemptible and
  cannot start preempts preemptible allocations to get devices (the youngest first, the fewest
  devices lost), but never one whose job was preempted less than an hour ago;
- the highest-priority job that cannot start gets a reservation: the earliest time enough devices
  free up, from the running allocations' expected ends; later jobs start before it only if they
  end by then or use devices the reservation does not need (EASY backfilling). `fifo` does not
  backfill (its first blocked job holds back the rest) and `sjf` does not reserve.

Policies (`POLICIES`): `fifo` (submission order), `sjf` (shortest expected job first), `easy`
(FIFO with EASY backfill), `sjf-easy` (shortest first, with EASY's reservation and backfill: given
true durations, the simulator's `oracle` reference), `edf` (earliest deadline first, with
backfill), and `ours`:

    ours first protects one starving job: of the jobs (not preemptible) whose wait has reached
    their patience, the one whose wait is the most times its patience goes first: it starts if it
    fits, else it holds the reservation, so no job, however large or long, is overtaken for ever.
    A job's patience is the shorter of max(STARVE_MIN, expected duration) capped at STARVE_CAP
    (2 h to 3 days) and STARVE_MIN + its FIFO drain time: when first-come-first-served would reach
    it, (the running allocations' expected GPU-seconds left + those of the jobs queued before it,
    not preemptible) / the pool's GPUs, an estimate of what EASY would make it wait. A long job
    submitted to a quiet cluster is protected after hours, not after its own days. One job, not
    all that waited long: where waits run to days a rule that put every long-waiting job first,
    oldest first, turned the policy into FIFO (1.88x the oracle's mean JCT on one cluster).
    Then the jobs whose deadline can still be met and whose slack (deadline - now -
    expected duration) is under URGENT_SLACK, least slack first: urgency grows as slack shrinks.
    Then the rest, smallest first, size = expected seconds x sqrt(GPUs) / F, F the team's
    fair-share factor 2^(-FAIR_SHARE_WEIGHT x U/S) (Slurm's classic with its exponent damped: U
    the team's share of the usage decayed with a half-life, S its share of the cluster, equal by
    default; undamped, a team with half the usage and an eighth of the shares had its jobs
    counted 16x their size, and real clusters have such teams), a deadline job's slack standing
    in for its size when smaller. Everything after the reservation is backfilled around it.
    Preemptible jobs come after all others. A job whose deadline can no longer be met (now +
    expected duration > deadline) is flagged in `Plan.infeasible`, gets no urgency, and runs
    when its turn comes as if it had no deadline.

Times in plans are expected ends and starts: what running allocations and queued jobs say they
need (`expected_end`, `expected_seconds`); an allocation past its expected end is taken to end
now, one with no expected end is never counted on.

It stays one file, over 500 lines, because every policy is one pass (`plan()`) over the same
private state (the device pool, the reservations, the preemption victims): split, those private
helpers would become an interface between modules, and the simulator and the scheduler must keep
calling exactly the same code.
"""

import math
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeAlias, TypedDict, cast, overload

POLICIES = {"fifo", "sjf", "easy", "sjf-easy", "edf", "ours"}
POLICY_ORDER = ("fifo", "sjf", "easy", "sjf-easy", "edf", "ours")  # for tables

DEFAULT_HALF_LIFE = 7 * 86400.0  # Slurm's default PriorityDecayHalfLife
PREEMPT_AT_MOST_EVERY = 3600.0  # a job is preempted at most once an hour
# ours: chosen across shared/traces (itp_cluster02 at 128 GPUs, itp_cluster10 at 32) and
# synthetic traces at loads 0.7 and 0.9, with skewed teams (scheduler.simulator), the same for all.
STARVE_MIN = 2 * 3600.0  # a job's patience: its expected duration, at least this ...
STARVE_CAP = 3 * 86400.0  # ... and at most this (shorter caps, 6 h to 2 days, cost mean JCT where waits run to days)
URGENT_SLACK = 1800.0  # a deadline job with less slack than this goes before the rest, least slack first
FAIR_SHARE_WEIGHT = 0.25  # the fair-share factor is 2^(-FAIR_SHARE_WEIGHT x U/S)
GPU_WEIGHT = 0.5  # size = expected seconds x GPUs^GPU_WEIGHT
INF = math.inf

Part: TypeAlias = tuple[str, tuple[int, ...]]  # (node id, device indices)
Parts: TypeAlias = tuple[Part, ...]  # where a job starts: one part per node
# [time, node id, devices, allocation id or None]: a list, so that a preemption can move its time.
_Release: TypeAlias = list[Any]


@dataclass(frozen=True)
class QueuedJob:
    id: str
    gpus: int
    submitted_at: float
    gpu_type: str = ""  # "" takes any type
    not_before: float | None = None
    deadline: float | None = None
    expected_seconds: float = 3600.0
    team: str = ""
    preemptible: bool = False
    staged_on: frozenset[str] | None = None  # nodes holding its data; None: it needs no staging
    staging_note: str = ""  # why it is not staged yet


@dataclass(frozen=True)
class NodeState:
    id: str
    device_type: str
    devices: int  # how many the node has
    free: tuple[int, ...]  # indices of its free devices
    held_elsewhere: int = 0  # devices a cluster engine's other users hold (never released to us in a plan)


@dataclass(frozen=True)
class Running:
    """An allocation holding devices now."""

    id: str  # the allocation's id
    node_id: str
    devices: tuple[int, ...]
    preemptible: bool
    started_at: float
    job_id: str = ""
    team: str = ""
    expected_end: float | None = None  # None: unknown (never counted on to free its devices)
    preempting: bool = False  # asked to give its devices back already
    last_preempted_at: float | None = None  # when its job was last preempted


@dataclass(frozen=True, init=False)
class Placement:
    """Where a job starts: ((node id, devices), ...), one part per node."""

    job_id: str
    parts: tuple[tuple[str, tuple[int, ...]], ...]

    @overload
    def __init__(self, job_id: str, parts: Iterable[tuple[str, Iterable[int]]]) -> None: ...

    @overload
    def __init__(self, job_id: str, parts: str, devices: Iterable[int]) -> None: ...

    def __init__(self, job_id: str, parts: Iterable[tuple[str, Iterable[int]]] | str, devices: Iterable[int] | None = None) -> None:
        # Placement(job, parts) or, for one node, Placement(job, node_id, devices).
        if devices is not None:
            parts = ((cast(str, parts), tuple(devices)),)
        object.__setattr__(self, "job_id", job_id)
        object.__setattr__(self, "parts", tuple((node, tuple(devs)) for node, devs in cast("Iterable[tuple[str, Iterable[int]]]", parts)))

    @property
    def node_id(self) -> str:
        return self._one()[0]

    @property
    def devices(self) -> tuple[int, ...]:
        return self._one()[1]

    @property
    def gpus(self) -> int:
        return sum(len(devices) for _, devices in self.parts)

    def _one(self) -> Part:
        if len(self.parts) != 1:
            raise ValueError(f"placement of job {self.job_id} spans {len(self.parts)} nodes: read .parts")
        return self.parts[0]


@dataclass
class Plan:
    placements: list[Placement] = field(default_factory=list)
    waiting: dict[str, str] = field(default_factory=dict)  # job id -> why it waits, for users
    preempt: list[str] = field(default_factory=list)  # allocation ids to preempt
    preempt_reasons: dict[str, str] = field(default_factory=dict)  # allocation id -> why
    reservations: dict[str, float] = field(default_factory=dict)  # job id -> reserved from
    infeasible: set[str] = field(default_factory=set)  # deadline can no longer be met
    wake_at: float | None = None  # the next time this plan would change with nothing else happening


# Texts ------------------------------------------------------------------------------------------


def _devices(n: int) -> str:
    return f"{n} device" if n == 1 else f"{n} devices"


def _when(t: float, now: float | None = None) -> str:
    if t == INF:
        return "an unknown time"
    moment = datetime.fromtimestamp(t, UTC)
    if now is not None and abs(t - now) < 86400:
        return f"{moment:%H:%M} UTC"
    return f"{moment:%Y-%m-%d %H:%M} UTC"


def _span(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    hours = seconds / 3600
    if hours < 10:
        return f"{hours:.1f}".rstrip("0").rstrip(".") + " h"
    if hours < 72:
        return f"{hours:.0f} h"
    return f"{hours / 24:.1f}".rstrip("0").rstrip(".") + " days"


def _seconds(t: float | datetime) -> float:
    """Times are floats; a datetime from older callers is taken as its epoch seconds."""
    return t.timestamp() if hasattr(t, "timestamp") else t


# Fair share -------------------------------------------------------------------------------------


def decayed_usage(records: Iterable[tuple[str, float, float]], now: float, half_life: float = DEFAULT_HALF_LIFE) -> dict[str, float]:
    """GPU-seconds per team, each record weighed by 2^(-age/half_life) from when it ended.
    records: iterable of (team, gpu_seconds, ended_at)."""
    usage: dict[str, float] = {}
    for team, gpu_seconds, ended_at in records:
        weight = 2.0 ** (-max(0.0, now - ended_at) / half_life)
        usage[team] = usage.get(team, 0.0) + gpu_seconds * weight
    return usage


def fair_share_factor(team: str, usage: Mapping[str, float] | None, shares: Mapping[str, float] | None = None) -> float:
    """Slurm's classic fair-share factor F = 2^(-U/S): U the team's share of all decayed usage,
    S its share of the cluster (operator-set shares, normalised; equal by default). 1.0 for a
    team that used nothing, 0.5 for one that used exactly its share, towards 0 for heavy users."""
    usage = usage or {}
    total = sum(usage.values())
    if total <= 0:
        return 1.0
    s = _normalised_shares(shares, set(usage) | {team})
    return 2.0 ** (-(usage.get(team, 0.0) / total) / s[team])


def _normalised_shares(shares: Mapping[str, float] | None, teams: Iterable[str]) -> dict[str, float]:
    raw = {t: (shares.get(t, 1.0) if shares else 1.0) for t in teams}
    if shares:
        raw.update(dict(shares.items()))
    total = sum(v for v in raw.values() if v > 0) or 1.0
    return {t: max(v, 1e-9) / total for t, v in raw.items()}


def _factors(
    queue: Iterable[QueuedJob],
    running: Iterable[Running],
    now: float,
    usage: Mapping[str, float] | None,
    shares: Mapping[str, float] | None,
    half_life: float,
) -> dict[str, float]:
    """Fair-share factor per team, running allocations' usage so far counted (decayed)."""
    usage = dict(usage or {})
    rate = half_life / math.log(2)
    for allocation in running:
        if allocation.team:
            held = max(0.0, now - allocation.started_at)
            usage[allocation.team] = usage.get(allocation.team, 0.0) + len(allocation.devices) * rate * (1 - 2.0 ** (-held / half_life))
    teams = {job.team for job in queue} | set(usage)
    total = sum(usage.values())
    if total <= 0:
        return dict.fromkeys(teams, 1.0)
    s = _normalised_shares(shares, teams)
    return {team: 2.0 ** (-FAIR_SHARE_WEIGHT * (usage.get(team, 0.0) / total) / s[team]) for team in teams}


# Devices ----------------------------------------------------------------------------------------


class _Pool:
    """The free devices of the nodes during one pass, indexed so best fit is cheap with many
    nodes: per device type, partly used nodes by free count and whole free nodes by size."""

    def __init__(self, nodes: Collection[NodeState]) -> None:
        self.nodes = {n.id: n for n in nodes}
        self.free = {n.id: set(n.free) for n in nodes}
        self.partial: dict[str, dict[int, set[str]]] = {}  # type -> {free count: {node ids}}
        self.whole: dict[str, dict[int, set[str]]] = {}  # type -> {devices: {node ids}}
        self.max_devices: dict[str, int] = {}  # type -> the largest node
        self.total_devices: dict[str, int] = {}  # type -> devices in all
        self.total_free = 0
        self._capacity: dict[str, tuple[int, int]] = {}
        for n in nodes:
            self.partial.setdefault(n.device_type, {})
            self.whole.setdefault(n.device_type, {})
            self.max_devices[n.device_type] = max(self.max_devices.get(n.device_type, 0), n.devices)
            self.total_devices[n.device_type] = self.total_devices.get(n.device_type, 0) + n.devices
            self._index(n.id)
            self.total_free += len(self.free[n.id])

    def _bucket(self, node_id: str) -> set[str] | None:
        n = self.nodes[node_id]
        count = len(self.free[node_id])
        if count == 0:
            return None
        if count >= n.devices:
            return self.whole[n.device_type].setdefault(n.devices, set())
        return self.partial[n.device_type].setdefault(count, set())

    def _index(self, node_id: str) -> None:
        bucket = self._bucket(node_id)
        if bucket is not None:
            bucket.add(node_id)

    def _unindex(self, node_id: str) -> None:
        bucket = self._bucket(node_id)
        if bucket is not None:
            bucket.discard(node_id)

    def take(self, parts: Iterable[tuple[str, Collection[int]]]) -> None:
        for node_id, devices in parts:
            self._unindex(node_id)
            self.free[node_id].difference_update(devices)
            self.total_free -= len(devices)
            self._index(node_id)

    def types(self, job: QueuedJob) -> list[str]:
        if job.gpu_type:
            return [job.gpu_type] if job.gpu_type in self.max_devices else []
        return list(self.max_devices)

    def capacity(self, job: QueuedJob) -> tuple[int, int]:
        """(largest node, devices in all) over the nodes of the job's type."""
        known = self._capacity.get(job.gpu_type)
        if known is None:
            types = self.types(job)
            known = self._capacity[job.gpu_type] = (max((self.max_devices[t] for t in types), default=0), sum(self.total_devices[t] for t in types))
        return known

    def find(self, job: QueuedJob, avoid: Mapping[str, set[int]] | None = None) -> Parts | None:
        """Where the job could start now: parts, or None. avoid: {node id: devices} it must not use."""
        types = self.types(job)
        if not types or job.gpus > self.total_free:
            return None
        largest = max(self.max_devices[t] for t in types)
        if job.staged_on is not None or avoid:
            candidates = None if job.staged_on is None else [i for i in job.staged_on if i in self.nodes and self.nodes[i].device_type in types]
            return _find_scan(job.gpus, largest, self.nodes, self.free, candidates, types, avoid or {})
        if job.gpus <= largest:
            best = self._best_single(types, job.gpus, largest, ())
            return None if best is None else ((best, _lowest(self.free[best], job.gpus)),)
        return self._multi(types, job.gpus, largest)

    def _best_single(self, types: Collection[str], gpus: int, largest: int, exclude: Collection[str]) -> str | None:
        for count in range(gpus, largest + 1):
            found = [i for t in types for i in self.partial[t].get(count, ()) if i not in exclude]
            if found:
                return min(found)
        for size in range(gpus, largest + 1):
            found = [i for t in types for i in self.whole[t].get(size, ()) if i not in exclude]
            if found:
                return min(found)
        return None

    def _multi(self, types: Collection[str], gpus: int, largest: int) -> Parts | None:
        wholes = sorted(((-size, i) for t in types for size, ids in self.whole[t].items() for i in ids))
        parts, left, used = [], gpus, set()
        for minus_size, node_id in wholes:
            if left >= -minus_size:
                parts.append((node_id, _lowest(self.free[node_id], -minus_size)))
                used.add(node_id)
                left += minus_size
        if left:
            best = self._best_single(types, left, largest, used)
            if best is None:
                return None
            parts.append((best, _lowest(self.free[best], left)))
        return tuple(parts)


def _lowest(devices: Iterable[int], n: int) -> tuple[int, ...]:
    return tuple(sorted(devices)[:n])


def _find_scan(
    gpus: int,
    largest: int,
    nodes: Mapping[str, NodeState],
    free: Mapping[str, set[int]],
    candidates: Sequence[str] | None,
    types: Collection[str],
    avoid: Mapping[str, set[int]],
) -> Parts | None:
    """The same choice as _Pool.find by scanning the nodes (for staged jobs, reservations and
    backfilling around them)."""
    ids = candidates if candidates is not None else [i for i, n in nodes.items() if n.device_type in types]

    def usable(i: str) -> set[int]:
        held = avoid.get(i)
        return free[i] - held if held else free[i]

    if gpus <= largest:
        best = None
        for i in ids:
            devs = usable(i)
            if len(devs) >= gpus:
                key = (len(devs) >= nodes[i].devices, len(devs), i)
                if best is None or key < best[0]:
                    best = (key, i, devs)
        return None if best is None else ((best[1], _lowest(best[2], gpus)),)
    wholes = sorted((-nodes[i].devices, i) for i in ids if len(usable(i)) >= nodes[i].devices)
    parts, left, used = [], gpus, set()
    for minus_size, i in wholes:
        if left >= -minus_size:
            parts.append((i, _lowest(usable(i), -minus_size)))
            used.add(i)
            left += minus_size
    if left > largest:
        return None
    if left:
        rest = _find_scan(left, largest, nodes, free, [i for i in ids if i not in used], types, avoid)
        if rest is None:
            return None
        parts.extend(rest)
    return tuple(parts)


# Ordering ---------------------------------------------------------------------------------------


def queue_order(job: QueuedJob) -> tuple[bool, float, str]:
    """Submission order, preemptible jobs after the rest: a preempted job goes back to the
    queue with its first place, and must not take back the devices it was preempted for."""
    return (job.preemptible, job.submitted_at, job.id)


def _order_key(
    policy: str,
    now: float,
    factors: Mapping[str, float],
    infeasible: Collection[str],
    urgent: set[str],
) -> Callable[[QueuedJob], tuple[float | str, ...]]:
    if policy in ("fifo", "easy"):
        return queue_order
    if policy in ("sjf", "sjf-easy"):
        return lambda j: (j.preemptible, j.expected_seconds, j.submitted_at, j.id)
    if policy == "edf":
        return lambda j: (j.preemptible, INF if j.deadline is None else j.deadline, j.submitted_at, j.id)

    def ours(j: QueuedJob) -> tuple[bool, int, float, float, str]:
        size = j.expected_seconds * j.gpus**GPU_WEIGHT / factors.get(j.team, 1.0)
        if j.deadline is not None and j.id not in infeasible:
            slack = j.deadline - now - j.expected_seconds
            if slack < URGENT_SLACK:
                urgent.add(j.id)
                return (j.preemptible, 0, slack, j.submitted_at, j.id)
            size = min(size, slack)
        return (j.preemptible, 1, size, j.submitted_at, j.id)

    return ours


# The pass ---------------------------------------------------------------------------------------


class _State(TypedDict):
    """What one pass of plan() carries between the jobs it considers."""

    reservation: tuple[QueuedJob, float, dict[str, set[int]]] | None  # (job, from when, {node id: devices})
    blocked: QueuedJob | None  # fifo: the first job that could not start
    reclaim: tuple[int, int] | None  # _may_preempt's cache
    room: tuple[int, int] | None  # _room_beside's cache


def plan(
    queue: Sequence[QueuedJob],
    nodes: Collection[NodeState],
    running: Sequence[Running],
    now: float | datetime,
    *,
    usage: Mapping[str, float] | None = None,
    shares: Mapping[str, float] | None = None,
    policy: str = "ours",
    half_life: float = DEFAULT_HALF_LIFE,
    explain: bool = True,
    preempt_every: float = PREEMPT_AT_MOST_EVERY,
) -> Plan:
    """One scheduling pass (see the module's docstring). usage: decayed GPU-seconds per team of
    ended allocations (decayed_usage); the running allocations' usage so far is added here.
    explain=False leaves out the texts of jobs that merely wait (the simulator's speed).
    preempt_every: a job is preempted at most once in this many seconds."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose from {', '.join(POLICY_ORDER)}")
    now = _seconds(now)
    result = Plan()
    pool = _Pool(nodes)
    waiting = result.waiting

    def note(job: QueuedJob, text: str) -> str:
        return _note(result, job, text, now)

    # Who can be considered now.
    due: list[QueuedJob] = []
    wake = INF
    for job in queue:
        nb = job.not_before
        if nb is not None and nb > now:
            wake = min(wake, nb)
            waiting[job.id] = f"not before {_when(nb)}"
            continue
        if job.deadline is not None and now + job.expected_seconds > job.deadline:
            result.infeasible.add(job.id)
        largest, total = pool.capacity(job)
        if job.gpus > total:
            kind = f"{job.gpu_type} " if job.gpu_type else ""
            waiting[job.id] = (
                f"waiting for a node with {job.gpus} {kind}device{'s' if job.gpus != 1 else ''}; none is online"
                if not total
                else f"waiting for {job.gpus} {kind}devices; the online nodes have {total} in all"
            )
            continue
        if job.staged_on is not None:
            staged = [pool.nodes[i].devices for i in job.staged_on if i in pool.nodes and _type_ok(job, pool.nodes[i])]
            if not (any(d >= job.gpus for d in staged) if job.gpus <= largest else sum(staged) >= job.gpus):
                waiting[job.id] = job.staging_note or "waiting for its data to be staged"
                continue
        due.append(job)

    factors = _factors(queue, running, now, usage, shares, half_life) if policy == "ours" else {}
    urgent: set[str] = set()
    due.sort(key=_order_key(policy, now, factors, result.infeasible, urgent))

    # When devices come back: running allocations at their expected ends, then our placements.
    releases: list[_Release] = []  # (time, node id, devices)
    victims: dict[str, list[Running]] = {}  # node id -> preemptible allocations that may be preempted now
    for a in running:
        end = INF if a.expected_end is None else max(a.expected_end, now)
        releases.append([end, a.node_id, a.devices, a.id])
        if a.preemptible and a.node_id in pool.nodes and (a.preempting or a.last_preempted_at is None or now - a.last_preempted_at >= preempt_every):
            victims.setdefault(a.node_id, []).append(a)
    release_of = {r[3]: r for r in releases}

    state: _State = {"reservation": None, "blocked": None, "reclaim": None, "room": None}  # reservation: (job, time, {node id: devices})
    backfill = policy in ("easy", "sjf-easy", "edf", "ours")

    def consider(job: QueuedJob) -> str:
        """Place the job, have it preempt, reserve for it, or say why it waits. Returns what
        became of it: "placed", "preempting", "reserved" or "waiting"."""
        reservation, blocked = state["reservation"], state["blocked"]
        if blocked is not None:
            if explain:
                waiting[job.id] = note(job, f"waiting behind job {blocked.id[:8]}, submitted earlier")
            return "waiting"
        parts = pool.find(job)
        if parts is not None and reservation is not None and now + job.expected_seconds > reservation[1]:
            parts = pool.find(job, avoid=reservation[2]) if _room_beside(job, pool, reservation[2], state) else None
            if parts is None:
                if explain:
                    waiting[job.id] = note(
                        job, f"waiting: starting now would delay job {reservation[0].id[:8]}, which has devices reserved from {_when(reservation[1], now)}"
                    )
                return "waiting"
        if parts is not None:
            pool.take(parts)
            state["reclaim"] = state["room"] = None
            result.placements.append(Placement(job.id, parts))
            end = now + job.expected_seconds
            for node_id, devices in parts:
                releases.append([end, node_id, devices, None])
            return "placed"
        if not job.preemptible and victims and _may_preempt(job, pool, victims, state):
            taken = _preempt_for(job, pool, victims, now)
            state["reclaim"] = None
            if taken is not None:
                parts, chosen, claimed = taken
                pool.take(claimed)
                state["room"] = None
                end = now + job.expected_seconds
                deadline = job.deadline if job.id not in result.infeasible else None
                why = (
                    f"job {job.id[:8]} needs its devices to meet its deadline ({_when(deadline, now)})"
                    if deadline is not None
                    else "a job that is not preemptible needs its devices"
                )
                for a in chosen:
                    release_of[a.id][0] = end
                    if not a.preempting:
                        result.preempt.append(a.id)
                        result.preempt_reasons[a.id] = why
                for node_id, devices in claimed:
                    releases.append([end, node_id, devices, None])
                waiting[job.id] = note(job, f"preempting {len(chosen)} preemptible job{'s' if len(chosen) != 1 else ''} to make room")
                return "preempting"
        if not backfill:
            if policy == "fifo":
                state["blocked"] = job
            if explain or policy == "fifo":
                waiting[job.id] = note(job, _short_of(job, pool))
            return "waiting"
        if reservation is None:
            at, reserved = _reserve(job, pool, releases)
            state["reservation"] = (job, at, reserved or {})
            if at < INF:
                result.reservations[job.id] = at
            waiting[job.id] = note(
                job,
                f"{_short_of(job, pool)}; reserved from {_when(at, now)}"
                if at < INF
                else f"{_short_of(job, pool)}; no start can be reserved yet (running jobs have no expected end)",
            )
            return "reserved"
        if explain:
            if policy == "ours":
                why = "waiting behind higher-priority jobs (fair share, deadlines)"
            elif policy == "edf":
                why = "waiting behind jobs with earlier deadlines"
            elif policy == "sjf-easy":
                why = "waiting behind shorter jobs"
            else:
                why = "waiting behind jobs submitted earlier"
            waiting[job.id] = note(job, why)
        return "waiting"

    handled: set[str] = set()
    if policy == "ours":
        # First the one starving job (the module's docstring), then urgent deadlines, least slack
        # first, then the rest by priority, all around the reservation.
        fifo_waits = _fifo_waits(due, running, pool, now)
        patiences = {j.id: patience(j, fifo_waits[j.id]) for j in due if not j.preemptible}
        starving = [j for j in due if not j.preemptible and now - j.submitted_at >= patiences[j.id]]
        if starving:
            first = max(starving, key=lambda j: ((now - j.submitted_at) / patiences[j.id], -j.submitted_at))
            consider(first)
            handled.add(first.id)
        for job in due:
            if job.id in urgent and job.id not in handled:
                consider(job)
                handled.add(job.id)
    for job in due:
        if job.id not in handled:
            consider(job)
    reservation = state["reservation"]
    if reservation is not None and now < reservation[1] < INF:
        wake = min(wake, reservation[1])
    result.wake_at = wake if wake < INF else None
    return result


def patience(job: QueuedJob, fifo_wait: float = INF) -> float:
    """How long a job may wait before ours protects it (the module's docstring); fifo_wait: its
    FIFO drain time (_fifo_waits)."""
    return min(STARVE_CAP, max(STARVE_MIN, job.expected_seconds), STARVE_MIN + fifo_wait)


def _fifo_waits(due: Iterable[QueuedJob], running: Iterable[Running], pool: _Pool, now: float) -> dict[str, float]:
    """{job id: when first-come-first-served would reach it} for the jobs that are not
    preemptible: (the running allocations' expected GPU-seconds left, those with no expected end
    left out, + the expected GPU-seconds of the jobs before it in submission order) / the GPUs it
    could use. One sort and one sum. The pool's GPUs of the job's types, but the work of all types
    (a cluster of several types overstates a job's drain time, and protects it sooner)."""
    ahead = sum(len(a.devices) * max(0.0, a.expected_end - now) for a in running if a.expected_end is not None)
    waits: dict[str, float] = {}
    for job in sorted((j for j in due if not j.preemptible), key=queue_order):
        waits[job.id] = ahead / max(1, pool.capacity(job)[1])
        ahead += job.gpus * job.expected_seconds
    return waits


def _type_ok(job: QueuedJob, node: NodeState) -> bool:
    return not job.gpu_type or job.gpu_type == node.device_type


def _note(result: Plan, job: QueuedJob, text: str, now: float) -> str:
    if job.id in result.infeasible and job.deadline is not None:  # infeasible: it has a deadline
        return (
            f"its deadline can no longer be met: it needs {_span(job.expected_seconds)} and "
            f"{_span(job.deadline - now)} {'is' if job.deadline - now < 90 else 'are'} left; {text}"
        )
    return text


def _short_of(job: QueuedJob, pool: _Pool) -> str:
    largest, _ = pool.capacity(job)
    types = pool.types(job)
    ids = [i for i, n in pool.nodes.items() if n.device_type in types and (job.staged_on is None or i in job.staged_on)]
    elsewhere = sum(pool.nodes[i].held_elsewhere for i in ids)
    others = f"; {elsewhere} held by other users' jobs on the cluster" if elsewhere else ""
    if job.gpus <= largest:
        most = max((len(pool.free[i]) for i in ids), default=0)
        return f"waiting for {_devices(job.gpus)} on one node; at most {most} free{others}"
    whole = sum(1 for i in ids if len(pool.free[i]) >= pool.nodes[i].devices)
    return f"waiting for {_devices(job.gpus)} on whole nodes; {sum(len(pool.free[i]) for i in ids)} free, {whole} whole node{'s' if whole != 1 else ''}{others}"


def _reserve(job: QueuedJob, pool: _Pool, releases: Iterable[_Release]) -> tuple[float, dict[str, set[int]] | None]:
    """The earliest time the job fits, with the devices released at their expected ends, and
    the devices it would take then: on each node it takes, those released last first, so the
    devices free now stay out of the reservation where they can, for jobs to backfill (taking
    the lowest-numbered could take every device free now and hold back jobs that harm no one)."""
    types = pool.types(job)
    largest, _ = pool.capacity(job)
    candidates = None if job.staged_on is None else [i for i in job.staged_on if i in pool.nodes]
    future = {i: set(devs) for i, devs in pool.free.items()}
    freed_at: dict[str, dict[int, float]] = {i: {} for i in future}  # devices released later than now, and when
    ordered = sorted((r for r in releases if r[0] < INF and r[1] in future), key=lambda r: r[0])
    k = 0
    while k < len(ordered):
        at = ordered[k][0]
        while k < len(ordered) and ordered[k][0] == at:
            _, node_id, devices, *_ = ordered[k]
            future[node_id].update(devices)
            freed_at[node_id].update(dict.fromkeys(devices, at))
            k += 1
        parts = _find_scan(job.gpus, largest, pool.nodes, future, candidates, types, {})
        if parts is not None:
            latest_first = lambda i: sorted(future[i], key=lambda d: (-freed_at[i].get(d, -INF), d))  # noqa: E731
            return at, {node_id: set(latest_first(node_id)[: len(devices)]) for node_id, devices in parts}
    return INF, None


def _room_beside(job: QueuedJob, pool: _Pool, reserved: Mapping[str, set[int]], state: _State) -> bool:
    """A cheap bound: are there enough free devices outside the reservation for the job? Cached
    in state["room"] (None after any change) as (most on one node, devices on whole nodes)."""
    room = state["room"]
    if room is None:
        most, whole = 0, 0
        for i, devices in pool.free.items():
            n = len(devices - reserved[i]) if i in reserved else len(devices)
            most = max(most, n)
            if n >= pool.nodes[i].devices:
                whole += n
        room = state["room"] = (most, whole)
    most, whole = room
    largest, _ = pool.capacity(job)
    return job.gpus <= most if job.gpus <= largest else job.gpus <= whole + most


def _may_preempt(job: QueuedJob, pool: _Pool, victims: Mapping[str, list[Running]], state: _State) -> bool:
    """A cheap bound: could preempting give the job enough devices anywhere? Cached in
    state["reclaim"] (None after any change) as (most on one node, devices of nodes that could
    be emptied)."""
    reclaim = state["reclaim"]
    if reclaim is None:
        most, whole = 0, 0
        for i, node in pool.nodes.items():
            n = len(pool.free[i]) + sum(len(a.devices) for a in victims.get(i, ()))
            most = max(most, n)
            if n >= node.devices:
                whole += node.devices
        reclaim = state["reclaim"] = (most, whole)
    most, whole = reclaim
    largest, _ = pool.capacity(job)
    return job.gpus <= most if job.gpus <= largest else job.gpus <= whole


def _preempt_for(
    job: QueuedJob,
    pool: _Pool,
    victims: dict[str, list[Running]],
    now: float,
) -> tuple[Parts, list[Running], list[Part]] | None:
    """Devices for a job that is not preemptible, on one node (or whole nodes for a job larger
    than a node), by preempting the youngest preemptible allocations there: (parts, allocations,
    free devices claimed as parts) or None."""
    types = pool.types(job)
    ids = [i for i, n in pool.nodes.items() if n.device_type in types and (job.staged_on is None or i in job.staged_on)]
    largest, _ = pool.capacity(job)
    options: list[tuple[int, str, list[Running], set[int]]] = []  # (cost, node id, allocations taken, devices available)
    for i in ids:
        available = set(pool.free[i])
        taking = []
        need = job.gpus if job.gpus <= largest else pool.nodes[i].devices
        for a in sorted(victims.get(i, ()), key=lambda a: (a.preempting, a.started_at, a.id), reverse=True):
            if len(available) >= need:
                break
            available |= set(a.devices)
            taking.append(a)
        if len(available) >= need:
            cost = sum(len(a.devices) for a in taking if not a.preempting)
            options.append((cost, i, taking, available))
    if not options:
        return None
    options.sort(key=lambda o: (o[0], o[1]))
    if job.gpus <= largest:
        chosen = [options[0]]
    else:
        chosen, left = [], job.gpus
        for option in sorted(options, key=lambda o: (o[0] / pool.nodes[o[1]].devices, o[1])):
            if left <= 0:
                break
            chosen.append(option)
            left -= pool.nodes[option[1]].devices
        if left > 0:
            return None
    parts, allocations, claimed, left = [], [], [], job.gpus
    for _, i, taking, available in chosen:
        keep = sorted(available)[: min(left, len(available))]
        left -= len(keep)
        parts.append((i, tuple(keep)))
        allocations.extend(taking)
        free_taken = tuple(d for d in keep if d in pool.free[i])
        if free_taken:
            claimed.append((i, free_taken))
        victims[i] = [a for a in victims[i] if a not in taking] if i in victims else []
    return tuple(parts), allocations, claimed


# The first-come-first-served pass of the first release, kept for its callers ------------------


def _fits(job: QueuedJob, node: NodeState) -> bool:
    return (not job.gpu_type or job.gpu_type == node.device_type) and node.devices >= job.gpus


def place_fcfs(queue: Iterable[QueuedJob], nodes: Sequence[NodeState], now: float | datetime) -> Plan:
    """Place jobs in submission order on one node each; the first that cannot start now holds
    back the rest, so a large job is not overtaken forever by small ones. Jobs that no live node
    could ever hold, or that must not start yet, do not hold anyone back."""
    now = _seconds(now)
    result = Plan()
    free = {node.id: list(node.free) for node in nodes}
    blocked_by: str | None = None
    for job in sorted(queue, key=queue_order):
        if job.not_before is not None and _seconds(job.not_before) > now:
            result.waiting[job.id] = f"not before {_when(_seconds(job.not_before))}"
            continue
        candidates = [n for n in nodes if _fits(job, n)]
        if not candidates:
            kind = f"{job.gpu_type} " if job.gpu_type else ""
            result.waiting[job.id] = f"waiting for a node with {job.gpus} {kind}device{'s' if job.gpus != 1 else ''}; none is online"
            continue
        if job.staged_on is not None:
            candidates = [n for n in candidates if n.id in job.staged_on]
            if not candidates:
                result.waiting[job.id] = job.staging_note or "waiting for its data to be staged"
                continue
        if blocked_by is not None:
            result.waiting[job.id] = f"waiting behind job {blocked_by[:8]}, submitted earlier"
            continue
        fitting = [n for n in candidates if len(free[n.id]) >= job.gpus]
        if not fitting:
            most = max(len(free[n.id]) for n in candidates)
            result.waiting[job.id] = f"waiting for {_devices(job.gpus)} on one node; at most {most} free"
            blocked_by = job.id
            continue
        node = min(fitting, key=lambda n: (len(free[n.id]), n.id))
        devices = tuple(sorted(free[node.id])[: job.gpus])
        free[node.id] = [d for d in free[node.id] if d not in devices]
        result.placements.append(Placement(job.id, node.id, devices))
    return result


def choose_preemptions(
    plan: Plan,
    queue: Iterable[QueuedJob],
    nodes: Sequence[NodeState],
    running: Iterable[Running],
    now: float | datetime,
) -> tuple[list[str], dict[str, str]]:
    """Which preemptible allocations to stop so that jobs that are not preemptible can start,
    after a pass that left them waiting (place_fcfs). `plan()` does this itself.

    For each job the plan left waiting (in queue order) that is not preemptible, is due, and
    has its data staged: the node where it fits with the fewest devices preempted, the youngest
    preemptible allocations first (they lose the least work). Devices already being given back
    count as free; an allocation whose job was preempted less than an hour ago is spared.
    Returns (allocation ids to preempt, {job id: why it waits now})."""
    now = _seconds(now)
    placed = {p.job_id for p in plan.placements}
    pool = _Pool(nodes)
    for placement in plan.placements:
        pool.take(placement.parts)
    victims: dict[str, list[Running]] = {}
    for a in running:
        if (
            a.preemptible
            and a.node_id in pool.nodes
            and (a.preempting or a.last_preempted_at is None or now - _seconds(a.last_preempted_at) >= PREEMPT_AT_MOST_EVERY)
        ):
            victims.setdefault(a.node_id, []).append(a)
    chosen: list[str] = []
    notes: dict[str, str] = {}
    for job in sorted(queue, key=queue_order):
        if job.id in placed or job.preemptible or (job.not_before is not None and _seconds(job.not_before) > now):
            continue
        if not any(_fits(job, n) and (job.staged_on is None or n.id in job.staged_on) for n in nodes):
            continue
        taken = _preempt_for(job, pool, victims, now)
        if taken is None:
            continue
        _, allocations, claimed = taken
        pool.take(claimed)
        chosen.extend(a.id for a in allocations if not a.preempting)
        notes[job.id] = f"preempting {len(allocations)} preemptible job{'s' if len(allocations) != 1 else ''} to make room"
    return chosen, notes


def choose_staging_node(
    job: QueuedJob,
    nodes: Iterable[NodeState],
    cached_bytes: Mapping[str, int],
    lined_up: Mapping[str, int],
) -> str | None:
    """Where to stage a queued job's data: a node that can run it, preferring the one that
    already holds the most of its data, then the one with the fewest jobs lined up, then the
    one with the most free devices."""
    candidates = [n for n in nodes if _fits(job, n)]
    if not candidates:
        return None
    best = min(candidates, key=lambda n: (-cached_bytes.get(n.id, 0), lined_up.get(n.id, 0), -len(n.free), n.id))
    return best.id


MAX_STAGING_NODES = 3  # a job waiting on busy nodes is staged on at most this many at once


def choose_another_staging_node(
    job: QueuedJob,
    nodes: Iterable[NodeState],
    staged_on: Collection[str],
    spare: Mapping[str, int],
    cached_bytes: Mapping[str, int],
    lined_up: Mapping[str, int],
) -> str | None:
    """A queued job is staged on staged_on, but none of those nodes has the devices for it now;
    if another node that could run it has them spare (spare: node id -> devices free and not
    already promised to a job ahead in the queue), stage it there too, so it does not wait for
    its first node while another stands idle. The same order of preference as
    choose_staging_node. None when no such node, when a staged node has room, or when the job is
    a gang larger than any node (its nodes are chosen together) or is on MAX_STAGING_NODES."""
    fitting = [n for n in nodes if _fits(job, n)]
    if not fitting or not staged_on or len(staged_on) >= MAX_STAGING_NODES:
        return None
    if any(spare.get(i, 0) >= job.gpus for i in staged_on):
        return None
    candidates = [n for n in fitting if n.id not in staged_on and spare.get(n.id, 0) >= job.gpus]
    if not candidates:
        return None
    return min(candidates, key=lambda n: (-cached_bytes.get(n.id, 0), lined_up.get(n.id, 0), -spare.get(n.id, 0), n.id)).id


def choose_staging_nodes(
    job: QueuedJob,
    nodes: Sequence[NodeState],
    cached_bytes: Mapping[str, int],
    lined_up: Mapping[str, int],
    exclude: Collection[str] = (),
) -> list[str]:
    """Where to stage a queued job's data: one node (choose_staging_node) when one node can run
    it; for a gang larger than any node, enough nodes of its type to hold it together, in the
    same order of preference. [] when the live nodes cannot hold it. exclude: nodes that already
    stage it (their devices count)."""
    if any(_fits(job, n) for n in nodes):
        if exclude:
            return []
        best = choose_staging_node(job, nodes, cached_bytes, lined_up)
        return [] if best is None else [best]  # never None: a node fits
    typed = [n for n in nodes if not job.gpu_type or job.gpu_type == n.device_type]
    have = sum(n.devices for n in typed if n.id in exclude)
    chosen = []
    for node in sorted((n for n in typed if n.id not in exclude), key=lambda n: (-cached_bytes.get(n.id, 0), lined_up.get(n.id, 0), -n.devices, n.id)):
        if have >= job.gpus:
            break
        chosen.append(node.id)
        have += node.devices
    return chosen if have >= job.gpus else []


def predict(
    queue: Sequence[QueuedJob],
    nodes: Sequence[NodeState],
    running: Sequence[Running],
    now: float | datetime,
    *,
    usage: Mapping[str, float] | None = None,
    shares: Mapping[str, float] | None = None,
    policy: str = "ours",
    half_life: float = DEFAULT_HALF_LIFE,
) -> dict[str, tuple[float, float]]:
    """job id -> (predicted start, predicted finish): the current queue and running allocations
    simulated with their expected durations and no new arrivals (running ones end at their
    expected_end; one with none never ends, and jobs that wait on it get math.inf). Running
    allocations with a job_id are included with their start and expected end."""
    from scheduler.simulator import predict_queue  # here: the simulator imports this module (it runs this policy)

    return predict_queue(queue, nodes, running, _seconds(now), usage=usage, shares=shares, policy=policy, half_life=half_life)
