"""The fan-out of a job's events to many sockets in one web process (jobs/live.py Hub and Tail):
each announcement is read once for all of them, and every socket still gets every event once, in
order, whether it joined before the output, behind it (a backlog) or across a gap."""

import asyncio
import threading
import uuid
from datetime import datetime
from unittest import mock
from zoneinfo import ZoneInfo

import pytest
from asgiref.sync import async_to_sync, sync_to_async
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from rest_framework.authtoken.models import Token

from e31web.settings import layer_hosts
from jobs import consumers, live
from jobs.models import JobEvent
from tests.conftest import make_job
from tests.test_consumer import communicator, live_mode, logs, one_socket_reads, receive_until, stop_relay  # noqa: F401 (live_mode: a fixture, used by name)

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


BATCHES = [[f"line {batch}.{i}" for i in range(4)] for batch in range(3)]


def batches_to_sockets(job, write, sockets, reads):
    """BATCHES written one after the other by write(job, texts) while `sockets` sockets watch
    the job from its first event: the events each socket got after its backlog, with `reads`
    cleared once the backlogs are in (each socket reads its own, as it must)."""
    key = Token.objects.create(user=job.created_by).key

    async def scenario():
        comms = [communicator(job, key) for _ in range(sockets)]
        for comm in comms:
            assert (await comm.connect())[0]
            await receive_until(comm, 1)
        reads.clear()
        seen = [[] for _ in comms]
        for texts_ in BATCHES:
            last = await sync_to_async(write)(job, texts_)
            for comm, events in zip(comms, seen, strict=True):
                events += await receive_until(comm, last)
        for comm in comms:
            await comm.disconnect()
        return seen

    try:
        seen = async_to_sync(scenario)()
    finally:
        stop_relay()
    for events in seen:
        assert texts(events) == [text for batch in BATCHES for text in batch]
        assert [e["seq"] for e in events] == list(range(2, 14))
    return seen


@pytest.mark.usefixtures("live_mode")
def test_many_sockets_get_every_line_in_order_from_one_read_per_announcement(alice, rate, reads):
    sockets = 5
    batches_to_sockets(make_job(alice), logs, sockets, reads)
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
        # The socket's backlog read is over (its sender may still read after the line above
        # arrived, and would then send the new lines itself, with no frame to lose): the tail
        # begins only once it is.
        for _ in range(100):
            if socket.tail.seq is not None and not socket.sending.locked():
                break
            await asyncio.sleep(0.05)
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
        assert skipped == [(2, 3)]
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
    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels_redis.core.RedisChannelLayer", "CONFIG": {"hosts": layer_hosts("redis://127.0.0.1:6379/1")}}}
    from channels.layers import channel_layers

    channel_layers.backends = {}
    try:
        live.announce("job-a", 1)
        loop = live.announcer.loop
        live.announce("job-a", 2)
        assert live.announcer.loop is loop and loop.is_running()
    finally:
        channel_layers.backends = {}


def lines(job, texts, rank=None):
    """Log lines stored as the runner stores them (JobEvent.append_lines, which announces them
    with the lines themselves)."""
    at = timezone.now()
    return JobEvent.append_lines(job.pk, [("stdout", at, text, rank) for text in texts])


@pytest.mark.parametrize("live_mode", ["redis-pubsub", "redis"], indirect=True)
def test_carried_lines_are_the_rows_as_a_read_sends_them(live_mode, alice):
    """What an announcement carries is what reading the rows back would send: the same frame."""
    job = make_job(alice)
    carried = []
    announce = live.announce

    def kept(job_id, last_seq, events=None):
        carried.append(events)
        announce(job_id, last_seq, events)

    berlin = datetime.now(ZoneInfo("Europe/Berlin")).replace(microsecond=123456)
    rows = [("stdout", berlin, "a line", None), ("stderr", berlin, "ünïcode \t tab", 3), ("stdout", berlin.replace(microsecond=0), "", 0)]
    with mock.patch.object(live, "announce", kept):
        last = JobEvent.append_lines(job.pk, rows)
    assert len(carried) == 1 and carried[0] is not None
    assert live.frame(carried[0]) == live.frame(live.events_after(job.pk, last - len(rows)))
    assert [e["seq"] for e in carried[0]] == list(range(last - 2, last + 1))


@pytest.mark.parametrize("live_mode", ["redis-pubsub"], indirect=True)
def test_lines_that_follow_on_are_handed_on_without_a_read(live_mode, alice, reads, monkeypatch):
    """The steady state of a running job: each batch of lines goes out as its announcement
    carried it, to every socket, with no read of the rows."""
    monkeypatch.setattr(consumers, "CATCH_UP_SECONDS", 60.0)  # no catch-up round reads meanwhile
    batches_to_sockets(make_job(alice), lines, 3, reads)
    assert reads == []


@pytest.mark.parametrize("live_mode", ["redis-pubsub"], indirect=True)
def test_carried_lines_after_a_lost_announcement_are_read_from_the_rows(live_mode, alice, reads, monkeypatch):
    """An announcement lost on the way: the next one's lines do not follow on from what the
    tail handed on, so it reads the rows across the gap, once, and every socket gets them all."""
    monkeypatch.setattr(consumers, "CATCH_UP_SECONDS", 60.0)
    job = make_job(alice)
    key = Token.objects.create(user=alice).key
    announce, lost = live.announce, []

    def lossy(job_id, last_seq, events=None):
        if not lost:
            lost.append(last_seq)
            return
        announce(job_id, last_seq, events)

    async def scenario():
        comms = [communicator(job, key) for _ in range(2)]
        for comm in comms:
            assert (await comm.connect())[0]
            await receive_until(comm, 1)
        reads.clear()
        with mock.patch.object(live, "announce", lossy):
            await sync_to_async(lines)(job, ["lost", "announcement"])
            last = await sync_to_async(lines)(job, ["carried"])
        seen = [await receive_until(comm, last) for comm in comms]
        assert live.hub.tails[str(job.pk)].offered == {}  # the carried lines, read meanwhile, are not kept
        for comm in comms:
            await comm.disconnect()
        return seen

    seen = async_to_sync(scenario)()
    assert lost == [3]
    for events in seen:
        assert texts(events) == ["lost", "announcement", "carried"]
        assert [e["seq"] for e in events] == [2, 3, 4]
    assert reads == [(job.pk, 1)]


def test_storing_lines_takes_their_numbers_in_one_statement(alice):
    """The runner's hot path. On PostgreSQL a store of a few lines is one statement in all: the
    counter's UPDATE (which returns it) and the rows' INSERT, no transaction around them (four
    round trips were: BEGIN, the UPDATE, a COPY, COMMIT). Elsewhere, and for a long store, one
    statement takes the numbers (an UPDATE that returns the counter, not an UPDATE then a SELECT)
    and one stores the rows."""
    from jobs.models import ONE_STATEMENT_LINES

    job = make_job(alice)
    first = JobEvent.append_lines(job.pk, [("stdout", timezone.now(), "before")])
    with CaptureQueriesContext(connection) as queries:
        last = JobEvent.append_lines(job.pk, [("stdout", timezone.now(), text, rank) for text, rank in (("a", None), ("b 'quoted' \\ ü", 1), ("", 0))])
    sql = [q["sql"] for q in queries.captured_queries]
    if connection.vendor == "postgresql":
        assert len(sql) == 1 and sql[0].startswith("WITH counter AS (UPDATE") and "INSERT INTO" in sql[0], sql
    else:
        statements = [q for q in sql if q.split()[0] not in ("BEGIN", "COMMIT", "SAVEPOINT", "RELEASE")]
        assert len(statements) == 2 and statements[0].startswith("UPDATE") and "RETURNING" in statements[0], statements
    assert last == first + 3
    job.refresh_from_db()
    assert job.last_seq == last
    assert list(JobEvent.objects.filter(job=job, seq__gt=first).order_by("seq").values_list("seq", "kind", "stream", "text", "rank")) == [
        (first + 1, "log", "stdout", "a", None),
        (first + 2, "log", "stdout", "b 'quoted' \\ ü", 1),
        (first + 3, "log", "stdout", "", 0),
    ]
    # A long store: the numbers in one statement, the rows by COPY (past Django's query log).
    many = [("stderr", timezone.now(), f"line {n}") for n in range(ONE_STATEMENT_LINES + 1)]
    with CaptureQueriesContext(connection) as queries:
        end = JobEvent.append_lines(job.pk, many)
    counter = [q["sql"] for q in queries.captured_queries if 'jobs_job"' in q["sql"]]
    assert len(counter) == 1 and counter[0].startswith("UPDATE") and "RETURNING" in counter[0], counter
    assert end == last + len(many) and JobEvent.objects.filter(job=job, seq__gt=last, stream="stderr").count() == len(many)
    for size in (1, ONE_STATEMENT_LINES + 1):
        with pytest.raises(type(job).DoesNotExist):
            JobEvent.append_lines(uuid.uuid4(), [("stdout", timezone.now(), "nobody's")] * size)
    assert not JobEvent.objects.filter(text="nobody's").exists()


@pytest.mark.usefixtures("live_mode")
def test_a_socket_reads_its_backlog_on_the_hubs_thread(alice, monkeypatch):
    """A socket's own reads share the hub's one thread and kept connection with the tails': on
    threads of their own, a few sockets' backlogs at once starve the event loop of the GIL."""
    job = make_job(alice)
    logs(job, [f"line {i}" for i in range(5)])
    key = Token.objects.create(user=alice).key
    threads = []
    read = live.events_after

    def where(*args):
        threads.append(threading.current_thread().name)
        return read(*args)

    monkeypatch.setattr(live, "events_after", where)
    events = one_socket_reads(job, key, 6)
    assert texts(events) == [f"line {i}" for i in range(5)]
    assert threads and all(name.startswith("live-reads") for name in threads), threads
