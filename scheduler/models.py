import uuid
from datetime import timedelta

from django.conf import settings
from django.db import models, transaction
from django.utils import timezone

from billing import meter
from billing.models import Credit, UsageRecord, billing_month, open_month
from core.jsonfield import JSONField


class NodeQuerySet(models.QuerySet):
    def live(self, now=None):
        now = now or timezone.now()
        cutoff = now - timedelta(seconds=settings.E31_NODE_TIMEOUT_SECONDS)
        return self.filter(lost_at__isnull=True, stopped_at__isnull=True, last_heartbeat__gte=cutoff)


class Node(models.Model):
    """A machine whose runner offers devices: GPUs where CUDA is present, CPU slots otherwise."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    name = models.CharField(max_length=200, unique=True)
    hostname = models.CharField(max_length=255, blank=True)
    address = models.CharField(max_length=255, blank=True, help_text="where the other nodes of a gang reach this one (torchrun's rendezvous endpoint)")
    device_type = models.CharField(max_length=100)
    devices = models.PositiveIntegerField()
    registered_at = models.DateTimeField(default=timezone.now)
    last_heartbeat = models.DateTimeField(default=timezone.now)
    lost_at = models.DateTimeField(null=True, blank=True)
    stopped_at = models.DateTimeField(null=True, blank=True)
    # A node of a cluster engine (E31_EXECUTOR=slurm) rather than one our runner registered: the
    # engine reports it (scheduler/executors/bridge.py), its devices held by the engine's other
    # work are not free, and a drained or down one offers nothing.
    executor = models.CharField(max_length=20, blank=True, help_text="the engine that reports this node; blank: our own runner")
    busy_elsewhere = models.PositiveIntegerField(default=0, help_text="devices held by the engine's other users' jobs")
    engine_state = models.CharField(max_length=20, blank=True, help_text="up, drained or down, as the engine reports it")
    engine_reason = models.CharField(max_length=300, blank=True)

    objects = NodeQuerySet.as_manager()

    class Meta:
        ordering = ["name"]

    def __str__(self):
        return self.name

    def used_devices(self):
        used = set()
        for devices in self.allocations.filter(ended_at__isnull=True).values_list("devices", flat=True):
            used.update(devices)
        return used

    @property
    def offered(self):
        """Whether work may be placed here: an engine's node must be up (not drained or down)."""
        return not self.executor or self.engine_state == "up"

    def free_devices(self):
        if not self.offered:
            return ()
        used = self.used_devices()
        free = tuple(d for d in range(self.devices) if d not in used)
        # The engine's other users hold some: which ones is the engine's business (Slurm binds
        # the GPUs it grants), so the last of the free indices stand for them.
        return free[: max(0, len(free) - self.busy_elsewhere)]


class Allocation(models.Model):
    """Compute held for a job: the meter runs from started_at to ended_at."""

    EXITED = "exited"
    CANCELLED = "cancelled"
    LIMIT = "limit"
    NODE_LOST = "node_lost"
    RUNNER_STOPPED = "runner_stopped"
    START_FAILED = "start_failed"
    PREEMPTED = "preempted"
    EARLY_STOP = "early_stop"
    GANG_STOPPED = "gang_stopped"
    # Ends the network is to blame for: time since the last checkpoint is credited.
    NETWORK_FAULTS = (NODE_LOST, RUNNER_STOPPED, PREEMPTED)
    # A gang member stopped because another member ended: what it lost is the other's doing.
    END_REASONS = [
        (EXITED, "Process exited"),
        (CANCELLED, "Cancelled"),
        (LIMIT, "Span or ceiling reached"),
        (NODE_LOST, "Node lost"),
        (RUNNER_STOPPED, "Runner stopped"),
        (START_FAILED, "Could not start"),
        (PREEMPTED, "Preempted"),
        (EARLY_STOP, "Stopped early"),
        (GANG_STOPPED, "Another node of its gang stopped"),
    ]

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    job = models.ForeignKey("jobs.Job", on_delete=models.PROTECT, related_name="allocations")
    node = models.ForeignKey(Node, on_delete=models.PROTECT, related_name="allocations")
    devices = JSONField(help_text="device indices on the node")
    device_type = models.CharField(max_length=100)
    rate = models.DecimalField(max_digits=12, decimal_places=4, help_text="per GPU-hour, in force at started_at")
    limit_seconds = models.PositiveBigIntegerField(null=True, blank=True, help_text="held time the job may use")
    cost_cap = models.DecimalField(max_digits=30, decimal_places=8, null=True, blank=True)
    started_at = models.DateTimeField()
    launched_at = models.DateTimeField(null=True, blank=True)
    ended_at = models.DateTimeField(null=True, blank=True)
    end_reason = models.CharField(max_length=20, choices=END_REASONS, blank=True)
    preemptible = models.BooleanField(default=False)
    preempt_requested_at = models.DateTimeField(null=True, blank=True)
    pid = models.IntegerField(null=True, blank=True, help_text="the job's process (group) on the node")
    # A run across nodes is a gang: one allocation per node, placed and started together, all
    # or nothing; it lives and dies as one.
    gang = models.UUIDField(null=True, blank=True, db_index=True, help_text="shared by the allocations of one gang")
    node_rank = models.PositiveSmallIntegerField(default=0)
    gang_size = models.PositiveSmallIntegerField(default=1)
    rendezvous = models.CharField(max_length=300, blank=True, help_text="host:port of torchrun's c10d rendezvous, set by node 0's runner")
    # On a cluster engine: the engine's handle (Slurm's job id) and, once it ended, the time the
    # engine says it held the compute (accounting), to reconcile the meter with.
    engine_handle = models.CharField(max_length=100, blank=True, db_index=True)
    engine_seconds = models.FloatField(null=True, blank=True, help_text="held time as the engine's accounting reports it")

    class Meta:
        ordering = ["started_at"]
        indexes = [models.Index(fields=["node", "ended_at"])]

    def __str__(self):
        return f"{self.job_id} on {self.node_id} {self.devices}"

    @property
    def gpus(self):
        return len(self.devices)

    def describe(self):
        noun = "device" if self.gpus == 1 else "devices"
        return f"{self.gpus} {self.device_type} {noun} on {self.node.name} ({', '.join(map(str, self.devices))})"

    def meter(self, now=None):
        """(held seconds, amount) so far: live while held, frozen once released."""
        end = self.ended_at or now or timezone.now()
        seconds = meter.held_seconds(self.started_at, end)
        return seconds, meter.charge(self.gpus, seconds, self.rate, cap=self.cost_cap)

    def release(self, at, reason):
        """End the allocation (the meter stops at `at`) and make its usage record final, with
        a credit record of its own for time lost through the network's fault.

        Claimed with a conditional update: if another process (the scheduler declaring the node
        lost, say) released it first, this returns None and writes nothing."""

        at = max(at, self.started_at)
        with transaction.atomic():
            claimed = Allocation.objects.filter(pk=self.pk, ended_at__isnull=True).update(ended_at=at, end_reason=reason)
            if claimed != 1:
                return None
            self.ended_at, self.end_reason = at, reason
            seconds, amount = self.meter()
            final = {"ended_at": at, "held_seconds": seconds, "amount": amount, "provisional": False, "period": open_month(self.job.team_id, at)}
            if UsageRecord.ledger.filter(allocation=self, provisional=True).update(**final):
                usage = UsageRecord.objects.get(allocation=self)
            else:  # an allocation from before provisional records
                usage = UsageRecord.objects.create(
                    team_id=self.job.team_id,
                    job_id=self.job_id,
                    allocation=self,
                    gpu_type=self.device_type,
                    gpus=self.gpus,
                    started_at=self.started_at,
                    rate=self.rate,
                    **final,
                )
            credit_seconds, credit_amount, credit_reason = self.lost_time_credit(amount)
            if credit_seconds:
                Credit.objects.create(
                    team_id=usage.team_id,
                    job_id=self.job_id,
                    usage=usage,
                    seconds=credit_seconds,
                    amount=credit_amount,
                    reason=credit_reason,
                    period=usage.period,
                    created_at=at,
                )
            self.job.record("meter", at=at, data=self.job.meter_event(at))
        return usage

    def open_usage(self):
        """The provisional usage record of an allocation just made: the live meter's record
        until it is released."""

        return UsageRecord.ledger.create(
            team_id=self.job.team_id,
            job_id=self.job_id,
            allocation=self,
            gpu_type=self.device_type,
            gpus=self.gpus,
            started_at=self.started_at,
            ended_at=self.started_at,
            held_seconds=0,
            rate=self.rate,
            amount=0,
            provisional=True,
            period=billing_month(self.started_at),
        )

    @classmethod
    def bring_usage_up_to_date(cls, node_id, now=None):
        """Bring the provisional usage records of a node's running allocations up to `now` (the
        runner's heartbeat does, so the ledger knows what runs costs even between pages)."""

        now = now or timezone.now()
        for allocation in cls.objects.filter(node_id=node_id, ended_at__isnull=True):
            seconds, amount = allocation.meter(now)
            UsageRecord.ledger.filter(allocation=allocation, provisional=True).update(ended_at=now, held_seconds=seconds, amount=amount)

    def lost_time_credit(self, charged):
        """(seconds, amount, why) credited when the network took the compute away: the time
        since the job's last checkpoint uploaded from this allocation."""
        if self.end_reason not in self.NETWORK_FAULTS:
            return 0, 0, ""
        last = self.checkpoints.aggregate(at=models.Max("written_at"))["at"]
        seconds, amount = meter.lost_time_credit(self.gpus, self.rate, self.started_at, self.ended_at, last, charged)
        if not seconds:
            return 0, 0, ""
        since = "its last checkpoint" if last is not None and last > self.started_at else "the allocation began (no checkpoint)"
        return seconds, amount, f"{self.get_end_reason_display().lower()}: time since {since} lost"


class Staging(models.Model):
    """Getting a job's work and data onto a node, as a step of its own.

    The scheduler lines a queued job up for a node; that node's runner stages it while the job
    still waits, so the meter does not run while data moves. A job is placed only where its
    data is staged."""

    WAITING = "waiting"
    STAGING = "staging"
    STAGED = "staged"
    FAILED = "failed"
    ABANDONED = "abandoned"
    STATES = [(WAITING, "Waiting"), (STAGING, "Staging"), (STAGED, "Staged"), (FAILED, "Failed"), (ABANDONED, "Abandoned")]
    LIVE = (WAITING, STAGING, STAGED)

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    job = models.ForeignKey("jobs.Job", on_delete=models.CASCADE, related_name="stagings")
    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="stagings")
    state = models.CharField(max_length=10, choices=STATES, default=WAITING)
    created_at = models.DateTimeField(default=timezone.now)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    files_total = models.PositiveIntegerField(default=0)
    files_done = models.PositiveIntegerField(default=0)
    bytes_total = models.PositiveBigIntegerField(default=0)
    bytes_done = models.PositiveBigIntegerField(default=0)
    bytes_moved = models.PositiveBigIntegerField(default=0, help_text="fetched from storage; the rest came from the node's cache")
    error = models.TextField(blank=True)

    class Meta:
        ordering = ["-created_at"]
        indexes = [models.Index(fields=["node", "state"])]

    def __str__(self):
        return f"staging of {self.job_id} on {self.node_id}: {self.state}"

    @property
    def seconds(self):
        if self.started_at is None:
            return None
        return ((self.finished_at or timezone.now()) - self.started_at).total_seconds()

    def progress(self, live=None):
        """The staging as the job page and the API show it, and as the runner reports it while it
        stages. live: the counts of a staging under way (agent.staging.Progress), newer than
        the row's; the staging is then shown as staging, without an error."""
        counts = self if live is None else live
        seconds = self.seconds
        return {
            "state": self.state if live is None else self.STAGING,
            "node": self.node.name,
            "files_done": counts.files_done,
            "files_total": counts.files_total,
            "bytes_done": counts.bytes_done,
            "bytes_total": counts.bytes_total,
            "bytes_moved": counts.bytes_moved,
            "seconds": round(seconds, 3) if seconds is not None else None,
            "throughput": round(counts.bytes_moved / seconds) if seconds else None,
            "error": self.error if live is None else "",
        }


class CachedBlob(models.Model):
    """A file (by SHA-256) a node holds in its staging cache, so the scheduler can prefer the
    node that already has a job's data."""

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="cached_blobs")
    sha256 = models.CharField(max_length=64)
    size = models.PositiveBigIntegerField()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["node", "sha256"], name="cached_blob_unique_per_node")]

    def __str__(self):
        return f"{self.node_id}: {self.sha256[:12]}"
