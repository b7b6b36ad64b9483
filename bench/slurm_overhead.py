"""Slurm overhead: the digits example through the Slurm executor against our local runner.

Two systems side by side on this machine: one with our runner (the embedded default), one with
E31_EXECUTOR=slurm on a real single-node Slurm started here (tests/slurm_cluster.py: Debian's
slurm-wlm and munge, as root; bin/setup test installs them). The same digits job is submitted to
each in turn, alternating, so a noisy machine weighs on both alike, and for each run two figures
are read from the job itself:

- held: allocation to release, the seconds billed (through Slurm: from Slurm's start to our agent's
  end, which includes starting our agent inside the Slurm job and staging the job's data there,
  where the runner had it staged before the meter started);
- turnaround: submission to succeeded, as the user waits for it;
- first line: submission to the job's first log line (stored), as the user watching it waits.

The job is the example as it comes (its own config: 30 epochs, held some 4.5 s here, most of it
the job's own start: Python, torch, the data); --epochs N runs it shorter. What the Slurm side
adds is about fixed per allocation (starting our agent, Python and Django, inside the Slurm job:
some 0.4 s here), so the shorter the job, the more it weighs: it is printed in seconds too.

Prints each run, the medians of each side, the fixed overhead, and last the ratio of the medians
of held time, Slurm over local (issue 26's target: at most 1.10). Exits 1 if a job does not
succeed.

Both systems run on PostgreSQL by default, as under Slurm, where the agents reach the database
from the nodes (--database sqlite: the embedded default's).

    .venv/bin/python bench/slurm_overhead.py [--rounds 5] [--epochs N] [--database postgres] [--quick]

--quick (CI: the benchmark still works, about a minute on 2 cores): one round of one epoch.
"""

import argparse
import os
import statistics
import sys
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.slurm_cluster import SlurmCluster, missing_tools  # noqa: E402
from tests.system import LiveSystem  # noqa: E402

EXAMPLE = ROOT / "examples" / "digits" / "train.py"


def run_once(system, name, epochs):
    started = time.monotonic()
    spec = {"name": name, "train_dataset": "digits", "gpus": 1, "span_hours": 0.5}
    if epochs is not None:  # else the example's own config
        spec["config"] = {"epochs": epochs}
    job = system.submit(spec, EXAMPLE)
    done = system.wait_for_state(job["id"], timeout=600)
    turnaround = time.monotonic() - started
    if done["state"] != "succeeded":
        sys.exit(f"{name} ended {done['state']}: {done.get('reason')}\n{system.logs()[-4000:]}")
    [allocation] = done["allocations"]
    held = (parse(allocation["ended_at"]) - parse(allocation["started_at"])).total_seconds()
    lines = system.api("GET", f"/api/jobs/{job['id']}/logs/?limit=1").json()["lines"]
    first_line = (parse(lines[0]["at"]) - parse(done["created_at"])).total_seconds() if lines else float("nan")
    return held, turnaround, first_line


def parse(text):
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=None, help="train this many epochs (default: the example's own config, 30)")
    parser.add_argument("--quick", action="store_true", help="one round of one epoch (CI: the benchmark still works)")
    parser.add_argument(
        "--database",
        default="postgres",
        choices=["postgres", "sqlite"],
        help="both systems' database: PostgreSQL (the default) as under Slurm, where the agents reach it from the nodes",
    )
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.epochs = 1, 1
    missing = missing_tools()
    if missing or os.geteuid() != 0:
        sys.exit(f"needs a test Slurm: root, and {', '.join(missing) or 'the Slurm tools'} (bin/setup test installs slurm-wlm and munge)")

    cluster = SlurmCluster().start()
    slurm_env = {
        "E31_EXECUTOR": "slurm",
        "E31_SLURM_CONF": str(cluster.conf),
        "E31_SLURM_PARTITIONS": cluster.partition,
        "E31_ENGINE_SECONDS": "0.2",
        "E31_ENGINE_MEMORY_MB_PER_DEVICE": "1024",
    }
    local, slurm = LiveSystem(devices=1, database=args.database), LiveSystem(devices=1, env=slurm_env, database=args.database)
    figures = {"local": [], "slurm": []}
    try:
        local.start()
        slurm.start(runner=False)
        print(f"Slurm started in {cluster.started_in:.1f} s; node {cluster.node} with {cluster.cpus} CPUs")
        # One run each to warm up (imports, the runner's staging of the digits data): not counted.
        run_once(local, "warm-local", 1)
        run_once(slurm, "warm-slurm", 1)
        print(f"{'run':<12} {'held s':>8} {'turnaround s':>13} {'first line s':>13}")
        for n in range(args.rounds):
            for side, system in (("local", local), ("slurm", slurm)) if n % 2 == 0 else (("slurm", slurm), ("local", local)):
                held, turnaround, first_line = run_once(system, f"{side}-{n}", args.epochs)
                figures[side].append((held, turnaround, first_line))
                print(f"{side}-{n:<6} {held:>8.2f} {turnaround:>13.2f} {first_line:>13.2f}")
    finally:
        local.stop()
        slurm.stop()
        cluster.stop()
    medians = {side: tuple(statistics.median(run[i] for run in runs) for i in range(3)) for side, runs in figures.items()}
    for side, (held, turnaround, first_line) in medians.items():
        print(f"median {side}: held {held:.2f} s, turnaround {turnaround:.2f} s, submission to first log line {first_line:.2f} s")
    print(f"turnaround, Slurm over local: {medians['slurm'][1] / medians['local'][1]:.2f}")
    print(f"what the Slurm side adds to each allocation (median held, Slurm minus local): {medians['slurm'][0] - medians['local'][0]:.2f} s")
    print(f"held time (billed), Slurm over local (target at most 1.10): {medians['slurm'][0] / medians['local'][0]:.2f}")


if __name__ == "__main__":
    main()
