"""Checkpoints, metrics, early stopping, preemption and credits, with a real runner and real
job processes (the runner is driven step by step, in this process)."""

import json
import os
import shutil
import time
from datetime import timedelta
from decimal import Decimal
from pathlib import Path

import pytest
from django.utils import timezone

from agent.runner import Runner
from billing.models import Rate, UsageRecord
from jobs.models import Checkpoint, Job
from scheduler import allocations
from scheduler.models import Node
from tests.conftest import make_job
from tests.test_runner import log_lines, run_job, run_until

pytestmark = [pytest.mark.runs_jobs, pytest.mark.timeout(120), pytest.mark.django_db(transaction=True)]

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def runner(db, settings, tmp_path):
    settings.E31_STOP_GRACE_SECONDS = 2.0
    runner = Runner(name="ckpt-node", devices=2, work_dir=tmp_path / "runs", device_type="cpu")
    runner.register()
    yield runner
    runner.stop_all()


def lose_node(settings):
    """The node goes silent now: the scheduler declares it lost once the timeout has passed."""
    last_heard = timezone.now()
    Node.objects.update(last_heartbeat=last_heard)
    assert allocations.expire_lost_nodes(now=last_heard + timedelta(seconds=settings.E31_NODE_TIMEOUT_SECONDS + 1)) == 1


# Writes a checkpoint file every 0.4 s the way a script without the SDK would (temporary name,
# then rename), counting on from the checkpoint it finds; the first run waits to be lost.
COUNTING = b"""
import os, sys, time, pathlib
folder = pathlib.Path(os.environ["E31_CHECKPOINT_DIR"])
found = sorted(folder.glob("ckpt-*.bin"))
start = int(found[-1].stem.split("-")[1]) if found else 0
print(f"start {start} restart {os.environ['E31_RESTART']}", flush=True)
for i in range(start + 1, start + 5):
    tmp = folder / f".ckpt-{i}.tmp"
    tmp.write_bytes(str(i).encode() * 1000)
    os.replace(tmp, folder / f"ckpt-{i}.bin")
    time.sleep(0.4)
if start == 0:
    time.sleep(600)
open(os.path.join(os.environ["E31_OUTPUT_DIR"], "done.txt"), "w").write(str(start))
"""


def test_checkpoints_are_uploaded_pruned_and_restored_after_the_node_is_lost(runner, alice, rate, settings):
    job = make_job(alice, script=COUNTING, keep_checkpoints=2)
    kept = Checkpoint.objects.filter(job=job, pruned_at__isnull=True)
    # Four uploaded, and the pruning after the fourth done.
    run_until(runner, lambda: Checkpoint.objects.filter(job=job).count() >= 4 and kept.count() == 2)
    assert sorted(kept.values_list("name", flat=True)) == ["ckpt-3.bin", "ckpt-4.bin"]
    assert [c.step for c in Checkpoint.objects.filter(job=job)] == [1, 2, 3, 4]
    pruned = Checkpoint.objects.filter(job=job, pruned_at__isnull=False)
    assert pruned.count() == 2
    from core.storage import get_storage

    # Their objects go once the rows say so (agent.checkpoints.prune, on the upload thread).
    run_until(runner, lambda: not any(get_storage().exists(c.key) for c in pruned))
    assert all(get_storage().exists(c.key) for c in kept)

    time.sleep(2.1)  # work done after the last checkpoint, lost with the node
    lose_node(settings)
    runner.heartbeat()  # the node comes back; its job went back to the queue meanwhile
    job = run_job(runner, job)
    assert job.state == "succeeded" and job.restarts == 1
    assert ("stdout", "start 4 restart 1") in log_lines(job)
    resume = job.events.get(kind="resume")
    assert resume.data["name"] == "ckpt-4.bin" and resume.data["step"] == 4
    kinds = list(job.timeline().values_list("kind", flat=True))
    assert kinds.count("checkpoint") == 8 and "resume" in kinds
    assert kinds.index("resume") > kinds.index("checkpoint")
    # The first run was lost after its last checkpoint: the time since it is credited.
    lost = UsageRecord.objects.get(job=job, allocation__end_reason="node_lost")
    assert 2 <= lost.credit_seconds < lost.held_seconds
    assert lost.credit_amount > 0 and "lost" in lost.credit_reason
    finished = UsageRecord.objects.get(job=job, allocation__end_reason="exited")
    assert finished.credit_seconds == 0


def test_a_job_lost_more_often_than_it_may_be_restarted_fails(runner, alice, rate, settings):
    job = make_job(alice, script=b"import time\nprint('up', flush=True)\ntime.sleep(600)\n", max_restarts=0)
    run_until(runner, lambda: bool(log_lines(job)))
    lose_node(settings)
    job.refresh_from_db()
    assert job.state == "failed"
    assert "restarted 0 times, its limit is 0" in job.reason


def metric_points(job):
    return [(e.data["step"], e.data["values"]) for e in job.events.filter(kind="metric").order_by("seq")]


EARLY = b"""
import os, time
from e31 import log_metric, should_stop
for step, value in enumerate([1.0, 0.8, 0.7, 0.75, 0.72, 0.71, 0.69, 0.5], start=1):
    log_metric(step, val_loss=value, loss=2.0 / step)
    for _ in range(20):
        if should_stop():
            open(os.path.join(os.environ["E31_OUTPUT_DIR"], "model.pt"), "w").write(f"weights at {step}")
            print(f"stopping at {step}", flush=True)
            raise SystemExit(0)
        time.sleep(0.05)
print("ran to the end", flush=True)
"""


def test_early_stopping_ends_the_run_when_the_metric_stops_improving(runner, alice, rate):
    job = run_job(runner, make_job(alice, script=EARLY, early_stop_metric="val_loss", early_stop_patience=3))
    assert job.state == "succeeded", job.reason
    assert job.reason == "stopped early: val_loss has not improved for 3 evaluations (best 0.7 at step 3)"
    assert ("stdout", "ran to the end") not in log_lines(job)
    assert any(text.startswith("stopping at 6") for _, text in log_lines(job))
    assert job.artifacts.filter(name="model.pt").exists()
    points = metric_points(job)
    assert points[0] == (1, {"val_loss": 1.0, "loss": 2.0})
    assert [p[0] for p in points] == list(range(1, len(points) + 1))
    assert job.allocations.get().end_reason == "early_stop"


NAN = b"""
import time
from e31 import log_metric, should_stop
for step in range(1, 200):
    log_metric(step, loss=float("nan") if step >= 5 else 1.0 / step)
    if should_stop():
        print(f"told to stop at {step}", flush=True)
        break
    time.sleep(0.05)
"""


def test_a_nan_loss_stops_the_run_as_failed(runner, alice, rate):
    job = run_job(runner, make_job(alice, script=NAN))
    assert job.state == "failed"
    assert job.reason.startswith("the loss became NaN at step 5")
    assert (5, {"loss": "NaN"}) in metric_points(job)
    assert job.allocations.get().end_reason == "early_stop"


def test_the_nan_stop_can_be_turned_off(runner, alice, rate):
    job = run_job(runner, make_job(alice, script=NAN.replace(b"range(1, 200)", b"range(1, 10)"), stop_on_nan=False))
    assert job.state == "succeeded"
    assert (9, {"loss": "NaN"}) in metric_points(job)


def test_lines_of_the_metrics_file_that_are_not_points_are_skipped_with_one_notice(runner, alice, rate):
    script = b"""
import json, os
with open(os.environ["E31_METRICS_FILE"], "a") as out:
    out.write("not json\\n")
    out.write(json.dumps({"step": 1, "values": {"loss": 0.5, "": 1, "flag": True}}) + "\\n")
    out.write(json.dumps({"step": "two", "values": {"loss": 0.4}}) + "\\n")
    out.write(json.dumps({"step": 3, "values": {"loss": "Infinity", "acc": 0.9}}) + "\\n")
"""
    job = run_job(runner, make_job(alice, script=script, stop_on_nan=False))
    assert metric_points(job) == [(1, {"loss": 0.5}), (3, {"loss": "Infinity", "acc": 0.9})]
    notices = [e.data["text"] for e in job.events.filter(kind="notice")]
    assert sum("not a metric point" in n for n in notices) == 1


SDK_LOOP = b"""
import os, time, torch
from e31 import checkpoint, resume, should_stop
model = torch.nn.Linear(4, 2)
state = resume(model=model)
step = state.step if state else 0
print(f"starting at {step}", flush=True)
while True:
    step += 1
    with torch.no_grad():
        model.weight.add_(1.0)
    if step % 5 == 0 or should_stop():
        checkpoint(step, model=model)
    if should_stop():
        print(f"stopping at {step}", flush=True)
        break
    time.sleep(0.1)
"""


def test_at_the_ceiling_the_job_checkpoints_and_its_latest_weights_come_back(runner, alice, rate):
    # 0.02 buys 10 s: on a loaded machine importing torch alone can take 5, and a SIGTERM that
    # comes before the script has imported the SDK ends it without its "stopping at".
    Rate.objects.create(gpu_type="", per_gpu_hour=Decimal("7.20"))
    job = run_job(runner, make_job(alice, script=SDK_LOOP, span_hours=None, ceiling_amount=Decimal("0.02")))
    assert job.state == "stopped" and "ceiling is reached" in job.reason
    assert any(text.startswith("stopping at") for _, text in log_lines(job))
    [artifact] = job.artifacts.all()
    latest = Checkpoint.objects.filter(job=job).order_by("-written_at").first()
    assert artifact.name == f"checkpoints/{latest.name}" and artifact.sha256 == latest.sha256
    usage = UsageRecord.objects.get(job=job)
    assert usage.amount <= Decimal("0.02") and usage.held_seconds <= 10


def test_a_preemptible_job_makes_room_checkpoints_and_resumes(runner, alice, rate, settings):
    Rate.objects.create(gpu_type="", per_gpu_hour=Decimal("2.40"), preemptible_per_gpu_hour=Decimal("0.80"))
    cheap = make_job(alice, script=SDK_LOOP.replace(b"while True:", b"while step < 30:"), gpus=2, preemptible=True, name="cheap")
    run_until(runner, lambda: Checkpoint.objects.filter(job=cheap).exists())
    first = cheap.allocations.get()
    assert first.rate == Decimal("0.80") and first.preemptible
    urgent = make_job(alice, script=b"print('urgent work')\n", gpus=2, name="urgent")
    run_until(runner, lambda: Job.objects.get(pk=urgent.pk).is_terminal, timeout=60)
    cheap.refresh_from_db()
    first.refresh_from_db()
    assert first.end_reason == "preempted"
    assert cheap.preemptions == 1 and cheap.restarts == 1
    urgent_allocation = Job.objects.get(pk=urgent.pk).allocations.get()
    assert urgent_allocation.started_at >= first.ended_at  # it waited for the devices to come back
    cheap = run_job(runner, cheap)
    assert cheap.state == "succeeded"
    lines = [text for _, text in log_lines(cheap)]
    # On two devices it runs as two processes (torchrun) that do not wait for each other: rank 0
    # checkpoints when told to stop and resumes from that checkpoint (rank 1, started a moment
    # later, may already find a newer one that rank 0 wrote since).
    resumed = cheap.events.get(kind="resume").data["step"]
    assert f"stopping at {resumed}" in lines and f"starting at {resumed}" in lines, lines
    usage = UsageRecord.objects.get(allocation=first)
    assert usage.credit_seconds <= 2  # it checkpointed on the notice: little was lost


def test_an_unmodified_sagemaker_script_runs(runner, alice, rate, team_a):
    from e31web.demo import add_dataset, digits_csv, digits_split

    script = (ROOT / "examples" / "sagemaker" / "train.py").read_bytes()
    (x, y), _ = digits_split()
    dataset = add_dataset(team_a, "digits", {"digits-train.csv": digits_csv(x[:400], y[:400])})
    job = make_job(
        alice,
        script=script,
        train_version=dataset.latest_version(),
        config={"epochs": 2, "lr": 0.01},
        args=["--epochs", "2"],
    )
    job = run_job(runner, job, timeout=90)
    assert job.state == "succeeded", log_lines(job)[-20:]
    names = set(job.artifacts.values_list("name", flat=True))
    assert "model.pth" in names and "data/metrics.json" in names


def test_the_job_environment_has_the_sdk_and_sagemaker_names(runner, alice, rate):
    script = b"""
import json, os
keys = ["E31_METRICS_FILE", "E31_STOP_FILE", "E31_RESTART", "SM_MODEL_DIR", "SM_OUTPUT_DATA_DIR",
        "SM_CHANNEL_TRAIN", "SM_CHANNEL_HELDOUT", "SM_NUM_GPUS", "SM_HPS", "SM_HP_EPOCHS"]
print(json.dumps({k: os.environ.get(k) for k in keys}), flush=True)
"""
    job = run_job(runner, make_job(alice, script=script, config={"epochs": 3, "name": "x"}))
    env = json.loads(next(text for stream, text in log_lines(job) if stream == "stdout"))
    assert env["SM_MODEL_DIR"].endswith("/output") and env["SM_OUTPUT_DATA_DIR"].endswith("/output/data")
    assert env["SM_CHANNEL_TRAIN"].endswith("/data/train") and env["SM_CHANNEL_HELDOUT"].endswith("/data/heldout")
    assert env["SM_NUM_GPUS"] == "0" and json.loads(env["SM_HPS"]) == {"epochs": 3, "name": "x"}
    assert env["SM_HP_EPOCHS"] == "3" and env["E31_RESTART"] == "0"
    assert env["E31_METRICS_FILE"].endswith("/.e31/metrics.jsonl") and env["E31_STOP_FILE"].endswith("/.e31/stop")


@pytest.mark.skipif(not shutil.which("bwrap"), reason="needs bubblewrap")
def test_a_job_whose_runner_dies_is_killed_with_it(tmp_path):
    """The kernel kills a job whose runner died (no training left running unwatched): the
    runner's own launch path, the shim then bwrap, from a process that is then SIGKILLed."""
    import subprocess
    import sys

    from tests.test_isolation import host_pids_with

    marker = f"e31-orphan-{os.urandom(8).hex()}"
    folder = tmp_path / "job"
    folder.mkdir()
    runner_code = (
        "import json, os, subprocess, sys, time\n"
        "from agent.isolation import View, args_file, sandbox_args, shim_command, system_folders\n"
        f"view = View(root={str(folder)!r}, cwd={str(folder)!r}, system=system_folders(), runtime=(sys.base_prefix, sys.prefix))\n"
        "fd = args_file(sandbox_args(view))\n"
        f"spec = {{'cwd': {str(folder)!r}, 'bwrap': {shutil.which('bwrap')!r}, 'args_fd': fd}}\n"
        f"subprocess.Popen(shim_command([sys.executable, '-c', 'import time; time.sleep(600)', {marker!r}], spec), pass_fds=(fd,))\n"
        "time.sleep(600)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", runner_code], cwd=ROOT)
    try:
        deadline = time.monotonic() + 20
        while not host_pids_with(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert host_pids_with(marker), "the job started"
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 10
        while host_pids_with(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not host_pids_with(marker), "the job outlived its runner"
    finally:
        parent.kill()


def test_a_run_needing_twice_its_money_ceiling_stops_at_it_with_its_weights(runner, alice, rate, team_a):
    from e31web.demo import add_dataset, digits_csv, digits_split

    Rate.objects.create(gpu_type="", per_gpu_hour=Decimal("3.60"))  # 0.01 buys 10 s of one device
    (x, y), _ = digits_split()
    dataset = add_dataset(team_a, "digits", {"digits-train.csv": digits_csv(x[:500], y[:500])})
    script = (ROOT / "examples" / "resumable" / "train.py").read_bytes()
    # 400 steps with 0.05 s of sleep each: at least 20 s, so at least 0.02 of money.
    config = {"steps": 400, "sleep": 0.05, "checkpoint_every": 20, "eval_every": 20}
    job = make_job(alice, script=script, train_version=dataset.latest_version(), config=config, span_hours=None, ceiling_amount=Decimal("0.01"))
    job = run_job(runner, job, timeout=90)
    assert job.state == "stopped" and "ceiling is reached" in job.reason
    assert job.artifacts.filter(name="model.pt").exists()  # the weights so far, written when told to stop
    assert Checkpoint.objects.filter(job=job).exists()
    usage = UsageRecord.objects.get(job=job)
    assert usage.amount <= Decimal("0.01") and usage.held_seconds <= 10
    steps = [p[0] for p in metric_points(job) if "loss" in p[1]]
    assert 0 < max(steps) < 400
