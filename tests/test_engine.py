"""E31 on a cluster engine (scheduler/engine.py): the engine's nodes as E31's, its other users'
jobs as busy devices and as the reason a job waits, allocations submitted to it, the meter from
its start, a job it leaves pending or loses taken back. The engine here is a double that keeps
its jobs in a dict (the real Slurm is in tests/test_slurm_engine.py); the decisions are pure
functions, tested on their own."""

import subprocess
from datetime import timedelta

import pytest
from django.utils import timezone

from jobs.models import Checkpoint, Job
from scheduler import allocations, engine, services
from scheduler.executors import base, slurm
from scheduler.models import Allocation, Node
from tests.conftest import make_job


def info(name="n1", devices=4, free=4, state=base.UP, device_type="cpu", gpu_type="", reason=""):
    return base.NodeInfo(
        name=name,
        device_type=device_type,
        devices=devices,
        free=free,
        memory_mb=8000,
        free_memory_mb=8000,
        state=state,
        reason=reason,
        gpu_type=gpu_type,
    )


class Engine:
    """An engine's double: nodes as set, jobs kept as submitted, states as a test sets them."""

    def __init__(self, *nodes):
        self.infos = list(nodes)
        self.requests = {}
        self.statuses = {}
        self.records = {}  # accounting's (sacct): none unless a test keeps some
        self.stopped = []

    def nodes(self):
        return list(self.infos)

    def start(self, request):
        handle = str(100 + len(self.requests))
        self.requests[handle] = request
        self.statuses[handle] = base.AllocationStatus(state=base.PENDING, reason="Priority")
        return handle

    def status(self, handles):
        return {h: self.statuses.get(h, base.AllocationStatus(state=base.UNKNOWN)) for h in handles}

    def stop(self, handle, graceful=True):
        self.stopped.append((handle, graceful))
        self.statuses[handle] = base.AllocationStatus(state=base.CANCELLED, engine_state="CANCELLED")

    def accounted(self, handles):
        return {h: self.records[h] for h in handles if h in self.records}


# Decisions ---------------------------------------------------------------------------------------


@pytest.mark.nodb
def test_device_types_name_the_gpu_model_where_the_engine_does():
    assert engine.device_type_of(info(device_type="gpu", gpu_type="a100")) == "a100"
    assert engine.device_type_of(info(device_type="gpu")) == "gpu"
    assert engine.device_type_of(info()) == "cpu"


@pytest.mark.nodb
def test_devices_held_by_others_are_what_the_engine_holds_beyond_ours():
    assert engine.held_by_others(info(devices=4, free=1), ours=2) == 1
    assert engine.held_by_others(info(devices=4, free=4), ours=0) == 0
    assert engine.held_by_others(info(devices=4, free=2), ours=3) == 0  # ours not yet counted by the engine
    assert engine.held_by_others(info(devices=4, free=0, state=base.DRAINED), ours=0) == 0


@pytest.mark.nodb
def test_an_end_the_agent_did_not_see_requeues_or_keeps_the_teams_word():
    lost = base.AllocationStatus(state=base.NODE_LOST, engine_state="NODE_FAIL")
    assert engine.ended_here(lost, cancel_requested=False)[:2] == (Allocation.NODE_LOST, "queued")
    assert "NODE_FAIL" in engine.ended_here(lost, cancel_requested=False)[2]
    assert engine.ended_here(lost, cancel_requested=True)[:2] == (Allocation.CANCELLED, "cancelled")
    timeout = base.AllocationStatus(state=base.ENDED, engine_state="TIMEOUT", reason="TimeLimit")
    assert engine.ended_here(timeout, cancel_requested=False)[:2] == (Allocation.LIMIT, "stopped")
    killed = base.AllocationStatus(state=base.FAILED, engine_state="FAILED", exit_code=137)
    assert engine.ended_here(killed, cancel_requested=False)[1] == "queued"


@pytest.mark.nodb
def test_the_meter_and_the_engine_agree_within_what_whole_seconds_explain():
    assert engine.disagreement(30.4, 30.0) is None
    assert engine.disagreement(31.0, 30.0) is None
    assert engine.disagreement(32.5, 30.0) == pytest.approx(2.5), "billed more than Slurm held"
    # Under: Slurm's whole seconds, and our agent's exit after the meter stopped.
    assert engine.disagreement(28.2, 30.0) is None
    assert engine.disagreement(27.5, 30.0) == pytest.approx(-2.5)
    assert engine.disagreement(10.0, None) is None


@pytest.mark.nodb
def test_the_batch_scripts_instant_refines_the_engines_whole_second():
    second = timezone.now().replace(microsecond=0)
    script = second + timedelta(seconds=0.62)
    assert engine.refined_start(second, script) == script
    assert engine.refined_start(None, script) == script
    assert engine.refined_start(second, None) == second
    # Outside the second the engine gave (a node's clock apart): the engine's word stands.
    assert engine.refined_start(second, second + timedelta(seconds=1.2)) == second
    assert engine.refined_start(second, second - timedelta(seconds=0.3)) == second


@pytest.mark.nodb
def test_the_agent_starts_the_meter_at_the_engines_second_when_its_script_started_a_second_late():
    """Whichever of the scheduler and the agent reads the engine first, the meter starts at the
    same instant: a script launched 1.06 s after Slurm's start second (a loaded node), told first,
    had started the meter there, a second after the devices were held."""
    second = timezone.now().replace(microsecond=0)
    assert engine.agent_start(second + timedelta(seconds=0.4), second) == (second + timedelta(seconds=0.4), True)
    assert engine.agent_start(second + timedelta(seconds=1.06), second) == (second, False)
    assert engine.agent_start(second + timedelta(seconds=1.06), None) == (second + timedelta(seconds=1.06), True)
    assert engine.agent_start(None, second) == (second, False)
    assert engine.agent_start(None, None) == (None, False)
    # The same start as the scheduler's word first, then the script's (refined_start).
    for script in (second + timedelta(seconds=0.4), second + timedelta(seconds=1.06), second - timedelta(seconds=0.3)):
        assert engine.agent_start(script, second)[0] == engine.refined_start(second, script)


@pytest.mark.nodb
def test_the_agent_command_asks_the_engine_for_its_start_beside_its_scripts_instant(monkeypatch):
    from agent.management.commands import runner as command

    second = timezone.now().replace(microsecond=0)
    late = second + timedelta(seconds=1.06)
    attached = []

    class Agent:
        allocation_id, name = "a1", "n1"

        def __init__(self, *args):
            pass

        def attach(self, started_at, precise=False):
            attached.append((started_at, precise))

        def run(self):
            pass

        def terminate(self):
            pass

    class Engine:
        answer = base.AllocationStatus(state=base.RUNNING, started_at=second, engine_state="RUNNING")

        def status(self, handles):
            if isinstance(self.answer, Exception):
                raise self.answer
            return dict.fromkeys(handles, self.answer)

    executor = Engine()
    monkeypatch.setattr(command, "AllocationAgent", Agent)
    monkeypatch.setattr("scheduler.executors.configured.get_executor", lambda: executor)
    monkeypatch.setenv("SLURM_JOB_ID", "41")
    monkeypatch.setenv("E31_ENGINE_STARTED_AT", f"{late.timestamp():.6f}")
    command.Command().run_one("a1", None)
    assert attached.pop() == (second, False), "a script launched a second late: Slurm's start"
    executor.answer = subprocess.TimeoutExpired(["squeue"], 10)
    command.Command().run_one("a1", None)
    assert attached.pop() == (late, True), "the controller did not answer: the script's instant"


@pytest.mark.nodb
def test_the_batch_script_tells_its_first_instant_to_the_microsecond(tmp_path):
    script = tmp_path / "batch.sh"
    script.write_text(slurm.BATCH_SCRIPT)
    before = timezone.now()
    done = subprocess.run(
        ["bash", str(script), "sh", "-c", 'echo "$E31_ENGINE_STARTED_AT"'], capture_output=True, text=True, check=True, env={"PATH": "/usr/bin:/bin"}
    )
    started = engine.script_start(done.stdout.strip())
    assert before - timedelta(seconds=1) <= started <= timezone.now(), (done.stdout, before)
    assert engine.script_start("1796431837,329296") == engine.script_start("1796431837.329296")
    assert engine.script_start("1796431837.329296").microsecond == 329296
    for bad in (None, "", "soon", "-5", "1e40"):
        assert engine.script_start(bad) is None, bad


@pytest.mark.nodb
def test_the_agent_gets_the_settings_and_nothing_else_of_the_schedulers_environment():
    env = engine.agent_environment({"E31_VAR_DIR": "/v", "DATABASE_URL": "postgres://x", "PATH": "/bin", "SSH_AUTH_SOCK": "/tmp/a", "OLDPWD": "/"})
    assert env == {"E31_VAR_DIR": "/v", "DATABASE_URL": "postgres://x", "PATH": "/bin"}
    command = engine.agent_command("abc", python="/py", manage="/m.py")
    assert command == ("/py", "/m.py", "runner", "--allocation", "abc")


# Nodes -------------------------------------------------------------------------------------------


def test_the_engines_nodes_become_nodes_with_others_work_busy_and_a_drained_one_not_offered(db):
    fake = Engine(info("n1", devices=4, free=1), info("n2", devices=4, free=0, state=base.DRAINED, reason="maintenance"))
    engine.sync_nodes(fake)
    n1, n2 = Node.objects.order_by("name")
    assert (n1.executor, n1.device_type, n1.devices, n1.busy_elsewhere, n1.engine_state) == ("slurm", "cpu", 4, 3, "up")
    assert n1.free_devices() == (0,)
    assert (n2.engine_state, n2.engine_reason, n2.free_devices()) == ("drained", "maintenance", ())
    assert [n.devices for n in services.node_states()] == [4], "a drained node is not offered, nor counted in predictions"
    # A node the engine no longer reports (out of the partitions) is stopped; back, it returns.
    fake.infos = fake.infos[:1]
    engine.sync_nodes(fake)
    assert Node.objects.get(name="n2").stopped_at is not None
    assert [n.name for n in Node.objects.live()] == ["n1"]


def test_a_runners_node_of_the_same_name_is_left_alone(db):
    Node.objects.create(name="n1", device_type="cpu", devices=2)
    engine.sync_nodes(Engine(info("n1", devices=8, free=8)))
    node = Node.objects.get(name="n1")
    assert (node.executor, node.devices) == ("", 2)


def test_a_job_waits_for_cpus_others_hold_and_says_so(alice, rate):
    engine.sync_nodes(Engine(info("n1", devices=2, free=0)))
    job = make_job(alice, name="waits", gpus=2)
    assert services.schedule() == []
    job.refresh_from_db()
    assert job.state == "queued"
    assert "2 held by other users' jobs on the cluster" in job.wait_reason


# Allocations -------------------------------------------------------------------------------------


@pytest.fixture
def placed(alice, rate, settings, tmp_path):
    """A job placed on the engine's node (no staging needed there), submitted to the engine."""
    settings.E31_ENGINE_WORK_DIR = tmp_path / "engine"
    fake = Engine(info("n1", devices=4, free=4))
    engine.sync_nodes(fake)
    job = make_job(alice, name="on-slurm", gpus=2)
    [allocation] = services.schedule()
    [handle] = engine.launch_new(fake)
    allocation.refresh_from_db()
    return fake, job, allocation, handle


def test_a_placed_allocation_is_submitted_pinned_to_its_node_running_our_agent(placed):
    fake, _job, allocation, handle = placed
    request = fake.requests[handle]
    assert allocation.engine_handle == handle
    assert request.nodes == ("n1",) and request.cpus_per_node == 2 and request.gpus_per_node == 0
    assert request.command[-3:] == ("runner", "--allocation", str(allocation.pk))
    assert request.time_limit_seconds == allocation.limit_seconds
    assert engine.launch_new(fake) == [], "submitted once"


def test_the_meter_starts_when_the_engine_starts_it(placed):
    fake, _job, allocation, handle = placed
    started = allocation.started_at + timedelta(seconds=7)
    fake.statuses[handle] = base.AllocationStatus(state=base.RUNNING, started_at=started, engine_state="RUNNING")
    engine.follow(fake, now=started + timedelta(seconds=1))
    allocation.refresh_from_db()
    assert allocation.started_at == started == allocation.launched_at
    assert allocation.usage.held_seconds == 0 and allocation.usage.started_at == started
    # Counted as E31's own from then on, not as another user's.
    engine.sync_nodes(Engine(info("n1", devices=4, free=2)))
    assert Node.objects.get(name="n1").busy_elsewhere == 0


def test_the_agents_instant_refines_the_start_the_scheduler_read_in_whole_seconds(placed):
    fake, _job, allocation, handle = placed
    second = (allocation.started_at + timedelta(seconds=5)).replace(microsecond=0)
    fake.statuses[handle] = base.AllocationStatus(state=base.RUNNING, started_at=second, engine_state="RUNNING")
    engine.follow(fake, now=second + timedelta(seconds=1))
    allocation.refresh_from_db()
    assert allocation.started_at == second
    # The agent's batch script started 0.4 s into that second: billed from then, not before.
    engine.held(allocation, second + timedelta(seconds=0.4), precise=True)
    allocation.refresh_from_db()
    assert allocation.started_at == allocation.launched_at == second + timedelta(seconds=0.4)
    assert allocation.usage.started_at == second + timedelta(seconds=0.4)
    # A second word of the engine's, or an instant outside the second, changes nothing.
    engine.held(allocation, second + timedelta(seconds=3))
    engine.held(allocation, second + timedelta(seconds=2.5), precise=True)
    allocation.refresh_from_db()
    assert allocation.started_at == second + timedelta(seconds=0.4)


def test_a_job_the_engine_leaves_pending_goes_back_unbilled_with_the_engines_reason(placed, settings):
    fake, job, allocation, handle = placed
    settings.E31_ENGINE_PENDING_SECONDS = 30
    engine.follow(fake, now=allocation.started_at + timedelta(seconds=10))
    assert Allocation.objects.get(pk=allocation.pk).ended_at is None
    engine.follow(fake, now=allocation.started_at + timedelta(seconds=31))
    allocation.refresh_from_db()
    job.refresh_from_db()
    assert fake.stopped == [(handle, False)]
    assert allocation.ended_at == allocation.started_at and allocation.usage.held_seconds == 0
    assert job.state == "queued" and "did not start it on n1 within 30 s (Priority)" in job.timeline().last().data["reason"]


def test_a_job_cancelled_while_the_engine_has_not_started_it_ends_there_and_here_unbilled(placed):
    fake, job, allocation, handle = placed
    job.request_cancel()
    engine.follow(fake, now=allocation.started_at + timedelta(seconds=5))
    allocation.refresh_from_db()
    job.refresh_from_db()
    assert fake.stopped == [(handle, False)]
    assert (job.state, allocation.end_reason, allocation.usage.held_seconds) == ("cancelled", Allocation.CANCELLED, 0)


def test_a_cancelled_job_whose_agent_does_not_stop_it_is_cancelled_in_the_engine(placed, settings):
    fake, job, allocation, handle = placed
    settings.E31_ENGINE_GRACE_SECONDS = 10
    settings.E31_STOP_GRACE_SECONDS = 2
    Job.objects.filter(pk=job.pk).update(state="running")
    fake.statuses[handle] = base.AllocationStatus(state=base.RUNNING, started_at=allocation.started_at)
    engine.follow(fake)
    job.request_cancel()
    asked = Job.objects.get(pk=job.pk).cancel_requested_at
    engine.follow(fake, now=asked + timedelta(seconds=20))
    assert fake.stopped == [], "the agent has its grace to stop it"
    fake.statuses[handle] = base.AllocationStatus(state=base.RUNNING, started_at=allocation.started_at)
    engine.follow(fake, now=asked + timedelta(seconds=43))
    assert fake.stopped == [(handle, False)]
    # Slurm says it ended: the job is cancelled, not requeued.
    ended = asked + timedelta(seconds=45)
    fake.statuses[handle] = base.AllocationStatus(state=base.CANCELLED, started_at=allocation.started_at, ended_at=ended, engine_state="CANCELLED")
    engine.follow(fake, now=ended)
    job.refresh_from_db()
    assert job.state == "cancelled" and Allocation.objects.get(pk=allocation.pk).ended_at == ended


def test_a_job_slurm_ended_past_its_span_is_billed_to_its_span(placed):
    fake, job, allocation, handle = placed
    Job.objects.filter(pk=job.pk).update(state="running")
    fake.statuses[handle] = base.AllocationStatus(state=base.RUNNING, started_at=allocation.started_at)
    engine.follow(fake)
    allocation.refresh_from_db()
    ended = allocation.started_at + timedelta(seconds=allocation.limit_seconds + 90)
    fake.statuses[handle] = base.AllocationStatus(state=base.ENDED, started_at=allocation.started_at, ended_at=ended, engine_state="TIMEOUT")
    engine.follow(fake, now=ended)
    allocation.refresh_from_db()
    job.refresh_from_db()
    assert job.state == "stopped" and allocation.end_reason == Allocation.LIMIT
    assert allocation.usage.held_seconds == allocation.limit_seconds


def test_a_job_the_engine_lost_is_requeued_from_the_engines_end(placed):
    fake, job, allocation, handle = placed
    started = allocation.started_at
    Job.objects.filter(pk=job.pk).update(state="running")
    fake.statuses[handle] = base.AllocationStatus(state=base.RUNNING, started_at=started)
    engine.follow(fake)
    ended = started + timedelta(seconds=40)
    Checkpoint.objects.create(
        job=job, allocation=allocation, name="step-5.pt", step=5, key="k", size=1, sha256="0" * 64, written_at=started + timedelta(seconds=10)
    )
    fake.statuses[handle] = base.AllocationStatus(state=base.NODE_LOST, started_at=started, ended_at=ended, engine_state="NODE_FAIL")
    engine.follow(fake, now=ended + timedelta(seconds=5))
    allocation.refresh_from_db()
    job.refresh_from_db()
    assert (allocation.ended_at, allocation.end_reason, job.state) == (ended, Allocation.NODE_LOST, "queued")
    assert allocation.usage.held_seconds == 40
    assert job.credited()[0] == 30, "the time since its last checkpoint (at 10 s) is credited"
    assert job.restarts == 1
    # Once ended, the engine's accounting is kept beside the meter.
    engine.follow(fake, now=ended + timedelta(seconds=6))
    assert Allocation.objects.get(pk=allocation.pk).engine_seconds == 40


def test_an_engine_that_does_not_answer_ends_nothing_and_offers_nothing(placed, settings):
    # Slurm's controller restarting: its nodes go silent, but the jobs our agents run there go
    # on; the engine says itself when a node failed.
    allocation = placed[2]
    later = timezone.now() + timedelta(seconds=settings.E31_NODE_TIMEOUT_SECONDS + 60)
    assert allocations.expire_lost_nodes(now=later) == 0
    assert Allocation.objects.get(pk=allocation.pk).ended_at is None
    assert services.node_states(later) == [], "nothing new is placed on it meanwhile"


def test_a_refused_submission_releases_the_compute_unbilled(alice, rate, settings, tmp_path):
    settings.E31_ENGINE_WORK_DIR = tmp_path / "engine"

    class Refusing(Engine):
        def start(self, request):
            raise RuntimeError("sbatch: error: invalid account")

    fake = Refusing(info("n1", devices=4, free=4))
    engine.sync_nodes(fake)
    job = make_job(alice, name="refused", gpus=1)
    [allocation] = services.schedule()
    assert engine.launch_new(fake) == []
    allocation.refresh_from_db()
    job.refresh_from_db()
    assert allocation.ended_at == allocation.started_at and job.state == "queued"
    assert "invalid account" in job.timeline().last().data["reason"]


def test_a_node_the_engine_runs_is_not_staged_on_beforehand(alice, rate):
    engine.sync_nodes(Engine(info("n1", devices=4, free=4)))
    make_job(alice, name="no-staging", gpus=1)
    assert services.line_up() == []
    [queued] = services.queued_jobs()
    assert queued.staged_on == frozenset({str(Node.objects.get().pk)})


def test_lining_up_on_an_engines_nodes_alone_never_reads_the_queues_rows(alice, rate):
    """Nothing is staged beforehand on an engine's nodes: however long the queue, lining up
    asks only whether anything waits, and reads no job row, every cycle."""
    import re

    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    engine.sync_nodes(Engine(info("n1", devices=4, free=4)))
    for n in range(3):
        make_job(alice, name=f"waits-{n}", gpus=1)
    with CaptureQueriesContext(connection) as queries:
        assert services.line_up() == []
    assert not [q["sql"] for q in queries if re.match(r'SELECT (?:DISTINCT )?"jobs_job"\.', q["sql"])]


def test_where_the_engine_keeps_accounting_the_meter_is_reconciled_with_its_record(placed):
    fake, job, allocation, handle = placed
    started = allocation.started_at + timedelta(seconds=2)
    Job.objects.filter(pk=job.pk).update(state="running")
    fake.statuses[handle] = base.AllocationStatus(state=base.RUNNING, started_at=started)
    engine.follow(fake, now=started)
    allocation.refresh_from_db()
    # Our agent ended it after 30 s; the controller says the job ended a moment later.
    allocations.end_allocation(allocation, started + timedelta(seconds=30), Allocation.EXITED, "succeeded")
    fake.statuses[handle] = base.AllocationStatus(state=base.ENDED, exit_code=0, started_at=started, ended_at=started + timedelta(seconds=31))
    # sacct lags the controller: its record has no end yet, so nothing is reconciled this cycle.
    fake.records[handle] = base.AllocationStatus(state=base.PENDING, started_at=started)
    engine.follow(fake, now=started + timedelta(seconds=32))
    assert Allocation.objects.get(pk=allocation.pk).engine_seconds is None
    # Then accounting's record, which is what the operator reads (here 2 s apart from the meter).
    fake.records[handle] = base.AllocationStatus(state=base.ENDED, exit_code=0, started_at=started, ended_at=started + timedelta(seconds=32))
    engine.follow(fake, now=started + timedelta(seconds=40))
    allocation.refresh_from_db()
    assert allocation.engine_seconds == 32, "accounting's record, not the controller's 31 s"
    assert allocation.usage.held_seconds == 30
