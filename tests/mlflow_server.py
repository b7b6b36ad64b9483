"""A real MLflow tracking server for the tracker tests: `mlflow server` on loopback with a SQLite
store in a temporary folder, run from the separate virtual environment bin/setup test makes
(.mlflow/: mlflow pins many packages of its own, so it stays out of the product's .venv).

It can be stopped and started again on the same port and store (a tracker that is down for a
while). Missing .mlflow/, the tests skip, except in CI (CI set), where they fail.
"""

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parent.parent
MLFLOW = ROOT / ".mlflow" / "bin" / "mlflow"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MlflowServer:
    def __init__(self):
        self.root = Path(tempfile.mkdtemp(prefix="e31-mlflow-"))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process = None
        self.log = None

    def start(self, timeout=180):
        self.log = open(self.root / "server.log", "ab")
        args = [
            str(MLFLOW),
            "server",
            "--backend-store-uri",
            f"sqlite:///{self.root / 'mlflow.db'}",
            "--default-artifact-root",
            str(self.root / "artifacts"),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--workers",
            "1",
        ]
        env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "true", "PYTHONUNBUFFERED": "1"}
        # A session of its own: the server's worker processes are stopped with it (by its group).
        self.process = subprocess.Popen(args, cwd=self.root, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"mlflow server exited with {self.process.returncode}: {self.tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"mlflow server did not answer within {timeout} s: {self.tail()}")

    def stop(self):
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.process = None
        if self.log is not None:
            self.log.close()
            self.log = None
        # The port is free again once nothing answers there.
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                httpx.get(f"{self.url}/health", timeout=1)
            except httpx.HTTPError:
                return
            time.sleep(0.2)

    def tail(self, size=3000):
        try:
            return (self.root / "server.log").read_bytes()[-size:].decode(errors="replace")
        except OSError:
            return ""

    # Reading back, through the REST API ----------------------------------------------------------

    def call(self, method, path, **kwargs):
        response = httpx.request(method, f"{self.url}/api/2.0/mlflow/{path}", timeout=30, **kwargs)
        response.raise_for_status()
        return response.json()

    def run_of_job(self, experiment, job_id):
        """The run (as runs/get answers it) of the job in the named experiment; None: none."""
        experiment_id = self.call("GET", "experiments/get-by-name", params={"experiment_name": experiment})["experiment"]["experiment_id"]
        found = self.call("POST", "runs/search", json={"experiment_ids": [experiment_id], "filter": f"tags.`e31.job_id` = '{job_id}'", "max_results": 10})
        runs = found.get("runs") or []
        assert len(runs) <= 1, f"{len(runs)} runs of job {job_id}"
        return runs[0] if runs else None

    def history(self, run_id, key):
        return self.call("GET", "metrics/get-history", params={"run_id": run_id, "metric_key": key, "max_results": 25000}).get("metrics") or []


def start_or_skip():
    if not MLFLOW.exists():
        message = f"{MLFLOW} is missing: run bin/setup test (it installs mlflow into .mlflow/)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return MlflowServer().start()


@pytest.fixture(scope="session")
def mlflow_server():
    """A real MLflow tracking server for the whole session (started once: it takes seconds)."""
    server = start_or_skip()
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(server.root, ignore_errors=True)
