"""The built-in recipes (e31/recipes/): settings, LoRA, and the recipes run as a job runs them.

The recipes run as subprocesses with a job's environment (temporary data, output, checkpoint and
model folders; a JSON config). Data and models are tiny so the whole file takes well under a minute.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from e31.recipes import RECIPES, common, validate
from e31.recipes.classifier import MLP

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.nodb  # plain processes and tensors: run once, with the SQLite pass


# -- helpers ----------------------------------------------------------------------------------


def run_recipe(recipe, folder, config, *, data, models=None, check=True, stop_file=False, env=None):
    """Run python -m e31.recipes.<recipe> with a job's environment rooted at folder (and env's variables)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    extra = env or {}
    env = {k: v for k, v in os.environ.items() if not k.startswith(("E31_", "SM_")) and k not in ("RANK", "WORLD_SIZE")}
    env.update(
        PYTHONPATH=str(ROOT),
        OMP_NUM_THREADS="1",
        CUDA_VISIBLE_DEVICES="",
        E31_DATA_DIR=str(data),
        E31_OUTPUT_DIR=str(folder / "out"),
        E31_CHECKPOINT_DIR=str(folder / "ckpt"),
        E31_CONFIG=str(folder / "config.json"),
        E31_METRICS_FILE=str(folder / "metrics.jsonl"),
        E31_STOP_FILE=str(folder / "stop"),
        E31_RESTART="0",
    )
    if models is not None:
        env["E31_MODEL_DIR"] = str(models)
    env.update(extra)
    if stop_file:
        (folder / "stop").write_text(json.dumps({"reason": "preempted", "deadline": 0}))
    else:
        (folder / "stop").unlink(missing_ok=True)
    result = subprocess.run([sys.executable, "-m", f"e31.recipes.{recipe}"], env=env, capture_output=True, text=True, timeout=120)
    if check:
        assert result.returncode == 0, result.stdout + result.stderr
    return result


def metric_lines(folder):
    return [json.loads(line) for line in (Path(folder) / "metrics.jsonl").read_text().splitlines()]


def evaluations(folder, name):
    return [(line["step"], line["values"][name]) for line in metric_lines(folder) if name in line["values"]]


def final_metrics(folder):
    return json.loads((Path(folder) / "out" / "metrics.json").read_text())


def stage(models, **folders):
    """$E31_MODEL_DIR with one subfolder per model, copied from run output folders."""
    models.mkdir(parents=True, exist_ok=True)
    for label, source in folders.items():
        target = models / label
        target.mkdir()
        for path in Path(source).iterdir():
            (target / path.name).write_bytes(path.read_bytes())
    return models


def write_table(path, x, y):
    columns = ",".join(f"f{i}" for i in range(x.shape[1]))
    rows = [",".join(f"{v:.6f}" for v in row) + f",{label}" for row, label in zip(x, y)]
    path.write_text(f"{columns},label\n" + "\n".join(rows) + "\n")


def blobs(rng, count, shift=0.0):
    """Three separable classes in 5 dimensions (features on different scales)."""
    y = rng.integers(0, 3, size=count)
    centres = np.array([[3, 0, 0, 0, 0], [0, 3, 0, 0, 0], [0, 0, 3, 0, 0]], dtype=np.float64)
    x = centres[y] + rng.normal(scale=0.7, size=(count, 5)) + shift
    return (x * np.array([1, 10, 0.1, 1, 100])).astype(np.float32), y


@pytest.fixture(scope="module")
def tabular(tmp_path_factory):
    data = tmp_path_factory.mktemp("tabular")
    rng = np.random.default_rng(0)
    (data / "train").mkdir()
    (data / "heldout").mkdir()
    write_table(data / "train" / "part1.csv", *blobs(rng, 300))
    x, y = blobs(rng, 200)
    np.savez(data / "train" / "part2.npz", x=x, y=y)
    write_table(data / "heldout" / "rows.csv", *blobs(rng, 150))
    return data


CLASSIFIER = {"max_steps": 40, "eval_every": 20, "checkpoint_every": 10, "hidden": 32, "batch_size": 32, "lr": 0.01}


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tabular):
    """A classifier trained from scratch (its output folder is the start of other tests)."""
    folder = tmp_path_factory.mktemp("trained")
    run_recipe("classifier", folder, CLASSIFIER, data=tabular)
    return folder


# -- settings ---------------------------------------------------------------------------------


def test_validate_fills_defaults_and_coerces():
    clean, errors = validate("classifier", {"lr": "0.01", "max_steps": 12.0, "smoke": "true", "adaptation": "lora"})
    assert errors == {}
    assert clean["lr"] == 0.01 and clean["max_steps"] == 12 and isinstance(clean["max_steps"], int)
    assert clean["smoke"] is True and clean["adaptation"] == "lora"
    assert clean["hidden"] == 128 and clean["layers"] == 2 and clean["mode"] == "train" and clean["patience"] == 0
    assert {p.name for p in RECIPES["charlm"].params} >= {"context", "d_model", "n_layers", "n_heads", "lora_rank", "lora_alpha", "seed"}


def test_validate_explains_what_is_wrong():
    assert "unknown recipe 'gpt5'" in validate("gpt5", {})[1]["recipe"]
    _, errors = validate("classifier", {"hiden": 3, "lr": -1, "adaptation": "qlora", "max_steps": 2.5, "smoke": "maybe"})
    assert set(errors) == {"hiden", "lr", "adaptation", "max_steps", "smoke"}
    assert "unknown setting 'hiden'" in errors["hiden"]
    assert "at least" in errors["lr"]
    assert "'qlora' is not one of: full, lora" in errors["adaptation"]
    assert "whole number" in errors["max_steps"]
    assert "true or false" in errors["smoke"]
    assert "must divide d_model" in validate("charlm", {"d_model": 30, "n_heads": 4})[1]["n_heads"]


def test_the_package_imports_without_torch():
    code = "import sys, e31.recipes; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True)
    assert out.stdout.strip() == "False", out.stderr


# -- LoRA, in process -------------------------------------------------------------------------


def test_lora_starts_equal_freezes_the_base_and_merges_to_the_same_outputs():
    torch.manual_seed(0)
    model = MLP(6, 16, 2, 3)
    base = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(20, 6)
    before = model(x)
    adapters = common.apply_lora(model, rank=4, alpha=8)
    assert len(adapters) == 3
    assert torch.equal(model(x), before)  # B starts at zero
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(name.endswith((".lora_A", ".lora_B")) for name in trainable)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05)
    for _ in range(5):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), torch.arange(20) % 3).backward()
        optimizer.step()
    for key, value in base.items():  # the base weights never moved
        layer, _, kind = key.rpartition(".")
        assert torch.equal(model.state_dict()[f"{layer}.base.{kind}"], value)
    assert set(common.lora_state_dict(model)) == {f"net.{i}.lora_{m}" for i in (0, 2, 4) for m in "AB"}

    merged = common.merge_lora(model)
    assert not common.has_lora(merged) and common.has_lora(model)
    assert set(merged.state_dict()) == set(base)  # the base architecture, plain nn.Linear layers
    assert torch.allclose(merged(x), model(x), atol=1e-5)
    assert not torch.allclose(merged(x), before, atol=1e-3)  # the adapters did change the outputs
    layer = adapters[0]
    expected = base["net.0.weight"] + (layer.alpha / layer.rank) * layer.lora_B @ layer.lora_A
    assert torch.allclose(merged.state_dict()["net.0.weight"], expected)


# -- classifier -------------------------------------------------------------------------------


def test_classifier_learns_separable_data(trained):
    final = final_metrics(trained)
    assert final["val_accuracy"] >= 0.95
    assert evaluations(trained, "val_accuracy")[-1] == (CLASSIFIER["max_steps"], final["val_accuracy"])
    info = json.loads((trained / "out" / "recipe.json").read_text())
    assert info["recipe"] == "classifier" and info["data"]["classes"] == [0, 1, 2] and info["data"]["features"] == 5
    assert info["architecture"] == {"in_features": 5, "hidden": 32, "layers": 2, "classes": 3}
    assert not (trained / "out" / "adapters.safetensors").exists()


def test_a_fine_tune_starts_where_the_previous_run_ended(tmp_path, tabular, trained):
    models = stage(tmp_path / "models", start=trained / "out")
    run_recipe("classifier", tmp_path / "job", {**CLASSIFIER, "max_steps": 10, "eval_every": 5}, data=tabular, models=models)
    previous = final_metrics(trained)
    first = metric_lines(tmp_path / "job")[0]
    assert first["step"] == 0
    assert first["values"]["val_loss"] == pytest.approx(previous["val_loss"], abs=1e-6)
    assert first["values"]["val_accuracy"] == pytest.approx(previous["val_accuracy"], abs=1e-6)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, tabular, trained):
    folder = tmp_path_factory.mktemp("lora")
    models = stage(folder / "models", start=trained / "out")
    config = {**CLASSIFIER, "max_steps": 10, "eval_every": 5, "adaptation": "lora", "lora_rank": 2, "lora_alpha": 4, "lr": 0.05}
    run_recipe("classifier", folder / "job", config, data=tabular, models=models)
    return folder / "job"


def test_lora_fine_tune_changes_the_start_only_by_the_merged_adapters(lora_run, trained):
    start = load_file(str(trained / "out" / "model.safetensors"))
    merged = load_file(str(lora_run / "out" / "model.safetensors"))
    adapters = load_file(str(lora_run / "out" / "adapters.safetensors"))
    info = json.loads((lora_run / "out" / "recipe.json").read_text())
    assert info["adaptation"] == {"kind": "lora", "rank": 2, "alpha": 4.0}
    assert set(merged) == set(start)
    scale = 4.0 / 2
    moved = 0
    for key, value in start.items():
        layer, _, kind = key.rpartition(".")
        if kind == "bias":
            assert torch.equal(merged[key], value)  # frozen, not adapted
            continue
        delta = scale * adapters[f"{layer}.lora_B"] @ adapters[f"{layer}.lora_A"]
        assert torch.allclose(merged[key], value + delta, atol=1e-6)
        moved += int(delta.abs().max() > 1e-4)
    assert moved == 3  # every layer's adapter trained

    # The merged weights give the LoRA model's outputs.
    arch = info["architecture"]
    lora_model = MLP(arch["in_features"], arch["hidden"], arch["layers"], arch["classes"])
    lora_model.load_state_dict(start)
    common.apply_lora(lora_model, 2, 4.0)
    lora_model.load_state_dict(adapters, strict=False)
    plain = MLP(arch["in_features"], arch["hidden"], arch["layers"], arch["classes"])
    plain.load_state_dict(merged)
    x = torch.randn(50, arch["in_features"])
    assert torch.allclose(plain(x), lora_model(x), atol=1e-5)


def test_evaluate_scores_each_staged_model_on_the_same_rows(tmp_path, tabular, trained, lora_run):
    models = stage(tmp_path / "models", scratch=trained / "out", lora=lora_run / "out")
    run_recipe("classifier", tmp_path / "job", {"mode": "evaluate"}, data=tabular, models=models)
    report = json.loads((tmp_path / "job" / "out" / "evaluation.json").read_text())
    assert report["recipe"] == "classifier" and report["metric"] == "accuracy" and report["higher_is_better"] is True
    assert set(report["models"]) == {"scratch", "lora"}

    # The accuracy of the scratch model, computed here from its files, row by row.
    info = json.loads((trained / "out" / "recipe.json").read_text())
    model = MLP(5, 32, 2, 3)
    model.load_state_dict(load_file(str(trained / "out" / "model.safetensors")))
    table = np.loadtxt(tabular / "heldout" / "rows.csv", delimiter=",", skiprows=1, dtype=np.float32)
    x = (table[:, :5] - np.array(info["data"]["mean"], dtype=np.float32)) / np.array(info["data"]["std"], dtype=np.float32)
    with torch.no_grad():
        correct = (model(torch.from_numpy(x)).argmax(dim=1).numpy() == table[:, 5]).astype(float)
    scratch = report["models"]["scratch"]
    assert scratch["per_example"] == correct.tolist()
    assert scratch["metrics"]["accuracy"] == pytest.approx(correct.mean())
    assert scratch["metrics"]["accuracy"] == pytest.approx(final_metrics(trained)["val_accuracy"])
    assert len(report["models"]["lora"]["per_example"]) == len(correct)
    assert report["models"]["lora"]["metrics"]["accuracy"] == pytest.approx(final_metrics(lora_run)["val_accuracy"])


def test_evaluate_refuses_a_model_of_another_architecture(tmp_path, tabular, trained):
    models = stage(tmp_path / "models", good=trained / "out", bad=trained / "out")
    info = json.loads((models / "bad" / "recipe.json").read_text())
    info["architecture"]["hidden"] = 16
    (models / "bad" / "recipe.json").write_text(json.dumps(info))
    result = run_recipe("classifier", tmp_path / "job", {"mode": "evaluate"}, data=tabular, models=models, check=False)
    assert result.returncode != 0
    message = result.stderr.strip().splitlines()[-1]
    assert message.startswith("error:") and "'bad'" in message and "do not match the architecture" in message
    assert not (tmp_path / "job" / "out" / "evaluation.json").exists()


def test_smoke_runs_a_few_steps_and_writes_outputs(tmp_path, tabular):
    run_recipe("classifier", tmp_path, {**CLASSIFIER, "smoke": True, "max_steps": 1000}, data=tabular)
    steps = [line["step"] for line in metric_lines(tmp_path)]
    assert max(steps) <= common.SMOKE_STEPS
    assert (tmp_path / "out" / "model.safetensors").exists() and (tmp_path / "out" / "recipe.json").exists()
    assert set(final_metrics(tmp_path)) == {"val_loss", "val_accuracy"}


def test_an_interrupted_run_resumes_to_identical_weights(tmp_path, tabular, trained):
    stopped = run_recipe("classifier", tmp_path, CLASSIFIER, data=tabular, stop_file=True)
    assert "stopping at step 1" in stopped.stdout
    assert not (tmp_path / "out" / "metrics.json").exists()
    assert [p.name for p in (tmp_path / "ckpt").iterdir()] == ["step-000000000001.pt"]
    resumed = run_recipe("classifier", tmp_path, CLASSIFIER, data=tabular)
    assert "resumed from step-000000000001.pt" in resumed.stdout
    ours = load_file(str(tmp_path / "out" / "model.safetensors"))
    uninterrupted = load_file(str(trained / "out" / "model.safetensors"))
    assert all(torch.equal(ours[k], uninterrupted[k]) for k in uninterrupted)
    assert final_metrics(tmp_path) == final_metrics(trained)


def test_bf16_on_the_cpu_is_a_no_op_said_once_and_trains_as_fp32_does(tmp_path, tabular, trained):
    result = run_recipe("classifier", tmp_path, CLASSIFIER, data=tabular, env={"E31_PRECISION": "bf16"})
    assert result.stdout.count("precision bf16 asked: a no-op on the CPU, running fp32") == 1
    ours = load_file(str(tmp_path / "out" / "model.safetensors"))
    fp32 = load_file(str(trained / "out" / "model.safetensors"))
    assert all(torch.equal(ours[k], fp32[k]) for k in fp32)
    assert final_metrics(tmp_path) == final_metrics(trained)


def test_fp32_and_the_default_say_nothing_of_precision_and_a_bad_one_fails_at_once(tmp_path, tabular):
    for value in ("fp32", ""):
        result = run_recipe("classifier", tmp_path / (value or "default"), {**CLASSIFIER, "smoke": True}, data=tabular, env={"E31_PRECISION": value})
        assert "precision" not in result.stdout
    bad = run_recipe("classifier", tmp_path / "bad", CLASSIFIER, data=tabular, env={"E31_PRECISION": "fp8"}, check=False)
    assert bad.returncode == 1
    assert "error: $E31_PRECISION: 'fp8' is not a precision: choose fp32, bf16 or fp16" in bad.stderr
    assert not (tmp_path / "bad" / "metrics.jsonl").exists()  # refused before a step ran


# -- charlm -----------------------------------------------------------------------------------


CHARLM = {"max_steps": 20, "eval_every": 10, "context": 16, "d_model": 32, "n_layers": 1, "n_heads": 2, "batch_size": 16, "lr": 0.01, "eval_windows": 16}


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    data = tmp_path_factory.mktemp("text")
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "the", "dog", "ran", "to", "the", "big", "red", "house"]
    rng = np.random.default_rng(0)
    (data / "train").mkdir()
    (data / "train" / "a.txt").write_text(" ".join(rng.choice(words, size=1500)) + "\n")
    return data  # no heldout/: the last 10% of the training bytes


def test_charlm_learns_and_a_fine_tune_starts_where_it_ended(tmp_path, text):
    run_recipe("charlm", tmp_path / "first", CHARLM, data=text)
    losses = evaluations(tmp_path / "first", "val_loss")
    assert [step for step, _ in losses] == [10, 20]
    final = final_metrics(tmp_path / "first")
    assert final["val_loss"] < losses[0][1] < math.log(256)
    assert final["val_bpb"] == pytest.approx(final["val_loss"] / math.log(2))

    models = stage(tmp_path / "models", start=tmp_path / "first" / "out")
    run_recipe("charlm", tmp_path / "second", {**CHARLM, "max_steps": 6, "eval_every": 6}, data=text, models=models)
    tuned = evaluations(tmp_path / "second", "val_loss")
    assert tuned[0] == (0, pytest.approx(final["val_loss"], abs=1e-6))
    assert tuned[-1][1] < tuned[0][1]


# -- charlm over several processes ------------------------------------------------------------


def run_recipe_processes(recipe, folder, config, *, data, processes, stop_file=False):
    """Run the recipe under torchrun (gloo on the CPU) with processes processes and a job's environment."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("E31_", "SM_", "TORCHELASTIC_")) and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update(
        PYTHONPATH=str(ROOT),
        OMP_NUM_THREADS="1",
        CUDA_VISIBLE_DEVICES="",
        E31_DATA_DIR=str(data),
        E31_OUTPUT_DIR=str(folder / "out"),
        E31_CHECKPOINT_DIR=str(folder / "ckpt"),
        E31_CONFIG=str(folder / "config.json"),
        E31_METRICS_FILE=str(folder / "metrics.jsonl"),
        E31_STOP_FILE=str(folder / "stop"),
        E31_RESTART="0",
    )
    if stop_file:
        (folder / "stop").write_text(json.dumps({"reason": "preempted", "deadline": 0}))
    else:
        (folder / "stop").unlink(missing_ok=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}", "-m", f"e31.recipes.{recipe}"]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def test_a_finished_run_of_several_processes_leaves_without_the_interpreters_teardown(monkeypatch, capsys):
    """After the group is left, a run of several processes ends at once (os._exit, its streams
    flushed): the interpreter's teardown of what torch.distributed held aborted a finished run's
    process now and then in CI. A run of one process, or one that failed, ends as Python does."""
    calls = []

    class Group:
        def __init__(self, parallel):
            self.active = int(os.environ.get("WORLD_SIZE", "1")) > 1

        def close(self, finished=False):
            calls.append(("close", finished))

    class Left(Exception):
        pass

    def exit_now(code):
        calls.append(("exit", code))
        raise Left

    monkeypatch.setattr(common, "Dist", Group)
    monkeypatch.setattr(common.os, "_exit", exit_now)
    monkeypatch.delenv("E31_CONFIG", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(Left):
        common.main("charlm", lambda config, dist: print("trained", end=""), lambda config: None)
    assert calls == [("close", True), ("exit", 0)]
    assert capsys.readouterr().out == "trained", "printed before it left"
    calls.clear()
    with pytest.raises(RuntimeError):
        common.main("charlm", lambda config, dist: (_ for _ in ()).throw(RuntimeError("diverged")), lambda config: None)
    assert calls == [("close", False)]
    calls.clear()
    monkeypatch.setenv("WORLD_SIZE", "1")
    common.main("charlm", lambda config, dist: None, lambda config: None)
    assert calls == [("close", True)]


def test_charlm_validates_the_parallel_setting():
    assert validate("charlm", {})[0]["parallel"] == "ddp"
    assert validate("charlm", {"parallel": "fsdp"}) == ({**RECIPES["charlm"].defaults(), "parallel": "fsdp"}, {})
    assert "'tp' is not one of: ddp, fsdp" in validate("charlm", {"parallel": "tp"})[1]["parallel"]


FSDP_CHARLM = {**CHARLM, "parallel": "fsdp", "checkpoint_every": 10}


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory, text):
    """charlm with parallel=fsdp over 2 processes (gloo on the CPU), checkpointing at steps 10 and 20."""
    folder = tmp_path_factory.mktemp("fsdp")
    result = run_recipe_processes("charlm", folder, FSDP_CHARLM, data=text, processes=2)
    assert "fully sharded data parallel (FSDP2): 2 processes on cpu (gloo)" in result.stdout
    return folder


@pytest.fixture(scope="module")
def one_process_run(tmp_path_factory, text):
    """The same configuration in one process: parallel=fsdp then trains the plain model."""
    folder = tmp_path_factory.mktemp("one")
    result = run_recipe("charlm", folder, FSDP_CHARLM, data=text)
    assert "1 process on cpu" in result.stdout
    return folder


def test_charlm_fully_sharded_over_two_processes_trains_as_one_process_does(sharded_run, one_process_run, text):
    from e31.recipes import charlm

    # Each process takes half of every global batch of 16 and FSDP averages the gradients, so two
    # sharded processes take the steps one process takes on the whole batch (to rounding).
    ours, one = evaluations(sharded_run, "val_loss"), evaluations(one_process_run, "val_loss")
    assert [step for step, _ in ours] == [10, 20] and ours[-1][1] < ours[0][1]
    for (step, loss), (_, expected) in zip(ours, one):
        assert loss == pytest.approx(expected, rel=1e-4), step

    # model.safetensors holds the whole, unsharded model: it loads into the single-process
    # architecture and scores what the run reported.
    info = json.loads((sharded_run / "out" / "recipe.json").read_text())
    model = charlm.build_model(info)
    model.load_state_dict(load_file(str(sharded_run / "out" / "model.safetensors")))
    train = charlm.read_text(text / "train")
    val = train[len(train) - max(1, int(len(train) * charlm.HOLDOUT_FRACTION)) :]
    starts = charlm.window_starts(len(val), CHARLM["context"], CHARLM["eval_windows"])
    metrics, _ = charlm.score(model, val, starts, CHARLM["context"], torch.device("cpu"))
    assert metrics["loss"] == pytest.approx(final_metrics(sharded_run)["val_loss"], rel=1e-6)


def test_a_fully_sharded_checkpoint_resumes_in_one_process(tmp_path, sharded_run, one_process_run, text):
    # The checkpoint holds the gathered (whole) model and optimizer state, so it does not depend
    # on how many processes wrote it.
    assert sorted(p.name for p in (sharded_run / "ckpt").iterdir()) == ["step-000000000010.pt", "step-000000000020.pt"]
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "step-000000000010.pt").write_bytes((sharded_run / "ckpt" / "step-000000000010.pt").read_bytes())
    resumed = run_recipe("charlm", tmp_path, FSDP_CHARLM, data=text)
    assert "resumed from step-000000000010.pt at step 10" in resumed.stdout
    assert [step for step, _ in evaluations(tmp_path, "val_loss")] == [20]
    assert final_metrics(tmp_path)["val_loss"] == pytest.approx(final_metrics(one_process_run)["val_loss"], rel=1e-4)
