"""The experiment a job joins, named where the job is described: the new-job form, the retrain
form, a spec file and the API. Blank is the job's name (a retraining's: its source's experiment);
a bad one is refused on its field, naming the spec's line."""

import io
import json

import pytest
import yaml
from django.core.files.uploadedfile import SimpleUploadedFile
from django.urls import reverse

from jobs import specfile
from jobs.models import Artifact, Job
from jobs.spec_form import spec_form_data
from tests.conftest import make_job


@pytest.fixture
def signed_in(client, alice, rate):
    client.force_login(alice)
    return client


@pytest.fixture
def api(client, token, rate):
    client.defaults["HTTP_AUTHORIZATION"] = f"Token {token}"
    return client


def post_form(client, **fields):
    data = {"gpus": "1", "mode": "span", "span_hours": "1", "code": SimpleUploadedFile("train.py", b"print(1)\n"), **fields}
    data["data"] = SimpleUploadedFile("train.csv", b"x,y\n1,2\n")
    return client.post(reverse("jobs:new"), data)


def submit(api, spec):
    """POST /api/jobs/ with the spec (an object, or a spec file's text) and a script and data."""
    code, data = io.BytesIO(b"print(1)\n"), io.BytesIO(b"x,y\n1,2\n")
    code.name, data.name = "train.py", "train.csv"
    payload = {"spec": spec if isinstance(spec, str) else json.dumps(spec), "code": code, "data": data}
    if isinstance(spec, str):
        payload["spec_name"] = "job.yaml"
    return api.post(reverse("api:jobs"), payload)


def finished_with_weights(user, **fields):
    job = make_job(user, **fields)
    Artifact.objects.create(job=job, name="model.pt", key="k", size=1, sha256="0" * 64)
    Job.objects.filter(pk=job.pk).update(state="succeeded")
    job.refresh_from_db()
    return job


# The new-job form ------------------------------------------------------------------------------


def test_the_form_asks_for_the_experiment_and_says_what_it_is_for(signed_in):
    page = signed_in.get(reverse("jobs:new")).content.decode()
    assert 'name="experiment"' in page and 'maxlength="200"' in page.split('name="experiment"')[1].split(">")[0]
    assert "compared side by side on the experiment page" in page


def test_a_job_submitted_with_an_experiment_joins_it(signed_in):
    response = post_form(signed_in, name="mlp-wide", experiment="  mlp  ")
    job = Job.objects.get()
    assert response.status_code == 302 and (job.name, job.experiment) == ("mlp-wide", "mlp")


def test_a_blank_experiment_is_the_job_s_name(signed_in):
    post_form(signed_in, name="mlp", experiment="")
    post_form(signed_in)  # no name either: both the entrypoint's
    assert sorted(Job.objects.values_list("name", "experiment")) == [("mlp", "mlp"), ("train", "train")]


@pytest.mark.parametrize(
    "experiment, message",
    [
        ("x" * 201, "An experiment's name is at most 200 characters (it has 201)."),
        ("mlp\tlr", "The experiment cannot contain control characters (such as line breaks)."),
        ("mlp\nlr", "The experiment cannot contain control characters (such as line breaks)."),
    ],
)
def test_a_bad_experiment_is_refused_on_the_page(signed_in, experiment, message):
    response = post_form(signed_in, name="mlp", experiment=experiment)
    assert response.status_code == 200 and not Job.objects.exists()
    assert response.context["form"].errors["experiment"] == [message]
    page = response.content.decode()
    assert 'href="#field-experiment">Experiment</a>' in page and message.replace("'", "&#x27;") in page


def test_the_experiment_page_lists_a_run_submitted_into_it_under_another_name(signed_in, alice):
    first = make_job(alice, name="mlp")
    post_form(signed_in, name="mlp, wider", experiment="mlp")
    wider = Job.objects.get(name="mlp, wider")
    make_job(alice, name="mlp, elsewhere")
    page = signed_in.get(reverse("jobs:experiment", args=[first.pk])).content.decode()
    rows = [r.split('"')[0] for r in page.split('<tr data-run="')[1:]]
    assert rows == [str(first.pk), str(wider.pk)] and "2 runs" in page and "mlp, elsewhere" not in page
    # The same page through the new run.
    assert signed_in.get(reverse("jobs:experiment", args=[wider.pk])).content.decode().count('<tr data-run="') == 2


# Retraining: prefilled with the job's experiment --------------------------------------------------


def test_a_retraining_is_prefilled_with_the_job_s_experiment_and_may_change_it(signed_in, alice):
    base = finished_with_weights(alice, name="base", experiment="digits")
    url = reverse("jobs:retrain", args=[base.pk])
    page = signed_in.get(url).content.decode()
    assert 'name="experiment"' in page and 'value="digits"' in page.split('name="experiment"')[1].split(">")[0]
    fields = {"gpus": "1", "mode": "span", "span_hours": "1"}
    signed_in.post(url, {**fields, "experiment": "digits"})
    signed_in.post(url, {**fields, "experiment": "", "name": "blank"})
    signed_in.post(url, {**fields, "experiment": "digits-ft", "name": "moved"})
    retrained = dict(Job.objects.filter(parent=base).values_list("name", "experiment"))
    assert retrained == {"base (retrained)": "digits", "blank": "digits", "moved": "digits-ft"}
    refused = signed_in.post(url, {**fields, "experiment": "a\nb"})
    assert refused.status_code == 400 and "control characters" in refused.context["form"].errors["experiment"][0]


def test_the_api_s_retraining_keeps_the_experiment_or_takes_another(api, alice):
    base = finished_with_weights(alice, name="base", experiment="digits")
    url = reverse("api:job-retrain", args=[base.pk])
    kept = api.post(url, {"spec": json.dumps({"name": "again"})})
    moved = api.post(url, {"spec": json.dumps({"experiment": "digits-ft"})})
    assert (kept.status_code, kept.json()["experiment"]) == (201, "digits")
    assert (moved.status_code, moved.json()["experiment"]) == (201, "digits-ft")
    refused = api.post(url, {"spec": json.dumps({"experiment": ["digits"]})})
    assert refused.status_code == 400 and refused.json()["errors"]["experiment"] == ["experiment must be a string or a number, not list."]


# Spec files ---------------------------------------------------------------------------------------


def test_a_spec_file_s_experiment_is_read_with_its_line():
    spec = specfile.read("name: mlp-wide\nexperiment: mlp\nwork: {code: train.py}\n", "job.yaml")
    assert spec.fields["experiment"] == "mlp" and spec.line_of("experiment") == 2 and spec.paths["experiment"] == "experiment"
    flat = specfile.read('{"experiment": "mlp", "gpus": 1}', "job.json")
    assert flat.fields == {"experiment": "mlp", "gpus": 1}


def test_a_spec_s_experiment_that_is_not_text_is_refused_naming_the_line(alice):
    spec = specfile.read("name: mlp\nexperiment: [a, b]\nrequest: {gpus: 1}\n", "job.yaml")
    with pytest.raises(Exception) as refused:
        spec_form_data(spec, alice.membership.team)
    assert refused.value.detail == {"experiment": ["job.yaml line 2: experiment must be a string or a number, not list."]}


def test_a_job_s_spec_names_its_experiment_and_fills_the_form_with_it(signed_in, alice):
    job = make_job(alice, name="mlp-wide", experiment="mlp")
    spec = yaml.safe_load(signed_in.get(reverse("jobs:spec", args=[job.pk])).content)
    assert list(spec)[:3] == ["name", "experiment", "kind"] and spec["experiment"] == "mlp"
    upload = io.BytesIO(yaml.safe_dump({**spec, "name": "mlp-wider"}).encode())
    upload.name = "again.yaml"
    response = signed_in.post(reverse("jobs:new"), {"spec_file": upload})
    assert response.context["form"].initial["experiment"] == "mlp"
    assert 'value="mlp"' in response.content.decode().split('name="experiment"')[1].split(">")[0]


def test_a_spec_file_submits_into_its_experiment_and_a_bad_one_is_refused_by_line(api):
    text = "name: mlp-wide\nexperiment: mlp\nrequest:\n  gpus: 1\n  span_hours: 1\n"
    response = submit(api, text)
    assert response.status_code == 201, response.json()
    assert (response.json()["name"], response.json()["experiment"]) == ("mlp-wide", "mlp")
    too_long = submit(api, f"name: mlp\nexperiment: {'x' * 201}\nrequest:\n  gpus: 1\n  span_hours: 1\n")
    assert too_long.status_code == 400
    assert too_long.json()["errors"]["experiment"] == ["job.yaml line 2: experiment: An experiment's name is at most 200 characters (it has 201)."]
    not_text = submit(api, "name: mlp\nexperiment: {a: 1}\nrequest:\n  gpus: 1\n  span_hours: 1\n")
    assert not_text.status_code == 400
    assert not_text.json()["errors"]["experiment"] == ["job.yaml line 2: experiment must be a string or a number, not dict."]
    assert Job.objects.count() == 1


# The API ------------------------------------------------------------------------------------------


def test_the_api_takes_the_experiment_and_shows_it_in_the_job_and_the_list(api):
    created = submit(api, {"name": "mlp-wide", "experiment": "mlp", "gpus": 1, "span_hours": 1})
    assert created.status_code == 201, created.json()
    job_id = created.json()["id"]
    assert api.get(reverse("api:job", args=[job_id])).json()["experiment"] == "mlp"
    defaulted = submit(api, {"name": "cnn", "gpus": 1, "span_hours": 1}).json()
    assert defaulted["experiment"] == "cnn"
    listed = {j["name"]: j["experiment"] for j in api.get(reverse("api:jobs")).json()["results"]}
    assert listed == {"mlp-wide": "mlp", "cnn": "cnn"}
    refused = submit(api, {"name": "x", "experiment": "a\u0007b", "gpus": 1, "span_hours": 1})
    assert refused.status_code == 400 and "control characters" in refused.json()["errors"]["experiment"][0]
