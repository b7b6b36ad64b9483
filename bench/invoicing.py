"""How long issuing a month's invoices takes, and how many SQL queries it costs.

On a fresh PostgreSQL database (CREATE DATABASE e31_bench_..., migrated with manage.py
migrate, dropped at the end), --teams teams get --records usage records in October 2026 over
jobs of a random number each (so invoices have from a few lines to many), every job with a
staging row (bulk_create throughout; the tables populated then vacuumed and analyzed, as autovacuum
leaves them by a month's end). Then the month is issued as `manage.py invoices --month
2026-10` does (invoice_service.invoice_month: teams in chunks, each chunk in one transaction and
a fixed number of queries), timed, its queries counted per chunk: the count must be the same for
every full chunk, however many records or lines a chunk holds. First, for comparison, the first
SAMPLED teams are issued one at a time (invoice_team_month, as before the batching), listed by
django.test.utils.CaptureQueriesContext and timed apart.

The last line is the milliseconds per invoice of the month issued in chunks (the issue's budget:
5 ms for 1,000 teams and 100,000 records). It exits 1 if the queries per chunk are not the same
for every full chunk, if one team's invoice costs more queries than a chunk does, or if issuing
the month again issues anything.

    .venv/bin/python bench/invoicing.py [--teams 1000] [--records 100000] [--keep] [--quick]

--quick (CI: the benchmark still works, in about 6 s): 30 teams, 600 records, in chunks of 3
teams (the first 20 teams issued one at a time); the figures are meaningless.
"""

import argparse
import gc
import os
import random
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SAMPLED = 20  # teams issued one at a time first (their queries listed by CaptureQueriesContext)
sys.path.insert(0, str(ROOT))
ADMIN_URL = os.environ.get("E31_TEST_POSTGRES_URL", "postgres://postgres@127.0.0.1:5432/test")
UTC = UTC
START = datetime(2026, 10, 1, tzinfo=UTC)


def admin(sql):
    import psycopg

    with psycopg.connect(ADMIN_URL, autocommit=True) as conn:
        conn.execute(sql)


def populate(teams, records, seed=31):
    from django.contrib.auth import get_user_model

    from accounts.models import Team
    from billing import meter
    from billing.models import Credit, UsageRecord, billing_month
    from jobs.models import Job
    from scheduler.models import Allocation, Node, Staging

    rng = random.Random(seed)
    user = get_user_model().objects.create_user("bench", "bench@example.com", "x")
    node = Node.objects.create(name="bench", device_type="NVIDIA H100", devices=8)
    team_rows = Team.objects.bulk_create([Team(name=f"team-{i:05d}") for i in range(teams)])
    per_team = max(1, records // teams)
    jobs, allocations, usages, stagings, credits = [], [], [], [], []
    rates = [Decimal("2.40"), Decimal("3.125"), Decimal("1.80")]
    made = 0
    for t, team in enumerate(team_rows):
        count = per_team if t < teams - 1 else records - made
        made += count
        n_jobs = rng.randint(1, max(1, min(count, per_team // 2)))
        team_jobs = []
        for j in range(n_jobs):
            created = START + timedelta(seconds=rng.randint(0, 20 * 86400))
            job = Job(
                team=team,
                created_by=user,
                name=f"run-{t}-{j}",
                entrypoint="train.py",
                gpus=rng.choice([1, 2, 4, 8]),
                span_hours=Decimal(1),
                created_at=created,
                state="succeeded",
            )
            team_jobs.append(job)
            stagings.append(
                Staging(
                    job=job,
                    node=node,
                    state=Staging.STAGED,
                    created_at=created,
                    started_at=created + timedelta(seconds=5),
                    finished_at=created + timedelta(seconds=5 + rng.randint(1, 600)),
                )
            )
        jobs += team_jobs
        for _ in range(count):
            job = rng.choice(team_jobs)
            started = job.created_at + timedelta(seconds=rng.randint(60, 86400))
            seconds = rng.randint(1, 6 * 3600)
            rate = rng.choice(rates)
            amount = meter.charge(job.gpus, seconds, rate)
            credit = amount / 4 if rng.random() < 0.05 else Decimal(0)
            allocation = Allocation(
                job=job,
                node=node,
                devices=list(range(job.gpus)),
                device_type="NVIDIA H100",
                rate=rate,
                started_at=started,
                ended_at=started + timedelta(seconds=seconds),
                end_reason="exited",
            )
            allocations.append(allocation)
            usages.append(
                UsageRecord(
                    team=team,
                    job=job,
                    allocation=allocation,
                    gpu_type="NVIDIA H100",
                    gpus=job.gpus,
                    started_at=started,
                    ended_at=started + timedelta(seconds=seconds),
                    held_seconds=seconds,
                    rate=rate,
                    amount=amount,
                    period=billing_month(started + timedelta(seconds=seconds)),
                )
            )
            if credit:
                credits.append((len(usages) - 1, seconds // 4, credit.quantize(meter.AMOUNT_PLACES)))
    Job.objects.bulk_create(jobs, batch_size=5000)
    Staging.objects.bulk_create(stagings, batch_size=5000)
    Allocation.objects.bulk_create(allocations, batch_size=5000)
    UsageRecord.objects.bulk_create(usages, batch_size=5000)
    Credit.objects.bulk_create(
        [
            Credit(team=usages[i].team, job=usages[i].job, usage=usages[i], seconds=seconds, amount=amount, reason="preempted", period=usages[i].period)
            for i, seconds, amount in credits
        ],
        batch_size=5000,
    )
    return team_rows


def run(teams, records, chunk):
    import django

    django.setup()
    from django.db import connection
    from django.db.models import Count, Sum
    from django.test.utils import CaptureQueriesContext

    from accounts.models import Team
    from billing import invoice_service
    from billing.models import Credit, Invoice, InvoiceLine, UsageRecord
    from jobs.models import Job
    from scheduler.models import Allocation, Staging

    chunk = chunk or invoice_service.CHUNK
    t0 = time.perf_counter()
    populate(teams, records)
    # The tables populated, as autovacuum leaves them by the month's end: vacuumed (the first
    # read of rows just written sets their hint bits: writes, in the timing) and analyzed. Only
    # those: autovacuum never analyzes a table nobody wrote, and the invoice tables analyzed
    # empty made the planner check each line's invoice key by scanning the invoices (the
    # commits grew from 0.2 to 0.8 s a chunk: 1.9 s of the month's 5, measured).
    with connection.cursor() as cursor:
        for model in (Team, Job, Staging, Allocation, UsageRecord, Credit):
            cursor.execute(f"VACUUM ANALYZE {connection.ops.quote_name(model._meta.db_table)}")
    # The populating's million model instances in reference cycles are collected now, not by
    # a full pass of the collector in the middle of the timed month (0.45 s: measured).
    gc.collect()
    print(f"populated {teams} teams, {UsageRecord.objects.count()} usage records in {time.perf_counter() - t0:.1f} s")

    now = datetime(2026, 11, 2, tzinfo=UTC)
    counted = [0]

    def count(execute, sql, params, many, context):
        counted[0] += 1
        return execute(sql, params, many, context)

    # One team at a time, for comparison (the first SAMPLED teams by name).
    single, single_queries = [], []
    for team in Team.objects.order_by("name")[:SAMPLED]:
        connection.queries_log.clear()  # the log keeps 9,000 queries: count from empty
        with CaptureQueriesContext(connection) as captured:
            t = time.perf_counter()
            invoice_service.invoice_team_month(team, 2026, 10, now=now)
            single.append(time.perf_counter() - t)
        single_queries.append(len(captured.captured_queries))

    # The month: chunk boundaries are seen from on_invoice, called for each invoice of a chunk
    # once it has committed.
    at_chunk_end = []

    def seen(invoice):
        if not at_chunk_end or at_chunk_end[-1] != counted[0]:
            at_chunk_end.append(counted[0])

    counted[0] = 0
    started = time.perf_counter()
    with connection.execute_wrapper(count):
        made = invoice_service.invoice_month(2026, 10, now=now, on_invoice=seen, chunk=chunk)
    total = time.perf_counter() - started
    month_queries = counted[0]
    again = time.perf_counter()
    repeated = invoice_service.invoice_month(2026, 10, now=now)
    idempotent = time.perf_counter() - again
    per_chunk = [b - a for a, b in zip([0, *at_chunk_end], at_chunk_end, strict=False)]

    # The figures an invoice needs, for every team at once, in one SQL query (raw: no model
    # instances, no Decimal conversion by the ORM).
    sql, params = (
        UsageRecord.objects.filter(period=START.date())
        .values("team_id", "job_id")
        .annotate(n=Count("id"), held=Sum("held_seconds"), amount=Sum("amount"))
        .query.sql_with_params()
    )
    aggregate_times = []
    for _ in range(5):
        t = time.perf_counter()
        with connection.cursor() as cursor:
            cursor.execute(sql, params)
            rows = cursor.fetchall()
        aggregate_times.append(time.perf_counter() - t)
    aggregate = statistics.median(aggregate_times)

    issued = Invoice.objects.filter(state=Invoice.ISSUED).count()
    lines = InvoiceLine.objects.filter(invoice__in=made).values("invoice").annotate(n=Count("id")).values_list("n", flat=True)
    per_invoice = total / max(1, len(made))
    full = per_chunk[1:-1] if len(made) % chunk else per_chunk[1:]  # the first also counts finding the teams
    print(
        f"one team at a time (invoice_team_month), first {len(single)} teams: median {statistics.median(single) * 1000:.1f} ms, queries {sorted(set(single_queries))} per invoice (CaptureQueriesContext, with BEGIN and COMMIT)"
    )
    print(
        f"issued {issued} invoices; the month in chunks of {chunk}: {len(made)} invoices, {sum(lines)} lines ({min(lines)}..{max(lines)} per invoice) in {total:.2f} s"
    )
    print(
        f"SQL queries: {month_queries} for the month ({month_queries / max(1, len(made)):.3f} per invoice); per chunk {per_chunk} (the first also finds the teams; the lines go by one COPY each)"
    )
    print(f"re-running the month (idempotent, nothing to issue): {idempotent:.2f} s")
    print(f"one aggregate SQL query over the same records (sums per team and job, {len(rows)} rows): {aggregate * 1000:.1f} ms (median of 5)")
    print(f"ratio of the month's invoicing time to the aggregate query: {total / aggregate:.1f}")
    print(f"milliseconds per invoice (the month in chunks, {len(made)} invoices): {per_invoice * 1000:.2f}")
    problems = []
    if len(set(full)) > 1:
        problems.append(f"the SQL queries per chunk are not the same for every full chunk: {per_chunk}")
    if per_chunk and max(single_queries) - 2 > max(per_chunk):
        problems.append("one team's invoice costs more queries than a chunk of teams")
    if repeated:
        problems.append(f"issuing the month again issued {len(repeated)} invoices")
    return problems


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--teams", type=int, default=1000)
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--keep", action="store_true", help="keep the database")
    parser.add_argument("--chunk", type=int, default=None, help="teams per transaction (default: invoice_service.CHUNK; 3 with --quick)")
    parser.add_argument("--quick", action="store_true", help=f"30 teams, 600 records (CI: the benchmark still works; {SAMPLED} teams one at a time)")
    args = parser.parse_args()
    if args.quick:
        args.teams, args.records = SAMPLED + 10, 600
        args.chunk = args.chunk or 3

    from tests.system import stop_on_sigterm

    stop_on_sigterm()  # killed by SIGTERM, it still drops its database (below)
    name = f"e31_bench_{secrets.token_hex(4)}"
    admin(f'CREATE DATABASE "{name}"')
    env = {
        **os.environ,
        "DATABASE_URL": ADMIN_URL.rsplit("/", 1)[0] + f"/{name}",
        "E31_VAR_DIR": tempfile.mkdtemp(prefix="e31-bench-"),
        "DJANGO_SETTINGS_MODULE": "e31web.settings",
    }
    try:
        subprocess.run([sys.executable, "manage.py", "migrate", "-v", "0"], cwd=ROOT, env=env, check=True)
        os.environ.update(env)
        problems = run(args.teams, args.records, args.chunk)
    finally:
        from django.db import connections

        connections.close_all()
        if not args.keep:
            admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    if problems:
        sys.exit("; ".join(problems))


if __name__ == "__main__":
    main()
