"""What the user's settings page shows and saves of notifications: their email notifications and
the team's webhooks with their latest deliveries (accounts.settings_page renders the page)."""

from accounts.access import is_owner, require_team
from notifications.forms import EmailPreferencesForm, WebhookForm
from notifications.models import Delivery, EmailPreference


def settings_context(request, email_form=None, webhook_form=None):
    """What the settings page shows of notifications (accounts.settings_page.render_settings renders it)."""
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
