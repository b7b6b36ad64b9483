"""Does pruning pay? One sweep of the classifier recipe on the digits data run twice, with pruning
(asynchronous successive halving on the validation loss) and with every trial run to the end.

Both sweeps search the same space (learning rate, width, depth) with the same sampler and seed
(random search: trial n gets the same parameters in both), the same number of trials, two at a
time, under a ceiling that never binds, on a live system (web server, scheduler, runner with two
CPU slots). A trial is a job like any other; the template is a classifier job submitted first.
Printed per sweep: each trial's parameters, state, objective and held seconds; then the best
objective of each, and the held device-seconds of all trials together (from the usage records:
what the meter charges; both sweeps pay the same rate for the same devices, so their ratio is
the cost ratio). Targets (issue 23): the pruned sweep's best within 1% of the full sweep's, at
most half its cost. The last line is the cost ratio, pruned / full.

    .venv/bin/python bench/sweep.py [--trials 16] [--steps 6000] [--quick]

A trial holds its device a few seconds before its first step (its process, torch, the data) and
a second or so after it is told to stop; pruning saves only the steps in between. At 600 steps
(about 3 s of training here) those fixed seconds are most of a trial, so pruning cannot halve a
sweep whatever it decides; at 6000 (about 20 s) the training is most of it, as in a real sweep.

--quick (CI: the benchmark still works, about a minute on 2 cores): 4 trials of 60 steps; its
figures say nothing. It exits 1 if a sweep does not end done, or a trial failed.
"""

import argparse
import json
import sys
import time
from decimal import Decimal
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.system import TERMINAL, LiveSystem, parse_time  # noqa: E402

SPACE = {
    "lr": {"type": "float", "low": 1e-4, "high": 0.3, "log": True},
    "hidden": {"type": "choice", "choices": [16, 64, 256]},
    "layers": {"type": "int", "low": 1, "high": 3},
}
TARGET_COST = 0.5
TARGET_BEST = 0.01


def template(system, steps):
    config = {"max_steps": steps, "eval_every": max(1, steps // 12), "batch_size": 64}
    spec = {
        "name": "digits-sweep",
        "recipe": "classifier",
        "gpus": 1,
        "span_hours": 1,
        "config": config,
        "train_dataset": "digits",
        "heldout_dataset": "digits-heldout",
    }
    response = system.api("POST", "/api/jobs/", data={"spec": json.dumps(spec)})
    assert response.status_code == 201, response.text
    job_id = response.json()["id"]
    system.wait_until(lambda: system.job(job_id)["state"] in TERMINAL, 300, "the template job to end", interval=0.5, max_interval=1)
    return job_id


def run_sweep(system, template_id, name, trials, prune):
    body = {
        "name": name, "template": template_id, "space": SPACE, "method": "random", "objective": "val_loss", "direction": "min",
        "max_trials": trials, "parallel": 2, "ceiling": "1000.00", "seed": 7, "prune": prune,
    }  # fmt: skip
    response = system.api("POST", "/api/sweeps/", json=body)
    assert response.status_code == 201, response.text
    sweep_id = response.json()["id"]
    started = time.monotonic()
    sweep = system.wait_until(
        lambda: (s := system.api("GET", f"/api/sweeps/{sweep_id}/").json())["state"] != "running" and s,
        1800,
        f"sweep {name} to end",
        interval=1,
        max_interval=2,
    )
    return sweep, time.monotonic() - started


def held_seconds(system, job_ids):
    """Device-seconds held by these jobs, from the usage records (allocation to release)."""
    wanted, total = set(job_ids), 0.0
    for record in system.api("GET", "/api/usage/").json()["records"]:
        if record["job_id"] in wanted and record["ended_at"]:
            total += (parse_time(record["ended_at"]) - parse_time(record["started_at"])).total_seconds() * record.get("gpus", 1)
    return total


def report(system, sweep, wall):
    print(f"{sweep['name']}: {sweep['state']} in {wall:.0f} s, spent {sweep['spent']} {sweep['currency']}")
    for t in sweep["trials"]:
        p = t["params"]
        value = f"{t['value']:.4f}" if t["value"] is not None else "-"
        print(
            f"  #{t['number']:>2} lr {p['lr']:.5f} hidden {p['hidden']:>3} layers {p['layers']}  {t['state']:<8} val_loss {value:>7}  held {t['held_seconds']} s"
        )
    held = held_seconds(system, [t["job"] for t in sweep["trials"]])
    best = sweep["best"]["value"] if sweep["best"] else None
    return best, held


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=16)
    parser.add_argument("--steps", type=int, default=6000, help="the classifier's optimizer steps per trial")
    parser.add_argument("--quick", action="store_true", help="4 trials of 60 steps (CI: the benchmark still works)")
    args = parser.parse_args()
    if args.quick:
        args.trials, args.steps = 4, 60
    failed = False
    with LiveSystem(devices=2) as system:
        template_id = template(system, args.steps)
        results = {}
        for prune in (False, True):
            name = "pruned" if prune else "full"
            sweep, wall = run_sweep(system, template_id, name, args.trials, prune)
            results[name] = report(system, sweep, wall)
            failed |= sweep["state"] != "done" or any(t["state"] == "failed" for t in sweep["trials"])
    (full_best, full_held), (pruned_best, pruned_held) = results["full"], results["pruned"]
    if full_best is None or pruned_best is None or not full_held:
        print("a sweep found no best trial or held nothing")
        return 1
    worse = (pruned_best - full_best) / abs(full_best) if full_best else 0.0
    ratio = pruned_held / full_held
    print(f"best val_loss: full {full_best:.4f}, pruned {pruned_best:.4f} ({worse:+.2%}; target within {TARGET_BEST:.0%})")
    print(f"held device-seconds: full {full_held:.1f}, pruned {pruned_held:.1f} (target at most {TARGET_COST}x)")
    print(f"cost ratio, pruned / full: {Decimal(ratio).quantize(Decimal('0.001'))}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
