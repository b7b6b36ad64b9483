"""PostgreSQL and Redis taken away for 30 seconds in the middle of a run (every connection reset,
new ones refused, through a proxy): the system waits, retries and recovers on its own. The job
runs on without a restart, every log line is stored once, the ledger holds one final record for
its one allocation, and a websocket watcher gets every line."""

import json
import threading
import time
from urllib.parse import urlsplit

import pytest
from websockets.sync.client import connect

from tests.proxy import Proxy
from tests.system import POSTGRES_ADMIN_URL, REDIS_URL, LiveSystem

pytestmark = [pytest.mark.e2e, pytest.mark.late, pytest.mark.timeout(300)]  # late: after bin/test's PostgreSQL pass, in its lane

LINES = 400
OUTAGE_SECONDS = 30
SCRIPT = f"""
import time
for i in range({LINES}):
    print(f"line {{i}}", flush=True)
    time.sleep(0.1)
"""


def test_postgres_and_redis_gone_for_30_seconds_lose_nothing(tmp_path):
    pg, redis = urlsplit(POSTGRES_ADMIN_URL), urlsplit(REDIS_URL)
    pg_proxy, redis_proxy = Proxy(pg.hostname, pg.port or 5432), Proxy(redis.hostname, redis.port or 6379)
    system = LiveSystem(database="postgres", redis=True, seeded=False)
    # Every process reaches both servers through the proxies.
    system.env["DATABASE_URL"] = system.env["DATABASE_URL"].replace(f":{pg.port or 5432}/", f":{pg_proxy.port}/")
    system.env["REDIS_URL"] = REDIS_URL.replace(f":{redis.port or 6379}", f":{redis_proxy.port}")
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    data = tmp_path / "points.csv"
    data.write_text("x\n1\n")
    seen, watching = [], threading.Event()
    try:
        system.start()
        job = system.submit({"name": "outage", "gpus": 1, "span_hours": 0.1}, script, [data])

        def watch():
            after = 0
            while not watching.is_set():
                try:
                    with connect(system.ws_url(job["id"], after), additional_headers={"Authorization": f"Token {system.token}"}) as ws:
                        while not watching.is_set():
                            message = json.loads(ws.recv(timeout=60))
                            for event in message.get("events", []):
                                after = max(after, event["seq"])
                                if event["kind"] == "log":
                                    seen.append(event["text"])
                                if event["kind"] == "state" and event.get("state") in ("succeeded", "failed", "cancelled", "stopped"):
                                    watching.set()
                except Exception:  # noqa: BLE001 - the server is away: reconnect from where it stopped
                    time.sleep(1)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        system.wait_for_state(job["id"], wanted={"running"}, timeout=60)
        time.sleep(3)
        pg_proxy.cut()
        redis_proxy.cut()
        time.sleep(OUTAGE_SECONDS)
        pg_proxy.restore()
        redis_proxy.restore()
        done = system.wait_for_state(job["id"], timeout=180)
        watcher.join(30)
        assert done["state"] == "succeeded", done
        assert done["restarts"] == 0 and len(done["allocations"]) == 1, [(t["state"], t.get("reason")) for t in done["timeline"] if t["kind"] == "state"]

        lines = system.log_lines(job["id"])
        assert lines == [f"line {i}" for i in range(LINES)]
        assert seen == lines  # the watcher, reconnecting, got each line once
        usage = system.api("GET", "/api/usage/").json()["records"]
        mine = [u for u in usage if u.get("job") == job["id"] or u.get("job_id") == job["id"]]
        assert len(mine) == 1 and abs(mine[0]["held_seconds"] - done["held_seconds"]) <= 1, usage
    finally:
        watching.set()
        system.stop()
        pg_proxy.close()
        redis_proxy.close()
