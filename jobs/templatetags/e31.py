import uuid
from decimal import Decimal

from django import template
from django.conf import settings
from django.urls import get_script_prefix, get_urlconf, reverse

from core.text import format_duration
from jobs.metrics import format_value

register = template.Library()

# {% link %}'s URLs, made once per process: (script prefix, URL conf, view name) -> the URL, or
# for a view of one id (and the id's type), the URL split around the id it was made with.
_LINKS = {}


@register.simple_tag
def link(viewname, pk=None):
    """{% url viewname %} or {% url viewname pk %} for an id (a UUID or an integer), reversed
    once per process and view: a later id goes into the first one's URL. reverse() costs 25-75 us
    (it reads asgiref's Locals and checks the URL it makes against the pattern); a signed-in page
    has a dozen in its menu and a job's page as many again, about a tenth of its CPU (issue 24).
    Anything else is reversed as {% url %} would."""
    key = (get_script_prefix(), get_urlconf(), viewname)
    if pk is None:
        url = _LINKS.get(key)
        if url is None:
            url = _LINKS[key] = reverse(viewname)
        return url
    if not isinstance(pk, uuid.UUID | int) or isinstance(pk, bool):
        return reverse(viewname, args=[pk])
    key, text = (*key, type(pk)), str(pk)
    made = _LINKS.get(key)
    if made is not None:
        return made[0] + text + made[1]
    url = reverse(viewname, args=[pk])
    if url.count(text) == 1:
        _LINKS[key] = tuple(url.split(text))
    return url


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
