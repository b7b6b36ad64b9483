"""What checkpoints cost a run, and how fast a run comes back after its runner dies.

Overhead: the same training job (a 100 MB model: one 5000 x 5000 linear layer, SGD) submitted
twice to a LiveSystem (daphne + scheduler + two runners, a fresh database): once without
checkpoints and once saving a checkpoint with the e31 SDK every --every seconds, which the
runner uploads to storage while the training goes on. The job times its own training loop;
the ratio of the two is the overhead (target: at most 1.05). The number of steps is calibrated
first so that a run lasts about --seconds.

Recovery: a job that checkpoints every few seconds is running when its runner is killed with
SIGKILL; timed from the kill to the job running again on the other runner, against the
heartbeat timeout (target: under 2x the timeout).

    .venv/bin/python bench/checkpoint_overhead.py [--seconds 90] [--every 30] [--timeout 5] [--repeat 3] [--quick]

Runs with and without checkpoints alternate; the medians are compared. It exits 1 if a run with
checkpoints saved none, or the killed job did not resume from a checkpoint.

--quick (CI: the benchmark still works, in about 40 s on 2 cores): a 4 MB model (a 1000 x 1000
layer), runs of about 3 s with a checkpoint every half second (so that even a run much shorter
than calibrated saves some), one of each, and the recovery with a heartbeat timeout of 2 s and
a checkpoint every second; the figures are meaningless.
"""

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.system import LiveSystem  # noqa: E402  (no Django inside)

OVERHEAD_TARGET = 1.05
RECOVERY_TARGET = 2.0

JOB = """
import json, os, time
import torch
from e31 import checkpoint, checkpoint_due, resume, should_stop

config = json.load(open(os.environ["E31_CONFIG"])) if os.environ.get("E31_CONFIG") else {}
steps, every, width = config.get("steps", 20), config.get("every"), config.get("width", 5000)
torch.manual_seed(0)
model = torch.nn.Linear(width, width)  # 5000: 25M parameters, 100 MB of float32
optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)
state = resume(model=model, optimizer=optimizer) if every else None
start = state.step if state else 0
x = torch.randn(16, width)
saves, save_seconds = 0, 0.0
started = time.perf_counter()
for step in range(start + 1, steps + 1):
    optimizer.zero_grad()
    model(x).square().mean().backward()
    optimizer.step()
    if every and checkpoint_due(step, every_seconds=every):
        t = time.perf_counter()
        checkpoint(step, model=model, optimizer=optimizer)
        save_seconds += time.perf_counter() - t
        saves += 1
    if should_stop():
        break
seconds = time.perf_counter() - started
print("RESULT " + json.dumps({"seconds": seconds, "steps": steps - start, "saves": saves, "save_seconds": save_seconds}))
"""


def calibrate(script, width, probe_steps=15):
    """Seconds per training step of the job, run directly on one thread."""
    with tempfile.TemporaryDirectory() as folder:  # noqa: SIM117
        config = Path(folder) / "config.json"
        config.write_text(json.dumps({"steps": probe_steps, "width": width}))
        env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(ROOT), "E31_CONFIG": str(config), "OMP_NUM_THREADS": "1"}
        out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, check=True, timeout=300)
    result = json.loads(out.stdout.split("RESULT ", 1)[1])
    return result["seconds"] / result["steps"]


def result_of(system, job_id):
    lines = system.api("GET", f"/api/jobs/{job_id}/logs/", params={"limit": 5000}).json()["lines"]
    for line in reversed(lines):
        if line["text"].startswith("RESULT "):
            return json.loads(line["text"][len("RESULT ") :])
    raise RuntimeError(f"job {job_id} printed no result: {lines[-20:]}")


def run_job(system, script, config, name):
    job = system.submit({"name": name, "train_dataset": "digits", "gpus": 1, "span_hours": 2, "config": config}, script)
    finished = system.wait_for_state(job["id"], timeout=3600)
    if finished["state"] != "succeeded":
        raise RuntimeError(f"{name} ended {finished['state']}: {finished['reason']}")
    checkpoints = [e for e in finished["timeline"] if e["kind"] == "checkpoint"]
    return result_of(system, job["id"]), finished, checkpoints


def recovery(system, script, timeout, width, every=3):
    """Seconds from SIGKILL of the runner holding a job to the job running on the other one."""
    config = {"steps": 10**6, "every": every, "width": width}
    job = system.submit({"name": "recovery", "train_dataset": "digits", "gpus": 1, "span_hours": 2, "config": config}, script)
    job_id = job["id"]
    system.wait_until(lambda: any(e["kind"] == "checkpoint" for e in system.job(job_id)["timeline"]), 600, "the recovery job's first checkpoint")
    node = system.job(job_id)["allocation"]["node"]
    victim = {"e2e-a": "a", "e2e-b": "b"}[node]
    system.processes[victim].send_signal(signal.SIGKILL)
    killed = time.monotonic()
    system.processes[victim].wait()
    system.wait_until(
        lambda: (j := system.job(job_id))["state"] == "running" and j["allocation"]["node"] != node,
        10 * timeout + 60,
        "the job to run again",
    )
    seconds = time.monotonic() - killed
    resumed = [e for e in system.job(job_id)["timeline"] if e["kind"] == "resume"]
    system.api("POST", f"/api/jobs/{job_id}/cancel/")
    system.wait_for_state(job_id, timeout=120)
    return seconds, resumed


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=90.0, help="length of each training run")
    parser.add_argument("--every", type=float, default=30.0, help="seconds between checkpoints")
    parser.add_argument("--timeout", type=float, default=5.0, help="heartbeat timeout of the runners")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each kind, alternating")
    parser.add_argument("--width", type=int, default=5000, help="the model's layer: width x width (5000: 100 MB)")
    parser.add_argument("--quick", action="store_true", help="a 4 MB model, 3 s runs, one of each (CI: the benchmark still works)")
    args = parser.parse_args()
    recovery_every = 3.0
    if args.quick:
        args.width, args.seconds, args.every, args.timeout, args.repeat, recovery_every = 1000, 3.0, 0.5, 2.0, 1, 1.0

    work = Path(tempfile.mkdtemp(prefix="bench-ckpt-"))
    script = work / "train.py"
    script.write_text(JOB)
    per_step = calibrate(script, args.width)
    steps = max(10, round(args.seconds / per_step))
    parameters = args.width * args.width + args.width
    print(f"model: {parameters:,} parameters ({parameters * 4 / 1e6:,.0f} MB); {per_step * 1000:.1f} ms per step; {steps} steps per run")

    env = {"E31_NODE_TIMEOUT_SECONDS": str(args.timeout), "E31_HEARTBEAT_SECONDS": "0.5", "E31_STOP_GRACE_SECONDS": "10"}
    system = LiveSystem(devices=1, env=env)
    try:
        system.start(runner=False)
        system.start_runner("a", devices=1)
        system.start_runner("b", devices=1)
        plain, saved, problems = [], [], []
        for n in range(args.repeat):  # alternating, so drift on a shared machine hits both alike
            plain.append(run_job(system, script, {"steps": steps, "width": args.width}, f"without checkpoints {n}")[0])
            config = {"steps": steps, "every": args.every, "width": args.width}
            result, _, checkpoints = run_job(system, script, config, f"with checkpoints {n}")
            saved.append(result)
            print(
                f"run {n + 1}: without checkpoints {plain[-1]['seconds']:.2f} s of training; with a checkpoint every "
                f"{args.every:g} s {result['seconds']:.2f} s ({result['saves']} checkpoints saved in "
                f"{result['save_seconds']:.2f} s by the job, {len({e['name'] for e in checkpoints})} uploaded by the runner)"
            )
            if not result["saves"] or not checkpoints:
                problems.append(f"run {n + 1} with checkpoints: {result['saves']} saved, {len(checkpoints)} uploaded")
        seconds, resumed = recovery(system, script, args.timeout, args.width, recovery_every)
        if not resumed:
            problems.append("the killed job did not resume from a checkpoint")
    finally:
        system.stop()
    print(
        f"runner killed -> job running on the other runner: {seconds:.2f} s with a heartbeat timeout of {args.timeout:g} s "
        f"({seconds / args.timeout:.2f}x the timeout; target under {RECOVERY_TARGET:g}x); "
        f"resumed from {resumed[-1]['name'] if resumed else 'nothing'}"
    )
    without = statistics.median(r["seconds"] for r in plain)
    with_checkpoints = statistics.median(r["seconds"] for r in saved)
    print(f"medians over {args.repeat} runs each: without {without:.2f} s, with {with_checkpoints:.2f} s")
    ratio = with_checkpoints / without
    print(f"checkpoint overhead, training time with / without checkpoints: {ratio:.3f} (target at most {OVERHEAD_TARGET})")
    if problems:
        sys.exit("broken: " + "; ".join(problems))


if __name__ == "__main__":
    main()
