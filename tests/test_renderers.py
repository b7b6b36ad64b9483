"""The API's JSON renderer (core/renderers.py): DRF's bytes, written by orjson."""

import json
import uuid
from datetime import UTC, datetime, timedelta, timezone
from decimal import Decimal
from zoneinfo import ZoneInfo

import pytest
from django.urls import reverse
from django.utils.translation import gettext_lazy
from rest_framework.renderers import JSONRenderer

from core.renderers import FastJSONRenderer
from tests.test_api_shapes import answers, api, clock, world  # noqa: F401 - the fixtures

PAYLOADS = {
    "times": [
        datetime(2026, 11, 3, 10, 30, tzinfo=UTC),
        datetime(2026, 11, 3, 10, 30, 0, 123456, tzinfo=UTC),
        datetime(2026, 11, 3, 10, 30, 0, 120000, tzinfo=ZoneInfo("UTC")),
        datetime(2026, 11, 3, 10, 30),  # naive
        datetime(2026, 11, 3, 10, 30, tzinfo=ZoneInfo("Asia/Kolkata")),
        datetime(2026, 11, 3, 10, 30, tzinfo=timezone(timedelta(hours=-7))),
        datetime(2026, 11, 3).date(),
    ],
    "plain": {"id": uuid.UUID("12345678-1234-5678-1234-567812345678"), "cost": Decimal("12.3400"), "n": 3, "f": 0.1, "none": None, "t": True},
    "text": ["plain", "ünïcödé ✓", "line\u2028separator\u2029", 'quote " and \\ and \n', gettext_lazy("Log in")],
    "keys": {1: "int key", "x": {"nested": [1, [2, [3, {}]]]}},
    "tuple": ("a", 1),
}


@pytest.mark.parametrize("name", sorted(PAYLOADS))
def test_the_bytes_are_drfs(name):
    data = PAYLOADS[name]
    assert FastJSONRenderer().render(data) == JSONRenderer().render(data)


def test_a_float_reads_back_as_the_same_number():
    floats = [1e-05, 1e20, 1.5, -0.0, 123456789.125, 0.1 + 0.2, 2.5e-300]
    fast = FastJSONRenderer().render(floats)
    assert json.loads(fast) == json.loads(JSONRenderer().render(floats)) == floats
    assert fast.startswith(b"[0.00001,1e+20,1.5,-0.0,")  # DRF writes 1e-05


def test_what_orjson_refuses_is_written_by_drf():
    huge = {"n": 2**70}
    assert FastJSONRenderer().render(huge) == JSONRenderer().render(huge) == b'{"n":1180591620717411303424}'


def test_an_indented_answer_is_drfs():
    data = {"a": [1, {"b": datetime(2026, 11, 3, tzinfo=UTC)}]}
    fast = FastJSONRenderer().render(data, "application/json; indent=4", {})
    assert fast == JSONRenderer().render(data, "application/json; indent=4", {}) and b'\n    "a"' in fast


def test_not_a_number_is_null_not_a_failure():
    assert FastJSONRenderer().render({"loss": float("nan")}) == b'{"loss":null}'
    with pytest.raises(ValueError, match="not JSON compliant"):
        JSONRenderer().render({"loss": float("nan")})


def test_the_api_writes_its_answers_with_it_byte_for_byte_as_drf_would(api, world):  # noqa: F811
    response = api.get(reverse("api:jobs"))
    assert type(response.accepted_renderer) is FastJSONRenderer
    assert response.content == JSONRenderer().render(response.data)
    # Every answer of the varied world: jobs of every state and shape, datasets, versions, uploads.
    responses, get = [], api.get
    api.get = lambda *args, **kwargs: responses.append(get(*args, **kwargs)) or responses[-1]
    assert len(answers(api, world)) > 20
    for response in responses:
        assert response.content == JSONRenderer().render(response.data), response.request["PATH_INFO"]
