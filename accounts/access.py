"""Permission helpers: every view, API call, websocket and download goes through one.

Another team's object is a 404, never a 403: its existence is not revealed.
"""

from django.core.exceptions import ValidationError
from django.http import Http404

from accounts.models import Membership


def membership_of(user):
    """The user's membership with its team, or None for anonymous users and users without a
    team: one query, kept on the user (user.membership) for what reads it next; none where the
    user was fetched with them (accounts.authentication)."""
    if user is None or not user.is_authenticated:
        return None
    related = user.__class__.membership.related  # __class__: request.user is a lazy object
    if not related.is_cached(user):
        related.set_cached_value(user, Membership.objects.select_related("team").filter(user=user).first())
    return related.get_cached_value(user)


def team_of(user):
    """The user's team, or None for anonymous users and users without a team."""
    membership = membership_of(user)
    return membership.team if membership is not None else None


def is_owner(user):
    """Whether the user is their team's owner (who alone changes budgets, webhooks, datasets'
    credentials, deletes datasets and reads the audit log)."""
    return getattr(getattr(user, "membership", None), "role", None) == Membership.OWNER


def require_team(user):
    team = team_of(user)
    if team is None:
        raise Http404("You are not on a team.")
    return team


def get_for_team(queryset, user, team_path="team", **lookup):
    """The object of the user's team matching lookup, or Http404. team_path: the lookup from the
    object to its team, where the team is further away ("version__dataset__team")."""
    team = require_team(user)
    try:
        return queryset.get(**{team_path: team}, **lookup)
    except queryset.model.DoesNotExist:
        # Another team's is the same 404 as a missing one, but someone asking for ids that are
        # not theirs is probing: recorded, for the team whose object it is.
        from accounts import audit  # audit imports this module

        foreign = queryset.filter(**lookup).first()
        if foreign is not None:
            owner = foreign
            for step in team_path.split("__"):
                owner = getattr(owner, step)
            audit.foreign_object(user, foreign, owner)
    except (ValueError, TypeError, ValidationError):
        pass  # a malformed id (not a UUID) is just as absent
    raise Http404(f"No such {queryset.model._meta.verbose_name}.")
