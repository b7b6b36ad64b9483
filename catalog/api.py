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

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import status
from rest_framework.decorators import api_view, parser_classes
from rest_framework.exceptions import PermissionDenied
from rest_framework.parsers import FormParser, MultiPartParser
from rest_framework.response import Response

from accounts import audit
from accounts.access import is_owner, require_team
from catalog import datasets
from catalog.access import OWNERS_ONLY, get_dataset, get_upload, get_version
from catalog.api_common import refused, storage_failed
from catalog.forms import CredentialsForm, DatasetForm, S3DatasetForm
from catalog.models import Dataset, DatasetUpload
from catalog.serializers import (
    DatasetCreate,
    DatasetCredentials,
    DatasetDetailSerializer,
    DatasetS3Create,
    DatasetSerializer,
    DatasetUploadSerializer,
    DatasetVersionManifestSerializer,
    DatasetVersionSerializer,
    UploadComplete,
    UploadStart,
)
from core.api import fields, form_errors_response, paginate
from core.parsers import BoundedJSONParser
from core.serializers import page_params, paged

PARSERS = [BoundedJSONParser, FormParser, MultiPartParser]
TAG = "datasets"
IN_THE_WAY = OpenApiResponse(description="In the way.")
log = logging.getLogger(__name__)


def form_body(shape):
    """A request body the endpoint reads as JSON or as a form."""
    return {"application/json": shape, "application/x-www-form-urlencoded": shape, "multipart/form-data": shape}


def dataset_answer(dataset, request, **kwargs):
    """The dataset with its versions, as created or changed."""
    return Response(DatasetDetailSerializer(dataset, context={"request": request}).data, **kwargs)


def version_answer(version, request, **kwargs):
    """The version with its manifest."""
    return Response(DatasetVersionManifestSerializer(version, context={"request": request}).data, **kwargs)


def upload_answer(upload, request, **kwargs):
    return Response(DatasetUploadSerializer(upload, context={"request": request}).data, **kwargs)


def form_errors(form):
    return form_errors_response(form)


# Datasets --------------------------------------------------------------------------------------


@extend_schema(
    methods=["GET"],
    operation_id="datasets_list",
    tags=[TAG],
    summary="List the team's datasets",
    parameters=page_params(),
    responses={200: paged("PagedDatasets", DatasetSerializer)},
)
@extend_schema(
    methods=["POST"],
    operation_id="datasets_create",
    tags=[TAG],
    summary="Create a dataset to upload files into (version 1, open)",
    request=form_body(DatasetCreate),
    responses={201: DatasetDetailSerializer, 409: OpenApiResponse(description="In the way (e.g. the name is taken).")},
)
@api_view(["GET", "POST"])
@parser_classes(PARSERS)
def dataset_list(request):
    """GET: the team's datasets, by name, paged (?page=N&page_size=M). POST {name, description}:
    a dataset to upload files into."""
    team = require_team(request.user)
    if request.method == "GET":
        queryset = DatasetSerializer.prefetch(Dataset.objects.filter(team=team).order_by("name", "created_at"))
        return paginate(request, queryset, DatasetSerializer(context={"request": request}).to_representation)
    return create_with(DatasetForm(fields(request), team=team), request)


@extend_schema(
    operation_id="datasets_register_s3",
    tags=[TAG],
    summary="Register the objects under an S3 URI as a dataset",
    request=form_body(DatasetS3Create),
    responses={201: DatasetDetailSerializer, 409: IN_THE_WAY},
)
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
    return dataset_answer(dataset, request, status=status.HTTP_201_CREATED)


@extend_schema(methods=["GET"], operation_id="dataset_retrieve", tags=[TAG], summary="A dataset with its versions", responses={200: DatasetDetailSerializer})
@extend_schema(
    methods=["DELETE"],
    operation_id="dataset_destroy",
    tags=[TAG],
    summary="Delete the dataset with its versions (the team's owner; stored blobs and a registered bucket's objects are kept)",
    request=None,
    responses={204: OpenApiResponse(description="Deleted."), 409: OpenApiResponse(description="Unfinished jobs use it: 'detail' names them.")},
)
@api_view(["GET", "DELETE"])
def dataset_detail(request, dataset_id):
    """GET: the dataset with its versions. DELETE (the team's owner): the dataset, its versions
    and unfinished uploads go (204); 409 while unfinished jobs use it, naming them."""
    dataset = get_dataset(request, dataset_id)
    if request.method == "GET":
        return dataset_answer(dataset, request)
    if not is_owner(request.user):
        raise PermissionDenied(OWNERS_ONLY["delete"])
    try:
        versions = datasets.delete_dataset(dataset)
    except datasets.DatasetError as error:
        return refused(error)
    audit.record(request, "dataset.delete", dataset, label=f"{dataset.name} ({versions} version{'s' if versions != 1 else ''})")
    return Response(status=status.HTTP_204_NO_CONTENT)


@extend_schema(
    operation_id="dataset_credentials",
    tags=[TAG],
    summary="New credentials for a registered bucket (the team's owner)",
    request=form_body(DatasetCredentials),
    responses={200: DatasetDetailSerializer},
)
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
    return dataset_answer(dataset, request)


@extend_schema(
    operation_id="dataset_rescan",
    tags=[TAG],
    summary="Scan a registered bucket again (a new version)",
    request=None,
    responses={202: DatasetVersionSerializer, 409: IN_THE_WAY},
)
@api_view(["POST"])
def dataset_rescan(request, dataset_id):
    dataset = get_dataset(request, dataset_id)
    try:
        version = datasets.rescan(dataset)
    except datasets.DatasetError as error:
        return refused(error)
    return Response(DatasetVersionSerializer(version, context={"request": request}).data, status=status.HTTP_202_ACCEPTED)


# Versions --------------------------------------------------------------------------------------


@extend_schema(
    operation_id="dataset_version_open",
    tags=[TAG],
    summary="The version to add files to: the open one, or a new one",
    request=None,
    responses={200: DatasetVersionManifestSerializer, 201: DatasetVersionManifestSerializer, 409: IN_THE_WAY},
)
@api_view(["POST"])
def version_open(request, dataset_id):
    """The version to add files to: the open one (200) or a new one holding the latest ready
    version's files (201)."""
    dataset = get_dataset(request, dataset_id)
    try:
        version, created = datasets.open_version(dataset)
    except datasets.DatasetError as error:
        return refused(error)
    return version_answer(version, request, status=status.HTTP_201_CREATED if created else status.HTTP_200_OK)


@extend_schema(operation_id="dataset_version_retrieve", tags=[TAG], summary="A version with its manifest", responses={200: DatasetVersionManifestSerializer})
@api_view(["GET"])
def version_detail(request, dataset_id, number):
    """The version with its manifest: every file's path, size and SHA-256."""
    version = get_version(get_dataset(request, dataset_id), number)
    return version_answer(version, request)


@extend_schema(
    operation_id="dataset_version_seal",
    tags=[TAG],
    summary="Seal an open version: ready and immutable",
    request=None,
    responses={200: DatasetVersionManifestSerializer, 409: IN_THE_WAY},
)
@api_view(["POST"])
def version_seal(request, dataset_id, number):
    version = get_version(get_dataset(request, dataset_id), number)
    try:
        version = datasets.seal_version(version)
    except datasets.DatasetError as error:
        return refused(error)
    audit.record(request, "dataset.seal", version, label=f"{version.dataset.name}@{version.number}")
    return version_answer(version, request)


# Chunked uploads -------------------------------------------------------------------------------


@extend_schema(
    operation_id="dataset_upload_start",
    tags=[TAG],
    summary="Start a chunked upload of a file into an open version",
    request=form_body(UploadStart),
    responses={201: DatasetUploadSerializer, 409: OpenApiResponse(description="In the way (e.g. the version is sealed).")},
)
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
    return upload_answer(upload, request, status=status.HTTP_201_CREATED)


@extend_schema(
    methods=["GET"], operation_id="dataset_upload_retrieve", tags=[TAG], summary="How far an upload has arrived", responses={200: DatasetUploadSerializer}
)
@extend_schema(
    methods=["PUT"],
    operation_id="dataset_upload_put_chunk",
    tags=[TAG],
    summary="Send a chunk of the file, at an offset",
    parameters=[OpenApiParameter("offset", OpenApiTypes.INT, required=True, description="The chunk's offset in bytes: the upload's received.")],
    request={"application/octet-stream": OpenApiTypes.BINARY},
    responses={
        200: DatasetUploadSerializer,
        409: OpenApiResponse(description="Not at the expected offset: continue from 'received'."),
        503: OpenApiResponse(description="Storage failed: send the chunk again."),
    },
)
@extend_schema(
    methods=["DELETE"],
    operation_id="dataset_upload_abort",
    tags=[TAG],
    summary="Give an upload up",
    request=None,
    responses={200: DatasetUploadSerializer, 409: IN_THE_WAY},
)
@api_view(["GET", "PUT", "DELETE"])
def upload_detail(request, upload_id):
    """GET: how far the upload has arrived. PUT ?offset=N with the chunk as the raw body.
    DELETE: give the upload up."""
    upload = get_upload(request, upload_id)
    if request.method == "GET":
        return upload_answer(upload, request)
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
    return upload_answer(upload, request)


@extend_schema(
    operation_id="dataset_upload_complete",
    tags=[TAG],
    summary="Join the chunks and add the file to its version",
    request=form_body(UploadComplete),
    responses={
        200: DatasetUploadSerializer,
        202: OpenApiResponse(
            DatasetUploadSerializer, description="A large file, checked and completing: poll its url (also in Location) until complete or failed."
        ),
        409: OpenApiResponse(description="Not all arrived, or the digest differs."),
        503: OpenApiResponse(description="Storage failed: complete it again."),
    },
)
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
    body = DatasetUploadSerializer(upload, context={"request": request}).data
    if upload.state == DatasetUpload.COMPLETING:
        return Response(body, status=status.HTTP_202_ACCEPTED, headers={"Location": body["url"]})
    return Response(body)
