"""The job's work as uploaded: a single script, or an archive with an entrypoint inside.

Archives are checked before they are accepted and again when extracted: an entry with '..',
an absolute path, a link or a device file is refused, so nothing lands outside the job's folder,
and so is an archive that unpacks to more bytes or entries than the limits allow (a zip bomb).
The checks and the bounded extraction live in e31/unpack.py, which imports nothing of ours, so
the runner can run it as a script inside the job's sandbox; this module gives them the settings.
"""

from django.conf import settings

from e31 import unpack
from e31.unpack import ArchiveError, kind_of

__all__ = [
    "REQUIREMENTS",
    "RUNNABLE",
    "ArchiveError",
    "check_entrypoint",
    "extract",
    "extract_limited",
    "kind_of",
    "limits",
    "list_entries",
    "read_requirements",
]

RUNNABLE = (".py", ".sh")
# The packages a job brings may come in its archive, as pip reads them, at the archive's root.
REQUIREMENTS = "requirements.txt"
REQUIREMENTS_MAX_BYTES = 64 * 1024
extract_limited = unpack.extract_limited


def limits():
    """(bytes, entries) an archive may unpack to: never more than a job's folder may hold
    (E31_JOB_DISK_BYTES, where the operator set one; 0 is each node's share, unknown here)."""
    disk = settings.E31_JOB_DISK_BYTES or settings.E31_ARCHIVE_MAX_BYTES
    return min(settings.E31_ARCHIVE_MAX_BYTES, disk), settings.E31_ARCHIVE_MAX_ENTRIES


def list_entries(path, filename, *, max_bytes=None, max_entries=None):
    """The files in the upload (relative paths); raises ArchiveError for anything unsafe or for
    an archive whose headers declare more bytes or entries than the limits (the settings')."""
    default_bytes, default_entries = limits()
    max_bytes = default_bytes if max_bytes is None else max_bytes
    max_entries = default_entries if max_entries is None else max_entries
    return unpack.check(path, filename, max_bytes, max_entries)


def check_entrypoint(entries, entrypoint):
    entrypoint = unpack.check_name(entrypoint.strip()) if entrypoint.strip() else ""
    if not entrypoint:
        raise ArchiveError("name the entrypoint: the script in the archive to run")
    if not entrypoint.endswith(RUNNABLE):
        raise ArchiveError("the entrypoint must be a .py or .sh file")
    if entrypoint not in entries:
        shown = ", ".join(sorted(e for e in entries if e.endswith(RUNNABLE))[:10]) or "none"
        raise ArchiveError(f"{entrypoint!r} is not in the archive (runnable files there: {shown})")
    return entrypoint


def extract(path, filename, dest):
    """Unpack the work into dest (which must exist), re-checking every entry and counting what
    is written against the settings' limits."""
    unpack.extract_limited(path, filename, dest, *limits())


def read_requirements(path, filename, entries):
    """The text of the requirements.txt at the root of an archive (checked: `entries` is what
    list_entries found), or None if it has none; ArchiveError if it is too large or not UTF-8."""
    if kind_of(filename) == "script" or REQUIREMENTS not in entries:
        return None
    data = unpack.read_file(path, filename, REQUIREMENTS, REQUIREMENTS_MAX_BYTES)
    try:
        return None if data is None else data.decode("utf-8-sig")  # an editor's byte-order mark is no requirement
    except UnicodeDecodeError:
        raise ArchiveError(f"{REQUIREMENTS} is not UTF-8 text") from None
