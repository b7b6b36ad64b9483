"""How many HTTP requests one web worker lets into Django at once.

Django runs each request's view in a thread of its own (lent for the request: e31web/handler.py),
with a database connection of its own.
Nothing bounded them: a burst beyond what the worker serves (an open loop of 40 submissions a
second against one worker that serves 29) grew to hundreds of threads, PostgreSQL refused the
connection past its max_connections ("sorry, too many clients already"), the requests failed
with 500, and the scheduler, which shares the database, lost its connections too.

Admission lets at most E31_WEB_CONCURRENCY requests of a worker into the application at once;
the others wait their turn here, in the event loop, holding no thread and no connection. One
that waited E31_WEB_QUEUE_SECONDS without a turn is answered 503 with Retry-After: a clear
answer the client may retry, never a half-done submission. Websockets are not held here (their
consumers' database work runs in Channels' own bounded thread pool).
"""

import asyncio
import json


class Admission:
    def __init__(self, app, limit, wait_seconds):
        self.app = app
        self.limit = limit
        self.wait_seconds = wait_seconds
        self.turns: asyncio.Semaphore | None = None  # made in the worker's event loop, at its first request

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.turns is None:
            self.turns = asyncio.Semaphore(self.limit)
        if not self.turns.locked():
            # A free turn, and no one waiting before this request: taken at once, without the
            # task and the timer wait_for makes (most requests, where the worker keeps up).
            await self.turns.acquire()
        else:
            try:
                await asyncio.wait_for(self.turns.acquire(), self.wait_seconds)
            except TimeoutError:
                return await busy(send, self.wait_seconds)
        try:
            return await self.app(scope, receive, send)
        finally:
            self.turns.release()


async def busy(send, waited):
    retry = max(1, round(waited / 2))
    body = json.dumps({"detail": f"The server is busy: this request waited {waited:g} s for its turn. Try again in {retry} s."}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 503,
            "headers": [(b"content-type", b"application/json"), (b"retry-after", str(retry).encode()), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})
