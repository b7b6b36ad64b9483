"""A URL a team gives for the network to call (a webhook, an experiment tracker), checked as a
form field: http(s), a host, a port that is a number, and the address policy of its purpose
(core.endpoints), each refusal a message saying why. The callers check the address again
before every use: DNS may change after this."""

from urllib.parse import urlparse

from django import forms

from core import endpoints


def clean_public_url(value, purpose, *, example, scheme_hint=""):
    """The URL, stripped, or forms.ValidationError. example: a URL of the kind asked for, for the
    messages; scheme_hint: why it must be http(s), if worth saying."""
    value = (value or "").strip()
    parsed = urlparse(value)
    if parsed.scheme not in ("http", "https"):
        raise forms.ValidationError(f"Enter an http:// or https:// URL{': ' + scheme_hint if scheme_hint else ''}.")
    if not parsed.hostname:
        raise forms.ValidationError(f"Enter a URL with a host name, such as {example}.")
    try:
        _ = parsed.port  # urllib raises ValueError for a port that is not a number
    except ValueError:
        raise forms.ValidationError("The URL's port is not a number from 0 to 65535.") from None
    if reason := endpoints.check_url(value, purpose):
        raise forms.ValidationError(f"{reason[0].upper()}{reason[1:]}.")
    return value
