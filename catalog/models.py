"""The team's datasets: a dataset, its versions, their files, and the chunked uploads that fill
them (and a job's code folder: jobs.FolderUpload).

The tables are the ones these models had in the jobs app (Meta.db_table): the move
(catalog/migrations/0001_initial.py, jobs/migrations/0019_datasets_to_catalog.py) changed the
models' home, not a row.
"""

import uuid

from django.conf import settings
from django.db import models, transaction
from django.utils import timezone

from core.jsonfield import JSONField


class Dataset(models.Model):
    """A team's named data, in immutable versions. Its files are uploaded (kept as blobs in our
    storage) or live in a bucket of the team's, registered by URI with the team's credentials."""

    UPLOAD = "upload"
    S3 = "s3"
    SOURCES = [(UPLOAD, "Uploaded"), (S3, "S3 bucket")]

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    team = models.ForeignKey("accounts.Team", on_delete=models.CASCADE, related_name="datasets")
    name = models.CharField(max_length=200)
    description = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    source = models.CharField(max_length=10, choices=SOURCES, default=UPLOAD)
    # A registered bucket: where, and the team's credentials (encrypted; never shown back,
    # never passed to a job's process).
    s3_bucket = models.CharField(max_length=255, blank=True)
    s3_prefix = models.CharField(max_length=1024, blank=True)
    s3_endpoint_url = models.CharField(max_length=500, blank=True)
    s3_region = models.CharField(max_length=64, blank=True)
    s3_credentials = models.TextField(blank=True)

    class Meta:
        db_table = "jobs_dataset"
        ordering = ["name"]
        constraints = [models.UniqueConstraint(fields=["team", "name"], name="dataset_name_unique_in_team")]

    def __str__(self):
        return self.name

    @property
    def s3_uri(self):
        return f"s3://{self.s3_bucket}/{self.s3_prefix}".rstrip("/") if self.source == self.S3 else ""

    def latest_version(self):
        return self.versions.filter(state=DatasetVersion.READY).order_by("-number").first()

    @transaction.atomic
    def new_version(self, state=None):
        """An open version holding the latest ready version's files, to add to."""
        locked = Dataset.objects.select_for_update().get(pk=self.pk)
        parent = locked.latest_version()
        number = (locked.versions.aggregate(n=models.Max("number"))["n"] or 0) + 1
        version = DatasetVersion.objects.create(dataset=self, number=number, parent=parent, state=state or DatasetVersion.OPEN)
        if parent is not None:
            DatasetFile.objects.bulk_create(DatasetFile(version=version, path=f.path, size=f.size, sha256=f.sha256, key=f.key) for f in parent.files.all())
        return version


class DatasetVersion(models.Model):
    """One immutable state of a dataset: a manifest of paths, sizes and SHA-256 digests.

    A version is open while files are added to it, then sealed: ready, and never changed again.
    Adding files later makes a new version that shares every unchanged file (the same blobs)."""

    OPEN = "open"
    SCANNING = "scanning"
    READY = "ready"
    FAILED = "failed"
    STATES = [(OPEN, "Open"), (SCANNING, "Scanning"), (READY, "Ready"), (FAILED, "Failed")]

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    dataset = models.ForeignKey(Dataset, on_delete=models.CASCADE, related_name="versions")
    number = models.PositiveIntegerField()
    parent = models.ForeignKey("self", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    state = models.CharField(max_length=10, choices=STATES, default=OPEN)
    error = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    sealed_at = models.DateTimeField(null=True, blank=True)
    file_count = models.PositiveIntegerField(default=0)
    total_bytes = models.PositiveBigIntegerField(default=0)
    claimed_at = models.DateTimeField(null=True, blank=True, help_text="when a worker took up its scan")

    class Meta:
        db_table = "jobs_datasetversion"
        ordering = ["dataset", "-number"]
        constraints = [models.UniqueConstraint(fields=["dataset", "number"], name="dataset_version_number_unique")]

    def __str__(self):
        return f"{self.dataset.name} v{self.number}"

    @property
    def label(self):
        """NAME@N, as specs and the API name a version."""
        return f"{self.dataset.name}@{self.number}"

    @property
    def team_id(self):
        return self.dataset.team_id

    def add_file(self, path, size, sha256, key):
        """Add (or replace) a file of a version being filled (uploads) or scanned (a bucket)."""
        with transaction.atomic():
            version = DatasetVersion.objects.select_for_update().get(pk=self.pk)
            if version.state not in (self.OPEN, self.SCANNING):
                raise ValueError(f"version {version.number} of {version.dataset.name} is {version.state}: it cannot change")
            DatasetFile.objects.update_or_create(version=version, path=path, defaults={"size": size, "sha256": sha256, "key": key})

    def seal(self, at=None):
        """Open (or scanned) to ready: from now on the version never changes."""
        with transaction.atomic():
            version = DatasetVersion.objects.select_for_update().get(pk=self.pk)
            if version.state not in (self.OPEN, self.SCANNING):
                raise ValueError(f"version {version.number} is {version.state}")
            totals = version.files.aggregate(n=models.Count("id"), b=models.Sum("size"))
            DatasetVersion.objects.filter(pk=self.pk).update(
                state=self.READY, sealed_at=at or timezone.now(), file_count=totals["n"], total_bytes=totals["b"] or 0
            )
        self.refresh_from_db()
        return self

    def fail(self, error):
        DatasetVersion.objects.filter(pk=self.pk).update(state=self.FAILED, error=error[:2000])
        self.refresh_from_db()


class DatasetFile(models.Model):
    """One file of a version. key: the blob in our storage (uploaded datasets), or the object's
    key in the team's bucket (registered S3 datasets)."""

    version = models.ForeignKey(DatasetVersion, on_delete=models.CASCADE, related_name="files")
    path = models.CharField(max_length=500)
    key = models.CharField(max_length=1100)
    size = models.PositiveBigIntegerField()
    sha256 = models.CharField(max_length=64)

    class Meta:
        db_table = "jobs_datasetfile"
        ordering = ["path"]
        constraints = [models.UniqueConstraint(fields=["version", "path"], name="dataset_version_file_path_unique")]

    def __str__(self):
        return f"{self.version_id}: {self.path}"


class DatasetUpload(models.Model):
    """One file on its way into an open dataset version (or into a jobs.FolderUpload: a job's code),
    sent in chunks of chunk_size bytes.

    Each chunk is a part of a multipart upload in storage (part n holds the bytes from
    (n - 1) * chunk_size). Chunks arrive in order, but any chunk already received may be sent
    again and replaces its part, so a client that lost an answer just sends it again; received
    is how far the file has arrived, where a resumed upload continues. On completion the parts
    are joined, hashed, kept as a blob under their SHA-256 and added to the version."""

    OPEN = "open"
    COMPLETING = "completing"
    COMPLETE = "complete"
    FAILED = "failed"
    ABORTED = "aborted"
    STATES = [(OPEN, "Open"), (COMPLETING, "Completing"), (COMPLETE, "Complete"), (FAILED, "Failed"), (ABORTED, "Aborted")]
    # What stops a version from being sealed.
    UNFINISHED = (OPEN, COMPLETING)

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    version = models.ForeignKey(DatasetVersion, null=True, blank=True, on_delete=models.CASCADE, related_name="uploads")
    # A job's code folder (jobs/folder_uploads.py) is sent file by file through these same chunked
    # uploads. Named by string: catalog imports nothing of jobs (the layers); the migration graph
    # stays one way too, as catalog's first migration follows jobs' 0018, where these tables began.
    folder = models.ForeignKey("jobs.FolderUpload", null=True, blank=True, on_delete=models.CASCADE, related_name="files")
    path = models.CharField(max_length=1024, help_text="in a version, as catalog.datasets.clean_path makes it; in a folder, as sent")
    size = models.PositiveBigIntegerField()
    sha256 = models.CharField(max_length=64, blank=True, help_text="the client's digest to check, then the file's")
    chunk_size = models.PositiveIntegerField()
    received = models.PositiveBigIntegerField(default=0)
    key = models.CharField(max_length=200, help_text="the incoming object in storage, until it becomes a blob")
    multipart_id = models.CharField(max_length=1024, blank=True, help_text="the storage's multipart upload id")
    parts = JSONField(default=list, blank=True, help_text="[[part number, etag], ...] in order")
    state = models.CharField(max_length=10, choices=STATES, default=OPEN)
    claimed_at = models.DateTimeField(null=True, blank=True, help_text="when a worker took up its completion")
    error = models.TextField(blank=True)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        db_table = "jobs_datasetupload"
        ordering = ["created_at"]
        indexes = [models.Index(fields=["state", "updated_at"])]
        constraints = [
            models.CheckConstraint(
                condition=models.Q(version__isnull=False, folder__isnull=True) | models.Q(version__isnull=True, folder__isnull=False),
                name="dataset_upload_into_a_version_or_a_folder",
            )
        ]

    def __str__(self):
        return f"{self.path} into {self.version or self.folder}"

    def chunk_length(self, offset):
        """How many bytes the chunk at offset must hold: chunk_size, less for the last."""
        return min(self.chunk_size, self.size - offset)

    def part_number(self, offset):
        return offset // self.chunk_size + 1
