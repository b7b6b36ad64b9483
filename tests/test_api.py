import io
import json
from unittest import mock

import pytest
from django.core.management import call_command
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from rest_framework.authtoken.models import Token

from jobs.models import Job, JobEvent, Upload
from tests.conftest import make_job, schedule_now


@pytest.fixture
def api(client, token, rate):
    client.defaults["HTTP_AUTHORIZATION"] = f"Token {token}"
    return client


def files(code=b"print(1)\n", name="train.py"):
    return {"code": io.BytesIO(code), "data": io.BytesIO(b"x,y\n")}


def submit(api, spec, code=b"print(1)\n", code_name="train.py", data=True):
    payload = {"spec": json.dumps(spec) if not isinstance(spec, str) else spec}
    code_file = io.BytesIO(code)
    code_file.name = code_name
    payload["code"] = code_file
    if data:
        data_file = io.BytesIO(b"x,y\n1,2\n")
        data_file.name = "train.csv"
        payload["data"] = data_file
    return api.post(reverse("api:jobs"), payload)


def test_a_job_is_submitted_with_a_spec_and_files(api, alice):
    response = submit(api, {"name": "api-run", "gpus": 2, "span_hours": 1.5, "args": ["--lr", "0.1"], "config": {"epochs": 3}})
    assert response.status_code == 201, response.json()
    body = response.json()
    job = Job.objects.get(pk=body["id"])
    assert (body["state"], body["gpus"], body["span_hours"], body["mode"]) == ("queued", 2, "1.5000", "span")
    assert job.args == ["--lr", "0.1"] and job.config == {"epochs": 3}
    assert [t["state"] for t in body["timeline"]] == ["queued"]
    assert body["last_seq"] == 1
    assert sorted(job.uploads.values_list("role", flat=True)) == ["code", "train"]


def test_until_done_is_inferred_from_a_ceiling(api):
    body = submit(api, {"gpus": 1, "ceiling": "20", "ceiling_kind": "money"}).json()
    assert body["mode"] == "until_done" and body["ceiling_amount"] == "20.00"


def test_datasets_are_named_by_name_or_id(api, dataset):
    assert submit(api, {"gpus": 1, "span_hours": 1, "train_dataset": "numbers"}, data=False).status_code == 201
    assert submit(api, {"gpus": 1, "span_hours": 1, "train_dataset": str(dataset.pk)}, data=False).status_code == 201
    response = submit(api, {"gpus": 1, "span_hours": 1, "train_dataset": "nope"}, data=False)
    assert response.status_code == 400 and response.json()["errors"]["train_dataset"] == ["No dataset 'nope' in your team."]


def test_a_dataset_version_can_be_pinned(api, dataset):
    from catalog.datasets import add_files

    add_files(dataset, {"more.csv": b"3\n"})
    body = submit(api, {"gpus": 1, "span_hours": 1, "train_dataset": "numbers@1"}, data=False).json()
    assert body["train_dataset"] == "numbers@1"
    body = submit(api, {"gpus": 1, "span_hours": 1, "train_dataset": "numbers"}, data=False).json()
    assert body["train_dataset"] == "numbers@2"
    response = submit(api, {"gpus": 1, "span_hours": 1, "train_dataset": "numbers@7"}, data=False)
    assert response.status_code == 400 and response.json()["errors"]["train_dataset"] == ["Numbers has no ready version 7."]


@pytest.mark.parametrize(
    "spec,field,message",
    [
        ({"gpus": 0, "span_hours": 1}, "gpus", "Ask for at least 1 GPU."),
        ({"gpus": 1, "ceiling": 0}, "ceiling", "The ceiling must be more than 0."),
        ({"gpus": 1, "span_hours": 1, "config": "a: [1"}, "config", "not valid YAML"),
        (
            {"gpus": 1, "span_hours": 1, "not_before": "2030-01-02T08:00:00Z", "deadline": "2030-01-01T08:00:00Z"},
            "deadline",
            "after the not-before time",
        ),
    ],
)
def test_the_api_validates_like_the_form(api, spec, field, message):
    response = submit(api, spec)
    assert response.status_code == 400
    assert any(message in e for e in response.json()["errors"][field])
    assert not Job.objects.exists()
    assert not Upload.objects.exists(), "a refused API call leaves no files behind"


def test_an_archive_without_the_entrypoint_is_refused(api):
    import zipfile

    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as z:
        z.writestr("src/run.py", "x")
    response = submit(api, {"gpus": 1, "span_hours": 1, "entrypoint": "main.py"}, code=buffer.getvalue(), code_name="w.zip")
    assert response.status_code == 400
    assert "is not in the archive" in response.json()["errors"]["entrypoint"][0]


def test_a_malformed_spec_is_a_400_with_a_reason(api):
    response = submit(api, '{"gpus": 1,,}')
    assert response.status_code == 400 and "not valid JSON" in response.json()["errors"]["spec"][0]
    response = submit(api, {"gpus": 1, "span_hours": 1, "gpu": 4})
    assert response.status_code == 400 and "unknown field 'gpu' in the spec; did you mean 'gpus'?" in response.json()["errors"]["spec"][0]
    response = api.post(reverse("api:jobs"), {})
    assert response.status_code == 400 and "spec" in response.json()["errors"]
    response = submit(api, "[1, 2]")
    assert response.status_code == 400 and "must be a mapping of fields" in response.json()["errors"]["spec"][0]


def test_jobs_are_listed(api, alice, bob):
    make_job(alice, name="one")
    make_job(bob, name="two")
    names = [j["name"] for j in api.get(reverse("api:jobs")).json()["results"]]
    assert sorted(names) == ["one", "two"]
    assert [j["name"] for j in api.get(reverse("api:jobs") + "?state=running").json()["results"]] == []


def test_logs_are_paged_by_sequence_number(api, alice):
    job = make_job(alice)
    JobEvent.append(job.pk, [JobEvent(kind="log", at=job.created_at, stream="stdout", text=f"line {i}") for i in range(5)])
    first = api.get(reverse("api:job-logs", args=[job.pk]) + "?limit=3").json()
    assert [line["text"] for line in first["lines"]] == ["line 0", "line 1", "line 2"]
    assert first["more"] is True
    rest = api.get(reverse("api:job-logs", args=[job.pk]) + f"?after={first['next_after']}").json()
    assert [line["text"] for line in rest["lines"]] == ["line 3", "line 4"] and rest["more"] is False
    # Exactly the lines left: no more. One read of the events says so (a line past the page).
    with CaptureQueriesContext(connection) as queries:
        exact = api.get(reverse("api:job-logs", args=[job.pk]) + f"?after={first['next_after']}&limit=2").json()
    assert [line["text"] for line in exact["lines"]] == ["line 3", "line 4"] and exact["more"] is False and exact["next_after"] == rest["next_after"]
    assert sum('"jobs_jobevent"' in q["sql"] for q in queries) == 1
    empty = api.get(reverse("api:job-logs", args=[job.pk]) + f"?after={rest['next_after']}").json()
    assert empty["lines"] == [] and empty["more"] is False and empty["next_after"] == rest["next_after"]


@pytest.mark.parametrize("query", ["?after=x", "?limit=0", "?limit=100000", "?after=-1"])
def test_bad_log_parameters_are_a_400(api, alice, query):
    job = make_job(alice)
    response = api.get(reverse("api:job-logs", args=[job.pk]) + query)
    assert response.status_code == 400


def test_cancelling_a_queued_job(api, alice):
    job = make_job(alice)
    response = api.post(reverse("api:job-cancel", args=[job.pk]))
    assert response.status_code == 202 and response.json()["state"] == "cancelled"
    response = api.post(reverse("api:job-cancel", args=[job.pk]))
    assert response.status_code == 409 and "already ended" in response.json()["detail"]


def test_an_unknown_job_is_a_404(api):
    import uuid

    assert api.get(reverse("api:job", args=[uuid.uuid4()])).status_code == 404


def test_usage_needs_a_proper_month(api):
    response = api.get(reverse("api:usage") + "?month=2026-13")
    assert response.status_code == 400 and "YYYY-MM" in response.json()["errors"]["month"][0]


def test_apitoken_prints_a_user_s_token(alice, capsys):
    call_command("apitoken", "alice")
    key = capsys.readouterr().out.strip()
    assert Token.objects.get(user=alice).key == key


def test_apitoken_refuses_an_unknown_user(db):
    from django.core.management import CommandError

    with pytest.raises(CommandError, match="No user named 'nobody'"):
        call_command("apitoken", "nobody")


def test_the_whole_log_downloads_through_the_api(api, alice):
    job = make_job(alice)
    JobEvent.append(job.pk, [JobEvent(kind="log", at=job.created_at, stream="stdout", text=f"l{i}") for i in range(3)])
    response = api.get(reverse("api:job-log", args=[job.pk]))
    assert response.streaming
    assert b"".join(response.streaming_content).decode() == "l0\nl1\nl2\n"


@pytest.mark.parametrize(
    "spec,field,message",
    [
        ({"gpus": [1, 2], "span_hours": 1}, "gpus", "gpus must be a string or a number, not list"),
        ({"gpus": True, "span_hours": 1}, "gpus", "not bool"),
        ({"gpus": 1, "span_hours": {"h": 1}}, "span_hours", "not dict"),
        ({"gpus": 1, "span_hours": 1, "config": 5}, "config", "config must be an object or a string, not int"),
        ({"gpus": 1, "span_hours": 1, "name": ["x"]}, "name", "not list"),
        ({"gpus": 1, "span_hours": 1, "packages": {"numpy": ">=1.26"}}, "packages", "packages must be a list or a string, not dict"),
        ({"gpus": 1, "span_hours": 1, "packages": ["numpy", 2]}, "packages", "packages must be a list of requirements, each a string of one line"),
        ({"gpus": 1, "span_hours": 1, "packages": ["numpy\n-e ."]}, "packages", "each a string of one line"),
    ],
)
def test_a_value_of_the_wrong_type_is_refused(api, spec, field, message):
    response = submit(api, spec)
    assert response.status_code == 400
    assert message in response.json()["errors"][field][0]


@pytest.mark.parametrize(
    "spec,field,message",
    [
        ({"gpus": 1, "span_hours": 1, "config": "[" * 100000}, "config", "nested too deeply"),
        ({"gpus": 1, "span_hours": 1, "config": {"a": "\u0000"}}, "config", "NUL character"),
        ({"gpus": 1, "span_hours": 1, "name": "two\nlines"}, "name", "control characters"),
        ({"gpus": 1, "span_hours": 1, "args": ["a\u0000b"]}, "args", "NUL character"),
        ({"gpus": 1, "ceiling_kind": "gpu_hours", "ceiling": "9999999999999.99"}, "ceiling", "no more than 14 digits"),
        ({"gpus": 10**9, "span_hours": 1}, "gpus", "less than or equal to 1024"),
        ({"gpus": 1, "span_hours": "NaN"}, "span_hours", "Enter a number"),
        ({"gpus": 1, "span_hours": 1, "not_before": "tomorrow"}, "not_before", "Enter a valid date/time"),
    ],
)
def test_hostile_values_get_a_400_with_a_reason(api, spec, field, message):
    response = submit(api, spec)
    assert response.status_code == 400, response.content
    assert any(message in e for e in response.json()["errors"][field])


def test_a_deeply_nested_spec_is_a_400(api):
    response = submit(api, "[" * 100000)
    assert response.status_code == 400 and "nested too deeply" in response.json()["errors"]["spec"][0]


def test_the_largest_ceiling_is_accepted_and_placed(api, alice):
    from scheduler.models import Node

    Node.objects.create(name="n", device_type="cpu", devices=1)
    response = submit(api, {"gpus": 1, "ceiling_kind": "gpu_hours", "ceiling": "999999999999.99"})
    assert response.status_code == 201, response.content
    [allocation] = schedule_now()
    assert allocation.limit_seconds == 100 * 365 * 24 * 3600  # "unbounded", and storable


@pytest.mark.parametrize("month", ["0000-01", "9999-12", "1969-12"])
def test_months_outside_the_calendar_are_a_400(api, month):
    response = api.get(reverse("api:usage") + f"?month={month}")
    assert response.status_code == 400 and "out of range" in response.json()["errors"]["month"][0]


def test_checkpoint_and_stopping_fields_through_the_api(api):
    body = submit(api, {"gpus": 1, "span_hours": 1}).json()
    assert body["stop_on_nan"] is True and body["preemptible"] is False and body["keep_checkpoints"] == 3
    spec = {
        "gpus": 1,
        "span_hours": 1,
        "preemptible": True,
        "stop_on_nan": False,
        "keep_checkpoints": 2,
        "max_restarts": 0,
        "early_stop_metric": "acc",
        "early_stop_mode": "max",
        "early_stop_patience": 5,
    }
    body = submit(api, spec).json()
    assert (body["preemptible"], body["stop_on_nan"], body["keep_checkpoints"], body["max_restarts"]) == (True, False, 2, 0)
    assert (body["early_stop_metric"], body["early_stop_mode"], body["early_stop_patience"]) == ("acc", "max", 5)
    assert body["preemptions"] == 0 and body["credited"] == "0"
    response = submit(api, {"gpus": 1, "span_hours": 1, "preemptible": "yes"})
    assert response.status_code == 400 and response.json()["errors"]["preemptible"] == ["preemptible must be true or false, not str."]
    response = submit(api, {"gpus": 1, "span_hours": 1, "early_stop_mode": "sideways", "early_stop_metric": "a", "early_stop_patience": 1})
    assert response.status_code == 400 and "early_stop_mode" in response.json()["errors"]


@pytest.mark.parametrize("given", [["numpy>=1.26", "einops==0.8.0"], "numpy>=1.26\n# pinned:\neinops==0.8.0\n"])
def test_packages_are_submitted_as_a_list_or_as_text_and_come_back_as_a_list(api, given):
    response = submit(api, {"gpus": 1, "span_hours": 1, "packages": given})
    assert response.status_code == 201, response.json()
    assert response.json()["packages"] == ["numpy>=1.26", "einops==0.8.0"]
    job = Job.objects.get(pk=response.json()["id"])
    assert job.packages == "numpy>=1.26\neinops==0.8.0"
    assert api.get(reverse("api:job", args=[job.pk])).json()["packages"] == ["numpy>=1.26", "einops==0.8.0"]


def test_a_job_without_packages_has_an_empty_list(api):
    assert submit(api, {"gpus": 1, "span_hours": 1}).json()["packages"] == []


def test_a_package_that_is_not_a_plain_requirement_is_a_400_naming_its_line(api):
    response = submit(api, {"gpus": 1, "span_hours": 1, "packages": ["numpy", "git+https://github.com/org/pkg.git"]})
    assert response.status_code == 400 and not Job.objects.exists()
    [message] = response.json()["errors"]["packages"]
    assert message.startswith("work.packages: line 2 (git+https://github.com/org/pkg.git): a URL is not taken")


def test_an_archive_s_requirements_txt_is_read_through_the_api_too(api):
    import zipfile

    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as z:
        z.writestr("train.py", "print(1)\n")
        z.writestr("requirements.txt", "scipy\neinops==0.8.0\n")
    response = submit(api, {"gpus": 1, "span_hours": 1, "entrypoint": "train.py", "packages": ["einops==0.8.0"]}, code=buffer.getvalue(), code_name="work.zip")
    assert response.status_code == 201, response.json()
    assert response.json()["packages"] == ["einops==0.8.0", "scipy"]


def test_precision_is_taken_and_shown_and_a_bad_one_is_a_400_naming_the_choices(api):
    response = submit(api, {"gpus": 1, "span_hours": 1, "precision": "fp16"})
    assert response.status_code == 201, response.json()
    assert response.json()["precision"] == "fp16" and Job.objects.get(pk=response.json()["id"]).precision == "fp16"
    assert submit(api, {"gpus": 1, "span_hours": 1}).json()["precision"] == ""  # not chosen: the default
    for bad in ("fp8", "BF16", 16):
        response = submit(api, {"gpus": 1, "span_hours": 1, "precision": bad})
        assert response.status_code == 400, response.json()
        [message] = response.json()["errors"]["precision"]
        assert f"{bad} is not a precision: choose fp32, bf16 or fp16" in message
    assert Job.objects.count() == 2


SUBMITTED = {
    "a script and its data": ({"name": "plain", "gpus": 1, "span_hours": 1}, {}),
    "datasets, named inputs, held-out files": (
        {"name": "inputs", "gpus": 1, "span_hours": 1, "train_dataset": "numbers", "inputs": {"corpus": "numbers@1", "extra": "numbers"}},
        {"heldout": ("held.csv", b"x,y\n3,4\n")},
    ),
    "a base model and a ceiling": (
        {"name": "tune", "kind": "finetune", "gpus": 2, "ceiling": "12.5", "ceiling_kind": "money"},
        {"base_model": ("model.safetensors", b"w")},
    ),
    "a smoke run first": ({"name": "careful", "gpus": 2, "span_hours": 3, "smoke_first": True, "config": {"epochs": 3}}, {}),
}


@pytest.mark.parametrize("spec, extra", SUBMITTED.values(), ids=SUBMITTED.keys())
def test_a_submission_answers_the_job_as_reading_it_back_does(api, dataset, spec, extra, django_assert_max_num_queries):
    """The 201's job is the job as a GET of it shows it, though the answer reads back none of
    what was made with it (jobs.serializers.as_made)."""
    payload = {"spec": json.dumps(spec)}
    for field, (name, content) in {"code": ("train.py", b"print(1)\n"), "data": ("train.csv", b"x,y\n1,2\n"), **extra}.items():
        payload[field] = io.BytesIO(content)
        payload[field].name = name
    if "train_dataset" in spec:
        del payload["data"]
    made = api.post(reverse("api:jobs"), payload)
    assert made.status_code == 201, made.json()
    read = api.get(reverse("api:job", args=[made.json()["id"]]))
    assert made.json() == read.json()


def test_a_submission_reads_nothing_back_for_its_answer(api, django_assert_num_queries):
    """After the job is saved and audited, its answer is made without a query: its allocations,
    stagings, credits, models, inputs, uploads and timeline are what was just made."""
    from jobs import serializers

    seen = []
    made_with = serializers.as_made

    def counted(job, made):
        seen.append(job)
        return made_with(job, made)

    serializers_answer = serializers.JobSerializer.to_representation

    def answer(self, instance):
        with django_assert_num_queries(0):
            return serializers_answer(self, instance)

    with mock.patch("jobs.api.as_made", counted), mock.patch.object(serializers.JobSerializer, "to_representation", answer):
        response = submit(api, {"name": "quiet", "gpus": 1, "span_hours": 1})
    assert response.status_code == 201, response.json()
    assert len(seen) == 1


def test_a_submission_reads_the_gpu_types_only_when_it_names_one(api, alice):
    """The GPU type's choices (the nodes' types and the rates') are read when a type is given,
    to check it, not for every submission (issue 24); a type no node or rate has is still
    refused with the choices it may take."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from scheduler.models import Node

    Node.objects.create(name="n1", device_type="h100", devices=8)
    with CaptureQueriesContext(connection) as queries:
        assert submit(api, {"name": "any", "gpus": 1, "span_hours": 1}).status_code == 201
    assert not [q["sql"] for q in queries if 'FROM "scheduler_node"' in q["sql"] or 'SELECT "billing_rate"."gpu_type"' in q["sql"]]
    with CaptureQueriesContext(connection) as queries:
        made = submit(api, {"name": "typed", "gpus": 1, "span_hours": 1, "gpu_type": "h100"})
    assert made.status_code == 201, made.json()
    assert made.json()["gpu_type"] == "h100"
    assert [q["sql"] for q in queries if 'FROM "scheduler_node"' in q["sql"]]
    refused = submit(api, {"name": "typo", "gpus": 1, "span_hours": 1, "gpu_type": "h1000"})
    assert refused.status_code == 400
    assert "h1000 is not one of the available choices" in refused.json()["errors"]["gpu_type"][0]


def recipes_with_fields(form):
    from e31.recipes import RECIPES

    return sorted(name for name in RECIPES if any(field.startswith(f"recipe_{name}_") for field in form.fields))


def test_the_apis_form_makes_the_chosen_recipes_fields_only(api, team_a):
    """The page's form has every recipe's fields (it switches between them); the API's only the
    recipe its spec names, whose settings it still checks field by field (issue 24)."""
    from e31.recipes import RECIPES
    from jobs import api as jobs_api
    from jobs.forms import JobForm

    made = []

    class Seen(JobForm):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(recipes_with_fields(self))

    real = jobs_api.job_form
    with mock.patch("jobs.api.job_form", lambda request, team, spec: real(request, team, spec, form_class=Seen)):
        assert submit(api, {"name": "own", "gpus": 1, "span_hours": 1}).status_code == 201
        recipe = next(iter(RECIPES))
        refused = api.post(reverse("api:jobs"), {"spec": json.dumps({"name": "r", "recipe": recipe, "gpus": 1, "span_hours": 1, "config": {"lr": -1}})})
    assert made == [[], [recipe]]
    assert refused.status_code == 400 and "lr" in json.dumps(refused.json()["errors"]), refused.json()
    assert recipes_with_fields(JobForm(team=team_a)) == sorted(RECIPES)


def test_a_submission_stores_its_first_event_with_the_job_and_resolves_a_dataset_in_one_query(api, alice, dataset):
    """The job is made with its counter past its "submitted" event (no savepoint, no UPDATE of
    the job); a dataset named in the spec is found with its ready version in one query."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from catalog.models import DatasetVersion

    newer = dataset.new_version()
    DatasetVersion.objects.filter(pk=newer.pk).update(state=DatasetVersion.READY)  # numbers@2, the latest
    with CaptureQueriesContext(connection) as queries:
        response = submit(api, {"name": "first", "gpus": 1, "span_hours": 1, "train_dataset": "numbers"}, data=False)
    assert response.status_code == 201, response.json()
    sql = [q["sql"] for q in queries]
    assert not [q for q in sql if q.startswith("UPDATE") and "jobs_job" in q.split("SET")[0]], sql
    # One transaction (the test's own makes it a savepoint), none inside it, with the audit's record.
    assert len([q for q in sql if q.startswith("SAVEPOINT")]) == 1, "\n".join(q[:90] for q in sql)
    [audited] = [i for i, q in enumerate(sql) if q.startswith('INSERT INTO "accounts_auditevent"')]
    [released] = [i for i, q in enumerate(sql) if q.startswith("RELEASE SAVEPOINT")]
    assert audited < released
    assert len([q for q in sql if 'FROM "jobs_dataset' in q]) == 1, sql
    job = Job.objects.get(pk=response.json()["id"])
    assert job.train_version.pk == newer.pk and job.train_version.number == 2
    assert job.last_seq == 1 and list(job.events.values_list("seq", "kind", "data__reason")) == [(1, "state", "submitted")]
    job.record("notice", data={"text": "and then"})  # the counter goes on from there
    assert list(job.events.order_by("seq").values_list("seq", flat=True)) == [1, 2]
    # The older version by its number, one not ready, an unknown name: as before, with reasons.
    assert submit(api, {"name": "older", "gpus": 1, "span_hours": 1, "train_dataset": "numbers@1"}, data=False).status_code == 201
    opened = dataset.new_version()
    for ref, reason in ((f"numbers@{opened.number}", "has no ready version"), ("nothing", "No dataset 'nothing'"), ("numbers@x", "must be a number")):
        refused = submit(api, {"name": "bad", "gpus": 1, "span_hours": 1, "train_dataset": ref}, data=False)
        assert refused.status_code == 400 and reason in json.dumps(refused.json()), (ref, refused.json())


def test_no_job_is_submitted_without_its_audit_record(api, alice):
    with mock.patch("accounts.audit.record", side_effect=RuntimeError("the audit log is down")), pytest.raises(RuntimeError):
        submit(api, {"name": "unrecorded", "gpus": 1, "span_hours": 1, "env": {"TOKEN": "x"}})
    assert not Job.objects.filter(name="unrecorded").exists()
    response = submit(api, {"name": "recorded", "gpus": 1, "span_hours": 1, "env": {"TOKEN": "x"}})
    assert response.status_code == 201
    from accounts.models import AuditEvent

    assert sorted(AuditEvent.objects.filter(object_id=response.json()["id"]).values_list("action", flat=True)) == ["job.env", "job.submit"]


def test_store_first_refuses_a_job_whose_counter_does_not_stand_past_them(alice):
    job = make_job(alice)  # its "submitted" event already stored: last_seq 1
    with pytest.raises(ValueError):
        JobEvent.store_first(job, [JobEvent(kind="notice", at=job.created_at, data={}) for _ in range(2)])
    assert job.events.count() == 1


def test_log_lines_times_are_written_as_the_json_writes_a_datetime(api, alice):
    """The log page's times come as text from the database (core.sqltime.IsoUtc): the same text
    DRF's JSON writes for the datetime, with or without microseconds, in UTC whatever the zone
    the time was given in."""
    from datetime import UTC, datetime, timedelta
    from zoneinfo import ZoneInfo

    from rest_framework.utils.encoders import JSONEncoder

    job = make_job(alice)
    base = datetime(2026, 12, 5, 23, 59, 59, tzinfo=UTC)
    times = [
        base,
        base.replace(microsecond=1),
        base.replace(microsecond=999999),
        base.replace(microsecond=500000) + timedelta(seconds=1),  # into the next day and month
        datetime(2026, 3, 29, 2, 30, 0, 120, tzinfo=ZoneInfo("Europe/Berlin")),  # a zone's own clock
    ]
    JobEvent.append_lines(job.pk, [("stdout", at, f"line {n}") for n, at in enumerate(times)])
    body = api.get(reverse("api:job-logs", args=[job.pk])).json()
    assert [line["at"] for line in body["lines"]] == [JSONEncoder().default(at.astimezone(UTC)) for at in times]
    assert [line["text"] for line in body["lines"]] == [f"line {n}" for n in range(len(times))]
    assert list(body["lines"][0]) == ["seq", "at", "stream", "rank", "text"]
