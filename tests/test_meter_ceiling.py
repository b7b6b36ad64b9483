"""The meter against a job's ceiling: the arithmetic (pure), the API's figures, the job page's
bar and `e31 logs --follow`; with them, the job page's cancel confirmation and the demo's
preemptible rate (issue 21)."""

import io
import re
import threading
import time
from datetime import timedelta
from decimal import Decimal

import httpx
import pytest
from django.urls import reverse
from django.utils import timezone
from hypothesis import given
from hypothesis import strategies as st

from e31.cli import client as client_module
from e31.cli.client import Client
from e31.cli.follow import Follower, Printer, format_meter
from jobs.ceiling import ceiling_use
from scheduler.models import Allocation, Node
from tests.conftest import make_job, schedule_now
from tests.test_cli import TRAIN, e31, live  # noqa: F401 - the live system's fixtures

JOB_ID = "0f5c2b4e-9a1d-4c3b-8e7f-123456789abc"


@pytest.fixture
def node(db):
    return Node.objects.create(name="n1", device_type="cpu", devices=2)


def held_for(job, hours, reason=Allocation.EXITED):
    """The job placed now and its compute released `hours` later."""
    [allocation] = schedule_now()
    allocation.release(allocation.started_at + timedelta(hours=hours), reason)
    job.refresh_from_db()
    return allocation


# The arithmetic -------------------------------------------------------------------------------


@pytest.mark.nodb
def test_a_money_ceiling_is_used_by_what_was_billed():
    use = ceiling_use(Decimal("5.00"), None, billed=Decimal("1.20000000"), gpu_seconds=999_999)
    assert use.used_fraction == Decimal("0.24") and use.used_percent == 24
    assert use.amount_left == Decimal("3.80") and use.gpu_hours_left is None


@pytest.mark.nodb
def test_a_gpu_hour_ceiling_is_used_by_gpu_seconds_held():
    use = ceiling_use(None, Decimal("4"), billed=Decimal("123"), gpu_seconds=2 * 3600 + 1)
    assert use.gpu_hours_left == Decimal("1.9997")  # rounded down: never more left than there is
    assert use.used_fraction == Decimal("0.5000") and use.amount_left is None


@pytest.mark.nodb
def test_with_both_ceilings_the_nearer_one_counts():
    use = ceiling_use(Decimal("10"), Decimal("4"), billed=Decimal("2"), gpu_seconds=3 * 3600)
    assert use.used_fraction == Decimal("0.75") and use.amount_left == Decimal("8") and use.gpu_hours_left == Decimal("1")


@pytest.mark.nodb
def test_without_a_ceiling_there_is_nothing_to_say():
    assert ceiling_use(None, None, billed=Decimal("3"), gpu_seconds=100) is None


@pytest.mark.nodb
def test_nothing_is_left_past_the_ceiling_and_the_bar_stops_full():
    use = ceiling_use(Decimal("1"), Decimal("1"), billed=Decimal("1.5"), gpu_seconds=7200)
    assert (use.used_fraction, use.amount_left, use.gpu_hours_left) == (1, 0, 0)


@pytest.mark.nodb
@given(
    ceiling=st.decimals(min_value="0.01", max_value="100000", places=2),
    billed=st.decimals(min_value="0", max_value="200000", places=8),
)
def test_used_and_left_make_up_a_money_ceiling(ceiling, billed):
    use = ceiling_use(ceiling, None, billed=billed, gpu_seconds=0)
    assert 0 <= use.used_fraction <= 1 and 0 <= use.amount_left <= ceiling
    if billed <= ceiling:
        assert use.amount_left + billed == ceiling
        assert use.used_fraction <= billed / ceiling < use.used_fraction + Decimal("0.0001")


# The API ------------------------------------------------------------------------------------------


@pytest.fixture
def api(client, token, rate):
    client.defaults["HTTP_AUTHORIZATION"] = f"Token {token}"
    return client


def test_the_api_gives_what_is_left_of_a_money_ceiling(api, alice, node):
    job = make_job(alice, span_hours=None, ceiling_amount=Decimal("5.00"))
    held_for(job, 1)  # 1 GPU x 1 h x 2.40
    body = api.get(reverse("api:job", args=[job.pk])).json()
    assert body["cost"] == "2.40000000"
    assert body["ceiling_used_fraction"] == 0.48
    assert body["ceiling_amount_left"] == "2.60000000" and body["ceiling_gpu_hours_left"] is None


def test_the_api_gives_what_is_left_of_a_gpu_hour_ceiling(api, alice, node):
    job = make_job(alice, gpus=2, span_hours=None, ceiling_gpu_hours=Decimal("6"))
    held_for(job, 1.5)  # 2 GPUs x 1.5 h
    body = api.get(reverse("api:job", args=[job.pk])).json()
    assert body["ceiling_used_fraction"] == 0.5
    assert body["ceiling_gpu_hours_left"] == "3.0000" and body["ceiling_amount_left"] is None


def test_credited_time_is_given_back_to_the_ceiling(api, alice, node):
    job = make_job(alice, span_hours=None, ceiling_amount=Decimal("5.00"))
    held_for(job, 1, reason=Allocation.NODE_LOST)  # no checkpoint: all of it credited
    body = api.get(reverse("api:job", args=[job.pk])).json()
    assert Decimal(body["cost"]) == Decimal(body["credited"]) == Decimal("2.40")
    assert body["ceiling_used_fraction"] == 0 and body["ceiling_amount_left"] == "5.00000000"


def test_a_job_without_a_ceiling_has_no_ceiling_figures(api, alice, node):
    job = make_job(alice)
    held_for(job, 0.5)
    body = api.get(reverse("api:job", args=[job.pk])).json()
    assert (body["ceiling_used_fraction"], body["ceiling_amount_left"], body["ceiling_gpu_hours_left"]) == (None, None, None)


# The job page -------------------------------------------------------------------------------------


def test_the_job_page_shows_a_bar_and_the_amount_left(client, alice, rate, node):
    job = make_job(alice, span_hours=None, ceiling_amount=Decimal("5.00"))
    held_for(job, 1)
    client.force_login(alice)
    page = client.get(reverse("jobs:detail", args=[job.pk])).content.decode()
    assert '<progress id="ceiling-bar" max="1" value="0.4800"' in page
    assert '<span id="ceiling-amount-left" class="mono">USD 2.6000</span> left of USD 5.00' in page
    assert '<span id="ceiling-used">48%</span>' in page


def test_the_bar_follows_the_meter_while_it_runs(client, alice, rate, node):
    job = make_job(alice, gpus=2, span_hours=None, ceiling_gpu_hours=Decimal("4"))
    schedule_now(timezone.now() - timedelta(seconds=3630))  # held for 2 x 1 h 30 s so far, and still held
    client.force_login(alice)
    url = reverse("jobs:detail", args=[job.pk])
    page = client.get(url).content.decode()
    assert f'hx-get="{url}?part=ceiling"' in page and "every 3s" in page
    fragment = client.get(url, {"part": "ceiling"}, HTTP_HX_REQUEST="true").content.decode()
    assert fragment.lstrip().startswith('<div id="ceiling"') and "<html" not in fragment
    assert '<span id="ceiling-gpu-hours-left" class="mono">1.98' in fragment and "GPU-hours left of 4" in fragment
    assert '<span id="ceiling-used">50%</span>' in fragment


def test_an_outsider_cannot_read_the_ceiling(client, alice, charlie, rate, node):
    job = make_job(alice, span_hours=None, ceiling_amount=Decimal("5.00"))
    client.force_login(charlie)
    assert client.get(reverse("jobs:detail", args=[job.pk]), {"part": "ceiling"}, HTTP_HX_REQUEST="true").status_code == 404


def test_the_job_page_says_nothing_of_a_ceiling_it_does_not_have(client, alice, rate, node):
    job = make_job(alice)
    held_for(job, 0.5)
    client.force_login(alice)
    page = client.get(reverse("jobs:detail", args=[job.pk])).content.decode()
    assert 'id="ceiling' not in page and "of the ceiling" not in page


def test_cancel_asks_for_confirmation_and_still_cancels_without_javascript(client, alice, rate):
    job = make_job(alice, name="o'brien <run>")
    client.force_login(alice)
    page = client.get(reverse("jobs:detail", args=[job.pk])).content.decode()
    assert 'id="cancel-form" onsubmit="return confirm(\'Cancel the job “o\\u0027brien \\u003Crun\\u003E”? This cannot be undone.\')"' in page
    client.post(reverse("jobs:cancel", args=[job.pk]))
    job.refresh_from_db()
    assert job.state == "cancelled"


# e31 logs --follow -------------------------------------------------------------------------------


@pytest.mark.nodb
def test_the_meter_line_gives_the_cost_and_what_is_left_of_the_ceiling():
    job = {"cost": "2.40000000", "currency": "USD", "held_seconds": 3725, "ceiling_used_fraction": 0.29, "ceiling_amount_left": "2.60000000"}
    assert format_meter(job) == "meter: held 1:02:05, cost USD 2.4000; USD 2.6000 left of the ceiling (29% used)"
    gpu_hours = {"cost": "7.2", "currency": "USD", "held_seconds": 3600, "ceiling_used_fraction": 0.75, "ceiling_gpu_hours_left": "1.0000"}
    assert format_meter(gpu_hours) == "meter: held 1:00:00, cost USD 7.2000; 1 GPU-hours left of the ceiling (75% used)"
    assert format_meter({"cost": "0.5", "currency": "USD", "held_seconds": 1, "ceiling_used_fraction": None}) == "meter: held 0:00:01, cost USD 0.5000"
    assert format_meter({"id": JOB_ID, "state": "running"}) is None


@pytest.fixture
def fake_server(monkeypatch, tmp_path):
    routes = {}

    def handle(request):
        for (method, path), answer in routes.items():
            if request.method == method and request.url.path == path:
                return answer(request) if callable(answer) else answer
        return httpx.Response(404, json={"detail": "Not found."})

    monkeypatch.setattr(client_module, "DEFAULT_TRANSPORT", httpx.MockTransport(handle))
    monkeypatch.setenv("E31_CONFIG_DIR", str(tmp_path / "config"))
    return routes


def serve_once(messages):
    """A websocket server that sends each message (a list of events) then waits to be closed."""
    import json

    from websockets.sync.server import serve

    def handler(websocket):
        for events in messages:
            websocket.send(json.dumps({"type": "events", "events": events}))
        time.sleep(0.2)

    server = serve(handler, "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, server.socket.getsockname()[1]


def tick(seq, running=True):
    return {"seq": seq, "kind": "meter", "at": "x", "held_seconds": seq, "amount": "0.1", "running": running}


@pytest.mark.nodb
def test_following_prints_the_meter_now_and_then_and_when_it_stops(fake_server):
    answers = iter([("0.10", "4.90", 0.02), ("1.10", "3.90", 0.22), ("2.40", "2.60", 0.48)])

    def job(request):
        cost, left, used = next(answers)
        return httpx.Response(
            200,
            json={
                "id": JOB_ID,
                "state": "running",
                "cost": cost,
                "currency": "USD",
                "held_seconds": 60,
                "ceiling_amount": "5.00",
                "ceiling_used_fraction": used,
                "ceiling_amount_left": left,
                "ceiling_gpu_hours_left": None,
            },
        )

    fake_server[("GET", f"/api/jobs/{JOB_ID}/")] = job
    now = [0.0]
    events = [tick(1), tick(2), {"seq": 3, "kind": "log", "at": "x", "stream": "stdout", "text": "step 1"}, tick(4)]
    server, port = serve_once([events, [tick(5), tick(6, running=False), {"seq": 7, "kind": "state", "at": "x", "state": "stopped"}]])
    out, err = io.StringIO(), io.StringIO()

    def clock():
        now[0] += 25  # each tick read 25 s after the last: a line at most every 60 s
        return now[0]

    try:
        with Client(f"http://127.0.0.1:{port}", "secret-token") as client:
            assert Follower(client, JOB_ID, Printer(out=out, err=err), clock=clock).run() == "stopped"
    finally:
        server.shutdown()
    meters = [line for line in err.getvalue().splitlines() if line.startswith("-- meter")]
    assert meters == [
        "-- meter: held 0:01:00, cost USD 0.1000; USD 4.9000 left of the ceiling (2% used)",
        "-- meter: held 0:01:00, cost USD 1.1000; USD 3.9000 left of the ceiling (22% used)",
        "-- meter: held 0:01:00, cost USD 2.4000; USD 2.6000 left of the ceiling (48% used)",
    ]
    assert out.getvalue() == "step 1\n"


CEILING_SPEC = """\
name: ceiling-e2e
kind: train
work:
  code: code/train.py
  entrypoint: train.py
request: {gpus: 1, mode: until_done, ceiling: 5, ceiling_kind: money}
data:
  train_files: [data/]
"""


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_following_a_real_job_shows_what_is_left_of_its_ceiling(live, e31, tmp_path):
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "train.py").write_text(TRAIN)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "points.csv").write_text("x,y\n1,2\n")
    (tmp_path / "job.yaml").write_text(CEILING_SPEC)
    done = e31("submit", "job.yaml", "--follow")
    assert done.returncode == 0, (done.stdout, done.stderr, live.logs())
    meters = [line for line in done.stderr.splitlines() if line.startswith("-- meter: held ")]
    assert meters, done.stderr
    # The last line has the final figures: compute released, the cost and the rest of the ceiling.
    assert re.fullmatch(r"-- meter: held 0:00:\d\d, cost USD \d\.\d{4}; USD [45]\.\d{4} left of the ceiling \(\d+% used\)", meters[-1])
    assert "step 4" in done.stdout


# The demo -----------------------------------------------------------------------------------------


def test_the_demo_rate_has_a_cheaper_preemptible_price(db, monkeypatch):
    from e31web import demo

    monkeypatch.delenv("E31_DEMO_RATE", raising=False)
    monkeypatch.delenv("E31_DEMO_PREEMPTIBLE_RATE", raising=False)
    rate = demo.seed()["rate"]
    assert (rate.per_gpu_hour, rate.preemptible_per_gpu_hour) == (Decimal("2.50"), Decimal("1.5000"))
    assert rate.for_job(preemptible=True) < rate.for_job(preemptible=False)


def test_the_demo_rates_come_from_the_environment(db, monkeypatch):
    from billing.models import Rate
    from e31web import demo

    monkeypatch.setenv("E31_DEMO_RATE", "3.00")
    monkeypatch.delenv("E31_DEMO_PREEMPTIBLE_RATE", raising=False)
    assert demo.seed()["rate"].preemptible_per_gpu_hour == Decimal("1.80")
    Rate.objects.all().delete()
    monkeypatch.setenv("E31_DEMO_PREEMPTIBLE_RATE", "0.75")
    assert demo.seed()["rate"].preemptible_per_gpu_hour == Decimal("0.75")
