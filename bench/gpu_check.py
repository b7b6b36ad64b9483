"""Prove the GPU paths on a GPU node: one script, a few minutes on one GPU, that needs only what
bin/node-install put on the node (the wheelhouse) and the node's own torch.

It starts a live system (SQLite, local storage: daphne, the scheduler and a runner offering the
machine's GPUs, as tests/system.py starts them) and reports each check as PASS or FAIL with its
figures:

- recipes: the classifier and charlm recipes in bf16 on one GPU, through the platform (allocation
  to release, what the meter charges) against the same run started directly with the environment
  the runner gives it (target: at most 1.05x);
- utilization: NVML samples recorded for those jobs (mean and peak GPU use and memory), and the
  right-size hints the job page would show;
- fencing: a job sees only its own GPU (CUDA_VISIBLE_DEVICES, torch's device count and, under the
  sandbox, the /dev/nvidia* device nodes);
- resume: a run checkpointing on the GPU, its runner killed (SIGKILL) and started again, resumes
  from its checkpoint and ends with weights bit-identical to an uninterrupted run's;
- gang: with 2+ GPUs, a 2-process NCCL all-reduce under torchrun; with one GPU it says it was skipped.

Where the job sandbox (bubblewrap) cannot start, that is reported as a failure and the other
checks run again with E31_JOB_ISOLATION=0, so one missing package does not hide the rest.

    python bench/gpu_check.py [--quick] [--report FILE]

On a machine where torch sees no CUDA device it says so and exits 0 (CI runs it that way, with
--quick); --cpu runs every check on the CPU in fp32 (to develop this script where no GPU is; its
figures say nothing of a GPU). It exits 1 when a check fails. The last line: the worse recipe's
allocation-to-release / direct ratio.
"""

import argparse
import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

TARGET = 1.05  # issue 21 and 27: allocation to release <= 1.05x the direct run
JOB_SECONDS = 600

# A job that reports its world: what CUDA shows it, and the device nodes it can open.
SEES = b"""
import glob, json, os, torch
x = torch.ones(64, 64, device="cuda" if torch.cuda.is_available() else "cpu")
print(json.dumps({
    "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
    "count": torch.cuda.device_count(),
    "name": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
    "nodes": sorted(p for p in glob.glob("/dev/nvidia*") if p[len("/dev/nvidia"):].isdigit()),
    "sum": float((x @ x).sum()),
}))
"""

# A resumable run on the GPU: an MLP on fixed random data, deterministic, checkpointing through the
# SDK every few steps (with the RNG states), slowed so that it can be interrupted.
RESUMABLE = b"""
import json, os, time
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
import torch
from torch import nn
import e31
config = json.load(open(os.environ["E31_CONFIG"]))
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.use_deterministic_algorithms(True)
torch.manual_seed(0)
data = torch.randn(512, 32, generator=torch.Generator().manual_seed(1)).to(device)
target = (data[:, :4].sum(1) > 0).long()
model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Dropout(0.1), nn.Linear(256, 2)).to(device)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
start = 0
state = e31.resume(model=model, optimizer=opt, map_location=device)
if state is not None:
    start = state.step
    print(f"resumed at step {start}")
for step in range(start, config["steps"]):
    batch = torch.randint(0, 512, (64,), device=device)
    loss = nn.functional.cross_entropy(model(data[batch]), target[batch])
    opt.zero_grad()
    loss.backward()
    opt.step()
    if (step + 1) % config["every"] == 0:
        e31.checkpoint(step + 1, model=model, optimizer=opt)
        e31.log_metric(step + 1, loss=float(loss))
    time.sleep(config["sleep"])
os.makedirs(os.environ["E31_OUTPUT_DIR"], exist_ok=True)
torch.save({k: v.cpu() for k, v in model.state_dict().items()}, os.path.join(os.environ["E31_OUTPUT_DIR"], "model.pt"))
print("done")
"""

# Two processes under torchrun, one per GPU: an all-reduce over NCCL.
GANG = b"""
import os, torch, torch.distributed as dist
dist.init_process_group("nccl")
rank = dist.get_rank()
torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
x = torch.full((1024,), float(rank + 1), device="cuda")
dist.all_reduce(x)
print(f"rank {rank}: sum {x[0].item()}")
dist.destroy_process_group()
"""


class Check:
    def __init__(self, name):
        self.name, self.ok, self.figures, self.note = name, None, {}, ""

    def line(self):
        state = {True: "PASS", False: "FAIL", None: "SKIP"}[self.ok]
        figures = ", ".join(f"{k} {v}" for k, v in self.figures.items())
        return f"{state}  {self.name}: {figures}{'; ' if figures and self.note else ''}{self.note}"


def gpu_count():
    try:
        import torch
    except ImportError as error:
        return None, f"torch cannot be imported ({error})"
    return torch.cuda.device_count() if torch.cuda.is_available() else 0, torch.__version__


def wait_job(system, job_id, timeout=JOB_SECONDS):
    from tests.system import TERMINAL

    return system.wait_until(lambda: (j := system.job(job_id))["state"] in TERMINAL and j, timeout, f"job {job_id} to end", interval=0.3, max_interval=0.5)


def submit(system, spec, files=()):
    response = system.api("POST", "/api/jobs/", data={"spec": json.dumps(spec)}, files=list(files))
    if response.status_code != 201:
        raise RuntimeError(f"submitting {spec['name']}: {response.status_code} {response.text[:500]}")
    return response.json()["id"]


def held_seconds(system, job_id):
    from tests.system import parse_time

    records = [r for r in system.api("GET", "/api/usage/").json()["records"] if r["job_id"] == job_id]
    return sum((parse_time(r["ended_at"]) - parse_time(r["started_at"])).total_seconds() for r in records)


def log_tail(system, job_id, n=15):
    return " | ".join(system.log_lines(job_id)[-n:])


# The recipes -------------------------------------------------------------------------------------


def recipe_cases(system, text, precision, steps, cpu):
    """[(recipe, spec, files to submit, {role: [(path, bytes)]} for the direct run)]."""
    from runner_overhead import staged_dataset

    train, train_files = staged_dataset(system, "digits")
    heldout, heldout_files = staged_dataset(system, "digits-heldout")
    classifier = {"max_steps": steps, "eval_every": max(1, steps // 4), "hidden": 512, "layers": 3, "batch_size": 256}
    charlm = {"max_steps": steps, "eval_every": max(1, steps // 4), "d_model": 256, "n_layers": 4, "context": 128, "batch_size": 64}
    if cpu:  # the script's own test: the sizes of a CPU, not of a GPU
        classifier.update(hidden=64, layers=2)
        charlm.update(d_model=32, n_layers=1, context=32, batch_size=16)
    base = {"gpus": 1, "span_hours": 1, "precision": precision}
    return [
        (
            "classifier",
            {**base, "name": "gpu-classifier", "recipe": "classifier", "config": classifier, "train_dataset": train, "heldout_dataset": heldout},
            [],
            {"train": train_files, "heldout": heldout_files},
        ),
        ("charlm", {**base, "name": "gpu-charlm", "recipe": "charlm", "config": charlm}, [("data", ("corpus.txt", text))], {"train": [("corpus.txt", text)]}),
    ]


def run_recipe_direct(work, recipe, config, data, precision, device_type):
    """The recipe started as the runner starts it, in a job folder laid out as the runner lays it
    out; seconds from start to exit."""
    from jobs.launch import JobDirs, build_environment

    dirs = JobDirs(Path(tempfile.mkdtemp(prefix=f"direct-{recipe}-", dir=work)))
    dirs.create()
    dirs.config.write_text(json.dumps(config))
    for role, files in data.items():
        for path, content in files:
            dest = dirs.data / role / path
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(content)
    env = build_environment(job_id="direct", dirs=dirs, devices=[0], device_type=device_type, declared={}, config=config, precision=precision)
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-u", "-m", f"e31.recipes.{recipe}"], cwd=dirs.code, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if done.returncode:
        raise RuntimeError(f"direct {recipe} failed: {done.stderr[-1500:]}")
    return seconds, (done.stdout.strip().splitlines() or [""])[-1]


def check_recipes(system, work, args, device_type):
    from jobs.utilization import Summary, gb, right_size

    precision = "fp32" if args.cpu else "bf16"
    recipes, usage = [], Check("utilization (NVML)")
    text = b"".join(p.read_bytes() for p in sorted((ROOT / "docs").glob("*.md")))
    for recipe, spec, files, data in recipe_cases(system, text, precision, args.steps, args.cpu):
        check = Check(f"{recipe} in {precision}, platform vs direct")
        recipes.append(check)
        try:
            # Direct runs before and after the platform's, the faster counted: the ratio errs
            # against the platform, and a cold start (CUDA's, the disk cache's) is not blamed on it.
            first, last = run_recipe_direct(work, recipe, spec["config"], data, precision, device_type)
            job_id = submit(system, spec, files)
            job = wait_job(system, job_id)
            if job["state"] != "succeeded":
                raise RuntimeError(f"job {job_id} ended {job['state']}: {log_tail(system, job_id)}")
            held = held_seconds(system, job_id)
            second, last = run_recipe_direct(work, recipe, spec["config"], data, precision, device_type)
            direct = min(first, second)
            ratio = held / direct
            check.figures = {"direct": f"{first:.2f} s, {second:.2f} s", "allocation to release": f"{held:.2f} s", "ratio": f"{ratio:.3f}"}
            check.ok, check.ratio = ratio <= TARGET, ratio
            check.note = f"direct's last line: {last[:80]}"
            series = (job.get("utilization") or {}).get("series") or []
            usage.figures[recipe] = (
                "; ".join(
                    f"{s['name']} mean {s['mean']:.0f}% peak {s['peak']:.0f}%, memory mean {gb(s['memory_mean'] or 0)} peak {gb(s['memory_peak'] or 0)} of {gb(s['memory_total'] or 0)}"
                    for s in series
                )
                or "no samples"
            )
            hints = right_size(Summary.from_data(job.get("utilization")), devices=1, held_seconds=job["held_seconds"])
            usage.note += f"{recipe} hints: {'; '.join(h.text for h in hints) or 'none'}. "
            # On a GPU node the samples come from NVML, one series per GPU; the process tree's
            # figures (a "cpu" series) would mean NVML was not read.
            sampled = [s for s in series if args.cpu or s["name"] != "cpu"]
            usage.ok = (usage.ok is not False) and bool(sampled) and max(s["peak"] for s in sampled) > 0
        except Exception as error:  # noqa: BLE001 - a check that breaks is reported, the others still run
            check.ok, check.note = False, f"{type(error).__name__}: {error}"[:600]
            usage.ok = False
    return [*recipes, usage]


# Fencing, resume, gang ---------------------------------------------------------------------------


def check_fencing(system, work, gpus, sandboxed, cpu):
    check = Check("fencing: the job sees only its own GPU")
    try:
        job_id = submit(
            system, {"name": "gpu-sees", "entrypoint": "sees.py", "gpus": 1, "span_hours": 1, "train_dataset": "digits"}, [("code", ("sees.py", SEES))]
        )
        job = wait_job(system, job_id)
        seen = json.loads(system.log_lines(job_id)[-1])
        own = str(job["allocation"]["devices"][0]) if job.get("allocation") else "?"
        check.figures = {"CUDA_VISIBLE_DEVICES": seen["visible"], "torch devices": seen["count"], "device nodes": seen["nodes"], "of the node's": gpus}
        if cpu:  # the script's own test: a CPU job sees no GPU at all
            check.ok = job["state"] == "succeeded" and seen["visible"] == "" and seen["count"] == 0
            return check
        ok = job["state"] == "succeeded" and seen["visible"] == own and seen["count"] == 1
        if sandboxed:
            ok = ok and seen["nodes"] == [f"/dev/nvidia{own}"]
        else:
            check.note = "unsandboxed: device nodes are not fenced"
        check.ok = ok
    except Exception as error:  # noqa: BLE001
        check.ok, check.note = False, f"{type(error).__name__}: {error}"[:600]
    return check


def weights_digest(system, job_id):
    response = system.api("GET", f"/api/jobs/{job_id}/artifacts/model.pt", follow_redirects=True)
    if response.status_code != 200:
        raise RuntimeError(f"job {job_id}'s model.pt: {response.status_code}")
    return hashlib.sha256(response.content).hexdigest(), response.content


def check_resume(system, work, args):
    import io

    import torch

    check = Check("checkpoint, runner killed, resumed on the GPU: weights bit-identical")
    config = {"steps": args.resume_steps, "every": max(1, args.resume_steps // 6), "sleep": 0.05}
    spec = {"entrypoint": "resume.py", "gpus": 1, "span_hours": 1, "config": config, "train_dataset": "digits"}
    try:
        whole = submit(system, {**spec, "name": "gpu-whole"}, [("code", ("resume.py", RESUMABLE))])
        job = wait_job(system, whole)
        if job["state"] != "succeeded":
            raise RuntimeError(f"the uninterrupted run ended {job['state']}: {log_tail(system, whole)}")
        broken = submit(system, {**spec, "name": "gpu-resumed"}, [("code", ("resume.py", RESUMABLE))])
        system.wait_until(lambda: [e for e in system.job(broken)["timeline"] if e["kind"] == "checkpoint"], 120, "a checkpoint", interval=0.1, max_interval=0.1)
        system.processes["runner"].send_signal(signal.SIGKILL)
        system.processes["runner"].wait()
        restart_runner(system)
        job = wait_job(system, broken)
        resumed = [line for line in system.log_lines(broken) if line.startswith("resumed at step")]
        a, b = torch.load(io.BytesIO(weights_digest(system, whole)[1])), torch.load(io.BytesIO(weights_digest(system, broken)[1]))
        identical = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        check.figures = {
            "state": job["state"],
            "restarts": job["restarts"],
            "resumed": resumed[-1][len("resumed at ") :] if resumed else "no",
            "credited": f"{job['credited_seconds']} s",
        }
        check.ok = job["state"] == "succeeded" and job["restarts"] >= 1 and bool(resumed) and identical
        check.note = "weights bit-identical" if identical else "weights DIFFER from the uninterrupted run"
    except Exception as error:  # noqa: BLE001
        check.ok, check.note = False, f"{type(error).__name__}: {error}"[:600]
    return check


def restart_runner(system, timeout=90):
    """The killed runner started again under its name, which it may take once the name's last
    heartbeat is older than E31_NODE_TIMEOUT_SECONDS: it then kills what its predecessor left and
    ends that allocation, and the job is queued again to resume from its checkpoint. Started
    again until its log says it is offering its devices (the name was free)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        system.start_runner(devices=system.devices)
        runner, log = system.processes["runner"], system.var_dir / "runner.log"
        while runner.poll() is None and "offering" not in log.read_text(errors="replace"):
            time.sleep(0.2)
        if runner.poll() is None:
            return
        time.sleep(1)
    raise RuntimeError("the runner did not start again: " + (system.var_dir / "runner.log").read_text().strip().splitlines()[-1])


def check_gang(system, gpus):
    check = Check("gang: 2 processes, NCCL all-reduce")
    if gpus < 2:
        check.note = f"skipped: this node has {gpus} GPU (a gang needs 2)"
        return check
    try:
        job_id = submit(
            system,
            {"name": "gpu-gang", "entrypoint": "gang.py", "gpus": 2, "processes": 2, "span_hours": 1, "train_dataset": "digits"},
            [("code", ("gang.py", GANG))],
        )
        job = wait_job(system, job_id)
        sums = [line for line in system.log_lines(job_id) if "sum" in line]
        check.figures = {"state": job["state"], "lines": sums}
        check.ok = job["state"] == "succeeded" and len(sums) == 2 and all(line.endswith("sum 3.0") for line in sums)
    except Exception as error:  # noqa: BLE001
        check.ok, check.note = False, f"{type(error).__name__}: {error}"[:600]
    return check


# The system --------------------------------------------------------------------------------------


def start_system(devices, isolation):
    from tests.system import LiveSystem

    env = {"E31_NODE_TIMEOUT_SECONDS": "4", "E31_STOP_GRACE_SECONDS": "5"}
    if not isolation:
        env["E31_JOB_ISOLATION"] = "0"
    system = LiveSystem(devices=devices, env=env, seeded=False)
    system.start()
    time.sleep(3)
    runner = system.processes["runner"]
    if runner.poll() is not None:
        log = (system.var_dir / "runner.log").read_text(errors="replace")
        system.stop()
        return None, log.strip().splitlines()[-1] if log.strip() else f"the runner exited {runner.returncode}"
    return system, ""


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="CI: fewer steps (on a machine without a GPU it only says so)")
    parser.add_argument("--cpu", action="store_true", help="run every check on the CPU in fp32 (developing this script; no GPU figure)")
    parser.add_argument("--report", help="also write the results as JSON to this file")
    parser.add_argument("--logs", help="copy the live system's logs into this folder before it stops")
    args = parser.parse_args(argv)
    args.steps = 60 if args.quick else 1500
    args.resume_steps = 90 if args.quick else 300

    gpus, torch_version = gpu_count()
    if gpus is None or (gpus == 0 and not args.cpu):
        why = torch_version if gpus is None else f"torch {torch_version} sees no CUDA device"
        print(f"no GPU: {why}, so no GPU path was proven here (run this on a GPU node)")
        print("gpu_check: 0 GPUs seen, nothing proven")
        return 0
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "e31web.settings")
    import django

    django.setup()
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per poll otherwise
    from agent.runner import detect_device_type

    device_type = "cpu" if args.cpu else detect_device_type()
    devices = max(gpus, 1)
    print(f"node: {devices} x {device_type}; torch {torch_version}; Python {sys.version.split()[0]}", flush=True)

    checks = []
    sandbox = Check("sandbox (bubblewrap) starts jobs")
    system, why = start_system(devices, isolation=True)
    sandbox.ok = system is not None
    sandbox.note = why or "the runner's sandbox probe passed"
    if system is None:
        system, why = start_system(devices, isolation=False)
        if system is None:
            raise SystemExit(f"gpu_check: the runner does not start even unsandboxed: {why}")
    checks.append(sandbox)
    print(sandbox.line(), flush=True)
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    try:
        for run in (
            lambda: check_fencing(system, work, gpus, sandbox.ok, args.cpu),
            lambda: check_recipes(system, work, args, device_type),
            lambda: check_resume(system, work, args),
            lambda: check_gang(system, gpus),
        ):
            found = run()
            for check in found if isinstance(found, list) else [found]:
                checks.append(check)
                print(check.line(), flush=True)
    finally:
        if args.logs:  # the web server's, the scheduler's and the runner's, for a failure read elsewhere
            Path(args.logs).mkdir(parents=True, exist_ok=True)
            for log in system.var_dir.glob("*.log"):
                shutil.copy(log, Path(args.logs) / log.name)
        system.stop()
    if args.report:
        Path(args.report).write_text(json.dumps([{"name": c.name, "ok": c.ok, "figures": c.figures, "note": c.note} for c in checks], indent=1, default=str))
    failed = [c for c in checks if c.ok is False]
    ratios = [(c.ratio, c.name.split()[0]) for c in checks if hasattr(c, "ratio")]
    print(f"{len([c for c in checks if c.ok])} passed, {len(failed)} failed, {len([c for c in checks if c.ok is None])} skipped")
    if ratios:
        worst = max(ratios)
        print(f"worse recipe's allocation-to-release / direct ({worst[1]}): {worst[0]:.3f}")
    else:
        print("gpu_check: no recipe ratio measured")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
