"""Replay a job trace through scheduler.policy.plan with a simulated clock (pure: no Django).

The clock jumps from event to event: arrivals, completions, and the times a plan asks to be
woken at (not-before times, reservations). At each event time the queue, the nodes' free devices
and the running allocations (with their expected ends) go through the same `plan()` the
scheduler uses; its placements start at once, its preemptions stop at once (the job checkpoints
on the notice and requeues with the work left, keeping its place), and everything is checked: a
device handed out twice, a job started before its not-before time or twice at once raises
SimulationError.

What the policy sees and what decides, for a trace (columns in shared/traces/README.md):

- Teams: a trace's own `team` column where it has one. Otherwise job j is drawn into one of
  `teams` (8 by default) with the skew real clusters show, a few heavy teams: team k (0-based)
  with weight (k + 1)^-SKEW, SKEW 1.5, so on 8 teams the largest submits about half the jobs
  (as on the one real cluster measured) and the smallest about 2%; the draw is u = H(seed:j) /
  16^8 (H: the first 8 hex digits of SHA-256) through the weights' cumulative sums, fixed per
  seed. skew=0 gives equal teams in expectation (the old hashing).
- Expected duration (what the policy sees): the true duration x f, f = max(1, lognormal with
  median 1.5 and sigma 0.5), drawn per job from Random(seed): users over-estimate (a fifth of
  them exactly right, the median by half, one in twenty by 3x or more). The true duration
  decides when a job ends; the estimate is its limit (it never runs past it), and a running
  job's allocation is expected to end at its limit (less what earlier runs held), as
  production's are (scheduler.allocations.running_allocations), whatever the policy was told.
- Learned durations (`ours`, or any policy with learn=True): as scheduler.services tells the
  real scheduler, min(the estimate, jobs.durations.learned_seconds of the held times of the jobs
  of the same work that had finished when the job arrived), a minute at least; the work is
  work_of(job): its team, its trace's `user` where there is one, and its GPUs (a trace names no
  code or config). Nothing from the future: a job's history is what ended before it was queued.
  The baselines read the estimates alone, as the published algorithms do.
- Deadlines: `trace` keeps the trace's own (submit + U(0.5, 1.5) x duration: about half cannot be
  met by a rigid job even started at once); `stretched` draws submit + duration x U(1.5, 3) from
  Random(f"{seed}-deadlines"), so every job can meet it.

Metrics (`metrics()`): JCT = finish - submit; queueing delay = first start - submit; bounded
slowdown = max(1, JCT / max(duration, 10 s)); makespan = last finish - first submit; utilization
= sum(GPUs x duration) / (pool GPUs x makespan); deadline satisfaction = share of jobs with a
deadline that finish by it; Jain's index (sum x)^2 / (n sum x^2) over teams, with x = the team's
mean bounded slowdown (equal service: 1.0 when every team's jobs are slowed alike); and the
longest queueing delay of a job of 16 or more GPUs.
"""

import csv
import hashlib
import heapq
import math
import random
import statistics
import time
from dataclasses import dataclass, field, replace

from jobs import durations
from scheduler import policy as P

INF = math.inf


class SimulationError(AssertionError):
    pass


@dataclass
class TraceJob:
    id: str
    submit: float
    gpus: int
    duration: float  # true run time
    estimate: float | None = None  # what the policy is told (None: the true duration)
    deadline: float | None = None
    team: str = ""
    preemptible: bool = False
    not_before: float | None = None
    gpu_type: str = ""
    user: str = ""


@dataclass
class Outcome:
    first_start: float | None = None
    finish: float | None = None
    preemptions: int = 0
    runs: list = field(default_factory=list)  # (start, end, ((node, devices), ...))
    told: float | None = None  # the expected seconds the policy was told when the job arrived


@dataclass
class Result:
    jobs: list
    outcomes: dict  # job id -> Outcome
    gpus: int
    plans: int = 0
    wall_seconds: float = 0.0
    stuck: list = field(default_factory=list)  # jobs never finished (no event left)


# Traces -----------------------------------------------------------------------------------------

TRACE_COLUMNS = ("job_id", "submit_time_s", "num_gpus", "duration_s")  # and deadline_s, optional


def read_trace(path):
    """The rows of a trace CSV; ValueError naming the missing column or the bad row."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in TRACE_COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"missing column(s) {', '.join(missing)}; expected {', '.join(TRACE_COLUMNS)}, deadline_s")
        rows = []
        for line, r in enumerate(reader, start=2):
            try:
                rows.append(
                    {
                        "job_id": r["job_id"],
                        "submit_time_s": float(r["submit_time_s"]),
                        "num_gpus": int(r["num_gpus"]),
                        "duration_s": float(r["duration_s"]),
                        "deadline_s": float(r["deadline_s"]) if r.get("deadline_s") else None,
                        "team": (r.get("team") or "").strip() or None,
                        "user": (r.get("user") or "").strip(),
                    }
                )
            except (TypeError, ValueError) as error:
                raise ValueError(f"line {line}: {error}") from None
        return rows


SKEW = 1.5  # team k's weight (k + 1)^-SKEW when a trace names no teams


def team_of(job_id, seed=0, teams=8, skew=SKEW):
    """The team a trace job without one is drawn into (the module's docstring)."""
    u = int(hashlib.sha256(f"{seed}:{job_id}".encode()).hexdigest()[:8], 16) / 16**8
    weights = [(k + 1) ** -skew for k in range(teams)]
    total, acc = sum(weights), 0.0
    for k, w in enumerate(weights):
        acc += w / total
        if u < acc:
            return f"team{k}"
    return f"team{teams - 1}"


def prepare(rows, *, seed=0, teams=8, deadlines="trace", noise=True, skew=SKEW):
    """TraceJobs from trace rows, with teams, noisy estimates and deadlines as the module says."""
    if deadlines not in ("trace", "stretched", "none"):
        raise ValueError(f"deadlines: trace, stretched or none, not {deadlines!r}")
    estimates, stretch = random.Random(seed), random.Random(f"{seed}-deadlines")
    jobs = []
    for r in rows:
        d = max(1.0, r["duration_s"])
        factor = max(1.0, estimates.lognormvariate(math.log(1.5), 0.5)) if noise else 1.0
        u = stretch.uniform(1.5, 3.0)
        deadline = {"trace": r.get("deadline_s"), "stretched": r["submit_time_s"] + d * u, "none": None}[deadlines]
        jobs.append(
            TraceJob(
                id=r["job_id"],
                submit=r["submit_time_s"],
                gpus=r["num_gpus"],
                duration=d,
                estimate=d * factor,
                deadline=deadline,
                team=r.get("team") or team_of(r["job_id"], seed, teams, skew),
                user=r.get("user") or "",
            )
        )
    return jobs


def make_nodes(gpus, per_node=8, device_type="gpu"):
    count = math.ceil(gpus / per_node)
    return [P.NodeState(f"n{i:03d}", device_type, min(per_node, gpus - i * per_node), tuple(range(min(per_node, gpus - i * per_node)))) for i in range(count)]


# The engine -------------------------------------------------------------------------------------


def work_of(job):
    """What a trace job's learned duration is keyed by: its team, and the same work as
    jobs.durations.work_key sees it with what a trace has (its user, where it names one, and its
    GPUs; a trace has no names, code or configs, so all of a team's jobs of a size are one work)."""
    return job.team, durations.work_key(name=job.user, code="", config=None, hyperparameters=None, args=None, gpus=job.gpus)


class _Sim:
    def __init__(self, nodes, policy, half_life, shares, usage=None, check=True, learn=False):
        self.learn = learn
        self.held = {}  # work_of(job) -> held seconds of the jobs of that work that finished, oldest first
        self.nodes = {n.id: n for n in nodes}
        self.free = {n.id: set(n.free) for n in nodes}
        self.policy, self.half_life, self.shares, self.check = policy, half_life, shares, check
        self.queue = {}  # job id -> QueuedJob
        self.left = {}  # job id -> true seconds of work left
        self.estimate_left = {}  # job id -> the seconds the policy is told are left
        self.limit_left = {}  # job id -> the seconds its limit (the declared estimate) leaves it
        self.jobs = {}  # job id -> TraceJob
        self.running = {}  # allocation id -> [Running, job id, true end]
        self.by_job = {}  # job id -> [allocation ids]
        self.ends = []  # heap (true end, allocation id)
        self.usage = {team: (value, 0.0) for team, value in (usage or {}).items()}  # team -> (decayed value, as of)
        self.outcomes = {}
        self.last_preempted = {}
        self.plans = 0
        self.serial = 0

    def usage_at(self, t):
        return {team: v * 2.0 ** (-(t - at) / self.half_life) for team, (v, at) in self.usage.items()}

    def add(self, job, t):
        self.jobs[job.id] = job
        self.left[job.id] = job.duration
        declared = job.estimate if job.estimate is not None else job.duration
        self.limit_left[job.id] = declared
        if self.learn:
            # As scheduler.services does: learned once, when the job is first queued, from the
            # runs of its work that had finished by then.
            declared = durations.expected_seconds(declared, durations.learned_seconds(self.held.get(work_of(job), ())))
        self.estimate_left[job.id] = declared
        self.outcomes[job.id] = Outcome(told=declared)
        self.enqueue(job, t)

    def enqueue(self, job, t):
        self.queue[job.id] = P.QueuedJob(
            id=job.id,
            gpus=job.gpus,
            submitted_at=job.submit,
            gpu_type=job.gpu_type,
            not_before=job.not_before,
            deadline=job.deadline,
            expected_seconds=self.estimate_left[job.id],
            team=job.team,
            preemptible=job.preemptible,
        )

    def start_running(self, allocation, true_end):
        """An allocation already running when the simulation starts (predict)."""
        for d in allocation.devices:
            self.free[allocation.node_id].discard(d)
        self.running[allocation.id] = [allocation, allocation.job_id or allocation.id, true_end]
        self.by_job.setdefault(allocation.job_id or allocation.id, []).append(allocation.id)
        if true_end < INF:
            heapq.heappush(self.ends, (true_end, allocation.id))

    def release(self, allocation_id, t):
        allocation, job_id, _ = self.running.pop(allocation_id)
        self.free[allocation.node_id].update(allocation.devices)
        if allocation.team:
            v, at = self.usage.get(allocation.team, (0.0, t))
            held = len(allocation.devices) * (t - allocation.started_at)
            self.usage[allocation.team] = (v * 2.0 ** (-(t - at) / self.half_life) + held, t)
        ids = self.by_job.get(job_id, [])
        if allocation_id in ids:
            ids.remove(allocation_id)
        return job_id

    def complete(self, t):
        while self.ends and self.ends[0][0] <= t:
            end, allocation_id = heapq.heappop(self.ends)
            if allocation_id not in self.running or self.running[allocation_id][2] != end:
                continue  # preempted meanwhile
            job_id = self.release(allocation_id, t)
            if job_id in self.outcomes and not self.by_job.get(job_id):
                outcome = self.outcomes[job_id]
                outcome.finish = t
                outcome.runs[-1] = (outcome.runs[-1][0], t, outcome.runs[-1][2])
                self.left[job_id] = 0.0
                if self.learn:
                    held = self.held.setdefault(work_of(self.jobs[job_id]), [])
                    held.append(sum(end - start for start, end, _ in outcome.runs))
                    del held[: -durations.KEPT]  # learned_seconds reads no more

    def step(self, t):
        """One plan at time t, applied. Returns the plan."""
        self.plans += 1
        nodes = [P.NodeState(n.id, n.device_type, n.devices, tuple(sorted(self.free[n.id]))) for n in self.nodes.values()]
        running = [r[0] for r in self.running.values()]
        result = P.plan(
            list(self.queue.values()),
            nodes,
            running,
            t,
            usage=self.usage_at(t),
            shares=self.shares,
            policy=self.policy,
            half_life=self.half_life,
            explain=False,
        )
        stopped = set()
        for allocation_id in result.preempt:
            if allocation_id in stopped:
                continue  # another part of a gang already stopped
            if allocation_id not in self.running:
                raise SimulationError(f"plan preempts {allocation_id}, which is not running")
            allocation, job_id, _ = self.running[allocation_id]
            if not allocation.preemptible:
                raise SimulationError(f"plan preempts {allocation_id}, which is not preemptible")
            if allocation.last_preempted_at is not None and t - allocation.last_preempted_at < P.PREEMPT_AT_MOST_EVERY:
                raise SimulationError(f"job {job_id} preempted twice within an hour")
            if job_id not in self.jobs:  # predict: an allocation of an unknown job just ends
                self.release(allocation_id, t)
                continue
            started = allocation.started_at
            for other in list(self.by_job.get(job_id, [])):
                self.release(other, t)
                stopped.add(other)
            outcome = self.outcomes[job_id]
            outcome.preemptions += 1
            outcome.runs[-1] = (outcome.runs[-1][0], t, outcome.runs[-1][2])
            ran = t - started
            self.left[job_id] -= ran
            self.estimate_left[job_id] = max(60.0, self.estimate_left[job_id] - ran)
            self.limit_left[job_id] = max(60.0, self.limit_left[job_id] - ran)
            self.last_preempted[job_id] = t
            self.enqueue(self.jobs[job_id], t)
        for placement in result.placements:
            job = self.queue.pop(placement.job_id, None)
            if job is None:
                raise SimulationError(f"plan places {placement.job_id}, which is not queued")
            if job.not_before is not None and job.not_before > t:
                raise SimulationError(f"job {job.id} placed at {t} before its not-before time {job.not_before}")
            if sum(len(d) for _, d in placement.parts) != job.gpus:
                raise SimulationError(f"job {job.id} placed on {placement.parts}, wants {job.gpus} devices")
            for node_id, devices in placement.parts:
                node = self.nodes.get(node_id)
                if node is None or (job.gpu_type and node.device_type != job.gpu_type):
                    raise SimulationError(f"job {job.id} placed on unusable node {node_id}")
                if len(set(devices)) != len(devices) or not set(devices) <= self.free[node_id]:
                    raise SimulationError(f"job {job.id} given busy devices {devices} on {node_id} at {t}")
            true_end = t + self.left[job.id]
            outcome = self.outcomes[job.id]
            if outcome.first_start is None:
                outcome.first_start = t
            outcome.runs.append((t, None, placement.parts))
            for node_id, devices in placement.parts:
                self.serial += 1
                allocation = P.Running(
                    id=f"a{self.serial}",
                    node_id=node_id,
                    devices=tuple(devices),
                    preemptible=job.preemptible,
                    started_at=t,
                    job_id=job.id,
                    team=job.team,
                    expected_end=t + self.limit_left[job.id],  # its limit, as production's (allocations.running_allocations)
                    last_preempted_at=self.last_preempted.get(job.id),
                )
                self.free[node_id].difference_update(devices)
                self.running[allocation.id] = [allocation, job.id, true_end]
                self.by_job.setdefault(job.id, []).append(allocation.id)
                heapq.heappush(self.ends, (true_end, allocation.id))
        return result

    def worth_planning(self):
        if not self.queue:
            return False
        if any(self.free.values()):
            return True
        return any(r[0].preemptible for r in self.running.values())


# The reference every run is measured against: shortest job first with EASY's reservation and
# backfilling, told each job's true duration (no policy that reads users' estimates has that).
ORACLE = "oracle"
NAMES = (*P.POLICY_ORDER, ORACLE)  # what simulate() runs, in table order


def simulate(jobs, nodes, policy="ours", *, learn=None, half_life=P.DEFAULT_HALF_LIFE, shares=None, usage=None, max_plans=None):
    """Run the jobs (TraceJob, any order) on the nodes (NodeState) to the end. Returns a Result.
    policy: one of NAMES (ORACLE: sjf-easy told the true durations). learn: the policy is told
    min(the estimate, the learned duration) (the module's docstring); None: for ours alone, as
    the baselines stand for the published algorithms, which read users' estimates."""
    if learn is None:
        learn = policy == "ours"
    if policy == ORACLE:
        jobs, policy, learn = [replace(j, estimate=None) for j in jobs], "sjf-easy", False
    began = time.perf_counter()
    sim = _Sim(nodes, policy, half_life, shares, usage, learn=learn)
    arrivals = sorted(jobs, key=lambda j: (j.submit, j.id))
    _run(sim, arrivals, max_plans)
    stuck = [j.id for j in jobs if sim.outcomes[j.id].finish is None]
    return Result(
        jobs=list(jobs), outcomes=sim.outcomes, gpus=sum(n.devices for n in nodes), plans=sim.plans, wall_seconds=time.perf_counter() - began, stuck=stuck
    )


def _run(sim, arrivals, max_plans=None, start=None):
    i, n = 0, len(arrivals)
    wakes, woken = [], set()
    if start is not None:
        heapq.heappush(wakes, start)
    same_t, last_t = 0, None
    while True:
        t = min(arrivals[i].submit if i < n else INF, sim.ends[0][0] if sim.ends else INF, wakes[0] if wakes else INF)
        if t == INF:
            return
        sim.complete(t)
        while i < n and arrivals[i].submit <= t:
            sim.add(arrivals[i], t)
            i += 1
        while wakes and wakes[0] <= t:
            woken.discard(heapq.heappop(wakes))
        if not sim.worth_planning():
            continue
        same_t = same_t + 1 if t == last_t else 0
        last_t = t
        if same_t > 50:
            raise SimulationError(f"the plan keeps changing at t={t} with nothing happening")
        result = sim.step(t)
        if max_plans is not None and sim.plans >= max_plans:
            return
        later = [w for w in ([result.wake_at] if result.wake_at is not None else []) if w > t]
        if result.preempt:
            later.append(t)  # the devices given back are free now: plan again at once
        for w in later:
            if w not in woken:
                woken.add(w)
                heapq.heappush(wakes, w)


def predict_queue(queue, nodes, running, now, *, usage=None, shares=None, policy="ours", half_life=P.DEFAULT_HALF_LIFE):
    """policy.predict: the queue and running allocations played out with expected durations."""
    sim = _Sim(nodes, policy, half_life, shares, usage)
    for allocation in running:
        end = INF if allocation.expected_end is None else max(allocation.expected_end, now)
        sim.start_running(allocation, end)
    for job in queue:
        sim.jobs[job.id] = TraceJob(
            job.id,
            job.submitted_at,
            job.gpus,
            job.expected_seconds,
            job.expected_seconds,
            job.deadline,
            job.team,
            job.preemptible,
            job.not_before,
            job.gpu_type,
        )
        sim.left[job.id] = sim.estimate_left[job.id] = sim.limit_left[job.id] = job.expected_seconds
        sim.outcomes[job.id] = Outcome()
        sim.queue[job.id] = job
    _run(sim, [], start=now)
    out = {}
    for allocation in running:
        if allocation.job_id:
            end = INF if allocation.expected_end is None else max(allocation.expected_end, now)
            start, finish = out.get(allocation.job_id, (allocation.started_at, end))
            out[allocation.job_id] = (min(start, allocation.started_at), max(finish, end))
    for job in queue:
        o = sim.outcomes[job.id]
        out[job.id] = (INF if o.first_start is None else o.first_start, INF if o.finish is None else o.finish)
    return out


# Metrics ----------------------------------------------------------------------------------------


def _pct(values, q):
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def jain(values):
    values = [v for v in values if v is not None]
    if not values:
        return float("nan")
    square = sum(v * v for v in values)
    return (sum(values) ** 2) / (len(values) * square) if square else 1.0


def metrics(result):
    """The figures of the module's docstring, over the jobs that finished."""
    done = [j for j in result.jobs if result.outcomes[j.id].finish is not None]
    out = {"jobs": len(result.jobs), "finished": len(done)}
    if not done:
        return out
    o = result.outcomes
    jct = [o[j.id].finish - j.submit for j in done]
    wait = [o[j.id].first_start - j.submit for j in done]
    slow = [max(1.0, (o[j.id].finish - j.submit) / max(j.duration, 10.0)) for j in done]
    first = min(j.submit for j in result.jobs)
    makespan = max(o[j.id].finish for j in done) - first
    with_deadline = [j for j in done if j.deadline is not None]
    per_team, gpu_seconds = {}, {}
    for j, s in zip(done, slow):
        per_team.setdefault(j.team, []).append(s)
        gpu_seconds[j.team] = gpu_seconds.get(j.team, 0.0) + j.gpus * j.duration
    big = [w for j, w in zip(done, wait) if j.gpus >= 16]
    out.update(
        mean_jct=statistics.fmean(jct),
        median_jct=statistics.median(jct),
        p99_jct=_pct(jct, 0.99),
        mean_wait=statistics.fmean(wait),
        p99_wait=_pct(wait, 0.99),
        mean_bounded_slowdown=statistics.fmean(slow),
        makespan=makespan,
        utilization=sum(j.gpus * j.duration for j in done) / (result.gpus * makespan) if makespan > 0 else float("nan"),
        deadline_satisfaction=(sum(1 for j in with_deadline if o[j.id].finish <= j.deadline + 1e-6) / len(with_deadline) if with_deadline else float("nan")),
        jain_teams=jain([statistics.fmean(v) for v in per_team.values()]),
        # Each team's jobs, mean bounded slowdown and share of the GPU-hours run (its entitlement:
        # an equal share, 1 / teams), largest first.
        teams={
            t: {"jobs": len(v), "mean_bounded_slowdown": statistics.fmean(v), "gpu_hour_share": gpu_seconds[t] / sum(gpu_seconds.values())}
            for t, v in sorted(per_team.items(), key=lambda kv: (-len(kv[1]), kv[0]))
        },
        longest_wait_16plus=max(big) if big else float("nan"),
        # How far what the policy was told is from the truth: (median, p90) of told / duration.
        estimate_accuracy=durations.accuracy((o[j.id].told or j.duration, j.duration) for j in done),
        preemptions=sum(o[j.id].preemptions for j in done),
        plans=result.plans,
        wall_seconds=result.wall_seconds,
    )
    return out


# Text -------------------------------------------------------------------------------------------

COLUMNS = (  # key, heading, scale, format
    ("mean_jct", "JCT mean h", 3600, "{:.2f}"),
    ("median_jct", "JCT med h", 3600, "{:.2f}"),
    ("p99_jct", "JCT p99 h", 3600, "{:.1f}"),
    ("mean_wait", "wait mean h", 3600, "{:.2f}"),
    ("p99_wait", "wait p99 h", 3600, "{:.1f}"),
    ("mean_bounded_slowdown", "bsld", 1, "{:.2f}"),
    ("makespan", "makespan d", 86400, "{:.2f}"),
    ("utilization", "util", 1, "{:.3f}"),
    ("deadline_satisfaction", "deadl.", 1, "{:.3f}"),
    ("jain_teams", "Jain", 1, "{:.3f}"),
    ("longest_wait_16plus", "max wait 16+ h", 3600, "{:.1f}"),
)


def describe(m):
    """The metrics as lines for people."""
    if not m.get("finished"):
        return [f"jobs: {m.get('jobs', 0)}, none finished"]
    h = 3600
    return [
        f"jobs: {m['jobs']} ({m['finished']} finished)",
        f"JCT: mean {m['mean_jct']:.0f} s ({m['mean_jct'] / h:.2f} h), median {m['median_jct']:.0f} s, p99 {m['p99_jct']:.0f} s",
        f"queueing delay: mean {m['mean_wait']:.0f} s ({m['mean_wait'] / h:.2f} h), p99 {m['p99_wait']:.0f} s",
        f"mean bounded slowdown (10 s): {m['mean_bounded_slowdown']:.3f}",
        f"makespan: {m['makespan']:.0f} s ({m['makespan'] / 86400:.2f} days)",
        f"utilization: {m['utilization']:.3f}",
        f"deadline satisfaction: {m['deadline_satisfaction']:.3f}",
        f"Jain's index over teams (x = mean bounded slowdown): {m['jain_teams']:.3f}",
        *(
            f"  {t}: {v['jobs']} jobs, mean bounded slowdown {v['mean_bounded_slowdown']:.2f}, "
            f"{v['gpu_hour_share']:.1%} of the GPU-hours (entitled to {1 / len(m['teams']):.1%})"
            for t, v in m["teams"].items()
        ),
        f"longest wait of a job of 16+ GPUs: {m['longest_wait_16plus']:.0f} s ({m['longest_wait_16plus'] / h:.1f} h)",
        "estimates / true durations: median {:.2f}, p90 {:.2f}".format(*m["estimate_accuracy"]),
        f"preemptions: {m['preemptions']}; scheduling passes: {m['plans']}; simulated in {m['wall_seconds']:.1f} s",
    ]


def table(rows):
    """rows: [(name, metrics)] -> lines of a fixed-width table."""
    head = ["policy"] + [c[1] for c in COLUMNS]
    body = [[name] + [fmt.format(m[key] / scale) if m.get(key) is not None else "-" for key, _, scale, fmt in COLUMNS] for name, m in rows]
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
    return ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in [head, *body]]
