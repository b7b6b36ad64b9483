"""A folder sent ahead of the job form, resumably: the browser's folder upload (static/js/folder.js).

The browser announces the folder (its files' paths, as sent, and sizes: checked here by
jobs.folders.plan, with an uploaded archive's limits) and gets a FolderUpload with one
DatasetUpload per file. Each file is then sent in chunks through the dataset uploads' own
machinery (catalog.datasets.put_chunk: offsets, a chunk sent again replaces its part, a gap is a
409 with where to continue), so after a dropped connection or a reload the browser asks the
folder how far each file got and goes on from there. The form post carries only the folder's id:
`pack_folder` packs the stored files into the zip the job unpacks (jobs.folders.pack, which
checks the paths and counts the bytes again) and keeps it as the job's code, an Upload, as a
folder posted with the form is kept (jobs.forms.keep_folder); a refused form keeps that Upload,
and the folder answers the same Upload when referred to again. A folder is its team's alone:
every look-up goes through accounts.access.get_for_team.

A file's multipart upload in storage is started with its first chunk, not when the folder is
announced: a folder of many files costs nothing in storage until it is sent. A folder no chunk
reached for too long is given up by the sweep of abandoned uploads (purge_stale_uploads).
"""

import contextlib
import logging
import tempfile
import uuid

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from catalog import datasets
from catalog.datasets import UploadConflict
from catalog.models import DatasetUpload
from core.storage import get_storage
from e31.unpack import size_text
from jobs import archive, folders
from jobs.models import FolderUpload, Upload

log = logging.getLogger(__name__)


def parse_entries(files):
    """The announced files as (path, size) pairs, from [{"path", "size"}, ...] (or [[path, size],
    ...]); FolderError if the shape is not that."""
    if not isinstance(files, list):
        raise folders.FolderError('give the folder\'s files as a list: {"files": [{"path": "myproj/train.py", "size": 120}, ...]}')
    entries = []
    for item in files:
        if isinstance(item, dict):
            path, size = item.get("path"), item.get("size")
        elif isinstance(item, (list, tuple)) and len(item) == 2:
            path, size = item
        else:
            raise folders.FolderError('each file is {"path": ..., "size": ...}')
        entries.append((path, size))
    return entries


def open_folder(team, user, entries):
    """A FolderUpload for the announced files [(path as sent, size)], each an open upload of its
    own with nothing received. FolderError (the reason) if the folder may not be sent."""
    chunk_size = settings.E31_UPLOAD_CHUNK_BYTES
    max_bytes, max_entries = archive.limits()
    top, kept = folders.plan(entries, max_bytes=max_bytes, max_entries=max_entries, max_file_bytes=chunk_size * datasets.MAX_PARTS)
    with transaction.atomic():
        folder = FolderUpload.objects.create(team=team, created_by=user, top=top[:255], file_count=len(kept), total_bytes=sum(size for _, size in kept))
        files = []
        for path, size in kept:
            pk = uuid.uuid4()
            files.append(DatasetUpload(id=pk, folder=folder, path=path, size=size, chunk_size=chunk_size, key=f"incoming/{pk}", created_by=user))
        DatasetUpload.objects.bulk_create(files, batch_size=1000)
    return folder


def put_chunk(folder, upload, offset, data):
    """Store a chunk of one of the folder's files, as catalog.datasets.put_chunk does for a
    dataset's (a chunk received before is replaced; a gap or a misplaced offset is an
    UploadConflict with how far the file has arrived). Returns the file's upload."""
    if upload.folder_id != folder.pk:
        raise ValueError("the upload is not one of the folder's files")
    if folder.state != FolderUpload.OPEN:
        raise UploadConflict(_not_open(folder))  # no `received`: there is nowhere to continue
    if offset == 0 and upload.size and not upload.multipart_id:
        upload = _start_multipart(upload)
    upload = datasets.put_chunk(upload, offset, data)
    # The folder's clock for the sweep: a folder is abandoned when none of its files gets a chunk.
    FolderUpload.objects.filter(pk=folder.pk).update(updated_at=timezone.now())
    return upload


def _start_multipart(upload):
    """The file's multipart upload in storage, started with its first chunk (once, however many
    first chunks arrive at the same moment)."""
    storage = get_storage()
    multipart_id = storage.start_multipart(upload.key)
    with transaction.atomic():
        locked = DatasetUpload.objects.select_for_update().get(pk=upload.pk)
        if locked.multipart_id or locked.state != DatasetUpload.OPEN:
            taken = False  # started by another request meanwhile (or given up): that one stands
        else:
            locked.multipart_id, taken = multipart_id, True
            locked.save(update_fields=["multipart_id", "updated_at"])
    if not taken:
        datasets._quietly(storage.abort_multipart, upload.key, multipart_id)
    return locked


def abort_folder(folder, reason="given up by its client"):
    """Give up the folder's upload and free what its files held in storage. A packed folder is
    its zip's already: refused."""
    with transaction.atomic():
        locked = FolderUpload.objects.select_for_update().get(pk=folder.pk)
        if locked.state == FolderUpload.PACKED:
            raise UploadConflict("the folder is packed already: it is the job's code now")
        if locked.state == FolderUpload.OPEN:
            locked.state, locked.error = FolderUpload.ABORTED, reason
            locked.save(update_fields=["state", "error", "updated_at"])
    for upload in locked.files.filter(state=DatasetUpload.OPEN):
        with contextlib.suppress(UploadConflict):
            datasets.abort_upload(upload, reason)
    return locked


def pack_folder(folder, user):
    """The folder as the job's code: its files, every byte arrived, packed into a zip kept as an
    Upload (role code, unclaimed). A folder packed before answers its zip again (a refused form
    sent once more, or a second job from the same folder). UploadConflict if not every byte has
    arrived or the folder was given up (nothing is lost: send the rest, or choose it again);
    FolderError if what arrived does not pack (the reason; the folder is given up, as sending the
    same files again would not pack either)."""
    try:
        with transaction.atomic():
            # Locked while it is packed: a form sent twice at once packs it once.
            locked = FolderUpload.objects.select_for_update().get(pk=folder.pk)
            if locked.state == FolderUpload.PACKED:
                return _packed_again(locked, user)
            if locked.state != FolderUpload.OPEN:
                raise UploadConflict(_not_open(locked))
            files = list(locked.files.order_by("path"))
            _check_arrived(locked, files)
            storage = get_storage()
            max_bytes, max_entries = archive.limits()
            with tempfile.TemporaryFile() as out, contextlib.ExitStack() as opened:
                top, _ = folders.pack([(f.path, StoredFile(storage, f, opened)) for f in files], out, max_bytes=max_bytes, max_entries=max_entries)
                out.seek(0)
                key, size, sha256 = storage.save_blob(out)
            name = f"{(top or 'folder')[:200]}.zip"
            upload = Upload.objects.create(team=locked.team, uploaded_by=user, role=Upload.CODE, name=name, size=size, sha256=sha256, key=key)
            locked.state, locked.packed, locked.error = FolderUpload.PACKED, upload, ""
            locked.save(update_fields=["state", "packed", "error", "updated_at"])
            DatasetUpload.objects.filter(folder=locked, state=DatasetUpload.OPEN).update(state=DatasetUpload.COMPLETE, updated_at=timezone.now())
    except folders.FolderError as error:
        abort_folder(folder, f"it was not packed: {error}")
        raise
    # The zip holds the bytes now: the files' own storage goes (after commit: the rows say so).
    for file in files:
        datasets._discard(file)
    return upload


def _check_arrived(folder, files):
    """UploadConflict unless every byte of every file has arrived, saying how much has."""
    given_up = [f for f in files if f.state != DatasetUpload.OPEN]
    if given_up:
        raise UploadConflict(f"the upload of {given_up[0].path} is {given_up[0].get_state_display().lower()}: choose the folder again")
    arrived = sum(1 for f in files if f.received >= f.size)
    if arrived < len(files):
        received = sum(min(f.received, f.size) for f in files)
        raise UploadConflict(
            f"the folder has not all arrived yet: {arrived} of {len(files)} files, {size_text(received)} of "
            f"{size_text(folder.total_bytes)}; the page sends the rest, and the form once it has"
        )


def _packed_again(folder, user):
    """The zip of a folder packed before: its Upload while no job has it, else a new Upload of
    the same bytes (a blob is shared, not copied)."""
    packed = folder.packed
    if packed is None:
        raise UploadConflict("the folder was packed, and its zip is no longer kept: choose the folder again")
    if packed.job_id is None:
        return packed
    return Upload.objects.create(team=folder.team, uploaded_by=user, role=Upload.CODE, name=packed.name, size=packed.size, sha256=packed.sha256, key=packed.key)


class StoredFile:
    """One of the folder's files as a binary file for jobs.folders.pack: its chunks joined in
    storage when it is first read (found joined already when packing is tried again), closed at
    its end; FolderError if it does not hold the bytes announced."""

    def __init__(self, storage, upload, opened):
        self.storage, self.upload, self.opened = storage, upload, opened
        self.body, self.count = None, 0

    def read(self, size=-1):
        upload = self.upload
        if not upload.size:
            return b""
        if self.body is None:
            if not self.storage.exists(upload.key):
                self.storage.complete_multipart(upload.key, upload.multipart_id, upload.parts)
            self.body = self.opened.enter_context(contextlib.closing(self.storage.open(upload.key)))
        data = self.body.read(size)
        self.count += len(data)
        if not data:
            self.body.close()  # one file open at a time, however many the folder holds
            if self.count != upload.size:
                raise folders.FolderError(f"{upload.path} arrived as {self.count:,} bytes, not the {upload.size:,} announced")
        return data


def purge_stale_folders(older_than):
    """Folders whose clock (the last chunk, or packing) is older than older_than go, with their
    files' rows (their storage was freed when they were packed, or given up by the sweep of
    abandoned uploads, which calls this). Returns how many."""
    return FolderUpload.objects.filter(updated_at__lt=older_than).delete()[1].get(FolderUpload._meta.label, 0)


def purge_stale_uploads(older_than):
    """The sweep of abandoned uploads (the scheduler's housekeeping): the uploads no chunk reached
    since older_than are given up, a dataset's files and a folder's (catalog.datasets), then the
    folders older than that go with their rows. Returns how many uploads were given up."""
    count = datasets.purge_stale_uploads(older_than)
    gone = purge_stale_folders(older_than)
    if gone:
        log.info("deleted %d folder upload(s) untouched since %s", gone, older_than)
    return count


def _not_open(folder):
    if folder.state == FolderUpload.PACKED:
        return "the folder is packed already: it is the job's code now"
    reason = f" ({folder.error})" if folder.error else ""
    return f"the folder's upload was given up{reason}: choose the folder again"
