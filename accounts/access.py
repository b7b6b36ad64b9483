"""Permission helpers: every view, API call, websocket and download goes through one.

Another team's object is a 404, never a 403: its existence is not revealed.
"""

from django.http import Http404

from accounts.models import Membership


def team_of(user):
    """The user's team, or None for anonymous users and users without a team."""
    if user is None or not user.is_authenticated:
        return None
    try:
        return user.membership.team
    except Membership.DoesNotExist:
        return None


def is_owner(user):
    """Whether the user is their team's owner (who alone changes budgets, webhooks, datasets'
    credentials, deletes datasets and reads the audit log)."""
    return getattr(getattr(user, "membership", None), "role", None) == Membership.OWNER


def require_team(user):
    team = team_of(user)
    if team is None:
        raise Http404("You are not on a team.")
    return team


def get_for_team(queryset, user, **lookup):
    """The object of the user's team matching lookup, or Http404."""
    team = require_team(user)
    try:
        return queryset.get(team=team, **lookup)
    except (queryset.model.DoesNotExist, ValueError, TypeError):
        # ValueError/TypeError: a malformed id (not a UUID) is just as absent.
        raise Http404(f"No such {queryset.model._meta.verbose_name}.") from None
