"""Read load: what a CLI polls and a browser opens, for a team with 10,000 jobs (issue 24).

A LiveSystem on PostgreSQL and Redis (the production-like mode), one daphne worker, the
scheduler stopped once the system is up (nothing is queued: the figures are the web tier's
own). The demo team is given --jobs finished jobs, one an hour back from now (so the last full
month holds 720 to 744 of them), each with an allocation and its usage record, its state
changes, --lines log lines and --metrics metric points interleaved with them (a metric point
after every lines/metrics lines). They are built in the database in bulk (bulk_create for the
jobs, allocations and usage records; INSERT ... SELECT over generate_series for the events),
not through the API, then VACUUM ANALYZE'd as autovacuum would in time.

Then, from one client, one request at a time, --requests of each read (after a few to warm up):

    job list     GET /api/jobs/                 the newest page (50 jobs)
    job          GET /api/jobs/<id>/            a job drawn at random from all of them
    log page     GET /api/jobs/<id>/logs/?after=N   N: half the job's events (a page of about
                                                half its lines, as a CLI catching up reads)
    usage        GET /api/usage/?month=<last>   the last full month: its statement and a page
                                                of its records
    job page     GET /jobs/<id>/                the browser's page of a job (HTML, signed in)

Prints a table of each read's p50, p99 and max latency, the web worker's CPU per request and
errors (a request that does not answer 200), and last the worst p99 in milliseconds (issue 24's
target: p50 at most 15 ms and p99 at most 50 ms for each). It exits 1 if any request failed.

    .venv/bin/python bench/read_load.py [--jobs 10000] [--lines 1000] [--metrics 100]
                                        [--requests 300] [--quick]

--quick (CI: the benchmark still works, in well under a minute on 2 cores): 200 jobs of 50
lines and 5 metric points, 20 requests of each read; the figures are meaningless.
"""

import argparse
import random
import signal
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.system import LiveSystem  # noqa: E402

# Run by manage.py shell in the system's environment: the team's jobs, allocations and usage
# records through the ORM in bulk, their events in three INSERT ... SELECTs (PostgreSQL).
BUILD = """
from datetime import timedelta
from decimal import Decimal
from django.contrib.auth import get_user_model
from django.db import connection, transaction
from django.utils import timezone
from accounts.models import Team
from billing import meter
from billing.models import UsageRecord, billing_month
from e31web.demo import DEMO_TEAM, DEMO_USER
from jobs.models import Job
from scheduler.models import Allocation, Node

JOBS, LINES, METRICS = {jobs}, {lines}, {metrics}
EVERY = LINES // METRICS  # log lines before each metric point
LAST = 2 + LINES + METRICS + 1  # starting, running, the body, succeeded
team = Team.objects.get(name=DEMO_TEAM)
user = get_user_model().objects.get(username=DEMO_USER[0])
now = timezone.now().replace(minute=0, second=0, microsecond=0)
rate = Decimal("2.4000")
with transaction.atomic():
    # Stopped: the scheduler never places anything on it or declares it lost.
    node = Node.objects.create(name="bench-node", device_type="a100", devices=8, stopped_at=now)
    jobs = Job.objects.bulk_create(
        [
            Job(team=team, created_by=user, name=f"bench-{{n % 97}}", experiment=f"bench-{{n % 97}}", state="succeeded",
                entrypoint="train.py", args=["--epochs", "3"], config={{"lr": 0.01}}, gpus=1, gpu_type="a100",
                span_hours=Decimal("1"), created_at=now - timedelta(hours=n + 1), finished_at=now - timedelta(hours=n + 1, minutes=-31),
                reason="process exited 0", exit_code=0, last_seq=LAST)
            for n in range(JOBS)
        ],
        batch_size=2000,
    )
    allocations = Allocation.objects.bulk_create(
        [
            Allocation(job=job, node=node, devices=[n % 8], device_type="a100", rate=rate, started_at=job.created_at + timedelta(minutes=1),
                       ended_at=job.finished_at, end_reason=Allocation.EXITED)
            for n, job in enumerate(jobs)
        ],
        batch_size=2000,
    )
    UsageRecord.objects.bulk_create(
        [
            UsageRecord(team=team, job_id=a.job_id, allocation=a, gpu_type="a100", gpus=1, started_at=a.started_at, ended_at=a.ended_at,
                        held_seconds=1800, rate=rate, amount=meter.charge(1, 1800, rate), period=billing_month(a.ended_at))
            for a in allocations
        ],
        batch_size=2000,
    )
    ids = [job.pk for job in jobs]
    with connection.cursor() as cursor:
        events = "INSERT INTO jobs_jobevent (job_id, seq, at, kind, stream, text, rank, data) "
        cursor.execute(
            events + "SELECT j.id, s.seq, j.created_at + s.seq * interval '1 second', 'state', '', '', NULL, s.data "
            "FROM jobs_job j, (VALUES (1, jsonb_build_object('state', 'starting', 'from', 'queued', 'reason', 'held 1 a100 device on bench-node')), "
            "(2, jsonb_build_object('state', 'running', 'from', 'starting', 'reason', 'process started')), "
            "(%s, jsonb_build_object('state', 'succeeded', 'from', 'running', 'reason', 'process exited 0'))) AS s(seq, data) "
            "WHERE j.id = ANY(%s)",
            [LAST, ids],
        )
        cursor.execute(
            events + "SELECT j.id, 3 + (i / %s) * (%s + 1) + i %% %s, j.created_at + interval '1 minute' + i * interval '1 second', 'log', 'stdout', "
            "'epoch ' || (i / 100) || ' step ' || i || ': loss ' || round(1.0 / (i + 1), 6) || ', lr 0.001, 1234.5 samples/s', NULL, NULL "
            "FROM jobs_job j, generate_series(0, %s - 1) AS i WHERE j.id = ANY(%s)",
            [EVERY, EVERY, EVERY, LINES, ids],
        )
        cursor.execute(
            events + "SELECT j.id, 3 + m * (%s + 1) + %s, j.created_at + interval '1 minute' + m * interval '10 seconds', 'metric', '', '', NULL, "
            "jsonb_build_object('step', m, 'values', jsonb_build_object('loss', 1.0 / (m + 1), 'acc', m / 100.0)) "
            "FROM jobs_job j, generate_series(0, %s - 1) AS m WHERE j.id = ANY(%s)",
            [EVERY, EVERY, METRICS, ids],
        )
with connection.cursor() as cursor:
    cursor.execute("VACUUM ANALYZE")
for job in jobs:
    print("job", job.pk)
"""


def percentile(values, q):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]


def last_month(now):
    year, month = (now.year, now.month - 1) if now.month > 1 else (now.year - 1, 12)
    return f"{year:04d}-{month:02d}"


def measure(system, http, paths, warm_up=5):
    """Each path asked once in turn (after warm_up of them): (latencies, errors, web CPU s)."""
    for path in paths[:warm_up]:
        http.get(path)
    latencies, errors = [], []
    before = system.cpu_seconds()["web"]
    for path in paths:
        start = time.perf_counter()
        try:
            response = http.get(path)
            problem = None if response.status_code == 200 else f"{path}: {response.status_code} {response.text[:200]}"
        except httpx.HTTPError as error:
            problem = f"{path}: {type(error).__name__}: {error}"
        latencies.append(time.perf_counter() - start)
        if problem:
            errors.append(problem)
    return latencies, errors, system.cpu_seconds()["web"] - before


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--lines", type=int, default=1000, help="log lines per job")
    parser.add_argument("--metrics", type=int, default=100, help="metric points per job (they divide --lines)")
    parser.add_argument("--requests", type=int, default=300, help="of each read")
    parser.add_argument("--quick", action="store_true", help="200 jobs of 50 lines and 5 points, 20 requests each (CI: the benchmark still works)")
    args = parser.parse_args()
    if args.quick:
        args.jobs, args.lines, args.metrics, args.requests = 200, 50, 5, 20
    if args.lines % args.metrics:
        parser.error("--metrics must divide --lines")

    rng = random.Random(24)
    system = LiveSystem(database="postgres", redis=True, env={"E31_API_RATE": "1000000/min"})
    failed = 0
    try:
        system.start(runner=False)
        scheduler = system.processes.pop("scheduler")
        scheduler.send_signal(signal.SIGTERM)
        scheduler.wait(30)
        started = time.perf_counter()
        made = system.manage("shell", "-c", BUILD.format(jobs=args.jobs, lines=args.lines, metrics=args.metrics), timeout=3600)
        ids = [line.split()[1] for line in made.splitlines() if line.startswith("job ")]
        assert len(ids) == args.jobs, made[-2000:]
        events = args.jobs * (3 + args.lines + args.metrics)
        print(
            f"built {args.jobs:,} jobs with {events:,} events ({args.lines} log lines, {args.metrics} metric points each) in {time.perf_counter() - started:.0f} s"
        )
        print("server: 1 daphne worker, postgres + redis, scheduler stopped, no runner; one client, one request at a time")

        half = (3 + args.lines + args.metrics) // 2
        month = last_month(datetime.now(UTC))
        picks = [rng.choice(ids) for _ in range(args.requests)]
        reads = {
            "job list (API)": ["/api/jobs/"] * args.requests,
            "job (API)": [f"/api/jobs/{job}/" for job in picks],
            f"log page ?after={half} (API)": [f"/api/jobs/{job}/logs/?after={half}" for job in picks],
            f"usage {month} (API)": [f"/api/usage/?month={month}"] * args.requests,
            "job page (HTML)": [f"/jobs/{job}/" for job in picks],
        }
        api = httpx.Client(base_url=system.url, headers={"Authorization": f"Token {system.token}"}, timeout=60)
        browser = system.browser_session()
        print(f"{'read':<34} {'requests':>8} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'web CPU ms/req':>15} {'errors':>7}")
        worst = 0.0
        for what, paths in reads.items():
            http = browser if "HTML" in what else api
            latencies, errors, cpu = measure(system, http, paths)
            p50, p99 = statistics.median(latencies) * 1000, percentile(latencies, 99) * 1000
            worst = max(worst, p99)
            failed += len(errors)
            print(f"{what:<34} {len(latencies):>8} {p50:>8.1f} {p99:>8.1f} {max(latencies) * 1000:>8.1f} {cpu * 1000 / len(latencies):>15.1f} {len(errors):>7}")
            for problem in errors[:3]:
                print(f"  error: {problem}")
        api.close()
        browser.close()
    finally:
        system.stop()
    print(f"worst p99 of the reads (target at most 50 ms): {worst:.1f} ms")
    if failed:
        sys.exit(f"{failed} request(s) failed")


if __name__ == "__main__":
    main()
