"""The API's OpenAPI 3 description (drf-spectacular): what each endpoint takes and answers.

Jobs, datasets, their versions and uploads have serializers (jobs/serializers.py,
catalog/serializers.py), the one source of their JSON and their schema: the views that answer
them carry their @extend_schema (jobs/api.py, catalog/api.py). The other views are
function-based (@api_view) without serializers, so their request bodies, query parameters and
answers are described here, next to each other, and applied to the view functions where they are
defined (extend_schema on an @api_view function annotates its view class in place).
e31web/api_urls.py imports this module, so the schema is complete wherever the URLs are.

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
from core.serializers import page_params, paged
from jobs import api as jobs_api
from jobs import folder_api, run_api
from jobs.serializers import JobSubmitJson, SpecOnlyForm

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


def month_param(description="The month, YYYY-MM; this month by default."):
    return OpenApiParameter("month", OpenApiTypes.STR, description=description, pattern=r"^\d{4}-\d{2}$")


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
