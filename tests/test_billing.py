import csv
import io
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from django.urls import reverse

from billing.models import NoRateInForce, Rate, UsageRecord
from scheduler.models import Allocation, Node
from tests.conftest import make_job, schedule_now


@pytest.fixture
def node(db):
    return Node.objects.create(name="n1", device_type="cpu", devices=4)


def run_for(job, seconds):
    [allocation] = [a for a in schedule_now() if a.job_id == job.pk]
    ended = allocation.started_at + timedelta(seconds=seconds)
    usage = allocation.release(ended, Allocation.EXITED)
    job.refresh_from_db()
    job.mark_running()
    job.finish("succeeded", at=ended)
    return usage


def test_the_rate_in_force_is_the_latest_effective_one(db):
    now = datetime(2026, 12, 2, tzinfo=UTC)
    Rate.objects.create(gpu_type="", per_gpu_hour=Decimal("1"), effective_from=now - timedelta(days=30))
    Rate.objects.create(gpu_type="", per_gpu_hour=Decimal("2"), effective_from=now - timedelta(days=1))
    Rate.objects.create(gpu_type="", per_gpu_hour=Decimal("3"), effective_from=now + timedelta(days=1))
    Rate.objects.create(gpu_type="H100", per_gpu_hour=Decimal("9"), effective_from=now - timedelta(days=2))
    assert Rate.objects.in_force("cpu", now).per_gpu_hour == 2
    assert Rate.objects.in_force("H100", now).per_gpu_hour == 9
    assert Rate.objects.in_force("cpu", now + timedelta(days=2)).per_gpu_hour == 3
    assert Rate.objects.worst_case(now).per_gpu_hour == 9
    with pytest.raises(NoRateInForce):
        Rate.objects.in_force("cpu", now - timedelta(days=60))


def test_the_worst_case_rate_is_the_highest_latest_rate_of_any_type_in_one_query(db, django_assert_num_queries):
    """A request that takes any type is priced at the dearest type's rate in force: each type's
    latest (an older, higher rate of a type no longer counts), preemptible or not."""
    now = datetime(2026, 12, 2, tzinfo=UTC)
    Rate.objects.create(gpu_type="", per_gpu_hour=Decimal("2"), effective_from=now - timedelta(days=9))
    Rate.objects.create(gpu_type="H100", per_gpu_hour=Decimal("12"), effective_from=now - timedelta(days=9))
    Rate.objects.create(gpu_type="H100", per_gpu_hour=Decimal("5"), preemptible_per_gpu_hour=Decimal("1"), effective_from=now - timedelta(days=1))
    Rate.objects.create(gpu_type="A100", per_gpu_hour=Decimal("4"), preemptible_per_gpu_hour=Decimal("3"), effective_from=now - timedelta(days=2))
    Rate.objects.create(gpu_type="B200", per_gpu_hour=Decimal("30"), effective_from=now + timedelta(days=1))
    with django_assert_num_queries(1):
        assert Rate.objects.worst_case(now).per_gpu_hour == 5
    assert Rate.objects.worst_case(now, preemptible=True).gpu_type == "A100"  # 3 against H100's 1 and the any-type 2
    assert Rate.objects.worst_case(now + timedelta(days=2)).gpu_type == "B200"
    with pytest.raises(NoRateInForce):
        Rate.objects.worst_case(now - timedelta(days=60))


def test_a_usage_record_is_gpus_times_held_seconds_times_rate(alice, rate, node):
    job = make_job(alice, gpus=3)
    usage = run_for(job, 1234)
    assert (usage.gpus, usage.held_seconds, usage.rate) == (3, 1234, Decimal("2.40"))
    assert usage.amount == Decimal("2.468")  # 3 x 1234 x 2.40 / 3600
    assert usage.team == alice.membership.team and usage.job == job


def test_releasing_twice_bills_once(alice, rate, node):
    job = make_job(alice)
    [allocation] = schedule_now()
    assert allocation.release(allocation.started_at + timedelta(seconds=10), Allocation.EXITED) is not None
    assert allocation.release(allocation.started_at + timedelta(seconds=99), Allocation.NODE_LOST) is None
    assert job.usage.get().held_seconds == 10


def test_the_billing_page_lists_jobs_and_the_month_total(client, alice, rate, node):
    run_for(make_job(alice, name="first-run"), 3600)
    run_for(make_job(alice, name="second-run", gpus=2), 1800)
    client.force_login(alice)
    page = client.get(reverse("billing:usage")).content.decode()
    assert "first-run" in page and "second-run" in page
    # Each line: the rate 2.40, the cost 2.40 (1 GPU x 1 h, and 2 GPUs x 0.5 h), billed 2.40.
    assert page.count("USD 2.40<") == 6
    assert 'id="month-total">USD 4.80<' in page
    assert "Holding compute now" not in page


def test_the_month_downloads_as_csv(client, alice, rate, node):
    job = make_job(alice, name="csv-run")
    usage = run_for(job, 7200)
    month = usage.ended_at.strftime("%Y-%m")
    client.force_login(alice)
    response = client.get(reverse("billing:usage_csv") + f"?month={month}")
    assert response["Content-Type"].startswith("text/csv")
    rows = list(csv.DictReader(io.StringIO(response.content.decode())))
    assert rows[0]["job"] == "csv-run" and rows[0]["held_seconds"] == "7200" and rows[0]["amount"] == "4.80"
    assert rows[-1]["job"] == "total" and rows[-1]["amount"] == "4.80"


def test_other_months_are_empty(client, alice, rate, node):
    run_for(make_job(alice), 60)
    client.force_login(alice)
    rows = list(csv.reader(io.StringIO(client.get(reverse("billing:usage_csv") + "?month=2001-01").content.decode())))
    assert len(rows) == 2 and rows[-1][1] == "total" and rows[-1][-2] == "0.00"


def test_a_bad_month_is_a_400(client, alice):
    client.force_login(alice)
    response = client.get(reverse("billing:usage") + "?month=13-2026")
    assert response.status_code == 400 and b"YYYY-MM" in response.content


def test_rates_are_set_in_the_admin(admin_client):
    response = admin_client.post(
        reverse("admin:billing_rate_add"),
        {"gpu_type": "H100", "per_gpu_hour": "3.25", "effective_from_0": "2026-12-01", "effective_from_1": "00:00:00"},
    )
    assert response.status_code == 302
    assert Rate.objects.get().per_gpu_hour == Decimal("3.25")


def test_the_ledger_cannot_be_edited_in_the_admin(admin_client, alice, rate, node):
    usage = run_for(make_job(alice), 60)
    assert admin_client.get(reverse("admin:billing_usagerecord_change", args=[usage.pk])).status_code in (200, 403)
    response = admin_client.post(reverse("admin:billing_usagerecord_change", args=[usage.pk]), {"held_seconds": 1})
    assert response.status_code == 403
    usage.refresh_from_db()
    assert usage.held_seconds == 60


def test_a_job_s_name_and_team_are_not_changed_in_the_admin(admin_client, alice, rate, node):
    """What its statements and invoices bill it as (a worker keeps a month's statement while
    the ledger does not move: billing.usage.month_of)."""
    job = make_job(alice, name="billed-as")
    page = admin_client.get(reverse("admin:jobs_job_change", args=[job.pk])).content.decode()
    assert "billed-as" in page and 'name="name"' not in page and 'name="team"' not in page
    adding = admin_client.get(reverse("admin:jobs_job_add")).content.decode()
    assert 'name="name"' in adding and 'name="team"' in adding


def test_no_rate_is_written_in_code():
    """Rates come from the operator: no number in billing code stands for a price."""
    import pathlib
    import re

    for path in pathlib.Path("billing").glob("*.py"):
        text = path.read_text()
        assert not re.search(r"per_gpu_hour\s*=\s*Decimal\(\"\d", text), path


def test_credits_are_shown_and_taken_off_the_total(client, alice, rate, node):
    from jobs.models import Checkpoint

    job = make_job(alice, name="lost-run")
    [allocation] = schedule_now()
    Checkpoint.objects.create(
        job=job,
        allocation=allocation,
        name="c.pt",
        step=1,
        key="k",
        size=1,
        sha256="0" * 64,
        written_at=allocation.started_at + timedelta(seconds=1800),
    )
    allocation.release(allocation.started_at + timedelta(hours=1), Allocation.NODE_LOST)
    usage = UsageRecord.objects.get(allocation=allocation)
    assert usage.amount == Decimal("2.40") and usage.credit_amount == Decimal("1.20") and usage.credit_seconds == 1800
    client.force_login(alice)
    month = allocation.ended_at.strftime("%Y-%m")
    page = client.get(f"/billing/?month={month}").content.decode()
    assert 'id="month-credits">−USD 1.20<' in page and 'id="month-total">USD 1.20<' in page
    rows = list(csv.DictReader(io.StringIO(client.get(f"/billing/usage.csv?month={month}").content.decode())))
    assert rows[0]["amount"] == "2.40" and rows[0]["credit"] == "1.20" and rows[0]["billed"] == "1.20"
    assert rows[-1]["billed"] == "1.20"
    data = client.get(f"/api/usage/?month={month}").json()
    assert data["total"] == "1.20" and data["credits"] == "1.20" and data["records"][0]["credit_seconds"] == 1800


# A month's records and statement are kept by each worker while its counts of final records and
# credits stay the same (billing.usage.month_of): the ledger is append-only.


def month_reads(client, month):
    """The usage endpoint's answer, and whether it read the month's records (their jobs' names)
    or their times."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    with CaptureQueriesContext(connection) as captured:
        data = client.get(f"/api/usage/?month={month}").json()
    read = [q["sql"] for q in captured.captured_queries if '"jobs_job"."name"' in q["sql"] or '"billing_usagerecord"."started_at" AS' in q["sql"]]
    return data, bool(read)


def test_an_unchanged_month_is_not_read_again_and_a_new_record_or_credit_is_seen_at_once(client, alice, charlie, rate, node):
    from billing import meter
    from billing.models import Credit

    first = run_for(make_job(alice, name="first-run"), 3600)
    month = first.ended_at.strftime("%Y-%m")
    client.force_login(alice)
    data, read = month_reads(client, month)
    assert read and [line["job"] for line in data["lines"]] == ["first-run"] and data["total"] == "2.40"
    again, read = month_reads(client, month)
    assert not read and again == data
    # A job still running has a provisional record: not the ledger's, nothing moves.
    make_job(alice, name="running")
    [allocation] = schedule_now()
    assert UsageRecord.ledger.filter(allocation=allocation, provisional=True).exists()
    assert not month_reads(client, month)[1]
    # A record made final (in the same month as the first): the month is read again.
    second = allocation.release(first.ended_at, Allocation.EXITED)
    total = meter.round_money(first.amount) + meter.round_money(second.amount)
    data, read = month_reads(client, month)
    assert read and sorted(line["job"] for line in data["lines"]) == ["first-run", "running"] and data["total"] == str(total)
    # A credit, the records unchanged: read again.
    Credit.objects.create(team=first.team, job=first.job, usage=first, seconds=600, amount=Decimal("0.40"), reason="node lost")
    data, read = month_reads(client, month)
    assert read and data["credits"] == "0.40" and data["total"] == str(total - Decimal("0.40"))
    assert month_reads(client, month) == (data, False)
    # Another team's month is its own.
    client.force_login(charlie)
    data, read = month_reads(client, month)
    assert read and data["lines"] == [] and data["total"] == "0.00"


def test_a_worker_keeps_recent_months_up_to_their_weight_and_lets_the_oldest_go():
    """A month weighs its records and one more (its own cost)."""
    from billing.statements import statement
    from billing.usage import Month, _Kept

    def month(n):
        return Month(tuple(range(n)), statement([]))

    kept = _Kept(most=7)
    kept.put("a", (3, 0), month(3))
    kept.put("b", (2, 0), month(2))  # 4 + 3
    assert kept.get("a", (3, 0)) is not None and kept.get("a", (3, 1)) is None  # a credit since
    kept.put("c", (2, 0), month(2))  # 10: b, the least recently used, goes
    assert kept.get("b", (2, 0)) is None and kept.get("a", (3, 0)) and kept.get("c", (2, 0))
    kept.put("a", (7, 0), month(7))  # a month weighing more than 7 is not kept, nor its old counts
    assert kept.get("a", (3, 0)) is None and kept.get("a", (7, 0)) is None and kept.get("c", (2, 0))
    kept.put("d", (4, 0), month(4))  # 3 + 5: c goes
    assert kept.get("c", (2, 0)) is None and kept.get("d", (4, 0))


def test_a_month_with_no_records_or_read_in_a_transaction_that_rolls_back_is_not_kept(client, alice, rate, node):
    """Asking for every empty month must not fill a worker; and what a transaction read and
    then rolled back must not stand for the month once the same counts are reached for real."""
    from django.db import transaction

    from billing.usage import month_of

    client.force_login(alice)
    assert month_reads(client, "2001-01")[1] and month_reads(client, "2001-01")[1]
    team = alice.membership.team
    rolled_back, committed = make_job(alice, name="rolled-back"), make_job(alice, name="committed")

    class Undo(Exception):
        pass

    with pytest.raises(Undo), transaction.atomic():
        usage = run_for(rolled_back, 600)
        year, month = usage.ended_at.year, usage.ended_at.month
        assert [line.job_name for line in month_of(team, year, month).statement.lines] == ["rolled-back"]
        raise Undo
    run_for(committed, 600)
    assert [line.job_name for line in month_of(team, year, month).statement.lines] == ["committed"]
