"""Settings come from the environment, and a bad value stops start-up with a message."""

import os
import subprocess
import sys

import pytest

from tests.system import ROOT


def check(tmp_path, **env):
    base = {"PATH": os.environ["PATH"], "E31_VAR_DIR": str(tmp_path)}
    code = (
        "import django, json; django.setup(); from django.conf import settings as s; "
        "print(json.dumps({'engine': s.DATABASES['default']['ENGINE'], 'layer': s.CHANNEL_LAYERS['default']['BACKEND'], "
        "'debug': s.DEBUG, 'hosts': s.ALLOWED_HOSTS, 'storage': str(s.STORAGE_DIR), 'live': s.E31_LIVE_MODE}))"
    )
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**base, "DJANGO_SETTINGS_MODULE": "e31web.settings", **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_embedded_default(tmp_path):
    import json

    result = check(tmp_path)
    assert result.returncode == 0, result.stderr
    values = json.loads(result.stdout)
    assert values["engine"] == "django.db.backends.sqlite3"
    assert values["layer"] == "channels.layers.InMemoryChannelLayer" and values["live"] == "db"
    assert values["debug"] is False
    assert values["storage"] == str(tmp_path / "storage")
    assert (tmp_path / "secret_key").stat().st_mode & 0o777 == 0o600


def test_production_settings(tmp_path):
    import json

    result = check(
        tmp_path,
        DATABASE_URL="postgres://u@db.internal:5432/e31",
        REDIS_URL="redis://cache:6379/0",
        SECRET_KEY="x" * 50,
        ALLOWED_HOSTS="e31.example,www.e31.example",
        E31_STORAGE_DIR=str(tmp_path / "elsewhere"),
        DEBUG="false",
    )
    assert result.returncode == 0, result.stderr
    values = json.loads(result.stdout)
    assert values["engine"] == "django.db.backends.postgresql"
    assert values["layer"] == "channels_redis.pubsub.RedisPubSubChannelLayer" and values["live"] == "redis"
    assert values["hosts"] == ["e31.example", "www.e31.example"]
    assert values["storage"] == str(tmp_path / "elsewhere")


@pytest.mark.parametrize(
    "name,value,message",
    [
        ("DEBUG", "maybe", "DEBUG='maybe' is not a boolean"),
        ("DATABASE_URL", "mysql://root@localhost/e31", "must start with one of"),
        ("DATABASE_URL", "postgres:///nohost", "has no host"),
        ("REDIS_URL", "http://localhost:6379", "REDIS_URL='http://localhost:6379' must start with one of: redis://, rediss://"),
        ("SECRET_KEY", "short", "SECRET_KEY must be at least 32 characters"),
        ("ALLOWED_HOSTS", "a.example,,b.example", "has an empty item"),
        ("E31_HEARTBEAT_SECONDS", "often", "is not a number"),
        ("E31_HEARTBEAT_SECONDS", "nan", "must be a finite number"),
        ("E31_MAX_UPLOAD_BYTES", "0", "must be at least 1"),
    ],
)
def test_a_bad_value_is_an_error_at_start_up(tmp_path, name, value, message):
    result = check(tmp_path, **{name: value})
    assert result.returncode != 0
    assert "ImproperlyConfigured" in result.stderr and message in result.stderr


def test_the_queue_channel_layer_is_still_there_on_request(tmp_path):
    import json

    result = check(tmp_path, REDIS_URL="redis://cache:6379/0", E31_CHANNEL_LAYER="core")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["layer"] == "channels_redis.core.RedisChannelLayer"
    result = check(tmp_path, REDIS_URL="redis://cache:6379/0", E31_CHANNEL_LAYER="kafka")
    assert result.returncode != 0 and "E31_CHANNEL_LAYER='kafka' must be core or pubsub" in result.stderr


def test_every_package_of_the_project_is_in_its_distribution():
    """A package left out of pyproject's list works from a checkout but is missing from an
    installed wheel (a GPU node's agent, say). Every folder at the top with an __init__.py, but the
    tests, is in it."""
    import tomllib
    from pathlib import Path

    from setuptools import find_packages

    root = Path(__file__).resolve().parent.parent
    config = tomllib.loads((root / "pyproject.toml").read_text())
    include = config["tool"]["setuptools"]["packages"]["find"]["include"]
    found = set(find_packages(str(root), include=include))
    tops = {p.parent.name for p in root.glob("*/__init__.py")} - {"tests", "bench", "examples"}
    assert tops <= found, f"not in the distribution: {sorted(tops - found)}"
