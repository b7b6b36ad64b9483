"""Pages for jobs made from jobs: retrain a finished job, compare a fine-tuning with its start,
and the comparison's verdict (see jobs.lineage and jobs.evaluation; the form is jobs.retrain_form, the
comparison jobs.comparisons)."""

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import Http404, JsonResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from accounts import audit
from accounts.access import require_team
from jobs import lineage
from jobs.access import get_job
from jobs.comparisons import comparison, comparison_json
from jobs.forms import keep_uploads
from jobs.models import Upload
from jobs.retrain_form import RetrainForm


@login_required
@require_http_methods(["GET", "POST"])
def job_retrain(request, job_id):
    job = get_job(request, job_id)
    team = require_team(request.user)
    problem = None
    try:
        lineage.weights_of(job)
    except lineage.LineageError as error:
        problem = str(error)
    if request.method == "POST" and problem is None:
        data, upload_errors, _ = keep_uploads(request.FILES, request.POST, team, request.user)
        form = RetrainForm(data, team=team, job=job, upload_errors=upload_errors)
        if form.is_valid():
            try:
                new = lineage.retrain(
                    job,
                    request.user,
                    new_data=form.cleaned_data.get("kept_data") or [],
                    name=form.cleaned_data.get("name") or "",
                    experiment=form.cleaned_data.get("experiment") or "",
                    request=form.request_fields(),
                    work=form.work_changes(),
                    inputs=form.cleaned_data.get("inputs"),
                )
            except lineage.LineageError as error:
                form.add_error(None, str(error))
            else:
                audit.record(request, "job.retrain", job, label=f"{job.name} -> {new.name} ({new.pk})")
                messages.success(request, f"Retraining submitted as {new.name}: it starts from the weights of {job.short_id}.")
                return redirect("jobs:detail", job_id=new.pk)
    else:
        form = RetrainForm(initial=RetrainForm.initial_from(job), team=team, job=job)
    kept = form.fields["kept_data"].queryset.filter(pk__in=form.data.getlist("kept_data")) if form.is_bound else []
    old_files = job.train_version.files.all() if job.train_version else job.uploads.filter(role=Upload.TRAIN)
    return render(
        request,
        "jobs/retrain.html",
        {"job": job, "form": form, "problem": problem, "kept_data": kept, "old_files": old_files},
        status=400 if request.method == "POST" else 200,
    )


@login_required
@require_POST
def job_compare(request, job_id):
    job = get_job(request, job_id)
    try:
        new = lineage.compare(job, request.user)
    except lineage.LineageError as error:
        messages.error(request, str(error))
        return redirect("jobs:detail", job_id=job.pk)
    audit.record(request, "job.compare", job, label=f"{job.name} -> {new.name} ({new.pk})")
    messages.success(request, f"Comparison submitted: {new.name}.")
    return redirect("jobs:detail", job_id=new.pk)


@login_required
@require_GET
def job_comparison_json(request, job_id):
    job = get_job(request, job_id)
    found = comparison(job)
    if found is None:
        raise Http404("This job has no evaluation.")
    response = JsonResponse(comparison_json(job, found), json_dumps_params={"indent": 2})
    response["Content-Disposition"] = f'attachment; filename="comparison-{job.short_id}.json"'
    return response
