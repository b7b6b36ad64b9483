from django.contrib import admin

from tracking.models import TrackedRun, Tracker


@admin.register(Tracker)
class TrackerAdmin(admin.ModelAdmin):
    list_display = ["team", "url", "enabled", "last_delivered_at", "last_error_at"]
    exclude = ["sealed_token"]  # encrypted; never shown


@admin.register(TrackedRun)
class TrackedRunAdmin(admin.ModelAdmin):
    list_display = ["job", "run_id", "delivered_seq", "finished_sent", "attempts", "next_attempt_at"]
    raw_id_fields = ["job"]
