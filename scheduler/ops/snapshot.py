"""The operator's view over the database: a few aggregate queries read into scheduler.ops.figures
plain data, for the page at /ops/ and for /metrics."""

from datetime import UTC, timedelta
from decimal import Decimal

from django.conf import settings
from django.db.models import Count, F, Q, Sum
from django.utils import timezone

from billing.models import Credit, UsageRecord
from jobs import states
from jobs.models import Job
from scheduler.models import Allocation, Node
from scheduler.ops import figures

DAY = 24 * 3600


def thresholds():
    return figures.Thresholds(
        starting_seconds=settings.E31_STUCK_STARTING_SECONDS,
        queued_seconds=settings.E31_STUCK_QUEUED_SECONDS,
        running_seconds=settings.E31_STUCK_RUNNING_SECONDS,
        overrun_seconds=settings.E31_STUCK_OVERRUN_SECONDS,
    )


def nodes():
    """Every node with the devices its open allocations hold (two queries)."""
    allocated = {}
    for node_id, devices in Allocation.objects.filter(ended_at__isnull=True).values_list("node_id", "devices"):
        allocated[node_id] = allocated.get(node_id, 0) + len(devices)
    return [
        figures.NodeRow(
            name=n.name,
            device_type=n.device_type,
            devices=n.devices,
            allocated=allocated.get(n.pk, 0),
            last_heartbeat=n.last_heartbeat,
            lost_at=n.lost_at,
            stopped_at=n.stopped_at,
            executor=n.executor,
            busy_elsewhere=n.busy_elsewhere,
            engine_state=n.engine_state,
            engine_reason=n.engine_reason,
        )
        for n in Node.objects.order_by("name")
    ]


def engine_disagreements(now, days=30):
    """Allocations of the last days whose billed time and the engine's accounting differ by
    more than a second (one query)."""
    rows = (
        Allocation.objects.filter(ended_at__gte=now - timedelta(days=days), engine_seconds__isnull=False)
        .order_by("-ended_at")
        .values_list("pk", "job_id", "job__name", "node__name", "engine_handle", "started_at", "ended_at", "engine_seconds")[:1000]
    )
    return figures.disagreements(rows)


def queued():
    rows = Job.objects.filter(state=states.QUEUED).values_list("pk", "name", "team__name", "gpus", "created_at", "predicted_start", "wait_reason")
    return [
        figures.Queued(id=str(pk), name=name, team=team, gpus=gpus, submitted_at=created, predicted_start=start, wait_reason=reason)
        for pk, name, team, gpus, created, start, reason in rows
    ]


def candidates():
    """The jobs that may be stuck, as figures.JobState: queued ones with a predicted start, and
    every job starting or running, with when its compute was held and when its span or ceiling
    runs out (the earliest of a gang's allocations)."""
    jobs = {}
    fields = ("pk", "name", "team__name", "state", "predicted_start", "predicted_finish")
    for pk, name, team, state, start, finish in Job.objects.filter(
        Q(state=states.QUEUED, predicted_start__isnull=False) | Q(state__in=states.HOLDING)
    ).values_list(*fields):
        jobs[pk] = {"id": str(pk), "name": name, "team": team, "state": state, "predicted_start": start, "predicted_finish": finish, "holding": False}
    open_allocations = Allocation.objects.filter(ended_at__isnull=True, job__state__in=states.HOLDING)
    for job_id, started, limit in open_allocations.values_list("job_id", "started_at", "limit_seconds"):
        job = jobs.get(job_id)
        if job is None:
            continue
        job["holding"] = True
        job["since"] = min(started, job.get("since") or started)
        if limit is not None:
            until = started + timedelta(seconds=min(limit, 10**10))
            job["held_until"] = min(until, job.get("held_until") or until)
    return [figures.JobState(**job) for job in jobs.values()]


def stuck(now):
    return figures.stuck_jobs(candidates(), now, thresholds())


def job_counts():
    counts = dict.fromkeys((value for value, _ in states.CHOICES), 0)
    counts.update(Job.objects.order_by().values_list("state").annotate(n=Count("pk")))
    return counts


def utilization(now, span_seconds, bucket_seconds):
    """figures.Bucket's over the window: allocations held against the devices the nodes offered
    (a node offers its devices from registration until it is lost or stopped, or its last
    heartbeat if it went silent)."""
    start, end = figures.window(now, span_seconds, bucket_seconds)
    held = [
        figures.Held(s, e, len(devices))
        for s, e, devices in Allocation.objects.filter(Q(ended_at__isnull=True) | Q(ended_at__gt=start), started_at__lt=end).values_list(
            "started_at", "ended_at", "devices"
        )
    ]
    cutoff = now - timedelta(seconds=settings.E31_NODE_TIMEOUT_SECONDS)
    offered = []
    for registered, last, lost, stopped, devices in Node.objects.filter(registered_at__lt=end).values_list(
        "registered_at", "last_heartbeat", "lost_at", "stopped_at", "devices"
    ):
        until = lost or stopped or (last if last < cutoff else None)
        offered.append(figures.Held(registered, until, devices))
    return figures.utilization(held, offered, start, end, bucket_seconds, now)


def daily(now, days=14):
    """figures.Day's for the last `days` days (UTC) from the ledger, running allocations'
    provisional records included."""
    wanted = figures.days_back(now.astimezone(UTC).date(), days)
    since = now - timedelta(days=days + 1)
    usage = [
        figures.Usage(s, e, gpus, amount)
        for s, e, gpus, amount in UsageRecord.ledger.filter(ended_at__gte=since).values_list("started_at", "ended_at", "gpus", "amount")
    ]
    credits = Credit.objects.filter(created_at__gte=since).values_list("created_at", "amount")
    return figures.daily(usage, credits, wanted)


def ledger_totals():
    """({device type: device-seconds held}, amount charged, amount credited), ever."""
    held = {
        gpu_type: seconds or 0 for gpu_type, seconds in UsageRecord.ledger.order_by().values_list("gpu_type").annotate(s=Sum(F("gpus") * F("held_seconds")))
    }
    charged = UsageRecord.ledger.aggregate(a=Sum("amount"))["a"] or Decimal(0)
    credited = Credit.objects.aggregate(a=Sum("amount"))["a"] or Decimal(0)
    return held, charged, credited


def snapshot(now=None):
    """The pool as /metrics exports it: about ten queries, whatever the size of the history."""
    now = now or timezone.now()
    held, charged, credited = ledger_totals()
    return figures.Snapshot(
        now=now,
        node_timeout_seconds=settings.E31_NODE_TIMEOUT_SECONDS,
        nodes=nodes(),
        job_counts=job_counts(),
        queued=queued(),
        stuck=stuck(now),
        held_device_seconds=held,
        charged=charged,
        credited=credited,
        currency=settings.E31_CURRENCY,
    )
