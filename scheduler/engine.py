"""E31 on a cluster engine the operator already runs (E31_EXECUTOR=slurm): the engine's nodes as
E31's nodes, E31's allocations as the engine's jobs, and what the engine says of them.

Each scheduler cycle (every E31_ENGINE_SECONDS):
- sync_nodes: the engine's nodes become Node rows (executor "slurm"); devices the engine's other
  users hold are busy for E31 too (Node.busy_elsewhere), a drained or down node offers nothing,
  and the nodes' last_heartbeat is the engine's answer (no runner of ours heartbeats them).
- launch_new: an allocation the policy placed on such a node is submitted to the engine, pinned
  to its nodes, running our node agent for that one allocation (`manage.py runner --allocation`),
  which runs the job exactly as a runner would and exits.
- follow: the meter starts when the engine reports the compute held (the allocation's
  started_at becomes the engine's start); an allocation the engine leaves pending longer than
  E31_ENGINE_PENDING_SECONDS goes back (cancelled there, requeued here, nothing billed, the
  engine's reason told); one the engine ended while our agent had not (node failure, killed) is
  ended here and its job requeued from its checkpoint, the lost time credited; once the engine
  has ended it, its elapsed time is kept beside the meter's and a difference over a second is
  logged for the operator.

The decisions are pure functions below the wrappers (tested without the engine or a database).
"""

import logging
import os
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from billing.models import UsageRecord
from jobs import states
from scheduler.allocations import end_allocation
from scheduler.executors import base
from scheduler.executors.base import AGREE_SECONDS, disagreement
from scheduler.executors.configured import slurm_account
from scheduler.models import Allocation, Node

log = logging.getLogger(__name__)

ENGINE = "slurm"
ROOT = Path(__file__).resolve().parent.parent
# What the engine's job environment carries over from the scheduler's: the settings the node
# agent needs to reach the database, storage and cache (the agent is the same code, configured
# the same way), and nothing else of the scheduler's environment.
PASSED_ON = ("E31_", "PATH", "DATABASE_URL", "REDIS_URL", "DJANGO_", "AWS_", "S3_", "SEAWEEDFS_", "PYTHONPATH", "HOME", "LANG", "TZ")


# -- decisions -------------------------------------------------------------------------------------


def device_type_of(info):
    """E31's device type (what a rate is set for) of an engine's node: its GPU model where the
    engine names one, "gpu" where it does not, "cpu" for a node of CPUs."""
    if info.device_type != "gpu":
        return "cpu"
    return info.gpu_type or "gpu"


def held_by_others(info, ours):
    """Devices of a node the engine counts as taken that E31's running allocations do not
    account for: other users' jobs (never below 0; nothing on a node that offers nothing)."""
    if info.state != base.UP:
        return 0
    return max(0, info.devices - info.free - ours)


def ended_here(status, cancel_requested):
    """(allocation end reason, job state, why) for an allocation the engine ended while our agent
    did not end it: its agent was killed with it, or the node was lost. The job goes back to the
    queue and resumes from its checkpoint, the lost time credited where the fault was not the
    job's (a cancelled job stays cancelled)."""
    engine = f"Slurm: {status.engine_state or status.state}" + (f", {status.reason}" if status.reason else "")
    if cancel_requested:
        return Allocation.CANCELLED, states.CANCELLED, f"cancelled by the team ({engine})"
    if status.state == base.ENDED and status.engine_state == "TIMEOUT":
        return Allocation.LIMIT, states.STOPPED, f"its span ran out ({engine})"
    if status.state == base.CANCELLED:
        return Allocation.NODE_LOST, states.QUEUED, f"requeued: the cluster cancelled it ({engine}); it resumes from its latest checkpoint"
    return Allocation.NODE_LOST, states.QUEUED, f"requeued: its node was lost ({engine}); it resumes from its latest checkpoint"


def cancel_overdue(cancel_requested_at, now, grace_seconds):
    """Whether a cancelled job still running has had its grace, and our agent's time to keep its
    outputs, and more: then Slurm cancels it."""
    if cancel_requested_at is None:
        return False
    return (now - cancel_requested_at).total_seconds() > grace_seconds + settings.E31_ENGINE_GRACE_SECONDS + 30


def billed_until(allocation, ended_at):
    """When the meter of an allocation Slurm ended stops: its end, never past the job's limit
    (its span or ceiling), whatever Slurm held beyond it (the span's end missed by our agent)."""
    if allocation.limit_seconds is None:
        return ended_at
    return min(ended_at, allocation.started_at + timedelta(seconds=allocation.limit_seconds))


def pending_too_long(placed_at, now, pending_seconds):
    return (now - placed_at).total_seconds() > pending_seconds


def refined_start(recorded, script_at):
    """The meter's start once the engine's batch script has told its own first instant.

    Slurm says when it started a job in whole seconds; the scheduler records that (or the
    placement, when later) as soon as it reads it. The script starts a few milliseconds after
    Slurm allocated the nodes, and reads the clock to the microsecond: inside the second recorded,
    it is the better start, and the part of that second Slurm spent on other things (its own
    scheduling tick, from which it started the job) is not billed. Outside it (clocks apart), the
    record stands."""
    if script_at is None:
        return recorded
    if recorded is None or recorded <= script_at < recorded + timedelta(seconds=AGREE_SECONDS):
        return script_at
    return recorded


def agent_start(script_at, engine_at):
    """(the meter's start, precise) as a node agent tells it, from its batch script's first
    instant and the engine's whole second (either may be unknown): refined_start's choice, so the
    start does not depend on whether the scheduler or the agent read the engine first. A script
    that Slurm launched a second or more after its start (a loaded node) starts the meter at
    Slurm's start, when the devices were held; told first, its late instant had stood (the
    scheduler records the engine's start only while none is recorded). precise: the start is
    the script's instant."""
    started_at = refined_start(engine_at, script_at)
    return started_at, started_at is not None and started_at == script_at


def script_start(text):
    """The batch script's first instant (E31_ENGINE_STARTED_AT: bash's EPOCHREALTIME) as a time,
    or None when it is missing or not a number."""
    try:
        seconds = float((text or "").replace(",", "."))  # EPOCHREALTIME follows the locale's point
    except ValueError:
        return None
    if not 0 < seconds < 2**33:
        return None
    return datetime.fromtimestamp(seconds, tz=UTC)


def agent_command(allocation_id, python=None, manage=None):
    """The command the engine runs on each node of an allocation: our node agent for it."""
    return (python or settings.E31_ENGINE_PYTHON or sys.executable, manage or str(ROOT / "manage.py"), "runner", "--allocation", str(allocation_id))


def agent_environment(environ):
    """The settings the node agent needs, from the scheduler's environment."""
    return {name: value for name, value in environ.items() if name.startswith(PASSED_ON) and "\0" not in value}


# -- the wrappers ----------------------------------------------------------------------------------


def sync_nodes(executor, now=None):
    """The engine's nodes as Node rows; returns them. A node the engine no longer reports (out
    of the operator's partitions) is stopped; a local runner's node of the same name is left alone."""
    now = now or timezone.now()
    infos = executor.nodes()
    ours = {}
    running = Allocation.objects.filter(ended_at__isnull=True, node__executor=ENGINE, launched_at__isnull=False)
    for name, devices in running.values_list("node__name", "devices"):
        ours[name] = ours.get(name, 0) + len(devices)
    local = set(Node.objects.filter(executor="", name__in=[i.name for i in infos]).values_list("name", flat=True))
    nodes = []
    for info in infos:
        if info.name in local:
            log.warning("Slurm's node %s has the name of a runner's node: left out", info.name)
            continue
        fields = {
            "executor": ENGINE,
            "hostname": info.name,
            "device_type": device_type_of(info),
            "devices": info.devices,
            "busy_elsewhere": held_by_others(info, ours.get(info.name, 0)),
            "engine_state": info.state,
            "engine_reason": info.reason[:300],
            "last_heartbeat": now,
            "lost_at": None,
            "stopped_at": None,
        }
        node, _ = Node.objects.update_or_create(name=info.name, defaults=fields)
        nodes.append(node)
    Node.objects.filter(executor=ENGINE, stopped_at__isnull=True).exclude(name__in=[n.name for n in nodes]).update(stopped_at=now)
    for node in nodes:
        Allocation.bring_usage_up_to_date(node.pk, now)
    return nodes


def request_for(parts, workdir):
    """The engine's request for one allocation (a gang: all its parts, one engine job)."""
    first = parts[0]
    job = first.job
    per_node = len(first.devices)
    gpu = first.device_type != "cpu"
    limit = first.limit_seconds if first.limit_seconds is not None else settings.E31_ENGINE_MAX_SECONDS
    return base.AllocationRequest(
        allocation_id=str(first.pk),
        job_id=str(job.pk),
        nodes=tuple(a.node.name for a in parts),
        command=agent_command(first.pk),
        workdir=str(workdir),
        time_limit_seconds=int(limit),
        # The agent's own stop (TERM, the job's grace) comes first; then time to keep its outputs.
        grace_seconds=settings.E31_STOP_GRACE_SECONDS + settings.E31_ENGINE_GRACE_SECONDS,
        gpus_per_node=per_node if gpu else 0,
        cpus_per_node=1 if gpu else per_node,
        memory_mb=settings.E31_ENGINE_MEMORY_MB_PER_DEVICE * per_node,
        account=slurm_account(job.team.name),
        environment=agent_environment(os.environ),
    )


def launch_new(executor, now=None):
    """Submit the allocations placed on the engine's nodes and not submitted yet; returns their
    handles. One the engine refuses is released at once (nothing billed) and its job requeued."""
    now = now or timezone.now()
    fresh = Allocation.objects.filter(ended_at__isnull=True, engine_handle="", node__executor=ENGINE).select_related("job__team", "node")
    handles = []
    seen = set()
    for allocation in fresh.order_by("node_rank"):
        key = allocation.gang or allocation.pk
        if key in seen:
            continue
        seen.add(key)
        parts = [allocation] if not allocation.gang else list(fresh.filter(gang=allocation.gang).order_by("node_rank"))
        # Slurm's files (the batch script, the agent's output) beside the agent's folder
        # (agent.runner.AllocationAgent: runs/, cache/), kept after it for the operator.
        workdir = Path(settings.E31_ENGINE_WORK_DIR) / str(parts[0].pk) / "slurm"
        try:
            handle = executor.start(request_for(parts, workdir))
        except Exception as error:  # noqa: BLE001 - whatever the engine said, the compute goes back
            log.exception("Slurm did not take allocation %s", allocation.pk)
            for part in parts:
                end_allocation(part, part.started_at, Allocation.START_FAILED, states.QUEUED, f"requeued: Slurm did not take it: {error}")
            continue
        Allocation.objects.filter(pk__in=[p.pk for p in parts]).update(engine_handle=handle)
        handles.append(handle)
    return handles


def follow(executor, now=None):
    """Read the engine's word on every open allocation it runs and on those it ended lately."""
    now = now or timezone.now()
    recent = now - timedelta(hours=1)
    watched = Allocation.objects.filter(node__executor=ENGINE).exclude(engine_handle="")
    watched = watched.filter(Q(ended_at__isnull=True) | Q(ended_at__gte=recent, engine_seconds__isnull=True)).select_related("job", "node")
    watched = list(watched)
    if not watched:
        return
    statuses = executor.status(sorted({a.engine_handle for a in watched}))
    # Where the engine keeps accounting, its record is what the meter is reconciled with.
    ended = sorted({a.engine_handle for a in watched if a.ended_at is not None and (s := statuses.get(a.engine_handle)) is not None and s.finished})
    accounted = executor.accounted(ended) if ended else {}
    pending = settings.E31_ENGINE_PENDING_SECONDS
    stopped = set()
    for allocation in watched:
        status = statuses.get(allocation.engine_handle)
        if status is None:
            continue
        if allocation.ended_at is None:
            if status.state == base.PENDING and allocation.job.cancel_requested_at is not None:
                # Cancelled before Slurm started it: no agent to tell, nothing held, nothing billed.
                if allocation.engine_handle not in stopped:
                    stopped.add(allocation.engine_handle)
                    executor.stop(allocation.engine_handle, graceful=False)
                end_allocation(allocation, allocation.started_at, Allocation.CANCELLED, states.CANCELLED, "cancelled before Slurm started it")
                continue
            if status.state == base.PENDING:
                if pending_too_long(allocation.started_at, now, pending) and allocation.engine_handle not in stopped:
                    stopped.add(allocation.engine_handle)
                    executor.stop(allocation.engine_handle, graceful=False)
                    why = f"requeued: Slurm did not start it on {allocation.node.name} within {pending:g} s ({status.reason or 'no reason given'})"
                    for part in [a for a in watched if a.engine_handle == allocation.engine_handle and a.ended_at is None]:
                        end_allocation(part, part.started_at, Allocation.START_FAILED, states.QUEUED, why)
                        part.ended_at = part.started_at
                continue
            if status.state == base.RUNNING and allocation.launched_at is None:
                held(allocation, status.started_at or now)
                continue
            if status.state == base.RUNNING and cancel_overdue(allocation.job.cancel_requested_at, now, settings.E31_STOP_GRACE_SECONDS):
                # Our agent stops a cancelled job within its grace and exits; one that has not (hung,
                # its node unreachable) is cancelled in Slurm (TERM, then KILL), and the job ends
                # when Slurm says it did.
                if allocation.engine_handle not in stopped:
                    stopped.add(allocation.engine_handle)
                    log.warning(
                        "allocation %s: cancelled %s ago and still running; cancelling Slurm job %s",
                        allocation.pk,
                        now - allocation.job.cancel_requested_at,
                        allocation.engine_handle,
                    )
                    executor.stop(allocation.engine_handle, graceful=False)
                continue
            if status.finished:
                reason, state, why = ended_here(status, allocation.job.cancel_requested_at is not None)
                end_allocation(allocation, billed_until(allocation, status.ended_at or now), reason, state, why)
                continue
        elif status.finished:
            record = accounted.get(allocation.engine_handle)
            if record is not None and not record.finished:
                continue  # accounting lags the controller by a moment: its end comes next cycle
            reconcile(allocation, record or status)


def held(allocation, started_at, precise=False):
    """The engine started it: the meter runs from the engine's start, not from when it was placed.

    precise: started_at is the batch script's own instant (the agent's word), which refines the
    whole second the scheduler read from the engine (refined_start); otherwise the first word wins."""
    started_at = max(started_at, allocation.started_at)
    with transaction.atomic():
        row = Allocation.objects.select_for_update().filter(pk=allocation.pk, ended_at__isnull=True).values("launched_at").first()
        if row is None:
            return
        if row["launched_at"] is not None and (not precise or refined_start(row["launched_at"], started_at) == row["launched_at"]):
            allocation.started_at = allocation.launched_at = row["launched_at"]
            return
        Allocation.objects.filter(pk=allocation.pk).update(started_at=started_at, launched_at=started_at)
        UsageRecord.ledger.filter(allocation_id=allocation.pk, provisional=True).update(started_at=started_at, ended_at=started_at, held_seconds=0, amount=0)
    allocation.started_at = allocation.launched_at = started_at


def reconcile(allocation, status):
    """Keep the engine's elapsed time beside the meter's; a difference over a second is logged
    for the operator (and shown on the allocation)."""
    if status.started_at is None or status.ended_at is None:
        Allocation.objects.filter(pk=allocation.pk).update(engine_seconds=-1)  # the engine does not remember it
        return
    engine_seconds = (status.ended_at - status.started_at).total_seconds()
    Allocation.objects.filter(pk=allocation.pk).update(engine_seconds=engine_seconds)
    held_seconds = allocation.meter()[0]
    off = disagreement(held_seconds, engine_seconds)
    if off is not None:
        log.warning(
            "allocation %s (Slurm job %s): billed %.0f s, Slurm's accounting says %.0f s (%+.0f s)",
            allocation.pk,
            allocation.engine_handle,
            held_seconds,
            engine_seconds,
            off,
        )


def cycle(executor, now=None):
    """One pass: nodes, new allocations, the engine's word on the rest."""
    now = now or timezone.now()
    sync_nodes(executor, now)
    launch_new(executor, now)
    follow(executor, now)
