from django.contrib import admin

from jobs.models import Artifact, Dataset, DatasetFile, Job, Upload


class DatasetFileInline(admin.TabularInline):
    model = DatasetFile
    extra = 0
    readonly_fields = ["path", "key", "size", "sha256"]


@admin.register(Dataset)
class DatasetAdmin(admin.ModelAdmin):
    list_display = ["name", "team", "created_at"]
    list_filter = ["team"]
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
