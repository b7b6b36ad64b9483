"""On a GPU node: a job's sandbox holds its own GPUs' device nodes and no other, CUDA works inside
it, and the precisions a job may ask for run there. Skipped where torch sees no CUDA device (these
machines); run it on a GPU node with `bin/gpu-check`.

The GPU paths are written to be no-ops on the CPU (scheduler/isolation.gpu_device_nodes binds
nothing there; e31/recipes/precision.plan runs fp32 and says so), so the rest of the suite proves
the CPU side; this file is the one short script that proves the other.
"""

import json
import time

import pytest
import torch

from jobs.models import Job
from scheduler import services
from tests.conftest import make_job

pytestmark = [
    pytest.mark.runs_jobs,
    pytest.mark.timeout(300),
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU: run bin/gpu-check on a GPU node"),
]

# What the job reports of its own world: the device nodes it can see, what CUDA says, a step in
# each precision (autocast's dtype, and whether the result is finite), and the processes in its /proc.
SEES = b"""
import glob, json, os, torch
from e31.recipes import common
x = torch.randn(256, 256, device="cuda")
steps = {}
for asked in ("fp32", "bf16", "fp16"):
    os.environ["E31_PRECISION"] = asked
    with common.autocast(torch.device("cuda", 0)):
        y = x @ x
    steps[asked] = [str(y.dtype), bool(torch.isfinite(y.float()).all())]
print(json.dumps({
    "nodes": sorted(glob.glob("/dev/nvidia*")),
    "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
    "count": torch.cuda.device_count(),
    "steps": steps,
    "pids": sorted(int(p) for p in os.listdir("/proc") if p.isdigit()),
}))
"""


def run(runner, job, timeout=240):
    deadline = time.monotonic() + timeout
    while not Job.objects.get(pk=job.pk).is_terminal:
        assert time.monotonic() < deadline, "the job did not end in time"
        services.line_up()
        services.schedule()
        runner.step()
        time.sleep(0.05)
    job.refresh_from_db()
    return job


def test_a_gpu_job_sees_its_own_device_only_and_every_precision_runs(alice, rate, team_a, tmp_path, settings):
    from agent.runner import Runner, detect_device_type

    settings.E31_STOP_GRACE_SECONDS = 1.0
    count = torch.cuda.device_count()
    runner = Runner(name="gpu-node", devices=count, work_dir=tmp_path / "runs", device_type=detect_device_type(), cache_dir=tmp_path / "cache")
    runner.register()
    try:
        job = run(runner, make_job(alice, script=SEES, gpus=1))
    finally:
        runner.stop_all()
    assert job.state == "succeeded", job.reason
    report = next(json.loads(e.text) for e in job.events.filter(kind="log").order_by("seq") if e.text.startswith('{"nodes"'))
    [device] = job.allocations.get().devices
    own = f"/dev/nvidia{device}"
    others = [n for n in report["nodes"] if n[len("/dev/nvidia") :].isdigit() and n != own]
    assert own in report["nodes"] and "/dev/nvidiactl" in report["nodes"] and not others, report["nodes"]
    assert report["visible"] == str(device) and report["count"] == 1
    assert report["steps"] == {"fp32": ["torch.float32", True], "bf16": ["torch.bfloat16", True], "fp16": ["torch.float16", True]}
    assert len(report["pids"]) < 10  # its own processes, not the node's
