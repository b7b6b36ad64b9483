"""core.jsonfield: the project's JSON columns read by orjson, with json.loads' values."""

import json
import random
import struct

import pytest
from django.apps import apps
from django.core.management import call_command
from django.db import models

from core import jsonfield
from core.jsonfield import JSONField, loads
from tests.conftest import make_job


def same(text):
    """loads(text) is json.loads(text): equal, of the same types all the way down."""

    def shape(value):
        if isinstance(value, dict):
            return {k: shape(v) for k, v in value.items()}
        if isinstance(value, list):
            return [shape(v) for v in value]
        return (type(value), repr(value))

    return shape(loads(text)) == shape(json.loads(text))


@pytest.mark.nodb
def test_floats_read_as_json_reads_them():
    rng = random.Random(24)
    for _ in range(20_000):
        number = struct.unpack("d", struct.pack("Q", rng.getrandbits(64)))[0]
        if number != number or abs(number) == float("inf"):
            continue
        for text in (repr(number), f"{number:.17g}", f"{number:.6g}", f"{number:.3e}"):
            assert same(text), text
    for text in ("0.1", "-0.0", "1e-400", "5e-324", "1.7976931348623157e308", "[1.0, 2.50, 1E3]"):
        assert same(text), text
    # Long fractions (PostgreSQL's numeric division writes 20 digits and more) and long
    # mantissas with an exponent: floats in both, read by orjson.
    for _ in range(20_000):
        whole = str(rng.randint(0, 10**30))
        text = whole + rng.choice(["", "e5", "E-3"]) if len(whole) > 18 else whole + "." + str(rng.randint(0, 10**30)).zfill(25)
        if "e" in text.lower() or "." in text:
            assert same(text), text


@pytest.mark.nodb
def test_what_orjson_reads_otherwise_is_read_by_json():
    # Integers past 64 bits (orjson: a float), numbers past a float's range (orjson refuses
    # them, json reads an infinity), a lone surrogate (orjson refuses it).
    for text in (
        str(2**63),
        str(2**64),
        str(-(2**63) - 1),
        str(10**30),
        '{"seed": 123456789012345678901234}',
        "1e400",
        "-1E+400",
        "NaN",
        "[Infinity]",
        '["\\ud800"]',
    ):
        assert same(text), text
    assert loads(str(2**70)) == 2**70 and isinstance(loads(str(2**70)), int)
    for text in ('{"a": [1, {"b": null}], "c": "\\u00e9\\ud83d\\ude00", "d": true}', '"\\u2028"', "[]", "{}", '""', "null"):
        assert same(text), text


@pytest.mark.nodb
def test_a_text_that_is_not_json_comes_back_as_it_is_as_djangos_does():
    field, djangos = JSONField(), models.JSONField()
    for text in ("not json", "{'single': 'quotes'}", "[1, 2"):
        assert field.from_db_value(text, None, None) == djangos.from_db_value(text, None, None) == text
    assert field.from_db_value(None, None, None) is None


@pytest.mark.nodb
def test_every_json_column_of_the_project_is_read_so_and_migrations_see_djangos_field():
    ours = [f for m in apps.get_models() for f in m._meta.get_fields() if isinstance(f, models.JSONField) and m.__module__.split(".")[0] != "django"]
    assert len(ours) >= 18
    assert [f"{f.model.__name__}.{f.name}" for f in ours if not isinstance(f, JSONField)] == []
    assert all(f.deconstruct()[1] == "django.db.models.JSONField" for f in ours)


def test_the_models_need_no_migration(db):
    """The models and their migrations agree (a field class of the project's own changed none)."""
    call_command("makemigrations", "--check", "--dry-run", verbosity=0)


def test_values_come_back_from_the_database_as_json_reads_them(alice):
    config = {"lr": 0.1, "seed": 2**70, "steps": 10**6, "tiny": 5e-324, "name": "é😀", "nested": [{"a": None}, True]}
    job = make_job(alice, config=config, args=["--x", "1"])
    job.refresh_from_db()
    assert job.config == config and isinstance(job.config["seed"], int)
    assert job.args == ["--x", "1"]
    assert jsonfield.loads(json.dumps(config)) == config


@pytest.mark.nodb
def test_long_fractions_are_read_by_orjson_and_long_integers_by_json():
    from unittest import mock

    with mock.patch("core.jsonfield.json.loads", side_effect=AssertionError("read by json")):
        assert loads('{"loss": 0.333333333333333333333, "step": 12}') == {"loss": 1 / 3, "step": 12}
        assert loads("[1234567890123456789012e5]") == [1234567890123456789012e5]
        with pytest.raises(AssertionError):
            loads('{"seed": 12345678901234567890}')
