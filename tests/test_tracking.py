"""The team's experiment tracker: each job sent to a real MLflow tracking server (tests/mlflow_server.py)
as a run, with its parameters, every metric point exactly once and its cost; through an outage of
the server and a reply lost after the server took a batch, nothing lost and nothing doubled; the
tracker's address under the network's policy, its token sealed and never shown back."""

import json
import math
import threading
import time
from datetime import timedelta
from decimal import Decimal

import httpx
import pytest
from django.urls import reverse
from django.utils import timezone

from billing.models import UsageRecord
from core import endpoints
from jobs import states
from jobs.models import Job, JobEvent
from scheduler.allocations import end_allocation
from scheduler.models import Allocation, Node
from tests.conftest import make_job, schedule_now
from tests.mlflow_server import mlflow_server  # noqa: F401 - the fixture
from tracking import batches
from tracking import worker as tracking_worker
from tracking.batches import Point
from tracking.models import TrackedRun, Tracker
from tracking.worker import Worker

TOKEN = "mlflow-token-zanzibar-7f3a"


# The decisions, over plain data -------------------------------------------------------------------


def points_of(*sizes, start=1):
    """Points of consecutive events (seq start, start+1, ...), each with `size` points."""
    return [Point(seq, f"m{i}", float(i), 1000 + seq, seq) for seq, size in enumerate(sizes, start) for i in range(size)]


@pytest.mark.nodb
def test_a_batch_takes_whole_events_up_to_a_thousand_points():
    points = points_of(400, 400, 400, 10)
    first = batches.next_batch(points, cursor=0)
    assert len(first.points) == 800 and first.cursor == 2 and first.partial == 0
    rest = [p for p in points if p.seq > first.cursor]
    second = batches.next_batch(rest, cursor=first.cursor)
    assert len(second.points) == 410 and second.cursor == 4 and second.partial == 0
    assert batches.next_batch([], cursor=4) == batches.Batch([], 4, 0)


@pytest.mark.nodb
def test_an_event_larger_than_a_batch_goes_in_parts_and_the_cursor_counts_them():
    points = points_of(2500, 3)
    sent, cursor, partial = [], 0, 0
    while True:
        batch = batches.next_batch([p for p in points if p.seq > cursor], cursor, partial)
        if not batch.points:
            break
        assert len(batch.points) <= batches.MAX_METRICS_PER_BATCH
        sent += batch.points
        cursor, partial = batch.cursor, batch.partial
    assert sent == points and cursor == 2 and partial == 0
    # Where it stood after the first part: event 1 not whole yet, 1000 of its points sent.
    first = batches.next_batch(points, 0)
    assert (first.cursor, first.partial) == (0, 1000)


@pytest.mark.nodb
def test_a_resend_leaves_out_the_points_the_history_has_and_keeps_the_others():
    points = [Point(1, "loss", 0.5, 1000, 0), Point(1, "acc", "NaN", 1000, 0), Point(2, "loss", 0.25, 2000, 1), Point(2, "loss", 0.25, 2000, 1)]
    history = [
        {"key": "loss", "value": 0.5, "timestamp": 1000, "step": 0},
        {"key": "acc", "value": "NaN", "timestamp": 1000, "step": 0},
        {"key": "loss", "value": 0.25, "timestamp": 2000, "step": 1},  # one of the two equal points
        {"key": "loss", "value": 0.5, "timestamp": 1000, "step": 7},  # another step: not this point
    ]
    assert batches.missing(points, history) == [Point(2, "loss", 0.25, 2000, 1)]
    assert batches.missing(points, []) == points


@pytest.mark.nodb
def test_metric_events_become_points_with_steps_and_named_non_finite_values():
    at = timezone.now()
    events = [
        (5, at, {"step": 3, "values": {"loss": 1.5, "acc": True, "lr": "fast", "bad:name": float("inf")}}),
        (9, at, {"step": None, "values": {"loss": "NaN"}}),
        (12, at, {"values": {"loss": 2}}),
        (13, at, None),
    ]
    points = batches.metric_points(events, ordinal=10)
    assert [(p.seq, p.key, p.value, p.step) for p in points] == [
        (5, "loss", 1.5, 3),
        (5, "bad_name", "Infinity", 3),
        (9, "loss", "NaN", 11),
        (12, "loss", 2.0, 12),
    ]
    assert {p.timestamp for p in points} == {batches.millis(at)}


@pytest.mark.nodb
def test_parameters_are_flattened_stringified_and_cut_to_mlflows_limits():
    params = batches.params({"lr": 0.01, "opt": {"name": "adam", "betas": [0.9, 0.99]}, "x" * 300: "long", "note": "y" * 7000}, {"batch": 32, "": {}})
    as_dict = {p["key"]: p["value"] for p in params}
    assert as_dict["lr"] == "0.01" and as_dict["opt.name"] == "adam" and as_dict["opt.betas"] == "[0.9, 0.99]"
    assert as_dict["config.batch"] == "32"
    assert "x" * 250 in as_dict and len(as_dict["note"]) == 6000
    assert all(len(key) <= 250 for key in as_dict)
    assert batches.key_of("a//b") == "a__b" and batches.key_of("../up") == ".._up" and batches.key_of("") == "_"
    assert batches.params({}, {}) == []


@pytest.mark.nodb
def test_retries_wait_longer_each_time_up_to_a_cap():
    assert [batches.retry_delay(n, 5, 300) for n in range(9)] == [0, 5, 10, 20, 40, 80, 160, 300, 300]
    assert batches.retry_delay(10_000, 5, 300) == 300


# With a real MLflow server -----------------------------------------------------------------------


@pytest.fixture
def tracker(settings, mlflow_server, team_a, alice):
    settings.E31_TRACKER_ALLOW = ["127.0.0.1"]
    settings.E31_SITE_URL = "https://e31.example"
    tracker = Tracker(team=team_a, url=mlflow_server.url, created_by=alice)
    tracker.set_token(TOKEN)
    tracker.save()
    return tracker


class Clock:
    """The worker's clock: moved on past any backoff whenever the test says."""

    def __init__(self):
        self.now = timezone.now()

    def later(self, seconds=600):
        self.now += timedelta(seconds=seconds)
        return self.now


def running_job(alice, name, **fields):
    Node.objects.get_or_create(name="tracked-node", defaults={"device_type": "cpu", "devices": 4})
    job = make_job(alice, name=name, **fields)
    [allocation] = schedule_now()
    job.refresh_from_db()
    job.mark_running()
    return job, allocation


def log_metrics(job, steps, base=0.0):
    """Metric points as the runner stores them (agent.running): one event per step, two series."""
    at = timezone.now()
    events = [
        JobEvent(kind="metric", at=at + timedelta(milliseconds=i), data={"step": step, "values": {"loss": base + 1 / (step + 1), "acc": step / 1000}})
        for i, step in enumerate(steps)
    ]
    JobEvent.append(job.pk, events)
    return {("loss", step): base + 1 / (step + 1) for step in steps} | {("acc", step): step / 1000 for step in steps}


def finish(job, allocation, seconds=120):
    end_allocation(allocation, allocation.started_at + timedelta(seconds=seconds), Allocation.EXITED, states.SUCCEEDED, "exited with 0", 0)
    job.refresh_from_db()


def assert_every_point_once(server, run_id, expected):
    """The run's history of each key has each expected (key, step) point exactly once."""
    for key in {k for k, _ in expected}:
        stored = server.history(run_id, key)
        steps = sorted(m["step"] for m in stored)
        want = sorted(step for k, step in expected if k == key)
        assert steps == want, f"{key}: {len(stored)} points stored, {len(want)} sent"
        for m in stored:
            assert math.isclose(m["value"], expected[(key, m["step"])]), (key, m)


@pytest.mark.bench  # a real MLflow server (its start, a 30 s outage): once, in bin/test's lane beside the SQLite pass
def test_a_job_appears_as_a_run_with_its_parameters_every_metric_point_and_its_cost(tracker, mlflow_server, alice, rate):
    job, allocation = running_job(alice, "tracked-full", hyperparameters={"lr": 0.01, "layers": {"depth": 4}}, config={"batch": 32})
    worker, clock = Worker(), Clock()
    expected = log_metrics(job, range(700))
    worker.drain(clock.later(1))
    # Metrics as they arrive: a second lot, more than one batch (1000 points) of them.
    expected |= log_metrics(job, range(700, 1300))
    JobEvent.append(job.pk, [JobEvent(kind="log", at=timezone.now(), stream="stdout", text="a line between the points")])
    worker.drain(clock.later(1))
    tracked = TrackedRun.objects.get(job=job)
    assert tracked.run_id and tracked.params_sent and not tracked.finished_sent and tracked.last_error == ""
    assert tracked.delivered_seq == job.events.order_by("-seq").first().seq
    finish(job, allocation, seconds=120)
    worker.drain(clock.later(1))
    tracked.refresh_from_db()
    assert tracked.finished_sent and tracked.last_error == ""

    run = mlflow_server.run_of_job(job.experiment, job.pk)
    assert run["info"]["status"] == "FINISHED" and run["info"]["end_time"] == batches.millis(job.finished_at)
    params = {p["key"]: p["value"] for p in run["data"]["params"]}
    assert params == {"lr": "0.01", "layers.depth": "4", "config.batch": "32"}
    tags = {t["key"]: t["value"] for t in run["data"]["tags"]}
    assert tags["e31.job_id"] == str(job.pk) and tags["e31.state"] == "succeeded" and tags["mlflow.runName"] == job.name
    assert tags["e31.url"] == f"https://e31.example/jobs/{job.pk}/" and tags["e31.team"] == job.team.name
    assert_every_point_once(mlflow_server, tracked.run_id, expected)
    usage = UsageRecord.objects.get(job=job)
    cost = {key: mlflow_server.history(tracked.run_id, key) for key in ("e31.cost", "e31.held_seconds", "e31.gpu_hours")}
    assert all(len(points) == 1 for points in cost.values()), cost
    assert math.isclose(cost["e31.cost"][0]["value"], float(usage.amount)) and usage.amount == Decimal("0.08")  # 120 s x 2.40/h
    assert cost["e31.held_seconds"][0]["value"] == 120 and math.isclose(cost["e31.gpu_hours"][0]["value"], 120 / 3600)
    # Done: nothing more is sent for it, however often the worker looks.
    assert worker.drain(clock.later()) == 0


@pytest.mark.bench  # a real MLflow server (its start, a 30 s outage): once, in bin/test's lane beside the SQLite pass
def test_a_tracker_down_for_thirty_seconds_loses_no_point_and_doubles_none(tracker, mlflow_server, alice, rate):
    job, allocation = running_job(alice, "tracked-outage", hyperparameters={"lr": 0.1})
    worker, clock = Worker(), Clock()
    expected = log_metrics(job, range(300))
    worker.drain(clock.later(1))
    delivered = TrackedRun.objects.get(job=job).delivered_seq
    mlflow_server.stop()
    try:
        # Down for 30 s of real time while the job goes on logging and the worker keeps trying.
        down_until, step, tries = time.monotonic() + 30, 300, 0
        while time.monotonic() < down_until:
            expected |= log_metrics(job, range(step, step + 50))
            step += 50
            tries += worker.drain(clock.later())
            time.sleep(1)
        tracked = TrackedRun.objects.get(job=job)
        assert tries >= 10 and tracked.attempts >= 10 and tracked.delivered_seq == delivered
        assert "cannot reach the tracker" in tracked.last_error
        tracker.refresh_from_db()
        assert "cannot reach the tracker" in tracker.last_error and tracked.job.name in tracker.last_error
    finally:
        mlflow_server.start()
    expected |= log_metrics(job, range(step, step + 20))
    finish(job, allocation)
    worker.drain(clock.later())
    tracked = TrackedRun.objects.get(job=job)
    assert tracked.finished_sent and tracked.attempts == 0
    tracker.refresh_from_db()
    assert tracker.last_error == ""
    assert_every_point_once(mlflow_server, tracked.run_id, expected)
    assert len(mlflow_server.history(tracked.run_id, "e31.cost")) == 1


class LoseReplies(httpx.BaseTransport):
    """Forwards every request, and for the first `lose[path]` requests to a path drops the
    server's answer and raises a read error: the server took the request, the worker never hears."""

    def __init__(self, inner, lose):
        self.inner, self.lose, self.sent = inner, dict(lose), []

    def handle_request(self, request):
        response = self.inner.handle_request(request)
        path = request.url.path.removeprefix("/api/2.0/mlflow/")
        self.sent.append((path, request.headers.get("authorization"), json.loads(request.content) if request.content else None))
        if self.lose.get(path):
            self.lose[path] -= 1
            response.read()
            response.close()
            raise httpx.ReadError("connection reset after the request was sent", request=request)
        return response


@pytest.mark.bench  # a real MLflow server (its start, a 30 s outage): once, in bin/test's lane beside the SQLite pass
def test_a_reply_lost_after_the_server_took_a_batch_or_a_run_doubles_nothing(tracker, mlflow_server, alice, rate):
    job, allocation = running_job(alice, "tracked-lost-replies")
    transport = LoseReplies(endpoints.PinnedTransport("tracker"), {"runs/create": 1, "runs/log-batch": 0})
    worker, clock = Worker(client=httpx.Client(transport=transport, trust_env=False, follow_redirects=False)), Clock()
    expected = log_metrics(job, range(40))
    worker.drain(clock.later(1))  # the run is made, its answer lost: the attempt fails
    tracked = TrackedRun.objects.get(job=job)
    assert tracked.run_id == "" and tracked.attempts == 1 and "connection" in tracked.last_error
    worker.drain(clock.later())  # found by its tag, not made again; then the points
    tracked.refresh_from_db()
    assert tracked.run_id and tracked.last_error == ""

    transport.lose["runs/log-batch"] = 1
    expected |= log_metrics(job, range(40, 90))
    worker.drain(clock.later(1))
    tracked.refresh_from_db()
    assert tracked.attempts == 1 and tracked.verify_through_seq > 0 and tracked.delivered_seq < job.events.order_by("-seq").first().seq
    expected |= log_metrics(job, range(90, 100))
    finish(job, allocation)
    worker.drain(clock.later())
    tracked.refresh_from_db()
    assert tracked.finished_sent

    assert mlflow_server.run_of_job(job.experiment, job.pk)["info"]["run_id"] == tracked.run_id  # one run
    assert_every_point_once(mlflow_server, tracked.run_id, expected)
    # And not because the server dropped doubles: no point went out twice.
    sent = [(m["key"], m["step"]) for path, _, body in transport.sent if path == "runs/log-batch" for m in body.get("metrics", [])]
    assert sorted(p for p in sent if not p[0].startswith("e31.")) == sorted(expected)
    assert {path for path, _, _ in transport.sent if path == "runs/create"} and [p for p, _, _ in transport.sent].count("runs/create") == 1
    # Every request carried the team's token.
    assert {auth for _, auth, _ in transport.sent} == {f"Bearer {TOKEN}"}


@pytest.mark.bench  # a real MLflow server (its start, a 30 s outage): once, in bin/test's lane beside the SQLite pass
def test_a_job_that_ran_before_the_tracker_is_sent_from_its_first_event_and_old_jobs_are_not(settings, mlflow_server, team_a, alice, rate):
    settings.E31_TRACKER_ALLOW = ["127.0.0.1"]
    old, old_allocation = running_job(alice, "tracked-old")
    finish(old, old_allocation)
    Job.objects.filter(pk=old.pk).update(finished_at=timezone.now() - timedelta(hours=1))  # long before the tracker
    job, _ = running_job(alice, "tracked-late")
    expected = log_metrics(job, range(30))
    Tracker.objects.create(team=team_a, url=mlflow_server.url)
    worker, clock = Worker(), Clock()
    worker.drain(clock.later(1))
    assert not TrackedRun.objects.filter(job=old).exists()
    tracked = TrackedRun.objects.get(job=job)
    assert_every_point_once(mlflow_server, tracked.run_id, expected)


@pytest.mark.bench  # a real MLflow server (its start, a 30 s outage): once, in bin/test's lane beside the SQLite pass
def test_an_event_larger_than_a_batch_and_events_without_numbers_are_delivered_whole(tracker, mlflow_server, alice, rate, monkeypatch):
    monkeypatch.setattr(tracking_worker, "EVENTS_READ", 7)  # the events are read a few at a time
    job, allocation = running_job(alice, "tracked-large-event")
    at = timezone.now()
    wide = {f"layer{i}/grad_norm": i / 7 for i in range(2500)}
    JobEvent.append(job.pk, [JobEvent(kind="metric", at=at, data={"step": s, "values": {"note": "text, no number"}}) for s in range(10)])
    JobEvent.append(job.pk, [JobEvent(kind="metric", at=at, data={"step": 10, "values": wide})])
    expected = log_metrics(job, range(11, 30))
    finish(job, allocation)
    Worker().drain(Clock().later(1))
    tracked = TrackedRun.objects.get(job=job)
    assert tracked.finished_sent and tracked.delivered_points == 0, tracked.last_error
    assert_every_point_once(mlflow_server, tracked.run_id, expected)
    for key in ("layer0/grad_norm", "layer1234/grad_norm", "layer2499/grad_norm"):
        [point] = mlflow_server.history(tracked.run_id, key)
        assert point["step"] == 10 and math.isclose(point["value"], wide[key])


@pytest.mark.bench  # a real MLflow server (its start, a 30 s outage): once, in bin/test's lane beside the SQLite pass
@pytest.mark.django_db(transaction=True)
def test_the_worker_runs_as_a_thread_on_its_own_connection(tracker, mlflow_server, alice, rate):
    """As the scheduler starts it (scheduler/management/commands/scheduler.py)."""
    job, allocation = running_job(alice, "tracked-thread")
    expected = log_metrics(job, range(25))
    finish(job, allocation)
    stop = threading.Event()
    thread = tracking_worker.start_thread(stop, interval=0.1)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not TrackedRun.objects.filter(job=job, finished_sent=True).exists():
            time.sleep(0.2)
    finally:
        stop.set()
        thread.join(timeout=30)
    assert not thread.is_alive()
    tracked = TrackedRun.objects.get(job=job)
    assert tracked.finished_sent, tracked.last_error
    assert_every_point_once(mlflow_server, tracked.run_id, expected)


# The address policy, the page and the token ------------------------------------------------------


def test_a_tracker_at_a_loopback_address_is_refused_unless_the_operators_allow_it(settings, client, alice, team_a):
    settings.E31_TRACKER_ALLOW = []
    client.force_login(alice)
    response = client.post(reverse("tracking:tracker"), {"url": "http://127.0.0.1:5000", "token": "", "enabled": "on"})
    assert response.status_code == 400
    assert "The tracker 127.0.0.1 is at a loopback address; an experiment tracker must be at a public address." in response.content.decode()
    assert not Tracker.objects.exists()
    # Another purpose's allow-list does not let it through.
    settings.E31_WEBHOOK_ALLOW = settings.E31_S3_ENDPOINT_ALLOW = ["127.0.0.1"]
    assert client.post(reverse("tracking:tracker"), {"url": "http://127.0.0.1:5000"}).status_code == 400
    settings.E31_TRACKER_ALLOW = ["127.0.0.1"]
    assert client.post(reverse("tracking:tracker"), {"url": "http://127.0.0.1:5000", "enabled": "on"}).status_code == 302
    assert Tracker.objects.get(team=team_a).url == "http://127.0.0.1:5000"


def test_the_worker_checks_the_address_again_before_sending(settings, team_a, alice, rate):
    settings.E31_TRACKER_ALLOW = []  # allowed when saved, no longer
    Tracker.objects.create(team=team_a, url="http://127.0.0.1:9")
    job, _ = running_job(alice, "tracked-refused")
    Worker().drain(timezone.now())
    tracked = TrackedRun.objects.get(job=job)
    assert tracked.run_id == "" and tracked.attempts == 1
    assert tracked.last_error == "not sent: the tracker 127.0.0.1 is at a loopback address; an experiment tracker must be at a public address"


def test_the_token_is_stored_sealed_and_never_shown_back(settings, client, alice, bob, team_a):
    settings.E31_TRACKER_ALLOW = ["127.0.0.1"]
    client.force_login(alice)
    page = reverse("tracking:tracker")
    assert client.post(page, {"url": "http://127.0.0.1:5000/", "token": TOKEN, "enabled": "on"}).status_code == 302
    tracker = Tracker.objects.get(team=team_a)
    assert tracker.url == "http://127.0.0.1:5000" and TOKEN not in tracker.sealed_token and tracker.token() == TOKEN
    for user in (alice, bob):
        client.force_login(user)
        text = client.get(page).content.decode()
        assert "http://127.0.0.1:5000" in text and "token stored" in text and TOKEN not in text
        assert TOKEN not in client.get(reverse("settings")).content.decode()
    # Blank keeps the stored token; a member changes nothing.
    client.force_login(alice)
    assert client.post(page, {"url": "http://127.0.0.1:5000", "token": "", "enabled": "on"}).status_code == 302
    assert Tracker.objects.get(team=team_a).token() == TOKEN
    client.force_login(bob)
    assert client.post(page, {"url": "http://127.0.0.1:6000", "token": "other"}).status_code == 403
    assert client.post(reverse("tracking:tracker_remove")).status_code == 403
    client.force_login(alice)
    assert client.post(page, {"url": "http://127.0.0.1:5000", "clear_token": "on", "enabled": "on"}).status_code == 302
    assert Tracker.objects.get(team=team_a).token() == ""
    assert client.post(reverse("tracking:tracker_remove")).status_code == 302
    assert not Tracker.objects.exists()


def test_the_page_shows_the_last_delivery_error(client, bob, team_a):
    Tracker.objects.create(
        team=team_a, url="https://mlflow.example", last_error="job x (1234abcd): the tracker refused the token (401)", last_error_at=timezone.now()
    )
    client.force_login(bob)
    text = client.get(reverse("tracking:tracker")).content.decode()
    assert "the tracker refused the token (401)" in text and "Only the team's owners" in text
