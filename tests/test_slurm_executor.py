"""The Slurm executor (issue 26): what it reads from Slurm's tools, what it submits, and the same
against a real single-node Slurm (tests/slurm_cluster.py) started for the session."""

import subprocess
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest

from scheduler.executors.base import CANCELLED, DOWN, DRAINED, ENDED, FAILED, NODE_LOST, PENDING, RUNNING, UNKNOWN, UP, AllocationRequest
from scheduler.executors.slurm import (
    BATCH_SCRIPT,
    SlurmError,
    SlurmExecutor,
    export_text,
    gpu_count,
    node_state,
    parse_job,
    parse_nodes,
    parse_record,
    parse_sacct,
    parse_squeue,
    sbatch_args,
    slurm_duration,
    time_limit,
)
from tests.slurm_cluster import slurm  # noqa: F401 - the session's cluster

# -- samples of what Slurm 22.05 prints --------------------------------------------------------------

CPU_NODE = (
    "NodeName=vm Arch=x86_64 CoresPerSocket=1  CPUAlloc=0 CPUEfctv=2 CPUTot=2 CPULoad=2.29 AvailableFeatures=(null) ActiveFeatures=(null) "
    "Gres=(null) NodeAddr=127.0.0.1 NodeHostName=vm Version=22.05.8 OS=Linux 6.18.44-fc-v1252 #1 SMP PREEMPT_DYNAMIC @0  RealMemory=21695 "
    "AllocMem=0 FreeMem=21138 Sockets=2 Boards=1 State=IDLE ThreadsPerCore=1 TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A Partitions=e31test  "
    "BootTime=2026-12-04T18:37:22 SlurmdStartTime=2026-12-04T19:17:27 LastBusyTime=2026-12-04T19:17:27 CfgTRES=cpu=2,mem=21695M,billing=2 "
    "AllocTRES= CapWatts=n/a CurrentWatts=0 AveWatts=0 ExtSensorsJoules=n/s ExtSensorsWatts=0 ExtSensorsTemp=n/s"
)
GPU_NODE_MIXED = (
    "NodeName=gpu07 Arch=x86_64 CoresPerSocket=32 CPUAlloc=16 CPUEfctv=64 CPUTot=64 CPULoad=12.01 AvailableFeatures=a100 ActiveFeatures=a100 "
    "Gres=gpu:a100:4(S:0-1) NodeAddr=gpu07 NodeHostName=gpu07 Version=22.05.8 OS=Linux 5.15.0-91-generic #101-Ubuntu SMP "
    "RealMemory=515000 AllocMem=131072 FreeMem=300112 Sockets=2 Boards=1 State=MIXED ThreadsPerCore=1 TmpDisk=0 Weight=1 Owner=N/A "
    "MCS_label=N/A Partitions=gpu,long BootTime=2026-11-30T08:00:00 SlurmdStartTime=2026-11-30T08:01:00 LastBusyTime=2026-12-04T10:00:00 "
    "CfgTRES=cpu=64,mem=515000M,billing=64,gres/gpu=4 AllocTRES=cpu=16,mem=128G,gres/gpu=3 CapWatts=n/a CurrentWatts=0 AveWatts=0 "
    "ExtSensorsJoules=n/s ExtSensorsWatts=0 ExtSensorsTemp=n/s"
)
DRAINED_NODE = (
    "NodeName=gpu08 Arch=x86_64 CoresPerSocket=32 CPUAlloc=0 CPUEfctv=64 CPUTot=64 CPULoad=0.01 AvailableFeatures=(null) ActiveFeatures=(null) "
    "Gres=gpu:8 NodeAddr=gpu08 NodeHostName=gpu08 Version=22.05.8 OS=Linux 5.15.0 #1 SMP RealMemory=1000000 AllocMem=0 FreeMem=990000 "
    "Sockets=2 Boards=1 State=IDLE+DRAIN ThreadsPerCore=1 TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A Partitions=gpu BootTime=None "
    "SlurmdStartTime=None LastBusyTime=2026-12-04T09:00:00 CfgTRES=cpu=64,mem=1000000M,billing=64,gres/gpu=8 AllocTRES= CapWatts=n/a "
    "CurrentWatts=0 AveWatts=0 ExtSensorsJoules=n/s ExtSensorsWatts=0 ExtSensorsTemp=n/s "
    "Reason=GPU 3 fell off the bus, RMA [root@2026-12-04T09:12:44]"
)
DOWN_NODE = (
    CPU_NODE.replace("NodeName=vm", "NodeName=cpu02").replace("State=IDLE", "State=DOWN+NOT_RESPONDING") + " Reason=Not responding [slurm@2026-12-04T11:00:00]"
)
DRAINING_NODE = (
    GPU_NODE_MIXED.replace("NodeName=gpu07", "NodeName=gpu09").replace("State=MIXED", "State=MIXED+DRAIN") + " Reason=kernel update [ops@2026-12-04T12:00:00]"
)

JOB = (
    "JobId=41 JobName=e31-7 UserId=e31(990) GroupId=e31(990) MCS_label=N/A Priority=4294901759 Nice=0 Account=team_a QOS=normal "
    "JobState={state} Reason={reason} Dependency=(null) Requeue=0 Restarts=0 BatchFlag=1 Reboot=0 ExitCode={exit_code} RunTime=00:00:31 "
    "TimeLimit=00:02:00 TimeMin=N/A SubmitTime=2026-12-04T19:19:50 EligibleTime=2026-12-04T19:19:50 AccrueTime=2026-12-04T19:19:50 "
    "StartTime={start} EndTime={end} Deadline=N/A SuspendTime=None SecsPreSuspend=0 LastSchedEval=2026-12-04T19:19:52 Scheduler=Main "
    "Partition=gpu AllocNode:Sid=web1:24008 ReqNodeList=gpu07 ExcNodeList=(null) NodeList=gpu07 BatchHost=gpu07 NumNodes=1 NumCPUs=1 "
    "NumTasks=1 CPUs/Task=1 ReqB:S:C:T=0:0:*:* TRES=cpu=1,mem=100M,node=1,billing=1,gres/gpu=2 Socks/Node=* NtasksPerN:B:S:C=1:0:*:* "
    "CoreSpec=* MinCPUsNode=1 MinMemoryNode=100M MinTmpDiskNode=0 Features=(null) DelayBoot=00:00:00 OverSubscribe=OK Contiguous=0 "
    "Licenses=(null) Network=(null) Command=/srv/e31/runs/7/e31-slurm-batch.sh python -m agent x WorkDir=/srv/e31/runs/7 "
    "Comment=e31 job=5 allocation=7  StdErr=/srv/e31/runs/7/slurm-41.err StdIn=/dev/null StdOut=/srv/e31/runs/7/slurm-41.out Power= TresPerNode=gres:gpu:2"
)


def job_line(state, reason="None", exit_code="0:0", start="2026-12-04T19:19:52", end="2026-12-04T19:20:23"):
    return JOB.format(state=state, reason=reason, exit_code=exit_code, start=start, end=end)


def request(**fields):
    defaults = {
        "allocation_id": 7,
        "job_id": 5,
        "nodes": ("gpu07",),
        "command": ("python", "-m", "agent", "run-allocation", "7"),
        "workdir": "/srv/e31/runs/7",
        "time_limit_seconds": 3600,
        "grace_seconds": 60,
        "gpus_per_node": 2,
        "cpus_per_node": 8,
        "memory_mb": 64000,
    }
    return AllocationRequest(**{**defaults, **fields})


# -- nodes ------------------------------------------------------------------------------------------


@pytest.mark.nodb
def test_it_reads_a_cpu_node():
    [node] = parse_nodes(CPU_NODE)
    assert (node.name, node.device_type, node.devices, node.free, node.memory_mb, node.free_memory_mb) == ("vm", "cpu", 2, 2, 21695, 21695)
    assert (node.state, node.reason, node.partitions) == (UP, "", ("e31test",))


@pytest.mark.nodb
def test_it_keeps_values_with_spaces_in_one_field():
    fields = parse_record(CPU_NODE)
    assert fields["OS"] == "Linux 6.18.44-fc-v1252 #1 SMP PREEMPT_DYNAMIC @0"
    assert parse_record(job_line("RUNNING"))["Comment"] == "e31 job=5 allocation=7"


@pytest.mark.nodb
def test_a_gpu_node_counts_its_gres_gpus_and_those_other_jobs_hold():
    [node] = parse_nodes(GPU_NODE_MIXED)
    assert (node.device_type, node.devices, node.free, node.gpu_type) == ("gpu", 4, 1, "a100")
    assert (node.memory_mb, node.free_memory_mb, node.state, node.partitions) == (515000, 515000 - 131072, UP, ("gpu", "long"))


@pytest.mark.nodb
def test_gres_used_counts_where_scontrol_prints_it():
    [node] = parse_nodes(GPU_NODE_MIXED.replace("AllocTRES=cpu=16,mem=128G,gres/gpu=3", "AllocTRES=cpu=16 GresUsed=gpu:a100:2(IDX:0,2)"))
    assert node.free == 2


@pytest.mark.nodb
def test_a_drained_node_has_nothing_free_and_says_why():
    [node] = parse_nodes(DRAINED_NODE)
    assert (node.state, node.devices, node.free, node.free_memory_mb) == (DRAINED, 8, 0, 0)
    assert node.reason == "GPU 3 fell off the bus, RMA [root@2026-12-04T09:12:44]"


@pytest.mark.nodb
def test_a_draining_node_and_a_down_node_are_not_offered():
    draining, down = parse_nodes(DRAINING_NODE + "\n" + DOWN_NODE)
    assert (draining.state, draining.free, draining.reason) == (DRAINED, 0, "kernel update [ops@2026-12-04T12:00:00]")
    assert (down.state, down.free, down.reason) == (DOWN, 0, "Not responding [slurm@2026-12-04T11:00:00]")


@pytest.mark.nodb
@pytest.mark.parametrize(
    "state, ours",
    [
        ("IDLE", UP),
        ("MIXED", UP),
        ("ALLOCATED", UP),
        ("COMPLETING", UP),
        ("IDLE+DRAIN", DRAINED),
        ("ALLOCATED+DRAIN", DRAINED),
        ("DRAINED", DRAINED),
        ("IDLE+MAINT+RESERVED", DRAINED),
        ("DOWN", DOWN),
        ("DOWN+DRAIN", DOWN),
        ("IDLE+NOT_RESPONDING", DOWN),
        ("DOWN+NOT_RESPONDING", DOWN),
        ("IDLE+POWERED_DOWN", DOWN),
        ("UNKNOWN", DOWN),
        ("down*", DOWN),  # sinfo's short form: not responding
        ("idle~", DOWN),  # sinfo: powered down
        ("drain", DRAINED),
        ("idle", UP),
    ],
)
def test_node_states(state, ours):
    assert node_state(state) == ours


@pytest.mark.nodb
def test_nodes_keep_to_the_operators_partitions():
    text = "\n".join([CPU_NODE, GPU_NODE_MIXED, DRAINED_NODE])
    assert [n.name for n in parse_nodes(text, ["gpu"])] == ["gpu07", "gpu08"]
    assert [n.name for n in parse_nodes(text, ["long", "e31test"])] == ["vm", "gpu07"]
    assert [n.name for n in parse_nodes(text)] == ["vm", "gpu07", "gpu08"]


@pytest.mark.nodb
def test_gpu_count():
    assert gpu_count("gpu:a100:4(S:0-1),shard:8") == (4, "a100")
    assert gpu_count("gpu:2(IDX:0-1)") == (2, "")
    assert gpu_count("gpu:a100:2,gpu:h100:2") == (4, "a100")
    assert gpu_count("(null)") == (0, "")
    assert gpu_count(None) == (0, "")


# -- jobs -------------------------------------------------------------------------------------------

STARTED = datetime(2026, 12, 4, 19, 19, 52, tzinfo=UTC)
ENDED_AT = datetime(2026, 12, 4, 19, 20, 23, tzinfo=UTC)


@pytest.mark.nodb
@pytest.mark.parametrize(
    "slurm_state, ours",
    [
        ("PENDING", PENDING),
        ("CONFIGURING", PENDING),
        ("REQUEUE_HOLD", PENDING),
        ("RUNNING", RUNNING),
        ("COMPLETING", RUNNING),
        ("SUSPENDED", RUNNING),
        ("COMPLETED", ENDED),
        ("TIMEOUT", ENDED),
        ("FAILED", FAILED),
        ("OUT_OF_MEMORY", FAILED),
        ("BOOT_FAIL", FAILED),
        ("DEADLINE", FAILED),
        ("CANCELLED", CANCELLED),
        ("NODE_FAIL", NODE_LOST),
        ("PREEMPTED", NODE_LOST),
        ("REQUEUED", NODE_LOST),
        ("SOMETHING_NEW", UNKNOWN),
    ],
)
def test_every_job_state(slurm_state, ours):
    assert parse_job(parse_record(job_line(slurm_state))).state == ours


@pytest.mark.nodb
def test_a_pending_job_has_no_start_yet_and_says_why_it_waits():
    # For a pending job Slurm prints its guess of the start: not a fact to start a meter on.
    status = parse_job(parse_record(job_line("PENDING", reason="Resources", start="2026-12-04T20:00:00", end="2026-12-04T20:02:00")))
    assert (status.state, status.started_at, status.ended_at, status.exit_code, status.reason) == (PENDING, None, None, None, "Resources")


@pytest.mark.nodb
def test_a_running_job_has_a_start_and_no_end():
    status = parse_job(parse_record(job_line("RUNNING", end="2026-12-04T19:21:52")))
    assert (status.state, status.started_at, status.ended_at, status.exit_code, status.reason) == (RUNNING, STARTED, None, None, "")


@pytest.mark.nodb
def test_a_finished_job_has_its_times_and_exit_code():
    status = parse_job(parse_record(job_line("COMPLETED")))
    assert (status.state, status.started_at, status.ended_at, status.exit_code, status.signal, status.finished) == (ENDED, STARTED, ENDED_AT, 0, None, True)
    failed = parse_job(parse_record(job_line("FAILED", reason="NonZeroExitCode", exit_code="3:0")))
    assert (failed.state, failed.exit_code, failed.reason) == (FAILED, 3, "NonZeroExitCode")
    cancelled = parse_job(parse_record(job_line("CANCELLED", exit_code="0:15")))
    assert (cancelled.state, cancelled.exit_code, cancelled.signal) == (CANCELLED, 0, 15)
    timeout = parse_job(parse_record(job_line("TIMEOUT", exit_code="0:15")))
    assert (timeout.state, timeout.reason, timeout.engine_state) == (ENDED, "TimeLimit", "TIMEOUT")


@pytest.mark.nodb
def test_squeue_lines():
    text = "41\x1fRUNNING\x1f2026-12-04T19:19:52\x1f2026-12-04T19:21:52\x1fNone\n42\x1fPENDING\x1fN/A\x1fN/A\x1fResources\n"
    statuses = parse_squeue(text)
    assert (statuses["41"].state, statuses["41"].started_at, statuses["41"].ended_at) == (RUNNING, STARTED, None)
    assert (statuses["42"].state, statuses["42"].reason) == (PENDING, "Resources")


@pytest.mark.nodb
def test_sacct_lines():
    text = "41|COMPLETED|2026-12-04T19:19:52|2026-12-04T19:20:23|0:0|None\n42|CANCELLED by 990|2026-12-04T19:19:52|2026-12-04T19:20:23|0:15|None\n"
    statuses = parse_sacct(text)
    assert (statuses["41"].state, statuses["41"].exit_code, statuses["41"].ended_at) == (ENDED, 0, ENDED_AT)
    assert (statuses["42"].state, statuses["42"].signal) == (CANCELLED, 15)


@pytest.mark.nodb
def test_a_cluster_without_accounting_is_asked_once(monkeypatch):
    executor, calls = SlurmExecutor(), []

    def run(args, check=True, pass_fds=()):
        calls.append(args[0])
        return subprocess.CompletedProcess(args, 1, "", "Slurm accounting storage is disabled\n")

    monkeypatch.setattr(executor, "_run", run)
    assert executor.accounted(["41"]) == {} and executor.accounting is False
    assert executor.accounted(["42"]) == {} and calls == ["sacct"], "not asked again"


# -- what is submitted ------------------------------------------------------------------------------


@pytest.mark.nodb
def test_slurm_durations():
    assert [slurm_duration(s) for s in (0, 59, 3600, 3660, 90061)] == ["00:00:00", "00:00:59", "01:00:00", "01:01:00", "1-01:01:01"]


@pytest.mark.nodb
def test_the_time_limit_is_the_span_plus_the_grace_in_whole_minutes_and_term_comes_at_the_span():
    assert time_limit(request(time_limit_seconds=3600, grace_seconds=60)) == (3660, 60)
    assert time_limit(request(time_limit_seconds=100, grace_seconds=30)) == (180, 80)


@pytest.mark.nodb
def test_the_sbatch_command_line():
    args = sbatch_args(request(account="team_a"), "/srv/e31/runs/7/e31-slurm-batch.sh", "3", ["gpu"])
    assert args == [
        "sbatch",
        "--parsable",
        "--no-requeue",
        "--job-name=e31-7",
        "--comment=e31 job=5 allocation=7",
        "--nodes=1",
        "--nodelist=gpu07",
        "--ntasks-per-node=1",
        "--partition=gpu",
        "--account=team_a",
        "--gres=gpu:2",
        "--cpus-per-task=8",
        "--mem=64000M",
        "--time=01:01:00",
        "--signal=B:TERM@60",
        "--chdir=/srv/e31/runs/7",
        "--output=/srv/e31/runs/7/slurm-%j.out",
        "--error=/srv/e31/runs/7/slurm-%j.err",
        "--export=ALL",
        "--export-file=3",
        "/srv/e31/runs/7/e31-slurm-batch.sh",
        "python",
        "-m",
        "agent",
        "run-allocation",
        "7",
    ]


@pytest.mark.nodb
def test_a_cpu_gang_without_an_account():
    args = sbatch_args(request(nodes=("a", "b"), gpus_per_node=0, cpus_per_node=4, memory_mb=0, account=None), "/w/s.sh", "3")
    assert "--nodes=2" in args and "--nodelist=a,b" in args and "--cpus-per-task=4" in args
    assert not [a for a in args if a.startswith(("--gres", "--account", "--partition", "--mem"))]
    assert 'srun --nodes="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1' in BATCH_SCRIPT


@pytest.mark.nodb
def test_job_data_stays_out_of_the_options():
    # A hostile command is the script's arguments, after the script: sbatch reads no option there.
    args = sbatch_args(request(command=("--wrap=rm -rf /", "; echo", "$(id)")), "/w/s.sh", "3")
    assert args[-4:] == ["/w/s.sh", "--wrap=rm -rf /", "; echo", "$(id)"]
    assert export_text({"A": "x,y=z; $(id)", "B": "line\nbreak"}) == b"A=x,y=z; $(id)\0B=line\nbreak\0"
    with pytest.raises(ValueError):
        export_text({"BAD NAME": "x"})


# -- against a real Slurm -----------------------------------------------------------------------------


def wait_for(predicate, timeout=60, what="a condition"):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)
    return value


def finished_status(executor, handle, timeout=60):
    return wait_for(lambda: (s := executor.status([handle])[handle]).finished and s, timeout, f"job {handle} to finish")


@pytest.fixture
def executor(slurm):
    return SlurmExecutor(conf=str(slurm.conf), partitions=[slurm.partition])


def cpu_request(slurm, workdir, allocation_id, command, **fields):
    return AllocationRequest(
        allocation_id=allocation_id,
        job_id=1000 + allocation_id,
        nodes=(slurm.node,),
        command=tuple(command),
        workdir=str(workdir),
        time_limit_seconds=120,
        grace_seconds=10,
        cpus_per_node=1,
        memory_mb=64,
        **fields,
    )


@pytest.mark.bench  # a real Slurm: once, in bin/test's lane beside the SQLite pass
def test_it_finds_the_node_with_its_cpus_and_memory(slurm, executor):
    [node] = executor.nodes()
    assert (node.name, node.device_type, node.devices, node.free, node.memory_mb, node.state) == (
        slurm.node,
        "cpu",
        slurm.cpus,
        slurm.cpus,
        slurm.memory_mb,
        UP,
    )
    assert slurm.started_in < 30


@pytest.mark.bench
def test_an_allocation_runs_its_command_and_ends(slurm, executor, tmp_path):
    command = ["sh", "-c", 'printf "%s %s" "$GREETING" "$1" > out.txt', "sh", "world"]
    handle = executor.start(cpu_request(slurm, tmp_path, 1, command, environment={"GREETING": "hello, there"}))
    assert executor.status([handle])[handle].state in (PENDING, RUNNING, ENDED)
    status = finished_status(executor, handle)
    assert (status.state, status.exit_code, status.engine_state) == (ENDED, 0, "COMPLETED")
    assert status.started_at is not None and status.ended_at is not None and status.started_at <= status.ended_at
    assert abs((status.started_at - datetime.now(UTC)).total_seconds()) < 120
    assert (tmp_path / "out.txt").read_text() == "hello, there world"
    job = subprocess.run(["scontrol", "show", "job", "-o", handle], env=slurm.env, capture_output=True, text=True, check=True).stdout
    assert "JobName=e31-1 " in job and "Comment=e31 job=1001 allocation=1" in job


@pytest.mark.bench
def test_a_failing_command_fails_with_its_exit_code(slurm, executor, tmp_path):
    handle = executor.start(cpu_request(slurm, tmp_path, 2, ["sh", "-c", "exit 3"]))
    status = finished_status(executor, handle)
    assert (status.state, status.exit_code) == (FAILED, 3)


@pytest.mark.bench
def test_a_graceful_stop_reaches_the_command_which_ends(slurm, executor, tmp_path):
    script = 'trap "echo term > stopped; kill \\$pid; exit 0" TERM; sleep 300 & pid=$!; touch ready; wait'
    handle = executor.start(cpu_request(slurm, tmp_path, 3, ["sh", "-c", script]))
    wait_for(lambda: (tmp_path / "ready").exists(), what="the command to start")
    assert executor.status([handle])[handle].state == RUNNING
    executor.stop(handle, graceful=True)
    status = finished_status(executor, handle, timeout=30)
    # The command trapped TERM and exited 0 by itself: the batch script ends with its status.
    assert (status.state, status.exit_code) == (ENDED, 0)
    assert (tmp_path / "stopped").read_text() == "term\n"


@pytest.mark.bench
def test_a_forced_stop_cancels(slurm, executor, tmp_path):
    handle = executor.start(cpu_request(slurm, tmp_path, 4, ["sleep", "300"]))
    wait_for(lambda: executor.status([handle])[handle].state == RUNNING, what="the allocation to run")
    executor.stop(handle, graceful=False)
    assert finished_status(executor, handle, timeout=30).state == CANCELLED


@pytest.mark.bench
def test_another_users_job_holds_the_cpus_and_is_never_stopped(slurm, executor, tmp_path):
    other = slurm.run("sbatch", "--parsable", f"--cpus-per-task={slurm.cpus}", "--mem=64M", f"--chdir={tmp_path}", "--wrap", "sleep 60").stdout.strip()
    try:
        wait_for(lambda: slurm.run("squeue", "--noheader", "--jobs", other, "--format=%T").stdout.strip() == "RUNNING", what="the other job to run")
        [node] = executor.nodes()
        assert (node.state, node.devices, node.free) == (UP, slurm.cpus, 0)
        # Ours waits for the CPUs it holds (and says so); theirs is not E31's to stop.
        handle = executor.start(cpu_request(slurm, tmp_path, 5, ["true"]))
        waiting = wait_for(lambda: (s := executor.status([handle])[handle]).reason and s, what="a reason to wait")
        assert (waiting.state, waiting.reason) == (PENDING, "Resources")
        with pytest.raises(SlurmError, match="not an E31 allocation"):
            executor.stop(other)
        executor.stop(handle)
        assert executor.status([handle])[handle].state == CANCELLED
        assert slurm.run("squeue", "--noheader", "--jobs", other, "--format=%T").stdout.strip() == "RUNNING"
    finally:
        slurm.run("scancel", other, check=False)
        wait_for(lambda: executor.nodes()[0].free == slurm.cpus, what="the CPUs to come free")


@pytest.mark.bench
def test_a_drained_node_is_not_offered_until_resumed(slurm, executor):
    slurm.run("scontrol", "update", f"nodename={slurm.node}", "state=drain", "reason=test drain")
    try:
        [node] = executor.nodes()
        assert (node.state, node.free, node.free_memory_mb) == (DRAINED, 0, 0)
        assert node.reason.startswith("test drain")
    finally:
        slurm.run("scontrol", "update", f"nodename={slurm.node}", "state=resume")
    slurm.wait_for_state("idle", timeout=30)
    [node] = executor.nodes()
    assert (node.state, node.free, node.reason) == (UP, slurm.cpus, "")


@pytest.mark.bench
def test_a_handle_slurm_has_never_seen_is_unknown(executor):
    assert executor.status(["999999"])["999999"].state == UNKNOWN
    executor.stop("999999")  # nothing to stop: no error


@pytest.mark.nodb
def test_the_batch_script_is_valid_bash(tmp_path):
    script = Path(tmp_path / "s.sh")
    script.write_text(BATCH_SCRIPT)
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0


@pytest.mark.nodb
@pytest.mark.parametrize("exit_code", [0, 3])
def test_the_batch_script_passes_term_on_and_ends_with_the_commands_status(tmp_path, exit_code):
    script = tmp_path / "batch.sh"
    script.write_text(BATCH_SCRIPT)
    command = f'trap "echo term > stopped; kill \\$pid; exit {exit_code}" TERM; sleep 30 & pid=$!; touch ready; wait'
    batch = subprocess.Popen(["bash", str(script), "sh", "-c", command], cwd=tmp_path)
    wait_for(lambda: (tmp_path / "ready").exists(), timeout=10, what="the command to start")
    batch.terminate()
    assert batch.wait(timeout=10) == exit_code
    assert (tmp_path / "stopped").read_text() == "term\n"
