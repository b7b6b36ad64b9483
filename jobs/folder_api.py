"""The folder upload API: a job's code folder sent ahead of the job form, resumably (the new-job
page's folder.js; jobs/folder_uploads.py). Team scoped: another team's folder, or a file of it,
is a 404 (and recorded as asked for). What a client can get wrong is a 4xx with a reason.

    POST /api/folders/                          {"files": [{"path", "size"}, ...]} -> the folder:
                                                  its id, and each file's id, chunk_size, received
    GET  /api/folders/<id>/                     -> how far each file has arrived: continue from there
    PUT  /api/folders/<id>/files/<file>/?offset=N   raw bytes -> the file's {received}; a chunk at
                                                  the wrong offset is a 409 with `received`
    DELETE /api/folders/<id>/                   -> given up, its storage freed

Then the job form (or POST /api/jobs/) names the folder in `code_folder_upload`: it is packed
into the zip the job unpacks, and kept across a refused form.
"""

import logging

from django.urls import reverse
from rest_framework import status
from rest_framework.decorators import api_view, parser_classes
from rest_framework.response import Response

from accounts.access import get_for_team, require_team
from catalog import datasets
from catalog.api_common import refused, storage_failed
from catalog.models import DatasetUpload
from core.api import fields
from core.parsers import BoundedJSONParser
from jobs import folder_uploads, folders
from jobs.models import FolderUpload

log = logging.getLogger(__name__)


def get_folder(request, folder_id):
    return get_for_team(FolderUpload.objects.all(), request.user, pk=folder_id)


def get_file(request, folder, file_id):
    """One of the folder's files (the folder found for the team first: a file of another folder,
    even the team's own, is not found here)."""
    return get_for_team(DatasetUpload.objects.filter(folder=folder).select_related("folder"), request.user, "folder__team", pk=file_id)


def folder_json(folder, request):
    url = request.build_absolute_uri(reverse("api:folder", args=[folder.pk]))
    rows = list(folder.files.order_by("path"))
    arrived = sum(1 for f in rows if f.received >= f.size)
    return {
        "id": str(folder.pk),
        "state": folder.state,
        "error": folder.error,
        "top": folder.top,
        "file_count": folder.file_count,
        "bytes": folder.total_bytes,
        "files_arrived": arrived,
        "received": sum(min(f.received, f.size) for f in rows),
        "complete": folder.state == FolderUpload.PACKED or (folder.state == FolderUpload.OPEN and arrived == folder.file_count),
        "packed_as": folder.packed.name if folder.packed_id else None,
        "created_at": folder.created_at,
        "url": url,
        "files": [file_json(f, url) for f in rows],
    }


def file_json(upload, folder_url):
    return {
        "id": str(upload.pk),
        "path": upload.path,
        "size": upload.size,
        "chunk_size": upload.chunk_size,
        "received": upload.received,
        "state": upload.state,
        "url": f"{folder_url}files/{upload.pk}/",
    }


@api_view(["POST"])
@parser_classes([BoundedJSONParser])
def folder_open(request):
    """{"files": [{"path": "myproj/train.py", "size": 120}, ...]}: the folder's files, with their
    paths as the browser gives them, checked as an uploaded folder's are, within an archive's
    limits -> 201 with the folder, each file ready for its chunks."""
    team = require_team(request.user)
    try:
        entries = folder_uploads.parse_entries(fields(request).get("files"))
        folder = folder_uploads.open_folder(team, request.user, entries)
    except folders.FolderError as error:
        return Response({"detail": f"The folder was not accepted: {str(error).rstrip('.')}."}, status=status.HTTP_400_BAD_REQUEST)
    return Response(folder_json(folder, request), status=status.HTTP_201_CREATED)


@api_view(["GET", "DELETE"])
def folder_detail(request, folder_id):
    """GET: the folder, with how far each of its files has arrived. DELETE: give it up."""
    folder = get_folder(request, folder_id)
    if request.method == "DELETE":
        try:
            folder = folder_uploads.abort_folder(folder)
        except datasets.DatasetError as error:
            return refused(error)
    return Response(folder_json(folder, request))


@api_view(["GET", "PUT"])
def folder_file(request, folder_id, file_id):
    """GET: how far the file has arrived. PUT ?offset=N with the chunk as the raw body (at the
    offset the file has arrived to; a chunk received before may be sent again)."""
    folder = get_folder(request, folder_id)
    upload = get_file(request, folder, file_id)
    folder_url = request.build_absolute_uri(reverse("api:folder", args=[folder.pk]))
    if request.method == "GET":
        return Response(file_json(upload, folder_url))
    offset = request.query_params.get("offset", "")
    if not offset.isdigit():
        return Response({"detail": "Give the chunk's offset in bytes: ?offset=N.", "received": upload.received}, status=status.HTTP_400_BAD_REQUEST)
    try:
        # Read no more than a chunk's worth (and one byte to tell an overlong chunk).
        stream = request.stream
        data = stream.read(upload.chunk_size + 1) if stream is not None else b""
        upload = folder_uploads.put_chunk(folder, upload, int(offset), data)
    except datasets.DatasetError as error:
        return refused(error)
    except Exception:  # storage trouble: the client sends the chunk again
        log.exception("storing a chunk of %s", upload)
        return storage_failed(f"Storage failed while keeping a chunk of {upload.path}; send it again.")
    return Response(file_json(upload, folder_url))
