"""The runner with real job processes: output kept line by line, artifacts, the meter, cancel,
span and ceiling limits, an environment without the network's secrets, lost and restarted nodes."""

import json
import os
import time
import uuid
from datetime import timedelta
from decimal import Decimal

import pytest
from django.utils import timezone

from agent.runner import Runner
from billing.models import UsageRecord
from e31web.demo import add_dataset
from jobs.models import Job
from scheduler import allocations, services
from scheduler.models import Node
from tests.conftest import make_job, schedule_now

# The runner stages on threads of their own, which must see the test's rows: real transactions.
pytestmark = [pytest.mark.timeout(120), pytest.mark.django_db(transaction=True)]


@pytest.fixture
def runner(db, settings, tmp_path):
    settings.E31_STOP_GRACE_SECONDS = 1.0
    runner = Runner(name="test-node", devices=2, work_dir=tmp_path / "runs", device_type="cpu")
    runner.register()
    yield runner
    runner.stop_all()


def run_until(runner, done, timeout=60):
    """Drive the scheduler's cycle and the runner's step until done() holds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        services.line_up()
        services.schedule()
        runner.step()
        if done():
            return
        time.sleep(0.05)
    raise TimeoutError("the runner did not get there in time")


def run_job(runner, job, timeout=60):
    run_until(runner, lambda: Job.objects.get(pk=job.pk).is_terminal, timeout)
    job.refresh_from_db()
    return job


def log_lines(job):
    return list(job.events.filter(kind="log").order_by("seq").values_list("stream", "text"))


def test_the_loop_finishes_a_job_when_it_ends_not_at_its_next_turn(runner, alice, rate):
    """Runner.run waits for its next turn on an event that a job's exit and the end of its output
    set: with a turn of ten minutes, a job that ends a second after the loop went to sleep is
    finished at once (on a cluster engine the meter runs until the agent is done with it)."""
    import threading

    job = make_job(alice, script=b"import time\ntime.sleep(1)\nprint('done')\n")
    run_until(runner, lambda: bool(runner.running))
    loop = threading.Thread(target=runner.run, kwargs={"interval": 600}, daemon=True)
    loop.start()
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not Job.objects.get(pk=job.pk).is_terminal:
            time.sleep(0.1)
        job.refresh_from_db()
        assert job.state == "succeeded", job.state
        assert log_lines(job) == [("stdout", "done")]
    finally:
        runner.shutdown = True
        runner.wake.set()
        loop.join(30)
    assert not loop.is_alive()


def test_a_job_runs_and_everything_is_kept(runner, alice, rate):
    script = b"""
import os, sys
for i in range(500):
    print(f"out {i}")
print("to stderr", file=sys.stderr)
open(os.path.join(os.environ["E31_OUTPUT_DIR"], "model.pt"), "wb").write(b"weights")
os.makedirs(os.path.join(os.environ["E31_OUTPUT_DIR"], "sub"))
open(os.path.join(os.environ["E31_OUTPUT_DIR"], "sub", "notes.txt"), "w").write("hi")
"""
    job = run_job(runner, make_job(alice, script=script))
    assert job.state == "succeeded" and job.exit_code == 0
    lines = log_lines(job)
    assert [t for s, t in lines if s == "stdout"] == [f"out {i}" for i in range(500)]
    assert ("stderr", "to stderr") in lines
    assert sorted(job.artifacts.values_list("name", "size")) == [("model.pt", 7), ("sub/notes.txt", 2)]
    assert [e.data["state"] for e in job.timeline()] == ["queued", "starting", "running", "succeeded"]

    allocation = job.allocations.get()
    usage = UsageRecord.objects.get(allocation=allocation)
    held = int((allocation.ended_at - allocation.started_at).total_seconds())
    assert usage.held_seconds == held
    assert usage.amount == (Decimal(held) * Decimal("2.40") / 3600).quantize(Decimal("0.00000001"))
    last_meter = job.events.filter(kind="meter").order_by("-seq").first()
    assert last_meter.data["running"] is False and last_meter.data["held_seconds"] == held
    # The node's devices are free again, the working folder is gone.
    assert Node.objects.get().free_devices() == (0, 1)
    assert not any(runner.work_dir.iterdir())


def test_the_meter_stops_when_the_process_exits_not_when_the_runner_next_looks(runner, alice, rate):
    job = make_job(alice, script=b"import time\nprint(time.time(), flush=True)\n")
    run_until(runner, lambda: Job.objects.get(pk=job.pk).state == "running")
    # The runner looks again only 1.5 s later (a busy loop, a slow step): the process has long
    # exited by then, and the meter must stop at its exit, not at that look.
    time.sleep(1.5)
    job = run_job(runner, job)
    assert job.state == "succeeded"
    printed = float(log_lines(job)[-1][1])
    allocation = job.allocations.get()
    assert allocation.ended_at.timestamp() - printed < 1.0, (allocation.ended_at.timestamp(), printed)


def test_a_failing_job_fails_with_its_exit_code_and_keeps_its_output(runner, alice, rate):
    script = b"import os, sys\nopen(os.environ['E31_OUTPUT_DIR'] + '/partial.txt', 'w').write('x')\nprint('boom'); sys.exit(3)\n"
    job = run_job(runner, make_job(alice, script=script))
    assert job.state == "failed" and job.exit_code == 3
    assert job.reason == "the process exited with code 3"
    assert ("stdout", "boom") in log_lines(job)
    assert job.artifacts.filter(name="partial.txt").exists()
    assert UsageRecord.objects.filter(job=job).count() == 1


def test_the_job_gets_its_folders_config_data_and_no_secrets(runner, alice, rate, monkeypatch, team_a):
    monkeypatch.setenv("DATABASE_URL", "postgres://secret@db/prod")
    monkeypatch.setenv("REDIS_URL", "redis://secret")
    monkeypatch.setenv("SECRET_KEY", "the-django-secret")
    script = b"""
import json, os
print(json.dumps(dict(os.environ)))
print(json.dumps(json.load(open(os.environ["E31_CONFIG"]))))
print(json.dumps(sorted(os.listdir(os.path.join(os.environ["E31_DATA_DIR"], "train")))))
"""
    dataset = add_dataset(team_a, "numbers", {"numbers.csv": b"1,2\n", "more/deep.csv": b"3,4\n"})
    job = make_job(alice, script=script, config={"lr": 0.5}, env={"MY_FLAG": "yes"}, train_version=dataset.latest_version())
    job = run_job(runner, job)
    assert job.state == "succeeded", log_lines(job)
    env_line, config_line, data_line = [t for s, t in log_lines(job) if s == "stdout"]
    env = json.loads(env_line)
    for secret in ("DATABASE_URL", "REDIS_URL", "SECRET_KEY", "DJANGO_SETTINGS_MODULE"):
        assert secret not in env
    assert "the-django-secret" not in env_line and "postgres://" not in env_line
    assert env["E31_JOB_ID"] == str(job.pk) and env["MY_FLAG"] == "yes"
    for name in ("E31_DATA_DIR", "E31_OUTPUT_DIR", "E31_CHECKPOINT_DIR", "E31_CONFIG"):
        assert env[name].startswith(str(runner.work_dir))
    assert json.loads(config_line) == {"lr": 0.5}
    assert json.loads(data_line) == ["more", "numbers.csv"]


def test_cancel_stops_the_whole_process_group_within_five_seconds(runner, alice, rate):
    # Its processes carry a marker in their arguments, found from the host: in its sandbox the
    # job's own pids are those of its PID namespace.
    marker = f"e31-cancel-{uuid.uuid4().hex}"
    script = f"""
import os, signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a job that will not stop when asked
child = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)", "{marker}"])
print("started", flush=True)
while True:
    time.sleep(0.1)
""".encode()
    job = make_job(alice, script=script)
    run_until(runner, lambda: any(t == "started" for _, t in log_lines(job)))
    assert host_pids_with(marker)
    cancelled_at = time.monotonic()
    job.request_cancel()
    run_until(runner, lambda: Job.objects.get(pk=job.pk).is_terminal, timeout=10)
    assert time.monotonic() - cancelled_at < 5
    job.refresh_from_db()
    assert job.state == "cancelled"
    assert ("stdout", "started") in log_lines(job), "the logs are kept"
    assert not host_pids_with(marker), "a process of the job survived the cancel"
    allocation = job.allocations.get()
    assert allocation.end_reason == "cancelled" and allocation.ended_at is not None


def host_pids_with(marker):
    from tests.test_isolation import host_pids_with as find

    return find(marker)


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie is dead, just not yet reaped
        return stat.read().split()[2] != "Z"


def test_a_fixed_span_is_enforced_and_the_output_so_far_kept(runner, alice, rate):
    script = b"""
import os, time
open(os.environ["E31_OUTPUT_DIR"] + "/weights-so-far.pt", "w").write("w")
i = 0
while True:
    print(f"step {i}", flush=True); i += 1; time.sleep(0.2)
"""
    job = run_job(runner, make_job(alice, script=script, span_hours=Decimal("0.001")))  # 3.6 s
    assert job.state == "stopped"
    assert "span is reached" in job.reason
    assert job.artifacts.filter(name="weights-so-far.pt").exists()
    allocation = job.allocations.get()
    assert allocation.ended_at - allocation.started_at <= timedelta(seconds=3.6)
    assert UsageRecord.objects.get(job=job).held_seconds <= 3


def test_a_money_ceiling_is_never_passed(runner, alice, rate):
    from billing.models import Rate

    Rate.objects.create(gpu_type="", per_gpu_hour=Decimal("12.00"))  # 0.01 buys 3 s
    script = b"import time\nprint('up', flush=True)\nwhile True: time.sleep(0.1)\n"
    ceiling = Decimal("0.01")
    job = run_job(runner, make_job(alice, script=script, span_hours=None, ceiling_amount=ceiling))
    assert job.state == "stopped" and "ceiling is reached" in job.reason
    assert ("stdout", "up") in log_lines(job)
    usage = UsageRecord.objects.get(job=job)
    assert 1 <= usage.held_seconds <= 3
    assert 0 < usage.amount <= ceiling


def test_long_lines_are_split_not_lost(runner, alice, rate, settings):
    runner.max_line_bytes = 1000
    job = run_job(runner, make_job(alice, script=b"print('x' * 2500)\nprint('end')\n"))
    texts = [t for _, t in log_lines(job)]
    assert "".join(texts[:-1]) == "x" * 2500 and texts[-1] == "end"


def test_a_missing_entrypoint_fails_with_python_s_message(runner, alice, rate):
    job = make_job(alice)
    Job.objects.filter(pk=job.pk).update(entrypoint="missing.py")
    job = run_job(runner, job)
    assert job.state == "failed" and job.exit_code == 2
    assert any("can't open file" in t for _, t in log_lines(job))


def test_a_missing_object_fails_the_job_in_staging_without_a_charge(runner, alice, rate, storage_dir):
    job = make_job(alice)
    for upload in job.uploads.all():
        (storage_dir / upload.key).unlink()
    job = run_job(runner, job)
    assert job.state == "failed"
    assert job.reason == "staging failed: code/train.py: the stored object is missing"
    assert not job.allocations.exists() and not UsageRecord.objects.filter(job=job).exists()
    staging = job.stagings.get()
    assert staging.state == "failed" and "missing" in staging.error


def test_a_runner_whose_allocation_was_ended_elsewhere_kills_the_process(runner, alice, rate, settings):
    job = make_job(alice, script=b"import time\nprint('up', flush=True)\ntime.sleep(600)\n")
    run_until(runner, lambda: bool(log_lines(job)))
    pid = next(iter(runner.running.values())).process.pid
    Node.objects.update(last_heartbeat=timezone.now() - timedelta(seconds=settings.E31_NODE_TIMEOUT_SECONDS + 1))
    allocations.expire_lost_nodes()
    runner.step()
    assert runner.running == {}
    assert not _alive(pid)
    job.refresh_from_db()
    assert job.state == "queued" and job.restarts == 1


def test_stopping_the_runner_requeues_its_jobs(runner, alice, rate):
    job = make_job(alice, script=b"import time\nprint('up', flush=True)\ntime.sleep(600)\n")
    run_until(runner, lambda: bool(log_lines(job)))
    runner.stop_all()
    job.refresh_from_db()
    assert job.state == "queued" and job.restarts == 1
    assert job.allocations.get().end_reason == "runner_stopped"
    assert Node.objects.get().stopped_at is not None


def test_a_restarted_runner_releases_what_its_predecessor_held(db, alice, rate, tmp_path):
    first = Runner(name="node", devices=1, work_dir=tmp_path, device_type="cpu")
    first.register()
    job = make_job(alice)
    [allocation] = schedule_now()
    Node.objects.update(stopped_at=timezone.now())  # the old runner died without cleaning up
    second = Runner(name="node", devices=1, work_dir=tmp_path, device_type="cpu")
    second.register()
    allocation.refresh_from_db()
    job.refresh_from_db()
    assert allocation.end_reason == "runner_stopped" and job.state == "queued"


def test_two_live_runners_cannot_share_a_name(runner, tmp_path):
    with pytest.raises(RuntimeError, match="already running"):
        Runner(name="test-node", devices=1, work_dir=tmp_path, device_type="cpu").register()


def test_a_job_cancelled_before_its_process_started_is_not_launched(runner, alice, rate):
    job = make_job(alice)
    schedule_now()
    job.request_cancel()
    run_until(runner, lambda: Job.objects.get(pk=job.pk).is_terminal)
    job.refresh_from_db()
    assert job.state == "cancelled" and not log_lines(job)


def test_nul_bytes_and_bad_utf8_are_kept_as_replacement_characters(runner, alice, rate):
    script = b"import sys\nsys.stdout.buffer.write(b'a\\x00b \\xff end\\n')\n"
    job = run_job(runner, make_job(alice, script=script))
    assert log_lines(job) == [("stdout", "a\ufffdb \ufffd end")]


def test_a_daemon_holding_the_pipes_does_not_hold_the_job_forever(runner, alice, rate, monkeypatch):
    from agent import running as running_module

    monkeypatch.setattr(running_module, "READER_JOIN_SECONDS", 1.0)
    # The daemon leaves the job's session, so the group kill misses it, and keeps stdout open.
    script = b"import subprocess\ndaemon = subprocess.Popen(['setsid', 'sleep', '30'])\nprint(f'daemon {daemon.pid}', flush=True)\nprint('bye', flush=True)\n"
    job = make_job(alice, script=script)
    started = time.monotonic()
    try:
        job = run_job(runner, job, timeout=20)
        assert job.state == "succeeded" and ("stdout", "bye") in log_lines(job)
        assert time.monotonic() - started < 10
    finally:
        for _, text in log_lines(job):
            if text.startswith("daemon "):
                try:
                    os.kill(int(text.split()[1]), 9)
                except ProcessLookupError:
                    pass


def test_a_chatty_job_s_lines_are_all_stored_in_order(runner, alice, rate):
    script = b"import sys\nw = sys.stdout.write\nfor i in range(30000): w(f'{i}\\n')\n"
    job = run_job(runner, make_job(alice, script=script))
    texts = [t for _, t in log_lines(job)]
    assert texts == [str(i) for i in range(30000)]
    assert list(job.events.filter(kind="log").values_list("seq", flat=True)) == sorted(job.events.filter(kind="log").values_list("seq", flat=True))


def test_output_files_with_unusable_names_are_skipped_with_a_notice(runner, alice, rate):
    script = rb"""
import os
out = os.environ["E31_OUTPUT_DIR"].encode()
for name in (b"model.pt", b"run\\model.pt", b"line\nbreak.txt", b"bad\xff.bin", b"d" * 250 + b"/" + b"e" * 250 + b"/f"):
    os.makedirs(os.path.dirname(os.path.join(out, name)), exist_ok=True)
    with open(os.path.join(out, name), "wb") as f:
        f.write(b"w")
"""
    job = run_job(runner, make_job(alice, script=script))
    assert job.state == "succeeded"
    assert list(job.artifacts.values_list("name", flat=True)) == ["model.pt"]
    notices = [e.data["text"] for e in job.events.filter(kind="notice")]
    assert sum(text.startswith("output file not kept") for text in notices) == 4
    assert any("backslash" in t for t in notices) and any("control characters" in t for t in notices)
    assert any("not valid UTF-8" in t for t in notices) and any("longer than 500" in t for t in notices)


def test_when_outputs_cannot_be_kept_the_job_fails_and_its_compute_is_released(runner, alice, rate, monkeypatch):
    from core.storage import LocalStorage

    def broken(self, key, src):
        raise RuntimeError("the store is on fire")

    script = b"import os\nopen(os.environ['E31_OUTPUT_DIR'] + '/model.pt', 'w').write('w')\n"
    job = make_job(alice, script=script)
    monkeypatch.setattr(LocalStorage, "save", broken)  # outputs are saved from a descriptor; save_file goes through it too
    job = run_job(runner, job)
    assert job.state == "failed" and "could not be kept: the store is on fire" in job.reason
    assert job.allocations.get().ended_at is not None


def test_one_job_s_trouble_does_not_stall_the_others(runner, alice, rate, monkeypatch):
    from agent.running import RunningJob

    bad = make_job(alice, name="bad", script=b"import time\ntime.sleep(600)\n")
    good = make_job(alice, name="good", script=b"print('fine')\n")
    original = RunningJob.pump

    def pump(self):
        if self.job.pk == bad.pk:
            raise RuntimeError("trouble")
        return original(self)

    monkeypatch.setattr(RunningJob, "pump", pump)
    good = run_job(runner, good)
    assert good.state == "succeeded" and log_lines(good) == [("stdout", "fine")]


def test_a_job_that_cannot_be_launched_gives_its_compute_back_and_the_next_one_runs(runner, alice, rate, monkeypatch):
    from django.db import OperationalError

    first = make_job(alice, name="first")
    second = make_job(alice, name="second")
    original = Runner.stage
    calls = []

    def stage(self, job, dirs):
        calls.append(job.pk)
        if job.pk == first.pk:
            raise OperationalError("database is locked")
        return original(self, job, dirs)

    monkeypatch.setattr(Runner, "stage", stage)
    run_until(runner, lambda: all(Job.objects.get(pk=j.pk).is_terminal for j in (first, second)))
    first.refresh_from_db()
    second.refresh_from_db()
    assert first.state == "failed" and first.reason == "could not start: database is locked"
    assert first.allocations.get().end_reason == "start_failed"
    assert second.state == "succeeded"


def test_a_job_whose_node_was_lost_while_it_started_is_not_left_running(runner, alice, rate, monkeypatch, settings):
    job = make_job(alice, script=b"import time\nprint('up', flush=True)\ntime.sleep(600)\n")
    original = Runner.stage

    def stage(self, job, dirs):
        original(self, job, dirs)
        # The scheduler gives up on the node while the data is being copied.
        Node.objects.update(last_heartbeat=timezone.now() - timedelta(seconds=settings.E31_NODE_TIMEOUT_SECONDS + 1))
        allocations.expire_lost_nodes()

    monkeypatch.setattr(Runner, "stage", stage)
    schedule_now()
    runner.step()
    assert runner.running == {}
    job.refresh_from_db()
    assert job.state == "queued" and job.restarts == 1
    assert not log_lines(job)
    assert not any(runner.work_dir.iterdir())


def test_a_batch_of_lines_the_database_refused_is_written_again(runner, alice, rate, monkeypatch):
    from django.db import OperationalError

    from jobs.models import JobEvent

    original = JobEvent.append_lines.__func__
    failures = []

    def append_lines(cls, job_id, lines):
        if lines and not failures:
            failures.append(len(lines))
            raise OperationalError("database is locked")
        return original(cls, job_id, lines)

    monkeypatch.setattr(JobEvent, "append_lines", classmethod(append_lines))
    job = make_job(alice, script=b"for i in range(300): print(i)\n")
    job = run_job(runner, job)
    assert failures and job.state == "succeeded"
    assert [t for _, t in log_lines(job)] == [str(i) for i in range(300)]


def lose_the_answer_once(monkeypatch, name, kind="log", pause=0.0):
    """JobEvent.<name> stores its batch, then raises as if the connection had been cut before
    the answer came back (an outage): the first time it is given events of the kind, after
    `pause` seconds."""
    from django.db import OperationalError

    from jobs.models import JobEvent

    original = getattr(JobEvent, name).__func__
    lost = []

    def store(cls, job_id, events):
        last = original(cls, job_id, events)
        if events and getattr(events[0], "kind", "log") == kind and not lost:
            lost.append(len(events))
            time.sleep(pause)
            raise OperationalError("server closed the connection unexpectedly")
        return last

    monkeypatch.setattr(JobEvent, name, classmethod(store))
    return lost


def test_a_batch_of_lines_stored_but_whose_answer_was_lost_is_not_stored_twice(runner, alice, rate, monkeypatch):
    lost = lose_the_answer_once(monkeypatch, "append_lines")
    job = run_job(runner, make_job(alice, script=b"for i in range(300): print(i)\n"))
    assert lost and job.state == "succeeded"
    assert [t for _, t in log_lines(job)] == [str(i) for i in range(300)]


def test_metric_points_stored_but_whose_answer_was_lost_are_not_stored_twice(runner, alice, rate, monkeypatch):
    # Lines printed while the points' store hangs: the next step stores them before it tries the
    # points again, and the points are looked for after what was stored when their store raised,
    # not after those lines (a review found them stored twice).
    lost = lose_the_answer_once(monkeypatch, "append", kind="metric", pause=1.0)
    script = b"""
import json, os, time
with open(os.environ["E31_METRICS_FILE"], "a") as out:
    for step in range(50):
        out.write(json.dumps({"step": step, "values": {"loss": 1 / (step + 1), "flops": 3.14e18 * (step + 1)}}) + "\\n")
time.sleep(0.5)
for i in range(20):
    print("line", i, flush=True)
time.sleep(1)
"""
    job = run_job(runner, make_job(alice, script=script))
    assert lost and job.state == "succeeded"
    steps = [e.data["step"] for e in job.events.filter(kind="metric").order_by("seq")]
    assert steps == list(range(50))
    assert [t for _, t in log_lines(job)] == [f"line {i}" for i in range(20)]


@pytest.mark.django_db(transaction=True)
def test_the_lookup_waits_for_a_store_that_holds_the_jobs_row(alice):
    """A store still running for a connection that was cut holds the job's row (its counter)
    until it commits: the retry's lookup takes the row first, so it reads after that commit, not
    before it and then stores the batch a second time."""
    import threading

    from django.db import connection, transaction

    from jobs.models import Job, JobEvent

    if connection.vendor != "postgresql":
        pytest.skip("SQLite has one writer at a time: no store runs beside a lookup")
    job = make_job(alice)
    at = timezone.now()
    holding, release, found = threading.Event(), threading.Event(), []

    def orphan_store():  # the cut connection's store: it holds the row, then commits
        try:
            with transaction.atomic():
                Job.objects.select_for_update().get(pk=job.pk)
                holding.set()
                release.wait(10)
                JobEvent.append_lines(job.pk, [("stdout", at, "once")])
        finally:
            connection.close()

    def lookup():
        try:
            found.append(JobEvent.stored_batch(job.pk, 0, [("stdout", at, "once")]))
        finally:
            connection.close()

    store = threading.Thread(target=orphan_store)
    store.start()
    assert holding.wait(10)
    looking = threading.Thread(target=lookup)
    looking.start()
    looking.join(0.5)
    assert looking.is_alive() and not found  # waiting for the row
    release.set()
    store.join(10)
    looking.join(10)
    assert found and found[0] is not None


def test_a_batch_is_found_as_stored_whatever_json_makes_of_its_numbers(alice):
    """PostgreSQL's jsonb gives a float such as 3.14e18 back as an integer, which the float does
    not equal exactly: the lookup compares numbers as numbers (jobs.models.same_json)."""
    from jobs.models import JobEvent, same_json

    job = make_job(alice)
    at = timezone.now()
    data = {"step": 3, "values": {"flops": 3.14e18, "perplexity": 1.14e26, "loss": 0.5}}
    last = JobEvent.append(job.pk, [JobEvent(kind="metric", at=at, data=data)])
    assert JobEvent.stored_batch(job.pk, 0, [JobEvent(kind="metric", at=at, data=data)]) == last
    assert JobEvent.stored_batch(job.pk, last, [JobEvent(kind="metric", at=at, data=data)]) is None  # after it: not there
    other = {"step": 3, "values": {"flops": 3.15e18, "perplexity": 1.14e26, "loss": 0.5}}
    assert JobEvent.stored_batch(job.pk, 0, [JobEvent(kind="metric", at=at, data=other)]) is None
    assert same_json(3140000000000000000, 3.14e18) and not same_json(True, 1.0) and not same_json({"a": 1}, {"a": 1, "b": 2})


def test_the_same_lines_printed_again_are_stored_again(runner, alice, rate, monkeypatch):
    """The retry looks for its own batch, not for the same text: a job that prints a line it
    printed before (after its batch failed) has it stored each time."""
    from django.db import OperationalError

    from jobs.models import JobEvent

    original = JobEvent.append_lines.__func__
    failures = []

    def append_lines(cls, job_id, lines):
        if lines and not failures:
            failures.append(len(lines))
            raise OperationalError("database is locked")  # refused: nothing stored
        return original(cls, job_id, lines)

    monkeypatch.setattr(JobEvent, "append_lines", classmethod(append_lines))
    job = run_job(runner, make_job(alice, script=b"import time\nfor i in range(6):\n    print('same', flush=True)\n    time.sleep(0.05)\n"))
    assert failures and job.state == "succeeded"
    assert [t for _, t in log_lines(job)] == ["same"] * 6


def test_a_torchrun_workers_line_written_in_pieces_is_stored_whole_with_its_rank(runner, alice, rate):
    """torchrun copies each worker's output a line at a time, and copied the start of a line
    written in pieces (print's arguments under `python -u`) as a line of its own, glued to the
    other worker's (jobs.launch.TORCHRUN_SHIM). What a worker prints that looks like torchrun's
    mark stays its own text: a log format's "[rank0]:", a rank no column holds."""
    script = b"""
import os, sys, time
rank = int(os.environ["RANK"])
time.sleep(0.3 * rank)
sys.stdout.write(f"rank {rank} says")
sys.stdout.flush()
time.sleep(1.5)  # torchrun's copy reaches the end of the file meanwhile
print(" hello", flush=True)
print(f"12:00:00 [rank{rank % 1}]: step 0", flush=True)
print("a[rank99999999999999999999]:x", flush=True)
sys.stdout.write("no end of line")
"""
    job = run_job(runner, make_job(alice, script=script, gpus=2, processes=2), timeout=120)
    assert job.state == "succeeded", (job.reason, log_lines(job))
    stored = list(job.events.filter(kind="log", stream="stdout").order_by("seq").values_list("rank", "text"))
    for rank in (0, 1):
        assert [text for r, text in stored if r == rank] == [
            f"rank {rank} says hello",
            "12:00:00 [rank0]: step 0",
            "a[rank99999999999999999999]:x",
            "no end of line",
        ]


@pytest.mark.nodb
def test_a_long_lines_rest_that_looks_like_torchruns_mark_is_text_not_a_rank():
    """The reader splits a line longer than its limit; the rest starts a line of its own, and a
    job can make it start with "[rank<20 digits>]:". Read as a rank, no column held it: the line
    could never be stored, and the job never ended (the review of this stop's changes)."""
    import subprocess
    import sys

    from agent.running import OutputReader

    fake = "[rank99999999999999999999]:x"
    line = "[rank0]:" + "a" * 20 + fake  # torchrun's mark, then the job's own text: 28 characters each
    process = subprocess.Popen([sys.executable, "-c", f"print({line!r})"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    reader = OutputReader(process, max_line_bytes=len(fake), ranked=True)
    process.wait(30)
    reader.join(30)
    lines = [(text, rank) for _, _, text, rank in reader.drain(10)]
    assert lines == [("a" * 20, 0), (fake, None), ("", None)]  # the last: the line's end alone


def test_the_live_meter_and_the_bill_agree_at_release(runner, alice, rate):
    from billing import meter

    job = run_job(runner, make_job(alice, script=b"import time\ntime.sleep(2.5)\n"))
    usage = UsageRecord.objects.get(job=job)
    ticks = [e.data for e in job.events.filter(kind="meter").order_by("seq")]
    live = [t for t in ticks if t["running"]]
    assert live, "the meter ticked while the job ran"
    one_second = meter.charge(usage.gpus, 1, usage.rate)
    assert Decimal(usage.amount) - Decimal(live[-1]["amount"]) <= one_second
    assert live[-1]["held_seconds"] <= usage.held_seconds <= live[-1]["held_seconds"] + 1
    # The figure the page shows once released is the bill itself.
    assert not ticks[-1]["running"] and Decimal(ticks[-1]["amount"]) == usage.amount
    assert ticks[-1]["held_seconds"] == usage.held_seconds
