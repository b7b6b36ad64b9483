from django.contrib import admin

from jobs.models import (
    Artifact,
    Dataset,
    DatasetFile,
    DatasetUpload,
    DatasetVersion,
    Job,
    Upload,
    Utilization,
)


class DatasetFileInline(admin.TabularInline):
    model = DatasetFile
    extra = 0
    readonly_fields = ["path", "key", "size", "sha256"]
    can_delete = False

    def has_add_permission(self, request, obj=None):
        return False  # versions are immutable: files come in through uploads and scans


@admin.register(Dataset)
class DatasetAdmin(admin.ModelAdmin):
    list_display = ["name", "team", "source", "created_at"]
    list_filter = ["team", "source"]
    exclude = ["s3_credentials"]


@admin.register(DatasetVersion)
class DatasetVersionAdmin(admin.ModelAdmin):
    list_display = ["dataset", "number", "state", "file_count", "total_bytes", "sealed_at"]
    list_filter = ["state"]
    readonly_fields = ["dataset", "number", "parent", "state", "error", "sealed_at", "file_count", "total_bytes", "claimed_at"]
    inlines = [DatasetFileInline]


@admin.register(Job)
class JobAdmin(admin.ModelAdmin):
    list_display = ["name", "short_id", "team", "state", "gpus", "created_at", "finished_at"]
    list_filter = ["state", "team"]
    search_fields = ["name", "id"]
    readonly_fields = ["state", "last_seq", "cancel_requested_at", "exit_code", "reason", "restarts"]


@admin.register(Upload)
class UploadAdmin(admin.ModelAdmin):
    list_display = ["name", "role", "team", "job", "size", "created_at"]


@admin.register(Artifact)
class ArtifactAdmin(admin.ModelAdmin):
    list_display = ["name", "job", "size", "created_at"]


@admin.register(DatasetUpload)
class DatasetUploadAdmin(admin.ModelAdmin):
    list_display = ["path", "version", "size", "received", "state", "updated_at"]
    list_filter = ["state"]
    readonly_fields = ["version", "folder", "path", "size", "sha256", "chunk_size", "received", "key", "multipart_id", "parts", "state", "error"]


@admin.register(Utilization)
class UtilizationAdmin(admin.ModelAdmin):
    """Read only: the runner writes the samples."""

    list_display = ["job", "allocation", "started_at", "width", "updated_at"]
    readonly_fields = ["job", "allocation", "started_at", "every", "width", "series", "windows", "updated_at"]

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False
