from urllib.parse import urlparse

from django import forms

from core.url_fields import clean_public_url


class TrackerForm(forms.Form):
    """A team's MLflow tracking server: its address (under the network's address policy) and a
    token, kept encrypted and never shown back (blank keeps the one stored)."""

    url = forms.CharField(
        max_length=500,
        label="Tracking server URL",
        help_text="The MLflow tracking server's address, as MLFLOW_TRACKING_URI gives it, e.g. https://mlflow.example.com.",
        widget=forms.URLInput(attrs={"placeholder": "https://mlflow.example.com"}),
    )
    token = forms.CharField(
        required=False,
        max_length=2000,
        strip=True,
        label="Token",
        widget=forms.PasswordInput(render_value=False, attrs={"autocomplete": "off"}),
        help_text="Sent as a Bearer token (MLFLOW_TRACKING_TOKEN). Stored encrypted, never shown again; blank keeps the stored one.",
    )
    clear_token = forms.BooleanField(required=False, label="Remove the stored token", help_text="For a server that takes no token.")
    enabled = forms.BooleanField(required=False, initial=True, label="Send jobs", help_text="Off: nothing is sent; the jobs wait, and nothing is lost.")

    def clean_url(self):
        """An http(s) URL at a public address (or one the operators allow in E31_TRACKER_ALLOW:
        core.endpoints). The worker checks the address again before every request."""
        value = clean_public_url(self.cleaned_data.get("url"), "tracker", example="https://mlflow.example.com")
        parsed = urlparse(value)
        if parsed.query or parsed.fragment:
            raise forms.ValidationError("Give the server's address without a query or fragment.")
        return value.rstrip("/")
