"""Early stopping keeps the best: a job the network stops early on its metric gets back the
weights of its best step (the checkpoint taken at it, or the latest kept before it), named in
the log and in metrics.json, with its own output beside them under last/.

The decisions are pure functions over plain data (tested first, without a database); then real
script jobs on a real runner, and a recipe run as a job runs it.

Over 500 lines: the pure decisions, then the same cases through real jobs."""

import hashlib
import json
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace

import pytest

from agent.checkpoints import at_or_before, to_prune
from agent.stopping import Watch, best_report, returned_message, unmatched_message


def checkpoint(step, name=None, minute=0):
    written_at = datetime(2025, 1, 1, tzinfo=UTC) + timedelta(minutes=minute)
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
            "metric": "val_loss",
            "mode": "min",
            "best": 0.0474,
            "best_step": 100,
            "weights": "ckpt-90.bin",
            "weights_step": 90,
            "last": "last/",
            "last_step": 402,
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
    from core.storage import get_storage

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
        "metric": "val_loss",
        "mode": "min",
        "best": 0.3,
        "best_step": 30,
        "weights": "ckpt-30.bin",
        "weights_step": 30,
        "last": "last/",
        "last_step": report["early_stop"]["last_step"],
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
    said = "the weights returned are those of step 20 (checkpoint ckpt-20.bin), the latest kept at or before the best val_loss (0.3, at step 30)"
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


# -- a recipe the network stops early on its metric -----------------------------------------------


@pytest.mark.nodb
def test_the_stop_notice_tells_a_stop_on_the_metric_from_any_other():
    from e31.best import early_stop_notice, early_stop_of

    notice = {"reason": "stopped early", "deadline": 0, "early_stop": early_stop_notice("val_acc", "max", (30, 0.9))}
    assert early_stop_of(json.loads(json.dumps(notice))) == ("val_acc", "max", (30, 0.9))
    assert early_stop_of({"reason": "stopped early", "early_stop": early_stop_notice("val_loss", "min", None)}) == ("val_loss", "min", None)
    for other in (
        None,
        {"reason": "preempted", "deadline": 0},
        {"early_stop": {"metric": "", "mode": "min"}},
        {"early_stop": {"metric": "val_loss", "mode": "sideways"}},
        {"early_stop": "val_loss"},
    ):
        assert early_stop_of(other) is None
    assert early_stop_of({"early_stop": {"metric": "m", "mode": "min", "best": "x", "best_step": 3}}) == ("m", "min", None)
    assert early_stop_of({"early_stop": {"metric": "m", "mode": "min", "best": 1, "best_step": True}}) == ("m", "min", (None, 1.0))


@pytest.mark.nodb
def test_a_recipe_tracks_the_watched_metric_as_the_network_counts_it():
    from e31.best import at_or_before, better_of, track
    from e31.recipes.common import _improved, network_watch

    best = None
    for step, value in [(1, 0.5), (2, float("nan")), (3, 0.4), (4, 0.4), (5, "0.1"), (6, 0.45)]:
        best = track(best, step, value, "min")
    assert best == (3, 0.4)  # the first of equal ones; NaN and non-numbers ignored
    assert track((3, 0.4), 7, 0.6, "max") == (7, 0.6)
    # The notice's best (the runs before a restart count) against the run's own, later one.
    assert better_of((3, 0.4), (9, 0.3), "min") == (9, 0.3)
    assert better_of((3, 0.4), (9, 0.4), "min") == (3, 0.4)
    assert better_of((9, 0.4), (3, 0.4), "min") == (3, 0.4)
    assert better_of(None, (3, 0.4), "max") == (3, 0.4) and better_of((3, 0.4), None, "max") == (3, 0.4)
    assert at_or_before([0, 10, 30, 40], 35) == 30 and at_or_before([10], 5) is None and at_or_before([10], None) is None

    assert network_watch({}) is None
    assert network_watch({"E31_EARLY_STOP_METRIC": "val_accuracy", "E31_EARLY_STOP_MODE": "max"}) == ("val_accuracy", "max")
    assert network_watch({"E31_EARLY_STOP_METRIC": "val_loss", "E31_EARLY_STOP_MODE": "?"}) == ("val_loss", "min")
    # A checkpoint at each new best of the watched metric, in the network's mode.
    bests = {}
    assert _improved(bests, 10, {"val_loss": 0.5}, ("val_loss", "max"))
    assert _improved(bests, 20, {"val_loss": 0.6}, ("val_loss", "max"))
    assert not _improved(bests, 30, {"val_loss": 0.55}, ("val_loss", "max"))
    assert bests == {"val_loss": (20, 0.6)}


@pytest.mark.nodb
def test_the_network_passes_the_watched_metric_and_its_mode_to_the_job(tmp_path):
    from jobs.launch import (
        JobDirs,
        build_environment,
        known_variables,
        refused_env_name,
    )

    env = build_environment(job_id="j", dirs=JobDirs(tmp_path), devices=[0], device_type="cpu", declared={}, early_stop=("val_acc", "max"))
    assert env["E31_EARLY_STOP_METRIC"] == "val_acc" and env["E31_EARLY_STOP_MODE"] == "max"
    env = build_environment(job_id="j", dirs=JobDirs(tmp_path), devices=[0], device_type="cpu", declared={"E31_EARLY_STOP_METRIC": "x"})
    assert "E31_EARLY_STOP_METRIC" not in env and "E31_EARLY_STOP_MODE" not in env
    assert refused_env_name("E31_EARLY_STOP_MODE").startswith("E31_EARLY_STOP_MODE is set by the network")
    assert "E31_EARLY_STOP_METRIC" not in known_variables()  # unset when no metric is watched: arguments may not name it


@pytest.mark.django_db
def test_a_restart_puts_back_the_checkpoint_holding_the_best_step_beside_the_latest(alice, tmp_path):
    """A recipe returns its best weights itself, from its checkpoint folder: restarted, it gets
    back the one holding the best step (or the latest before it) too; the latest is still the
    newest, the one resumed from."""
    import io

    from agent.checkpoints import restore
    from core.storage import get_storage
    from jobs.models import Checkpoint
    from tests.conftest import make_job

    job = make_job(alice)
    for step in (10, 20, 30, 40):
        key = f"jobs/{job.pk}/checkpoints/{step}/step-{step:012d}.pt"
        size, sha256 = get_storage().save(key, io.BytesIO(f"weights at step {step}".encode()))
        written_at = datetime(2025, 1, 1, tzinfo=UTC) + timedelta(minutes=step)
        Checkpoint.objects.create(job=job, name=f"step-{step:012d}.pt", step=step, key=key, size=size, sha256=sha256, written_at=written_at)
    Checkpoint.objects.filter(job=job, step=30).update(pruned_at=datetime(2025, 1, 2, tzinfo=UTC))

    assert restore(job, tmp_path / "a", best_step=35).step == 40
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["step-000000000020.pt", "step-000000000040.pt"]
    assert (tmp_path / "a" / "step-000000000020.pt").read_text() == "weights at step 20"
    restore(job, tmp_path / "b", best_step=40)
    restore(job, tmp_path / "c")
    assert [p.name for p in (tmp_path / "b").iterdir()] == [p.name for p in (tmp_path / "c").iterdir()] == ["step-000000000040.pt"]


@pytest.mark.nodb
def test_a_recipe_stopped_for_another_reason_keeps_its_last_weights_as_before(tmp_path):
    """Preempted while the network watches its metric: the weights so far, no last/, no
    metrics.json (a restart resumes it), as without a watched metric."""
    import numpy as np

    from tests.test_recipes import run_recipe, write_table

    rng = np.random.default_rng(1)
    data = tmp_path / "data"
    (data / "train").mkdir(parents=True)
    write_table(data / "train" / "rows.csv", rng.normal(size=(40, 4)).astype(np.float32), rng.integers(0, 2, size=40))
    config = {"max_steps": 50, "eval_every": 1, "hidden": 8, "batch_size": 20}
    watched = {"E31_EARLY_STOP_METRIC": "val_loss", "E31_EARLY_STOP_MODE": "min"}
    result = run_recipe("classifier", tmp_path / "run", config, data=data, stop_file=True, env=watched)
    out = tmp_path / "run" / "out"
    assert "stopping at step 1 of 50: preempted; checkpoint saved" in result.stdout
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors", "recipe.json"]


NOISE_ROWS = 60


def noisy_csv(seed):
    """Three classes from two features, a fifth of the labels noise: val_loss gets better for a
    while, then worse as a model learns the noise."""
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.normal(size=(NOISE_ROWS, 8))
    y = (x[:, 0] > 0).astype(int) + (x[:, 1] > 0.5).astype(int)
    y = np.where(rng.random(NOISE_ROWS) < 0.2, rng.integers(0, 3, size=NOISE_ROWS), y)
    lines = [",".join(f"f{i}" for i in range(8)) + ",label"] + [",".join(f"{v:.6f}" for v in row) + f",{label}" for row, label in zip(x, y)]
    return ("\n".join(lines) + "\n").encode()


def checkpoint_model(job, step):
    """The model state in the job's kept checkpoint of this step (as the recipe wrote it)."""
    import io

    import torch

    from core.storage import get_storage
    from e31.recipes.common import _checkpoint_globals
    from jobs.models import Checkpoint

    kept = Checkpoint.objects.filter(job=job, step=step, pruned_at__isnull=True).order_by("-written_at").first()
    assert kept is not None, f"no checkpoint of step {step} kept: {list(Checkpoint.objects.filter(job=job).values_list('step', 'pruned_at'))}"
    with get_storage().open(kept.key) as source, _checkpoint_globals():
        return torch.load(io.BytesIO(source.read()), map_location="cpu", weights_only=True)["model"]


def returned_of(job, name="model.safetensors"):
    from safetensors.torch import load

    return load(artifact_bytes(job, name))


def same(one, other):
    import torch

    return one.keys() == other.keys() and all(torch.equal(one[k], other[k]) for k in one)


def job_log(job):
    return list(job.events.filter(kind="log").order_by("seq").values_list("text", flat=True))


def check_best_returned(job, merged=lambda state: state):
    """A recipe job the network stopped early on val_loss returned the weights of the best step
    (those of the checkpoint taken at it; merged: as the recipe writes a checkpoint's state),
    kept its last ones (those of the checkpoint it took when told to stop) under last/, and named
    them in its log and metrics.json as a script's are. Returns metrics.json."""
    from agent.runner import metric_watch

    assert job.state == "succeeded", job.reason
    assert job.reason.startswith("stopped early: val_loss has not improved for 3 evaluations"), job.reason
    report = json.loads(artifact_bytes(job, "metrics.json"))
    early = report["early_stop"]
    best_step, last_step = early["best_step"], early["last_step"]
    assert metric_watch(job).best() == (best_step, early["best"])  # the network's best point, and the recipe's
    name = f"step-{best_step:012d}.pt"
    assert early == {
        "metric": "val_loss",
        "mode": "min",
        "best": early["best"],
        "best_step": best_step,
        "weights": name,
        "weights_step": best_step,
        "last": "last/",
        "last_step": last_step,
    }
    assert last_step > best_step
    assert report["val_loss"] == pytest.approx(early["best"], abs=1e-9)  # the evaluation of the weights returned

    returned, last = returned_of(job), returned_of(job, "last/model.safetensors")
    assert same(returned, merged(checkpoint_model(job, best_step)))
    assert same(last, merged(checkpoint_model(job, last_step)))
    assert not same(returned, last)
    assert json.loads(artifact_bytes(job, "recipe.json")) == json.loads(artifact_bytes(job, "last/recipe.json"))

    said = returned_message("val_loss", (best_step, early["best"]), name, best_step, last_step=last_step)
    assert said in job_log(job)
    assert said.startswith(f"the weights returned are those of the best val_loss ({early['best']:.6g}, at step {best_step}): checkpoint {name}; ")
    return report


@pytest.mark.runs_jobs
@pytest.mark.timeout(240)
@pytest.mark.django_db(transaction=True)
def test_a_recipe_stopped_early_on_its_metric_returns_the_best_step_s_weights_and_retrains_from_them(make_runner, alice, rate, team_a, settings):
    """A classifier on noisy labels, its val_loss watched by the network (the recipe's own
    patience off): stopped early, it returns the best step's weights, as its usual output
    (recipe.json beside them), the last ones under last/. A LoRA retraining of them starts from
    them, and stopped early in turn returns its best step's weights with the adapters merged."""
    from catalog import datasets
    from e31.recipes import classifier, common
    from jobs import lineage
    from tests.test_recipe_e2e import metric_points, recipe_job
    from tests.test_staging import run

    settings.E31_STOP_GRACE_SECONDS = 30.0  # it writes its outputs before it is killed, however busy the machine
    runner = make_runner()
    train = datasets.create_dataset(team_a, "noisy", {"rows.csv": noisy_csv(1)}).latest_version()
    heldout = datasets.create_dataset(team_a, "noisy-test", {"rows.csv": noisy_csv(2)}).latest_version()
    # Never its end: the network stops it (after its best, 3 evaluations without a better val_loss).
    config = {"max_steps": 1_000_000, "eval_every": 5, "checkpoint_every": 0, "hidden": 32, "batch_size": NOISE_ROWS, "lr": 0.003, "seed": 0}
    job = recipe_job(
        alice,
        team_a,
        "noise",
        config,
        train_version=train,
        heldout_version=heldout,
        early_stop_metric="val_loss",
        early_stop_patience=3,
        keep_checkpoints=1,
    )
    job = run([runner], job)
    report = check_best_returned(job)
    assert report["early_stop"]["best_step"] > 5  # better for a while: neither its first evaluation nor its last
    names = sorted(job.artifacts.values_list("name", flat=True))
    assert names == ["last/model.safetensors", "last/recipe.json", "metrics.json", "model.safetensors", "recipe.json"]

    # Retrained (LoRA) from them: its first evaluation, before any step, is theirs.
    lora = {**config, "adaptation": "lora", "lora_rank": 4, "lr": 0.05}
    tuned = run([runner], lineage.retrain(job, alice, work={"config": lora}))
    step, first = metric_points(tuned, "val_loss")[0]
    assert step == 0 and first == pytest.approx(report["val_loss"], abs=1e-6)

    info = json.loads(artifact_bytes(tuned, "recipe.json"))
    assert info["adaptation"] == {"kind": "lora", "rank": 4, "alpha": 16.0}

    def merged(state):
        model = classifier.build_model(info)
        common.apply_lora(model, 4, 16.0)
        model.load_state_dict(state)
        return common.merge_lora(model).state_dict()

    early = check_best_returned(tuned, merged)["early_stop"]
    adapters = returned_of(tuned, "adapters.safetensors")
    best = checkpoint_model(tuned, early["best_step"])
    assert same(adapters, {k: v for k, v in best.items() if k.endswith((".lora_A", ".lora_B"))})
