"""The fan-out of a job's events to many sockets in one web process (jobs/live.py Hub and Tail):
each announcement is read once for all of them, and every socket still gets every event once, in
order, whether it joined before the output, behind it (a backlog) or across a gap."""

import asyncio

import pytest
from asgiref.sync import async_to_sync, sync_to_async
from rest_framework.authtoken.models import Token

from jobs import consumers, live
from tests.conftest import make_job
from tests.test_consumer import communicator, live_mode, logs, receive_until, stop_relay  # noqa: F401 (live_mode: a fixture, used by name)

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def reads(monkeypatch):
    """The tails' reads, counted: [(job id, after seq)]."""
    made = []
    read = live.events_after

    def counted(job_id, after, latest=None, until=None):
        made.append((job_id, after))
        return read(job_id, after, latest, until)

    monkeypatch.setattr(live, "events_after", counted)
    return made


def texts(events):
    return [e["text"] for e in events if e["kind"] == "log"]


@pytest.mark.usefixtures("live_mode")
def test_many_sockets_get_every_line_in_order_from_one_read_per_announcement(alice, rate, reads):
    job = make_job(alice)
    key = Token.objects.create(user=alice).key
    sockets = 5

    async def scenario():
        comms = [communicator(job, key) for _ in range(sockets)]
        for comm in comms:
            assert (await comm.connect())[0]
            await receive_until(comm, 1)
        seen = [[] for _ in comms]
        reads.clear()  # the backlogs were read by each socket, as they must be
        for batch in range(3):
            last = await sync_to_async(logs)(job, [f"line {batch}.{i}" for i in range(4)])
            for comm, events in zip(comms, seen, strict=True):
                events += await receive_until(comm, last)
        for comm in comms:
            await comm.disconnect()
        return seen

    try:
        seen = async_to_sync(scenario)()
    finally:
        stop_relay()
    wanted = [f"line {batch}.{i}" for batch in range(3) for i in range(4)]
    for events in seen:
        assert texts(events) == wanted
        assert [e["seq"] for e in events] == list(range(2, 14))
    # One read per announcement for the five sockets (a catch-up round or a relay step that
    # found the rows already read adds nothing), never one per socket.
    assert 3 <= len(reads) < 3 * sockets


@pytest.mark.usefixtures("live_mode")
def test_a_socket_that_joins_a_running_tail_gets_its_backlog_then_the_frames(alice, rate):
    job = make_job(alice)
    key = Token.objects.create(user=alice).key

    async def scenario():
        first = communicator(job, key)
        assert (await first.connect())[0]
        await receive_until(first, 1)
        last = await sync_to_async(logs)(job, ["a", "b"])
        await receive_until(first, last)
        # The second joins after seq 1 while the tail stands at 3: its backlog, then the frames.
        second = communicator(job, key, after=1)
        assert (await second.connect())[0]
        events = await receive_until(second, last)
        last = await sync_to_async(logs)(job, ["c"])
        events += await receive_until(second, last)
        await first.disconnect()
        await second.disconnect()
        return events

    try:
        events = async_to_sync(scenario)()
    finally:
        stop_relay()
    assert [e["seq"] for e in events] == [2, 3, 4]
    assert texts(events) == ["a", "b", "c"]


@pytest.mark.usefixtures("live_mode")
def test_a_socket_that_missed_a_frame_reads_across_the_gap(alice, rate):
    """A frame that does not follow on from what the socket sent (here: one the socket was made
    to skip) is not sent as it is: the socket reads the gap from the database, once, in order."""
    job = make_job(alice)
    key = Token.objects.create(user=alice).key
    skipped = []

    async def scenario():
        comm = communicator(job, key)
        assert (await comm.connect())[0]
        await receive_until(comm, 1)
        socket = next(iter(live.hub.sockets()))
        push = socket.push

        async def lossy(frame, first, last):
            if not skipped:  # the first frame goes missing
                skipped.append((first, last))
                return
            await push(frame, first, last)

        socket.push = lossy
        await sync_to_async(logs)(job, ["lost", "frame"])
        for _ in range(200):  # until the frame went missing (the relay announces it in its time)
            if skipped:
                break
            await asyncio.sleep(0.05)
        last = await sync_to_async(logs)(job, ["next"])
        events = await receive_until(comm, last)
        await comm.disconnect()
        return events

    try:
        events = async_to_sync(scenario)()
    finally:
        stop_relay()
    assert skipped
    assert [e["seq"] for e in events] == [2, 3, 4]
    assert texts(events) == ["lost", "frame", "next"]


def test_the_access_check_of_all_sockets_takes_three_queries(alice, bob, charlie, django_assert_num_queries):
    """One round for every socket of the process: members of the job's team with their own
    token (or none) stay; an outsider, a token of someone else's and a deactivated member go."""
    job = make_job(alice)
    alice_key, bob_key = Token.objects.create(user=alice).key, Token.objects.create(user=bob).key
    keys = {
        (job.pk, alice.pk, alice_key),
        (job.pk, alice.pk, None),
        (job.pk, bob.pk, bob_key),
        (job.pk, alice.pk, bob_key),  # a token that is not the user's
        (job.pk, charlie.pk, None),  # not on the team
    }
    with django_assert_num_queries(3):
        allowed = consumers.allowed(keys)
    assert allowed == {(job.pk, alice.pk, alice_key), (job.pk, alice.pk, None), (job.pk, bob.pk, bob_key)}
    bob.is_active = False
    bob.save()
    assert consumers.allowed(keys) == {(job.pk, alice.pk, alice_key), (job.pk, alice.pk, None)}


def test_announcements_from_sync_code_share_one_loop(settings):
    """The runner's announcements go out on the process's one announcer loop, not a loop (and a
    Redis connection) each."""
    settings.E31_LIVE_MODE = "redis"
    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels_redis.core.RedisChannelLayer", "CONFIG": {"hosts": ["redis://127.0.0.1:6379/1"]}}}
    from channels.layers import channel_layers

    channel_layers.backends = {}
    try:
        live.announce("job-a", 1)
        loop = live.announcer.loop
        live.announce("job-a", 2)
        assert live.announcer.loop is loop and loop.is_running()
    finally:
        channel_layers.backends = {}
