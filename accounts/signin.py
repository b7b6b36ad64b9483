"""Sign-in attempts limited: after too many failures for one username, or from one address,
within a window, sign-in is refused until the window has passed (the page and the API alike).

Counts live in the cache (Redis when REDIS_URL is set, so every web process shares them)."""

import hashlib
import math
import time

from django.conf import settings
from django.core.cache import cache


def keys(username, address):
    """The counters an attempt touches: one for the username (case-folded), one for the address."""
    name = hashlib.sha256((username or "").strip().casefold().encode()).hexdigest()[:32]
    return [f"signin:user:{name}", f"signin:addr:{address or '-'}"]


def retry_after(username, address, now=None):
    """Seconds until sign-in may be tried again (0: it may be tried now)."""
    now = time.time() if now is None else now
    wait = 0.0
    for key in keys(username, address):
        entry = cache.get(key)
        if entry and entry["count"] >= settings.E31_LOGIN_FAILURES:
            wait = max(wait, entry["since"] + settings.E31_LOGIN_WINDOW_SECONDS - now)
    return max(0, math.ceil(wait))


def failed(username, address, now=None):
    """Count a failure against the username and the address; the window starts at the first."""
    now = time.time() if now is None else now
    for key in keys(username, address):
        entry = cache.get(key)
        if not entry or now - entry["since"] >= settings.E31_LOGIN_WINDOW_SECONDS:
            entry = {"count": 0, "since": now}
        entry["count"] += 1
        cache.set(key, entry, timeout=settings.E31_LOGIN_WINDOW_SECONDS)


def succeeded(username, address):
    """A right password clears the username's count (not the address's: one good account does
    not unlock guessing others from the same place)."""
    cache.delete(keys(username, address)[0])


def refusal(seconds):
    minutes = max(1, round(seconds / 60))
    return f"Too many failed sign-ins: try again in {minutes} minute{'s' if minutes != 1 else ''}."
