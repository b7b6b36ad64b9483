from django.db import models
from django.utils import timezone

from billing import meter


class NoRateInForce(Exception):
    def __init__(self, gpu_type):
        self.gpu_type = gpu_type
        kind = f"{gpu_type} devices" if gpu_type else "this request"
        super().__init__(f"No rate is in force for {kind}: an operator has to set one before jobs can be submitted.")


class RateQuerySet(models.QuerySet):
    def in_force(self, gpu_type, at=None):
        """The rate for gpu_type at a moment: its own rate if it has one, else the any-type rate."""
        at = at or timezone.now()
        current = self.filter(effective_from__lte=at).order_by("-effective_from", "-id")
        for candidate in (gpu_type, ""):
            rate = current.filter(gpu_type=candidate).first()
            if rate is not None:
                return rate
        raise NoRateInForce(gpu_type)

    def worst_case(self, at=None):
        """The highest rate in force over all GPU types (for requests that take any type)."""
        at = at or timezone.now()
        types = set(self.filter(effective_from__lte=at).values_list("gpu_type", flat=True))
        rates = [self.in_force(t, at) for t in types]
        if not rates:
            raise NoRateInForce("")
        return max(rates, key=lambda r: r.per_gpu_hour)


class Rate(models.Model):
    """A price per GPU-hour, set by an operator. A new rate never changes a past bill:
    an allocation keeps the rate in force when it started."""

    gpu_type = models.CharField(
        max_length=100, blank=True, help_text="Device type as runners report it (e.g. 'cpu', 'NVIDIA H100'); blank: any type without a rate of its own."
    )
    per_gpu_hour = models.DecimalField(max_digits=12, decimal_places=4)
    effective_from = models.DateTimeField(default=timezone.now)
    created_at = models.DateTimeField(auto_now_add=True)

    objects = RateQuerySet.as_manager()

    class Meta:
        ordering = ["gpu_type", "-effective_from"]
        constraints = [models.CheckConstraint(condition=models.Q(per_gpu_hour__gt=0), name="rate_positive")]

    def __str__(self):
        return f"{self.gpu_type or 'any type'}: {self.per_gpu_hour}/GPU-hour from {self.effective_from:%Y-%m-%d %H:%M}"


class UsageRecord(models.Model):
    """One per allocation, written when it is released. Append-only."""

    team = models.ForeignKey("accounts.Team", on_delete=models.PROTECT, related_name="usage")
    job = models.ForeignKey("jobs.Job", on_delete=models.PROTECT, related_name="usage")
    allocation = models.OneToOneField("scheduler.Allocation", on_delete=models.PROTECT, related_name="usage")
    gpu_type = models.CharField(max_length=100)
    gpus = models.PositiveIntegerField()
    started_at = models.DateTimeField()
    ended_at = models.DateTimeField()
    held_seconds = models.PositiveBigIntegerField()
    rate = models.DecimalField(max_digits=12, decimal_places=4)
    amount = models.DecimalField(max_digits=30, decimal_places=8)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["ended_at", "id"]
        indexes = [models.Index(fields=["team", "ended_at"])]

    @property
    def held_hours(self):
        return self.held_seconds / 3600

    @property
    def amount_rounded(self):
        return meter.round_money(self.amount)
