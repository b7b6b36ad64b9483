from django.contrib import admin

from scheduler.models import Allocation, Node


@admin.register(Node)
class NodeAdmin(admin.ModelAdmin):
    list_display = ["name", "device_type", "devices", "last_heartbeat", "lost_at", "stopped_at"]


@admin.register(Allocation)
class AllocationAdmin(admin.ModelAdmin):
    list_display = ["job", "node", "devices", "rate", "started_at", "ended_at", "end_reason"]
    list_filter = ["end_reason", "node"]
