"""The scheduler's steps over the database; decisions come from scheduler.policy."""

import logging
from decimal import Decimal

from django.db import transaction
from django.utils import timezone

from billing import meter
from billing.models import NoRateInForce, Rate
from jobs import states
from jobs.models import Job
from scheduler import policy
from scheduler.models import Allocation, Node

log = logging.getLogger(__name__)


def expire_lost_nodes(now=None):
    """Declare nodes whose runner went silent lost: their allocations end at the last heartbeat
    (the meter does not run on after the network lost the node) and their jobs are requeued."""
    now = now or timezone.now()
    silent = Node.objects.filter(lost_at__isnull=True, stopped_at__isnull=True).exclude(
        pk__in=Node.objects.live(now).values("pk")
    )
    count = 0
    for node in silent:
        if Node.objects.filter(pk=node.pk, lost_at__isnull=True).update(lost_at=now) != 1:
            continue
        count += 1
        log.warning("node %s lost: no heartbeat since %s", node.name, node.last_heartbeat)
        release_node(node, at=node.last_heartbeat, reason=Allocation.NODE_LOST, why=f"node {node.name} was lost")
    return count


def release_node(node, at, reason, why):
    """End every open allocation of a node and put its jobs back in the queue."""
    for allocation in node.allocations.filter(ended_at__isnull=True).select_related("job", "node"):
        if allocation.release(at, reason) is None:
            continue
        job = allocation.job
        job.refresh_from_db()
        if job.state in states.HOLDING:
            job.requeue(f"requeued: {why}", at=at)


def queued_jobs():
    return [
        policy.QueuedJob(
            id=str(job.pk),
            gpus=job.gpus,
            submitted_at=job.created_at,
            gpu_type=job.gpu_type,
            not_before=job.not_before,
        )
        for job in Job.objects.filter(state=states.QUEUED).order_by("created_at")
    ]


def node_states(now=None):
    return [
        policy.NodeState(id=str(node.pk), device_type=node.device_type, devices=node.devices, free=node.free_devices())
        for node in Node.objects.live(now)
    ]


def place(placement, now=None):
    """Hold devices for a job: the allocation's started_at is when the meter starts.

    The node row is locked while its free devices are re-read, so two schedulers cannot hand
    out the same device; the job's transition checks it is still queued."""
    now = now or timezone.now()
    with transaction.atomic():
        node = Node.objects.select_for_update().get(pk=placement.node_id)
        if node.lost_at or node.stopped_at or set(placement.devices) & node.used_devices():
            return None
        job = Job.objects.select_for_update().get(pk=placement.job_id)
        if job.state != states.QUEUED:
            return None
        rate = Rate.objects.in_force(node.device_type, now).per_gpu_hour
        limit, cap = remaining_allowance(job, rate)
        allocation = Allocation.objects.create(
            job=job,
            node=node,
            devices=list(placement.devices),
            device_type=node.device_type,
            rate=rate,
            limit_seconds=limit,
            cost_cap=cap,
            started_at=now,
        )
        job.start(allocation)
    return allocation


def remaining_allowance(job, rate):
    """What is left of the job's span or ceiling after its earlier allocations (if requeued)."""
    request = job.meter_request()
    limit = meter.held_limit_seconds(request, rate)
    cap = meter.cost_cap(request, rate)
    held_before, spent_before = job.held()
    if limit is not None:
        limit = max(0, limit - held_before)
    if cap is not None:
        cap = max(Decimal(0), cap - spent_before)
    return limit, cap


def schedule(now=None):
    """One scheduling cycle: place what fits, and tell the rest why they wait."""
    now = now or timezone.now()
    plan = policy.place_fcfs(queued_jobs(), node_states(now), now)
    placed = []
    for placement in plan.placements:
        try:
            allocation = place(placement, now)
        except NoRateInForce as error:
            plan.waiting[placement.job_id] = str(error)
            continue
        if allocation is not None:
            placed.append(allocation)
    for job_id, reason in plan.waiting.items():
        Job.objects.filter(pk=job_id, state=states.QUEUED).exclude(wait_reason=reason).update(wait_reason=reason[:300])
    return placed
