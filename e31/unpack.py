"""Unpack a job's work (a .py script, a .zip or a .tar.gz) into a folder, within limits.

Standard library only, and no import from this package or the project: the runner runs this
file by itself, as the job's unprivileged user inside its sandbox, with `python -I -S`:

    python -I -S e31/unpack.py ARCHIVE FILENAME DEST MAX_BYTES MAX_ENTRIES

It exits 0 once the work is in DEST, or 2 with one line on stderr naming why it was refused.

A zip bomb is small on the wire and huge on disk, so two checks stand in its way. Before a byte
is written, the sizes and the count the archive's own headers declare are totalled (`check`),
and a tar's headers are read one at a time so a bomb is refused after little decompression.
Then, while writing, the bytes actually written are counted (`extract_limited`): headers can lie,
the count cannot. Entries with '..', an absolute path, links, devices and pipes are refused, so
nothing lands outside DEST.
"""

import os
import stat
import sys
import tarfile
import zipfile
import zlib
from collections.abc import Callable
from functools import partial
from pathlib import Path, PurePosixPath
from types import TracebackType
from typing import IO, Literal

CHUNK = 1024 * 1024

PathArg = str | os.PathLike[str]


class ArchiveError(ValueError):
    pass


def kind_of(filename: str) -> str | None:
    name = filename.lower()
    if name.endswith(".py"):
        return "script"
    if name.endswith(".zip"):
        return "zip"
    if name.endswith((".tar.gz", ".tgz")):
        return "tar"
    return None


def check_name(name: str) -> str:
    """The entry's path, relative and inside the archive; raises ArchiveError otherwise."""
    path = PurePosixPath(name.replace("\\", "/"))
    if path.is_absolute() or name.startswith(("/", "\\")) or (len(name) > 1 and name[1] == ":"):
        raise ArchiveError(f"the archive entry {name!r} has an absolute path")
    if ".." in path.parts:
        raise ArchiveError(f"the archive entry {name!r} points outside the archive ('..')")
    return str(path)


def size_text(count: int) -> str:
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{count:,} bytes"


def too_big(total: int, limit: int, at_least: bool = False) -> ArchiveError:
    shown, allowed = size_text(total), size_text(limit)
    if shown == allowed:  # 1.0 MB against 1.0 MB says nothing: show the bytes
        shown, allowed = f"{total:,} bytes", f"{limit:,} bytes"
    more = "at least " if at_least else ""
    return ArchiveError(f"the archive unpacks to {more}{shown}, more than the {allowed} a job's folder may hold")


def too_many(count: int, limit: int, at_least: bool = False) -> ArchiveError:
    more = "at least " if at_least else ""
    return ArchiveError(f"the archive has {more}{count:,} entries, more than {limit:,}")


# One entry as both formats describe it: (name, kind, size) with kind "file", "dir" or refused.
Entry = tuple[str, str, int]


def _zip_entry(info: zipfile.ZipInfo) -> Entry:
    name = check_name(info.filename)
    if stat.S_ISLNK(info.external_attr >> 16):
        raise ArchiveError(f"the archive entry {info.filename!r} is a symbolic link")
    return name, "dir" if info.is_dir() else "file", info.file_size


def _tar_entry(member: tarfile.TarInfo) -> Entry:
    name = check_name(member.name)
    if member.issym() or member.islnk():
        raise ArchiveError(f"the archive entry {member.name!r} is a link")
    if member.isdev() or member.isfifo():
        raise ArchiveError(f"the archive entry {member.name!r} is a device or pipe")
    if not (member.isfile() or member.isdir()):
        raise ArchiveError(f"the archive entry {member.name!r} is neither a file nor a folder")
    return name, "dir" if member.isdir() else "file", member.size


def check(path: PathArg, filename: str, max_bytes: int, max_entries: int) -> list[str]:
    """The files in the work (relative paths), from the archive's headers; raises ArchiveError
    for anything unsafe or for declared totals over the limits, before anything is unpacked."""
    kind = kind_of(filename)
    if kind == "script":
        size = os.path.getsize(path)
        if size > max_bytes:
            raise too_big(size, max_bytes)
        return [PurePosixPath(filename).name]
    if kind is None:
        raise ArchiveError("the work must be a .py script or a .zip or .tar.gz archive")
    with _reading():
        if kind == "zip":
            with zipfile.ZipFile(path) as archive:
                return _check_zip(archive.infolist(), max_bytes, max_entries)
        with tarfile.open(path, "r:gz") as archive:
            return _check_tar(archive, max_bytes, max_entries)


def _check_zip(infos: list[zipfile.ZipInfo], max_bytes: int, max_entries: int) -> list[str]:
    # The central directory is already in memory: exact totals cost nothing more.
    if len(infos) > max_entries:
        raise too_many(len(infos), max_entries)
    total = sum(info.file_size for info in infos)
    if total > max_bytes:
        raise too_big(total, max_bytes)
    entries = [_zip_entry(info) for info in infos]
    return [name for name, kind, _ in entries if kind == "file"]


def _check_tar(archive: tarfile.TarFile, max_bytes: int, max_entries: int) -> list[str]:
    # Iterating reads one header at a time (getmembers() would read them all first), so a tar
    # bomb is refused as soon as its running totals pass a limit, not after it was all inflated.
    files, total = [], 0
    for count, member in enumerate(archive, 1):
        if count > max_entries:
            raise too_many(count, max_entries, at_least=True)
        name, kind, size = _tar_entry(member)
        total += size
        if total > max_bytes:
            raise too_big(total, max_bytes, at_least=True)
        if kind == "file":
            files.append(name)
    return files


def read_file(path: PathArg, filename: str, name: str, max_bytes: int) -> bytes | None:
    """The bytes of one file in an archive (a checked one: see `check`), None if it has no
    file of that name; raises ArchiveError if it holds more than max_bytes (its header can lie:
    at most max_bytes + 1 bytes are read)."""
    kind = kind_of(filename)
    with _reading():
        if kind == "zip":
            with zipfile.ZipFile(path) as archive:
                found = next((i for i in archive.infolist() if not i.is_dir() and check_name(i.filename) == name), None)
                return None if found is None else _read_limited(partial(archive.open, found), name, max_bytes)
        if kind == "tar":
            with tarfile.open(path, "r:gz") as archive:
                member = next((m for m in archive if m.isfile() and check_name(m.name) == name), None)
                return None if member is None else _read_limited(partial(archive.extractfile, member), name, max_bytes)
    return None


def _read_limited(opener: Callable[[], IO[bytes] | None], name: str, max_bytes: int) -> bytes:
    with _opened(opener, name) as source:
        data = source.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise ArchiveError(f"{name} is larger than {max_bytes // 1024} KB")
    return data


def _opened(opener: Callable[[], IO[bytes] | None], name: str) -> IO[bytes]:
    """The entry's content, opened. tarfile's extractfile() gives None for what is not a file,
    which the checks have already refused."""
    source = opener()
    if source is None:
        raise ArchiveError(f"the archive entry {name!r} is neither a file nor a folder")
    return source


class _reading:
    """Turns a corrupt archive's many exceptions into one ArchiveError with the reason."""

    def __enter__(self) -> "_reading":
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None) -> Literal[False]:
        if isinstance(error, (zipfile.BadZipFile, zipfile.LargeZipFile, tarfile.TarError, EOFError, zlib.error, OSError)):
            raise ArchiveError(f"the archive cannot be read: {error}") from None
        return False


class _Budget:
    """What may still be written: bytes actually written and entries made, against the limits."""

    def __init__(self, max_bytes: int, max_entries: int) -> None:
        self.max_bytes, self.max_entries = max_bytes, max_entries
        self.written, self.entries = 0, 0

    def entry(self) -> None:
        self.entries += 1
        if self.entries > self.max_entries:
            raise too_many(self.entries, self.max_entries, at_least=True)

    def copy(self, source: IO[bytes], target: IO[bytes], name: str) -> None:
        while chunk := source.read(CHUNK):
            if self.written + len(chunk) > self.max_bytes:
                raise too_big(self.written + len(chunk), self.max_bytes, at_least=True)
            try:
                target.write(chunk)
            except OSError as error:  # a full disk, say: not the archive's fault, but it stops here
                raise ArchiveError(f"the archive entry {name!r} cannot be written: {error.strerror}") from None
            self.written += len(chunk)


def extract_limited(path: PathArg, filename: str, dest: PathArg, max_bytes: int, max_entries: int) -> None:
    """Unpack the work into dest (which must exist), checking the headers first, then counting
    what is written; raises ArchiveError once a limit is passed (what was written stays: dest
    is the caller's to remove)."""
    check(path, filename, max_bytes, max_entries)  # refuses what it can before a byte is written
    dest, budget = Path(dest), _Budget(max_bytes, max_entries)
    kind = kind_of(filename)
    with _reading():
        if kind == "script":
            with open(path, "rb") as source:
                _write(budget, dest, PurePosixPath(filename).name, source, 0o644)
        elif kind == "zip":
            with zipfile.ZipFile(path) as archive:
                for info in archive.infolist():
                    _unpack(budget, dest, _zip_entry(info), partial(archive.open, info), info.external_attr >> 16)
        else:
            with tarfile.open(path, "r:gz") as archive:
                for member in archive:
                    _unpack(budget, dest, _tar_entry(member), partial(archive.extractfile, member), member.mode)


def _unpack(budget: _Budget, dest: Path, entry: Entry, opener: Callable[[], IO[bytes] | None], mode: int) -> None:
    name, kind, _ = entry  # the declared size is not trusted here
    budget.entry()
    if name == ".":
        return  # the archive's own top folder
    if kind == "dir":
        _make_folder(dest / name, name)
        return
    _make_folder((dest / name).parent, name)
    with _opened(opener, name) as source:
        _write(budget, dest, name, source, 0o755 if mode & 0o111 else 0o644)


def _make_folder(folder: Path, name: str) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise ArchiveError(f"the archive entry {name!r} clashes with a file of the same name") from None
    except OSError as error:  # no room, say: not the archive's fault, but it stops here
        raise ArchiveError(f"the archive entry {name!r} cannot be written: {error.strerror}") from None


def _write(budget: _Budget, dest: Path, name: str, source: IO[bytes], mode: int) -> None:
    # O_EXCL: never follows a link, never overwrites; an archive naming a file twice is refused.
    try:
        fd = os.open(dest / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), mode)
    except (FileExistsError, IsADirectoryError, NotADirectoryError):
        raise ArchiveError(f"the archive entry {name!r} clashes with another entry of the same name") from None
    except OSError as error:
        raise ArchiveError(f"the archive entry {name!r} cannot be written: {error.strerror}") from None
    with os.fdopen(fd, "wb") as target:
        os.fchmod(fd, mode)  # the umask may have taken bits the job needs
        budget.copy(source, target, name)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 5 or not (args[3].isdigit() and args[4].isdigit()):
        print("usage: unpack.py ARCHIVE FILENAME DEST MAX_BYTES MAX_ENTRIES", file=sys.stderr)
        return 1
    archive, filename, dest, max_bytes, max_entries = args
    try:
        extract_limited(archive, filename, dest, int(max_bytes), int(max_entries))
    except ArchiveError as error:
        print(f"{filename}: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
