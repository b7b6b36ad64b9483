"""API tokens, read with the user, its membership and its team in one query.

Every call a CLI or SDK makes with its token asked three queries before its own work: the token
with its user (DRF's TokenAuthentication), then the user's membership, then its team (the
permission every team endpoint checks, accounts.access.team_of). Kept apart from accounts.access
for the reason core/throttling.py is: DRF's settings import this class while DRF defines APIView.

That one query is compiled once per process (TokenRead), not for every call: Django built a
four-table select_related query anew each time, 1.1 ms of CPU a call where running it costs some
0.05 (issue 24: a polling CLI's every call). Once per process, not per connection: under ASGI
each request runs in a thread lent to it alone (e31web/handler.py), with that thread's connection
object, and a worker's threads are many.
"""

from django.db import DEFAULT_DB_ALIAS
from django.utils.translation import gettext_lazy as _
from rest_framework import exceptions
from rest_framework.authentication import TokenAuthentication

from core.compiled import Param, Read


class TeamTokenAuthentication(TokenAuthentication):
    """DRF's token authentication (the same header, answers and schema), its user fetched with
    the membership and team every team endpoint reads next."""

    def authenticate_credentials(self, key):
        model = self.get_model()
        token = TokenRead.of(model)(key)
        if token is None:
            raise exceptions.AuthenticationFailed(_("Invalid token."))
        if not token.user.is_active:
            raise exceptions.AuthenticationFailed(_("User inactive or deleted."))
        return token.user, token


class TokenRead:
    """`model.objects.select_related("user__membership__team").filter(key=key)` compiled once
    per process and database (core.compiled.Read), so the token, its user, membership and team
    are the ORM's own objects."""

    made: dict[tuple[str, type], "TokenRead"] = {}

    def __init__(self, model, alias=DEFAULT_DB_ALIAS):
        self.alias = alias
        self.read = Read(lambda: model.objects.select_related("user__membership__team").filter(key=Param("key", model._meta.pk))[:1])
        self.read.compiled(alias)

    @classmethod
    def of(cls, model, alias=DEFAULT_DB_ALIAS):
        """The process's own for the database, made on first use (made twice at worst, by two
        threads at once: the same)."""
        read = cls.made.get((alias, model))
        if read is None:
            read = cls.made[alias, model] = cls(model, alias)
        return read

    def __call__(self, key):
        """The token of that key, with its user, membership and team; None if there is none."""
        return self.read.first(self.alias, key=key)
