import uuid
from decimal import Decimal

from django.conf import settings
from django.db import connection, models, transaction
from django.db.models import F
from django.utils import timezone

from billing import meter
from jobs import live, states


class Dataset(models.Model):
    """A team's named set of files, staged into a job's data folder."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    team = models.ForeignKey("accounts.Team", on_delete=models.CASCADE, related_name="datasets")
    name = models.CharField(max_length=200)
    description = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]
        constraints = [models.UniqueConstraint(fields=["team", "name"], name="dataset_name_unique_in_team")]

    def __str__(self):
        return self.name

    @property
    def total_bytes(self):
        return sum(f.size for f in self.files.all())


class DatasetFile(models.Model):
    dataset = models.ForeignKey(Dataset, on_delete=models.CASCADE, related_name="files")
    path = models.CharField(max_length=500)
    key = models.CharField(max_length=700)
    size = models.PositiveBigIntegerField()
    sha256 = models.CharField(max_length=64)

    class Meta:
        ordering = ["path"]
        constraints = [models.UniqueConstraint(fields=["dataset", "path"], name="dataset_file_path_unique")]


class Job(models.Model):
    KIND_TRAIN = "train"
    KINDS = [(KIND_TRAIN, "Train")]

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    team = models.ForeignKey("accounts.Team", on_delete=models.PROTECT, related_name="jobs")
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="jobs")
    name = models.CharField(max_length=200)
    kind = models.CharField(max_length=20, choices=KINDS, default=KIND_TRAIN)
    state = models.CharField(max_length=20, choices=states.CHOICES, default=states.QUEUED)
    created_at = models.DateTimeField(default=timezone.now)
    finished_at = models.DateTimeField(null=True, blank=True)

    # Work
    entrypoint = models.CharField(max_length=500)
    args = models.JSONField(default=list, blank=True)
    config = models.JSONField(default=dict, blank=True)
    env = models.JSONField(default=dict, blank=True)

    # Data
    train_dataset = models.ForeignKey(Dataset, null=True, blank=True, on_delete=models.PROTECT, related_name="+")
    heldout_dataset = models.ForeignKey(Dataset, null=True, blank=True, on_delete=models.PROTECT, related_name="+")

    # Request
    gpus = models.PositiveIntegerField()
    gpu_type = models.CharField(max_length=100, blank=True, help_text="blank: any type")
    span_hours = models.DecimalField(max_digits=10, decimal_places=4, null=True, blank=True)
    ceiling_amount = models.DecimalField(max_digits=14, decimal_places=2, null=True, blank=True)
    ceiling_gpu_hours = models.DecimalField(max_digits=16, decimal_places=4, null=True, blank=True)
    not_before = models.DateTimeField(null=True, blank=True)
    deadline = models.DateTimeField(null=True, blank=True)

    # Run
    cancel_requested_at = models.DateTimeField(null=True, blank=True)
    wait_reason = models.CharField(max_length=300, blank=True)
    exit_code = models.IntegerField(null=True, blank=True)
    reason = models.CharField(max_length=500, blank=True, help_text="why the job ended as it did")
    restarts = models.PositiveIntegerField(default=0)
    last_seq = models.PositiveBigIntegerField(default=0)

    class Meta:
        ordering = ["-created_at"]
        indexes = [models.Index(fields=["team", "-created_at"]), models.Index(fields=["state", "created_at"])]

    def __str__(self):
        return f"{self.name} ({self.short_id})"

    @property
    def short_id(self):
        return str(self.id)[:8]

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
        self.refresh_from_db()
        return self

    def start(self, allocation):
        """Compute is held: the allocation exists and the meter runs from its started_at."""
        return self._transition(
            states.STARTING, at=allocation.started_at, reason=f"held {allocation.describe()}", wait_reason=""
        )

    def mark_running(self):
        return self._transition(states.RUNNING, reason="process started")

    def finish(self, state, *, reason="", exit_code=None, at=None):
        return self._transition(state, reason=reason, exit_code=exit_code, at=at)

    def requeue(self, reason, at=None):
        """Back to the queue after the network lost its compute (node lost, runner stopped)."""
        if self.cancel_requested_at is not None:
            return self._transition(states.CANCELLED, reason="cancelled while its node was lost", at=at)
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
        return self.events.filter(kind="state").order_by("seq")

    def latest_allocation(self):
        return self.allocations.select_related("node").order_by("-started_at").first()

    def held(self, now=None, allocations=None):
        """(held seconds, amount so far) over all the job's allocations, live for an open one."""
        now = now or timezone.now()
        seconds, amount = 0, Decimal(0)
        for allocation in self.allocations.all() if allocations is None else allocations:
            s, a = allocation.meter(now)
            seconds += s
            amount += a
        return seconds, amount

    def meter_event(self, now=None):
        """The meter as the job page shows it: totals over all allocations, and whether it runs."""
        now = now or timezone.now()
        allocations = list(self.allocations.all())
        seconds, amount = self.held(now, allocations)
        current = next((a for a in allocations if a.ended_at is None), allocations[-1] if allocations else None)
        return {
            "held_seconds": seconds,
            "amount": f"{amount:f}",
            "gpus": current.gpus if current else self.gpus,
            "rate": str(current.rate) if current else None,
            "currency": settings.E31_CURRENCY,
            "running": any(a.ended_at is None for a in allocations),
        }


class JobEvent(models.Model):
    """A log line, state change, meter tick or notice: stored first, then announced."""

    KINDS = [("log", "Log line"), ("state", "State change"), ("meter", "Meter tick"), ("notice", "Notice")]

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="events")
    seq = models.PositiveBigIntegerField()
    at = models.DateTimeField()
    kind = models.CharField(max_length=10, choices=KINDS)
    stream = models.CharField(max_length=10, blank=True)
    text = models.TextField(blank=True)
    data = models.JSONField(null=True, blank=True)

    class Meta:
        ordering = ["job", "seq"]
        constraints = [models.UniqueConstraint(fields=["job", "seq"], name="job_event_seq_unique")]

    MESSAGE_FIELDS = ("seq", "kind", "at", "stream", "text", "data")

    @staticmethod
    def _reserve(job_id, count):
        """The first of count new sequence numbers for the job (call inside a transaction).

        The counter lives on the job row: the UPDATE locks it until commit, so two writers for
        one job (runner, scheduler, web) take turns and sequence order is commit order."""
        Job.objects.filter(pk=job_id).update(last_seq=F("last_seq") + count)
        return Job.objects.filter(pk=job_id).values_list("last_seq", flat=True).get() - count + 1

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
    def append_lines(cls, job_id, lines):
        """append() for log lines given as (stream, at, text), the runner's hot path: plain rows
        in one statement (COPY on PostgreSQL), no model instances. Measured by
        bench/log_throughput.py: about 4x the lines per second of bulk_create."""
        if not lines:
            return None
        table = cls._meta.db_table
        columns = "job_id, seq, at, kind, stream, text"
        with transaction.atomic():
            first = cls._reserve(job_id, len(lines))
            with connection.cursor() as cursor:
                if connection.vendor == "postgresql":
                    with cursor.cursor.copy(f"COPY {table} ({columns}) FROM STDIN") as copy:
                        for offset, (stream, at, text) in enumerate(lines):
                            copy.write_row((job_id, first + offset, at, "log", stream, text))
                else:
                    job_value = cls._meta.get_field("job").get_db_prep_value(job_id, connection)
                    adapt = connection.ops.adapt_datetimefield_value
                    cursor.executemany(
                        f"INSERT INTO {table} ({columns}) VALUES (%s, %s, %s, %s, %s, %s)",
                        [(job_value, first + i, adapt(at), "log", stream, text) for i, (stream, at, text) in enumerate(lines)],
                    )
            last = first + len(lines) - 1
            transaction.on_commit(lambda: live.announce(job_id, last))
        return last



def event_message(seq, kind, at, stream, text, data):
    """An event as the websocket sends it."""
    message = {"seq": seq, "kind": kind, "at": at.isoformat()}
    if kind == "log":
        message["stream"] = stream
        message["text"] = text
    else:
        message.update(data or {})
    return message


class Upload(models.Model):
    """A file a user uploaded: kept even when the form it came with is refused, and attached
    to the job once the job is submitted."""

    CODE = "code"
    TRAIN = "train"
    HELDOUT = "heldout"
    ROLES = [(CODE, "Code"), (TRAIN, "Training data"), (HELDOUT, "Held-out data")]

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    team = models.ForeignKey("accounts.Team", on_delete=models.CASCADE, related_name="uploads")
    uploaded_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+")
    job = models.ForeignKey(Job, null=True, blank=True, on_delete=models.CASCADE, related_name="uploads")
    role = models.CharField(max_length=10, choices=ROLES)
    name = models.CharField(max_length=255)
    key = models.CharField(max_length=700)
    size = models.PositiveBigIntegerField()
    sha256 = models.CharField(max_length=64)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["created_at", "name"]

    @classmethod
    def purge_unclaimed(cls, older_than):
        """Delete files kept for refused forms that nobody came back for; returns how many."""
        from e31web.storage import get_storage

        storage = get_storage()
        stale = list(cls.objects.filter(job__isnull=True, created_at__lt=older_than))
        for upload in stale:
            storage.delete(upload.key)
        cls.objects.filter(pk__in=[u.pk for u in stale]).delete()
        return len(stale)


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
