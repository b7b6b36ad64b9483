import json
from decimal import Decimal

from django.conf import settings
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.db.models import BigIntegerField, Case, F, FloatField, Func, Q, Sum, UUIDField, Value, When
from django.db.models.functions import Cast, Coalesce, Greatest, Least
from django.http import HttpResponse, HttpResponseGone
from django.shortcuts import redirect, render
from django.utils import timezone
from django.views.decorators.http import require_GET, require_http_methods, require_POST
from rest_framework.exceptions import ValidationError

from accounts import audit
from accounts.access import require_team, team_of
from core.compiled import Param, Read, together
from core.downloads import download_response
from core.prefetch import RowsIn
from jobs import durations, lineage, metrics, specfile, states, utilization
from jobs.access import get_artifact, get_job
from jobs.ceiling import job_ceiling
from jobs.comparisons import comparison
from jobs.downloads import artifact_response, log_response
from jobs.estimates import budget_left, prediction
from jobs.forms import JobForm, RequestForm, keep_uploads
from jobs.logs import lines_html
from jobs.models import Job, JobEvent, Upload
from jobs.run_data import METRIC_CHUNK, checkpoint_is_gone, get_checkpoint, gone_message, job_checkpoints, metric_points, metrics_data
from jobs.spec_form import form_initial

LOG_LINES_ON_PAGE = 500
# Points per metric series the job page starts with (min/max buckets: see jobs.metrics).
METRIC_POINTS_ON_PAGE = 1000


JOB_SORTS = {"cost": ("cost", "-created_at"), "-cost": ("-cost", "-created_at")}


class SecondsSince(Func):
    """Seconds from a timestamp column to a moment, as a float, in SQLite and PostgreSQL."""

    output_field = FloatField()

    def __init__(self, expression, moment):
        super().__init__(expression, Value(moment))

    def compiled(self, compiler):
        start, moment = self.source_expressions
        (start_sql, start_params), (moment_sql, moment_params) = compiler.compile(start), compiler.compile(moment)
        return start_sql, moment_sql, [*moment_params, *start_params]

    def as_sqlite(self, compiler, connection, **extra):
        start, moment, params = self.compiled(compiler)
        return f"((julianday({moment}) - julianday({start})) * 86400.0)", params

    def as_postgresql(self, compiler, connection, **extra):
        start, moment, params = self.compiled(compiler)
        return f"EXTRACT(EPOCH FROM (({moment})::timestamptz - {start}))::float", params


def with_cost(jobs, now):
    """Annotate each job's cost in one query: its released allocations' usage, and what its
    running allocation has cost so far (GPUs x held time x rate, never past its cost cap)."""
    held = Greatest(SecondsSince("allocations__started_at", now), Value(0.0))
    live = Cast(F("gpus"), FloatField()) * held * Cast(F("allocations__rate"), FloatField()) / 3600.0
    capped = Least(live, Coalesce(Cast(F("allocations__cost_cap"), FloatField()), Value(1e30)))
    cost = Sum(
        Case(
            When(Q(allocations__ended_at__isnull=True, allocations__isnull=False), then=capped),
            default=Cast(F("allocations__usage__amount"), FloatField()),
            output_field=FloatField(),
        )
    )
    return jobs.annotate(cost=Coalesce(cost, Value(0.0)))


@login_required
@require_GET
def job_list(request):
    if request.user.is_staff and team_of(request.user) is None:
        return redirect("ops:pool")  # the operator, on no team, signs in to the pool's page
    team = require_team(request.user)
    sort = request.GET.get("sort", "")
    jobs = Job.objects.filter(team=team)
    if sort in JOB_SORTS:
        jobs = with_cost(jobs, timezone.now()).order_by(*JOB_SORTS[sort])
    else:
        sort = ""
    jobs = jobs.prefetch_related("allocations")[:200]
    if request.htmx:
        return render(request, "jobs/_job_rows.html", {"jobs": jobs, "any_active": any(job.is_active for job in jobs), "sort": sort})
    return render(request, "jobs/list.html", {"jobs": jobs, "any_active": any(job.is_active for job in jobs), "sort": sort, "learned": learned_accuracy(team)})


def learned_accuracy(team, last=200):
    """How well the scheduler's learned durations (jobs.durations) foretold the team's last
    jobs that ran to their end: (median, p90 of expected / held, how many), or None."""
    done = (
        Job.objects.filter(team=team, state=states.SUCCEEDED, learned_seconds__isnull=False)
        .annotate(held=Sum("usage__held_seconds"))
        .order_by("-finished_at")
        .values_list("learned_seconds", "held")[:last]
    )
    pairs = [(learned, float(held)) for learned, held in done if held]
    found = durations.accuracy(pairs)
    return (*found, len(pairs)) if found else None


@login_required
@require_http_methods(["GET", "POST"])
def job_new(request):
    team = require_team(request.user)
    if request.method == "POST" and "spec_file" in request.FILES:
        return job_new_from_spec(request, team)
    if request.method == "POST":
        data, upload_errors, created = keep_uploads(request.FILES, request.POST, team, request.user)
        form = JobForm(data, team=team, upload_errors=upload_errors, known=created)  # the files sent: taken unread
        if form.is_valid():
            job = form.submit(request)
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
        "kept_model": form.kept("kept_model"),
        "kept_inputs": form.kept("kept_inputs"),
        **previous_right_size(team, form["name"].value()),
    }
    if request.method == "GET" and estimate_form.estimate is not None:
        context.update(prediction(team, estimate_form))
        context.update(budget_left(team, estimate_form.estimate.amount))
    return render(request, "jobs/new.html", context)


def job_new_from_spec(request, team):
    """The new-job form filled in from an uploaded spec file: what it says, ready to check and
    submit; a spec that cannot be read is refused with its lines, and the form stays empty."""
    uploaded = request.FILES["spec_file"]
    name = uploaded.name.rsplit("/", 1)[-1][:200] or "spec"
    spec_errors, files_wanted, initial = [], [], {}
    if uploaded.size > specfile.MAX_BYTES:
        spec_errors.append(f"{name}: larger than {specfile.MAX_BYTES // 1024} KB; is this the right file?")
    else:
        try:
            spec = specfile.read(uploaded.read(), name)
            initial = form_initial(spec, team)
            files_wanted = [(spec.paths[field], ", ".join(p for p, _ in paths)) for field, paths in spec.files.items()]
        except specfile.SpecFileError as error:
            spec_errors = [specfile.where(error.name, line) + message for line, _, message in error.problems]
        except ValidationError as error:
            spec_errors = [str(m) for messages in error.detail.values() for m in messages]
    form = JobForm(team=team, initial=initial)
    estimate_form = RequestForm({n: initial.get(n, f.initial) for n, f in RequestForm.base_fields.items()})
    estimate_form.is_valid()
    if not spec_errors:
        messages.success(request, f"The form is filled in from {name}: check it, choose the files it names, and submit.")
    context = {
        "form": form,
        "estimate_form": estimate_form,
        "spec_errors": spec_errors,
        "files_wanted": files_wanted,
        "spec_name": name,
        **previous_right_size(team, initial.get("name")),
    }
    if estimate_form.estimate is not None:
        context.update(prediction(team, estimate_form))
        context.update(budget_left(team, estimate_form.estimate.amount))
    return render(request, "jobs/new.html", context, status=400 if spec_errors else 200)


@login_required
def job_spec_download(request, job_id):
    """The job as a spec file (YAML): submit it again with `e31 submit`, or fill the form from it."""
    job = get_job(request, job_id)
    response = HttpResponse(specfile.dump(specfile.job_spec(job)), content_type="application/yaml; charset=utf-8")
    response["Content-Disposition"] = f'attachment; filename="{specfile.file_name(job)}"'
    return audit.recorded(response, request, "spec.download", job)


@login_required
@require_POST
def job_estimate(request):
    """The cost of the request as the form is filled in (an htmx fragment)."""
    team = require_team(request.user)
    form = RequestForm(request.POST)
    context = {"form": form, **previous_right_size(team, request.POST.get("name"))}
    if form.is_valid() and form.estimate is not None:
        context.update(prediction(team, form))
        context.update(budget_left(team, form.estimate.amount))
    return render(request, "jobs/_estimate.html", context)


# The page's reads of a job's rows, their SQL made once (core.compiled): its last log lines (one
# more than it shows), its timeline and notices, its allocations with their nodes.
LAST_LINES = Read(
    lambda: (
        JobEvent.objects.filter(job_id=Param("job", UUIDField()), kind="log", seq__lte=Param("upto", BigIntegerField()))
        .order_by("-seq")
        .values_list("seq", "stream", "rank", "text")[: LOG_LINES_ON_PAGE + 1]
    )
)
PAGE_EVENTS = Read(
    lambda: JobEvent.objects.filter(
        job_id=Param("job", UUIDField()), kind__in=(*Job.TIMELINE_KINDS, "notice"), seq__lte=Param("upto", BigIntegerField())
    ).order_by("seq")
)
JOB_ALLOCATIONS = Read(
    lambda: Job.allocations.rel.related_model.objects.filter(job_id=Param("job", UUIDField())).select_related("node")
)  # the scheduler's, read through the relation

# The files it was given, but its code (every job has code: read always, its SQL made once).
SHOWN_UPLOADS = Read(lambda: Upload.objects.filter(job_id=Param("job", UUIDField())).exclude(role=Upload.CODE))

# The parts of a job its page reads only when the job has rows in them (most jobs have no
# stagings left, credits, models or utilization: an empty query costs as much to make).
PAGE_PARTS = RowsIn(Job, ("credits", "artifacts", "stagings", "checkpoints", "models", "utilization_runs", "inputs"))


@login_required
@require_GET
def job_detail(request, job_id):
    job = get_job(request, job_id)
    if request.htmx and request.GET.get("part") == "artifacts":
        return render(request, "jobs/_artifacts.html", {"job": job, "artifacts": job.artifacts.all()})
    if request.htmx and request.GET.get("part") == "checkpoints":
        return render(request, "jobs/_checkpoints.html", {"job": job, "checkpoints": job_checkpoints(job)})
    if request.htmx and request.GET.get("part") == "utilization":
        return render(request, "jobs/_utilization.html", {"job": job, **utilization_context(job)})
    if request.htmx and request.GET.get("part") == "ceiling":
        return render(request, "jobs/_ceiling.html", {"job": job, "ceiling": ceiling_of(job)})
    # Everything below shows the job up to job.last_seq; the websocket sends what comes after.
    # Its rows in one round trip: its last log lines, as plain rows (seq, stream, rank, text), not
    # events or dicts (cheaper to make and to render: dicts of 500 lines cost half a millisecond),
    # one line more than the page shows, which says whether there are earlier ones; its metric
    # points (the first chunk: most jobs have no more); its timeline and notices; its allocations
    # with their nodes; the files it was given; which of its other parts it has rows in.
    job_rows, upto = {"job": job.pk}, {"job": job.pk, "upto": job.last_seq}
    lines, points, events, allocations, uploads, has = together(
        (LAST_LINES, upto),
        (metric_points(METRIC_CHUNK), {**upto, "after": 0}),
        (PAGE_EVENTS, upto, {"job": job}),
        (JOB_ALLOCATIONS, job_rows, {"job": job}),
        (SHOWN_UPLOADS, job_rows, {"job": job}),
        (PAGE_PARTS, {"of": job.pk}),
    )
    chart = metrics_data(job, upto=job.last_seq, limit=METRIC_POINTS_ON_PAGE, first=points)
    chart.update(early_stop_metric=job.early_stop_metric, early_stop_mode=job.early_stop_mode)
    lines = lines[::-1]
    earlier_lines = len(lines) > LOG_LINES_ON_PAGE
    lines = lines[1:] if earlier_lines else lines
    timeline, unisolated, environment = page_events(job, events)
    credited = "credits" in has
    artifacts = list(job.artifacts.all()) if "artifacts" in has else []
    context = {
        "job": job,
        "timeline": timeline,
        "unisolated": unisolated,
        "environment": environment,
        "lines_html": lines_html(lines),
        "earlier_lines": earlier_lines,
        "meter": job.meter_event(allocations=allocations, credited=None if credited else (0, Decimal(0))),
        "ceiling": job_ceiling(job, credits=None if credited else [], allocations=allocations),
        "allocation": job.latest_allocation(allocations),
        "allocations": job.latest_allocations(allocations),
        "staging": job.shown_staging(None if "stagings" in has else []),
        "artifacts": artifacts,
        "inputs": list(job.inputs.all()) if "inputs" in has else [],  # named inputs (most jobs have none)
        "uploads": uploads,
        "config_text": json.dumps(job.config),
        "last_seq": job.last_seq,
        "checkpoints": job_checkpoints(job) if "checkpoints" in has else [],
        # The ranks of the lines shown (a run under torchrun), for the filter; live lines add theirs.
        "log_ranks": sorted({rank for _, _, rank, _ in lines if rank is not None}),
        "metrics": chart,
        "metric_rows": metric_rows(chart["summary"]),
    }
    context.update(lineage_context(job, artifacts=artifacts, models=None if "models" in has else []))
    context.update(utilization_context(job, runs=None if "utilization_runs" in has else [], allocations=allocations))
    # The cost of the experiment beside its metrics: billed so far (less credits), final once it ended.
    meter_now = context["meter"]
    context["cost"] = Decimal(meter_now["amount"]) - Decimal(meter_now["credit_amount"])
    return render(request, "jobs/detail.html", context)


def page_events(job, events):
    """(its timeline, the notice that it ran without isolation or None, the latest notice of
    its environment, being built or ready, or None) from its PAGE_EVENTS up to job.last_seq: its
    state changes, checkpoints, resumes and notices are few, beside its log lines and metric
    points (an index of their own: jobs.models.JobEvent)."""
    timeline, unisolated, environment = [], None, None
    for event in events:
        if event.kind != "notice":
            timeline.append(event)
            continue
        data = event.data if isinstance(event.data, dict) else {}
        if unisolated is None and data.get("isolation") == "off":
            unisolated = event
        if "environment" in data and job.packages:
            environment = event
    return timeline, unisolated, environment


def ceiling_of(job):
    """How much of its ceiling the job has used (None without one), as the API counts it."""
    return job_ceiling(job)


def utilization_context(job, runs=None, allocations=None):
    """The job's device utilization as the page shows it: charts of every run, the mean and peak
    per device, and, once it ended, the right-size hints (runs, allocations: the job's, where the
    caller has them)."""
    runs = list(job.utilization_runs.all() if runs is None else runs)
    if not runs:
        return {"utilization": None}
    first = runs[0].started_at
    drawn = [((r.started_at - first).total_seconds(), r.series, r.windows) for r in runs]
    summary = utilization.Summary.from_data(job.utilization) if job.is_terminal else None
    summary = summary or utilization.summarize([(r.series, r.windows) for r in runs])
    return {
        "utilization": {
            "chart": utilization.chart(drawn),
            "memory_chart": utilization.chart(drawn, memory=True),
            "summary": summary,
            "hints": right_size_hints(job, summary, allocations) if job.is_terminal else [],
        }
    }


def right_size_hints(job, summary, allocations=None):
    """jobs.utilization.right_size for a job that held compute: what it held, for how
    long, and what it paid per device-hour (over all its allocations)."""
    device_seconds, amount, kinds = 0, Decimal(0), set()
    for allocation in job.allocations.all() if allocations is None else allocations:
        seconds, charged = allocation.meter()
        device_seconds += allocation.gpus * seconds
        amount += charged
        kinds.add(allocation.device_type)
    if not device_seconds or summary is None:
        return []
    return utilization.right_size(
        summary,
        devices=job.gpus,
        held_seconds=device_seconds / job.gpus,
        rate=amount * 3600 / device_seconds,
        unit="slot" if kinds == {"cpu"} else "GPU",
        currency=settings.E31_CURRENCY,
    )


def previous_right_size(team, name):
    """The right-size hints of the team's latest finished job of this name, for the form."""
    name = (name or "").strip()
    if not name:
        return {}
    previous = Job.objects.filter(team=team, name=name, state__in=states.TERMINAL, utilization__isnull=False).order_by("-finished_at").first()
    if previous is None:
        return {}
    hints = right_size_hints(previous, utilization.Summary.from_data(previous.utilization))
    return {"previous_job": previous, "previous_hints": hints} if hints else {}


def lineage_context(job, artifacts=None, models=None):
    """What the page shows of the models a job starts from or scores, and what can be made of it
    (artifacts, models: the job's, where the caller has them)."""
    finished = job.state in (states.SUCCEEDED, states.STOPPED)
    has_weights = finished and bool(lineage.model_files(job.artifacts.all() if artifacts is None else artifacts))
    models = list(job.models.all() if models is None else models)
    return {
        "models": models,
        "can_retrain": has_weights and job.kind != Job.KIND_EVALUATE,
        "can_compare": has_weights and job.kind == Job.KIND_FINETUNE and any(m.label == "start" for m in models),
        "comparison": comparison(job) if finished else None,
    }


@login_required
@require_POST
def job_cancel(request, job_id):
    job = get_job(request, job_id)
    if job.is_terminal:
        messages.info(request, f"The job has already {job.get_state_display().lower()}.")
    else:
        job.request_cancel()
        audit.record(request, "job.cancel", job)
        messages.success(request, "Cancelling the job." if job.is_active else "The job is cancelled.")
    return redirect("jobs:detail", job_id=job.pk)


@login_required
@require_GET
def job_log(request, job_id):
    job = get_job(request, job_id)
    return audit.recorded(log_response(request, job), request, "log.download", job)


@login_required
@require_GET
def artifact_download(request, job_id, name):
    job = get_job(request, job_id)
    artifact = get_artifact(job, name)
    return audit.recorded(artifact_response(request, artifact), request, "artifact.download", artifact, label=f"{job.name}: {artifact.name}")


# Metrics ------------------------------------------------------------------------------------


def metric_rows(summary):
    """The summary as rows for the page's table (readable without the chart)."""
    return [
        {
            "name": name,
            "last": metrics.format_value(s["last"]),
            "last_x": s["last_x"],
            "best": metrics.format_value(s["best"]) if s["best"] is not None else "",
            "best_x": s["best_x"],
            "mode": s["mode"],
            "count": s["count"],
            "non_finite": s["non_finite"],
        }
        for name, s in sorted(summary.items())
    ]


# Checkpoints --------------------------------------------------------------------------------


@login_required
@require_GET
def checkpoint_download(request, job_id, name):
    job = get_job(request, job_id)
    checkpoint = get_checkpoint(job, name)
    if checkpoint_is_gone(checkpoint):
        return HttpResponseGone(gone_message(job, checkpoint), content_type="text/plain; charset=utf-8")
    response = download_response(request, checkpoint.key, checkpoint.name.rsplit("/", 1)[-1])
    return audit.recorded(response, request, "checkpoint.download", checkpoint, label=f"{job.name}: {checkpoint.name}")
