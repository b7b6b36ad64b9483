import asyncio
import logging

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer
from django.conf import settings
from django.db.models import Max

from accounts import audit, ws_auth
from accounts.access import team_of
from jobs import live
from jobs.models import Job, JobEvent, event_message

log = logging.getLogger(__name__)
BATCH = 1000
# On the Redis layer, each socket also looks for new rows this often by itself: announcements
# lost while Redis was away (or a receive loop broken by it) delay a watcher at most this long.
CATCH_UP_SECONDS = 5.0
# Each socket checks this often that its user is still on the job's team (and its token not
# revoked): the bound on how long a removed member or a revoked token keeps streaming (5 s, with
# the check's query) where the message sent at the change cannot reach it (accounts/ws_auth.py).
ACCESS_CHECK_SECONDS = 3.0


class JobConsumer(AsyncJsonWebsocketConsumer):
    """Streams a job's events: the backlog after ?after=<seq>, then each new one, in order, once."""

    async def connect(self):
        self.job_id = await self.job_for_user(self.scope.get("user"), self.scope["url_route"]["kwargs"]["job_id"])
        if self.job_id is None:
            await audit.websocket_refused(self.scope, Job, self.scope["url_route"]["kwargs"]["job_id"])
            await self.close(code=4404)
            return
        self.group = live.group_name(self.job_id)
        self.last_seq = self.after_from_query()
        self.sending = asyncio.Lock()  # one sender at a time: each event goes out once, in order
        await self.channel_layer.group_add(self.group, self.channel_name)
        self.user_group = ws_auth.user_group(self.scope["user"].pk)
        await self.channel_layer.group_add(self.user_group, self.channel_name)
        await self.accept()
        await self.send_events(backlog=True)
        live.relay.watch(self.job_id)
        self.catching_up = asyncio.create_task(self.catch_up()) if settings.E31_LIVE_MODE == "redis" else None
        self.checking_access = asyncio.create_task(self.check_access())

    async def disconnect(self, code):
        await self.leave()

    async def leave(self):
        """Stop streaming, once: the socket closed, or its access ended."""
        group, self.group = getattr(self, "group", None), None
        if group is None:
            return
        for task in (self.catching_up, self.checking_access):
            if task is not None and task is not asyncio.current_task():
                task.cancel()
        live.relay.unwatch(self.job_id)
        await self.channel_layer.group_discard(group, self.channel_name)
        await self.channel_layer.group_discard(self.user_group, self.channel_name)

    async def job_events(self, message):
        if self.group is not None and message["last_seq"] > self.last_seq:
            await self.send_events()

    async def access_changed(self, message):
        await self.close_unless_allowed()

    async def check_access(self):
        while self.group is not None:
            await asyncio.sleep(ACCESS_CHECK_SECONDS)
            await self.close_unless_allowed()

    async def close_unless_allowed(self):
        try:
            allowed = await self.still_allowed()
        except Exception:  # noqa: BLE001 - the database away: no rows go out either; check again next round
            log.warning("checking access to job %s failed", self.job_id, exc_info=True)
            return
        if not allowed and self.group is not None:
            await self.leave()
            await self.close(code=4403)

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
    def still_allowed(self):
        """Whether the user is still an active member of the job's team, and the token the
        socket came with (if it came with one) still theirs: one query."""
        member = {"team__memberships__user_id": self.scope["user"].pk, "team__memberships__user__is_active": True}
        if self.scope.get("token"):
            member["team__memberships__user__auth_token__key"] = self.scope["token"]
        return Job.objects.filter(pk=self.job_id, **member).exists()

    @database_sync_to_async
    def latest_progress(self):
        rows = JobEvent.objects.filter(job_id=self.job_id, kind__in=JobEvent.PROGRESS_KINDS)
        return dict(rows.values("kind").annotate(seq=Max("seq")).values_list("kind", "seq"))

    @database_sync_to_async
    def fetch(self, after, latest):
        rows = JobEvent.objects.filter(job_id=self.job_id, seq__gt=after).order_by("seq")
        for kind, seq in latest.items():
            rows = rows.exclude(kind=kind, seq__lt=seq)
        return [event_message(*row) for row in rows.values_list(*JobEvent.MESSAGE_FIELDS)[:BATCH]]
