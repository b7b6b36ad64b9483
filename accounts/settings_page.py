"""The user's settings page: their time zone, and what notifications.settings_page gives of
notifications. The settings view (accounts.views) and the webhook views (notifications.views) render it."""

import zoneinfo

from django import forms
from django.shortcuts import render

from notifications.settings_page import settings_context


class TimeZoneForm(forms.Form):
    time_zone = forms.ChoiceField(
        required=False,
        label="Your time zone",
        help_text="Deadlines you enter (“by 08:00 tomorrow”) and times you see are in this zone. Blank: the site’s (UTC).",
    )

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["time_zone"].choices = [("", "The site's")] + [(name, name) for name in sorted(zoneinfo.available_timezones())]


def render_settings(request, form=None, **notification_forms):
    """The settings page; a form with errors makes it a 400."""
    form = form or TimeZoneForm(initial={"time_zone": request.user.membership.time_zone})
    context = {"form": form, **settings_context(request, **notification_forms)}
    invalid = form.errors or any(f.errors for f in notification_forms.values() if f is not None)
    return render(request, "accounts/settings.html", context, status=400 if invalid else 200)
