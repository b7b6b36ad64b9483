from django.contrib import admin

from catalog.models import Dataset, DatasetFile, DatasetUpload, DatasetVersion


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


@admin.register(DatasetUpload)
class DatasetUploadAdmin(admin.ModelAdmin):
    list_display = ["path", "version", "size", "received", "state", "updated_at"]
    list_filter = ["state"]
    readonly_fields = ["version", "folder", "path", "size", "sha256", "chunk_size", "received", "key", "multipart_id", "parts", "state", "error"]
