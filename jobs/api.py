"""The REST API: the same jobs, validation and team scoping as the pages."""

import json
import shlex

from django.conf import settings
from django.urls import reverse
from rest_framework import status
from rest_framework.decorators import api_view, parser_classes
from rest_framework.exceptions import ValidationError
from rest_framework.parsers import FormParser, JSONParser, MultiPartParser
from rest_framework.response import Response

from accounts.access import require_team
from jobs.forms import JobForm, keep_uploads
from jobs import datasets
from jobs.models import Job
from jobs.spec import format_env
from jobs.views import artifact_response, get_artifact, get_job, log_response

SPEC_FIELDS = {
    "name",
    "kind",
    "recipe",
    "start_job",
    "evaluate_jobs",
    "smoke_first",
    "entrypoint",
    "args",
    "config",
    "env",
    "train_dataset",
    "heldout_dataset",
    "gpus",
    "gpu_type",
    "mode",
    "span_hours",
    "ceiling_kind",
    "ceiling",
    "not_before",
    "deadline",
    "preemptible",
    "keep_checkpoints",
    "max_restarts",
    "early_stop_metric",
    "early_stop_mode",
    "early_stop_patience",
    "stop_on_nan",
}
BOOLEAN_FIELDS = {"preemptible", "stop_on_nan", "smoke_first"}
MAX_LOG_LIMIT = 5000


def spec_to_form_data(spec, team):
    """The API's JSON spec as the job form's fields; raises ValidationError on a malformed spec."""
    if not isinstance(spec, dict):
        raise ValidationError({"spec": ["The spec must be a JSON object."]})
    unknown = sorted(set(spec) - SPEC_FIELDS)
    if unknown:
        raise ValidationError({"spec": [f"Unknown field(s): {', '.join(unknown)}. Known: {', '.join(sorted(SPEC_FIELDS))}."]})
    structured = {"args": (list, str), "config": (dict, str), "env": (dict, str), "evaluate_jobs": (list,)}
    for field, value in spec.items():
        if field in BOOLEAN_FIELDS:
            if value is not None and not isinstance(value, bool):
                raise ValidationError({field: [f"{field} must be true or false, not {type(value).__name__}."]})
            continue
        allowed = structured.get(field, (str, int, float))
        if value is not None and (not isinstance(value, allowed) or isinstance(value, bool)):
            raise ValidationError({field: [f"{field} must be {_kinds(allowed)}, not {type(value).__name__}."]})
    data = dict(spec)
    # Booleans as a form sends them: absent is off, except the NaN stop, which is on by default.
    data["stop_on_nan"] = spec.get("stop_on_nan") is not False
    for field in BOOLEAN_FIELDS:
        data[field] = "on" if data.get(field) else ""
    if isinstance(data.get("args"), list):
        data["args"] = shlex.join(str(a) for a in data["args"])
    if isinstance(data.get("config"), dict):
        data["config"] = json.dumps(data["config"])
    if isinstance(data.get("env"), dict):
        data["env"] = format_env(data["env"])
    if "mode" not in data:
        data["mode"] = "until_done" if data.get("ceiling") is not None and data.get("span_hours") is None else "span"
    return data


def _kinds(types):
    names = {str: "a string", int: "a number", float: "a number", list: "a list", dict: "an object"}
    return " or ".join(dict.fromkeys(names[t] for t in types))


def pin_datasets(data, team):
    """Datasets named by name or id, with an optional @version ("digits@2"), as the form's
    dataset and version fields."""
    for field, version_field in (("train_dataset", "train_version"), ("heldout_dataset", "heldout_version")):
        if data.get(field):
            try:
                version = datasets.resolve(team, data[field])
            except datasets.DatasetError as error:
                raise ValidationError({field: [f"{str(error)[0].upper()}{str(error)[1:]}."]}) from None
            data[field] = str(version.dataset_id)
            data[version_field] = str(version.pk)
    return data


def job_json(job, request):
    seconds, amount = job.held()
    credit_seconds, credit_amount = job.credited()
    allocation = job.latest_allocation()
    return {
        "id": str(job.pk),
        "name": job.name,
        "kind": job.kind,
        "recipe": job.recipe,
        "parent": str(job.parent_id) if job.parent_id else None,
        "smoke_run": str(job.smoke_run_id) if job.smoke_run_id else None,
        "models": [
            {"label": m.label, "source_job": str(m.source_job_id) if m.source_job_id else None, "description": m.description,
             "files": [{k: f[k] for k in ("name", "size", "sha256")} for f in m.files]}
            for m in job.models.all()
        ],
        "state": job.state,
        "created_at": job.created_at,
        "finished_at": job.finished_at,
        "entrypoint": job.entrypoint,
        "args": job.args,
        "config": job.config,
        "train_dataset": version_ref(job.train_version),
        "heldout_dataset": version_ref(job.heldout_version),
        "staging": staging.progress() if (staging := job.stagings.select_related("node").first()) else None,
        "gpus": job.gpus,
        "gpu_type": job.gpu_type,
        "mode": job.mode,
        "span_hours": decimal_str(job.span_hours),
        "ceiling_amount": decimal_str(job.ceiling_amount),
        "ceiling_gpu_hours": decimal_str(job.ceiling_gpu_hours),
        "not_before": job.not_before,
        "deadline": job.deadline,
        "deadline_missed": job.deadline_missed_at is not None,
        "predicted_start": job.predicted_start,
        "predicted_finish": job.predicted_finish,
        "wait_reason": job.wait_reason,
        "exit_code": job.exit_code,
        "reason": job.reason,
        "restarts": job.restarts,
        "preemptions": job.preemptions,
        "preemptible": job.preemptible,
        "keep_checkpoints": job.keep_checkpoints,
        "max_restarts": job.max_restarts,
        "early_stop_metric": job.early_stop_metric,
        "early_stop_mode": job.early_stop_mode,
        "early_stop_patience": job.early_stop_patience,
        "stop_on_nan": job.stop_on_nan,
        "credited_seconds": credit_seconds,
        "credited": f"{credit_amount:f}",
        "held_seconds": seconds,
        "cost": f"{amount:f}",
        "currency": settings.E31_CURRENCY,
        "allocation": allocation_json(allocation) if allocation else None,
        # Every node and device of the latest allocation (one, or a gang's).
        "allocations": [allocation_json(a) for a in job.latest_allocations()],
        "timeline": [timeline_json(e) for e in job.timeline()],
        "last_seq": job.last_seq,
        "url": request.build_absolute_uri(reverse("jobs:detail", args=[job.pk])),
    }


def timeline_json(event):
    data = event.data or {}
    if event.kind == "state":
        return {"seq": event.seq, "at": event.at, "kind": "state", "state": data.get("state"), "from": data.get("from"), "reason": data.get("reason", "")}
    return {"seq": event.seq, "at": event.at, "kind": event.kind, "name": data.get("name"), "step": data.get("step"), "text": data.get("text", "")}


def version_ref(version):
    return f"{version.dataset.name}@{version.number}" if version is not None else None


def decimal_str(value):
    return None if value is None else str(value)


def allocation_json(allocation):
    return {
        "node": allocation.node.name,
        "devices": allocation.devices,
        "device_type": allocation.device_type,
        "rate": str(allocation.rate),
        "started_at": allocation.started_at,
        "ended_at": allocation.ended_at,
        "end_reason": allocation.end_reason,
        "node_rank": allocation.node_rank,
        "gang_size": allocation.gang_size,
    }


@api_view(["GET", "POST"])
@parser_classes([MultiPartParser, FormParser, JSONParser])
def jobs(request):
    team = require_team(request.user)
    if request.method == "GET":
        queryset = Job.objects.filter(team=team).prefetch_related("allocations")
        state = request.query_params.get("state")
        if state:
            queryset = queryset.filter(state=state)
        return Response([job_json(job, request) for job in queryset[:200]])

    raw = request.data.get("spec")
    if raw is None:
        raise ValidationError({"spec": ["Send the job as a 'spec' field (a JSON object) with files 'code' and 'data'."]})
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as error:
            raise ValidationError({"spec": [f"The spec is not valid JSON: {error.msg} (line {error.lineno}, column {error.colno})."]}) from None
        except RecursionError:
            raise ValidationError({"spec": ["The spec is nested too deeply."]}) from None
    data = pin_datasets(spec_to_form_data(raw, team), team)
    data, upload_errors, created = keep_uploads(request.FILES, data, team, request.user)
    form = JobForm(data, team=team, upload_errors=upload_errors)
    if not form.is_valid():
        # An API client sends its files again with the fixed spec: keep nothing half-made.
        for upload in created:
            upload.delete()
        errors = {field: [str(e) for e in errs] for field, errs in form.errors.items()}
        if "__all__" in errors:
            errors["non_field_errors"] = errors.pop("__all__")
        return Response({"errors": errors}, status=status.HTTP_400_BAD_REQUEST)
    job = form.save(request.user)
    return Response(job_json(job, request), status=status.HTTP_201_CREATED)


@api_view(["GET"])
def job_detail(request, job_id):
    return Response(job_json(get_job(request, job_id), request))


@api_view(["POST"])
def job_cancel(request, job_id):
    job = get_job(request, job_id)
    if job.is_terminal:
        return Response(
            {"detail": f"The job has already ended ({job.state}).", "state": job.state}, status=status.HTTP_409_CONFLICT
        )
    job.request_cancel()
    return Response(job_json(job, request), status=status.HTTP_202_ACCEPTED)


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


@api_view(["GET"])
def job_logs(request, job_id):
    job = get_job(request, job_id)
    after = int_param(request, "after", 0)
    limit = int_param(request, "limit", 1000, minimum=1, maximum=MAX_LOG_LIMIT)
    logs = job.events.filter(kind="log")
    rank = request.query_params.get("rank")
    if rank not in (None, ""):
        logs = logs.filter(rank=int_param(request, "rank", 0))  # one process of a run under torchrun
    rows = list(logs.filter(seq__gt=after).order_by("seq")[:limit])
    lines = [{"seq": e.seq, "at": e.at, "stream": e.stream, "rank": e.rank, "text": e.text} for e in rows]
    next_after = rows[-1].seq if rows else after
    more = logs.filter(seq__gt=next_after).exists()
    return Response({"lines": lines, "next_after": next_after, "more": more, "state": job.state, "done": job.is_terminal and not more})


@api_view(["GET"])
def job_log(request, job_id):
    """The whole log as text, streamed."""
    return log_response(request, get_job(request, job_id))


@api_view(["GET"])
def job_artifacts(request, job_id):
    job = get_job(request, job_id)
    return Response(
        [
            {
                "name": a.name,
                "size": a.size,
                "sha256": a.sha256,
                "url": request.build_absolute_uri(reverse("api:job-artifact", args=[job.pk, a.name])),
            }
            for a in job.artifacts.all()
        ]
    )


@api_view(["GET"])
def job_artifact(request, job_id, name):
    return artifact_response(request, get_artifact(get_job(request, job_id), name))


RETRAIN_FIELDS = {"name", "gpus", "gpu_type", "mode", "span_hours", "ceiling_kind", "ceiling", "not_before", "by", "deadline", "preemptible"}


@api_view(["POST"])
@parser_classes([MultiPartParser, FormParser, JSONParser])
def job_retrain(request, job_id):
    """Retrain a finished job: its work and request (overridable in `spec`), its weights as the
    starting model, its training data plus the files sent as `data`."""
    from jobs import lineage
    from jobs.lineage_views import RetrainForm

    job = get_job(request, job_id)
    team = require_team(request.user)
    raw = request.data.get("spec") or {}
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as error:
            raise ValidationError({"spec": [f"The spec is not valid JSON: {error.msg} (line {error.lineno}, column {error.colno})."]}) from None
    if not isinstance(raw, dict):
        raise ValidationError({"spec": ["The spec must be a JSON object."]})
    unknown = sorted(set(raw) - RETRAIN_FIELDS)
    if unknown:
        raise ValidationError({"spec": [f"Unknown field(s): {', '.join(unknown)}. Known: {', '.join(sorted(RETRAIN_FIELDS))}."]})
    try:
        lineage.weights_of(job)
    except lineage.LineageError as error:
        return Response({"detail": str(error)}, status=status.HTTP_409_CONFLICT)
    fields = {**RetrainForm.initial_from(job), **raw}
    fields["preemptible"] = "on" if fields.get("preemptible") else ""
    data, upload_errors, created = keep_uploads(request.FILES, fields, team, request.user)
    form = RetrainForm(data, team=team, upload_errors=upload_errors)
    if not form.is_valid():
        for upload in created:
            upload.delete()
        return Response({"errors": {f: [str(e) for e in errs] for f, errs in form.errors.items()}}, status=status.HTTP_400_BAD_REQUEST)
    try:
        new = lineage.retrain(
            job, request.user, new_data=form.cleaned_data.get("kept_data") or [], name=form.cleaned_data.get("name") or "",
            request=form.request_fields(),
        )
    except lineage.LineageError as error:
        return Response({"detail": str(error)}, status=status.HTTP_409_CONFLICT)
    return Response(job_json(new, request), status=status.HTTP_201_CREATED)


@api_view(["POST"])
def job_compare(request, job_id):
    """An evaluation job of a finished fine-tuning's weights against its starting weights."""
    from jobs import lineage

    job = get_job(request, job_id)
    try:
        new = lineage.compare(job, request.user)
    except lineage.LineageError as error:
        return Response({"detail": str(error)}, status=status.HTTP_409_CONFLICT)
    return Response(job_json(new, request), status=status.HTTP_201_CREATED)


@api_view(["GET"])
def job_comparison(request, job_id):
    """An evaluation job's metrics per model, and the verdict of new against previous."""
    from jobs.lineage_views import comparison, comparison_json

    job = get_job(request, job_id)
    found = comparison(job)
    if found is None:
        return Response({"detail": "This job has no evaluation (yet)."}, status=status.HTTP_404_NOT_FOUND)
    return Response(comparison_json(job, found))
