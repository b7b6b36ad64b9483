"""A folder sent from the browser, packed into a zip that the job unpacks as any uploaded archive.

A browser sends a chosen folder's files with paths that begin with the folder's own name
(`myproj/src/train.py`); when every path shares one top folder it is taken off, so the paths,
and the entrypoint, are relative to the folder chosen (`src/train.py`). Each path is checked
before a byte is read: it stays inside the folder, names a file once, and holds no backslash or
control character; the zip holds only regular files (a browser sends no links, and none can be
made here). The same limits as an uploaded archive's hold (jobs/archive.py: bytes and entries),
the bytes counted as they are read, not taken from what the client declared.

A folder may also be sent ahead of the form, resumably (jobs/folder_uploads.py): the browser
first announces its files' paths and sizes, which `plan` checks as `pack` would, before a byte
is sent; the bytes are then counted again as they are packed.

Pure functions over (relative path, bytes or binary file) pairs: no Django, no storage.
"""

import zipfile
from pathlib import PurePosixPath

from e31.unpack import size_text

# Left out, as `e31 submit` leaves them out of a folder it packs (e31/cli/spec.py).
SKIPPED = {"__pycache__", ".git", ".DS_Store"}
MAX_PATH_CHARS = 1024
MAX_PART_BYTES = 255  # a file name on Linux
CHUNK = 1024 * 1024
# One date for every entry: the same folder packs to the same bytes, kept once in storage.
DATE = (1980, 1, 1, 0, 0, 0)
FILE_MODE = 0o100644 << 16  # a regular file, rw-r--r--


class FolderError(ValueError):
    pass


def check_path(path):
    """The path as sent, if it is a plain relative path inside the folder; FolderError if not."""
    if not isinstance(path, str) or not path:
        raise FolderError("a file came without its path in the folder")
    shown = repr(path[:100])
    if any(ord(c) < 32 or ord(c) == 127 for c in path):
        raise FolderError(f"the path {shown} holds a NUL or another control character")
    if "\\" in path:
        raise FolderError(f"the path {shown} holds a backslash: paths in a folder are separated by '/'")
    if path.startswith("/") or (len(path) > 1 and path[1] == ":"):
        raise FolderError(f"the path {shown} is absolute: paths must be relative to the folder")
    if len(path) > MAX_PATH_CHARS:
        raise FolderError(f"the path {shown}... is longer than {MAX_PATH_CHARS} characters")
    parts = path.split("/")
    if ".." in parts:
        raise FolderError(f"the path {shown} points outside the folder ('..')")
    if any(part in ("", ".") for part in parts):
        raise FolderError(f"the path {shown} has an empty or '.' part")
    if any(len(part.encode("utf-8", "surrogatepass")) > MAX_PART_BYTES for part in parts):
        raise FolderError(f"the path {shown} has a name longer than {MAX_PART_BYTES} bytes")
    return path


def relative_paths(paths):
    """(top, paths): the paths checked, without what is skipped, and relative to the folder
    chosen: `top` is the one top folder they all shared, taken off ("" if they shared none)."""
    top, relative = _relative(paths)
    return top, [path for path in relative if path is not None]


def _relative(paths):
    # One for each path sent, in order: its path in the zip, or None where it is skipped.
    checked = [check_path(path) for path in paths]
    kept = [path for path in checked if not skipped(path)]
    if not kept:
        raise FolderError("the folder has no files to send")
    tops = {path.split("/", 1)[0] for path in kept}
    top = tops.pop() if len(tops) == 1 and all("/" in path for path in kept) else ""
    strip = len(top) + 1 if top else 0
    relative = [None if skipped(path) else path[strip:] for path in checked]
    _refuse_clashes([path for path in relative if path is not None])
    return top, relative


def plan(entries, *, max_bytes, max_entries, max_file_bytes):
    """The folder a client announces before sending it, [(path as sent, size in bytes)], checked
    as `pack` checks what it packs: (top, [(path as sent, size)] of the files to send, in the
    order given, what is skipped left out). FolderError, with the reason, for a path that is not
    safe, a size that is not a whole number of bytes, a file larger than max_file_bytes (what one
    chunked upload may hold), more files than max_entries or more bytes than max_bytes in all."""
    entries = list(entries)
    top, relative = _relative([path for path, _ in entries])
    kept = [(path, size) for (path, size), rel in zip(entries, relative) if rel is not None]
    for path, size in kept:
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise FolderError(f"the size of {path[:100]!r} must be its size in bytes, a whole number")
        if size > max_file_bytes:
            raise FolderError(f"{path[:100]!r} holds {size_text(size)}, more than the {size_text(max_file_bytes)} one file may hold")
    if len(kept) > max_entries:
        raise FolderError(f"the folder has {len(kept):,} files, more than the {max_entries:,} an archive may hold")
    total = sum(size for _, size in kept)
    if total > max_bytes:
        raise FolderError(f"the folder holds {size_text(total)}, more than the {size_text(max_bytes)} a job's folder may hold")
    return top, kept


def skipped(path):
    return bool(SKIPPED.intersection(path.split("/")))


def _refuse_clashes(paths):
    seen, folders = set(), set()
    for path in paths:
        if path in seen:
            raise FolderError(f"the path {path!r} is sent twice")
        seen.add(path)
        folders.update(str(parent) for parent in PurePosixPath(path).parents if str(parent) != ".")
    clash = sorted(seen & folders)
    if clash:
        raise FolderError(f"{clash[0]!r} is both a file and a folder")


def pack(files, out, *, max_bytes, max_entries):
    """Write the folder's files, [(path as sent, bytes or binary file)], into `out` (a binary
    file) as a zip; returns (top, [paths in the zip]), as relative_paths gives them.

    FolderError, with the reason, for a path that is not safe, more files than max_entries, or
    more bytes than max_bytes (counted as read: what was written to `out` is then the caller's
    to discard)."""
    files = list(files)
    top, relative = _relative([path for path, _ in files])
    by_path = {path: content for path, (_, content) in zip(relative, files) if path is not None}
    if len(by_path) > max_entries:
        raise FolderError(f"the folder has {len(by_path):,} files, more than the {max_entries:,} an archive may hold")
    written = 0
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for path in sorted(by_path):
            info = zipfile.ZipInfo(path, date_time=DATE)
            info.external_attr = FILE_MODE
            info.compress_type = zipfile.ZIP_DEFLATED
            with archive.open(info, "w", force_zip64=True) as target:
                for chunk in _chunks(by_path[path]):
                    written += len(chunk)
                    if written > max_bytes:
                        raise FolderError(f"the folder holds at least {size_text(written)}, more than the {size_text(max_bytes)} a job's folder may hold")
                    target.write(chunk)
    return top, sorted(by_path)


def _chunks(content):
    if isinstance(content, (bytes, bytearray, memoryview)):
        if content:
            yield bytes(content)
        return
    while chunk := content.read(CHUNK):
        yield chunk
