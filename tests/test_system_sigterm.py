"""A process that started a LiveSystem and is told to stop (SIGTERM: CI's timeout, `kill`) stops
the system's processes and drops its database on the way out, as on Ctrl-C. Python's default for
SIGTERM is to die at once: a killed benchmark left its PostgreSQL databases and its daphne,
scheduler and runner behind."""

import signal
import subprocess
import sys
import time
from pathlib import Path

import psycopg
import pytest

from tests.system import POSTGRES_ADMIN_URL

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = """
import sys, time
sys.path.insert(0, {root!r})
from tests.system import LiveSystem
system = LiveSystem(database="postgres", seeded=False)
try:
    system.spawn("sleeper", [sys.executable, "-c", "import time; time.sleep(600)"])
    print(system.pg_name, system.processes["sleeper"].pid, flush=True)
    time.sleep(600)
finally:
    system.stop()
"""


def databases():
    with psycopg.connect(POSTGRES_ADMIN_URL, autocommit=True) as conn:
        return {name for (name,) in conn.execute("SELECT datname FROM pg_database")}


def alive(pid):
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.nodb
@pytest.mark.timeout(120)
def test_a_process_told_to_stop_stops_its_live_system_and_drops_its_database():
    process = subprocess.Popen([sys.executable, "-c", SCRIPT.format(root=str(ROOT))], stdout=subprocess.PIPE, text=True)
    try:
        name, pid = process.stdout.readline().split()
        assert name in databases()
        process.send_signal(signal.SIGTERM)
        process.wait(60)
        assert process.returncode != 0  # it was stopped, not finished
        assert name not in databases()
        deadline = time.monotonic() + 10
        while alive(int(pid)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(int(pid))
    finally:
        process.kill()
