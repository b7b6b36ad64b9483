import asyncio
import logging

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer
from django.conf import settings
from django.db.models import Max

from accounts.access import team_of
from jobs import live
from jobs.models import Job, JobEvent, event_message

log = logging.getLogger(__name__)
BATCH = 1000
# On the Redis layer, each socket also looks for new rows this often by itself: announcements
# lost while Redis was away (or a receive loop broken by it) delay a watcher at most this long.
CATCH_UP_SECONDS = 5.0


class JobConsumer(AsyncJsonWebsocketConsumer):
    """Streams a job's events: the backlog after ?after=<seq>, then each new one, in order, once."""

    async def connect(self):
        self.job_id = await self.job_for_user(self.scope.get("user"), self.scope["url_route"]["kwargs"]["job_id"])
        if self.job_id is None:
            await self.close(code=4404)
            return
        self.group = live.group_name(self.job_id)
        self.last_seq = self.after_from_query()
        self.sending = asyncio.Lock()  # one sender at a time: each event goes out once, in order
        await self.channel_layer.group_add(self.group, self.channel_name)
        await self.accept()
        await self.send_events(backlog=True)
        live.relay.watch(self.job_id)
        self.catching_up = asyncio.create_task(self.catch_up()) if settings.E31_LIVE_MODE == "redis" else None

    async def disconnect(self, code):
        if getattr(self, "group", None):
            if self.catching_up is not None:
                self.catching_up.cancel()
            live.relay.unwatch(self.job_id)
            await self.channel_layer.group_discard(self.group, self.channel_name)

    async def job_events(self, message):
        if message["last_seq"] > self.last_seq:
            await self.send_events()

    async def catch_up(self):
        while True:
            await asyncio.sleep(CATCH_UP_SECONDS)
            try:
                await self.send_events()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the database away: the next round tries again
                log.warning("catching up job %s failed", self.job_id, exc_info=True)

    async def send_events(self, backlog=False):
        async with self.sending:
            # Old meter ticks and staging progress are history: a (re)connecting client needs
            # only the latest of each.
            latest = await self.latest_progress() if backlog else {}
            while True:
                events = await self.fetch(self.last_seq, latest)
                if not events:
                    return
                self.last_seq = events[-1]["seq"]
                await self.send_json({"type": "events", "events": events})

    def after_from_query(self):
        for pair in self.scope.get("query_string", b"").decode().split("&"):
            name, _, value = pair.partition("=")
            if name == "after" and value.isdigit():
                return int(value)
        return 0

    @database_sync_to_async
    def job_for_user(self, user, job_id):
        team = team_of(user)
        if team is None:
            return None
        return Job.objects.filter(pk=job_id, team=team).values_list("pk", flat=True).first()

    @database_sync_to_async
    def latest_progress(self):
        rows = JobEvent.objects.filter(job_id=self.job_id, kind__in=JobEvent.PROGRESS_KINDS)
        return {kind: seq for kind, seq in rows.values("kind").annotate(seq=Max("seq")).values_list("kind", "seq")}

    @database_sync_to_async
    def fetch(self, after, latest):
        rows = JobEvent.objects.filter(job_id=self.job_id, seq__gt=after).order_by("seq")
        for kind, seq in latest.items():
            rows = rows.exclude(kind=kind, seq__lt=seq)
        return [event_message(*row) for row in rows.values_list(*JobEvent.MESSAGE_FIELDS)[:BATCH]]
