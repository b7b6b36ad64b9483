"""The jobs' records: a job (the work, its data, its request and ceiling), its events (states,
log lines, metrics), uploads, artifacts, named inputs, base models, checkpoints, folder uploads
and utilization.

Over 500 lines because a job's record is one table read by every part of the network: its fields
and the few methods over them (the meter's view, the states' checks) stay together.
"""

import math
import uuid
from decimal import Decimal

from django.conf import settings
from django.db import connection, models, transaction
from django.utils import timezone

from billing import meter
from core.jsonfield import JSONField
from e31.recipes.precision import CHOICES as PRECISION_CHOICES
from jobs import live, states
from notifications import events as notifications


def add_credits(credits):
    """(seconds, amount) of credits given as (seconds, amount) pairs: 0 and 0 for none, or for
    credits of nothing."""
    credits = list(credits)
    return sum(seconds for seconds, _ in credits), sum((amount for _, amount in credits), Decimal(0)) or Decimal(0)


class Job(models.Model):
    KIND_TRAIN = "train"
    KIND_FINETUNE = "finetune"
    KIND_EVALUATE = "evaluate"
    KINDS = [(KIND_TRAIN, "Train"), (KIND_FINETUNE, "Fine-tune"), (KIND_EVALUATE, "Evaluate")]
    RECIPE_PREFIX = "recipe:"

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    team = models.ForeignKey("accounts.Team", on_delete=models.PROTECT, related_name="jobs")
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="jobs")
    name = models.CharField(max_length=200)
    experiment = models.CharField(
        max_length=200,
        blank=True,
        db_index=True,
        help_text="the experiment it belongs to: by default its name; a sweep's trials, the sweep's; a copy, its source's",
    )
    kind = models.CharField(max_length=20, choices=KINDS, default=KIND_TRAIN)
    state = models.CharField(max_length=20, choices=states.CHOICES, default=states.QUEUED)
    created_at = models.DateTimeField(default=timezone.now)
    finished_at = models.DateTimeField(null=True, blank=True)

    # Work: an uploaded script (entrypoint), or a built-in recipe (entrypoint "recipe:NAME",
    # its parameters in config), or a shell line (command) run in the job's sandbox.
    entrypoint = models.CharField(max_length=500, blank=True)
    command = models.TextField(blank=True, default="", help_text="one shell line run instead of an entrypoint (bash -c)")
    args = JSONField(default=list, blank=True)
    # Passed as --name value after the arguments (SageMaker's way), and as SM_HPS / SM_HP_<NAME>.
    hyperparameters = JSONField(default=dict, blank=True)
    config = JSONField(default=dict, blank=True)
    env = JSONField(default=dict, blank=True)
    # Relative to the code's folder; blank: the entrypoint's own folder.
    workdir = models.CharField(max_length=500, blank=True, default="")
    # Processes per node; None: one per GPU, or one for CPU slots (with a thread per slot).
    processes = models.PositiveSmallIntegerField(null=True, blank=True)
    # The Python packages the job brings: requirements (jobs.packages), one a line. The node
    # builds an environment with them while the job waits, off the meter.
    packages = models.TextField(blank=True, default="", help_text="requirements, one a line (checked by jobs.packages)")
    # Passed to the job as E31_PRECISION; the recipes autocast by it on CUDA (e31.recipes.precision).
    precision = models.CharField(max_length=4, blank=True, default="", choices=PRECISION_CHOICES, help_text="fp32, bf16 or fp16; blank: the recipes' default")

    # Data: dataset versions are pinned when the job is submitted.
    # The labels ("digits@2") stay when the dataset is deleted later (the version becomes None).
    train_version = models.ForeignKey("catalog.DatasetVersion", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    heldout_version = models.ForeignKey("catalog.DatasetVersion", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    train_label = models.CharField(max_length=300, blank=True, help_text="the training dataset version, as NAME@N")
    heldout_label = models.CharField(max_length=300, blank=True, help_text="the held-out dataset version, as NAME@N")

    # Request
    gpus = models.PositiveIntegerField()
    gpu_type = models.CharField(max_length=100, blank=True, help_text="blank: any type")
    span_hours = models.DecimalField(max_digits=10, decimal_places=4, null=True, blank=True)
    ceiling_amount = models.DecimalField(max_digits=14, decimal_places=2, null=True, blank=True)
    ceiling_gpu_hours = models.DecimalField(max_digits=16, decimal_places=4, null=True, blank=True)
    not_before = models.DateTimeField(null=True, blank=True)
    deadline = models.DateTimeField(null=True, blank=True)

    # The job it was made from: a retraining's previous job, a comparison's fine-tuning job.
    parent = models.ForeignKey("self", null=True, blank=True, on_delete=models.SET_NULL, related_name="children")
    # A short run of the same work on a sample of the data that must succeed before this job
    # may start (a job of its own, billed as such).
    smoke_run = models.ForeignKey("self", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")

    # Run
    cancel_requested_at = models.DateTimeField(null=True, blank=True)
    # A stop asked for by the network (a sweep's pruner): the job is stopped as early stopping
    # stops it (SIGTERM, the grace period, its weights kept), and ends "stopped" with this reason.
    stop_requested_at = models.DateTimeField(null=True, blank=True)
    stop_reason = models.CharField(max_length=300, blank=True)
    wait_reason = models.CharField(max_length=300, blank=True)
    # How long the scheduler expects it to hold its devices, learned once while it is queued from
    # the team's earlier runs of the same work (jobs.durations): the seconds, and how many
    # runs they were learned from (0: none; null: not looked at yet).
    learned_seconds = models.FloatField(null=True, blank=True)
    learned_from = models.PositiveIntegerField(null=True, blank=True)
    exit_code = models.IntegerField(null=True, blank=True)
    reason = models.CharField(max_length=500, blank=True, help_text="why the job ended as it did")
    restarts = models.PositiveIntegerField(default=0, help_text="times the job went back to the queue")
    preemptions = models.PositiveIntegerField(default=0)
    last_seq = models.PositiveBigIntegerField(default=0)

    # Checkpoints, restarts and stopping
    preemptible = models.BooleanField(default=False, help_text="may be preempted, at the preemptible rate")
    keep_checkpoints = models.PositiveIntegerField(default=3, help_text="checkpoints kept in storage (the latest K)")
    max_restarts = models.PositiveIntegerField(default=3, help_text="restarts after a lost node before the job fails (preemptions do not count)")
    early_stop_metric = models.CharField(max_length=100, blank=True, help_text="a metric to watch for early stopping")
    early_stop_mode = models.CharField(max_length=3, choices=[("min", "Lower is better"), ("max", "Higher is better")], default="min")
    early_stop_patience = models.PositiveIntegerField(null=True, blank=True, help_text="evaluations without improvement")
    stop_on_nan = models.BooleanField(default=True, help_text="stop when a loss becomes NaN or infinite")
    network = models.BooleanField(default=False, help_text="the job may reach the network (off: its own loopback only; gangs always keep the network)")
    # Idle detection: flagged (and the team told) when every device stays idle this long;
    # stopped, with a checkpoint, only if the job said so.
    idle_minutes = models.PositiveIntegerField(default=30, help_text="minutes with every device idle before the job is flagged")
    stop_if_idle = models.BooleanField(default=False, help_text="stop the job (with a checkpoint) once it is flagged idle")
    idle_since = models.DateTimeField(null=True, blank=True, help_text="while flagged idle: since when its devices are idle")
    # Mean and peak per device over the whole run (jobs.utilization.Summary), kept when it ends.
    utilization = JSONField(null=True, blank=True)

    # What the scheduler expects for a queued job (a simulation of the queue), and its flags
    predicted_start = models.DateTimeField(null=True, blank=True)
    predicted_finish = models.DateTimeField(null=True, blank=True)
    deadline_missed_at = models.DateTimeField(null=True, blank=True, help_text="when its deadline was found infeasible")
    last_preempted_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]
        indexes = [models.Index(fields=["team", "-created_at"]), models.Index(fields=["state", "created_at"])]

    def __str__(self):
        return f"{self.name} ({self.short_id})"

    def save(self, *args, **kwargs):
        filled = self.fill_derived()
        if kwargs.get("update_fields") is not None:
            kwargs["update_fields"] = {*kwargs["update_fields"], *(f for f in filled if f != "experiment")}
        super().save(*args, **kwargs)

    def fill_derived(self):
        """Fills what a job's save derives from its other fields; the names of those it filled.
        Its experiment is its name's, where it has none. The pinned versions' names are kept as
        text, so the job still says what it trained on after the dataset is deleted."""
        filled = []
        if not self.experiment:
            self.experiment = self.name[: self._meta.get_field("experiment").max_length]
            filled.append("experiment")
        for role in ("train", "heldout"):
            version = getattr(self, f"{role}_version")
            if version is not None and not getattr(self, f"{role}_label"):
                setattr(self, f"{role}_label", version.label)
                filled.append(f"{role}_label")
        return filled

    def shown_staging(self, stagings=None):
        """The staging a job's page and API show: of a job staged on several nodes (its first
        node was busy), the one that finished, else the newest still going, else the newest.
        stagings: the job's, newest first with their nodes, where the caller has them (a list's
        prefetch, jobs.serializers)."""
        stagings = list(self.stagings.select_related("node") if stagings is None else stagings)  # newest first
        return next((s for s in stagings if s.state == "staged"), None) or next(
            (s for s in stagings if s.state != "abandoned"), stagings[0] if stagings else None
        )

    @property
    def short_id(self):
        return str(self.id)[:8]

    @property
    def recipe(self):
        """The built-in recipe's name, or '' for a job that brings its own script."""
        return self.entrypoint.removeprefix(self.RECIPE_PREFIX) if self.entrypoint.startswith(self.RECIPE_PREFIX) else ""

    @property
    def is_active(self):
        return self.state in states.ACTIVE

    @property
    def is_terminal(self):
        return self.state in states.TERMINAL

    @property
    def mode(self):
        return "span" if self.span_hours is not None else "until_done"

    def meter_request(self):
        return meter.Request(
            gpus=self.gpus,
            span_hours=self.span_hours,
            ceiling_amount=self.ceiling_amount,
            ceiling_gpu_hours=self.ceiling_gpu_hours,
        )

    def is_smoke_run(self):
        """Whether this job is another job's smoke run (jobs.lineage.smoke_run made it)."""
        return Job.objects.filter(smoke_run=self).exists()

    # Events -----------------------------------------------------------------------------------

    def record(self, kind, *, at=None, data=None):
        """Store one event (state change, meter tick) with the next sequence number."""
        return JobEvent.append(self.pk, [JobEvent(kind=kind, at=at or timezone.now(), data=data)])

    # Transitions: each checks the current state inside a transaction and records an event --------

    def _transition(self, target, *, reason="", at=None, **fields):
        at = at or timezone.now()
        with transaction.atomic():
            job = Job.objects.select_for_update().get(pk=self.pk)
            states.check(job.state, target)
            previous = job.state
            job.state = target
            for name, value in fields.items():
                setattr(job, name, value)
            if target in states.TERMINAL:
                job.finished_at = at
                job.reason = reason
            job.save(update_fields=["state", "finished_at", "reason", *fields])
            job.record("state", at=at, data={"state": target, "from": previous, "reason": reason})
            notifications.job_changed(job, previous, target, reason)
        self.refresh_from_db()
        return self

    def start(self, allocation, gang=None):
        """Compute is held: the allocation (or every allocation of a gang) exists and the meter
        runs from its started_at."""
        held = "; ".join(a.describe() for a in gang) if gang else allocation.describe()
        where = f"a gang of {len(gang)} nodes: {held}" if gang else held
        return self._transition(states.STARTING, at=allocation.started_at, reason=f"held {where}", wait_reason="")

    def mark_running(self):
        return self._transition(states.RUNNING, reason="process started")

    def finish(self, state, *, reason="", exit_code=None, at=None):
        return self._transition(state, reason=reason, exit_code=exit_code, at=at)

    def requeue(self, reason, at=None, preempted=False):
        """Back to the queue after the network took its compute away (node lost, runner
        stopped, preempted). A job lost more than max_restarts times fails instead:
        preemptions are the network's choice and do not count against it."""
        if self.cancel_requested_at is not None:
            return self._transition(states.CANCELLED, reason="cancelled while its compute was taken back", at=at)
        if preempted:
            return self._transition(states.QUEUED, reason=reason, at=at, restarts=self.restarts + 1, preemptions=self.preemptions + 1)
        losses = self.restarts - self.preemptions + 1
        if losses > self.max_restarts:
            return self._transition(
                states.FAILED,
                at=at,
                reason=f"{reason}; it was restarted {self.restarts - self.preemptions} times, its limit is {self.max_restarts}",
            )
        return self._transition(states.QUEUED, reason=reason, at=at, restarts=self.restarts + 1)

    def request_cancel(self):
        """A queued job is cancelled at once; a held one is stopped by its runner, which then
        releases the compute and records the cancellation."""
        with transaction.atomic():
            job = Job.objects.select_for_update().get(pk=self.pk)
            if job.state == states.QUEUED:
                job._transition(states.CANCELLED, reason="cancelled before it started")
            elif job.state in states.HOLDING and job.cancel_requested_at is None:
                Job.objects.filter(pk=job.pk).update(cancel_requested_at=timezone.now())
                job.record("notice", data={"text": "cancel requested; stopping the process"})
        self.refresh_from_db()
        return self

    # Views of the run -----------------------------------------------------------------------

    def timeline(self):
        """State changes, checkpoints and resumes, in order."""
        return self.events.filter(kind__in=self.TIMELINE_KINDS).order_by("seq")

    TIMELINE_KINDS = ("state", "checkpoint", "resume")

    def latest_allocation(self, allocations=None):
        """allocations: the job's with their nodes, where the caller has them (a list's prefetch,
        jobs.serializers): chosen from in the same order, without a query."""
        if allocations is None:
            return self.allocations.select_related("node").order_by("-started_at", "node_rank").first()
        ordered = sorted(sorted(allocations, key=lambda a: a.node_rank), key=lambda a: a.started_at, reverse=True)
        return ordered[0] if ordered else None

    def latest_allocations(self, allocations=None):
        """The latest allocation, or every node of the latest gang, in node order (allocations:
        as for latest_allocation)."""
        latest = self.latest_allocation(allocations)
        if latest is None or latest.gang is None:
            return [latest] if latest is not None else []
        if allocations is not None:
            return sorted((a for a in allocations if a.gang == latest.gang), key=lambda a: a.node_rank)
        return list(self.allocations.select_related("node").filter(gang=latest.gang).order_by("node_rank"))

    def held(self, now=None, allocations=None):
        """(held seconds, amount so far) over all the job's allocations, live for an open one."""
        now = now or timezone.now()
        seconds, amount = 0, Decimal(0)
        for allocation in self.allocations.all() if allocations is None else allocations:
            s, a = allocation.meter(now)
            seconds += s
            amount += a
        return seconds, amount

    def credited(self):
        """(seconds, amount) credited for time lost through the network's fault: the credits
        added up here, as a page of jobs adds up its own (jobs.serializers), to the amount's 8
        places on every database (SQLite's SUM of decimals is a float's 15)."""
        return add_credits(self.credits.values_list("seconds", "amount"))

    def meter_event(self, now=None, allocations=None, credited=None):
        """The meter as the job page shows it: totals over all allocations, and whether it runs
        (allocations, credited: as the job's own, where the caller has them)."""
        now = now or timezone.now()
        allocations = list(self.allocations.all() if allocations is None else allocations)
        seconds, amount = self.held(now, allocations)
        credit_seconds, credit_amount = self.credited() if credited is None else credited
        current = next((a for a in allocations if a.ended_at is None), allocations[-1] if allocations else None)
        return {
            "held_seconds": seconds,
            "amount": f"{amount:f}",
            "gpus": current.gpus if current else self.gpus,
            "rate": str(current.rate) if current else None,
            "currency": settings.E31_CURRENCY,
            "running": any(a.ended_at is None for a in allocations),
            "credit_seconds": credit_seconds,
            "credit_amount": f"{credit_amount:f}",
        }


class Utilization(models.Model):
    """The device utilization of one allocation (one run of a job on one node), as compact
    windows of samples (jobs.utilization): one row, updated in place as windows close."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="utilization_runs")
    allocation = models.OneToOneField("scheduler.Allocation", on_delete=models.CASCADE, related_name="utilization")
    started_at = models.DateTimeField(help_text="when the allocation started: windows count seconds from here")
    every = models.FloatField(help_text="seconds between samples")
    width = models.FloatField(help_text="seconds per window (doubles as a long run's windows are merged)")
    series = JSONField(default=list, help_text='[{"name", "kind", "memory_total"}, ...]: one per device')
    windows = JSONField(default=list, help_text="[[start, seconds, [[mean %, peak %, mean MiB, peak MiB], ...]], ...]")
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["started_at"]

    def __str__(self):
        return f"utilization of {self.allocation_id}"


# A store of at most this many log lines goes as one statement on PostgreSQL
# (JobEvent._append_in_one_statement); more go by COPY, in a transaction.
ONE_STATEMENT_LINES = 200


class JobEvent(models.Model):
    """A log line, state change, meter tick or notice: stored first, then announced."""

    KINDS = [
        ("log", "Log line"),
        ("state", "State change"),
        ("meter", "Meter tick"),
        ("staging", "Staging progress"),
        ("notice", "Notice"),
        ("metric", "Metric point"),
        ("checkpoint", "Checkpoint kept"),
        ("resume", "Resumed from a checkpoint"),
    ]
    # Kinds where only the latest matters to someone who was not watching.
    PROGRESS_KINDS = ("meter", "staging")

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="events")
    seq = models.PositiveBigIntegerField()
    at = models.DateTimeField()
    kind = models.CharField(max_length=10, choices=KINDS)
    stream = models.CharField(max_length=10, blank=True)
    rank = models.PositiveIntegerField(null=True, blank=True, help_text="the process (torchrun's global rank) that printed a log line")
    text = models.TextField(blank=True)
    data = JSONField(null=True, blank=True)

    class Meta:
        ordering = ["job", "seq"]
        constraints = [models.UniqueConstraint(fields=["job", "seq"], name="job_event_seq_unique")]
        # A job's few other events (its timeline, notices) found without reading through its
        # log lines and metric points, a thousand to one (issue 24); small, and nothing for
        # the runner's COPY of log lines to maintain.
        indexes = [
            models.Index(fields=["job", "seq"], condition=~models.Q(kind__in=["log", "metric"]), name="job_event_rare_kinds"),
            # And its metric points (the job page's chart, the metrics endpoint) without reading
            # through its log lines, ten to one in a usual run (issue 24).
            models.Index(fields=["job", "seq"], condition=models.Q(kind="metric"), name="job_event_metrics"),
        ]

    MESSAGE_FIELDS = ("seq", "kind", "at", "stream", "text", "data", "rank")

    @staticmethod
    def _reserve(job_id, count):
        """The first of count new sequence numbers for the job (call inside a transaction).

        The counter lives on the job row: the UPDATE locks it until commit, so two writers for
        one job (runner, scheduler, web) take turns and sequence order is commit order. One
        statement that returns the counter (both databases have RETURNING): the runner's every
        store of log lines makes it, and an UPDATE then a SELECT cost a round trip and two
        queries' building more (1.5 -> 0.9 ms of CPU per store of 10 lines on PostgreSQL, measured in-process)."""
        meta = Job._meta
        quote, column = connection.ops.quote_name, meta.get_field("last_seq").column
        with connection.cursor() as cursor:
            cursor.execute(
                f"UPDATE {quote(meta.db_table)} SET {quote(column)} = {quote(column)} + %s WHERE {quote(meta.pk.column)} = %s RETURNING {quote(column)}",
                [count, meta.pk.get_db_prep_value(job_id, connection)],
            )
            row = cursor.fetchone()
        if row is None:
            raise Job.DoesNotExist(f"no job {job_id}")
        return row[0] - count + 1

    @classmethod
    def append(cls, job_id, events):
        """Give events the job's next sequence numbers and store them; announce after commit."""
        if not events:
            return None
        with transaction.atomic():
            first = cls._reserve(job_id, len(events))
            for offset, event in enumerate(events):
                event.job_id = job_id
                event.seq = first + offset
            cls.objects.bulk_create(events, batch_size=500)
            last = first + len(events) - 1
            transaction.on_commit(lambda: live.announce(job_id, last))
        return last

    @classmethod
    def store_first(cls, job, events):
        """append() for the first events of a job made in the caller's transaction with its
        counter already past them (last_seq = len(events)): no other writer can see the job
        before the commit, so their numbers are 1.. without moving the counter (a submission's
        "submitted" event: one INSERT, not a savepoint, an UPDATE and the INSERT).

        Nor are they announced: no one can watch a job before it exists (a socket reads what
        was stored before it listens, from the first event), so the announcement reached no one
        and cost a submission a round trip to Redis (issue 24)."""
        if job.last_seq != len(events):
            raise ValueError(f"store_first: a job made with last_seq {len(events)}, not {job.last_seq}")
        for seq, event in enumerate(events, start=1):
            event.job_id, event.seq = job.pk, seq
        cls.objects.bulk_create(events)
        return job.last_seq

    @classmethod
    def append_lines(cls, job_id, lines):
        """append() for log lines given as (stream, at, text) or (stream, at, text, rank), the
        runner's hot path: plain rows in one statement (COPY on PostgreSQL), no model instances.
        Measured by bench/log_throughput.py: about 4x the lines per second of bulk_create."""
        if not lines:
            return None
        table = cls._meta.db_table
        columns = "job_id, seq, at, kind, stream, text, rank"
        rows = [(line[0], line[1], line[2], line[3] if len(line) > 3 else None) for line in lines]
        if connection.vendor == "postgresql" and len(rows) <= ONE_STATEMENT_LINES:
            last = cls._append_in_one_statement(job_id, rows)
            carried = live.carried_lines(last - len(rows) + 1, rows)
            transaction.on_commit(lambda: live.announce(job_id, last, carried))  # at once, outside a transaction
            return last
        with transaction.atomic():
            first = cls._reserve(job_id, len(rows))
            with connection.cursor() as cursor:
                if connection.vendor == "postgresql":
                    with cursor.cursor.copy(f"COPY {table} ({columns}) FROM STDIN") as copy:
                        for offset, (stream, at, text, rank) in enumerate(rows):
                            copy.write_row((job_id, first + offset, at, "log", stream, text, rank))
                else:
                    job_value = cls._meta.get_field("job").get_db_prep_value(job_id, connection)
                    adapt = connection.ops.adapt_datetimefield_value
                    cursor.executemany(
                        f"INSERT INTO {table} ({columns}) VALUES (%s, %s, %s, %s, %s, %s, %s)",
                        [(job_value, first + i, adapt(at), "log", stream, text, rank) for i, (stream, at, text, rank) in enumerate(rows)],
                    )
            last = first + len(rows) - 1
            # The rows go with the announcement: a web process that has sent up to first - 1
            # hands them on without reading them back (jobs/live.py).
            carried = live.carried_lines(first, rows)
            transaction.on_commit(lambda: live.announce(job_id, last, carried))
        return last

    @classmethod
    def stored_batch(cls, job_id, after, events):
        """The last seq of a batch a writer tried to store and saw fail, if it was stored all
        the same, else None. A store that raised may have committed: the connection lost after
        the server ran it and before its answer came back (an outage, a restart), and the one
        statement of a few log lines commits as soon as it runs. Writing the batch again would
        store every event twice (tests/test_outages.py found a repeated line), so a writer that
        retries asks here first. A batch is stored whole or not at all, in consecutive seqs:
        its first event is looked for after the writer's last stored seq, by its kind and time
        (taken when it was read, to the microsecond) and its content. A rare query, and a range
        of the job's (job, seq) index.

        events: JobEvent instances, or log lines as append_lines takes them."""
        if not events:
            return None
        with transaction.atomic():
            # The job's row first, as a store takes it: a store still running for a connection
            # that was cut (waiting for the row) commits or fails before this reads.
            if not Job.objects.select_for_update().filter(pk=job_id).values_list("pk", flat=True):
                return None
            first = events[0]
            if isinstance(first, JobEvent):
                found = cls.objects.filter(job_id=job_id, seq__gt=after, kind=first.kind, at=first.at)
                for seq, stream, text, rank, data in found.order_by("seq").values_list("seq", "stream", "text", "rank", "data"):
                    if (stream, text, rank) == (first.stream, first.text, first.rank) and same_json(data, first.data):
                        return seq + len(events) - 1
                return None
            stream, at, text = first[:3]
            rank = first[3] if len(first) > 3 else None
            found = cls.objects.filter(job_id=job_id, seq__gt=after, kind="log", at=at, stream=stream, text=text, rank=rank)
            seq = found.order_by("seq").values_list("seq", flat=True).first()
        return None if seq is None else seq + len(events) - 1

    @classmethod
    def _append_in_one_statement(cls, job_id, rows):
        """A store of a few lines on PostgreSQL: the counter's UPDATE and the rows' INSERT as one
        statement (the lines as arrays, unnested in order), atomic on its own; the last seq.
        A runner stores each job's lines about ten times a second, a few at a time: in a
        transaction (BEGIN, the UPDATE, a COPY, COMMIT) that cost four round trips and Django's
        transaction handling, 1.37 ms of CPU for 10 lines (in-process, with Redis's
        announcement), a producer's most in bench/stream_load.py."""
        meta, quote = Job._meta, connection.ops.quote_name
        counter = quote(meta.get_field("last_seq").column)
        job = meta.pk.get_db_prep_value(job_id, connection)
        with connection.cursor() as cursor:
            cursor.execute(
                f"WITH counter AS (UPDATE {quote(meta.db_table)} SET {counter} = {counter} + %s WHERE {quote(meta.pk.column)} = %s RETURNING {counter} AS last) "
                f"INSERT INTO {quote(cls._meta.db_table)} (job_id, seq, at, kind, stream, text, rank) "
                "SELECT %s, counter.last - %s + line.n, line.at, 'log', line.stream, line.text, line.rank FROM counter, "
                "unnest(%s::timestamptz[], %s::varchar[], %s::text[], %s::integer[]) WITH ORDINALITY AS line(at, stream, text, rank, n) "
                "RETURNING seq",
                [
                    len(rows), job, job, len(rows),
                    [row[1] for row in rows], [row[0] for row in rows], [row[2] for row in rows], [row[3] for row in rows],
                ],
            )  # fmt: skip
            stored = cursor.fetchall()
        if not stored:
            raise Job.DoesNotExist(f"no job {job_id}")
        return max(seq for (seq,) in stored)

    def __str__(self):
        return f"{self.job_id} #{self.seq} {self.kind}"


def same_json(stored, sent):
    """Whether JSON read back equals what was sent, as far as JSON keeps it: numbers compare as
    numbers (PostgreSQL's jsonb gives 3.14e18 back as the integer 3140000000000000000, which a
    float of that value does not equal exactly)."""
    if isinstance(sent, dict):
        return isinstance(stored, dict) and stored.keys() == sent.keys() and all(same_json(stored[k], v) for k, v in sent.items())
    if isinstance(sent, (list, tuple)):
        return isinstance(stored, (list, tuple)) and len(stored) == len(sent) and all(map(same_json, stored, sent))
    if isinstance(sent, bool) or isinstance(stored, bool):
        return stored is sent
    if isinstance(sent, float) and isinstance(stored, (int, float)):
        return math.isclose(stored, sent, rel_tol=1e-12) or stored == sent
    return stored == sent


def event_message(seq, kind, at, stream, text, data, rank=None):
    """An event as the websocket sends it (at: a datetime, or its isoformat already)."""
    message = {"seq": seq, "kind": kind, "at": at if isinstance(at, str) else at.isoformat()}
    if kind == "log":
        message["stream"] = stream
        message["text"] = text
        if rank is not None:
            message["rank"] = rank
    else:
        message.update(data or {})
    return message


class Upload(models.Model):
    """A file a user uploaded: kept even when the form it came with is refused, and attached
    to the job once the job is submitted."""

    CODE = "code"
    TRAIN = "train"
    HELDOUT = "heldout"
    MODEL = "model"
    INPUT = "input"  # a file of a named input (channel)
    ROLES = [(CODE, "Code"), (TRAIN, "Training data"), (HELDOUT, "Held-out data"), (MODEL, "Model weights"), (INPUT, "A named input's file")]

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    team = models.ForeignKey("accounts.Team", on_delete=models.CASCADE, related_name="uploads")
    uploaded_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+")
    job = models.ForeignKey(Job, null=True, blank=True, on_delete=models.CASCADE, related_name="uploads")
    role = models.CharField(max_length=10, choices=ROLES)
    channel = models.CharField(max_length=64, blank=True, default="", help_text="the named input a file of role input belongs to")
    name = models.CharField(max_length=255)
    key = models.CharField(max_length=700)
    size = models.PositiveBigIntegerField()
    sha256 = models.CharField(max_length=64)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["created_at", "name"]

    @classmethod
    def purge_unclaimed(cls, older_than):
        """Forget files kept for refused forms that nobody came back for; returns how many.
        Their bytes are shared blobs (another upload or dataset may hold the same), so only
        the rows go here; unreferenced blobs are a matter for a blob sweep."""
        stale = cls.objects.filter(job__isnull=True, created_at__lt=older_than)
        return stale.delete()[0]

    def __str__(self):
        return f"{self.role}: {self.name}"


class Artifact(models.Model):
    """A file the job wrote to its output folder, kept in storage."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="artifacts")
    name = models.CharField(max_length=500)
    key = models.CharField(max_length=700)
    size = models.PositiveBigIntegerField()
    sha256 = models.CharField(max_length=64)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]
        constraints = [models.UniqueConstraint(fields=["job", "name"], name="artifact_name_unique")]

    def __str__(self):
        return f"{self.job_id}: {self.name}"


def input_names(job):
    """The names of a job's named inputs: from datasets (JobInput) and from files (uploads)."""
    from_files = {u.channel for u in job.uploads.all() if u.role == Upload.INPUT and u.channel}
    return sorted({i.name for i in job.inputs.all()} | from_files)


class JobInput(models.Model):
    """A named input of a job besides its training and held-out sets (SageMaker's channels): a
    dataset version staged into $E31_DATA_DIR/<name> and announced as SM_CHANNEL_<NAME>. The
    label (NAME@N) stays when the dataset is deleted later (the version becomes None)."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="inputs")
    name = models.CharField(max_length=64)
    version = models.ForeignKey("catalog.DatasetVersion", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    label = models.CharField(max_length=300)

    class Meta:
        ordering = ["name"]
        constraints = [models.UniqueConstraint(fields=["job", "name"], name="job_input_name_unique")]

    def __str__(self):
        return f"{self.name}: {self.label}"


def unfinished_users(version_ids):
    """The unfinished jobs pinning any of these dataset versions (as a set, a held-out set or a
    named input), as (name, short id, state), oldest first: what deleting a dataset asks
    (catalog.usage; registered in jobs.apps)."""
    pinned = models.Q(train_version__in=version_ids) | models.Q(heldout_version__in=version_ids) | models.Q(inputs__version__in=version_ids)
    pinning = Job.objects.filter(state__in=states.ACTIVE).filter(pinned).distinct().order_by("created_at")
    return [(job.name, job.short_id, job.state) for job in pinning]


class JobModel(models.Model):
    """A model a job starts from (a fine-tuning's "start") or scores (an evaluation's models).

    Its files are pinned when the job is submitted (storage keys of content-addressed blobs,
    with size and SHA-256) and staged with the data, under model/<label>/: the job carries its
    own starting point and depends on nothing the network keeps between runs."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="models")
    label = models.SlugField(max_length=50)
    source_job = models.ForeignKey(Job, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    description = models.CharField(max_length=300, blank=True)
    files = JSONField(default=list, help_text='[{"name", "key", "size", "sha256"}, ...]')

    class Meta:
        ordering = ["id"]
        constraints = [models.UniqueConstraint(fields=["job", "label"], name="job_model_label_unique")]

    def __str__(self):
        return f"{self.label} of {self.job_id}"

    @property
    def size(self):
        return sum(f["size"] for f in self.files)


class Checkpoint(models.Model):
    """A checkpoint the job wrote to its checkpoint folder, uploaded to storage by its runner.

    The latest K (the job's keep_checkpoints) are kept; older ones are deleted from storage
    (pruned_at set, the row stays for the timeline). A restarted job gets the latest back."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="checkpoints")
    allocation = models.ForeignKey("scheduler.Allocation", null=True, blank=True, on_delete=models.SET_NULL, related_name="checkpoints")
    name = models.CharField(max_length=255)
    step = models.BigIntegerField(null=True, blank=True)
    key = models.CharField(max_length=700)
    size = models.PositiveBigIntegerField()
    sha256 = models.CharField(max_length=64)
    written_at = models.DateTimeField(help_text="when the job finished writing it: the work it saves")
    uploaded_at = models.DateTimeField(default=timezone.now)
    pruned_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["written_at", "id"]
        indexes = [models.Index(fields=["job", "pruned_at"])]

    def __str__(self):
        return f"{self.name} of {self.job_id}"


class FolderUpload(models.Model):
    """A folder on its way from the browser to be a job's code (static/js/folder.js), sent so
    that a dropped connection or a reload continues where it stopped: its files are
    catalog.DatasetUploads (folder set, no version; related name `files`), each sent in chunks
    as a dataset's files are, and the job form refers to the folder by id. Once every byte has
    arrived the form packs it into a zip kept as the job's code (an Upload, `packed`), and its
    files' storage is freed (jobs/folder_uploads.py). The sweep of abandoned uploads gives up a
    folder no chunk reached for too long, its clock being the folder's updated_at
    (jobs.folder_uploads.purge_stale_uploads)."""

    OPEN = "open"
    PACKED = "packed"
    ABORTED = "aborted"
    STATES = [(OPEN, "Open"), (PACKED, "Packed"), (ABORTED, "Aborted")]

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    team = models.ForeignKey("accounts.Team", on_delete=models.CASCADE, related_name="folder_uploads")
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    top = models.CharField(max_length=255, blank=True, help_text="the one top folder the paths shared (taken off in the zip)")
    file_count = models.PositiveIntegerField()
    total_bytes = models.PositiveBigIntegerField()
    state = models.CharField(max_length=10, choices=STATES, default=OPEN)
    error = models.TextField(blank=True)
    packed = models.ForeignKey(Upload, null=True, blank=True, on_delete=models.SET_NULL, related_name="+", help_text="the zip, once packed")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True, help_text="when a chunk last arrived: the sweep's clock")

    class Meta:
        ordering = ["created_at"]
        indexes = [models.Index(fields=["state", "updated_at"])]

    def __str__(self):
        return f"folder {self.top or str(self.pk)[:8]} ({self.file_count} files)"
