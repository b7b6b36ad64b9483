"""The API's rate limit: so many requests per period for each API token; and the counting in a
window that it shares with sign-in's limit (accounts/signin.py).

Kept apart from core/api.py: DRF imports its throttle classes while it defines APIView, so
this module must not import DRF's views.
"""

import hashlib

from django.conf import settings
from django.core.cache import cache
from rest_framework.throttling import SimpleRateThrottle

from core.env import parse_rate


def count(key, seconds, now):
    """One more against key in its window (opened by the first count, `seconds` long); the count.

    An increment in the cache, never a read then a write: on Redis, processes counting at the
    same moment keep every one of each other's counts (a read-then-write loses those made in
    between). Without Redis the cache, and so the count, is each process's own. The web tier's
    Redis cache counts in one round trip (core.cache.SharedRedisCache.count_in_window)."""
    in_window = getattr(cache, "count_in_window", None)
    if in_window is not None:
        counted, opened = in_window(key, seconds)
        if opened:
            cache.set(f"{key}:since", now, seconds)
        return counted
    try:
        counted = cache.incr(key)
    except ValueError:  # no window open: this count opens one, unless another process's did first
        if cache.add(key, 1, seconds):
            cache.set(f"{key}:since", now, seconds)
            return 1
        counted = cache.incr(key)
    if counted == 1:
        # The window ran out between Redis's check for the key and its increment, which made a
        # count without an expiry: give it one, or it would refuse for good.
        cache.touch(key, seconds)
        cache.set(f"{key}:since", now, seconds)
    return counted


def counted(key):
    """key's count in its window (0 when none is open) and when the window opened (None)."""
    values = cache.get_many([key, f"{key}:since"])
    return values.get(key, 0), values.get(f"{key}:since")


class TokenRateThrottle(SimpleRateThrottle):
    """settings.E31_API_RATE requests per period for each API token (each signed-in user
    without one, each address without either), counted in Django's cache, so on Redis the limit
    holds across the server's processes.

    The period is a window opened by the token's first call, not DRF's sliding one: a window
    is one counter that every process increments, where a sliding window is a list of times
    that each process reads and writes back (losing the calls of others meanwhile). The price: up
    to twice the rate across the end of one window and the start of the next."""

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
        # ":calls": a counter, never read as the list of times DRF's own throttle kept here.
        return self.cache_format % {"scope": self.scope, "ident": ident} + ":calls"

    def allow_request(self, request, view):
        if self.rate is None:
            return True
        self.key, self.now = self.get_cache_key(request, view), self.timer()
        return count(self.key, self.duration, self.now) <= self.num_requests

    def wait(self):
        since = counted(self.key)[1]
        return self.duration if since is None else max(0.0, since + self.duration - self.now)
