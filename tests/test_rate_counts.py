"""Sign-in failures and API calls are counted in Django's cache. On Redis every web process shares
one count, and counts made at the same moment by several processes are all kept (each process
with a client of its own: Django gives each thread its own cache client, so threads stand in for
processes here)."""

import threading
import uuid
from types import SimpleNamespace

import pytest
import redis

from accounts import signin
from core.throttling import TokenRateThrottle

# A database of its own on the tests' Redis (the live systems use 0, the channel layer tests 1).
REDIS_CACHE_URL = "redis://127.0.0.1:6379/3"


# Django's Redis cache, and the web tier's (which counts in one round trip).
BACKENDS = ["django.core.cache.backends.redis.RedisCache", "core.cache.SharedRedisCache"]


@pytest.fixture(params=BACKENDS, ids=["django", "shared"])
def redis_cache(settings, request):
    prefix = f"test-{uuid.uuid4().hex}"  # bin/test's passes run at once: keys of this test only
    settings.CACHES = {"default": {"BACKEND": request.param, "LOCATION": REDIS_CACHE_URL, "KEY_PREFIX": prefix}}
    yield
    server = redis.Redis.from_url(REDIS_CACHE_URL)
    for key in server.scan_iter(f"{prefix}:*"):
        server.delete(key)


def in_processes(count, step):
    """step(i) in count threads (each its own cache client) released at the same moment."""
    start, errors = threading.Barrier(count), []

    def run(i):
        start.wait()
        try:
            step(i)
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors


@pytest.fixture
def unaudited(monkeypatch):
    """Failures counted without their audit events: the log is not what is tested here (and
    SQLite takes one writer at a time)."""
    monkeypatch.setattr(signin.audit, "sign_in_failed", lambda *args, **kwargs: None)


def test_two_processes_share_the_sign_in_count(redis_cache, unaudited, settings):
    settings.E31_LOGIN_FAILURES = 3
    in_processes(1, lambda i: [signin.failed("alice", "10.0.0.1") for _ in range(2)])
    assert signin.retry_after("alice", "10.0.0.2") == 0
    in_processes(1, lambda i: signin.failed("alice", "10.0.0.2"))
    assert signin.retry_after("alice", "10.0.0.3") > 0


def test_sign_in_failures_made_at_once_by_several_processes_all_count(redis_cache, unaudited, settings):
    settings.E31_LOGIN_FAILURES = 80
    in_processes(4, lambda i: [signin.failed("alice", f"10.0.0.{i}") for _ in range(20)])
    assert signin.retry_after("alice", "10.9.9.9") > 0
    settings.E31_LOGIN_FAILURES = 81  # exactly 80 were counted
    assert signin.retry_after("alice", "10.9.9.9") == 0


def call_with(key):
    return SimpleNamespace(auth=SimpleNamespace(key=key), user=None, META={})


def test_api_calls_made_at_once_by_several_processes_all_count(redis_cache, settings):
    settings.E31_API_RATE = "80/min"
    request, answers = call_with("a-token"), []
    in_processes(4, lambda i: answers.extend(TokenRateThrottle().allow_request(request, None) for _ in range(20)))
    assert answers == [True] * 80
    throttle = TokenRateThrottle()
    assert not throttle.allow_request(request, None)
    assert 0 < throttle.wait() <= 60
    assert TokenRateThrottle().allow_request(call_with("another-token"), None)


def test_the_web_tiers_cache_counts_an_api_call_in_one_round_trip_with_its_window_expiring(settings, monkeypatch):
    from django.core.cache import cache

    prefix = f"test-{uuid.uuid4().hex}"
    settings.CACHES = {"default": {"BACKEND": "core.cache.SharedRedisCache", "LOCATION": REDIS_CACHE_URL, "KEY_PREFIX": prefix}}
    settings.E31_API_RATE = "5/min"
    request = call_with("a-token")
    assert TokenRateThrottle().allow_request(request, None)  # opens the window (and notes when)
    sent = []
    real = redis.connection.Connection.send_packed_command
    monkeypatch.setattr(redis.connection.Connection, "send_packed_command", lambda self, *a, **k: sent.append(1) or real(self, *a, **k))
    assert TokenRateThrottle().allow_request(request, None)
    assert len(sent) == 1  # Django's incr(): EXISTS, then INCRBY
    server = redis.Redis.from_url(REDIS_CACHE_URL)
    try:
        [key] = [k for k in server.scan_iter(f"{prefix}:*") if k.endswith(b":calls")]
        assert 0 < server.ttl(key) <= 60 and cache.get(key.decode().split(":", 2)[2]) == 2
    finally:
        for key in server.scan_iter(f"{prefix}:*"):
            server.delete(key)
