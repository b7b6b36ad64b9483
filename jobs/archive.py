"""The job's work as uploaded: a single script, or an archive with an entrypoint inside.

Archives are checked before they are accepted and again when extracted: an entry with '..',
an absolute path, a link or a device file is refused, so nothing lands outside the job's folder.
"""

import shutil
import stat
import tarfile
import zipfile
from pathlib import Path, PurePosixPath

RUNNABLE = (".py", ".sh")


class ArchiveError(ValueError):
    pass


def kind_of(filename):
    name = filename.lower()
    if name.endswith(".py"):
        return "script"
    if name.endswith(".zip"):
        return "zip"
    if name.endswith((".tar.gz", ".tgz")):
        return "tar"
    return None


def _check_name(name):
    path = PurePosixPath(name.replace("\\", "/"))
    if path.is_absolute() or name.startswith(("/", "\\")) or (len(name) > 1 and name[1] == ":"):
        raise ArchiveError(f"the archive entry {name!r} has an absolute path")
    if ".." in path.parts:
        raise ArchiveError(f"the archive entry {name!r} points outside the archive ('..')")
    return str(path)


def list_entries(path, filename):
    """The files in the upload (relative paths); raises ArchiveError for anything unsafe."""
    kind = kind_of(filename)
    if kind == "script":
        return [PurePosixPath(filename).name]
    try:
        if kind == "zip":
            with zipfile.ZipFile(path) as archive:
                files = []
                for info in archive.infolist():
                    name = _check_name(info.filename)
                    mode = info.external_attr >> 16
                    if stat.S_ISLNK(mode):
                        raise ArchiveError(f"the archive entry {info.filename!r} is a symbolic link")
                    if not info.is_dir():
                        files.append(name)
                return files
        if kind == "tar":
            with tarfile.open(path, "r:gz") as archive:
                files = []
                for member in archive.getmembers():
                    name = _check_name(member.name)
                    if member.issym() or member.islnk():
                        raise ArchiveError(f"the archive entry {member.name!r} is a link")
                    if member.isdev() or member.isfifo():
                        raise ArchiveError(f"the archive entry {member.name!r} is a device or pipe")
                    if member.isfile():
                        files.append(name)
                return files
    except (zipfile.BadZipFile, tarfile.TarError, EOFError, OSError) as error:
        raise ArchiveError(f"the archive cannot be read: {error}") from None
    raise ArchiveError("the work must be a .py script or a .zip or .tar.gz archive")


def check_entrypoint(entries, entrypoint):
    entrypoint = _check_name(entrypoint.strip()) if entrypoint.strip() else ""
    if not entrypoint:
        raise ArchiveError("name the entrypoint: the script in the archive to run")
    if not entrypoint.endswith(RUNNABLE):
        raise ArchiveError("the entrypoint must be a .py or .sh file")
    if entrypoint not in entries:
        shown = ", ".join(sorted(e for e in entries if e.endswith(RUNNABLE))[:10]) or "none"
        raise ArchiveError(f"{entrypoint!r} is not in the archive (runnable files there: {shown})")
    return entrypoint


def extract(path, filename, dest):
    """Unpack the work into dest (which must exist), re-checking every entry."""
    dest = Path(dest)
    kind = kind_of(filename)
    if kind == "script":
        shutil.copyfile(path, dest / PurePosixPath(filename).name)
        return
    list_entries(path, filename)  # refuses anything unsafe before a byte is written
    if kind == "zip":
        with zipfile.ZipFile(path) as archive:
            archive.extractall(dest)
    else:
        with tarfile.open(path, "r:gz") as archive:
            archive.extractall(dest, filter="data")
