"""A runner's cache of staged files, content-addressed by SHA-256, least recently used evicted.

A file is in the cache under its digest, whatever job or dataset it came with: a second job on
the same data stages nothing, and a new dataset version moves only its new files. Files are
read-only once in; jobs see them through hard links (or copies across file systems).

Trust. A file enters only once its size and digest were checked, and only after its bytes are on
the disk (fsync, then the rename, then the folder's fsync): after a crash, a name in the cache
means the whole verified file. A file's mtime is when it entered and never moves after (use is
recorded in its atime, for eviction), so a file whose mtime, size or mode changed was written to
by someone since. That can only be a job run as the runner's own user (without isolation a job
could chmod its hard link back to writable); `check` after each job drops such a file, and a
restart drops files left writable, so the next job stages them afresh.

Shared (shared=True): the node's agents under a cluster engine, each running one allocation in a
process of its own, all keep one cache on the node, so data staged once is there for every later
job on that node. What a process knows is then only a view of the folder: a file another agent
put is found on the disk, one another agent evicted is missed; a half-fetched file is removed
only once the process fetching it is gone; and eviction waits for no one: it is skipped while any
agent is staging or linking (they hold the folder's lock shared, `using`, eviction exclusive).
"""

import contextlib
import fcntl
import itertools
import logging
import mmap
import os
import stat
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)
_temp_names = itertools.count()  # next() on a count is atomic under the GIL


def _fsync_folder(path):
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _takes_direct_io(folder):
    """Whether files in folder can be written with O_DIRECT (not on tmpfs, for one)."""
    if not hasattr(os, "O_DIRECT"):
        return False
    probe = folder / f".direct.{os.getpid()}.{next(_temp_names)}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_DIRECT, 0o600)
    except OSError:
        return False
    block = mmap.mmap(-1, 4096)
    try:
        os.pwrite(fd, block, 0)
        return True
    except OSError:
        return False
    finally:
        block.close()
        os.close(fd)
        probe.unlink(missing_ok=True)


def _stamp(st):
    return (st.st_size, st.st_mtime_ns, stat.S_IMODE(st.st_mode))


def _trusted(st):
    """A cache entry as put: a plain file, read-only (not a link, not made writable since)."""
    return stat.S_ISREG(st.st_mode) and not st.st_mode & 0o222


def _fetcher_alive(name):
    """Whether the process whose pid a temporary file's name carries (sha256.pid.n, or
    .direct.pid.n) still runs on this node."""
    parts = name.split(".")
    pid = parts[-2] if len(parts) >= 3 else ""
    if not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # alive, another user's
    return True


class BlobCache:
    def __init__(self, root, limit_bytes, direct_io=True, shared=False):
        self.root = Path(root)
        self.limit_bytes = limit_bytes
        self.shared = shared
        self.lock = threading.Lock()
        self.tmp = self.root / ".tmp"
        self.tmp.mkdir(parents=True, exist_ok=True)
        # Jobs see their files through hard links; the cache itself is the runner's alone (or
        # its node's agents', all this user).
        os.chmod(self.root, 0o700)
        for leftover in self.tmp.iterdir():  # half-fetched files of an earlier run
            if not (shared and _fetcher_alive(leftover.name)):
                leftover.unlink(missing_ok=True)
        # Staging writes whole blocks with O_DIRECT where the file system takes it (staging._Fetch).
        self.direct_io = bool(direct_io) and _takes_direct_io(self.tmp)
        self.stamps = {}  # sha256 -> (size, mtime_ns, mode) as the file entered
        self._scan()

    def _scan(self):
        """What the folder holds, as this process's view (a file left writable is dropped)."""
        found = {}
        for path in self.root.glob("??/*"):
            if len(path.name) != 64:
                continue
            try:
                st = path.lstat()
            except FileNotFoundError:
                continue  # evicted by another agent as we looked
            if not _trusted(st):
                log.warning("cache: %s is writable or not a plain file (changed by a job?): removed, to be staged again", path.name)
                path.unlink(missing_ok=True)
                continue
            found[path.name] = _stamp(st)
        with self.lock:
            self.stamps = found

    @contextlib.contextmanager
    def using(self):
        """While staging into the cache and linking from it: a shared cache is not evicted by
        another process meanwhile (a no-op for a cache of one process, whose own lock does)."""
        if not self.shared:
            yield
            return
        with open(self.root / ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_SH)
            yield

    @property
    def sizes(self):
        """sha256 -> size of every file in the cache."""
        with self.lock:
            return {sha: stamp[0] for sha, stamp in self.stamps.items()}

    def path(self, sha256):
        return self.root / sha256[:2] / sha256

    def has(self, sha256):
        """True if the file is here; marks it as just used."""
        with self.lock:
            known = sha256 in self.stamps
        if not known and not (self.shared and self._adopt(sha256)):
            return False
        try:
            # Only the access time moves: the mtime stays the file's entry stamp (see check).
            now = time.time_ns()
            mtime = self.stamps[sha256][1]
            os.utime(self.path(sha256), ns=(now, mtime))
        except (FileNotFoundError, KeyError):
            with self.lock:
                self.stamps.pop(sha256, None)
            return False
        return True

    def _adopt(self, sha256):
        """A file another process put in a shared cache since this one looked: known from now on."""
        try:
            st = self.path(sha256).lstat()
        except FileNotFoundError:
            return False
        if not _trusted(st):
            return False
        with self.lock:
            self.stamps[sha256] = _stamp(st)
        return True

    def temp_path(self, sha256):
        """Where to fetch a file before it is verified and put in: a new name at every call, so
        two stagings of the same file at once (in one process or several) never share one."""
        return self.tmp / f"{sha256}.{os.getpid()}.{next(_temp_names)}"

    def put(self, tmp_path, sha256, synced=False):
        """Move a verified file in (read-only from now on). Its bytes reach the disk first
        (synced: the caller already fsynced them), then the name."""
        dest = self.path(sha256)
        dest.parent.mkdir(exist_ok=True)
        if not synced:
            fd = os.open(tmp_path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        os.chmod(tmp_path, 0o444)
        os.replace(tmp_path, dest)
        _fsync_folder(dest.parent)
        with self.lock:
            self.stamps[sha256] = _stamp(dest.stat())

    @property
    def total_bytes(self):
        with self.lock:
            return sum(stamp[0] for stamp in self.stamps.values())

    def check(self, digests):
        """After a job that saw these files: drop any that changed since they entered (size,
        mtime or mode). Returns the digests dropped."""
        dropped = []
        for sha in digests:
            with self.lock:
                stamp = self.stamps.get(sha)
            if stamp is None:
                continue
            try:
                # The name itself: a link put in a file's place is a change, never followed.
                now = _stamp(os.lstat(self.path(sha)))
            except FileNotFoundError:
                now = None
            if now != stamp:
                log.warning("cache: %s changed while a job held it (%s, was %s): removed, to be staged again", sha, now, stamp)
                self.path(sha).unlink(missing_ok=True)
                with self.lock:
                    self.stamps.pop(sha, None)
                dropped.append(sha)
        return dropped

    def evict(self, protect=frozenset()):
        """Remove the least recently used files until the cache fits its limit; files in
        protect (needed by jobs staged or running here) stay. Returns the digests removed.

        A shared cache is read again from the disk first, and is left as it is while another
        process stages into it or links from it (`using`): it is evicted by the next one done."""
        if not self.shared:
            return self._evict(protect)
        with open(self.root / ".lock", "a") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return []
            self._scan()
            return self._evict(protect)

    def _evict(self, protect):
        removed = []
        with self.lock:
            total = sum(stamp[0] for stamp in self.stamps.values())
            if total <= self.limit_bytes:
                return removed
            by_age = sorted(self.stamps, key=lambda sha: self._used_at(sha))
            for sha in by_age:
                if total <= self.limit_bytes:
                    break
                if sha in protect:
                    continue
                self.path(sha).unlink(missing_ok=True)
                total -= self.stamps.pop(sha)[0]
                removed.append(sha)
        return removed

    def _used_at(self, sha256):
        try:
            return self.path(sha256).stat().st_atime_ns
        except FileNotFoundError:
            return 0

    def link_into(self, sha256, dest):
        """Make the cached file appear at dest: a hard link where it can, else a copy."""
        dest = Path(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(self.path(sha256), dest)
        except OSError:
            import shutil

            shutil.copyfile(self.path(sha256), dest)
