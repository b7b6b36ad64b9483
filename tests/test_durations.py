"""Learned durations (issue 25): a queued job's expected hold comes from its team's earlier runs
of the same work, never past its declared limit, learned once per job."""

from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest

from billing import meter
from billing.models import UsageRecord
from jobs import durations
from jobs.models import Job
from scheduler import services
from scheduler.models import Allocation, Node
from tests.conftest import make_job

STARTED = datetime(2026, 11, 3, tzinfo=UTC)


@pytest.mark.nodb
def test_the_learned_duration_is_a_high_quantile_of_the_last_runs_and_never_past_the_limit():
    assert durations.learned_seconds([600.0]) is None  # one run says too little
    assert durations.learned_seconds([600.0, 700.0, 800.0]) == pytest.approx(760.0)  # 0.8 quantile
    many = [10_000.0] * 5 + [100.0] * durations.KEPT  # only the last KEPT count
    assert durations.learned_seconds(many) == pytest.approx(100.0)
    assert durations.expected_seconds(3600.0, None) == 3600.0  # nothing learned: the declared limit
    assert durations.expected_seconds(3600.0, 760.0) == 760.0
    assert durations.expected_seconds(500.0, 760.0) == 500.0  # never past the limit
    assert durations.expected_seconds(3600.0, 760.0, held_before=740.0) == 60.0  # requeued: what is left, a minute at least
    same = {"name": "n", "code": "abc", "config": {"a": 1, "b": 2}, "hyperparameters": {}, "args": [], "gpus": 1}
    assert durations.work_key(**same) == durations.work_key(**{**same, "config": {"b": 2, "a": 1}})
    for change in ({"name": "m"}, {"code": "abd"}, {"config": {"a": 2}}, {"args": ["--x"]}, {"gpus": 2}):
        assert durations.work_key(**same) != durations.work_key(**{**same, **change})
    assert durations.accuracy([(120.0, 100.0), (100.0, 100.0), (300.0, 100.0)]) == (pytest.approx(1.2), pytest.approx(2.64))
    assert durations.accuracy([]) is None


def ran(user, node, held, **fields):
    job = make_job(user, name="digits", span_hours=Decimal("10"), **fields)
    allocation = Allocation.objects.create(
        job=job, node=node, devices=[0], device_type="cpu", rate=Decimal("2.40"), started_at=STARTED, ended_at=STARTED + timedelta(seconds=held)
    )
    UsageRecord.objects.create(
        team=job.team, job=job, allocation=allocation, gpu_type="cpu", gpus=1, started_at=STARTED, ended_at=STARTED + timedelta(seconds=held),
        held_seconds=held, rate=Decimal("2.40"), amount=meter.charge(1, held, Decimal("2.40")),
    )  # fmt: skip
    Job.objects.filter(pk=job.pk).update(state="succeeded", finished_at=STARTED + timedelta(seconds=held))
    return job


@pytest.mark.django_db
def test_a_queued_job_is_expected_to_hold_what_the_same_work_held_before(alice, rate, django_assert_max_num_queries):
    node = Node.objects.create(name="n", device_type="cpu", devices=4)
    for held in (600, 700, 800):
        ran(alice, node, held, config={"epochs": 3})
    ran(alice, node, 5000, config={"epochs": 30})  # other work: not counted
    again = make_job(alice, name="digits", span_hours=Decimal("10"), config={"epochs": 3})
    other = make_job(alice, name="digits", span_hours=Decimal("10"), config={"epochs": 300})
    expected = {q.id: q.expected_seconds for q in services.queued_jobs(staged=False)}
    assert expected[str(again.pk)] == pytest.approx(760.0)  # learned from 3 runs
    assert expected[str(other.pk)] == 36000.0  # never ran: its declared span
    again.refresh_from_db()
    assert (again.learned_seconds, again.learned_from) == (pytest.approx(760.0), 3)
    # Learned once: the next cycles read no history.
    with django_assert_max_num_queries(12) as seen:
        services.queued_jobs(staged=False)
    assert not any("usagerecord" in q["sql"].lower() for q in seen.captured_queries)


@pytest.mark.django_db
def test_the_job_page_says_what_was_learned(client, alice, rate):
    node = Node.objects.create(name="n", device_type="cpu", devices=4)
    for held in (600, 700, 800):
        ran(alice, node, held)
    again = make_job(alice, name="digits", span_hours=Decimal("10"))
    services.queued_jobs(staged=False)
    Job.objects.filter(pk=again.pk).update(wait_reason="waiting for 1 device")
    client.force_login(alice)
    page = client.get(f"/jobs/{again.pk}/").content.decode()
    assert 'id="learned-duration"' in page and "learned from 3 earlier runs of the same work" in page


@pytest.mark.django_db
def test_the_job_list_says_how_well_the_learned_durations_foretold_the_jobs(client, alice, rate):
    node = Node.objects.create(name="n", device_type="cpu", devices=4)
    for held, learned in ((600, 660.0), (1000, 900.0), (500, 1000.0)):
        job = ran(alice, node, held)
        Job.objects.filter(pk=job.pk).update(learned_seconds=learned, learned_from=2)
    client.force_login(alice)
    page = client.get("/jobs/").content.decode()
    # Ratios 1.1, 0.9 and 2.0: median 1.10, 90th percentile 1.82.
    assert "the last 3 such jobs held: median 1.10x, 90th percentile 1.82x" in page


@pytest.mark.nodb
def test_runs_of_the_same_work_that_disagree_teach_nothing():
    assert durations.learned_seconds([100.0, 250.0]) == pytest.approx(220.0)  # within AGREE: learned
    assert durations.learned_seconds([100.0, 1000.0]) is None  # 10x apart: one figure would mislead
    assert durations.learned_seconds([1000.0] * 3 + [100.0] * durations.KEPT) == pytest.approx(100.0)  # the kept runs agree
