"""API load: 500 job submissions from 20 concurrent clients, each with its own token.

A LiveSystem on PostgreSQL and Redis (the production-like mode: Redis carries the channel layer,
the cache and with it the per-token rate limits), with the scheduler running (it lines up and
predicts the queued jobs while they arrive) and no runner, so every job stays queued and the
figures are the API's own. `--workers N` starts N daphne processes on ports of their own, as a
load balancer would spread clients over workers; the clients are spread over them.

Each submission is what `e31 submit` sends: a multipart POST /api/jobs/ with a spec file's
text and a small script. A request that does not answer 201 counts as an error (must be 0).

Baseline, in the same run on the same server: one client submitting alone.

A closed loop of clients against a saturated server measures its queue, not the server: so
then an open loop, submissions sent at a fixed arrival rate (--rate a second for --seconds,
evenly spaced, each from a thread of its own whatever the others are doing), each one's latency
measured from when it was due (a late send counts against the server), and every job checked
to be queued exactly once (listed once by its unique name).

Prints requests per second, p50 and p99 latency and errors of each, the web workers' CPU, and
last the web workers' CPU milliseconds per submission in the open loop (issue 24's target: at
most 10). It exits 1 if any submission failed or a job was not queued exactly once.

    .venv/bin/python bench/api_load.py [--jobs 500] [--clients 20] [--single 100] [--workers 2]
                                       [--rate 50] [--seconds 60] [--quick]

--quick (CI: the benchmark still works, in about 30 s on 2 cores): 20 submissions from 4 clients
over the 2 workers, a baseline of 10, and 3 s at 5 a second; the figures are meaningless.
"""

import argparse
import itertools
import os
import statistics
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.system import LiveSystem, free_port  # noqa: E402

SPEC = """\
name: load-{client}-{n}
work:
  code: train.py
  args: [--epochs, "3"]
  config: {{lr: 0.01}}
data:
  train: digits
request:
  gpus: 1
  span_hours: 0.5
output:
  keep_checkpoints: 2
"""
SCRIPT = b"print('hello')\n"
USERS = """
from django.contrib.auth import get_user_model
from rest_framework.authtoken.models import Token
from accounts.models import Membership, Team
from e31web.demo import DEMO_TEAM
team = Team.objects.get(name=DEMO_TEAM)
User = get_user_model()
for i in range({clients}):
    user = User.objects.create_user(f"load{{i}}", f"load{{i}}@example.com", "load-password")
    Membership.objects.create(user=user, team=team)
    print("token", Token.objects.create(user=user).key)
"""


def percentile(values, q):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]


def client_run(url, token, client_id, count, latencies, errors, lock):
    with httpx.Client(base_url=url, headers={"Authorization": f"Token {token}"}, timeout=120) as http:
        for n in range(count):
            spec = SPEC.format(client=client_id, n=n)
            start = time.perf_counter()
            try:
                response = http.post("/api/jobs/", data={"spec": spec, "spec_name": "job.yaml"}, files={"code": ("train.py", SCRIPT, "text/x-python")})
                ok = response.status_code == 201
                problem = None if ok else f"{response.status_code} {response.text[:200]}"
            except httpx.HTTPError as error:
                ok, problem = False, f"{type(error).__name__}: {error}"
            took = time.perf_counter() - start
            with lock:
                latencies.append(took)
                if not ok:
                    errors.append(problem)


def run(urls, tokens, jobs, clients):
    latencies, errors, lock = [], [], threading.Lock()
    share = [jobs // clients + (1 if i < jobs % clients else 0) for i in range(clients)]
    threads = [
        threading.Thread(target=client_run, args=(urls[i % len(urls)], tokens[i % len(tokens)], i, share[i], latencies, errors, lock)) for i in range(clients)
    ]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - start, latencies, errors


def open_loop(urls, tokens, rate, seconds):
    """Submissions due every 1/rate s for `seconds`, each sent from a thread of its own when due;
    (latencies from when each was due, errors, names sent)."""
    latencies, errors, names, lock = [], [], [], threading.Lock()
    clients = [
        httpx.Client(base_url=urls[i % len(urls)], headers={"Authorization": f"Token {tokens[i % len(tokens)]}"}, timeout=120) for i in range(len(tokens))
    ]
    counter = itertools.count()

    def send(n, due):
        http = clients[n % len(clients)]
        name = f"open-{n}"
        spec = SPEC.format(client="open", n=n)
        try:
            response = http.post("/api/jobs/", data={"spec": spec, "spec_name": "job.yaml"}, files={"code": ("train.py", SCRIPT, "text/x-python")})
            problem = None if response.status_code == 201 else f"{response.status_code} {response.text[:200]}"
        except httpx.HTTPError as error:
            problem = f"{type(error).__name__}: {error}"
        with lock:
            latencies.append(time.perf_counter() - due)
            names.append(f"load-{name}")
            if problem:
                errors.append(problem)

    threads, start = [], time.perf_counter()
    for k in range(int(rate * seconds)):
        due = start + k / rate
        time.sleep(max(0.0, due - time.perf_counter()))
        thread = threading.Thread(target=send, args=(next(counter), due))
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join()
    for http in clients:
        http.close()
    return time.perf_counter() - start, latencies, errors, names


def report(label, wall, latencies, errors):
    print(
        f"{label}: {len(latencies)} submissions in {wall:.1f} s: {len(latencies) / wall:.1f} req/s, "
        f"p50 {statistics.median(latencies) * 1000:.0f} ms, p99 {percentile(latencies, 99) * 1000:.0f} ms, errors {len(errors)}"
    )
    for problem in errors[:5]:
        print(f"  error: {problem}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=500)
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--single", type=int, default=100, help="submissions of the single-client baseline")
    parser.add_argument("--workers", type=int, default=2, help="daphne processes")
    parser.add_argument("--rate", type=float, default=50.0, help="open loop: submissions a second")
    parser.add_argument("--seconds", type=float, default=60.0, help="open loop: for this long")
    parser.add_argument("--database", default="postgres", choices=["postgres", "sqlite"])
    parser.add_argument("--quick", action="store_true", help="20 submissions from 4 clients, 10 alone, 3 s at 5/s (CI: the benchmark still works)")
    args = parser.parse_args()
    if args.quick:
        args.jobs, args.clients, args.single, args.rate, args.seconds = 20, 4, 10, 5.0, 3.0

    system = LiveSystem(database=args.database, redis=args.database == "postgres", env={"E31_API_RATE": "100000/min"})
    try:
        system.start(runner=False)
        urls = [system.url]
        for worker in range(1, args.workers):
            port = free_port()
            system.spawn(f"web{worker}", [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(port), "e31web.asgi:application"])
            urls.append(f"http://127.0.0.1:{port}")
        for url in urls:
            system.wait_until(lambda url=url: _answers(url), 30, f"{url} to answer")
        made = system.manage("shell", "-c", USERS.format(clients=args.clients))
        tokens = [line.split()[1] for line in made.splitlines() if line.startswith("token ")]
        assert len(tokens) == args.clients, made
        print(f"server: {args.workers} daphne worker(s), {args.database}{' + redis' if system.redis else ''}, scheduler running, no runner")

        # Warm up each worker (imports, connections), then the baseline and the load.
        run(urls, tokens, 2 * len(urls), len(urls))
        single_wall, single, single_errors = run(urls[:1], tokens[:1], args.single, 1)
        report("single client", single_wall, single, single_errors)
        before = system.cpu_seconds()
        wall, latencies, errors = run(urls, tokens, args.jobs, args.clients)
        after = system.cpu_seconds()
        report(f"{args.clients} clients", wall, latencies, errors)
        used = ", ".join(f"{name} {after[name] - before.get(name, 0):.1f} s" for name in sorted(after))
        print(f"CPU during the load ({wall:.1f} s of wall time on {os.cpu_count()} cores): {used}")
        queued = system.api("GET", "/api/jobs/?page_size=1").json()["count"]
        print(f"jobs the API lists for the demo team: {queued}")

        web = [name for name in system.processes if name.startswith("web")]
        before = system.cpu_seconds()
        open_wall, open_latencies, open_errors, sent = open_loop(urls, tokens, args.rate, args.seconds)
        after = system.cpu_seconds()
        report(f"open loop at {args.rate:g}/s for {args.seconds:g} s", open_wall, open_latencies, open_errors)
        web_ms = 1000 * sum(after[name] - before.get(name, 0) for name in web) / max(1, len(open_latencies))
        listed = Counter(name for name in system.manage("shell", "-c", LISTED).split() if name.startswith("load-open-"))
        twice = sorted(n for n, c in listed.items() if c > 1)
        missing = sorted(set(sent) - set(listed))
        print(f"queued exactly once: {len(sent) - len(missing) - len(twice)} of {len(sent)} (missing {len(missing)}, doubled {len(twice)})")
    finally:
        system.stop()
    ratio = percentile(latencies, 99) / percentile(single, 99)
    print(f"errors under load: {len(errors)}")
    print(f"p99 under load / p99 single client: {ratio:.2f}")
    failed = len(errors) + len(single_errors) + len(open_errors)
    print(f"web CPU per submission in the open loop (target at most 10 ms): {web_ms:.1f} ms")
    if failed or missing or twice:
        sys.exit(f"{failed} submission(s) failed; {len(missing)} job(s) not queued, {len(twice)} queued twice")


LISTED = """
from jobs.models import Job
for name in Job.objects.filter(name__startswith="load-open-").values_list("name", flat=True):
    print(name)
"""


def _answers(url):
    try:
        return httpx.get(f"{url}/accounts/login/", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


if __name__ == "__main__":
    main()
