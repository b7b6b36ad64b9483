"""A job's log and output files as downloads, for the pages and the API alike."""

from django.http import StreamingHttpResponse
from django.utils.http import content_disposition_header

from core.downloads import download_response
from core.storage import get_storage
from jobs.logs import log_key, stream_log


def log_response(request, job):
    """A finished job's log from storage (Range, or a presigned URL); else from the database."""
    if job.is_terminal and get_storage().exists(log_key(job.pk)):
        return download_response(request, log_key(job.pk), f"{job.name}-{job.short_id}.log")
    response = StreamingHttpResponse(stream_log(job), content_type="text/plain; charset=utf-8")
    response["Content-Disposition"] = content_disposition_header(True, f"{job.name}-{job.short_id}.log")
    return response


def artifact_response(request, artifact):
    return download_response(request, artifact.key, artifact.name.rsplit("/", 1)[-1])
