import zoneinfo

from asgiref.sync import sync_to_async
from django.conf import settings
from django.utils import timezone

from accounts import audit
from accounts.access import membership_of
from core.middleware import BothModes


class UserTimeZoneMiddleware(BothModes):
    """Times a user enters (a deadline) and sees are in their own time zone, as they set it.

    Sync in the web worker, whose chain runs in the request's one thread (e31web.handler); async
    as well, for Django's own ASGI handler, where a sync-only middleware would run the rest of
    the chain in a thread and come back to the event loop before the view. There only a request
    with a session cookie can name a user here (an API token is read by the view, which
    activates its user's zone itself: jobs/api.py), so the others need no thread at all."""

    def call(self, request):
        activate_for(request.user)
        return self.get_response(request)

    async def __acall__(self, request):
        signed_in = settings.SESSION_COOKIE_NAME in request.COOKIES
        activate(await sync_to_async(zone_of)(request.user) if signed_in else "")
        return await self.get_response(request)


def zone_of(user):
    """The name of the time zone the user set ("" for none, or for no user)."""
    membership = membership_of(user)
    return membership.time_zone if membership is not None else ""


def activate(name):
    if name:
        try:
            timezone.activate(zoneinfo.ZoneInfo(name))
            return
        except (zoneinfo.ZoneInfoNotFoundError, ValueError):
            pass
    timezone.deactivate()


def activate_for(user):
    """The user's own time zone for this request (the API calls it once a token names the user)."""
    activate(zone_of(user))


class AuditRequestMiddleware(BothModes):
    """The request being answered, for the audit events recorded where only a user is at hand
    (accounts.audit.current_request). A context variable, so the view's thread sees it when the
    middleware runs in the event loop (asgiref copies the context into sync_to_async)."""

    def call(self, request):
        with audit.answering(request):
            return self.get_response(request)

    async def __acall__(self, request):
        with audit.answering(request):
            return await self.get_response(request)
