"""Websocket authentication: a browser's session cookie, or an API token.

Cookie-authenticated sockets must come from one of our own origins (a page elsewhere could
otherwise ride the user's cookie). A token is not sent by browsers on their own, so a socket
that presents one (the `e31` client, scripts) needs no Origin header.
"""

from channels.auth import AuthMiddlewareStack
from channels.db import database_sync_to_async
from channels.security.websocket import AllowedHostsOriginValidator
from django.contrib.auth.models import AnonymousUser


def _token_from(scope):
    for name, value in scope.get("headers", []):
        if name == b"authorization":
            kind, _, key = value.decode("latin1").partition(" ")
            if kind.lower() in ("token", "bearer") and key.strip():
                return key.strip()
    return None


@database_sync_to_async
def _user_for_token(key):
    from rest_framework.authtoken.models import Token

    try:
        token = Token.objects.select_related("user").get(key=key)
    except Token.DoesNotExist:
        return AnonymousUser()
    return token.user if token.user.is_active else AnonymousUser()


class TokenOrSessionAuth:
    def __init__(self, inner):
        self.inner = inner
        self.session_app = AllowedHostsOriginValidator(AuthMiddlewareStack(inner))

    async def __call__(self, scope, receive, send):
        key = _token_from(scope)
        if key is None:
            return await self.session_app(scope, receive, send)
        scope = dict(scope, user=await _user_for_token(key))
        return await self.inner(scope, receive, send)
