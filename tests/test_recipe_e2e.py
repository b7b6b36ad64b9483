"""The built-in classifier recipe through the whole platform (real runner, staging, storage): a
fine-tuning truly starts from its starting weights, and "compare with previous" gives the right
verdict for a clearly better and a clearly worse fine-tuning."""

import json
import random

import pytest

from catalog import datasets
from jobs import lineage
from jobs.models import Job, Upload
from tests.conftest import make_job, upload
from tests.test_staging import run

# Real runners and recipe runs: with the end-to-end tests (the SQLite pass).
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300), pytest.mark.django_db(transaction=True)]


def table(rows, seed):
    """Two features; the label is which side of a line a point is on."""
    rng = random.Random(seed)
    lines = ["a,b,label"]
    for _ in range(rows):
        a, b = rng.uniform(-1, 1), rng.uniform(-1, 1)
        lines.append(f"{a:.4f},{b:.4f},{int(a + 0.5 * b > 0)}")
    return ("\n".join(lines) + "\n").encode()


def metric_points(job, name):
    """[(step, value)] of a metric the job logged, in order."""
    points = []
    for event in job.events.filter(kind="metric").order_by("seq"):
        data = event.data or {}
        values = data.get("values") or {k: v for k, v in data.items() if k not in ("step", "at", "t")}
        if name in values:
            points.append((data.get("step"), values[name]))
    return points


def recipe_job(alice, team_a, name, config, **fields):
    job = make_job(alice, name=name, **fields)
    Job.objects.filter(pk=job.pk).update(entrypoint="recipe:classifier", config=config)
    job.uploads.filter(role=Upload.CODE).delete()
    job.refresh_from_db()
    return job


@pytest.fixture
def data(team_a, alice):
    train = datasets.create_dataset(team_a, "lines", {"part-0.csv": table(400, 1)})
    heldout = datasets.create_dataset(team_a, "lines-test", {"test.csv": table(400, 2)})
    return train.latest_version(), heldout.latest_version()


BASE = {"max_steps": 3, "eval_every": 1, "batch_size": 16, "hidden": 16, "lr": 0.01, "seed": 0}


def test_a_fine_tuning_starts_from_its_starting_weights(make_runner, alice, rate, team_a, data):
    runner = make_runner()
    train, heldout = data
    base = run([runner], recipe_job(alice, team_a, "weak", BASE, train_version=train, heldout_version=heldout))
    assert base.state == "succeeded", base.reason
    final = json.loads(b"".join(read(base, "metrics.json")))
    tuned = run([runner], lineage.retrain(base, alice))
    assert tuned.state == "succeeded", tuned.reason
    # Its first evaluation, before any step, is the previous job's last: the same weights.
    step, first = metric_points(tuned, "val_accuracy")[0]
    assert step == 0 and first == pytest.approx(final["val_accuracy"], abs=1e-6)
    assert metric_points(tuned, "val_loss")[0][1] == pytest.approx(final["val_loss"], abs=1e-6)


def read(job, name):
    from core.storage import get_storage

    with get_storage().open(job.artifacts.get(name=name).key) as stream:
        yield stream.read()


def test_compare_tells_a_clearly_better_and_a_clearly_worse_fine_tuning(make_runner, alice, rate, team_a, data, client):
    runner = make_runner()
    train, heldout = data
    weak = run([runner], recipe_job(alice, team_a, "weak", {**BASE, "max_steps": 1, "lr": 0.0005}, train_version=train, heldout_version=heldout))
    assert weak.state == "succeeded", weak.reason
    # Trained on: clearly better than where it started.
    better = lineage.retrain(weak, alice)
    Job.objects.filter(pk=better.pk).update(config={**BASE, "max_steps": 60, "eval_every": 30, "lr": 0.02})
    better = run([runner], better)
    assert better.state == "succeeded", better.reason
    verdict = compared(runner, lineage.compare(better, alice), client, alice)
    assert verdict["verdict"] == "better", verdict
    # Fine-tuned with labels turned upside down: clearly worse than where it started.
    flipped = datasets.create_dataset(team_a, "flipped", {"part-0.csv": flip(table(400, 1))}).latest_version()
    worse = lineage.retrain(better, alice)
    Job.objects.filter(pk=worse.pk).update(train_version=flipped, config={**BASE, "max_steps": 60, "eval_every": 30, "lr": 0.02})
    worse = run([runner], worse)
    assert worse.state == "succeeded", worse.reason
    verdict = compared(runner, lineage.compare(worse, alice), client, alice)
    assert verdict["verdict"] == "worse", verdict
    assert verdict["test"] == "McNemar's exact test" and verdict["n"] == 400


def flip(csv):
    head, *rows = csv.decode().strip().split("\n")
    return ("\n".join([head, *(r[:-1] + str(1 - int(r[-1])) for r in rows)]) + "\n").encode()


def compared(runner, job, client, user):
    done = run([runner], job)
    assert done.state == "succeeded", done.reason
    client.force_login(user)
    return client.get(f"/jobs/{done.pk}/comparison.json").json()["verdict"]


def test_an_uploaded_model_is_staged_for_a_fine_tuning(make_runner, alice, rate, team_a, data):
    runner = make_runner()
    train, heldout = data
    base = run([runner], recipe_job(alice, team_a, "weak", BASE, train_version=train, heldout_version=heldout))
    files = {a.name: b"".join(read(base, a.name)) for a in base.artifacts.all() if "/" not in a.name}
    tuned = recipe_job(alice, team_a, "from upload", BASE, train_version=train, heldout_version=heldout)
    Job.objects.filter(pk=tuned.pk).update(kind="finetune")
    uploads = [upload(team_a, alice, Upload.MODEL, name, content) for name, content in files.items() if name in ("model.safetensors", "recipe.json")]
    lineage.pin_model(tuned, "start", lineage.files_of_uploads(uploads), description="uploaded")
    tuned = run([runner], tuned)
    assert tuned.state == "succeeded", tuned.reason
    final = json.loads(files["metrics.json"])
    assert metric_points(tuned, "val_accuracy")[0][1] == pytest.approx(final["val_accuracy"], abs=1e-6)


def test_a_recipe_given_two_devices_trains_data_parallel_to_the_same_weights(make_runner, alice, rate, team_a, data):
    import torch
    from safetensors.torch import load

    runner = make_runner(devices=2)
    train, heldout = data
    config = {**BASE, "max_steps": 8, "eval_every": 4, "batch_size": 32}
    two = run([runner], recipe_job(alice, team_a, "two", config, gpus=2, processes=2, train_version=train, heldout_version=heldout))
    one = run([runner], recipe_job(alice, team_a, "one", config, gpus=1, train_version=train, heldout_version=heldout))
    assert two.state == one.state == "succeeded", (two.reason, one.reason)
    log = "\n".join(two.events.filter(kind="log").values_list("text", flat=True))
    assert "2 processes" in log, log[-2000:]
    weights = [load(b"".join(read(job, "model.safetensors"))) for job in (two, one)]
    assert weights[0].keys() == weights[1].keys()
    for name in weights[0]:
        assert torch.allclose(weights[0][name], weights[1][name], atol=1e-5), name
