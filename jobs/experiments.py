"""Experiments: the runs of one experiment side by side, and what each improvement cost.

Every job belongs to an experiment (Job.experiment: by default its name; a sweep's trials, the
sweep's name; a retraining or a run again, its source's). The comparison is a pure function over
plain runs (tested without a database); runs_of() reads them from the database for the page.

Cost per unit of improvement: what a run cost, divided by how much better its metric is than the
experiment's first run's (lower for a metric that is better lower). A run no better than the
first has none: it bought nothing on that metric.
"""

import math
from dataclasses import dataclass, field
from decimal import ROUND_HALF_UP, Decimal

from django.db.models import Count, Max, OuterRef, Subquery
from django.utils import timezone

from jobs.metrics import best_mode, series_from_events, summarize
from jobs.models import Job, JobEvent


@dataclass(frozen=True)
class Run:
    """One job of an experiment as the comparison needs it."""

    id: str
    name: str
    state: str
    params: dict = field(default_factory=dict)  # hyperparameters and config keys: {name: value}
    metrics: dict = field(default_factory=dict)  # {metric: its last finite value}
    held_seconds: int = 0
    cost: Decimal = Decimal(0)


@dataclass(frozen=True)
class Row:
    run: Run
    value: float | None  # the chosen metric's last value
    improvement: float | None  # over the first run's, positive when better
    cost_per_unit: Decimal | None


def improvement(base, value, direction):
    """How much better value is than base ("min": lower is better), or None without both."""
    if base is None or value is None:
        return None
    return base - value if direction == "min" else value - base


def compare(runs, metric, direction):
    """[Row] in the runs' order, each measured against the first run's value of metric."""
    if not runs:
        return []
    base = runs[0].metrics.get(metric)
    rows = []
    for run in runs:
        value = run.metrics.get(metric)
        gain = improvement(base, value, direction)
        per_unit = (run.cost / Decimal(repr(gain))).quantize(Decimal("0.0001"), ROUND_HALF_UP) if gain and gain > 0 else None
        rows.append(Row(run, value, gain, per_unit))
    return rows


def default_metric(runs):
    """The metric most runs logged (one whose better direction its name tells first, then by
    name), or None when none logged any."""
    counts = {}
    for run in runs:
        for name in run.metrics:
            counts[name] = counts.get(name, 0) + 1
    if not counts:
        return None
    return min(counts, key=lambda name: (-counts[name], best_mode(name) is None, name))


def param_names(runs):
    """The parameters to show: those whose values differ between runs first, then the rest."""
    names = sorted({name for run in runs for name in run.params})
    differ = [n for n in names if len({repr(run.params.get(n)) for run in runs}) > 1]
    return differ + [n for n in names if n not in differ]


def flat_params(job):
    """A job's hyperparameters and config as one {name: value}: nested config keys as a.b."""
    found = dict(job.hyperparameters or {})

    def walk(prefix, value):
        if isinstance(value, dict) and value:
            for key, inner in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), inner)
        else:
            found.setdefault(prefix, value)

    walk("", job.config or {})
    found.pop("", None)
    return found


def last_values(events):
    """{metric: its last finite value} from a job's metric events (in order)."""
    summary = summarize(series_from_events(events))
    return {name: s["last"] for name, s in summary.items() if isinstance(s["last"], int | float) and math.isfinite(s["last"])}


def runs_of(team, experiment, now=None):
    """The experiment's jobs as Runs, oldest first: the first is what the others are measured
    against. Three queries whatever the number of runs."""
    now = now or timezone.now()
    jobs = list(Job.objects.filter(team=team, experiment=experiment).order_by("created_at").prefetch_related("allocations"))
    events = {}
    for event in JobEvent.objects.filter(job__in=jobs, kind="metric").order_by("seq").only("job_id", "data", "at", "seq"):
        events.setdefault(event.job_id, []).append({"data": event.data, "at": event.at, "seq": event.seq})
    runs = []
    for job in jobs:
        held, amount = job.held(now)
        runs.append(Run(str(job.pk), job.name, job.state, flat_params(job), last_values(events.get(job.pk, [])), held, amount))
    return jobs, runs


def experiments_of(team):
    """[{experiment, runs, latest, job}] of the team, the most recently run first; job: the
    latest run's id (an experiment's page is reached through one of its jobs)."""
    jobs = Job.objects.filter(team=team)
    newest = jobs.filter(experiment=OuterRef("experiment")).order_by("-created_at").values("pk")[:1]
    return list(jobs.values("experiment").annotate(runs=Count("id"), latest=Max("created_at"), job=Subquery(newest)).order_by("-latest"))
