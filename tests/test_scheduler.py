from datetime import timedelta
from decimal import Decimal

import pytest
from django.core.management import call_command
from django.utils import timezone

from billing.models import Rate, UsageRecord
from scheduler import allocations as ending
from scheduler import services
from scheduler.models import Allocation, Node
from tests.conftest import make_job, schedule_now


@pytest.fixture
def node(db):
    return Node.objects.create(name="n1", device_type="cpu", devices=2)


def test_a_queued_job_is_placed_and_the_meter_starts(alice, rate, node):
    job = make_job(alice)
    [allocation] = schedule_now()
    job.refresh_from_db()
    assert job.state == "starting"
    assert allocation.devices == [0] and allocation.node == node
    assert allocation.rate == Decimal("2.40")
    assert allocation.limit_seconds == 3600  # the job's span of 1 h
    starting = job.timeline().last()
    assert starting.data["state"] == "starting" and starting.at == allocation.started_at


def test_devices_are_never_handed_out_twice(alice, rate, node):
    jobs = [make_job(alice, name=f"j{i}") for i in range(3)]
    schedule_now()
    schedule_now()
    allocations = list(Allocation.objects.all())
    assert len(allocations) == 2
    assert sorted(d for a in allocations for d in a.devices) == [0, 1]
    jobs[2].refresh_from_db()
    assert jobs[2].state == "queued" and "waiting for 1 device" in jobs[2].wait_reason


def test_placing_rechecks_the_node_under_its_lock(alice, rate, node):
    """A placement planned from a stale view (another scheduler took the device) is dropped."""
    from scheduler.policy import Placement

    first, second = make_job(alice, name="a"), make_job(alice, name="b")
    assert services.place(Placement(str(first.pk), str(node.pk), (0,))) is not None
    assert services.place(Placement(str(second.pk), str(node.pk), (0,))) is None
    second.refresh_from_db()
    assert second.state == "queued"


def test_nodes_that_stopped_heartbeating_get_nothing(alice, rate, node, settings):
    Node.objects.filter(pk=node.pk).update(last_heartbeat=timezone.now() - timedelta(seconds=settings.E31_NODE_TIMEOUT_SECONDS + 5))
    job = make_job(alice)
    assert schedule_now() == []
    job.refresh_from_db()
    assert "none is online" in job.wait_reason


def test_without_a_rate_a_job_waits_with_the_reason(alice, node):
    job = make_job(alice)
    assert schedule_now() == []
    job.refresh_from_db()
    assert job.state == "queued" and "No rate is in force" in job.wait_reason


def test_an_allocation_keeps_the_rate_in_force_when_it_started(alice, rate, node):
    make_job(alice)
    [allocation] = schedule_now()
    Rate.objects.create(gpu_type="", per_gpu_hour=Decimal("99"), effective_from=timezone.now())
    usage = allocation.release(allocation.started_at + timedelta(seconds=90), Allocation.EXITED)
    assert usage.rate == Decimal("2.40") and usage.amount == Decimal("0.06")


def test_a_lost_node_s_allocations_end_at_its_last_heartbeat_and_jobs_requeue(alice, rate, node, settings):
    job = make_job(alice)
    [allocation] = schedule_now()
    last_heard = allocation.started_at + timedelta(seconds=40)
    Node.objects.filter(pk=node.pk).update(last_heartbeat=last_heard)
    assert ending.expire_lost_nodes(now=last_heard + timedelta(seconds=settings.E31_NODE_TIMEOUT_SECONDS + 1)) == 1
    allocation.refresh_from_db()
    job.refresh_from_db()
    assert allocation.ended_at == last_heard and allocation.end_reason == "node_lost"
    assert UsageRecord.objects.get(allocation=allocation).held_seconds == 40
    assert job.state == "queued" and job.restarts == 1
    assert "was lost" in job.timeline().last().data["reason"]


def test_no_node_is_declared_lost_until_the_runners_have_had_time_to_beat_after_a_database_outage(alice, rate, node, settings):
    """The scheduler could not reach the database (nor could the runners): silence during it is
    not a lost node. tests/test_outages.py takes PostgreSQL away from the whole system."""
    make_job(alice)
    [allocation] = schedule_now()
    timeout = timedelta(seconds=settings.E31_NODE_TIMEOUT_SECONDS)
    last_heard = allocation.started_at
    Node.objects.filter(pk=node.pk).update(last_heartbeat=last_heard)
    back = last_heard + timeout * 2  # the database was away until here
    assert ending.expire_lost_nodes(now=back + timedelta(seconds=1), last_failure_at=back) == 0
    assert ending.expire_lost_nodes(now=back + timeout - timedelta(seconds=1), last_failure_at=back) == 0
    assert ending.expire_lost_nodes(now=back + timeout, last_failure_at=back) == 1  # still silent: lost


def test_a_requeued_job_only_has_what_is_left_of_its_span_less_what_was_credited(alice, rate, node):
    from jobs.models import Checkpoint

    job = make_job(alice, span_hours=Decimal("0.5"))
    [first] = schedule_now()
    Checkpoint.objects.create(
        job=job,
        allocation=first,
        name="step-1.pt",
        step=1,
        key="k",
        size=1,
        sha256="0" * 64,
        written_at=first.started_at + timedelta(seconds=400),
    )
    first.release(first.started_at + timedelta(seconds=600), Allocation.NODE_LOST)
    usage = UsageRecord.objects.get(allocation=first)
    assert usage.held_seconds == 600 and usage.credit_seconds == 200  # lost since the checkpoint
    job.refresh_from_db()
    job.requeue("requeued: test")
    [second] = schedule_now()
    assert second.limit_seconds == 1800 - 400  # the credited 200 s are given back


def test_a_money_ceiling_becomes_a_time_limit_and_a_cap(alice, rate, node):
    make_job(alice, span_hours=None, ceiling_amount=Decimal("1.20"))
    [allocation] = schedule_now()
    assert allocation.limit_seconds == 1800  # 1.20 at 2.40 per hour on 1 GPU
    assert allocation.cost_cap == Decimal("1.20")


def test_not_before_holds_a_job_back(alice, rate, node):
    job = make_job(alice, not_before=timezone.now() + timedelta(hours=1))
    assert schedule_now() == []
    job.refresh_from_db()
    assert job.wait_reason.startswith("not before")


def test_a_job_cancelled_while_its_node_was_lost_ends_cancelled(alice, rate, node):
    job = make_job(alice)
    [_allocation] = schedule_now()
    job.request_cancel()
    ending.release_node(node, at=timezone.now(), reason=Allocation.NODE_LOST, why="test")
    job.refresh_from_db()
    assert job.state == "cancelled"


def test_the_scheduler_command_lines_jobs_up_then_places_them_once_staged(alice, rate, node):
    from scheduler.models import Staging

    job = make_job(alice)
    call_command("scheduler", "--once")
    job.refresh_from_db()
    assert job.state == "queued" and job.stagings.get().state == "waiting"
    assert job.wait_reason == "waiting for n1 to stage its data"
    Staging.objects.update(state=Staging.STAGED)
    call_command("scheduler", "--once")
    job.refresh_from_db()
    assert job.state == "starting"


def test_uploads_of_refused_forms_are_purged_after_a_while(alice, storage_dir):
    from jobs.models import Upload
    from tests.conftest import upload

    old = upload(alice.membership.team, alice, Upload.CODE, "old.py", b"x")
    Upload.objects.filter(pk=old.pk).update(created_at=timezone.now() - timedelta(days=3))
    upload(alice.membership.team, alice, Upload.CODE, "fresh.py", b"y")
    job = make_job(alice)  # its uploads are claimed: never purged, however old
    job.uploads.update(created_at=timezone.now() - timedelta(days=30))
    assert Upload.purge_unclaimed(timezone.now() - timedelta(days=2)) == 1
    assert set(Upload.objects.values_list("name", flat=True)) == {"fresh.py", "train.py"}


def test_the_scheduler_cycle_purges_unclaimed_uploads(alice, storage_dir):
    from jobs.models import Upload
    from tests.conftest import upload

    old = upload(alice.membership.team, alice, Upload.CODE, "old.py", b"x")
    Upload.objects.filter(pk=old.pk).update(created_at=timezone.now() - timedelta(days=3))
    call_command("scheduler", "--once")
    assert not Upload.objects.filter(pk=old.pk).exists()


def test_the_scheduler_gives_up_dataset_uploads_left_for_days(alice):
    from catalog import datasets
    from catalog.models import DatasetUpload

    dataset = datasets.create_upload_dataset(alice.membership.team, "half")
    version, _ = datasets.open_version(dataset)
    upload = datasets.start_upload(version, "big.bin", 20 * 1024 * 1024)
    DatasetUpload.objects.filter(pk=upload.pk).update(updated_at=timezone.now() - timedelta(days=3))
    call_command("scheduler", "--once")
    upload.refresh_from_db()
    assert upload.state == "aborted"


def test_an_idle_cycle_reads_the_queue_and_nothing_more(alice, rate, node):
    """With nothing queued, lining up and scheduling read whether anything waits (and settle
    smoke runs), not the nodes, the running allocations, the teams' usage or their shares: the
    scheduler runs this every second however quiet the network is. A queued job is still placed."""
    import re

    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    with CaptureQueriesContext(connection) as queries:
        assert services.line_up() == [] and services.schedule() == []
    # The tables the queries select rows of (their first column's)
    tables = {found.group(1) for q in queries if (found := re.match(r'SELECT (?:DISTINCT )?"(\w+)"\.', q["sql"]))}
    assert not tables & {"scheduler_allocation", "billing_usagerecord", "accounts_team"}, tables
    assert len(queries) <= 6, [q["sql"][:120] for q in queries]
    job = make_job(alice)
    [allocation] = schedule_now()
    assert allocation.job_id == job.pk
