"""Browser sessions in the database, as Django's own backend keeps them, each read by a Read.

Every page a signed-in browser asks for reads its session first. Django's backend builds and
compiles the query at every request (a queryset with two lookups): the Read's SQL is made once
per process (core.compiled), as the user's own read is (accounts.backends). The rows, their
expiry and what a missing or expired session does are the backend's.
"""

import string

from django.contrib.sessions.backends import db
from django.contrib.sessions.models import Session
from django.db.models import CharField, DateTimeField
from django.utils import timezone

from core.compiled import Param, Read

# The characters of the keys Django makes (SessionBase._get_new_session_key): a cookie with any
# other is no session, and is not asked of the database (a NUL in it failed PostgreSQL's query,
# a 500, in Django's own backend too).
KEY_CHARACTERS = frozenset(string.ascii_lowercase + string.digits)

# A session that has not expired, by its key.
LIVE_SESSION = Read(lambda: Session.objects.filter(session_key=Param("key", CharField()), expire_date__gt=Param("now", DateTimeField()))[:1])


class SessionStore(db.SessionStore):
    def _get_session_from_db(self):
        if self.model is not Session:  # a subclass's own model: Django's read
            return super()._get_session_from_db()
        key = self.session_key
        fits = len(key) <= Session._meta.get_field("session_key").max_length and KEY_CHARACTERS.issuperset(key)
        session = LIVE_SESSION.first(key=key, now=timezone.now()) if fits else None
        if session is None:  # as Django's: the key is forgotten, a new one is made when saved
            self._session_key = None
        return session
