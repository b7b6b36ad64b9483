"""A job's use of its ceiling (money or GPU-hours): the meter's arithmetic, and the job as it stands."""

from dataclasses import dataclass
from decimal import ROUND_FLOOR, Decimal

from django.utils import timezone

from billing.meter import AMOUNT_PLACES, SECONDS_PER_HOUR

FRACTION_PLACES = Decimal("0.0001")
GPU_HOUR_PLACES = Decimal("0.0001")  # as ceiling_gpu_hours is stored


@dataclass(frozen=True)
class CeilingUse:
    """How much of its ceiling a job has used, and what is left of it."""

    used_fraction: Decimal  # 0 to 1; of the nearer ceiling when a job has both
    amount_left: Decimal | None  # of a money ceiling, in currency
    gpu_hours_left: Decimal | None  # of a GPU-hours ceiling

    @property
    def used_percent(self):
        return int(self.used_fraction * 100)


def ceiling_use(ceiling_amount, ceiling_gpu_hours, billed, gpu_seconds):
    """Meter arithmetic, pure: a job's use of its ceiling from what it was billed (credits taken
    off) and the GPU-seconds it held (credited time given back, as the scheduler gives it back
    to a requeued job). None without a ceiling. What is left and the fraction are rounded down:
    never more left than there is."""
    fractions, amount_left, gpu_hours_left = [], None, None
    if ceiling_amount is not None:
        ceiling, used = Decimal(ceiling_amount), Decimal(billed)
        amount_left = max(Decimal(0), ceiling - used).quantize(AMOUNT_PLACES, rounding=ROUND_FLOOR)
        fractions.append(used / ceiling if ceiling > 0 else Decimal(1))
    if ceiling_gpu_hours is not None:
        ceiling, used = Decimal(ceiling_gpu_hours), Decimal(gpu_seconds) / SECONDS_PER_HOUR
        gpu_hours_left = max(Decimal(0), ceiling - used).quantize(GPU_HOUR_PLACES, rounding=ROUND_FLOOR)
        fractions.append(used / ceiling if ceiling > 0 else Decimal(1))
    if not fractions:
        return None
    fraction = min(Decimal(1), max(Decimal(0), *fractions))
    return CeilingUse(fraction.quantize(FRACTION_PLACES, rounding=ROUND_FLOOR), amount_left, gpu_hours_left)


def job_ceiling(job, now=None, credits=None, allocations=None):
    """ceiling_use for a job as it stands, live for an allocation still held. credits (with
    their usage records) and allocations: the job's, where the caller has them (a list's
    prefetch, jobs.serializers)."""
    if job.ceiling_amount is None and job.ceiling_gpu_hours is None:
        return None
    now = now or timezone.now()
    billed, gpu_seconds = Decimal(0), 0
    for allocation in job.allocations.all() if allocations is None else allocations:
        seconds, amount = allocation.meter(now)
        billed += amount
        gpu_seconds += allocation.gpus * seconds
    for credit in job.credits.select_related("usage") if credits is None else credits:
        billed -= credit.amount
        gpu_seconds -= credit.usage.gpus * credit.seconds
    return ceiling_use(job.ceiling_amount, job.ceiling_gpu_hours, billed, gpu_seconds)
