"""The job websocket against the real ASGI app: backlog, live events, reconnects, scoping,
in the embedded default (database relay) and on the Redis channel layer."""

import pytest
from asgiref.sync import async_to_sync, sync_to_async
from channels.layers import channel_layers
from channels.testing import WebsocketCommunicator
from django.utils import timezone
from rest_framework.authtoken.models import Token

from e31web.asgi import application
from e31web.settings import layer_hosts
from jobs import live
from jobs.models import JobEvent
from tests.conftest import make_job

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(params=["db", "redis", "redis-pubsub"])
def live_mode(request, settings):
    settings.E31_LIVE_MODE = request.param.split("-")[0]
    if request.param == "redis":
        settings.CHANNEL_LAYERS = {
            "default": {"BACKEND": "channels_redis.core.RedisChannelLayer", "CONFIG": {"hosts": layer_hosts("redis://127.0.0.1:6379/1")}}
        }
    elif request.param == "redis-pubsub":  # the default with Redis (E31_CHANNEL_LAYER)
        settings.CHANNEL_LAYERS = {
            "default": {"BACKEND": "channels_redis.pubsub.RedisPubSubChannelLayer", "CONFIG": {"hosts": layer_hosts("redis://127.0.0.1:6379/1")}}
        }
    else:
        settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
    channel_layers.backends = {}
    live.relay.known.clear()
    yield request.param
    channel_layers.backends = {}


def logs(job, texts):
    return JobEvent.append(job.pk, [JobEvent(kind="log", at=timezone.now(), stream="stdout", text=t) for t in texts])


def communicator(job, key=None, after=0, headers=None):
    headers = list(headers or [])
    if key:
        headers.append((b"authorization", f"Token {key}".encode()))
    return WebsocketCommunicator(application, f"/ws/jobs/{job.pk}/?after={after}", headers=headers)


async def receive_until(comm, last_seq, timeout=5):
    events = []
    while not events or events[-1]["seq"] < last_seq:
        message = await comm.receive_json_from(timeout=timeout)
        assert message["type"] == "events"
        events.extend(message["events"])
    return events


def stop_relay():
    if live.relay.task is not None:
        live.relay.task.cancel()
        live.relay.task = None


def one_socket_reads(job, key, last_seq):
    """The events one socket gets, connected from the start, up to last_seq."""

    async def scenario():
        comm = communicator(job, key)
        assert (await comm.connect())[0]
        events = await receive_until(comm, last_seq)
        await comm.disconnect()
        return events

    try:
        return async_to_sync(scenario)()
    finally:
        stop_relay()


def test_the_backlog_then_live_events(live_mode, alice, rate):
    job = make_job(alice)
    logs(job, ["one", "two"])
    key = Token.objects.create(user=alice).key

    async def scenario():
        comm = communicator(job, key)
        connected, _ = await comm.connect()
        assert connected
        backlog = await receive_until(comm, 3)
        assert [e.get("text") for e in backlog] == [None, "one", "two"]  # the "queued" state event first
        last = await sync_to_async(logs)(job, ["three", "four"])
        fresh = await receive_until(comm, last)
        assert [e["text"] for e in fresh] == ["three", "four"]
        await comm.disconnect()

    try:
        async_to_sync(scenario)()
    finally:
        stop_relay()


def test_on_redis_a_socket_catches_up_on_events_whose_announcement_was_lost(settings, alice, rate, monkeypatch):
    from jobs import consumers

    settings.E31_LIVE_MODE = "redis"
    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels_redis.core.RedisChannelLayer", "CONFIG": {"hosts": layer_hosts("redis://127.0.0.1:6379/1")}}}
    channel_layers.backends = {}
    monkeypatch.setattr(consumers, "CATCH_UP_SECONDS", 0.3)
    job = make_job(alice)
    key = Token.objects.create(user=alice).key

    async def scenario():
        comm = communicator(job, key)
        connected, _ = await comm.connect()
        assert connected
        await receive_until(comm, 1)
        with monkeypatch.context() as lost:  # Redis away: no announcement reaches anyone
            lost.setattr(live, "announce", lambda job_id, last_seq, events=None: None)
            last = await sync_to_async(logs)(job, ["during", "the outage"])
        events = await receive_until(comm, last)
        assert [e["text"] for e in events] == ["during", "the outage"]  # each once, in order
        await comm.disconnect()

    try:
        async_to_sync(scenario)()
    finally:
        channel_layers.backends = {}


def test_a_reconnect_gets_what_it_missed_once_in_order(live_mode, alice, rate):
    job = make_job(alice)
    logs(job, [f"line {i}" for i in range(10)])
    key = Token.objects.create(user=alice).key

    async def scenario():
        comm = communicator(job, key)
        assert (await comm.connect())[0]
        seen = await receive_until(comm, 11)
        await comm.disconnect()
        # While away, more lines arrive; come back after the last one seen.
        await sync_to_async(logs)(job, [f"line {i}" for i in range(10, 15)])
        comm = communicator(job, key, after=seen[-1]["seq"])
        assert (await comm.connect())[0]
        seen += await receive_until(comm, 16)
        await comm.disconnect()
        return seen

    try:
        seen = async_to_sync(scenario)()
    finally:
        stop_relay()
    assert [e["seq"] for e in seen] == list(range(1, 17))
    assert [e["text"] for e in seen if e["kind"] == "log"] == [f"line {i}" for i in range(15)]


def test_a_backlog_skips_old_meter_ticks(live_mode, alice, rate):
    job = make_job(alice)
    for held in range(3):
        job.record("meter", data={"held_seconds": held, "amount": "0", "running": True})
    logs(job, ["after"])
    events = one_socket_reads(job, Token.objects.create(user=alice).key, 5)
    assert [(e["kind"], e.get("held_seconds")) for e in events] == [("state", None), ("meter", 2), ("log", None)]


@pytest.mark.parametrize("persona", ["charlie", None])
def test_outsiders_and_anonymous_users_are_refused(live_mode, alice, charlie, rate, persona):
    job = make_job(alice)
    key = Token.objects.create(user=charlie).key if persona else None

    async def scenario():
        comm = communicator(job, key, headers=[(b"origin", b"http://localhost")])
        connected, code = await comm.connect()
        assert not connected and code == 4404
        await comm.disconnect()

    async_to_sync(scenario)()


def test_a_bad_token_is_refused(live_mode, alice, rate):
    job = make_job(alice)

    async def scenario():
        connected, _ = await communicator(job, "not-a-token").connect()
        assert not connected

    async_to_sync(scenario)()


def test_a_session_socket_must_come_from_our_origin(live_mode, alice, rate, client):
    job = make_job(alice)
    client.force_login(alice)
    cookie = f"sessionid={client.cookies['sessionid'].value}".encode()

    async def scenario():
        ours = communicator(job, headers=[(b"cookie", cookie), (b"origin", b"http://localhost"), (b"host", b"localhost")])
        assert (await ours.connect())[0]
        await ours.disconnect()
        theirs = communicator(job, headers=[(b"cookie", cookie), (b"origin", b"http://evil.example"), (b"host", b"localhost")])
        assert not (await theirs.connect())[0]

    try:
        async_to_sync(scenario)()
    finally:
        stop_relay()


def test_the_relay_announces_watched_jobs_once_per_change(settings, alice, rate):
    """One query per step for all watched jobs; a job is announced only when its events move
    on, and jobs nobody watches cost nothing."""
    settings.E31_LIVE_MODE = "db"
    watched, unwatched = make_job(alice, name="watched"), make_job(alice, name="unwatched")
    sent = []

    class Layer:
        async def group_send(self, group, message):
            sent.append((group, message["last_seq"]))

    relay = live.Relay()
    relay.ensure_started = lambda: None  # steps are driven by hand here

    async def scenario():
        await relay.step(Layer())  # nobody watches: no query, nothing sent
        relay.watch(watched.pk)
        await relay.step(Layer())
        await sync_to_async(logs)(watched, ["a", "b"])
        await sync_to_async(logs)(unwatched, ["c"])
        await relay.step(Layer())
        await relay.step(Layer())  # nothing new: nothing sent
        relay.unwatch(watched.pk)
        await sync_to_async(logs)(watched, ["d"])
        await relay.step(Layer())

    async_to_sync(scenario)()
    assert sent == [(live.group_name(watched.pk), 1), (live.group_name(watched.pk), 3)]


def test_a_submitted_jobs_first_event_is_not_announced_and_a_socket_still_reads_it(live_mode, alice, rate, client):
    """No one can watch a job before it exists, so a submission announces nothing (issue 24);
    a socket opened afterwards reads the "submitted" event from what is stored, then new ones."""
    import io
    import json
    from unittest import mock

    from django.urls import reverse

    from jobs.models import Job

    key = Token.objects.create(user=alice).key
    code, data = io.BytesIO(b"print(1)\n"), io.BytesIO(b"x,y\n1,2\n")
    code.name, data.name = "train.py", "train.csv"
    with mock.patch.object(live, "announce", wraps=live.announce) as announced:
        made = client.post(
            reverse("api:jobs"),
            {"spec": json.dumps({"name": "fresh", "gpus": 1, "span_hours": 1}), "code": code, "data": data},
            HTTP_AUTHORIZATION=f"Token {key}",
        )
    assert made.status_code == 201, made.json()
    assert announced.call_count == 0
    job = Job.objects.get(pk=made.json()["id"])

    async def scenario():
        comm = communicator(job, key)
        assert (await comm.connect())[0]
        [first] = await receive_until(comm, 1)
        assert (first["seq"], first["kind"], first["state"], first["reason"]) == (1, "state", "queued", "submitted")
        last = await sync_to_async(logs)(job, ["one"])
        assert [e["text"] for e in await receive_until(comm, last)] == ["one"]
        await comm.disconnect()

    try:
        async_to_sync(scenario)()
    finally:
        stop_relay()
