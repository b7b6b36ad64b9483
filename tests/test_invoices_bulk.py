"""A month's invoices issued in chunks of teams (invoice_service.invoice_month, what `manage.py
invoices --month` runs): the same numbers, totals, lines, audit events and notifications as
issuing each team's invoice one at a time (a draft, then issue()), the lines those of the pure
billing.invoices.lines over the records, and a fixed number of queries per chunk, however many
teams and records."""

from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext

from accounts.models import AuditEvent, Membership, Team
from billing import invoice_service, invoices
from billing.models import Invoice, InvoiceNumber, UsageRecord
from notifications import policy
from notifications.models import EmailPreference, Notification, Webhook
from scheduler.models import Node, Staging
from tests.conftest import make_user
from tests.test_invoices import new_job, record

NOV = datetime(2026, 11, 1, tzinfo=UTC)
LATER = datetime(2026, 12, 15, tzinfo=UTC)  # November is over
ACTOR = "manage.py invoices"


@pytest.fixture
def node(db):
    return Node.objects.create(name="n1", device_type="cpu", devices=8)


def staged(job, started, seconds):
    Staging.objects.create(job=job, node=Node.objects.first(), state=Staging.STAGED, started_at=started, finished_at=started + timedelta(seconds=seconds))


def build_world(node):
    """Seven teams: one without usage, one invoiced before (September: its November invoice is
    its second number), the rest with jobs over several rates, GPU types and GPU counts, credits
    (two on one record, different reasons), records crossing into and out of November, jobs
    queued and staged (one job staged twice, over several records), a webhook and a member who
    wants no email."""
    users = [make_user(f"user{i}", Team.objects.create(name=f"team-{i}"), Membership.OWNER) for i in range(7)]
    rates = [Decimal("2.40"), Decimal("3.125"), Decimal("1.80"), Decimal("0.0001")]
    for t, user in enumerate(users[1:], start=1):
        for j in range(t % 3 + 1):
            job = new_job(user, f"run-{t}-{j}", created_at=NOV - timedelta(hours=t + j), gpus=1 + j)
            for r in range(j + 2):
                started = NOV + timedelta(days=3 * r + t, hours=j)
                rate = rates[(t + j + r) % len(rates)]
                credit = Decimal("0.75") if (t + r) % 4 == 0 else Decimal(0)
                gpu_type = "NVIDIA H100" if r % 2 else "cpu"
                record(job, node, started, 600 * (t + r) + 17, rate, gpus=1 + j, credit=credit, reason=f"node lost {r}", gpu_type=gpu_type)
            if j == 0:
                staged(job, job.created_at + timedelta(seconds=5), 40 + t)
                staged(job, job.created_at + timedelta(seconds=100), 7)
    # Crossing the month's edges: released in November (billed there), released in December.
    early = new_job(users[2], "over-october", created_at=datetime(2026, 10, 31, 20, tzinfo=UTC))
    record(early, node, datetime(2026, 10, 31, 23, tzinfo=UTC), 7200, Decimal("2.40"))
    record(early, node, datetime(2026, 10, 30, 1, tzinfo=UTC), 60, Decimal("2.40"))  # October's, but its first start
    late = new_job(users[3], "into-december", created_at=datetime(2026, 11, 30, 20, tzinfo=UTC))
    record(late, node, datetime(2026, 11, 30, 23, tzinfo=UTC), 7200, Decimal("2.40"))
    # Two credits on one record.
    twice = record(
        new_job(users[4], "credited-twice"), node, NOV + timedelta(days=9), 3600, Decimal("3.125"), gpus=2, credit=Decimal("1.00"), reason="preempted"
    )
    twice.credits.create(team=twice.team, job=twice.job, seconds=60, amount=Decimal("0.50"), reason="node lost")
    # Invoiced before: its November invoice takes its second number of 2026.
    september = new_job(users[5], "september", created_at=datetime(2026, 9, 2, tzinfo=UTC))
    record(september, node, datetime(2026, 9, 3, tzinfo=UTC), 600, Decimal("1"))
    invoice_service.invoice_team_month(users[5].membership.team, 2026, 9, now=datetime(2026, 10, 1, 1, tzinfo=UTC))
    Webhook.objects.create(team=users[1].membership.team, url="https://example.com/hook", kinds=[policy.INVOICE_ISSUED])
    Webhook.objects.create(team=users[2].membership.team, url="https://example.com/other", kinds=[policy.FAILED])
    EmailPreference.objects.create(user=users[3], kinds=[])
    return users


def snapshot():
    """The month's invoices, their lines, audit events and notifications as plain data (ids and
    anything holding them left out), by team."""
    out = {}
    for invoice in Invoice.objects.filter(period_start=NOV).select_related("team").order_by("team__name"):
        notes = Notification.objects.filter(team=invoice.team, kind=policy.INVOICE_ISSUED)
        out[invoice.team.name] = {
            "invoice": {
                field: getattr(invoice, field)
                for field in ("team_name", "kind", "state", "period_start", "period_end", "number", "number_year", "sequence", "issued_at", "currency")
            }
            | {"subtotal": invoice.subtotal, "credits": invoice.credits, "total": invoice.total},
            "lines": [
                (
                    line.position,
                    line.kind,
                    line.job_ref,
                    line.job_name,
                    line.description,
                    line.gpu_type,
                    line.gpus,
                    line.seconds,
                    line.gpu_seconds,
                    line.rates,
                    line.amount,
                )
                for line in invoice.lines.order_by("position")
            ],
            "document": invoice_service.document(invoice),
            "audit": list(
                AuditEvent.objects.filter(object_id=str(invoice.pk)).values_list("user", "actor", "team", "action", "object_type", "label", "via", "ip")
            ),
            "notifications": [
                (
                    {k: v for k, v in n.payload["data"].items() if k not in ("invoice", "url")},
                    n.payload["team"],
                    n.created_at,
                    sorted(n.deliveries.values_list("channel", "address")),
                )
                for n in notes
            ],
        }
    counters = dict(InvoiceNumber.objects.filter(year=2026).values_list("team__name", "last"))
    return out, counters


def expected_lines(team):
    """billing.invoices.lines over the team's November records, read here without
    invoice_service."""
    usages, times = [], {}
    for usage in UsageRecord.objects.filter(team=team, period=NOV.date()).order_by("ended_at", "id"):
        credits = list(usage.credits.order_by("id"))
        usages.append(
            invoices.Usage(
                job_id=str(usage.job_id),
                job_name=usage.job.name,
                gpus=usage.gpus,
                gpu_type=usage.gpu_type,
                held_seconds=usage.held_seconds,
                rate=usage.rate,
                amount=usage.amount,
                credit_seconds=sum(c.seconds for c in credits),
                credit_amount=sum((c.amount for c in credits), Decimal(0)),
                credit_reason=credits[0].reason if credits else "",
            )
        )
        job = usage.job
        first = min(u.started_at for u in UsageRecord.ledger.filter(job=job))
        times[str(job.pk)] = invoices.JobTimes(
            queue_seconds=invoices.queue_seconds(job.created_at, first),
            staging_seconds=invoices.staging_seconds((s.started_at, s.finished_at) for s in job.stagings.all()),
        )
    return invoices.lines(usages, times)


def test_the_month_in_chunks_issues_what_one_at_a_time_does(node):
    build_world(node)
    with transaction.atomic():
        # One at a time, as issuing worked before: a draft per team, then issue().
        for team in Team.objects.filter(usage__period=NOV.date()).distinct().order_by("name"):
            invoice_service.issue(invoice_service.draft(team, 2026, 11), at=LATER, actor=ACTOR)
        one_by_one = snapshot()
        transaction.set_rollback(True)
    assert not Invoice.objects.filter(period_start=NOV).exists()

    made = invoice_service.invoice_month(2026, 11, now=LATER, actor=ACTOR, chunk=2)  # three chunks
    assert snapshot() == one_by_one
    invoiced, counters = one_by_one
    assert len(made) == len(invoiced) == 6  # team-0 has no usage in November: no invoice
    assert [i.team_name for i in made] == sorted(invoiced)
    assert invoiced["team-5"]["invoice"]["number"] == "2026-0002" and counters["team-5"] == 2
    assert {v["invoice"]["number"] for k, v in invoiced.items() if k != "team-5"} == {"2026-0001"}
    for invoice in made:
        assert invoiced[invoice.team_name]["document"].lines == expected_lines(invoice.team)
        assert invoiced[invoice.team_name]["audit"] == [(None, ACTOR, invoice.team_id, "invoice.issue", "invoice", invoice.number, "system", None)]
    # The staging twice of a job with several records shows once per staging.
    staging = [line for line in invoiced["team-1"]["lines"] if line[1] == "staging"]
    assert [line[7] for line in staging] == [41 + 7]
    assert [n[3] for n in invoiced["team-1"]["notifications"]] == [[("email", "user1@example.com"), ("webhook", "https://example.com/hook")]]
    assert invoiced["team-3"]["notifications"] == []  # its only member wants no email
    # Idempotent: again, nothing is issued and no number is taken.
    assert invoice_service.invoice_month(2026, 11, now=LATER, actor=ACTOR, chunk=2) == []
    assert snapshot() == one_by_one


def test_a_team_invoiced_meanwhile_is_skipped_and_the_others_numbered_as_ever(node):
    users = build_world(node)
    first = invoice_service.invoice_team_month(users[3].membership.team, 2026, 11, now=LATER)
    made = invoice_service.invoice_month(2026, 11, now=LATER, chunk=2)
    assert first.number == "2026-0001" and users[3].membership.team.pk not in {i.team_id for i in made}
    assert sorted(i.number for i in made) == ["2026-0001"] * 4 + ["2026-0002"]
    assert Invoice.objects.filter(period_start=NOV).count() == 6


def test_a_chunk_that_fails_issues_nothing_of_it(node, monkeypatch):
    build_world(node)

    def refuse(issued, at):
        raise RuntimeError("the outbox is down")

    monkeypatch.setattr(invoice_service, "_tell_issued", refuse)
    with pytest.raises(RuntimeError):
        invoice_service.invoice_month(2026, 11, now=LATER, chunk=2)
    assert not Invoice.objects.filter(period_start=NOV).exists()
    assert AuditEvent.objects.filter(action="invoice.issue").count() == 1  # September's
    assert dict(InvoiceNumber.objects.values_list("team__name", "last")) == {"team-5": 1}  # the numbers went back


def teams_with_usage(node, month, teams, records_per_team):
    """`teams` new teams, each with a member and two jobs sharing records_per_team records
    released in `month` (the lines stay the same however many records)."""
    for t in range(teams):
        user = make_user(f"u-{month:%m}-{teams}-{records_per_team}-{t}", Team.objects.create(name=f"t-{month:%m}-{teams}-{records_per_team}-{t}"))
        jobs = [new_job(user, f"job-{j}", created_at=month) for j in range(2)]
        for r in range(records_per_team):
            record(
                jobs[r % 2], node, month + timedelta(hours=r + 1), 600, Decimal("2.40"), credit=Decimal("0.10") if r == 0 else Decimal(0), reason="preempted"
            )


def queries_to_issue(year, month):
    with CaptureQueriesContext(connection) as captured:
        made = invoice_service.invoice_month(year, month, now=LATER, chunk=CHUNK)
    assert made
    return len(captured.captured_queries)


CHUNK = 2


def test_the_queries_per_chunk_are_fixed_however_many_teams_and_records(node):
    """N, 2N and 3N teams (N = a chunk), and N teams with five times the records: the month
    costs a fixed number of queries per chunk. (On PostgreSQL the lines go by one COPY, which
    Django's query log does not list; on SQLite by one INSERT while they fit its parameters.)"""
    months = {6: (CHUNK, 4), 7: (2 * CHUNK, 4), 8: (3 * CHUNK, 4), 9: (CHUNK, 20)}
    for number, (teams, records) in months.items():
        teams_with_usage(node, datetime(2026, number, 1, tzinfo=UTC), teams, records)
    one, two, three, more_records = (queries_to_issue(2026, number) for number in months)
    per_chunk = two - one
    assert three - two == per_chunk
    assert more_records == one
    assert per_chunk <= 20  # (one team at a time cost 21 queries a team)
