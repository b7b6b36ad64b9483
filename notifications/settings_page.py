"""The user's settings page: their time zone (accounts.forms), the email notifications they get
and the team's webhooks with their latest deliveries. It lives here, above accounts: the page
shows both apps' settings (user_settings in notifications.views, the webhook views too)."""

from django.shortcuts import render

from accounts.access import is_owner, require_team
from accounts.forms import TimeZoneForm
from notifications.forms import EmailPreferencesForm, WebhookForm
from notifications.models import Delivery, EmailPreference


def settings_context(request, email_form=None, webhook_form=None):
    """What the settings page shows of notifications."""
    team = require_team(request.user)
    webhooks = list(team.webhooks.all())
    return {
        "email_form": email_form or EmailPreferencesForm(initial={"kinds": EmailPreference.kinds_for(request.user)}),
        "webhook_form": webhook_form or WebhookForm(),
        "webhooks": webhooks,
        "deliveries": Delivery.objects.filter(webhook__team=team).select_related("notification", "webhook")[:20],
        "can_change_webhooks": is_owner(request.user),
    }


def save_email_preferences(request):
    """The settings page's email form: (form, saved)."""
    form = EmailPreferencesForm(request.POST)
    if not form.is_valid():
        return form, False
    EmailPreference.objects.update_or_create(user=request.user, defaults={"kinds": form.cleaned_data["kinds"]})
    return form, True


def render_settings(request, form=None, **notification_forms):
    """The settings page; a form with errors makes it a 400."""
    form = form or TimeZoneForm(initial={"time_zone": request.user.membership.time_zone})
    context = {"form": form, **settings_context(request, **notification_forms)}
    invalid = form.errors or any(f.errors for f in notification_forms.values() if f is not None)
    return render(request, "accounts/settings.html", context, status=400 if invalid else 200)
