"""An open job websocket ends with its access: a member removed from the team (or moved to
another), an API token revoked. The socket is closed (4403) within 5 s, by the message sent where
the membership or token ends (Redis layer) or by the consumer's own periodic check (which also
catches a change made in a process the message cannot reach)."""

import asyncio

import pytest
from asgiref.sync import async_to_sync, sync_to_async
from rest_framework.authtoken.models import Token

from accounts.models import Membership, Team
from e31web.settings import layer_hosts
from jobs import consumers
from tests.conftest import make_job
from tests.test_consumer import communicator, live_mode, logs, receive_until, stop_relay  # noqa: F401 (live_mode: a fixture, used by name)

pytestmark = pytest.mark.django_db(transaction=True)

# A functional bound, not a performance one: access ends within 5 s (plus a margin for the test).
CLOSE_WITHIN = 6.0


async def close_code(comm, timeout=CLOSE_WITHIN):
    """The code the server closes the socket with (events before it are skipped); a timeout
    (asyncio.TimeoutError) if it stays open."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        message = await comm.receive_output(timeout=max(0.01, deadline - loop.time()))
        if message["type"] == "websocket.close":
            return message.get("code")


def watch(job, key=None, headers=None, ended=None):
    """Connect to the job's socket, read its backlog, end the access (ended, sync code) and
    return the close code and the texts of the log lines seen."""

    async def scenario():
        comm = communicator(job, key, headers=headers)
        connected, _ = await comm.connect()
        assert connected
        await receive_until(comm, 1)
        await sync_to_async(ended)()
        await sync_to_async(logs)(job, ["after the access ended"])
        try:
            return await close_code(comm)
        finally:
            await comm.disconnect()

    try:
        return async_to_sync(scenario)()
    finally:
        stop_relay()


@pytest.mark.usefixtures("live_mode")
def test_a_removed_members_socket_is_closed(alice, bob, rate):
    job = make_job(alice)
    key = Token.objects.create(user=bob).key
    assert watch(job, key, ended=lambda: Membership.objects.get(user=bob).delete()) == 4403


@pytest.mark.usefixtures("live_mode")
def test_a_member_moved_to_another_team_is_closed(alice, bob, rate):
    job = make_job(alice)
    key = Token.objects.create(user=bob).key
    other = Team.objects.create(name="Team C")

    def move():
        membership = Membership.objects.get(user=bob)
        membership.team = other
        membership.save()

    assert watch(job, key, ended=move) == 4403


@pytest.mark.usefixtures("live_mode")
def test_a_revoked_tokens_socket_is_closed(alice, rate):
    job = make_job(alice)
    token = Token.objects.create(user=alice)
    assert watch(job, token.key, ended=token.delete) == 4403


@pytest.mark.usefixtures("live_mode")
def test_a_session_socket_is_closed_when_the_membership_ends(alice, bob, rate, client):
    job = make_job(alice)
    client.force_login(bob)
    headers = [(b"cookie", f"sessionid={client.cookies['sessionid'].value}".encode()), (b"origin", b"http://localhost"), (b"host", b"localhost")]
    assert watch(job, headers=headers, ended=lambda: Membership.objects.get(user=bob).delete()) == 4403


@pytest.mark.usefixtures("live_mode")
def test_a_deactivated_users_socket_is_closed(alice, bob, rate):
    job = make_job(alice)
    key = Token.objects.create(user=bob).key

    def deactivate():
        bob.is_active = False
        bob.save()

    assert watch(job, key, ended=deactivate) == 4403


@pytest.mark.parametrize("end", ["membership", "token in the admin"])
def test_on_redis_the_end_of_access_is_told_not_waited_for(settings, alice, bob, rate, monkeypatch, end):
    """With the periodic check far off, the message sent where the membership ends (or the
    token is revoked: the admin deletes it through DRF's proxy model) closes the socket."""
    from channels.layers import channel_layers
    from rest_framework.authtoken.models import TokenProxy

    settings.E31_LIVE_MODE = "redis"
    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels_redis.core.RedisChannelLayer", "CONFIG": {"hosts": layer_hosts("redis://127.0.0.1:6379/1")}}}
    channel_layers.backends = {}
    monkeypatch.setattr(consumers, "ACCESS_CHECK_SECONDS", 600.0)
    job = make_job(alice)
    key = Token.objects.create(user=bob).key
    ended = {
        "membership": lambda: Membership.objects.get(user=bob).delete(),
        "token in the admin": lambda: TokenProxy.objects.get(user=bob).delete(),
    }[end]
    try:
        assert watch(job, key, ended=ended) == 4403
    finally:
        channel_layers.backends = {}


@pytest.mark.usefixtures("live_mode")
def test_a_member_who_stays_keeps_the_stream(alice, bob, rate, monkeypatch):
    monkeypatch.setattr(consumers, "ACCESS_CHECK_SECONDS", 0.1)
    job = make_job(alice)
    key = Token.objects.create(user=bob).key

    async def scenario():
        comm = communicator(job, key)
        assert (await comm.connect())[0]
        await receive_until(comm, 1)
        # Another user's access ending, and several periodic checks, leave bob's socket open.
        await sync_to_async(lambda: Token.objects.create(user=alice).delete())()
        await asyncio.sleep(0.5)
        last = await sync_to_async(logs)(job, ["still here"])
        events = await receive_until(comm, last)
        await comm.disconnect()
        return events

    try:
        events = async_to_sync(scenario)()
    finally:
        stop_relay()
    assert [e["text"] for e in events] == ["still here"]
