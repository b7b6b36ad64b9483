"""The scheduler's policy over the database: fair share between teams, deadlines flagged,
predicted starts for the queue and for a request as filled in on the form."""

from datetime import timedelta
from decimal import Decimal

import pytest
from django.urls import reverse
from django.utils import timezone

from billing.models import UsageRecord
from jobs.models import Job
from scheduler import predictions
from scheduler.models import Allocation, Node
from tests.conftest import make_job, schedule_now

pytestmark = pytest.mark.django_db


@pytest.fixture
def node(db):
    return Node.objects.create(name="n1", device_type="cpu", devices=1)


def heavy_usage(team, job, hours):
    """Usage a team had yesterday (a released allocation and its record)."""
    node = Node.objects.create(name=f"old-{team.pk}", device_type="cpu", devices=8, stopped_at=timezone.now())
    ended = timezone.now() - timedelta(hours=1)
    allocation = Allocation.objects.create(
        job=job,
        node=node,
        devices=list(range(8)),
        device_type="cpu",
        rate=Decimal("1"),
        started_at=ended - timedelta(hours=hours),
        ended_at=ended,
        end_reason="exited",
        launched_at=ended - timedelta(hours=hours),
    )
    UsageRecord.objects.create(
        team=team,
        job=job,
        allocation=allocation,
        gpu_type="cpu",
        gpus=8,
        started_at=allocation.started_at,
        ended_at=ended,
        held_seconds=hours * 3600,
        rate=Decimal("1"),
        amount=Decimal(8 * hours),
    )


def test_a_team_that_used_a_lot_yields_to_one_that_did_not(alice, charlie, rate, node, team_a):
    past = make_job(alice, name="yesterday")
    Job.objects.filter(pk=past.pk).update(state="succeeded")
    heavy_usage(team_a, past, hours=20)
    first = make_job(alice, name="a-first")  # submitted earlier
    second = make_job(charlie, name="b-second")
    [allocation] = schedule_now()
    assert allocation.job_id == second.pk
    first.refresh_from_db()
    assert first.state == "queued" and first.wait_reason


def test_without_usage_the_earlier_job_goes_first(alice, charlie, rate, node):
    first = make_job(alice, name="a-first")
    make_job(charlie, name="b-second")
    [allocation] = schedule_now()
    assert allocation.job_id == first.pk


def test_a_deadline_that_can_no_longer_be_met_is_flagged_once_and_the_team_told(alice, rate, node):
    job = make_job(alice, span_hours=Decimal("2"), deadline=timezone.now() + timedelta(hours=1))
    schedule_now()
    schedule_now()
    job.refresh_from_db()
    assert job.deadline_missed_at is not None
    notices = [e.data["text"] for e in job.events.filter(kind="notice")]
    assert sum("can no longer be met" in n for n in notices) == 1
    assert job.state == "starting"  # it still runs: nothing else wanted the node


def test_queued_jobs_get_a_predicted_start_and_finish(alice, rate, node):
    running = make_job(alice, name="running", span_hours=Decimal("1"))
    schedule_now()
    waiting = make_job(alice, name="waiting", span_hours=Decimal("2"))
    schedule_now()
    assert predictions.update_predictions() >= 1
    waiting.refresh_from_db()
    started = running.allocations.get().started_at
    assert abs((waiting.predicted_start - (started + timedelta(hours=1))).total_seconds()) < 5
    assert abs((waiting.predicted_finish - waiting.predicted_start).total_seconds() - 7200) < 5
    from django.test import Client

    client = Client()
    client.force_login(alice)
    page = client.get(reverse("jobs:detail", args=[waiting.pk])).content.decode()
    assert 'id="prediction"' in page


def test_the_form_predicts_the_request_and_warns_of_an_infeasible_deadline(client, alice, rate, node):
    make_job(alice, name="running", span_hours=Decimal("3"))
    schedule_now()
    client.force_login(alice)
    soon = (timezone.now() + timedelta(hours=2)).strftime("%Y-%m-%dT%H:%M")
    fields = {"gpus": "1", "mode": "span", "span_hours": "1"}
    body = client.post(reverse("jobs:estimate"), fields).content.decode()
    assert 'id="prediction"' in body and "Predicted start" in body and 'id="deadline-warning"' not in body
    body = client.post(reverse("jobs:estimate"), {**fields, "deadline": soon}).content.decode()
    assert 'id="deadline-warning"' in body and "looks infeasible" in body  # it waits 3 h behind the running job
    later = (timezone.now() + timedelta(hours=6)).strftime("%Y-%m-%dT%H:%M")
    body = client.post(reverse("jobs:estimate"), {**fields, "deadline": later}).content.decode()
    assert 'id="deadline-warning"' not in body


def test_the_team_share_is_the_operator_s_to_set(alice, charlie, rate, node, team_a, team_b):
    """With equal usage, the team with the larger share goes first."""
    team_b.share = 4
    team_b.save()
    for team, user in ((team_a, alice), (team_b, charlie)):
        past = make_job(user, name="past")
        Job.objects.filter(pk=past.pk).update(state="succeeded")
        heavy_usage(team, past, hours=5)
    make_job(alice, name="a-first")
    second = make_job(charlie, name="b-second")
    [allocation] = schedule_now()
    assert allocation.job_id == second.pk


def test_the_job_list_shows_the_prediction_and_a_missed_deadline(client, alice, rate, node):
    make_job(alice, name="running", span_hours=Decimal("1"))
    schedule_now()
    waiting = make_job(alice, name="waiting", span_hours=Decimal("2"), deadline=timezone.now() + timedelta(minutes=90))
    schedule_now()
    predictions.update_predictions()
    waiting.refresh_from_db()
    client.force_login(alice)
    page = client.get(reverse("jobs:list")).content.decode()
    assert f"starts about {timezone.localtime(waiting.predicted_start):%m-%d %H:%M}" in page
    assert "deadline can no longer be met" in page
