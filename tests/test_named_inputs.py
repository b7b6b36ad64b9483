"""Named inputs, as SageMaker's channels: a job reads any number of datasets, each under a name
it chooses, staged into $E31_DATA_DIR/<name> and announced as SM_CHANNEL_<NAME>, SM_CHANNELS
listing them all. A SageMaker script that reads SM_CHANNEL_TRAINING and SM_CHANNEL_TESTING runs
with no wrapper."""

import io
import json

import pytest
from django.urls import reverse

from catalog import datasets
from jobs import launch, spec_text
from jobs.manifest import job_manifest
from jobs.models import Job, JobInput, Upload
from tests.conftest import add_dataset, upload
from tests.test_staging import run

# Pure ------------------------------------------------------------------------------------------


@pytest.mark.nodb
@pytest.mark.parametrize(
    "name,words",
    [
        ("../up", "letters, digits"),
        ("", "letters, digits"),
        ("a b", "letters, digits"),
        ("x" * 65, "at most 64"),
        ("model", "the models' channel"),
        ("-x", "letters, digits"),
    ],
)
def test_an_input_s_name_is_a_folder_and_a_variable(name, words):
    assert words in launch.input_name_problem(name)


@pytest.mark.nodb
def test_two_names_that_would_be_one_variable_are_refused():
    assert launch.input_name_problem("train-set", ["train-set", "train_set"]) == ("'train-set' and 'train_set' would both be SM_CHANNEL_TRAIN_SET: rename one")
    assert launch.input_name_problem("training", ["training", "testing"]) is None


@pytest.mark.nodb
def test_inputs_are_a_mapping_of_names_to_datasets():
    assert spec_text.parse_inputs("training: digits\ntesting: {dataset: digits@2}") == {"training": "digits", "testing": "digits@2"}
    with pytest.raises(spec_text.SpecError, match="input testing: name the dataset"):
        spec_text.parse_inputs({"testing": 3})
    with pytest.raises(spec_text.SpecError, match="must be a mapping"):
        spec_text.parse_inputs("- a\n- b\n")


@pytest.mark.nodb
def test_each_input_is_a_channel_of_the_environment(tmp_path):
    dirs = launch.JobDirs(tmp_path)
    env = launch.build_environment(job_id="j", dirs=dirs, devices=[0], device_type="cpu", declared={}, inputs=["training", "testing"])
    assert env["SM_CHANNEL_TRAINING"] == str(dirs.data / "training") and env["SM_CHANNEL_TESTING"] == str(dirs.data / "testing")
    assert json.loads(env["SM_CHANNELS"]) == ["heldout", "model", "testing", "train", "training"]
    assert json.loads(env["SM_TRAINING_ENV"])["channel_input_dirs"]["training"] == str(dirs.data / "training")
    assert "SM_CHANNEL_TRAINING is set by the network" in launch.refused_env_name("SM_CHANNEL_TRAINING", inputs=["training"])
    assert launch.refused_env_name("SM_CHANNEL_TRAINING") is None  # without such an input, the job's own to set


# Through the API -------------------------------------------------------------------------------


@pytest.fixture
def api(client, token, rate):
    client.defaults["HTTP_AUTHORIZATION"] = f"Token {token}"
    return client


@pytest.fixture
def two(team_a):
    return add_dataset(team_a, "mnist-train", {"a.csv": b"x\n1\n"}), add_dataset(team_a, "mnist-test", {"b.csv": b"x\n2\n"})


def submit(api, fields):
    code = io.BytesIO(b"print(1)\n")
    code.name = "train.py"
    return api.post(reverse("api:jobs"), {"spec": json.dumps({"gpus": 1, "span_hours": 1, "entrypoint": "train.py", **fields}), "code": code})


@pytest.mark.django_db
def test_a_job_names_its_inputs_and_needs_no_training_set(api, two):
    response = submit(api, {"inputs": {"training": "mnist-train", "testing": "mnist-test@1"}, "env": {"X": "$SM_CHANNEL_TESTING"}})
    assert response.status_code == 201, response.json()
    assert response.json()["inputs"] == {"testing": "mnist-test@1", "training": "mnist-train@1"}
    job = Job.objects.get()
    assert {i.name: i.version for i in job.inputs.all()} == {"training": two[0].latest_version(), "testing": two[1].latest_version()}
    assert sorted(item.dest for item in job_manifest(job) if item.role != "code") == ["data/testing/b.csv", "data/training/a.csv"]
    exported = api.get(reverse("api:job-spec", args=[job.pk]) + "?format=json").json()
    assert exported["data"]["inputs"] == {"testing": "mnist-test@1", "training": "mnist-train@1"}


@pytest.mark.django_db
def test_train_among_the_inputs_is_the_training_set(api, two):
    assert submit(api, {"inputs": {"train": "mnist-train"}}).status_code == 201
    job = Job.objects.get()
    assert job.train_version == two[0].latest_version() and not job.inputs.exists()


@pytest.mark.django_db
@pytest.mark.parametrize(
    "fields,words",
    [
        ({"inputs": {"training": "nope"}}, "input training: no dataset 'nope' in your team"),
        ({"inputs": {"model": "mnist-train"}}, "'model' is the models' channel"),
        ({"inputs": {"a-b": "mnist-train", "a_b": "mnist-test"}}, "would both be SM_CHANNEL_A_B"),
        ({"inputs": {"training": "mnist-train"}, "env": {"SM_CHANNEL_TRAINING": "/x"}}, "SM_CHANNEL_TRAINING is set by the network"),
        ({"inputs": {"train": "mnist-train"}, "train_dataset": "mnist-test"}, "give it once"),
    ],
)
def test_bad_inputs_are_a_400_with_the_reason(api, two, fields, words):
    response = submit(api, fields)
    assert response.status_code == 400
    assert words in json.dumps(response.json()), response.json()


@pytest.mark.django_db
def test_a_dataset_a_queued_job_reads_as_an_input_cannot_be_deleted(api, two):
    assert submit(api, {"inputs": {"training": "mnist-train"}}).status_code == 201
    with pytest.raises(datasets.DatasetInUse):
        datasets.delete_dataset(two[0])


# A SageMaker script, unchanged ------------------------------------------------------------------

SAGEMAKER = b"""
import argparse, json, os, shutil

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=1)
parser.add_argument("--model-dir", default=os.environ["SM_MODEL_DIR"])
parser.add_argument("--train", default=os.environ["SM_CHANNEL_TRAINING"])
parser.add_argument("--test", default=os.environ["SM_CHANNEL_TESTING"])
args = parser.parse_args()
rows = lambda folder: sum(len(open(os.path.join(folder, f)).read().split()) - 1 for f in os.listdir(folder))
json.dump({"train": rows(args.train), "test": rows(args.test), "epochs": args.epochs, "channels": json.loads(os.environ["SM_CHANNELS"])},
          open(os.path.join(args.model_dir, "summary.json"), "w"))
shutil.copy(__file__, os.path.join(args.model_dir, "code.py"))
"""


@pytest.mark.runs_jobs
@pytest.mark.timeout(180)
@pytest.mark.django_db(transaction=True)
def test_a_sagemaker_script_reads_its_channels_unchanged(make_runner, alice, rate, team_a):
    runner = make_runner()
    train = add_dataset(team_a, "mnist-train", {"a.csv": b"x\n1\n2\n3\n"})
    test = add_dataset(team_a, "mnist-test", {"b.csv": b"x\n4\n"})
    job = Job.objects.create(team=team_a, created_by=alice, name="sm", entrypoint="train.py", span_hours=1, gpus=1, hyperparameters={"epochs": 4})
    for name, dataset in (("training", train), ("testing", test)):
        version = dataset.latest_version()
        JobInput.objects.create(job=job, name=name, version=version, label=version.label)
    code = upload(team_a, alice, Upload.CODE, "train.py", SAGEMAKER)
    code.job = job
    code.save()
    job.record("state", data={"state": "queued", "from": None, "reason": "submitted"})
    job = run([runner], job)
    assert job.state == "succeeded", job.reason
    from core.storage import get_storage

    with get_storage().open(job.artifacts.get(name="summary.json").key) as stream:
        summary = json.loads(stream.read())
    assert summary == {"train": 3, "test": 1, "epochs": 4, "channels": ["heldout", "model", "testing", "train", "training"]}


@pytest.mark.django_db
def test_a_retraining_replaces_one_named_input_and_keeps_the_others(api, two, monkeypatch):
    from jobs import lineage

    assert submit(api, {"inputs": {"training": "mnist-train", "testing": "mnist-test"}}).status_code == 201
    job = Job.objects.get()
    # As if it had finished with weights (tests/test_lineage.py runs the real thing).
    monkeypatch.setattr(lineage, "weights_of", lambda job: [{"name": "model.pt", "size": 1, "sha256": "0" * 64, "key": "k"}])
    body = {"spec": json.dumps({"inputs": {"training": "mnist-test@1"}, "name": "again"})}
    response = api.post(reverse("api:job-retrain", args=[job.pk]), body)
    assert response.status_code == 201, response.json()
    assert response.json()["inputs"] == {"testing": "mnist-test@1", "training": "mnist-test@1"}
    refused = api.post(reverse("api:job-retrain", args=[job.pk]), {"spec": json.dumps({"inputs": {"training": "nope"}})})
    assert refused.status_code == 400 and "input training: no dataset 'nope'" in json.dumps(refused.json())
    files = api.post(reverse("api:job-retrain", args=[job.pk]), {"spec": json.dumps({"inputs": {"training": {"files": ["a.csv"]}}})})
    assert files.status_code == 400 and "reads datasets as its named inputs" in json.dumps(files.json())


# An input of files sent with the job -------------------------------------------------------------


def submit_files(api, fields, files):
    code = io.BytesIO(b"print(1)\n")
    code.name = "train.py"
    payload = {"spec": json.dumps({"gpus": 1, "span_hours": 1, "entrypoint": "train.py", **fields}), "code": code}
    for field, items in files.items():
        payload[field] = []
        for name, content in items:
            handle = io.BytesIO(content)
            handle.name = name
            payload[field].append(handle)
    return api.post(reverse("api:jobs"), payload)


@pytest.mark.django_db
def test_an_input_may_be_files_sent_with_the_job(api, two):
    response = submit_files(
        api,
        {"inputs": {"training": "mnist-train", "testing": {"files": ["t1.csv", "t2.csv"]}}},
        {"input:testing": [("t1.csv", b"x\n1\n"), ("t2.csv", b"x\n2\n")]},
    )
    assert response.status_code == 201, response.json()
    assert response.json()["inputs"] == {"testing": ["t1.csv", "t2.csv"], "training": "mnist-train@1"}
    job = Job.objects.get()
    assert sorted(i.dest for i in job_manifest(job) if i.role != "code") == ["data/testing/t1.csv", "data/testing/t2.csv", "data/training/a.csv"]
    exported = api.get(reverse("api:job-spec", args=[job.pk]) + "?format=json").json()["data"]["inputs"]
    assert exported == {"testing": {"files": ["t1.csv", "t2.csv"]}, "training": "mnist-train@1"}


@pytest.mark.django_db
@pytest.mark.parametrize(
    "fields,files,words",
    [
        ({"inputs": {"testing": {"files": ["t.csv"]}}}, {}, "The input testing is to be files, and none were sent"),
        ({"inputs": {"testing": "mnist-test"}}, {"input:testing": [("t.csv", b"x")]}, "is the dataset mnist-test@1 and files too"),
        ({}, {"input:../up": [("t.csv", b"x")]}, "an input's name is letters"),
        ({}, {"input:testing": [("t.csv", b"x"), ("t.csv", b"y")]}, "two files are named t.csv"),
    ],
)
def test_bad_input_files_are_a_400_with_the_reason(api, two, fields, files, words):
    response = submit_files(api, {"train_dataset": "mnist-train", **fields}, files)
    assert response.status_code == 400 and words in json.dumps(response.json()), response.json()


@pytest.mark.nodb
def test_the_e31_command_sends_an_input_s_files(tmp_path):
    from e31.cli.spec import local_refs

    (tmp_path / "t.csv").write_text("x\n1\n")
    text = "work: {code: train.py}\ndata:\n  inputs:\n    training: digits\n    testing:\n      files: [t.csv]\n"
    refs = local_refs(text, "job.yaml", tmp_path)
    assert [(r.field, r.text, r.line) for r in refs] == [("code", "train.py", 1), ("input:testing", "t.csv", 6)]


@pytest.mark.runs_jobs
@pytest.mark.timeout(180)
@pytest.mark.django_db(transaction=True)
def test_a_script_reads_an_input_of_sent_files(make_runner, alice, rate, team_a, client):
    train = add_dataset(team_a, "mnist-train", {"a.csv": b"x\n1\n2\n3\n"})
    client.force_login(alice)
    from django.core.files.uploadedfile import SimpleUploadedFile

    response = client.post(
        reverse("jobs:new"),
        {
            "code": SimpleUploadedFile("train.py", SAGEMAKER),
            "inputs": f"training: {train.name}",
            "name": "files-in",
            "input:testing": [SimpleUploadedFile("b.csv", b"x\n4\n5\n")],
            "gpus": 1,
            "mode": "span",
            "span_hours": "0.25",
            "stop_on_nan": "on",
        },
    )
    assert response.status_code == 302, response.context["form"].errors if response.context else response
    job = run([make_runner()], Job.objects.get(name="files-in"))
    assert job.state == "succeeded", job.reason
    from core.storage import get_storage

    with get_storage().open(job.artifacts.get(name="summary.json").key) as stream:
        assert json.loads(stream.read())["test"] == 2


@pytest.mark.django_db
def test_the_job_page_shows_its_inputs_and_reads_none_for_a_job_without(api, two, alice):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    named = submit(api, {"inputs": {"training": "mnist-train", "testing": "mnist-test@1"}})
    assert named.status_code == 201, named.json()
    named = named.json()["id"]
    plain = submit(api, {"name": "no-inputs", "train_dataset": "mnist-train"})
    assert plain.status_code == 201, plain.json()
    plain = plain.json()["id"]
    api.force_login(alice)
    page = api.get(reverse("jobs:detail", args=[named])).content.decode()
    assert page.count('class="job-input"') == 2 and "mnist-train@1" in page and "$E31_DATA_DIR/testing" in page
    with CaptureQueriesContext(connection) as captured:
        page = api.get(reverse("jobs:detail", args=[plain])).content.decode()
    assert 'class="job-input"' not in page
    assert not [q["sql"] for q in captured.captured_queries if q["sql"].startswith('SELECT "jobs_jobinput"')]
