from decimal import Decimal

from django import template
from django.conf import settings

from core.text import format_duration
from jobs.metrics import format_value

register = template.Library()


@register.filter
def money(amount, places=2):
    """An amount with the currency: 'USD 1.23' (more places for the live meter)."""
    if amount in (None, ""):
        return ""
    value = Decimal(str(amount)).quantize(Decimal(1).scaleb(-int(places)))
    return f"{settings.E31_CURRENCY} {value:,}"


@register.filter
def rate(amount):
    """A rate with the places it needs, at least two: 'USD 2.50', 'USD 0.125'."""
    if amount in (None, ""):
        return ""
    value = Decimal(str(amount)).normalize()
    if value.as_tuple().exponent > -2:
        value = value.quantize(Decimal("0.01"))
    return f"{settings.E31_CURRENCY} {value:,f}"


@register.filter
def duration(seconds):
    if seconds in (None, ""):
        return ""
    return format_duration(seconds)


@register.filter
def hours(value):
    if value in (None, ""):
        return ""
    return f"{Decimal(str(value)).normalize():f}"


@register.filter
def state_class(state):
    return f"state state-{state}"


@register.filter
def get(mapping, key):
    """mapping[key] in a template, None when it has none."""
    try:
        return mapping.get(key)
    except AttributeError:
        return None


@register.filter
def metric(value):
    """A metric's value as text: 6 significant digits ("" for none)."""
    return "" if value is None else format_value(value)
