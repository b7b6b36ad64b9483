"""Live events: every event is a row first (JobEvent), then announced to the job's group.

Announcements carry only "job X has events up to seq N"; a consumer reads the rows themselves
from the database after the last seq it sent. So a missed or repeated announcement costs a
query, never a lost or repeated line.

Two ways to announce, chosen by settings.E31_LIVE_MODE:
- "redis": the writer (runner, scheduler, web) group_sends over the Redis channel layer after
  its transaction commits.
- "db": the embedded default. Channels' in-memory layer lives in one process and is not
  thread-safe, so writers in other processes cannot reach it. Instead each web process runs one
  relay task that tails the event table (one query every quarter second per process, however
  many watchers) and announces to its local groups.
"""

import asyncio
import logging
from typing import TypedDict

from asgiref.sync import async_to_sync
from channels.db import database_sync_to_async
from channels.layers import get_channel_layer
from django.conf import settings
from django.db.models import Max

log = logging.getLogger(__name__)

RELAY_INTERVAL = 0.25
# Rows may commit out of id order on PostgreSQL; look back this many ids so a late commit is
# still seen. Announcing twice is harmless (consumers dedupe by seq).
RELAY_LOOKBACK = 2000


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
    """Tails JobEvent rows and announces them to this process's groups."""

    def __init__(self):
        self.task = None
        self.known = {}  # job id -> last seq announced

    def ensure_started(self):
        if settings.E31_LIVE_MODE != "db":
            return
        loop = asyncio.get_running_loop()
        if self.task is None or self.task.done() or self.task.get_loop() is not loop:
            self.task = loop.create_task(self.run())

    async def run(self):
        from jobs.models import JobEvent

        cursor = await database_sync_to_async(lambda: JobEvent.objects.aggregate(m=Max("id"))["m"] or 0)()
        layer = get_channel_layer()
        while True:
            try:
                cursor = await self.step(layer, cursor)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - keep relaying; the next step retries the same rows
                log.exception("event relay step failed")
            await asyncio.sleep(RELAY_INTERVAL)

    async def step(self, layer, cursor):
        rows = await database_sync_to_async(self._changes)(cursor)
        for job_id, last_seq, max_id in rows:
            cursor = max(cursor, max_id)
            if self.known.get(job_id, 0) < last_seq:
                self.known[job_id] = last_seq
                await layer.group_send(group_name(job_id), message(job_id, last_seq))
        return cursor

    @staticmethod
    def _changes(cursor):
        from jobs.models import JobEvent

        return list(
            JobEvent.objects.filter(id__gt=max(0, cursor - RELAY_LOOKBACK))
            .values("job_id")
            .annotate(last_seq=Max("seq"), max_id=Max("id"))
            .values_list("job_id", "last_seq", "max_id")
        )


relay = Relay()
