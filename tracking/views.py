"""The team's experiment tracker: members see it and how its deliveries go; only owners change it."""

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.db import transaction
from django.shortcuts import redirect, render
from django.views.decorators.http import require_http_methods, require_POST

from accounts.access import is_owner, require_team
from tracking.forms import TrackerForm
from tracking.models import TrackedRun, Tracker

OWNERS_ONLY = "Only the team's owners change its experiment tracker."


def require_owner(user):
    require_team(user)
    if not is_owner(user):
        raise PermissionDenied(OWNERS_ONLY)


@login_required
@require_http_methods(["GET", "POST"])
def tracker_settings(request):
    """The tracker and its deliveries; an owner's POST registers or changes it."""
    team = require_team(request.user)
    tracker = Tracker.objects.filter(team=team).first()
    initial = {"url": tracker.url, "enabled": tracker.enabled} if tracker else {"enabled": True}
    if request.method == "POST":
        require_owner(request.user)
    form = TrackerForm(request.POST or None, initial=initial)
    if request.method == "POST" and form.is_valid():
        tracker = save(request, team, tracker, form.cleaned_data)
        messages.success(request, f"Experiment tracker saved: jobs go to {tracker.url} as MLflow runs.")
        return redirect("tracking:tracker")
    runs = TrackedRun.objects.filter(tracker=tracker).select_related("job").order_by("-created_at")[:20] if tracker else []
    pending = TrackedRun.objects.filter(tracker=tracker, finished_sent=False).count() if tracker else 0
    context = {"tracker": tracker, "form": form, "runs": runs, "pending": pending, "can_change": is_owner(request.user)}
    return render(request, "tracking/tracker.html", context, status=400 if form.errors else 200)


def save(request, team, tracker, data):
    with transaction.atomic():
        if tracker is None:
            tracker = Tracker(team=team, created_by=request.user)
        elif tracker.url != data["url"]:
            # Another server: its runs start over there (a run already there is found by its
            # e31.job_id tag and checked point by point, so a URL that names the same server
            # doubles nothing).
            TrackedRun.objects.filter(tracker=tracker).delete()
        tracker.url, tracker.enabled = data["url"], data["enabled"]
        if data["token"]:
            tracker.set_token(data["token"])
        elif data["clear_token"]:
            tracker.set_token("")
        tracker.last_error = ""
        tracker.save()
    return tracker


@login_required
@require_POST
def tracker_remove(request):
    require_owner(request.user)
    team = require_team(request.user)
    tracker = Tracker.objects.filter(team=team).first()
    if tracker is not None:
        tracker.delete()
        messages.success(request, f"Experiment tracker {tracker.url} removed: jobs are no longer sent there.")
    return redirect("tracking:tracker")
