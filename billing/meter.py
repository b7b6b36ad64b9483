"""Meter arithmetic: pure functions over plain numbers, no database.

The meter runs while compute is held. Billing is per second: the held time of an allocation is
counted in whole seconds, a partial last second is not charged. Money is Decimal throughout;
amounts keep 8 decimal places here and are rounded once, per invoice line, elsewhere.
"""

import math
from dataclasses import dataclass
from datetime import datetime
from decimal import ROUND_HALF_EVEN, Decimal

SECONDS_PER_HOUR = 3600
# Beyond this a limit means "unbounded" (a hundred years), and stays a storable number.
MAX_HELD_SECONDS = 100 * 365 * 24 * SECONDS_PER_HOUR
AMOUNT_PLACES = Decimal("0.00000001")
CENTS = Decimal("0.01")


def held_seconds(started_at: datetime, ended_at: datetime) -> int:
    """Whole seconds between two datetimes (never negative)."""
    return max(0, math.floor((ended_at - started_at).total_seconds()))


def charge(gpus: int, seconds: int, rate_per_gpu_hour: Decimal, cap: Decimal | None = None) -> Decimal:
    """GPUs x held seconds x rate (per GPU-hour); never more than cap when a cap is given."""
    amount = Decimal(gpus * seconds) * Decimal(rate_per_gpu_hour) / SECONDS_PER_HOUR
    amount = amount.quantize(AMOUNT_PLACES, rounding=ROUND_HALF_EVEN)
    if cap is not None and amount > cap:
        return Decimal(cap).quantize(AMOUNT_PLACES)
    return amount


def round_money(amount: Decimal) -> Decimal:
    """Round once, half-even, to the currency's minor unit."""
    return Decimal(amount).quantize(CENTS, rounding=ROUND_HALF_EVEN)


def seconds_for_money(amount: Decimal, gpus: int, rate_per_gpu_hour: Decimal) -> int | None:
    """The most whole seconds of gpus that amount pays for at the rate."""
    rate = Decimal(rate_per_gpu_hour)
    if rate <= 0:
        return None
    return math.floor(Decimal(amount) * SECONDS_PER_HOUR / (gpus * rate))


@dataclass(frozen=True)
class Request:
    """The compute request of a job, as the meter sees it."""

    gpus: int
    span_hours: Decimal | None = None  # a fixed span
    ceiling_amount: Decimal | None = None  # "until done", capped by money
    ceiling_gpu_hours: Decimal | None = None  # "until done", capped by GPU-hours


def held_limit_seconds(request: Request, rate_per_gpu_hour: Decimal) -> int | None:
    """How long compute may be held for the request at the rate; None when unbounded."""
    limits = []
    if request.span_hours is not None:
        limits.append(math.floor(Decimal(request.span_hours) * SECONDS_PER_HOUR))
    if request.ceiling_gpu_hours is not None:
        limits.append(math.floor(Decimal(request.ceiling_gpu_hours) * SECONDS_PER_HOUR / request.gpus))
    if request.ceiling_amount is not None:
        seconds = seconds_for_money(request.ceiling_amount, request.gpus, rate_per_gpu_hour)
        if seconds is not None:
            limits.append(seconds)
    return min(limits) if limits else None


def remaining_allowance(
    request: Request, rate_per_gpu_hour: Decimal, held_before: int = 0, spent_before: Decimal = Decimal(0)
) -> tuple[int | None, Decimal | None]:
    """(held seconds, money) a new allocation may use after earlier ones held held_before
    seconds and were billed spent_before (credits already taken off); None where unbounded."""
    limit = held_limit_seconds(request, rate_per_gpu_hour)
    cap = cost_cap(request, rate_per_gpu_hour)
    if limit is not None:
        limit = min(max(0, limit - held_before), MAX_HELD_SECONDS)
    if cap is not None:
        cap = max(Decimal(0), Decimal(cap) - Decimal(spent_before))
    return limit, cap


def cost_cap(request: Request, rate_per_gpu_hour: Decimal) -> Decimal | None:
    """The most the job may be billed: its money ceiling, or what its GPU-hour ceiling costs."""
    caps = []
    if request.ceiling_amount is not None:
        caps.append(Decimal(request.ceiling_amount))
    if request.ceiling_gpu_hours is not None:
        caps.append(Decimal(request.ceiling_gpu_hours) * Decimal(rate_per_gpu_hour))
    return min(caps) if caps else None


@dataclass(frozen=True)
class Estimate:
    amount: Decimal  # the most the request can cost
    hours: Decimal  # wall-clock hours of compute it buys
    gpu_hours: Decimal


def estimate(request: Request, rate_per_gpu_hour: Decimal) -> Estimate:
    """What a request costs at most: span x GPUs x rate, or the ceiling for "until done"."""
    rate = Decimal(rate_per_gpu_hour)
    gpus = Decimal(request.gpus)
    if request.span_hours is not None:
        hours = Decimal(request.span_hours)
        return Estimate(amount=gpus * hours * rate, hours=hours, gpu_hours=gpus * hours)
    if request.ceiling_gpu_hours is not None:
        gpu_hours = Decimal(request.ceiling_gpu_hours)
        return Estimate(amount=gpu_hours * rate, hours=gpu_hours / gpus, gpu_hours=gpu_hours)
    if request.ceiling_amount is not None:
        amount = Decimal(request.ceiling_amount)
        gpu_hours = amount / rate if rate > 0 else Decimal(0)
        return Estimate(amount=amount, hours=gpu_hours / gpus, gpu_hours=gpu_hours)
    raise ValueError("a request needs a span or a ceiling")


def lost_time_credit(
    gpus: int,
    rate_per_gpu_hour: Decimal,
    started_at: datetime,
    ended_at: datetime,
    last_checkpoint_at: datetime | None,
    charged: Decimal,
) -> tuple[int, Decimal]:
    """What the network owes back when it took a job's compute away (node lost, preempted):
    the held time since the job's last checkpoint in this allocation (all of it when the
    allocation saved none), at the allocation's rate, never more than was charged.
    Returns (seconds, amount)."""
    since = started_at
    if last_checkpoint_at is not None and last_checkpoint_at > started_at:
        since = min(last_checkpoint_at, ended_at)
    seconds = held_seconds(since, ended_at)
    amount = min(charge(gpus, seconds, rate_per_gpu_hour), Decimal(charged))
    return seconds, amount.quantize(AMOUNT_PLACES)
