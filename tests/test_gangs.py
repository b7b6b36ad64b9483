"""Runs bigger than one device or one node: placed as one gang (all or nothing), started with
torchrun (c10d rendezvous at node 0's runner), logs marked with each process's rank, and a gang
that lives and dies as one. Real multi-process and multi-runner runs on the CPU (gloo)."""

from datetime import timedelta

import pytest
from django.utils import timezone

from jobs.models import Job
from scheduler import allocations as ending
from scheduler import services
from scheduler.models import Allocation, Node
from tests.conftest import make_job, schedule_now

# Data-parallel linear regression with the SDK: each process takes its share (rank::world) of
# the step's global batch of 32 rows; DDP averages the gradients, so any number of processes
# takes the steps one process would. Rank 0 checkpoints, logs and writes the weights.
DDP_SCRIPT = b"""
import json, os, time
import torch
import torch.distributed as dist
import e31

config = json.load(open(os.environ["E31_CONFIG"])) if os.path.exists(os.environ.get("E31_CONFIG", "")) else {}
steps, pause = int(config.get("steps", 40)), float(config.get("sleep", 0))
if os.environ.get("E31_RESTART", "0") != "0":  # a resumed run may go faster (config "resumed_sleep")
    pause = float(config.get("resumed_sleep", pause))
rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
if world > 1:
    dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
module = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
data = torch.Generator().manual_seed(1)
x = torch.randn(512, 8, generator=data)
y = x @ torch.randn(8, 1, generator=data) + 0.1
state = e31.resume(model=model, optimizer=optimizer)
start = state.step + 1 if state else 1
print(f"process {rank} of {world} starts at step {start}", flush=True)
for step in range(start, steps + 1):
    rows = torch.arange((step - 1) * 32, step * 32) % len(x)
    mine = rows[rank::world]
    loss = torch.nn.functional.mse_loss(module(x[mine]), y[mine])
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    e31.log_metric(step, loss=loss.item())
    stopping = e31.should_stop()
    if stopping or step % 5 == 0:
        e31.checkpoint(step, model=model, optimizer=optimizer)
    if stopping:
        break
    time.sleep(pause)
if rank == 0:
    torch.save(model.state_dict(), os.path.join(os.environ["E31_OUTPUT_DIR"], "model.pt"))
print(f"process {rank} done", flush=True)
"""


@pytest.fixture
def nodes(db):
    return [Node.objects.create(name=f"n{i}", device_type="cpu", devices=1, address="127.0.0.1") for i in (1, 2)]


# Placement -------------------------------------------------------------------------------------


def test_a_gang_never_starts_partly(alice, rate, nodes):
    other = make_job(alice, name="other")
    Allocation.objects.create(job=other, node=nodes[1], devices=[0], device_type="cpu", rate=rate.per_gpu_hour, started_at=timezone.now())
    job = make_job(alice, name="wide", gpus=2)
    assert [a.job_id for a in schedule_now()] == []
    job.refresh_from_db()
    assert job.state == "queued" and not job.allocations.exists()
    assert job.wait_reason, "the job waits with the reason shown"


def test_a_gang_is_held_whole_at_one_moment(alice, rate, nodes):
    job = make_job(alice, name="wide", gpus=2, ceiling_amount=None)
    [_first] = schedule_now()
    allocations = list(job.allocations.order_by("node_rank"))
    assert [a.node.name for a in allocations] == ["n1", "n2"] or [a.node.name for a in allocations] == ["n2", "n1"]
    assert len({a.gang for a in allocations}) == 1 and allocations[0].gang is not None
    assert [a.node_rank for a in allocations] == [0, 1] and {a.gang_size for a in allocations} == {2}
    assert len({a.started_at for a in allocations}) == 1, "the meter starts when the whole gang is held"
    job.refresh_from_db()
    assert job.state == "starting" and "a gang of 2 nodes" in job.timeline().last().data["reason"]
    # The meter covers every node: two devices held.
    later = allocations[0].started_at + timedelta(seconds=100)
    assert job.held(later)[0] == 200
    # Preempting one part asks the whole gang to give its devices back.
    Allocation.objects.update(preemptible=True)
    assert ending.preempt(allocations[1].pk, "test")
    assert Allocation.objects.filter(job=job, preempt_requested_at__isnull=False).count() == 2


def test_a_requeued_gang_waits_until_every_part_is_released(alice, rate, nodes):
    job = make_job(alice, name="wide", gpus=2)
    schedule_now()
    first, second = job.allocations.order_by("node_rank")
    ending.end_allocation(first, timezone.now(), Allocation.EXITED, "queued", "requeued: a rank failed")
    job.refresh_from_db()
    assert job.state == "queued"
    assert str(job.pk) not in {q.id for q in services.queued_jobs(staged=False)}  # node 2 still holds its part
    second.release(timezone.now(), Allocation.GANG_STOPPED)
    assert str(job.pk) in {q.id for q in services.queued_jobs(staged=False)}


def test_a_gang_succeeds_when_node_0_ends_not_when_another_node_finishes_first(alice, rate, nodes):
    # Rank 0 writes the outputs, kept by node 0's runner: a job seen succeeded must have them.
    job = make_job(alice, name="wide", gpus=2)
    schedule_now()
    Job.objects.filter(pk=job.pk).update(state="running")  # both runners launched their ranks
    first, second = job.allocations.order_by("node_rank")
    assert ending.end_allocation(second, timezone.now(), Allocation.EXITED, "succeeded", "the process exited with code 0")
    job.refresh_from_db()
    second.refresh_from_db()
    assert second.ended_at is not None and job.state == "running", "node 1's part is done; the job waits for node 0"
    assert not ending.gang_broken(job.state, [second.end_reason]), "node 0 is not told to stop"
    assert ending.end_allocation(first, timezone.now(), Allocation.EXITED, "succeeded", "the process exited with code 0")
    job.refresh_from_db()
    assert job.state == "succeeded" and job.finished_at is not None


def test_a_gang_breaks_when_a_part_ends_and_the_job_left_its_compute():
    assert ending.gang_broken("queued", [Allocation.EXITED])  # a rank failed: requeued
    assert ending.gang_broken("failed", [Allocation.EXITED])
    assert ending.gang_broken("running", [Allocation.NODE_LOST])
    assert ending.gang_broken("running", [Allocation.EXITED, Allocation.GANG_STOPPED])
    assert not ending.gang_broken("succeeded", [Allocation.EXITED])  # the others finish on their own
    assert not ending.gang_broken("running", [Allocation.EXITED])  # a part finished before node 0
    assert not ending.gang_broken("running", [])


# Real runs -----------------------------------------------------------------------------------------

import io  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

from tests.system import ROOT, LiveSystem  # noqa: E402

CONFIG = {"steps": 40}


class ReferenceRun:
    """The script in one process, outside the network: the weights every run must end with.

    Started in the background (it runs while a test's system starts and its jobs run) and
    waited for in weights(). The pause between steps ("sleep") changes no number, so the
    reference runs without it."""

    def __init__(self, folder, config):
        config = {k: v for k, v in config.items() if k != "sleep"}
        self.folder = folder
        folder.mkdir(parents=True)
        script = folder / "train.py"
        script.write_bytes(DDP_SCRIPT)
        (folder / "config.json").write_text(json.dumps(config))
        env = {
            "PATH": os.environ["PATH"],
            "PYTHONPATH": str(ROOT),
            "OMP_NUM_THREADS": "1",
            "CUDA_VISIBLE_DEVICES": "",
            "E31_OUTPUT_DIR": str(folder),
            "E31_CHECKPOINT_DIR": str(folder / "ckpt"),
            "E31_CONFIG": str(folder / "config.json"),
            "E31_METRICS_FILE": str(folder / "metrics.jsonl"),
        }
        self.process = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self._weights = None

    def weights(self):
        if self._weights is None:
            output, _ = self.process.communicate(timeout=120)
            assert self.process.returncode == 0, output.decode(errors="replace")
            import torch

            self._weights = torch.load(self.folder / "model.pt")
        return self._weights

    def close(self):
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The weights of CONFIG's run in one process, for every test here (they differ only in
    their pauses)."""
    run = ReferenceRun(tmp_path_factory.mktemp("gang-reference") / "ref", CONFIG)
    yield run
    run.close()


def assert_close(weights, reference):
    import torch

    assert weights.keys() == reference.keys()
    for name in reference:
        assert torch.allclose(weights[name], reference[name], atol=1e-6), f"{name}: {weights[name]} vs {reference[name]}"


def job_weights(system, job_id):
    import torch

    response = system.api("GET", f"/api/jobs/{job_id}/artifacts/model.pt", follow_redirects=True)
    assert response.status_code == 200, response.text
    return torch.load(io.BytesIO(response.content))


def submit(system, tmp_path, gpus, config, processes=None):
    script = tmp_path / "train.py"
    script.write_bytes(DDP_SCRIPT)
    spec = {"name": f"ddp-{gpus}", "gpus": gpus, "span_hours": 1, "config": config, "max_restarts": 3, "train_dataset": "digits"}
    if processes:
        spec["processes"] = processes  # CPU slots run one process (with a thread each) unless asked
    return system.submit(spec, script)["id"]


def log_ranks(system, job_id):
    lines = system.api("GET", f"/api/jobs/{job_id}/logs/?limit=5000").json()["lines"]
    return {line["rank"] for line in lines if line["text"].startswith("process ")}


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_two_ranks_on_one_runner_and_two_nodes_end_with_the_weights_of_one_process(tmp_path, reference):
    system = LiveSystem(devices=2)
    try:
        system.start(runner=False)
        system.start_runner("two", devices=2)
        one_runner = submit(system, tmp_path, 2, CONFIG, processes=2)
        job = system.wait_for_state(one_runner, timeout=180)
        assert job["state"] == "succeeded", (job, system.logs())
        assert [a["node"] for a in job["allocations"]] == ["e2e-two"] and job["allocations"][0]["devices"] == [0, 1]
        assert_close(job_weights(system, one_runner), reference.weights())
        assert log_ranks(system, one_runner) == {0, 1}
        # Only rank 1's lines, on request.
        lines = system.api("GET", f"/api/jobs/{one_runner}/logs/?rank=1").json()["lines"]
        assert lines and {line["rank"] for line in lines} == {1}

        # Two runner processes with one slot each: a gang of two nodes.
        system.processes["two"].send_signal(signal.SIGTERM)
        system.processes["two"].wait(30)
        system.start_runner("a", devices=1)
        system.start_runner("b", devices=1)
        two_nodes = submit(system, tmp_path, 2, CONFIG)
        job = system.wait_for_state(two_nodes, timeout=180)
        assert job["state"] == "succeeded", (job, system.logs())
        assert sorted(a["node"] for a in job["allocations"]) == ["e2e-a", "e2e-b"]
        assert [a["node_rank"] for a in job["allocations"]] == [0, 1] and {a["gang_size"] for a in job["allocations"]} == {2}
        assert len({a["started_at"] for a in job["allocations"]}) == 1
        assert_close(job_weights(system, two_nodes), reference.weights())
        assert log_ranks(system, two_nodes) == {0, 1}
        # Its meter: both nodes' held time, one usage record each. The job ends with node 0's
        # release; node 1's record is final when its own runner sees its processes gone, a moment
        # before or after.
        deadline = time.monotonic() + 30
        while True:
            records = [r for r in system.api("GET", "/api/usage/").json()["records"] if r["job_id"] == two_nodes]
            if len(records) == 2 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        job = system.job(two_nodes)
        assert len(records) == 2 and job["held_seconds"] == sum(r["held_seconds"] for r in records)
    finally:
        system.stop()


@pytest.mark.e2e
@pytest.mark.timeout(400)
def test_a_gang_that_loses_a_runner_stops_whole_and_resumes_from_its_checkpoint(tmp_path, reference):
    config = {**CONFIG, "sleep": 0.2}  # the reference's run, with pauses to stop it in
    system = LiveSystem(devices=1, env={"E31_NODE_TIMEOUT_SECONDS": "3", "E31_STOP_GRACE_SECONDS": "2"})
    try:
        system.start(runner=False)
        system.start_runner("a", devices=1)
        system.start_runner("b", devices=1)
        job_id = submit(system, tmp_path, 2, config)
        system.wait_until(lambda: [e for e in system.job(job_id)["timeline"] if e["kind"] == "checkpoint"], 120, "a checkpoint")
        time.sleep(1)
        system.processes["b"].send_signal(signal.SIGKILL)
        system.processes["b"].wait()
        # The other rank is stopped too and both devices are released: the job goes back to the queue.
        first = system.wait_until(
            lambda: (j := system.job(job_id))["restarts"] == 1 and all(a["ended_at"] for a in j["allocations"]) and j["allocations"],
            60,
            "the whole gang to be released",
        )
        ended = sorted(a["ended_at"] for a in first)
        from tests.system import parse_time

        assert (parse_time(ended[-1]) - parse_time(ended[0])).total_seconds() < 10, first
        system.start_runner("c", devices=1)
        job = system.wait_for_state(job_id, timeout=240)
        assert job["state"] == "succeeded", (job, system.logs())
        assert job["restarts"] == 1
        assert sorted(a["node"] for a in job["allocations"]) == ["e2e-a", "e2e-c"]
        resumes = [e for e in job["timeline"] if e["kind"] == "resume"]
        assert resumes and resumes[0]["step"] >= 5
        assert_close(job_weights(system, job_id), reference.weights())
        # No process of it is left on the machine.
        leftover = subprocess.run(["pgrep", "-f", f"E31_JOB_ID={job_id}"], capture_output=True, text=True).stdout
        assert not leftover.strip()
    finally:
        system.stop()


def test_log_lines_keep_their_rank_and_the_page_filters_by_it(alice, client):
    from jobs.models import JobEvent

    job = make_job(alice, name="ranked")
    now = timezone.now()
    JobEvent.append_lines(job.pk, [("stdout", now, "torchrun says hello"), ("stdout", now, "step 1", 0), ("stderr", now, "step 1", 1)])
    client.force_login(alice)
    page = client.get(f"/jobs/{job.pk}/").content.decode()
    assert 'id="rank-filter"' in page and '<option value="0">0</option>' in page and '<option value="1">1</option>' in page
    assert 'data-rank="1"><span class="rank">[1]</span> step 1' in page
    lines = client.get(f"/api/jobs/{job.pk}/logs/?rank=0").json()["lines"]
    assert [(line["rank"], line["text"]) for line in lines] == [(0, "step 1")]
    assert client.get(f"/api/jobs/{job.pk}/logs/?rank=x").status_code == 400
    # The downloaded log keeps each line's rank.
    text = b"".join(client.get(f"/jobs/{job.pk}/log.txt").streaming_content).decode()
    assert text == "torchrun says hello\n[rank0]:step 1\n[rank1]:step 1\n"


def test_a_gang_larger_than_any_node_is_staged_on_enough_nodes():
    from scheduler import policy

    nodes = [policy.NodeState(id=i, device_type="cpu", devices=d, free=tuple(range(d))) for i, d in (("a", 2), ("b", 1), ("c", 2))]
    wide = policy.QueuedJob(id="j", gpus=4, submitted_at=0)
    assert policy.choose_staging_nodes(wide, nodes, {}, {}) == ["a", "c"]  # the biggest first: fewest nodes
    assert policy.choose_staging_nodes(wide, nodes, {"b": 10}, {}) == ["b", "a", "c"]  # where its data already is
    assert policy.choose_staging_nodes(wide, nodes, {}, {}, exclude={"a"}) == ["c"]  # a stages it already
    assert policy.choose_staging_nodes(policy.QueuedJob(id="k", gpus=6, submitted_at=0), nodes, {}, {}) == []
    assert policy.choose_staging_nodes(policy.QueuedJob(id="s", gpus=2, submitted_at=0), nodes, {}, {}) == ["a"]
