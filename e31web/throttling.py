"""The API's rate limit: so many requests per period for each API token.

Kept apart from e31web/api.py: DRF imports its throttle classes while it defines APIView, so
this module must not import DRF's views.
"""

import hashlib

from django.conf import settings
from rest_framework.throttling import SimpleRateThrottle

from e31web.env import parse_rate


class TokenRateThrottle(SimpleRateThrottle):
    """settings.E31_API_RATE requests per period for each API token (each signed-in user
    without one, each address without either), counted in Django's cache, so on Redis the limit
    holds across the server's processes."""

    scope = "e31_api"

    def get_rate(self):
        rate = getattr(settings, "E31_API_RATE", None)
        return rate if parse_rate(rate) else None

    def parse_rate(self, rate):
        return parse_rate(rate) or (None, None)

    def get_cache_key(self, request, view):
        key = getattr(request.auth, "key", None)
        if key:
            ident = "token:" + hashlib.sha256(key.encode()).hexdigest()[:32]
        elif request.user is not None and request.user.is_authenticated:
            ident = f"user:{request.user.pk}"
        else:
            ident = f"ip:{self.get_ident(request)}"
        return self.cache_format % {"scope": self.scope, "ident": ident}
