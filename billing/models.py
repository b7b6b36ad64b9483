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

    def worst_case(self, at=None, preemptible=False):
        """The highest rate in force over all GPU types (for requests that take any type)."""
        at = at or timezone.now()
        types = set(self.filter(effective_from__lte=at).values_list("gpu_type", flat=True))
        rates = [self.in_force(t, at) for t in types]
        if not rates:
            raise NoRateInForce("")
        return max(rates, key=lambda r: r.for_job(preemptible))


class Rate(models.Model):
    """A price per GPU-hour, set by an operator. A new rate never changes a past bill:
    an allocation keeps the rate in force when it started."""

    gpu_type = models.CharField(
        max_length=100, blank=True, help_text="Device type as runners report it (e.g. 'cpu', 'NVIDIA H100'); blank: any type without a rate of its own."
    )
    per_gpu_hour = models.DecimalField(max_digits=12, decimal_places=4)
    preemptible_per_gpu_hour = models.DecimalField(
        max_digits=12, decimal_places=4, null=True, blank=True,
        help_text="The discounted rate of preemptible jobs; blank: the same as the rate.",
    )
    effective_from = models.DateTimeField(default=timezone.now)
    created_at = models.DateTimeField(auto_now_add=True)

    objects = RateQuerySet.as_manager()

    class Meta:
        ordering = ["gpu_type", "-effective_from"]
        constraints = [
            models.CheckConstraint(condition=models.Q(per_gpu_hour__gt=0), name="rate_positive"),
            models.CheckConstraint(
                condition=models.Q(preemptible_per_gpu_hour__isnull=True) | models.Q(preemptible_per_gpu_hour__gt=0),
                name="preemptible_rate_positive",
            ),
        ]

    def for_job(self, preemptible):
        """The rate a job pays: the preemptible rate where it has one."""
        if preemptible and self.preemptible_per_gpu_hour is not None:
            return self.preemptible_per_gpu_hour
        return self.per_gpu_hour

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
    # Time lost through the network's fault (node lost, preempted) since the job's last
    # checkpoint: recorded against the usage, not billed.
    credit_seconds = models.PositiveBigIntegerField(default=0)
    credit_amount = models.DecimalField(max_digits=30, decimal_places=8, default=0)
    credit_reason = models.CharField(max_length=300, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["ended_at", "id"]
        indexes = [models.Index(fields=["team", "ended_at"])]

    @property
    def held_hours(self):
        return self.held_seconds / 3600

    @property
    def billed(self):
        return self.amount - self.credit_amount

    @property
    def amount_rounded(self):
        return meter.round_money(self.amount)
