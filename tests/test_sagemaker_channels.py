"""examples/sagemaker_channels: a SageMaker script with two channels (SM_CHANNEL_TRAINING,
SM_CHANNEL_TESTING), hyperparameters from argparse, copying its own source beside the model,
runs with no wrapper: directly, through the job form with a real runner, and through its spec
with the `e31` command against a live system."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.urls import reverse

from core.storage import get_storage
from e31web.demo import digits_csv, digits_split
from jobs.models import Job
from tests.conftest import add_dataset
from tests.test_cli import e31, live  # noqa: F401 - the live system's fixtures
from tests.test_staging import run

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "sagemaker_channels"
SOURCE = (EXAMPLE / "train.py").read_bytes()


def csvs():
    (x_train, y_train), (x_test, y_test) = digits_split()
    return digits_csv(x_train, y_train), digits_csv(x_test, y_test)


def stored(job, name):
    with get_storage().open(job.artifacts.get(name=name).key) as stream:
        return stream.read()


def test_it_runs_directly(tmp_path):
    train, test = csvs()
    for name, content in (("train", train), ("test", test)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "digits.csv").write_bytes(content)
    shutil.copy(EXAMPLE / "train.py", tmp_path / "train.py")
    env = {**os.environ, "SM_MODEL_DIR": str(tmp_path / "out"), "SM_CHANNEL_TRAINING": str(tmp_path / "train"), "SM_CHANNEL_TESTING": str(tmp_path / "test")}
    done = subprocess.run([sys.executable, "train.py", "--epochs", "2"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "out" / "train.py").read_bytes() == SOURCE


@pytest.mark.runs_jobs
@pytest.mark.timeout(240)
@pytest.mark.django_db(transaction=True)
def test_it_runs_through_the_form(make_runner, alice, rate, team_a, client):
    train, test = csvs()
    add_dataset(team_a, "digits", {"digits.csv": train})
    add_dataset(team_a, "digits-heldout", {"digits-heldout.csv": test})
    client.force_login(alice)
    response = client.post(
        reverse("jobs:new"),
        {
            "code": SimpleUploadedFile("train.py", SOURCE),
            "inputs": "training: digits\ntesting: digits-heldout",
            "hyperparameters": '{"epochs": 5, "lr": 0.01}',
            "gpus": 1,
            "mode": "span",
            "span_hours": "0.25",
            "stop_on_nan": "on",
            "name": "sm-form",
        },
    )
    assert response.status_code == 302, response.context["form"].errors if response.context else response
    job = run([make_runner()], Job.objects.get(name="sm-form"))
    assert job.state == "succeeded", job.reason
    assert stored(job, "train.py") == SOURCE
    metrics = json.loads(stored(job, "metrics.json"))
    assert (metrics["epochs"], metrics["lr"]) == (5, 0.01) and metrics["test_accuracy"] > 0.8  # the hyperparameters reached argparse


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_it_runs_from_its_spec_with_the_e31_command(live, e31, tmp_path):  # noqa: F811
    for name in ("train.py", "job.yaml"):
        shutil.copy(EXAMPLE / name, tmp_path / name)
    done = e31("submit", "job.yaml", "--follow")
    assert done.returncode == 0, (done.stdout, done.stderr, live.logs())
    assert "epoch 5: test accuracy" in done.stdout
    job_id = done.stdout.splitlines()[0].split()[2]
    fetched = e31("download", job_id[:8], "--to", "out")
    assert fetched.returncode == 0, fetched.stderr
    assert (tmp_path / "out" / "train.py").read_bytes() == SOURCE
    assert json.loads((tmp_path / "out" / "metrics.json").read_text())["test_accuracy"] > 0.8
