"""When queued jobs will start and finish behind today's queue (scheduler.simulator), refreshed by
the scheduler every E31_PREDICT_SECONDS; deadlines missed or at risk; the prediction for a request
as filled in on the new-job form (jobs.compute asks it through NodesCompute)."""

from datetime import UTC, datetime

from django.conf import settings
from django.utils import timezone

from core.compiled import Read
from jobs import states
from jobs.models import Job
from notifications import events as notify
from notifications import policy as notify_policy
from notifications.models import Notification
from scheduler import policy
from scheduler.allocations import running_allocations, stamp
from scheduler.holds import budget_holds
from scheduler.models import Node
from scheduler.services import expected_seconds, node_states, queued_jobs, team_shares, team_usage


def predictions(queue, now, extra=()):
    """{job id: (start, finish) as datetimes} from a simulation of the queue and the running
    allocations (no new arrivals, expected durations)."""
    nodes = node_states(now)
    result = policy.predict(
        [*queue, *extra],
        nodes,
        running_allocations(nodes, now),
        now.timestamp(),
        usage=team_usage(now),
        shares=team_shares(),
        policy=settings.E31_SCHEDULER_POLICY,
    )
    return {job_id: (moment(start), moment(finish)) for job_id, (start, finish) in result.items()}


def moment(seconds):
    """The policy's float seconds as a datetime; None for never (a prediction of infinity)."""
    return datetime.fromtimestamp(seconds, UTC) if seconds is not None and seconds < 4e9 else None


def update_predictions(now=None):
    """Store each queued job's predicted start and finish, for its page and the API (none for
    a job over its team's budget)."""
    now = now or timezone.now()
    queue = queued_jobs(now, staged=False)
    # A job its team's budget holds back has no start to predict (the scheduler leaves it out too).
    held_back = budget_holds([(q.id, None) for q in queue], now, cumulative=False)
    predicted = predictions([q for q in queue if q.id not in held_back], now)
    changed = []
    for job in Job.objects.filter(state=states.QUEUED).only("pk", "predicted_start", "predicted_finish"):
        start, finish = predicted.get(str(job.pk), (None, None))
        if (job.predicted_start, job.predicted_finish) != (start, finish):
            job.predicted_start, job.predicted_finish = start, finish
            changed.append(job)
    Job.objects.bulk_update(changed, ["predicted_start", "predicted_finish"], batch_size=500)
    notify_deadlines_at_risk(predicted, now)
    return len(changed)


def notify_deadlines_at_risk(predicted, now):
    """Tell the team, once per job, when a queued job is predicted to finish after its deadline."""
    at_risk = {}
    for job_id, deadline in Job.objects.filter(state=states.QUEUED, deadline__isnull=False).values_list("pk", "deadline"):
        finish = predicted.get(str(job_id), (None, None))[1]
        if notify_policy.deadline_at_risk(finish, deadline):
            at_risk[notify_policy.deadline_key(job_id)] = (job_id, finish)
    told = set(Notification.objects.filter(key__in=list(at_risk)).values_list("key", flat=True))
    for key, (job_id, finish) in at_risk.items():
        if key in told:
            continue
        job = Job.objects.select_related("team").get(pk=job_id)
        notify.emit(
            notify_policy.DEADLINE_AT_RISK,
            team=job.team,
            job=job,
            once=key,
            at=now,
            data={"deadline": job.deadline, "predicted_finish": finish},
        )


def predict_request(team, request, *, gpu_type="", not_before=None, deadline=None, preemptible=False, rate=None, now=None):
    """When a request as filled in on the form would start and finish, behind the queue as it
    is now: (start, finish) as datetimes, or (None, None) when no node could run it."""
    now = now or timezone.now()
    wanted = policy.QueuedJob(
        id="(this request)",
        gpus=request.gpus,
        submitted_at=now.timestamp(),
        gpu_type=gpu_type,
        not_before=stamp(not_before),
        deadline=stamp(deadline),
        expected_seconds=expected_seconds(request, rate),
        team=str(team.pk),
        preemptible=preemptible,
    )
    return predictions(queued_jobs(now, staged=False), now, extra=[wanted]).get(wanted.id, (None, None))


NODE_TYPES = Read(lambda: Node.objects.values_list("device_type", flat=True))  # every submission's form asks: made once (core.compiled)


class NodesCompute:
    """The runners' nodes as the job pages see them (jobs.compute)."""

    def device_types(self):
        return set(NODE_TYPES())

    def predict(self, team, request, **options):
        return predict_request(team, request, **options)
