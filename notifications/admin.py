from django import forms
from django.contrib import admin

from notifications.forms import clean_webhook_url
from notifications.models import Delivery, EmailPreference, Notification, Webhook


class WebhookAdminForm(forms.ModelForm):
    """Staff are held to the address policy too: an internal receiver is allowed by setting
    (E31_WEBHOOK_ALLOW), where it is written down, not by one edit here."""

    url = forms.URLField(max_length=500, assume_scheme="https")

    class Meta:
        model = Webhook
        fields = ["team", "url", "kinds", "active", "created_at", "created_by"]  # never its sealed secret

    def clean_url(self):
        return clean_webhook_url(self.cleaned_data.get("url"))


@admin.register(Webhook)
class WebhookAdmin(admin.ModelAdmin):
    form = WebhookAdminForm
    list_display = ["url", "team", "active", "created_at"]
    list_filter = ["active"]


@admin.register(Notification)
class NotificationAdmin(admin.ModelAdmin):
    list_display = ["kind", "team", "job", "created_at"]
    list_filter = ["kind"]
    readonly_fields = ["payload"]


@admin.register(Delivery)
class DeliveryAdmin(admin.ModelAdmin):
    list_display = ["notification", "channel", "address", "state", "attempts", "last_status", "next_attempt_at"]
    list_filter = ["state", "channel"]


admin.site.register(EmailPreference)
