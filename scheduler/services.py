"""The scheduler's placement cycle over the database: line up the queue (line_up), place what fits
(schedule, place), flag missed deadlines. Decisions come from scheduler.policy; budget holds from
scheduler.holds; nodes lost and allocations ended are scheduler.allocations; predictions are
scheduler.predictions."""

import logging
import uuid
from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import Q, Sum
from django.utils import timezone

from accounts.models import Team
from billing import meter
from billing.budget_service import Rates, remaining_allowance
from billing.models import NoRateInForce, Rate, UsageRecord
from jobs import durations, lineage, states
from jobs.manifest import job_manifest, manifest_digests
from jobs.models import Job, Upload
from jobs.packages import packages_digest, requirements_of
from scheduler import policy
from scheduler.allocations import preempt, running_allocations, stamp
from scheduler.holds import budget_holds
from scheduler.models import Allocation, CachedBlob, Node, Staging

log = logging.getLogger(__name__)


def expected_seconds(request, rate, held_before=0):
    """How long a request (a meter.Request) is expected to hold its devices: its span, or the
    time its ceiling buys, less what it held already (a requeued job). An hour when nothing
    bounds it."""
    limit = meter.held_limit_seconds(request, rate) if rate is not None else None
    if limit is None:
        if request.span_hours is None:
            return 3600.0
        limit = float(request.span_hours) * 3600
    return float(max(60, min(limit, meter.MAX_HELD_SECONDS) - held_before))


def learn_durations(jobs):
    """Learn, once per job, how long these queued jobs will hold their devices from their
    teams' earlier runs of the same work that succeeded (jobs.durations); stored on the
    jobs (learned_seconds, learned_from), so a cycle reads history only for jobs new to it."""
    jobs = [j for j in jobs if j.learned_from is None]
    if not jobs:
        return
    past = list(
        Job.objects.filter(state=states.SUCCEEDED, team_id__in={j.team_id for j in jobs}, name__in={j.name for j in jobs})
        .annotate(held=Sum("usage__held_seconds"))
        .order_by("-finished_at")
        .only("pk", "team_id", "name", "entrypoint", "config", "hyperparameters", "args", "gpus")[: durations.KEPT * 50]
    )
    code = {}
    for job_id, sha256 in Upload.objects.filter(job__in=[*jobs, *past], role=Upload.CODE).order_by("sha256").values_list("job_id", "sha256"):
        code[job_id] = f"{code.get(job_id, '')}{sha256}"

    def key(job):
        work = code.get(job.pk) or job.entrypoint  # its code, or the recipe it runs
        return job.team_id, durations.work_key(name=job.name, code=work, config=job.config, hyperparameters=job.hyperparameters, args=job.args, gpus=job.gpus)

    held = {}
    for run in reversed(past):  # oldest first, as learned_seconds reads them
        if run.held:
            held.setdefault(key(run), []).append(float(run.held))
    for job in jobs:
        runs = held.get(key(job), [])[-durations.KEPT :]
        job.learned_seconds, job.learned_from = durations.learned_seconds(runs), len(runs)
        Job.objects.filter(pk=job.pk).update(learned_seconds=job.learned_seconds, learned_from=job.learned_from)


def queued_jobs(now=None, staged=True):
    """The queue as the policy sees it. staged=False: as if every job's data were staged (for
    predictions, which look past the staging)."""
    now = now or timezone.now()
    live_nodes = Node.objects.live(now)
    # A cluster engine's nodes are never staged on beforehand: our agent stages a job's data when
    # the engine starts it there (scheduler/engine.py), so every job may go to them.
    anywhere = frozenset(str(pk) for pk in live_nodes.exclude(executor="").values_list("pk", flat=True))
    stagings = {}
    if staged:
        for row in Staging.objects.filter(job__state=states.QUEUED, state__in=Staging.LIVE, node__in=live_nodes).select_related("node"):
            stagings.setdefault(row.job_id, []).append(row)
    rates = Rates(now)
    queue = []
    ready = Q(smoke_run__isnull=True) | Q(smoke_run__state=states.SUCCEEDED)  # not waiting for its smoke run
    # A gang requeued while one of its nodes still holds devices (a lost node not yet declared
    # so) waits until every part is released: a job never holds two gangs.
    holding = Allocation.objects.filter(ended_at__isnull=True).values("job_id")
    jobs = list(Job.objects.filter(ready, state=states.QUEUED).exclude(pk__in=holding).order_by("created_at"))
    learn_durations(jobs)
    for job in jobs:
        held_before = job.held(now)[0] - job.credited()[0] if job.restarts else 0
        declared = expected_seconds(job.meter_request(), rates.for_job(job), held_before)
        queue.append(
            policy.QueuedJob(
                id=str(job.pk),
                gpus=job.gpus,
                submitted_at=job.created_at.timestamp(),
                gpu_type=job.gpu_type,
                not_before=stamp(job.not_before),
                deadline=stamp(job.deadline),
                expected_seconds=durations.expected_seconds(declared, job.learned_seconds, held_before),
                team=str(job.team_id),
                preemptible=job.preemptible,
                staged_on=frozenset(str(s.node_id) for s in stagings.get(job.pk, []) if s.state == Staging.STAGED) | anywhere if staged else None,
                staging_note=staging_note(stagings.get(job.pk, [])) if staged else "",
            )
        )
    return queue


def team_usage(now=None):
    """Each team's GPU-seconds of released allocations, decayed with the fair-share half-life."""
    now = now or timezone.now()
    half_life = settings.E31_FAIR_SHARE_HALF_LIFE_HOURS * 3600
    since = now - timedelta(seconds=8 * half_life)  # older usage weighs less than 1/256
    records = [
        (str(team), gpus * seconds, ended.timestamp())
        for team, gpus, seconds, ended in UsageRecord.objects.filter(ended_at__gte=since).values_list("team_id", "gpus", "held_seconds", "ended_at")
    ]
    # What running allocations have held so far, the policy adds itself.
    return policy.decayed_usage(records, now.timestamp(), half_life)


def team_shares():
    return {str(pk): share for pk, share in Team.objects.values_list("pk", "share")}


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
    it, chosen while it waits, so its data moves before compute is held. A gang larger than any
    node is staged on enough nodes to hold it together. A job whose nodes are all busy while
    another node that could run it has its devices spare is staged there too
    (policy.choose_another_staging_node): it starts on whichever is ready first."""
    # An idle cycle reads no node; the queue's rows are read only where a node could take their
    # data (never on a cluster engine's nodes alone, however long the queue).
    queued = Job.objects.filter(state=states.QUEUED).order_by("created_at")
    if not queued.exists():
        return []
    engine_nodes = {str(pk) for pk in Node.objects.live(now).exclude(executor="").values_list("pk", flat=True)}
    nodes = [n for n in node_states(now) if n.id not in engine_nodes]  # an engine's: staged by our agent when it starts
    if not nodes:
        return []
    live_ids = [n.id for n in nodes]
    devices = {n.id: n.devices for n in nodes}
    largest = max(devices.values())
    # Free devices not yet promised to a job ahead in the queue (first come, first promised).
    spare = {n.id: len(n.free) for n in nodes}
    live = Staging.objects.filter(state__in=Staging.LIVE, node_id__in=live_ids, job__state=states.QUEUED)
    staging_on = {}
    lined_up = {}
    for job_id, node_id in live.values_list("job_id", "node_id"):
        staging_on.setdefault(job_id, set()).add(str(node_id))
        lined_up[str(node_id)] = lined_up.get(str(node_id), 0) + 1
    created = []

    def stage_on(job, items, node_id):
        lined_up[node_id] = lined_up.get(node_id, 0) + 1
        staging_on.setdefault(job.pk, set()).add(node_id)
        created.append(Staging.objects.create(job=job, node_id=node_id, files_total=len(items), bytes_total=sum(item.size for item in items)))

    def cached_bytes(items, job):
        # Its data, and its environment where it asks for packages: a node holding either
        # saves the job that much waiting.
        digests = manifest_digests(items) | environment_digests(job)
        return {
            str(row["node_id"]): row["total"]
            for row in CachedBlob.objects.filter(sha256__in=digests, node_id__in=live_ids).values("node_id").annotate(total=Sum("size"))
        }

    for job in queued:
        already = staging_on.get(job.pk, set())
        wanted = policy.QueuedJob(id=str(job.pk), gpus=job.gpus, submitted_at=job.created_at, gpu_type=job.gpu_type)
        if already and job.gpus <= largest:
            # One node stages it; it can run there once devices are free, unless another node
            # has them now.
            promised = next((i for i in sorted(already, key=lambda i: -spare.get(i, 0)) if spare.get(i, 0) >= job.gpus), None)
            if promised is not None:
                spare[promised] -= job.gpus
                continue
            if not any(spare[n.id] >= job.gpus for n in nodes if n.id not in already):
                continue  # nowhere else is free either: no need to read its manifest
            items = job_manifest(job)
            node_id = policy.choose_another_staging_node(wanted, nodes, frozenset(already), spare, cached_bytes(items, job), lined_up)
            if node_id is not None:
                spare[node_id] -= job.gpus
                stage_on(job, items, node_id)
            continue
        if already and sum(devices[i] for i in already) >= job.gpus:
            continue  # a gang lined up where it can run
        if not policy.choose_staging_nodes(wanted, nodes, {}, lined_up, exclude=already):
            continue  # the live nodes could not run it: no need to read its manifest every cycle
        items = job_manifest(job)
        for node_id in policy.choose_staging_nodes(wanted, nodes, cached_bytes(items, job), lined_up, exclude=already):
            if spare.get(node_id, 0) >= job.gpus:
                spare[node_id] -= job.gpus
            stage_on(job, items, node_id)
    return created


def environment_digests(job):
    requirements = requirements_of(job)
    return {packages_digest(requirements)} if requirements else set()


def node_states(now=None):
    return [
        policy.NodeState(id=str(node.pk), device_type=node.device_type, devices=node.devices, free=node.free_devices(), held_elsewhere=node.busy_elsewhere)
        for node in Node.objects.live(now)
        if node.offered
    ]


def place(placement, now=None):
    """Hold devices for a job: the allocations' started_at is when the meter starts.

    The nodes' rows are locked (in one order, so two schedulers cannot deadlock) while their
    free devices are re-read, so two schedulers cannot hand out the same device; the job's
    transition checks it is still queued. A placement across nodes is a gang: one allocation
    per node, all made in one transaction with one started_at, or none. Without `now`, the meter
    starts when the locks are held: not at the start of a cycle, when the devices may still
    have been another job's. Returns the first allocation (node 0's), or None."""
    with transaction.atomic():
        nodes = {str(n.pk): n for n in Node.objects.select_for_update().filter(pk__in=[node for node, _ in placement.parts]).order_by("pk")}
        for node_id, devices in placement.parts:
            node = nodes.get(str(node_id))
            if node is None or node.lost_at or node.stopped_at or not set(devices) <= set(node.free_devices()):
                return None
        # Only now: a release committed while we read the devices (its ended_at taken before
        # its commit) is then always before this start, never a fraction of a millisecond after.
        now = now or timezone.now()
        job = Job.objects.select_for_update().get(pk=placement.job_id)
        if job.state != states.QUEUED:
            return None
        if job.team.monthly_budget is not None:
            # The budget is checked again under the team's lock: another scheduler may have
            # started one of the team's jobs since this one's plan was made, and together they
            # must not pass the budget.
            Team.objects.select_for_update().get(pk=job.team_id)
            held = budget_holds([(str(job.pk), nodes[str(placement.parts[0][0])].device_type)], now)
            if held:
                Job.objects.filter(pk=job.pk).update(wait_reason=held[str(job.pk)][:300])
                return None
        rates = {node_id: Rate.objects.in_force(nodes[str(node_id)].device_type, now).for_job(job.preemptible) for node_id, _ in placement.parts}
        # The job's span or ceiling, at the dearest of its nodes' rates; a money cap is shared
        # out by devices, so the gang together never passes it.
        limit, cap = remaining_allowance(job, max(rates.values()))
        total = placement.gpus
        gang = uuid.uuid4() if len(placement.parts) > 1 else None
        allocations = []
        for rank, (node_id, devices) in enumerate(placement.parts):
            node = nodes[str(node_id)]
            allocation = Allocation.objects.create(
                job=job,
                node=node,
                devices=list(devices),
                device_type=node.device_type,
                rate=rates[node_id],
                limit_seconds=limit,
                cost_cap=None if cap is None else cap * len(devices) / total,
                started_at=now,
                preemptible=job.preemptible,
                gang=gang,
                node_rank=rank,
                gang_size=len(placement.parts),
            )
            allocation.open_usage()
            allocations.append(allocation)
        job.start(allocations[0], gang=allocations if gang else None)
    return allocations[0]


def schedule(now=None):
    """One scheduling cycle: place what the policy chose, preempt what must make room, flag
    deadlines that can no longer be met, and tell the rest why they wait."""
    given, now = now, now or timezone.now()
    lineage.settle_smoke_runs()
    queue = queued_jobs(now)
    if not queue:
        return []  # an idle cycle: nothing to place, preempt for, or flag
    nodes = node_states(now)
    # A job whose worst case alone would overrun its team's budget is not planned at all: it
    # must not hold devices back from, or preempt, jobs that can start.
    over_budget = budget_holds([(q.id, None) for q in queue], now, cumulative=False)
    queue = [q for q in queue if q.id not in over_budget]
    plan = policy.plan(
        queue,
        nodes,
        running_allocations(nodes, now),
        now.timestamp(),
        usage=team_usage(now),
        shares=team_shares(),
        policy=settings.E31_SCHEDULER_POLICY,
        half_life=settings.E31_FAIR_SHARE_HALF_LIFE_HOURS * 3600,
        preempt_every=settings.E31_PREEMPT_EVERY_SECONDS,
    )
    for allocation_id in plan.preempt:
        preempt(allocation_id, plan.preempt_reasons.get(allocation_id, "another job needs its devices"))
    flag_missed_deadlines(plan.infeasible, now)
    plan.waiting.update(over_budget)
    # Together, the jobs about to start must fit too: each one's worst case counts against its
    # team's budget before the next one is allowed, at the rate of the node it would start on.
    device_types = {n.id: n.device_type for n in nodes}
    held_back = budget_holds([(p.job_id, device_types.get(p.parts[0][0], "")) for p in plan.placements], now)
    plan.waiting.update(held_back)
    placed = []
    for placement in plan.placements:
        if placement.job_id in held_back:
            continue
        try:
            allocation = place(placement, given)
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


def flag_missed_deadlines(job_ids, now):
    """Jobs whose deadline can no longer be met are flagged once, and the team told on the
    job's page, instead of starving silently."""
    for job_id in job_ids:
        if Job.objects.filter(pk=job_id, deadline_missed_at__isnull=True).update(deadline_missed_at=now):
            job = Job.objects.get(pk=job_id)
            job.record(
                "notice",
                data={"text": f"its deadline ({job.deadline:%Y-%m-%d %H:%M} UTC) can no longer be met; it stays queued and runs as soon as it can"},
            )
