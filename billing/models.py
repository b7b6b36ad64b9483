import uuid
from datetime import UTC, date, datetime
from decimal import Decimal

from django.db import models
from django.db.models import OuterRef, Subquery, Sum, Value
from django.db.models.functions import Coalesce
from django.utils import timezone

from core.compiled import Param, Read


class NoRateInForce(Exception):
    def __init__(self, gpu_type):
        self.gpu_type = gpu_type
        kind = f"{gpu_type} devices" if gpu_type else "this request"
        super().__init__(f"No rate is in force for {kind}: an operator has to set one before jobs can be submitted.")


# Every submission asks for a rate: their SQL made once (core.compiled), used where the rates
# asked of are all of them (Rate.objects, not a filtered queryset).
RATE_OF_TYPE = Read(
    lambda: Rate.objects.filter(effective_from__lte=Param("at", models.DateTimeField()), gpu_type=Param("gpu_type", models.CharField())).order_by(
        "-effective_from", "-id"
    )[:1]
)
RATES_SINCE = Read(lambda: Rate.objects.filter(effective_from__lte=Param("at", models.DateTimeField())).order_by("-effective_from", "-id"))


class RateQuerySet(models.QuerySet):
    def in_force(self, gpu_type, at=None):
        """The rate for gpu_type at a moment: its own rate if it has one, else the any-type rate."""
        at = at or timezone.now()
        current = self.filter(effective_from__lte=at).order_by("-effective_from", "-id")
        for candidate in (gpu_type, ""):
            rate = current.filter(gpu_type=candidate).first() if self.query.has_filters() else RATE_OF_TYPE.first(at=at, gpu_type=candidate)
            if rate is not None:
                return rate
        raise NoRateInForce(gpu_type)

    def worst_case(self, at=None, preemptible=False):
        """The highest rate in force over all GPU types (for requests that take any type): the
        latest of each type, read in one query (every submission that names no type asks)."""
        at = at or timezone.now()
        latest = {}
        for rate in self.filter(effective_from__lte=at).order_by("-effective_from", "-id") if self.query.has_filters() else RATES_SINCE(at=at):
            latest.setdefault(rate.gpu_type, rate)
        if not latest:
            raise NoRateInForce("")
        return max(latest.values(), key=lambda r: r.for_job(preemptible))


class Rate(models.Model):
    """A price per GPU-hour, set by an operator. A new rate never changes a past bill:
    an allocation keeps the rate in force when it started."""

    gpu_type = models.CharField(
        max_length=100, blank=True, help_text="Device type as runners report it (e.g. 'cpu', 'NVIDIA H100'); blank: any type without a rate of its own."
    )
    per_gpu_hour = models.DecimalField(max_digits=12, decimal_places=4)
    preemptible_per_gpu_hour = models.DecimalField(
        max_digits=12,
        decimal_places=4,
        null=True,
        blank=True,
        help_text="The discounted rate of preemptible jobs; blank: the same as the rate.",
    )
    effective_from = models.DateTimeField(default=timezone.now)
    created_at = models.DateTimeField(auto_now_add=True)

    objects = RateQuerySet.as_manager()

    class Meta:
        ordering = ["gpu_type", "-effective_from"]
        constraints = [
            models.CheckConstraint(condition=models.Q(per_gpu_hour__gt=0), name="rate_positive"),
            models.CheckConstraint(
                condition=models.Q(preemptible_per_gpu_hour__isnull=True) | models.Q(preemptible_per_gpu_hour__gt=0),
                name="preemptible_rate_positive",
            ),
        ]

    def for_job(self, preemptible):
        """The rate a job pays: the preemptible rate where it has one."""
        if preemptible and self.preemptible_per_gpu_hour is not None:
            return self.preemptible_per_gpu_hour
        return self.per_gpu_hour

    def __str__(self):
        return f"{self.gpu_type or 'any type'}: {self.per_gpu_hour}/GPU-hour from {self.effective_from:%Y-%m-%d %H:%M}"


class LedgerImmutable(Exception):
    """A final usage record and a credit are never changed nor deleted: the ledger is append-only."""


def billing_month(at):
    """The first day of the calendar month (UTC) a moment falls in: the month it is billed in,
    unless that month is invoiced already."""
    utc = at.astimezone(UTC)
    return date(utc.year, utc.month, 1)


def open_month(team_id, at):
    """The month usage ending at `at` is billed in: its own month, or where the team's invoice
    for that month was already issued (usage released late, a lost node's say), the first month
    after it that has no invoice yet. Nothing held is ever left off a bill."""
    month = billing_month(at)
    invoiced = set(
        Invoice.objects.filter(team_id=team_id, kind=Invoice.INVOICE, period_start__gte=datetime(month.year, month.month, 1, tzinfo=UTC)).values_list(
            "period_start", flat=True
        )
    )
    invoiced = {billing_month(p) for p in invoiced}
    while month in invoiced:
        month = date(month.year + month.month // 12, month.month % 12 + 1, 1)
    return month


class UsageQuerySet(models.QuerySet):
    def with_credits(self):
        """Annotate credited_seconds, credited_amount and credited_reason (the first reason)
        from each record's credits, for value lists."""
        mine = Credit.objects.filter(usage=OuterRef("pk")).order_by().values("usage")
        return self.annotate(
            credited_seconds=Coalesce(Subquery(mine.annotate(s=Sum("seconds")).values("s")), Value(0)),
            credited_amount=Coalesce(
                Subquery(mine.annotate(a=Sum("amount")).values("a")), Value(Decimal(0)), output_field=models.DecimalField(max_digits=30, decimal_places=8)
            ),
            credited_reason=Coalesce(
                Subquery(Credit.objects.filter(usage=OuterRef("pk")).order_by("id").values("reason")[:1]),
                Value(""),
                output_field=models.CharField(),
            ),
        )

    def update(self, **kwargs):
        if self.filter(provisional=False).exists():
            raise LedgerImmutable("A final usage record cannot be changed.")
        return super().update(**kwargs)

    def delete(self):
        if self.filter(provisional=False).exists():
            raise LedgerImmutable("A final usage record cannot be deleted.")
        return super().delete()


class FinalUsageManager(models.Manager.from_queryset(UsageQuerySet)):
    """The ledger as billed: final records only (provisional ones are the live meter's)."""

    def get_queryset(self):
        return super().get_queryset().filter(provisional=False)


class UsageRecord(models.Model):
    """One per allocation segment. Append-only.

    Written provisionally when the allocation starts and brought up to date by its runner's
    heartbeat while it runs (the live meter's record, never billed), and made final when it is
    released: from then on it never changes. The rate is the one in force when the segment
    started, for all of it: a rate change while a job runs splits nothing."""

    team = models.ForeignKey("accounts.Team", on_delete=models.PROTECT, related_name="usage")
    job = models.ForeignKey("jobs.Job", on_delete=models.PROTECT, related_name="usage")
    allocation = models.OneToOneField("scheduler.Allocation", on_delete=models.PROTECT, related_name="usage")
    gpu_type = models.CharField(max_length=100)
    gpus = models.PositiveIntegerField()
    started_at = models.DateTimeField()
    ended_at = models.DateTimeField(help_text="when the segment ended; while provisional, when it was last brought up to date")
    held_seconds = models.PositiveBigIntegerField()
    rate = models.DecimalField(max_digits=12, decimal_places=4)
    amount = models.DecimalField(max_digits=30, decimal_places=8)
    provisional = models.BooleanField(default=False, help_text="still running: the live meter's figure, not billed")
    period = models.DateField(help_text="the month (its first day, UTC) the record is billed in")
    created_at = models.DateTimeField(auto_now_add=True)

    objects = FinalUsageManager()
    ledger = UsageQuerySet.as_manager()  # provisional records included

    class Meta:
        base_manager_name = "ledger"
        ordering = ["ended_at", "id"]
        indexes = [models.Index(fields=["team", "period"]), models.Index(fields=["team", "ended_at"])]

    def save(self, *args, **kwargs):
        if self.pk is not None and not self._state.adding and UsageRecord.ledger.filter(pk=self.pk, provisional=False).exists():
            raise LedgerImmutable(f"The usage record of {self.job_id} is final: it cannot be changed.")
        if self.period is None:
            self.period = billing_month(self.ended_at)
        super().save(*args, **kwargs)

    def delete(self, *args, **kwargs):
        if not self.provisional:
            raise LedgerImmutable(f"The usage record of {self.job_id} is final: it cannot be deleted.")
        return super().delete(*args, **kwargs)

    @property
    def held_hours(self):
        return self.held_seconds / 3600

    def _credits(self):
        return list(self.credits.all())

    @property
    def credit_seconds(self):
        return sum(c.seconds for c in self._credits())

    @property
    def credit_amount(self):
        return sum((c.amount for c in self._credits()), Decimal(0))

    @property
    def credit_reason(self):
        return "; ".join(dict.fromkeys(c.reason for c in self._credits() if c.reason))

    @property
    def billed(self):
        return self.amount - self.credit_amount

    def __str__(self):
        return f"{self.job_id} {self.gpus}x{self.gpu_type or 'device'} {self.held_seconds}s{' (provisional)' if self.provisional else ''}"


class CreditQuerySet(models.QuerySet):
    def update(self, **kwargs):
        raise LedgerImmutable("A credit cannot be changed.")

    def delete(self):
        raise LedgerImmutable("A credit cannot be deleted.")


class Credit(models.Model):
    """Held time given back: time lost through the network's fault (a node lost, a runner
    stopped, a preemption) since the job's last checkpoint. A ledger record of its own,
    append-only, against the usage record of the segment it was lost in; billed in the same
    month, as a line of its own."""

    team = models.ForeignKey("accounts.Team", on_delete=models.PROTECT, related_name="credits")
    job = models.ForeignKey("jobs.Job", on_delete=models.PROTECT, related_name="credits")
    usage = models.ForeignKey(UsageRecord, on_delete=models.PROTECT, related_name="credits")
    seconds = models.PositiveBigIntegerField()
    amount = models.DecimalField(max_digits=30, decimal_places=8)
    reason = models.CharField(max_length=300)
    period = models.DateField(help_text="the month (its first day, UTC) the credit is billed in")
    created_at = models.DateTimeField(default=timezone.now)

    objects = CreditQuerySet.as_manager()

    class Meta:
        ordering = ["created_at", "id"]
        indexes = [models.Index(fields=["team", "period"])]
        constraints = [models.CheckConstraint(condition=models.Q(amount__gte=0), name="credit_not_negative")]

    def save(self, *args, **kwargs):
        if self.pk is not None and not self._state.adding:
            raise LedgerImmutable("A credit cannot be changed.")
        if self.period is None:
            self.period = self.usage.period
        super().save(*args, **kwargs)

    def delete(self, *args, **kwargs):
        raise LedgerImmutable("A credit cannot be deleted.")

    def __str__(self):
        return f"credit of {self.seconds} s for {self.job_id}: {self.reason}"


class InvoiceImmutable(Exception):
    """An issued invoice (and each of its lines) is never changed nor deleted: a correction is
    a credit note, a new document of its own."""


class InvoiceQuerySet(models.QuerySet):
    def issued(self):
        return self.filter(state=Invoice.ISSUED)

    def update(self, **kwargs):
        if self.filter(state=Invoice.ISSUED).exists():
            raise InvoiceImmutable("An issued invoice cannot be changed.")
        return super().update(**kwargs)

    def delete(self):
        if self.filter(state=Invoice.ISSUED).exists():
            raise InvoiceImmutable("An issued invoice cannot be deleted.")
        return super().delete()


class Invoice(models.Model):
    """One per team per calendar month (kind invoice), or a credit note correcting one.

    Draft -> issued. The number (YEAR-NNNN, without gaps per team and year of issue, invoices
    and credit notes alike) is taken when it is issued; from then on neither the invoice nor
    its lines change: save() and delete() raise InvoiceImmutable."""

    DRAFT = "draft"
    ISSUED = "issued"
    STATES = [(DRAFT, "Draft"), (ISSUED, "Issued")]
    INVOICE = "invoice"
    CREDIT_NOTE = "credit_note"
    KINDS = [(INVOICE, "Invoice"), (CREDIT_NOTE, "Credit note")]

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    team = models.ForeignKey("accounts.Team", on_delete=models.PROTECT, related_name="invoices")
    team_name = models.CharField(max_length=100, help_text="the team's name when the invoice was made")
    kind = models.CharField(max_length=12, choices=KINDS, default=INVOICE)
    state = models.CharField(max_length=10, choices=STATES, default=DRAFT)
    period_start = models.DateTimeField()
    period_end = models.DateTimeField()
    number = models.CharField(max_length=20, blank=True)
    number_year = models.PositiveIntegerField(null=True, blank=True)
    sequence = models.PositiveIntegerField(null=True, blank=True)
    issued_at = models.DateTimeField(null=True, blank=True)
    currency = models.CharField(max_length=10)
    subtotal = models.DecimalField(max_digits=18, decimal_places=2, default=0)
    credits = models.DecimalField(max_digits=18, decimal_places=2, default=0)
    total = models.DecimalField(max_digits=18, decimal_places=2, default=0)
    corrects = models.ForeignKey("self", null=True, blank=True, on_delete=models.PROTECT, related_name="credit_notes")
    reason = models.CharField(max_length=500, blank=True, help_text="why a credit note was issued")
    created_at = models.DateTimeField(default=timezone.now)

    objects = InvoiceQuerySet.as_manager()

    class Meta:
        ordering = ["-period_start", "-issued_at", "-created_at"]
        constraints = [
            models.UniqueConstraint(fields=["team", "period_start"], condition=models.Q(kind="invoice"), name="one_invoice_per_team_and_month"),
            models.UniqueConstraint(fields=["team", "number_year", "sequence"], condition=models.Q(sequence__isnull=False), name="invoice_number_unique"),
            models.CheckConstraint(
                condition=models.Q(state="draft", sequence__isnull=True, issued_at__isnull=True)
                | models.Q(state="issued", sequence__isnull=False, issued_at__isnull=False),
                name="issued_invoices_are_numbered",
            ),
            models.CheckConstraint(
                condition=models.Q(kind="invoice", corrects__isnull=True) | models.Q(kind="credit_note", corrects__isnull=False),
                name="credit_notes_correct_an_invoice",
            ),
        ]
        indexes = [models.Index(fields=["team", "-period_start"])]

    def __str__(self):
        return f"{self.get_kind_display()} {self.number or '(draft)'} for {self.team_name}, {self.period_start:%Y-%m}"

    @property
    def month(self):
        return f"{self.period_start:%Y-%m}"

    def _stored_issued(self):
        return self.pk is not None and not self._state.adding and type(self).objects.filter(pk=self.pk, state=self.ISSUED).exists()

    def save(self, *args, **kwargs):
        if self._stored_issued():
            raise InvoiceImmutable(f"{self} is issued: it cannot be changed; issue a credit note instead.")
        super().save(*args, **kwargs)

    def delete(self, *args, **kwargs):
        if self.state == self.ISSUED or self._stored_issued():
            raise InvoiceImmutable(f"{self} is issued: it cannot be deleted; issue a credit note instead.")
        return super().delete(*args, **kwargs)


class InvoiceNumber(models.Model):
    """The last number taken per team and year: locked (SELECT ... FOR UPDATE) while an
    invoice is issued, so two issuers never take the same number, and rolled back with it."""

    team = models.ForeignKey("accounts.Team", on_delete=models.CASCADE, related_name="+")
    year = models.PositiveIntegerField()
    last = models.PositiveIntegerField(default=0)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["team", "year"], name="one_invoice_counter_per_team_and_year")]

    def __str__(self):
        return f"{self.team_id}/{self.year}: {self.last}"


class InvoiceLineQuerySet(models.QuerySet):
    def _touches_issued(self):
        return self.filter(invoice__state=Invoice.ISSUED).exists()

    def update(self, **kwargs):
        if self._touches_issued():
            raise InvoiceImmutable("The lines of an issued invoice cannot be changed.")
        return super().update(**kwargs)

    def delete(self):
        if self._touches_issued():
            raise InvoiceImmutable("The lines of an issued invoice cannot be deleted.")
        return super().delete()

    def bulk_create(self, objs, *args, **kwargs):
        objs = list(objs)
        ids = {line.invoice_id for line in objs}
        if ids and Invoice.objects.filter(pk__in=ids, state=Invoice.ISSUED).exists():
            raise InvoiceImmutable("Lines cannot be added to an issued invoice.")
        return super().bulk_create(objs, *args, **kwargs)


class InvoiceLine(models.Model):
    """A line as it was issued: what the PDF and the CSV show, never recomputed."""

    USAGE = "usage"
    CREDIT = "credit"
    QUEUE = "queue"
    STAGING = "staging"
    KINDS = [(USAGE, "Compute held"), (CREDIT, "Credit"), (QUEUE, "Queue time (not billed)"), (STAGING, "Staging time (not billed)")]

    invoice = models.ForeignKey(Invoice, on_delete=models.CASCADE, related_name="lines")
    position = models.PositiveIntegerField()
    kind = models.CharField(max_length=10, choices=KINDS)
    job_ref = models.CharField(max_length=36, help_text="the job's id")
    job_name = models.CharField(max_length=200)
    description = models.CharField(max_length=500, blank=True)
    gpu_type = models.CharField(max_length=300, blank=True)
    gpus = models.PositiveIntegerField(default=0)
    seconds = models.PositiveBigIntegerField(default=0, help_text="held, credited, queued or staging seconds")
    gpu_seconds = models.PositiveBigIntegerField(default=0)
    rates = models.CharField(max_length=300, blank=True, help_text="the rates per GPU-hour, space separated")
    amount = models.DecimalField(max_digits=18, decimal_places=2)

    objects = InvoiceLineQuerySet.as_manager()

    class Meta:
        ordering = ["invoice", "position"]
        constraints = [models.UniqueConstraint(fields=["invoice", "position"], name="invoice_line_position_unique")]

    def _invoice_issued(self):
        return Invoice.objects.filter(pk=self.invoice_id, state=Invoice.ISSUED).exists()

    def save(self, *args, **kwargs):
        if self._invoice_issued():
            raise InvoiceImmutable("The lines of an issued invoice cannot be changed.")
        super().save(*args, **kwargs)

    def delete(self, *args, **kwargs):
        if self._invoice_issued():
            raise InvoiceImmutable("The lines of an issued invoice cannot be deleted.")
        return super().delete(*args, **kwargs)

    def __str__(self):
        return f"{self.invoice_id} #{self.position}: {self.kind} {self.job_name} {self.amount}"
