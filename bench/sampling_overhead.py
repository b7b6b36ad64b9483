"""What sampling a job's devices costs: the digits example through the whole system with the
runner sampling every 2 s, against the same run with sampling off; and the bytes stored per
job-hour of samples.

Two LiveSystems are up at once (fresh databases; one runner each, E31_UTIL_SAMPLE_SECONDS=2 and
=0, given to the runners: nothing else reads it), and runs alternate between them, so drift on
a noisy machine hits both alike. Each run is timed from allocation to release (its usage record). Medians are reported; the last line is the
ratio of the medians (sampled / not sampled), target at most 1.01.

Bytes per job-hour: the windows the sampled runs stored (their rows, as JSON), per hour held;
and, as the runner's arithmetic gives them, for an hour of a 1-device and an 8-device job. It
exits 1 if the sampled runs stored no samples.

    .venv/bin/python bench/sampling_overhead.py [--repeat 5] [--epochs 150] [--database sqlite|postgres] [--quick]

--quick (CI: the benchmark still works, in about 25 s on 2 cores): one 20-epoch run on each
system, no warm-up runs, sampling every 0.5 s (a run of a few seconds would otherwise end before
its first reading) and 50 readings of a process tree for the cost of one; the figures are
meaningless.
"""

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from agent.sampling import ProcessTreeSampler  # noqa: E402  (no Django inside)
from jobs.utilization import Reading, Recorder, stored_bytes  # noqa: E402
from tests.system import TERMINAL, LiveSystem, parse_time  # noqa: E402

EXAMPLE = ROOT / "examples" / "digits" / "train.py"
TARGET = 1.01
EVERY = 2.0
POLL_SECONDS = 0.5

STORED = """
import json
from jobs.models import Utilization
rows = [(r.allocation.started_at, r.allocation.ended_at, len(json.dumps(r.windows, separators=(",", ":"))), len(r.windows)) for r in Utilization.objects.select_related("allocation")]
print(json.dumps([[(e - s).total_seconds(), b, n] for s, e, b, n in rows if e]))
"""


def run(system, config, n):
    """One run: (allocation-to-release seconds, the script's last line)."""
    spec = {"name": f"bench-sampling-{n}", "train_dataset": "digits", "heldout_dataset": "digits-heldout", "gpus": 1, "span_hours": 1, "config": config}
    job = system.submit(spec, EXAMPLE)
    deadline = time.monotonic() + 600
    while (done := system.job(job["id"]))["state"] not in TERMINAL:
        if time.monotonic() > deadline:
            raise TimeoutError(f"job {job['id']}: {done}\n{system.logs()}")
        time.sleep(POLL_SECONDS)
    if done["state"] != "succeeded":
        raise RuntimeError(f"job {job['id']} ended {done['state']}: {done}\n{system.logs()}")
    [record] = [r for r in system.api("GET", "/api/usage/").json()["records"] if r["job_id"] == job["id"]]
    held = (parse_time(record["ended_at"]) - parse_time(record["started_at"])).total_seconds()
    lines = system.api("GET", f"/api/jobs/{job['id']}/logs/?after=0&limit=5000").json()["lines"]
    return held, lines[-1]["text"], done.get("utilization")


@contextlib.contextmanager
def live_system(database, every):
    """A LiveSystem whose runner samples every `every` seconds (0: never). Only the runner reads
    E31_UTIL_SAMPLE_SECONDS, so only the runner is given it: both systems start from the same
    seeded database (a setting in a LiveSystem's env would make it a seed of its own)."""
    system = LiveSystem(database=database)
    try:
        system.start(runner=False)
        system.env["E31_UTIL_SAMPLE_SECONDS"] = str(every)
        system.start_runner()
        yield system
    finally:
        system.stop()


def hour_of(devices, width=30.0):
    """Bytes of one job-hour of samples every 2 s, as the runner's Recorder stores them."""
    recorder = Recorder(every=EVERY, width=width)
    for i in range(int(3600 / EVERY)):
        recorder.add(i * EVERY, [Reading(40.0 + (i * 7 + d * 13) % 60 + 0.3, (9 + d) * 1024**3 + i * 4096) for d in range(devices)])
    return stored_bytes(recorder.snapshot())


def read_cost(children=4, n=500):
    """Seconds one reading of a process tree takes (this process and a few children, found by
    walking /proc as on a node without cgroups: the dearer way)."""
    kids = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]) for _ in range(children)]
    try:
        sampler = ProcessTreeSampler(os.getpid())
        sampler.read()
        started = time.perf_counter()
        for _ in range(n):
            sampler.read()
        return (time.perf_counter() - started) / n
    finally:
        for kid in kids:
            kid.kill()
            kid.wait()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=150)
    parser.add_argument("--database", choices=["sqlite", "postgres"], default="sqlite")
    parser.add_argument("--quick", action="store_true", help="one 20-epoch run on each, no warm-up, sampling every 0.5 s (CI: the benchmark still works)")
    args = parser.parse_args()
    every, readings = EVERY, 500
    if args.quick:
        args.repeat, args.epochs, every, readings = 1, 20, 0.5, 50

    config = {"epochs": args.epochs, "lr": 0.003, "hidden": 128, "batch_size": 64, "seed": 0}
    sampled, plain = [], []
    print(f"digits example, config {config}; {args.repeat} runs each, alternating; sampling every {every:g} s vs off; database {args.database}", flush=True)
    with live_system(args.database, every) as on, live_system(args.database, 0) as off:
        if not args.quick:
            run(on, {**config, "epochs": 1}, "warmup")
            run(off, {**config, "epochs": 1}, "warmup")
            print("  (one untimed 1-epoch warm-up run on each done)", flush=True)
        for i in range(args.repeat):
            # Which goes first alternates too.
            order = [(on, sampled, "sampled"), (off, plain, "not sampled")]
            for system, times, label in order if i % 2 == 0 else order[::-1]:
                held, last, summary = run(system, config, i)
                times.append(held)
                busy = f"; mean {summary['series'][0]['mean']}% of a core" if summary else ""
                print(f"  run {i + 1}: {label:12} {held:.3f} s allocation->release   ({last[:70]}){busy}", flush=True)
        rows = json.loads(on.manage("shell", "-c", STORED).strip().splitlines()[-1])

    if not rows:
        sys.exit("the sampled runs stored no samples")
    cost = read_cost(n=readings)
    print(
        f"one reading of a job's process tree (5 processes, /proc walked): {cost * 1000:.2f} ms; every {EVERY:g} s "
        f"that is {cost / EVERY * 100:.3f}% of the runner loop's time"
    )
    s, p = statistics.median(sampled), statistics.median(plain)
    print(f"sampled, median of {len(sampled)}: {s:.3f} s   (all: {', '.join(f'{x:.3f}' for x in sampled)})")
    print(f"not sampled, median of {len(plain)}: {p:.3f} s   (all: {', '.join(f'{x:.3f}' for x in plain)})")
    print(f"overhead: {s - p:+.3f} s per run")
    held = sum(r[0] for r in rows)
    stored = sum(r[1] for r in rows)
    print(
        f"stored by the sampled runs: {stored} bytes in {sum(r[2] for r in rows)} windows over {held:.0f} s held: "
        f"{stored / held * 3600:.0f} bytes per job-hour (short runs: their partial windows weigh more)"
    )
    print(f"one job-hour as stored (30 s windows): 1 device {hour_of(1)} bytes, 8 devices {hour_of(8)} bytes; a 10-hour 8-device job keeps at most 240 windows")
    ratio = s / p
    print(f"target: ratio <= {TARGET:.2f}: {'within' if ratio <= TARGET else 'OVER'} target")
    print(f"ratio (sampled / not sampled): {ratio:.3f}")


if __name__ == "__main__":
    main()
