"""Live streams: 500 websocket watchers over 50 running jobs printing 100 lines a second each.

A LiveSystem on PostgreSQL and Redis (the Redis channel layer carries the announcements) with
one daphne worker, no scheduler and no runner: the jobs are made and set running by hand, and
producer processes (--runners of them, the jobs shared out, as jobs are over nodes) store each
job's lines as the runner does, through the runner's own call (JobEvent.append_lines, which
announces after commit), every --pump-every seconds at --rate lines a second per job. Each
line carries the time it was handed to the store; watchers (asyncio, `websockets`, in
--clients processes, spread evenly over the jobs, each with the API token as `e31 logs
--follow` sends it; the slow ones below in one more) take each line's delivery delay from it, so the store's own time counts.

Every watcher checks that its job's events come in order and once (each event's seq the one
after the last) and at the end that it saw every line. A few of them (--slow) stop reading for
--pause seconds: the server must drop them (daphne's keepalive ping goes unanswered behind the
unread output) while the producers keep their rate, and, resuming as the job page does
(reconnecting with ?after=<the last seq seen>), they must get every line they missed.

Prints the delay percentiles, the producers' rate and how late their lines were stored (in and
out of the slow watchers' pause), the slow watchers' fate, the web worker's CPU, and last the
delivery p99 in milliseconds of the watchers that kept reading (issue 24's target: at most
200). It exits 1 if any watcher lost a line or saw one out of order or twice, or a slow
watcher was not dropped.

    .venv/bin/python bench/stream_load.py [--jobs 50] [--watchers 500] [--rate 100] [--seconds 90]
                                          [--slow 5] [--pause 60] [--runners 5] [--clients 2]
                                          [--profile web.svg|web.txt] [--quick]

--quick (CI: the benchmark still works, in about 40 s on 2 busy cores): 4 jobs at 20 lines a
second, 20 watchers of which 2 slow, 10 s of output, a 6 s pause, and the web worker pinging
every second with a 1 s timeout (daphne's defaults, 20 s and 30 s, drop a silent watcher within
50 s: the full run's pause is longer than that); the figures are meaningless.
"""

import argparse
import asyncio
import json
import multiprocessing
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
from websockets.exceptions import ConnectionClosed, InvalidHandshake

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.system import LiveSystem, free_port  # noqa: E402

JOBS = """
from accounts.models import Team
from e31web.demo import DEMO_TEAM
from jobs.models import Job
team = Team.objects.get(name=DEMO_TEAM)
user = team.memberships.first().user
for i in range({jobs}):
    job = Job.objects.create(team=team, created_by=user, name=f"stream-{{i}}", entrypoint="train.py", gpus=1, span_hours=1)
    job.record("state", data={{"state": "queued", "from": None, "reason": "submitted"}})
    Job.objects.filter(pk=job.pk).update(state="running")
    job.record("state", data={{"state": "running", "from": "queued", "reason": "set by the benchmark"}})
    print("job", job.pk)
"""


TARGET_MS = 200  # issue 24: delivery p99 at most this


def percentile(values, q):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]


def histogram_percentile(counts, q):
    """The q-th percentile of a Counter of whole milliseconds."""
    total, seen = sum(counts.values()), 0
    for value in sorted(counts):
        seen += counts[value]
        if seen >= q / 100 * total:
            return value
    return 0


# The producers: the runner's hot path ----------------------------------------------------------


def produce(env, jobs, rate, seconds, pump_every, start_at, results):
    """Store each job's lines as the runner does, `rate` a second from start_at for `seconds`;
    put (per job: lines, last seq; per append: (handed at, ms taken, s late)) on results."""
    os.environ.update(env)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "e31web.settings")
    import django

    django.setup()
    from django.utils import timezone

    from jobs import live
    from jobs.models import JobEvent

    # Warm, as a runner is when its jobs print: the database connection open and the announcer's
    # loop and Redis connection up (an announcement of seq 0 moves no watcher).
    for job in jobs:
        JobEvent.objects.filter(job_id=job).exists()
        live.announce(job, 0)
    sent = dict.fromkeys(jobs, 0)
    last = dict.fromkeys(jobs, 0)
    appends = []
    total = int(rate * seconds)
    time.sleep(max(0.0, start_at - time.time()))
    cpu = time.process_time()
    while min(sent.values()) < total:
        step = time.time()
        due = min(total, int((step - start_at) * rate))
        for job in jobs:
            if sent[job] >= due:
                continue
            handed = time.time()
            at = timezone.now()
            lines = [("stdout", at, f"{n} {handed:.6f}") for n in range(sent[job], due)]
            # How late the batch's first line is: it was due when the job printed it.
            late = handed - (start_at + sent[job] / rate)
            last[job] = JobEvent.append_lines(job, lines)
            appends.append((handed, (time.time() - handed) * 1000, late))
            sent[job] = due
        time.sleep(max(0.0, step + pump_every - time.time()))
    results.put({"jobs": {job: (sent[job], last[job]) for job in jobs}, "appends": appends, "cpu": time.process_time() - cpu})


# The watchers ------------------------------------------------------------------------------------


class Watcher:
    def __init__(self, url, token, job, slow):
        self.url, self.token, self.job, self.slow = url, token, job, slow
        self.last_seq = 0
        self.next_line = 0
        self.problems = []
        self.connects = 0
        self.closes = []  # codes the server closed a watcher with that was reading
        self.failed_connects = []
        self.dropped_after = None  # seconds from the start of its pause to the server's close
        self.resumed_lines = 0

    async def connect(self):
        from websockets.asyncio.client import connect

        self.connects += 1
        # No pings of its own: a slow watcher must not give up on the server first.
        return await connect(
            f"{self.url}/ws/jobs/{self.job}/?after={self.last_seq}",
            additional_headers={"Authorization": f"Token {self.token}"},
            ping_interval=None,
            open_timeout=120,
            max_size=None,
        )

    async def reconnect(self):
        """As the job page does: after the last seq seen, trying again with a growing wait."""
        wait = 0.5
        while True:
            try:
                return await self.connect()
            except (OSError, TimeoutError, InvalidHandshake) as error:
                self.failed_connects.append(f"{type(error).__name__}: {error}")
                await asyncio.sleep(wait)
                wait = min(wait * 2, 10.0)

    def take(self, text, delays, late):
        now = time.time()
        message = json.loads(text)
        if message.get("type") != "events":
            return
        for event in message["events"]:
            if event["seq"] != self.last_seq + 1:
                self.problems.append(f"seq {event['seq']} after {self.last_seq}")
            self.last_seq = max(self.last_seq, event["seq"])
            if event["kind"] != "log":
                continue
            number, handed = event["text"].split()
            if int(number) != self.next_line:
                self.problems.append(f"line {number} where {self.next_line} was due")
            self.next_line = int(number) + 1
            if not self.slow:
                delay = round((now - float(handed)) * 1000)
                delays[delay] += 1
                if delay > TARGET_MS:
                    late[int(float(handed))] += 1
            elif self.dropped_after is not None:
                self.resumed_lines += 1

    async def run(self, socket, final, delays, late, pause):
        """Read until the job's last event (final: a future of {job: last seq}); a slow
        watcher stops reading for pause=(from, seconds) and then resumes as the page does."""
        paused = False
        while True:
            if final.done() and self.last_seq >= final.result()[self.job]:
                await socket.close()
                return
            if self.slow and not paused and time.time() >= pause[0]:
                # Not reading at all: not even the socket (where pings would still be answered).
                paused = True
                socket.transport.pause_reading()
                await asyncio.sleep(pause[0] + pause[1] - time.time())
                socket.transport.resume_reading()
            try:
                text = await asyncio.wait_for(socket.recv(), timeout=0.5)
            except TimeoutError:
                continue
            except ConnectionClosed:
                if self.slow and paused and self.dropped_after is None:
                    self.dropped_after = time.time() - pause[0]
                else:
                    self.closes.append(socket.close_code)  # not a loss: it resumes after its last seq, as the page does
                socket = await self.reconnect()
                continue
            self.take(text, delays, late)


def watch(url, token, plan, pipe):
    """Run the watchers of plan [(job, slow)] in one process: connect them, say "ready", take the
    slow ones' pause (start, seconds), read, take the final seqs, and send back a report."""

    async def main():
        loop = asyncio.get_running_loop()
        watchers = [Watcher(url, token, job, slow) for job, slow in plan]
        sockets = []
        for start in range(0, len(watchers), 50):  # a few at a time: not a connection storm
            sockets += await asyncio.gather(*(w.reconnect() for w in watchers[start : start + 50]))
        pipe.send("ready")
        pause = await loop.run_in_executor(None, pipe.recv)
        cpu = time.process_time()
        final = loop.run_in_executor(None, pipe.recv)
        delays, late = Counter(), Counter()
        await asyncio.gather(*(w.run(s, final, delays, late, pause) for w, s in zip(watchers, sockets, strict=True)))
        return {
            "cpu": time.process_time() - cpu,
            "delays": dict(delays),
            "late": dict(late),
            "watchers": [
                {
                    "slow": w.slow,
                    "complete": w.last_seq == final.result()[w.job] and w.next_line == final.result()["lines"][w.job],
                    "problems": w.problems[:5],
                    "connects": w.connects,
                    "closes": w.closes,
                    "failed_connects": w.failed_connects,
                    "dropped_after": w.dropped_after,
                    "resumed_lines": w.resumed_lines,
                }
                for w in watchers
            ],
        }

    pipe.send(asyncio.run(main()))


# The run -----------------------------------------------------------------------------------------


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=50)
    parser.add_argument("--watchers", type=int, default=500)
    parser.add_argument("--rate", type=float, default=100.0, help="lines a second per job")
    parser.add_argument("--seconds", type=float, default=90.0, help="of output")
    parser.add_argument("--slow", type=int, default=5, help="watchers that stop reading for a while")
    parser.add_argument("--pause", type=float, default=60.0, help="seconds a slow watcher does not read")
    parser.add_argument("--pump-every", type=float, default=0.1, help="seconds between a runner's stores of a job's lines (its loop)")
    parser.add_argument("--runners", type=int, default=5, help="producer processes, the jobs shared out")
    parser.add_argument("--clients", type=int, default=2, help="watcher processes")
    parser.add_argument("--ping", type=float, nargs=2, metavar=("INTERVAL", "TIMEOUT"), help="daphne's --ping-interval and --ping-timeout")
    parser.add_argument(
        "--profile",
        metavar="FILE",
        help="record the web worker with py-spy (not a dependency: `.venv/bin/pip install py-spy`) into this flame graph (.svg) or folded stacks",
    )
    parser.add_argument("--layer", default="pubsub", choices=["core", "pubsub"], help="the Redis channel layer (E31_CHANNEL_LAYER)")
    parser.add_argument("--quick", action="store_true", help="4 jobs, 20 watchers (2 slow), 10 s at 20 lines/s (CI: the benchmark still works)")
    args = parser.parse_args()
    if args.quick:
        args.jobs, args.watchers, args.rate, args.seconds, args.slow, args.pause = 4, 20, 20.0, 10.0, 2, 6.0
        args.runners, args.clients, args.ping = 2, 1, args.ping or (1, 1)

    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if args.profile and not Path(py_spy).exists():
        parser.error("--profile needs py-spy, which the project does not install: `.venv/bin/pip install py-spy` first")
    context = multiprocessing.get_context("fork")
    system = LiveSystem(database="postgres", redis=True, env={"E31_CHANNEL_LAYER": args.layer})
    children = []
    try:
        system.start(runner=False)
        # Nothing else asks the database or the channel layer for work: the jobs are set running
        # by hand and only the producers write.
        system.processes.pop("scheduler").terminate()
        web = [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(free_port()), "e31web.asgi:application"]
        if args.ping:
            web[3:3] = ["--ping-interval", f"{args.ping[0]:g}", "--ping-timeout", f"{args.ping[1]:g}"]
        system.processes.pop("web").terminate()
        system.spawn("web", web)
        url = f"http://127.0.0.1:{web[web.index('-p') + 1]}"
        system.wait_until(lambda: _answers(url), 30, "the web worker to answer")
        made = system.manage("shell", "-c", JOBS.format(jobs=args.jobs))
        jobs = [line.split()[1] for line in made.splitlines() if line.startswith("job ")]
        assert len(jobs) == args.jobs, made
        pings = f" pinging every {args.ping[0]:g} s, timeout {args.ping[1]:g} s" if args.ping else " (daphne's default keepalive)"
        print(
            f"server: 1 daphne worker{pings}, "
            f"postgres + redis; {args.jobs} jobs at {args.rate:g} lines/s each for {args.seconds:g} s "
            f"from {args.runners} producer(s) storing every {args.pump_every:g} s; {args.watchers} watchers "
            f"({args.slow} slow, {args.pause:g} s without reading) in {args.clients} process(es), the slow ones in one more"
        )

        # Watchers spread evenly over the jobs; the slow ones on different jobs.
        plan = [(jobs[i % len(jobs)], i < args.slow) for i in range(args.watchers)]
        # The slow ones in a process of their own: when they read again, the backlog they take
        # in (the kernel's buffers, then what they missed) must not hold up the reading
        # watchers' event loop, in the benchmark's own client, as if the server were late.
        reading = [w for w in plan if not w[1]]
        parts = [reading[client :: args.clients] for client in range(args.clients)] + [[w for w in plan if w[1]]]
        ws_url = url.replace("http://", "ws://")
        pipes = []
        for part in filter(None, parts):
            ours, theirs = context.Pipe()
            child = context.Process(target=watch, args=(ws_url, system.token, part, theirs), daemon=True)
            child.start()
            pipes.append(ours)
            children.append(child)
        for pipe in pipes:
            if not pipe.poll(120) or pipe.recv() != "ready":
                sys.exit("the watchers did not connect")
        # The output starts in a second; the slow watchers stop reading a few seconds into it.
        start_at = time.time() + 1
        pause = (start_at + min(5.0, args.seconds / 5), args.pause)
        for pipe in pipes:
            pipe.send(pause)
        results = context.Queue()
        shares = [jobs[i :: args.runners] for i in range(args.runners)]
        env = {**system.env, "PYTHONPATH": str(ROOT)}
        producers = [
            context.Process(target=produce, args=(env, share, args.rate, args.seconds, args.pump_every, start_at, results), daemon=True)
            for share in shares
            if share
        ]
        children += producers
        before, machine = system.cpu_seconds(), machine_busy()
        for producer in producers:
            producer.start()
        if args.profile:
            spy = [py_spy, "record", "--nonblocking", "-o", args.profile]
            spy += [] if args.profile.endswith(".svg") else ["--format", "raw"]  # folded stacks, to read as text
            duration = ["-d", str(int(args.seconds)), "-p", str(system.processes["web"].pid)]
            children.append(subprocess.Popen([*spy, *duration], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        produced = [results.get(timeout=args.seconds + 300) for _ in producers]
        after, machine = system.cpu_seconds(), machine_busy(machine)
        wall = time.time() - start_at
        final = {job: last for part in produced for job, (_, last) in part["jobs"].items()}
        final["lines"] = {job: count for part in produced for job, (count, _) in part["jobs"].items()}
        for pipe in pipes:
            pipe.send(final)
        reports = []
        for pipe in pipes:
            if not pipe.poll(args.pause + 120):
                sys.exit("the watchers did not finish: lines never came")
            try:
                reports.append(pipe.recv())
            except EOFError:
                sys.exit("a watcher process failed (its traceback is above)")
    finally:
        web_log = system.logs().get("web", "")
        for child in children:
            if isinstance(child, subprocess.Popen):
                child.wait(30)
            elif child.is_alive():
                child.kill()
        system.stop()

    if "Traceback" in web_log:
        print("the web worker's log ends with a traceback:\n" + web_log[web_log.rindex("Traceback") :], file=sys.stderr)
    delays, late_at = Counter(), Counter()
    for part in reports:
        delays.update({int(ms): n for ms, n in part["delays"].items()})
        late_at.update({int(second): n for second, n in part["late"].items()})
    watchers = [w for part in reports for w in part["watchers"]]
    lost = [w for w in watchers if not w["complete"] or w["problems"]]
    slow = [w for w in watchers if w["slow"]]
    appends = [a for part in produced for a in part["appends"]]
    in_pause = [a for a in appends if pause[0] <= a[0] < pause[0] + pause[1]]
    outside = [a for a in appends if not pause[0] <= a[0] < pause[0] + pause[1]]
    lines = sum(final["lines"].values())

    print()
    print("| delivery delay, store to watcher (ms) | p50 | p90 | p99 | p99.9 | max | lines delivered |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    cells = [histogram_percentile(delays, q) for q in (50, 90, 99, 99.9)]
    print(
        f"| {len(watchers) - len(slow)} watchers that kept reading | {' | '.join(f'{c:,}' for c in cells)} | {max(delays, default=0):,} | {sum(delays.values()):,} |"
    )
    print()
    print("| producers (the runner's path) | lines/s stored | appends | append p50 ms | append p99 ms | lateness p99 s | lateness max s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for label, part in (("while slow watchers did not read", in_pause), ("the rest of the run", outside)):
        if part:
            took, late = [a[1] for a in part], [a[2] for a in part]
            rate = args.rate * args.jobs
            print(
                f"| {label} | {rate:,.0f} due | {len(part):,} | {statistics.median(took):.1f} | {percentile(took, 99):.1f} "
                f"| {percentile(late, 99):.2f} | {max(late):.2f} |"
            )
    print(f"stored {lines:,} lines in {wall:.1f} s: {lines / wall:,.0f} lines/s ({args.rate * args.jobs:,.0f} due)")
    print()
    for w in slow:
        fate = f"dropped {w['dropped_after']:.1f} s into its pause" if w["dropped_after"] is not None else "NOT dropped"
        print(f"slow watcher: {fate}, {w['connects']} connects, {w['resumed_lines']:,} lines after resuming, {'complete' if w['complete'] else 'INCOMPLETE'}")
    closes = Counter(code for w in watchers for code in w["closes"])
    print(
        f"watchers complete and in order: {len(watchers) - len(lost)} of {len(watchers)}; "
        f"reading watchers the server closed (each resumed): {sum(closes.values())} {dict(closes) if closes else ''}"
    )
    failed = Counter(f for w in watchers for f in w["failed_connects"])
    if failed:
        print(f"connections that failed (tried again): {sum(failed.values())}: {dict(failed.most_common(3))}")
    for w in lost[:5]:
        print(f"  lost or out of order: {w['problems']} complete={w['complete']}")
    used = {name: after[name] - before.get(name, 0) for name in after}
    producing, watching = sum(part["cpu"] for part in produced), sum(part["cpu"] for part in reports)
    print(
        f"CPU in {wall:.1f} s of output on {os.cpu_count()} cores: web worker {used['web']:.1f} s ({100 * used['web'] / wall:.0f}% of a core), "
        f"producers {producing:.1f} s, watcher processes {watching:.1f} s; the machine {100 * machine:.0f}% busy"
    )
    if late_at:
        # When the late lines were stored, in seconds of the output: a burst (the slow watchers'
        # return, a round over all sockets) or spread over the run (the worker short of CPU).
        worst = ", ".join(f"{second - start_at:+.0f} s: {n:,}" for second, n in late_at.most_common(5))
        print(
            f"lines delivered later than {TARGET_MS} ms: {sum(late_at.values()):,}, stored in the seconds {worst} (the slow watchers read again at {pause[0] + pause[1] - start_at:+.0f} s)"
        )
    print(f"delivery p99 (ms, target at most {TARGET_MS}): {histogram_percentile(delays, 99)}")
    undropped = [w for w in slow if w["dropped_after"] is None]
    if lost or undropped:
        sys.exit(f"{len(lost)} watcher(s) lost lines or saw them out of order; {len(undropped)} slow watcher(s) not dropped")


def machine_busy(since=None):
    """The machine's CPU counters (/proc/stat); given earlier ones, the busy fraction since."""
    fields = [int(n) for n in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle, total = fields[3] + fields[4], sum(fields)
    if since is None:
        return idle, total
    return 1 - (idle - since[0]) / max(1, total - since[1])


def _answers(url):
    try:
        return httpx.get(f"{url}/accounts/login/", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


if __name__ == "__main__":
    main()
