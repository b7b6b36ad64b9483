"""Log throughput: a job that prints 200,000 numbered lines as fast as it can.

Through a LiveSystem (daphne + scheduler + runner, a fresh database), with a websocket client
connected from the moment the job is queued:

- produced: the script's own loop rate inside the system (it writes its loop start/end times
  to $E31_OUTPUT_DIR/timing.json, which comes back as an artifact); the pipe to the runner
  holds it back if the runner reads slower than it writes;
- read: lines/s the runner's reader threads took off the pipe (the first log event's `at` to
  the last one's: `at` is set when the line is read);
- stored: lines/s from the first line read to the moment every line is committed (a thread
  polls the job's last_seq straight from the database every 20 ms);
- delivered: lines/s from the first line read to the moment the websocket client has the last
  one; every line number 0..N-1 must arrive exactly once, in order ("lines lost" must be 0);
- the wall time from submission to the 'succeeded' state event on the websocket.

Baseline: the same script, with the same command and environment as the runner would give it,
writing to /dev/null, run directly (its own loop rate, and the whole process's).

The last line is delivered lines/s through the system / the baseline's loop rate. It exits 1 if
a line was lost, repeated or delivered out of order.

    .venv/bin/python bench/log_throughput.py [--lines 200000] [--repeat 3] [--py-spy PATH] [--database sqlite|postgres] [--redis] [--quick]

--quick (CI: the benchmark still works, in about 10 s on 2 cores): 2,000 lines, one system run,
the baseline once before and once after; the figures are meaningless.

--py-spy PATH records collapsed stacks of the web server and the runner during each run
(e.g. `.venv/bin/pip install --target /tmp/pyspy py-spy`, then --py-spy /tmp/pyspy/bin/py-spy).
"""

import argparse
import json
import os
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from websockets.sync.client import connect

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from jobs.launch import JobDirs, build_environment, command_for  # noqa: E402  (no Django inside)
from tests.system import TERMINAL, LiveSystem, parse_time  # noqa: E402

SCRIPT = '''"""Print {lines} numbered lines as fast as possible; note the loop's start and end."""
import json
import os
import sys
import time

N = {lines}
write = sys.stdout.write
start = time.time()
for i in range(N):
    write(f"line {{i}}\\n")
sys.stdout.flush()
end = time.time()
with open(os.path.join(os.environ.get("E31_OUTPUT_DIR", "."), "timing.json"), "w") as f:
    json.dump({{"start": start, "end": end, "lines": N}}, f)
'''
POLL_SECONDS = 0.02
BASELINE_RUNS = 5  # before and again after the system runs (1 with --quick)


def when(text):
    return parse_time(text).timestamp()


def peak_rss_mib(pid):
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def run_direct(script, work):
    """The script into /dev/null: (loop lines/s, whole-process lines/s)."""
    dirs = JobDirs(Path(tempfile.mkdtemp(prefix="direct-", dir=work)))
    dirs.create()
    shutil.copy(script, dirs.code / "spam.py")
    env = build_environment(job_id="direct", dirs=dirs, devices=[0], device_type="cpu", declared={})
    started = time.perf_counter()
    with open(os.devnull, "wb") as devnull:
        subprocess.run(command_for("spam.py", []), cwd=dirs.code, env=env, stdin=subprocess.DEVNULL, stdout=devnull, check=True)
    wall = time.perf_counter() - started
    timing = json.loads((dirs.output / "timing.json").read_text())
    shutil.rmtree(dirs.root, ignore_errors=True)
    return timing["lines"] / (timing["end"] - timing["start"]), timing["lines"] / wall


class SeqPoller(threading.Thread):
    """Polls the job's last_seq (committed together with the events) straight from the database."""

    def __init__(self, system, job_id):
        super().__init__(daemon=True)
        self.system, self.job_id = system, job_id
        self.samples = []  # (time.time(), last_seq)
        self.halt = threading.Event()

    def run(self):
        if self.system.database == "sqlite":
            conn = sqlite3.connect(f"file:{self.system.var_dir / 'e31.sqlite3'}?mode=ro", uri=True, timeout=30)
            sql, arg = "SELECT last_seq FROM jobs_job WHERE id = ?", self.job_id.replace("-", "")
        else:
            import psycopg

            conn = psycopg.connect(self.system.env["DATABASE_URL"], autocommit=True)
            sql, arg = "SELECT last_seq FROM jobs_job WHERE id = %s", self.job_id
        try:
            while not self.halt.is_set():
                row = conn.execute(sql, (arg,)).fetchone()
                self.samples.append((time.time(), row[0] if row else 0))
                time.sleep(POLL_SECONDS)
        finally:
            conn.close()

    def first_time_at_least(self, seq):
        return next((t for t, s in self.samples if s >= seq), None)


def start_profilers(system, py_spy, out_dir, tag):
    """py-spy record on the web server and the runner (collapsed stacks, one file each)."""
    profilers = []
    for name in ("web", "runner"):
        output = Path(out_dir) / f"{name}-{tag}.txt"
        profilers.append(
            subprocess.Popen(
                [
                    py_spy,
                    "record",
                    "--pid",
                    str(system.processes[name].pid),
                    "--format",
                    "raw",
                    "--threads",
                    "--rate",
                    "250",
                    "--nonblocking",
                    "--output",
                    str(output),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
    time.sleep(1.0)  # let them attach
    return profilers


def stop_profilers(profilers):
    for profiler in profilers:
        profiler.send_signal(signal.SIGINT)
    for profiler in profilers:
        try:
            profiler.wait(30)
        except subprocess.TimeoutExpired:
            profiler.kill()


def run_system(system, script, lines, n):
    # A job needs a training set; the demo's small digits CSV is staged and ignored.
    spec = {"name": f"bench-log-{n}", "train_dataset": "digits", "gpus": 1, "span_hours": 1}
    submitted = time.time()
    job = system.submit(spec, script)
    poller = SeqPoller(system, job["id"])
    poller.start()
    headers = {"Authorization": f"Token {system.token}"}
    expected = 0
    lost_or_wrong = duplicates = out_of_order = 0
    messages = 0
    first_received = last_log_received = succeeded_received = None
    first_log = last_log = None  # events
    final_state = None
    with connect(system.ws_url(job["id"]), additional_headers=headers, max_size=None) as ws:
        while final_state is None:
            message = json.loads(ws.recv(timeout=600))
            now = time.time()
            assert message["type"] == "events", message
            messages += 1
            for event in message["events"]:
                if event["kind"] == "state" and event["state"] in TERMINAL:
                    final_state, succeeded_received = event["state"], now
                if event["kind"] != "log":
                    continue
                if first_log is None:
                    first_log, first_received = event, now
                last_log, last_log_received = event, now
                number = int(event["text"].split()[1])
                if number == expected:
                    expected += 1
                elif number < expected:
                    duplicates += 1
                else:
                    out_of_order += 1
                    lost_or_wrong += number - expected
                    expected = number + 1
    poller.halt.set()
    poller.join()
    if final_state != "succeeded":
        raise RuntimeError(f"job {job['id']} ended {final_state}\n{system.logs()}")
    lost = lines - expected + lost_or_wrong

    done = system.job(job["id"])
    timeline = {t["state"]: when(t["at"]) for t in done["timeline"] if t["kind"] == "state"}  # not checkpoints, resumes
    artifact = system.api("GET", f"/api/jobs/{job['id']}/artifacts/timing.json")
    artifact.raise_for_status()
    timing = artifact.json()

    t0 = when(first_log["at"])  # the runner read line 0
    stored_at = poller.first_time_at_least(last_log["seq"])
    return {
        "produced": lines / (timing["end"] - timing["start"]),
        "read": lines / (when(last_log["at"]) - t0),
        "stored": lines / (stored_at - t0) if stored_at else float("nan"),
        "delivered": lines / (last_log_received - t0),
        "delivered_client": lines / (last_log_received - first_received),
        "first_line_latency": first_received - t0,
        "last_line_lag_after_stored": last_log_received - stored_at if stored_at else float("nan"),
        "lost": lost,
        "duplicates": duplicates,
        "out_of_order": out_of_order,
        "messages": messages,
        "wall_to_succeeded": succeeded_received - submitted,
        "running_to_exit": timeline["succeeded"] - timeline["running"],
        "exit_to_succeeded": succeeded_received - timeline["succeeded"],
        "process_exit_to_stored": (stored_at - timing["end"]) if stored_at else float("nan"),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lines", type=int, default=200_000)
    parser.add_argument("--repeat", type=int, default=3, help="system runs (medians reported); the baseline runs 5 times before and 5 after")
    parser.add_argument("--database", choices=["sqlite", "postgres"], default="sqlite")
    parser.add_argument("--redis", action="store_true", help="the Redis channel layer instead of the database relay")
    parser.add_argument("--py-spy", metavar="PY_SPY", help="path to a py-spy binary: profile the web server and the runner")
    parser.add_argument("--profile-dir", default="bench/profiles", help="where py-spy's collapsed stacks go")
    parser.add_argument("--quick", action="store_true", help="2,000 lines, one run (CI: the benchmark still works)")
    args = parser.parse_args()
    baseline_runs = BASELINE_RUNS
    if args.quick:
        args.lines, args.repeat, baseline_runs = 2000, 1, 1

    work = Path(tempfile.mkdtemp(prefix="e31-bench-log-"))
    script = work / "spam.py"
    script.write_text(SCRIPT.format(lines=args.lines))
    print(f"{args.lines} numbered lines; database {args.database}{' + redis' if args.redis else ''}", flush=True)
    try:
        # The baseline's loop lasts a tenth of a second: run it often, before and after the system runs.
        baseline = [run_direct(script, work) for _ in range(baseline_runs)]

        results = []
        with LiveSystem(database=args.database, redis=args.redis) as system:
            for i in range(args.repeat):
                profilers = []
                if args.py_spy:
                    Path(args.profile_dir).mkdir(parents=True, exist_ok=True)
                    profilers = start_profilers(system, args.py_spy, args.profile_dir, i + 1)
                before = system.cpu_seconds()
                rss_before = peak_rss_mib(system.processes["runner"].pid)
                try:
                    r = run_system(system, script, args.lines, i)
                finally:
                    after = system.cpu_seconds()
                    stop_profilers(profilers)
                r["cpu"] = {k: after[k] - before.get(k, 0.0) for k in after}
                results.append(r)
                print(
                    f"  run {i + 1}: produced {r['produced']:,.0f}/s (script's loop, piped to the runner), "
                    f"read {r['read']:,.0f}/s, stored {r['stored']:,.0f}/s, delivered {r['delivered']:,.0f}/s "
                    f"({r['delivered_client']:,.0f}/s first->last received); lost {r['lost']}, "
                    f"duplicates {r['duplicates']}, out of order {r['out_of_order']}; {r['messages']} websocket messages",
                    flush=True,
                )
                print(
                    f"         first line reached the client {r['first_line_latency']:.3f} s after it was read; "
                    f"the last line {r['last_line_lag_after_stored']:.3f} s after it was stored; "
                    f"all stored {r['process_exit_to_stored']:.3f} s after the script's loop ended",
                    flush=True,
                )
                print(
                    f"         submit->succeeded {r['wall_to_succeeded']:.2f} s (process started->exited {r['running_to_exit']:.2f} s, exited->'succeeded' received {r['exit_to_succeeded']:.2f} s); "
                    "CPU used meanwhile: "
                    + ", ".join(f"{k} {v:.2f} s" for k, v in r["cpu"].items())
                    + f"; runner peak RSS {rss_before:.0f} MiB before, {peak_rss_mib(system.processes['runner'].pid):.0f} MiB after",
                    flush=True,
                )
            rss = peak_rss_mib(system.processes["runner"].pid)
        baseline += [run_direct(script, work) for _ in range(baseline_runs)]
        loop_rate = statistics.median(b[0] for b in baseline)
        process_rate = statistics.median(b[1] for b in baseline)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    def med(key):
        return statistics.median(r[key] for r in results)

    n = len(results)
    lost = sum(r["lost"] for r in results)
    print(f"lines produced per second (the script's loop, in the system), median of {n}: {med('produced'):,.0f}")
    print(f"lines read per second by the runner, median of {n}: {med('read'):,.0f}")
    print(f"lines stored per second, median of {n}: {med('stored'):,.0f}")
    print(f"lines delivered per second to the websocket client, median of {n}: {med('delivered'):,.0f}")
    print(f"lines lost: {lost}   (duplicates {sum(r['duplicates'] for r in results)}, out of order {sum(r['out_of_order'] for r in results)})")
    print(f"wall time from submission to 'succeeded', median of {n}: {med('wall_to_succeeded'):.2f} s")
    print(f"runner peak RSS: {rss:.0f} MiB")
    print(
        f"baseline, the script into /dev/null, median of {len(baseline)}: {loop_rate:,.0f} lines/s in its loop "
        f"(range {min(b[0] for b in baseline):,.0f}-{max(b[0] for b in baseline):,.0f}), "
        f"{process_rate:,.0f} lines/s over the whole process (interpreter start included)"
    )
    print(f"ratio (delivered / direct into /dev/null): {med('delivered') / loop_rate:.4f}")
    wrong = lost + sum(r["duplicates"] + r["out_of_order"] for r in results)
    if wrong:
        sys.exit(f"{wrong} line(s) lost, repeated or out of order")


if __name__ == "__main__":
    main()
