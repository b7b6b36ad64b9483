"""Read settings from environment variables, failing loudly on a bad value.

A typo in production must be an error at start-up, never a silent default.
"""

import math
import os
import re
from urllib.parse import urlparse

from django.core.exceptions import ImproperlyConfigured

TRUE = {"1", "true", "yes", "on"}
FALSE = {"0", "false", "no", "off"}


def _raw(name):
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return None
    return value.strip()


def env_str(name, default=None):
    value = _raw(name)
    return default if value is None else value


def env_bool(name, default):
    value = _raw(name)
    if value is None:
        return default
    if value.lower() in TRUE:
        return True
    if value.lower() in FALSE:
        return False
    raise ImproperlyConfigured(f"{name}={value!r} is not a boolean (use 1/0, true/false, yes/no, on/off)")


def env_int(name, default, minimum=None):
    value = _raw(name)
    if value is None:
        return default
    try:
        number = int(value)
    except ValueError:
        raise ImproperlyConfigured(f"{name}={value!r} is not a whole number") from None
    if minimum is not None and number < minimum:
        raise ImproperlyConfigured(f"{name}={number} must be at least {minimum}")
    return number


def env_float(name, default, minimum=None):
    value = _raw(name)
    if value is None:
        return default
    try:
        number = float(value)
    except ValueError:
        raise ImproperlyConfigured(f"{name}={value!r} is not a number") from None
    if not math.isfinite(number):
        raise ImproperlyConfigured(f"{name}={value!r} must be a finite number")
    if minimum is not None and number < minimum:
        raise ImproperlyConfigured(f"{name}={number} must be at least {minimum}")
    return number


def env_list(name, default):
    value = _raw(name)
    if value is None:
        return list(default)
    items = [item.strip() for item in value.split(",")]
    if any(not item for item in items):
        raise ImproperlyConfigured(f"{name}={value!r} has an empty item")
    return items


def env_url(name, default, schemes):
    value = _raw(name)
    if value is None:
        return default
    parsed = urlparse(value)
    if parsed.scheme not in schemes:
        allowed = ", ".join(f"{s}://" for s in sorted(schemes))
        raise ImproperlyConfigured(f"{name}={value!r} must start with one of: {allowed}")
    if parsed.scheme not in ("sqlite",) and not parsed.hostname:
        raise ImproperlyConfigured(f"{name}={value!r} has no host")
    return value


RATE = re.compile(r"^\s*(\d+)\s*/\s*(s|sec|second|m|min|minute|h|hour|d|day)\s*$")
PERIODS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_rate(rate):
    """'1200/min' as (1200, 60); None (no limit) for None, '' and 'off'. Raises ValueError."""
    if rate is None or str(rate).strip().lower() in ("", "off", "none"):
        return None
    match = RATE.match(str(rate))
    if not match:
        raise ValueError(f"{rate!r} is not a rate: write requests per period, e.g. 1200/min, 20/s, 10000/hour or off")
    return int(match.group(1)), PERIODS[match.group(2)[0]]


def env_rate(name, default):
    """A rate limit: 'N/period' (s, min, hour, day) or 'off' (None)."""
    value = _raw(name)
    if value is None:
        value = default
    try:
        return value if parse_rate(value) else None
    except ValueError as error:
        raise ImproperlyConfigured(f"{name}={value!r}: {error}") from None
