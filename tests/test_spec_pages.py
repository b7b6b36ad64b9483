"""The pages' side of spec files: "Download as spec" on a job's page, and the new-job form
filled in from an uploaded spec."""

import io

import pytest
import yaml
from django.urls import reverse

from tests.conftest import PASSWORD, make_job


@pytest.fixture
def signed_in(client, alice, rate):
    client.login(username="alice", password=PASSWORD)
    return client


def spec_upload(text, name="job.yaml"):
    handle = io.BytesIO(text.encode())
    handle.name = name
    return handle


def test_a_job_page_offers_its_spec_for_download(signed_in, alice, charlie):
    job = make_job(alice, name="nightly", gpus=2, early_stop_metric="loss", early_stop_patience=3)
    page = signed_in.get(reverse("jobs:detail", args=[job.pk])).content.decode()
    assert f'href="{reverse("jobs:spec", args=[job.pk])}"' in page and "Download as spec" in page
    response = signed_in.get(reverse("jobs:spec", args=[job.pk]))
    assert response.status_code == 200 and 'filename="nightly.yaml"' in response["Content-Disposition"]
    spec = yaml.safe_load(response.content)
    assert spec["work"] == {"code": "train.py", "entrypoint": "train.py"}
    assert spec["request"] == {"gpus": 2, "mode": "span", "span_hours": 1}
    assert spec["output"]["early_stop"] == {"metric": "loss", "mode": "min", "patience": 3}
    theirs = make_job(charlie, name="theirs")
    assert signed_in.get(reverse("jobs:spec", args=[theirs.pk])).status_code == 404


def test_the_form_is_filled_from_an_uploaded_spec(signed_in, dataset):
    text = (
        "name: from-a-file\nwork:\n  code: train.py\n  args: [--lr, '0.1']\n  config: {epochs: 3}\n"
        "data:\n  train: numbers\n  train_files: [extra.csv]\nrequest:\n  gpus: 3\n  span_hours: 2\n  preemptible: true\n"
        "output:\n  early_stop: {metric: val_loss, patience: 2}\n"
    )
    response = signed_in.post(reverse("jobs:new"), {"spec_file": spec_upload(text)})
    assert response.status_code == 200
    form = response.context["form"]
    assert not form.is_bound
    initial = form.initial
    assert (initial["name"], initial["gpus"], initial["span_hours"], initial["preemptible"]) == ("from-a-file", 3, 2, True)
    assert (initial["args"], initial["config"], initial["early_stop_metric"]) == ("--lr 0.1", '{"epochs": 3}', "val_loss")
    assert initial["train_dataset"] == str(dataset.pk)
    page = response.content.decode()
    assert 'name="gpus" value="3"' in page and 'value="from-a-file"' in page
    assert 'id="spec-files"' in page and "work.code</span>: train.py" in page and "data.train_files</span>: extra.csv" in page
    # The estimate is of the spec's request: 3 GPUs x 2 h x 2.40.
    assert "14.40" in page


def test_a_spec_s_packages_fill_the_packages_field_one_a_line(signed_in):
    text = "work:\n  code: train.py\n  packages: [numpy>=1.26, einops==0.8.0]\nrequest: {gpus: 1, span_hours: 1}\n"
    response = signed_in.post(reverse("jobs:new"), {"spec_file": spec_upload(text)})
    assert response.context["form"].initial["packages"] == "numpy>=1.26\neinops==0.8.0"
    assert "numpy&gt;=1.26\neinops==0.8.0</textarea>" in response.content.decode()


def test_a_recipe_spec_fills_the_recipe_fields(signed_in):
    text = "work:\n  recipe: classifier\n  config: {lr: 0.01, max_steps: 50, extra: 1}\nrequest: {gpus: 1, span_hours: 1}\n"
    initial = signed_in.post(reverse("jobs:new"), {"spec_file": spec_upload(text)}).context["form"].initial
    assert (initial["recipe"], initial["recipe_classifier_lr"], initial["recipe_classifier_max_steps"]) == ("classifier", 0.01, 50)
    assert initial["config"] == '{"extra": 1}'


def test_a_bad_spec_leaves_the_form_empty_and_names_the_line(signed_in):
    response = signed_in.post(reverse("jobs:new"), {"spec_file": spec_upload("request:\n  gpus: 1\n  span_hour: 2\n", "mine.yaml")})
    assert response.status_code == 400
    page = response.content.decode()
    assert 'id="spec-errors"' in page and "mine.yaml line 3: unknown field" in page and "did you mean" in page
    assert not response.context["form"].initial


def test_a_job_s_precision_goes_into_its_spec_and_comes_back_on_the_form(signed_in, alice):
    job = make_job(alice, name="halved", precision="fp16")
    spec = yaml.safe_load(signed_in.get(reverse("jobs:spec", args=[job.pk])).content)
    assert spec["work"] == {"code": "train.py", "entrypoint": "train.py", "precision": "fp16"}
    assert "precision" not in yaml.safe_load(signed_in.get(reverse("jobs:spec", args=[make_job(alice).pk])).content)["work"]
    response = signed_in.post(reverse("jobs:new"), {"spec_file": spec_upload(yaml.safe_dump(spec))})
    assert response.context["form"].initial["precision"] == "fp16"
    assert '<option value="fp16" selected>' in response.content.decode()
