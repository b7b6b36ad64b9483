import zoneinfo

from django.utils import timezone


class UserTimeZoneMiddleware:
    """Times a user enters (a deadline) and sees are in their own time zone, as they set it."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        name = getattr(getattr(request.user, "membership", None), "time_zone", "") if request.user.is_authenticated else ""
        if name:
            try:
                timezone.activate(zoneinfo.ZoneInfo(name))
            except (zoneinfo.ZoneInfoNotFoundError, ValueError):
                timezone.deactivate()
        else:
            timezone.deactivate()
        return self.get_response(request)
