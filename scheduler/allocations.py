"""Nodes lost and allocations ended: a node that stopped heartbeating is declared lost and its
allocations released (their jobs requeued or failed); an allocation that ends stops its meter and
sets its job's state. Preemption releases one on purpose."""

import logging
from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from jobs import states
from jobs.models import Job
from scheduler import policy
from scheduler.models import Allocation, Node, Staging

log = logging.getLogger(__name__)


def may_declare_lost(now, timeout_seconds, last_failure_at):
    """Whether silence can mean a lost node yet: not until the timeout has passed since the
    scheduler last failed to reach the database, for then the runners may not have reached it
    either (their heartbeats start again when it comes back)."""
    return last_failure_at is None or now - last_failure_at >= timedelta(seconds=timeout_seconds)


def expire_lost_nodes(now=None, last_failure_at=None):
    """Declare nodes whose runner went silent lost: their allocations end at the last heartbeat
    (the meter does not run on after the network lost the node) and their jobs are requeued.
    last_failure_at: when the caller last failed to reach the database (see may_declare_lost)."""
    now = now or timezone.now()
    if not may_declare_lost(now, settings.E31_NODE_TIMEOUT_SECONDS, last_failure_at):
        return 0
    cutoff = now - timedelta(seconds=settings.E31_NODE_TIMEOUT_SECONDS)
    count = 0
    # A cluster engine's nodes are not ours to declare lost: their heartbeat is the scheduler's
    # last read of the engine (a restart of Slurm's controller must not end the jobs our agents
    # still run there), and the engine itself reports a node that failed (scheduler/engine.py).
    for node in Node.objects.filter(executor="", lost_at__isnull=True, stopped_at__isnull=True, last_heartbeat__lt=cutoff):
        with transaction.atomic():
            # Re-checked in the update: a heartbeat that landed since the read keeps the node.
            silent = Node.objects.filter(pk=node.pk, lost_at__isnull=True, last_heartbeat__lt=cutoff)
            if silent.update(lost_at=now) != 1:
                continue
            last_heard = Node.objects.values_list("last_heartbeat", flat=True).get(pk=node.pk)
        count += 1
        log.warning("node %s lost: no heartbeat since %s", node.name, last_heard)
        Staging.objects.filter(node=node, state__in=Staging.LIVE).update(state=Staging.ABANDONED, finished_at=now, error=f"node {node.name} was lost")
        release_node(node, at=last_heard, reason=Allocation.NODE_LOST, why=f"node {node.name} was lost")
    return count


def release_node(node, at, reason, why):
    """End every open allocation of a node and put its jobs back in the queue."""
    for allocation in node.allocations.filter(ended_at__isnull=True).select_related("job", "node"):
        end_allocation(allocation, at, reason, states.QUEUED, f"requeued: {why}")


def end_allocation(allocation, at, reason, state, message="", exit_code=None):
    """Release the allocation (the meter stops at `at`) and move its job on to `state`
    (QUEUED: back to the queue), in one transaction. False, and nothing done, if another process
    released it first: that process also decided what became of the job."""
    with transaction.atomic():
        if allocation.release(at, reason) is None:
            return False
        job = Job.objects.select_for_update().get(pk=allocation.job_id)
        if job.state in states.HOLDING:
            if state == states.QUEUED:
                job.requeue(message, at=at, preempted=reason == Allocation.PREEMPTED)
            elif waits_for_node_zero(allocation, state):
                pass  # its part is done; the job ends with node 0, once its outputs are kept
            else:
                job.finish(state, reason=message, exit_code=exit_code, at=at)
    return True


def waits_for_node_zero(allocation, state):
    """Whether a gang's part that succeeded leaves the job running: a node other than node 0
    whose processes exited 0 before node 0's did. Node 0 keeps the job's outputs (rank 0 writes
    them), so the job succeeds only when node 0 ends; had the first node to finish ended it, a
    client that saw it succeed could find its weights not there yet."""
    if state != states.SUCCEEDED or not allocation.gang or allocation.node_rank == 0:
        return False
    return Allocation.objects.filter(gang=allocation.gang, node_rank=0, ended_at__isnull=True).exists()


def gang_broken(job_state, ended_reasons):
    """Whether the parts of a gang still running must stop, given the job's state and the end
    reasons of its parts that ended: a gang lives and dies as one, so yes when a part ended and
    the job left its compute (requeued, failed, stopped) or a part ended otherwise than by its
    processes exiting. Not when the job succeeded (the other nodes finish on their own), nor
    when the parts that ended only finished their share before node 0 (waits_for_node_zero)."""
    if not ended_reasons or job_state == states.SUCCEEDED:
        return False
    return job_state not in states.HOLDING or any(reason != Allocation.EXITED for reason in ended_reasons)


def running_allocations(nodes, now=None):
    """The allocations holding devices, with when each is expected to end: its limit, or an
    hour from now when nothing bounds it."""
    now = now or timezone.now()
    rows = Allocation.objects.filter(ended_at__isnull=True, node_id__in=[n.id for n in nodes]).select_related("job")
    running = []
    for a in rows:
        end = a.started_at.timestamp() + a.limit_seconds if a.limit_seconds is not None else now.timestamp() + 3600
        running.append(
            policy.Running(
                id=str(a.pk),
                node_id=str(a.node_id),
                devices=tuple(a.devices),
                preemptible=a.preemptible,
                started_at=a.started_at.timestamp(),
                job_id=str(a.job_id),
                team=str(a.job.team_id),
                expected_end=max(end, now.timestamp()),
                preempting=a.preempt_requested_at is not None,
                last_preempted_at=stamp(a.job.last_preempted_at),
            )
        )
    return running


def preempt(allocation_id, why):
    """Ask the runner holding a preemptible allocation to give it back: the job is told to
    stop (SIGTERM, the SDK's should_stop()), gets the grace period to checkpoint, and goes back
    to the queue. False if it is not preemptible, already ended or already asked."""
    now = timezone.now()
    gang = Allocation.objects.filter(pk=allocation_id).values_list("gang", flat=True).first()
    members = Allocation.objects.filter(gang=gang) if gang else Allocation.objects.filter(pk=allocation_id)  # a gang goes as one
    asked = members.filter(preemptible=True, ended_at__isnull=True, preempt_requested_at__isnull=True).update(preempt_requested_at=now)
    if asked:
        job = Job.objects.get(allocations__pk=allocation_id)
        Job.objects.filter(pk=job.pk).update(last_preempted_at=now)
        job.record("notice", data={"text": f"preempted: {why}; it goes back to the queue and resumes from its latest checkpoint"})
    return bool(asked)


def stamp(moment):
    """A datetime as the policy's float seconds (None stays None)."""
    return None if moment is None else moment.timestamp()
