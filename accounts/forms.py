"""The forms of accounts: the user's time zone (on the settings page, notifications.settings_page)."""

import zoneinfo

from django import forms


class TimeZoneForm(forms.Form):
    time_zone = forms.ChoiceField(
        required=False,
        label="Your time zone",
        help_text="Deadlines you enter (“by 08:00 tomorrow”) and times you see are in this zone. Blank: the site’s (UTC).",
    )

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["time_zone"].choices = [("", "The site's")] + [(name, name) for name in sorted(zoneinfo.available_timezones())]
