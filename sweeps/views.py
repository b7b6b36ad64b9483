"""The sweep pages: the team's sweeps, and one sweep with its trials (refreshed while it runs),
the best so far, its spend against its ceiling, and its objective against each parameter."""

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.shortcuts import redirect, render
from django.utils import timezone
from django.views.decorators.http import require_GET, require_POST

from accounts.access import get_for_team, require_team
from sweeps import ceiling, chart
from sweeps import services as sweeps
from sweeps.models import Sweep


def sweep_context(sweep):
    now = timezone.now()
    trials = list(sweep.trials.select_related("job").prefetch_related("job__allocations"))
    costs = sweeps.costs(trials, now)
    rows = [(trial, trial.job.held(now)[0], cost.spent) for trial, cost in zip(trials, costs, strict=True)]
    spent, committed = ceiling.spent(costs), ceiling.committed(costs)
    best = sweeps.best(sweep)
    return {
        "sweep": sweep,
        "rows": rows,
        "best": best,
        "spent": spent,
        "committed": committed,
        "spent_percent": min(100, int(spent * 100 / sweep.ceiling_amount)) if sweep.ceiling_amount else 0,
        "charts": chart.charts(sweep.space, [(t.params, t.value) for t in trials if t.state in ("complete", "pruned")], sweep.direction),
        "running": sweep.state == Sweep.RUNNING,
    }


@login_required
@require_GET
def sweep_list(request):
    team = require_team(request.user)
    return render(request, "sweeps/list.html", {"sweeps": Sweep.objects.filter(team=team).select_related("template")})


@login_required
@require_GET
def sweep_detail(request, sweep_id):
    sweep = get_for_team(Sweep.objects.select_related("template"), request.user, pk=sweep_id)
    template = "sweeps/_body.html" if request.headers.get("HX-Request") else "sweeps/detail.html"
    return render(request, template, sweep_context(sweep))


@login_required
@require_POST
def sweep_rerun(request, sweep_id):
    """The best trial's configuration as a job of its own; to its page."""
    sweep = get_for_team(Sweep.objects.select_related("template"), request.user, pk=sweep_id)
    try:
        job = sweeps.run_best_again(sweep, request.user)
    except sweeps.SweepError as error:
        messages.error(request, f"Nothing to run again: {error}.")
        return redirect("sweeps:detail", sweep.pk)
    messages.success(request, f"The best configuration of {sweep.name} is queued as a job of its own.")
    return redirect("jobs:detail", job.pk)
