"""Soak: a stream of small jobs on 4 runners with websocket watchers, while a random process of
the system is SIGKILLed and started again every 30 seconds.

A LiveSystem on loopback (SQLite by default; --database postgres --redis for production's
shape) with 4 runners (--runners) of one slot each. Two phases over the same kind of stream:

- without faults: --baseline-jobs jobs, nothing killed (the baseline turnaround);
- under faults: --jobs jobs submitted evenly over --minutes, --watchers websocket clients
  following the jobs (reconnecting from their last event when the web server goes), and every
  --kill-every seconds one of web, scheduler and the runners, chosen at random, SIGKILLed and
  started again at once.

Each job prints numbered lines and checkpoints its position, so a job requeued off a killed
runner resumes. Afterwards, for every job:

- finished: it succeeded; lost: it did not reach an end state, or failed (must be 0);
- log lines lost: numbers 0..N-1 missing from its stored log (must be 0);
- ledger mismatches: an ended allocation without exactly one final usage record whose held
  seconds match the allocation's times, or a job whose held seconds differ from its records'
  sum (must be 0).

The last line is the mean turnaround (submitted to ended) under faults / without. It exits 1 if
a job was lost, a log line was lost or the ledger does not match (or no job finished).

    .venv/bin/python bench/soak.py [--minutes 10] [--jobs 200] [--watchers 100] [--kill-every 30] [--runners 4] [--quick]

--quick (CI: the benchmark still works, in about 45 s on 2 cores): 2 runners; 2 jobs without
faults, then 5 jobs over 21 s with 4 watchers while the web server, the scheduler and a runner
are killed and started again in turn, one every 6 s (each kind once, rather than at random);
every check runs, the turnaround ratio means little.
"""

import argparse
import json
import random
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from websockets.sync.client import connect  # noqa: E402

from tests.system import TERMINAL, LiveSystem, parse_time  # noqa: E402

LINES = 40
SCRIPT = f"""
import json, os, time
from pathlib import Path
mark = Path(os.environ["E31_CHECKPOINT_DIR"]) / "position.json"
start = json.loads(mark.read_text())["next"] if mark.exists() else 0
for i in range(start, {LINES}):
    print(f"line {{i}}", flush=True)
    time.sleep(0.1)
    if i % 10 == 9:
        partial = mark.with_suffix(".tmp")
        partial.write_text(json.dumps({{"next": i + 1}}))
        os.replace(partial, mark)
"""
LEDGER = """
import json
from billing.models import UsageRecord
from scheduler.models import Allocation
ids = {ids!r}
out = {{}}
for job in ids:
    out[job] = {{
        "usage": [[str(u.allocation_id), u.held_seconds, u.provisional] for u in UsageRecord.ledger.filter(job_id=job)],
        "allocations": [[str(a.pk), (a.ended_at - a.started_at).total_seconds() if a.ended_at else None]
                        for a in Allocation.objects.filter(job_id=job)],
    }}
print("LEDGER " + json.dumps(out))
"""


class Watchers:
    """Websocket clients, each following one job from its last event, reconnecting on a drop."""

    def __init__(self, system, count):
        self.system, self.count = system, count
        self.stop = threading.Event()
        self.jobs = []
        self.lock = threading.Lock()
        self.reconnects = 0
        self.threads = [threading.Thread(target=self.watch, args=(i,), daemon=True) for i in range(count)]

    def start(self):
        for thread in self.threads:
            thread.start()

    def watch(self, index):
        rng = random.Random(index)
        while not self.stop.is_set():
            with self.lock:
                job = rng.choice(self.jobs) if self.jobs else None
            if job is None:
                time.sleep(0.5)
                continue
            after, ended = 0, False
            while not ended and not self.stop.is_set():
                try:
                    headers = {"Authorization": f"Token {self.system.token}"}
                    with connect(self.system.ws_url(job, after), additional_headers=headers, open_timeout=10) as socket:
                        while not self.stop.is_set():
                            message = json.loads(socket.recv(timeout=30))
                            for event in message.get("events", []):
                                after = max(after, event["seq"])
                                ended |= event["kind"] == "state" and event.get("state") in TERMINAL
                            if ended:
                                break
                except Exception:  # noqa: BLE001 - the web server went away: come back from `after`
                    with self.lock:
                        self.reconnects += 1
                    time.sleep(1)


def submit(system, script, data, name):
    return system.submit({"name": name, "gpus": 1, "span_hours": 0.25, "max_restarts": 20}, script, [data])["id"]


def run_phase(system, script, data, jobs, minutes, kill_every, watchers, rng, label, victims=None):
    """Submit `jobs` over `minutes` (killing a process every kill_every seconds if set: the next
    of `victims`, or one at random); wait for them to end. Returns (ids, kills)."""
    ids, kills, ended = [], [], set()
    spacing = minutes * 60 / max(1, jobs)
    started = time.monotonic()
    next_kill = started + kill_every if kill_every else None
    deadline = started + minutes * 60 + 600
    while time.monotonic() < deadline:
        now = time.monotonic()
        if len(ids) < jobs and now >= started + len(ids) * spacing:
            try:
                ids.append(submit(system, script, data, f"{label}-{len(ids)}"))
                if watchers is not None:
                    with watchers.lock:
                        watchers.jobs.append(ids[-1])
            except Exception as error:  # noqa: BLE001 - the web server is down: submit again shortly
                print(f"  submission retried: {type(error).__name__}")
                time.sleep(1)
                continue
        if next_kill is not None and now >= next_kill and now < started + minutes * 60:
            kills.append(kill_one(system, rng, victims[len(kills) % len(victims)] if victims else None))
            next_kill = now + kill_every
        if len(ids) == jobs and all_ended(system, ids, ended):
            break
        time.sleep(0.2)
    return ids, kills


def all_ended(system, ids, ended):
    """Whether every job of ids has reached an end state; ended: those seen there (an end state
    is final), not asked about again. Each job is asked about itself: counting the jobs listed
    as queued, then starting, then running, one list after the other, missed a job requeued off
    a killed runner in between (running when the queued ones were listed, queued by the time the
    running ones were), and ended the phase with it still to run."""
    try:
        for job_id in ids:
            if job_id not in ended:
                if system.job(job_id)["state"] not in TERMINAL:
                    return False
                ended.add(job_id)
    except Exception:  # noqa: BLE001 - the web server is down: not yet
        return False
    return True


def kill_one(system, rng, name=None):
    runners = sorted(n for n in system.processes if n.startswith("runner-"))
    name = name or rng.choice(["web", "scheduler", *runners])
    process = system.processes[name]
    process.send_signal(signal.SIGKILL)
    process.wait(10)
    if name == "web":
        system.spawn("web", [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(system.port), "e31web.asgi:application"])
    elif name == "scheduler":
        system.spawn("scheduler", [sys.executable, "manage.py", "scheduler"])
    else:
        system.start_runner(name, 1)
    print(f"  {time.strftime('%H:%M:%S')} killed and restarted {name}")
    return name


def check(system, ids):
    jobs = {job: system.job(job) for job in ids}
    ledger = {}
    for start in range(0, len(ids), 50):
        out = system.manage("shell", "-c", LEDGER.format(ids=ids[start : start + 50]))
        ledger.update(json.loads(next(line for line in out.splitlines() if line.startswith("LEDGER "))[7:]))
    finished = lost = lines_lost = mismatches = 0
    turnaround = []
    for job_id, job in jobs.items():
        if job["state"] == "succeeded":
            finished += 1
            turnaround.append((parse_time(job["finished_at"]) - parse_time(job["created_at"])).total_seconds())
        else:
            lost += 1
            print(f"  lost: {job_id} {job['state']} {job['reason']}")
        texts = set(system.log_lines(job_id))
        missing = [i for i in range(LINES) if f"line {i}" not in texts]
        if missing:
            lines_lost += len(missing)
            print(f"  log lines lost: {job_id} ({job['state']}): {missing}")
        records = ledger[job_id]
        final = [u for u in records["usage"] if not u[2]]
        for allocation, seconds in records["allocations"]:
            mine = [u for u in final if u[0] == allocation]
            if seconds is not None and (len(mine) != 1 or abs(mine[0][1] - seconds) > 1):
                mismatches += 1
                print(f"  ledger mismatch: {job_id} allocation {allocation} held {seconds} s; its final records {mine}")
        if sum(u[1] for u in final) != job["held_seconds"]:
            mismatches += 1
            print(f"  ledger mismatch: {job_id} holds {job['held_seconds']} s; its final records {final}")
    return finished, lost, lines_lost, mismatches, turnaround


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--baseline-jobs", type=int, default=40)
    parser.add_argument("--watchers", type=int, default=100)
    parser.add_argument("--kill-every", type=float, default=30)
    parser.add_argument("--database", default="sqlite", choices=["sqlite", "postgres"])
    parser.add_argument("--redis", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--runners", type=int, default=4, help="runners of one slot each")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="2 runners, 2 + 5 jobs over 21 s, 4 watchers, web, scheduler and a runner killed once each (CI: the benchmark still works)",
    )
    args = parser.parse_args()
    victims = None
    if args.quick:
        args.minutes, args.jobs, args.baseline_jobs, args.watchers, args.kill_every, args.runners = 0.35, 5, 2, 4, 6, 2
        victims = ["web", "scheduler", "runner-1"]
    rng = random.Random(args.seed)

    work = Path(__import__("tempfile").mkdtemp(prefix="e31-soak-"))
    script, data = work / "train.py", work / "points.csv"
    script.write_text(SCRIPT)
    data.write_text("x\n1\n")
    system = LiveSystem(database=args.database, redis=args.redis, env={"E31_NODE_TIMEOUT_SECONDS": "5", "E31_API_RATE": "off"})
    try:
        system.start(runner=False)
        for index in range(args.runners):
            system.start_runner(f"runner-{index}", 1)
        print(f"system: {args.runners} runners of 1 slot, {args.database}{' + redis' if args.redis else ''}")

        baseline_minutes = args.minutes * args.baseline_jobs / max(1, args.jobs)
        ids, _ = run_phase(system, script, data, args.baseline_jobs, baseline_minutes, None, None, rng, "calm")
        _, _, _, _, calm = check(system, ids)
        print(f"without faults: {len(ids)} jobs, mean turnaround {statistics.mean(calm):.1f} s")

        watchers = Watchers(system, args.watchers)
        watchers.start()
        started = time.monotonic()
        ids, kills = run_phase(system, script, data, args.jobs, args.minutes, args.kill_every, watchers, rng, "soak", victims)
        watchers.stop.set()
        finished, lost, lines_lost, mismatches, faulted = check(system, ids)
        print(
            f"under faults: {len(ids)} jobs in {time.monotonic() - started:.0f} s, {len(kills)} processes killed "
            f"({', '.join(sorted(set(kills)))}), {args.watchers} watchers reconnected {watchers.reconnects} times"
        )
        print(f"jobs finished: {finished}")
        print(f"jobs lost: {lost}")
        print(f"log lines lost: {lines_lost}")
        print(f"ledger mismatches: {mismatches}")
        if faulted and calm:
            print(f"mean turnaround under faults / without: {statistics.mean(faulted) / statistics.mean(calm):.2f}")
    finally:
        system.stop()
    if lost or lines_lost or mismatches or not (faulted and calm):
        sys.exit(
            f"broken: {lost} job(s) lost, {lines_lost} log line(s) lost, {mismatches} ledger mismatch(es), "
            f"{len(calm)} job(s) finished without faults, {len(faulted)} under faults"
        )


if __name__ == "__main__":
    main()
