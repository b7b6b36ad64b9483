"""Early stopping keeps the best: a job the network stops early on its metric gets back the
weights of its best step (the checkpoint taken at it, or the latest kept before it), named in
the log and in metrics.json, with its own output beside them under last/.

The decisions are pure functions over plain data (tested first, without a database); then real
script jobs on a real runner, and a recipe run as a job runs it."""

import hashlib
import json
from datetime import datetime, timedelta
from datetime import timezone as dt_timezone
from types import SimpleNamespace

import pytest

from scheduler.checkpoints import at_or_before, to_prune
from scheduler.stopping import Watch, best_report, returned_message, unmatched_message


def checkpoint(step, name=None, minute=0):
    written_at = datetime(2025, 1, 1, tzinfo=dt_timezone.utc) + timedelta(minutes=minute)
    return SimpleNamespace(step=step, name=name or f"ckpt-{step}.bin", written_at=written_at)


# -- the decisions, over plain data -------------------------------------------------------------


@pytest.mark.nodb
def test_the_best_point_is_the_first_of_equal_ones_and_follows_the_mode():
    watch = Watch(metric="val_loss", mode="min", patience=3)
    for step, value in [(10, 0.9), (20, 0.4), (30, 0.4), (40, 0.6)]:
        watch.add(step, {"val_loss": value})
    assert watch.best() == (20, 0.4)
    watch = Watch(metric="acc", mode="max", patience=3)
    for step, value in [(1, 0.5), (2, 0.8), (3, 0.7)]:
        watch.add(step, {"acc": value})
    assert watch.best() == (2, 0.8)


@pytest.mark.nodb
def test_there_is_no_best_without_early_stopping_or_points():
    assert Watch(metric="val_loss", patience=2).best() is None
    watch = Watch(metric="val_loss", patience=None)
    watch.add(1, {"val_loss": 0.5})
    assert watch.best() is None
    assert Watch().best() is None


@pytest.mark.nodb
def test_a_resumed_run_logging_steps_again_moves_the_best_with_its_rewind():
    watch = Watch(metric="val_loss", patience=5)
    for step, value in [(10, 0.5), (20, 0.3), (30, 0.6)]:
        watch.add(step, {"val_loss": value})
    watch.add(20, {"val_loss": 0.45})  # resumed from step 10: its step 20 replaces the old one
    assert watch.best() == (20, 0.45)


@pytest.mark.nodb
def test_the_checkpoint_returned_is_the_one_at_the_best_step_or_the_latest_before_it():
    kept = [checkpoint(10), checkpoint(20), checkpoint(30), checkpoint(40)]
    assert at_or_before(kept, 30).name == "ckpt-30.bin"
    assert at_or_before(kept, 35).name == "ckpt-30.bin"
    assert at_or_before(kept, 9) is None
    assert at_or_before(kept, None) is None
    assert at_or_before([checkpoint(None, "latest.pt")], 30) is None  # a name with no step says nothing of its weights
    # A resumed run wrote step 20 again: the newer of the two holds what the run went on from.
    again = [checkpoint(10), checkpoint(20, "first-20.bin"), checkpoint(20, "again-20.bin", minute=5)]
    assert at_or_before(again, 25).name == "again-20.bin"


@pytest.mark.nodb
def test_pruning_spares_the_checkpoint_holding_the_best_step():
    newest_first = [checkpoint(50), checkpoint(40), checkpoint(30), checkpoint(20), checkpoint(10)]
    assert [c.step for c in to_prune(newest_first, keep=2)] == [30, 20, 10]
    assert [c.step for c in to_prune(newest_first, keep=2, best_step=30)] == [20, 10]
    assert [c.step for c in to_prune(newest_first, keep=2, best_step=35)] == [20, 10]  # 30 holds the weights nearest before it
    assert [c.step for c in to_prune(newest_first, keep=2, best_step=45)] == [30, 20, 10]  # among the latest already
    assert [c.step for c in to_prune(newest_first, keep=0, best_step=10)] == [40, 30, 20]  # at least one is always kept


@pytest.mark.nodb
def test_the_log_says_which_step_s_weights_come_back():
    assert returned_message("val_loss", (100, 0.0474), "ckpt-100.bin", 100, last_step=402) == (
        "the weights returned are those of the best val_loss (0.0474, at step 100): checkpoint ckpt-100.bin; "
        "the job's own output, as it was when it stopped (its last metric point: step 402), is kept under last/"
    )
    assert returned_message("val_loss", (100, 0.0474), "ckpt-90.bin", 90) == (
        "the weights returned are those of step 90 (checkpoint ckpt-90.bin), the latest kept at or before the best "
        "val_loss (0.0474, at step 100); the job's own output, as it was when it stopped, is kept under last/"
    )
    assert returned_message("val_loss", (100, 0.0474), "ckpt-100.bin", 100, last_kept=False).endswith(
        "checkpoint ckpt-100.bin; the job left no output files of its own"
    )
    assert unmatched_message("val_loss", (100, 0.0474)) == (
        "no checkpoint at or before step 100, where val_loss was best (0.0474), was kept: the best weights cannot be "
        "returned; the job's own output, as it was when it stopped, is returned instead"
    )
    assert unmatched_message("val_loss", (100, 0.0474), own_output=False).endswith(
        "the best weights cannot be returned, and the job left no output files of its own"
    )
    assert unmatched_message("acc", (None, 0.9)).startswith("the best acc (0.9) was logged without a step")


@pytest.mark.nodb
def test_metrics_json_names_the_weights_and_the_best():
    report = best_report("val_loss", "min", (100, 0.0474), "ckpt-90.bin", 90, {"val_loss": 0.05, "loss": 0.02}, 402)
    assert report == {
        "early_stop": {
            "metric": "val_loss", "mode": "min", "best": 0.0474, "best_step": 100, "weights": "ckpt-90.bin", "weights_step": 90,
            "last": "last/", "last_step": 402,
        },
        "metrics": {"val_loss": 0.05, "loss": 0.02},
    }
    assert json.loads(json.dumps(report)) == report


@pytest.mark.nodb
def test_recipes_checkpoint_at_each_new_best_of_any_validation_metric():
    from e31.recipes.common import _improved

    bests = {}
    assert _improved(bests, 10, {"val_loss": 0.5, "val_accuracy": 0.7})
    assert not _improved(bests, 20, {"val_loss": 0.6, "val_accuracy": 0.7})  # equal is not better
    assert _improved(bests, 30, {"val_loss": 0.6, "val_accuracy": 0.8})  # higher is better for an accuracy
    assert _improved(bests, 40, {"val_loss": 0.4, "val_accuracy": float("nan")})
    assert bests == {"val_loss": (40, 0.4), "val_accuracy": (30, 0.8)}


# -- a script job on a real runner --------------------------------------------------------------


# val_loss is best at step 30 and only worsens after it. Each step's "weights" are bytes that
# tell their step, checkpointed (as a script without the SDK would: a temporary name, then a
# rename) every `EVERY` steps from `FIRST` on; told to stop, it writes its last weights to its
# output folder, as a script does at its end.
WORSENING = b"""
import os, pathlib, time
from e31 import log_metric, should_stop
EVERY, FIRST = %d, %d
checkpoints = pathlib.Path(os.environ["E31_CHECKPOINT_DIR"])
output = pathlib.Path(os.environ["E31_OUTPUT_DIR"])
for i, val_loss in enumerate([1.0, 0.6, 0.3, 0.5, 0.7, 0.9, 1.1, 1.3, 1.5, 1.7, 1.9, 2.1], start=1):
    step = 10 * i
    weights = f"weights at step {step}\\n".encode() * 200
    if step >= FIRST and step %% EVERY == 0:
        (checkpoints / f".ckpt-{step}.tmp").write_bytes(weights)
        os.replace(checkpoints / f".ckpt-{step}.tmp", checkpoints / f"ckpt-{step}.bin")
    log_metric(step, val_loss=val_loss, loss=val_loss / 2)
    for _ in range(8):
        if should_stop():
            (output / "model.bin").write_bytes(weights)
            (output / "notes.txt").write_text(f"stopped at step {step}")
            print(f"told to stop at step {step}", flush=True)
            raise SystemExit(0)
        time.sleep(0.05)
print("ran to the end", flush=True)
"""


def weights_at(step):
    return hashlib.sha256(f"weights at step {step}\n".encode() * 200).hexdigest()


def notices(job):
    return [e.data["text"] for e in job.events.filter(kind="notice").order_by("seq")]


def artifact_bytes(job, name):
    from e31web.storage import get_storage

    with get_storage().open(job.artifacts.get(name=name).key) as source:
        return source.read()


def stopped_step(job):
    return int(artifact_bytes(job, "last/notes.txt").decode().rsplit(" ", 1)[1])


@pytest.mark.runs_jobs
@pytest.mark.timeout(120)
@pytest.mark.django_db(transaction=True)
def test_a_job_stopped_early_on_its_metric_gets_the_best_step_s_weights(make_runner, alice, rate):
    from jobs.models import Checkpoint
    from tests.conftest import make_job
    from tests.test_runner import run_job

    runner = make_runner("best-node")
    # keep_checkpoints=1: without the best spared, the pruning would have deleted it long before the end.
    job = make_job(alice, script=WORSENING % (10, 10), early_stop_metric="val_loss", early_stop_patience=3, keep_checkpoints=1)
    job = run_job(runner, job)
    assert job.state == "succeeded", job.reason
    assert job.reason == "stopped early: val_loss has not improved for 3 evaluations (best 0.3 at step 30)"

    best = Checkpoint.objects.get(job=job, step=30, pruned_at__isnull=True)
    returned = job.artifacts.get(name="ckpt-30.bin")
    assert returned.sha256 == best.sha256 == weights_at(30)
    assert hashlib.sha256(artifact_bytes(job, "ckpt-30.bin")).hexdigest() == weights_at(30)
    assert Checkpoint.objects.filter(job=job, pruned_at__isnull=True).count() == 2  # the latest, and the best

    # The job's own output, its last weights, beside them under last/ (and nothing of it on top).
    last = stopped_step(job)
    assert last >= 60
    assert job.artifacts.get(name="last/model.bin").sha256 == weights_at(last)
    assert sorted(job.artifacts.values_list("name", flat=True)) == ["ckpt-30.bin", "last/model.bin", "last/notes.txt", "metrics.json"]

    report = json.loads(artifact_bytes(job, "metrics.json"))
    assert report["early_stop"] == {
        "metric": "val_loss", "mode": "min", "best": 0.3, "best_step": 30, "weights": "ckpt-30.bin", "weights_step": 30,
        "last": "last/", "last_step": report["early_stop"]["last_step"],
    }
    assert report["early_stop"]["last_step"] >= 60 and report["metrics"] == {"val_loss": 0.3, "loss": 0.15}
    said = [n for n in notices(job) if n.startswith("the weights returned")]
    assert said == [
        "the weights returned are those of the best val_loss (0.3, at step 30): checkpoint ckpt-30.bin; the job's own "
        f"output, as it was when it stopped (its last metric point: step {report['early_stop']['last_step']}), is kept under last/"
    ]
    assert "kept 2 output files under last/" in notices(job)


@pytest.mark.runs_jobs
@pytest.mark.timeout(120)
@pytest.mark.django_db(transaction=True)
def test_without_a_checkpoint_at_the_best_step_the_latest_before_it_comes_back_and_the_log_says_so(make_runner, alice, rate):
    from tests.conftest import make_job
    from tests.test_runner import run_job

    runner = make_runner("before-node")
    job = run_job(runner, make_job(alice, script=WORSENING % (20, 20), early_stop_metric="val_loss", early_stop_patience=3))
    assert job.state == "succeeded", job.reason
    assert job.artifacts.get(name="ckpt-20.bin").sha256 == weights_at(20)
    assert json.loads(artifact_bytes(job, "metrics.json"))["early_stop"]["weights_step"] == 20
    said = (
        "the weights returned are those of step 20 (checkpoint ckpt-20.bin), the latest kept at or before the best val_loss "
        "(0.3, at step 30)"
    )
    assert any(n.startswith(said) for n in notices(job))


@pytest.mark.runs_jobs
@pytest.mark.timeout(120)
@pytest.mark.django_db(transaction=True)
def test_with_no_checkpoint_at_or_before_the_best_step_its_own_output_comes_back_and_the_log_says_so(make_runner, alice, rate):
    from tests.conftest import make_job
    from tests.test_runner import run_job

    runner = make_runner("none-node")
    job = run_job(runner, make_job(alice, script=WORSENING % (10, 40), early_stop_metric="val_loss", early_stop_patience=3))
    assert job.state == "succeeded", job.reason
    assert sorted(job.artifacts.values_list("name", flat=True)) == ["model.bin", "notes.txt"]
    assert "no checkpoint at or before step 30, where val_loss was best (0.3), was kept" in " ".join(notices(job))


# -- a recipe -----------------------------------------------------------------------------------


@pytest.mark.nodb
def test_a_recipe_checkpoints_its_best_returns_it_and_keeps_the_last_weights_under_last(tmp_path):
    """Labels that are noise: val_loss is best early and worsens as the model learns the noise.
    The recipe's own early stopping returns the best step's weights (the checkpoint it took at
    that step holds the same), names the step, and keeps the last weights in last/."""
    import numpy as np
    import torch
    from safetensors.torch import load_file

    from e31.recipes import common
    from tests.test_recipes import run_recipe, write_table

    rng = np.random.default_rng(1)
    data = tmp_path / "data"
    (data / "train").mkdir(parents=True)
    (data / "heldout").mkdir()
    write_table(data / "train" / "rows.csv", rng.normal(size=(60, 8)).astype(np.float32), rng.integers(0, 3, size=60))
    write_table(data / "heldout" / "rows.csv", rng.normal(size=(60, 8)).astype(np.float32), rng.integers(0, 3, size=60))
    config = {"max_steps": 400, "eval_every": 10, "checkpoint_every": 0, "patience": 3, "hidden": 64, "batch_size": 60, "lr": 0.03}
    result = run_recipe("classifier", tmp_path / "run", config, data=data)

    final = json.loads((tmp_path / "run" / "out" / "metrics.json").read_text())
    early = final["early_stop"]
    best_step, last_step = early["best_step"], early["last_step"]
    assert early["weights_step"] == best_step < last_step and early["last"] == "last/"
    assert f"the weights returned are those of step {best_step}, where val_loss was best" in result.stdout
    assert final["val_loss"] == pytest.approx(early["best"])

    out = tmp_path / "run" / "out"
    returned, last = load_file(str(out / "model.safetensors")), load_file(str(out / "last" / "model.safetensors"))
    assert (out / "last" / "recipe.json").exists()
    assert any(not torch.equal(returned[k], last[k]) for k in returned)
    # The checkpoint taken at the best step is still in the folder (the network may not have
    # picked it up yet) and holds the weights returned; as a starting model, it loads as they do.
    best_file = tmp_path / "run" / "ckpt" / f"step-{best_step:012d}.pt"
    start = tmp_path / "start"
    start.mkdir()
    (start / best_file.name).write_bytes(best_file.read_bytes())
    loaded = common.load_weights(start)
    assert all(torch.equal(loaded[k], returned[k]) for k in returned)
