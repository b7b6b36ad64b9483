"""Staging: putting a job's work and data where its compute is, as a declared, verified step.

A job's manifest lists every file it needs (its uploaded work and data, the files of its
dataset versions) with size and SHA-256. A runner stages the manifest into its content-addressed
cache (agent.cache.BlobCache), several files at once and each large file in parallel parts,
checking every file's digest; what the cache already holds moves no bytes. At launch the job's
folder is made of hard links into the cache.

Bytes are hashed as they arrive (into a small per-worker buffer, then written out), not read back
afterwards: on a small machine serving its own S3, hashing and copying are where the time goes
(bench/staging.py). A file enters the cache only once its size and digest match the manifest.
It stays one file, at about 500 lines, because stage() and the fetches it drives share the
per-thread buffers, the sources and the abandon signal of one staging; split, each half would
reach into the other's private parts.
"""

import hashlib
import logging
import os
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass

from core import buckets
from core.buffers import read_buffer
from core.storage import CHUNK, NotFound, RangeNotSatisfiable, get_storage, s3_open_range

log = logging.getLogger(__name__)


class StagingError(Exception):
    pass


# Where the bytes come from -------------------------------------------------------------------


def team_bucket_client(dataset):
    """A client for the dataset's registered bucket; StagingError when its endpoint is refused."""
    try:
        return buckets.team_bucket(str(dataset.pk), dataset.s3_credentials, dataset.s3_endpoint_url, dataset.s3_region)
    except buckets.BucketRefused as error:
        raise StagingError(str(error)) from None


def _size_mismatch(item, size):
    return f"{item.dest}: expected {item.size} bytes, got {size}"


def _digest_mismatch(item):
    return f"{item.dest}: its SHA-256 does not match the manifest (the object changed or is corrupt)"


# Reading a file's bytes, in parts, hashed on the way ----------------------------------------------

PART_SIZE = 64 * CHUNK  # a larger file moves as ranged parts of this size, several at once
READ_RETRIES = 3  # a connection lost in the middle of a part: read on from where it stopped
DIRECT_ALIGN = 4096  # O_DIRECT writes: offset, length and memory aligned to this


def _transient_errors():
    import http.client

    import urllib3.exceptions
    from botocore.exceptions import BotoCoreError

    return (OSError, http.client.HTTPException, urllib3.exceptions.HTTPError, BotoCoreError)


class _Abandoned(Exception):
    """The staging failed elsewhere or was stopped: this part gives up quietly."""


class _LocalStream:
    def __init__(self, path, start):
        self.file = open(path, "rb", buffering=0)  # noqa: SIM115 - closed by close()
        self.object_size = os.fstat(self.file.fileno()).st_size
        self.file.seek(start)

    def readinto(self, buffer):
        return self.file.readinto(buffer)

    def close(self):
        self.file.close()


class _Source:
    """Where one item's bytes come from: open(start, end) gives a stream with readinto() and the
    whole object's size (end None: the whole object in one request); StagingError for a missing
    object."""

    def __init__(self, item, open_range, missing, ranged, refused=None):
        self.item = item
        self.open_range = open_range
        self.missing = missing
        self.ranged = ranged  # whether parts can be read separately
        self.refused = refused  # the message for other refusals of a team's bucket

    def open(self, start, end):
        from botocore.exceptions import ClientError

        try:
            stream = self.open_range(start, end)
        except (NotFound, FileNotFoundError):
            raise StagingError(self.missing) from None
        except RangeNotSatisfiable:
            raise StagingError(_size_mismatch(self.item, "fewer")) from None
        except ClientError as error:
            if self.refused is None:
                raise
            raise StagingError(self.refused.format(code=error.response.get("Error", {}).get("Code"))) from None
        if stream.object_size is not None and stream.object_size != self.item.size:
            stream.close()
            raise StagingError(_size_mismatch(self.item, stream.object_size))
        return stream


def _source(item, datasets):
    """How to read item's bytes: a file of the local folder, or ranges of an S3 object."""

    kind = item.source[0]
    if kind == "storage":
        storage = get_storage()
        key = item.source[1]
        missing = f"{item.dest}: the stored object is missing"
        path = storage.local_path(key)
        if path is not None:
            return _Source(item, lambda start, end: _LocalStream(path, start), missing, ranged=False)
        return _Source(item, lambda start, end: storage.open_range(key, start, end), missing, ranged=True)
    dataset = datasets[item.source[1]]
    client, bucket, key = team_bucket_client(dataset), dataset.s3_bucket, item.source[2]
    return _Source(
        item,
        lambda start, end: s3_open_range(client, bucket, key, start, end),
        f"{item.dest}: s3://{bucket}/{key} is missing",
        ranged=True,
        refused=f"{item.dest}: the bucket refused: {{code}}",
    )


def _pwrite_all(fd, data, offset):
    while data:
        written = os.pwrite(fd, data, offset)
        data, offset = data[written:], offset + written


class _Fetch:
    """One file on its way into the cache. Its parts are read by the staging's workers (several
    at once for a large file) and written into a temporary file at their offsets; the SHA-256 is
    taken in order: a part that starts where hashing has got to is hashed as it arrives, the
    others once every part before them is written, read back from the temporary file. The worker
    that hashes the last byte checks the digest and puts the file in.

    Where the cache's file system takes it (cache.direct_io), whole aligned blocks are written
    with O_DIRECT: from the buffer straight to the disk, without a copy into the page cache or
    the writeback of it later (on a small machine, a fifth of staging's CPU); the rest (a last
    partial block, parts at unaligned offsets) through the page cache. The fsync before the file
    enters the cache covers both."""

    def __init__(self, item, source, cache, part_size):
        self.item = item
        self.source = source
        self.cache = cache
        self.tmp = cache.temp_path(item.sha256)
        size = item.size
        if source.ranged and size > part_size:
            self.parts = [(start, min(start + part_size, size)) for start in range(0, size, part_size)]
        else:
            self.parts = [(0, size)]
        self.lock = threading.Lock()
        self.fd = None  # through the page cache
        self.direct_fd = None  # O_DIRECT, where the cache takes it
        self.direct_bytes = 0  # written with O_DIRECT (for the tests and the benchmark)
        self.digest = hashlib.sha256()
        self.hashed = 0  # bytes hashed, from the start
        self.hashing = False  # a worker is advancing `hashed`
        self.ready = 0  # every byte before this is written
        self.written = {}  # start -> end of the parts written beyond `ready`
        self.finished = False

    def fetch_part(self, index, abandon):
        """Read one part; True if this completed the file (now verified and in the cache)."""
        start, end = self.parts[index]
        with self.lock:
            if self.fd is None:
                self.fd = os.open(self.tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
                if getattr(self.cache, "direct_io", False):
                    self.direct_fd = os.open(self.tmp, os.O_WRONLY | os.O_CLOEXEC | os.O_DIRECT)
            inline = not self.hashing and self.hashed == start
            if inline:
                self.hashing = True
        try:
            self._read(start, end, inline, abandon)
        except BaseException:
            if inline:
                with self.lock:
                    self.hashing = False
            raise
        with self.lock:
            self.written[start] = end
            while self.ready in self.written:
                self.ready = self.written.pop(self.ready)
            if inline:
                self.hashing = False
        return self._catch_up(abandon)

    def _read(self, start, end, inline, abandon):
        buffer = read_buffer()
        whole = len(self.parts) == 1
        position = start  # the next byte to read
        flushed = start  # where the buffer's first byte goes in the file
        stream = self.source.open(start, None if whole else end)
        retries = 0
        try:
            while position < end:
                if abandon.is_set():
                    raise _Abandoned()
                filled = position - flushed
                try:
                    n = stream.readinto(buffer[filled : filled + min(len(buffer) - filled, end - position)])
                    if n == 0:
                        raise ConnectionError("the connection closed before the end of the object")
                except _transient_errors() as error:
                    stream.close()
                    retries += 1
                    if retries > READ_RETRIES:
                        raise StagingError(f"{self.item.dest}: reading it failed: {error}") from error
                    log.warning("%s: reading failed (%s), reading on from byte %d", self.item.dest, error, position)
                    time.sleep(0.2 * retries)
                    stream = self.source.open(position, end)
                    continue
                if inline:
                    self.digest.update(buffer[filled : filled + n])  # while the bytes are still in the CPU's cache
                    self.hashed += n
                position += n
                if position - flushed == len(buffer) or position == end:
                    self._write(buffer[: position - flushed], flushed)
                    flushed = position
        finally:
            stream.close()

    def _write(self, data, offset):
        """Whole aligned blocks with O_DIRECT where it can, the rest through the page cache."""
        if self.direct_fd is not None and offset % DIRECT_ALIGN == 0:
            aligned = len(data) - len(data) % DIRECT_ALIGN
            if aligned:
                written = os.pwrite(self.direct_fd, data[:aligned], offset)
                self.direct_bytes += written
                data, offset = data[written:], offset + written
        _pwrite_all(self.fd, data, offset)

    def _catch_up(self, abandon):
        """Hash what is written but not yet hashed, unless another worker is at it; finish the file
        when everything is hashed."""
        buffer = read_buffer()
        while True:
            with self.lock:
                if self.finished or self.hashing:
                    return False
                if self.hashed >= self.ready:
                    if self.ready < self.item.size:
                        return False  # parts still on their way: the worker that writes the next one goes on
                    self.finished = True
                    break
                self.hashing = True
                position, stop = self.hashed, self.ready
            try:
                while position < stop:
                    if abandon.is_set():
                        raise _Abandoned()
                    n = os.preadv(self.fd, [buffer[: min(len(buffer), stop - position)]], position)
                    if n == 0:
                        raise StagingError(f"{self.item.dest}: its temporary file is shorter than what was written")
                    self.digest.update(buffer[:n])
                    position += n
            finally:
                with self.lock:
                    self.hashed = position
                    self.hashing = False
        self._finish()
        return True

    def _finish(self):
        with self.lock:
            fd, self.fd = self.fd, None
            direct_fd, self.direct_fd = self.direct_fd, None
        if direct_fd is not None:
            os.close(direct_fd)
        try:
            if self.digest.hexdigest() != self.item.sha256:
                raise StagingError(_digest_mismatch(self.item))
            os.fdatasync(fd)  # on the disk before its name is in the cache (agent.cache)
        finally:
            os.close(fd)
        self.cache.put(self.tmp, self.item.sha256, synced=True)

    def discard(self):
        """After the staging: close and remove what is left (nothing, if it went into the cache)."""
        with self.lock:
            fds, self.fd, self.direct_fd = (self.fd, self.direct_fd), None, None
        for fd in fds:
            if fd is not None:
                os.close(fd)
        self.tmp.unlink(missing_ok=True)


# Staging a manifest ----------------------------------------------------------------------------


@dataclass
class Progress:
    files_total: int
    bytes_total: int
    files_done: int = 0
    bytes_done: int = 0
    bytes_moved: int = 0


def stage(items, cache, datasets, workers=8, on_progress=None, should_stop=None, part_size=PART_SIZE):
    """Make sure every item is in the cache, fetching what is missing, several parts at once.

    Files the cache holds count as done at once and move nothing. Each fetched file is checked
    against its size and SHA-256 before it enters the cache. Returns the final Progress; raises
    StagingError for a missing or corrupt object (nothing half-fetched is kept).

    workers is how many reads run at once: parts of different files, or of one large file (every
    file larger than part_size is read as ranged parts of that size)."""
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

    def part_done(fetch, index, completed):
        # Bytes count as they arrive, part by part, so one huge file does not sit at 0% until
        # its last byte; the file counts once it is verified and in the cache.
        start, end = fetch.parts[index]
        with lock:
            progress.bytes_done += (end - start) * counts[fetch.item.sha256]
            progress.bytes_moved += end - start
            if completed:
                progress.files_done += counts[fetch.item.sha256]

    missing = []
    for sha, item in unique.items():
        if cache.has(sha):
            done(item, 0)
        else:
            missing.append(item)

    def stopped():
        return should_stop is not None and should_stop()

    abandon = threading.Event()

    def part(fetch, index):
        if abandon.is_set():
            raise _Abandoned()
        if stopped():
            raise StagingError("staging was stopped")
        part_done(fetch, index, fetch.fetch_part(index, abandon))

    if missing:
        # Largest first, so a big file does not start last and finish alone.
        missing.sort(key=lambda item: -item.size)
        fetches = []
        try:
            with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="stage") as pool:
                futures = []
                try:
                    for item in missing:
                        source = _source(item, datasets)
                        fetches.append(_Fetch(item, source, cache, part_size))
                        futures += [pool.submit(part, fetches[-1], index) for index in range(len(fetches[-1].parts))]
                except StagingError:
                    abandon.set()
                    raise
                except Exception as error:
                    abandon.set()
                    raise StagingError(f"staging failed: {error}") from error
                pending = set(futures)
                while pending:
                    finished, pending = wait(pending, timeout=0.5, return_when=FIRST_EXCEPTION)
                    if on_progress is not None:
                        on_progress(progress)
                    failed = next((f for f in finished if f.exception() is not None), None)
                    if failed is None and (not pending or not stopped()):
                        continue
                    abandon.set()  # the workers give up between reads
                    for future in pending:
                        future.cancel()
                    if failed is None:
                        raise StagingError("staging was stopped")
                    error = failed.exception()
                    if isinstance(error, StagingError):
                        raise error
                    raise StagingError(f"staging failed: {error}") from error
        finally:
            abandon.set()
            for fetch_ in fetches:
                fetch_.discard()
    if on_progress is not None:
        on_progress(progress)
    return progress


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
