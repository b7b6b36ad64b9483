"""Invoices: lines rounded once and totalled, issued once per team and month and never changed,
numbered without gaps (also by four issuers at once), credit notes, the command, the pages, the
API, the CSV and the PDF, and who may see them.

Over 500 lines: each rule of the invoice, case by case, then the command and the pages.
"""

import csv
import io
import shutil
import subprocess
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import transaction
from django.urls import reverse
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from billing import invoice_service, invoices, meter, statements
from billing.models import Credit, Invoice, InvoiceImmutable, InvoiceLine, UsageRecord
from jobs.models import Job
from scheduler.models import Allocation, Node, Staging
from tests.conftest import make_user

UTC = UTC
NOV = datetime(2026, 11, 1, tzinfo=UTC)
LATER = datetime(2026, 12, 15, tzinfo=UTC)  # November is over


@pytest.fixture
def node(db):
    return Node.objects.create(name="n1", device_type="cpu", devices=8)


def new_job(user, name="job", created_at=None, gpus=1):
    return Job.objects.create(
        team=user.membership.team,
        created_by=user,
        name=name,
        entrypoint="train.py",
        gpus=gpus,
        span_hours=Decimal(1),
        created_at=created_at or NOV,
    )


def record(job, node, started, seconds, rate, gpus=1, credit=Decimal(0), reason="", gpu_type="cpu"):
    """A released allocation and its usage record, as Allocation.release writes them."""
    ended = started + timedelta(seconds=seconds)
    allocation = Allocation.objects.create(
        job=job,
        node=node,
        devices=list(range(gpus)),
        device_type=gpu_type,
        rate=rate,
        started_at=started,
        ended_at=ended,
        end_reason=Allocation.NODE_LOST if credit else Allocation.EXITED,
    )
    amount = meter.charge(gpus, seconds, rate)
    usage = UsageRecord.objects.create(
        team=job.team,
        job=job,
        allocation=allocation,
        gpu_type=gpu_type,
        gpus=gpus,
        started_at=started,
        ended_at=ended,
        held_seconds=seconds,
        rate=rate,
        amount=amount,
    )
    if credit:
        Credit.objects.create(team=job.team, job=job, usage=usage, seconds=seconds, amount=min(Decimal(credit), amount), reason=reason)
    return usage


def issue_november(team):
    return invoice_service.invoice_team_month(team, 2026, 11, now=LATER)


# Pure properties ----------------------------------------------------------------------------

rates = st.decimals(min_value=Decimal("0.0001"), max_value=Decimal("99.9999"), places=4)
usage_items = st.lists(
    st.tuples(
        st.integers(0, 5),  # job
        st.integers(1, 8),  # GPUs
        st.integers(0, 40 * 24 * 3600),  # held seconds
        rates,
        st.integers(0, 100),  # credit, percent of the amount
    ),
    max_size=30,
)


def usages_of(items):
    out = []
    for job, gpus, seconds, rate, percent in items:
        amount = meter.charge(gpus, seconds, rate)
        credit = (amount * percent / 100).quantize(meter.AMOUNT_PLACES)
        out.append(
            invoices.Usage(
                job_id=f"job-{job}",
                job_name=f"run {job}",
                gpus=gpus,
                gpu_type="H100",
                held_seconds=seconds,
                rate=rate,
                amount=amount,
                credit_seconds=seconds * percent // 100,
                credit_amount=credit,
                credit_reason="node lost" if credit else "",
            )
        )
    return out


@settings(max_examples=300, deadline=None)
@given(usage_items)
def test_the_total_is_the_sum_of_the_rounded_lines_and_each_line_is_rounded_once(items):
    usages = usages_of(items)
    doc = invoices.Document(team_name="T", period_start=NOV, period_end=LATER, currency="USD", lines=invoices.lines(usages))
    assert doc.total == sum((line.amount for line in doc.lines), Decimal("0.00"))
    assert doc.total == doc.subtotal + doc.credits
    for line in doc.lines:
        assert line.amount == line.amount.quantize(meter.CENTS)
        mine = [u for u in usages if u.job_id == line.job_id]
        if line.kind == invoices.USAGE:
            # GPUs x held seconds x rate, as the meter charges each allocation, rounded once.
            exact = sum((meter.charge(u.gpus, u.held_seconds, u.rate) for u in mine), Decimal(0))
            assert line.amount == meter.round_money(exact)
            assert line.seconds == sum(u.held_seconds for u in mine)
            assert line.rates == tuple(sorted({u.rate for u in mine}))
            if len(mine) == 1:  # one allocation: exactly the product, rounded once, half-even
                u = mine[0]
                assert line.amount == meter.round_money(Decimal(u.gpus * u.held_seconds) * u.rate / 3600)
        elif line.kind == invoices.CREDIT:
            assert line.amount == -meter.round_money(sum((u.credit_amount for u in mine), Decimal(0)))
            assert line.amount <= 0 and line.description == "node lost" and str(line.amount) != "-0.00"
    # The same figures as the usage page's statement, and the same again when regenerated.
    old = statements.statement(
        statements.Usage(u.job_id, u.job_name, u.gpus, u.gpu_type, u.held_seconds, u.rate, u.amount, u.credit_seconds, u.credit_amount) for u in usages
    )
    assert doc.total == old.total and doc.credits == -old.credits
    assert invoices.lines(usages) == doc.lines


def test_half_even_rounding_once_per_line():
    # 3 records of 0.005 each: rounded once (0.015 -> 0.02), not per record (0 + 0 + 0).
    usages = [invoices.Usage("j", "j", 1, "cpu", 1, Decimal("18"), Decimal("0.005")) for _ in range(3)]
    [line] = invoices.lines(usages)
    assert line.amount == Decimal("0.02")
    [line] = invoices.lines(usages[:1])
    assert line.amount == Decimal("0.00")  # half to even


# With the database --------------------------------------------------------------------------


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(
    st.lists(
        st.tuples(st.integers(0, 1), st.integers(0, 3), st.integers(1, 4), st.integers(1, 3 * 24 * 3600), rates, st.integers(0, 100), st.integers(0, 27)),
        min_size=1,
        max_size=12,
    )
)
def test_issued_invoices_store_the_statement_and_never_change(alice, charlie, node, items):
    with transaction.atomic():
        users = [alice, charlie]
        jobs = {}
        for who, job, gpus, seconds, rate, percent, day in items:
            key = (who, job)
            if key not in jobs:
                jobs[key] = new_job(users[who], name=f"run-{who}-{job}")
            amount = meter.charge(gpus, seconds, rate)
            record(
                jobs[key],
                node,
                NOV + timedelta(days=day),
                seconds,
                rate,
                gpus,
                credit=(amount * percent / 100).quantize(meter.AMOUNT_PLACES),
                reason="preempted",
            )
        before = {u.membership.team_id: invoice_service.statement(u.membership.team, 2026, 11) for u in users}
        made = invoice_service.invoice_month(2026, 11, now=LATER)
        assert invoice_service.invoice_month(2026, 11, now=LATER) == []  # idempotent
        # (A record started late in November may end, and be billed, in December.)
        november = NOV.date().replace(day=1)
        assert {i.team_id for i in made} == {u.membership.team_id for u in users if u.membership.team.usage.filter(period=november).exists()}
        for invoice in made:
            stored = invoice_service.document(invoice)
            again = invoice_service.statement(invoice.team, 2026, 11)
            assert stored.lines == again.lines == before[invoice.team_id].lines
            assert invoice.total == stored.total == sum((line.amount for line in invoice.lines.all()), Decimal("0.00"))
            assert (invoice.subtotal, invoice.credits) == (stored.subtotal, stored.credits)
            assert invoice.number == "2026-0001" and invoice.state == Invoice.ISSUED
            # The usage page's figures are the invoice's.
            assert (
                statements.statement(
                    statements.Usage(str(r.job_id), r.job.name, r.gpus, r.gpu_type, r.held_seconds, r.rate, r.amount, r.credit_seconds, r.credit_amount)
                    for r in invoice.team.usage.filter(period=november)
                ).total
                == invoice.total
            )
            invoice.total += 1
            with pytest.raises(InvoiceImmutable):
                invoice.save()
            with pytest.raises(InvoiceImmutable):
                invoice.delete()
        transaction.set_rollback(True)


def test_an_issued_invoice_and_its_lines_cannot_change(alice, node):
    record(new_job(alice, "a"), node, NOV + timedelta(days=2), 3600, Decimal("2.40"))
    invoice = issue_november(alice.membership.team)
    line = invoice.lines.first()
    fresh = Invoice.objects.get(pk=invoice.pk)
    fresh.reason = "edited"
    for attempt in (
        fresh.save,
        fresh.delete,
        lambda: Invoice.objects.filter(pk=invoice.pk).update(total=0),
        lambda: Invoice.objects.filter(pk=invoice.pk).delete(),
        line.save,
        line.delete,
        lambda: InvoiceLine.objects.filter(invoice=invoice).update(amount=0),
        lambda: InvoiceLine.objects.filter(invoice=invoice).delete(),
        lambda: InvoiceLine.objects.bulk_create([InvoiceLine(invoice=invoice, position=99, kind="usage", job_ref="x", job_name="x", amount=1)]),
    ):
        with pytest.raises(InvoiceImmutable):
            attempt()
    invoice.refresh_from_db()
    assert invoice.total == Decimal("2.40") and invoice.reason == "" and invoice.lines.count() == 2
    # A draft may still change, and be thrown away.
    draft = invoice_service.draft(alice.membership.team, 2026, 10)
    draft.reason = "fine"
    draft.save()
    draft.delete()


def test_numbers_have_no_gaps_per_team_and_year_and_restart_with_the_year(alice, charlie, node):
    team_a, team_b = alice.membership.team, charlie.membership.team
    for month in (9, 10, 11):
        record(new_job(alice, f"a{month}"), node, datetime(2026, month, 3, tzinfo=UTC), 600, Decimal("1"))
    record(new_job(charlie, "b"), node, datetime(2026, 10, 3, tzinfo=UTC), 600, Decimal("1"))
    record(new_job(alice, "a12"), node, datetime(2026, 12, 3, tzinfo=UTC), 600, Decimal("1"))
    issued = [
        invoice_service.invoice_team_month(team_a, 2026, 9, now=datetime(2026, 10, 1, 1, tzinfo=UTC)),
        invoice_service.invoice_team_month(team_b, 2026, 10, now=datetime(2026, 11, 1, 1, tzinfo=UTC)),
        invoice_service.invoice_team_month(team_a, 2026, 10, now=datetime(2026, 11, 1, 1, tzinfo=UTC)),
    ]
    # A failed issue takes no number: its transaction, the number's with it, rolls back.
    with pytest.raises(RuntimeError), transaction.atomic():
        invoice_service.invoice_team_month(team_a, 2026, 11, now=datetime(2026, 12, 1, 1, tzinfo=UTC))
        raise RuntimeError("crash after issuing")
    issued.append(invoice_service.invoice_team_month(team_a, 2026, 11, now=datetime(2026, 12, 1, 1, tzinfo=UTC)))
    note = invoice_service.credit_note(issued[-1], "wrong rate", at=datetime(2026, 12, 20, tzinfo=UTC))
    # December is invoiced in January: a new year, a new sequence.
    january = invoice_service.invoice_team_month(team_a, 2026, 12, now=datetime(2027, 1, 1, 0, 5, tzinfo=UTC))
    assert [i.number for i in issued] == ["2026-0001", "2026-0001", "2026-0002", "2026-0003"]
    assert [issued[1].team_id, note.number, january.number] == [team_b.pk, "2026-0004", "2027-0001"]
    assert invoice_service.invoice_team_month(team_a, 2026, 12, now=datetime(2027, 2, 1, tzinfo=UTC)) is None
    with pytest.raises(invoice_service.NotInvoiceable):  # an issued invoice is not issued again
        invoice_service.issue(january)


def test_a_credit_note_reverses_an_invoice_with_negative_lines(alice, node):
    job = new_job(alice, "lost")
    record(job, node, NOV + timedelta(days=1), 7200, Decimal("2.40"), gpus=2, credit=Decimal("1.2"), reason="node lost")
    invoice = issue_november(alice.membership.team)
    assert (invoice.subtotal, invoice.credits, invoice.total) == (Decimal("9.60"), Decimal("-1.20"), Decimal("8.40"))
    note = invoice_service.credit_note(invoice, "goodwill")
    assert note.kind == Invoice.CREDIT_NOTE and note.corrects == invoice and note.state == Invoice.ISSUED
    assert [line.amount for line in note.lines.all()] == [Decimal("-9.60"), Decimal("1.20")]
    assert note.total == Decimal("-8.40") and note.number == f"{note.issued_at.year}-0002"
    invoice.refresh_from_db()
    assert invoice.total == Decimal("8.40")  # the original is untouched
    with pytest.raises(invoice_service.NotInvoiceable):
        invoice_service.credit_note(note, "a note of a note")
    with pytest.raises(invoice_service.NotInvoiceable, match="already reversed"):
        invoice_service.credit_note(invoice, "twice")
    assert [line.description for line in note.lines.all()] == ["goodwill: reverses the compute held", "goodwill: reverses the credit (node lost)"]
    text = pdf_text(invoices.render_pdf(invoice_service.document(note)))
    assert f"Credit note {note.number}" in text and f"Corrects invoice {invoice.number}" in text and "USD -8.40" not in text and "-USD 8.40" in text
    Path("test-artifacts").mkdir(exist_ok=True)
    Path("test-artifacts/credit-note.pdf").write_bytes(invoices.render_pdf(invoice_service.document(note)))


def test_invoices_are_read_only_in_the_admin(admin_client, issued):
    assert admin_client.get(reverse("admin:billing_invoice_changelist")).status_code == 200
    page = admin_client.get(reverse("admin:billing_invoice_change", args=[issued.pk]))
    assert page.status_code == 200 and "bert-finetune" in page.content.decode()
    assert admin_client.post(reverse("admin:billing_invoice_change", args=[issued.pk]), {"reason": "x"}).status_code == 403
    assert admin_client.post(reverse("admin:billing_invoice_delete", args=[issued.pk]), {"post": "yes"}).status_code == 403
    assert Invoice.objects.get(pk=issued.pk).reason == ""


def test_a_rate_change_during_the_month_shows_each_rate(alice, node):
    before, after = Decimal("2.40"), Decimal("3.00")
    record(new_job(alice, "early"), node, NOV + timedelta(days=3), 3600, before)
    record(new_job(alice, "late"), node, NOV + timedelta(days=20), 3600, after, gpus=2)
    both = new_job(alice, "across")
    record(both, node, NOV + timedelta(days=14), 1800, before)
    record(both, node, NOV + timedelta(days=16), 1800, after)
    invoice = issue_november(alice.membership.team)
    usage = {line.job_name: line for line in invoice.lines.filter(kind="usage")}
    assert (usage["early"].rates, usage["early"].amount) == ("2.4000", Decimal("2.40"))
    assert (usage["late"].rates, usage["late"].amount) == ("3.0000", Decimal("6.00"))
    assert (usage["across"].rates, usage["across"].amount, usage["across"].seconds) == ("2.4000 3.0000", Decimal("2.70"), 3600)
    assert invoice.total == Decimal("11.10")


def test_queue_and_staging_times_are_shown_free(alice, node):
    job = new_job(alice, "waited", created_at=NOV + timedelta(days=1))
    start = NOV + timedelta(days=1, seconds=754)
    Staging.objects.create(
        job=job, node=node, state=Staging.STAGED, started_at=NOV + timedelta(days=1, seconds=600), finished_at=NOV + timedelta(days=1, seconds=725)
    )
    record(job, node, start, 60, Decimal("2.40"))
    lines = list(issue_november(alice.membership.team).lines.all())
    assert [(line.kind, line.seconds, line.amount) for line in lines] == [
        ("usage", 60, Decimal("0.04")),
        ("queue", 754, Decimal("0.00")),
        ("staging", 125, Decimal("0.00")),
    ]


def test_the_command_invoices_each_team_once_and_refuses_a_month_not_over(alice, charlie, node):
    record(new_job(alice, "a"), node, datetime(2026, 10, 5, tzinfo=UTC), 3600, Decimal("2.40"))
    record(new_job(charlie, "b"), node, datetime(2026, 10, 6, tzinfo=UTC), 1800, Decimal("2.40"))
    record(new_job(charlie, "c"), node, datetime(2026, 9, 6, tzinfo=UTC), 1800, Decimal("2.40"))
    out = io.StringIO()
    call_command("invoices", month="2026-10", stdout=out)
    assert "2 invoice(s) issued for 2026-10" in out.getvalue()
    call_command("invoices", month="2026-10", stdout=(again := io.StringIO()))
    assert "0 invoice(s) issued" in again.getvalue()
    assert Invoice.objects.filter(period_start=datetime(2026, 10, 1, tzinfo=UTC)).count() == 2
    with pytest.raises(CommandError, match="not over"):
        call_command("invoices", month="2999-01")
    with pytest.raises(CommandError):
        call_command("invoices", month="2026-13")
    invoice = Invoice.objects.get(team=alice.membership.team)
    call_command("invoices", credit_note=str(invoice.pk), reason="billing error", stdout=(note := io.StringIO()))
    assert "credit note" in note.getvalue() and invoice.credit_notes.get().total == Decimal("-2.40")


# Pages, downloads, API ------------------------------------------------------------------------


@pytest.fixture
def issued(alice, node):
    job = new_job(alice, "resnet-50 <&> sweep")
    record(job, node, NOV + timedelta(days=4), 5400, Decimal("2.40"), gpus=4, credit=Decimal("3.00"), reason="preempted: time since its last checkpoint lost")
    record(new_job(alice, "bert-finetune"), node, NOV + timedelta(days=9), 1234, Decimal("3.125"), gpus=2, gpu_type="NVIDIA H100")
    return issue_november(alice.membership.team)


def urls(invoice):
    return [
        reverse("billing:invoice", args=[invoice.pk]),
        reverse("billing:invoice_pdf", args=[invoice.pk]),
        reverse("billing:invoice_csv", args=[invoice.pk]),
        reverse("api:invoice", args=[invoice.pk]),
        reverse("api:invoice-pdf", args=[invoice.pk]),
        reverse("api:invoice-csv", args=[invoice.pk]),
    ]


def test_the_team_sees_its_invoice_and_an_outsider_gets_404_everywhere(client, alice, bob, charlie, issued):
    assert next(iter(urls(issued))) == f"/billing/invoices/{issued.pk}/"
    assert urls(issued)[4] == f"/api/invoices/{issued.pk}.pdf"
    for user in (alice, bob):
        client.force_login(user)
        for url in urls(issued):
            assert client.get(url).status_code == 200, url
        assert issued.number in client.get(reverse("billing:invoices")).content.decode()
        assert [i["number"] for i in client.get("/api/invoices/").json()["results"]] == [issued.number]
    client.force_login(charlie)
    for url in urls(issued):
        assert client.get(url).status_code == 404, url
    assert issued.number not in client.get(reverse("billing:invoices")).content.decode()
    assert client.get("/api/invoices/").json()["results"] == []
    statement = client.get("/api/invoices/statement/?month=2026-11").json()
    assert statement["lines"] == [] and statement["total"] == "0.00"
    client.logout()
    for url in urls(issued):
        assert client.get(url).status_code in (302, 401, 403), url


def test_the_invoice_page_api_and_csv_hold_the_lines(client, alice, issued):
    client.force_login(alice)
    page = client.get(reverse("billing:invoice", args=[issued.pk])).content.decode()
    assert "resnet-50 &lt;&amp;&gt; sweep" in page and "bert-finetune" in page
    assert 'id="invoice-total">USD 13.54<' in page  # 14.40 - 3.00 + 2.14 (2 x 1234 s x 3.125 = 2.142...)
    data = client.get(f"/api/invoices/{issued.pk}/").json()
    assert (data["number"], data["total"], data["credits"], data["period"]) == (issued.number, "13.54", "-3.00", "2026-11")
    assert [(line["kind"], line["amount"]) for line in data["lines"] if line["kind"] in ("usage", "credit")] == [
        ("usage", "14.40"),
        ("credit", "-3.00"),
        ("usage", "2.14"),
    ]
    rows = list(csv.DictReader(io.StringIO(client.get(f"/api/invoices/{issued.pk}.csv").content.decode())))
    assert rows[0]["job"] == "resnet-50 <&> sweep" and rows[0]["amount"] == "14.40" and rows[0]["seconds"] == "5400"
    assert rows[-1]["kind"] == "total" and rows[-1]["amount"] == "13.54" and rows[-1]["number"] == issued.number


def test_the_statement_of_the_month_so_far_is_a_draft(client, alice, node):
    now = datetime.now(UTC)
    record(new_job(alice, "now"), node, now.replace(day=1, hour=0, minute=0, second=0, microsecond=0), 3600, Decimal("2.40"))
    client.force_login(alice)
    page = client.get(reverse("billing:statement")).content.decode()
    assert "Statement" in page and "draft" in page and 'id="invoice-total">USD 2.40<' in page
    text = pdf_text(client.get(reverse("billing:statement_pdf")).content)
    assert "draft" in text and "2.40" in text
    assert not Invoice.objects.exists()
    assert client.get(reverse("billing:statement") + "?month=2026-13").status_code == 400


def pdf_text(content):
    from pypdf import PdfReader

    assert content.startswith(b"%PDF")
    return "\n".join(page.extract_text() for page in PdfReader(io.BytesIO(content)).pages)


def test_the_pdf_holds_the_header_lines_and_total(client, alice, issued):
    client.force_login(alice)
    response = client.get(reverse("billing:invoice_pdf", args=[issued.pk]))
    assert response["Content-Type"] == "application/pdf"
    assert f"e31-invoice-{issued.number}.pdf" in response["Content-Disposition"]
    assert client.get(reverse("api:invoice-pdf", args=[issued.pk])).content == response.content  # never changes
    text = pdf_text(response.content)
    for needle in (
        "E31 Network",
        f"Invoice {issued.number}",
        "Team A",
        "2026-11",
        "resnet-50 <&> sweep",
        "bert-finetune",
        "NVIDIA H100",
        "14.40",
        "-3.00",
        "2.14",
        "USD 13.54",
        "Queue time, not billed",
        "1:30:00",
        "0:20:34",
        "3.125",
        "USD",
    ):
        assert needle in text, needle
    pdftoppm = shutil.which("pdftoppm")
    if pdftoppm is None:
        return  # no renderer here: the picture is for a person to look at
    out = Path("test-artifacts")
    out.mkdir(exist_ok=True)
    (out / "invoice.pdf").write_bytes(response.content)
    subprocess.run([pdftoppm, "-png", "-r", "80", "-singlefile", str(out / "invoice.pdf"), str(out / "invoice")], check=True)
    assert (out / "invoice.png").stat().st_size > 10_000


def test_a_long_invoice_pdf_runs_over_pages(alice, node):
    lines = invoices.lines([invoices.Usage(f"job-{i}", f"run {i}", 1, "cpu", 3600, Decimal("2.40"), Decimal("2.40")) for i in range(120)])
    doc = invoices.Document(
        team_name="Team A", period_start=NOV, period_end=LATER.replace(day=1), currency="USD", lines=lines, state="issued", number="2026-0009", issued_at=LATER
    )
    text = pdf_text(invoices.render_pdf(doc))
    assert "run 119" in text and "USD 288.00" in text and "Page 2" in text


def test_another_teams_user_cannot_reach_a_missing_or_foreign_invoice_via_a_token(alice, charlie, issued):
    from rest_framework.authtoken.models import Token
    from rest_framework.test import APIClient

    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=charlie).key}")
    for url in urls(issued)[3:]:
        assert api.get(url).status_code == 404
    api.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=alice).key}")
    assert api.get(urls(issued)[3]).json()["total"] == str(issued.total)
    nobody = make_user("nobody", None)
    api.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=nobody).key}")
    refused = api.get(urls(issued)[3])  # a user on no team is refused before any lookup
    assert refused.status_code == 403 and "not on a team" in refused.json()["detail"], refused.json()


# Two issuers at once, on PostgreSQL ----------------------------------------------------------

CONCURRENT_SETUP = """
from django.contrib.auth import get_user_model
from accounts.models import Team
from billing import invoice_service
team = Team.objects.create(name="racers")
for month in range(1, 25):
    invoice_service.draft(team, 2023 + (month - 1) // 12, (month - 1) % 12 + 1)
"""

CONCURRENT_WORKER = """
import time
from datetime import datetime, timezone
from billing import invoice_service
from billing.models import Invoice
drafts = list(Invoice.objects.order_by("period_start"))
drafts = drafts[{part} * 6:] + drafts[:{part} * 6]
time.sleep(max(0, {start} - time.time()))
issued = 0
for invoice in drafts:  # every worker tries every invoice: each is issued once, by one of them
    try:
        invoice_service.issue(invoice, at=datetime(2026, 6, 1, tzinfo=timezone.utc))
        issued += 1
    except invoice_service.NotInvoiceable:
        pass
print("issued", issued)
"""


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_four_issuers_at_once_take_each_number_once_without_gaps():
    import sys
    import time

    import psycopg

    from tests.system import ROOT, LiveSystem

    system = LiveSystem(database="postgres")
    try:
        system.manage("migrate", "--noinput", "-v", "0")
        system.manage("shell", "-c", CONCURRENT_SETUP)
        start = time.time() + 3
        workers = [
            subprocess.Popen(
                [sys.executable, "manage.py", "shell", "-c", CONCURRENT_WORKER.format(part=part, start=start)],
                cwd=ROOT,
                env=system.env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
            for part in range(4)
        ]
        issued = 0
        for worker in workers:
            output, _ = worker.communicate(timeout=120)
            assert worker.returncode == 0, output.decode()
            issued += int(output.decode().rsplit("issued ", 1)[1].split()[0])
        assert issued == 24
        with psycopg.connect(system.env["DATABASE_URL"]) as conn:
            numbers = [row[0] for row in conn.execute("SELECT number FROM billing_invoice WHERE state = 'issued' ORDER BY sequence")]
        assert numbers == [f"2026-{n:04d}" for n in range(1, 25)]
    finally:
        system.stop()
