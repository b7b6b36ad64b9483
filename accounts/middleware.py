import zoneinfo

from django.utils import timezone

from accounts import audit
from accounts.access import membership_of


class UserTimeZoneMiddleware:
    """Times a user enters (a deadline) and sees are in their own time zone, as they set it."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        activate_for(request.user)
        return self.get_response(request)


def activate_for(user):
    """The user's own time zone for this request (the API calls it once a token names the user)."""
    membership = membership_of(user)
    name = membership.time_zone if membership is not None else ""
    if name:
        try:
            timezone.activate(zoneinfo.ZoneInfo(name))
            return
        except (zoneinfo.ZoneInfoNotFoundError, ValueError):
            pass
    timezone.deactivate()


class AuditRequestMiddleware:
    """The request being answered, for the audit events recorded where only a user is at hand
    (accounts.audit.current_request)."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        with audit.answering(request):
            return self.get_response(request)
