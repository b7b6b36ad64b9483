"""The API's shapes of datasets, dataset versions and uploads: DRF serializers, the one source of
both the JSON the views answer (catalog.api) and the OpenAPI schema, as jobs.serializers is for
jobs (the building blocks: core.serializers). Also here: the request bodies of the datasets API.
"""

from django.db.models import Prefetch
from django.urls import reverse
from drf_spectacular.utils import extend_schema_serializer, inline_serializer
from rest_framework import serializers as s

from catalog import datasets
from catalog.models import Dataset, DatasetUpload, DatasetVersion
from core.serializers import DirectSerializer, Facts, FactsSerializer, Moment, absolute_url, nullable_str

# Datasets -------------------------------------------------------------------------------------


class UploadFacts(Facts):
    def __init__(self, upload, request):
        super().__init__(upload)
        self.sha256 = upload.sha256 or None
        self.url = absolute_url(request, "api:dataset-upload", upload.pk)
        self.complete_url = absolute_url(request, "api:dataset-upload-complete", upload.pk)


@extend_schema_serializer(component_name="Upload")
class DatasetUploadSerializer(FactsSerializer):
    facts_class = UploadFacts

    id = s.UUIDField()
    path = s.CharField()
    size = s.IntegerField()
    sha256 = s.CharField(allow_null=True)
    chunk_size = s.IntegerField()
    received = s.IntegerField(help_text="Bytes arrived so far: send the next chunk at this offset.")
    state = s.CharField()
    error = s.CharField(allow_blank=True, allow_null=True)
    url = s.URLField()
    complete_url = s.URLField()


class DatasetFileSerializer(DirectSerializer):
    path = s.CharField()
    size = s.IntegerField()
    sha256 = s.CharField()


class VersionFacts(Facts):
    def __init__(self, version, request):
        super().__init__(version)
        dataset_id, number = version.dataset_id, version.number
        self.open_files = None
        if version.state == DatasetVersion.OPEN:  # its counts are kept once it is sealed
            self.open_files = list(version.files.all())
            self.files, self.bytes = len(self.open_files), sum(f.size for f in self.open_files)
            self.uploads_url = request.build_absolute_uri(reverse("api:dataset-uploads", args=[dataset_id, number]))
            self.seal_url = request.build_absolute_uri(reverse("api:dataset-seal", args=[dataset_id, number]))
            self.upload_page = request.build_absolute_uri(reverse("datasets:upload", args=[dataset_id, number]))
        else:
            self.files, self.bytes = version.file_count, version.total_bytes
        self.parent = version.parent.number if version.parent_id else None
        self.url = request.build_absolute_uri(reverse("api:dataset-version", args=[dataset_id, number]))

    # Read only where the manifest is shown (DatasetVersionManifestSerializer).

    @property
    def manifest(self):
        return self.open_files if self.open_files is not None else self.obj.files.all()

    @property
    def uploads(self):
        return self.obj.uploads.filter(state__in=DatasetUpload.UNFINISHED)


class DatasetVersionSerializer(FactsSerializer):
    facts_class = VersionFacts

    number = s.IntegerField()
    state = s.CharField()
    error = s.CharField(allow_blank=True, allow_null=True)
    files = s.IntegerField()
    bytes = s.IntegerField()
    parent = s.IntegerField(allow_null=True)
    created_at = Moment()
    sealed_at = Moment(allow_null=True)
    url = s.URLField()
    uploads_url = s.URLField(required=False, help_text="Open versions only.")
    seal_url = s.URLField(required=False, help_text="Open versions only.")
    upload_page = s.URLField(required=False, help_text="Open versions only: the page to upload files from a browser.")


class DatasetVersionManifestSerializer(DatasetVersionSerializer):
    manifest = DatasetFileSerializer(many=True)
    uploads = DatasetUploadSerializer(many=True, help_text="The version's unfinished uploads.")


class DatasetFacts(Facts):
    def __init__(self, dataset, request):
        super().__init__(dataset)
        summary = datasets.summarize(dataset)
        latest, open_version = summary["latest"], summary["open"]
        self.state = summary["state"]
        self.latest_version = latest.number if latest else None
        self.files = latest.file_count if latest else 0
        self.bytes = latest.total_bytes if latest else 0
        self.open_version = open_version.number if open_version else None
        self.url = absolute_url(request, "api:dataset", dataset.pk)
        self.page = absolute_url(request, "datasets:detail", dataset.pk)
        if dataset.source == Dataset.S3:  # else no s3 at all: the field is left out
            # The credentials are stored encrypted and never shown back, here or anywhere.
            self.s3 = {"uri": dataset.s3_uri, "endpoint_url": dataset.s3_endpoint_url, "region": dataset.s3_region, "credentials": "stored"}
        self.versions = summary["versions"]


class DatasetSerializer(FactsSerializer):
    facts_class = DatasetFacts

    id = s.UUIDField()
    name = s.CharField()
    description = s.CharField(allow_blank=True)
    source = s.CharField()
    created_at = Moment()
    state = s.CharField()
    latest_version = s.IntegerField(allow_null=True)
    files = s.IntegerField()
    bytes = s.IntegerField()
    open_version = s.IntegerField(allow_null=True)
    url = s.URLField()
    page = s.URLField()
    s3 = inline_serializer(
        name="DatasetS3",
        required=False,
        help_text="A registered bucket's only.",
        fields={"uri": s.CharField(), "endpoint_url": nullable_str(), "region": nullable_str(), "credentials": s.CharField()},
    )

    @staticmethod
    def prefetch(queryset):
        """A queryset of datasets with the versions the summary reads, newest first."""
        return queryset.prefetch_related(Prefetch("versions", DatasetVersion.objects.order_by("-number")))


class DatasetDetailSerializer(DatasetSerializer):
    versions = DatasetVersionSerializer(many=True)


# Request bodies -------------------------------------------------------------------------------

DatasetCreate = inline_serializer(
    name="DatasetCreate",
    fields={
        "name": s.CharField(max_length=200, help_text="Jobs name it: name, or name@2 for version 2."),
        "description": s.CharField(required=False, allow_blank=True),
    },
)
DatasetS3Create = inline_serializer(
    name="DatasetS3Create",
    fields={
        "name": s.CharField(max_length=200),
        "description": s.CharField(required=False, allow_blank=True),
        "uri": s.CharField(help_text="s3://bucket/prefix"),
        "endpoint_url": s.URLField(required=False, help_text="Blank: AWS."),
        "region": s.CharField(required=False, allow_blank=True),
        "access_key_id": s.CharField(),
        "secret_access_key": s.CharField(help_text="Stored encrypted, never shown back."),
    },
)
DatasetCredentials = inline_serializer(
    name="DatasetCredentials",
    fields={
        "access_key_id": s.CharField(),
        "secret_access_key": s.CharField(help_text="Stored encrypted, never shown back."),
        "endpoint_url": s.URLField(required=False, allow_blank=True, help_text="Blank: AWS. Left out: unchanged."),
        "region": s.CharField(required=False, allow_blank=True, help_text="Left out: unchanged."),
        "rescan": s.BooleanField(required=False, help_text="Scan the bucket again with the new credentials (a new version)."),
    },
)
UploadStart = inline_serializer(
    name="UploadStart",
    fields={
        "path": s.CharField(help_text="The file's path in the dataset."),
        "size": s.IntegerField(min_value=0, help_text="In bytes."),
        "sha256": s.CharField(required=False, allow_blank=True, help_text="Checked on completion if given."),
    },
)
UploadComplete = inline_serializer(name="UploadComplete", fields={"sha256": s.CharField(required=False, allow_blank=True)})
