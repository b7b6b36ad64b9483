"""The digits job through a real single-node Slurm (tests/slurm_cluster.py), end to end: the
scheduler with E31_EXECUTOR=slurm reads the node from Slurm, places the job there, submits it
with sbatch running our agent for the allocation; the job runs with a live log and meter, its
weights come back, and the billed seconds are Slurm's elapsed time. Another user's Slurm job
holding the node's CPUs delays it, and shows as the reason it waits, and is never touched."""

import subprocess
import time

import pytest

from tests.slurm_cluster import slurm  # noqa: F401 - the fixture
from tests.system import LiveSystem
from tests.test_e2e import EXAMPLE, heldout_accuracy


def slurm_elapsed(cluster, handle):
    """(start, end) of a Slurm job as scontrol prints them, in seconds since the epoch."""
    from scheduler.executors.slurm import parse_job, parse_records

    done = subprocess.run(["scontrol", "show", "job", "-o", handle], env={**cluster.env, "TZ": "UTC"}, capture_output=True, text=True, check=True)
    status = parse_job(parse_records(done.stdout)[0])
    return status


@pytest.mark.bench  # a real Slurm and a whole system: once, in bin/test's lane
@pytest.mark.e2e
@pytest.mark.timeout(400)
def test_the_digits_job_runs_through_slurm_and_bills_slurms_elapsed_time(slurm):  # noqa: F811
    env = {
        "E31_EXECUTOR": "slurm",
        "E31_SLURM_CONF": str(slurm.conf),
        "E31_SLURM_PARTITIONS": slurm.partition,
        "E31_ENGINE_SECONDS": "0.5",
        "E31_ENGINE_MEMORY_MB_PER_DEVICE": "512",
    }
    system = LiveSystem(env=env)
    other = None
    try:
        system.start(runner=False)
        # Another user's job holds every CPU of the node first.
        other = slurm.run("sbatch", "--parsable", f"--cpus-per-task={slurm.cpus}", "--mem=64M", "--chdir=/tmp", "--wrap", "sleep 25").stdout.strip()
        system.wait_until(lambda: slurm.run("squeue", "--noheader", "--jobs", other, "--format=%T").stdout.strip() == "RUNNING", 30, "the other job to run")
        time.sleep(2)  # the scheduler reads the node again (every 0.5 s here)
        job = system.submit({"name": "digits-slurm", "train_dataset": "digits", "gpus": 1, "span_hours": 0.25, "config": {"epochs": 5}}, EXAMPLE)
        waiting = system.wait_until(
            lambda: "held by other users' jobs on the cluster" in (system.job(job["id"]).get("wait_reason") or "") and system.job(job["id"]),
            60,
            "the job to wait for the other user's CPUs",
        )
        assert waiting["state"] == "queued" and waiting["held_seconds"] == 0, "queued with the meter stopped"
        assert slurm.run("squeue", "--noheader", "--jobs", other, "--format=%T").stdout.strip() == "RUNNING"

        # Once theirs ends, ours runs through Slurm: a live meter, then succeeded with its weights.
        running = system.wait_until(lambda: (j := system.job(job["id"]))["state"] in ("running", "succeeded", "failed") and j, 120, "the job to start")
        assert running["state"] != "failed", system.logs()
        if running["state"] == "running":  # its meter runs while it does (a quick machine may have finished already)
            live = system.wait_until(lambda: (j := system.job(job["id"]))["held_seconds"] > 0 and j, 60, "the meter to run")
            assert live["state"] in ("running", "succeeded")
        done = system.wait_for_state(job["id"], timeout=240)
        assert done["state"] == "succeeded", (done, system.logs())
        [allocation] = done["allocations"]
        assert allocation["node"] == slurm.node
        weights = system.api("GET", f"/api/jobs/{job['id']}/artifacts/model.pt", follow_redirects=True)
        assert weights.status_code == 200, weights.text
        assert heldout_accuracy(weights.content) > 0.8
        assert any("epoch" in line for line in system.log_lines(job["id"]))

        # Billed: what Slurm held, within a second.
        handles = system.manage(
            "shell", "-c", f"from scheduler.models import Allocation; print(Allocation.objects.get(job_id='{job['id']}').engine_handle)"
        ).split()
        status = slurm_elapsed(slurm, handles[-1])
        assert status.engine_state == "COMPLETED"
        elapsed = (status.ended_at - status.started_at).total_seconds()
        assert abs(done["held_seconds"] - elapsed) <= 1.0, (done["held_seconds"], elapsed)
        # The other user's job ran to its end, untouched.
        finished = slurm.run("scontrol", "show", "job", "-o", other).stdout
        assert "JobState=COMPLETED" in finished, finished
    finally:
        if other:
            slurm.run("scancel", other, check=False)
        system.stop()
        deadline = time.monotonic() + 30
        while slurm.squeue_ids() and time.monotonic() < deadline:
            time.sleep(0.5)
