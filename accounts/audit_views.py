"""The team's audit log for its owner: a page (/accounts/audit/) and the API (/api/audit/).
Members get a 403; everyone sees only their own team's events."""

from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.core.paginator import Paginator
from django.shortcuts import render
from django.views.decorators.http import require_GET
from rest_framework import exceptions
from rest_framework.decorators import api_view

from accounts.access import is_owner, require_team
from accounts.models import AuditEvent
from core.api import paginate

PAGE_SIZE = 100
ACTIONS = dict(AuditEvent.ACTIONS)
OWNERS_ONLY = "Only the team's owner can read its audit log."


def team_events(team, action=""):
    """The team's events, newest first; only one action's when given."""
    events = AuditEvent.objects.filter(team=team).select_related("user").order_by("-at", "-id")
    return events.filter(action=action) if action else events


def event_json(event):
    return {
        "id": event.pk,
        "at": event.at,
        "user": event.user.get_username() if event.user_id else None,
        "actor": event.actor,
        "action": event.action,
        "object_type": event.object_type,
        "object_id": event.object_id,
        "label": event.label,
        "via": event.via,
        "ip": event.ip,
    }


@login_required
@require_GET
def audit_page(request):
    team = require_team(request.user)
    if not is_owner(request.user):
        raise PermissionDenied(OWNERS_ONLY)
    action = request.GET.get("action", "")
    if action not in ACTIONS:
        action = ""
    page = Paginator(team_events(team, action), PAGE_SIZE).get_page(request.GET.get("page"))
    return render(request, "accounts/audit.html", {"page": page, "events": page.object_list, "action": action, "actions": AuditEvent.ACTIONS})


@api_view(["GET"])
def api_audit(request):
    """The team's audit log, newest first, paged (?page=N&page_size=M); ?action= one action's
    events. The team's owner only."""

    team = require_team(request.user)
    if not is_owner(request.user):
        raise exceptions.PermissionDenied(OWNERS_ONLY)
    action = request.query_params.get("action", "")
    if action and action not in ACTIONS:
        raise exceptions.ValidationError({"action": [f"{action!r} is not an action; one of {', '.join(ACTIONS)}."]})
    return paginate(request, team_events(team, action), event_json, default_size=100, max_size=500)
