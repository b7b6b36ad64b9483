"""The web server and the scheduler killed (SIGKILL) and started again in the middle of a busy
run: the job carries on, and afterwards every log line is there once and the ledger holds one
final usage record per allocation, matching the allocation's own times (nothing lost, nothing
counted twice). Losing a runner is tests/test_resilience.py's."""

import json
import signal
import sys
import time

import pytest

from tests.system import LiveSystem

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

LINES = 200
SCRIPT = f"""
import time
for i in range({LINES}):
    print(f"line {{i}}", flush=True)
    time.sleep(0.05)
"""
LEDGER = """
import json
from billing.models import UsageRecord
from scheduler.models import Allocation
job = "{job}"
print(json.dumps({{
    "usage": [dict(allocation=str(u.allocation_id), held=u.held_seconds, provisional=u.provisional)
              for u in UsageRecord.ledger.filter(job_id=job)],
    "allocations": [dict(id=str(a.pk), seconds=(a.ended_at - a.started_at).total_seconds() if a.ended_at else None)
                    for a in Allocation.objects.filter(job_id=job)],
}}))
"""


def test_killing_the_web_server_and_the_scheduler_mid_run_loses_nothing(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    data = tmp_path / "points.csv"
    data.write_text("x\n1\n")
    with LiveSystem() as system:
        job = system.submit({"name": "restarts", "gpus": 1, "span_hours": 0.1}, script, [data])
        system.wait_for_state(job["id"], wanted={"running"}, timeout=60)
        time.sleep(1.0)
        for name, args in (
            ("web", [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(system.port), "e31web.asgi:application"]),
            ("scheduler", [sys.executable, "manage.py", "scheduler"]),
        ):
            process = system.processes[name]
            process.send_signal(signal.SIGKILL)
            process.wait(10)
            time.sleep(0.5)
            system.spawn(name, args)
            if name == "web":
                system.wait_until(system._web_is_up, 30, "the web server to answer again")
        assert system.job(job["id"])["state"] == "running"  # both came back while it ran
        done = system.wait_for_state(job["id"], timeout=120)
        assert done["state"] == "succeeded", done

        lines = system.log_lines(job["id"])
        assert lines == [f"line {i}" for i in range(LINES)]

        ledger = json.loads(system.manage("shell", "-c", LEDGER.format(job=job["id"])).strip().splitlines()[-1])
        (allocation,) = ledger["allocations"]
        (usage,) = ledger["usage"]
        assert usage["allocation"] == allocation["id"] and not usage["provisional"]
        assert abs(usage["held"] - allocation["seconds"]) <= 1
        assert done["held_seconds"] == usage["held"]
