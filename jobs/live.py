"""Live events: every event is a row first (JobEvent), then announced to the job's group.

Announcements carry only "job X has events up to seq N"; a consumer reads the rows themselves
from the database after the last seq it sent. So a missed or repeated announcement costs a
query, never a lost or repeated line.

Two ways to announce, chosen by settings.E31_LIVE_MODE:
- "redis": the writer (runner, scheduler, web) group_sends over the Redis channel layer after
  its transaction commits.
- "db": the embedded default. Channels' in-memory layer lives in one process and is not
  thread-safe, so writers in other processes cannot reach it. Instead each web process runs one
  relay task that reads the sequence counters of the jobs its websockets watch (one query every
  quarter second per process, however many watchers) and announces those that moved on. The
  counter commits with its events, so whatever it shows is readable.
"""

import asyncio
import logging
from typing import TypedDict

from asgiref.sync import async_to_sync
from channels.db import database_sync_to_async
from channels.layers import get_channel_layer
from django.conf import settings

log = logging.getLogger(__name__)

RELAY_INTERVAL = 0.25


class JobEventsMessage(TypedDict):
    type: str  # "job.events"
    job_id: str
    last_seq: int


def group_name(job_id):
    return f"job.{job_id}"


def message(job_id, last_seq) -> JobEventsMessage:
    return {"type": "job.events", "job_id": str(job_id), "last_seq": int(last_seq)}


def announce(job_id, last_seq):
    """Tell watchers of a job that its events now reach last_seq (sync code, after commit)."""
    if settings.E31_LIVE_MODE != "redis":
        return  # the relay in each web process picks the rows up
    try:
        async_to_sync(get_channel_layer().group_send)(group_name(job_id), message(job_id, last_seq))
    except Exception:  # noqa: BLE001 - a lost announcement only delays watchers until the next one
        log.warning("could not announce events of job %s", job_id, exc_info=True)


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
