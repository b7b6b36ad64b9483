"""The scheduler's steps over the database; decisions come from scheduler.policy."""

import logging
from datetime import timedelta
from decimal import Decimal

from django.conf import settings
from django.db import transaction
from django.db.models import Sum
from django.utils import timezone

from billing import meter
from billing.models import NoRateInForce, Rate
from jobs import states
from jobs.models import Job
from scheduler import policy
from scheduler.models import Allocation, CachedBlob, Node, Staging
from scheduler.staging import job_manifest, manifest_digests

log = logging.getLogger(__name__)


def expire_lost_nodes(now=None):
    """Declare nodes whose runner went silent lost: their allocations end at the last heartbeat
    (the meter does not run on after the network lost the node) and their jobs are requeued."""
    now = now or timezone.now()
    cutoff = now - timedelta(seconds=settings.E31_NODE_TIMEOUT_SECONDS)
    count = 0
    for node in Node.objects.filter(lost_at__isnull=True, stopped_at__isnull=True, last_heartbeat__lt=cutoff):
        with transaction.atomic():
            # Re-checked in the update: a heartbeat that landed since the read keeps the node.
            silent = Node.objects.filter(pk=node.pk, lost_at__isnull=True, last_heartbeat__lt=cutoff)
            if silent.update(lost_at=now) != 1:
                continue
            last_heard = Node.objects.values_list("last_heartbeat", flat=True).get(pk=node.pk)
        count += 1
        log.warning("node %s lost: no heartbeat since %s", node.name, last_heard)
        Staging.objects.filter(node=node, state__in=Staging.LIVE).update(
            state=Staging.ABANDONED, finished_at=now, error=f"node {node.name} was lost"
        )
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
            else:
                job.finish(state, reason=message, exit_code=exit_code, at=at)
    return True


def queued_jobs(now=None):
    live_nodes = Node.objects.live(now)
    stagings = {}
    for row in Staging.objects.filter(job__state=states.QUEUED, state__in=Staging.LIVE, node__in=live_nodes).select_related("node"):
        stagings.setdefault(row.job_id, []).append(row)
    return [
        policy.QueuedJob(
            id=str(job.pk),
            gpus=job.gpus,
            submitted_at=job.created_at,
            gpu_type=job.gpu_type,
            not_before=job.not_before,
            staged_on=frozenset(str(s.node_id) for s in stagings.get(job.pk, []) if s.state == Staging.STAGED),
            staging_note=staging_note(stagings.get(job.pk, [])),
            preemptible=job.preemptible,
        )
        for job in Job.objects.filter(state=states.QUEUED).order_by("created_at")
    ]


def staging_note(stagings):
    for row in stagings:
        if row.state == Staging.STAGING:
            percent = 100 * row.bytes_done // row.bytes_total if row.bytes_total else 0
            return f"staging its data on {row.node.name}: {percent}% done"
        if row.state == Staging.WAITING:
            return f"waiting for {row.node.name} to stage its data"
    return "waiting to be lined up for staging"


def line_up(now=None):
    """Give each queued job that has no staging on a live node one: on the node that will run
    it, chosen while it waits, so its data moves before compute is held."""
    nodes = node_states(now)
    if not nodes:
        return []
    live_ids = [n.id for n in nodes]
    covered = set(
        Staging.objects.filter(state__in=Staging.LIVE, node_id__in=live_ids, job__state=states.QUEUED).values_list("job_id", flat=True)
    )
    lined_up = {}
    for node_id in Staging.objects.filter(state__in=Staging.LIVE, node_id__in=live_ids, job__state=states.QUEUED).values_list(
        "node_id", flat=True
    ):
        lined_up[str(node_id)] = lined_up.get(str(node_id), 0) + 1
    created = []
    for job in Job.objects.filter(state=states.QUEUED).exclude(pk__in=covered).order_by("created_at"):
        wanted = policy.QueuedJob(id=str(job.pk), gpus=job.gpus, submitted_at=job.created_at, gpu_type=job.gpu_type)
        if policy.choose_staging_node(wanted, nodes, {}, lined_up) is None:
            continue  # no live node could run it: no need to read its manifest every cycle
        items = job_manifest(job)
        digests = manifest_digests(items)
        cached = {
            str(row["node_id"]): row["total"]
            for row in CachedBlob.objects.filter(sha256__in=digests, node_id__in=live_ids).values("node_id").annotate(total=Sum("size"))
        }
        node_id = policy.choose_staging_node(wanted, nodes, cached, lined_up)
        lined_up[node_id] = lined_up.get(node_id, 0) + 1
        created.append(
            Staging.objects.create(
                job=job, node_id=node_id, files_total=len(items), bytes_total=sum(item.size for item in items)
            )
        )
    return created


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
        rate = Rate.objects.in_force(node.device_type, now).for_job(job.preemptible)
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
            preemptible=job.preemptible,
        )
        job.start(allocation)
    return allocation


def remaining_allowance(job, rate):
    """What is left of the job's span or ceiling after its earlier allocations (if requeued).
    Time credited for the network's faults is given back: it was not billed."""
    request = job.meter_request()
    limit = meter.held_limit_seconds(request, rate)
    cap = meter.cost_cap(request, rate)
    held_before, spent_before = job.held()
    credit_seconds, credit_amount = job.credited()
    held_before, spent_before = max(0, held_before - credit_seconds), max(Decimal(0), spent_before - credit_amount)
    if limit is not None:
        limit = min(max(0, limit - held_before), meter.MAX_HELD_SECONDS)
    if cap is not None:
        cap = max(Decimal(0), cap - spent_before)
    return limit, cap


def running_allocations(nodes):
    rows = Allocation.objects.filter(ended_at__isnull=True, node_id__in=[n.id for n in nodes])
    return [
        policy.Running(
            id=str(a.pk), node_id=str(a.node_id), devices=tuple(a.devices), preemptible=a.preemptible,
            started_at=a.started_at, preempting=a.preempt_requested_at is not None,
        )
        for a in rows
    ]


def preempt(allocation_id, why):
    """Ask the runner holding a preemptible allocation to give it back: the job is told to
    stop (SIGTERM, the SDK's should_stop()), gets the grace period to checkpoint, and goes back
    to the queue. False if it is not preemptible, already ended or already asked."""
    now = timezone.now()
    asked = Allocation.objects.filter(
        pk=allocation_id, preemptible=True, ended_at__isnull=True, preempt_requested_at__isnull=True
    ).update(preempt_requested_at=now)
    if asked:
        job = Job.objects.get(allocations__pk=allocation_id)
        job.record("notice", data={"text": f"preempted: {why}; it goes back to the queue and resumes from its latest checkpoint"})
    return bool(asked)


def schedule(now=None):
    """One scheduling cycle: place what fits, preempt what must make room, and tell the rest
    why they wait."""
    now = now or timezone.now()
    queue, nodes = queued_jobs(now), node_states(now)
    plan = policy.place_fcfs(queue, nodes, now)
    victims, notes = policy.choose_preemptions(plan, queue, nodes, running_allocations(nodes), now)
    for allocation_id in victims:
        preempt(allocation_id, "a job that is not preemptible needs its devices")
    plan.waiting.update(notes)
    placed = []
    for placement in plan.placements:
        try:
            allocation = place(placement, now)
        except NoRateInForce as error:
            plan.waiting[placement.job_id] = str(error)
            continue
        except Exception as error:  # noqa: BLE001 - one job that cannot be placed must not stop the rest
            log.exception("could not place job %s", placement.job_id)
            plan.waiting[placement.job_id] = f"could not be placed: {error}"
            continue
        if allocation is not None:
            placed.append(allocation)
    for job_id, reason in plan.waiting.items():
        Job.objects.filter(pk=job_id, state=states.QUEUED).exclude(wait_reason=reason).update(wait_reason=reason[:300])
    return placed
