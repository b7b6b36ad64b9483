"""Live events: every event is a row first (JobEvent), then announced to the job's group.

An announcement says "job X has events up to seq N"; a consumer reads the rows themselves from
the database after the last seq it sent. So a missed or repeated announcement costs a query,
never a lost or repeated line. Log lines (the runner's hot path, JobEvent.append_lines) are
announced with the lines themselves, as the websocket sends them: a web process whose tail
stands just before them hands them on without reading them back, and one that stands elsewhere
(a gap: an announcement lost, or its tail starting) reads the rows as before. Measured by
bench/stream_load.py (500 watchers, 50 jobs, 100 lines a second each, one daphne worker, all on
2 busy cores): with a read per announcement, 500 a second on the tails' one thread, delivery's
p50 was 149 ms and its p99 464 ms; with the lines carried, 55 ms and (the other changes of the
same day counted: fewer statements per store, the sockets' own reads on the hub's thread and
their times as text) a p50 of 5-9 ms and a p99 of 147-225 ms.

Two ways to announce, chosen by settings.E31_LIVE_MODE:
- "redis": the writer (runner, scheduler, web) group_sends over the Redis channel layer after
  its transaction commits.
- "db": the embedded default. Channels' in-memory layer lives in one process and is not
  thread-safe, so writers in other processes cannot reach it. Instead each web process runs one
  relay task that reads the sequence counters of the jobs its websockets watch (one query every
  quarter second per process, however many watchers) and announces those that moved on. The
  counter commits with its events, so whatever it shows is readable.

Either way the announcement reaches each web process once per job, not once per socket: the
process's Hub is the one member of the job's group there, and its Tail for the job reads the new
rows once, encodes them once and hands the same frame to every socket of the process that
watches the job. Measured by bench/stream_load.py (100 sockets over 10 jobs printing 100 lines
a second each, one daphne worker): a read per socket per announcement, each through
database_sync_to_async (which opens and closes a PostgreSQL connection per call), put delivery at
a p99 of 2.3 s; one read per job, 25 ms. The tails' reads run on one thread of their own, whose
connection stays open while the process has sockets watching.
"""

import asyncio
import json
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC
from functools import partial
from typing import Required, TypedDict

from channels.db import database_sync_to_async
from channels.layers import get_channel_layer
from django.conf import settings
from django.db import connection

from core.sqltime import IsoUtc

log = logging.getLogger(__name__)

RELAY_INTERVAL = 0.25
ANNOUNCE_WAIT = 1.0  # seconds a writer waits for an announcement to reach Redis, at most
BATCH = 1000  # events a read takes at most: a long backlog goes out in frames of this many
CARRY_CHARS = 64 * 1024  # log text an announcement carries at most (more: the web reads the rows)
OFFERED = 64  # carried batches a tail keeps at most while it cannot hand them on yet


class JobEventsMessage(TypedDict, total=False):
    type: Required[str]  # "job.events"
    job_id: Required[str]
    last_seq: Required[int]
    events: list[dict]  # the events themselves, where the writer sent them along


def group_name(job_id):
    return f"job.{job_id}"


def message(job_id, last_seq, events=None) -> JobEventsMessage:
    announced: JobEventsMessage = {"type": "job.events", "job_id": str(job_id), "last_seq": int(last_seq)}
    if events:
        announced["events"] = events
    return announced


def carried_lines(first, rows):
    """The websocket's form of log lines just stored as seqs first.. from rows (stream, at, text,
    rank), to go with their announcement; None where they are not announced (the embedded
    default) or too long to carry (the web processes read them instead)."""
    if settings.E31_LIVE_MODE != "redis" or sum(len(text) for _, _, text, _ in rows) > CARRY_CHARS:
        return None
    from jobs.models import event_message  # here: jobs.models imports this module

    return [event_message(first + offset, "log", _utc(at), stream, text, None, rank) for offset, (stream, at, text, rank) in enumerate(rows)]


def _utc(at):
    """A time as the database gives it back: in UTC (what a read of the row would send)."""
    return at.astimezone(UTC) if at.tzinfo is not None else at.replace(tzinfo=UTC)


def announce(job_id, last_seq, events=None):
    """Tell watchers of a job that its events now reach last_seq (sync code, after commit);
    events: the new events themselves, where the writer has them in the websocket's form (all
    of them, from the first after what was announced before, to last_seq)."""
    if settings.E31_LIVE_MODE != "redis":
        return  # the relay in each web process picks the rows up
    try:
        announcer.send(group_name(job_id), message(job_id, last_seq, events))
    except Exception:  # noqa: BLE001 - a lost announcement only delays watchers until the next one
        log.warning("could not announce events of job %s", job_id, exc_info=True)


class Announcer:
    """Sends announcements from sync code (the runner's hot path) on one event loop of the
    process's own, kept running on a thread: async_to_sync would start a loop, a thread and a
    Redis connection for each (2.7 ms, 1.9 ms of CPU, measured: at 50 jobs a runner stores
    lines 500 times a second). Waits for each at most ANNOUNCE_WAIT seconds: a Redis that
    hangs delays the writer no longer, and the sockets' catch-up reads what it missed."""

    def __init__(self):
        self.lock = threading.Lock()
        self.loop = None
        self.pid = None

    def _loop(self):
        with self.lock:
            if self.loop is None or self.pid != os.getpid():  # a forked child has no such thread
                self.loop, self.pid = asyncio.new_event_loop(), os.getpid()
                threading.Thread(target=self.loop.run_forever, name="live-announcer", daemon=True).start()
            return self.loop

    def send(self, group, message):
        future = asyncio.run_coroutine_threadsafe(get_channel_layer().group_send(group, message), self._loop())
        try:
            future.result(ANNOUNCE_WAIT)
        except TimeoutError:
            future.cancel()
            raise


announcer = Announcer()


class Relay:
    """Announces the jobs this process's websockets watch whenever their events move on."""

    def __init__(self):
        self.task = None
        self.watched = {}  # job id -> number of websockets watching it
        self.known = {}  # job id -> last seq announced

    def watch(self, job_id):
        self.watched[job_id] = self.watched.get(job_id, 0) + 1
        self.ensure_started()

    def unwatch(self, job_id):
        self.watched[job_id] = self.watched.get(job_id, 1) - 1
        if self.watched[job_id] <= 0:
            self.watched.pop(job_id, None)
            self.known.pop(job_id, None)

    def ensure_started(self):
        if settings.E31_LIVE_MODE != "db":
            return
        loop = asyncio.get_running_loop()
        if self.task is None or self.task.done() or self.task.get_loop() is not loop:
            self.task = loop.create_task(self.run())

    async def run(self):
        layer = get_channel_layer()
        while True:
            try:
                await self.step(layer)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - keep relaying; the next step reads the counters again
                log.exception("event relay step failed")
            await asyncio.sleep(RELAY_INTERVAL)

    async def step(self, layer):
        if not self.watched:
            return
        counters = await database_sync_to_async(self._counters)(list(self.watched))
        for job_id, last_seq in counters:
            if self.known.get(job_id, 0) < last_seq:
                self.known[job_id] = last_seq
                await layer.group_send(group_name(job_id), message(job_id, last_seq))

    @staticmethod
    def _counters(job_ids):
        from jobs.models import Job  # here: jobs.models imports this module (a job announces its events live)

        return list(Job.objects.filter(pk__in=job_ids).values_list("pk", "last_seq"))


relay = Relay()


def events_after(job_id, after, latest=None, until=None):
    """Up to BATCH of the job's events after seq `after` (and up to seq `until`), as the
    websocket sends them, skipping progress events (meter ticks, staging) older than the seqs in
    latest {kind: seq}."""
    from jobs.models import JobEvent, event_message  # here: jobs.models imports this module

    rows = JobEvent.objects.filter(job_id=job_id, seq__gt=after).order_by("seq")
    if until is not None:
        rows = rows.filter(seq__lte=until)
    for kind, seq in (latest or {}).items():
        rows = rows.exclude(kind=kind, seq__lt=seq)
    # The times as text, written by the database as isoformat would: a 6,000-line backlog took
    # 45 ms of CPU, 18 ms so.
    fields = ["at_text" if name == "at" else name for name in JobEvent.MESSAGE_FIELDS]
    return [event_message(*row) for row in rows.annotate(at_text=IsoUtc("at", zone="+00:00")).values_list(*fields)[:BATCH]]


def frame(events):
    """The text of the websocket message that carries events (encoded once for all sockets)."""
    return json.dumps({"type": "events", "events": events})


class Tail:
    """One job's new events for every socket of this process that watches it.

    seq: the last seq read and handed on (None until the first socket has sent its backlog:
    the tail starts where that socket stands). A socket gets each frame as push(frame, first
    seq, last seq) and keeps order itself: it skips what it has sent already and reads for itself
    across a gap (its backlog still going out, or it joined behind the tail), up to the tail's
    seq only, so that the next frame follows on (a socket that read past the tail would find
    each frame overlapping and read for itself forever)."""

    def __init__(self, job_id):
        self.job_id = job_id
        self.sockets = set()
        self.seq = None
        self.announced = 0
        self.reading = None
        self.offered = {}  # first seq -> events an announcement carried, not handed on yet

    def moved(self, last_seq, force=False, events=None):
        """The job's events reach last_seq (an announcement, with the events themselves where
        the writer sent them); force: read even without one."""
        self.announced = max(self.announced, last_seq)
        if events and len(self.offered) < OFFERED and (self.seq is None or events[0]["seq"] > self.seq):
            self.offered[events[0]["seq"]] = events
        if self.seq is None or not (force or self.announced > self.seq):
            return
        if self.reading is None or self.reading.done():
            self.reading = asyncio.get_running_loop().create_task(self.read(force))

    def begin(self, seq):
        """The first socket's backlog ends at seq: read on from there."""
        if self.seq is None:
            self.seq = seq
            self.moved(self.announced)

    async def read(self, force):
        while self.sockets and (force or self.announced > self.seq):
            force, announced = False, self.announced
            # The events that follow on, as an announcement carried them, or else from the rows.
            events = self.offered.pop(self.seq + 1, None) or await hub.run(events_after, self.job_id, self.seq)
            if not events:
                if self.announced == announced:
                    return
                continue  # announced while this read ran (it may have missed the rows): again
            text, first, last = frame(events), events[0]["seq"], events[-1]["seq"]
            self.seq = last
            for handed in [seq for seq in self.offered if seq <= last]:
                del self.offered[handed]  # read from the rows meanwhile
            # Each push only hands the frame to the server (daphne buffers it; a socket that
            # does not read is dropped by its keepalive), so one socket never holds up the rest.
            for socket in list(self.sockets):
                try:
                    await socket.push(text, first, last)
                except Exception:  # noqa: BLE001 - one broken socket must not stop the others
                    log.warning("pushing events of job %s failed", self.job_id, exc_info=True)


class Hub:
    """This process's member of each watched job's group: one announcement per job reaches one
    Tail, whatever the number of sockets. Its state belongs to one event loop and one channel
    layer (tests make new ones), and starts afresh when either changes."""

    def __init__(self):
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="live-reads")
        self.loop = self.layer = None
        self.tails = {}

    async def run(self, function, *args):
        """function(*args) on the hub's own thread: its database connection is kept between
        reads (one per call would cost a connection each), and closed after a failure so that
        the next read starts on a fresh one."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, partial(_kept_connection, function, *args))

    def _current(self):
        loop, layer = asyncio.get_running_loop(), get_channel_layer()
        if self.loop is not loop or self.layer is not layer:
            self.loop, self.layer = loop, layer
            self.tails = {}
            self.channel = self.receiving = None
            self.joining = asyncio.Lock()  # group membership changes one at a time, in order

    async def watch(self, job_id, socket):
        """The job's Tail, with socket among those it pushes to."""
        self._current()
        async with self.joining:
            if self.channel is None:
                self.channel = await self.layer.new_channel()
                self.receiving = self.loop.create_task(self.receive())
            tail = self.tails.get(str(job_id))
            if tail is None:
                tail = self.tails[str(job_id)] = Tail(job_id)
                await self.layer.group_add(group_name(job_id), self.channel)
            tail.sockets.add(socket)
        return tail

    async def unwatch(self, job_id, socket):
        self._current()
        async with self.joining:
            tail = self.tails.get(str(job_id))
            if tail is None or socket not in tail.sockets:
                return
            tail.sockets.discard(socket)
            if not tail.sockets:
                del self.tails[str(job_id)]
                await self.layer.group_discard(group_name(job_id), self.channel)
            if not self.tails:
                # Nobody watches: the reads' connection is not held open for nothing (and a
                # test database can be dropped).
                await self.run(_close_connection)

    def sockets(self):
        self._current()
        return [socket for tail in self.tails.values() for socket in tail.sockets]

    async def receive(self):
        while True:
            try:
                message = await self.layer.receive(self.channel)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - Redis away: the catch-up rounds read meanwhile
                log.warning("receiving announcements failed", exc_info=True)
                await asyncio.sleep(1)
                continue
            tail = self.tails.get(message.get("job_id"))
            if message.get("type") == "job.events" and tail is not None:
                tail.moved(message["last_seq"], events=message.get("events"))

    async def catch_up(self):
        """Read every watched job once, announced or not, and join its group again (it may
        have expired, or Redis restarted): a lost announcement delays watchers until here."""
        self._current()
        for tail in list(self.tails.values()):
            if self.channel is not None:
                await self.layer.group_add(group_name(tail.job_id), self.channel)
            tail.moved(0, force=True)


def _close_connection():
    connection.close()  # the calling thread's: looked up here, on the hub's thread


def _kept_connection(function, *args):
    try:
        return function(*args)
    except Exception:
        connection.close()
        raise


hub = Hub()
