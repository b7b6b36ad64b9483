"""Invoices over the database: fetch a team's month in a fixed number of queries, store the
lines, issue with a number taken under a row lock. The figures come from billing.invoices."""

from decimal import Decimal

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Min
from django.urls import reverse
from django.utils import timezone

from accounts import audit
from accounts.models import Team
from billing import invoices, statements
from billing.models import Invoice, InvoiceLine, InvoiceNumber, UsageRecord
from notifications import events as notify
from notifications import policy as notify_policy


class NotInvoiceable(Exception):
    pass


def month_usages(team_id, start, end):
    """(usages, times) of a team's records billed in the month beginning at `start` (released
    in it, or released late into it: see billing.models.open_month): three queries, however
    many records and jobs."""
    rows = list(
        UsageRecord.objects.filter(team_id=team_id, period=start.date())
        .with_credits()
        .order_by("ended_at", "id")
        .values_list(
            "job_id",
            "job__name",
            "job__created_at",
            "gpus",
            "gpu_type",
            "held_seconds",
            "rate",
            "amount",
            "credited_seconds",
            "credited_amount",
            "credited_reason",
        )
    )
    usages = [
        invoices.Usage(
            job_id=str(job_id),
            job_name=name,
            gpus=gpus,
            gpu_type=gpu_type,
            held_seconds=held,
            rate=rate,
            amount=amount,
            credit_seconds=credit_seconds,
            credit_amount=credit_amount,
            credit_reason=credit_reason,
        )
        for job_id, name, _, gpus, gpu_type, held, rate, amount, credit_seconds, credit_amount, credit_reason in rows
    ]
    submitted = {str(row[0]): row[2] for row in rows}
    times = {}
    if rows:
        # Read through the ledger's own relations: each allocation opened a usage record when
        # it started, so a job's first record started with its first allocation; its stagings
        # are reached through its job.
        jobs = UsageRecord.objects.filter(team_id=team_id, period=start.date()).values("job_id")
        first_start = {
            str(job_id): at
            for job_id, at in UsageRecord.ledger.filter(job_id__in=jobs).values("job_id").annotate(at=Min("started_at")).values_list("job_id", "at")
        }
        stagings = {}
        finished = (
            UsageRecord.ledger.filter(job_id__in=jobs, job__stagings__started_at__isnull=False, job__stagings__finished_at__isnull=False)
            .values_list("job_id", "job__stagings__id", "job__stagings__started_at", "job__stagings__finished_at")
            .distinct()
        )
        for job_id, _staging, started, ended in finished:
            stagings.setdefault(str(job_id), []).append((started, ended))
        for job_id, at in submitted.items():
            times[job_id] = invoices.JobTimes(
                queue_seconds=invoices.queue_seconds(at, first_start.get(job_id)),
                staging_seconds=invoices.staging_seconds(stagings.get(job_id, [])),
            )
    return usages, times


def statement(team, year, month):
    """The month so far as a draft document (never stored, never numbered)."""
    start, end = statements.month_bounds(year, month)
    usages, times = month_usages(team.pk, start, end)
    return invoices.Document(team_name=team.name, period_start=start, period_end=end, currency=settings.E31_CURRENCY, lines=invoices.lines(usages, times))


def document(invoice, lines=None):
    """The stored invoice as a document: from its stored rows, never recomputed."""
    lines = invoice.lines.all() if lines is None else lines
    return invoices.Document(
        team_name=invoice.team_name,
        period_start=invoice.period_start,
        period_end=invoice.period_end,
        currency=invoice.currency,
        kind=invoice.kind,
        state=invoice.state,
        number=invoice.number,
        issued_at=invoice.issued_at,
        corrects_number=invoice.corrects.number if invoice.corrects_id else "",
        reason=invoice.reason,
        lines=tuple(
            invoices.Line(
                kind=line.kind,
                job_id=line.job_ref,
                job_name=line.job_name,
                amount=line.amount,
                description=line.description,
                gpu_type=line.gpu_type,
                gpus=line.gpus,
                seconds=line.seconds,
                gpu_seconds=line.gpu_seconds,
                rates=tuple(Decimal(r) for r in line.rates.split()),
            )
            for line in lines
        ),
    )


def _store(invoice, lines):
    doc_lines = tuple(lines)
    probe = invoices.Document(team_name="", period_start=invoice.period_start, period_end=invoice.period_end, currency="", lines=doc_lines)
    invoice.subtotal, invoice.credits, invoice.total = probe.subtotal, probe.credits, probe.total
    invoice.save()
    InvoiceLine.objects.bulk_create(
        InvoiceLine(
            invoice=invoice,
            position=i,
            kind=line.kind,
            job_ref=line.job_id,
            job_name=line.job_name[:200],
            description=line.description[:500],
            gpu_type=line.gpu_type[:300],
            gpus=line.gpus,
            seconds=line.seconds,
            gpu_seconds=line.gpu_seconds,
            rates=line.rates_text[:300],
            amount=line.amount,
        )
        for i, line in enumerate(doc_lines)
    )
    return invoice


def draft(team, year, month):
    """A stored draft invoice of the team's month (its lines as of now)."""
    start, end = statements.month_bounds(year, month)
    usages, times = month_usages(team.pk, start, end)
    invoice = Invoice(team=team, team_name=team.name, period_start=start, period_end=end, currency=settings.E31_CURRENCY)
    return _store(invoice, invoices.lines(usages, times))


def issue(invoice, at=None, actor="system", request=None):
    """Draft -> issued: the next number of the team in the year of issue, taken with the
    counter row locked, in the same transaction as the invoice, so a rollback returns it.
    Audited (invoice.issue) in the same transaction: by the request's user, or by `actor`
    (the management command's name) when there is no request."""
    at = at or timezone.now()
    with transaction.atomic():
        locked = Invoice.objects.select_for_update().get(pk=invoice.pk)
        if locked.state != Invoice.DRAFT:
            raise NotInvoiceable(f"{locked} is already issued.")
        counter, _ = InvoiceNumber.objects.select_for_update().get_or_create(team_id=locked.team_id, year=at.year)
        counter.last += 1
        counter.save(update_fields=["last"])
        locked.state = Invoice.ISSUED
        locked.number_year = at.year
        locked.sequence = counter.last
        locked.number = invoices.number(at.year, counter.last)
        locked.issued_at = at
        locked.save(update_fields=["state", "number_year", "sequence", "number", "issued_at"])
        audit.record(request, "invoice.issue", locked, actor=actor)
        # Told in the same transaction: an issue that rolls back tells nobody.
        notify.emit(
            notify_policy.INVOICE_ISSUED,
            team=locked.team,
            at=at,
            data={
                "invoice": str(locked.pk),
                "number": locked.number,
                "title": locked.get_kind_display(),
                "period": f"{locked.period_start:%Y-%m}",
                "total": locked.total,
                "currency": locked.currency,
                "url": notify.site_url(reverse("billing:invoice", args=[locked.pk])),
            },
        )
    return locked


def invoice_team_month(team, year, month, now=None, actor="system"):
    """Draft and issue the team's invoice of the month, in one transaction; None when it
    already has one."""
    now = now or timezone.now()
    start, end = statements.month_bounds(year, month)
    if end > now:
        raise NotInvoiceable(f"{year:04d}-{month:02d} is not over yet: its figures so far are a statement.")
    try:
        with transaction.atomic():
            if Invoice.objects.filter(team=team, kind=Invoice.INVOICE, period_start=start).exists():
                return None
            return issue(draft(team, year, month), at=now, actor=actor)
    except IntegrityError:
        # Another issuer invoiced the team's month meanwhile (one invoice per team and month
        # is a constraint of the table): nothing was written here.
        if Invoice.objects.filter(team=team, kind=Invoice.INVOICE, period_start=start).exists():
            return None
        raise


def invoice_month(year, month, now=None, on_invoice=None, actor="system"):
    """Invoice every team with usage in the month that has no invoice for it yet. Returns the
    new invoices. Idempotent: a team already invoiced for the month is skipped."""
    now = now or timezone.now()
    start, end = statements.month_bounds(year, month)
    if end > now:
        raise NotInvoiceable(f"{year:04d}-{month:02d} is not over yet: its figures so far are a statement.")
    done = Invoice.objects.filter(kind=Invoice.INVOICE, period_start=start).values("team_id")
    team_ids = UsageRecord.objects.filter(period=start.date()).exclude(team_id__in=done).values("team_id").distinct()
    made = []
    for team in Team.objects.filter(pk__in=team_ids).order_by("name"):
        invoice = invoice_team_month(team, year, month, now=now, actor=actor)
        if invoice is not None:
            made.append(invoice)
            if on_invoice is not None:
                on_invoice(invoice)
    return made


def credit_note(original, reason, at=None, actor="system"):
    """Issue a credit note reversing an issued invoice (its billed lines negated)."""
    if original.kind != Invoice.INVOICE or original.state != Invoice.ISSUED:
        raise NotInvoiceable("Only an issued invoice can be corrected by a credit note.")
    if not reason:
        raise NotInvoiceable("A credit note needs a reason.")
    with transaction.atomic():
        Invoice.objects.select_for_update().get(pk=original.pk)  # one correction at a time
        earlier = original.credit_notes.first()
        if earlier is not None:
            raise NotInvoiceable(f"Invoice {original.number} is already reversed by credit note {earlier.number or '(draft)'}.")
        note = Invoice(
            team_id=original.team_id,
            team_name=original.team_name,
            kind=Invoice.CREDIT_NOTE,
            period_start=original.period_start,
            period_end=original.period_end,
            currency=original.currency,
            corrects=original,
            reason=reason[:500],
        )
        _store(note, invoices.credit_note_lines(document(original).lines, reason))
        return issue(note, at=at, actor=actor)
