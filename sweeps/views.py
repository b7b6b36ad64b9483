"""The sweep pages: the team's sweeps, and one sweep with its trials (refreshed while it runs),
the best so far, its spend against its ceiling, and its objective against each parameter."""

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.shortcuts import redirect, render
from django.views.decorators.http import require_GET, require_POST

from accounts.access import get_for_team, require_team
from sweeps import chart
from sweeps import services as sweeps
from sweeps.models import Sweep


def sweep_context(sweep):
    seen = sweeps.summary(sweep)
    trials = [row.trial for row in seen.rows]
    return {
        "sweep": sweep,
        "rows": [(row.trial, row.held_seconds, row.cost) for row in seen.rows],
        "best": seen.best.trial if seen.best else None,
        "spent": seen.spent,
        "committed": seen.committed,
        "spent_percent": min(100, int(seen.spent * 100 / sweep.ceiling_amount)) if sweep.ceiling_amount else 0,
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
    sweep = get_for_team(sweeps.with_trials(Sweep.objects.select_related("template")), request.user, pk=sweep_id)
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
