import json

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import Http404, StreamingHttpResponse
from django.shortcuts import redirect, render
from django.utils.http import content_disposition_header
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from accounts.access import get_for_team, require_team
from e31web.downloads import download_response
from e31web.storage import get_storage
from jobs.forms import JobForm, RequestForm, keep_uploads
from jobs.logs import log_key, stream_log
from jobs.models import Job

LOG_LINES_ON_PAGE = 500


def get_job(request, job_id):
    return get_for_team(Job.objects.all(), request.user, pk=job_id)


@login_required
@require_GET
def job_list(request):
    team = require_team(request.user)
    jobs = Job.objects.filter(team=team).prefetch_related("allocations")[:200]
    template = "jobs/_job_rows.html" if request.htmx else "jobs/list.html"
    return render(request, template, {"jobs": jobs, "any_active": any(job.is_active for job in jobs)})


@login_required
@require_http_methods(["GET", "POST"])
def job_new(request):
    team = require_team(request.user)
    if request.method == "POST":
        data, upload_errors, _ = keep_uploads(request.FILES, request.POST, team, request.user)
        form = JobForm(data, team=team, upload_errors=upload_errors)
        if form.is_valid():
            job = form.save(request.user)
            messages.success(request, f"Job {job.name} submitted.")
            return redirect("jobs:detail", job_id=job.pk)
        estimate_form = form
    else:
        form = JobForm(team=team)
        estimate_form = RequestForm({name: field.initial for name, field in RequestForm.base_fields.items()})
        estimate_form.is_valid()
    context = {
        "form": form,
        "estimate_form": estimate_form,
        "kept_code": form.kept("kept_code"),
        "kept_data": form.kept("kept_data"),
        "kept_heldout": form.kept("kept_heldout"),
    }
    return render(request, "jobs/new.html", context)


@login_required
@require_POST
def job_estimate(request):
    """The cost of the request as the form is filled in (an htmx fragment)."""
    require_team(request.user)
    form = RequestForm(request.POST)
    form.is_valid()
    return render(request, "jobs/_estimate.html", {"form": form})


@login_required
@require_GET
def job_detail(request, job_id):
    job = get_job(request, job_id)
    if request.htmx and request.GET.get("part") == "artifacts":
        return render(request, "jobs/_artifacts.html", {"job": job, "artifacts": job.artifacts.all()})
    lines = list(job.events.filter(kind="log").order_by("-seq")[:LOG_LINES_ON_PAGE])[::-1]
    context = {
        "job": job,
        "timeline": job.timeline(),
        "lines": lines,
        "earlier_lines": lines and lines[0].seq > 1 and job.events.filter(kind="log", seq__lt=lines[0].seq).exists(),
        "meter": job.meter_event(),
        "allocation": job.latest_allocation(),
        "staging": job.stagings.select_related("node").first(),
        "artifacts": job.artifacts.all(),
        "uploads": job.uploads.exclude(role="code"),
        "config_text": json.dumps(job.config),
        "last_seq": job.last_seq,
    }
    return render(request, "jobs/detail.html", context)


@login_required
@require_POST
def job_cancel(request, job_id):
    job = get_job(request, job_id)
    if job.is_terminal:
        messages.info(request, f"The job has already {job.get_state_display().lower()}.")
    else:
        job.request_cancel()
        messages.success(request, "Cancelling the job." if job.is_active else "The job is cancelled.")
    return redirect("jobs:detail", job_id=job.pk)


@login_required
@require_GET
def job_log(request, job_id):
    return log_response(request, get_job(request, job_id))


def log_response(request, job):
    """A finished job's log from storage (Range, or a presigned URL); else from the database."""
    if job.is_terminal and get_storage().exists(log_key(job.pk)):
        return download_response(request, log_key(job.pk), f"{job.name}-{job.short_id}.log")
    response = StreamingHttpResponse(stream_log(job), content_type="text/plain; charset=utf-8")
    response["Content-Disposition"] = content_disposition_header(True, f"{job.name}-{job.short_id}.log")
    return response


def artifact_response(request, artifact):
    return download_response(request, artifact.key, artifact.name.rsplit("/", 1)[-1])


@login_required
@require_GET
def artifact_download(request, job_id, name):
    job = get_job(request, job_id)
    return artifact_response(request, get_artifact(job, name))


def get_artifact(job, name):
    artifact = job.artifacts.filter(name=name).first()
    if artifact is None:
        raise Http404("No such output file.")
    return artifact
