import uuid

from django.conf import settings
from django.db import models

from core.jsonfield import JSONField


class Sweep(models.Model):
    """A search over a template job's parameters: its trials are jobs, copies of the template
    with the parameters a sampler chose (sweeps.search), all under one money ceiling."""

    RUNNING, DONE, CEILING = "running", "done", "ceiling reached"
    STATES = [(RUNNING, "Running"), (DONE, "Done"), (CEILING, "Ceiling reached")]

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    team = models.ForeignKey("accounts.Team", on_delete=models.CASCADE, related_name="sweeps")
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    name = models.CharField(max_length=200)
    template = models.ForeignKey("jobs.Job", on_delete=models.PROTECT, related_name="+", help_text="the job each trial copies")
    space = JSONField(help_text="{parameter: spec} (sweeps.search)")
    method = models.CharField(max_length=10, help_text="grid, random or tpe (model-based)")
    objective = models.CharField(max_length=100, help_text="the metric the trials log and the search optimises (its last value)")
    direction = models.CharField(max_length=3, default="min", help_text="min or max")
    max_trials = models.PositiveIntegerField()
    parallel = models.PositiveIntegerField(default=2, help_text="trials queued or running at once, at most")
    ceiling_amount = models.DecimalField(max_digits=14, decimal_places=2, help_text="the most the whole sweep may cost")
    seed = models.IntegerField(default=0)
    prune = models.BooleanField(default=True, help_text="stop trials that fall behind (asynchronous successive halving)")
    state = models.CharField(max_length=20, choices=STATES, default=RUNNING)
    reason = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self):
        return f"{self.name} ({self.state})"


class Trial(models.Model):
    """One point of a sweep's search: the parameters asked for, the job that runs them, and the
    objective it reached. The sampler's own attributes (a grid's cell) are kept, so the search
    can be rebuilt from these rows alone."""

    RUNNING, COMPLETE, FAILED, PRUNED = "running", "complete", "failed", "pruned"

    sweep = models.ForeignKey(Sweep, on_delete=models.CASCADE, related_name="trials")
    number = models.PositiveIntegerField()
    params = JSONField()
    system_attrs = JSONField(default=dict)
    job = models.OneToOneField("jobs.Job", on_delete=models.PROTECT, related_name="trial")
    state = models.CharField(max_length=10, default=RUNNING)
    value = models.FloatField(null=True, blank=True)
    # The objective as its job logged it so far, read a few events at a time (sweeps.services.
    # catch_up): {step: value}, the last metric event read, and how many were read (the x of a
    # point logged without a step).
    intermediate = JSONField(default=dict)
    seen_seq = models.BigIntegerField(default=0)
    seen_points = models.PositiveIntegerField(default=0)

    class Meta:
        ordering = ["number"]
        constraints = [models.UniqueConstraint(fields=["sweep", "number"], name="trial_number_unique_per_sweep")]

    def __str__(self):
        return f"{self.sweep.name} #{self.number}"
