"""The runner's side of checkpoints: take each new checkpoint a job writes, upload it to
storage without holding up the training, keep the latest K (and, while early stopping watches
a metric, the one of its best step: a job stopped early gets those weights back), and put the
latest back when the job starts again.

A checkpoint is a file in the job's checkpoint folder whose name does not start with "." or
end in ".tmp". The SDK writes each one under a temporary name and renames it, so it appears
whole; for scripts that write in place, a file is taken only once its size and modification
time have held still between two looks.
"""

import logging
import os
import re
import shutil
import stat
import threading
import uuid
from datetime import UTC, datetime
from pathlib import Path

from django.db import connection, transaction
from django.utils import timezone

from agent import jobfiles
from core.storage import get_storage
from jobs.models import Checkpoint

log = logging.getLogger(__name__)

STEP = re.compile(r"(\d+)")
SCAN_SECONDS = 0.5


def step_of(name):
    """The step a checkpoint's name tells (the last number in it), or None."""
    numbers = STEP.findall(Path(name).stem)
    return int(numbers[-1]) if numbers else None


def at_or_before(checkpoints, step):
    """Of checkpoints (in the order they were written, each with a .step), the one that holds
    the weights of `step`, or else the nearest before it: the highest step at or before it, the
    newest written of equal steps. None when there is none, or step is None. A checkpoint whose
    name tells no step is never chosen: nothing says when its weights were taken."""
    if step is None:
        return None
    chosen = None
    for checkpoint in checkpoints:
        if checkpoint.step is not None and checkpoint.step <= step and (chosen is None or checkpoint.step >= chosen.step):
            chosen = checkpoint
    return chosen


def to_prune(checkpoints, keep, best_step=None):
    """Of a job's kept checkpoints (newest first), those to delete: all but the latest `keep`,
    and never the one holding the best step of the metric early stopping watches (see
    at_or_before): the weights a job stopped early gets back."""
    spared = at_or_before(list(reversed(checkpoints)), best_step)
    return [c for c in checkpoints[max(1, keep) :] if c is not spared]


def is_candidate(name):
    return not name.startswith(".") and not name.endswith((".tmp", ".partial"))


def scan(folder):
    """{name: (size, mtime_ns)} of the candidate files in a checkpoint folder."""
    found = {}
    try:
        # The folder is the job's and the runner may be root: a symlink in its place is not
        # followed (its parent, the job's own folder, is the runner's to name).
        fd = _open_folder(folder)
    except OSError:
        return found
    try:
        return _scan(fd, found)
    finally:
        os.close(fd)


def _scan(fd, found):
    for entry in list(os.scandir(fd)):
        if not is_candidate(entry.name):
            continue
        try:
            # The entry itself, never what a link (put there since the listing) points to.
            info = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if stat.S_ISREG(info.st_mode):
            found[entry.name] = (info.st_size, info.st_mtime_ns)
    return found


def _open_folder(folder):
    folder = Path(folder)
    return jobfiles.open_dir(folder.parent, folder.name)


class CheckpointKeeper:
    """Watches one running job's checkpoint folder and uploads what appears in it.

    poll() is called from the runner's loop and only looks at the folder; the copies run on
    the runner's upload pool. Each new checkpoint is first hard-linked into the runner's own
    folder, so the job deleting or rewriting its file later cannot spoil the upload."""

    def __init__(self, job, allocation, folder, spool, pool, node_name):
        self.job = job
        self.allocation = allocation
        self.folder = Path(folder)
        self.spool = Path(spool)
        self.pool = pool
        self.node_name = node_name
        self.seen = {}  # name -> (size, mtime_ns) last looked at
        self.taken = {}  # name -> (size, mtime_ns) already uploaded or uploading
        self.futures = []
        self.last_scan = 0.0
        self.lock = threading.Lock()
        # The longest checkpoint kept, by its length: a sparse file takes nothing on the job's
        # disk and all of its length in storage (the runner sets the job's disk limit here).
        self.max_bytes = None
        # The job's early-stopping watch (stopping.Watch), set by the runner: the checkpoint of
        # its best step is never pruned, so a job stopped early gets those weights back.
        self.watch = None

    def ignore_existing(self):
        """What is in the folder before the job starts (a restored checkpoint) is not new."""
        self.taken.update(scan(self.folder))

    def poll(self, now_monotonic, final=False):
        """Look at the folder; start uploads of new checkpoints. final: the job has exited, so
        every file is complete and taken without waiting for it to hold still."""
        if not final and now_monotonic - self.last_scan < SCAN_SECONDS:
            return
        self.last_scan = now_monotonic
        current = scan(self.folder)
        fresh = []
        for name, signature in current.items():
            if self.taken.get(name) == signature:
                continue
            if final or self.seen.get(name) == signature:
                fresh.append((signature[1], name, signature))
        self.seen = current
        for _, name, signature in sorted(fresh):  # oldest first: the latest is uploaded last
            self.take(name, signature)

    def take(self, name, signature):
        self.spool.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # the runner's alone
        self.spool.mkdir(mode=0o700, exist_ok=True)
        copy = self.spool / f"{uuid.uuid4().hex}-{name}"
        try:
            # Through the folder's descriptor and never following a link: the job cannot swap
            # the folder or the file for a link to something of the runner's.
            folder = _open_folder(self.folder)
        except OSError:
            return
        try:
            try:
                os.link(name, copy, src_dir_fd=folder, follow_symlinks=False)
            except FileNotFoundError:
                return  # deleted by the job before we got to it: a newer one will come
            except OSError:
                # Another filesystem: a plain copy, still ours once made.
                try:
                    source = jobfiles.open_file(folder, name)  # a regular file, not a link or a pipe
                except (OSError, ValueError):
                    return
                with open(source, "rb") as src, open(copy, "wb") as dst:
                    shutil.copyfileobj(src, dst)
        finally:
            os.close(folder)
        if not stat.S_ISREG(os.lstat(copy).st_mode):
            copy.unlink()  # a link or a pipe the job put there: not a checkpoint
            return
        self.taken[name] = signature
        if self.max_bytes is not None and os.lstat(copy).st_size > self.max_bytes:
            copy.unlink()
            self.job.record("notice", data={"text": f"checkpoint {name} not kept: it is longer than the job's disk limit ({self.max_bytes / 1e9:.3g} GB)"})
            return
        written_at = datetime.fromtimestamp(signature[1] / 1e9, tz=UTC)
        self.futures.append(self.pool.submit(self._upload, name, copy, written_at))

    def _upload(self, name, path, written_at):
        try:
            key = f"jobs/{self.job.pk}/checkpoints/{uuid.uuid4().hex}/{name}"
            size, sha256 = get_storage().save_file(key, path)
            with self.lock:
                checkpoint = Checkpoint.objects.create(
                    job_id=self.job.pk,
                    allocation_id=self.allocation.pk,
                    name=name,
                    step=step_of(name),
                    key=key,
                    size=size,
                    sha256=sha256,
                    written_at=min(written_at, timezone.now()),
                )
                self.job.record(
                    "checkpoint",
                    data={
                        "name": name,
                        "step": checkpoint.step,
                        "size": size,
                        "node": self.node_name,
                        "text": f"checkpoint {name} kept" + (f" (step {checkpoint.step})" if checkpoint.step is not None else ""),
                    },
                )
                best = self.watch.best() if self.watch is not None else None
                prune(self.job.pk, self.job.keep_checkpoints, best_step=best[0] if best else None)
            return checkpoint
        except Exception:
            log.exception("could not upload checkpoint %s of job %s", name, self.job.pk)
            raise
        finally:
            path.unlink(missing_ok=True)
            connection.close()

    def wait(self, timeout=None):
        """Block until every upload started has finished (the job is ending)."""
        for future in self.futures:
            try:
                future.result(timeout=timeout)
            except Exception:  # noqa: BLE001 - logged in the upload; the job still ends
                pass
        self.futures = [f for f in self.futures if not f.done()]

    def pending(self):
        self.futures = [f for f in self.futures if not f.done()]
        return len(self.futures)


def prune(job_id, keep, best_step=None):
    """Delete from storage all of a job's checkpoints but the latest `keep` and the one
    holding best_step (see to_prune)."""
    with transaction.atomic():
        kept = Checkpoint.objects.select_for_update().filter(job_id=job_id, pruned_at__isnull=True).order_by("-written_at", "-id")
        old = to_prune(list(kept), keep, best_step)
        if not old:
            return 0
        Checkpoint.objects.filter(pk__in=[c.pk for c in old]).update(pruned_at=timezone.now())
    storage = get_storage()
    for checkpoint in old:
        try:
            storage.delete(checkpoint.key)
        except Exception:  # noqa: BLE001 - a leftover object costs space, not correctness
            log.exception("could not delete checkpoint %s", checkpoint.key)
    return len(old)


def best_kept(job_id, step):
    """The job's kept checkpoint at `step`, or the latest one before it (None: none is kept)."""
    return at_or_before(Checkpoint.objects.filter(job_id=job_id, pruned_at__isnull=True).order_by("written_at", "id"), step)


def latest(job_id):
    return Checkpoint.objects.filter(job_id=job_id, pruned_at__isnull=True).order_by("-written_at", "-id").first()


def restore(job, folder, best_step=None):
    """Put the job's latest checkpoint in its checkpoint folder; returns it, or None.

    best_step: the best step of the metric early stopping watches, for a recipe (it returns
    those weights itself when the network stops it on that metric): the kept checkpoint holding
    it (or the latest before it) is put back too, older than the latest, which is still the one
    resumed from."""
    checkpoint = latest(job.pk)
    if checkpoint is None:
        return None
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    _put_back(checkpoint, folder)
    best = best_kept(job.pk, best_step) if best_step is not None else None
    if best is not None and best.name != checkpoint.name:
        _put_back(best, folder)
    return checkpoint


def _put_back(checkpoint, folder):
    target = folder / checkpoint.name
    get_storage().download(checkpoint.key, target)
    # Its time is when it was written, so scripts that pick the newest file pick it.
    stamp = checkpoint.written_at.timestamp()
    os.utime(target, (stamp, stamp))
