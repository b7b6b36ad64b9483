"""The core loop end to end, with the web server, the scheduler and a runner as real processes.

Submit the digits example through the form (with CSRF) and the API, watch log lines and meter
ticks arrive over a websocket (reconnecting halfway), wait for success, download the weights,
check the model is trained, and check the bill is held seconds x rate. On SQLite with the
database relay, on PostgreSQL, and on PostgreSQL with the Redis channel layer.
"""

import importlib.util
import io
import json
import time
from datetime import datetime
from decimal import ROUND_HALF_EVEN, Decimal

import pytest
import torch
from websockets.sync.client import connect

from e31web.demo import digits_csv, digits_split
from tests.system import ROOT, TERMINAL, LiveSystem, csrf_from

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

EXAMPLE = ROOT / "examples" / "digits" / "train.py"


@pytest.fixture(
    scope="module",
    params=[("sqlite", False, False), ("postgres", True, True)],
    ids=["sqlite", "postgres-redis-s3"],
)
def system(request):
    """The embedded default, and production's shape: PostgreSQL, the Redis channel layer and S3
    storage (a real SeaweedFS). (PostgreSQL with the database relay instead of Redis is covered
    by tests/test_consumer.py on the PostgreSQL pass.)"""
    database, redis, s3 = request.param
    with LiveSystem(database=database, redis=redis, s3=request.getfixturevalue("seaweed") if s3 else None) as live:
        yield live


def load_example():
    spec = importlib.util.spec_from_file_location("digits_train", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def heldout_accuracy(weights_bytes):
    example = load_example()
    model = example.build_model(hidden=128)
    model.load_state_dict(torch.load(io.BytesIO(weights_bytes), weights_only=True))
    model.eval()
    _, (x, y) = digits_split()
    with torch.no_grad():
        predicted = model(torch.from_numpy(x.astype("float32") / 16.0)).argmax(dim=1).numpy()
    return (predicted == y).mean()


def read_events(websocket, until, timeout=120):
    """Events from a websocket until until(events) holds."""
    events = []
    while not until(events):
        message = json.loads(websocket.recv(timeout=timeout))
        assert message["type"] == "events"
        events.extend(message["events"])
    return events


def ended(events):
    return any(e["kind"] == "state" and e["state"] in TERMINAL for e in events)


def submit_through_form(system, tmp_path):
    """Log in and fill the new-job form, uploading the script and CSV files, CSRF and all."""
    (x_train, y_train), (x_held, y_held) = digits_split()
    client = system.browser_session()
    page = client.get("/jobs/new/")
    assert page.status_code == 200
    response = client.post(
        "/jobs/new/",
        data={
            "csrfmiddlewaretoken": csrf_from(page.text),
            "name": "digits-form",
            "gpus": "1",
            "mode": "span",
            "span_hours": "0.25",
            "config": "epochs: 30\nlr: 0.003\n",
        },
        files=[
            ("code", ("train.py", EXAMPLE.read_bytes())),
            ("data", ("digits-train.csv", digits_csv(x_train, y_train))),
            ("heldout", ("digits-heldout.csv", digits_csv(x_held, y_held))),
        ],
    )
    assert response.status_code == 302, response.text[-3000:]
    job_id = response.headers["location"].rstrip("/").rsplit("/", 1)[-1]
    job_page = client.get(f"/jobs/{job_id}/")
    assert job_page.status_code == 200 and "digits-form" in job_page.text
    return client, job_id


def check_bill(system, job):
    """The usage record is exactly GPUs x held seconds x rate, and matches the job's meter."""
    usage = system.api("GET", "/api/usage/").json()
    records = [r for r in usage["records"] if r["job_id"] == job["id"]]
    assert len(records) == 1
    record = records[0]
    started = datetime.fromisoformat(record["started_at"])
    ended_at = datetime.fromisoformat(record["ended_at"])
    held = int((ended_at - started).total_seconds())
    assert record["held_seconds"] == held > 0
    expected = (Decimal(record["gpus"] * held) * Decimal(record["rate"]) / 3600).quantize(Decimal("0.00000001"), rounding=ROUND_HALF_EVEN)
    assert Decimal(record["amount"]) == expected
    assert Decimal(record["rate"]) == Decimal("2.50")  # the demo's rate, set as an operator would
    assert job["held_seconds"] == held
    assert Decimal(job["cost"]) == expected
    return record


def test_the_core_loop(system, tmp_path):
    # Through the API, naming the demo datasets; watch it live from the moment it is queued.
    job = system.submit(
        {"name": "digits-api", "train_dataset": "digits", "heldout_dataset": "digits-heldout", "gpus": 1, "span_hours": 0.25},
        EXAMPLE,
    )
    assert job["state"] == "queued"
    headers = {"Authorization": f"Token {system.token}"}

    # First connection: read until a few log lines arrived, then drop it.
    with connect(system.ws_url(job["id"]), additional_headers=headers) as ws:
        first = read_events(ws, lambda ev: sum(e["kind"] == "log" for e in ev) >= 3)
    last_seen = first[-1]["seq"]
    # Second connection: resume after the last event seen, read to the end.
    with connect(system.ws_url(job["id"], after=last_seen), additional_headers=headers) as ws:
        second = read_events(ws, ended)
    events = first + second
    seqs = [e["seq"] for e in events]
    assert seqs == sorted(set(seqs)), "events repeated or out of order across the reconnect"

    # Through the browser form, at the same time.
    client, form_job_id = submit_through_form(system, tmp_path)

    done = system.wait_for_state(job["id"])
    assert done["state"] == "succeeded", done
    form_job = system.wait_for_state(form_job_id)
    assert form_job["state"] == "succeeded", form_job

    # Every log line the server kept arrived over the websockets, once, in order.
    logs = system.api("GET", f"/api/jobs/{job['id']}/logs/?after=0&limit=5000").json()
    assert not logs["more"]
    stored = [(line["seq"], line["text"]) for line in logs["lines"]]
    live = [(e["seq"], e["text"]) for e in events if e["kind"] == "log"]
    assert live == stored
    assert any("epoch 30/30" in text for _, text in stored)

    # The meter ticked while compute was held, and its last figure is the bill.
    meters = [e for e in events if e["kind"] == "meter"]
    assert any(m["running"] for m in meters), "no live meter tick arrived"
    assert meters[-1]["running"] is False
    assert meters[-1]["held_seconds"] == done["held_seconds"]
    states = [e["state"] for e in events if e["kind"] == "state"]
    assert states[-3:] == ["starting", "running", "succeeded"]

    # The weights come back and the model is trained.
    # (With S3 storage a download is a redirect to a short-lived presigned URL.)
    api_get = lambda path: system.api("GET", path, follow_redirects=True)  # noqa: E731
    page_get = lambda path: client.get(path, follow_redirects=True)  # noqa: E731
    for job_id, download in ((job["id"], api_get), (form_job_id, page_get)):
        artifacts = {a["name"]: a for a in system.api("GET", f"/api/jobs/{job_id}/artifacts/").json()}
        assert {"model.pt", "metrics.json"} <= set(artifacts)
        path = artifacts["model.pt"]["url"].split(str(system.port), 1)[1]
        weights = download(path if job_id == job["id"] else f"/jobs/{job_id}/artifacts/model.pt")
        assert weights.status_code == 200
        assert len(weights.content) == artifacts["model.pt"]["size"]
        if "E31_STORAGE_URL" in system.env:
            assert weights.history and weights.history[0].status_code == 302
            assert weights.url.host == "127.0.0.1" and "X-Amz-Signature" in str(weights.url)
        assert heldout_accuracy(weights.content) > 0.9

    # The full log downloads from the page too.
    full_log = page_get(f"/jobs/{form_job_id}/log.txt")
    assert full_log.status_code == 200 and "epoch 30/30" in full_log.text

    # The bill: held seconds x rate, nothing while queued, nothing after.
    check_bill(system, done)
    check_bill(system, form_job)


def test_reconnecting_after_the_end_sends_only_what_was_missed(system):
    job = system.submit({"name": "digits-api", "train_dataset": "digits", "gpus": 1, "span_hours": 0.25, "config": {"epochs": 5}}, EXAMPLE)
    done = system.wait_for_state(job["id"])
    assert done["state"] == "succeeded", done
    headers = {"Authorization": f"Token {system.token}"}
    cut = 5
    with connect(system.ws_url(job["id"], after=cut), additional_headers=headers) as ws:
        events = read_events(ws, lambda ev: ev and ev[-1]["seq"] == done["last_seq"])
    seqs = [e["seq"] for e in events]
    assert seqs[0] > cut and seqs == sorted(set(seqs))
    # Old meter ticks are history: a backlog carries only the latest, the final one.
    meters = [e for e in events if e["kind"] == "meter"]
    assert len(meters) == 1 and meters[0]["running"] is False
    assert [e["state"] for e in events if e["kind"] == "state"][-1] == "succeeded"
    logs = system.api("GET", f"/api/jobs/{job['id']}/logs/?after={cut}").json()["lines"]
    assert [line["seq"] for line in logs] == [e["seq"] for e in events if e["kind"] == "log"]


def test_a_browser_socket_needs_our_origin_and_a_session(system):
    job = system.submit({"name": "tiny", "train_dataset": "digits", "gpus": 1, "span_hours": 0.25, "config": {"epochs": 1}}, EXAMPLE)
    client = system.browser_session()
    cookie = f"sessionid={client.cookies['sessionid']}"
    with connect(system.ws_url(job["id"]), additional_headers={"Cookie": cookie}, origin=system.url) as ws:
        assert json.loads(ws.recv(timeout=30))["type"] == "events"
    with pytest.raises(Exception):
        with connect(system.ws_url(job["id"]), additional_headers={"Cookie": cookie}, origin="http://evil.example") as ws:
            ws.recv(timeout=10)


def test_cancel_stops_a_running_job_within_five_seconds(system):
    job = system.submit({"name": "long", "train_dataset": "digits", "gpus": 1, "span_hours": 1, "config": {"epochs": 100000}}, EXAMPLE)
    system.wait_until(lambda: system.api("GET", f"/api/jobs/{job['id']}/logs/").json()["lines"], 60, "the first log line")
    asked = time.monotonic()
    response = system.api("POST", f"/api/jobs/{job['id']}/cancel/")
    assert response.status_code == 202
    done = system.wait_for_state(job["id"], timeout=30)
    assert time.monotonic() - asked < 5
    assert done["state"] == "cancelled"
    assert done["allocation"]["ended_at"] is not None
    logs = system.api("GET", f"/api/jobs/{job['id']}/logs/").json()["lines"]
    assert any(line["text"].startswith("training on") for line in logs), "the log is kept"
