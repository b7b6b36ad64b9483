"""The signed-in user of a browser's session, read with its membership and team in one query.

Every page and websocket of a signed-in user read its user (Django's ModelBackend.get_user),
then its membership with its team (accounts.access.membership_of, which the time zone
middleware and every team view ask for): two queries where one does, as the API's tokens have
theirs (accounts.authentication). Its SQL is made once per process (core.compiled), as the
session's is (core.sessions): Django built and compiled the four-table query at every page.
"""

from django.contrib.auth import get_user_model
from django.contrib.auth.backends import ModelBackend
from django.db.models import IntegerField

from core.compiled import Param, Read

# The user of that id, with its membership and team.
TEAM_USER = Read(lambda: get_user_model()._default_manager.select_related("membership__team").filter(pk=Param("user", get_user_model()._meta.pk))[:1])


class TeamModelBackend(ModelBackend):
    """Django's ModelBackend (the same passwords, permissions and inactive users), its
    session's user fetched with the membership and team every team page reads next."""

    def get_user(self, user_id):
        user = TEAM_USER.first(user=user_id) if may_be_an_id(user_id) else None
        if user is None:
            return None
        return user if self.user_can_authenticate(user) else None


def may_be_an_id(user_id):
    """Whether a session's user id may be a user's: of an integer key, an integer in 64 bits.
    Django's own get_user finds no user of a larger one; asked of SQLite, the Read failed."""
    if not isinstance(get_user_model()._meta.pk, IntegerField):
        return True
    try:
        return -(2**63) <= int(user_id) < 2**63
    except (TypeError, ValueError):
        return False
