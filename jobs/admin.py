from django.contrib import admin

from jobs.models import Artifact, Job, Upload, Utilization


@admin.register(Job)
class JobAdmin(admin.ModelAdmin):
    list_display = ["name", "short_id", "team", "state", "gpus", "created_at", "finished_at"]
    list_filter = ["state", "team"]
    search_fields = ["name", "id"]
    readonly_fields = ["state", "last_seq", "cancel_requested_at", "exit_code", "reason", "restarts"]

    def get_readonly_fields(self, request, obj=None):
        """A job's name and team are what its statements and invoices bill it as, and a worker
        keeps a month's statement while the ledger does not move (billing.usage.month_of): a
        job's are not changed here (a new one's are given)."""
        fields = super().get_readonly_fields(request, obj)
        return fields if obj is None else ["name", "team", *fields]


@admin.register(Upload)
class UploadAdmin(admin.ModelAdmin):
    list_display = ["name", "role", "team", "job", "size", "created_at"]


@admin.register(Artifact)
class ArtifactAdmin(admin.ModelAdmin):
    list_display = ["name", "job", "size", "created_at"]


@admin.register(Utilization)
class UtilizationAdmin(admin.ModelAdmin):
    """Read only: the runner writes the samples."""

    list_display = ["job", "allocation", "started_at", "width", "updated_at"]
    readonly_fields = ["job", "allocation", "started_at", "every", "width", "series", "windows", "updated_at"]

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False
