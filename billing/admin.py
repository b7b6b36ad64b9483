from django.contrib import admin

from billing.models import Credit, Invoice, InvoiceLine, Rate, UsageRecord
from core.admin import LedgerAdmin


@admin.register(Rate)
class RateAdmin(admin.ModelAdmin):
    list_display = ["gpu_type", "per_gpu_hour", "preemptible_per_gpu_hour", "effective_from", "created_at"]
    list_filter = ["gpu_type"]


@admin.register(UsageRecord)
class UsageRecordAdmin(LedgerAdmin):
    list_display = ["job", "team", "gpus", "gpu_type", "started_at", "ended_at", "held_seconds", "rate", "amount", "provisional", "period"]
    list_filter = ["team", "gpu_type", "provisional"]

    def get_queryset(self, request):
        return UsageRecord.ledger.all()  # provisional records too: what runs now


@admin.register(Credit)
class CreditAdmin(LedgerAdmin):
    list_display = ["job", "team", "seconds", "amount", "reason", "period", "created_at"]
    list_filter = ["team"]


class InvoiceLineInline(admin.TabularInline):
    model = InvoiceLine
    fields = ["position", "kind", "job_name", "job_ref", "description", "gpu_type", "gpus", "seconds", "rates", "amount"]
    readonly_fields = fields
    extra = 0
    can_delete = False

    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False


@admin.register(Invoice)
class InvoiceAdmin(admin.ModelAdmin):
    """Invoices are made by `manage.py invoices`; issued ones never change (a correction is a
    credit note: `manage.py invoices --credit-note ID --reason ...`)."""

    list_display = ["number", "kind", "team_name", "period_start", "state", "issued_at", "total", "currency"]
    list_filter = ["state", "kind", "team"]
    search_fields = ["number", "team_name"]
    inlines = [InvoiceLineInline]

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False
