"""A sweep's money ceiling: pure arithmetic, no Django.

A trial may start only while what the sweep has spent, plus the worst case of its trials still
running, plus the new trial's own worst case stays within the sweep's ceiling. Each trial runs
under a money ceiling of its own (its worst case, which the meter enforces: it is stopped
gracefully there, its weights kept), so the sweep's bill can never pass its ceiling.
"""

from dataclasses import dataclass
from decimal import Decimal


@dataclass(frozen=True)
class TrialCost:
    spent: Decimal  # billed so far (live for one still holding compute)
    worst: Decimal  # the most it may cost in all (its own ceiling)
    running: bool  # queued or running: it may still spend


def committed(trials: list[TrialCost]) -> Decimal:
    """What the sweep has spent, plus what its running trials may still spend."""
    total = Decimal(0)
    for trial in trials:
        total += max(trial.spent, trial.worst) if trial.running else trial.spent
    return total


def may_start(trials: list[TrialCost], trial_worst: Decimal, ceiling: Decimal) -> bool:
    """Whether one more trial, whose worst case is trial_worst, fits under the ceiling."""
    return committed(trials) + trial_worst <= ceiling


def spent(trials: list[TrialCost]) -> Decimal:
    return sum((t.spent for t in trials), Decimal(0))
