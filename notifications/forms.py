from django import forms

from core.url_fields import clean_public_url
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
    E31_WEBHOOK_ALLOW): core.url_fields."""
    return clean_public_url(value, "webhook", example="https://example.com/e31-hook", scheme_hint="webhooks are POSTed over HTTP")


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
