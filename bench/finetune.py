"""Does fine-tuning from an earlier run's weights pay? The charlm recipe, fine-tuned vs from scratch.

Two related generated corpora: A, many records of a structured text ("name: ada; city: oslo; ...")
and B, the same kind of records with other names, cities and field order. The charlm recipe is
run as a job runs it (python -m e31.recipes.charlm with a job's environment, temporary folders):
first trained on A from scratch, then on B for --steps steps twice, once starting from A's
weights ($E31_MODEL_DIR/start) and once from scratch, same settings and seed. Printed: each run's
final validation loss on B's held-out text and its wall time (the recipe run directly, start-up
included), and the ratio of the two B runs' validation losses (fine-tuned / from scratch; below
1 means the earlier run's weights helped).

Then the same fine-tuning through the platform: a LiveSystem (web server, scheduler, runner) and
a finetune job submitted through the API with A's weights uploaded as its starting model, timed
from allocation to release (its usage record), as bench/runner_overhead.py times the digits
example; direct and platform runs alternate. The last line is the ratio of the medians,
platform / direct (target at most 1.10). It exits 1 if a platform run's validation loss is not
the direct run's (the same fine-tuning on the same data and seed).

    .venv/bin/python bench/finetune.py [--pretrain-steps 300] [--steps 100] [--repeat 5] [--quick]

--quick (CI: the benchmark still works, in about 30 s on 2 cores): 10 pretraining steps, 5
fine-tuning steps and one round of direct and platform runs; every step of the full run, its
figures meaningless.
"""

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
TARGET = 1.10
POLL_SECONDS = 0.5
MODEL = {"context": 64, "d_model": 64, "n_layers": 2, "n_heads": 4, "batch_size": 32, "lr": 0.003, "eval_windows": 64}


def records(rng, names, cities, fields, count):
    lines = []
    for _ in range(count):
        values = {
            "name": rng.choice(names),
            "city": rng.choice(cities),
            "age": str(rng.randint(18, 90)),
            "score": f"{rng.randint(0, 100)}.{rng.randint(0, 9)}",
        }
        lines.append("; ".join(f"{field}: {values[field]}" for field in fields) + ".")
    return "\n".join(lines) + "\n"


def make_corpora(root):
    rng = random.Random(0)
    corpus_a = records(rng, ["ada", "alan", "grace", "edsger", "barbara", "donald"], ["oslo", "lima", "kyoto", "paris"], ["name", "age", "city", "score"], 6000)
    new_names, new_cities, new_fields = ["ken", "dennis", "frances", "john", "radia"], ["quito", "perth", "riga", "nairobi"], ["city", "name", "score", "age"]
    corpus_b = records(rng, new_names, new_cities, new_fields, 600)
    corpus_b_heldout = records(rng, new_names, new_cities, new_fields, 150)
    for name, train, heldout in (("a", corpus_a, None), ("b", corpus_b, corpus_b_heldout)):
        (root / name / "train").mkdir(parents=True)
        (root / name / "train" / "records.txt").write_text(train)
        if heldout:
            (root / name / "heldout").mkdir()
            (root / name / "heldout" / "records.txt").write_text(heldout)


def run(folder, data, config, models=None):
    """Run the recipe as a job would; (final metrics, wall seconds)."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("E31_", "SM_")) and k not in ("RANK", "WORLD_SIZE")}
    env.update(
        OMP_NUM_THREADS="1",  # what a job on one CPU slot gets: the same compute either way
        PYTHONPATH=str(ROOT),
        E31_DATA_DIR=str(data),
        E31_OUTPUT_DIR=str(folder / "out"),
        E31_CHECKPOINT_DIR=str(folder / "ckpt"),
        E31_CONFIG=str(folder / "config.json"),
        E31_METRICS_FILE=str(folder / "metrics.jsonl"),
    )
    if models is not None:
        env["E31_MODEL_DIR"] = str(models)
    started = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "e31.recipes.charlm"], env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if result.returncode != 0:
        sys.exit(f"the recipe failed in {folder.name}:\n{result.stdout}{result.stderr}")
    return json.loads((folder / "out" / "metrics.json").read_text()), seconds


def run_platform(system, root, tuning, n):
    """The fine-tuning as a job: (allocation-to-release seconds, final val_loss)."""
    from tests.system import TERMINAL, parse_time

    spec = {"name": f"bench-finetune-{n}", "kind": "finetune", "recipe": "charlm", "config": tuning, "gpus": 1, "span_hours": 1}
    out = root / "pretrain" / "out"
    files = [
        ("data", ("records.txt", (root / "b" / "train" / "records.txt").read_bytes())),
        ("heldout", ("records.txt", (root / "b" / "heldout" / "records.txt").read_bytes())),
        ("base_model", ("model.safetensors", (out / "model.safetensors").read_bytes())),
        ("base_model", ("recipe.json", (out / "recipe.json").read_bytes())),
    ]
    response = system.api("POST", "/api/jobs/", data={"spec": json.dumps(spec)}, files=files)
    assert response.status_code == 201, response.text
    job_id = response.json()["id"]
    deadline = time.monotonic() + 900
    while (done := system.job(job_id))["state"] not in TERMINAL:
        if time.monotonic() > deadline:
            raise TimeoutError(f"job {job_id}: {done}\n{system.logs()}")
        time.sleep(POLL_SECONDS)
    if done["state"] != "succeeded":
        raise RuntimeError(f"job {job_id} ended {done['state']}: {done['reason']}\n{system.logs()}")
    [record] = [r for r in system.api("GET", "/api/usage/").json()["records"] if r["job_id"] == job_id]
    started = parse_time(record["started_at"])
    held = (parse_time(record["ended_at"]) - started).total_seconds()
    # The timeline holds checkpoints and resumes too, not only state changes.
    running = [parse_time(t["at"]) for t in done["timeline"] if t["kind"] == "state" and t["state"] == "running"][-1]
    metrics = json.loads(system.api("GET", f"/api/jobs/{job_id}/artifacts/metrics.json").content)
    return held, (running - started).total_seconds(), metrics["val_loss"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pretrain-steps", type=int, default=300)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=5, help="fine-tunings timed directly and through the platform, alternating")
    parser.add_argument("--quick", action="store_true", help="10 + 5 steps, one round (CI: the benchmark still works)")
    args = parser.parse_args()
    if args.quick:
        args.pretrain_steps, args.steps, args.repeat = 10, 5, 1
    differ = 0
    root = Path(tempfile.mkdtemp(prefix="e31-bench-finetune-"))
    try:
        make_corpora(root)
        tuning = {**MODEL, "max_steps": args.steps, "eval_every": args.steps, "checkpoint_every": 0}
        pretrained, seconds = run(
            root / "pretrain", root / "a", {**MODEL, "max_steps": args.pretrain_steps, "eval_every": args.pretrain_steps, "checkpoint_every": 0}
        )
        print(f"corpus A from scratch, {args.pretrain_steps} steps: val_loss {pretrained['val_loss']:.4f} (on A), {seconds:.1f} s", flush=True)
        (root / "models").mkdir()
        shutil.copytree(root / "pretrain" / "out", root / "models" / "start")
        tuned, tuned_seconds = run(root / "finetune", root / "b", tuning, models=root / "models")
        scratch, scratch_seconds = run(root / "scratch", root / "b", tuning)
        print(f"corpus B fine-tuned from A, {args.steps} steps: val_loss {tuned['val_loss']:.4f}, val_bpb {tuned['val_bpb']:.3f}, {tuned_seconds:.1f} s")
        print(f"corpus B from scratch,      {args.steps} steps: val_loss {scratch['val_loss']:.4f}, val_bpb {scratch['val_bpb']:.3f}, {scratch_seconds:.1f} s")
        print(f"ratio finetune/scratch val_loss: {tuned['val_loss'] / scratch['val_loss']:.3f} (below 1: the earlier weights helped)", flush=True)

        from tests.system import LiveSystem

        direct, platform = [], []
        with LiveSystem(devices=1) as system:
            for i in range(args.repeat):
                metrics, seconds = run(root / f"direct-{i}", root / "b", tuning, models=root / "models")
                direct.append(seconds)
                held, to_running, val_loss = run_platform(system, root, tuning, i)
                platform.append(held)
                same = "same" if abs(val_loss - metrics["val_loss"]) < 1e-6 else f"DIFFERENT: {metrics['val_loss']:.6f}"
                differ += same != "same"
                print(
                    f"  run {i + 1}: direct {seconds:.2f} s, platform {held:.2f} s allocation->release "
                    f"({to_running:.2f} s of it to the process start); val_loss {val_loss:.4f} ({same})",
                    flush=True,
                )
        d, p = statistics.median(direct), statistics.median(platform)
        print(f"fine-tuning wall time, median of {args.repeat}: direct {d:.2f} s, through the platform {p:.2f} s (overhead {p - d:+.2f} s)")
        print(f"target: ratio <= {TARGET:.2f}: {'within' if p / d <= TARGET else 'OVER'} target")
        print(f"ratio (platform / direct): {p / d:.2f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if differ:
        sys.exit(f"{differ} platform run(s) ended with another validation loss than the direct run")


if __name__ == "__main__":
    main()
