import io
import tarfile
import zipfile
from decimal import Decimal

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.urls import reverse

from billing.models import Rate
from jobs.models import Job, Upload

URL = reverse("jobs:new")


@pytest.fixture
def client_a(client, alice, rate):
    client.force_login(alice)
    return client


def script(name="train.py", content=b"print('hi')\n"):
    return SimpleUploadedFile(name, content, content_type="text/x-python")


def zipped(entries, name="work.zip"):
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as z:
        for entry, content in entries.items():
            z.writestr(entry, content)
    return SimpleUploadedFile(name, buffer.getvalue(), content_type="application/zip")


def data_file():
    return SimpleUploadedFile("train.csv", b"x,y\n1,2\n", content_type="text/csv")


def post(client, **fields):
    data = {"gpus": "1", "mode": "span", "span_hours": "1", **fields}
    data = {k: v for k, v in data.items() if v is not None}
    return client.post(URL, data)


def errors_of(response):
    return {name: [str(e) for e in errs] for name, errs in response.context["form"].errors.items()}


def test_the_form_page_shows_the_cost_of_the_default_request(client_a):
    response = client_a.get(URL)
    assert response.status_code == 200
    assert "USD 2.40" in response.content.decode()  # 1 GPU x 1 h x 2.40


def test_a_valid_form_queues_a_job(client_a, alice):
    response = post(client_a, code=script(), data=data_file(), name="first", config="lr: 0.1", args="--epochs 3", env="A=1")
    job = Job.objects.get()
    assert response.status_code == 302 and response["Location"] == reverse("jobs:detail", args=[job.pk])
    assert (job.state, job.name, job.entrypoint, job.gpus) == ("queued", "first", "train.py", 1)
    assert job.config == {"lr": 0.1} and job.args == ["--epochs", "3"] and job.env == {"A": "1"}
    assert job.created_by == alice and job.team == alice.membership.team
    assert sorted(job.uploads.values_list("role", "name")) == [("code", "train.py"), ("train", "train.csv")]
    assert [e.data["state"] for e in job.timeline()] == ["queued"]


def test_a_dataset_s_latest_version_is_pinned_for_the_job(client_a, dataset):
    from catalog.datasets import add_files

    second = add_files(dataset, {"more.csv": b"3,4\n"})
    post(client_a, code=script(), train_dataset=str(dataset.pk))
    job = Job.objects.get()
    assert job.train_version == second and second.number == 2
    add_files(dataset, {"later.csv": b"5\n"})  # a newer version changes nothing for this job
    job.refresh_from_db()
    assert job.train_version == second


def test_the_name_defaults_to_the_entrypoint(client_a):
    post(client_a, code=script("fit_model.py"), data=data_file())
    assert Job.objects.get().name == "fit_model"


@pytest.mark.parametrize(
    "fields,field,message",
    [
        ({"gpus": "0"}, "gpus", "Ask for at least 1 GPU."),
        ({"span_hours": "0"}, "span_hours", "The span must be longer than 0 hours."),
        ({"span_hours": ""}, "span_hours", "Give the span in hours."),
        ({"mode": "until_done", "ceiling": "0"}, "ceiling", "The ceiling must be more than 0."),
        ({"mode": "until_done", "ceiling": ""}, "ceiling", "Until done needs a ceiling"),
        ({"config": '{"lr": 0.1,,}'}, "config", "the config is not valid JSON"),
        ({"config": "a: [1, 2"}, "config", "the config is not valid YAML"),
        ({"args": "--name 'open"}, "args", "cannot be split"),
        ({"env": "PATH=/evil"}, "env", "set by the network"),
        (
            {"not_before": "2030-01-02T08:00", "deadline": "2030-01-01T08:00"},
            "deadline",
            "The deadline must be after the not-before time.",
        ),
        ({"deadline": "2001-01-01T08:00"}, "deadline", "The deadline is already past."),
        ({"packages": "numpy>=1.26\n-e ./mypkg"}, "packages", "line 2 (-e ./mypkg): options such as -e, -r and --index-url are not taken"),
        ({"packages": "pkg @ https://example.com/pkg.whl"}, "packages", "line 1 (pkg @ https://example.com/pkg.whl): a direct reference"),
    ],
)
def test_bad_input_is_refused_next_to_its_field_and_the_upload_is_kept(client_a, fields, field, message):
    response = post(client_a, code=script(), data=data_file(), **fields)
    assert response.status_code == 200
    assert not Job.objects.exists()
    assert any(message in error for error in errors_of(response)[field])
    page = response.content.decode()
    assert message.split(":")[0][:30] in page.replace("&#x27;", "'")
    # What was uploaded is kept, listed on the page, and sent back with the fixed form.
    kept = Upload.objects.filter(job__isnull=True)
    assert sorted(kept.values_list("name", flat=True)) == ["train.csv", "train.py"]
    for upload in kept:
        assert f'value="{upload.pk}"' in page
    fixed = {"gpus": "1", "span_hours": "1", "mode": "span", "ceiling": "", "config": "", "args": "", "env": ""}
    response = client_a.post(
        URL,
        {**fixed, "kept_code": str(kept.get(role="code").pk), "kept_data": [str(kept.get(role="train").pk)]},
    )
    assert response.status_code == 302, errors_of(response)
    job = Job.objects.get()
    assert sorted(job.uploads.values_list("name", flat=True)) == ["train.csv", "train.py"]


def test_an_archive_needs_its_entrypoint(client_a):
    response = post(client_a, code=zipped({"pkg/train.py": "x"}), data=data_file(), entrypoint="main.py")
    assert "'main.py' is not in the archive (runnable files there: pkg/train.py)" in errors_of(response)["entrypoint"][0]
    response = post(client_a, code=zipped({"pkg/train.py": "x"}), data=data_file())
    assert "name the entrypoint" in errors_of(response)["entrypoint"][0]
    response = post(client_a, code=zipped({"pkg/train.py": "x"}), data=data_file(), entrypoint="pkg/train.py")
    assert response.status_code == 302


@pytest.mark.parametrize("entry", ["../escape.py", "/etc/cron.d/x"])
def test_an_archive_with_entries_outside_its_folder_is_refused(client_a, entry):
    response = post(client_a, code=zipped({entry: "x", "train.py": "y"}), data=data_file(), entrypoint="train.py")
    assert any("outside the archive" in e or "absolute path" in e for e in errors_of(response)["code"])
    assert not Job.objects.exists()


def test_the_work_must_be_given(client_a):
    response = post(client_a, data=data_file())
    assert "Upload a training script (.py) or an archive (.zip, .tar.gz)." in errors_of(response)["code"]


def test_the_training_set_must_be_given(client_a):
    response = post(client_a, code=script())
    assert "Give the training set" in errors_of(response)["data"][0]


def test_another_team_s_dataset_cannot_be_named(client_a, team_b):
    from e31web.demo import add_dataset

    theirs = add_dataset(team_b, "theirs", {"a.csv": b"1"})
    response = post(client_a, code=script(), train_dataset=str(theirs.pk))
    assert "train_dataset" in errors_of(response)


def test_another_team_s_upload_cannot_be_kept(client_a, charlie):
    from tests.conftest import upload

    theirs = upload(charlie.membership.team, charlie, Upload.CODE, "train.py", b"x")
    response = client_a.post(URL, {"gpus": "1", "mode": "span", "span_hours": "1", "kept_code": str(theirs.pk), "data": data_file()})
    assert "An earlier upload is no longer available" in errors_of(response)["code"][0]


def test_without_a_rate_in_force_nothing_is_submitted(client, alice):
    client.force_login(alice)
    response = post(client, code=script(), data=data_file())
    assert not Job.objects.exists()
    assert "No rate is in force" in str(response.context["form"].non_field_errors())


def test_until_done_uses_the_ceiling_and_ignores_the_span(client_a):
    post(client_a, code=script(), data=data_file(), mode="until_done", ceiling="12.50", ceiling_kind="money", span_hours="0")
    job = Job.objects.get()
    assert job.ceiling_amount == Decimal("12.50") and job.span_hours is None and job.ceiling_gpu_hours is None


def test_a_gpu_hour_ceiling(client_a):
    post(client_a, code=script(), data=data_file(), mode="until_done", ceiling="3", ceiling_kind="gpu_hours")
    assert Job.objects.get().ceiling_gpu_hours == Decimal("3")


def test_the_estimate_follows_the_request(client_a):
    url = reverse("jobs:estimate")
    body = client_a.post(url, {"gpus": "2", "mode": "span", "span_hours": "3"}, HTTP_HX_REQUEST="true").content.decode()
    assert "USD 14.40" in body  # 2 x 3 x 2.40
    body = client_a.post(url, {"gpus": "2", "mode": "until_done", "ceiling": "50", "ceiling_kind": "money"}).content.decode()
    assert "At most <strong>USD 50.00</strong>" in body
    body = client_a.post(url, {"gpus": "0", "mode": "span", "span_hours": "3"}).content.decode()
    assert "Fix the compute request above to see its cost." in body


def test_the_estimate_uses_the_rate_of_the_gpu_type(client_a):
    Rate.objects.create(gpu_type="H100", per_gpu_hour=Decimal("4.00"))
    body = client_a.post(reverse("jobs:estimate"), {"gpus": "1", "gpu_type": "H100", "mode": "span", "span_hours": "1"}).content.decode()
    assert "USD 4.00" in body
    # Any type: the worst case is shown.
    body = client_a.post(reverse("jobs:estimate"), {"gpus": "1", "mode": "span", "span_hours": "1"}).content.decode()
    assert "USD 4.00" in body


def test_an_oversized_upload_is_refused_with_its_name(client_a, settings):
    settings.E31_MAX_UPLOAD_BYTES = 5
    response = post(client_a, code=script(), data=data_file())
    assert "larger than" in errors_of(response)["code"][0]
    assert not Job.objects.exists()


def test_checkpoint_and_stopping_choices_are_kept_on_the_job(client_a):
    response = post(
        client_a,
        code=script(),
        data=data_file(),
        preemptible="on",
        keep_checkpoints="5",
        max_restarts="1",
        early_stop_metric="heldout_loss",
        early_stop_mode="min",
        early_stop_patience="4",
    )
    assert response.status_code == 302, errors_of(response)
    job = Job.objects.get()
    assert job.preemptible and job.keep_checkpoints == 5 and job.max_restarts == 1
    assert (job.early_stop_metric, job.early_stop_mode, job.early_stop_patience) == ("heldout_loss", "min", 4)
    assert not job.stop_on_nan  # an unticked box


def test_the_defaults_keep_three_checkpoints_and_stop_on_nan(client_a):
    page = client_a.get(URL).content.decode()
    import re

    [tag] = re.findall(r'<input[^>]*name="stop_on_nan"[^>]*>', page)
    assert "checked" in tag
    response = post(client_a, code=script(), data=data_file(), stop_on_nan="on")
    job = Job.objects.get()
    assert response.status_code == 302 and job.keep_checkpoints == 3 and job.max_restarts == 3 and job.stop_on_nan
    assert not job.preemptible and job.early_stop_metric == "" and job.early_stop_patience is None


@pytest.mark.parametrize(
    "fields, field, message",
    [
        ({"early_stop_metric": "val_loss"}, "early_stop_patience", "Early stopping needs a patience"),
        ({"early_stop_patience": "3"}, "early_stop_metric", "Name the metric to watch"),
        ({"early_stop_metric": "val loss!", "early_stop_patience": "3"}, "early_stop_metric", "A metric name is letters"),
        ({"keep_checkpoints": "0"}, "keep_checkpoints", "greater than or equal to 1"),
        ({"max_restarts": "-1"}, "max_restarts", "greater than or equal to 0"),
    ],
)
def test_bad_stopping_choices_are_refused_next_to_their_field(client_a, fields, field, message):
    response = post(client_a, code=script(), data=data_file(), **fields)
    assert response.status_code == 200
    assert any(message in e for e in errors_of(response)[field]), errors_of(response)


def test_the_estimate_uses_the_preemptible_rate(client_a):
    Rate.objects.create(gpu_type="", per_gpu_hour=Decimal("2.40"), preemptible_per_gpu_hour=Decimal("0.80"))
    url = reverse("jobs:estimate")
    body = client_a.post(url, {"gpus": "1", "mode": "span", "span_hours": "1", "preemptible": "on"}).content.decode()
    assert "USD 0.80" in body
    body = client_a.post(url, {"gpus": "1", "mode": "span", "span_hours": "1"}).content.decode()
    assert "USD 2.40" in body


# The packages a job brings ---------------------------------------------------------------------


def tarred(entries, name="work.tar.gz"):
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as t:
        for entry, content in entries.items():
            info = tarfile.TarInfo(entry)
            info.size = len(content)
            t.addfile(info, io.BytesIO(content))
    return SimpleUploadedFile(name, buffer.getvalue(), content_type="application/gzip")


def test_the_packages_given_are_kept_on_the_job_one_a_line(client_a):
    response = post(client_a, code=script(), data=data_file(), packages="# what it needs\n\n numpy>=1.26 \neinops==0.8.0  # pinned\n")
    assert response.status_code == 302, errors_of(response)
    assert Job.objects.get().packages == "numpy>=1.26\neinops==0.8.0"


def test_the_form_shows_the_packages_field_with_the_work(client_a):
    page = client_a.get(URL).content.decode()
    assert 'name="packages"' in page and "Python packages" in page and "a requirements.txt at the root of an archive is read too" in page


def test_an_archive_s_requirements_txt_is_read_after_the_packages_given(client_a):
    work = zipped({"train.py": "x", "requirements.txt": "# the archive's\nnumpy >= 1.26\nscipy\n"})
    response = post(client_a, code=work, data=data_file(), entrypoint="train.py", packages="numpy>=1.26\neinops")
    assert response.status_code == 302, errors_of(response)
    assert Job.objects.get().packages == "numpy>=1.26\neinops\nscipy"


def test_a_tar_archive_s_requirements_txt_is_read_too(client_a):
    work = tarred({"./train.py": b"x", "./requirements.txt": b"\xef\xbb\xbfeinops==0.8.0\r\n"})  # a byte-order mark, Windows lines
    response = post(client_a, code=work, data=data_file(), entrypoint="train.py")
    assert response.status_code == 302, errors_of(response)
    assert Job.objects.get().packages == "einops==0.8.0"


def test_only_a_requirements_txt_at_the_archive_s_root_is_read(client_a):
    work = zipped({"train.py": "x", "vendor/requirements.txt": "-e .\n"})
    response = post(client_a, code=work, data=data_file(), entrypoint="train.py")
    assert response.status_code == 302, errors_of(response)
    assert Job.objects.get().packages == ""


def test_a_bad_line_in_the_archive_s_requirements_txt_is_refused_on_the_code_naming_its_line(client_a):
    work = zipped({"train.py": "x", "requirements.txt": "numpy\n--index-url https://mirror.example/simple\n"})
    response = post(client_a, code=work, data=data_file(), entrypoint="train.py")
    assert response.status_code == 200 and not Job.objects.exists()
    [error] = errors_of(response)["code"]
    assert error.startswith("work.zip: requirements.txt line 2 (--index-url https://mirror.example/simple): options such as")


@pytest.mark.parametrize(
    "content,message",
    [
        (b"numpy\n" + b"# padding\n" * 7000, "work.zip: requirements.txt is larger than 64 KB"),
        (b"numpy\xff\n", "work.zip: requirements.txt is not UTF-8 text"),
    ],
)
def test_an_unreadable_requirements_txt_is_refused_on_the_code(client_a, content, message):
    work = zipped({"train.py": "x", "requirements.txt": content})
    response = post(client_a, code=work, data=data_file(), entrypoint="train.py")
    assert response.status_code == 200 and not Job.objects.exists()
    assert errors_of(response)["code"] == [message]


def test_the_packages_given_and_the_archive_s_together_hold_the_limit(client_a):
    given = "\n".join(f"a{i}" for i in range(150))
    work = zipped({"train.py": "x", "requirements.txt": "\n".join(f"b{i}" for i in range(60))})
    response = post(client_a, code=work, data=data_file(), entrypoint="train.py", packages=given)
    assert response.status_code == 200 and not Job.objects.exists()
    assert errors_of(response)["packages"] == ["With the archive's requirements.txt: 210 requirements in all: a job may name at most 200"]


def test_the_job_page_shows_the_packages_of_a_job_that_has_some(client_a):
    post(client_a, code=script(), data=data_file(), packages="numpy>=1.26\neinops==0.8.0", name="with")
    post(client_a, code=script(), data=data_file(), name="without")
    page = client_a.get(reverse("jobs:detail", args=[Job.objects.get(name="with").pk])).content.decode()
    assert '<pre class="mono small" id="packages">numpy&gt;=1.26\neinops==0.8.0</pre>' in page
    page = client_a.get(reverse("jobs:detail", args=[Job.objects.get(name="without").pk])).content.decode()
    assert 'id="packages"' not in page and "Python packages" not in page


def test_a_retraining_brings_the_same_packages(client_a, alice):
    from jobs import lineage, states
    from jobs.models import Artifact

    post(client_a, code=script(), data=data_file(), packages="einops==0.8.0")
    job = Job.objects.get()
    Job.objects.filter(pk=job.pk).update(state=states.SUCCEEDED)
    Artifact.objects.create(job=job, name="model.pt", key="k", size=1, sha256="0" * 64)
    job.refresh_from_db()
    assert lineage.retrain(job, alice).packages == "einops==0.8.0"


def test_the_form_shows_the_precision_with_the_work_and_keeps_the_choice(client_a):
    page = client_a.get(URL).content.decode()
    assert '<select name="precision"' in page and '<option value="fp16">fp16: float16 autocast with loss scaling on GPUs</option>' in page
    assert "A script reads the choice from $E31_PRECISION" in page
    response = post(client_a, code=script(), data=data_file(), precision="bf16", name="bf16")
    assert response.status_code == 302, errors_of(response)
    post(client_a, code=script(), data=data_file(), name="default")
    assert dict(Job.objects.values_list("name", "precision")) == {"bf16": "bf16", "default": ""}
    page = client_a.get(reverse("jobs:detail", args=[Job.objects.get(name="bf16").pk])).content.decode()
    assert '<dt>Precision</dt><dd id="job-precision">bf16: bfloat16 autocast on GPUs</dd>' in page
    page = client_a.get(reverse("jobs:detail", args=[Job.objects.get(name="default").pk])).content.decode()
    assert '<dd id="job-precision">Default (the recipes: bf16 on GPUs, fp32 on the CPU)</dd>' in page


def test_a_precision_that_is_not_one_is_refused_next_to_its_field(client_a):
    response = post(client_a, code=script(), data=data_file(), precision="fp8")
    assert response.status_code == 200 and not Job.objects.exists()
    assert errors_of(response)["precision"] == ["fp8 is not a precision: choose fp32, bf16 or fp16 (or leave it blank for the default)."]


def test_a_retraining_and_a_smoke_run_keep_the_precision(client_a, alice):
    from jobs import lineage, states
    from jobs.models import Artifact

    post(client_a, recipe="classifier", data=data_file(), precision="fp16", smoke_first="on")
    job = Job.objects.get(smoke_run__isnull=False)
    assert job.precision == job.smoke_run.precision == "fp16"
    Job.objects.filter(pk=job.pk).update(state=states.SUCCEEDED)
    Artifact.objects.create(job=job, name="model.safetensors", key="k", size=1, sha256="0" * 64)
    job.refresh_from_db()
    assert lineage.retrain(job, alice).precision == "fp16"


# What a submission already holds, its form takes unread (jobs.forms.KnownChoiceField) -------------


def test_a_submission_reads_back_neither_its_code_nor_the_dataset_its_spec_named(client, alice, rate, dataset):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    client.force_login(alice)
    spec = "name: known\nwork:\n  code: train.py\ndata:\n  train: numbers\nrequest:\n  gpus: 1\n  span_hours: 1\n"
    with CaptureQueriesContext(connection) as captured:
        response = client.post("/api/jobs/", {"spec": spec, "spec_name": "job.yaml", "code": script()})
    assert response.status_code == 201, response.content
    job = Job.objects.get(pk=response.json()["id"])
    assert job.train_version == dataset.latest_version() and job.uploads.get().name == "train.py"
    reads = [q["sql"] for q in captured.captured_queries if q["sql"].startswith("SELECT")]
    assert not [sql for sql in reads if 'FROM "jobs_upload"' in sql]  # the upload was made here
    # The spec's name, resolved once: its ready version with its dataset, in one query.
    [resolved] = [sql for sql in reads if 'FROM "jobs_dataset' in sql]
    assert 'FROM "jobs_datasetversion" INNER JOIN "jobs_dataset"' in resolved


def test_the_form_takes_unread_only_what_its_querysets_would_find(alice, charlie, dataset):
    from catalog.models import DatasetVersion
    from jobs.forms import _known
    from tests.conftest import upload

    team = alice.membership.team
    mine = upload(team, alice, Upload.CODE, "train.py", b"x")
    theirs = upload(charlie.membership.team, charlie, Upload.CODE, "train.py", b"x")
    data = upload(team, alice, Upload.TRAIN, "a.csv", b"1")
    used = upload(team, alice, Upload.CODE, "old.py", b"x")
    used.job = Job.objects.create(team=team, created_by=alice, name="old", gpus=1)
    ready = dataset.latest_version()
    sealing = DatasetVersion.objects.create(dataset=dataset, number=ready.number + 1, state=DatasetVersion.OPEN)
    found = _known(team, [mine, theirs, data, used, ready, sealing])
    assert found["kept_code"] == {str(mine.pk): mine}
    assert found["kept_data"] == {str(data.pk): data}
    assert found["train_version"] == found["heldout_version"] == {str(ready.pk): ready}
    assert found["train_dataset"] == {str(dataset.pk): dataset}
    assert _known(charlie.membership.team, [mine, ready]) == {}


def test_a_submission_with_files_of_every_role_reads_none_of_them_back(client, alice, rate):
    """The files a request sent are the kept fields' objects unread (jobs.forms.KnownMultipleChoiceField)."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    client.force_login(alice)
    spec = "name: files\nkind: evaluate\nwork:\n  code: train.py\nrequest:\n  gpus: 1\n  span_hours: 1\n"
    files = {
        "code": script(),
        "heldout": SimpleUploadedFile("test.csv", b"x\n1\n"),
        "base_model": SimpleUploadedFile("model.safetensors", b"w"),
        "input:extra": [SimpleUploadedFile("b.txt", b"2"), SimpleUploadedFile("a.txt", b"1")],
    }
    with CaptureQueriesContext(connection) as captured:
        response = client.post("/api/jobs/", {"spec": spec, "spec_name": "job.yaml", **files})
    assert response.status_code == 201, response.content
    reads = [q["sql"] for q in captured.captured_queries if q["sql"].startswith("SELECT")]
    assert not [sql for sql in reads if 'FROM "jobs_upload"' in sql], reads
    job = Job.objects.get(pk=response.json()["id"])
    assert sorted(job.uploads.values_list("role", "name")) == [
        ("code", "train.py"),
        ("heldout", "test.csv"),
        ("input", "a.txt"),
        ("input", "b.txt"),
        ("model", "model.safetensors"),
    ]
    # In its queryset's order (created, then name), as reading the job back gives them.
    assert response.json()["inputs"] == {"extra": ["b.txt", "a.txt"]}
    assert client.get(reverse("api:job", args=[job.pk])).json() == response.json()


def test_kept_files_of_another_team_or_of_a_job_are_refused(client_a, alice, charlie):
    from tests.conftest import upload

    theirs = upload(charlie.membership.team, charlie, Upload.TRAIN, "secret.csv", b"1")
    mine = upload(alice.membership.team, alice, Upload.TRAIN, "a.csv", b"1")
    used = upload(alice.membership.team, alice, Upload.TRAIN, "used.csv", b"1")
    used.job = Job.objects.create(team=alice.membership.team, created_by=alice, name="old", gpus=1)
    used.save()
    for kept in ([theirs], [used], [mine, theirs]):
        response = post(client_a, code=script(), kept_data=[str(u.pk) for u in kept])
        assert response.status_code == 200, [u.name for u in kept]
        assert errors_of(response)["data"] == ["An earlier upload is no longer available: please upload it again."]
    assert not Job.objects.exclude(pk=used.job.pk).exists()
    response = post(client_a, code=script(), kept_data=[str(mine.pk)])
    assert response.status_code == 302, errors_of(response)
    assert Upload.objects.get(pk=mine.pk).job is not None and Upload.objects.get(pk=theirs.pk).job is None


def test_the_job_form_builds_no_queryset_until_one_is_read(alice, charlie):
    """Building the form's eleven querysets cost a submission as much as running a query each
    (jobs.forms.LazyQueryset): they are built when read, and are what they were."""
    from unittest import mock

    from django.db.models.query import QuerySet

    from jobs import forms
    from tests.conftest import upload

    team = alice.membership.team
    with mock.patch.object(QuerySet, "filter", side_effect=AssertionError("a queryset was built")):
        form = forms.JobForm({"gpus": "1"}, team=team)
    with mock.patch.object(QuerySet, "none", side_effect=AssertionError("a queryset was built")):
        assert form.fields["kept_data"].clean([]) == []  # nothing sent: no files, no query
    mine = upload(team, alice, Upload.TRAIN, "a.csv", b"1")
    upload(team, alice, Upload.CODE, "train.py", b"1")
    upload(charlie.membership.team, charlie, Upload.TRAIN, "b.csv", b"1")
    assert list(form.fields["kept_data"].queryset) == [mine]
    assert form.fields["kept_data"].queryset is form.fields["kept_data"].queryset  # built once


def test_the_page_lists_the_teams_ready_datasets_and_finished_jobs_as_choices(client_a, alice, charlie, dataset):
    """The choices are what each lazily made queryset finds, when the page lists them."""
    from tests.conftest import add_dataset

    add_dataset(charlie.membership.team, "theirs", {"a.csv": b"1"})
    finished = Job.objects.create(team=alice.membership.team, created_by=alice, name="done", gpus=1, state="succeeded")
    finished.artifacts.create(name="model.pt", size=1, key="k", sha256="0" * 64)
    page = client_a.get(URL).content.decode()
    for field, value, label in (("train_dataset", dataset.pk, "numbers"), ("heldout_dataset", dataset.pk, "numbers"), ("start_job", finished.pk, "done")):
        select = page.split(f'name="{field}"')[1].split("</select>")[0]
        assert f'value="{value}"' in select and label in select, field
    assert "theirs" not in page


def test_the_page_takes_the_files_it_was_sent_unread(client_a):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    with CaptureQueriesContext(connection) as captured:
        response = post(client_a, code=script(), data=data_file(), heldout=SimpleUploadedFile("test.csv", b"x\n1\n"))
    assert response.status_code == 302, errors_of(response)
    reads = [q["sql"] for q in captured.captured_queries if q["sql"].startswith("SELECT")]
    assert not [sql for sql in reads if 'FROM "jobs_upload"' in sql], reads
    assert sorted(Job.objects.get().uploads.values_list("name", flat=True)) == ["test.csv", "train.csv", "train.py"]


def test_the_gpu_types_are_read_once_by_a_form_that_lists_them_again(team_a, rate):
    """The choices are read when first needed (a type given, or the form shown) and kept: a page
    that shows the form again with its errors lists them without reading them again."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from jobs import forms
    from scheduler.models import Node

    Node.objects.create(name="n1", device_type="h100", devices=8)
    with CaptureQueriesContext(connection) as queries:
        form = forms.JobForm({"gpus": "1", "gpu_type": "h100"}, team=team_a)
        assert not form.is_valid() and "gpu_type" not in form.errors
        listed = [str(form["gpu_type"]), str(form["gpu_type"])]
    assert 'value="h100"' in listed[0] and listed[0] == listed[1]
    assert len([q for q in queries if 'FROM "scheduler_node"' in q["sql"]]) == 1
    refused = forms.JobForm({"gpus": "1", "gpu_type": "h1000"}, team=team_a)
    assert not refused.is_valid() and "h1000 is not one of the available choices" in refused.errors["gpu_type"][0]
