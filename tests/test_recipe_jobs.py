"""Submitting fine-tuning and evaluation jobs with built-in recipes from the form and the API,
the window's quick choices in the user's time zone, and the time zone setting."""

import json
import zoneinfo
from datetime import datetime
from decimal import Decimal

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.urls import reverse
from django.utils import timezone

from e31.recipes import RECIPES
from jobs import windows
from jobs.models import Artifact, Job, Upload
from tests.conftest import make_job

URL = reverse("jobs:new")
ZONE = zoneinfo.ZoneInfo("Europe/Berlin")


@pytest.fixture
def client_a(client, alice, rate):
    client.force_login(alice)
    return client


def data_file(name="train.csv"):
    return SimpleUploadedFile(name, b"a,b,label\n1,2,0\n3,4,1\n", content_type="text/csv")


def post(client, **fields):
    data = {"gpus": "1", "mode": "span", "span_hours": "1", **fields}
    return client.post(URL, {k: v for k, v in data.items() if v is not None})


def errors_of(response):
    return {name: [str(e) for e in errs] for name, errs in response.context["form"].errors.items()}


def finished_with_weights(alice, name="base"):
    job = make_job(alice, name=name)
    Job.objects.filter(pk=job.pk).update(state="succeeded")
    for file, size in (("model.safetensors", 1000), ("recipe.json", 50)):
        Artifact.objects.create(job=job, name=file, key=f"blobs/{name}-{file}", size=size, sha256=f"{len(file):064x}")
    job.refresh_from_db()
    return job


def test_the_form_offers_each_recipe_with_its_parameters(client_a):
    page = client_a.get(URL).content.decode()
    for name, recipe in RECIPES.items():
        assert f'value="{name}"' in page and f'id="recipe-{name}"' in page
        for param in recipe.params:
            # The mode follows the job's kind and the smoke option is "smoke run first".
            shown = param.name not in ("mode", "smoke")
            assert (f'name="recipe_{name}_{param.name}"' in page) == shown, param.name


def test_a_recipe_job_needs_no_script_and_its_parameters_are_checked(client_a):
    response = post(client_a, recipe="classifier", data=data_file(), recipe_classifier_lr="0.01", recipe_classifier_max_steps="50")
    assert response.status_code == 302, errors_of(response)
    job = Job.objects.get()
    assert job.entrypoint == "recipe:classifier" and job.recipe == "classifier" and job.name == "classifier"
    assert job.config["lr"] == 0.01 and job.config["max_steps"] == 50
    assert job.config["batch_size"] == RECIPES["classifier"].param("batch_size").default  # defaults filled in
    assert not job.uploads.filter(role=Upload.CODE).exists()
    response = post(client_a, recipe="classifier", data=data_file(), recipe_classifier_lr="-1")
    assert response.status_code == 200 and errors_of(response)["recipe_classifier_lr"]
    response = post(client_a, recipe="classifier", data=data_file(), config='{"no_such_setting": 1}')
    assert response.status_code == 200 and "no_such_setting" in " ".join(errors_of(response)["config"])


def test_a_fine_tuning_starts_from_a_previous_job_or_uploaded_weights(client_a, alice):
    base = finished_with_weights(alice)
    response = post(client_a, kind="finetune", recipe="classifier", data=data_file())
    assert "A fine-tuning starts from a model" in errors_of(response)["start_job"][0]
    response = post(client_a, kind="finetune", recipe="classifier", data=data_file(), start_job=str(base.pk), name="tuned")
    assert response.status_code == 302, errors_of(response)
    job = Job.objects.get(name="tuned")
    [start] = job.models.all()
    assert job.kind == "finetune" and start.label == "start" and start.source_job_id == base.pk
    assert sorted(f["name"] for f in start.files) == ["model.safetensors", "recipe.json"]
    # Uploaded weights instead: kept as the job's model files.
    weights = SimpleUploadedFile("model.pt", b"w" * 64)
    response = post(client_a, kind="finetune", recipe="classifier", data=data_file(), base_model=weights, name="from upload")
    assert response.status_code == 302, errors_of(response)
    job = Job.objects.get(name="from upload")
    assert [f["name"] for f in job.models.get().files] == ["model.pt"] and job.uploads.filter(role=Upload.MODEL).count() == 1
    response = post(client_a, kind="finetune", recipe="classifier", data=data_file(), base_model=SimpleUploadedFile("notes.txt", b"x"))
    assert "needs its weights" in errors_of(response)["base_model"][0]
    response = post(client_a, recipe="classifier", data=data_file(), start_job=str(base.pk))
    assert "Fine-tune or Evaluate" in errors_of(response)["kind"][0]


def test_an_evaluation_scores_several_models_on_held_out_data(client_a, alice):
    one, two = finished_with_weights(alice, "one"), finished_with_weights(alice, "two")
    response = post(client_a, kind="evaluate", recipe="classifier", evaluate_jobs=[str(one.pk), str(two.pk)])
    assert "held-out data" in errors_of(response)["heldout"][0]
    response = post(client_a, kind="evaluate", recipe="classifier", evaluate_jobs=[str(one.pk), str(two.pk)], heldout=data_file("test.csv"), name="eval")
    assert response.status_code == 302, errors_of(response)
    job = Job.objects.get(name="eval")
    assert job.kind == "evaluate" and job.config["mode"] == "evaluate"
    assert {m.label for m in job.models.all()} == {f"job-{one.short_id}", f"job-{two.short_id}"}
    unfinished = make_job(alice, name="running")
    response = post(client_a, kind="evaluate", recipe="classifier", evaluate_jobs=[str(unfinished.pk)], heldout=data_file("test.csv"))
    assert response.status_code == 200 and "evaluate_jobs" in errors_of(response)


def test_the_api_takes_a_recipe_and_a_starting_job(client, alice, rate, token):
    base = finished_with_weights(alice)
    spec = {"name": "api-tune", "kind": "finetune", "recipe": "classifier", "start_job": str(base.pk), "config": {"max_steps": 20}, "gpus": 1, "span_hours": 1}
    response = client.post(reverse("api:jobs"), {"spec": json.dumps(spec), "data": data_file()}, HTTP_AUTHORIZATION=f"Token {token}")
    assert response.status_code == 201, response.content
    body = response.json()
    assert body["kind"] == "finetune" and body["recipe"] == "classifier" and body["config"]["max_steps"] == 20
    assert body["models"][0]["label"] == "start" and body["models"][0]["source_job"] == str(base.pk)


# The window --------------------------------------------------------------------------------------


def test_quick_choices_are_the_next_such_time_in_the_user_s_zone():
    evening = datetime(2026, 12, 3, 22, 30, tzinfo=ZONE)  # a Thursday
    assert windows.deadline_for("morning", evening) == datetime(2026, 12, 4, 8, 0, tzinfo=ZONE)
    assert windows.deadline_for("tonight", evening) == datetime(2026, 12, 3, 23, 0, tzinfo=ZONE)
    assert windows.deadline_for("tonight", evening.replace(hour=23, minute=30)) == datetime(2026, 12, 4, 23, 0, tzinfo=ZONE)
    assert windows.deadline_for("monday", evening) == datetime(2026, 12, 7, 9, 0, tzinfo=ZONE)
    small_hours = datetime(2026, 12, 4, 1, 0, tzinfo=ZONE)
    assert windows.deadline_for("morning", small_hours) == datetime(2026, 12, 4, 8, 0, tzinfo=ZONE)
    assert windows.deadline_for("", evening) is None
    with pytest.raises(ValueError):
        windows.deadline_for("soon", evening)


def test_by_08_00_tomorrow_is_in_the_user_s_time_zone(client_a, alice):
    response = client_a.post(reverse("settings"), {"time_zone": "Nope/Nowhere"})
    assert response.status_code == 400
    response = client_a.post(reverse("settings"), {"time_zone": "Asia/Tokyo"})
    assert response.status_code == 302
    alice.membership.refresh_from_db()
    assert alice.membership.time_zone == "Asia/Tokyo"
    response = post(client_a, recipe="classifier", data=data_file(), by="morning", name="overnight")
    assert response.status_code == 302, errors_of(response)
    job = Job.objects.get(name="overnight")
    local = timezone.localtime(job.deadline, zoneinfo.ZoneInfo("Asia/Tokyo"))
    assert (local.hour, local.minute) == (8, 0) and job.deadline > timezone.now()
    # A deadline typed in is read in the user's zone too.
    response = post(client_a, recipe="classifier", data=data_file(), deadline="2030-01-02T08:00", name="typed")
    job = Job.objects.get(name="typed")
    assert job.deadline == datetime(2030, 1, 1, 23, 0, tzinfo=zoneinfo.ZoneInfo("UTC"))
    assert "Asia/Tokyo" in client_a.get(URL).content.decode()


# Smoke runs ----------------------------------------------------------------------------------------


def test_a_smoke_run_goes_first_as_a_job_of_its_own(client_a, alice):
    from jobs import states
    from scheduler import services

    response = post(client_a, recipe="classifier", data=data_file(), smoke_first="on", name="full", span_hours="3")
    assert response.status_code == 302, errors_of(response)
    job = Job.objects.get(name="full")
    smoke = job.smoke_run
    assert smoke.name == "full (smoke run)" and smoke.config["smoke"] is True and job.config["smoke"] is False
    assert smoke.span_hours == Decimal("0.1") and smoke.gpus == 1 and smoke.parent_id == job.pk
    assert list(smoke.uploads.values_list("role", "name")) == [("train", "train.csv")]
    page = client_a.get(reverse("jobs:detail", args=[job.pk])).content.decode()
    assert 'id="job-smoke-run"' in page
    # Only the smoke run is in the queue until it succeeds.
    assert [q.id for q in services.queued_jobs(staged=False)] == [str(smoke.pk)]
    Job.objects.filter(pk=smoke.pk).update(state=states.SUCCEEDED)
    assert {q.id for q in services.queued_jobs(staged=False)} == {str(job.pk)}


def test_a_failed_smoke_run_fails_its_job_before_it_costs_anything(client_a, alice):
    from jobs import lineage, states

    post(client_a, recipe="classifier", data=data_file(), smoke_first="on", name="full")
    job = Job.objects.get(name="full")
    Job.objects.filter(pk=job.smoke_run_id).update(state=states.FAILED, reason="exit code 1")
    assert lineage.settle_smoke_runs() == [job]
    job.refresh_from_db()
    assert job.state == "failed" and job.reason == f"its smoke run {job.smoke_run.short_id} failed: exit code 1"
    assert not job.allocations.exists()
    # Cancelling a job cancels its smoke run too (a script's smoke runs: tests/test_smoke_scripts.py).
    post(client_a, recipe="classifier", data=data_file(), smoke_first="on", name="other")
    other = Job.objects.get(name="other")
    other.request_cancel()
    lineage.settle_smoke_runs()
    assert Job.objects.get(pk=other.smoke_run_id).state == "cancelled"


# The API's retrain and compare -----------------------------------------------------------------------


def test_retrain_and_compare_through_the_api(client, alice, charlie, rate, token):
    from rest_framework.authtoken.models import Token

    base = finished_with_weights(alice)
    auth = {"HTTP_AUTHORIZATION": f"Token {token}"}
    url = reverse("api:job-retrain", args=[base.pk])
    response = client.post(url, {"spec": json.dumps({"gpus": 0})}, **auth)
    assert response.status_code == 400 and "gpus" in response.json()["errors"]
    response = client.post(url, {"spec": json.dumps({"colour": "red"})}, **auth)
    assert response.status_code == 400 and "colour" in response.json()["errors"]["spec"][0]
    response = client.post(url, {"spec": json.dumps({"name": "api retrain", "by": "morning"}), "data": data_file("more.csv")}, **auth)
    assert response.status_code == 201, response.content
    body = response.json()
    assert body["kind"] == "finetune" and body["parent"] == str(base.pk) and body["models"][0]["source_job"] == str(base.pk)
    assert body["deadline"] is not None and body["span_hours"] == "1.0000"  # as the job had it
    retrained = Job.objects.get(pk=body["id"])
    assert list(retrained.uploads.filter(role=Upload.TRAIN).values_list("name", flat=True)) == ["more.csv"]
    # Not finished: no weights to start from, a conflict with the reason.
    response = client.post(reverse("api:job-retrain", args=[retrained.pk]), {}, **auth)
    assert response.status_code == 409 and "has not finished" in response.json()["detail"]
    response = client.post(reverse("api:job-compare", args=[base.pk]), **auth)
    assert response.status_code == 409 and "fine-tuning" in response.json()["detail"]
    assert client.get(reverse("api:job-comparison", args=[base.pk]), **auth).status_code == 404
    # Another team's token sees none of it.
    other = {"HTTP_AUTHORIZATION": f"Token {Token.objects.create(user=charlie).key}"}
    for name in ("api:job-retrain", "api:job-compare"):
        assert client.post(reverse(name, args=[base.pk]), **other).status_code == 404
    assert client.get(reverse("api:job-comparison", args=[base.pk]), **other).status_code == 404


def test_a_spec_names_its_starting_and_scored_jobs_by_name(client, alice, rate, token):
    """examples/specs/finetune.yaml and evaluate.yaml name jobs as a person would: by name, the
    team's latest succeeded job of that name."""
    import io

    older = finished_with_weights(alice, name="digits-classifier")
    newer = finished_with_weights(alice, name="digits-classifier")
    Job.objects.filter(pk=older.pk).update(finished_at=timezone.now() - timezone.timedelta(days=1))
    Job.objects.filter(pk=newer.pk).update(finished_at=timezone.now())
    auth = {"HTTP_AUTHORIZATION": f"Token {token}"}

    def post_spec(text):
        data = io.BytesIO(b"x,y\n1,2\n")
        data.name = "train.csv"
        return client.post(reverse("api:jobs"), {"spec": text, "spec_name": "tune.yaml", "data": data}, **auth)

    response = post_spec("kind: finetune\nwork: {recipe: classifier}\ndata:\n  start_job: digits-classifier\nrequest: {gpus: 1, span_hours: 1}\n")
    assert response.status_code == 201, response.json()
    assert [m["source_job"] for m in response.json()["models"]] == [str(newer.pk)]
    missing = post_spec("kind: finetune\nwork: {recipe: classifier}\ndata:\n  start_job: nothing-like-it\nrequest: {gpus: 1, span_hours: 1}\n")
    assert missing.status_code == 400
    assert missing.json()["errors"]["start_job"] == ["tune.yaml line 4: No succeeded job named 'nothing-like-it' in your team (give a job's id or name)."]
