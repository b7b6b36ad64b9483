"""Metric series and checkpoints of a run: the pure series functions, the API, the checkpoint
download and the job page's Metrics, Checkpoints, Timeline, Meter and Request cards."""

import json
from datetime import UTC, datetime, timedelta

import pytest
from django.urls import reverse
from django.utils import timezone

from core.storage import get_storage
from jobs import metrics, run_data
from jobs.models import Checkpoint, JobEvent
from scheduler.models import Allocation, Node
from tests.conftest import make_job, schedule_now

T0 = datetime(2025, 6, 1, 12, 0, tzinfo=UTC)


def point(step, at=None, **values):
    """A metric event as the websocket sends it."""
    return {"seq": 0, "kind": "metric", "at": (at or T0).isoformat(), "step": step, "values": values}


# The pure functions ---------------------------------------------------------------------------


def test_series_per_name_with_step_value_and_time():
    series = metrics.series_from_events([point(1, loss=0.9, acc=0.5), point(2, loss=0.7), point(3, loss=0.6, acc=0.8)])
    at = T0.isoformat()
    assert series == {"loss": [[1, 0.9, at], [2, 0.7, at], [3, 0.6, at]], "acc": [[1, 0.5, at], [3, 0.8, at]]}


def test_stored_rows_and_datetimes_are_taken_too():
    rows = [{"seq": 4, "at": T0, "data": {"step": 10, "values": {"loss": 1}}}]
    assert metrics.series_from_events(rows) == {"loss": [[10, 1.0, T0.isoformat()]]}


def test_non_finite_values_are_gaps_that_say_what_they_were():
    events = [point(1, loss=0.5), point(2, loss="NaN"), point(3, loss="Infinity"), point(4, loss="-Infinity"), point(5, loss=0.4)]
    series = metrics.series_from_events(events)["loss"]
    assert [p[1] for p in series] == [0.5, None, None, None, 0.4]
    assert [p[3] for p in series if len(p) == 4] == ["NaN", "Infinity", "-Infinity"]
    summary = metrics.summarize({"loss": series})["loss"]
    assert summary["non_finite"] == 3 and summary["count"] == 5
    assert summary["min"] == 0.4 and summary["max"] == 0.5 and summary["best"] == 0.4 and summary["best_x"] == 5
    last_nan = metrics.summarize(metrics.series_from_events(events[:2]))["loss"]
    assert last_nan["last"] == "NaN" and last_nan["last_x"] == 2
    # Python floats that are not finite (from an in-process caller) are reported the same way.
    assert metrics.parse_value(float("nan")) == (None, "NaN")
    assert metrics.parse_value(float("-inf")) == (None, "-Infinity")


def test_values_that_are_no_numbers_are_no_points():
    series = metrics.series_from_events([point(1, loss=True, note="fast", acc=None, lr=0.1)])
    assert list(series) == ["lr"]


def test_points_without_a_step_are_placed_by_their_ordinal():
    events = [point(None, loss=1.0), point(None, loss=0.8), point(None, acc=0.3)]
    assert [p[0] for p in metrics.series_from_events(events)["loss"]] == [0, 1]
    assert [p[0] for p in metrics.series_from_events(events)["acc"]] == [2]
    # After earlier events (the API's ?after=), the ordinal continues.
    assert [p[0] for p in metrics.series_from_events(events, offset=10)["loss"]] == [10, 11]
    # A step-less point after stepped ones goes after them, never rewinding the series.
    mixed = metrics.series_from_events([point(100, loss=0.5), point(None, loss=0.4)])["loss"]
    assert [p[0] for p in mixed] == [100, 101]


def test_a_resumed_run_rewinds_the_series_to_before_the_repeated_steps():
    events = [point(s, loss=1.0 / s) for s in range(1, 6)] + [point(4, loss=0.3), point(5, loss=0.2), point(6, loss=0.1)]
    series = metrics.series_from_events(events)["loss"]
    assert [(p[0], p[1]) for p in series] == [(1, 1.0), (2, 0.5), (3, 1 / 3), (4, 0.3), (5, 0.2), (6, 0.1)]


def test_names_filter():
    events = [point(1, loss=0.9, acc=0.5, lr=0.1)]
    assert sorted(metrics.series_from_events(events, names={"loss", "acc", "other"})) == ["acc", "loss"]


def test_downsampling_keeps_ends_extremes_and_gaps_within_the_limit():
    points = [[i, float(i % 100), "t"] for i in range(10_000)]
    points[5000] = [5000, 1000.0, "t"]  # a spike
    points[7777] = [7777, None, "t", "NaN"]  # a gap
    points[3333] = [3333, -50.0, "t"]  # a dip
    small = metrics.downsample(points, 500)
    assert len(small) <= 500
    assert small[0] == points[0] and small[-1] == points[-1]
    assert points[5000] in small and points[7777] in small and points[3333] in small
    assert [p[0] for p in small] == sorted({p[0] for p in small})  # in order, none twice
    assert metrics.downsample(points[:100], 500) == points[:100]
    assert metrics.downsample(points, 2) == [points[0], points[-1]]


def test_summary_best_follows_the_direction_of_the_series():
    events = [
        point(1, loss=0.9, heldout_accuracy=0.5, lr=0.1),
        point(2, loss=0.4, heldout_accuracy=0.9, lr=0.05),
        point(3, loss=0.6, heldout_accuracy=0.7, lr=0.01),
    ]
    summary = metrics.summarize(metrics.series_from_events(events))
    assert (summary["loss"]["mode"], summary["loss"]["best"], summary["loss"]["best_x"]) == ("min", 0.4, 2)
    assert (summary["heldout_accuracy"]["mode"], summary["heldout_accuracy"]["best"]) == ("max", 0.9)
    assert summary["lr"]["mode"] is None and summary["lr"]["best"] is None and summary["lr"]["min"] == 0.01
    assert summary["loss"]["last"] == 0.6 and summary["loss"]["last_x"] == 3 and summary["loss"]["count"] == 3
    # The job's early-stopping metric goes the way the job says.
    forced = metrics.summarize(metrics.series_from_events(events), modes={"lr": "max"})
    assert forced["lr"]["best"] == 0.1


def test_build_summarizes_the_whole_series_and_downsamples_what_is_drawn():
    events = [point(s, loss=float(s)) for s in range(1, 3001)]
    data = metrics.build(events, limit=100)
    assert len(data["series"]["loss"]) <= 100
    assert data["summary"]["loss"]["count"] == 3000 and data["summary"]["loss"]["best"] == 1.0


# The API ------------------------------------------------------------------------------------


def add_metrics(job, points):
    """Metric events for (step, values) pairs, a second apart."""
    return JobEvent.append(
        job.pk,
        [JobEvent(kind="metric", at=T0 + timedelta(seconds=i), data={"step": step, "values": values}) for i, (step, values) in enumerate(points)],
    )


@pytest.fixture
def api(client, token, rate):
    client.defaults["HTTP_AUTHORIZATION"] = f"Token {token}"
    return client


def test_metrics_api_returns_series_and_summary(api, alice):
    job = make_job(alice)
    add_metrics(job, [(1, {"loss": 0.9, "heldout_accuracy": 0.5}), (2, {"loss": "NaN"}), (3, {"loss": 0.5, "heldout_accuracy": 0.8})])
    body = api.get(reverse("api:job-metrics", args=[job.pk])).json()
    assert [p[:2] for p in body["series"]["loss"]] == [[1, 0.9], [2, None], [3, 0.5]]
    assert body["series"]["loss"][1][3] == "NaN"
    assert body["series"]["loss"][0][2] == T0.isoformat()
    assert body["summary"]["loss"]["non_finite"] == 1 and body["summary"]["loss"]["best"] == 0.5
    assert body["summary"]["heldout_accuracy"]["best"] == 0.8
    job.refresh_from_db()
    assert body["last_seq"] == job.last_seq and body["events"] == 3


def test_metrics_api_after_and_names(api, alice):
    job = make_job(alice)
    first = add_metrics(job, [(1, {"loss": 0.9, "acc": 0.1}), (2, {"loss": 0.8, "acc": 0.2})])
    job.record("log", data=None)
    add_metrics(job, [(3, {"loss": 0.7, "acc": 0.3}), (None, {"loss": 0.6})])
    url = reverse("api:job-metrics", args=[job.pk])
    newer = api.get(url, {"after": first}).json()
    # The step-less point: ordinal 3 (two metric events before), placed after step 3.
    assert [p[0] for p in newer["series"]["loss"]] == [3, 4]
    assert newer["summary"]["loss"]["count"] == 2 and newer["events"] == 4
    only = api.get(url, {"names": "acc"}).json()
    assert list(only["series"]) == ["acc"] and list(only["summary"]) == ["acc"]
    assert api.get(url, {"names": "acc,loss", "after": first}).json()["series"]["acc"] == [[3, 0.3, (T0 + timedelta(seconds=0)).isoformat()]]
    nothing = api.get(url, {"after": newer["last_seq"]}).json()
    assert nothing["series"] == {} and nothing["last_seq"] == newer["last_seq"]
    assert api.get(url, {"after": "x"}).status_code == 400
    assert api.get(url, {"names": "bad name!"}).status_code == 400


def test_metrics_api_points_limit(api, alice):
    job = make_job(alice)
    add_metrics(job, [(s, {"loss": 1.0 / s}) for s in range(1, 501)])
    body = api.get(reverse("api:job-metrics", args=[job.pk]), {"points": 50}).json()
    assert len(body["series"]["loss"]) <= 50 and body["summary"]["loss"]["count"] == 500


def test_metric_events_are_read_in_chunks_after_the_last_seq_read(alice, django_assert_num_queries):
    job = make_job(alice)
    add_metrics(job, [(s, {"loss": 1.0 / s}) for s in range(1, 4)])
    job.record("log", data=None)  # other kinds between the points are passed by
    add_metrics(job, [(s, {"loss": 1.0 / s}) for s in range(4, 8)])
    # Seven points, three a chunk: three queries; a job's page's hundred points are one.
    with django_assert_num_queries(3):
        events = list(run_data.metric_events(job, chunk=3))
    assert [e["step"] for e in events] == [1, 2, 3, 4, 5, 6, 7]
    assert [e["seq"] for e in events] == sorted(e["seq"] for e in events) and len({e["seq"] for e in events}) == 7
    # after and upto bound every chunk: the 2nd point to the 6th.
    second, sixth = events[1]["seq"], events[5]["seq"]
    assert [e["step"] for e in run_data.metric_events(job, after=second, upto=sixth, chunk=2)] == [3, 4, 5, 6]
    with django_assert_num_queries(1):
        assert len(list(run_data.metric_events(job))) == 7


def test_run_api_is_for_the_jobs_team_only(client, alice, bob, charlie, rate):
    job = make_job(alice)
    add_metrics(job, [(1, {"loss": 0.9})])
    keep_checkpoint(job, "step-000000000001.pt", 1)
    client.force_login(charlie)
    for name in ("api:job-metrics", "api:job-checkpoints"):
        assert client.get(reverse(name, args=[job.pk])).status_code == 404
    assert client.get(reverse("api:job-checkpoint", args=[job.pk, "step-000000000001.pt"])).status_code == 404
    client.force_login(bob)  # a teammate sees it (session auth)
    assert client.get(reverse("api:job-metrics", args=[job.pk])).json()["summary"]["loss"]["last"] == 0.9
    client.logout()
    assert client.get(reverse("api:job-metrics", args=[job.pk])).status_code in (401, 403)


# Checkpoints --------------------------------------------------------------------------------


def keep_checkpoint(job, name, step, content=None, pruned=False, written_at=None):
    """A checkpoint saved to storage as the runner does, optionally pruned since."""
    import tempfile
    from pathlib import Path

    key = f"jobs/{job.pk}/checkpoints/{name}"
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / name
        path.write_bytes(content if content is not None else f"weights at {step}".encode() * 100)
        size, sha256 = get_storage().save_file(key, path)
    written_at = written_at or T0 + timedelta(minutes=step)
    checkpoint = Checkpoint.objects.create(job=job, name=name, step=step, key=key, size=size, sha256=sha256, written_at=written_at)
    if pruned:
        get_storage().delete(key)
        checkpoint.pruned_at = written_at + timedelta(minutes=5)
        checkpoint.save()
    job.record(
        "checkpoint",
        at=written_at,
        data={"name": name, "step": step, "size": size, "node": "node-a", "text": f"checkpoint {name} kept (step {step})"},
    )
    return checkpoint


def test_checkpoints_api_lists_kept_and_pruned(api, alice):
    job = make_job(alice)
    keep_checkpoint(job, "step-000000000100.pt", 100, pruned=True)
    kept = keep_checkpoint(job, "step-000000000200.pt", 200)
    body = api.get(reverse("api:job-checkpoints", args=[job.pk])).json()
    assert [(c["name"], c["step"], c["pruned"]) for c in body] == [("step-000000000200.pt", 200, False), ("step-000000000100.pt", 100, True)]
    assert body[0]["size"] == kept.size and body[0]["sha256"] == kept.sha256 and body[0]["written_at"]
    assert body[0]["url"].endswith(reverse("api:job-checkpoint", args=[job.pk, kept.name]))
    assert body[1]["url"] is None and body[1]["pruned_at"]
    response = api.get(body[0]["url"])
    assert response.status_code == 200 and b"".join(response.streaming_content) == b"weights at 200" * 100
    gone = api.get(reverse("api:job-checkpoint", args=[job.pk, "step-000000000100.pt"]))
    assert gone.status_code == 410 and "latest 3" in gone.json()["detail"]


def test_a_kept_checkpoint_downloads_from_the_page_with_range(client, alice, rate):
    job = make_job(alice)
    content = bytes(range(256)) * 400
    keep_checkpoint(job, "step-000000000100.pt", 100, content=content)
    client.force_login(alice)
    url = reverse("jobs:checkpoint", args=[job.pk, "step-000000000100.pt"])
    response = client.get(url)
    assert response.status_code == 200 and response.streaming
    assert response["Content-Disposition"].startswith('attachment; filename="step-000000000100.pt"')
    assert b"".join(response.streaming_content) == content
    part = client.get(url, HTTP_RANGE="bytes=100-199")
    assert part.status_code == 206 and part["Content-Range"] == f"bytes 100-199/{len(content)}"
    assert b"".join(part.streaming_content) == content[100:200]


def test_a_pruned_checkpoint_is_gone_with_a_reason(client, alice, rate):
    job = make_job(alice, keep_checkpoints=2)
    keep_checkpoint(job, "step-000000000100.pt", 100, pruned=True)
    client.force_login(alice)
    response = client.get(reverse("jobs:checkpoint", args=[job.pk, "step-000000000100.pt"]))
    assert response.status_code == 410
    assert "deleted from storage" in response.content.decode() and "latest 2 checkpoints" in response.content.decode()
    assert client.get(reverse("jobs:checkpoint", args=[job.pk, "nope.pt"])).status_code == 404


def test_a_checkpoint_of_another_team_is_a_404(client, alice, charlie, rate):
    job = make_job(alice)
    keep_checkpoint(job, "step-000000000100.pt", 100)
    client.force_login(charlie)
    assert client.get(reverse("jobs:checkpoint", args=[job.pk, "step-000000000100.pt"])).status_code == 404


def test_a_checkpoint_on_s3_redirects_to_a_presigned_url(client, alice, rate, s3_storage):
    job = make_job(alice)
    keep_checkpoint(job, "step-000000000100.pt", 100)
    client.force_login(alice)
    response = client.get(reverse("jobs:checkpoint", args=[job.pk, "step-000000000100.pt"]))
    assert response.status_code == 302 and "X-Amz-Signature" in response["Location"]


# The job page -------------------------------------------------------------------------------


@pytest.fixture
def node(db):
    return Node.objects.create(name="n1", device_type="cpu", devices=2)


def page_of(client, user, job):
    client.force_login(user)
    response = client.get(reverse("jobs:detail", args=[job.pk]))
    assert response.status_code == 200
    return response.content.decode()


def test_the_page_has_the_metrics_card_with_data_and_latest_values(client, alice, rate):
    job = make_job(alice, early_stop_metric="heldout_accuracy", early_stop_mode="max", early_stop_patience=5)
    add_metrics(job, [(s, {"loss": 1.0 / s, "heldout_accuracy": s / 100}) for s in range(1, 3001)] + [(3001, {"loss": "NaN"})])
    page = page_of(client, alice, job)
    assert 'id="metrics"' in page and 'id="metric-charts"' in page
    data = json.loads(page.split('<script id="metrics-data" type="application/json">')[1].split("</script>")[0])
    assert set(data["series"]) == {"loss", "heldout_accuracy"}
    assert len(data["series"]["loss"]) <= 1000 and data["series"]["loss"][-1][:2] == [3001, None]
    assert data["summary"]["loss"]["count"] == 3001 and data["events"] == 3001
    assert data["early_stop_metric"] == "heldout_accuracy"
    # The latest values as text, without the chart.
    assert '<tr data-series="loss">' in page and ">NaN</td>" in page and "(1 not finite)" in page
    assert '<tr data-series="heldout_accuracy">' in page and ">30</td>" in page
    # The request card: early stopping, NaN stop, restarts, checkpoints kept, preemptible.
    assert "heldout_accuracy</span>, higher is better, after 5 evaluations without improvement" in page
    assert "Stops when a loss becomes NaN or infinite" in page
    assert "The latest 3 kept" in page and 'id="job-restarts">0</span> so far, at most 3 after lost nodes' in page
    assert 'id="job-preemptible">No<' in page


def test_a_page_without_metrics_says_so(client, alice, rate):
    job = make_job(alice, preemptible=True, stop_on_nan=False)
    page = page_of(client, alice, job)
    assert "No metrics yet" in page and "None yet" in page
    assert 'id="job-preemptible">Yes, at the preemptible rate<' in page
    assert 'id="job-nan-stop">Off<' in page and 'id="job-early-stop">Off<' in page
    assert 'id="meter-credit" hidden' in page


def test_the_page_lists_checkpoints_and_shows_them_on_the_timeline(client, alice, rate):
    job = make_job(alice)
    keep_checkpoint(job, "step-000000000100.pt", 100, pruned=True)
    keep_checkpoint(job, "step-000000000200.pt", 200)
    job.record("resume", data={"name": "step-000000000200.pt", "step": 200, "text": "resumed from step-000000000200.pt (step 200)"})
    page = page_of(client, alice, job)
    kept_url = reverse("jobs:checkpoint", args=[job.pk, "step-000000000200.pt"])
    pruned_url = reverse("jobs:checkpoint", args=[job.pk, "step-000000000100.pt"])
    assert f'href="{kept_url}"' in page and f'href="{pruned_url}"' not in page
    assert '<li data-name="step-000000000100.pt" class="pruned"' in page and ">pruned</span>" in page
    assert "step 200 · " in page
    card = page.split('id="checkpoints"')[1].split("</section>")[0]
    assert card.index("step-000000000200.pt") < card.index("step-000000000100.pt")  # newest first
    timeline = page.split('id="timeline"')[1].split("</ol>")[0]
    assert "checkpoint step-000000000100.pt kept (step 100)" in timeline
    assert 'mark mark-resume">resumed</span>' in timeline and "resumed from step-000000000200.pt (step 200)" in timeline
    assert '"state state-queued">queued' in timeline
    # The card alone, for htmx to fetch again when a checkpoint is kept.
    client.force_login(alice)
    fragment = client.get(reverse("jobs:detail", args=[job.pk]) + "?part=checkpoints", HTTP_HX_REQUEST="true").content.decode()
    assert fragment.startswith('<section class="card" id="checkpoints"') and "step-000000000200.pt" in fragment


def test_the_meter_shows_the_credit_for_time_lost_through_the_network(client, alice, rate, node):
    job = make_job(alice)
    [allocation] = schedule_now()
    job.refresh_from_db()
    job.mark_running()
    allocation.release(allocation.started_at + timedelta(seconds=72), Allocation.NODE_LOST)
    job.refresh_from_db()
    job.requeue("node n1 lost")
    page = page_of(client, alice, job)
    assert 'id="meter-credit" hidden' not in page
    assert 'Credited: <span id="credit-held" class="mono">0:01:12</span>' in page
    assert "USD 0.0480</span> for time lost through the network's fault" in page
    assert 'id="job-restarts">1</span>' in page


def test_the_page_shows_events_up_to_its_last_seq_only(client, alice, rate):
    """What the page shows and what the websocket sends after data-after never overlap."""
    job = make_job(alice)
    add_metrics(job, [(1, {"loss": 0.5})])
    page = page_of(client, alice, job)
    job.refresh_from_db()
    assert f'data-after="{job.last_seq}"' in page
    data = json.loads(page.split('<script id="metrics-data" type="application/json">')[1].split("</script>")[0])
    assert data["last_seq"] == job.last_seq


def test_other_teams_do_not_see_the_page(client, alice, charlie, rate):
    job = make_job(alice)
    client.force_login(charlie)
    assert client.get(reverse("jobs:detail", args=[job.pk])).status_code == 404
    assert client.get(reverse("jobs:detail", args=[job.pk]) + "?part=checkpoints", HTTP_HX_REQUEST="true").status_code == 404


def test_metric_times_are_iso(alice, rate):
    job = make_job(alice)
    at = timezone.now()
    JobEvent.append(job.pk, [JobEvent(kind="metric", at=at, data={"step": 1, "values": {"loss": 1}})])
    from jobs.views import metrics_data

    assert metrics_data(job)["series"]["loss"][0][2] == at.isoformat()


def test_metric_events_times_are_written_as_isoformat_writes_them(alice):
    """A point's time is the text the websocket's events carry (isoformat, UTC), with and
    without microseconds: the chart's points and the live ones line up."""
    from datetime import UTC, datetime

    from jobs.models import JobEvent, event_message

    job = make_job(alice)
    whole, fraction = datetime(2026, 12, 6, 7, 0, 0, tzinfo=UTC), datetime(2026, 12, 6, 7, 0, 1, 5, tzinfo=UTC)
    JobEvent.append(job.pk, [JobEvent(kind="metric", at=at, data={"step": n, "values": {"loss": 0.5}}) for n, at in enumerate([whole, fraction])])
    read = list(run_data.metric_events(job))
    stored = JobEvent.objects.filter(job=job, kind="metric").order_by("seq")
    assert read == [event_message(e.seq, "metric", e.at, "", "", e.data) for e in stored]
    assert [e["at"] for e in read] == ["2026-12-06T07:00:00+00:00", "2026-12-06T07:00:01.000005+00:00"]
