from django.contrib import admin

from accounts.models import AuditEvent, Membership, Team
from core.admin import LedgerAdmin


class MembershipInline(admin.TabularInline):
    model = Membership
    extra = 1


@admin.register(Team)
class TeamAdmin(admin.ModelAdmin):
    list_display = ["name", "share", "monthly_budget", "created_at"]
    search_fields = ["name"]
    inlines = [MembershipInline]


@admin.register(Membership)
class MembershipAdmin(admin.ModelAdmin):
    list_display = ["user", "team", "role"]
    list_filter = ["team", "role"]


@admin.register(AuditEvent)
class AuditEventAdmin(LedgerAdmin):
    """The audit log, read-only: nobody adds, changes or deletes an event (the model refuses too)."""

    list_display = ["at", "actor", "team", "action", "object_type", "label", "via", "ip"]
    list_filter = ["action", "team", "via"]
    search_fields = ["user__username", "actor", "label", "object_id"]
    date_hierarchy = "at"
    list_select_related = ["team"]
