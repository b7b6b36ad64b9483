"""A large upload does not make the web worker hold it in memory many times over
(e31web/http_bodies.py): twisted, under daphne, parsed every POST's multipart body into
request.args, reading it whole into memory; a 200 MB upload took a worker to 2.8 GB."""

import json
import os
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
def test_a_large_upload_is_not_held_in_the_web_workers_memory_many_times_over():
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
        # daphne queues the body for the application whole (about 1.7x it); twisted's parse of
        # it made 14x.
        assert grown < 4 * BODY, f"the web worker grew by {grown / BODY:.1f}x the upload"
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
