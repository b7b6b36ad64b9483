"""Jobs made from jobs, with real runners and a real cache: a retraining starts from the previous
job's weights (staged with the data) and moves only the new bytes; "compare with previous" is an
evaluation job of the new weights against the starting ones whose page gives the verdict."""

import hashlib
import json

import pytest
from django.test import Client
from django.urls import reverse

from catalog import datasets
from core.storage import get_storage
from jobs import evaluation, lineage
from jobs.manifest import job_manifest
from jobs.models import Job, JobModel, Upload
from tests.conftest import make_job, upload
from tests.test_staging import run

pytestmark = [pytest.mark.runs_jobs, pytest.mark.timeout(180), pytest.mark.django_db(transaction=True)]

# Trains (writes weights whose "quality" is one more than its starting model's), or, with
# mode evaluate, scores each model on the held-out rows: a row is right when its difficulty
# is below the model's quality.
SCRIPT = b"""
import hashlib, json, os
data, out, models = os.environ["E31_DATA_DIR"], os.environ["E31_OUTPUT_DIR"], os.environ["E31_MODEL_DIR"]
config = json.load(open(os.environ["E31_CONFIG"]))
def listing(root):
    return sorted((os.path.relpath(os.path.join(d, f), root), hashlib.sha256(open(os.path.join(d, f), "rb").read()).hexdigest())
                  for d, _, files in os.walk(root) for f in files)
print(json.dumps({"train": listing(os.path.join(data, "train")), "models": listing(models)}))
def quality(folder):
    return int(open(os.path.join(folder, "model.pt")).read())
if config.get("mode") == "evaluate":
    rows = [int(x) for x in open(os.path.join(data, "heldout", "rows.txt")).read().split()]
    result = {"recipe": "test", "metric": "accuracy", "higher_is_better": True, "models": {}}
    for label in sorted(os.listdir(models)):
        q = quality(os.path.join(models, label))
        right = [1.0 if r < q else 0.0 for r in rows]
        result["models"][label] = {"metrics": {"accuracy": sum(right) / len(right)}, "per_example": right}
    json.dump(result, open(os.path.join(out, "evaluation.json"), "w"))
else:
    start = os.path.join(models, "start")
    q = quality(start) + int(config.get("gain", 1)) if os.path.isdir(start) else int(config.get("quality", 10))
    open(os.path.join(out, "model.pt"), "w").write(str(q))
    json.dump({"quality": q}, open(os.path.join(out, "recipe.json"), "w"))
"""


def seen(job):
    first = job.events.filter(kind="log").order_by("seq").first()
    return json.loads(first.text)


def sha(data):
    return hashlib.sha256(data).hexdigest()


def first_job(alice, team_a, runner, **fields):
    dataset = datasets.create_dataset(team_a, "grows", {f"old-{i}.bin": bytes([i]) * 30_000 for i in range(4)})
    job = run([runner], make_job(alice, script=SCRIPT, name="base", train_version=dataset.latest_version(), config={"quality": 10}, **fields))
    assert job.state == "succeeded", job.reason
    return job


def test_a_retraining_starts_from_the_weights_and_stages_only_the_new_files(make_runner, alice, rate, team_a):
    runner = make_runner()
    base = first_job(alice, team_a, runner)
    new_files = [upload(team_a, alice, Upload.TRAIN, "new-0.bin", b"n" * 12_345), upload(team_a, alice, Upload.TRAIN, "new-1.bin", b"m" * 6_789)]
    retrained = lineage.retrain(base, alice, new_data=new_files)
    assert retrained.kind == "finetune" and retrained.parent_id == base.pk and retrained.entrypoint == base.entrypoint
    assert retrained.config == base.config and retrained.gpus == base.gpus and retrained.span_hours == base.span_hours
    # The old dataset plus the new files, as a new version that shares the old ones.
    version = retrained.train_version
    assert version.dataset_id == base.train_version.dataset_id and version.number == 2 and version.file_count == 6
    assert version.parent_id == base.train_version.pk
    # The starting model is pinned: the previous job's weights, staged under model/start/.
    [start] = retrained.models.all()
    assert start.label == "start" and start.source_job_id == base.pk
    assert sorted(f["name"] for f in start.files) == ["model.pt", "recipe.json"]
    assert {i.dest for i in job_manifest(retrained) if i.role == "model"} == {"model/start/model.pt", "model/start/recipe.json"}

    done = run([runner], retrained)
    assert done.state == "succeeded", done.reason
    staged = done.stagings.get()
    weights = sum(f["size"] for f in start.files)
    assert staged.bytes_moved == 12_345 + 6_789 + weights, "only the new files and the starting model moved"
    listing = seen(done)
    assert [name for name, _ in listing["train"]] == ["new-0.bin", "new-1.bin", *[f"old-{i}.bin" for i in range(4)]]
    assert dict(listing["models"])["start/model.pt"] == sha(b"10")
    assert done.artifacts.get(name="model.pt").size == 2  # "11": it went on from the starting weights
    assert json.loads(b"".join(open_artifact(done, "recipe.json")))["quality"] == 11


def open_artifact(job, name):
    from core.storage import get_storage

    with get_storage().open(job.artifacts.get(name=name).key) as stream:
        yield stream.read()


def test_compare_with_previous_evaluates_both_models_and_gives_the_verdict(make_runner, alice, rate, team_a, client):
    runner = make_runner()
    base = first_job(alice, team_a, runner)
    Upload.objects.filter(pk=upload(team_a, alice, Upload.HELDOUT, "rows.txt", " ".join(str(i % 20) for i in range(200)).encode()).pk).update(job=base)
    better = run([runner], lineage.retrain(base, alice))
    with pytest.raises(lineage.LineageError, match="fine-tuning"):
        lineage.compare(base, alice)
    comparison = lineage.compare(better, alice)
    assert comparison.kind == "evaluate" and comparison.config["mode"] == "evaluate" and comparison.parent_id == better.pk
    assert [m.label for m in comparison.models.all()] == ["new", "previous"]
    assert comparison.uploads.filter(role=Upload.HELDOUT).count() == 1 and comparison.gpus == 1
    assert comparison.train_version is None and not [i for i in job_manifest(comparison) if i.role == "train"]  # only what it scores on
    done = run([runner], comparison)
    assert done.state == "succeeded", done.reason

    client.force_login(alice)
    page = client.get(reverse("jobs:detail", args=[done.pk])).content.decode()
    assert 'id="verdict"' in page and "better than" in page and "McNemar" in page
    data = client.get(reverse("jobs:comparison", args=[done.pk])).json()
    # quality 11 against 10: rows of difficulty 10 (10 of 200) only the new model gets right.
    assert data["verdict"]["verdict"] == "better" and data["verdict"]["only_new_right"] == 10 and data["verdict"]["only_previous_right"] == 0
    assert data["evaluation"]["models"]["new"]["metrics"]["accuracy"] == 0.55
    # The finished fine-tuning's page offers the comparison, the base's offers only a retraining.
    page = client.get(reverse("jobs:detail", args=[better.pk])).content.decode()
    assert 'id="compare-form"' in page and 'id="retrain-link"' in page
    page = client.get(reverse("jobs:detail", args=[base.pk])).content.decode()
    assert 'id="compare-form"' not in page and 'id="retrain-link"' in page


def test_the_retrain_form_is_prefilled_and_submits_a_fine_tuning(make_runner, alice, rate, team_a, client, charlie):
    runner = make_runner()
    base = first_job(alice, team_a, runner, span_hours=2)
    client.force_login(alice)
    url = reverse("jobs:retrain", args=[base.pk])
    page = client.get(url).content.decode()
    assert 'value="base (retrained)"' in page and 'name="span_hours"' in page and "old-3.bin" in page
    # Bad input: a clear error, and the new file is kept.
    from django.core.files.uploadedfile import SimpleUploadedFile

    response = client.post(url, {"gpus": 0, "mode": "span", "span_hours": "2", "data": SimpleUploadedFile("new.bin", b"z" * 100)})
    assert response.status_code == 400 and "Ask for at least 1 GPU." in response.content.decode()
    kept = Upload.objects.get(name="new.bin", job__isnull=True)
    assert kept.pk.hex[:8] in response.content.decode().replace("-", "")
    response = client.post(url, {"gpus": 1, "mode": "span", "span_hours": "2", "kept_data": [str(kept.pk)], "name": "overnight"})
    assert response.status_code == 302
    new = Job.objects.get(name="overnight")
    assert new.kind == "finetune" and new.parent_id == base.pk and new.train_version.file_count == 5
    assert JobModel.objects.get(job=new).source_job_id == base.pk
    # Another team's user cannot retrain, compare or read it.
    client.force_login(charlie)
    assert client.get(url).status_code == 404
    assert client.post(reverse("jobs:compare", args=[base.pk])).status_code == 404
    assert client.get(reverse("jobs:comparison", args=[base.pk])).status_code == 404


def test_a_retraining_may_change_the_config_hyperparameters_and_arguments(make_runner, alice, rate, team_a, client, token):
    runner = make_runner()
    base = first_job(alice, team_a, runner, span_hours=2)
    client.force_login(alice)
    url = reverse("jobs:retrain", args=[base.pk])
    page = client.get(url).content.decode()
    assert "{&quot;quality&quot;: 10}" in page  # the job's config, to change
    form = {"gpus": 1, "mode": "span", "span_hours": "2", "name": "gain 5", "config": "quality: 10\ngain: 5", "args": "--fast", "hyperparameters": ""}
    assert client.post(url, {**form, "args": "--data $NOPE"}).status_code == 400  # a variable the job does not have
    assert client.post(url, form).status_code == 302
    new = Job.objects.get(name="gain 5")
    assert (new.config, new.args, new.span_hours) == ({"quality": 10, "gain": 5}, ["--fast"], base.span_hours)
    new = run([runner], new)
    assert new.state == "succeeded", new.reason
    with get_storage().open(new.artifacts.get(name="model.pt").key) as stream:
        assert stream.read() == b"15"  # the base's 10, and the gain the changed config asked for
    # Through the API: what is not named is copied.
    api = Client(HTTP_AUTHORIZATION=f"Token {token}")
    body = {"spec": json.dumps({"hyperparameters": {"lr": 0.1}, "args": ["--data", "$E31_DATA_DIR/train"], "name": "api retrain"})}
    response = api.post(reverse("api:job-retrain", args=[base.pk]), body)
    assert response.status_code == 201, response.json()
    made = Job.objects.get(name="api retrain")
    assert (made.hyperparameters, made.args, made.config) == ({"lr": 0.1}, ["--data", "$E31_DATA_DIR/train"], base.config)
    refused = api.post(reverse("api:job-retrain", args=[base.pk]), {"spec": json.dumps({"hyperparameters": {"lr": [1]}})})
    assert refused.status_code == 400 and "hyperparameters" in refused.json()["errors"]


def test_a_job_without_weights_cannot_be_retrained(alice, team_a, client):
    job = make_job(alice, script=SCRIPT)
    with pytest.raises(lineage.LineageError, match="has not finished"):
        lineage.retrain(job, alice)
    client.force_login(alice)
    page = client.get(reverse("jobs:retrain", args=[job.pk])).content.decode()
    assert 'id="retrain-problem"' in page and 'id="retrain-form"' not in page


# The verdict, a pure function ---------------------------------------------------------------------


def scored(new, previous, metric="accuracy", higher=True):
    return {"metric": metric, "higher_is_better": higher, "models": {"new": {"per_example": new}, "previous": {"per_example": previous}}}


def test_a_clearly_better_and_a_clearly_worse_classifier():
    better = evaluation.compare(scored([1.0] * 90 + [0.0] * 10, [1.0] * 60 + [0.0] * 40))
    assert better.verdict == "better" and better.test == "McNemar's exact test" and better.p_value < 1e-6
    worse = evaluation.compare(scored([1.0] * 60 + [0.0] * 40, [1.0] * 90 + [0.0] * 10))
    assert worse.verdict == "worse"
    same = evaluation.compare(scored([1.0, 0.0] * 50, [0.0, 1.0] * 50))  # as many wins as losses
    assert same.verdict == "no significant difference" and same.p_value == 1.0
    few = evaluation.compare(scored([1.0] * 3 + [0.0] * 7, [0.0] * 10))  # 3 of 3 discordant: p = 0.25
    assert few.verdict == "no significant difference" and few.p_value == pytest.approx(0.25)


def test_losses_are_compared_with_a_paired_t_test_where_lower_is_better():
    import random

    rng = random.Random(0)
    previous = [2.0 + rng.gauss(0, 0.3) for _ in range(50)]
    new = [p - 0.2 + rng.gauss(0, 0.05) for p in previous]
    result = evaluation.compare(scored(new, previous, metric="loss", higher=False))
    assert result.verdict == "better" and result.test == "paired t-test" and result.difference < 0
    assert evaluation.compare(scored(previous, new, metric="loss", higher=False)).verdict == "worse"
    noise = [p + rng.gauss(0, 0.3) for p in previous]
    assert evaluation.compare(scored(noise[:10], previous[:10], metric="loss", higher=False)).verdict in ("no significant difference",)


def test_an_evaluation_that_does_not_line_up_is_refused():
    with pytest.raises(evaluation.EvaluationError, match="same examples"):
        evaluation.compare(scored([1.0, 0.0], [1.0]))
    with pytest.raises(evaluation.EvaluationError, match="no model labelled previous"):
        evaluation.compare({"models": {"new": {"per_example": [1.0]}}})
