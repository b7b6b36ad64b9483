from urllib.parse import urlparse

from django import forms

from core import endpoints
from notifications import policy


class EmailPreferencesForm(forms.Form):
    kinds = forms.MultipleChoiceField(
        choices=policy.KINDS,
        required=False,
        widget=forms.CheckboxSelectMultiple,
        label="Email me when",
        help_text="Emails go to your account's address, for your team's jobs, budget and invoices.",
    )


def clean_webhook_url(value):
    """An http(s) URL with a host at a public address (or one the operators allow, in
    E31_WEBHOOK_ALLOW: core.endpoints); anything else is refused with a message saying why.
    The worker checks the address again at every attempt: DNS may change after this."""
    value = (value or "").strip()
    parsed = urlparse(value)
    if parsed.scheme not in ("http", "https"):
        raise forms.ValidationError("Enter an http:// or https:// URL: webhooks are POSTed over HTTP.")
    if not parsed.hostname:
        raise forms.ValidationError("Enter a URL with a host name, such as https://example.com/e31-hook.")
    try:
        _ = parsed.port  # urllib raises ValueError for a port that is not a number
    except ValueError:
        raise forms.ValidationError("The URL's port is not a number from 0 to 65535.") from None
    if reason := endpoints.check_url(value, "webhook"):
        raise forms.ValidationError(f"{reason[0].upper()}{reason[1:]}.")
    return value


class WebhookForm(forms.Form):
    url = forms.CharField(
        max_length=500,
        label="URL",
        help_text="Events are POSTed here as JSON, signed with the webhook's secret (X-E31-Signature).",
        widget=forms.URLInput(attrs={"placeholder": "https://example.com/e31-hook"}),
    )
    kinds = forms.MultipleChoiceField(
        choices=policy.KINDS,
        required=False,
        widget=forms.CheckboxSelectMultiple,
        label="Events",
        help_text="None ticked: every event.",
    )
    active = forms.BooleanField(required=False, initial=True, label="Active", help_text="An inactive webhook is sent nothing.")

    def clean_url(self):
        return clean_webhook_url(self.cleaned_data.get("url"))
