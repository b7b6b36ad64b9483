"""The placement policy: pure functions over plain data, no ORM.

This issue's policy is first come, first served with gang placement on one node (best fit),
preemptible jobs after the others. A job is placed only on a node where its data is staged; a
job still staging holds no one back. A job that is not preemptible and waits for devices that
preemptible jobs hold has them preempted (see choose_preemptions).
The scheduler command and any simulator call the same code.
"""

from dataclasses import dataclass, field
from datetime import datetime


@dataclass(frozen=True)
class QueuedJob:
    id: str
    gpus: int
    submitted_at: datetime
    gpu_type: str = ""  # "" takes any type
    not_before: datetime | None = None
    staged_on: frozenset | None = None  # nodes holding its data; None: it needs no staging
    staging_note: str = ""  # why it is not staged yet
    preemptible: bool = False


@dataclass(frozen=True)
class NodeState:
    id: str
    device_type: str
    devices: int  # how many the node has
    free: tuple[int, ...]  # indices of its free devices


@dataclass(frozen=True)
class Running:
    """An allocation holding devices now."""

    id: str
    node_id: str
    devices: tuple[int, ...]
    preemptible: bool
    started_at: datetime
    preempting: bool = False  # asked to give its devices back already


@dataclass(frozen=True)
class Placement:
    job_id: str
    node_id: str
    devices: tuple[int, ...]


@dataclass
class Plan:
    placements: list[Placement] = field(default_factory=list)
    waiting: dict[str, str] = field(default_factory=dict)  # job id -> why it waits


def _devices(n):
    return f"{n} device" if n == 1 else f"{n} devices"


def _fits(job, node):
    return (not job.gpu_type or job.gpu_type == node.device_type) and node.devices >= job.gpus


def place_fcfs(queue, nodes, now):
    """Place jobs in submission order; the first that cannot start now holds back the rest,
    so a large job is not overtaken forever by small ones. Jobs that no live node could ever
    hold, or that must not start yet, do not hold anyone back."""
    plan = Plan()
    free = {node.id: list(node.free) for node in nodes}
    blocked_by = None
    for job in sorted(queue, key=queue_order):
        if job.not_before is not None and job.not_before > now:
            plan.waiting[job.id] = f"not before {job.not_before:%Y-%m-%d %H:%M} UTC"
            continue
        candidates = [n for n in nodes if _fits(job, n)]
        if not candidates:
            kind = f"{job.gpu_type} " if job.gpu_type else ""
            plan.waiting[job.id] = f"waiting for a node with {job.gpus} {kind}device{'s' if job.gpus != 1 else ''}; none is online"
            continue
        if job.staged_on is not None:
            candidates = [n for n in candidates if n.id in job.staged_on]
            if not candidates:
                plan.waiting[job.id] = job.staging_note or "waiting for its data to be staged"
                continue
        if blocked_by is not None:
            plan.waiting[job.id] = f"waiting behind job {blocked_by[:8]}, submitted earlier"
            continue
        # Best fit: the node left with the fewest free devices, keeping roomy nodes whole.
        fitting = [n for n in candidates if len(free[n.id]) >= job.gpus]
        if not fitting:
            most = max(len(free[n.id]) for n in candidates)
            plan.waiting[job.id] = f"waiting for {_devices(job.gpus)} on one node; at most {most} free"
            blocked_by = job.id
            continue
        node = min(fitting, key=lambda n: (len(free[n.id]), n.id))
        devices = tuple(sorted(free[node.id])[: job.gpus])
        free[node.id] = [d for d in free[node.id] if d not in devices]
        plan.placements.append(Placement(job.id, node.id, devices))
    return plan


def queue_order(job):
    """Submission order, preemptible jobs after the rest: a preempted job goes back to the
    queue with its first place, and must not take back the devices it was preempted for."""
    return (job.preemptible, job.submitted_at, job.id)


def choose_preemptions(plan, queue, nodes, running, now):
    """Which preemptible allocations to stop so that jobs that are not preemptible can start.

    For each job the plan left waiting (in queue order) that is not preemptible, is due, and
    has its data staged: the node where it fits with the fewest devices preempted, the youngest
    preemptible allocations first (they lose the least work). Devices already being given back
    count as free. Returns (allocation ids to preempt, {job id: why it waits now})."""
    placed = {p.job_id for p in plan.placements}
    free = {node.id: set(node.free) for node in nodes}
    for placement in plan.placements:
        free[placement.node_id] -= set(placement.devices)
    victims = {node.id: [] for node in nodes}
    for allocation in running:
        if allocation.preemptible and allocation.node_id in victims:
            victims[allocation.node_id].append(allocation)
    chosen, notes = [], {}
    for job in sorted(queue, key=queue_order):
        if job.id in placed or job.preemptible or (job.not_before is not None and job.not_before > now):
            continue
        candidates = [n for n in nodes if _fits(job, n) and (job.staged_on is None or n.id in job.staged_on)]
        best = None
        for node in candidates:
            available = set(free[node.id])
            taking = []
            for allocation in sorted(victims[node.id], key=lambda a: (a.preempting, a.started_at, a.id), reverse=True):
                if len(available) >= job.gpus:
                    break
                available |= set(allocation.devices)
                taking.append(allocation)
            if len(available) >= job.gpus:
                cost = sum(len(a.devices) for a in taking if not a.preempting)
                if best is None or (cost, node.id) < (best[0], best[1].id):
                    best = (cost, node, taking, available)
        if best is None:
            continue
        _, node, taking, available = best
        new = [a for a in taking if not a.preempting]
        chosen.extend(a.id for a in new)
        notes[job.id] = f"preempting {len(taking)} preemptible job{'s' if len(taking) != 1 else ''} to make room"
        # The devices freed (and any free ones it needs) are this job's from now on.
        keep = sorted(available)[: job.gpus]
        free[node.id] = available - set(keep)
        victims[node.id] = [a for a in victims[node.id] if a not in taking]
    return chosen, notes


def choose_staging_node(job, nodes, cached_bytes, lined_up):
    """Where to stage a queued job's data: a node that can run it, preferring the one that
    already holds the most of its data, then the one with the fewest jobs lined up, then the
    one with the most free devices."""
    candidates = [n for n in nodes if _fits(job, n)]
    if not candidates:
        return None
    best = min(candidates, key=lambda n: (-cached_bytes.get(n.id, 0), lined_up.get(n.id, 0), -len(n.free), n.id))
    return best.id
