"""How much longer the digits example takes when run through E31 Network than run directly.

Direct: examples/digits/train.py as a subprocess, in a job folder laid out as the runner lays it
out (code/, data/train, data/heldout, output/, config.json), with the environment and command
the runner would give it (scheduler.launch.build_environment / command_for), the same CSV
files the system stages (copied from the LiveSystem's own dataset storage) and its output read
through pipes. Timed from just before Popen to the process's exit.

System: the same script and config submitted to a LiveSystem (daphne + scheduler + runner, a
fresh database), timed from allocation to release: the usage record's started_at/ended_at.

Direct and system runs alternate, so drift on a noisy machine hits both alike; the direct runs
happen while the system is up and idle (its scheduler, runner and web server poll in the
background either way). Medians are
reported; the last line is the ratio of the medians.

    .venv/bin/python bench/runner_overhead.py [--repeat 5] [--epochs 200] [--database sqlite|postgres] [--redis]
"""

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scheduler.launch import JobDirs, build_environment, command_for  # noqa: E402  (no Django inside)
from tests.system import TERMINAL, LiveSystem, parse_time  # noqa: E402

EXAMPLE = ROOT / "examples" / "digits" / "train.py"
TARGET = 1.10
POLL_SECONDS = 0.5


def staged_dataset_file(system, name, work):
    """The CSV file the system keeps for a demo dataset (what its runner copies into a job),
    copied under its own name: datasets are kept as blobs named by their SHA-256."""
    import sqlite3

    with sqlite3.connect(system.var_dir / "e31.sqlite3") as db:
        rows = db.execute("SELECT key FROM jobs_datasetfile WHERE path = ?", (name,)).fetchall()
    assert len(rows) == 1, f"expected one stored {name}, found {rows}"
    copy = Path(work) / name
    shutil.copy(system.var_dir / "storage" / rows[0][0], copy)
    return copy


def run_direct(work, config, train_csv, heldout_csv):
    """One direct run in a fresh job folder; returns (seconds, last line printed)."""
    dirs = JobDirs(Path(tempfile.mkdtemp(prefix="direct-", dir=work)))
    dirs.create()
    dirs.config.write_text(json.dumps(config, indent=2))
    shutil.copy(EXAMPLE, dirs.code / "train.py")
    shutil.copy(train_csv, dirs.data / "train" / train_csv.name)
    shutil.copy(heldout_csv, dirs.data / "heldout" / heldout_csv.name)
    env = build_environment(job_id="direct", dirs=dirs, devices=[0], device_type="cpu", declared={})
    started = time.perf_counter()
    process = subprocess.Popen(
        command_for("train.py", []),
        cwd=dirs.code,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    out, err = process.communicate()
    seconds = time.perf_counter() - started
    if process.returncode != 0:
        raise RuntimeError(f"direct run failed ({process.returncode}):\n{err.decode()[-3000:]}")
    assert (dirs.output / "model.pt").exists()
    shutil.rmtree(dirs.root, ignore_errors=True)
    return seconds, out.decode().strip().splitlines()[-1]


def run_system(system, config, n):
    """One run through the system: (allocation-to-release seconds, submit-to-succeeded seconds,
    allocation-to-running seconds, the script's own training seconds)."""
    spec = {
        "name": f"bench-digits-{n}",
        "train_dataset": "digits",
        "heldout_dataset": "digits-heldout",
        "gpus": 1,
        "span_hours": 1,
        "config": config,
    }
    submitted = time.perf_counter()
    job = system.submit(spec, EXAMPLE)
    # Poll gently (LiveSystem.wait_for_state asks every 0.1 s, which costs the web server more CPU
    # than the job's whole run does); the figure that counts comes from the usage record anyway.
    deadline = time.monotonic() + 600
    while (done := system.job(job["id"]))["state"] not in TERMINAL:
        if time.monotonic() > deadline:
            raise TimeoutError(f"job {job['id']}: {done}\n{system.logs()}")
        time.sleep(POLL_SECONDS)
    wall = time.perf_counter() - submitted
    if done["state"] != "succeeded":
        raise RuntimeError(f"job {job['id']} ended {done['state']}: {done}\n{system.logs()}")
    records = [r for r in system.api("GET", "/api/usage/").json()["records"] if r["job_id"] == job["id"]]
    assert len(records) == 1, records
    started, ended = parse_time(records[0]["started_at"]), parse_time(records[0]["ended_at"])
    running = [parse_time(t["at"]) for t in done["timeline"] if t["state"] == "running"][-1]
    lines = system.api("GET", f"/api/jobs/{job['id']}/logs/?after=0&limit=5000").json()["lines"]
    return (ended - started).total_seconds(), wall, (running - started).total_seconds(), lines[-1]["text"]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=200, help="more epochs: a longer run (30 is the example's default)")
    parser.add_argument("--database", choices=["sqlite", "postgres"], default="sqlite")
    parser.add_argument("--redis", action="store_true", help="the Redis channel layer instead of the database relay")
    parser.add_argument("--no-warmup", action="store_true", help="skip the untimed first run of each")
    args = parser.parse_args()

    config = {"epochs": args.epochs, "lr": 0.003, "hidden": 128, "batch_size": 64, "seed": 0}
    direct, system_held, system_wall, system_cpu = [], [], [], {}
    work = Path(tempfile.mkdtemp(prefix="e31-bench-direct-"))
    print(f"digits example, config {config}; {args.repeat} runs each, alternating; database {args.database}"
          f"{' + redis' if args.redis else ''}", flush=True)
    try:
        with LiveSystem(database=args.database, redis=args.redis) as system:
            train_csv = staged_dataset_file(system, "digits-train.csv", work)
            heldout_csv = staged_dataset_file(system, "digits-heldout.csv", work)
            if not args.no_warmup:
                # Page cache warm for python, torch and sklearn, and the system's first-request costs paid.
                run_direct(work, {**config, "epochs": 1}, train_csv, heldout_csv)
                run_system(system, {**config, "epochs": 1}, "warmup")
                print("  (one untimed 1-epoch warm-up run of each done)", flush=True)
            for i in range(args.repeat):
                seconds, last = run_direct(work, config, train_csv, heldout_csv)
                direct.append(seconds)
                print(f"  run {i + 1}: direct {seconds:.3f} s   ({last[:90]})", flush=True)
                cpu_before = system.cpu_seconds()
                held, wall, to_running, last = run_system(system, config, i)
                cpu_after = system.cpu_seconds()
                cpu = {k: cpu_after[k] - cpu_before.get(k, 0.0) for k in cpu_after}
                for k, v in cpu.items():
                    system_cpu.setdefault(k, []).append(v)
                system_held.append(held)
                system_wall.append(wall)
                print(f"  run {i + 1}: system {held:.3f} s allocation->release   ({last[:90]})", flush=True)
                print(f"         allocation->process started {to_running:.3f} s, process started->release "
                      f"{held - to_running:.3f} s; submit->succeeded seen by polling (every {POLL_SECONDS} s) {wall:.3f} s", flush=True)
                print("         CPU used meanwhile by the system's own processes: "
                      + ", ".join(f"{k} {v:.2f} s" for k, v in cpu.items()), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    d, s, w = statistics.median(direct), statistics.median(system_held), statistics.median(system_wall)
    print(f"direct, median of {len(direct)}: {d:.3f} s   (all: {', '.join(f'{x:.3f}' for x in direct)})")
    print(f"system allocation->release, median of {len(system_held)}: {s:.3f} s   (all: {', '.join(f'{x:.3f}' for x in system_held)})")
    print(f"system submit->succeeded (client polling every {POLL_SECONDS} s), median: {w:.3f} s")
    print(f"overhead: {s - d:+.3f} s per run")
    print("system processes' own CPU per run, median: "
          + ", ".join(f"{k} {statistics.median(v):.2f} s ({statistics.median(v) / w * 100:.0f}% of a core)" for k, v in system_cpu.items()))
    ratio = s / d
    verdict = "within" if ratio <= TARGET else "OVER"
    print(f"target: ratio <= {TARGET:.2f}: {verdict} target")
    print(f"ratio (system / direct): {ratio:.2f}")


if __name__ == "__main__":
    main()
