"""Admin pages every app uses."""

from django.contrib import admin


class LedgerAdmin(admin.ModelAdmin):
    """Append-only records (the ledger, the audit log): written by the system, read here."""

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False
