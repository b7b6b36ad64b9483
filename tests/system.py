"""A whole E31 Network on this machine, as real processes, for end-to-end tests and benchmarks.

The web server (daphne), the scheduler and a runner each run as their own process against a
fresh database (a SQLite file, or a new PostgreSQL database on 127.0.0.1:5432), optionally with
the Redis channel layer. Nothing here imports Django: the system is driven over HTTP and
websockets, as a user would.
"""

import atexit
import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
POSTGRES_ADMIN_URL = os.environ.get("E31_TEST_POSTGRES_URL", "postgres://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("E31_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
TERMINAL = {"succeeded", "failed", "stopped", "cancelled"}


# What a seeded system starts from: the database migrated, the demo loaded and its API token made
# (about 10 s of manage.py runs), done once per kind of system in this process and copied for
# every system of that kind after the first (a file copy, or CREATE DATABASE ... TEMPLATE).
_SEEDS = {}
# Settings only the running processes read: systems that differ only in these start from the
# same seed. (Anything else in a system's environment gets a seed of its own.)
RUNTIME_ONLY = {
    "E31_VAR_DIR",
    "DATABASE_URL",
    "REDIS_URL",
    "PYTHONUNBUFFERED",
    "E31_SCHEDULER_INTERVAL_SECONDS",
    "E31_HEARTBEAT_SECONDS",
    "E31_STOP_GRACE_SECONDS",
    "E31_NODE_TIMEOUT_SECONDS",
    "E31_PREEMPT_EVERY_SECONDS",
    "E31_UPLOAD_CHUNK_BYTES",
    "E31_UPLOAD_INLINE_COMPLETE_BYTES",
    "E31_API_RATE",
}
SEED_CODE = """
import io
from django.core.management import call_command
call_command("migrate", interactive=False, verbosity=0)
call_command("demo", stdout=io.StringIO())
token = io.StringIO()
call_command("apitoken", "demo", stdout=token)
print("token", token.getvalue().strip())
"""


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _interrupted(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def stop_on_sigterm():
    """Take SIGTERM (a CI job's timeout, `kill`) as Ctrl-C in this process: the finally blocks and
    fixtures' teardowns that stop a LiveSystem's processes and drop its database run, and pytest
    ends its session as on Ctrl-C. Python's default is to die at once, which left a benchmark's
    databases and the system's processes behind. Only where SIGTERM's handler is still the
    default, from the main thread (the only one that may set one)."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _interrupted)


class LiveSystem:
    def __init__(self, database="sqlite", redis=False, devices=2, stop_grace=1.0, env=None, s3=None, seeded=True):
        """seeded: start() copies a database migrated and seeded once in this process (see
        _SEEDS) instead of running migrate, demo and apitoken again; never with S3 storage (the
        seed's files would stay in its bucket)."""
        stop_on_sigterm()
        self.database = database
        self.seeded = seeded and s3 is None
        self.redis = redis
        self.devices = devices
        self.var_dir = Path(tempfile.mkdtemp(prefix="e31-system-"))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.processes = {}
        self._spawned = []  # every process started, also one whose name was used again
        self.pg_name = None
        self.env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": os.environ.get("HOME", str(self.var_dir)),
            "E31_VAR_DIR": str(self.var_dir),
            "E31_SCHEDULER_INTERVAL_SECONDS": "0.2",
            "E31_HEARTBEAT_SECONDS": "0.5",
            "E31_STOP_GRACE_SECONDS": str(stop_grace),
            "PYTHONUNBUFFERED": "1",
            # The tests' S3 servers listen on loopback: teams' buckets may be there (tests/conftest.py).
            "E31_S3_ENDPOINT_ALLOW": "127.0.0.1",
            # The test run's own cgroup folder (tests/conftest.py), when there is one.
            **({"E31_JOB_CGROUP_PARENT": os.environ["E31_JOB_CGROUP_PARENT"]} if "E31_JOB_CGROUP_PARENT" in os.environ else {}),
            **(env or {}),
        }
        if database == "postgres":
            self.pg_name = f"e31_e2e_{secrets.token_hex(4)}"
            self._postgres(f'CREATE DATABASE "{self.pg_name}"')
            self.env["DATABASE_URL"] = POSTGRES_ADMIN_URL.rsplit("/", 1)[0] + f"/{self.pg_name}"
        if redis:
            self.env["REDIS_URL"] = REDIS_URL
        if s3 is not None:  # a tests.seaweed.SeaweedFS: storage in a fresh bucket there
            self.env.update(s3.settings_env(s3.bucket("system")))
        if "E31_STORAGE_URL" in self.env:  # a seed's files would be in its own bucket, not copied
            self.seeded = False
        self.token = None

    # Processes ------------------------------------------------------------------------------

    def manage(self, *args, timeout=120):
        result = subprocess.run([sys.executable, "manage.py", *args], cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=timeout)
        if result.returncode != 0:
            raise RuntimeError(f"manage.py {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}")
        return result.stdout

    def spawn(self, name, args):
        log = open(self.var_dir / f"{name}.log", "wb")
        self.processes[name] = subprocess.Popen(args, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        self._spawned.append(self.processes[name])

    def start(self, runner=True):
        if self.seeded:
            self._copy_seed()
        else:
            self.manage("migrate", "--noinput", "-v", "0")
            self.manage("demo")
            self.token = self.manage("apitoken", "demo").strip()
        self.spawn("web", [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(self.port), "e31web.asgi:application"])
        self.spawn("scheduler", [sys.executable, "manage.py", "scheduler"])
        if runner:
            self.start_runner()
        self.wait_until(self._web_is_up, 30, "the web server to answer")
        return self

    def start_runner(self, name="runner", devices=None):
        self.spawn(name, [sys.executable, "manage.py", "runner", "--devices", str(devices or self.devices), "--name", f"e2e-{name}"])

    def _web_is_up(self):
        try:
            return httpx.get(f"{self.url}/accounts/login/", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    # Seeds ----------------------------------------------------------------------------------

    def _seed_key(self):
        return self.database, tuple(sorted((k, v) for k, v in self.env.items() if k not in RUNTIME_ONLY))

    def _copy_seed(self):
        key = self._seed_key()
        if key not in _SEEDS:
            _SEEDS[key] = self._make_seed()
        seed = _SEEDS[key]
        shutil.copytree(seed["var_dir"], self.var_dir, dirs_exist_ok=True)
        # A token of its own, as a system seeded afresh has (the API's rate limits count per token).
        self.token = secrets.token_hex(20)
        change_token = "UPDATE authtoken_token SET key = %s WHERE key = %s"
        if self.pg_name:
            self._postgres(f'DROP DATABASE IF EXISTS "{self.pg_name}"')
            self._postgres(f'CREATE DATABASE "{self.pg_name}" TEMPLATE "{seed["pg_name"]}"')
            import psycopg

            with psycopg.connect(self.env["DATABASE_URL"], autocommit=True) as conn:
                assert conn.execute(change_token, (self.token, seed["token"])).rowcount == 1
        else:
            import sqlite3

            with contextlib.closing(sqlite3.connect(self.var_dir / "e31.sqlite3", timeout=30)) as conn, conn:
                assert conn.execute(change_token.replace("%s", "?"), (self.token, seed["token"])).rowcount == 1

    def _make_seed(self):
        seed = {"var_dir": Path(tempfile.mkdtemp(prefix="e31-seed-")), "pg_name": None}
        atexit.register(_drop_seed, seed)
        env = {**self.env, "E31_VAR_DIR": str(seed["var_dir"])}
        if env.get("DATABASE_URL", "").startswith("sqlite"):
            # A system told its SQLite file by name (as production is): the seed's goes in the
            # seed's folder, under the default name, or a second system would copy no database.
            del env["DATABASE_URL"]
        if self.pg_name:
            seed["pg_name"] = f"e31_seed_{secrets.token_hex(4)}"
            self._postgres(f'CREATE DATABASE "{seed["pg_name"]}"')
            env["DATABASE_URL"] = POSTGRES_ADMIN_URL.rsplit("/", 1)[0] + f"/{seed['pg_name']}"
        result = subprocess.run([sys.executable, "manage.py", "shell", "-c", SEED_CODE], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        if result.returncode != 0:
            raise RuntimeError(f"seeding a database failed:\n{result.stdout}\n{result.stderr}")
        seed["token"] = result.stdout.rsplit("token ", 1)[1].strip()
        return seed

    def stop(self):
        for process in self._spawned:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self._spawned:
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()
        if self.pg_name:
            self._postgres(f'DROP DATABASE IF EXISTS "{self.pg_name}" WITH (FORCE)')
        shutil.rmtree(self.var_dir, ignore_errors=True)

    def cpu_seconds(self):
        """CPU seconds (user + system) each of the system's own processes has used so far (not
        its children: a job's process is the runner's child and is not counted)."""
        tick = os.sysconf("SC_CLK_TCK")
        out = {}
        for name, process in self.processes.items():
            try:
                fields = Path(f"/proc/{process.pid}/stat").read_text().rsplit(")", 1)[1].split()
                out[name] = (int(fields[11]) + int(fields[12])) / tick
            except (OSError, IndexError, ValueError):
                out[name] = 0.0
        return out

    def logs(self):
        return {p.stem: p.read_text(errors="replace")[-4000:] for p in self.var_dir.glob("*.log")}

    def __enter__(self):
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc):
        self.stop()

    @staticmethod
    def _postgres(sql):
        import psycopg

        with psycopg.connect(POSTGRES_ADMIN_URL, autocommit=True) as conn:
            conn.execute(sql)

    # Driving it -----------------------------------------------------------------------------

    @staticmethod
    def wait_until(predicate, timeout, what, interval=0.1, max_interval=0.5):
        """predicate()'s first true value, asked every interval seconds at first and less often
        the longer it takes (up to max_interval): each question to the web server takes CPU
        from the jobs being waited for, on a small machine."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            time.sleep(interval)
            interval = min(max_interval, interval * 1.25)
        raise TimeoutError(f"gave up waiting for {what} after {timeout} s")

    def api(self, method, path, **kwargs):
        headers = {"Authorization": f"Token {self.token}", **kwargs.pop("headers", {})}
        return httpx.request(method, f"{self.url}{path}", headers=headers, timeout=60, **kwargs)

    def submit(self, spec, code_path, data_paths=()):
        files = [("code", (Path(code_path).name, Path(code_path).read_bytes()))]
        files += [("data", (Path(p).name, Path(p).read_bytes())) for p in data_paths]
        response = self.api("POST", "/api/jobs/", data={"spec": json.dumps(spec)}, files=files)
        assert response.status_code == 201, response.text
        return response.json()

    def log_lines(self, job_id):
        """Every stored log line of a job, in order, paged through the API."""
        lines, after = [], 0
        while True:
            page = self.api("GET", f"/api/jobs/{job_id}/logs/?after={after}&limit=5000").json()
            lines += [line["text"] for line in page["lines"]]
            after = page["next_after"]
            if not page["more"]:
                return lines

    def job(self, job_id):
        response = self.api("GET", f"/api/jobs/{job_id}/")
        response.raise_for_status()
        return response.json()

    def wait_for_state(self, job_id, wanted=TERMINAL, timeout=120):
        wanted = {wanted} if isinstance(wanted, str) else set(wanted)

        def reached():
            job = self.job(job_id)
            return job if job["state"] in wanted else None

        try:
            return self.wait_until(reached, timeout, f"job {job_id} to be {'/'.join(sorted(wanted))}")
        except TimeoutError:
            raise TimeoutError(f"job {job_id}: {self.job(job_id)}\nprocess logs: {self.logs()}") from None

    def ws_url(self, job_id, after=0):
        return f"ws://127.0.0.1:{self.port}/ws/jobs/{job_id}/?after={after}"

    def browser_session(self, username="demo", password="demo-e31"):
        """An httpx client logged in through the login form, CSRF and all."""
        client = httpx.Client(base_url=self.url, timeout=60, follow_redirects=False)
        page = client.get("/accounts/login/")
        token = csrf_from(page.text)
        response = client.post("/accounts/login/", data={"username": username, "password": password, "csrfmiddlewaretoken": token})
        assert response.status_code == 302, response.text
        return client


def _drop_seed(seed):
    shutil.rmtree(seed["var_dir"], ignore_errors=True)
    if seed["pg_name"]:
        try:
            LiveSystem._postgres(f'DROP DATABASE IF EXISTS "{seed["pg_name"]}" WITH (FORCE)')
        except Exception:  # noqa: BLE001 - at exit, nothing more to do
            pass


def parse_time(text):
    """A timestamp as the API writes it."""
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def csrf_from(html):
    match = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', html)
    assert match, "no CSRF token on the page"
    return match.group(1)
