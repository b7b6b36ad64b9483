"""The job SDK (e31/) and the resumable example. No database: these run without Django's db."""

import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import e31

pytestmark = pytest.mark.nodb

ROOT = Path(__file__).resolve().parent.parent
RESUMABLE = ROOT / "examples" / "resumable" / "train.py"


@pytest.fixture(autouse=True)
def fresh_sdk(tmp_path, monkeypatch):
    """Each test: a fresh SDK state, its own checkpoint folder, no job variables, and the
    process's SIGTERM handler put back afterwards."""
    for name in ("E31_METRICS_FILE", "E31_STOP_FILE", "RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("E31_CHECKPOINT_DIR", str(tmp_path / "ckpt"))
    monkeypatch.setattr(e31, "_state", e31._State())
    previous = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, previous)


def subprocess_env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("E31_", "SM_")) and k != "RANK"}
    env["PYTHONPATH"] = str(ROOT)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def small_model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def train_a_step(model, optimizer):
    optimizer.zero_grad()
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()


# -- checkpoint ------------------------------------------------------------------------------


def test_checkpoint_writes_the_final_name_only_complete(tmp_path, monkeypatch):
    folder = tmp_path / "ckpt"
    events = []
    real_save, real_replace = torch.save, os.replace

    def watching_save(obj, handle, *args, **kwargs):
        # While the bytes are written, only a hidden .tmp file exists in the folder.
        events.append(("save", sorted(p.name for p in folder.iterdir())))
        return real_save(obj, handle, *args, **kwargs)

    def watching_replace(src, dst):
        events.append(("replace", Path(src).name, Path(dst).name))
        return real_replace(src, dst)

    monkeypatch.setattr(torch, "save", watching_save)
    monkeypatch.setattr(os, "replace", watching_replace)
    path = e31.checkpoint(7, extra_value=1)
    assert path == folder / "step-000000000007.pt"
    assert events == [
        ("save", [".step-000000000007.pt.tmp"]),
        ("replace", ".step-000000000007.pt.tmp", "step-000000000007.pt"),
    ]
    assert sorted(p.name for p in folder.iterdir()) == ["step-000000000007.pt"]


def test_a_failed_save_leaves_no_file(tmp_path, monkeypatch):
    real_save = torch.save

    def failing_save(obj, handle, *args, **kwargs):
        handle.write(b"partial bytes")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(OSError, match="disk full"):
        e31.checkpoint(3, model=small_model(0))
    assert list((tmp_path / "ckpt").iterdir()) == []
    monkeypatch.setattr(torch, "save", real_save)
    assert e31.checkpoint(3).exists()


def test_keep_local_prunes_older_step_files(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "notes.txt").write_text("not a checkpoint")
    for step in (10, 20, 30):
        e31.checkpoint(step)
    assert sorted(p.name for p in folder.glob("step-*.pt")) == ["step-000000000020.pt", "step-000000000030.pt"]
    e31.checkpoint(40, keep_local=3)
    assert [p.name for p in sorted(folder.glob("step-*.pt"))] == ["step-000000000020.pt", "step-000000000030.pt", "step-000000000040.pt"]
    # The file just written stays even when it is not the highest step.
    e31.checkpoint(5, keep_local=1)
    assert [p.name for p in folder.glob("step-*.pt")] == ["step-000000000005.pt"]
    assert (folder / "notes.txt").exists()


def test_resume_restores_model_optimizer_rng_and_position():
    model = small_model(1)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    train_a_step(model, optimizer)
    random.seed(5)
    np.random.seed(5)
    saved = e31.checkpoint(12, model=model, optimizer=optimizer, data_position={"epoch": 2, "batch": 3}, note="hi")
    expected_state = {k: v.clone() for k, v in model.state_dict().items()}
    expected_draws = (torch.rand(4), random.random(), np.random.rand())
    train_a_step(model, optimizer)  # its input comes from the torch RNG, its update from Adam's moments
    expected_next = {k: v.clone() for k, v in model.state_dict().items()}

    fresh = small_model(2)
    fresh_optimizer = torch.optim.Adam(fresh.parameters(), lr=0.01)
    torch.manual_seed(999)
    random.seed(999)
    np.random.seed(999)
    assert e31.latest_checkpoint() == saved
    state = e31.resume(model=fresh, optimizer=fresh_optimizer)
    assert (state.step, state.data_position, state.extra, state.path) == (12, {"epoch": 2, "batch": 3}, {"note": "hi"}, saved)
    assert all(torch.equal(v, expected_state[k]) for k, v in fresh.state_dict().items())
    draws = (torch.rand(4), random.random(), np.random.rand())
    assert torch.equal(draws[0], expected_draws[0]) and draws[1:] == expected_draws[1:]
    train_a_step(fresh, fresh_optimizer)
    assert all(torch.equal(v, expected_next[k]) for k, v in fresh.state_dict().items())


def test_resume_picks_the_highest_step_then_other_pt_files(tmp_path):
    folder = tmp_path / "ckpt"
    assert e31.resume() is None and e31.latest_checkpoint() is None
    folder.mkdir()
    model = small_model(3)
    torch.save(model.state_dict(), folder / "older.pt")
    torch.save(small_model(4).state_dict(), folder / "newer.pt")
    os.utime(folder / "older.pt", (time.time() - 100, time.time() - 100))
    (folder / ".hidden.pt").write_bytes(b"ignored")
    (folder / "step-000000000009.pt.tmp").write_bytes(b"ignored")
    assert e31.latest_checkpoint() == folder / "newer.pt"
    target = small_model(5)
    assert e31.resume(model=target).path == folder / "newer.pt"
    assert all(torch.equal(v, small_model(4).state_dict()[k]) for k, v in target.state_dict().items())
    with pytest.raises(ValueError, match="no optimizer state"):
        e31.resume(model=target, optimizer=torch.optim.SGD(target.parameters(), lr=0.1))
    torch.save({"model": small_model(3).state_dict(), "step": 77}, folder / "mine.pt")
    state = e31.resume(model=target)
    assert (state.path.name, state.step) == ("mine.pt", 77)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in target.state_dict().items())
    e31.checkpoint(100, keep_local=None)
    e31.checkpoint(9, keep_local=None)
    assert e31.latest_checkpoint() == folder / "step-000000000100.pt"
    assert e31.resume().step == 100


def test_other_ranks_write_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RANK", "1")
    metrics = tmp_path / "metrics.jsonl"
    assert e31.checkpoint(10, model=small_model(0)) is None
    e31.log_metric(10, loss=1.0)
    monkeypatch.delenv("E31_CHECKPOINT_DIR")
    monkeypatch.chdir(tmp_path)
    e31.checkpoint(11)
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "checkpoints").exists()
    assert capsys.readouterr().out == ""
    monkeypatch.setenv("E31_METRICS_FILE", str(metrics))
    e31.log_metric(10, loss=1.0)
    assert not metrics.exists()
    monkeypatch.setenv("RANK", "0")
    e31.log_metric(10, loss=1.0)
    assert e31.checkpoint(10).parent == Path("checkpoints") and metrics.exists()


# -- metrics ---------------------------------------------------------------------------------


def strict_json(line):
    def refuse(token):
        raise ValueError(f"non-standard JSON token {token}")

    return json.loads(line, parse_constant=refuse)


def test_log_metric_writes_strict_json_lines(tmp_path, monkeypatch):
    metrics = tmp_path / "metrics.jsonl"
    monkeypatch.setenv("E31_METRICS_FILE", str(metrics))
    before = time.time()
    e31.log_metric(3, loss=0.5, accuracy=torch.tensor(0.25), lr=np.float32(0.125), count=np.int64(7), n=2)
    e31.log_metric(np.int64(4), loss=float("nan"), **{"grad/norm": torch.tensor(float("inf")), "val.loss-min": -math.inf})
    e31.log_metric(None, epoch_time=1.5)
    lines = metrics.read_text().splitlines()
    assert len(lines) == 3
    first, second, third = (strict_json(line) for line in lines)
    assert first["step"] == 3 and before <= first["at"] <= time.time()
    assert first["values"] == {"loss": 0.5, "accuracy": 0.25, "lr": 0.125, "count": 7.0, "n": 2.0}
    assert all(type(v) is float for v in first["values"].values())
    assert second == {"step": 4, "at": second["at"], "values": {"loss": "NaN", "grad/norm": "Infinity", "val.loss-min": "-Infinity"}}
    assert third["step"] is None and third["values"] == {"epoch_time": 1.5}


@pytest.mark.parametrize("name", ["", "x" * 101, "has space", "naïve", "semi;colon", 'quote"'])
def test_bad_metric_names_raise(tmp_path, monkeypatch, name):
    metrics = tmp_path / "metrics.jsonl"
    monkeypatch.setenv("E31_METRICS_FILE", str(metrics))
    with pytest.raises(ValueError):
        e31.log_metric(1, **{name: 1.0})
    assert not metrics.exists()
    e31.log_metric(1, **{"x" * 100: 1.0})
    assert metrics.exists()


def test_log_metric_refuses_non_numbers_and_prints_on_a_laptop(capsys):
    with pytest.raises(TypeError):
        e31.log_metric(1, loss="low")
    with pytest.raises(ValueError):
        e31.log_metric(1)
    e31.log_metric(12, loss=0.51, accuracy=0.9)
    assert capsys.readouterr().out == "step 12: loss=0.51 accuracy=0.9\n"


# -- stopping --------------------------------------------------------------------------------


def test_should_stop_reads_the_stop_file(tmp_path, monkeypatch):
    stop_file = tmp_path / "stop.json"
    monkeypatch.setenv("E31_STOP_FILE", str(stop_file))
    assert not e31.should_stop() and e31.stop_reason() is None
    assert not e31.checkpoint_due(1, every_steps=10)
    stop_file.write_text(json.dumps({"reason": "preempted", "deadline": time.time() + 30}))
    assert e31.should_stop() and e31.stop_reason() == "preempted"
    assert e31.checkpoint_due(1, every_steps=10)
    stop_file.unlink()
    assert e31.should_stop(), "a stop request stays"


def test_checkpoint_due_by_steps_and_seconds(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(e31, "_clock", lambda: clock[0])
    assert not e31.checkpoint_due(0, every_steps=5)
    assert [s for s in range(1, 16) if e31.checkpoint_due(s, every_steps=5)] == [5, 10, 15]
    assert not e31.checkpoint_due(1, every_seconds=60)
    clock[0] += 59
    assert not e31.checkpoint_due(2, every_seconds=60)
    clock[0] += 1
    assert e31.checkpoint_due(3, every_seconds=60)
    e31.checkpoint(3)
    assert not e31.checkpoint_due(4, every_seconds=60)
    clock[0] += 61
    assert e31.checkpoint_due(5, every_seconds=60)


POLLING_SCRIPT = """
import sys, time
from pathlib import Path
import e31
folder = Path(sys.argv[1])
assert not e31.should_stop()
(folder / "ready").write_text("ready")
for _ in range(1000):
    if e31.should_stop():
        (folder / "stopped").write_text(e31.stop_reason())
        sys.exit(0)
    time.sleep(0.01)
sys.exit(3)
"""


def test_should_stop_turns_sigterm_into_a_request(tmp_path):
    script = tmp_path / "poll.py"
    script.write_text(POLLING_SCRIPT)
    process = subprocess.Popen([sys.executable, str(script), str(tmp_path)], env=subprocess_env(), start_new_session=True)
    try:
        deadline = time.time() + 20
        while not (tmp_path / "ready").exists() and process.poll() is None and time.time() < deadline:
            time.sleep(0.02)
        assert (tmp_path / "ready").exists()
        os.killpg(process.pid, signal.SIGTERM)  # as the network does: the whole process group
        assert process.wait(timeout=20) == 0
    finally:
        process.kill()
    assert (tmp_path / "stopped").read_text() == "SIGTERM received"


def test_a_script_that_never_asks_dies_on_sigterm(tmp_path):
    process = subprocess.Popen(
        [sys.executable, "-c", "import e31, time, sys; print('up', flush=True); time.sleep(30); sys.exit(0)"],
        env=subprocess_env(),
        stdout=subprocess.PIPE,
    )
    try:
        assert process.stdout.readline() == b"up\n"
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=20) == -signal.SIGTERM
    finally:
        process.kill()


def test_import_e31_needs_neither_django_nor_torch():
    code = (
        "import sys, e31\n"
        "from e31 import checkpoint, resume, latest_checkpoint, log_metric, should_stop, stop_reason, checkpoint_due\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'django', 'torch', 'numpy', 'jobs', 'scheduler'}))"
    )
    result = subprocess.run([sys.executable, "-c", code], env=subprocess_env(), capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


# -- the resumable example -------------------------------------------------------------------


@pytest.fixture(scope="module")
def digits_dir(tmp_path_factory):
    from sklearn.datasets import load_digits

    digits = load_digits()
    folder = tmp_path_factory.mktemp("digits")
    header = ",".join([f"p{i}" for i in range(64)] + ["label"])
    for name, rows in (("train", slice(0, 400)), ("heldout", slice(400, 500))):
        (folder / name).mkdir()
        table = np.column_stack([digits.data[rows], digits.target[rows]]).astype(int)
        np.savetxt(folder / name / "digits.csv", table, fmt="%d", delimiter=",", header=header, comments="")
    return folder


def job_env(folder, digits_dir, config):
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return subprocess_env(
        E31_DATA_DIR=digits_dir,
        E31_OUTPUT_DIR=folder / "output",
        E31_CHECKPOINT_DIR=folder / "checkpoints",
        E31_CONFIG=folder / "config.json",
        E31_METRICS_FILE=folder / "metrics.jsonl",
        E31_STOP_FILE=folder / "stop.json",
    )


def start(env, folder, name):
    log = open(folder / f"{name}.log", "w")
    return subprocess.Popen([sys.executable, "-u", str(RESUMABLE)], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def checkpoint_steps(folder):
    return sorted(int(p.name[5:17]) for p in (folder / "checkpoints").glob("step-*.pt"))


def wait_for_checkpoint_after(process, folder, step, timeout=30):
    deadline = time.time() + timeout
    while time.time() < deadline and process.poll() is None:
        if any(s > step for s in checkpoint_steps(folder)):
            return
        time.sleep(0.02)
    raise AssertionError(f"no checkpoint after step {step} (exit code {process.poll()})")


def load_weights(path):
    return torch.load(path, weights_only=True)


def test_resumable_example_ends_with_the_same_weights_when_interrupted(tmp_path, digits_dir):
    # 400 rows in batches of 80: 5 batches an epoch, so the checkpoints every 20 steps fall on
    # epoch boundaries, and the one taken on SIGTERM most likely in the middle of an epoch.
    config = {"steps": 120, "batch_size": 80, "checkpoint_every": 20, "eval_every": 40, "sleep": 0.02, "hidden": 32}
    straight, pieces = tmp_path / "straight", tmp_path / "pieces"
    processes = []
    try:
        straight_run = start(job_env(straight, digits_dir, config), straight, "run")
        processes.append(straight_run)
        pieces_env = job_env(pieces, digits_dir, config)
        # First piece: SIGTERM once a checkpoint exists; it saves where it is and exits 0.
        first = start(pieces_env, pieces, "first")
        processes.append(first)
        wait_for_checkpoint_after(first, pieces, 0)
        os.killpg(first.pid, signal.SIGTERM)
        assert first.wait(timeout=30) == 0, (pieces / "first.log").read_text()
        first_log = (pieces / "first.log").read_text()
        assert "stopping at step" in first_log and "SIGTERM received" in first_log
        stopped_at = max(checkpoint_steps(pieces))
        assert 20 <= stopped_at < 120
        # Second piece: resumes there, then is killed outright after its next checkpoint.
        second = start(pieces_env, pieces, "second")
        processes.append(second)
        wait_for_checkpoint_after(second, pieces, stopped_at)
        os.killpg(second.pid, signal.SIGKILL)
        second.wait(timeout=30)
        second_log = (pieces / "second.log").read_text()
        assert f"resumed from step-{stopped_at:012d}.pt at step {stopped_at}" in second_log
        killed_after = max(checkpoint_steps(pieces))
        assert stopped_at < killed_after < 120, (stopped_at, killed_after)
        # Third piece: resumes from the last checkpoint the killed run left, and finishes.
        third = start(pieces_env, pieces, "third")
        processes.append(third)
        assert third.wait(timeout=60) == 0, (pieces / "third.log").read_text()
        third_log = (pieces / "third.log").read_text()
        assert f"resumed from step-{killed_after:012d}.pt" in third_log and "done: 120 steps" in third_log
        assert straight_run.wait(timeout=60) == 0, (straight / "run.log").read_text()
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()

    expected, got = load_weights(straight / "output" / "model.pt"), load_weights(pieces / "output" / "model.pt")
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[k], got[k]) for k in expected)
    # A different seed gives different weights: the comparison can tell them apart.
    assert not torch.equal(expected["0.weight"], load_weights_with_other_seed(tmp_path, digits_dir, config)["0.weight"])

    lines = [strict_json(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines if "loss" in line["values"]] == list(range(1, 121))
    assert [line["step"] for line in lines if "heldout_accuracy" in line["values"]] == [40, 80, 120]
    assert checkpoint_steps(straight) == [100, 120]


def load_weights_with_other_seed(tmp_path, digits_dir, config):
    folder = tmp_path / "other-seed"
    env = job_env(folder, digits_dir, {**config, "steps": 20, "sleep": 0, "seed": 1, "nan_at_step": 20})
    result = subprocess.run([sys.executable, str(RESUMABLE)], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    last = strict_json((folder / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["step"] == 20 and last["values"]["loss"] == "NaN"
    return load_weights(folder / "output" / "model.pt")
