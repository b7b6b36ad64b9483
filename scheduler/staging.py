"""Staging: putting a job's work and data where its compute is, as a declared, verified step.

A job's manifest lists every file it needs (its uploaded work and data, the files of its
dataset versions) with size and SHA-256. A runner stages the manifest into its content-addressed
cache (scheduler.cache.BlobCache), several files at once and each large file in parallel parts,
checking every file's digest; what the cache already holds moves no bytes. At launch the job's
folder is made of hard links into the cache.
"""

import hashlib
import logging
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from functools import lru_cache
from pathlib import PurePosixPath

from e31web.storage import CHUNK, NotFound, get_storage

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Item:
    dest: str  # relative to the job's folder: "code/.../train.py", "data/train/part-0.csv"
    size: int
    sha256: str
    source: tuple  # ("storage", key) or ("s3", dataset_id, object_key)
    role: str  # "code", "train", "heldout"


class StagingError(Exception):
    pass


def job_manifest(job):
    """Every file the job needs, from its uploads and the dataset versions it pinned."""
    items = []
    for upload in job.uploads.all():
        folder = "code" if upload.role == "code" else f"data/{upload.role}"
        items.append(Item(f"{folder}/{upload.name}", upload.size, upload.sha256, ("storage", upload.key), upload.role))
    for role, version in (("train", job.train_version), ("heldout", job.heldout_version)):
        if version is None:
            continue
        dataset = version.dataset
        for f in version.files.all():
            source = ("s3", str(dataset.pk), f.key) if dataset.source == dataset.S3 else ("storage", f.key)
            items.append(Item(f"data/{role}/{f.path}", f.size, f.sha256, source, role))
    return items


def manifest_digests(items):
    return {item.sha256 for item in items}


# Where the bytes come from -------------------------------------------------------------------


@lru_cache(maxsize=64)
def _team_bucket(dataset_id, credentials_token, endpoint_url, region):
    """A client for a team's registered bucket, with its (decrypted) credentials. These stay in
    the runner: a job's environment is built from scratch without them."""
    import boto3
    from botocore.config import Config

    from e31web.secrets_box import unseal

    credentials = unseal(credentials_token) if credentials_token else {}
    return boto3.client(
        "s3",
        endpoint_url=endpoint_url or None,
        aws_access_key_id=credentials.get("access_key_id"),
        aws_secret_access_key=credentials.get("secret_access_key"),
        region_name=region or "us-east-1",
        config=Config(signature_version="s3v4", s3={"addressing_style": "path"}, retries={"max_attempts": 5, "mode": "standard"}),
    )


def team_bucket_client(dataset):
    return _team_bucket(str(dataset.pk), dataset.s3_credentials, dataset.s3_endpoint_url, dataset.s3_region)


def fetch(item, dest, datasets):
    """Bring one file's bytes to dest (a local path)."""
    kind = item.source[0]
    if kind == "storage":
        try:
            get_storage().download(item.source[1], dest)
        except NotFound:
            raise StagingError(f"{item.dest}: the stored object is missing") from None
        return
    dataset = datasets[item.source[1]]
    from boto3.s3.transfer import TransferConfig
    from botocore.exceptions import ClientError

    config = TransferConfig(multipart_threshold=16 * CHUNK, multipart_chunksize=16 * CHUNK, max_concurrency=8)
    try:
        team_bucket_client(dataset).download_file(dataset.s3_bucket, item.source[2], str(dest), Config=config)
    except ClientError as error:
        code = error.response.get("Error", {}).get("Code")
        if code in ("404", "NoSuchKey", "NotFound"):
            raise StagingError(f"{item.dest}: s3://{dataset.s3_bucket}/{item.source[2]} is missing") from None
        raise StagingError(f"{item.dest}: the bucket refused: {code}") from None


def verify(path, item):
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(CHUNK), b""):
            digest.update(chunk)
            size += len(chunk)
    if size != item.size:
        raise StagingError(f"{item.dest}: expected {item.size} bytes, got {size}")
    if digest.hexdigest() != item.sha256:
        raise StagingError(f"{item.dest}: its SHA-256 does not match the manifest (the object changed or is corrupt)")


# Staging a manifest ----------------------------------------------------------------------------


@dataclass
class Progress:
    files_total: int
    bytes_total: int
    files_done: int = 0
    bytes_done: int = 0
    bytes_moved: int = 0


def stage(items, cache, datasets, workers=8, on_progress=None, should_stop=None):
    """Make sure every item is in the cache, fetching what is missing, several at once.

    Files the cache holds count as done at once and move nothing. Each fetched file is checked
    against its size and SHA-256 before it enters the cache. Returns the final Progress; raises
    StagingError for a missing or corrupt object (nothing half-fetched is kept)."""
    unique = {}
    for item in items:
        unique.setdefault(item.sha256, item)
    progress = Progress(files_total=len(items), bytes_total=sum(item.size for item in items))
    lock = threading.Lock()
    counts = {}
    for item in items:
        counts[item.sha256] = counts.get(item.sha256, 0) + 1

    def done(item, moved):
        with lock:
            progress.files_done += counts[item.sha256]
            progress.bytes_done += item.size * counts[item.sha256]
            progress.bytes_moved += moved

    missing = []
    for sha, item in unique.items():
        if cache.has(sha):
            done(item, 0)
        else:
            missing.append(item)

    def one(item):
        if should_stop is not None and should_stop():
            raise StagingError("staging was stopped")
        tmp = cache.temp_path(item.sha256)
        try:
            fetch(item, tmp, datasets)
            verify(tmp, item)
            cache.put(tmp, item.sha256)
        finally:
            tmp.unlink(missing_ok=True)
        done(item, item.size)

    if missing:
        # Largest first, so a big file does not start last and finish alone.
        missing.sort(key=lambda item: -item.size)
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="stage") as pool:
            futures = [pool.submit(one, item) for item in missing]
            pending = set(futures)
            while pending:
                finished, pending = wait(pending, timeout=0.5, return_when=FIRST_EXCEPTION)
                if on_progress is not None:
                    on_progress(progress)
                failed = next((f for f in finished if f.exception() is not None), None)
                if failed is not None:
                    for future in pending:
                        future.cancel()
                    error = failed.exception()
                    if isinstance(error, StagingError):
                        raise error
                    raise StagingError(f"staging failed: {error}") from error
    if on_progress is not None:
        on_progress(progress)
    return progress


def materialize(items, cache, root):
    """Build the job's folder from the cache: every item linked to its destination."""
    for item in items:
        dest = root / PurePosixPath(item.dest)
        if not cache.has(item.sha256):
            raise StagingError(f"{item.dest} is not staged on this node")
        cache.link_into(item.sha256, dest)


class Throttle:
    """Calls through at most once per interval (and always when forced)."""

    def __init__(self, interval):
        self.interval = interval
        self.last = 0.0

    def ready(self, force=False):
        now = time.monotonic()
        if force or now - self.last >= self.interval:
            self.last = now
            return True
        return False
