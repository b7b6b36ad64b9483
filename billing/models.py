import uuid

from django.db import models
from django.utils import timezone

from billing import meter


class NoRateInForce(Exception):
    def __init__(self, gpu_type):
        self.gpu_type = gpu_type
        kind = f"{gpu_type} devices" if gpu_type else "this request"
        super().__init__(f"No rate is in force for {kind}: an operator has to set one before jobs can be submitted.")


class RateQuerySet(models.QuerySet):
    def in_force(self, gpu_type, at=None):
        """The rate for gpu_type at a moment: its own rate if it has one, else the any-type rate."""
        at = at or timezone.now()
        current = self.filter(effective_from__lte=at).order_by("-effective_from", "-id")
        for candidate in (gpu_type, ""):
            rate = current.filter(gpu_type=candidate).first()
            if rate is not None:
                return rate
        raise NoRateInForce(gpu_type)

    def worst_case(self, at=None, preemptible=False):
        """The highest rate in force over all GPU types (for requests that take any type)."""
        at = at or timezone.now()
        types = set(self.filter(effective_from__lte=at).values_list("gpu_type", flat=True))
        rates = [self.in_force(t, at) for t in types]
        if not rates:
            raise NoRateInForce("")
        return max(rates, key=lambda r: r.for_job(preemptible))


class Rate(models.Model):
    """A price per GPU-hour, set by an operator. A new rate never changes a past bill:
    an allocation keeps the rate in force when it started."""

    gpu_type = models.CharField(
        max_length=100, blank=True, help_text="Device type as runners report it (e.g. 'cpu', 'NVIDIA H100'); blank: any type without a rate of its own."
    )
    per_gpu_hour = models.DecimalField(max_digits=12, decimal_places=4)
    preemptible_per_gpu_hour = models.DecimalField(
        max_digits=12, decimal_places=4, null=True, blank=True,
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


class UsageRecord(models.Model):
    """One per allocation, written when it is released. Append-only."""

    team = models.ForeignKey("accounts.Team", on_delete=models.PROTECT, related_name="usage")
    job = models.ForeignKey("jobs.Job", on_delete=models.PROTECT, related_name="usage")
    allocation = models.OneToOneField("scheduler.Allocation", on_delete=models.PROTECT, related_name="usage")
    gpu_type = models.CharField(max_length=100)
    gpus = models.PositiveIntegerField()
    started_at = models.DateTimeField()
    ended_at = models.DateTimeField()
    held_seconds = models.PositiveBigIntegerField()
    rate = models.DecimalField(max_digits=12, decimal_places=4)
    amount = models.DecimalField(max_digits=30, decimal_places=8)
    # Time lost through the network's fault (node lost, preempted) since the job's last
    # checkpoint: recorded against the usage, not billed.
    credit_seconds = models.PositiveBigIntegerField(default=0)
    credit_amount = models.DecimalField(max_digits=30, decimal_places=8, default=0)
    credit_reason = models.CharField(max_length=300, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["ended_at", "id"]
        indexes = [models.Index(fields=["team", "ended_at"])]

    @property
    def held_hours(self):
        return self.held_seconds / 3600

    @property
    def billed(self):
        return self.amount - self.credit_amount

    @property
    def amount_rounded(self):
        return meter.round_money(self.amount)


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
            models.UniqueConstraint(
                fields=["team", "period_start"], condition=models.Q(kind="invoice"), name="one_invoice_per_team_and_month"
            ),
            models.UniqueConstraint(
                fields=["team", "number_year", "sequence"], condition=models.Q(sequence__isnull=False), name="invoice_number_unique"
            ),
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

    @property
    def is_issued(self):
        return self.state == self.ISSUED

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
