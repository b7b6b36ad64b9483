"""What the jobs app's API views share besides their shapes (jobs.serializers): a whole-number
query parameter, and the answers to an upload's trouble (a dataset's file, a folder's)."""

from rest_framework import status
from rest_framework.exceptions import ValidationError
from rest_framework.response import Response

from jobs import datasets
from jobs.dataset_forms import sentence


def int_param(request, name, default, minimum=0, maximum=None):
    value = request.query_params.get(name)
    if value in (None, ""):
        return default
    try:
        number = int(value)
    except ValueError:
        raise ValidationError({name: [f"{value!r} is not a whole number."]}) from None
    if number < minimum or (maximum is not None and number > maximum):
        raise ValidationError({name: [f"must be between {minimum} and {maximum}."]})
    return number


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
