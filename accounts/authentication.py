"""API tokens, read with the user, its membership and its team in one query.

Every call a CLI or SDK makes with its token asked three queries before its own work: the token
with its user (DRF's TokenAuthentication), then the user's membership, then its team (the
permission every team endpoint checks, accounts.access.team_of). Kept apart from accounts.access
for the reason core/throttling.py is: DRF's settings import this class while DRF defines APIView.

That one query is compiled once per process (TokenRead), not for every call: Django built a
four-table select_related query anew each time, 1.1 ms of CPU a call where running it costs some
0.05 (issue 24: a polling CLI's every call). Once per process, not per connection: under ASGI
each request runs in a thread of its own, with a connection object of its own.
"""

from django.db import DEFAULT_DB_ALIAS, connections
from django.db.models.query import get_related_populators
from django.utils.translation import gettext_lazy as _
from rest_framework import exceptions
from rest_framework.authentication import TokenAuthentication


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
    for a database: its SQL kept, the rows turned into the token, its user, membership and team
    as Django's ModelIterable turns them (the compiler's converters, Model.from_db, the related
    populators), so the objects are the ORM's own. The query runs on the calling thread's own
    connection; the compiler, made on another's, only converts values (the backend's pure
    functions)."""

    KEY = "\x00key"  # stands for the key while the query is compiled
    made: dict[tuple[str, type], "TokenRead"] = {}

    def __init__(self, model, alias=DEFAULT_DB_ALIAS):
        queryset = model.objects.using(alias).select_related("user__membership__team").filter(key=self.KEY)
        self.alias = alias
        self.compiler = queryset.query.get_compiler(using=alias)
        self.sql, params = self.compiler.as_sql()
        self.params = list(params)
        self.at = self.params.index(self.KEY)
        select, klass_info = self.compiler.select, self.compiler.klass_info
        self.model = klass_info["model"]
        self.start, self.end = klass_info["select_fields"][0], klass_info["select_fields"][-1] + 1
        self.names = [column[0].target.attname for column in select[self.start : self.end]]
        self.populators = get_related_populators(klass_info, select, alias)

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
        params = list(self.params)
        params[self.at] = key
        with connections[self.alias].cursor() as cursor:
            cursor.execute(self.sql, params)
            rows = cursor.fetchall()
        for row in self.compiler.results_iter(results=[rows]):
            token = self.model.from_db(self.alias, self.names, row[self.start : self.end])
            for populator in self.populators:
                populator.populate(row, token)
            return token
        return None
