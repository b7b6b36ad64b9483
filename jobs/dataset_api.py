"""The datasets API: list and create datasets, upload files into an open version in chunks,
seal it; register a team's bucket and scan it again. Team scoped like every other endpoint:
another team's dataset or upload is a 404. What a user can get wrong is a 4xx with a reason.

A chunked upload, as upload.js (or any client) does it:

    POST /api/datasets/                                   {"name": ...} -> dataset, version 1 open
    POST /api/datasets/<id>/versions/1/uploads/           {"path", "size", "sha256"?} -> {id, chunk_size, received}
    PUT  /api/datasets/uploads/<upload>/?offset=N         raw bytes -> {received}
    GET  /api/datasets/uploads/<upload>/                  -> {received}: where to continue after a break
    POST /api/datasets/uploads/<upload>/complete/         -> the file's size and sha256 (200), or for a
                                                             large file 202 "completing": poll its url
    POST /api/datasets/<id>/versions/1/seal/              -> the version, ready and immutable
"""

import logging

from django.db.models import Prefetch
from django.urls import reverse
from rest_framework import status
from rest_framework.decorators import api_view, parser_classes
from rest_framework.exceptions import PermissionDenied
from rest_framework.parsers import FormParser, MultiPartParser
from rest_framework.response import Response

from accounts import audit
from accounts.access import is_owner, require_team
from core.api import fields, form_errors_response, paginate
from core.parsers import BoundedJSONParser
from jobs import datasets
from jobs.access import OWNERS_ONLY, get_dataset, get_upload, get_version
from jobs.dataset_forms import CredentialsForm, DatasetForm, S3DatasetForm, sentence
from jobs.models import Dataset, DatasetUpload, DatasetVersion

PARSERS = [BoundedJSONParser, FormParser, MultiPartParser]
log = logging.getLogger(__name__)


def refused(error):
    """A DatasetError as its answer: 409 when the state of things is in the way (with how far
    an upload has arrived, to continue from there), else 400."""
    body = {"detail": sentence(error)}
    if isinstance(error, datasets.UploadConflict):
        if error.received is not None:
            body["received"] = error.received
        return Response(body, status=status.HTTP_409_CONFLICT)
    return Response(body, status=status.HTTP_400_BAD_REQUEST)


def form_errors(form):
    return form_errors_response(form)


# What the API shows ----------------------------------------------------------------------------


def dataset_json(dataset, request, detail=False):
    summary = datasets.summarize(dataset)
    latest = summary["latest"]
    body = {
        "id": str(dataset.pk),
        "name": dataset.name,
        "description": dataset.description,
        "source": dataset.source,
        "created_at": dataset.created_at,
        "state": summary["state"],
        "latest_version": latest.number if latest else None,
        "files": latest.file_count if latest else 0,
        "bytes": latest.total_bytes if latest else 0,
        "open_version": summary["open"].number if summary["open"] else None,
        "url": request.build_absolute_uri(reverse("api:dataset", args=[dataset.pk])),
        "page": request.build_absolute_uri(reverse("datasets:detail", args=[dataset.pk])),
    }
    if dataset.source == Dataset.S3:
        # The credentials are stored encrypted and never shown back, here or anywhere.
        body["s3"] = {
            "uri": dataset.s3_uri,
            "endpoint_url": dataset.s3_endpoint_url,
            "region": dataset.s3_region,
            "credentials": "stored",
        }
    if detail:
        body["versions"] = [version_json(v, request) for v in summary["versions"]]
    return body


def version_json(version, request, manifest=False):
    dataset_id = version.dataset_id
    if version.state == DatasetVersion.OPEN:
        files = list(version.files.all())
        count, size = len(files), sum(f.size for f in files)
    else:
        files, count, size = None, version.file_count, version.total_bytes
    body = {
        "number": version.number,
        "state": version.state,
        "error": version.error,
        "files": count,
        "bytes": size,
        "parent": version.parent.number if version.parent_id else None,
        "created_at": version.created_at,
        "sealed_at": version.sealed_at,
        "url": request.build_absolute_uri(reverse("api:dataset-version", args=[dataset_id, version.number])),
    }
    if version.state == DatasetVersion.OPEN:
        body["uploads_url"] = request.build_absolute_uri(reverse("api:dataset-uploads", args=[dataset_id, version.number]))
        body["seal_url"] = request.build_absolute_uri(reverse("api:dataset-seal", args=[dataset_id, version.number]))
        body["upload_page"] = request.build_absolute_uri(reverse("datasets:upload", args=[dataset_id, version.number]))
    if manifest:
        body["manifest"] = [{"path": f.path, "size": f.size, "sha256": f.sha256} for f in (files if files is not None else version.files.all())]
        body["uploads"] = [upload_json(u, request) for u in version.uploads.filter(state__in=DatasetUpload.UNFINISHED)]
    return body


def upload_json(upload, request):
    return {
        "id": str(upload.pk),
        "path": upload.path,
        "size": upload.size,
        "sha256": upload.sha256 or None,
        "chunk_size": upload.chunk_size,
        "received": upload.received,
        "state": upload.state,
        "error": upload.error,
        "url": request.build_absolute_uri(reverse("api:dataset-upload", args=[upload.pk])),
        "complete_url": request.build_absolute_uri(reverse("api:dataset-upload-complete", args=[upload.pk])),
    }


# Datasets --------------------------------------------------------------------------------------


@api_view(["GET", "POST"])
@parser_classes(PARSERS)
def dataset_list(request):
    """GET: the team's datasets, by name, paged (?page=N&page_size=M). POST {name, description}:
    a dataset to upload files into."""
    team = require_team(request.user)
    if request.method == "GET":
        queryset = Dataset.objects.filter(team=team).order_by("name", "created_at")
        queryset = queryset.prefetch_related(Prefetch("versions", DatasetVersion.objects.order_by("-number")))
        return paginate(request, queryset, lambda d: dataset_json(d, request))
    return create_with(DatasetForm(fields(request), team=team), request)


@api_view(["POST"])
@parser_classes(PARSERS)
def dataset_register_s3(request):
    """{name, uri, endpoint_url, region, access_key_id, secret_access_key}: a dataset of the
    objects under an S3 URI, scanned next."""
    team = require_team(request.user)
    return create_with(S3DatasetForm(fields(request), team=team), request)


def create_with(form, request):
    """A dataset made by a form: 201 with the dataset, or 400/409 with the reasons."""
    if not form.is_valid():
        return form_errors(form)
    try:
        dataset = form.save()
    except datasets.DatasetError as error:
        return refused(error)
    audit.record(request, "dataset.create", dataset)
    return Response(dataset_json(dataset, request, detail=True), status=status.HTTP_201_CREATED)


@api_view(["GET", "DELETE"])
def dataset_detail(request, dataset_id):
    """GET: the dataset with its versions. DELETE (the team's owner): the dataset, its versions
    and unfinished uploads go (204); 409 while unfinished jobs use it, naming them."""
    dataset = get_dataset(request, dataset_id)
    if request.method == "GET":
        return Response(dataset_json(dataset, request, detail=True))
    if not is_owner(request.user):
        raise PermissionDenied(OWNERS_ONLY["delete"])
    try:
        versions = datasets.delete_dataset(dataset)
    except datasets.DatasetError as error:
        return refused(error)
    audit.record(request, "dataset.delete", dataset, label=f"{dataset.name} ({versions} version{'s' if versions != 1 else ''})")
    return Response(status=status.HTTP_204_NO_CONTENT)


@api_view(["POST"])
@parser_classes(PARSERS)
def dataset_credentials(request, dataset_id):
    """{access_key_id, secret_access_key, endpoint_url?, region?, rescan?} (the team's owner):
    new credentials for a registered bucket, never shown back; endpoint_url and region stay as
    they are unless given; rescan: true scans the bucket again with them."""
    dataset = get_dataset(request, dataset_id)
    if not is_owner(request.user):
        raise PermissionDenied(OWNERS_ONLY["credentials"])
    if dataset.source != Dataset.S3:
        return refused(datasets.DatasetError("only a dataset registered from a bucket has credentials to change"))
    data = fields(request)
    given = {key: data[key] for key in data}
    form = CredentialsForm({"endpoint_url": dataset.s3_endpoint_url, "region": dataset.s3_region, **given}, dataset=dataset)
    if not form.is_valid():
        return form_errors(form)
    dataset, _ = form.save()
    audit.record(request, "dataset.credentials", dataset)
    dataset.refresh_from_db()
    return Response(dataset_json(dataset, request, detail=True))


@api_view(["POST"])
def dataset_rescan(request, dataset_id):
    dataset = get_dataset(request, dataset_id)
    try:
        version = datasets.rescan(dataset)
    except datasets.DatasetError as error:
        return refused(error)
    return Response(version_json(version, request), status=status.HTTP_202_ACCEPTED)


# Versions --------------------------------------------------------------------------------------


@api_view(["POST"])
def version_open(request, dataset_id):
    """The version to add files to: the open one (200) or a new one holding the latest ready
    version's files (201)."""
    dataset = get_dataset(request, dataset_id)
    try:
        version, created = datasets.open_version(dataset)
    except datasets.DatasetError as error:
        return refused(error)
    return Response(version_json(version, request, manifest=True), status=status.HTTP_201_CREATED if created else status.HTTP_200_OK)


@api_view(["GET"])
def version_detail(request, dataset_id, number):
    """The version with its manifest: every file's path, size and SHA-256."""
    version = get_version(get_dataset(request, dataset_id), number)
    return Response(version_json(version, request, manifest=True))


@api_view(["POST"])
def version_seal(request, dataset_id, number):
    version = get_version(get_dataset(request, dataset_id), number)
    try:
        version = datasets.seal_version(version)
    except datasets.DatasetError as error:
        return refused(error)
    audit.record(request, "dataset.seal", version, label=f"{version.dataset.name}@{version.number}")
    return Response(version_json(version, request, manifest=True))


# Chunked uploads -------------------------------------------------------------------------------


@api_view(["POST"])
@parser_classes(PARSERS)
def upload_start(request, dataset_id, number):
    """{path, size, sha256?} -> {id, chunk_size, received}: send the chunks next."""
    version = get_version(get_dataset(request, dataset_id), number)
    data = fields(request)
    path, size = data.get("path"), data.get("size")
    if path is None or size is None:
        missing = {field: ["This field is required."] for field, value in (("path", path), ("size", size)) if value is None}
        return Response({"detail": "Give the file's path and size (in bytes).", "errors": missing}, status=status.HTTP_400_BAD_REQUEST)
    if isinstance(size, str) and size.isdigit():
        size = int(size)
    try:
        upload = datasets.start_upload(version, path, size, user=request.user, sha256=data.get("sha256") or "")
    except datasets.DatasetError as error:
        return refused(error)
    return Response(upload_json(upload, request), status=status.HTTP_201_CREATED)


@api_view(["GET", "PUT", "DELETE"])
def upload_detail(request, upload_id):
    """GET: how far the upload has arrived. PUT ?offset=N with the chunk as the raw body.
    DELETE: give the upload up."""
    upload = get_upload(request, upload_id)
    if request.method == "GET":
        return Response(upload_json(upload, request))
    try:
        if request.method == "DELETE":
            upload = datasets.abort_upload(upload)
        else:
            offset = request.query_params.get("offset", "")
            if not offset.isdigit():
                detail = "Give the chunk's offset in bytes: ?offset=N."
                return Response({"detail": detail, "received": upload.received}, status=status.HTTP_400_BAD_REQUEST)
            # Read no more than a chunk's worth (and one byte to tell an overlong chunk).
            stream = request.stream
            data = stream.read(upload.chunk_size + 1) if stream is not None else b""
            upload = datasets.put_chunk(upload, int(offset), data)
    except datasets.DatasetError as error:
        return refused(error)
    except Exception:  # storage trouble: the client sends the chunk again
        log.exception("storing a chunk of %s", upload)
        return storage_failed(f"Storage failed while keeping a chunk of {upload.path}; send it again.")
    return Response(upload_json(upload, request))


@api_view(["POST"])
@parser_classes(PARSERS)
def upload_complete(request, upload_id):
    """Join the chunks and add the file to its version; {sha256?} is checked if given. A small
    file is completed within the request (200, complete); a larger one (over
    E31_UPLOAD_INLINE_COMPLETE_BYTES) is checked, then completed by the scheduler's worker:
    202 with the upload (state completing) and its URL in Location, to poll until its state is
    complete or failed (with the reason in error; open again after storage trouble: complete
    it again)."""
    upload = get_upload(request, upload_id)
    sha256 = fields(request).get("sha256") or ""
    if not isinstance(sha256, str):
        return form_errors_response({"sha256": ["The SHA-256 is 64 hexadecimal digits, as text."]})
    try:
        upload = datasets.complete_upload(upload, sha256=sha256)
    except datasets.DatasetError as error:
        return refused(error)
    except Exception:  # storage trouble: the upload stays open to complete again
        log.exception("completing %s", upload)
        return storage_failed(f"Storage failed while completing {upload.path}; the upload is kept: complete it again.")
    audit.record(request, "dataset.upload.complete", upload, label=f"{upload.version.dataset.name}@{upload.version.number}: {upload.path}")
    body = upload_json(upload, request)
    if upload.state == DatasetUpload.COMPLETING:
        return Response(body, status=status.HTTP_202_ACCEPTED, headers={"Location": body["url"]})
    return Response(body)


def storage_failed(detail):
    """Not the client's doing, and nothing is lost: 503, which upload.js tries again."""
    return Response({"detail": detail}, status=status.HTTP_503_SERVICE_UNAVAILABLE)
