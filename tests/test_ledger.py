"""The usage ledger: a provisional record while an allocation runs, made final (and from then on
immutable) when it is released; credits as records of their own; usage released into a month
already invoiced is billed in the next open month; two schedulers cannot pass a budget together."""

from datetime import UTC, datetime, timedelta
from datetime import timezone as dt_timezone
from decimal import Decimal

import pytest
from django.utils import timezone

from agent.runner import Runner
from billing import budget_service, invoice_service, meter, statements
from billing.models import Credit, Invoice, LedgerImmutable, Rate, UsageRecord, billing_month, open_month
from jobs.models import Checkpoint
from scheduler import holds, services
from scheduler.models import Allocation, Node
from scheduler.policy import Placement
from tests.conftest import make_job, schedule_now

D = Decimal
UTC = UTC


@pytest.fixture
def node(db):
    return Node.objects.create(name="n1", device_type="cpu", devices=4)


def test_a_running_allocation_has_a_provisional_record_that_the_bill_leaves_out(alice, team_a, rate, node):
    job = make_job(alice)
    [allocation] = schedule_now()
    record = UsageRecord.ledger.get(allocation=allocation)
    assert record.provisional and record.held_seconds == 0 and record.amount == 0
    assert record.rate == allocation.rate and record.gpus == 1 and record.job_id == job.pk
    # Not billed while provisional: not in the ledger as billed, the statement or the month's spend.
    assert not UsageRecord.objects.filter(allocation=allocation).exists()
    now = timezone.now()
    assert statements.statement([]).total == invoice_service.statement(team_a, now.year, now.month).total
    assert budget_service.month_spend([team_a.pk], now)[str(team_a.pk)].released == 0

    # The heartbeat brings it up to date: the live meter's figure is in the ledger.
    later = allocation.started_at + timedelta(seconds=90)
    Allocation.bring_usage_up_to_date(node.pk, later)
    record.refresh_from_db()
    assert record.provisional and record.held_seconds == 90 and record.ended_at == later
    assert record.amount == allocation.meter(later)[1] == D("0.06")  # 90 s x 2.40/h

    # Released: the same row, final, with the exact figures; it never changes again.
    usage = allocation.release(allocation.started_at + timedelta(seconds=120), Allocation.EXITED)
    assert usage.pk == record.pk and not usage.provisional and usage.held_seconds == 120
    assert UsageRecord.ledger.filter(job=job).count() == 1
    usage.amount = D("0")
    with pytest.raises(LedgerImmutable):
        usage.save()
    with pytest.raises(LedgerImmutable):
        usage.delete()
    with pytest.raises(LedgerImmutable):
        UsageRecord.objects.filter(pk=usage.pk).update(amount=0)
    Allocation.bring_usage_up_to_date(node.pk)  # nothing running: the final record is left alone
    assert UsageRecord.objects.get(pk=usage.pk).held_seconds == 120


def test_the_runner_s_heartbeat_brings_provisional_records_up_to_date(alice, rate, tmp_path):
    runner = Runner(name="beat-node", devices=1, work_dir=tmp_path / "runs", device_type="cpu")
    runner.register()
    make_job(alice)
    [allocation] = schedule_now(timezone.now() - timedelta(seconds=30))
    runner.heartbeat()
    record = UsageRecord.ledger.get(allocation=allocation)
    assert record.provisional and 30 <= record.held_seconds <= 40


def test_a_credit_is_a_record_of_its_own(alice, team_a, rate, node):
    job = make_job(alice)
    [allocation] = schedule_now()
    Checkpoint.objects.create(
        job=job,
        allocation=allocation,
        name="step-1.pt",
        step=1,
        key="k",
        size=1,
        sha256="0" * 64,
        written_at=allocation.started_at + timedelta(seconds=400),
    )
    usage = allocation.release(allocation.started_at + timedelta(seconds=600), Allocation.NODE_LOST)
    [credit] = Credit.objects.filter(job=job)
    assert (credit.usage_id, credit.team_id, credit.seconds) == (usage.pk, team_a.pk, 200)
    assert credit.amount == meter.charge(1, 200, D("2.40"))
    assert credit.period == usage.period and "node lost" in credit.reason
    assert usage.amount == D("0.4")  # the usage record holds what was held; the credit gives part back
    assert job.credited() == (200, credit.amount)
    with pytest.raises(LedgerImmutable):
        credit.save()
    with pytest.raises(LedgerImmutable):
        credit.delete()
    with pytest.raises(LedgerImmutable):
        Credit.objects.filter(pk=credit.pk).update(amount=0)
    # On the statement: a line billed less its credit.
    now = timezone.now()
    document = invoice_service.statement(team_a, now.year, now.month)
    assert [line.kind for line in document.lines][:2] == ["usage", "credit"]
    assert document.total == D("0.40") - D("0.13")


def test_the_billing_month_is_utc():
    assert billing_month(datetime(2026, 11, 30, 23, 59, tzinfo=UTC)) == datetime(2026, 11, 1).date()
    assert billing_month(datetime(2026, 12, 1, 0, 30, tzinfo=dt_timezone(timedelta(hours=2)))) == datetime(2026, 11, 1).date()


def test_usage_released_into_a_month_already_invoiced_is_billed_in_the_next_one(alice, team_a, node):
    Rate.objects.create(gpu_type="", per_gpu_hour=D("3.60"), effective_from=datetime(2026, 10, 1, tzinfo=UTC))
    november = datetime(2026, 11, 30, 23, 0, tzinfo=UTC)
    make_job(alice, name="done in november")
    [first] = schedule_now(november)
    first.release(november + timedelta(seconds=100), Allocation.EXITED)
    late = make_job(alice, name="lost node")
    [allocation] = schedule_now(november + timedelta(seconds=200))
    assert allocation.job_id == late.pk
    # November is invoiced on 1 December, before the scheduler notices the lost node, whose
    # allocation ends at its last heartbeat: in November.
    [invoice] = invoice_service.invoice_month(2026, 11, now=datetime(2026, 12, 1, 0, 1, tzinfo=UTC))
    assert invoice.total == D("0.10") and [line.job_name for line in invoice.lines.filter(kind="usage")] == ["done in november"]
    assert open_month(team_a.pk, november) == datetime(2026, 12, 1).date()
    usage = allocation.release(november + timedelta(seconds=300), Allocation.NODE_LOST)
    assert usage.ended_at.month == 11 and usage.period == datetime(2026, 12, 1).date()
    assert {c.period for c in Credit.objects.filter(usage=usage)} <= {usage.period}
    # The issued invoice did not change; December's bill holds the late usage.
    invoice.refresh_from_db()
    assert invoice.total == D("0.10")
    december = invoice_service.statement(team_a, 2026, 12)
    assert [line.job_name for line in december.lines if line.kind == "usage"] == ["lost node"]
    assert december.subtotal == D("0.10")  # 100 s at 3.60/h
    # Nothing is billed twice nor left out: the two months' usage lines hold every record.
    assert UsageRecord.objects.filter(team=team_a).count() == 2


def test_two_schedulers_cannot_together_pass_a_budget(alice, team_a, rate, node):
    team_a.monthly_budget = D("5")
    team_a.save()
    first = make_job(alice, name="first", span_hours=D("1"))  # worst case 2.40
    second = make_job(alice, name="second", span_hours=D("1"))  # 2.40 more: 4.80 of 5 fits
    third = make_job(alice, name="third", span_hours=D("1"))  # 7.20 would not
    # Each scheduler planned alone, before the other's jobs started: each would start all it saw.
    assert holds.budget_holds([(str(first.pk), "cpu"), (str(second.pk), "cpu")], timezone.now()) == {}
    assert services.place(Placement(str(first.pk), str(node.pk), (0,))) is not None
    assert services.place(Placement(str(second.pk), str(node.pk), (1,))) is not None
    # The second scheduler's plan for the third job is stale: placing it checks the budget again.
    assert services.place(Placement(str(third.pk), str(node.pk), (2,))) is None
    third.refresh_from_db()
    assert third.state == "queued" and "past the team's budget of USD 5.00" in third.wait_reason
    assert not Invoice.objects.exists()
