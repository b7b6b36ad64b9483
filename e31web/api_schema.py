"""The API's OpenAPI 3 description (drf-spectacular): what each endpoint takes and answers.

The views are function-based (@api_view) without serializers, so their request bodies, query
parameters and answers are described here, next to each other, and applied to the view functions
where they are defined (extend_schema on an @api_view function annotates its view class in
place). e31web/api_urls.py imports this module, so the schema is complete wherever the URLs are.

Every operation also answers errors in one shape (the Error component): the postprocessing hook
add_error_responses documents them on every operation.
"""

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import (
    OpenApiParameter,
    OpenApiResponse,
    extend_schema,
    inline_serializer,
)
from rest_framework import serializers as s

from accounts import api as accounts_api
from accounts import audit_views
from billing import api as billing_api
from billing import invoice_views
from e31.recipes.precision import PRECISIONS
from jobs import api as jobs_api
from jobs import dataset_api, folder_api, run_api

ERROR_CODES = {
    "400": "The request was refused: 'detail' says why, 'errors' which fields are at fault.",
    "401": "No valid API token: send 'Authorization: Token <key>'.",
    "403": "Not allowed.",
    "404": "No such object in your team (another team's objects are not found either), or no such page.",
    "405": "The address does not answer this method.",
    "415": "The body's media type is not one the endpoint reads.",
    "429": "Too many requests for this token: wait retry_after seconds (also the Retry-After header).",
}


def add_error_responses(result, generator, request, public):
    """Postprocessing hook: the Error component, and the error answers on every operation."""
    schemas = result.setdefault("components", {}).setdefault("schemas", {})
    schemas["Error"] = {
        "type": "object",
        "description": "Every 4xx/5xx answer of the API. Some endpoints add keys (received, state, retry_after).",
        "properties": {
            "detail": {"type": "string", "description": "One sentence: what went wrong and what to do."},
            "errors": {
                "type": "object",
                "description": "The fields at fault, each with its messages.",
                "additionalProperties": {"type": "array", "items": {"type": "string"}},
            },
            "retry_after": {"type": "integer", "description": "429 only: seconds to wait."},
        },
        "required": ["detail"],
    }
    error = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
    for path_item in result.get("paths", {}).values():
        for operation in path_item.values():
            responses = operation.setdefault("responses", {})
            for code, description in ERROR_CODES.items():
                responses.setdefault(code, {"description": description, "content": error})
            responses.setdefault("default", {"description": "Any other error (a 5xx: the server's fault).", "content": error})
    return result


# Building blocks ------------------------------------------------------------------------------


def page_params():
    return [
        OpenApiParameter("page", OpenApiTypes.INT, description="Page number, from 1 (a page past the last one is a 404)."),
        OpenApiParameter("page_size", OpenApiTypes.INT, description="Items per page."),
    ]


def paged(name, item):
    return inline_serializer(
        name=name,
        fields={
            "count": s.IntegerField(help_text="How many items there are in all."),
            "next": s.URLField(allow_null=True, help_text="The next page's URL; null on the last page."),
            "previous": s.URLField(allow_null=True, help_text="The previous page's URL; null on the first page."),
            "results": item(many=True),
        },
    )


def month_param(description="The month, YYYY-MM; this month by default."):
    return OpenApiParameter("month", OpenApiTypes.STR, description=description, pattern=r"^\d{4}-\d{2}$")


def nullable_str(**kwargs):
    return s.CharField(allow_null=True, allow_blank=True, **kwargs)


class Allocation(s.Serializer):
    node = s.CharField()
    devices = s.JSONField()
    device_type = s.CharField(allow_blank=True)
    rate = s.CharField(help_text="Per GPU-hour, a decimal string.")
    started_at = s.DateTimeField()
    ended_at = s.DateTimeField(allow_null=True)
    end_reason = s.CharField(allow_blank=True, allow_null=True)
    node_rank = s.IntegerField(allow_null=True)
    gang_size = s.IntegerField(allow_null=True)


class Job(s.Serializer):
    id = s.UUIDField()
    name = s.CharField(allow_blank=True)
    kind = s.CharField()
    recipe = s.CharField(allow_blank=True, allow_null=True)
    parent = s.UUIDField(allow_null=True)
    smoke_run = s.UUIDField(allow_null=True)
    state = s.CharField()
    created_at = s.DateTimeField()
    finished_at = s.DateTimeField(allow_null=True)
    entrypoint = s.CharField(allow_blank=True, allow_null=True)
    command = s.CharField(allow_blank=True, help_text="One shell line run instead of an entrypoint (bash -c); blank for none.")
    args = s.ListField(child=s.CharField(), help_text="As given: $NAME and ${NAME} are replaced by the job's variables when it starts.")
    hyperparameters = s.DictField(help_text="Passed after the arguments as --name value, and in SM_HPS / SM_HP_<NAME>.")
    config = s.DictField()
    workdir = s.CharField(allow_blank=True, help_text="The working folder in the code; blank: the entrypoint's own folder.")
    processes = s.IntegerField(allow_null=True, help_text="Processes per node; null: one per GPU, or one for CPU slots (as threads).")
    precision = s.ChoiceField(
        choices=["", *PRECISIONS],
        allow_blank=True,
        help_text="fp32, bf16 or fp16: the recipes' autocast on GPUs (fp16 with loss scaling; the CPU runs fp32), and E31_PRECISION "
        "in the job; blank: the default (the recipes: bf16 on GPUs).",
    )
    packages = s.ListField(child=s.CharField(), help_text="The Python packages the job brings: requirements, as in requirements.txt.")
    train_dataset = nullable_str(help_text="name@version")
    heldout_dataset = nullable_str(help_text="name@version")
    inputs = s.DictField(
        child=s.JSONField(), help_text="The named inputs: {name: dataset@version, or the list of its files}, each in $E31_DATA_DIR/<name> (SM_CHANNEL_<NAME>)."
    )
    gpus = s.IntegerField()
    gpu_type = s.CharField(allow_blank=True)
    mode = s.CharField()
    span_hours = nullable_str()
    ceiling_amount = nullable_str()
    ceiling_gpu_hours = nullable_str()
    not_before = s.DateTimeField(allow_null=True)
    deadline = s.DateTimeField(allow_null=True)
    predicted_start = s.DateTimeField(allow_null=True)
    predicted_finish = s.DateTimeField(allow_null=True)
    exit_code = s.IntegerField(allow_null=True)
    restarts = s.IntegerField()
    preemptible = s.BooleanField()
    idle_minutes = s.IntegerField(help_text="Minutes with every device idle before the job is flagged (0: never).")
    stop_if_idle = s.BooleanField(help_text="Once flagged idle, the job is stopped with a checkpoint.")
    idle_since = s.DateTimeField(allow_null=True, help_text="While flagged idle: since when its devices are idle.")
    utilization = s.JSONField(
        allow_null=True,
        help_text='Once it ended: {"seconds", "busy" (devices\' worth), "series": [{"name", "mean", "peak", "memory_mean", "memory_peak", "memory_total"}]}.',
    )
    held_seconds = s.FloatField()
    cost = s.CharField(help_text="A decimal string, in currency.")
    currency = s.CharField()
    credited_seconds = s.FloatField(required=False)
    credited = s.CharField(required=False, help_text="A decimal string, in currency: taken off for time lost through the network's fault.")
    ceiling_used_fraction = s.FloatField(allow_null=True, help_text="How much of the job's ceiling is used, 0 to 1 (the nearer one of two); null: no ceiling.")
    ceiling_amount_left = nullable_str(help_text="Of a money ceiling, what is left (a decimal string); null: none.")
    ceiling_gpu_hours_left = nullable_str(help_text="Of a GPU-hours ceiling, what is left (a decimal string); null: none.")
    allocation = Allocation(allow_null=True)
    allocations = Allocation(many=True)
    timeline = s.ListField(child=s.DictField())
    last_seq = s.IntegerField()
    url = s.URLField()


class DatasetVersion(s.Serializer):
    number = s.IntegerField()
    state = s.CharField()
    error = s.CharField(allow_blank=True, allow_null=True)
    files = s.IntegerField()
    bytes = s.IntegerField()
    parent = s.IntegerField(allow_null=True)
    created_at = s.DateTimeField()
    sealed_at = s.DateTimeField(allow_null=True)
    url = s.URLField()
    uploads_url = s.URLField(required=False, help_text="Open versions only.")
    seal_url = s.URLField(required=False, help_text="Open versions only.")


class DatasetFile(s.Serializer):
    path = s.CharField()
    size = s.IntegerField()
    sha256 = s.CharField()


class Upload(s.Serializer):
    id = s.UUIDField()
    path = s.CharField()
    size = s.IntegerField()
    sha256 = s.CharField(allow_null=True)
    chunk_size = s.IntegerField()
    received = s.IntegerField(help_text="Bytes arrived so far: send the next chunk at this offset.")
    state = s.CharField()
    error = s.CharField(allow_blank=True, allow_null=True)
    url = s.URLField()
    complete_url = s.URLField()


class DatasetVersionManifest(DatasetVersion):
    manifest = DatasetFile(many=True)
    uploads = Upload(many=True, help_text="The version's unfinished uploads.")


class Dataset(s.Serializer):
    id = s.UUIDField()
    name = s.CharField()
    description = s.CharField(allow_blank=True)
    source = s.CharField()
    created_at = s.DateTimeField()
    state = s.CharField()
    latest_version = s.IntegerField(allow_null=True)
    files = s.IntegerField()
    bytes = s.IntegerField()
    open_version = s.IntegerField(allow_null=True)
    url = s.URLField()
    page = s.URLField()
    s3 = inline_serializer(
        name="DatasetS3",
        required=False,
        fields={"uri": s.CharField(), "endpoint_url": nullable_str(), "region": nullable_str(), "credentials": s.CharField()},
    )


class DatasetDetail(Dataset):
    versions = DatasetVersion(many=True)


class InvoiceSummary(s.Serializer):
    id = s.UUIDField()
    number = s.CharField(allow_blank=True, allow_null=True)
    kind = s.CharField()
    state = s.CharField()
    team = s.CharField()
    period = s.CharField(help_text="YYYY-MM")
    issued_at = s.DateTimeField(allow_null=True)
    currency = s.CharField()
    subtotal = s.CharField()
    credits = s.CharField()
    total = s.CharField()
    corrects = s.UUIDField(allow_null=True)
    corrects_number = s.CharField(allow_null=True, allow_blank=True)
    reason = s.CharField(allow_blank=True, allow_null=True)
    pdf = s.CharField()
    csv = s.CharField()


class InvoiceLine(s.Serializer):
    kind = s.CharField()
    job_id = s.CharField(allow_null=True)
    job = s.CharField(allow_null=True, allow_blank=True)
    description = s.CharField(allow_blank=True)
    gpus = s.IntegerField(allow_null=True)
    amount = s.CharField()


class Invoice(InvoiceSummary):
    lines = InvoiceLine(many=True)


class Statement(s.Serializer):
    kind = s.CharField()
    state = s.CharField()
    period = s.CharField()
    currency = s.CharField()
    subtotal = s.CharField()
    credits = s.CharField()
    total = s.CharField()
    lines = InvoiceLine(many=True)


class UsageRecord(s.Serializer):
    job_id = s.UUIDField()
    started_at = s.DateTimeField()
    ended_at = s.DateTimeField(allow_null=True)
    gpus = s.IntegerField()
    gpu_type = s.CharField(allow_blank=True)
    held_seconds = s.FloatField()
    rate = s.CharField()
    amount = s.CharField()
    credit_seconds = s.FloatField()
    credit_amount = s.CharField()
    credit_reason = s.CharField(allow_blank=True, allow_null=True)


Usage = inline_serializer(
    name="Usage",
    fields={
        "month": s.CharField(),
        "currency": s.CharField(),
        "lines": s.ListField(child=s.DictField(), help_text="The statement's lines, one per job."),
        "count": s.IntegerField(help_text="How many usage records the month has (records is one page of them)."),
        "next": s.URLField(allow_null=True),
        "previous": s.URLField(allow_null=True),
        "records": UsageRecord(many=True),
        "credits": s.CharField(),
        "total": s.CharField(),
        "budget": s.DictField(help_text="The team's budget against this month's spend."),
    },
)

Checkpoint = inline_serializer(
    name="Checkpoint",
    fields={
        "name": s.CharField(),
        "step": s.IntegerField(allow_null=True),
        "size": s.IntegerField(allow_null=True),
        "sha256": s.CharField(allow_blank=True, allow_null=True),
        "written_at": s.DateTimeField(allow_null=True),
        "uploaded_at": s.DateTimeField(allow_null=True),
        "node": s.CharField(allow_null=True),
        "pruned": s.BooleanField(),
        "pruned_at": s.DateTimeField(allow_null=True),
        "url": s.URLField(allow_null=True, help_text="Null once pruned."),
    },
)

Artifact = inline_serializer(
    name="Artifact",
    fields={"name": s.CharField(), "size": s.IntegerField(), "sha256": s.CharField(), "url": s.URLField()},
)

Logs = inline_serializer(
    name="Logs",
    fields={
        "lines": s.ListField(child=s.DictField(), help_text="{seq, at, stream, rank, text} each."),
        "next_after": s.IntegerField(help_text="Pass as ?after= to read on."),
        "more": s.BooleanField(),
        "state": s.CharField(),
        "done": s.BooleanField(help_text="The job has ended and every line has been read."),
    },
)

Metrics = inline_serializer(
    name="Metrics",
    fields={
        "series": s.DictField(help_text="{name: [[x, value, at(, 'NaN')], ...]}"),
        "summary": s.DictField(),
        "events": s.IntegerField(),
        "last_seq": s.IntegerField(help_text="Pass as ?after= to poll for new points."),
    },
)

Comparison = inline_serializer(
    name="Comparison",
    fields={"job": s.UUIDField(), "name": s.CharField(allow_blank=True), "evaluation": s.JSONField(required=False), "verdict": s.DictField(required=False)},
)

SPEC_HELP = (
    "The job's spec: a spec file's text (YAML or JSON), or (JSON body) an object of the API's fields: "
    "name, kind, recipe, entrypoint, command, args, hyperparameters, config, env, workdir, processes, precision (fp32, bf16 or fp16), "
    "packages (a list of requirements, or text with one a line), "
    "train_dataset, heldout_dataset, gpus, gpu_type, mode, span_hours, ceiling_kind, ceiling, not_before, deadline, by, "
    "preemptible, keep_checkpoints, max_restarts, early_stop_metric, early_stop_mode, early_stop_patience, stop_on_nan, network, idle_minutes, stop_if_idle."
)

FOLDER_UPLOAD_HELP = "The code: a folder uploaded ahead (POST /api/folders/, every byte arrived), packed into a zip the job unpacks."

JobSubmitForm = inline_serializer(
    name="JobSubmitForm",
    fields={
        "spec": s.CharField(help_text=SPEC_HELP),
        "spec_name": s.CharField(required=False, help_text="The spec file's name, for messages."),
        "code": s.ListField(child=s.FileField(), required=False, help_text="The code: a script or an archive."),
        "data": s.ListField(child=s.FileField(), required=False, help_text="Training data files."),
        "heldout": s.ListField(child=s.FileField(), required=False, help_text="Held-out data files."),
        "base_model": s.ListField(child=s.FileField(), required=False, help_text="A starting model's weights."),
        "code_folder_upload": s.UUIDField(required=False, help_text=FOLDER_UPLOAD_HELP),
    },
)
JobSubmitJson = inline_serializer(
    name="JobSubmitJson",
    fields={
        "spec": s.JSONField(help_text=SPEC_HELP),
        "spec_name": s.CharField(required=False),
        "code_folder_upload": s.UUIDField(required=False, help_text=FOLDER_UPLOAD_HELP),
    },
)
SpecOnlyForm = inline_serializer(name="SpecForm", fields={"spec": s.CharField(help_text=SPEC_HELP)})

RetrainForm = inline_serializer(
    name="RetrainForm",
    fields={
        "spec": s.CharField(
            required=False,
            help_text="A JSON object overriding the job's request: name, gpus, gpu_type, mode, span_hours, ceiling_kind, "
            "ceiling, not_before, by, deadline, preemptible.",
        ),
        "data": s.ListField(child=s.FileField(), required=False, help_text="More training data files."),
    },
)
RetrainJson = inline_serializer(name="RetrainJson", fields={"spec": s.DictField(required=False)})

DatasetCreate = inline_serializer(
    name="DatasetCreate",
    fields={
        "name": s.CharField(max_length=200, help_text="Jobs name it: name, or name@2 for version 2."),
        "description": s.CharField(required=False, allow_blank=True),
    },
)
DatasetS3Create = inline_serializer(
    name="DatasetS3Create",
    fields={
        "name": s.CharField(max_length=200),
        "description": s.CharField(required=False, allow_blank=True),
        "uri": s.CharField(help_text="s3://bucket/prefix"),
        "endpoint_url": s.URLField(required=False, help_text="Blank: AWS."),
        "region": s.CharField(required=False, allow_blank=True),
        "access_key_id": s.CharField(),
        "secret_access_key": s.CharField(help_text="Stored encrypted, never shown back."),
    },
)
DatasetCredentials = inline_serializer(
    name="DatasetCredentials",
    fields={
        "access_key_id": s.CharField(),
        "secret_access_key": s.CharField(help_text="Stored encrypted, never shown back."),
        "endpoint_url": s.URLField(required=False, allow_blank=True, help_text="Blank: AWS. Left out: unchanged."),
        "region": s.CharField(required=False, allow_blank=True, help_text="Left out: unchanged."),
        "rescan": s.BooleanField(required=False, help_text="Scan the bucket again with the new credentials (a new version)."),
    },
)
UploadStart = inline_serializer(
    name="UploadStart",
    fields={
        "path": s.CharField(help_text="The file's path in the dataset."),
        "size": s.IntegerField(min_value=0, help_text="In bytes."),
        "sha256": s.CharField(required=False, allow_blank=True, help_text="Checked on completion if given."),
    },
)
UploadComplete = inline_serializer(name="UploadComplete", fields={"sha256": s.CharField(required=False, allow_blank=True)})
FolderOpen = inline_serializer(
    name="FolderOpen",
    fields={
        "files": s.ListField(
            child=inline_serializer(
                name="FolderOpenFile",
                fields={
                    "path": s.CharField(help_text="The file's path as the browser gives it (myproj/src/train.py): the one top folder is taken off."),
                    "size": s.IntegerField(min_value=0, help_text="In bytes."),
                },
            ),
            help_text="Every file of the folder; __pycache__, .git and .DS_Store are left out.",
        )
    },
)


class FolderFile(s.Serializer):
    id = s.UUIDField()
    path = s.CharField()
    size = s.IntegerField()
    chunk_size = s.IntegerField()
    received = s.IntegerField(help_text="Bytes arrived so far: send the next chunk at this offset.")
    state = s.CharField()
    url = s.URLField(help_text="PUT ?offset=N with a chunk.")


class Folder(s.Serializer):
    id = s.UUIDField()
    state = s.CharField(help_text="open, packed (the job's code now) or aborted.")
    error = s.CharField(allow_blank=True)
    top = s.CharField(allow_blank=True, help_text="The one top folder the paths shared, taken off in the zip.")
    file_count = s.IntegerField()
    bytes = s.IntegerField()
    files_arrived = s.IntegerField()
    received = s.IntegerField()
    complete = s.BooleanField(help_text="Every byte has arrived: name the folder in code_folder_upload.")
    packed_as = s.CharField(allow_null=True)
    created_at = s.DateTimeField()
    url = s.URLField()
    files = FolderFile(many=True)


Token = inline_serializer(name="Token", fields={"token": s.CharField(), "username": s.CharField()})
Login = inline_serializer(name="Login", fields={"username": s.CharField(), "password": s.CharField()})
Me = inline_serializer(
    name="Me",
    fields={
        "username": s.CharField(),
        "email": s.CharField(allow_blank=True),
        "team": inline_serializer(name="MeTeam", allow_null=True, fields={"id": s.UUIDField(), "name": s.CharField()}),
        "role": s.CharField(allow_null=True),
        "time_zone": s.CharField(allow_null=True),
    },
)
MeUpdate = inline_serializer(name="MeUpdate", fields={"time_zone": s.CharField(allow_blank=True, help_text="An IANA time zone name; blank for the site's.")})


class AuditEvent(s.Serializer):
    id = s.IntegerField()
    at = s.DateTimeField()
    user = s.CharField(allow_null=True, help_text="The user's name; null for the system's own actions.")
    actor = s.CharField(help_text="The user's name, or the command's (e.g. 'manage.py invoices') for a system action.")
    action = s.ChoiceField(choices=list(audit_views.ACTIONS))
    object_type = s.CharField(
        allow_blank=True, help_text="job, artifact, checkpoint, invoice, dataset, datasetversion, datasetupload, folderupload; blank for none."
    )
    object_id = s.CharField(allow_blank=True)
    label = s.CharField(allow_blank=True, help_text="The object's name, for people.")
    via = s.ChoiceField(choices=["web", "api", "ws", "system"], help_text="api also for the CLI; ws for live sockets.")
    ip = s.CharField(allow_null=True, help_text="The client's address (REMOTE_ADDR).")


Estimate = inline_serializer(
    name="Estimate",
    fields={
        "gpus": s.IntegerField(),
        "gpu_type": s.CharField(allow_blank=True),
        "mode": s.CharField(),
        "hours": s.CharField(allow_null=True),
        "gpu_hours": s.CharField(allow_null=True),
        "rate": s.CharField(),
        "worst_case": s.CharField(allow_null=True, help_text="The most it can cost, in currency."),
        "currency": s.CharField(),
        "budget_remaining": s.CharField(allow_null=True),
        "over_budget": s.BooleanField(),
    },
)


def binary(description, *media_types):
    return {(200, media_type): OpenApiResponse(OpenApiTypes.BINARY, description=description) for media_type in media_types}


# The annotations --------------------------------------------------------------------------------


def annotate(view, methods=None, **kwargs):
    if methods:
        kwargs["methods"] = methods
    extend_schema(**kwargs)(view)


def describe():
    tag = "jobs"
    annotate(
        jobs_api.jobs,
        ["GET"],
        operation_id="jobs_list",
        tags=[tag],
        summary="List the team's jobs, newest first",
        parameters=[
            OpenApiParameter("state", OpenApiTypes.STR, description="Only jobs in this state."),
            OpenApiParameter("kind", OpenApiTypes.STR, description="Only jobs of this kind."),
            OpenApiParameter("name", OpenApiTypes.STR, description="Only jobs whose name contains this."),
            OpenApiParameter("id_prefix", OpenApiTypes.STR, description="Only jobs whose id starts with these hex digits."),
            *page_params(),
        ],
        responses={200: paged("PagedJobs", Job)},
    )
    annotate(
        jobs_api.jobs,
        ["POST"],
        operation_id="jobs_create",
        tags=[tag],
        summary="Submit a job",
        description="A spec and the files it names (multipart), or a JSON body with the spec as an object (no files).",
        request={"multipart/form-data": JobSubmitForm, "application/json": JobSubmitJson, "application/x-www-form-urlencoded": SpecOnlyForm},
        responses={201: Job},
    )
    annotate(jobs_api.job_detail, operation_id="job_retrieve", tags=[tag], summary="A job", responses={200: Job})
    if hasattr(jobs_api, "job_spec"):
        annotate(
            jobs_api.job_spec,
            operation_id="job_spec",
            tags=[tag],
            summary="The job as a spec file, to submit again",
            parameters=[OpenApiParameter("format", OpenApiTypes.STR, enum=["yaml", "json"], description="json: the spec as JSON; YAML by default.")],
            responses={(200, "application/yaml"): OpenApiTypes.OBJECT, (200, "application/json"): OpenApiTypes.OBJECT},
        )
    if hasattr(jobs_api, "estimate"):
        annotate(
            jobs_api.estimate,
            operation_id="jobs_estimate",
            tags=[tag],
            summary="What a spec would cost at most, and when it would start",
            request={"application/json": JobSubmitJson, "multipart/form-data": SpecOnlyForm, "application/x-www-form-urlencoded": SpecOnlyForm},
            responses={200: Estimate},
        )
    annotate(
        jobs_api.job_logs,
        operation_id="job_logs",
        tags=[tag],
        summary="The job's log lines after a sequence number",
        parameters=[
            OpenApiParameter("after", OpenApiTypes.INT, description="Only lines after this sequence number (next_after of the previous answer)."),
            OpenApiParameter("limit", OpenApiTypes.INT, description=f"At most this many lines (1 to {jobs_api.MAX_LOG_LIMIT}, default 1000)."),
            OpenApiParameter("rank", OpenApiTypes.INT, description="Only the lines of this process rank (torchrun)."),
        ],
        responses={200: Logs},
    )
    annotate(jobs_api.job_log, operation_id="job_log_text", tags=[tag], summary="The whole log as text", responses={(200, "text/plain"): OpenApiTypes.STR})
    annotate(
        jobs_api.job_cancel,
        operation_id="job_cancel",
        tags=[tag],
        summary="Cancel the job",
        request=None,
        responses={202: Job, 409: OpenApiResponse(description="The job has already ended.")},
    )
    annotate(
        jobs_api.job_retrain,
        operation_id="job_retrain",
        tags=[tag],
        summary="Retrain a finished job, with more data",
        request={"multipart/form-data": RetrainForm, "application/json": RetrainJson, "application/x-www-form-urlencoded": RetrainForm},
        responses={201: Job, 409: OpenApiResponse(description="The job has no weights to retrain from.")},
    )
    annotate(
        jobs_api.job_compare,
        operation_id="job_compare",
        tags=[tag],
        summary="Evaluate a fine-tuning against its starting weights",
        request=None,
        responses={201: Job, 409: OpenApiResponse(description="Nothing to compare.")},
    )
    annotate(jobs_api.job_comparison, operation_id="job_comparison", tags=[tag], summary="An evaluation job's verdict", responses={200: Comparison})
    annotate(
        jobs_api.job_artifacts, operation_id="job_artifacts_list", tags=[tag], summary="The job's artifacts", responses={200: s.ListSerializer(child=Artifact)}
    )
    annotate(
        jobs_api.job_artifact,
        operation_id="job_artifact_download",
        tags=[tag],
        summary="An artifact's bytes (Range supported; may redirect to storage)",
        responses={
            **binary("The artifact (its media type guessed from its name).", "*/*"),
            (206, "*/*"): OpenApiResponse(OpenApiTypes.BINARY, description="The range asked for."),
            302: OpenApiResponse(description="To a presigned URL."),
        },
    )
    annotate(
        run_api.job_metrics,
        operation_id="job_metrics",
        tags=[tag],
        summary="The job's metric series",
        parameters=[
            OpenApiParameter("after", OpenApiTypes.INT, description="Only points of events after this sequence number (last_seq of the previous answer)."),
            OpenApiParameter("names", OpenApiTypes.STR, description="Comma-separated metric names: only those series."),
            OpenApiParameter("points", OpenApiTypes.INT, description=f"At most this many points per series (0 to {run_api.MAX_POINTS}; 0: all)."),
        ],
        responses={200: Metrics},
    )
    annotate(
        run_api.job_checkpoints,
        operation_id="job_checkpoints_list",
        tags=[tag],
        summary="The job's checkpoints, newest first",
        responses={200: s.ListSerializer(child=Checkpoint)},
    )
    annotate(
        run_api.job_checkpoint,
        operation_id="job_checkpoint_download",
        tags=[tag],
        summary="A kept checkpoint's bytes (Range supported; may redirect to storage)",
        responses={
            **binary("The checkpoint (its media type guessed from its name).", "*/*"),
            (206, "*/*"): OpenApiResponse(OpenApiTypes.BINARY, description="The range asked for."),
            302: OpenApiResponse(description="To a presigned URL."),
            410: OpenApiResponse(description="Pruned."),
        },
    )

    tag = "datasets"
    annotate(
        dataset_api.dataset_list,
        ["GET"],
        operation_id="datasets_list",
        tags=[tag],
        summary="List the team's datasets",
        parameters=page_params(),
        responses={200: paged("PagedDatasets", Dataset)},
    )
    annotate(
        dataset_api.dataset_list,
        ["POST"],
        operation_id="datasets_create",
        tags=[tag],
        summary="Create a dataset to upload files into (version 1, open)",
        request={"application/json": DatasetCreate, "application/x-www-form-urlencoded": DatasetCreate, "multipart/form-data": DatasetCreate},
        responses={201: DatasetDetail, 409: OpenApiResponse(description="In the way (e.g. the name is taken).")},
    )
    annotate(
        dataset_api.dataset_register_s3,
        operation_id="datasets_register_s3",
        tags=[tag],
        summary="Register the objects under an S3 URI as a dataset",
        request={"application/json": DatasetS3Create, "application/x-www-form-urlencoded": DatasetS3Create, "multipart/form-data": DatasetS3Create},
        responses={201: DatasetDetail, 409: OpenApiResponse(description="In the way.")},
    )
    annotate(
        dataset_api.dataset_detail, ["GET"], operation_id="dataset_retrieve", tags=[tag], summary="A dataset with its versions", responses={200: DatasetDetail}
    )
    annotate(
        dataset_api.dataset_detail,
        ["DELETE"],
        operation_id="dataset_destroy",
        tags=[tag],
        summary="Delete the dataset with its versions (the team's owner; stored blobs and a registered bucket's objects are kept)",
        request=None,
        responses={204: OpenApiResponse(description="Deleted."), 409: OpenApiResponse(description="Unfinished jobs use it: 'detail' names them.")},
    )
    annotate(
        dataset_api.dataset_credentials,
        operation_id="dataset_credentials",
        tags=[tag],
        summary="New credentials for a registered bucket (the team's owner)",
        request={"application/json": DatasetCredentials, "application/x-www-form-urlencoded": DatasetCredentials, "multipart/form-data": DatasetCredentials},
        responses={200: DatasetDetail},
    )
    annotate(
        dataset_api.dataset_rescan,
        operation_id="dataset_rescan",
        tags=[tag],
        summary="Scan a registered bucket again (a new version)",
        request=None,
        responses={202: DatasetVersion, 409: OpenApiResponse(description="In the way.")},
    )
    annotate(
        dataset_api.version_open,
        operation_id="dataset_version_open",
        tags=[tag],
        summary="The version to add files to: the open one, or a new one",
        request=None,
        responses={200: DatasetVersionManifest, 201: DatasetVersionManifest, 409: OpenApiResponse(description="In the way.")},
    )
    annotate(
        dataset_api.version_detail,
        operation_id="dataset_version_retrieve",
        tags=[tag],
        summary="A version with its manifest",
        responses={200: DatasetVersionManifest},
    )
    annotate(
        dataset_api.version_seal,
        operation_id="dataset_version_seal",
        tags=[tag],
        summary="Seal an open version: ready and immutable",
        request=None,
        responses={200: DatasetVersionManifest, 409: OpenApiResponse(description="In the way.")},
    )
    annotate(
        dataset_api.upload_start,
        operation_id="dataset_upload_start",
        tags=[tag],
        summary="Start a chunked upload of a file into an open version",
        request={"application/json": UploadStart, "application/x-www-form-urlencoded": UploadStart, "multipart/form-data": UploadStart},
        responses={201: Upload, 409: OpenApiResponse(description="In the way (e.g. the version is sealed).")},
    )
    annotate(
        dataset_api.upload_detail, ["GET"], operation_id="dataset_upload_retrieve", tags=[tag], summary="How far an upload has arrived", responses={200: Upload}
    )
    annotate(
        dataset_api.upload_detail,
        ["PUT"],
        operation_id="dataset_upload_put_chunk",
        tags=[tag],
        summary="Send a chunk of the file, at an offset",
        parameters=[OpenApiParameter("offset", OpenApiTypes.INT, required=True, description="The chunk's offset in bytes: the upload's received.")],
        request={"application/octet-stream": OpenApiTypes.BINARY},
        responses={
            200: Upload,
            409: OpenApiResponse(description="Not at the expected offset: continue from 'received'."),
            503: OpenApiResponse(description="Storage failed: send the chunk again."),
        },
    )
    annotate(
        dataset_api.upload_detail,
        ["DELETE"],
        operation_id="dataset_upload_abort",
        tags=[tag],
        summary="Give an upload up",
        request=None,
        responses={200: Upload, 409: OpenApiResponse(description="In the way.")},
    )
    annotate(
        dataset_api.upload_complete,
        operation_id="dataset_upload_complete",
        tags=[tag],
        summary="Join the chunks and add the file to its version",
        request={"application/json": UploadComplete, "application/x-www-form-urlencoded": UploadComplete, "multipart/form-data": UploadComplete},
        responses={
            200: Upload,
            202: OpenApiResponse(Upload, description="A large file, checked and completing: poll its url (also in Location) until complete or failed."),
            409: OpenApiResponse(description="Not all arrived, or the digest differs."),
            503: OpenApiResponse(description="Storage failed: complete it again."),
        },
    )

    tag = "folders"
    annotate(
        folder_api.folder_open,
        operation_id="folder_open",
        tags=[tag],
        summary="Announce a folder to upload as a job's code, resumably",
        request={"application/json": FolderOpen},
        responses={201: Folder},
    )
    annotate(
        folder_api.folder_detail,
        ["GET"],
        operation_id="folder_retrieve",
        tags=[tag],
        summary="How far each of the folder's files has arrived",
        responses={200: Folder},
    )
    annotate(
        folder_api.folder_detail,
        ["DELETE"],
        operation_id="folder_abort",
        tags=[tag],
        summary="Give the folder's upload up",
        request=None,
        responses={200: Folder, 409: OpenApiResponse(description="Packed already.")},
    )
    annotate(
        folder_api.folder_file,
        ["GET"],
        operation_id="folder_file_retrieve",
        tags=[tag],
        summary="How far a file of the folder has arrived",
        responses={200: FolderFile},
    )
    annotate(
        folder_api.folder_file,
        ["PUT"],
        operation_id="folder_file_put_chunk",
        tags=[tag],
        summary="Send a chunk of a file of the folder, at an offset",
        parameters=[OpenApiParameter("offset", OpenApiTypes.INT, required=True, description="The chunk's offset in bytes: the file's received.")],
        request={"application/octet-stream": OpenApiTypes.BINARY},
        responses={
            200: FolderFile,
            409: OpenApiResponse(description="Not at the expected offset: continue from 'received'; or the folder is packed or given up."),
            503: OpenApiResponse(description="Storage failed: send the chunk again."),
        },
    )

    tag = "billing"
    annotate(
        billing_api.usage,
        operation_id="usage_retrieve",
        tags=[tag],
        summary="The month's usage, statement and budget",
        parameters=[month_param(), *page_params()],
        responses={200: Usage},
    )
    annotate(
        invoice_views.api_invoices,
        operation_id="invoices_list",
        tags=[tag],
        summary="The team's invoices and credit notes",
        parameters=page_params(),
        responses={200: paged("PagedInvoices", InvoiceSummary)},
    )
    annotate(
        invoice_views.api_statement,
        operation_id="invoices_statement",
        tags=[tag],
        summary="The month so far, as a draft statement",
        parameters=[month_param()],
        responses={200: Statement},
    )
    annotate(invoice_views.api_invoice, operation_id="invoice_retrieve", tags=[tag], summary="An invoice with its lines", responses={200: Invoice})
    annotate(
        invoice_views.api_invoice_download, tags=[tag], summary="An invoice as a PDF or CSV file", responses=binary("The file.", "application/pdf", "text/csv")
    )

    tag = "account"
    if hasattr(accounts_api, "token"):
        annotate(
            accounts_api.token,
            operation_id="token_create",
            tags=[tag],
            summary="Your API token, for a username and password",
            auth=[],
            request={"application/json": Login, "application/x-www-form-urlencoded": Login},
            responses={200: Token},
        )
    annotate(
        audit_views.api_audit,
        operation_id="audit_list",
        tags=[tag],
        summary="The team's audit log, newest first (the owner only)",
        parameters=[
            OpenApiParameter("action", OpenApiTypes.STR, enum=list(audit_views.ACTIONS), description="Only events of this action."),
            *page_params(),
        ],
        responses={200: paged("PagedAuditEvents", AuditEvent)},
    )
    if hasattr(accounts_api, "me"):
        annotate(accounts_api.me, ["GET"], operation_id="me_retrieve", tags=[tag], summary="Who the token is, and their team", responses={200: Me})
        if "PATCH" in accounts_api.me.cls.http_method_names or hasattr(accounts_api.me.cls, "patch"):
            annotate(
                accounts_api.me,
                ["PATCH"],
                operation_id="me_update",
                tags=[tag],
                summary="Change your settings (time zone)",
                request={"application/json": MeUpdate, "application/x-www-form-urlencoded": MeUpdate},
                responses={200: Me},
            )


describe()
