"""What the bubblewrap sandbox costs a job: the digits example run directly vs in the sandbox.

Both runs go through the runner's own code (agent.isolation) with the same uid, cgroup and
limits, in a job folder laid out as the runner lays it out, with the demo's digits CSV files:

- direct: the shim joins the cgroup, sets the limits and becomes the job's uid, then runs the
  command (only folders the uid cannot pass are covered, so it can reach Python);
- sandboxed: the same, then bwrap with the job's view (namespaces, the built file system).

Runs alternate, so drift on a noisy machine hits both alike. Printed: the medians of the whole
run (start to exit) and of the time to the job's first log line; the last line is the ratio of
the whole-run medians (target <= 1.03).

    sudo .venv/bin/python bench/sandbox_overhead.py [--repeat 7] [--epochs 60] [--quick]

--quick (CI: the benchmark still works, in about 10 s): one run of 3 epochs each way; the figures
are meaningless. Where job isolation is off (not root, no bubblewrap or cgroups) there is nothing
to compare and it exits 1, --quick or not: tests/test_bench_quick.py skips it there, as the
sandbox tests are skipped.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "e31web.settings")

import django  # noqa: E402

django.setup()

from django.conf import settings  # noqa: E402

from agent.isolation import (  # noqa: E402
    Isolation,
    Sandbox,
    job_limits,
    job_uid,
    rlimits,
    shim_command,
)
from e31web.demo import digits_csv, digits_split  # noqa: E402
from jobs.launch import JobDirs, build_environment, command_for  # noqa: E402

EXAMPLE = ROOT / "examples" / "digits" / "train.py"
TARGET = 1.03


def job_folder(work, config, train_csv):
    dirs = JobDirs(Path(tempfile.mkdtemp(prefix="run-", dir=work)))
    dirs.create()
    dirs.config.write_text(json.dumps(config))
    shutil.copy(EXAMPLE, dirs.code / "train.py")
    (dirs.data / "train" / "digits.csv").write_bytes(train_csv if isinstance(train_csv, bytes) else train_csv.encode())
    return dirs


def run_once(iso, work, config, train_csv, sandboxed, index):
    dirs = job_folder(work, config, train_csv)
    limits = job_limits(
        memory_bytes=0,
        max_processes=4096,
        max_open_files=65536,
        max_file_bytes=2**36,
        disk_bytes=0,
        devices_held=1,
        devices_total=2,
        node_memory=iso.node_memory,
        device_type="cpu",
        node_cpus=iso.node_cpus,
    )
    uid = job_uid(settings.E31_JOB_UID_BASE, settings.E31_JOB_UID_COUNT - 2) if iso.users_on else None
    sandbox = Sandbox(iso, f"bench-{index}", "bench", limits, uid=uid, network=False)
    sandbox.prepare(dirs)
    env = build_environment(job_id="bench", dirs=dirs, devices=[0], device_type="cpu", declared={})
    command = command_for("train.py", [])
    if sandboxed:
        argv, outer, fds = sandbox.command(command, dirs, env)
    else:
        spec = {"cgroups": [str(c) for c in sandbox.cgroups], "cwd": str(dirs.code), "rlimits": rlimits(limits, per_user=uid is not None, hard=iso.hard)}
        if uid is not None:
            spec.update(uid=uid, gid=uid, covers=iso.covers([str(dirs.root), *iso.runtime]))
        argv, outer, fds = shim_command(command, spec), env, ()
    started = time.perf_counter()
    process = subprocess.Popen(argv, env=outer, pass_fds=fds, cwd=dirs.code, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    for fd in fds:
        os.close(fd)
    first = None
    last = b""
    for line in process.stdout:
        first = first or time.perf_counter() - started
        last = line
    process.wait()
    elapsed = time.perf_counter() - started
    sandbox.release()
    shutil.rmtree(dirs.root, ignore_errors=True)
    if process.returncode != 0:
        raise SystemExit(f"the {'sandboxed' if sandboxed else 'direct'} run failed: {last.decode(errors='replace')}")
    return elapsed, first or elapsed


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--epochs", type=int, default=60)
    parser.add_argument("--quick", action="store_true", help="one short round of each (CI: the benchmark still works)")
    options = parser.parse_args()
    repeat, epochs = (1, 3) if options.quick else (options.repeat, options.epochs)
    work = Path(tempfile.mkdtemp(prefix="e31-sandbox-bench-"))
    iso = Isolation("bench", work / "runs", work / "cache", settings)
    iso.probe(f"bench-{os.getpid()}")
    if not iso.sandboxed:
        raise SystemExit("job isolation is off here (E31_JOB_ISOLATION=0): nothing to compare")
    (x, y), _ = digits_split()
    train_csv = digits_csv(x, y)
    config = {"epochs": epochs}
    times = {False: [], True: []}
    firsts = {False: [], True: []}
    try:
        for index in range(repeat):
            for sandboxed in (index % 2 == 1, index % 2 == 0):  # alternate which goes first
                elapsed, first = run_once(iso, work / "runs", config, train_csv, sandboxed, f"{index}-{int(sandboxed)}")
                times[sandboxed].append(elapsed)
                firsts[sandboxed].append(first)
    finally:
        iso.cgroups.remove_runner()
        shutil.rmtree(work, ignore_errors=True)
    direct, boxed = statistics.median(times[False]), statistics.median(times[True])
    print(
        f"runs: {repeat} of each, digits example, {epochs} epochs, uid {'of its own' if iso.users_on else 'the runner s'}, cgroups {'on' if iso.cgroups_on else 'off'}"
    )
    print(f"direct:    median {direct:.3f} s (runs {', '.join(f'{t:.2f}' for t in times[False])})")
    print(f"sandboxed: median {boxed:.3f} s (runs {', '.join(f'{t:.2f}' for t in times[True])})")
    print(f"first log line: direct {statistics.median(firsts[False]) * 1000:.0f} ms, sandboxed {statistics.median(firsts[True]) * 1000:.0f} ms")
    print(f"target: sandboxed / direct <= {TARGET}")
    print(f"sandboxed / direct: {boxed / direct:.3f}")


if __name__ == "__main__":
    main()
