"""A large upload does not make the web worker hold it in memory (e31web/http_bodies.py):
twisted, under daphne, parsed every POST's multipart body into request.args, reading it whole
into memory (a 200 MB upload took a worker to 2.8 GB); then daphne queued the body whole for the
application before it read any (1.05x the body)."""

import asyncio
import io
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.system import LiveSystem

BODY = 64 * 1024 * 1024


def peak_kb(pid):
    """The process's peak resident memory (VmHWM), in KB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmHWM for {pid}")


@pytest.mark.e2e
@pytest.mark.nodb
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")
def test_a_large_upload_is_not_held_in_the_web_workers_memory():
    system = LiveSystem()
    try:
        system.start(runner=False)
        web = system.processes["web"].pid
        assert system.api("GET", "/api/me/").status_code == 200
        before = peak_kb(web)
        spec = {"name": "large", "gpus": 1, "span_hours": 1}
        files = [("code", ("train.py", b"print(1)\n")), ("data", ("large.bin", os.urandom(BODY)))]
        response = system.api("POST", "/api/jobs/", data={"spec": json.dumps(spec)}, files=files)
        assert response.status_code == 201, response.text
        grown = (peak_kb(web) - before) * 1024
        # daphne queued the body for the application whole (1.05x it), and twisted's parse of it
        # made 14x; read from the file as Django reads it, 0.04x (200 MB).
        assert grown < BODY / 4, f"the web worker grew by {grown / BODY:.2f}x the upload"
    finally:
        system.stop()


@pytest.mark.nodb
def test_daphnes_requests_ask_twisted_to_leave_the_body_unparsed():
    from daphne.http_protocol import WebRequest

    import e31web.asgi  # noqa: F401  (installs it)

    seen = {}

    def init(self, *args, **kwargs):
        seen.update(kwargs)
        raise StopIteration  # nothing more of a request is needed

    from unittest import mock

    with mock.patch("twisted.web.http.Request.__init__", init), pytest.raises(StopIteration):
        WebRequest(mock.Mock())
    assert seen["parsePOSTFormSubmission"] is False


def run(coroutine):
    """asyncio.run on a thread of its own: after a browser test, Playwright's event loop
    (session-wide) is this thread's running loop, where asyncio.run refuses to run."""
    with ThreadPoolExecutor(1) as thread:
        return thread.submit(asyncio.run, coroutine).result()


def queued_as_daphne_does(content, buffer_size=8192):
    """A FileBodyQueue over `content` with the body put as daphne's WebRequest.process puts it."""
    from e31web.http_bodies import FileBodyQueue

    queue = asyncio.Queue()
    queue.__class__ = FileBodyQueue
    queue.content = content
    content.seek(0)
    while True:
        chunk = content.read(buffer_size)
        more_body = not (len(chunk) < buffer_size)
        queue.put_nowait({"type": "http.request", "body": chunk, "more_body": more_body})
        if not more_body:
            return queue


def received(queue):
    """Every message the application would receive, to the last body message or a disconnect."""

    async def read():
        messages = []
        while not messages or (messages[-1]["type"] == "http.request" and messages[-1]["more_body"]):
            messages.append(await queue.get())
        return messages

    return run(read())


@pytest.mark.nodb
@pytest.mark.parametrize("size", [0, 1, 8191, 8192, 8193, 3 * 1024 * 1024 + 5])
def test_a_queued_body_is_read_from_twisteds_file_when_the_application_takes_it(size):
    from e31web.http_bodies import READ_AT_ONCE

    body = os.urandom(size)
    content = io.BytesIO(body)
    queue = queued_as_daphne_does(content)
    # What daphne put is where the bytes lie, not the bytes: they are read when taken.
    assert not any(isinstance(item, dict) for item in queue._queue)
    content.seek(0)
    changed = bytes(b ^ 0xFF for b in body)
    content.write(changed)
    messages = received(queue)
    assert b"".join(m["body"] for m in messages) == changed
    assert [m["more_body"] for m in messages] == [True] * (len(messages) - 1) + [False]
    assert all(len(m["body"]) <= READ_AT_ONCE for m in messages)
    assert len(messages) == max(1, -(-size // READ_AT_ONCE))  # not one per 8 kB


@pytest.mark.nodb
def test_a_body_whose_file_twisted_closed_is_a_disconnect():
    content = io.BytesIO(os.urandom(3 * 1024 * 1024))
    queue = queued_as_daphne_does(content)
    queue.put_nowait({"type": "http.disconnect"})  # daphne's, as the connection is lost
    first = run(queue.get())
    assert first["type"] == "http.request" and first["more_body"]
    content.close()  # twisted closes it when the connection is lost
    assert received(queue) == [{"type": "http.disconnect"}]
    assert all(not isinstance(item, tuple) for item in queue._queue)


@pytest.mark.nodb
def test_daphnes_http_queues_keep_the_body_in_the_file():
    from unittest import mock

    from daphne.server import Server

    import e31web.asgi  # noqa: F401  (installs it)
    from e31web.http_bodies import FileBodyQueue

    server = Server.__new__(Server)
    content = io.BytesIO(b"x")
    protocol = mock.Mock(content=content)
    server.connections = {protocol: {}}

    async def application(scope, receive, send):
        return None

    server.application = application

    async def make(scope):
        return Server.create_application(server, protocol, scope)

    queue = run(make({"type": "http"}))
    assert isinstance(queue, FileBodyQueue) and queue.content is content
