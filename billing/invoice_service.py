"""Invoices over the database: fetch the teams' month in a fixed number of queries, store the
lines, issue with numbers taken under row locks. The figures come from billing.invoices.

A month's invoices are issued in chunks of teams, each in one transaction and a fixed number
of queries however many teams and records it holds; one team's invoice, a draft and a credit
note go through the same code, with one team or one invoice."""

from decimal import Decimal

from django.conf import settings
from django.db import IntegrityError, connection, transaction
from django.db.models import F, Min
from django.urls import reverse
from django.utils import timezone

from accounts import audit
from accounts.models import AuditEvent, Team
from billing import invoices, statements
from billing.models import Credit, Invoice, InvoiceLine, InvoiceNumber, UsageRecord
from notifications import events as notify
from notifications import policy as notify_policy
from notifications.models import Delivery, Notification

# Teams per transaction when a month is issued: large enough that the fixed cost of a chunk's
# queries is small per invoice, small enough that a chunk's rows (some 100 records and 75 lines a
# team) stay a few MB and its locks are held briefly.
CHUNK = 250
NO_CREDIT = (0, Decimal(0), "")
ATTEMPTS = 3  # of a chunk that another issuer got into first (see _invoice_teams)


class NotInvoiceable(Exception):
    pass


def months_usages(team_ids, start):
    """{team id: (usages, times)} of the teams' records billed in the month beginning at
    `start` (released in it, or released late into it: see billing.models.open_month), teams
    without records left out: four queries, however many teams, records and jobs."""
    records = UsageRecord.objects.filter(team_id__in=team_ids, period=start.date())
    rows = list(records.order_by("ended_at", "id").values_list("id", "team_id", "job_id", "job__name", "gpus", "gpu_type", "held_seconds", "rate", "amount"))
    if not rows:
        return {}
    # Each record's credits as UsageQuerySet.with_credits sums them (seconds, amount, the first
    # reason), read apart: its three subqueries a record cost more than all the rest.
    credited = {}
    for usage_id, seconds, amount, reason in Credit.objects.filter(usage__in=records).order_by("id").values_list("usage_id", "seconds", "amount", "reason"):
        earlier = credited.get(usage_id, (0, Decimal(0), reason))
        credited[usage_id] = (earlier[0] + seconds, earlier[1] + amount, earlier[2])
    # Read through the ledger's own relations: each allocation opened a usage record when it
    # started, so a job's first record started with its first allocation (its queue time ran
    # from its submission to then); its stagings are reached through its job.
    jobs = records.values("job_id")
    waited = {
        str(job_id): (submitted, first_start)
        for job_id, submitted, first_start in UsageRecord.ledger.filter(job_id__in=jobs)
        .values("job_id", "job__created_at")
        .annotate(at=Min("started_at"))
        .values_list("job_id", "job__created_at", "at")
    }
    stagings = {}
    finished = (
        _stagings()
        ._default_manager.filter(job_id__in=jobs, started_at__isnull=False, finished_at__isnull=False)
        .order_by()
        .values_list("job_id", "started_at", "finished_at")
    )
    for job_id, started, ended in finished:
        stagings.setdefault(str(job_id), []).append((started, ended))
    out = {}
    for usage_id, team_id, job_id, name, gpus, gpu_type, held, rate, amount in rows:
        job = str(job_id)
        credit_seconds, credit_amount, credit_reason = credited.get(usage_id, NO_CREDIT)
        usages, times = out.setdefault(team_id, ([], {}))
        usages.append(
            invoices.Usage(
                job_id=job,
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
        )
        if job not in times:
            times[job] = invoices.JobTimes(
                queue_seconds=invoices.queue_seconds(*waited.get(job, (None, None))),
                staging_seconds=invoices.staging_seconds(stagings.get(job, [])),
            )
    return out


def _stagings():
    """The stagings' model, reached through the ledger's relations (usage record -> job ->
    its stagings) rather than the scheduler's module, which billing does not import."""
    job = UsageRecord._meta.get_field("job").related_model
    return job._meta.get_field("stagings").related_model


def month_usages(team_id, start, end):
    """(usages, times) of a team's records billed in the month beginning at `start`: four
    queries, however many records and jobs."""
    return months_usages([team_id], start).get(team_id, ([], {}))


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


LINE_FIELDS = ("invoice_id", "position", "kind", "job_ref", "job_name", "description", "gpu_type", "gpus", "seconds", "gpu_seconds", "rates", "amount")


def _line_values(invoice, position, line):
    """An invoice line's column values, in LINE_FIELDS order."""
    return (
        invoice.pk,
        position,
        line.kind,
        line.job_id,
        line.job_name[:200],
        line.description[:500],
        line.gpu_type[:300],
        line.gpus,
        line.seconds,
        line.gpu_seconds,
        line.rates_text[:300],
        line.amount,
    )


def _store(drafts):
    """Store new invoices, each with its lines ([(invoice, lines)]): two statements, however
    many invoices and lines."""
    rows = []
    for invoice, lines in drafts:
        probe = invoices.Document(team_name="", period_start=invoice.period_start, period_end=invoice.period_end, currency="", lines=tuple(lines))
        invoice.subtotal, invoice.credits, invoice.total = probe.subtotal, probe.credits, probe.total
        rows += [_line_values(invoice, i, line) for i, line in enumerate(probe.lines)]
    made = Invoice.objects.bulk_create([invoice for invoice, _ in drafts])
    _insert_lines(rows)
    return made


def _insert_lines(rows):
    """Insert the lines of invoices stored in this same transaction (drafts, or issued ones
    being stored with their lines: InvoiceLine's guard, which keeps lines from being added to
    an invoice issued before, is passed by). On PostgreSQL by COPY, straight from the values:
    a month's 75,000 lines as model instances cost more than all the rest of issuing."""
    if connection.vendor != "postgresql":
        InvoiceLine._base_manager.bulk_create(InvoiceLine(**dict(zip(LINE_FIELDS, row, strict=True))) for row in rows)
        return
    meta = InvoiceLine._meta
    columns = ", ".join(connection.ops.quote_name(meta.get_field(name).column) for name in LINE_FIELDS)
    with connection.cursor() as cursor, cursor.copy(f"COPY {connection.ops.quote_name(meta.db_table)} ({columns}) FROM STDIN") as copy:
        for row in rows:
            copy.write_row(row)


def draft(team, year, month):
    """A stored draft invoice of the team's month (its lines as of now)."""
    start, end = statements.month_bounds(year, month)
    usages, times = month_usages(team.pk, start, end)
    invoice = Invoice(team=team, team_name=team.name, period_start=start, period_end=end, currency=settings.E31_CURRENCY)
    [stored] = _store([(invoice, invoices.lines(usages, times))])
    return stored


def issue(invoice, at=None, actor="system", request=None):
    """Draft -> issued: the next number of the team in the year of issue, taken with the
    counter row locked, in the same transaction as the invoice, so a rollback returns it.
    Audited (invoice.issue) in the same transaction: by the request's user, or by `actor`
    (the management command's name) when there is no request."""
    at = at or timezone.now()
    with transaction.atomic():
        locked = Invoice.objects.select_for_update(of=("self",)).select_related("team").get(pk=invoice.pk)
        if locked.state != Invoice.DRAFT:
            raise NotInvoiceable(f"{locked} is already issued.")
        _number([locked], at)
        locked.save(update_fields=["state", "number_year", "sequence", "number", "issued_at"])
        _announce([locked], at, actor, request)
    return locked


def _issue_new(drafts, at, actor):
    """Store new invoices ([(invoice, lines)], one per team at most) issued: numbered, stored
    with their lines, audited and told, in the caller's transaction and a fixed number of
    queries, however many. They are never stored as drafts: the transaction is their draft."""
    _number([invoice for invoice, _ in drafts], at)
    made = _store(drafts)
    _announce(made, at, actor)
    return made


def _number(drafts, at):
    """Give each draft (one per team at most) its team's next number in the year of issue."""
    sequences = _take_numbers([d.team_id for d in drafts], at.year)
    for d in drafts:
        d.state, d.number_year, d.sequence, d.issued_at = Invoice.ISSUED, at.year, sequences[d.team_id], at
        d.number = invoices.number(at.year, d.sequence)


def _announce(issued, at, actor, request=None):
    _audit_issued(issued, actor, request)
    # Told in the same transaction: an issue that rolls back tells nobody.
    _tell_issued(issued, at)


def _take_numbers(team_ids, year):
    """{team id: its next invoice number in the year}, without gaps: each team's counter row
    is locked (in team order, so that two issuers never wait on each other in a circle) and
    moved on in the caller's transaction, so a rollback returns the numbers."""
    team_ids = sorted(set(team_ids))
    # A counter another issuer is creating meanwhile is waited for, then left as it is.
    InvoiceNumber.objects.bulk_create([InvoiceNumber(team_id=t, year=year) for t in team_ids], ignore_conflicts=True)
    counters = InvoiceNumber.objects.filter(team_id__in=team_ids, year=year)
    last = dict(counters.select_for_update().order_by("team_id").values_list("team_id", "last"))
    counters.update(last=F("last") + 1)
    return {t: last[t] + 1 for t in team_ids}


def _audit_issued(issued, actor, request):
    """One invoice.issue event each: by the request's user, or by `actor` without a request
    (then in one insert, with the fields accounts.audit.record gives a system event)."""
    if request is not None:
        for invoice in issued:
            audit.record(request, "invoice.issue", invoice, actor=actor)
        return
    AuditEvent.objects.bulk_create(
        AuditEvent(
            user=None,
            actor=audit.text(actor or "system", 150),
            team_id=invoice.team_id,
            action="invoice.issue",
            object_type=audit.object_ref(invoice)[0],
            object_id=audit.object_ref(invoice)[1][:100],
            label=audit.text(audit.default_label(invoice), 300),
            via=audit.via_of(None),
            ip=None,
        )
        for invoice in issued
    )


def _tell_issued(issued, at):
    """notifications.events.emit(INVOICE_ISSUED, ...) for each invoice, in four queries
    however many: the same receivers (members who want it by email, webhooks whose filter lets
    it through, as notifications.events.recipients picks them), payload and rows; no row for a
    team nobody is to be told of."""
    kind = notify_policy.INVOICE_ISSUED
    told = notify.recipients_of_teams({invoice.team_id for invoice in issued}, kind, at)
    notes, deliveries = [], []
    for invoice in issued:
        rows = told.get(invoice.team_id)
        if not rows:
            continue
        note = Notification(team_id=invoice.team_id, kind=kind, created_at=at)
        note.payload = notify.payload(note.pk, kind, at, invoice.team, None, _told(invoice))
        notes.append(note)
        for row in rows:  # fresh rows: a team with two invoices is told of each
            deliveries.append(Delivery(notification=note, channel=row.channel, user=row.user, webhook=row.webhook, address=row.address, next_attempt_at=at))
    if notes:
        Notification.objects.bulk_create(notes)
        Delivery.objects.bulk_create(deliveries)


def _told(invoice):
    """What an invoice.issued event says."""
    return {
        "invoice": str(invoice.pk),
        "number": invoice.number,
        "title": invoice.get_kind_display(),
        "period": f"{invoice.period_start:%Y-%m}",
        "total": invoice.total,
        "currency": invoice.currency,
        "url": notify.site_url(reverse("billing:invoice", args=[invoice.pk])),
    }


def _month_over(year, month, now):
    start, end = statements.month_bounds(year, month)
    if end > now:
        raise NotInvoiceable(f"{year:04d}-{month:02d} is not over yet: its figures so far are a statement.")
    return start, end


def _invoice_teams(teams, start, end, at, actor):
    """Draft and issue the month's invoice of each of the teams that has none yet, in one
    transaction and a fixed number of queries, however many teams and records. Returns the new
    invoices, in the order of `teams`."""
    for attempt in range(ATTEMPTS):
        try:
            with transaction.atomic():
                _no_jit()
                ids = [team.pk for team in teams]
                done = set(Invoice.objects.filter(team_id__in=ids, kind=Invoice.INVOICE, period_start=start).values_list("team_id", flat=True))
                todo = [team for team in teams if team.pk not in done]
                if not todo:
                    return []
                months = months_usages([team.pk for team in todo], start)
                drafts = [
                    (
                        Invoice(team=team, team_name=team.name, period_start=start, period_end=end, currency=settings.E31_CURRENCY),
                        invoices.lines(*months.get(team.pk, ((), {}))),
                    )
                    for team in todo
                ]
                return _issue_new(drafts, at, actor)
        except IntegrityError:
            # Another issuer invoiced one of these teams' month meanwhile (one invoice per
            # team and month is a constraint of the table; our insert waited for its commit):
            # nothing of the chunk was written here. Again, without the teams it invoiced.
            if attempt == ATTEMPTS - 1:
                raise
    raise AssertionError("unreachable")


def _no_jit():
    """On PostgreSQL, no JIT compilation for the rest of the transaction: a chunk's usage query
    is estimated costly (some 25,000 records, each with three credit subqueries, most of them
    empty), and LLVM would take about a second to compile what runs in some 50 ms."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SET LOCAL jit = off")


def invoice_team_month(team, year, month, now=None, actor="system"):
    """Draft and issue the team's invoice of the month, in one transaction; None when it
    already has one."""
    now = now or timezone.now()
    start, end = _month_over(year, month, now)
    made = _invoice_teams([team], start, end, now, actor)
    return made[0] if made else None


def invoice_month(year, month, now=None, on_invoice=None, actor="system", chunk=CHUNK):
    """Invoice every team with usage in the month that has no invoice for it yet, `chunk` teams
    a transaction (on_invoice is called for each invoice once its chunk has committed). Returns
    the new invoices. Idempotent: a team already invoiced for the month is skipped."""
    now = now or timezone.now()
    start, end = _month_over(year, month, now)
    done = Invoice.objects.filter(kind=Invoice.INVOICE, period_start=start).values("team_id")
    team_ids = UsageRecord.objects.filter(period=start.date()).exclude(team_id__in=done).values("team_id").distinct()
    teams = list(Team.objects.filter(pk__in=team_ids).order_by("name"))
    made = []
    for i in range(0, len(teams), chunk):
        issued = _invoice_teams(teams[i : i + chunk], start, end, now, actor)
        made += issued
        if on_invoice is not None:
            for invoice in issued:
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
        [note] = _store([(note, invoices.credit_note_lines(document(original).lines, reason))])
        return issue(note, at=at, actor=actor)
