"""Datasets: made from uploaded files, or registered from a team's own bucket.

Uploaded files are kept as content-addressed blobs, so versions share unchanged files for free.
A registered bucket is scanned once per version: every object's size and SHA-256 go into the
manifest, which staging later checks the bytes against.

Past 500 lines because the chunked uploads live here with the versions they fill: they share the
version's lock (taken first, then the upload's) and the errors the API answers with.
"""

import contextlib
import hashlib
import io
import logging
import re
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from datetime import timedelta

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import CharField, IntegerField, UUIDField
from django.utils import timezone

from catalog import usage
from catalog.models import Dataset, DatasetUpload, DatasetVersion
from core import buckets
from core.buffers import read_buffer
from core.compiled import Param, Read
from core.endpoints import check_endpoint
from core.secrets_box import seal
from core.storage import (
    CHUNK,
    NotFound,
    StorageError,
    blob_key,
    get_storage,
    s3_open_range,
)

log = logging.getLogger(__name__)

S3_URI = re.compile(r"^s3://([a-z0-9][a-z0-9.\-]{1,61}[a-z0-9])(?:/(.*))?$")


class DatasetError(ValueError):
    pass


def clean_path(path):
    """A file's path inside a dataset: relative, '/'-separated, nothing that climbs out."""
    if path is not None and not isinstance(path, str):
        raise DatasetError(f"a file path is text, not {type(path).__name__}")
    path = (path or "").replace("\\", "/").strip()
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if not parts or ".." in parts or any(ord(c) < 32 or 0xD800 <= ord(c) <= 0xDFFF for c in path) or len(path) > 500:
        raise DatasetError(f"{path!r} is not a usable file path")
    return "/".join(parts)


@transaction.atomic
def create_dataset(team, name, files, description=""):
    """A dataset whose first version holds files: {path: bytes or binary file}."""
    if Dataset.objects.filter(team=team, name=name).exists():
        raise DatasetError(f"your team already has a dataset named {name!r}")
    dataset = Dataset.objects.create(team=team, name=name, description=description)
    add_files(dataset, files)
    return dataset


def add_files(dataset, files):
    """A new version: the latest one's files plus (or replaced by) these."""
    version = dataset.new_version()
    storage = get_storage()
    for path, content in files.items():
        stream = io.BytesIO(content) if isinstance(content, bytes) else content
        key, size, sha256 = storage.save_blob(stream)
        version.add_file(clean_path(path), size, sha256, key)
    return version.seal()


def parse_s3_uri(uri):
    match = S3_URI.match((uri or "").strip())
    if not match:
        raise DatasetError("give the bucket as s3://bucket/prefix (a bucket name of 3-63 lowercase letters, digits, dots or dashes)")
    return match.group(1), (match.group(2) or "").strip("/")


@transaction.atomic
def register_s3(team, name, uri, access_key_id, secret_access_key, endpoint_url="", region="", description=""):
    """A dataset whose files live in the team's bucket. Its first version is scanned next."""
    bucket, prefix = parse_s3_uri(uri)
    if Dataset.objects.filter(team=team, name=name).exists():
        raise DatasetError(f"your team already has a dataset named {name!r}")
    dataset = Dataset.objects.create(
        team=team,
        name=name,
        description=description,
        source=Dataset.S3,
        s3_bucket=bucket,
        s3_prefix=prefix,
        s3_endpoint_url=endpoint_url or "",
        s3_region=region or "",
        s3_credentials=seal({"access_key_id": access_key_id, "secret_access_key": secret_access_key}),
    )
    dataset.new_version(state=DatasetVersion.SCANNING)
    return dataset


def rescan(dataset):
    """A new version of a registered dataset, read afresh from its bucket."""
    if dataset.source != Dataset.S3:
        raise DatasetError("only a dataset registered from a bucket can be scanned again")
    return dataset.new_version(state=DatasetVersion.SCANNING)


def update_credentials(dataset, access_key_id, secret_access_key, endpoint_url=None, region=None):
    """New credentials for a registered bucket (a key rotated or revoked), sealed as at
    registration, never shown back; endpoint_url and region change too where given. The
    scanner's and the runners' clients are keyed on the sealed credentials, so the next scan or
    staging reads with the new ones."""
    if dataset.source != Dataset.S3:
        raise DatasetError("only a dataset registered from a bucket has credentials to change")
    changes = {"s3_credentials": seal({"access_key_id": access_key_id, "secret_access_key": secret_access_key})}
    if endpoint_url is not None:
        changes["s3_endpoint_url"] = endpoint_url
    if region is not None:
        changes["s3_region"] = region
    Dataset.objects.filter(pk=dataset.pk).update(**changes)
    dataset.refresh_from_db()
    return dataset


SCAN_WORKERS = 4  # objects hashed at once by a scan


def scan(version):
    """Read every object under the dataset's prefix: path, size and SHA-256 into the manifest.
    The version is sealed when done, or failed with the reason.

    Several objects are read at once (a bucket of many small objects is bound by round trips,
    not bandwidth), each into its thread's reused buffer; the manifest is written in the
    listing's order, so a scan of the same objects always gives the same manifest."""
    try:
        dataset = version.dataset
        prefix = f"{dataset.s3_prefix}/" if dataset.s3_prefix else ""
        # The endpoint is judged again before every scan: its DNS may have changed.
        if reason := check_endpoint(dataset.s3_endpoint_url):
            raise DatasetError(reason)
        client = buckets.team_bucket(str(dataset.pk), dataset.s3_credentials, dataset.s3_endpoint_url, dataset.s3_region)
        # A rescan replaces the copied manifest with what the bucket holds now.
        version.files.all().delete()
        paginator = client.get_paginator("list_objects_v2")
        count = 0
        pool = ThreadPoolExecutor(max_workers=SCAN_WORKERS, thread_name_prefix="scan-read")
        try:
            for page in paginator.paginate(Bucket=dataset.s3_bucket, Prefix=prefix):
                keys = [obj["Key"] for obj in page.get("Contents", []) if not obj["Key"].endswith("/")]
                for key, (size, digest) in zip(keys, pool.map(lambda key: _hash_object(client, dataset.s3_bucket, key), keys)):
                    version.add_file(clean_path(key[len(prefix) :]), size, digest, key)
                    count += 1
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
        if count == 0:
            raise DatasetError(f"there are no objects under s3://{dataset.s3_bucket}/{prefix}")
    except Exception as error:  # noqa: BLE001 - the reason is shown on the dataset's page
        if not DatasetVersion.objects.filter(pk=version.pk).exists():
            log.info("scan of version %s stopped: its dataset was deleted", version.pk)
            return version
        log.warning("scan of %s failed: %s", version, error)
        version.fail(_reason(error))
        return version
    return version.seal()


def _hash_object(client, bucket, key):
    """(size, SHA-256) of one object of a team's bucket, read into this thread's buffer."""
    buffer, digest, size = read_buffer(), hashlib.sha256(), 0
    try:
        stream = s3_open_range(client, bucket, key)
    except NotFound:
        raise DatasetError(f"s3://{bucket}/{key} went away while the bucket was scanned; scan it again") from None
    with stream:
        while n := stream.readinto(buffer):
            digest.update(buffer[:n])
            size += n
    if stream.length is not None and size != stream.length:
        raise DatasetError(f"s3://{bucket}/{key}: the connection closed after {size} of its {stream.length} bytes; scan it again")
    return size, digest.hexdigest()


def _reason(error):
    from botocore.exceptions import ClientError, EndpointConnectionError

    if isinstance(error, ClientError):
        code = error.response.get("Error", {}).get("Code", "")
        known = {
            "NoSuchBucket": "the bucket does not exist",
            "InvalidAccessKeyId": "the access key is not known to that endpoint",
            "SignatureDoesNotMatch": "the secret key does not match the access key",
            "AccessDenied": "the credentials may not read that bucket",
        }
        return known.get(code, f"the bucket refused: {code}")
    if isinstance(error, EndpointConnectionError):
        return "the endpoint cannot be reached"
    return str(error)


def claim_scans(limit=1):
    """Versions waiting to be scanned, claimed (one worker each)."""
    claimed = []
    for version in DatasetVersion.objects.filter(state=DatasetVersion.SCANNING, claimed_at__isnull=True)[:limit]:
        if DatasetVersion.objects.filter(pk=version.pk, claimed_at__isnull=True).update(claimed_at=timezone.now()) == 1:
            claimed.append(version)
    return claimed


def _ready_versions():
    return DatasetVersion.objects.select_related("dataset").filter(
        dataset__team_id=Param("team", UUIDField()), dataset__name=Param("name", CharField()), state=DatasetVersion.READY
    )


MAX_VERSION_NUMBER = 2**31 - 1  # DatasetVersion.number, a PositiveIntegerField (PostgreSQL's integer)

# A ready version of a dataset of the team by its name: the latest, or by its number (SQL made once).
READY_LATEST = Read(lambda: _ready_versions().order_by("-number")[:1])
READY_NUMBER = Read(lambda: _ready_versions().filter(number=Param("number", IntegerField()))[:1])


def resolve(team, ref):
    """The version a job should pin for a dataset named by name or id, with an optional
    @version: "digits", "digits@2". Raises DatasetError."""
    ref = str(ref).strip()
    name, _, number = ref.rpartition("@") if "@" in ref else (ref, "", "")
    # What a spec names most often, a ready version of a dataset of the team by its name, in
    # one query with its dataset; anything else (an id, a version not ready, no such dataset)
    # the way below, with its reasons.
    # A number of ASCII digits ("²" is a digit to isdigit, not to int) that a version may have
    # (a larger one is no version: SQLite cannot even be asked for it).
    digits = number.isascii() and number.isdigit()
    known = digits and int(number) <= MAX_VERSION_NUMBER
    if not number or known:
        found = READY_NUMBER.first(team=team.pk, name=name, number=int(number)) if number else READY_LATEST.first(team=team.pk, name=name)
        if found is not None:
            return found
    datasets = Dataset.objects.filter(team=team)
    dataset = datasets.filter(name=name).first()
    if dataset is None:
        import uuid

        try:
            dataset = datasets.filter(pk=uuid.UUID(name)).first()
        except ValueError:
            dataset = None
    if dataset is None:
        raise DatasetError(f"no dataset {name!r} in your team")
    if number:
        if not digits:
            raise DatasetError(f"{ref!r}: the version after @ must be a number")
        version = dataset.versions.filter(number=int(number)).first() if known else None
        if version is None or version.state != DatasetVersion.READY:
            raise DatasetError(f"{dataset.name} has no ready version {number}")
        return version
    version = dataset.latest_version()
    if version is None:
        raise DatasetError(f"{dataset.name} has no ready version yet")
    return version


# Datasets made in the browser or the API: an open version filled by chunked uploads, sealed ---

SHA256 = re.compile(r"^[0-9a-f]{64}$")
# S3 keeps at most 10,000 parts in one object; a chunk is a part.
MAX_PARTS = 10_000


class UploadConflict(DatasetError):
    """The request does not fit the state of the upload or version now (HTTP 409). received,
    where known, is how far the upload has arrived: a client continues from there."""

    def __init__(self, message, received=None):
        super().__init__(message)
        self.received = received


def clean_name(name):
    """A dataset's name as jobs and specs refer to it ("name" or "name@2")."""
    name = (name or "").strip()
    if not name:
        raise DatasetError("give the dataset a name")
    if len(name) > 200:
        raise DatasetError("a dataset's name has at most 200 characters")
    if "@" in name or any(ord(c) < 32 for c in name):
        raise DatasetError("a dataset's name cannot hold '@' (it picks a version: name@2) or control characters")
    return name


def check_name_free(team, name):
    if Dataset.objects.filter(team=team, name=name).exists():
        raise DatasetError(f"your team already has a dataset named {name!r}")


def create_upload_dataset(team, name, description=""):
    """A dataset whose version 1 is open, for files to be uploaded into."""
    name = clean_name(name)
    try:
        with transaction.atomic():
            check_name_free(team, name)
            dataset = Dataset.objects.create(team=team, name=name, description=description or "")
            dataset.new_version()
    except IntegrityError:  # the same name, created at the same moment by someone else
        raise DatasetError(f"your team already has a dataset named {name!r}") from None
    return dataset


def open_version(dataset):
    """The version to add files to: the dataset's open one, or a new one holding the latest
    ready version's files (so unchanged files are shared). Returns (version, created)."""
    if dataset.source != Dataset.UPLOAD:
        raise DatasetError("a registered bucket's dataset changes by scanning it again, not by uploading")
    with transaction.atomic():
        Dataset.objects.select_for_update().get(pk=dataset.pk)
        version = dataset.versions.filter(state=DatasetVersion.OPEN).order_by("-number").first()
        if version is not None:
            return version, False
        return dataset.new_version(), True


def _locked_open_version(version):
    """The version, locked (call inside a transaction); UploadConflict unless it is open."""
    locked = DatasetVersion.objects.select_for_update().select_related("dataset").get(pk=version.pk)
    if locked.state != DatasetVersion.OPEN:
        raise UploadConflict(
            f"version {locked.number} of {locked.dataset.name} is {locked.get_state_display().lower()}: it cannot change; open a new version to add files"
        )
    return locked


def _clean_sha256(value):
    value = (value or "").strip().lower()
    if value and not SHA256.match(value):
        raise DatasetError("sha256 must be 64 hexadecimal digits")
    return value


def start_upload(version, path, size, user=None, sha256=""):
    """A chunked upload of one file into an open version. Starting a file's upload again (its
    client lost track of the first) aborts the earlier, unfinished one."""
    path = clean_path(path)
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise DatasetError("size must be the file's size in bytes, a whole number")
    chunk_size = settings.E31_UPLOAD_CHUNK_BYTES
    if size > chunk_size * MAX_PARTS:
        raise DatasetError(f"a file may have at most {chunk_size * MAX_PARTS:,} bytes ({MAX_PARTS:,} chunks of {chunk_size:,})")
    sha256 = _clean_sha256(sha256)
    if version.dataset.source != Dataset.UPLOAD:
        raise DatasetError("files are uploaded only into uploaded datasets: a registered bucket's dataset changes by scanning it again")
    with transaction.atomic():
        _locked_open_version(version)  # refuse early, before storage is touched
    upload_pk = uuid.uuid4()
    key = f"incoming/{upload_pk}"
    storage = get_storage()
    # An empty file has no chunks and needs no multipart upload.
    multipart_id = storage.start_multipart(key) if size else ""
    try:
        with transaction.atomic():
            _locked_open_version(version)
            superseded = list(version.uploads.select_for_update().filter(path=path, state=DatasetUpload.OPEN))
            DatasetUpload.objects.filter(pk__in=[u.pk for u in superseded]).update(
                state=DatasetUpload.ABORTED, error="another upload of the same path took its place", updated_at=timezone.now()
            )
            upload = DatasetUpload.objects.create(
                id=upload_pk,
                version=version,
                path=path,
                size=size,
                sha256=sha256,
                chunk_size=chunk_size,
                key=key,
                multipart_id=multipart_id,
                created_by=user,
            )
    except BaseException:
        if multipart_id:
            _quietly(storage.abort_multipart, key, multipart_id)
        raise
    # Storage is tidied after commit: the rows already say these uploads are over.
    for old in superseded:
        _discard(old)
    return upload


def put_chunk(upload, offset, data):
    """Store the chunk at offset (a multiple of chunk_size, not past what was received: a chunk
    received before is replaced). Returns the upload, with received updated."""
    if upload.state != DatasetUpload.OPEN:
        raise UploadConflict(_not_open(upload))
    if offset < 0 or offset % upload.chunk_size:
        raise UploadConflict(f"offset {offset} is not a multiple of the chunk size {upload.chunk_size}", upload.received)
    if offset >= upload.size:
        raise DatasetError(f"offset {offset} is past the end of the file ({upload.size} bytes)")
    if offset > upload.received:
        raise UploadConflict(f"offset {offset} leaves a gap: {upload.received} bytes have arrived; send the chunk at {upload.received}", upload.received)
    expected = upload.chunk_length(offset)
    if len(data) != expected:
        what = "the last chunk" if offset + upload.chunk_size >= upload.size else "every chunk but the last"
        raise DatasetError(f"the chunk at {offset} has {len(data)} bytes; {what} must have {expected}")
    number = upload.part_number(offset)
    try:
        etag = get_storage().put_part(upload.key, upload.multipart_id, number, data)
    except NotFound:
        upload.refresh_from_db()
        raise UploadConflict(_not_open(upload) if upload.state != DatasetUpload.OPEN else "the upload is gone from storage; start it again") from None
    with transaction.atomic():
        locked = DatasetUpload.objects.select_for_update().get(pk=upload.pk)
        if locked.state != DatasetUpload.OPEN:
            raise UploadConflict(_not_open(locked))
        parts = dict(locked.parts)
        parts[number] = etag
        locked.parts = sorted([n, e] for n, e in parts.items())
        locked.received = max(locked.received, offset + len(data))
        locked.save(update_fields=["parts", "received", "updated_at"])
    return locked


# Completing an upload: joining and hashing read the whole file, which for gigabytes outlasts an
# HTTP request. The request checks what it can at once and queues the completion (COMPLETING,
# unclaimed); a small file is then completed within the request, a larger one by the scheduler's
# worker (claim_completions, finish_completion) while its client polls the upload.

# A claim this old on an upload still completing is a worker that died: released, taken again.
# A live worker renews its claim every CLAIM_RENEW_SECONDS while it reads.
COMPLETION_CLAIM_TIMEOUT = timedelta(hours=1)
CLAIM_RENEW_SECONDS = 300


def completes_inline(size, inline_limit):
    """Whether a file of size bytes is completed within the request (else by the worker)."""
    return size <= inline_limit


def complete_upload(upload, sha256=""):
    """Check the upload can complete (open, every byte arrived, the client's SHA-256 well formed
    and the same as any given before) and queue its completion. A file up to
    E31_UPLOAD_INLINE_COMPLETE_BYTES is completed here and now (complete, or DatasetError);
    a larger one is returned COMPLETING, for the worker. Completing an upload completed or
    queued already just returns it."""
    sha256 = _clean_sha256(sha256)
    if sha256 and upload.sha256 and sha256 != upload.sha256:
        raise DatasetError("this sha256 differs from the one given when the upload started")
    inline = completes_inline(upload.size, settings.E31_UPLOAD_INLINE_COMPLETE_BYTES)
    with transaction.atomic():
        # The version's lock first, as sealing takes it: a version is never sealed while one of
        # its files is completing (COMPLETING is unfinished).
        DatasetVersion.objects.select_for_update().filter(pk=upload.version_id).first()
        locked = DatasetUpload.objects.select_for_update().get(pk=upload.pk)
        if locked.state in (DatasetUpload.COMPLETE, DatasetUpload.COMPLETING):
            return locked
        _locked_open_version(locked.version)
        if locked.state != DatasetUpload.OPEN:
            raise UploadConflict(_not_open(locked))
        if locked.received < locked.size:
            raise UploadConflict(f"only {locked.received} of {locked.size} bytes have arrived; send the rest first", locked.received)
        locked.state = DatasetUpload.COMPLETING
        locked.sha256 = sha256 or locked.sha256  # the worker checks it
        locked.error = ""
        # Completed here: claimed at once, so no worker takes it meanwhile (if this process dies,
        # the claim grows stale and is released to the worker).
        locked.claimed_at = timezone.now() if inline else None
        locked.save(update_fields=["state", "sha256", "error", "claimed_at", "updated_at"])
    if not inline:
        return locked
    return finish_completion(locked)


def claim_completions(limit=1):
    """Uploads queued for completion, oldest first, claimed (one worker each)."""
    claimed = []
    queued = DatasetUpload.objects.filter(state=DatasetUpload.COMPLETING, claimed_at__isnull=True).order_by("updated_at")
    for upload in queued[:limit]:
        now = timezone.now()
        if DatasetUpload.objects.filter(pk=upload.pk, state=DatasetUpload.COMPLETING, claimed_at__isnull=True).update(claimed_at=now) == 1:
            upload.claimed_at = now
            claimed.append(upload)
    return claimed


def release_stale_claims(older_than):
    """Completions claimed before older_than and still not done (their worker died): claimed
    again by the next worker. Returns how many."""
    return DatasetUpload.objects.filter(state=DatasetUpload.COMPLETING, claimed_at__lt=older_than).update(claimed_at=None, updated_at=timezone.now())


def finish_completion(upload):
    """Complete a claimed upload: join the chunks, hash them, keep the bytes as a blob and add
    the file to its version; returns the upload, complete. Bytes that are not what was announced
    fail it with the reason (DatasetError, its storage freed); trouble with storage or the
    database opens it again, to be completed again (the joined object is found, not joined
    twice), and is raised."""
    try:
        key, digest = _assemble(upload, upload.sha256, renew=_claim_renewer(upload))
    except DatasetError as error:
        DatasetUpload.objects.filter(pk=upload.pk, state=DatasetUpload.COMPLETING).update(
            state=DatasetUpload.FAILED, error=str(error), updated_at=timezone.now()
        )
        _discard(upload)
        raise
    except BaseException:
        _reopen(upload)
        raise
    try:
        with transaction.atomic():
            DatasetVersion.objects.select_for_update().filter(pk=upload.version_id).first()
            locked = DatasetUpload.objects.select_for_update(of=("self",)).select_related("version").get(pk=upload.pk)
            if locked.state == DatasetUpload.COMPLETE:  # by another worker, after a claim grew stale
                return locked
            if locked.state != DatasetUpload.COMPLETING:
                raise UploadConflict(_not_open(locked))
            locked.version.add_file(locked.path, locked.size, digest, key)
            DatasetUpload.objects.filter(pk=locked.pk).update(state=DatasetUpload.COMPLETE, sha256=digest, updated_at=timezone.now())
    except (UploadConflict, DatasetUpload.DoesNotExist):
        raise
    except BaseException:
        _reopen(upload)
        raise
    # The incoming object goes only now: until the file is in the version, completing again
    # must find the joined bytes.
    _quietly(get_storage().delete, upload.key)
    locked.refresh_from_db()
    return locked


def _claim_renewer(upload):
    """A function to call while reading: renews the upload's claim now and then, so that a long
    read is not taken for a dead worker's."""
    renewed = time.monotonic()

    def renew():
        nonlocal renewed
        if time.monotonic() - renewed >= CLAIM_RENEW_SECONDS:
            renewed = time.monotonic()
            DatasetUpload.objects.filter(pk=upload.pk, state=DatasetUpload.COMPLETING).update(claimed_at=timezone.now())

    return renew


def _reopen(upload):
    """After trouble with storage or the database mid-way: open again, so that completing once
    more finishes the job (the joined object is found and not joined twice)."""
    DatasetUpload.objects.filter(pk=upload.pk, state=DatasetUpload.COMPLETING).update(
        state=DatasetUpload.OPEN, claimed_at=None, error="storage failed while completing it: complete it again", updated_at=timezone.now()
    )


def _assemble(upload, expected_sha256, renew=lambda: None):
    """The upload's bytes kept as a blob: (blob key, sha256). DatasetError if they are not what
    was announced.

    The joined object is read once: its SHA-256 is the check that the blob holds what its name
    says, and the blob is made from those same bytes without reading them again (a copy inside
    S3, a hard link in the local folder)."""
    storage = get_storage()
    if upload.size == 0:
        key, _, digest = storage.save_blob(io.BytesIO(b""))
        return key, digest
    # A retried completion may find the parts joined already.
    if not storage.exists(upload.key):
        storage.complete_multipart(upload.key, upload.multipart_id, upload.parts)
    digest, size = hashlib.sha256(), 0
    with closing(storage.open(upload.key)) as body:
        for chunk in iter(lambda: body.read(CHUNK), b""):
            digest.update(chunk)
            size += len(chunk)
            renew()
    digest = digest.hexdigest()
    if size != upload.size:
        raise DatasetError(f"{upload.path}: the joined file has {size} bytes, not the {upload.size} announced; upload it again")
    if expected_sha256 and digest != expected_sha256:
        raise DatasetError(f"{upload.path}: its SHA-256 is {digest}, not the {expected_sha256} given: the bytes changed on the way; upload it again")
    key = blob_key(digest)
    try:
        # Kept already: touched, so that the blob sweep sees it young until the file is in the version.
        storage.touch(key)
    except NotFound:
        storage.copy(upload.key, key)  # a new object: young too
        if storage.size(key) != size:
            storage.delete(key)
            raise StorageError(f"{upload.path}: the copy into the blob store has a different size; complete it again") from None
    return key, digest


def abort_upload(upload, reason="aborted by its client"):
    """Give up an unfinished upload and free what it held in storage."""
    if DatasetUpload.objects.filter(pk=upload.pk, state=DatasetUpload.OPEN).update(state=DatasetUpload.ABORTED, error=reason, updated_at=timezone.now()) != 1:
        upload.refresh_from_db()
        if upload.state != DatasetUpload.ABORTED:
            raise UploadConflict(_not_open(upload))
        return upload
    _discard(upload)
    upload.refresh_from_db()
    return upload


def purge_stale_uploads(older_than, claims_older_than=None):
    """Abort uploads nobody has sent a chunk to since older_than; returns how many. A completion
    claimed before claims_older_than (by default COMPLETION_CLAIM_TIMEOUT ago) and not done is
    released, for a worker to take again; one queued or claimed is never reopened nor aborted.

    A folder's files (a job's code sent ahead of its form, jobs/folder_uploads.py) are judged by
    their folder's clock, which any chunk of any of its files sets: a file waiting its turn in a
    folder still being sent is not abandoned. The folders' rows are jobs' to delete
    (jobs.folder_uploads.purge_stale_uploads calls this, then does)."""
    from django.db.models import Q

    released = release_stale_claims(claims_older_than or timezone.now() - COMPLETION_CLAIM_TIMEOUT)
    if released:
        log.warning("released %d upload completion(s) whose worker stopped part-way", released)
    count = 0
    stale = Q(folder__isnull=True, updated_at__lt=older_than) | Q(folder__isnull=False, folder__updated_at__lt=older_than)
    for upload in DatasetUpload.objects.filter(stale, state=DatasetUpload.OPEN):
        with contextlib.suppress(UploadConflict):
            abort_upload(upload, "abandoned: no chunk arrived for too long")
            count += 1
    return count


def seal_version(version):
    """Open to ready: the version never changes again. Refused while a file's upload is still
    unfinished (abort it, or complete it), and for a version without files."""
    with transaction.atomic():
        locked = _locked_open_version(version)
        unfinished = list(locked.uploads.filter(state__in=DatasetUpload.UNFINISHED).values_list("path", flat=True))
        if unfinished:
            shown = ", ".join(unfinished[:5]) + (f" and {len(unfinished) - 5} more" if len(unfinished) > 5 else "")
            raise UploadConflict(f"{len(unfinished)} upload(s) are not finished: {shown}; complete or abort them first")
        if not locked.files.exists():
            raise DatasetError("the version has no files yet: upload at least one before sealing it")
        return locked.seal()


def _not_open(upload):
    reason = f": {upload.error}" if upload.error else ""
    return f"the upload of {upload.path} is {upload.get_state_display().lower()}{reason}"


def _discard(upload):
    """Free the storage an upload that will not complete held."""
    storage = get_storage()
    if upload.multipart_id:
        _quietly(storage.abort_multipart, upload.key, upload.multipart_id)
    _quietly(storage.delete, upload.key)


# Deleting a dataset ------------------------------------------------------------------------------


class DatasetInUse(UploadConflict):
    """Unfinished jobs pin versions of the dataset (HTTP 409)."""


def in_use_refusal(name, jobs):
    """None if no unfinished job pins the dataset, else the reason, naming the jobs: jobs are
    (name, short id, state), oldest first."""
    if not jobs:
        return None
    shown = ", ".join(f"{job_name} ({short_id}, {state})" for job_name, short_id, state in jobs[:5])
    if len(jobs) > 5:
        shown += f" and {len(jobs) - 5} more"
    return f"the dataset {name} is used by {len(jobs)} unfinished job(s): {shown}; it can be deleted once they have finished (or are cancelled)"


def delete_dataset(dataset):
    """Delete the dataset with its versions, manifests and unfinished uploads (their storage is
    freed); refused (DatasetInUse) while an unfinished job pins one of its versions. Finished
    jobs keep the name of what they used (Job.train_label) and lose the link to it. Blobs stay
    (other datasets and jobs share them: the blob sweep frees those nothing refers to), and a
    registered bucket's objects are the team's: never touched. Returns how many versions went."""
    with transaction.atomic():
        if not Dataset.objects.select_for_update().filter(pk=dataset.pk).exists():
            raise DatasetError(f"{dataset.name} is already deleted")
        # The versions locked first: a job pinning one of them now waits for this to end.
        version_ids = list(DatasetVersion.objects.select_for_update().filter(dataset=dataset).values_list("pk", flat=True))
        reason = in_use_refusal(dataset.name, usage.unfinished_users(version_ids))
        if reason:
            raise DatasetInUse(reason)
        unfinished = list(DatasetUpload.objects.select_for_update().filter(version__in=version_ids, state__in=DatasetUpload.UNFINISHED))
        completing = [u.path for u in unfinished if u.state == DatasetUpload.COMPLETING]
        if completing:
            raise UploadConflict(f"the upload of {completing[0]} is being completed; delete the dataset once it is done")
        # A queryset's delete leaves the instance its id, for the audit log.
        Dataset.objects.filter(pk=dataset.pk).delete()
    for upload in unfinished:
        _discard(upload)
    return len(version_ids)


def _quietly(action, *args):
    # Tidying only: an upload or object already gone is what we wanted.
    try:
        action(*args)
    except Exception as error:  # noqa: BLE001
        log.info("tidying %s: %s", args[0], error)


def summarize(dataset):
    """A dataset at a glance, from its versions (prefetched, or read here): its versions newest
    first, the latest ready one, an open one, and its state as lists show it: ready once any
    version is, else the state of its newest version."""
    versions = sorted(dataset.versions.all(), key=lambda v: -v.number)
    latest = next((v for v in versions if v.state == DatasetVersion.READY), None)
    open_version = next((v for v in versions if v.state == DatasetVersion.OPEN), None)
    state = DatasetVersion.READY if latest else (versions[0].state if versions else DatasetVersion.OPEN)
    return {"versions": versions, "latest": latest, "open": open_version, "state": state}
