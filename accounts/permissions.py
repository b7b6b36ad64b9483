"""Who may call the API's endpoints beyond being signed in: a team endpoint needs a team.

The API's default (settings.REST_FRAMEWORK), so a new endpoint is a team's unless it says
otherwise (`GET /api/me/` answers anyone signed in). Kept apart from core/api.py for the same
reason as core/throttling.py: DRF imports it while it defines APIView.
"""

from rest_framework.permissions import BasePermission

STAFF_TOKEN = "This is a staff token, for the operator's endpoints (/metrics); this endpoint is a team's: use the token of a team member."
NO_TEAM = "This account is not on a team yet: ask your team's owner to add it."


class OnATeam(BasePermission):
    """The user is on a team. A staff operator on none (who gets a token for /metrics) is told
    that this is a team's endpoint, with a 403 rather than the 404 of another team's object."""

    message = NO_TEAM

    def has_permission(self, request, view):
        # Imported here: this module is imported while DRF defines APIView, perhaps before the
        # app registry is ready for models.
        from accounts.access import team_of

        user = request.user
        if user is None or not user.is_authenticated or team_of(user) is not None:
            return True  # the anonymous are IsAuthenticated's to refuse (a 401)
        self.message = STAFF_TOKEN if user.is_staff else NO_TEAM
        return False
