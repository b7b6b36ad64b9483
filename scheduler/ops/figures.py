"""The operator's view of the pool, as pure functions over plain data (no ORM): the page at
/ops/ and the Prometheus metrics at /metrics are built from these; scheduler/ops/snapshot.py reads the
database into them.

- utilization: devices held over devices offered, per bucket of time (an hour, six hours);
- daily totals: held device-hours and revenue per day, from the usage ledger;
- stuck jobs: a job held in a state longer than expected;
- the queue grouped by team, with predicted starts; nodes with their state.
"""

import math
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from decimal import ROUND_HALF_EVEN, Decimal

from scheduler.executors.base import disagreement

UP, SILENT, LOST, STOPPED = "up", "silent", "lost", "stopped"
DRAINED, DOWN = "drained", "down"  # as a cluster engine (Slurm) reports its node
AMOUNT_PLACES = Decimal("0.00000001")


# Utilization ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Held:
    """Devices held (an allocation) or offered (a node) from start to end; end None: still."""

    start: datetime
    end: datetime | None
    devices: int


@dataclass(frozen=True)
class Bucket:
    start: datetime
    end: datetime
    held: float  # device-seconds allocated in the bucket
    capacity: float  # device-seconds offered by the nodes in the bucket (up to now)

    @property
    def utilization(self):
        """Held over offered, 0..1; None where no device was offered."""
        return min(1.0, self.held / self.capacity) if self.capacity > 0 else None


def overlap_seconds(start, end, lo, hi):
    """Seconds [start, end) and [lo, hi) have in common."""
    return max(0.0, (min(end, hi) - max(start, lo)).total_seconds())


def window(now, span_seconds, bucket_seconds):
    """(start, end) of a window of span_seconds ending with the bucket now falls in, buckets
    aligned to the epoch (so hours and six-hour blocks start at UTC 00:00)."""
    stamp = now.timestamp()
    end = datetime.fromtimestamp(math.floor(stamp / bucket_seconds) * bucket_seconds + bucket_seconds, UTC)
    return end - timedelta(seconds=span_seconds), end


def utilization(held, offered, start, end, bucket_seconds, now):
    """One Bucket per bucket_seconds from start to end: the device-seconds held (allocations)
    and offered (nodes) in it. Open intervals run to now; nothing counts after now, so the
    bucket in progress is measured over its elapsed part."""
    step = timedelta(seconds=bucket_seconds)
    result = []
    lo = start
    while lo < end:
        hi = min(lo + step, end)
        upto = min(hi, now)
        result.append(
            Bucket(
                start=lo,
                end=hi,
                held=_device_seconds(held, lo, upto, now),
                capacity=_device_seconds(offered, lo, upto, now),
            )
        )
        lo = hi
    return result


def _device_seconds(intervals, lo, hi, now):
    if hi <= lo:
        return 0.0
    return sum(i.devices * overlap_seconds(i.start, i.end or now, lo, hi) for i in intervals)


def mean_utilization(buckets):
    """Held over offered across the buckets; None when nothing was offered."""
    capacity = sum(b.capacity for b in buckets)
    return min(1.0, sum(b.held for b in buckets) / capacity) if capacity > 0 else None


# Held device-hours and revenue per day ---------------------------------------------------------


@dataclass(frozen=True)
class Usage:
    """A usage record: gpus held from start to end, charged amount."""

    start: datetime
    end: datetime
    gpus: int
    amount: Decimal


@dataclass(frozen=True)
class Day:
    day: date
    device_seconds: float
    amount: Decimal  # charged for the time held that day
    credits: Decimal  # credited that day (time lost through the network's fault)

    @property
    def device_hours(self):
        return self.device_seconds / 3600

    @property
    def billed(self):
        return self.amount - self.credits


def days_back(today, count):
    """The last `count` days up to today, oldest first."""
    return [today - timedelta(days=n) for n in range(count - 1, -1, -1)]


def daily(usage, credits, days):
    """A Day per day (UTC): a record's held time and amount are shared between the days it
    spans in proportion to its time in each; credits ((at, amount) pairs) count on their day."""
    wanted = set(days)
    seconds = dict.fromkeys(days, 0.0)
    amounts = {d: Decimal(0) for d in days}
    for record in usage:
        total = (record.end - record.start).total_seconds()
        if total <= 0:
            day = _utc_day(record.start)
            if day in wanted:
                amounts[day] += Decimal(record.amount)
            continue
        for day in _days_between(record.start, record.end):
            if day not in wanted:
                continue
            lo = datetime(day.year, day.month, day.day, tzinfo=UTC)
            part = overlap_seconds(record.start, record.end, lo, lo + timedelta(days=1))
            seconds[day] += record.gpus * part
            amounts[day] += Decimal(record.amount) * Decimal(part) / Decimal(total)
    credited = {d: Decimal(0) for d in days}
    for at, amount in credits:
        day = _utc_day(at)
        if day in wanted:
            credited[day] += Decimal(amount)
    return [Day(day=d, device_seconds=seconds[d], amount=amounts[d].quantize(AMOUNT_PLACES, rounding=ROUND_HALF_EVEN), credits=credited[d]) for d in days]


def _utc_day(moment):
    return moment.astimezone(UTC).date()


def _days_between(start, end):
    day, last = _utc_day(start), _utc_day(end)
    while day <= last:
        yield day
        day += timedelta(days=1)


# Stuck jobs --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Thresholds:
    starting_seconds: float  # a job may take this long from compute held to its process running
    queued_seconds: float  # a queued job may be this far past its predicted start
    running_seconds: float  # a running job may be this far past its predicted finish
    overrun_seconds: float  # a job holding compute may be this far past the end of its span or ceiling


@dataclass(frozen=True)
class JobState:
    id: str
    name: str
    team: str
    state: str
    since: datetime | None = None  # when compute was held (starting, running)
    predicted_start: datetime | None = None
    predicted_finish: datetime | None = None
    held_until: datetime | None = None  # when its span or ceiling runs out
    holding: bool = True  # whether a job starting or running still has an allocation


@dataclass(frozen=True)
class Stuck:
    job: JobState
    over_seconds: float  # how far past what was expected
    why: str


def stuck_jobs(jobs, now, thresholds):
    """The jobs held in a state longer than expected, the furthest over first:
    starting for longer than starting_seconds; queued queued_seconds past the predicted start;
    starting or running overrun_seconds past the end of its span or ceiling (the runner should
    have stopped it), or running_seconds past its predicted finish; starting or running with no
    compute held."""
    found = [s for s in (_stuck(job, now, thresholds) for job in jobs) if s is not None]
    return sorted(found, key=lambda s: -s.over_seconds)


def _stuck(job, now, t):
    def past(moment, allowed):
        return None if moment is None else (now - moment).total_seconds() - allowed

    if job.state == "queued":
        over = past(job.predicted_start, t.queued_seconds)
        if over is not None and over > 0:
            return Stuck(job, over, f"still queued {human(over + t.queued_seconds)} after its predicted start")
        return None
    if job.state not in ("starting", "running"):
        return None
    if not job.holding:
        return Stuck(job, math.inf, f"{job.state} but holds no compute")
    over = past(job.held_until, t.overrun_seconds)
    if over is not None and over > 0:
        return Stuck(job, over, f"holds compute {human(over + t.overrun_seconds)} past the end of its span or ceiling")
    if job.state == "starting":
        over = past(job.since, t.starting_seconds)
        if over is not None and over > 0:
            return Stuck(job, over, f"starting for {human(over + t.starting_seconds)} (expected within {human(t.starting_seconds)})")
        return None
    over = past(job.predicted_finish, t.running_seconds)
    if over is not None and over > 0:
        return Stuck(job, over, f"running {human(over + t.running_seconds)} past its predicted finish")
    return None


def human(seconds):
    """A short duration: '40s', '14m', '2h 05m', '3d 4h'."""
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds}s"
    minutes, hours, days = seconds // 60, seconds // 3600, seconds // 86400
    if hours < 1:
        return f"{minutes}m"
    if days < 1:
        return f"{hours}h {minutes % 60:02d}m"
    return f"{days}d {hours % 24}h"


# The queue by team -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Queued:
    id: str
    name: str
    team: str
    gpus: int
    submitted_at: datetime
    predicted_start: datetime | None = None
    wait_reason: str = ""


@dataclass
class TeamQueue:
    team: str
    jobs: list = field(default_factory=list)

    @property
    def gpus(self):
        return sum(j.gpus for j in self.jobs)

    @property
    def oldest(self):
        return min(j.submitted_at for j in self.jobs)

    @property
    def next_start(self):
        """The earliest predicted start of the team's queued jobs (None: none predicted)."""
        return min((j.predicted_start for j in self.jobs if j.predicted_start is not None), default=None)


def queue_by_team(queued):
    """The queue grouped by team, the team waiting longest first; each team's jobs by predicted
    start (jobs with none last), then by submission."""
    teams = {}
    for job in queued:
        teams.setdefault(job.team, TeamQueue(job.team)).jobs.append(job)
    far = datetime.max.replace(tzinfo=UTC)
    for group in teams.values():
        group.jobs.sort(key=lambda j: (j.predicted_start is None, j.predicted_start or far, j.submitted_at, j.id))
    return sorted(teams.values(), key=lambda g: (g.oldest, g.team))


def oldest_wait_seconds(queued, now):
    """How long the longest-waiting queued job has waited (0 with an empty queue)."""
    return max(((now - j.submitted_at).total_seconds() for j in queued), default=0.0)


# Nodes --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeRow:
    name: str
    device_type: str
    devices: int
    allocated: int
    last_heartbeat: datetime
    lost_at: datetime | None = None
    stopped_at: datetime | None = None
    executor: str = ""  # a cluster engine's node ("slurm"); blank: a runner's
    busy_elsewhere: int = 0  # devices the engine's other users hold
    engine_state: str = ""
    engine_reason: str = ""

    def status(self, now, timeout_seconds):
        """up; silent (no heartbeat for the timeout, not yet declared lost; for an engine's
        node, the engine not answering); lost; stopped; drained or down (as the engine says)."""
        if self.lost_at is not None:
            return LOST
        if self.stopped_at is not None:
            return STOPPED
        if (now - self.last_heartbeat).total_seconds() > timeout_seconds:
            return SILENT
        if self.executor and self.engine_state in (DRAINED, DOWN):
            return self.engine_state
        return UP

    @property
    def free(self):
        return max(0, self.devices - self.allocated - self.busy_elsewhere)


@dataclass(frozen=True)
class EngineDisagreement:
    """An allocation whose billed seconds and the engine's elapsed seconds differ by more than
    a second: for the operator to look at (scheduler/engine.py reconcile)."""

    allocation_id: str
    job_id: str
    job_name: str
    node: str
    handle: str
    ended_at: datetime
    billed_seconds: float
    engine_seconds: float

    @property
    def difference(self):
        return self.billed_seconds - self.engine_seconds


def disagreements(rows):
    """Of (allocation, job, name, node, handle, started_at, ended_at, engine_seconds) rows, those
    whose meter (ended - started) differs from the engine's accounting by more than its whole
    seconds explain (executors.base.disagreement), newest first. An engine_seconds below 0: the
    engine no longer remembered the job (nothing to compare)."""
    found = []
    for allocation_id, job_id, name, node, handle, started_at, ended_at, engine_seconds in rows:
        if engine_seconds is None or engine_seconds < 0 or ended_at is None:
            continue
        billed = (ended_at - started_at).total_seconds()
        if disagreement(billed, engine_seconds) is not None:
            found.append(EngineDisagreement(str(allocation_id), str(job_id), name, node, handle, ended_at, billed, engine_seconds))
    return sorted(found, key=lambda d: d.ended_at, reverse=True)


def pool_totals(nodes, now, timeout_seconds):
    """(devices offered, devices allocated) over the nodes that are up."""
    up = [n for n in nodes if n.status(now, timeout_seconds) == UP]
    return sum(n.devices for n in up), sum(min(n.allocated, n.devices) for n in up)


# Charts ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Bar:
    x: float
    y: float
    width: float
    height: float
    title: str
    label: str = ""  # an axis label under the bar, for some bars
    label_x: float = 0.0  # where the label is anchored: its start, or its end at the chart's edge
    label_anchor: str = "start"


LABEL_CHAR_WIDTH = 6.5  # an axis label's character, in the chart's units (11px text, drawn about 1:1)


def label_place(x, label, width):
    """(x, anchor) of an axis label starting at x: at its start, unless it would run past the
    chart's right edge, where it ends there instead (a last day's "Sat 05" was cut to "Sat 0")."""
    if x + len(label) * LABEL_CHAR_WIDTH > width:
        return width, "end"
    return x, "start"


def bars(buckets, width, height, label_seconds=3600, label_format="%H:%M"):
    """An SVG bar per bucket, its height its utilization (a bucket with no devices offered is
    a zero-height bar): geometry for a server-drawn chart of `width` x `height`. Bars starting
    on a multiple of label_seconds (UTC) get an axis label."""
    if not buckets:
        return []
    step = width / len(buckets)
    result = []
    for n, bucket in enumerate(buckets):
        share = bucket.utilization
        h = round((share or 0.0) * height, 2)
        percent = "no devices" if share is None else f"{share * 100:.0f}%"
        x = round(n * step, 2)
        label = bucket.start.strftime(label_format) if bucket.start.timestamp() % label_seconds == 0 else ""
        label_x, anchor = label_place(x, label, width)
        result.append(
            Bar(
                x=x,
                y=round(height - h, 2),
                width=round(max(step - 1, 1), 2),
                height=h,
                title=f"{bucket.start:%Y-%m-%d %H:%M}–{bucket.end:%H:%M} UTC: {percent}",
                label=label,
                label_x=label_x,
                label_anchor=anchor,
            )
        )
    return result


# A snapshot for the metrics ---------------------------------------------------------------------


@dataclass
class Snapshot:
    """The pool at a moment, as /metrics exports it (plain data: scheduler/ops/prom.py renders it)."""

    now: datetime
    node_timeout_seconds: float
    nodes: list  # NodeRow
    job_counts: dict  # state -> jobs
    queued: list  # Queued
    stuck: list  # Stuck
    held_device_seconds: dict  # device type -> device-seconds held, ever (the ledger, running allocations included)
    charged: Decimal  # the ledger's amounts, ever
    credited: Decimal  # credits, ever
    currency: str = "USD"
