"""The digits job through a real single-node Slurm (tests/slurm_cluster.py), end to end: the
scheduler with E31_EXECUTOR=slurm reads the node from Slurm, places the job there, submits it
with sbatch running our agent for the allocation; the job runs with a live log and meter, its
weights come back, and the billed seconds are Slurm's elapsed time. Another user's Slurm job
holding the node's CPUs delays it, and shows as the reason it waits, and is never touched."""

import os
import signal
import subprocess
import time
from datetime import datetime, timedelta

import pytest

from scheduler import engine
from tests.slurm_cluster import _which, slurm, slurm_accounting, slurm_pair  # noqa: F401 - the fixtures
from tests.system import LiveSystem
from tests.test_e2e import EXAMPLE, heldout_accuracy

pytestmark = pytest.mark.slurm_engine  # with bench: run in bin/test's PostgreSQL lane, after its pass


def slurm_elapsed(cluster, handle):
    """(start, end) of a Slurm job as scontrol prints them, in seconds since the epoch."""
    from scheduler.executors.slurm import parse_job, parse_records

    done = subprocess.run(["scontrol", "show", "job", "-o", handle], env={**cluster.env, "TZ": "UTC"}, capture_output=True, text=True, check=True)
    status = parse_job(parse_records(done.stdout)[0])
    return status


@pytest.mark.bench  # a real Slurm and a whole system: once, in bin/test's lane
@pytest.mark.e2e
@pytest.mark.timeout(400)
def test_the_digits_job_runs_through_slurm_and_bills_slurms_elapsed_time(slurm):  # noqa: F811
    env = {
        "E31_EXECUTOR": "slurm",
        "E31_SLURM_CONF": str(slurm.conf),
        "E31_SLURM_PARTITIONS": slurm.partition,
        "E31_ENGINE_SECONDS": "0.5",
        "E31_ENGINE_MEMORY_MB_PER_DEVICE": "512",
    }
    system = LiveSystem(env=env)
    other = None
    try:
        system.start(runner=False)
        # Another user's job holds every CPU of the node first.
        other = slurm.run("sbatch", "--parsable", f"--cpus-per-task={slurm.cpus}", "--mem=64M", "--chdir=/tmp", "--wrap", "sleep 20").stdout.strip()
        system.wait_until(lambda: slurm.run("squeue", "--noheader", "--jobs", other, "--format=%T").stdout.strip() == "RUNNING", 30, "the other job to run")
        time.sleep(2)  # the scheduler reads the node again (every 0.5 s here)
        job = system.submit({"name": "digits-slurm", "train_dataset": "digits", "gpus": 1, "span_hours": 0.25, "config": {"epochs": 5}}, EXAMPLE)
        waiting = system.wait_until(
            lambda: "held by other users' jobs on the cluster" in (system.job(job["id"]).get("wait_reason") or "") and system.job(job["id"]),
            60,
            "the job to wait for the other user's CPUs",
        )
        assert waiting["state"] == "queued" and waiting["held_seconds"] == 0, "queued with the meter stopped"
        assert slurm.run("squeue", "--noheader", "--jobs", other, "--format=%T").stdout.strip() == "RUNNING"

        # Once theirs ends, ours runs through Slurm: a live meter, then succeeded with its weights.
        running = system.wait_until(lambda: (j := system.job(job["id"]))["state"] in ("running", "succeeded", "failed") and j, 120, "the job to start")
        assert running["state"] != "failed", system.logs()
        if running["state"] == "running":  # its meter runs while it does (a quick machine may have finished already)
            live = system.wait_until(lambda: (j := system.job(job["id"]))["held_seconds"] > 0 and j, 60, "the meter to run")
            assert live["state"] in ("running", "succeeded")
        done = system.wait_for_state(job["id"], timeout=240)
        assert done["state"] == "succeeded", (done, system.logs())
        [allocation] = done["allocations"]
        assert allocation["node"] == slurm.node
        weights = system.api("GET", f"/api/jobs/{job['id']}/artifacts/model.pt", follow_redirects=True)
        assert weights.status_code == 200, weights.text
        assert heldout_accuracy(weights.content) > 0.8
        assert any("epoch" in line for line in system.log_lines(job["id"]))

        # Billed: what Slurm held. Slurm counts whole seconds, so that is within a second of its
        # elapsed time either way; the meter runs from the batch script's first instant, inside
        # Slurm's start second (or from that second, where a loaded node launched the script
        # later), to the job's end, a moment before our agent exits.
        handles = system.manage(
            "shell", "-v", "0", "-c", f"from scheduler.models import Allocation; print(Allocation.objects.get(job_id='{job['id']}').engine_handle)"
        ).split()
        status = slurm_elapsed(slurm, handles[-1])
        assert status.engine_state == "COMPLETED"
        elapsed = (status.ended_at - status.started_at).total_seconds()
        assert engine.disagreement(done["held_seconds"], elapsed) is None, (done["held_seconds"], elapsed)
        started = datetime.fromisoformat(allocation["started_at"].replace("Z", "+00:00"))
        assert status.started_at <= started < status.started_at + timedelta(seconds=1), (started, status.started_at)
        # What the agent leaves: Slurm's files (its output, for the operator), the submitting
        # user's alone; nothing of the job's run. The job's data stays in the node's cache, the
        # same user's alone, for the next job there. Beside them, the note that a sandbox started
        # on this node (the next agent's start skips trying one), the same user's alone.
        folders = {p.name: p for p in (system.var_dir / "engine").iterdir() if p.is_dir()}
        nodes = folders.pop("nodes")
        cache = nodes / slurm.node / "cache"
        for private in (nodes, nodes / slurm.node, cache):  # the cache, its environments and their locks
            assert private.stat().st_uid == os.getuid() and private.stat().st_mode & 0o777 == 0o700, private
        assert any(cache.glob("??/*")), "the job's files, staged once for this node"
        [folder] = folders.values()
        noted = system.var_dir / "engine" / f".sandbox-started-{slurm.node}"
        assert noted.stat().st_uid == os.getuid() and noted.stat().st_mode & 0o777 == 0o600
        assert sorted(p.name for p in folder.iterdir()) == ["slurm"]
        assert (folder / "slurm").stat().st_mode & 0o777 == 0o700
        assert "agent: allocation" in (folder / "slurm" / f"slurm-{handles[-1]}.out").read_text()
        # The other user's job ran to its end, untouched.
        finished = slurm.run("scontrol", "show", "job", "-o", other).stdout
        assert "JobState=COMPLETED" in finished, finished
    finally:
        if other:
            slurm.run("scancel", other, check=False)
        system.stop()
        deadline = time.monotonic() + 30
        while slurm.squeue_ids() and time.monotonic() < deadline:
            time.sleep(0.5)


def slurm_system(slurm, **extra):  # noqa: F811
    env = {
        "E31_EXECUTOR": "slurm",
        "E31_SLURM_CONF": str(slurm.conf),
        "E31_SLURM_PARTITIONS": slurm.partition,
        "E31_ENGINE_SECONDS": "0.5",
        "E31_ENGINE_MEMORY_MB_PER_DEVICE": "512",
        **extra,
    }
    return LiveSystem(env=env)


def submit_steps(system, tmp_path, steps, pause, **extra):
    """The checkpointing regression of tests/test_gangs.py on one process: a step every pause
    seconds, a checkpoint every 5 steps."""
    from tests.test_gangs import DDP_SCRIPT

    script = tmp_path / "train.py"
    script.write_bytes(DDP_SCRIPT)
    config = {"steps": steps, "sleep": pause, **extra.pop("config", {})}
    spec = {"name": "steps", "gpus": 1, "span_hours": 1, "config": config, "max_restarts": 3, "train_dataset": "digits", **extra}
    return system.submit(spec, script)["id"]


def wait_for_checkpoint(system, job_id):
    system.wait_until(lambda: [e for e in system.job(job_id)["timeline"] if e["kind"] == "checkpoint"], 120, "a checkpoint")


def e31_jobs_in_slurm(slurm):
    return [line for line in slurm.run("squeue", "--noheader", "--format=%j %T").stdout.splitlines() if line.startswith("e31-")]


@pytest.mark.bench
@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_cancelled_job_stops_gracefully_inside_slurm_and_its_slurm_job_ends(slurm, tmp_path):  # noqa: F811
    system = slurm_system(slurm)
    try:
        system.start(runner=False)
        job_id = submit_steps(system, tmp_path, steps=2000, pause=0.1)
        wait_for_checkpoint(system, job_id)
        assert system.api("POST", f"/api/jobs/{job_id}/cancel/").status_code in (200, 202)
        job = system.wait_for_state(job_id, timeout=60)
        assert job["state"] == "cancelled", (job, system.logs())
        system.wait_until(lambda: not e31_jobs_in_slurm(slurm), 30, "its Slurm job to end")
        assert job["held_seconds"] > 0
    finally:
        system.stop()


def stagings_and_builds(system, job_id):
    """(stagings of the job's files, builds of its environment) on the nodes so far."""
    code = (
        "from scheduler.models import Staging; from jobs.models import JobEvent; "
        f"texts = [(d or {{}}).get('text', '') for d in JobEvent.objects.filter(job_id='{job_id}', kind='notice').values_list('data', flat=True)]; "
        f"print(Staging.objects.filter(job_id='{job_id}').count(), sum(t.startswith('building on') for t in texts))"
    )
    return tuple(int(n) for n in system.manage("shell", "-v", "0", "-c", code).split())


@pytest.mark.bench
@pytest.mark.e2e
@pytest.mark.timeout(420)
def test_a_job_whose_slurm_node_fails_resumes_from_its_checkpoint_when_the_node_returns(slurm, tmp_path):  # noqa: F811
    from tests.test_environments import make_wheel

    wheels = tmp_path / "wheels"
    wheels.mkdir()
    make_wheel(wheels, "e31demo", "1.0", "VALUE = 42\n")
    system = slurm_system(slurm, E31_ENV_FIND_LINKS=str(wheels), E31_ENV_NO_INDEX="1")
    try:
        system.start(runner=False)
        # A step a second until the node is lost (Slurm takes SlurmdTimeout to give it up), and
        # the rest quickly once resumed.
        job_id = submit_steps(system, tmp_path, steps=60, pause=1.0, packages=["e31demo==1.0"], config={"resumed_sleep": 0.05})
        wait_for_checkpoint(system, job_id)
        slurm.stop_slurmd()  # the node's daemon dies: Slurm gives the node up after SlurmdTimeout
        requeued = system.wait_until(lambda: (j := system.job(job_id))["restarts"] == 1 and j, 90, "the job to be requeued")
        assert requeued["state"] == "queued", requeued
        requeue = [e for e in requeued["timeline"] if e["kind"] == "state" and e["state"] == "queued"][-1]
        assert "its node was lost (Slurm: NODE_FAIL" in requeue["reason"], requeue
        # The time from its last checkpoint to Slurm's end is credited: nothing where the job
        # (its node only cut off from Slurm) checkpointed again after Slurm's end.
        assert requeued["credited_seconds"] >= 0
        assert stagings_and_builds(system, job_id) == (1, 1), "the first allocation staged the job's files and built its environment"
        time.sleep(3)
        assert system.job(job_id)["state"] == "queued", "the node is down: nothing is placed there"
        slurm.start_slurmd()
        slurm.wait_for_state("idle", "mixed", timeout=60)
        job = system.wait_for_state(job_id, timeout=240)
        assert job["state"] == "succeeded", (job, system.logs())
        resumes = [e for e in job["timeline"] if e["kind"] == "resume"]
        assert resumes and resumes[0]["step"] >= 5
        assert len(job["allocations"]) == 1 and job["restarts"] == 1
        assert stagings_and_builds(system, job_id) == (1, 1), "the second found both on the node: nothing staged or built again"
    finally:
        if "slurmd" not in slurm.processes:
            slurm.start_slurmd()
            slurm.wait_for_state("idle", "mixed", timeout=60)
        system.stop()


@pytest.mark.bench
@pytest.mark.e2e
@pytest.mark.timeout(400)
def test_a_gang_runs_as_one_slurm_job_over_two_nodes_with_an_agent_on_each(slurm_pair, tmp_path):  # noqa: F811
    from tests.test_gangs import CONFIG, DDP_SCRIPT, ReferenceRun, assert_close, job_weights, log_ranks

    system = slurm_system(slurm_pair)
    reference = ReferenceRun(tmp_path / "ref", CONFIG)
    try:
        system.start(runner=False)
        script = tmp_path / "train.py"
        script.write_bytes(DDP_SCRIPT)
        spec = {"name": "ddp-slurm", "gpus": 2, "span_hours": 1, "config": CONFIG, "max_restarts": 1, "train_dataset": "digits"}
        job_id = system.submit(spec, script)["id"]
        job = system.wait_for_state(job_id, timeout=300)
        assert job["state"] == "succeeded", (job, system.logs())
        assert sorted(a["node"] for a in job["allocations"]) == slurm_pair.names
        assert [a["node_rank"] for a in job["allocations"]] == [0, 1]
        assert log_ranks(system, job_id) == {0, 1}
        # Slurm holds both nodes until its job ends: so does the meter, node 1's part until node 0's
        # (its agent sees node 0's end within a poll, after the job succeeded).
        job = system.wait_until(lambda: (j := system.job(job_id)) and all(a["ended_at"] for a in j["allocations"]) and j, 30, "both parts to end")
        zero, one = (datetime.fromisoformat(a["ended_at"].replace("Z", "+00:00")) for a in job["allocations"])
        assert one >= zero, job["allocations"]
        assert_close(job_weights(system, job_id), reference.weights())
        # One Slurm job over both nodes, not two.
        handles = system.manage(
            "shell",
            "-v",
            "0",
            "-c",
            f"from scheduler.models import Allocation; print(*Allocation.objects.filter(job_id='{job_id}').values_list('engine_handle', flat=True))",
        ).split()
        assert len(handles) == 2 and len(set(handles)) == 1
        assert "NumNodes=2" in slurm_pair.run("scontrol", "show", "job", "-o", handles[0]).stdout
    finally:
        reference.close()
        system.stop()


def agent_pid(allocation_id):
    """The process of our agent for the allocation (not the batch shell whose arguments name it),
    and no other system's: another Slurm test or benchmark may run beside this one (bin/test's
    lanes), and this one freezes what it finds."""
    found = subprocess.run(["pgrep", "-f", f"runner --allocation {allocation_id}"], capture_output=True, text=True).stdout.split()
    for pid in found:
        try:
            if open(f"/proc/{pid}/comm").read().startswith("python"):
                return int(pid)
        except OSError:
            continue
    return None


@pytest.mark.bench
@pytest.mark.e2e
@pytest.mark.timeout(400)
def test_slurms_time_limit_ends_a_job_whose_agent_cannot_enforce_its_span(slurm, tmp_path):  # noqa: F811
    # The agent stops a job at its span itself; Slurm's --time (the span plus the grace, in whole
    # minutes) is the backstop when the agent cannot (here: frozen with SIGSTOP).
    system = slurm_system(slurm, E31_STOP_GRACE_SECONDS="1", E31_ENGINE_GRACE_SECONDS="0")
    # A span of 30 s: --time is a minute (span and grace in whole minutes), TERM at 30 s.
    agent = None
    try:
        system.start(runner=False)
        from tests.test_gangs import DDP_SCRIPT

        script = tmp_path / "train.py"
        script.write_bytes(DDP_SCRIPT)
        spec = {"name": "frozen", "gpus": 1, "span_hours": round(30 / 3600, 4), "config": {"steps": 100000, "sleep": 0.5}, "train_dataset": "digits"}
        job_id = system.submit(spec, script)["id"]
        system.wait_until(lambda: system.job(job_id)["state"] == "running", 120, "the job to run")
        # Its latest allocation: where an earlier one already ended (the flake below), the test
        # goes on to the assertion that shows the agents' output and the scheduler's log.
        allocation_id = system.manage(
            "shell", "-v", "0", "-c", f"from scheduler.models import Allocation; print(Allocation.objects.filter(job_id='{job_id}').latest('started_at').pk)"
        ).strip()
        agent = system.wait_until(lambda: agent_pid(allocation_id), 30, "the agent")
        os.kill(agent, signal.SIGSTOP)
        job = system.wait_for_state(job_id, timeout=240)
        assert job["state"] == "stopped", (job, system.logs())
        [allocation] = job["allocations"]
        assert allocation["end_reason"] == "limit"
        # Slurm ended it at its limit: it sends CONT and TERM (then KILL), and the agent, woken,
        # stops the job as its span's end, not as a runner going away (which would requeue it).
        # The team pays for its span, not for the minute the agent was frozen.
        rows = system.manage(
            "shell",
            "-v",
            "0",
            "-c",
            f"from scheduler.models import Allocation; [print(a.engine_handle, a.end_reason, a.started_at, a.ended_at) for a in Allocation.objects.filter(job_id='{job_id}').order_by('started_at')]",
        ).splitlines()
        # Once in a while under CI's load the first allocation ended a few seconds in (its
        # agent gone) and the job ran again: what the agents and the scheduler said, to see why.
        agents = {p.name: p.read_text(errors="replace")[-3000:] for p in (system.var_dir / "engine").glob("*/slurm/slurm-*.out")}
        assert len(rows) == 1, (rows, job["timeline"], agents, system.logs().get("scheduler"))
        handle = rows[0].split()[0]
        # The agent, woken, may end the job a moment before Slurm has ended its own.
        ended = system.wait_until(
            lambda: (
                (out := slurm.run("scontrol", "show", "job", "-o", handle).stdout)
                and "JobState=RUNNING" not in out
                and "JobState=COMPLETING" not in out
                and out
            ),
            60,
            "Slurm to end its job",
        )
        assert "JobState=TIMEOUT" in ended, ended
        assert job["held_seconds"] <= 30, "billed up to its span, not beyond (Slurm held it to a minute)"
        assert job["restarts"] == 0
    finally:
        if agent is not None:
            try:
                os.kill(agent, signal.SIGCONT)
            except ProcessLookupError:
                pass
        system.stop()


def sacct_record(cluster, handle):
    """(state, start, end, elapsed seconds) of a job as Slurm's accounting (sacct) has it."""
    done = cluster.run("sacct", "--noheader", "--parsable2", "--allocations", f"--jobs={handle}", "--format=State,Start,End,Elapsed")
    state, start, end, elapsed = done.stdout.strip().split("|")
    days, _, clock = elapsed.rpartition("-")  # [days-]hours:minutes:seconds
    hours, minutes, seconds = (int(part) for part in clock.split(":"))
    return state, start, end, int(days or 0) * 86400 + hours * 3600 + minutes * 60 + seconds


@pytest.mark.bench
@pytest.mark.e2e
@pytest.mark.timeout(400)
def test_with_slurms_accounting_on_the_meter_is_reconciled_with_sacct(slurm_accounting, tmp_path):  # noqa: F811
    from scheduler.executors.slurm import SlurmExecutor

    system = slurm_system(slurm_accounting)
    try:
        system.start(runner=False)
        job_id = submit_steps(system, tmp_path, steps=6, pause=0.3)
        job = system.wait_for_state(job_id, timeout=240)
        assert job["state"] == "succeeded", (job, system.logs())
        # Once Slurm has ended the job and sacct has its record, the scheduler keeps sacct's
        # elapsed time beside the meter, and they agree within Slurm's whole seconds.
        query = f"from scheduler.models import Allocation; a = Allocation.objects.get(job_id='{job_id}'); print(a.engine_handle, a.engine_seconds)"
        handle, kept = system.wait_until(
            lambda: (row := system.manage("shell", "-v", "0", "-c", query).split())[1] != "None" and row, 60, "sacct's elapsed time kept"
        )
        state, _start, _end, elapsed = sacct_record(slurm_accounting, handle)
        assert state == "COMPLETED"
        assert float(kept) == elapsed > 0
        assert engine.disagreement(job["held_seconds"], elapsed) is None, (job["held_seconds"], elapsed)
    finally:
        system.stop()
    # The controller forgets its jobs (restarted with its state cleared): sacct still answers,
    # and the executor reads it from there.
    executor = SlurmExecutor(conf=str(slurm_accounting.conf), partitions=[slurm_accounting.partition])
    remembered = executor.status([handle])[handle]
    slurm_accounting.processes.pop("slurmctld").terminate()
    slurm_accounting.processes["slurmctld"] = slurm_accounting._daemon("slurmctld-clean", [_which("slurmctld"), "-D", "-i", "-c"])
    slurm_accounting.wait_for_state("idle", timeout=60)
    assert slurm_accounting.run("scontrol", "show", "job", handle, check=False).returncode != 0, "forgotten by the controller"
    recorded = executor.status([handle])[handle]
    assert (recorded.state, recorded.exit_code, recorded.started_at, recorded.ended_at) == (
        remembered.state,
        remembered.exit_code,
        remembered.started_at,
        remembered.ended_at,
    )
    assert executor.accounted([handle])[handle].ended_at == remembered.ended_at
