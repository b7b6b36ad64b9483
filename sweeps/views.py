"""The sweep pages: the team's sweeps, and one sweep with its trials (refreshed while it runs),
the best so far, its spend against its ceiling, and its objective against each parameter."""

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.db.models import Count
from django.shortcuts import redirect, render
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from accounts.access import get_for_team, require_team
from sweeps import chart
from sweeps import services as sweeps
from sweeps.forms import EXAMPLE_SPACE, SweepForm
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
    found = Sweep.objects.filter(team=team).select_related("template").annotate(trial_count=Count("trials"))
    return render(request, "sweeps/list.html", {"sweeps": found})


@login_required
@require_http_methods(["GET", "POST"])
def sweep_new(request):
    """The form; a job's page links here with ?template=<its id>. A refused form keeps what was
    written and says why, beside the field."""
    team = require_team(request.user)
    if request.method == "GET":
        form = SweepForm(team, initial={"template": request.GET.get("template"), "space": EXAMPLE_SPACE})
        return render(request, "sweeps/new.html", {"form": form})
    form = SweepForm(team, request.POST)
    if form.is_valid():
        data = form.cleaned_data
        try:
            sweep = sweeps.create(
                team, request.user, name=data["name"], template=data["template"], space=data["space"], method=data["method"],
                objective=data["objective"], direction=data["direction"], max_trials=data["max_trials"], parallel=data["parallel"],
                ceiling_amount=data["ceiling"], prune=data["prune"],
            )  # fmt: skip
        except sweeps.SweepError as error:
            form.add_error(None, str(error))
        else:
            messages.success(request, f"Sweep {sweep.name} started: its first trials queue at the scheduler's next turn.")
            return redirect("sweeps:detail", sweep.pk)
    return render(request, "sweeps/new.html", {"form": form}, status=400)


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
