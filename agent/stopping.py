"""When a run should stop on its own: early stopping and dead (NaN) losses.

Pure functions over plain metric points, no database: the runner feeds each point a job
logs, in order, and stops the job when a check says so; and, for a job stopped early on its
metric, says which weights come back (those of its best step) and in what words.
"""

import math
from dataclasses import dataclass, field

# What a job stopped early on its metric gets back: the checkpoint at its best step (or the
# latest kept before it), its own output beside it under last/. The runner carries this out for
# a script; a recipe does it itself (e31/recipes/common.py). The words both use are e31.best's,
# which the job's own Python imports too.
from e31.best import (  # noqa: F401
    LAST,
    best_report,
    early_stop_notice,
    returned_message,
    unmatched_message,
)

NON_FINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def as_number(value):
    """A metric value as a float: numbers, and the strings the SDK writes for non-finite ones.
    None for anything else."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        return NON_FINITE.get(value)
    return None


def as_stored(value):
    """A metric value as it is stored (JSON that every database takes): a finite float, or the
    SDK's string for a non-finite one. None for anything that is not a number."""
    number = as_number(value)
    if number is None or math.isfinite(number):
        return number
    if math.isnan(number):
        return "NaN"
    return "Infinity" if number > 0 else "-Infinity"


def is_loss(name):
    return "loss" in name.lower()


@dataclass(frozen=True)
class Verdict:
    failed: bool  # True: the run is dead (a NaN loss); False: it is done (early stopping)
    message: str


@dataclass
class Watch:
    """Follows a job's metric points and says when to stop it.

    metric/mode/patience: early stopping, when `metric` has not improved (lower is better for
    "min", higher for "max") for `patience` evaluations in a row. stop_on_nan: a loss (any
    series whose name holds "loss") that becomes NaN or infinite ends the run.

    A job resumed from a checkpoint logs some steps again: a point at or before the last step
    seen rewinds the history to before it, so repeated steps are not counted twice."""

    metric: str = ""
    mode: str = "min"
    patience: int | None = None
    stop_on_nan: bool = True
    history: list = field(default_factory=list)  # [(step, value)] of `metric`

    def add(self, step, values):
        """Take one point (step may be None); returns a Verdict when the job should stop."""
        if self.stop_on_nan:
            for name, raw in values.items():
                value = as_number(raw)
                if value is not None and is_loss(name) and not math.isfinite(value):
                    where = f" at step {step}" if step is not None else ""
                    shown = "NaN" if math.isnan(value) else ("infinite" if value > 0 else "-infinite")
                    return Verdict(True, f"the {name} became {shown}{where}: stopped so no more is spent on a dead run")
        if not self.metric or not self.patience or self.metric not in values:
            return None
        value = as_number(values[self.metric])
        if value is None or not math.isfinite(value):
            return None
        if step is not None and self.history and self.history[-1][0] is not None and step <= self.history[-1][0]:
            self.history = [(s, v) for s, v in self.history if s is not None and s < step]
        self.history.append((step, value))
        return self.verdict()

    def best(self):
        """(step, value) of the best point of `metric` so far (the first of equal ones), or None
        when early stopping is off or nothing has been logged. Safe to call from another thread
        (the runner's uploads ask it which checkpoint to keep)."""
        if not self.metric or not self.patience:
            return None
        history = self.history  # one list: the runner's loop may put a new one in its place
        index = self._best_index(history)
        return None if index is None else history[index]

    def _best_index(self, history):
        best_index = None
        for index, (_, value) in enumerate(history):
            if best_index is None or self._better(value, history[best_index][1]):
                best_index = index
        return best_index

    def verdict(self):
        best_index = self._best_index(self.history)
        since_best = len(self.history) - 1 - best_index
        if since_best < self.patience:
            return None
        best_step, best = self.history[best_index]
        at = f" at step {best_step}" if best_step is not None else ""
        return Verdict(
            False,
            f"stopped early: {self.metric} has not improved for {since_best} evaluations (best {best:.6g}{at})",
        )

    def _better(self, value, best):
        return value < best if self.mode == "min" else value > best
