"""The operator's view: the pure arithmetic of scheduler.ops.figures on plain data (nodb), the staff-only
page at /ops/ and the Prometheus metrics at /metrics on real rows."""

from datetime import UTC, date, datetime, timedelta
from decimal import Decimal

import pytest
from django.urls import reverse
from prometheus_client.parser import text_string_to_metric_families
from rest_framework.authtoken.models import Token

from billing import meter
from billing.models import Credit, UsageRecord
from jobs import states
from jobs.models import Job
from scheduler.models import Allocation, Node
from scheduler.ops import figures, prom
from tests.conftest import make_job, make_user

UTC = UTC
T0 = datetime(2026, 12, 2, 0, 0, tzinfo=UTC)
HOUR = timedelta(hours=1)
nodb = pytest.mark.nodb


# Utilization ---------------------------------------------------------------------------------------


@nodb
def test_utilization_is_devices_held_over_devices_offered_per_bucket():
    offered = [figures.Held(T0 - HOUR, None, 4)]
    held = [figures.Held(T0, T0 + 30 * timedelta(minutes=1), 2), figures.Held(T0 + HOUR, None, 4)]
    buckets = figures.utilization(held, offered, T0, T0 + 3 * HOUR, 3600, now=T0 + 3 * HOUR)
    assert [b.utilization for b in buckets] == [0.25, 1.0, 1.0]
    assert buckets[0].held == 2 * 1800 and buckets[0].capacity == 4 * 3600


@nodb
def test_the_bucket_in_progress_counts_only_up_to_now_and_no_devices_is_none():
    offered = [figures.Held(T0 + HOUR, None, 2)]
    held = [figures.Held(T0 + HOUR, None, 1)]
    buckets = figures.utilization(held, offered, T0, T0 + 3 * HOUR, 3600, now=T0 + HOUR + timedelta(minutes=15))
    assert buckets[0].utilization is None  # no node yet
    assert buckets[1].held == 900 and buckets[1].capacity == 1800 and buckets[1].utilization == 0.5
    assert buckets[2].capacity == 0 and buckets[2].utilization is None
    assert figures.mean_utilization(buckets) == 0.5


@nodb
def test_the_window_ends_with_the_bucket_now_falls_in():
    start, end = figures.window(T0 + timedelta(hours=7, minutes=10), 24 * 3600, 6 * 3600)
    assert end == T0 + 12 * HOUR and start == T0 - 12 * HOUR


@nodb
def test_bars_are_as_tall_as_the_utilization():
    buckets = [figures.Bucket(T0, T0 + HOUR, 0, 0), figures.Bucket(T0 + HOUR, T0 + 2 * HOUR, 1800, 3600)]
    first, second = figures.bars(buckets, 200, 100, label_seconds=2 * 3600)
    assert (first.height, second.height, second.y, second.x) == (0, 50, 50, 100)
    assert first.label == "00:00" and second.label == ""
    assert "50%" in second.title and "no devices" in first.title
    assert (first.label_x, first.label_anchor) == (0, "start")


@nodb
def test_a_label_at_the_charts_right_edge_ends_there_rather_than_run_past_it():
    days = [figures.Bucket(T0 + n * 6 * HOUR, T0 + (n + 1) * 6 * HOUR, 0, 0) for n in range(29)]  # the last one from midnight: its day's label at the edge
    found = [b for b in figures.bars(days, 720, 100, label_seconds=24 * 3600, label_format="%a %d") if b.label]
    *inside, last = found
    assert all(b.label_anchor == "start" and b.label_x == b.x for b in inside)
    assert last.x + len(last.label) * figures.LABEL_CHAR_WIDTH > 720, "the last day's label starts near the edge"
    assert (last.label_x, last.label_anchor) == (720, "end")


# Held device-hours and revenue per day ------------------------------------------------------------


@nodb
def test_usage_across_midnight_is_shared_between_the_days_by_time():
    usage = [figures.Usage(T0 - 2 * HOUR, T0 + 6 * HOUR, 2, Decimal("16.00"))]  # 2 h before midnight, 6 h after
    credits = [(T0 + 7 * HOUR, Decimal("1.50"))]
    before, after = figures.daily(usage, credits, [T0.date() - timedelta(days=1), T0.date()])
    assert before.device_hours == 4 and before.amount == Decimal("4.00") and before.credits == 0
    assert after.device_hours == 12 and after.amount == Decimal("12.00") and after.billed == Decimal("10.50")


@nodb
def test_days_outside_the_window_are_left_out_and_empty_days_are_zero():
    usage = [figures.Usage(T0 - timedelta(days=5), T0 - timedelta(days=5) + HOUR, 1, Decimal("2.40")), figures.Usage(T0, T0, 1, Decimal(0))]
    days = figures.days_back(T0.date(), 3)
    assert days == [date(2026, 11, 30), date(2026, 12, 1), date(2026, 12, 2)]
    totals = figures.daily(usage, [], days)
    assert [d.device_seconds for d in totals] == [0, 0, 0] and sum(d.amount for d in totals) == 0


# Stuck jobs ----------------------------------------------------------------------------------------

LIMITS = figures.Thresholds(starting_seconds=600, queued_seconds=1800, running_seconds=3600, overrun_seconds=300)
NOW = T0 + 10 * HOUR


def job_state(state, **fields):
    return figures.JobState(id=state, name="j", team="A", state=state, **fields)


@nodb
def test_a_job_starting_too_long_is_stuck_and_one_just_started_is_not():
    slow = job_state("starting", since=NOW - timedelta(minutes=25))
    fresh = figures.JobState(id="fresh", name="j", team="A", state="starting", since=NOW - timedelta(minutes=5))
    [found] = figures.stuck_jobs([slow, fresh], NOW, LIMITS)
    assert found.job is slow and found.over_seconds == 15 * 60
    assert found.why == "starting for 25m (expected within 10m)"


@nodb
def test_a_queued_job_well_past_its_predicted_start_is_stuck():
    late = job_state("queued", predicted_start=NOW - 2 * HOUR)
    on_time = figures.JobState(id="b", name="j", team="A", state="queued", predicted_start=NOW - timedelta(minutes=10))
    unpredicted = figures.JobState(id="c", name="j", team="A", state="queued")
    [found] = figures.stuck_jobs([late, on_time, unpredicted], NOW, LIMITS)
    assert found.job is late and found.why == "still queued 2h 00m after its predicted start"


@nodb
def test_a_running_job_past_its_span_or_well_past_its_predicted_finish_is_stuck():
    over_span = figures.JobState(id="a", name="j", team="A", state="running", since=NOW - 3 * HOUR, held_until=NOW - HOUR)
    over_finish = figures.JobState(id="b", name="j", team="A", state="running", since=NOW - 5 * HOUR, predicted_finish=NOW - 90 * timedelta(minutes=1))
    fine = figures.JobState(id="c", name="j", team="A", state="running", since=NOW - 5 * HOUR, predicted_finish=NOW - HOUR / 2, held_until=NOW + HOUR)
    orphan = figures.JobState(id="d", name="j", team="A", state="running", holding=False)
    found = figures.stuck_jobs([fine, over_finish, over_span, orphan], NOW, LIMITS)
    assert [s.job.id for s in found] == ["d", "a", "b"]
    assert found[0].why == "running but holds no compute"
    assert found[1].why == "holds compute 1h 00m past the end of its span or ceiling"
    assert found[2].why == "running 1h 30m past its predicted finish"


@nodb
def test_finished_jobs_are_never_stuck():
    done = figures.JobState(id="a", name="j", team="A", state="succeeded", since=NOW - 99 * HOUR, predicted_start=NOW - 99 * HOUR)
    assert figures.stuck_jobs([done], NOW, LIMITS) == []


# The queue by team, nodes ----------------------------------------------------------------------------


@nodb
def test_the_queue_is_grouped_by_team_with_predicted_starts_first():
    a1 = figures.Queued("a1", "a1", "A", 2, T0 + HOUR, predicted_start=None)
    a2 = figures.Queued("a2", "a2", "A", 1, T0 + 2 * HOUR, predicted_start=T0 + 5 * HOUR)
    b1 = figures.Queued("b1", "b1", "B", 4, T0, predicted_start=T0 + 3 * HOUR)
    groups = figures.queue_by_team([a1, a2, b1])
    assert [g.team for g in groups] == ["B", "A"]  # B has waited longest
    assert [j.id for j in groups[1].jobs] == ["a2", "a1"]
    assert groups[1].gpus == 3 and groups[1].next_start == T0 + 5 * HOUR and groups[1].oldest == T0 + HOUR
    assert figures.oldest_wait_seconds([a1, a2, b1], T0 + 2 * HOUR) == 7200
    assert figures.oldest_wait_seconds([], T0) == 0


@nodb
def test_a_node_is_up_silent_lost_or_stopped():
    beat = NOW - timedelta(seconds=10)
    assert figures.NodeRow("n", "cpu", 4, 1, beat).status(NOW, 30) == figures.UP
    assert figures.NodeRow("n", "cpu", 4, 1, NOW - HOUR).status(NOW, 30) == figures.SILENT
    assert figures.NodeRow("n", "cpu", 4, 1, beat, lost_at=beat).status(NOW, 30) == figures.LOST
    assert figures.NodeRow("n", "cpu", 4, 0, beat, stopped_at=beat).status(NOW, 30) == figures.STOPPED
    nodes = [figures.NodeRow("a", "cpu", 4, 3, beat), figures.NodeRow("b", "cpu", 8, 2, beat, lost_at=beat)]
    assert figures.pool_totals(nodes, NOW, 30) == (4, 3)
    assert nodes[0].free == 1


def test_an_engines_node_is_drained_or_down_as_the_engine_says_and_others_work_is_not_free():
    beat = NOW - timedelta(seconds=10)
    slurm = figures.NodeRow("s", "cpu", 8, 2, beat, executor="slurm", busy_elsewhere=3, engine_state="up")
    assert slurm.status(NOW, 30) == figures.UP and slurm.free == 3
    drained = figures.NodeRow("s", "cpu", 8, 0, beat, executor="slurm", engine_state="drained", engine_reason="maintenance")
    assert drained.status(NOW, 30) == figures.DRAINED
    assert figures.pool_totals([slurm, drained], NOW, 30) == (8, 2)


@nodb
def test_an_allocation_billed_more_than_a_second_off_the_engines_elapsed_is_shown():
    start = NOW - HOUR
    rows = [
        ("a1", "j1", "agrees", "n", "11", start, start + timedelta(seconds=100.6), 100.0),
        ("a2", "j2", "overbilled", "n", "12", start, start + timedelta(seconds=104), 100.0),
        ("a3", "j3", "forgotten", "n", "13", start, start + timedelta(seconds=50), -1.0),
        ("a4", "j4", "underbilled", "n", "14", start, start + timedelta(seconds=200), 230.0),
        # Under by 1.5 s: Slurm's whole seconds, and our agent's exit after the meter stopped.
        ("a5", "j5", "agent's exit", "n", "15", start, start + timedelta(seconds=98.5), 100.0),
    ]
    found = figures.disagreements(rows)
    assert [(d.job_name, d.difference) for d in found] == [("underbilled", -30.0), ("overbilled", 4.0)]


def values(text):
    """{(sample name, sorted labels): value} of a Prometheus text exposition, through its parser."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in text_string_to_metric_families(text) for s in f.samples}


@nodb
def test_the_metrics_of_a_snapshot_parse_as_prometheus_text():
    beat = NOW - timedelta(seconds=5)
    snapshot = figures.Snapshot(
        now=NOW,
        node_timeout_seconds=30,
        nodes=[figures.NodeRow('gpu "1"', "NVIDIA H100", 8, 6, beat), figures.NodeRow("old", "cpu", 2, 0, beat, lost_at=beat)],
        job_counts={"queued": 2, "running": 1},
        queued=[figures.Queued("q", "q", "A", 2, NOW - HOUR)],
        stuck=[figures.Stuck(figures.JobState("s", "s", "A", "starting"), 60, "slow")],
        held_device_seconds={"NVIDIA H100": 7200},
        charged=Decimal("4.80"),
        credited=Decimal("0.40"),
        currency="EUR",
    )
    samples = values(prom.exposition(snapshot).decode())
    assert samples[("e31_node_devices", (("device_type", "NVIDIA H100"), ("node", 'gpu "1"')))] == 8
    assert samples[("e31_node_up", (("node", "old"),))] == 0
    assert samples[("e31_pool_utilization_ratio", ())] == 0.75
    assert samples[("e31_queue_oldest_wait_seconds", ())] == 3600
    assert samples[("e31_stuck_jobs", (("state", "starting"),))] == 1
    assert samples[("e31_held_device_seconds_total", (("device_type", "NVIDIA H100"),))] == 7200
    assert samples[("e31_revenue_total", (("currency", "EUR"),))] == 4.8


# The page and /metrics on real rows -------------------------------------------------------------------


@pytest.fixture
def staff(db):
    user = make_user("olivia", None)
    user.is_staff = True
    user.save()
    return user


@pytest.fixture
def world(alice, charlie, rate):
    """Two nodes (one lost), a running job holding 2 of gpu-a's 4 devices for 2 hours already,
    a job starting for 20 minutes, a queued job of each team, and a finished job's final usage
    with a credit."""
    from django.utils import timezone as dj_timezone

    now = dj_timezone.now()
    gpu = Node.objects.create(name="gpu-a", device_type="cpu", devices=4, registered_at=now - timedelta(days=2), last_heartbeat=now)
    Node.objects.create(name="gpu-lost", device_type="cpu", devices=2, registered_at=now - timedelta(days=2), last_heartbeat=now - HOUR, lost_at=now - HOUR / 2)
    running = make_job(alice, name="alices-long-run")
    Job.objects.filter(pk=running.pk).update(state=states.RUNNING, predicted_finish=now + HOUR)
    allocation = Allocation.objects.create(job=running, node=gpu, devices=[0, 1], device_type="cpu", rate=Decimal("2.40"), started_at=now - 2 * HOUR)
    UsageRecord.ledger.create(
        team=running.team,
        job=running,
        allocation=allocation,
        gpu_type="cpu",
        gpus=2,
        started_at=now - 2 * HOUR,
        ended_at=now,
        held_seconds=7200,
        rate=Decimal("2.40"),
        amount=meter.charge(2, 7200, Decimal("2.40")),
        provisional=True,
    )
    slow = make_job(alice, name="alices-slow-start")
    Job.objects.filter(pk=slow.pk).update(state=states.STARTING)
    Allocation.objects.create(job=slow, node=gpu, devices=[2], device_type="cpu", rate=Decimal("2.40"), started_at=now - timedelta(minutes=20))
    done = make_job(alice, name="alices-done")
    Job.objects.filter(pk=done.pk).update(state=states.SUCCEEDED)
    ended = now - 3 * HOUR
    past = Allocation.objects.create(
        job=done,
        node=gpu,
        devices=[3],
        device_type="cpu",
        rate=Decimal("2.40"),
        started_at=ended - HOUR,
        ended_at=ended,
        end_reason=Allocation.EXITED,
    )
    usage = UsageRecord.objects.create(
        team=done.team,
        job=done,
        allocation=past,
        gpu_type="cpu",
        gpus=1,
        started_at=ended - HOUR,
        ended_at=ended,
        held_seconds=3600,
        rate=Decimal("2.40"),
        amount=Decimal("2.40"),
    )
    Credit.objects.create(team=done.team, job=done, usage=usage, seconds=600, amount=Decimal("0.40"), reason="node lost", period=usage.period, created_at=ended)
    make_job(alice, name="alices-queued", predicted_start=now + HOUR)
    make_job(charlie, name="charlies-queued", gpus=2)
    return {"now": now, "running": running, "slow": slow}


def test_the_operator_page_sends_anonymous_users_to_log_in(client, db):
    response = client.get(reverse("ops:pool"))
    assert response.status_code == 302 and response["Location"].startswith(reverse("login"))


@pytest.mark.parametrize("persona", ["alice", "charlie"])
def test_the_operator_page_is_refused_to_non_staff(client, request, world, persona):
    client.force_login(request.getfixturevalue(persona))
    response = client.get(reverse("ops:pool"))
    assert response.status_code == 403
    assert "alices-long-run" not in response.content.decode()
    assert reverse("ops:pool") not in client.get(reverse("jobs:list")).content.decode()  # no link in the nav


def test_the_operator_page_shows_staff_the_pool(client, staff, world):
    client.force_login(staff)
    response = client.get(reverse("ops:pool"))
    assert response.status_code == 200
    page = response.content.decode()
    assert 'data-node="gpu-a"' in page and 'data-node="gpu-lost"' in page and "ops-lost" in page
    assert '<span id="pool-allocated">3</span> of <span id="pool-offered">4</span>' in page
    assert "Team A" in page and "alices-queued" in page and "charlies-queued" in page
    assert str(world["slow"].pk) in page and "starting for 20m (expected within 10m)" in page
    assert page.count('<rect class="ops-bar"') == 24 + 28
    # 2 devices for 2 hours (running) + 1 for an hour (done), possibly split over two days
    assert '<th class="num" id="days-hours">5.00</th>' in page
    assert f'href="{reverse("ops:pool")}"' in page  # the nav link, for staff
    assert 'id="ops-engine"' not in page, "no cluster engine: no section of its accounting"


def test_the_operator_page_shows_slurms_nodes_and_where_its_accounting_disagrees(client, staff, world):
    from django.utils import timezone as dj_timezone

    now = dj_timezone.now()
    node = Node.objects.create(name="slurm-1", device_type="cpu", devices=8, executor="slurm", busy_elsewhere=5, engine_state="up", last_heartbeat=now)
    Node.objects.create(name="slurm-2", device_type="cpu", devices=8, executor="slurm", engine_state="drained", engine_reason="bad fan", last_heartbeat=now)
    job = world["running"]
    started = now - HOUR
    off = Allocation.objects.create(
        job=job,
        node=node,
        devices=[0],
        device_type="cpu",
        rate=Decimal("2.40"),
        started_at=started,
        ended_at=started + timedelta(seconds=100),
        engine_handle="4242",
        engine_seconds=95.0,
    )
    Allocation.objects.create(
        job=job,
        node=node,
        devices=[1],
        device_type="cpu",
        rate=Decimal("2.40"),
        started_at=started,
        ended_at=started + timedelta(seconds=60),
        engine_handle="4243",
        engine_seconds=60.0,
    )
    client.force_login(staff)
    page = client.get(reverse("ops:pool")).content.decode()
    assert "+ 5 others&#x27;" in page or "+ 5 others'" in page
    assert "ops-drained" in page and "bad fan" in page
    assert f'data-allocation="{off.pk}"' in page and "4242" in page and "4243" not in page


def test_metrics_are_refused_without_a_staff_token(client, alice, world):
    url = reverse("metrics")
    assert client.get(url).status_code == 401
    assert client.get(url, HTTP_AUTHORIZATION="Token not-a-token").status_code == 401
    key = Token.objects.create(user=alice).key
    response = client.get(url, HTTP_AUTHORIZATION=f"Token {key}")
    assert response.status_code == 403 and b"e31_" not in response.content
    client.force_login(alice)
    assert client.get(url).status_code == 403


def test_metrics_parse_with_the_expected_values(client, staff, world):
    key = Token.objects.create(user=staff).key
    response = client.get(reverse("metrics"), HTTP_AUTHORIZATION=f"Bearer {key}")
    assert response.status_code == 200 and response["Content-Type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(response.content.decode())}
    value = values(response.content.decode())
    assert value[("e31_node_devices", (("device_type", "cpu"), ("node", "gpu-a")))] == 4
    assert value[("e31_node_devices_allocated", (("device_type", "cpu"), ("node", "gpu-a")))] == 3
    assert value[("e31_node_up", (("node", "gpu-a"),))] == 1 and value[("e31_node_up", (("node", "gpu-lost"),))] == 0
    assert value[("e31_node_last_heartbeat_seconds", (("node", "gpu-a"),))] == pytest.approx(world["now"].timestamp())
    assert value[("e31_jobs", (("state", "queued"),))] == 2 and value[("e31_jobs", (("state", "running"),))] == 1
    assert value[("e31_queue_jobs", (("team", "Team A"),))] == 1 and value[("e31_queue_jobs", (("team", "Team B"),))] == 1
    assert value[("e31_stuck_jobs", (("state", "starting"),))] == 1 and value[("e31_stuck_jobs", (("state", "running"),))] == 0
    assert value[("e31_held_device_seconds_total", (("device_type", "cpu"),))] == 2 * 7200 + 3600
    assert value[("e31_revenue_total", (("currency", "USD"),))] == pytest.approx(9.6 + 2.4)
    assert value[("e31_credited_total", (("currency", "USD"),))] == pytest.approx(0.4)
    assert families["e31_held_device_seconds"].type == "counter" and families["e31_node_devices"].type == "gauge"


def test_metrics_take_a_staff_session_too(client, staff, world):
    client.force_login(staff)
    response = client.get(reverse("metrics"))
    assert response.status_code == 200 and b"e31_node_up" in response.content
