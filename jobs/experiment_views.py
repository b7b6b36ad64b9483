"""The experiment pages: the team's experiments, and one experiment's runs side by side
(parameters, final metrics, held time, cost, and what each improvement over the first run cost)."""

from django.conf import settings
from django.contrib.auth.decorators import login_required
from django.shortcuts import render
from django.views.decorators.http import require_GET

from accounts.access import require_team
from jobs import experiments
from jobs.access import get_job
from jobs.metrics import best_mode


@login_required
@require_GET
def experiment_list(request):
    team = require_team(request.user)
    return render(request, "jobs/experiments.html", {"experiments": experiments.experiments_of(team)})


@login_required
@require_GET
def experiment_detail(request, job_id):
    """The experiment of one of the team's jobs (named by the job, so that no URL names an
    experiment to guess). ?metric= and ?direction= choose what improvement means (by default the
    metric most runs logged, better the way its name says, else lower)."""
    team = require_team(request.user)
    experiment = get_job(request, job_id).experiment
    _, runs = experiments.runs_of(team, experiment)
    metrics = sorted({name for run in runs for name in run.metrics})
    metric = request.GET.get("metric")
    if metric not in metrics:
        metric = experiments.default_metric(runs)
    chosen = request.GET.get("direction") if request.GET.get("direction") in ("min", "max") else ""
    direction = chosen or (best_mode(metric) if metric else None) or "min"
    rows = experiments.compare(runs, metric, direction) if metric else [experiments.Row(run, None, None, None) for run in runs]
    return render(
        request,
        "jobs/experiment.html",
        {
            "experiment": experiment,
            "rows": rows,
            "params": experiments.param_names(runs),
            "metrics": metrics,
            "metric": metric,
            "direction": direction,
            "chosen_direction": chosen,
            "currency": settings.E31_CURRENCY,
        },
    )
