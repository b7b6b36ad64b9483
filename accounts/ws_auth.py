"""Websocket authentication: a browser's session cookie, or an API token.

Cookie-authenticated sockets must come from one of our own origins (a page elsewhere could
otherwise ride the user's cookie). A token is not sent by browsers on their own, so a socket
that presents one (the `e31` client, scripts) needs no Origin header; its key is kept in the
scope ("token") so that the socket's access can be checked again while it is open.

Access checked at connect alone would outlive a removed member or a revoked token: every socket
of a user joins the user's group, and where a membership ends or a token is revoked (signals,
accounts/models.py) access_changed() tells those sockets to check again at once. That message
reaches them on the Redis layer only; each socket also checks by itself every few seconds
(jobs/consumers.py), for the in-memory layer and for changes made where no message is sent.
"""

import logging
from typing import TypedDict
from urllib.parse import urlparse

from asgiref.sync import async_to_sync
from channels.auth import AuthMiddlewareStack
from channels.db import database_sync_to_async
from channels.layers import get_channel_layer
from channels.security.websocket import OriginValidator, WebsocketDenier
from django.conf import settings
from django.contrib.auth.models import AnonymousUser
from django.db import transaction

log = logging.getLogger(__name__)


def _token_from(scope):
    kind, _, key = (_header(scope, b"authorization") or "").partition(" ")
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


def _header(scope, wanted):
    for name, value in scope.get("headers", []):
        if name == wanted:
            return value.decode("latin1")
    return None


class AuditedOriginValidator(OriginValidator):
    """Channels' check of a cookie socket's Origin against ALLOWED_HOSTS, each refusal recorded
    (ws.refuse, for the user whose cookie came along): a page elsewhere riding a signed-in
    user's session is what an operator looks for after an attack. Runs inside the session
    middleware, so that the user is known."""

    def __init__(self, application):
        hosts = settings.ALLOWED_HOSTS
        if settings.DEBUG and not hosts:
            hosts = ["localhost", "127.0.0.1", "[::1]"]  # as channels' AllowedHostsOriginValidator
        super().__init__(application, hosts)

    async def __call__(self, scope, receive, send):
        origin = _header(scope, b"origin")
        try:
            parsed = urlparse(origin) if origin is not None else None
        except ValueError:
            parsed = None
        if self.valid_origin(parsed):
            return await self.application(scope, receive, send)
        from accounts import (
            audit,  # the apps' models: not loaded when settings import this module
        )

        await audit.websocket_cross_origin(scope, origin)
        return await WebsocketDenier()(scope, receive, send)


class TokenOrSessionAuth:
    def __init__(self, inner):
        self.inner = inner
        self.session_app = AuthMiddlewareStack(AuditedOriginValidator(inner))

    async def __call__(self, scope, receive, send):
        key = _token_from(scope)
        if key is None:
            return await self.session_app(scope, receive, send)
        scope = dict(scope, user=await _user_for_token(key), token=key)
        return await self.inner(scope, receive, send)


class AccessChangedMessage(TypedDict):
    type: str  # "access.changed"
    user_id: int


def user_group(user_id):
    """The group every open socket of the user joins."""
    return f"user.{user_id}"


def access_changed(user_id):
    """Tell the user's open sockets to check their access again now (sync code): a membership
    ended or moved, a token was revoked. Sent after the commit, so that the check sees it."""
    if settings.E31_LIVE_MODE != "redis":
        # The in-memory layer is neither reachable from other processes nor thread-safe (as in
        # jobs/live.py): the sockets' own checks find the change.
        return
    transaction.on_commit(lambda: _send(user_id))


def _send(user_id):
    message: AccessChangedMessage = {"type": "access.changed", "user_id": int(user_id)}
    try:
        async_to_sync(get_channel_layer().group_send)(user_group(user_id), message)
    except Exception:  # noqa: BLE001 - never fails the change itself; the periodic check still closes
        log.warning("could not tell user %s's sockets that their access changed", user_id, exc_info=True)
