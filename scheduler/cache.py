"""A runner's cache of staged files, content-addressed by SHA-256, least recently used evicted.

A file is in the cache under its digest, whatever job or dataset it came with: a second job on
the same data stages nothing, and a new dataset version moves only its new files. Files are
read-only once in; jobs see them through hard links (or copies across file systems).
"""

import itertools
import os
import threading
from pathlib import Path

_temp_names = itertools.count()  # next() on a count is atomic under the GIL


class BlobCache:
    def __init__(self, root, limit_bytes):
        self.root = Path(root)
        self.limit_bytes = limit_bytes
        self.lock = threading.Lock()
        self.tmp = self.root / ".tmp"
        self.tmp.mkdir(parents=True, exist_ok=True)
        # Jobs see their files through hard links; the cache itself is the runner's alone.
        os.chmod(self.root, 0o700)
        for leftover in self.tmp.iterdir():  # half-fetched files of an earlier run
            leftover.unlink(missing_ok=True)
        self.sizes = {}
        for path in self.root.glob("??/*"):
            if len(path.name) == 64:
                self.sizes[path.name] = path.stat().st_size

    def path(self, sha256):
        return self.root / sha256[:2] / sha256

    def has(self, sha256):
        """True if the file is here; marks it as just used."""
        with self.lock:
            if sha256 not in self.sizes:
                return False
        try:
            os.utime(self.path(sha256))
        except FileNotFoundError:
            with self.lock:
                self.sizes.pop(sha256, None)
            return False
        return True

    def temp_path(self, sha256):
        """Where to fetch a file before it is verified and put in: a new name at every call, so
        two stagings of the same file at once (in one process or several) never share one."""
        return self.tmp / f"{sha256}.{os.getpid()}.{next(_temp_names)}"

    def put(self, tmp_path, sha256):
        """Move a verified file in (read-only from now on)."""
        dest = self.path(sha256)
        dest.parent.mkdir(exist_ok=True)
        os.chmod(tmp_path, 0o444)
        os.replace(tmp_path, dest)
        with self.lock:
            self.sizes[sha256] = dest.stat().st_size

    @property
    def total_bytes(self):
        with self.lock:
            return sum(self.sizes.values())

    def evict(self, protect=frozenset()):
        """Remove the least recently used files until the cache fits its limit; files in
        protect (needed by jobs staged or running here) stay. Returns the digests removed."""
        removed = []
        with self.lock:
            total = sum(self.sizes.values())
            if total <= self.limit_bytes:
                return removed
            by_age = sorted(self.sizes, key=lambda sha: self._mtime(sha))
            for sha in by_age:
                if total <= self.limit_bytes:
                    break
                if sha in protect:
                    continue
                self.path(sha).unlink(missing_ok=True)
                total -= self.sizes.pop(sha)
                removed.append(sha)
        return removed

    def _mtime(self, sha256):
        try:
            return self.path(sha256).stat().st_mtime
        except FileNotFoundError:
            return 0.0

    def link_into(self, sha256, dest):
        """Make the cached file appear at dest: a hard link where it can, else a copy."""
        dest = Path(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(self.path(sha256), dest)
        except OSError:
            import shutil

            shutil.copyfile(self.path(sha256), dest)
