from django.contrib import admin

from billing.models import Rate, UsageRecord


@admin.register(Rate)
class RateAdmin(admin.ModelAdmin):
    list_display = ["gpu_type", "per_gpu_hour", "preemptible_per_gpu_hour", "effective_from", "created_at"]
    list_filter = ["gpu_type"]


@admin.register(UsageRecord)
class UsageRecordAdmin(admin.ModelAdmin):
    list_display = ["job", "team", "gpus", "gpu_type", "started_at", "ended_at", "held_seconds", "rate", "amount", "credit_amount"]
    list_filter = ["team", "gpu_type"]

    # The ledger is append-only: written by the system when an allocation is released.
    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False
