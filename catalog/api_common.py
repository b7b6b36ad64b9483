"""The answers to an upload's trouble, which the datasets API (catalog.api) and the folder upload
API (jobs.folder_api) share: a dataset's file and a folder's go through the same uploads."""

from rest_framework import status
from rest_framework.response import Response

from catalog import datasets
from catalog.forms import sentence


def refused(error):
    """A DatasetError as its answer: 409 when the state of things is in the way (with how far
    an upload has arrived, to continue from there), else 400."""
    body = {"detail": sentence(error)}
    if isinstance(error, datasets.UploadConflict):
        if error.received is not None:
            body["received"] = error.received
        return Response(body, status=status.HTTP_409_CONFLICT)
    return Response(body, status=status.HTTP_400_BAD_REQUEST)


def storage_failed(detail):
    """Not the client's doing, and nothing is lost: 503, which upload.js tries again."""
    return Response({"detail": detail}, status=status.HTTP_503_SERVICE_UNAVAILABLE)
