"""Job spec files through the API: submit, estimate, refusals that name the line, the job
written back down as a spec, and signing in from the terminal."""

import io
from decimal import Decimal
from pathlib import Path

import pytest
import yaml
from django.urls import reverse
from django.utils import timezone

from jobs.models import Job
from tests.conftest import PASSWORD, make_job

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

SPEC = """\
# a job as a person writes it
name: spec-run
kind: train
work:
  code: train.py
  args: [--epochs, "3"]
  config:
    lr: 0.1
  env: {SEED: "7"}
data:
  train: numbers
  train_files: [extra.csv]
request:
  gpus: 2
  span_hours: 1.5
  preemptible: true
  network: true
output:
  keep_checkpoints: 2
  max_restarts: 1
  early_stop: {metric: heldout_loss, mode: min, patience: 4}
  stop_on_nan: false
"""


@pytest.fixture
def api(client, token, rate):
    client.defaults["HTTP_AUTHORIZATION"] = f"Token {token}"
    return client


def named(content, name):
    handle = io.BytesIO(content)
    handle.name = name
    return handle


def post_spec(api, text, url=None, name="job.yaml", **files):
    payload = {"spec": text, "spec_name": name}
    payload.update({field: named(content, file_name) for field, (file_name, content) in files.items()})
    return api.post(url or reverse("api:jobs"), payload)


def all_messages(body):
    return [m for messages in body.get("errors", {}).values() for m in messages]


def test_a_spec_file_submits_a_job_with_every_part(api, dataset):
    response = post_spec(api, SPEC, code=("train.py", b"print(1)\n"), data=("extra.csv", b"1\n"))
    assert response.status_code == 201, response.json()
    job = Job.objects.get(pk=response.json()["id"])
    assert (job.name, job.kind, job.gpus, job.span_hours, job.preemptible, job.network) == ("spec-run", "train", 2, Decimal("1.5"), True, True)
    assert (job.args, job.config, job.env) == (["--epochs", "3"], {"lr": 0.1}, {"SEED": "7"})
    assert job.train_version.dataset == dataset
    assert (job.keep_checkpoints, job.max_restarts, job.stop_on_nan) == (2, 1, False)
    assert (job.early_stop_metric, job.early_stop_mode, job.early_stop_patience) == ("heldout_loss", "min", 4)
    assert sorted(job.uploads.values_list("role", "name")) == [("code", "train.py"), ("train", "extra.csv")]


@pytest.mark.parametrize(
    "change,line,words",
    [
        (("  gpus: 2", "  gpus: zero"), 14, "request.gpus: Enter a whole number"),
        (("  gpus: 2", "  gpu: 2"), 14, "unknown field 'gpu' in 'request'; did you mean 'gpus'?"),
        (("  span_hours: 1.5", "  span_hours: 0"), 15, "The span must be longer than 0 hours"),
        (("  train: numbers", "  train: nope"), 11, "No dataset 'nope' in your team"),
        (('  args: [--epochs, "3"]', "  args: {a: 1}"), 6, "args must be a list or a string"),
        (("  early_stop: {metric: heldout_loss, mode: min, patience: 4}", "  early_stop: {metric: heldout_loss, mode: up}"), 21, "output.early_stop.mode"),
        (("    lr: 0.1", "    lr: [0.1"), 9, "not valid YAML"),
    ],
)
def test_a_bad_spec_is_refused_naming_its_line(api, dataset, change, line, words):
    text = SPEC.replace(*change)
    assert text != SPEC
    response = post_spec(api, text, code=("train.py", b"print(1)\n"), data=("extra.csv", b"1\n"))
    assert response.status_code == 400
    body = response.json()
    messages = all_messages(body)
    assert any(m.startswith(f"job.yaml line {line}: ") and words in m for m in messages), messages
    assert f"line {line}" in body["detail"]
    assert not Job.objects.exists()


def test_a_file_the_spec_names_must_be_sent(api, dataset):
    response = post_spec(api, SPEC, data=("extra.csv", b"1\n"))
    assert response.status_code == 400
    (message,) = response.json()["errors"]["code"]
    assert message.startswith("job.yaml line 5: work.code: names train.py, which was not sent")
    assert not Job.objects.exists()


def test_a_recipe_setting_is_refused_at_its_line(api):
    text = "name: r\nwork:\n  recipe: classifier\n  config:\n    lr: -1\nrequest: {gpus: 1, span_hours: 1}\n"
    response = post_spec(api, text, data=("train.csv", b"x,y\n1,2\n"))
    assert response.status_code == 400
    assert any(m.startswith("job.yaml line 5: work.config.lr") for m in all_messages(response.json())), response.json()


def test_the_flat_api_spec_still_works_as_a_json_object(api):
    response = api.post(reverse("api:jobs"), {"spec": {"gpus": 1, "span_hours": 1, "entrypoint": "train.py"}}, content_type="application/json")
    # No files: the form refuses for want of a script, without any line (the spec came as an object).
    assert response.status_code == 400
    assert all("line" not in m for m in all_messages(response.json()))


def test_an_estimate_for_a_spec_before_submitting(api, rate):
    text = "request:\n  gpus: 4\n  span_hours: 2.5\n"
    response = post_spec(api, text, url=reverse("api:estimate"))
    assert response.status_code == 200, response.json()
    body = response.json()
    assert body["worst_case"] == "24.00" and rate.per_gpu_hour == Decimal("2.40")
    assert (body["gpus"], body["hours"], body["gpu_hours"], body["mode"]) == (4, "2.5000", "10.0000", "span")
    assert body["predicted_start"] is None  # no node online can run it
    until_done = post_spec(api, "request: {gpus: 2, ceiling: 12, ceiling_kind: money}\n", url=reverse("api:estimate")).json()
    assert until_done["mode"] == "until_done" and until_done["worst_case"] == "12.00" and until_done["hours"] == "2.5000"
    bad = post_spec(api, "request:\n  gpus: -1\n  span_hours: 1\n", url=reverse("api:estimate"))
    assert bad.status_code == 400 and bad.json()["errors"]["gpus"][0].startswith("job.yaml line 2: request.gpus:")


def test_the_estimate_shows_the_budget_left(api, alice):
    team = alice.membership.team
    team.monthly_budget = Decimal("5")
    team.save()
    body = post_spec(api, "request: {gpus: 1, span_hours: 10}\n", url=reverse("api:estimate")).json()
    assert body["budget_remaining"] == "5.00" and body["over_budget"] is True


def test_a_job_downloads_as_a_spec_that_submits_the_same_job(api, alice, dataset):
    created = post_spec(api, SPEC, code=("train.py", b"print(1)\n"), data=("extra.csv", b"1\n")).json()
    response = api.get(reverse("api:job-spec", args=[created["id"]]))
    assert response.status_code == 200 and response["Content-Type"].startswith("application/yaml")
    assert 'filename="spec-run.yaml"' in response["Content-Disposition"]
    text = response.content.decode()
    spec = yaml.safe_load(text)
    assert spec["data"] == {"train": "numbers@1", "train_files": ["extra.csv"]}
    assert spec["work"]["code"] == "train.py" and spec["request"]["span_hours"] == 1.5
    again = post_spec(api, text, code=("train.py", b"print(1)\n"), data=("extra.csv", b"1\n"))
    assert again.status_code == 201, again.json()
    first, second = Job.objects.get(pk=created["id"]), Job.objects.get(pk=again.json()["id"])
    fields = [
        "name",
        "kind",
        "entrypoint",
        "args",
        "config",
        "env",
        "gpus",
        "gpu_type",
        "span_hours",
        "ceiling_amount",
        "preemptible",
        "network",
        "keep_checkpoints",
        "max_restarts",
        "early_stop_metric",
        "early_stop_mode",
        "early_stop_patience",
        "stop_on_nan",
        "train_version_id",
    ]
    assert [getattr(second, f) for f in fields] == [getattr(first, f) for f in fields]
    assert api.get(reverse("api:job-spec", args=[created["id"]]) + "?format=json").json() == spec


PACKAGED = SPEC.replace('  env: {SEED: "7"}\n', '  env: {SEED: "7"}\n  packages:\n    - numpy>=1.26\n    - einops==0.8.0\n')


def test_a_spec_file_s_packages_are_kept_and_written_back_to_submit_again(api, alice, dataset):
    assert PACKAGED != SPEC
    created = post_spec(api, PACKAGED, code=("train.py", b"print(1)\n"), data=("extra.csv", b"1\n"))
    assert created.status_code == 201, created.json()
    assert Job.objects.get(pk=created.json()["id"]).packages == "numpy>=1.26\neinops==0.8.0"
    text = api.get(reverse("api:job-spec", args=[created.json()["id"]])).content.decode()
    assert yaml.safe_load(text)["work"]["packages"] == ["numpy>=1.26", "einops==0.8.0"]
    again = post_spec(api, text, code=("train.py", b"print(1)\n"), data=("extra.csv", b"1\n"))
    assert again.status_code == 201, again.json()
    assert Job.objects.get(pk=again.json()["id"]).packages == "numpy>=1.26\neinops==0.8.0"
    # A job without packages writes none.
    assert "packages" not in api.get(reverse("api:job-spec", args=[make_job(alice).pk]) + "?format=json").json()["work"]


def test_a_bad_package_in_a_spec_file_is_refused_at_its_line(api, dataset):
    text = PACKAGED.replace("    - einops==0.8.0\n", "    - --extra-index-url https://mirror.example/simple\n")
    response = post_spec(api, text, code=("train.py", b"print(1)\n"), data=("extra.csv", b"1\n"))
    assert response.status_code == 400 and not Job.objects.exists()
    [message] = response.json()["errors"]["packages"]
    assert message.startswith("job.yaml line 10: work.packages: line 2 (--extra-index-url https://mirror.example/simple): options such as")


def test_a_past_deadline_is_left_out_of_the_spec(api, alice):
    job = make_job(alice, deadline=timezone.now() - timezone.timedelta(hours=1), not_before=timezone.now() + timezone.timedelta(hours=2))
    spec = api.get(reverse("api:job-spec", args=[job.pk]) + "?format=json").json()
    assert "deadline" not in spec["request"] and "not_before" in spec["request"]


@pytest.mark.nodb
@pytest.mark.parametrize("path", sorted((EXAMPLES / "specs").glob("*.yaml")), ids=lambda p: p.name)
def test_the_example_specs_read(path):
    from jobs import specfile

    spec = specfile.read(path.read_text(), path.name)
    for paths in spec.files.values():
        for file_path, _ in paths:
            assert (path.parent / file_path).exists(), file_path


def test_the_example_train_spec_submits(api, alice):
    from e31web.demo import add_dataset

    add_dataset(alice.membership.team, "digits", {"train.csv": b"x,y\n1,2\n"})
    add_dataset(alice.membership.team, "digits-heldout", {"heldout.csv": b"x,y\n1,2\n"})
    path = EXAMPLES / "specs" / "train.yaml"
    code = (path.parent / yaml.safe_load(path.read_text())["work"]["code"]).read_bytes()
    response = post_spec(api, path.read_text(), name="train.yaml", code=("train.py", code))
    assert response.status_code == 201, response.json()


def test_jobs_are_listed_with_filters_and_pages(api, alice, bob, charlie):
    jobs = [make_job(alice, name=f"run-{i}") for i in range(3)]
    Job.objects.filter(pk=jobs[0].pk).update(state="failed")
    make_job(charlie, name="run-theirs")
    body = api.get(reverse("api:jobs") + "?page_size=2").json()
    assert body["count"] == 3 and len(body["results"]) == 2 and body["next"]
    assert [j["name"] for j in body["results"]] == ["run-2", "run-1"]  # newest first
    assert [j["name"] for j in api.get(body["next"]).json()["results"]] == ["run-0"]
    assert [j["name"] for j in api.get(reverse("api:jobs") + "?state=failed").json()["results"]] == ["run-0"]
    assert api.get(reverse("api:jobs") + "?name=UN-1").json()["count"] == 1
    prefix = jobs[1].pk.hex[:6]
    assert [j["id"] for j in api.get(reverse("api:jobs") + f"?id_prefix={prefix}").json()["results"]] == [str(jobs[1].pk)]
    # Every prefix, short or long, with or without dashes, finds exactly the ids that start so.
    for job in jobs:
        for length in (1, 2, 7, 9, 32):
            prefix = str(job.pk)[:length]
            want = sorted(str(j.pk) for j in jobs if str(j.pk).startswith(prefix))
            got = sorted(j["id"] for j in api.get(reverse("api:jobs") + f"?id_prefix={prefix.upper()}").json()["results"])
            assert got == want, prefix
    for bad in ("state=lost", "kind=bake", "id_prefix=xyz"):
        response = api.get(reverse("api:jobs") + "?" + bad)
        assert response.status_code == 400 and response.json()["detail"], bad


def test_a_token_for_a_username_and_password(client, alice):
    wrong = client.post(reverse("api:token"), {"username": "alice", "password": "nope"}, content_type="application/json")
    assert wrong.status_code == 401 and wrong.json()["detail"] == "Wrong username or password."
    response = client.post(reverse("api:token"), {"username": "alice", "password": PASSWORD}, content_type="application/json")
    assert response.status_code == 200
    key = response.json()["token"]
    me = client.get(reverse("api:me"), HTTP_AUTHORIZATION=f"Token {key}").json()
    assert me["username"] == "alice" and me["team"]["name"] == "Team A"
    # The same token each time: a second terminal does not sign the first out.
    again = client.post(reverse("api:token"), {"username": "alice", "password": PASSWORD}, content_type="application/json")
    assert again.json()["token"] == key


def test_the_time_zone_is_set_from_the_api_and_used_for_by_morning(api, alice):
    from django.urls import reverse as url

    bad = api.patch(url("api:me"), {"time_zone": "Mars/Olympus"}, content_type="application/json")
    assert bad.status_code == 400 and "not a time zone" in bad.json()["detail"]
    response = api.patch(url("api:me"), {"time_zone": "Asia/Tokyo"}, content_type="application/json")
    assert response.status_code == 200 and response.json()["time_zone"] == "Asia/Tokyo"
    body = post_spec(api, "request: {gpus: 1, span_hours: 1, by: morning}\n", url=url("api:estimate")).json()
    # 08:00 in Tokyo is 23:00 UTC.
    assert body["deadline"].endswith("T08:00:00+09:00"), body["deadline"]


def test_two_files_of_one_name_are_refused_not_overwritten(api):
    payload = {
        "spec": "work: {entrypoint: train.py}\nrequest: {gpus: 1, span_hours: 1}\n",
        "spec_name": "job.yaml",
        "code": named(b"print(1)\n", "train.py"),
        "data": [named(b"1\n", "part.csv"), named(b"2\n", "part.csv")],
    }
    response = api.post(reverse("api:jobs"), payload)
    assert response.status_code == 400
    assert any("Two files are named part.csv" in m for m in all_messages(response.json()))
    assert not Job.objects.exists()
