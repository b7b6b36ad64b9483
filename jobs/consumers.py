import asyncio
import logging

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer
from django.conf import settings
from django.db.models import Max
from rest_framework.authtoken.models import Token

from accounts import audit, ws_auth
from accounts.access import team_of
from accounts.models import Membership
from jobs import live
from jobs.models import Job, JobEvent

log = logging.getLogger(__name__)
# On the Redis layer, each process also reads its watched jobs this often by itself: announcements
# lost while Redis was away (or a receive loop broken by it) delay a watcher at most this long.
CATCH_UP_SECONDS = 5.0
# Each socket is checked this often that its user is still on the job's team (and its token not
# revoked): the bound on how long a removed member or a revoked token keeps streaming (5 s, with
# the check's query) where the message sent at the change cannot reach it (accounts/ws_auth.py).
ACCESS_CHECK_SECONDS = 3.0


class JobConsumer(AsyncJsonWebsocketConsumer):
    """Streams a job's events: the backlog after ?after=<seq>, then each new one, in order, once.

    New events come from the process's Tail of the job (jobs/live.py), read and encoded once for
    all its sockets; this socket reads for itself only its backlog and across a gap."""

    async def connect(self):
        self.job_id = await self.job_for_user(self.scope.get("user"), self.scope["url_route"]["kwargs"]["job_id"])
        if self.job_id is None:
            await audit.websocket_refused(self.scope, Job, self.scope["url_route"]["kwargs"]["job_id"])
            await self.close(code=4404)
            return
        self.group = live.group_name(self.job_id)
        self.last_seq = self.after_from_query()
        self.sending = asyncio.Lock()  # one sender at a time: each event goes out once, in order
        self.waiting = []  # frames pushed while the sender was busy: (frame, first seq, last seq)
        self.reading = None
        self.access_key = (self.job_id, self.scope["user"].pk, self.scope.get("token"))
        self.user_group = ws_auth.user_group(self.scope["user"].pk)
        await self.channel_layer.group_add(self.user_group, self.channel_name)
        await self.accept()
        self.tail = await live.hub.watch(self.job_id, self)  # frames pushed from here on wait for the backlog
        await self.send_events(backlog=True)
        self.tail.begin(self.last_seq)
        live.relay.watch(self.job_id)
        rounds.start()

    async def disconnect(self, code):
        await self.leave()

    async def leave(self):
        """Stop streaming, once: the socket closed, or its access ended."""
        group, self.group = getattr(self, "group", None), None
        if group is None:
            return
        if self.reading is not None and self.reading is not asyncio.current_task():
            self.reading.cancel()
        live.relay.unwatch(self.job_id)
        await live.hub.unwatch(self.job_id, self)
        await self.channel_layer.group_discard(self.user_group, self.channel_name)

    async def push(self, frame, first, last):
        """Events first..last, as the text of a message, from the job's Tail."""
        if self.group is None or last <= self.last_seq:
            return
        if first == self.last_seq + 1 and not self.sending.locked():
            self.last_seq = last
            await self.send(text_data=frame)
            return
        # Its backlog still going out, or a gap: the sender reads up to the tail, then sends this.
        self.waiting.append((frame, first, last))
        if not self.sending.locked():
            self.reading = asyncio.create_task(self.send_events())

    async def access_changed(self, message):
        await self.close_unless_allowed()

    async def close_unless_allowed(self):
        try:
            allowed = await self.still_allowed()
        except Exception:  # noqa: BLE001 - the database away: no rows go out either; check again next round
            log.warning("checking access to job %s failed", self.job_id, exc_info=True)
            return
        if not allowed:
            await self.access_ended()

    async def access_ended(self):
        if self.group is not None:
            await self.leave()
            await self.close(code=4403)

    async def send_events(self, backlog=False):
        """Read and send the events after the last one sent, up to where the job's Tail stood
        (all there are, before it starts), then the frames it pushed meanwhile, reading across
        any gap between them up to the frame's end. Never past what the tail has pushed: a
        socket that read ahead would find every frame overlapping and chase the job's output
        with reads of its own."""
        async with self.sending:
            # Old meter ticks and staging progress are history: a (re)connecting client needs
            # only the latest of each.
            latest = await self.latest_progress() if backlog else {}
            until, reading = self.tail.seq, True
            while True:
                if reading:
                    events = await self.fetch(self.last_seq, latest, until)
                    if events:
                        self.last_seq = events[-1]["seq"]
                        await self.send(text_data=live.frame(events))
                    reading = bool(events) and (until is None or self.last_seq < until)
                    continue
                if not self.waiting:
                    return
                frame, first, last = self.waiting.pop(0)
                if first == self.last_seq + 1:
                    self.last_seq = last
                    await self.send(text_data=frame)
                elif last > self.last_seq:
                    until, reading = last, True  # a gap before it, or an overlap: read up to its end instead

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

    # A socket's own reads (its backlog, a gap) run on the hub's one thread, with its kept
    # connection, as the tails' do: not on a thread and a new connection of each socket's. Five
    # watchers coming back after a minute away read 6,000 lines each at once: on threads of their
    # own, their rows' conversion starved the event loop of the GIL for up to 200 ms, and every
    # other socket's lines waited (bench/stream_load.py).
    async def latest_progress(self):
        return await live.hub.run(latest_progress, self.job_id)

    async def fetch(self, after, latest, until):
        return await live.hub.run(live.events_after, self.job_id, after, latest, until)


def latest_progress(job_id):
    """{kind: seq} of the job's latest progress event of each kind (meter ticks, staging)."""
    rows = JobEvent.objects.filter(job_id=job_id, kind__in=JobEvent.PROGRESS_KINDS)
    return dict(rows.values("kind").annotate(seq=Max("seq")).values_list("kind", "seq"))


def allowed(keys):
    """Of the sockets' (job id, user id, token or None), those whose user is still an active
    member of the job's team with the token (if any) still theirs: three queries for them all."""
    teams = dict(Job.objects.filter(pk__in={job for job, _, _ in keys}).values_list("pk", "team_id"))
    members = dict(Membership.objects.filter(user_id__in={user for _, user, _ in keys}, user__is_active=True).values_list("user_id", "team_id"))
    owners = dict(Token.objects.filter(key__in={token for _, _, token in keys if token}).values_list("key", "user_id"))
    return {
        (job, user, token)
        for job, user, token in keys
        if teams.get(job) is not None and members.get(user) == teams[job] and (not token or owners.get(token) == user)
    }


class Rounds:
    """What this process does for all its sockets at once, each round a few queries whatever
    their number: the access check and, on the Redis layer, the catch-up read."""

    def __init__(self):
        self.loop = None

    def start(self):
        loop = asyncio.get_running_loop()
        if self.loop is not loop:  # one set of rounds per event loop (tests make new ones)
            self.loop = loop
            self.tasks = [loop.create_task(self.every(lambda: ACCESS_CHECK_SECONDS, self.check_access))]
            if settings.E31_LIVE_MODE == "redis":
                self.tasks.append(loop.create_task(self.every(lambda: CATCH_UP_SECONDS, live.hub.catch_up)))

    @staticmethod
    async def every(seconds, step):
        while True:
            await asyncio.sleep(seconds())  # read each round: tests change it
            try:
                await step()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the database or Redis away: the next round tries again
                log.warning("a round over the job sockets failed", exc_info=True)

    @staticmethod
    async def check_access():
        sockets = live.hub.sockets()
        if not sockets:
            return
        still = await live.hub.run(allowed, {socket.access_key for socket in sockets})
        for socket in sockets:
            if socket.access_key not in still:
                await socket.access_ended()


rounds = Rounds()
