"""The tracker worker: sends each job of a team with a tracker to that MLflow server as a run.

It runs as a thread of the scheduler process (scheduler/management/commands/scheduler.py), on
its own database connection, like the notification delivery: a tracker that hangs holds up this
thread only (at most E31_TRACKER_TIMEOUT_SECONDS per request), never a scheduling cycle. Tests
drive handle_one(now) with a clock of their own.

The outbox is the job's own events (durable rows, numbered per job) and a cursor over them per
job (TrackedRun.delivered_seq), moved only after the tracker answered 200 to the batch that
carried them. So a tracker that is down for hours loses no point: the cursor waits, with a
backoff. And doubles none: a batch whose answer never came (a timeout, a reset after sending)
may be stored all the same, so before it is sent again the run's history for its keys is read
and only the points not there are sent. A run whose creation's answer was lost is found again
by its e31.job_id tag before another is made.

The tracker's URL passes core.endpoints' policy (purpose "tracker", E31_TRACKER_ALLOW) at every
request, the connection made to the address checked, and redirects are not followed.
"""

import logging
from datetime import timedelta

import httpx
from django.conf import settings
from django.db.models import F, Max, Q
from django.urls import reverse
from django.utils import timezone

from core import endpoints, workers
from core.secrets_box import CannotDecrypt
from jobs import states
from jobs.models import Job
from tracking import batches
from tracking.mlflow_rest import Mlflow, TrackerError
from tracking.models import TrackedRun, Tracker

log = logging.getLogger("tracking")
EVENTS_READ = 2000  # metric events read at once (a batch takes whole events, up to 1000 points)
BATCHES_PER_TURN = 10  # then the run goes to the back of the line: one busy job does not starve the others
FINAL_METRICS = ("e31.cost", "e31.held_seconds", "e31.gpu_hours")
# A run is taken up at most this often: the points a job logs meanwhile go in one batch, and a job
# that logs without pause (every log line is an event) does not keep the worker in a loop.
PACE_SECONDS = 1.0


def job_url(job):
    return settings.E31_SITE_URL.rstrip("/") + reverse("jobs:detail", kwargs={"job_id": job.pk})


def run_tags(job):
    return {
        "e31.job_id": str(job.pk),
        "e31.url": job_url(job),
        "e31.team": job.team.name[: batches.MAX_TAG_VALUE_LENGTH],
        "e31.state": job.state,
        "mlflow.runName": job.name,
    }


def cost_metrics(job):
    """The job's cost as metric points, at its end: what it is billed (held, less credits),
    the seconds compute was held, and the GPU hours (GPUs x held hours)."""
    allocations = list(job.allocations.all())
    seconds, amount = job.held(allocations=allocations)
    _, credit = job.credited()
    gpu_seconds = sum(a.gpus * a.meter()[0] for a in allocations)
    at = batches.millis(job.finished_at or timezone.now())
    values = {"e31.cost": float(amount - credit), "e31.held_seconds": float(seconds), "e31.gpu_hours": gpu_seconds / 3600}
    return [batches.Point(job.last_seq, key, values[key], at, 0) for key in FINAL_METRICS]


class Worker:
    def __init__(self, client=None, timeout=None):
        self.timeout = settings.E31_TRACKER_TIMEOUT_SECONDS if timeout is None else timeout
        # trust_env=False: a proxy from the environment would connect by name, around the check.
        self.client = client or httpx.Client(timeout=self.timeout, follow_redirects=False, trust_env=False, transport=endpoints.PinnedTransport("tracker"))

    # Which jobs, and which is next ------------------------------------------------------------

    def enroll(self, now, limit=200):
        """A tracked run for each job of a team with an enabled tracker that has none yet: every
        job not ended before the tracker was registered (one running then is sent from its
        first event on). How many were added."""
        jobs = Job.objects.filter(team__tracker__enabled=True, tracked_run__isnull=True).filter(
            Q(finished_at__isnull=True) | Q(finished_at__gte=F("team__tracker__created_at"))
        )
        added = 0
        for job_id, tracker_id in jobs.values_list("pk", "team__tracker__pk")[:limit]:
            _, created = TrackedRun.objects.get_or_create(job_id=job_id, defaults={"tracker_id": tracker_id, "next_attempt_at": now, "created_at": now})
            added += created
        return added

    def claim(self, now):
        """The next tracked run with something to send, claimed for this attempt (None: none)."""
        lease = now + timedelta(seconds=4 * self.timeout + 60)
        due = TrackedRun.objects.filter(tracker__enabled=True, finished_sent=False, next_attempt_at__lte=now).filter(
            Q(run_id="") | Q(params_sent=False) | Q(job__last_seq__gt=F("delivered_seq")) | Q(job__state__in=states.TERMINAL)
        )
        for run in due.order_by("next_attempt_at").select_related("tracker", "job", "job__team")[:20]:
            # Claimed only if no other worker moved it meanwhile.
            claimed = TrackedRun.objects.filter(pk=run.pk, finished_sent=False, next_attempt_at=run.next_attempt_at)
            if claimed.update(next_attempt_at=lease) == 1:
                return run
        return None

    def handle_one(self, now=None):
        """Enroll new jobs, then claim one tracked run and send what it has pending; False when
        nothing was due."""
        now = now or timezone.now()
        self.enroll(now)
        run = self.claim(now)
        if run is None:
            return False
        try:
            self.deliver(run)
        except (TrackerError, endpoints.Refused, CannotDecrypt) as error:
            self.failed(run, now, error)
        except Exception as error:
            log.exception("tracker delivery of job %s failed", run.job_id)
            self.failed(run, now, error)
        else:
            self.succeeded(run, now)
        return True

    def drain(self, now=None, limit=1000):
        count = 0
        while count < limit and self.handle_one(now):
            count += 1
        return count

    def succeeded(self, run, now):
        pace = now + timedelta(seconds=PACE_SECONDS)
        TrackedRun.objects.filter(pk=run.pk).update(attempts=0, last_error="", last_attempt_at=now, next_attempt_at=pace)
        Tracker.objects.filter(pk=run.tracker_id).update(last_delivered_at=now)
        Tracker.objects.filter(pk=run.tracker_id).exclude(last_error="").update(last_error="")

    def failed(self, run, now, error):
        if isinstance(error, endpoints.Refused):
            text = f"not sent: {error}"
        elif isinstance(error, (TrackerError, CannotDecrypt)):
            text = str(error)
        else:
            text = f"{type(error).__name__}: {error}"
        attempts = run.attempts + 1
        wait = batches.retry_delay(attempts, settings.E31_TRACKER_RETRY_SECONDS, settings.E31_TRACKER_RETRY_MAX_SECONDS)
        TrackedRun.objects.filter(pk=run.pk).update(
            attempts=attempts, last_error=text[:2000], last_attempt_at=now, next_attempt_at=now + timedelta(seconds=wait)
        )
        Tracker.objects.filter(pk=run.tracker_id).update(last_error=f"job {run.job.name} ({run.job.short_id}): {text}"[:2000], last_error_at=now)
        log.warning("tracker delivery of job %s failed (attempt %d, next in %g s): %s", run.job_id, attempts, wait, text)

    # One run's delivery -----------------------------------------------------------------------

    def deliver(self, run):
        """Send what the run has pending, step by step, each step's progress saved as soon as
        the tracker took it (the next attempt starts where this one stopped)."""
        tracker, job = run.tracker, run.job
        api = Mlflow(self.client, tracker.url, tracker.token(), self.timeout)
        if not run.experiment_id:
            run.experiment_id = api.experiment_id(job.experiment or job.name)
            TrackedRun.objects.filter(pk=run.pk).update(experiment_id=run.experiment_id)
        if not run.run_id:
            self.make_run(api, run, job)
        if not run.params_sent:
            for chunk in batches.chunks(batches.params(job.hyperparameters, job.config), batches.MAX_PARAMS_PER_BATCH):
                api.log_batch(run.run_id, params=chunk)  # the same values again are taken: no check needed
            run.params_sent = True
            TrackedRun.objects.filter(pk=run.pk).update(params_sent=True)
        caught_up = self.send_metrics(api, run)
        job.refresh_from_db(fields=["state", "finished_at", "last_seq"])
        if caught_up and job.state in states.TERMINAL:
            self.finish(api, run, job)
        elif job.state != run.state_sent:
            api.set_tag(run.run_id, "e31.state", job.state)
            TrackedRun.objects.filter(pk=run.pk).update(state_sent=job.state)

    def make_run(self, api, run, job):
        found = api.find_run(run.experiment_id, "e31.job_id", str(job.pk))
        if found:
            # Made by an attempt whose answer was lost, or before the tracker's URL changed:
            # whatever was sent then may be there, so every event so far is checked first.
            run.run_id, run.verify_through_seq = found, job.last_seq
        else:
            run.run_id = api.create_run(run.experiment_id, job.name, batches.millis(job.created_at), run_tags(job))
            run.state_sent = job.state
        TrackedRun.objects.filter(pk=run.pk).update(run_id=run.run_id, verify_through_seq=run.verify_through_seq, state_sent=run.state_sent)

    def send_metrics(self, api, run):
        """Send the job's metric points after the cursor, a batch at a time; True when every
        event stored is delivered."""
        job = run.job
        for _ in range(BATCHES_PER_TURN):
            newer = job.events.filter(seq__gt=run.delivered_seq)
            # The last event stored now: the cursor may move past it (non-metric events
            # included) once every metric event up to it is sent. Events commit in sequence
            # order (JobEvent._reserve), so none below it can appear later.
            upto = newer.aggregate(last=Max("seq"))["last"]
            if upto is None:
                return True
            rows = list(newer.filter(kind="metric", seq__lte=upto).order_by("seq").values_list("seq", "at", "data")[:EVENTS_READ])
            ordinal = 0
            if any(not isinstance((data or {}).get("step"), int) for _, _, data in rows):
                ordinal = job.events.filter(kind="metric", seq__lte=run.delivered_seq).count()  # for points without a step
            points = batches.metric_points(rows, ordinal)
            batch = batches.next_batch(points, run.delivered_seq, run.delivered_points)
            self.send_points(api, run, batch.points)
            if points and (batch.partial or batch.cursor != points[-1].seq):
                cursor = batch.cursor  # more points than one batch: the rest next round
            elif len(rows) == EVENTS_READ:
                cursor = rows[-1][0]  # every point of the events read is in; more events to read
            else:
                cursor = upto  # every metric event up to upto is in: the rest are other kinds
            run.delivered_seq, run.delivered_points = cursor, batch.partial
            TrackedRun.objects.filter(pk=run.pk).update(delivered_seq=cursor, delivered_points=batch.partial)
        return not job.events.filter(seq__gt=run.delivered_seq).exists()

    def send_points(self, api, run, points):
        """One log-batch of points; those of events that may already be in the run (see
        verify_through_seq) only if its history lacks them."""
        if points and points[0].seq <= run.verify_through_seq:
            history = [m for key in sorted({p.key for p in points}) for m in api.history(run.run_id, key)]
            points = batches.missing(points, history)
        if not points:
            return
        try:
            api.log_batch(run.run_id, metrics=[p.as_mlflow() for p in points])
        except TrackerError as error:
            if error.unsure:
                run.verify_through_seq = max(run.verify_through_seq, points[-1].seq)
                TrackedRun.objects.filter(pk=run.pk).update(verify_through_seq=run.verify_through_seq)
            raise

    def finish(self, api, run, job):
        """The job ended and every event is in: its cost, its final state, the run's end."""
        points = batches.missing(cost_metrics(job), [m for key in FINAL_METRICS for m in api.history(run.run_id, key)])
        if points:
            api.log_batch(run.run_id, metrics=[p.as_mlflow() for p in points])
        api.set_tag(run.run_id, "e31.state", job.state)
        if job.reason:
            api.set_tag(run.run_id, "e31.reason", job.reason[: batches.MAX_TAG_VALUE_LENGTH])
        api.end_run(run.run_id, batches.RUN_STATUS.get(job.state, "FINISHED"), batches.millis(job.finished_at or timezone.now()))
        run.finished_sent = True
        TrackedRun.objects.filter(pk=run.pk).update(finished_sent=True, state_sent=job.state)

    # The thread ---------------------------------------------------------------------------------

    def run(self, stop, interval=1.0):
        """Deliver until `stop` (a threading.Event) is set; idle, look again every `interval` s."""
        try:
            workers.serve(self.handle_one, stop, interval, log, "tracker delivery")
        finally:
            self.client.close()


def start_thread(stop, interval=1.0):
    """The worker as a daemon thread (core.workers)."""
    return workers.start_thread(Worker().run, stop, interval, "tracking")
