"""A team's experiment tracker (an MLflow tracking server) and, per job, where its delivery
there stands: the outbox of tracking.worker.

The job's events are already durable rows with a per-job sequence number, so the outbox copies
nothing: a TrackedRun is a cursor over them (the last event delivered) plus the steps that are
not events (the run made, its parameters, the final cost and status).
"""

import uuid

from django.conf import settings
from django.db import models
from django.utils import timezone

from core.secrets_box import seal, unseal


class Tracker(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    team = models.OneToOneField("accounts.Team", on_delete=models.CASCADE, related_name="tracker")
    url = models.CharField(max_length=500, help_text="the MLflow tracking server's address")
    # The token, encrypted (core.secrets_box); never shown back, blank for a server without one.
    sealed_token = models.TextField(blank=True)
    enabled = models.BooleanField(default=True, help_text="off: nothing is sent (the outbox waits)")
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(auto_now=True)
    # What the team's page shows of the deliveries.
    last_error = models.TextField(blank=True)
    last_error_at = models.DateTimeField(null=True, blank=True)
    last_delivered_at = models.DateTimeField(null=True, blank=True)

    def __str__(self):
        return f"{self.team_id} -> {self.url}"

    @property
    def has_token(self):
        return bool(self.sealed_token)

    def set_token(self, token):
        self.sealed_token = seal({"token": token}) if token else ""

    def token(self):
        return unseal(self.sealed_token)["token"] if self.sealed_token else ""


class TrackedRun(models.Model):
    """One job's run in its team's tracker, and how far its delivery is."""

    job = models.OneToOneField("jobs.Job", on_delete=models.CASCADE, related_name="tracked_run")
    tracker = models.ForeignKey(Tracker, on_delete=models.CASCADE, related_name="runs")
    experiment_id = models.CharField(max_length=100, blank=True)
    run_id = models.CharField(max_length=100, blank=True)
    params_sent = models.BooleanField(default=False)
    state_sent = models.CharField(max_length=20, blank=True, help_text="the job's state as the run's e31.state tag last said")
    # The cursor: the last job event delivered, and of the event after it the points already
    # delivered (one with more values than a batch holds goes in parts).
    delivered_seq = models.PositiveBigIntegerField(default=0)
    delivered_points = models.PositiveIntegerField(default=0)
    # Events up to here may be in the run already (a batch sent whose answer was lost, a run
    # found rather than made): their points are checked against the run's history before sending.
    verify_through_seq = models.PositiveBigIntegerField(default=0)
    finished_sent = models.BooleanField(default=False, help_text="the cost, the final state and the run's end are in the tracker")
    attempts = models.PositiveIntegerField(default=0, help_text="failed attempts in a row")
    # When the worker may take it up next; a worker that claims it sets this to the end of its lease.
    next_attempt_at = models.DateTimeField(default=timezone.now)
    last_attempt_at = models.DateTimeField(null=True, blank=True)
    last_error = models.TextField(blank=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        indexes = [models.Index(fields=["finished_sent", "next_attempt_at"])]

    def __str__(self):
        return f"{self.job_id} -> {self.run_id or '(no run yet)'} #{self.delivered_seq}"
