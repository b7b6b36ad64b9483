"""How much longer the digits example takes when run through E31 Network than run directly.

Direct: examples/digits/train.py as a subprocess, in a job folder laid out as the runner lays it
out (code/, data/train, data/heldout, output/, config.json), with the environment and command
the runner would give it (scheduler.launch.build_environment / command_for) and its output read
through pipes. Its data are the files the system stages for the job: the manifest of each
dataset's latest version (path, size, SHA-256, from the API), the bytes read from the system's
storage by their blob keys (datasets are kept as content-addressed blobs) and checked against
the manifest, put at data/<role>/<path> as staging puts them. Timed from just before Popen to
the process's exit.

System: the same script and config submitted to a LiveSystem (daphne + scheduler + a real
runner, a fresh database), timed from allocation to release: the usage record's
started_at/ended_at, what the meter charges. The job must pin the dataset versions the direct
runs read.

Direct and system runs alternate, so drift on a noisy machine hits both alike; the direct runs
happen while the system is up and idle (its scheduler, runner and web server poll in the
background either way). Medians are reported; the last line is the ratio of the medians,
allocation-to-release / direct.

    .venv/bin/python bench/runner_overhead.py [--repeat 5] [--epochs 200] [--database sqlite|postgres] [--redis] [--quick]

--quick (CI: the benchmark still works): 3 rounds of 5 epochs, about 40 s on 2 idle cores.
"""

import argparse
import hashlib
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

from e31web.storage import LocalStorage, blob_key  # noqa: E402  (no Django settings read)
from scheduler.launch import JobDirs, build_environment, command_for  # noqa: E402  (no Django inside)
from tests.system import TERMINAL, LiveSystem, parse_time  # noqa: E402

EXAMPLE = ROOT / "examples" / "digits" / "train.py"
DATASETS = {"train": "digits", "heldout": "digits-heldout"}  # role: the demo dataset the job names
TARGET = 1.10
POLL_SECONDS = 0.5


def staged_dataset(system, name):
    """What the system stages for a dataset the job names: its latest version's label (NAME@N,
    as the job pins it) and files [(path, bytes)]. The manifest comes from the API; each file's
    bytes from the system's storage under the blob key of its SHA-256 (a LiveSystem keeps them
    in a local folder in its var dir), checked as staging checks them."""
    found = [d for d in system.api("GET", "/api/datasets/?page_size=200").json()["results"] if d["name"] == name]
    assert len(found) == 1 and found[0]["latest_version"], f"expected one ready dataset {name}, found {found}"
    dataset = found[0]
    version = system.api("GET", f"/api/datasets/{dataset['id']}/versions/{dataset['latest_version']}/").json()
    storage = LocalStorage(system.var_dir / "storage")
    files = []
    for f in version["manifest"]:
        with storage.open(blob_key(f["sha256"])) as blob:
            data = blob.read()
        assert len(data) == f["size"] and hashlib.sha256(data).hexdigest() == f["sha256"], f"{name}: {f['path']} is not as its manifest says"
        files.append((f["path"], data))
    return f"{name}@{version['number']}", files


def run_direct(work, config, data):
    """One direct run in a fresh job folder; returns (seconds, last line printed). data:
    {role: [(path, bytes)]}."""
    dirs = JobDirs(Path(tempfile.mkdtemp(prefix="direct-", dir=work)))
    dirs.create()
    dirs.config.write_text(json.dumps(config, indent=2))
    shutil.copy(EXAMPLE, dirs.code / "train.py")
    for role, files in data.items():
        for path, content in files:
            dest = dirs.data / role / path
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(content)
    env = build_environment(job_id="direct", dirs=dirs, devices=[0], device_type="cpu", declared={}, config=config)
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


def run_system(system, config, n, pinned):
    """One run through the system: (allocation-to-release seconds, submit-to-succeeded seconds,
    allocation-to-running seconds, the last line the script printed). pinned: {role: NAME@N},
    the versions the direct runs read, which the job must have pinned."""
    spec = {
        "name": f"bench-digits-{n}",
        "train_dataset": DATASETS["train"],
        "heldout_dataset": DATASETS["heldout"],
        "gpus": 1,
        "span_hours": 1,
        "config": config,
    }
    submitted = time.perf_counter()
    job = system.submit(spec, EXAMPLE)

    def ended():
        found = system.job(job["id"])
        return found if found["state"] in TERMINAL else None

    # Polled gently (every POLL_SECONDS): each question costs the web server CPU the job would
    # use; the figure that counts comes from the usage record anyway.
    try:
        done = system.wait_until(ended, 600, f"job {job['id']} to end", interval=POLL_SECONDS, max_interval=POLL_SECONDS)
    except TimeoutError:
        raise TimeoutError(f"job {job['id']}: {system.job(job['id'])}\n{system.logs()}") from None
    wall = time.perf_counter() - submitted
    if done["state"] != "succeeded":
        raise RuntimeError(f"job {job['id']} ended {done['state']}: {done}\n{system.logs()}")
    seen = {role: done[f"{role}_dataset"] for role in pinned}
    assert seen == pinned, f"the job pinned {seen}, the direct runs read {pinned}"
    records = [r for r in system.api("GET", "/api/usage/").json()["records"] if r["job_id"] == job["id"]]
    assert len(records) == 1, records
    started, ended_at = parse_time(records[0]["started_at"]), parse_time(records[0]["ended_at"])
    running = [parse_time(t["at"]) for t in done["timeline"] if t["state"] == "running"][-1]
    last = system.log_lines(job["id"])[-1]
    return (ended_at - started).total_seconds(), wall, (running - started).total_seconds(), last


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=200, help="more epochs: a longer run (30 is the example's default)")
    parser.add_argument("--database", choices=["sqlite", "postgres"], default="sqlite")
    parser.add_argument("--redis", action="store_true", help="the Redis channel layer instead of the database relay")
    parser.add_argument("--no-warmup", action="store_true", help="skip the untimed first run of each")
    parser.add_argument("--quick", action="store_true", help="3 rounds of 5 epochs (CI: the benchmark still works)")
    args = parser.parse_args()
    repeat, epochs = (3, 5) if args.quick else (args.repeat, args.epochs)
    if repeat < 1 or epochs < 1:
        parser.error("--repeat and --epochs must be at least 1")

    config = {"epochs": epochs, "lr": 0.003, "hidden": 128, "batch_size": 64, "seed": 0}
    direct, system_held, system_wall, system_cpu = [], [], [], {}
    work = Path(tempfile.mkdtemp(prefix="e31-bench-direct-"))
    print(f"digits example, config {config}; {repeat} runs each, alternating; database {args.database}"
          f"{' + redis' if args.redis else ''}", flush=True)
    try:
        with LiveSystem(database=args.database, redis=args.redis) as system:
            pinned, data = {}, {}
            for role, name in DATASETS.items():
                pinned[role], data[role] = staged_dataset(system, name)
            print("  data: " + "; ".join(
                f"{role} {pinned[role]} ({', '.join(f'{path} {len(content):,} bytes' for path, content in data[role])})" for role in data
            ), flush=True)
            if not args.no_warmup:
                # Page cache warm for python, torch and sklearn, and the system's first-request costs paid.
                run_direct(work, {**config, "epochs": 1}, data)
                run_system(system, {**config, "epochs": 1}, "warmup", pinned)
                print("  (one untimed 1-epoch warm-up run of each done)", flush=True)
            for i in range(repeat):
                seconds, last = run_direct(work, config, data)
                direct.append(seconds)
                print(f"  run {i + 1}: direct {seconds:.3f} s   ({last[:90]})", flush=True)
                cpu_before = system.cpu_seconds()
                held, wall, to_running, last = run_system(system, config, i, pinned)
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
    print(f"ratio (system allocation->release / direct): {ratio:.2f}")


if __name__ == "__main__":
    main()
