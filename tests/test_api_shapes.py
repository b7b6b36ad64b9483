"""The API's JSON for jobs, datasets, versions and uploads, pinned: golden files under
tests/api_shapes/, one per answer, compared as text (so a field's name, order, type or value
that changes is caught: 3600 and 3600.0 differ, and so does a missing key).

The world is varied and deterministic: a queued job, a running gang with an earlier lost
allocation and a credit, a succeeded job with artifacts and metrics and its retraining (parent,
models), a recipe job with its smoke run, a job with named inputs (a dataset's version, a
deleted dataset's label, files), a failed job with a reason, a cancelled evaluation; datasets
with several versions, files, unfinished and finished uploads and an open version's manifest, a
registered bucket whose scan failed, and a fresh dataset. The user has a time zone of their own
(+05:30): the API's times must still come out as stored (UTC, "Z").

What differs between runs is normalised, and only that:
- the clock: django.utils.timezone.now is fixed at NOW while the world is built and fetched (the
  live meter of the running job, auto_now fields, sealed_at ...); a time still taken from the
  real clock (a model default bound at import) is replaced by "<now>" (any time within a day of
  the real clock; the world's own times are in 2026-11);
- ids: every UUID, alone or inside a string (a URL), is replaced by the name of the object the
  test gave it, e.g. "<job:base>", "<dataset:digits>", "<upload:digits/extra/part.bin>"; a UUID
  the test did not name fails the test.
Everything else (sha256 digests of fixed content, names, numbers, URLs' shapes) is compared as is.

The goldens are SQLite's (tests/api_shapes/*.json). Another database may answer a few values
differently today (a job's credited sum: SQLite's SUM of decimals comes back through a float,
"3.25" where PostgreSQL says "3.25000000"), so tests/api_shapes/<vendor>/ holds that database's
own version of just the answers that differ, and is used where it has one.

To write the goldens from the code as it is (SQLite: all of them; another database: those that
differ), run this file with E31_UPDATE_API_SHAPES=1, e.g.
    E31_UPDATE_API_SHAPES=1 pytest tests/test_api_shapes.py
    E31_UPDATE_API_SHAPES=1 DATABASE_URL=postgres://... pytest tests/test_api_shapes.py

Over 500 lines: the whole API's shapes, one world and one request per endpoint.
"""

import hashlib
import io
import json
import os
import re
import uuid
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone
from rest_framework.authtoken.models import Token

from billing.models import Credit, UsageRecord
from catalog import datasets
from catalog.models import Dataset, DatasetUpload, DatasetVersion
from core.storage import get_storage
from jobs.models import Artifact, Job, JobEvent, JobInput, JobModel, Upload
from jobs.serializers import KEPT
from scheduler.models import Allocation, Node, Staging

GOLDEN = Path(__file__).parent / "api_shapes"
UPDATE = os.environ.get("E31_UPDATE_API_SHAPES") == "1"

T0 = datetime(2026, 11, 2, 8, 0, tzinfo=UTC)  # the world's first job
NOW = datetime(2026, 11, 3, 12, 0, tzinfo=UTC)  # the fixed clock
UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
ISO = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+)?(Z|[+-]\d{2}:\d{2})$")


def minutes(n):
    return timedelta(minutes=n)


# The world --------------------------------------------------------------------------------------


class World:
    """The objects, and the name each UUID is shown as in the goldens."""

    def __init__(self, user):
        self.user = user
        self.team = user.membership.team
        self.names = {}
        self.jobs = {}
        self.datasets = {}
        self.uploads = {}

    def name(self, obj, label):
        self.names[str(obj.pk)] = f"<{label}>"
        return obj


def state_events(states_at, previous=None):
    """State events: [(state, at, reason), ...], each from the one before (the first from
    `previous`)."""
    events = []
    for state, at, reason in states_at:
        events.append(JobEvent(kind="state", at=at, data={"state": state, "from": previous, "reason": reason}))
        previous = state
    return events


def add_job(world, name, created, events=(), **fields):
    job = Job.objects.create(team=world.team, created_by=world.user, name=name, created_at=created, **fields)
    JobEvent.append(job.pk, list(events))
    job.refresh_from_db()
    world.jobs[name] = world.name(job, f"job:{name}")
    return job


def allocate(job, node, started, devices=(0,), ended=None, reason="", rate="2.4000", **fields):
    return Allocation.objects.create(
        job=job,
        node=node,
        devices=list(devices),
        device_type=node.device_type,
        rate=Decimal(rate),
        started_at=started,
        ended_at=ended,
        end_reason=reason,
        **fields,
    )


def bill(job, allocation, credit_seconds=0, reason="node lost"):
    """The allocation's usage record (it ended), and a credit for time lost, if any."""
    seconds = int((allocation.ended_at - allocation.started_at).total_seconds())
    amount = (Decimal(allocation.gpus * seconds) * allocation.rate / 3600).quantize(Decimal("0.00000001"))
    usage = UsageRecord.objects.create(
        team=job.team,
        job=job,
        allocation=allocation,
        gpu_type=allocation.device_type,
        gpus=allocation.gpus,
        started_at=allocation.started_at,
        ended_at=allocation.ended_at,
        held_seconds=seconds,
        rate=allocation.rate,
        amount=amount,
        period=allocation.started_at.date().replace(day=1),
    )
    if credit_seconds:
        credit = (Decimal(allocation.gpus * credit_seconds) * allocation.rate / 3600).quantize(Decimal("0.00000001"))
        Credit.objects.create(
            team=job.team, job=job, usage=usage, seconds=credit_seconds, amount=credit, reason=reason, period=usage.period, created_at=allocation.ended_at
        )


def add_artifact(job, name, content):
    key, size, sha256 = get_storage().save_blob(io.BytesIO(content))
    return Artifact.objects.create(job=job, name=name, key=key, size=size, sha256=sha256)


def weights(name, content):
    return {"name": name, "key": f"blobs/{hashlib.sha256(content).hexdigest()}", "size": len(content), "sha256": hashlib.sha256(content).hexdigest()}


def build_datasets(world, suffix=""):
    user, team = world.user, world.team
    digits = datasets.create_dataset(team, f"digits{suffix}", {"train.csv": b"x,y\n1,2\n", "labels.txt": b"0\n1\n"}, "handwritten digits")
    datasets.add_files(digits, {"more.csv": b"x,y\n3,4\n", "labels.txt": b"0\n1\n2\n"})
    version, _ = datasets.open_version(digits)  # v3, open, holding v2's files
    part = datasets.start_upload(version, "extra/part.bin", 10, user=user)
    datasets.put_chunk(part, 0, b"0123456789")  # all arrived, not completed
    notes = datasets.start_upload(version, "notes.txt", 5, user=user, sha256="a" * 64)  # nothing arrived
    done = datasets.start_upload(version, "done.txt", 3, user=user)
    datasets.put_chunk(done, 0, b"end")
    done = datasets.complete_upload(done)
    for order, upload in enumerate((part, notes, done)):  # the manifest lists unfinished uploads by created_at
        DatasetUpload.objects.filter(pk=upload.pk).update(created_at=NOW - minutes(10 - order))
        world.uploads[f"digits{suffix}/{upload.path}"] = world.name(upload, f"upload:digits{suffix}/{upload.path}")

    corpus = datasets.create_dataset(team, f"corpus{suffix}", {"a.txt": b"alpha\n"})
    datasets.add_files(corpus, {"b.txt": b"beta\n"})

    bucket = Dataset.objects.create(
        team=team,
        name=f"bucket{suffix}",
        description="a team's bucket",
        source=Dataset.S3,
        s3_bucket="team-data",
        s3_prefix="images/2026",
        s3_endpoint_url="https://s3.example.com",
        s3_region="eu-west-1",
        s3_credentials="(encrypted)",
    )
    bucket.new_version(state=DatasetVersion.SCANNING).fail("AccessDenied: the credentials may not list team-data/images/2026")

    fresh = datasets.create_upload_dataset(team, f"fresh{suffix}")
    for dataset in (digits, corpus, bucket, fresh):
        world.datasets[dataset.name] = world.name(dataset, f"dataset:{dataset.name}")


def build_jobs(world, suffix=""):
    """The jobs, newest last; created a minute apart (the list shows the newest first)."""
    team = world.team
    digits = Dataset.objects.get(team=team, name=f"digits{suffix}")
    corpus = Dataset.objects.get(team=team, name=f"corpus{suffix}")
    gpu_a = Node.objects.create(name=f"gpu-a{suffix}", device_type="H100", devices=8)
    gpu_b = Node.objects.create(name=f"gpu-b{suffix}", device_type="H100", devices=8)
    cpu = Node.objects.create(name=f"cpu{suffix}", device_type="cpu", devices=4)
    at = T0

    def next_minute():
        nonlocal at
        at += minutes(7)
        return at

    # A queued job with most of the request's fields set.
    created = next_minute()
    add_job(
        world,
        f"queued{suffix}",
        created,
        state_events([("queued", created, "submitted")]),
        entrypoint="src/train.py",
        args=["--lr", "0.1", "$E31_DATA_DIR"],
        hyperparameters={"epochs": 3, "batch": 32},
        config={"optimizer": {"name": "adam"}},
        workdir="src",
        processes=2,
        packages="numpy==2.1.0\ntqdm",
        precision="bf16",
        train_version=digits.versions.get(number=2),
        heldout_version=digits.versions.get(number=1),
        gpus=1,
        span_hours=Decimal("1.5"),
        not_before=NOW - minutes(30),
        deadline=NOW + timedelta(days=1),
        predicted_start=NOW + timedelta(hours=1),
        predicted_finish=NOW + timedelta(hours=2, minutes=30),
        wait_reason="waiting for 1 GPU",
        network=True,
        idle_minutes=15,
        stop_if_idle=True,
        early_stop_metric="val_loss",
        early_stop_patience=3,
        keep_checkpoints=2,
    )

    # A running gang of two nodes, after an earlier allocation lost with its node (credited),
    # staged on its second try, with a checkpoint and a resume; a money ceiling.
    created = next_minute()
    started = NOW - minutes(90)
    running = add_job(
        world,
        f"gang-running{suffix}",
        created,
        [
            *state_events(
                [
                    ("queued", created, "submitted"),
                    ("starting", NOW - timedelta(hours=5), "held 2 H100 devices"),
                    ("running", NOW - timedelta(hours=5) + minutes(1), "process started"),
                ]
            ),
            JobEvent(kind="checkpoint", at=NOW - timedelta(hours=4, minutes=30), data={"name": "ckpt-100.pt", "step": 100}),
            JobEvent(kind="log", at=NOW - timedelta(hours=4, minutes=29), stream="stdout", text="epoch 1"),
            *state_events([("queued", NOW - timedelta(hours=4), "node lost")], previous="running"),
            *state_events([("starting", started, "held a gang of 2 nodes"), ("running", started + minutes(1), "process started")], previous="queued"),
            JobEvent(kind="resume", at=started + minutes(2), data={"name": "ckpt-100.pt", "step": 100, "text": "resumed from ckpt-100.pt"}),
            JobEvent(kind="metric", at=started + minutes(3), data={"step": 110, "values": {"loss": 0.25}}),
        ],
        entrypoint="train.py",
        gpus=2,
        gpu_type="H100",
        ceiling_amount=Decimal("100.00"),
        restarts=1,
        idle_since=NOW - minutes(10),
        state="running",
    )
    lost = allocate(running, gpu_a, NOW - timedelta(hours=5), devices=(0, 1), ended=NOW - timedelta(hours=4), reason=Allocation.NODE_LOST, rate="3.2500")
    bill(running, lost, credit_seconds=1800)
    gang = gang_id(suffix)
    for rank, node in enumerate((gpu_a, gpu_b)):
        allocate(running, node, started, devices=(2, 3), rate="3.2500", gang=gang, node_rank=rank, gang_size=2)
    Staging.objects.create(job=running, node=gpu_a, state=Staging.ABANDONED, created_at=NOW - timedelta(hours=6))
    Staging.objects.create(
        job=running,
        node=gpu_a,
        state=Staging.STAGED,
        created_at=started - minutes(20),
        started_at=started - minutes(20),
        finished_at=started - minutes(15),
        files_total=3,
        files_done=3,
        bytes_total=3000,
        bytes_done=3000,
        bytes_moved=1000,
    )

    # A succeeded training job: artifacts, metrics, utilization.
    created = next_minute()
    started, finished = created + minutes(5), created + minutes(65)
    base = add_job(
        world,
        f"base{suffix}",
        created,
        [
            *state_events([("queued", created, "submitted"), ("starting", started, "held 1 cpu device"), ("running", started, "process started")]),
            JobEvent(kind="metric", at=started + minutes(10), data={"step": 1, "values": {"loss": 0.9, "acc": 0.5}}),
            JobEvent(kind="metric", at=started + minutes(20), data={"step": 2, "values": {"loss": 0.4, "acc": 0.8}}),
            *state_events([("succeeded", finished, "exited 0")], previous="running"),
        ],
        entrypoint="train.py",
        gpus=1,
        span_hours=Decimal("2"),
        train_version=digits.versions.get(number=1),
        state="succeeded",
        finished_at=finished,
        exit_code=0,
        reason="exited 0",
        utilization={
            "seconds": 3600,
            "busy": 0.75,
            "series": [{"name": "cpu0", "mean": 75.0, "peak": 100.0, "memory_mean": 1.5, "memory_peak": 2, "memory_total": 8}],
        },
    )
    bill(base, allocate(base, cpu, started, ended=finished, reason=Allocation.EXITED))
    add_artifact(base, "model.pt", b"weights of base")
    add_artifact(base, "metrics.json", b'{"acc": 0.8}')

    # Its retraining: a fine-tuning from base's weights, with more data; a GPU-hours ceiling.
    created = next_minute()
    started, finished = NOW - timedelta(hours=3), NOW - timedelta(hours=2)
    retrained = add_job(
        world,
        f"retrained{suffix}",
        created,
        [
            *state_events([("queued", created, "retraining base"), ("starting", started, "held"), ("running", started, "process started")]),
            JobEvent(kind="checkpoint", at=started + minutes(30), data={"name": "ckpt/step-5", "step": 5}),
            *state_events([("succeeded", finished, "exited 0")], previous="running"),
        ],
        kind=Job.KIND_FINETUNE,
        parent=base,
        entrypoint="train.py",
        gpus=1,
        ceiling_gpu_hours=Decimal("4.0000"),
        train_version=digits.versions.get(number=2),
        state="succeeded",
        finished_at=finished,
        exit_code=0,
        reason="exited 0",
    )
    JobModel.objects.create(
        job=retrained, label="start", source_job=base, description=f"the weights of base{suffix}", files=[weights("model.pt", b"weights of base")]
    )
    bill(retrained, allocate(retrained, cpu, started, ended=finished, reason=Allocation.EXITED))
    add_artifact(retrained, "model.pt", b"weights of retrained")

    # A recipe job and its smoke run (a job of its own, which must succeed first).
    created = next_minute()
    smoke = add_job(
        world,
        f"classifier-smoke{suffix}",
        created,
        state_events([("queued", created, "smoke run"), ("starting", created + minutes(1), "held"), ("running", created + minutes(1), "process started")])
        + state_events([("succeeded", created + minutes(3), "exited 0")], previous="running"),
        entrypoint="recipe:classifier",
        config={"epochs": 1, "hidden": 16},
        gpus=1,
        span_hours=Decimal("0.1"),
        state="succeeded",
        finished_at=created + minutes(3),
        exit_code=0,
        reason="exited 0",
    )
    bill(smoke, allocate(smoke, cpu, created + minutes(1), ended=created + minutes(3), reason=Allocation.EXITED))
    created = next_minute()
    add_job(
        world,
        f"classifier{suffix}",
        created,
        state_events([("queued", created, "submitted")]),
        entrypoint="recipe:classifier",
        config={"epochs": 20, "hidden": 64, "lr": 0.001},
        smoke_run=smoke,
        train_version=digits.versions.get(number=2),
        gpus=4,
        gpu_type="H100",
        span_hours=Decimal("0.25"),
        preemptible=True,
        wait_reason="waiting for its smoke run",
    )

    # Named inputs: a dataset's version, a deleted dataset's label, and files of a channel.
    created = next_minute()
    inputs = add_job(
        world,
        f"inputs{suffix}",
        created,
        state_events([("queued", created, "submitted")]),
        command="python -m train --data $E31_DATA_DIR",
        gpus=1,
        span_hours=Decimal("1"),
    )
    JobInput.objects.create(job=inputs, name="corpus", version=corpus.versions.get(number=2), label=f"corpus{suffix}@2")
    JobInput.objects.create(job=inputs, name="archive", version=None, label="deleted@1")
    for file_name in ("z.txt", "a.txt"):
        Upload.objects.create(
            team=team, uploaded_by=world.user, job=inputs, role=Upload.INPUT, channel="extra", name=file_name, key=f"blobs/{file_name}", size=1, sha256="0" * 64
        )

    # A failed job with a reason, after a preemption, its deadline missed.
    created = next_minute()
    started, finished = NOW - timedelta(hours=6), NOW - timedelta(hours=5, minutes=30)
    failed = add_job(
        world,
        f"failed{suffix}",
        created,
        state_events(
            [
                ("queued", created, "submitted"),
                ("starting", NOW - timedelta(hours=7), "held"),
                ("running", NOW - timedelta(hours=7), "process started"),
                ("queued", NOW - timedelta(hours=6, minutes=30), "preempted"),
                ("starting", started, "held"),
                ("running", started, "process started"),
                ("failed", finished, "exited with 137: killed (out of memory?)"),
            ]
        ),
        entrypoint="train.py",
        gpus=1,
        span_hours=Decimal("3"),
        preemptible=True,
        deadline=NOW - timedelta(hours=1),
        deadline_missed_at=NOW - timedelta(hours=5),
        state="failed",
        finished_at=finished,
        exit_code=137,
        reason="exited with 137: killed (out of memory?)",
        restarts=1,
        preemptions=1,
    )
    first = allocate(failed, cpu, NOW - timedelta(hours=7), ended=NOW - timedelta(hours=6, minutes=30), reason=Allocation.PREEMPTED, preemptible=True)
    bill(failed, first, credit_seconds=600, reason="preempted")
    bill(failed, allocate(failed, cpu, started, ended=finished, reason=Allocation.EXITED, preemptible=True))

    # An evaluation of the retraining against base, cancelled before it started.
    created = next_minute()
    evaluation = add_job(
        world,
        f"evaluation{suffix}",
        created,
        state_events([("queued", created, "submitted"), ("cancelled", created + minutes(1), "cancelled before it started")]),
        kind=Job.KIND_EVALUATE,
        parent=retrained,
        entrypoint="recipe:classifier",
        heldout_version=digits.versions.get(number=1),
        gpus=1,
        span_hours=Decimal("0.5"),
        state="cancelled",
        finished_at=created + minutes(1),
        reason="cancelled before it started",
    )
    JobModel.objects.create(job=evaluation, label="new", source_job=retrained, files=[weights("model.pt", b"weights of retrained")])
    JobModel.objects.create(
        job=evaluation, label="previous", source_job=base, description="base", files=[weights("model.pt", b"weights of base"), weights("extra.bin", b"x")]
    )


def gang_id(suffix):
    """A gang's id, fixed (it is not shown)."""
    return uuid.uuid5(uuid.NAMESPACE_URL, f"gang{suffix}")


@pytest.fixture
def clock(monkeypatch):
    monkeypatch.setattr(timezone, "now", lambda: NOW)
    return NOW


@pytest.fixture
def api(client, alice, clock):
    membership = alice.membership
    membership.time_zone = "Asia/Kolkata"  # +05:30: the API's times stay UTC all the same
    membership.save()
    client.defaults["HTTP_AUTHORIZATION"] = f"Token {Token.objects.create(user=alice).key}"
    yield client
    timezone.deactivate()


@pytest.fixture
def world(alice, clock):
    world = World(alice)
    build_datasets(world)
    build_jobs(world)
    return world


# Normalising and comparing ----------------------------------------------------------------------


def normalise(value, names, real_now):
    if isinstance(value, dict):
        return {key: normalise(item, names, real_now) for key, item in value.items()}
    if isinstance(value, list):
        return [normalise(item, names, real_now) for item in value]
    if not isinstance(value, str):
        return value
    if ISO.match(value):
        moment = datetime.fromisoformat(value.replace("Z", "+00:00"))
        if abs(moment - real_now) < timedelta(days=1):
            return "<now>"
        return value

    def named(match):
        assert match.group(0) in names, f"an id the test did not name: {match.group(0)} in {value!r}"
        return names[match.group(0)]

    return UUID.sub(named, value)


def fetch(api, url):
    response = api.get(url)
    assert response.status_code == 200, (url, response.status_code, response.content[:500])
    return response.json()


def answers(api, world):
    """{golden name: the answer's JSON} of every call pinned."""
    found = {
        "jobs_list": fetch(api, reverse("api:jobs")),
        "jobs_list_page_2_of_3": fetch(api, reverse("api:jobs") + "?page_size=3&page=2"),
        "jobs_list_state_succeeded": fetch(api, reverse("api:jobs") + "?state=succeeded"),
        "datasets_list": fetch(api, reverse("api:datasets")),
        "datasets_list_page_2_of_2": fetch(api, reverse("api:datasets") + "?page_size=2&page=2"),
    }
    for name, job in world.jobs.items():
        found[f"job_{name}"] = fetch(api, reverse("api:job", args=[job.pk]))
    found["job_base_artifacts"] = fetch(api, reverse("api:job-artifacts", args=[world.jobs["base"].pk]))
    for name, dataset in world.datasets.items():
        found[f"dataset_{name}"] = fetch(api, reverse("api:dataset", args=[dataset.pk]))
        for number in dataset.versions.order_by("number").values_list("number", flat=True):
            found[f"version_{name}@{number}"] = fetch(api, reverse("api:dataset-version", args=[dataset.pk, number]))
    for name, upload in world.uploads.items():
        found[f"upload_{name.replace('/', '_')}"] = fetch(api, reverse("api:dataset-upload", args=[upload.pk]))
    return found


def as_text(value):
    return json.dumps(value, indent=2, ensure_ascii=False) + "\n"


def expected(name):
    """The golden answer: the database's own where it has one (see the module's docstring)."""
    own = GOLDEN / connection.vendor / f"{name}.json"
    return (own if own.exists() else GOLDEN / f"{name}.json").read_text()


def update(found):
    """Write the goldens: all of them on SQLite; on another database, those that differ."""
    if connection.vendor == "sqlite":
        folder, texts = GOLDEN, found
    else:
        folder = GOLDEN / connection.vendor
        texts = {name: text for name, text in found.items() if not (GOLDEN / f"{name}.json").exists() or (GOLDEN / f"{name}.json").read_text() != text}
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("*.json"):
        old.unlink()
    for name, text in texts.items():
        (folder / f"{name}.json").write_text(text)
    return folder, len(texts)


def test_the_api_answers_as_pinned(api, world):
    real_now = datetime.now(UTC)
    found = {name: as_text(normalise(body, world.names, real_now)) for name, body in answers(api, world).items()}
    if UPDATE:
        folder, count = update(found)
        pytest.skip(f"wrote {count} golden files to {folder}")
    pinned = {path.stem for path in GOLDEN.glob("*.json")}
    assert pinned == set(found), f"goldens without an answer: {sorted(pinned - set(found))}; answers without a golden: {sorted(set(found) - pinned)}"
    for name, text in found.items():
        assert text == expected(name), f"{name} differs from its golden file in tests/api_shapes/"


def test_the_world_is_varied_enough(api, world):
    """The goldens cover what they claim: each shape's optional parts appear somewhere."""
    jobs = fetch(api, reverse("api:jobs"))["results"]
    assert {j["state"] for j in jobs} == {"queued", "running", "succeeded", "failed", "cancelled"}
    assert {j["kind"] for j in jobs} == {"train", "finetune", "evaluate"}
    assert any(j["parent"] for j in jobs) and any(j["smoke_run"] for j in jobs) and any(j["recipe"] for j in jobs)
    assert any(j["models"] for j in jobs) and any(j["staging"] for j in jobs) and any(j["ceiling_used_fraction"] is not None for j in jobs)
    assert any(len(j["allocations"]) == 2 for j in jobs) and any(j["credited_seconds"] for j in jobs)
    assert any(isinstance(v, list) for j in jobs for v in j["inputs"].values()) and any(isinstance(v, str) for j in jobs for v in j["inputs"].values())
    assert any(t["kind"] == "resume" for j in jobs for t in j["timeline"]) and any(t["kind"] == "checkpoint" for j in jobs for t in j["timeline"])
    sets = fetch(api, reverse("api:datasets"))["results"]
    assert {d["state"] for d in sets} == {"ready", "failed", "open"} and any("s3" in d for d in sets)
    digits = fetch(api, reverse("api:dataset", args=[world.datasets["digits"].pk]))
    assert [v["number"] for v in digits["versions"]] == [3, 2, 1] and "uploads_url" in digits["versions"][0]
    version = fetch(api, reverse("api:dataset-version", args=[world.datasets["digits"].pk, 3]))
    assert len(version["manifest"]) == 4 and len(version["uploads"]) == 2


# The lists' cost ------------------------------------------------------------------------------


def queries(api, url, kept=False):
    """The queries of a read of url: a first read (no job's JSON kept, jobs.written), or, kept, a
    read that follows one."""
    if not kept:
        KEPT.clear()
    with CaptureQueriesContext(connection) as captured:
        fetch(api, url)
    return len(captured.captured_queries)


def test_the_lists_cost_no_query_per_item(api, world):
    """The job list is a hot path: its queries do not grow with the jobs it shows (nor does the
    datasets list's with the datasets)."""
    jobs_url, datasets_url = reverse("api:jobs") + "?page_size=200", reverse("api:datasets") + "?page_size=200"

    def counted():
        return {"jobs": queries(api, jobs_url), "jobs again": queries(api, jobs_url, kept=True), "datasets": queries(api, datasets_url)}

    before = counted()
    build_datasets(world, "-2")
    build_jobs(world, "-2")
    after = counted()
    print(f"queries for {len(world.jobs) // 2} and {len(world.jobs)} jobs, {len(world.datasets) // 2} and {len(world.datasets)} datasets: {before} {after}")
    assert after == before
