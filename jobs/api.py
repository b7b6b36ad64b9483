"""The REST API: the same jobs, validation and team scoping as the pages."""

import json
import shlex
import uuid
from decimal import Decimal

from django.conf import settings
from django.db import connection
from django.db.models import Func, IntegerField, UUIDField
from django.http import HttpResponse
from django.urls import reverse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import status
from rest_framework.decorators import api_view, parser_classes
from rest_framework.exceptions import ParseError, ValidationError
from rest_framework.parsers import FormParser, JSONParser, MultiPartParser
from rest_framework.response import Response

from accounts import audit
from accounts.access import require_team
from accounts.middleware import activate_for
from core.api import fields as body_fields
from core.api import paginate
from core.compiled import Pages, Param, Read
from core.serializers import page_params, paged
from core.sqltime import IsoUtc
from jobs import lineage, specfile, states
from jobs.access import get_artifact, get_job
from jobs.api_common import int_param
from jobs.comparisons import comparison, comparison_json
from jobs.downloads import artifact_response, log_response
from jobs.estimates import budget_left, prediction
from jobs.forms import FOLDER_FIELD, FOLDER_PATHS, FOLDER_UPLOAD, JobForm, RequestForm, keep_uploads
from jobs.models import Job
from jobs.retrain_form import RetrainForm
from jobs.serializers import JobSerializer, JobSubmitForm, JobSubmitJson, RetrainOverridesForm, RetrainOverridesJson, SpecOnlyForm, as_made
from jobs.spec_form import spec_form_data
from jobs.written import ROW_VERSION, row_version

MAX_LOG_LIMIT = 5000


class SpecJSONParser(JSONParser):
    """A JSON body read by the spec's own JSON reader: nested past the limit (or the stack) is a
    400 with the reason, not a 500. The body holds the spec, one level above the spec's own."""

    def parse(self, stream, media_type=None, parser_context=None):
        encoding = (parser_context or {}).get("encoding", settings.DEFAULT_CHARSET)
        try:
            return specfile.parse_json(stream.read().decode(encoding), max_depth=specfile.MAX_DEPTH + 1)
        except (UnicodeDecodeError, specfile.ParseError) as error:
            raise ParseError(f"JSON parse error - {error}") from None


def decimal_str(value):
    return None if value is None else str(value)


JOB_FILTERS = ("state", "kind", "name", "id_prefix")
HEX = set("0123456789abcdef")


TAG = "jobs"


@extend_schema(
    methods=["GET"],
    operation_id="jobs_list",
    tags=[TAG],
    summary="List the team's jobs, newest first",
    parameters=[
        OpenApiParameter("state", OpenApiTypes.STR, description="Only jobs in this state."),
        OpenApiParameter("kind", OpenApiTypes.STR, description="Only jobs of this kind."),
        OpenApiParameter("name", OpenApiTypes.STR, description="Only jobs whose name contains this."),
        OpenApiParameter("id_prefix", OpenApiTypes.STR, description="Only jobs whose id starts with these hex digits."),
        *page_params(),
    ],
    responses={200: paged("PagedJobs", JobSerializer)},
)
@extend_schema(
    methods=["POST"],
    operation_id="jobs_create",
    tags=[TAG],
    summary="Submit a job",
    description="A spec and the files it names (multipart), or a JSON body with the spec as an object (no files).",
    request={"multipart/form-data": JobSubmitForm, "application/json": JobSubmitJson, "application/x-www-form-urlencoded": SpecOnlyForm},
    responses={201: JobSerializer},
)
@api_view(["GET", "POST"])
@parser_classes([MultiPartParser, FormParser, SpecJSONParser])
def jobs(request):
    """GET: the team's jobs, newest first, paged; filters ?state= ?kind= ?name= (contains)
    ?id_prefix= (the start of an id, as `e31` takes one). POST: submit a job from a spec."""
    team = require_team(request.user)
    activate_for(request.user)  # a token's user: "by morning" is the morning where they are
    if request.method == "GET":
        shown = JobSerializer(context={"request": request})
        return paginate(request, filtered_jobs(request, team), shown.list_item, prepare=JobSerializer.prepare, release=JobSerializer.release)
    spec = read_spec(request)
    _data, created, form = job_form(request, team, spec)
    if not form.is_valid():
        # An API client sends its files again with the fixed spec: keep nothing half-made.
        for upload in created:
            upload.delete()
        return spec_refused(spec, form.errors)
    job = form.submit(request)
    return Response(JobSerializer(as_made(job, form.made), context={"request": request}).data, status=status.HTTP_201_CREATED)


# The team's jobs, newest first, a page at a time, and how many: what a CLI polls, their SQL
# made once.
TEAM_JOBS = Read(lambda: versioned(Job.objects.filter(team_id=Param("team", UUIDField())).order_by("-created_at")), paged=True)
TEAM_JOB_COUNT = Read(
    lambda: (
        Job.objects.filter(team_id=Param("team", UUIDField()))
        .order_by()
        .annotate(n=Func(template="COUNT(*)", output_field=IntegerField()))
        .values_list("n", flat=True)
    )
)


def versioned(jobs):
    """The jobs read with their rows' versions, where the database has them (jobs.written)."""
    version = row_version(connection)
    return jobs if version is None else jobs.annotate(**{ROW_VERSION: version})


def filtered_jobs(request, team):
    """The team's jobs the request's filters keep, newest first: a queryset, or, without a
    filter, Pages of TEAM_JOBS (Django built and compiled the page's query and the count at every
    call, about 1.3 ms of a job list's CPU, issue 24)."""
    params = request.query_params
    if not any(params.get(name) for name in JOB_FILTERS):
        return Pages(TEAM_JOBS, TEAM_JOB_COUNT, team=team.pk)
    queryset = versioned(Job.objects.filter(team=team).order_by("-created_at"))
    if params.get("state"):
        if params["state"] not in dict(states.CHOICES):
            raise ValidationError({"state": [f"{params['state']!r} is not a state; one of {', '.join(dict(states.CHOICES))}."]})
        queryset = queryset.filter(state=params["state"])
    if params.get("kind"):
        if params["kind"] not in dict(Job.KINDS):
            raise ValidationError({"kind": [f"{params['kind']!r} is not a kind; one of {', '.join(dict(Job.KINDS))}."]})
        queryset = queryset.filter(kind=params["kind"])
    if params.get("name"):
        queryset = queryset.filter(name__icontains=params["name"])
    if params.get("id_prefix"):
        prefix = params["id_prefix"].lower().replace("-", "")
        if not prefix or len(prefix) > 32 or not set(prefix) <= HEX:
            raise ValidationError({"id_prefix": ["The start of a job's id: hexadecimal digits."]})
        # The ids that start with the prefix are one range of ids (in both databases' order).
        queryset = queryset.filter(pk__gte=uuid.UUID(prefix.ljust(32, "0")), pk__lte=uuid.UUID(prefix.ljust(32, "f")))
    return queryset


def read_spec(request, field="spec"):
    """The job spec a client sent: a spec file's text (YAML or JSON; its refusals name the line,
    and the file by `spec_name`) or a JSON object (the API's flat fields, or the file's parts)."""
    raw = body_fields(request).get(field)
    if raw is None or raw == "":
        raise ValidationError(
            {
                "spec": [
                    "Send the job as 'spec': a spec file's text (YAML or JSON) or a JSON object, with files 'code', 'data', 'heldout' or 'base_model' as it names them."
                ]
            }
        )
    if isinstance(raw, (dict, list)):
        text, name = json.dumps(raw), None
    elif isinstance(raw, str):
        # Refusals name the file and line; a one-line spec without a name is the flat JSON of old.
        given = body_fields(request).get("spec_name")
        text, name = raw, (str(given)[:200] if given else ("spec" if "\n" in raw.strip() else None))
    else:
        raise ValidationError({"spec": ["The spec must be text or a JSON object."]})
    try:
        return specfile.read(text, name)
    except specfile.SpecFileError as error:
        errors = {}
        for line, flat, message in error.problems:  # a field's own problem under its name
            errors.setdefault(flat if flat in specfile.SPEC_FIELDS else "spec", []).append(specfile.where(error.name, line) + message)
        raise ValidationError(errors) from None


def job_form(request, team, spec, form_class=None):
    """The job form over a spec and the files sent with it: (data, new uploads, form)."""
    resolved = []  # the dataset versions the spec names: the form takes them unread
    data = spec_form_data(spec, team, pin=True, resolved=resolved)
    missing = {}
    for file_field, paths in spec.files.items():
        if not request.FILES.getlist(file_field):
            names = ", ".join(path for path, _ in paths)
            missing[file_field] = [
                spec.message(
                    file_field,
                    f"names {names}, which was not sent with the spec: `e31 submit` sends the files a spec names (with curl, add -F {file_field}=@<file>).",
                )
            ]
    if missing:
        raise ValidationError(missing)
    if request.FILES.getlist(FOLDER_FIELD):  # a folder's paths come beside its files, as from the form
        data = {**data, FOLDER_PATHS: request.data.getlist(FOLDER_PATHS) if hasattr(request.data, "getlist") else []}
    folder_ref = body_fields(request).get(FOLDER_UPLOAD)
    if folder_ref:  # or a folder uploaded ahead, by its id (POST /api/folders/), as from the form
        data = {**data, FOLDER_UPLOAD: str(folder_ref)}
    data, upload_errors, created = keep_uploads(request.FILES, data, team, request.user)
    form = (form_class or JobForm)(data, team=team, upload_errors=upload_errors, known=[*created, *resolved], chosen_recipe_only=True)
    return data, created, form


# The form's fields as the spec's: kept files, pinned versions and recipe settings.
FORM_TO_SPEC = {
    "kept_code": "code",
    "train_version": "train_dataset",
    "kept_data": "data",
    "heldout_version": "heldout_dataset",
    "kept_heldout": "heldout",
    "kept_model": "base_model",
}


def spec_refused(spec, form_errors):
    """The form's refusal of a spec: each message names the spec's line and field."""
    errors = {}
    for field, messages in form_errors.items():
        key = "non_field_errors" if field == "__all__" else field
        errors[key] = [spec_message(spec, field, str(m)) for m in messages]
    first = next(iter(errors.values()))[0]
    more = sum(len(m) for m in errors.values()) - 1
    detail = f"The job was refused: {first}" + (f" (and {more} more)" if more else "")
    return Response({"detail": detail, "errors": errors}, status=status.HTTP_400_BAD_REQUEST)


def spec_message(spec, form_field, text):
    if form_field == "__all__":
        return specfile.where(spec.name, None) + text
    if form_field.startswith("recipe_"):  # recipe_<name>_<param>: a key of work.config
        param = form_field.removeprefix(f"recipe_{spec.fields.get('recipe')}_")
        line = spec.key_lines.get(("work", "config", param)) or spec.key_lines.get(("config", param)) or spec.line_of("config") or spec.line_of("recipe")
        return specfile.where(spec.name, line) + f"work.config.{param}: {text}"
    return spec.message(FORM_TO_SPEC.get(form_field, form_field), text)


@extend_schema(operation_id="job_retrieve", tags=[TAG], summary="A job", responses={200: JobSerializer})
@api_view(["GET"])
def job_detail(request, job_id):
    return Response(JobSerializer(get_job(request, job_id), context={"request": request}).data)


@extend_schema(
    operation_id="job_cancel",
    tags=[TAG],
    summary="Cancel the job",
    request=None,
    responses={202: JobSerializer, 409: OpenApiResponse(description="The job has already ended.")},
)
@api_view(["POST"])
def job_cancel(request, job_id):
    job = get_job(request, job_id)
    if job.is_terminal:
        return Response({"detail": f"The job has already ended ({job.state}).", "state": job.state}, status=status.HTTP_409_CONFLICT)
    job.request_cancel()
    audit.record(request, "job.cancel", job)
    return Response(JobSerializer(job, context={"request": request}).data, status=status.HTTP_202_ACCEPTED)


@api_view(["GET"])
def job_logs(request, job_id):
    job = get_job(request, job_id)
    after = int_param(request, "after", 0)
    limit = int_param(request, "limit", 1000, minimum=1, maximum=MAX_LOG_LIMIT)
    logs = job.events.filter(kind="log")
    rank = request.query_params.get("rank")
    if rank not in (None, ""):
        logs = logs.filter(rank=int_param(request, "rank", 0))  # one process of a run under torchrun
    # Plain rows, not events: a page of a thousand lines spent more making model instances than
    # reading them (issue 24); their times as text, written by the database as the JSON would.
    rows = logs.filter(seq__gt=after).order_by("seq").annotate(at_text=IsoUtc("at"))
    fields = ("seq", "at", "stream", "rank", "text")
    # One line more than asked says whether there are more (no second query).
    lines = [dict(zip(fields, row, strict=True)) for row in rows.values_list("seq", "at_text", "stream", "rank", "text")[: limit + 1]]
    more = len(lines) > limit
    lines = lines[:limit]
    next_after = lines[-1]["seq"] if lines else after
    return Response({"lines": lines, "next_after": next_after, "more": more, "state": job.state, "done": job.is_terminal and not more})


@api_view(["GET"])
def job_log(request, job_id):
    """The whole log as text, streamed."""
    job = get_job(request, job_id)
    return audit.recorded(log_response(request, job), request, "log.download", job)


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
    job = get_job(request, job_id)
    artifact = get_artifact(job, name)
    return audit.recorded(artifact_response(request, artifact), request, "artifact.download", artifact, label=f"{job.name}: {artifact.name}")


RETRAIN_FIELDS = {
    "name",
    "experiment",
    "gpus",
    "gpu_type",
    "mode",
    "span_hours",
    "ceiling_kind",
    "ceiling",
    "not_before",
    "by",
    "deadline",
    "preemptible",
    "args",
    "hyperparameters",
    "config",
    "inputs",
}


@extend_schema(
    operation_id="job_retrain",
    tags=[TAG],
    summary="Retrain a finished job, with more data",
    request={"multipart/form-data": RetrainOverridesForm, "application/json": RetrainOverridesJson, "application/x-www-form-urlencoded": RetrainOverridesForm},
    responses={201: JobSerializer, 409: OpenApiResponse(description="The job has no weights to retrain from.")},
)
@api_view(["POST"])
@parser_classes([MultiPartParser, FormParser, SpecJSONParser])
def job_retrain(request, job_id):
    """Retrain a finished job: its work and request (overridable in `spec`), its weights as the
    starting model, its training data plus the files sent as `data`."""
    job = get_job(request, job_id)
    team = require_team(request.user)
    raw = body_fields(request).get("spec") or {}
    if isinstance(raw, str):
        try:
            raw = specfile.parse_json(raw)
        except specfile.ParseError as error:
            where = f" (line {error.line}, column {error.column})" if error.column else ""
            raise ValidationError({"spec": [f"The spec is {error}{where}."]}) from None
    if not isinstance(raw, dict):
        raise ValidationError({"spec": ["The spec must be a JSON object."]})
    unknown = sorted(set(raw) - RETRAIN_FIELDS)
    if unknown:
        raise ValidationError({"spec": [f"Unknown field(s): {', '.join(unknown)}. Known: {', '.join(sorted(RETRAIN_FIELDS))}."]})
    for field in ("name", "experiment"):  # as a submitted spec's (jobs.spec_form)
        if raw.get(field) is not None and (not isinstance(raw[field], (str, int, float)) or isinstance(raw[field], bool)):
            raise ValidationError({field: [f"{field} must be a string or a number, not {type(raw[field]).__name__}."]})
    try:
        lineage.weights_of(job)
    except lineage.LineageError as error:
        return Response({"detail": str(error)}, status=status.HTTP_409_CONFLICT)
    changed = {k: v for k, v in raw.items() if k in ("args", "hyperparameters", "config", "inputs")}
    for field, value in changed.items():
        if field == "args" and isinstance(value, list):
            raw[field] = shlex.join(str(a) for a in value)
        elif field != "args" and isinstance(value, dict):
            raw[field] = json.dumps(value)
    fields = {**RetrainForm.initial_from(job), **raw}
    fields["preemptible"] = "on" if fields.get("preemptible") else ""
    data, upload_errors, created = keep_uploads(request.FILES, fields, team, request.user)
    form = RetrainForm(data, team=team, job=job, upload_errors=upload_errors)
    if not form.is_valid():
        for upload in created:
            upload.delete()
        return Response({"errors": {f: [str(e) for e in errs] for f, errs in form.errors.items()}}, status=status.HTTP_400_BAD_REQUEST)
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
        return Response({"detail": str(error)}, status=status.HTTP_409_CONFLICT)
    audit.record(request, "job.retrain", job, label=f"{job.name} -> {new.name} ({new.pk})")
    return Response(JobSerializer(new, context={"request": request}).data, status=status.HTTP_201_CREATED)


@extend_schema(
    operation_id="job_compare",
    tags=[TAG],
    summary="Evaluate a fine-tuning against its starting weights",
    request=None,
    responses={201: JobSerializer, 409: OpenApiResponse(description="Nothing to compare.")},
)
@api_view(["POST"])
def job_compare(request, job_id):
    """An evaluation job of a finished fine-tuning's weights against its starting weights."""
    job = get_job(request, job_id)
    try:
        new = lineage.compare(job, request.user)
    except lineage.LineageError as error:
        return Response({"detail": str(error)}, status=status.HTTP_409_CONFLICT)
    audit.record(request, "job.compare", job, label=f"{job.name} -> {new.name} ({new.pk})")
    return Response(JobSerializer(new, context={"request": request}).data, status=status.HTTP_201_CREATED)


@api_view(["GET"])
def job_comparison(request, job_id):
    """An evaluation job's metrics per model, and the verdict of new against previous."""
    job = get_job(request, job_id)
    found = comparison(job)
    if found is None:
        return Response({"detail": "This job has no evaluation (yet)."}, status=status.HTTP_404_NOT_FOUND)
    return Response(comparison_json(job, found))


@api_view(["POST"])
@parser_classes([MultiPartParser, FormParser, SpecJSONParser])
def estimate(request):
    """What a spec would cost at most, and when it would start and finish behind today's queue,
    before it is submitted (no files needed)."""
    team = require_team(request.user)
    activate_for(request.user)
    spec = read_spec(request)
    form = RequestForm(spec_form_data(spec, team))
    if not form.is_valid() or form.estimate is None:
        return spec_refused(spec, form.errors or {"__all__": ["The request has no cost to estimate."]})
    cleaned, estimate = form.cleaned_data, form.estimate
    body = {
        "gpus": cleaned["gpus"],
        "gpu_type": cleaned.get("gpu_type") or "",
        "mode": cleaned["mode"],
        "hours": decimal_str(estimate.hours.quantize(Decimal("0.0001"))),
        "gpu_hours": decimal_str(estimate.gpu_hours.quantize(Decimal("0.0001"))),
        "rate": str(form.rate),
        "worst_case": decimal_str(estimate.amount.quantize(Decimal("0.01"))),
        "currency": settings.E31_CURRENCY,
        "preemptible": bool(cleaned.get("preemptible")),
        "not_before": cleaned.get("not_before"),
        "deadline": cleaned.get("deadline"),
        "budget_remaining": None,
        "over_budget": False,
    }
    body.update(prediction(team, form))
    budget = budget_left(team, estimate.amount)
    if budget:
        body.update(budget_remaining=decimal_str(budget["budget_remaining"]), over_budget=budget["over_budget"])
    return Response(body)


@api_view(["GET"])
def job_spec(request, job_id):
    """The job written down as a spec file (YAML; ?format=json for JSON), to submit again."""
    job = get_job(request, job_id)
    spec = specfile.job_spec(job)
    if request.query_params.get("format") == "json":
        return audit.recorded(Response(spec), request, "spec.download", job)
    response = HttpResponse(specfile.dump(spec), content_type="application/yaml; charset=utf-8")
    response["Content-Disposition"] = f'attachment; filename="{specfile.file_name(job)}"'
    return audit.recorded(response, request, "spec.download", job)
