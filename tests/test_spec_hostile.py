"""Specs an attacker writes: a YAML alias bomb, nesting past any sense, numbers too long to read.
Each is a 400 with a reason, answered without the memory it asks for; and valid JSON (an emoji
written as a surrogate pair, as json.dumps writes it) is read as JSON, not refused."""

import io
import json
import re
import resource

import pytest
from django.urls import reverse

from jobs import spec_text, specfile
from jobs.models import Job
from tests.conftest import PASSWORD, make_job

# 439 bytes that, with aliases expanded, are 4**11 (about four million) items.
BOMB = "a0: &a0 [x]\n" + "".join(f"a{n}: &a{n} [*a{n - 1}, *a{n - 1}, *a{n - 1}, *a{n - 1}]\n" for n in range(1, 12))
DEEP_TEXTS = {
    "json": "[" * 100000,
    "yaml flow": "x: " + "[" * 100000,
    "yaml block": "- " * 5000 + "x\n",
    "json, deeper than the limit but not the stack": "[" * 40 + "]" * 40,
}
EMOJI_NAME = "run \U0001f600"


def peak_rss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KB on Linux


@pytest.fixture
def bounded_memory():
    """Fails the test if the process's peak memory grew by 200 MB or more while it ran."""
    before = peak_rss_mb()
    yield
    assert peak_rss_mb() - before < 200


# The parsing itself, without a database ---------------------------------------------------------


@pytest.mark.nodb
def test_json_is_read_as_json_so_a_surrogate_pair_is_one_character():
    text = json.dumps({"name": EMOJI_NAME, "gpus": 1})
    assert "\\ud83d\\ude00" in text
    assert specfile.parse(text) == {"name": EMOJI_NAME, "gpus": 1}
    assert specfile.read(text, "job.json").fields["name"] == EMOJI_NAME
    assert spec_text.parse_config(json.dumps({"label": "\U0001f600"})) == {"label": "\U0001f600"}
    # Half a pair is still text no database can store.
    with pytest.raises(specfile.SpecFileError, match="not valid Unicode"):
        specfile.read('{"name": "\\ud83d"}', "job.json")


@pytest.mark.nodb
def test_an_alias_bomb_is_refused_at_its_first_anchor(bounded_memory):
    with pytest.raises(specfile.ParseError, match="alias") as raised:
        specfile.parse(BOMB)
    assert raised.value.line == 1
    with pytest.raises(specfile.SpecFileError, match="job.yaml line 1: .*alias"):
        specfile.read(BOMB, "job.yaml")
    with pytest.raises(spec_text.SpecError, match="alias"):
        spec_text.parse_config(BOMB)


@pytest.mark.nodb
@pytest.mark.parametrize("text", ["a: &x 1\nb: *x\n", "base: &b {gpus: 1}\nrequest:\n  <<: *b\n", "a: *x\n"])
def test_any_anchor_or_alias_is_refused(text):
    with pytest.raises(specfile.ParseError, match="alias"):
        specfile.parse(text)


@pytest.mark.nodb
@pytest.mark.parametrize("text", DEEP_TEXTS.values(), ids=DEEP_TEXTS.keys())
def test_deep_nesting_is_refused(text, bounded_memory):
    with pytest.raises(specfile.ParseError, match="nested too deeply"):
        specfile.parse(text)
    with pytest.raises(specfile.SpecFileError, match="nested too deeply"):
        specfile.read(text, "job.yaml")


@pytest.mark.nodb
def test_nesting_within_the_limit_is_read():
    nested = "[" * 20 + "]" * 20
    assert specfile.parse(f'{{"config": {{"layers": {nested}}}}}')["config"]["layers"] == json.loads(nested)
    assert spec_text.parse_config("a:\n  b:\n    c: [[1, 2], [3]]\n") == {"a": {"b": {"c": [[1, 2], [3]]}}}
    # YAML's dates, keys too, come back as the ISO text JSON can hold.
    assert spec_text.parse_config("2026-01-02: start\nend: 2026-01-03\n") == {"2026-01-02": "start", "end": "2026-01-03"}


@pytest.mark.nodb
@pytest.mark.parametrize(
    "text,words",
    [
        ('{"gpus": 1' + "0" * 5000 + "}", "not valid JSON"),
        ('{"gpus": NaN}', "not valid JSON"),
        ("a" * (specfile.MAX_BYTES + 1), "larger than 256 KB"),
        ("name: !!binary aGk=\n", "!!binary"),
        ("work:\n  config: !!set {a, b}\n", "!!set"),
    ],
)
def test_text_json_cannot_hold_is_a_refusal_not_a_crash(text, words):
    with pytest.raises(specfile.ParseError, match=words):
        specfile.parse(text)
    with pytest.raises(specfile.SpecFileError, match=words):
        specfile.read(text, "job.json")


# Through the API and the pages ------------------------------------------------------------------


@pytest.fixture
def api(client, token, rate):
    client.defaults["HTTP_AUTHORIZATION"] = f"Token {token}"
    return client


def post_spec(api, url, text, **files):
    payload = {"spec": text, "spec_name": "job.yaml"}
    for field, (name, content) in files.items():
        payload[field] = io.BytesIO(content)
        payload[field].name = name
    return api.post(reverse(url), payload)


def messages(response):
    return [m for found in response.json().get("errors", {}).values() for m in found]


@pytest.mark.parametrize("url", ["api:estimate", "api:jobs"])
def test_an_alias_bomb_is_a_400_with_a_reason(api, url, bounded_memory):
    response = post_spec(api, url, BOMB)
    assert response.status_code == 400
    assert any(m.startswith("job.yaml line 1: ") and "alias" in m for m in messages(response)), response.json()
    assert not Job.objects.exists()


def test_an_alias_bomb_as_the_config_is_a_400_with_a_reason(api, bounded_memory):
    flat = json.dumps({"gpus": 1, "span_hours": 1, "entrypoint": "train.py", "config": BOMB})
    response = api.post(reverse("api:jobs"), {"spec": flat, "code": io.BytesIO(b"print(1)\n")})
    assert response.status_code == 400
    assert any("alias" in m for m in response.json()["errors"]["config"]), response.json()


@pytest.mark.parametrize("url", ["api:estimate", "api:jobs"])
@pytest.mark.parametrize("text", DEEP_TEXTS.values(), ids=DEEP_TEXTS.keys())
def test_a_deeply_nested_spec_is_a_400(api, url, text, bounded_memory):
    response = post_spec(api, url, text)
    assert response.status_code == 400
    # Refused at the limit, whatever the stack allows, and the reason says where the limit is.
    assert any(re.search(r"nested too deeply \(more than \d+ levels\)", m) for m in messages(response)), response.json()


@pytest.mark.parametrize("url", ["api:estimate", "api:jobs"])
def test_a_deeply_nested_json_body_is_a_400(api, url, bounded_memory):
    body = '{"spec": ' + "[" * 100000 + "]" * 100000 + "}"
    response = api.post(reverse(url), body, content_type="application/json")
    assert response.status_code == 400
    assert "nested too deeply" in response.json()["detail"]


def test_a_deeply_nested_retrain_spec_is_a_400(api, alice, bounded_memory):
    job = make_job(alice)
    response = api.post(reverse("api:job-retrain", args=[job.pk]), {"spec": "[" * 100000})
    assert response.status_code == 400
    assert "nested too deeply" in response.json()["errors"]["spec"][0]


def test_a_json_spec_with_a_surrogate_pair_is_accepted_and_its_name_comes_back(api, dataset):
    text = json.dumps({"name": EMOJI_NAME, "gpus": 1, "span_hours": 1, "entrypoint": "train.py", "train_dataset": "numbers"}, indent=2)
    assert post_spec(api, "api:estimate", text).status_code == 200
    response = post_spec(api, "api:jobs", text, code=("train.py", b"print(1)\n"))
    assert response.status_code == 201, response.json()
    assert response.json()["name"] == EMOJI_NAME
    assert Job.objects.get().name == EMOJI_NAME


def test_a_json_body_with_an_emoji_in_the_name_is_accepted(api, dataset):
    spec_object = {"name": EMOJI_NAME, "recipe": "classifier", "train_dataset": "numbers", "gpus": 1, "span_hours": 1}
    response = api.post(reverse("api:jobs"), {"spec": spec_object}, content_type="application/json")
    assert response.status_code == 201, response.json()
    assert response.json()["name"] == EMOJI_NAME


@pytest.fixture
def signed_in(client, alice, rate):
    client.login(username="alice", password=PASSWORD)
    return client


def spec_file(text, name):
    handle = io.BytesIO(text.encode())
    handle.name = name
    return handle


def test_the_form_refuses_an_alias_bomb_spec_file(signed_in, bounded_memory):
    response = signed_in.post(reverse("jobs:new"), {"spec_file": spec_file(BOMB, "bomb.yaml")})
    assert response.status_code == 400
    assert any(e.startswith("bomb.yaml line 1: ") and "alias" in e for e in response.context["spec_errors"])
    assert not response.context["form"].initial


def test_the_form_fills_an_emoji_name_from_a_json_spec_file(signed_in):
    text = json.dumps({"name": EMOJI_NAME, "request": {"gpus": 1, "span_hours": 1}})
    response = signed_in.post(reverse("jobs:new"), {"spec_file": spec_file(text, "job.json")})
    assert response.status_code == 200, response.context["spec_errors"]
    assert response.context["form"].initial["name"] == EMOJI_NAME


# Every other JSON body, and JSON a job wrote ----------------------------------------------------

DEEP_BODY = '{"name": ' + "[" * 100000 + "]" * 100000 + "}"


@pytest.mark.parametrize("url", ["api:datasets", "api:dataset-register-s3", "api:token"])
def test_a_deeply_nested_body_on_any_endpoint_is_a_400_not_a_500(api, url, bounded_memory):
    # DRF's own JSONParser let the RecursionError through: a 500.
    response = api.post(reverse(url), DEEP_BODY, content_type="application/json")
    assert response.status_code == 400, response.content[:300]
    assert "nested too deeply" in response.json()["detail"]


def test_an_evaluation_file_nested_past_the_stack_is_shown_as_unreadable(signed_in, alice):
    from core.storage import get_storage

    job = make_job(alice, kind=Job.KIND_EVALUATE)
    body = b"[" * 200000 + b"]" * 200000  # what the job's own code wrote
    key = f"artifacts/{job.pk}/evaluation.json"
    get_storage().save(key, io.BytesIO(body))
    job.artifacts.create(name="evaluation.json", key=key, size=len(body), sha256="0" * 64)
    response = signed_in.get(reverse("jobs:comparison", args=[job.pk]))
    assert response.status_code == 200
    assert "cannot be read: nested too deeply" in response.json()["error"]
    assert signed_in.get(reverse("jobs:detail", args=[job.pk])).status_code == 200
