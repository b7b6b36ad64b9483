"""Comparing two models on the same held-out examples: pure functions over the evaluation a
recipe writes (output/evaluation.json), no database.

    {"recipe": "classifier", "metric": "accuracy", "higher_is_better": true,
     "models": {"new": {"metrics": {...}, "per_example": [1.0, 0.0, ...]}, "previous": {...}}}

per_example is aligned across models (the same examples in the same order): 1/0 correctness for
a classifier (the test is McNemar's exact test on the examples the two models disagree on), a
loss per example or window for a language model (a paired t-test on the differences).
"""

import math
from dataclasses import dataclass, field

BETTER = "better"
WORSE = "worse"
NO_DIFFERENCE = "no significant difference"
ALPHA = 0.05


class EvaluationError(ValueError):
    pass


@dataclass(frozen=True)
class Verdict:
    verdict: str  # better / worse / no significant difference: of `new` against `previous`
    test: str
    p_value: float
    n: int
    metric: str
    higher_is_better: bool
    new: float  # the metric's mean per example
    previous: float
    detail: dict = field(default_factory=dict)

    @property
    def difference(self):
        return self.new - self.previous

    def as_dict(self):
        return {
            "verdict": self.verdict,
            "test": self.test,
            "p_value": self.p_value,
            "n": self.n,
            "metric": self.metric,
            "higher_is_better": self.higher_is_better,
            "new": self.new,
            "previous": self.previous,
            "difference": self.difference,
            "alpha": ALPHA,
            **self.detail,
        }


def _is_binary(values):
    return all(v in (0, 1, 0.0, 1.0) for v in values)


def mcnemar(new, previous):
    """McNemar's exact test: (p, examples only new got right, examples only previous got right)."""
    from scipy.stats import binomtest

    only_new = sum(1 for a, b in zip(new, previous) if a and not b)
    only_previous = sum(1 for a, b in zip(new, previous) if b and not a)
    discordant = only_new + only_previous
    p = 1.0 if discordant == 0 else float(binomtest(only_new, discordant, 0.5).pvalue)
    return p, only_new, only_previous


def paired_t(new, previous):
    """A paired t-test on the per-example differences: (p, t statistic)."""
    from scipy.stats import ttest_rel

    differences = [a - b for a, b in zip(new, previous)]
    if len(differences) < 2 or all(d == differences[0] for d in differences):
        # No spread: a constant nonzero difference is as significant as it gets, none is none.
        return (0.0 if differences and differences[0] != 0 and len(differences) >= 2 else 1.0), math.nan
    result = ttest_rel(new, previous)
    return float(result.pvalue), float(result.statistic)


def compare(evaluation, new="new", previous="previous", alpha=ALPHA):
    """The verdict on `new` against `previous` from an evaluation (see the module)."""
    models = evaluation.get("models") or {}
    missing = [label for label in (new, previous) if label not in models]
    if missing:
        raise EvaluationError(f"the evaluation has no model labelled {', '.join(missing)}")
    a = [float(v) for v in models[new].get("per_example") or []]
    b = [float(v) for v in models[previous].get("per_example") or []]
    if not a or len(a) != len(b):
        raise EvaluationError(f"the two models were not scored on the same examples ({len(a)} and {len(b)})")
    higher = bool(evaluation.get("higher_is_better", True))
    metric = evaluation.get("metric") or "score"
    if _is_binary(a) and _is_binary(b):
        p, only_new, only_previous = mcnemar(a, b)
        test, detail = "McNemar's exact test", {"only_new_right": only_new, "only_previous_right": only_previous}
    else:
        p, t = paired_t(a, b)
        test, detail = "paired t-test", {"t": None if math.isnan(t) else t}
    mean_a, mean_b = sum(a) / len(a), sum(b) / len(b)
    if p < alpha and mean_a != mean_b:
        verdict = BETTER if (mean_a > mean_b) == higher else WORSE
    else:
        verdict = NO_DIFFERENCE
    return Verdict(verdict=verdict, test=test, p_value=p, n=len(a), metric=metric, higher_is_better=higher, new=mean_a, previous=mean_b, detail=detail)


def table(evaluation):
    """Side by side: [(metric, {label: value})] over every metric any model has, sorted."""
    models = evaluation.get("models") or {}
    names = sorted({name for m in models.values() for name in (m.get("metrics") or {})})
    return [(name, {label: (m.get("metrics") or {}).get(name) for label, m in models.items()}) for name in names]
