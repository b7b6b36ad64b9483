"""Monthly team budgets: pure functions over plain data, no database.

A team may set a monthly budget. A job starts only if its worst case fits in what the budget
leaves this month, counting what the month has billed already (released usage, less credits)
and the worst case of the allocations still running (what they may still spend: each one's
cost cap, or its limit at its rate), so two jobs cannot both squeeze under it.
"""

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from decimal import Decimal

from billing import meter

WARNING_PERCENT = 80
ZERO = Decimal(0)


def worst_case(gpus: int, rate_per_gpu_hour: Decimal, limit_seconds: int | None = None, cost_cap: Decimal | None = None) -> Decimal | None:
    """The most an allocation (or a job still to be placed) may cost: its held-time limit x GPUs
    x rate, never more than its cost cap. None when nothing bounds it."""
    amounts: list[Decimal] = []
    if limit_seconds is not None:
        amounts.append(meter.charge(gpus, limit_seconds, rate_per_gpu_hour))
    if cost_cap is not None:
        amounts.append(Decimal(cost_cap))
    return min(amounts) if amounts else None


@dataclass(frozen=True)
class Spend:
    """A team's spend in a month."""

    released: Decimal = ZERO  # billed by released usage (amount less credits)
    running_so_far: Decimal = ZERO  # what the allocations running now have cost so far
    running_worst_case: Decimal = ZERO  # the most the allocations running now may cost in all

    @property
    def so_far(self) -> Decimal:
        """What the month has cost so far, running jobs included (the billing page's figure)."""
        return self.released + self.running_so_far

    @property
    def committed(self) -> Decimal:
        """What the month may cost at most with what runs now (the scheduler's figure)."""
        return self.released + max(self.running_worst_case, self.running_so_far)


@dataclass(frozen=True)
class Candidate:
    """A job the scheduler would start: its team and its worst case (None: unbounded)."""

    job_id: str
    team: str
    worst_case: Decimal | None


def format_money(amount: Decimal, currency: str) -> str:
    return f"{currency} {meter.round_money(amount):,}"


def hold_back(
    candidates: Iterable[Candidate],
    budgets: Mapping[str, Decimal | None],
    spends: Mapping[str, Spend],
    currency: str = "USD",
    cumulative: bool = True,
) -> dict[str, str]:
    """{job id: reason} for the candidates that must not start: their worst case would take
    their team's month past its budget. budgets: {team: Decimal or None}; spends: {team: Spend}.

    cumulative: candidates are taken in order and each one allowed adds its worst case to its
    team's spend, so jobs started in the same cycle cannot together overrun the budget."""
    committed: dict[str, Decimal] = {}
    held: dict[str, str] = {}
    for candidate in candidates:
        budget = budgets.get(candidate.team)
        if budget is None:
            continue
        budget = Decimal(budget)
        spent = committed.get(candidate.team)
        if spent is None:
            spent = spends.get(candidate.team, Spend()).committed
        if candidate.worst_case is None:
            held[candidate.job_id] = (
                f"held back: it has no span or ceiling, so its worst case has no bound, and the team has a budget of {format_money(budget, currency)} a month"
            )
            continue
        total = spent + candidate.worst_case
        if total > budget:
            held[candidate.job_id] = (
                f"held back: its worst case of {format_money(candidate.worst_case, currency)} would take this month's "
                f"spend to {format_money(total, currency)}, past the team's budget of {format_money(budget, currency)}"
            )
            continue
        if cumulative:
            committed[candidate.team] = total
    return held


@dataclass(frozen=True)
class Status:
    """Where a team stands against its budget, for the billing page and the API."""

    budget: Decimal | None
    spent: Decimal  # so far this month, running jobs' cost so far included
    committed: Decimal  # with the running jobs' worst case

    @property
    def percent(self) -> int | None:
        """Of the budget spent so far, in whole percent (None without a budget)."""
        if self.budget is None:
            return None
        if self.budget <= 0:
            return 100  # a zero budget: nothing may start
        return int(self.spent * 100 / self.budget)

    @property
    def level(self) -> str:
        """'' (no budget or under 80%), 'warning' (80% or more), 'over' (100% or more)."""
        percent = self.percent
        if percent is None:
            return ""
        if percent >= 100:
            return "over"
        if percent >= WARNING_PERCENT:
            return "warning"
        return ""

    @property
    def remaining(self) -> Decimal | None:
        """What the budget leaves for new jobs: less what is spent and what running jobs may still cost."""
        if self.budget is None:
            return None
        return max(ZERO, self.budget - self.committed)

    @property
    def bar_percent(self) -> int | None:
        return None if self.percent is None else min(100, self.percent)


def status(budget: Decimal | None, spend: Spend) -> Status:
    return Status(budget=None if budget is None else Decimal(budget), spent=spend.so_far, committed=spend.committed)
