"""bench/gpu_check.py, the one script that proves the GPU paths on a GPU node, where no GPU is: it
says so and exits 0 (so CI can run it), and, told --cpu, it runs every one of its checks on the
CPU, so the script itself cannot rot between the rare runs on a GPU."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "gpu_check.py"

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: run bench/gpu_check.py itself")


@pytest.mark.nodb
def test_without_a_gpu_it_says_so_and_exits_0():
    done = subprocess.run([sys.executable, SCRIPT, "--quick"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines[0].startswith("no GPU: torch") and "sees no CUDA device" in lines[0]
    assert lines[-1] == "gpu_check: 0 GPUs seen, nothing proven"


@pytest.mark.e2e
@pytest.mark.bench  # a minute of a live system: once, in bin/test's lane beside the SQLite pass
@pytest.mark.timeout(600)
def test_on_the_cpu_every_check_runs_to_a_verdict(tmp_path):
    """Each check reaches a verdict through a live system: the sandbox starts jobs, a CPU job sees
    no GPU, both recipes run through the platform and directly (their figures are the CPU's, not
    judged), and a run whose runner is killed resumes from its checkpoint to weights identical to
    an uninterrupted run's."""
    report = tmp_path / "report.json"
    done = subprocess.run(
        [sys.executable, SCRIPT, "--quick", "--cpu", "--report", report, "--logs", tmp_path / "logs"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert done.returncode in (0, 1), done.stderr[-3000:]
    checks = {c["name"].split(":")[0].split(" ")[0]: c for c in json.loads(report.read_text())}
    assert set(checks) == {"sandbox", "fencing", "classifier", "charlm", "utilization", "checkpoint,", "gang"}, checks
    for name in ("sandbox", "fencing", "checkpoint,"):
        assert checks[name]["ok"] is True, checks[name]
    for recipe in ("classifier", "charlm"):
        assert "ratio" in checks[recipe]["figures"], checks[recipe]  # both runs ended, whatever the CPU's ratio
    assert checks["checkpoint,"]["figures"]["restarts"] >= 1 and checks["checkpoint,"]["note"] == "weights bit-identical"
    assert checks["gang"]["ok"] is None and "skipped" in checks["gang"]["note"]
    assert {p.name for p in (tmp_path / "logs").iterdir()} >= {"runner.log", "scheduler.log", "web.log"}
    assert done.stdout.strip().splitlines()[-1].startswith("worse recipe's allocation-to-release / direct")
