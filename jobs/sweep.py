"""The blob sweep: storage that nothing refers to any more is freed.

Uploaded files and dataset files are content-addressed blobs (core.storage.blob_key), kept
once and shared, so deleting a row never deletes its blob: another row may hold the same bytes.
The sweep lists the blobs, gathers every key a row refers to, and deletes the blobs no row
refers to that are older than a grace period.

Why the order and the grace period make it safe: a blob is written (or, when it was kept
already, touched: Storage.save_blob and catalog.datasets._assemble) a moment BEFORE the row that
refers to it is committed. The blobs are listed first and the rows read after, so a row
committed before the reading protects its blob, and a blob whose row came later was written or
touched recently: it is young, and kept. Each blob's age is read once more just before it is
deleted, for one touched after the listing. What is left is the instant between that last
read and the delete; a reuse that falls there would need its blob written again.
"""

import logging
from dataclasses import dataclass
from datetime import timedelta

from django.conf import settings
from django.utils import timezone

from catalog.models import Dataset, DatasetFile, DatasetUpload
from core.storage import NotFound, blob_key, get_storage
from jobs.models import Artifact, Checkpoint, JobModel, Upload

log = logging.getLogger(__name__)


@dataclass
class Plan:
    """What to delete (key -> size), and what the listing held."""

    doomed: dict
    seen: int = 0
    seen_bytes: int = 0
    referenced: int = 0
    young: int = 0

    @property
    def doomed_bytes(self):
        return sum(self.doomed.values())


def decide(blobs, referenced, now, grace):
    """Of blobs [(key, size, last modified)], those to delete: referenced by no row AND older
    than grace (last modified before now - grace). Pure: no database, no storage."""
    plan = Plan(doomed={})
    cutoff = now - grace
    for key, size, modified in blobs:
        plan.seen += 1
        plan.seen_bytes += size
        if key in referenced:
            plan.referenced += 1
        elif modified >= cutoff:
            plan.young += 1
        else:
            plan.doomed[key] = size
    return plan


def referenced_keys():
    """Every storage key a row refers to (blobs and other objects alike: only blobs are swept).

    Uploads (claimed or not), the files of uploaded datasets (a registered bucket's files are
    keys in the team's bucket, not ours), pinned models, artifacts and checkpoints; and the blob
    an unfinished dataset upload is announced to become, when its client gave the SHA-256 (the
    upload's own key is an incoming object, outside blobs/)."""
    keys = set()
    keys.update(Upload.objects.values_list("key", flat=True).iterator())
    keys.update(DatasetFile.objects.exclude(version__dataset__source=Dataset.S3).values_list("key", flat=True).iterator())
    for files in JobModel.objects.values_list("files", flat=True).iterator():
        keys.update(f["key"] for f in files or [] if isinstance(f, dict) and f.get("key"))
    keys.update(Artifact.objects.values_list("key", flat=True).iterator())
    keys.update(Checkpoint.objects.values_list("key", flat=True).iterator())
    unfinished = DatasetUpload.objects.filter(state__in=DatasetUpload.UNFINISHED).exclude(sha256="")
    keys.update(blob_key(sha) for sha in unfinished.values_list("sha256", flat=True).iterator())
    return keys


def default_grace():
    return timedelta(hours=settings.E31_BLOB_SWEEP_GRACE_HOURS)


def sweep(dry_run=False, grace=None, now=None, storage=None):
    """List the blobs, then read the references, then delete the unreferenced old blobs (each
    one's age read again just before). Returns a summary dict; a dry run deletes nothing and
    counts what it would delete."""
    storage = storage or get_storage()
    grace = default_grace() if grace is None else grace
    now = now or timezone.now()
    blobs = list(storage.list_blobs())  # first: see the module's docstring
    plan = decide(blobs, referenced_keys(), now, grace)
    deleted, freed, skipped = 0, 0, 0
    for key, size in plan.doomed.items():
        if dry_run:
            continue
        try:
            if storage.last_modified(key) >= now - grace:
                skipped += 1  # touched since the listing: about to be used again
                continue
        except NotFound:
            continue  # gone already (another sweep)
        storage.delete(key)
        deleted += 1
        freed += size
    summary = {
        "dry_run": dry_run,
        "seen": plan.seen,
        "seen_bytes": plan.seen_bytes,
        "referenced": plan.referenced,
        "young": plan.young,
        "unreferenced_old": len(plan.doomed),
        "unreferenced_old_bytes": plan.doomed_bytes,
        "deleted": deleted,
        "freed_bytes": freed,
        "skipped": skipped,
    }
    log.info("blob sweep: %s", describe(summary))
    return summary


def describe(summary):
    """The summary in one line, as the log and the command print it."""
    if summary["dry_run"]:
        outcome = f"would delete {summary['unreferenced_old']} ({summary['unreferenced_old_bytes']:,} bytes)"
    else:
        outcome = f"deleted {summary['deleted']} ({summary['freed_bytes']:,} bytes freed)"
        if summary["skipped"]:
            outcome += f", skipped {summary['skipped']} used again since the listing"
    return (
        f"{summary['seen']} blobs ({summary['seen_bytes']:,} bytes): {summary['referenced']} referenced, "
        f"{summary['young']} unreferenced but within the grace period; {outcome}"
    )
