"""The pipeline-parallel example (examples/pipeline/train.py) runs under torchrun as a job runs it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.nodb  # plain processes and tensors: run once, with the SQLite pass


def test_it_trains_two_stages_and_writes_each_stage(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"steps": 25}))
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("E31_", "TORCHELASTIC_")) and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update(
        PYTHONPATH=str(ROOT),
        OMP_NUM_THREADS="1",
        CUDA_VISIBLE_DEVICES="",
        E31_OUTPUT_DIR=str(tmp_path / "out"),
        E31_CONFIG=str(tmp_path / "config.json"),
        E31_METRICS_FILE=str(tmp_path / "metrics.jsonl"),
        E31_STOP_FILE=str(tmp_path / "stop"),
        E31_CHECKPOINT_DIR=str(tmp_path / "ckpt"),
    )
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "examples/pipeline/train.py"]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr

    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(1, 26))  # one line a step: only rank 0 writes
    losses = [line["values"]["loss"] for line in lines]
    assert sum(losses[-5:]) / 5 < 0.6 * sum(losses[:5]) / 5

    first = torch.load(tmp_path / "out" / "stage0.pt", weights_only=True)
    second = torch.load(tmp_path / "out" / "stage1.pt", weights_only=True)
    assert first["0.weight"].shape == (64, 16) and second["2.weight"].shape == (4, 64)
