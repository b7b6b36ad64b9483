"""The REST API of a job's run: its metric series and its checkpoints (token or session auth,
the job's team only: another team's job is a 404, as everywhere)."""

import re

from django.urls import reverse
from rest_framework import status
from rest_framework.decorators import api_view
from rest_framework.exceptions import ValidationError
from rest_framework.response import Response

from accounts import audit
from core.downloads import download_response
from jobs import run_data
from jobs.access import get_job
from jobs.api_common import int_param
from jobs.run_data import checkpoint_is_gone, get_checkpoint, gone_message, metrics_data

MAX_POINTS = 100_000
NAMES = re.compile(r"^[A-Za-z0-9_./-]{1,100}$")


def names_param(request):
    """?names=loss,accuracy as a set of names; None when not given."""
    raw = request.query_params.get("names")
    if raw in (None, ""):
        return None
    names = {name.strip() for name in raw.split(",") if name.strip()}
    bad = sorted(name for name in names if not NAMES.match(name))
    if bad:
        raise ValidationError({"names": [f"Not a metric name: {', '.join(bad)}. Names are 1-100 letters, digits, '_', '.', '/' or '-'."]})
    return names


@api_view(["GET"])
def job_metrics(request, job_id):
    """{"series": {name: [[x, value, at(, "NaN")], ...]}, "summary": {name: {...}}, "events",
    "last_seq"}: the job's metric points (see jobs.metrics for the shapes).

    ?after=<seq>: only points of events after that sequence number (poll with the last_seq of
    the previous answer; the summary then covers the points returned). ?names=loss,acc: only
    those series. ?points=N: at most N points per series (min/max buckets); all by default."""
    job = get_job(request, job_id)
    after = int_param(request, "after", 0)
    limit = int_param(request, "points", 0, minimum=0, maximum=MAX_POINTS)
    data = metrics_data(job, after=after, upto=job.last_seq, names=names_param(request), limit=limit or None)
    return Response(data)


def checkpoint_json(request, job, checkpoint):
    kept = checkpoint.pruned_at is None
    allocation = checkpoint.allocation
    return {
        "name": checkpoint.name,
        "step": checkpoint.step,
        "size": checkpoint.size,
        "sha256": checkpoint.sha256,
        "written_at": checkpoint.written_at,
        "uploaded_at": checkpoint.uploaded_at,
        "node": allocation.node.name if allocation is not None else None,
        "pruned": not kept,
        "pruned_at": checkpoint.pruned_at,
        "url": request.build_absolute_uri(reverse("api:job-checkpoint", args=[job.pk, checkpoint.name])) if kept else None,
    }


@api_view(["GET"])
def job_checkpoints(request, job_id):
    """The job's checkpoints, newest first: the kept ones (the latest keep_checkpoints, with a
    download url) and the pruned ones (deleted from storage; pruned true, no url)."""
    job = get_job(request, job_id)
    return Response([checkpoint_json(request, job, c) for c in run_data.job_checkpoints(job)])


@api_view(["GET"])
def job_checkpoint(request, job_id, name):
    """A kept checkpoint's bytes (Range, or a redirect to a presigned URL); 410 once pruned."""
    job = get_job(request, job_id)
    checkpoint = get_checkpoint(job, name)
    if checkpoint_is_gone(checkpoint):
        return Response({"detail": gone_message(job, checkpoint), "pruned": True}, status=status.HTTP_410_GONE)
    response = download_response(request, checkpoint.key, checkpoint.name.rsplit("/", 1)[-1])
    return audit.recorded(response, request, "checkpoint.download", checkpoint, label=f"{job.name}: {checkpoint.name}")
