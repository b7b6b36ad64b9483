"""API tokens, read with the user, its membership and its team in one query.

Every call a CLI or SDK makes with its token asked three queries before its own work: the token
with its user (DRF's TokenAuthentication), then the user's membership, then its team (the
permission every team endpoint checks, accounts.access.team_of). Kept apart from accounts.access
for the reason core/throttling.py is: DRF's settings import this class while DRF defines APIView.
"""

from django.utils.translation import gettext_lazy as _
from rest_framework import exceptions
from rest_framework.authentication import TokenAuthentication


class TeamTokenAuthentication(TokenAuthentication):
    """DRF's token authentication (the same header, answers and schema), its user fetched with
    the membership and team every team endpoint reads next."""

    def authenticate_credentials(self, key):
        model = self.get_model()
        try:
            token = model.objects.select_related("user__membership__team").get(key=key)
        except model.DoesNotExist:
            raise exceptions.AuthenticationFailed(_("Invalid token.")) from None
        if not token.user.is_active:
            raise exceptions.AuthenticationFailed(_("User inactive or deleted."))
        return token.user, token
