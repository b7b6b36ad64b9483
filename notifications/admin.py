from django.contrib import admin

from notifications.models import Delivery, EmailPreference, Notification, Webhook


@admin.register(Webhook)
class WebhookAdmin(admin.ModelAdmin):
    list_display = ["url", "team", "active", "created_at"]
    list_filter = ["active"]
    exclude = ["sealed_secret"]


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
