"""Where the network keeps uploads, datasets and job artifacts.

One interface; the embedded default is a local folder. Keys are relative, '/'-separated paths.
"""

import hashlib
import os
import shutil
import tempfile
from pathlib import Path, PurePosixPath

from django.conf import settings

CHUNK = 1024 * 1024


class StorageError(Exception):
    pass


def check_key(key):
    parts = PurePosixPath(key).parts
    if not parts or key.startswith("/") or any(p in ("", ".", "..") for p in parts) or "\\" in key:
        raise StorageError(f"invalid storage key {key!r}")
    return key


class LocalStorage:
    def __init__(self, root):
        self.root = Path(root)

    def path(self, key):
        return self.root / check_key(key)

    def save(self, key, fileobj):
        """Write fileobj under key; return (size, sha256). The file appears whole or not at all."""
        dest = self.path(key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        digest = hashlib.sha256()
        size = 0
        fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=".part-")
        try:
            with os.fdopen(fd, "wb") as out:
                for chunk in iter(lambda: fileobj.read(CHUNK), b""):
                    out.write(chunk)
                    digest.update(chunk)
                    size += len(chunk)
            os.replace(tmp, dest)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return size, digest.hexdigest()

    def save_file(self, key, src_path):
        with open(src_path, "rb") as src:
            return self.save(key, src)

    def open(self, key):
        return open(self.path(key), "rb")

    def exists(self, key):
        return self.path(key).is_file()

    def size(self, key):
        return self.path(key).stat().st_size

    def copy_to(self, key, dest_path):
        dest_path = Path(dest_path)
        dest_path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(self.path(key), dest_path)

    def delete(self, key):
        self.path(key).unlink(missing_ok=True)


def get_storage():
    return LocalStorage(settings.STORAGE_DIR)
