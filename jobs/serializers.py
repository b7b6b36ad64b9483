"""The API's shapes of jobs: DRF serializers, the one source of both the JSON the views answer
and the OpenAPI schema (the views carry @extend_schema with these classes; catalog.serializers
holds the datasets' shapes, e31web/api_schema.py describes the API's other shapes).

A serializer reads an object through its Facts (core.serializers): the model's own fields, and
what the API shows beyond them (a job's meter, ceiling and latest allocations, URLs), worked out
once per object. The fields' classes type the schema; their values are the model's, as they
are (a string, a number, a list), except that times go out as stored (UTC) and the JSON renderer
writes them ("2026-11-03T10:30:00Z"), whatever time zone the request activated (Moment).

Lists: JobSerializer.prepare(page) fetches what a page of jobs shows in at most a fixed number of
queries, however many jobs it holds (tests/test_api_shapes.py counts them); one job alone is
completed the same way when it is shown. On PostgreSQL the JSON of a page's ended jobs is kept
between lists while none of their rows changes (jobs.written), and read again without them.

Also here: the request bodies of the views that answer these shapes.
"""

from contextlib import nullcontext
from decimal import Decimal

from django.conf import settings
from drf_spectacular.utils import inline_serializer
from rest_framework import serializers as s

from core.compiled import OneOf, Read
from core.prefetch import ReadPrefetch, prefetch_sparse
from core.serializers import DirectSerializer, Facts, FactsSerializer, Moment, absolute_url, nullable_str
from e31.recipes.precision import PRECISIONS
from jobs import states
from jobs.ceiling import job_ceiling
from jobs.models import Job, JobEvent, Upload, add_credits
from jobs.written import ROW_VERSION, KeptJobs, one_snapshot

# Jobs -----------------------------------------------------------------------------------------


class AllocationSerializer(DirectSerializer):
    shared_fields = True
    node = s.CharField(source="node.name")
    devices = s.JSONField()
    device_type = s.CharField(allow_blank=True)
    rate = s.CharField(help_text="Per GPU-hour, a decimal string.")
    started_at = Moment()
    ended_at = Moment(allow_null=True)
    end_reason = s.CharField(allow_blank=True, allow_null=True)
    node_rank = s.IntegerField(allow_null=True)
    gang_size = s.IntegerField(allow_null=True)


class ModelFileSerializer(DirectSerializer):
    shared_fields = True
    name = s.CharField()
    size = s.IntegerField()
    sha256 = s.CharField()


class JobModelSerializer(DirectSerializer):
    shared_fields = True
    label = s.CharField(help_text="Its folder in the job (model/<label>/): start, a fine-tuning's starting weights; an evaluation's new, previous ...")
    source_job = s.UUIDField(source="source_job_id", allow_null=True, help_text="The job whose output these weights are; null: uploaded.")
    description = s.CharField(allow_blank=True)
    files = ModelFileSerializer(many=True)


def timeline_entry(seq, at, kind, data):
    """A state change, or a checkpoint or resume, as the job's timeline lists it."""
    data = data or {}
    if kind == "state":
        return {"seq": seq, "at": at, "kind": "state", "state": data.get("state"), "from": data.get("from"), "reason": data.get("reason", "")}
    return {"seq": seq, "at": at, "kind": kind, "name": data.get("name"), "step": data.get("step"), "text": data.get("text", "")}


# The timelines of a page of jobs, the SQL made once (the jobs' ids as one value).
TIMELINES = Read(
    lambda: (
        JobEvent.objects.filter(OneOf("job_id", "jobs", Job._meta.pk), kind__in=Job.TIMELINE_KINDS)
        .order_by("seq")
        .values_list("job_id", "seq", "at", "kind", "data")
    )
)


def read_timelines(jobs):
    """Each job's timeline (Job.timeline()'s events as timeline_entry shapes them), in one query
    of plain rows: made into model instances, a page's 150-odd events cost more than the query
    itself (issue 24)."""
    entries = {job.pk: [] for job in jobs}
    if entries:
        for job_id, seq, at, kind, data in TIMELINES(jobs=list(entries)):
            entries[job_id].append(timeline_entry(seq, at, kind, data))
    for job in jobs:
        job.timeline_entries = entries[job.pk]


def job_inputs(inputs, uploads):
    """{name: its dataset version (NAME@N), or the list of its files} of a job's named inputs,
    from its inputs and uploads."""
    found = {i.name: i.label for i in inputs}
    for upload in uploads:
        if upload.role == Upload.INPUT:
            found.setdefault(upload.channel, []).append(upload.name)
    return dict(sorted(found.items()))


def plain(value):
    """A decimal as a plain decimal string (no exponent); None stays None."""
    return None if value is None else f"{value:f}"


# What JobFacts reads besides the job's row (its timeline is read_timelines'), for a page of
# jobs (JobSerializer.prepare) or for one job when it is shown: each as a list (to_attr), in the
# relation's own order, read by a Read (core.prefetch.ReadPrefetch). Prefetched into the related
# managers' caches, Django made a queryset per job and relation, which cost a page of 50 jobs more
# than its queries and its JSON together; prefetched by Django at all, the allocations' query was
# built, compiled and run through its machinery at every page, 3 ms of it (issue 24).
JOB_PREFETCH = (
    ReadPrefetch(Job, "allocations", "shown_allocations", select_related=["node"]),
    ReadPrefetch(Job, "models", "shown_models"),
    ReadPrefetch(Job, "inputs", "shown_inputs"),
    ReadPrefetch(Job, "uploads", "shown_uploads"),
    ReadPrefetch(Job, "stagings", "shown_stagings", select_related=["node"]),
)
# A page's credits, with their usage records (JobSerializer.prepare).
JOB_CREDITS = ReadPrefetch(Job, "credits", "shown_credits", select_related=["usage"])


def as_made(job, made):
    """A job just made (JobForm.save), with what JOB_PREFETCH would read back from the rows
    made with it (made: its inputs, uploads, models and events), in the relations' own orders,
    and nothing held, staged or credited yet: its API answer costs no query more (a submission
    read seven back)."""
    job.shown_allocations, job.shown_stagings, job.shown_credits = [], [], []
    job.credited_seconds_total, job.credited_amount_total = 0, Decimal(0)  # as a page's (listed)
    job.shown_models = sorted(made["models"], key=lambda m: m.pk)
    job.shown_inputs = sorted(made["inputs"], key=lambda i: i.name)
    job.shown_uploads = sorted(made["uploads"], key=lambda u: (u.created_at, u.name))
    timeline = sorted((e for e in made["events"] if e.kind in Job.TIMELINE_KINDS), key=lambda e: e.seq)
    job.timeline_entries = [timeline_entry(e.seq, e.at, e.kind, e.data) for e in timeline]
    return job


class JobFacts(Facts):
    def __init__(self, job, request):
        super().__init__(job)
        listed = hasattr(job, "credited_amount_total")  # one of a page, from JobSerializer.prepare
        if not listed:  # one job alone: fetched here
            prefetch_sparse([job], *JOB_PREFETCH)
            read_timelines([job])
        allocations = job.shown_allocations
        if listed:
            credit_seconds, credit_amount = job.credited_seconds_total, job.credited_amount_total
            ceiling = job_ceiling(job, credits=job.shown_credits, allocations=allocations)
        else:
            credit_seconds, credit_amount = job.credited()
            ceiling = job_ceiling(job, allocations=allocations)
        seconds, amount = job.held(allocations=allocations)
        staging = job.shown_staging(job.shown_stagings)
        self.models = job.shown_models
        self.packages = job.packages.splitlines()
        # NAME@N, kept on the job (also after the dataset is deleted): no query per job.
        self.train_dataset = job.train_label or None
        self.heldout_dataset = job.heldout_label or None
        self.inputs = job_inputs(job.shown_inputs, job.shown_uploads)
        self.staging = staging.progress() if staging else None
        # Of the ceiling: the share used (billed, credits taken off) and what is left.
        self.ceiling_used_fraction = float(ceiling.used_fraction) if ceiling else None
        self.ceiling_amount_left = plain(ceiling and ceiling.amount_left)
        self.ceiling_gpu_hours_left = plain(ceiling and ceiling.gpu_hours_left)
        self.deadline_missed = job.deadline_missed_at is not None
        self.credited_seconds = credit_seconds
        self.credited = f"{credit_amount:f}"
        self.held_seconds = seconds
        self.cost = f"{amount:f}"
        self.currency = settings.E31_CURRENCY
        self.allocation = job.latest_allocation(allocations)
        self.allocations = job.latest_allocations(allocations)
        self.timeline = job.timeline_entries
        self.url = absolute_url(request, "jobs:detail", job.pk)


class JobSerializer(FactsSerializer):
    facts_class = JobFacts
    shared_fields = True

    id = s.UUIDField()
    name = s.CharField(allow_blank=True)
    experiment = s.CharField(
        help_text="The experiment it belongs to, its runs compared side by side: by default its name; a sweep's trials, the sweep's; a copy, its source's."
    )
    kind = s.CharField()
    recipe = s.CharField(allow_blank=True, allow_null=True)
    parent = s.UUIDField(source="parent_id", allow_null=True, help_text="The job it was made from: a retraining's previous job, a comparison's fine-tuning.")
    smoke_run = s.UUIDField(source="smoke_run_id", allow_null=True, help_text="The short run on a sample that must succeed before this job may start.")
    models = JobModelSerializer(many=True, help_text="The models the job starts from or scores, their files pinned.")
    state = s.CharField()
    created_at = Moment()
    finished_at = Moment(allow_null=True)
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
    staging = s.JSONField(
        allow_null=True,
        help_text='Getting its work and data onto a node, while it waits: {"state", "node", "files_done", "files_total", "bytes_done", '
        '"bytes_total", "bytes_moved", "seconds", "throughput", "error"}; null: not staged yet.',
    )
    gpus = s.IntegerField()
    gpu_type = s.CharField(allow_blank=True)
    mode = s.CharField()
    span_hours = nullable_str()
    ceiling_amount = nullable_str()
    ceiling_gpu_hours = nullable_str()
    ceiling_used_fraction = s.FloatField(allow_null=True, help_text="How much of the job's ceiling is used, 0 to 1 (the nearer one of two); null: no ceiling.")
    ceiling_amount_left = nullable_str(help_text="Of a money ceiling, what is left (a decimal string); null: none.")
    ceiling_gpu_hours_left = nullable_str(help_text="Of a GPU-hours ceiling, what is left (a decimal string); null: none.")
    not_before = Moment(allow_null=True)
    deadline = Moment(allow_null=True)
    deadline_missed = s.BooleanField(help_text="The deadline was found infeasible.")
    predicted_start = Moment(allow_null=True)
    predicted_finish = Moment(allow_null=True)
    wait_reason = s.CharField(allow_blank=True, help_text="While queued: what it waits for.")
    exit_code = s.IntegerField(allow_null=True)
    reason = s.CharField(allow_blank=True, help_text="Why the job ended as it did.")
    restarts = s.IntegerField()
    preemptions = s.IntegerField()
    preemptible = s.BooleanField()
    keep_checkpoints = s.IntegerField()
    max_restarts = s.IntegerField()
    early_stop_metric = s.CharField(allow_blank=True)
    early_stop_mode = s.CharField()
    early_stop_patience = s.IntegerField(allow_null=True)
    stop_on_nan = s.BooleanField()
    network = s.BooleanField()
    idle_minutes = s.IntegerField(help_text="Minutes with every device idle before the job is flagged (0: never).")
    stop_if_idle = s.BooleanField(help_text="Once flagged idle, the job is stopped with a checkpoint.")
    idle_since = Moment(allow_null=True, help_text="While flagged idle: since when its devices are idle.")
    utilization = s.JSONField(
        allow_null=True,
        help_text='Once it ended: {"seconds", "busy" (devices\' worth), "series": [{"name", "mean", "peak", "memory_mean", "memory_peak", "memory_total"}]}.',
    )
    credited_seconds = s.IntegerField(help_text="Held seconds credited for time lost through the network's fault.")
    credited = s.CharField(help_text="A decimal string, in currency: taken off for time lost through the network's fault.")
    held_seconds = s.IntegerField()
    cost = s.CharField(help_text="A decimal string, in currency.")
    currency = s.CharField()
    allocation = AllocationSerializer(allow_null=True, help_text="The latest allocation (of a gang: node 0's).")
    allocations = AllocationSerializer(many=True, help_text="Every node and device of the latest allocation (one, or a gang's).")
    timeline = s.ListField(
        child=s.DictField(),
        help_text='State changes {"seq", "at", "kind": "state", "state", "from", "reason"}, checkpoints and resumes {"seq", "at", "kind", "name", "step", "text"}.',
    )
    last_seq = s.IntegerField()
    url = s.URLField()

    @staticmethod
    def prepare(jobs):
        """A page of jobs with what the serializer reads, in at most a fixed number of queries:
        the relations none of them has rows in are not asked for. Their credits' sums are the
        credits' own, added up here: most jobs have none, and two sums in the page's query cost
        it two subqueries a job (issue 24).

        A job read with its row's version (PostgreSQL) whose JSON is kept (jobs.written: it had
        ended, and none of its rows has changed since) reads nothing more: list_item writes it.
        Only an ended job's JSON may be kept: a page of jobs still queued or running asks for no
        fingerprint."""
        ended = {job.pk for job in jobs if job.state in states.TERMINAL and getattr(job, ROW_VERSION, None) is not None}
        for job in jobs:
            job.written_key = None
        # The fingerprints of the ended jobs kept in some version (none: no query).
        KEPT.keys([job for job in jobs if job.pk in ended and KEPT.holds(job.pk)])
        rest = []
        for job in jobs:
            job.written = KEPT.get(job.written_key)
            if job.written is None:
                rest.append(job)
        if not rest:
            return
        to_keep = [job for job in rest if job.pk in ended]
        with one_snapshot(rest[0]._state.db or "default") if to_keep else nullcontext():
            # Their keys again, in the snapshot their rows are read in: the JSON is kept under
            # the fingerprint of what it was written from (jobs.written).
            KEPT.keys(to_keep)
            prefetch_sparse(rest, *JOB_PREFETCH, JOB_CREDITS)
            read_timelines(rest)
        for job in rest:
            job.credited_seconds_total, job.credited_amount_total = add_credits((c.seconds, c.amount) for c in job.shown_credits)

    def list_item(self, job):
        """A job of a page prepare() read: its kept JSON with this request's URL, or its JSON
        written now (and kept once the job has ended: a terminal state, every allocation ended)."""
        if job.written is not None:
            return {**job.written, "url": absolute_url(self.context["request"], "jobs:detail", job.pk)}
        data = self.to_representation(job)
        if job.written_key is not None and settled(job):
            KEPT.put(job.written_key, data)
        return data

    @staticmethod
    def release(jobs):
        """Let go of the rows prepare() hung on a page's jobs once they are written. Each row a
        prefetch reads points back at its job (Django caches the relation), so a job and its
        rows make a cycle, which refcounting never frees: a page's 50 jobs left about 1,400
        objects a request to the collector's oldest generation, and its passes over them,
        every 40 job lists or so, took 25-45 ms each (the list's p99, issue 24)."""
        for job in jobs:
            held = job.__dict__
            for name in PREPARED:  # by name: a job's 70-odd attributes searched cost 0.2 ms a page
                held.pop(name, None)


def settled(job):
    """Whether a job of a page prepare() read writes the same JSON until one of its rows changes:
    it has ended, and nothing it shows counts on with the clock (an allocation's meter, a
    staging's seconds)."""
    return (
        job.state in states.TERMINAL
        and all(a.ended_at is not None for a in job.shown_allocations)
        and all(s.started_at is None or s.finished_at is not None for s in job.shown_stagings)
    )


# What prepare() hangs on each job of a page, by the prefetches' names.
PREPARED = tuple(prefetch.to_attr for prefetch in (*JOB_PREFETCH, JOB_CREDITS))

# The JSON of ended jobs, kept in this process while none of the rows it is written from changes
# (jobs.written): the job's own, those of its relations read above, and its timeline events.
KEPT = KeptJobs((*JOB_PREFETCH, JOB_CREDITS), JobEvent._meta.db_table, Job.TIMELINE_KINDS)


# Request bodies -------------------------------------------------------------------------------

SPEC_HELP = (
    "The job's spec: a spec file's text (YAML or JSON), or (JSON body) an object of the API's fields: "
    "name, experiment (blank: the name), kind, recipe, entrypoint, command, args, hyperparameters, config, env, workdir, processes, precision (fp32, bf16 or fp16), "
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

RetrainOverridesForm = inline_serializer(
    name="RetrainForm",
    fields={
        "spec": s.CharField(
            required=False,
            help_text="A JSON object overriding the job's: name, experiment (blank: the job's), gpus, gpu_type, mode, span_hours, "
            "ceiling_kind, ceiling, not_before, by, deadline, preemptible, args, hyperparameters, config, inputs.",
        ),
        "data": s.ListField(child=s.FileField(), required=False, help_text="More training data files."),
    },
)
RetrainOverridesJson = inline_serializer(name="RetrainJson", fields={"spec": s.DictField(required=False)})
