"""A web worker lets a bounded number of HTTP requests into Django at once (e31web/admission.py):
a burst waits its turn instead of opening a thread and a database connection each until
PostgreSQL refuses them (bench/api_load.py at 40 submissions a second on one worker: 184 of 600
failed with 500, and the scheduler lost its connections; with admission, none)."""

import asyncio
import json

import pytest

from e31web.admission import Admission

pytestmark = pytest.mark.nodb


class App:
    """An ASGI app that holds each request a while and counts how many are inside at once."""

    def __init__(self, hold=0.02):
        self.hold = hold
        self.inside = self.most = self.served = 0
        self.scopes = []

    async def __call__(self, scope, receive, send):
        self.scopes.append(scope["type"])
        self.inside += 1
        self.most = max(self.most, self.inside)
        try:
            await asyncio.sleep(self.hold)
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})
            self.served += 1
        finally:
            self.inside -= 1


async def request(app, kind="http"):
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    await app({"type": kind, "path": "/api/jobs/"}, receive, send)
    return sent


def test_a_burst_waits_its_turn_and_every_request_is_served():
    app = App()
    admitted = Admission(app, limit=3, wait_seconds=30)

    async def burst():
        return await asyncio.gather(*(request(admitted) for _ in range(30)))

    answers = asyncio.run(burst())
    assert app.most == 3, "never more than the limit inside at once"
    assert app.served == 30 and all(a[0]["status"] == 200 for a in answers)


def test_a_request_that_waited_too_long_gets_a_503_to_retry_and_never_reaches_the_app():
    app = App(hold=0.5)
    admitted = Admission(app, limit=1, wait_seconds=0.1)

    async def two():
        return await asyncio.gather(request(admitted), request(admitted))

    first, second = asyncio.run(two())
    assert first[0]["status"] == 200
    start, body = second
    assert start["status"] == 503
    headers = dict(start["headers"])
    assert int(headers[b"retry-after"]) >= 1 and headers[b"content-type"] == b"application/json"
    assert "busy" in json.loads(body["body"])["detail"]
    assert app.served == 1 and app.scopes == ["http"]


def test_a_free_turn_is_taken_at_once_and_only_a_request_that_waits_is_timed(monkeypatch):
    """asyncio.wait_for makes a task and a timer for every call: a request that finds a free turn
    (most, where the worker keeps up) needs neither."""
    from e31web import admission

    timed = []
    wait_for = asyncio.wait_for

    def counted(awaitable, timeout):
        timed.append(timeout)
        return wait_for(awaitable, timeout)

    monkeypatch.setattr(admission.asyncio, "wait_for", counted)
    app = App(hold=0.01)
    admitted = Admission(app, limit=2, wait_seconds=30)

    async def one_by_one():
        for _ in range(5):
            await request(admitted)

    asyncio.run(one_by_one())
    assert app.served == 5 and timed == []

    async def burst():
        return await asyncio.gather(*(request(admitted) for _ in range(6)))

    asyncio.run(burst())
    assert app.served == 11 and app.most == 2 and len(timed) == 4  # the four that found no turn free


def test_websockets_are_not_held_at_the_door():
    app = App(hold=0.05)
    admitted = Admission(app, limit=1, wait_seconds=0.01)

    async def both():
        return await asyncio.gather(request(admitted), request(admitted, kind="websocket"), request(admitted, kind="websocket"))

    asyncio.run(both())
    assert app.scopes.count("websocket") == 2 and app.most == 3


def test_the_web_workers_http_goes_through_admission(settings):
    from e31web import asgi

    http = asgi.application.application_mapping["http"]
    assert isinstance(http, Admission)
    assert (http.limit, http.wait_seconds) == (settings.E31_WEB_CONCURRENCY, settings.E31_WEB_QUEUE_SECONDS)
