from django.contrib import admin

from scheduler.allocations import preempt
from scheduler.models import Allocation, Node


@admin.register(Node)
class NodeAdmin(admin.ModelAdmin):
    list_display = ["name", "device_type", "devices", "last_heartbeat", "lost_at", "stopped_at"]


@admin.register(Allocation)
class AllocationAdmin(admin.ModelAdmin):
    list_display = ["job", "node", "devices", "rate", "preemptible", "started_at", "ended_at", "end_reason"]
    list_filter = ["end_reason", "preemptible", "node"]
    actions = ["preempt"]

    @admin.action(description="Preempt (preemptible jobs checkpoint and go back to the queue)")
    def preempt(self, request, queryset):

        asked = sum(preempt(a.pk, f"preempted by operator {request.user.username}") for a in queryset)
        skipped = queryset.count() - asked
        self.message_user(request, f"Asked {asked} allocation(s) to give their devices back; {skipped} not preemptible, ended or already asked.")
