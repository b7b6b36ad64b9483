"""A run survives losing its machine: the whole system as real processes, runners killed with
SIGKILL or preempted, and the final weights compared bit for bit with a run never interrupted."""

import io
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.system import ROOT, LiveSystem

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

EXAMPLE = ROOT / "examples" / "resumable" / "train.py"
HEARTBEAT_TIMEOUT = 3


class ReferenceRun:
    """The example run straight through, outside the network, on the demo's training split.

    Started in the background (it runs while the test's system does its work) and waited for in
    weights(). The pause between steps ("sleep") changes no number, so it runs without it."""

    def __init__(self, tmp_path, config):
        from e31web.demo import digits_csv, digits_split

        (x, y), _ = digits_split()
        self.folder = tmp_path / "ref"
        data = self.folder / "data" / "train"
        data.mkdir(parents=True)
        (data / "digits-train.csv").write_bytes(digits_csv(x, y))
        (self.folder / "config.json").write_text(json.dumps({**config, "sleep": 0}))
        env = {
            "PATH": os.environ["PATH"],
            "PYTHONPATH": str(ROOT),
            "E31_DATA_DIR": str(data.parent),
            "E31_OUTPUT_DIR": str(self.folder / "output"),
            "E31_CHECKPOINT_DIR": str(self.folder / "checkpoints"),
            "E31_CONFIG": str(self.folder / "config.json"),
            "E31_METRICS_FILE": str(self.folder / "metrics.jsonl"),
            "E31_STOP_FILE": str(self.folder / "stop"),
            "OMP_NUM_THREADS": "1",
            "CUDA_VISIBLE_DEVICES": "",
        }
        self.process = subprocess.Popen([sys.executable, str(EXAMPLE)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    def weights(self):
        try:
            output, _ = self.process.communicate(timeout=120)
        finally:
            if self.process.poll() is None:
                self.process.kill()
        assert self.process.returncode == 0, output.decode(errors="replace")
        return torch.load(self.folder / "output" / "model.pt")


@pytest.fixture
def reference_run(tmp_path):
    """ReferenceRun(config), killed at the end if it is still running."""
    runs = []

    def start(config):
        runs.append(ReferenceRun(tmp_path, config))
        return runs[-1]

    yield start
    for run in runs:
        if run.process.poll() is None:
            run.process.kill()
            run.process.wait()


def job_weights(system, job_id):
    response = system.api("GET", f"/api/jobs/{job_id}/artifacts/model.pt", follow_redirects=True)
    assert response.status_code == 200, response.text
    return torch.load(io.BytesIO(response.content))


def assert_identical(weights, reference):
    assert weights.keys() == reference.keys()
    for name in reference:
        assert torch.equal(weights[name], reference[name]), f"{name} differs from the uninterrupted run"


def timeline(system, job_id, kind):
    return [e for e in system.job(job_id)["timeline"] if e["kind"] == kind]


def submit(system, config, **spec):
    spec = {"name": "resumable", "train_dataset": "digits", "gpus": 1, "span_hours": 1, "config": config, **spec}
    return system.submit(spec, EXAMPLE)["id"]


CONFIG = {"steps": 240, "checkpoint_every": 80, "sleep": 0.04, "eval_every": 40}


@pytest.fixture
def two_runners():
    env = {"E31_NODE_TIMEOUT_SECONDS": str(HEARTBEAT_TIMEOUT), "E31_STOP_GRACE_SECONDS": "5"}
    system = LiveSystem(devices=1, env=env)
    try:
        system.start(runner=False)
        system.start_runner("a", devices=1)
        system.start_runner("b", devices=1)
        yield system
    finally:
        system.stop()


def test_a_runner_killed_mid_run_loses_nothing_and_the_weights_are_bit_identical(two_runners, reference_run):
    system = two_runners
    reference = reference_run(CONFIG)
    job_id = submit(system, CONFIG)
    system.wait_until(lambda: timeline(system, job_id, "checkpoint"), 120, "a checkpoint")
    time.sleep(2)  # work after the checkpoint, lost with the runner
    first_node = system.job(job_id)["allocation"]["node"]
    victim = "a" if first_node == "e2e-a" else "b"
    system.processes[victim].send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    system.processes[victim].wait()

    system.wait_until(
        lambda: (job := system.job(job_id))["state"] == "running" and job["allocation"]["node"] != first_node,
        60,
        "the job to run on the other runner",
    )
    back_after = time.monotonic() - killed_at
    job = system.wait_for_state(job_id, timeout=180)
    assert job["state"] == "succeeded", job
    assert job["restarts"] == 1
    assert back_after < 2 * HEARTBEAT_TIMEOUT + 3, f"running again after {back_after:.1f} s"
    [resume] = timeline(system, job_id, "resume")
    assert resume["step"] == 80
    states = [e["state"] for e in timeline(system, job_id, "state")]
    assert states == ["queued", "starting", "running", "queued", "starting", "running", "succeeded"]
    assert job["credited_seconds"] >= 1  # the time since the last checkpoint went with the node
    assert_identical(job_weights(system, job_id), reference.weights())


def test_two_preemptions_lose_nothing_and_the_weights_are_bit_identical(tmp_path, reference_run):
    config = {**CONFIG, "steps": 300, "checkpoint_every": 20}
    reference = reference_run(config)
    hello = tmp_path / "hello.py"
    hello.write_text("print('urgent work done')\n")
    # Preempted twice in a minute: the hour a preempted job is normally spared is cut short here.
    with LiveSystem(devices=1, env={"E31_STOP_GRACE_SECONDS": "5", "E31_PREEMPT_EVERY_SECONDS": "1"}) as system:
        job_id = submit(system, config, preemptible=True)

        def checkpointed_since_resuming():
            job = system.job(job_id)
            resumes = [e["seq"] for e in job["timeline"] if e["kind"] == "resume"]
            since = resumes[-1] if resumes else 0
            return job["state"] == "running" and any(e["kind"] == "checkpoint" and e["seq"] > since for e in job["timeline"])

        for round_ in (1, 2):
            system.wait_until(checkpointed_since_resuming, 120, "a checkpoint of this run")
            urgent = system.submit({"name": f"urgent {round_}", "train_dataset": "digits", "gpus": 1, "span_hours": 1}, hello)["id"]
            assert system.wait_for_state(urgent, timeout=120)["state"] == "succeeded"
        job = system.wait_for_state(job_id, timeout=180)
        assert job["state"] == "succeeded", job
        assert job["preemptions"] == 2 and job["restarts"] == 2
        resumes = timeline(system, job_id, "resume")
        assert len(resumes) == 2 and resumes[0]["step"] < resumes[1]["step"]
        assert_identical(job_weights(system, job_id), reference.weights())
