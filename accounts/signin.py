"""Sign-in attempts limited: after too many failures for one username, or from one address,
within a window, sign-in is refused until the window has passed (the page and the API alike).

Counts live in the cache (Redis when REDIS_URL is set, so every web process shares them; else
each process keeps its own), counted as the API's calls are (core.throttling.count)."""

import hashlib
import math
import time

from django.conf import settings
from django.core.cache import cache

from accounts import audit
from core.throttling import count, counted


def keys(username, address):
    """The counters an attempt touches: one for the username (case-folded), one for the address."""
    name = hashlib.sha256((username or "").strip().casefold().encode()).hexdigest()[:32]
    # "failures": counters, never read as the {count, since} entries once kept under "signin:user:".
    return [f"signin:failures:user:{name}", f"signin:failures:addr:{address or '-'}"]


def retry_after(username, address, now=None):
    """Seconds until sign-in may be tried again (0: it may be tried now)."""
    now = time.time() if now is None else now
    wait = 0.0
    for key in keys(username, address):
        failures, since = counted(key)
        if failures >= settings.E31_LOGIN_FAILURES:
            wait = max(wait, (now if since is None else since) + settings.E31_LOGIN_WINDOW_SECONDS - now)
    return max(0, math.ceil(wait))


def failed(username, address, now=None):
    """Count a failure against the username and the address; the window starts at the first.
    The failure goes in the audit log, and so does the lockout it causes (once: the count that
    reaches the limit is one process's)."""
    now = time.time() if now is None else now
    locked = []
    for kind, key in zip(("username", "address"), keys(username, address)):
        if count(key, settings.E31_LOGIN_WINDOW_SECONDS, now) == settings.E31_LOGIN_FAILURES:
            locked.append(kind)
    audit.sign_in_failed(username, address, locked)


def succeeded(username, address):
    """A right password clears the username's count (not the address's: one good account does
    not unlock guessing others from the same place)."""
    key = keys(username, address)[0]
    cache.delete_many([key, f"{key}:since"])


def refusal(seconds):
    minutes = max(1, round(seconds / 60))
    return f"Too many failed sign-ins: try again in {minutes} minute{'s' if minutes != 1 else ''}."
