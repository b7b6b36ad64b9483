"""What a run the network stops early on its metric gets back, in the words both sides use.

For a script, the runner returns the checkpoint taken at the metric's best step (or the latest
kept before it) and keeps the job's own output under last/ (agent/running.py); a built-in
recipe does the same itself (e31/recipes/common.py), writing the best weights as its usual
output (beside recipe.json, LoRA merged), since a bare checkpoint lacks what a retraining and a
comparison need. Both name the weights in the log and in metrics.json in the words below.

How the recipe learns it: the runner sets $E31_EARLY_STOP_METRIC and $E31_EARLY_STOP_MODE for
a job whose metric it watches, and its stop notice ($E31_STOP_FILE) holds, for a stop on that
metric, {"early_stop": early_stop_notice(...)}. A stop for any other reason (a cancel, the
ceiling, a preemption) carries none.

Standard library only: the runner and the job's own Python both import it.
"""

import math
from collections.abc import Iterable
from typing import Any

LAST = "last/"
MODES = ("min", "max")

# A metric's best point: (step, value); the step is None for a value logged without one.
Point = tuple[int | None, float]


def better(value: float, best: float, mode: str) -> bool:
    """True when value beats best in mode ("min": lower is better, "max": higher)."""
    return value > best if mode == "max" else value < best


def _finite(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def track(best: Point | None, step: int | None, value: object, mode: str) -> Point | None:
    """The best (step, value) after one more point: best, or (step, value) when value is a
    finite number that beats it (the first of equal ones stays, as the network counts)."""
    value = _finite(value)
    if value is None:
        return best
    if best is None or better(value, best[1], mode):
        return (step, value)
    return best


def better_of(one: Point | None, other: Point | None, mode: str) -> Point | None:
    """Of two best points (step, value) (either may be None), the better; of equal values,
    the earlier step."""
    if one is None or other is None:
        return one if other is None else other
    if better(other[1], one[1], mode):
        return other
    if better(one[1], other[1], mode):
        return one
    if other[0] is not None and (one[0] is None or other[0] < one[0]):
        return other
    return one


def at_or_before(steps: Iterable[int | None], step: int | None) -> int | None:
    """Of checkpoint steps, the one holding the weights of `step`, else the nearest before it;
    None when there is none (or step is None)."""
    if step is None:
        return None
    return max((s for s in steps if s is not None and s <= step), default=None)


def early_stop_notice(metric: str, mode: str, best: Point | None) -> dict[str, Any]:
    """What the stop notice holds for a stop on the job's metric: the metric, its mode and its
    best point so far ((step, value); None when it has none)."""
    step, value = best if best is not None else (None, None)
    return {"metric": metric, "mode": mode, "best": value, "best_step": step}


def early_stop_of(notice: object) -> tuple[str, str, Point | None] | None:
    """(metric, mode, best (step, value) or None) when the stop notice (a dict, as the SDK's
    stop_notice() gives it) says the network stopped the job early on its metric; None for a
    stop for any other reason, or a notice that does not read right."""
    if not isinstance(notice, dict) or not isinstance(notice.get("early_stop"), dict):
        return None
    found = notice["early_stop"]
    metric, mode, step, value = found.get("metric"), found.get("mode"), found.get("best_step"), _finite(found.get("best"))
    if not isinstance(metric, str) or not metric or mode not in MODES:
        return None
    if isinstance(step, bool) or not (step is None or isinstance(step, int)):
        step = None
    return metric, mode, (step, value) if value is not None else None


def returned_message(metric: str, best: Point, checkpoint_name: str, checkpoint_step: int, last_step: int | None = None, last_kept: bool = True) -> str:
    """The log's line for the weights returned. best: (step, value) of the metric's best point;
    last_kept: the job left output files of its own (kept under last/)."""
    best_step, value = best
    where = f"the best {metric} ({value:.6g}, at step {best_step})"
    if checkpoint_step == best_step:
        what = f"the weights returned are those of {where}: checkpoint {checkpoint_name}"
    else:
        what = f"the weights returned are those of step {checkpoint_step} (checkpoint {checkpoint_name}), the latest kept at or before {where}"
    if not last_kept:
        return f"{what}; the job left no output files of its own"
    last = f" (its last metric point: step {last_step})" if last_step is not None else ""
    return f"{what}; the job's own output, as it was when it stopped{last}, is kept under {LAST}"


def unmatched_message(metric: str, best: Point, own_output: bool = True) -> str:
    """The log's line when no checkpoint holds the best point's weights, nor any before it.
    own_output: the job left output files of its own (returned as they are)."""
    best_step, value = best
    if best_step is None:
        why = f"the best {metric} ({value:.6g}) was logged without a step, so no checkpoint can be matched to it"
    else:
        why = f"no checkpoint at or before step {best_step}, where {metric} was best ({value:.6g}), was kept"
    if not own_output:
        return f"{why}: the best weights cannot be returned, and the job left no output files of its own"
    return f"{why}: the best weights cannot be returned; the job's own output, as it was when it stopped, is returned instead"


def best_report(
    metric: str, mode: str, best: Point, checkpoint_name: str, checkpoint_step: int, values: dict[str, Any], last_step: int | None = None
) -> dict[str, Any]:
    """metrics.json of a job stopped early on its metric: which weights came back and why, and
    the values the job logged at their step (as logged; {} when it logged none there)."""
    return {
        "early_stop": {
            "metric": metric,
            "mode": mode,
            "best": best[1],
            "best_step": best[0],
            "weights": checkpoint_name,
            "weights_step": checkpoint_step,
            "last": LAST,
            "last_step": last_step,
        },
        "metrics": values,
    }
