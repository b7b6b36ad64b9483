"""The Slurm executor: E31's allocations as batch jobs of a Slurm cluster the operator already runs.

It talks to Slurm through its command-line tools (scontrol, squeue, sbatch, scancel; sacct where
accounting is on), with the operator's slurm.conf. What Slurm prints is read by the pure functions
below (tested on samples without Slurm); the SlurmExecutor class only runs the commands.

- Nodes: `scontrol show node -o`, one line per node. Devices busy with anyone's Slurm jobs are
  busy for E31 too (free = total - allocated); a drained or down node is reported with nothing free.
- An allocation is one `sbatch` job pinned to the nodes the policy chose, named `e31-<allocation>`
  with E31's ids in its comment. The command travels as the batch script's arguments and the
  environment through an unnamed file (`--export-file=<fd>`): nothing from a job is ever part of a
  shell string or of sbatch's own options.
- The tools run with a small environment of our own (PATH, TZ=UTC, SLURM_CONF): an operator's
  SQUEUE_FORMAT or SBATCH_* variables cannot change what is submitted or how it is read, and
  every time Slurm prints is UTC.
"""

import math
import os
import re
import subprocess
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime

from scheduler.executors.base import (
    CANCELLED,
    DOWN,
    DRAINED,
    ENDED,
    FAILED,
    NODE_LOST,
    PENDING,
    RUNNING,
    UNKNOWN,
    UP,
    AllocationRequest,
    AllocationStatus,
    NodeInfo,
)

JOB_NAME_PREFIX = "e31-"

# The batch script is the same text for every allocation: the command is its arguments. TERM
# (a graceful stop: `scancel --batch --signal=TERM`, or --signal=B:TERM before the time limit)
# reaches only this shell, which passes it on to the command (to srun across nodes, which passes
# it on to each node's command) and waits for it to finish within its grace.
BATCH_SCRIPT = """#!/bin/bash
# E31 Network: one allocation as a Slurm batch job; the command is this script's arguments.
set -u
# Slurm keeps its start to the second; this instant, taken before anything else runs, is the
# meter's start to the microsecond (scheduler/engine.py refined_start). bash's own clock: no fork.
export E31_ENGINE_STARTED_AT="${EPOCHREALTIME:-$(date +%s.%N)}"
if [ "${SLURM_JOB_NUM_NODES:-1}" -gt 1 ]; then
  export SLURM_EXPORT_ENV=ALL  # each node's step gets the job's environment
  srun --nodes="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1 --kill-on-bad-exit=1 "$@" &
else
  "$@" &
fi
child=$!
trap 'kill -TERM "$child" 2>/dev/null' TERM INT
wait "$child"
# wait returns early (above 128) when a trapped signal arrives: wait on until the command has
# ended, then once more for its own exit status (bash keeps it).
while kill -0 "$child" 2>/dev/null; do
  wait "$child"
done
wait "$child"
"""

# Slurm's JobState (scontrol, squeue -o %T, sacct) to E31's allocation state.
JOB_STATES = {
    "PENDING": PENDING,
    "CONFIGURING": PENDING,  # nodes booting: compute not usable yet
    "REQUEUE_HOLD": PENDING,
    "REQUEUE_FED": PENDING,
    "RESV_DEL_HOLD": PENDING,
    "RUNNING": RUNNING,
    "COMPLETING": RUNNING,  # the command is done, its processes are being cleaned up: still held
    "SUSPENDED": RUNNING,
    "STOPPED": RUNNING,
    "SIGNALING": RUNNING,
    "STAGE_OUT": RUNNING,
    "RESIZING": RUNNING,
    "COMPLETED": ENDED,
    "TIMEOUT": ENDED,  # the time limit (span plus grace) reached
    "FAILED": FAILED,
    "OUT_OF_MEMORY": FAILED,
    "BOOT_FAIL": FAILED,
    "DEADLINE": FAILED,
    "SPECIAL_EXIT": FAILED,
    "REVOKED": FAILED,
    "CANCELLED": CANCELLED,
    "NODE_FAIL": NODE_LOST,
    "PREEMPTED": NODE_LOST,  # Slurm took the compute back for someone else: E31 requeues and credits
    "REQUEUED": NODE_LOST,
}

# Node state words (scontrol's State=BASE+FLAG+...) that take a node out of service.
DOWN_STATES = {"DOWN", "UNKNOWN", "FUTURE", "ERROR", "NOT_RESPONDING", "POWERED_DOWN", "POWERING_DOWN", "POWERING_UP", "POWER_DOWN", "INVALID", "INVALID_REG"}
DRAINED_STATES = {"DRAIN", "DRAINED", "DRAINING", "FAIL", "FAILING", "MAINT", "REBOOT_REQUESTED", "REBOOT_ISSUED", "RESERVED", "PLANNED"}

# A key of scontrol's one-line output (NodeName=, CPUAlloc=, ReqB:S:C:T=, CPUs/Task=). A token
# that does not start like one belongs to the value before it (OS=Linux 6.1 #1 SMP, Reason=a b).
_KEY = re.compile(r"^([A-Z][A-Za-z0-9_:/]*)=(.*)$")
_GPU_COUNT = re.compile(r"^gpu(?::([^:(]+))?:(\d+)")


class SlurmError(RuntimeError):
    pass


# -- reading what Slurm prints ---------------------------------------------------------------------


def parse_record(line: str) -> dict[str, str]:
    """One line of `scontrol show <node|job> -o` as a dict of its fields."""
    fields: dict[str, str] = {}
    key = None
    for token in line.split():
        match = _KEY.match(token)
        if match:
            key = match.group(1)
            fields[key] = match.group(2)
        elif key is not None:
            fields[key] += " " + token
    return fields


def parse_records(text: str) -> list[dict[str, str]]:
    return [parse_record(line) for line in text.splitlines() if line.strip() and "=" in line]


def _int(value: str | None, default: int = 0) -> int:
    try:
        return int(value) if value is not None else default
    except ValueError:
        return default


def gpu_count(gres: str | None) -> tuple[int, str]:
    """The GPUs in a gres string and their model: 'gpu:a100:4(S:0-1),shard:8' is (4, 'a100');
    'gpu:2(IDX:0-1)' is (2, ''); '(null)' is (0, '')."""
    count, model = 0, ""
    for item in (gres or "").split(","):
        match = _GPU_COUNT.match(item.strip())
        if match:
            count += int(match.group(2))
            model = model or (match.group(1) or "")
    return count, model


def _tres(value: str | None, name: str) -> int:
    """One count from a TRES list: 'cpu=2,mem=1G,gres/gpu=1' -> 1 for 'gres/gpu'."""
    for item in (value or "").split(","):
        key, _, count = item.partition("=")
        if key == name:
            return _int(count)
    return 0


def node_state(state: str) -> str:
    """E31's state for scontrol's State: IDLE and MIXED are up, IDLE+DRAIN is drained,
    DOWN+NOT_RESPONDING (or IDLE+NOT_RESPONDING, or sinfo's 'down*') is down."""
    base = state.rstrip("*~#!%$@^-")
    suffix = state[len(base) :]  # sinfo's marks: * not responding, ~ # % ! powered down or on the way
    words = set(base.upper().split("+")) - {""}
    if set(suffix) & set("*~#%!") or words & DOWN_STATES:
        return DOWN
    if suffix or words & DRAINED_STATES:  # $ maintenance, @ ^ rebooting, - planned
        return DRAINED
    return UP


def parse_node(fields: Mapping[str, str]) -> NodeInfo:
    """A NodeInfo from one node's fields (parse_record of `scontrol show node -o`)."""
    gpus, model = gpu_count(fields.get("Gres"))
    if not gpus:
        gpus = _tres(fields.get("CfgTRES"), "gres/gpu")
    if gpus:
        used, _ = gpu_count(fields.get("GresUsed"))
        busy = used or _tres(fields.get("AllocTRES"), "gres/gpu")
        device_type, total = "gpu", gpus
    else:
        total = _int(fields.get("CPUEfctv"), _int(fields.get("CPUTot")))
        busy = _int(fields.get("CPUAlloc"))
        device_type = "cpu"
    state = node_state(fields.get("State", "UNKNOWN"))
    memory = _int(fields.get("RealMemory"))
    reason = fields.get("Reason", "")
    up = state == UP
    return NodeInfo(
        name=fields["NodeName"],
        device_type=device_type,
        devices=total,
        free=max(0, total - busy) if up else 0,
        memory_mb=memory,
        free_memory_mb=max(0, memory - _int(fields.get("AllocMem"))) if up else 0,
        state=state,
        reason="" if reason in ("", "(null)") else reason,
        gpu_type=model,
        partitions=tuple(p for p in fields.get("Partitions", "").split(",") if p),
    )


def parse_nodes(text: str, partitions: Sequence[str] = ()) -> list[NodeInfo]:
    """The nodes in `scontrol show node -o`'s output, those of the given partitions (all when none)."""
    nodes = [parse_node(fields) for fields in parse_records(text) if "NodeName" in fields]
    if partitions:
        nodes = [node for node in nodes if set(node.partitions) & set(partitions)]
    return nodes


def parse_time(value: str | None) -> datetime | None:
    """Slurm's '2026-12-04T19:17:30' (printed in UTC: the executor runs the tools with TZ=UTC)."""
    if not value or value in ("N/A", "Unknown", "None", "(null)"):
        return None
    try:
        return datetime.strptime(value, "%Y-%m-%dT%H:%M:%S").replace(tzinfo=UTC)
    except ValueError:
        return None


def parse_exit_code(value: str | None) -> tuple[int | None, int | None]:
    """Slurm's ExitCode 'code:signal' as (code, signal or None): '0:0' -> (0, None), '0:15' -> (0, 15)."""
    if not value or ":" not in value:
        return None, None
    code, _, sig = value.partition(":")
    signal = _int(sig)
    return _int(code), signal or None


def job_status(state: str, start: str | None = None, end: str | None = None, reason: str = "", exit_code: str | None = None) -> AllocationStatus:
    """An AllocationStatus from Slurm's words for a job. For a job not yet running, Slurm's start
    and end are its guesses, not facts: they are left out."""
    slurm_state = state.split()[0].rstrip("+").upper() if state.strip() else "UNKNOWN"  # sacct: 'CANCELLED by 0'
    ours = JOB_STATES.get(slurm_state, UNKNOWN)
    started = parse_time(start) if ours != PENDING else None
    ended = parse_time(end) if ours not in (PENDING, RUNNING) else None
    code, signal = parse_exit_code(exit_code) if ours not in (PENDING, RUNNING) else (None, None)
    if ours == ENDED and slurm_state == "TIMEOUT":
        reason = reason if reason not in ("", "None") else "TimeLimit"
    return AllocationStatus(
        state=ours,
        started_at=started,
        ended_at=ended,
        exit_code=code,
        signal=signal,
        reason="" if reason in ("None", "(null)") else reason,
        engine_state=slurm_state,
    )


def parse_job(fields: Mapping[str, str]) -> AllocationStatus:
    """An AllocationStatus from one job's fields (parse_record of `scontrol show job -o`)."""
    return job_status(fields.get("JobState", ""), fields.get("StartTime"), fields.get("EndTime"), fields.get("Reason", ""), fields.get("ExitCode"))


# squeue's format for status(): fields split by a character no field holds.
SQUEUE_FORMAT = "%i\x1f%T\x1f%S\x1f%e\x1f%r"


def parse_squeue(text: str) -> dict[str, AllocationStatus]:
    """`squeue --noheader --format=SQUEUE_FORMAT` as {job id: status} (squeue prints no exit
    code: the executor asks scontrol for that once a job has finished)."""
    statuses = {}
    for line in text.splitlines():
        parts = line.split("\x1f")
        if len(parts) == 5:
            job_id, state, start, end, reason = (part.strip() for part in parts)
            statuses[job_id] = job_status(state, start, end, reason)
    return statuses


def parse_sacct(text: str) -> dict[str, AllocationStatus]:
    """`sacct --noheader --parsable2 --allocations --format=JobID,State,Start,End,ExitCode,Reason`
    as {job id: status}: for jobs the controller has forgotten, where accounting is on."""
    statuses = {}
    for line in text.splitlines():
        parts = line.split("|")
        if len(parts) >= 5:
            job_id, state, start, end, exit_code = parts[:5]
            reason = parts[5] if len(parts) > 5 else ""
            statuses[job_id] = job_status(state, start, end, reason, exit_code)
    return statuses


# -- what E31 submits ------------------------------------------------------------------------------


def slurm_duration(seconds: int) -> str:
    """Seconds in Slurm's [days-]hours:minutes:seconds."""
    days, rest = divmod(max(0, int(seconds)), 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{days}-{hours:02d}:{minutes:02d}:{secs:02d}" if days else f"{hours:02d}:{minutes:02d}:{secs:02d}"


def time_limit(request: AllocationRequest) -> tuple[int, int]:
    """(--time in seconds, --signal's seconds before it). Slurm keeps time limits in whole minutes
    (rounding a limit up), so the limit is the span plus the grace rounded up to a minute, and the
    TERM is asked for at the span itself: what the rounding adds goes to the grace."""
    total = math.ceil((request.time_limit_seconds + request.grace_seconds) / 60) * 60
    return total, min(65535, total - request.time_limit_seconds)


def sbatch_args(request: AllocationRequest, script: str, export_file: str, partitions: Sequence[str] = ()) -> list[str]:
    """sbatch's argument list for an allocation: options from E31's own numbers and names, then
    the batch script, then the command as its arguments."""
    limit, signal_before = time_limit(request)
    workdir = request.workdir.rstrip("/") or "/"
    args = [
        "sbatch",
        "--parsable",
        "--no-requeue",  # a lost node ends the allocation; E31 requeues the job from its checkpoint
        f"--job-name={JOB_NAME_PREFIX}{request.allocation_id}",
        f"--comment=e31 job={request.job_id} allocation={request.allocation_id}",
        f"--nodes={len(request.nodes)}",
        f"--nodelist={','.join(request.nodes)}",
        "--ntasks-per-node=1",
    ]
    if partitions:
        args.append(f"--partition={','.join(partitions)}")
    if request.account:
        args.append(f"--account={request.account}")
    if request.gpus_per_node:
        args.append(f"--gres=gpu:{request.gpus_per_node}")
    if request.cpus_per_node:
        args.append(f"--cpus-per-task={request.cpus_per_node}")
    if request.memory_mb:
        args.append(f"--mem={request.memory_mb}M")
    args += [
        f"--time={slurm_duration(limit)}",
        f"--signal=B:TERM@{signal_before}",
        f"--chdir={workdir}",
        f"--output={workdir}/slurm-%j.out",
        f"--error={workdir}/slurm-%j.err",
        # With --export-file the job's environment is that file's and nothing else (sbatch's own
        # is not passed on; --export=NONE would drop the file and load a login environment).
        "--export=ALL",
        f"--export-file={export_file}",
        script,
        *request.command,
    ]
    return args


def export_text(environment: Mapping[str, str]) -> bytes:
    """The job's environment as --export-file reads it: NAME=value, NUL-separated (any value)."""
    for name, value in environment.items():
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name) or "\0" in value:
            raise ValueError(f"environment variable {name!r} cannot be passed to a Slurm job")
    return b"".join(f"{name}={value}".encode() + b"\0" for name, value in environment.items())


# -- running the tools -----------------------------------------------------------------------------


class SlurmExecutor:
    """Allocations as Slurm batch jobs, through the Slurm tools on this machine."""

    def __init__(self, conf: str | None = None, partitions: Sequence[str] = (), timeout: float = 30.0, path: str | None = None):
        self.conf = conf
        self.partitions = tuple(partitions)
        self.timeout = timeout
        self.env = {"PATH": path or os.environ.get("PATH", "/usr/bin:/bin"), "TZ": "UTC", "LC_ALL": "C"}
        self.accounting: bool | None = None  # False once sacct has said accounting is off
        if conf:
            self.env["SLURM_CONF"] = conf

    def _run(self, args: Sequence[str], check: bool = True, pass_fds: Sequence[int] = ()) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(list(args), env=self.env, capture_output=True, text=True, timeout=self.timeout, pass_fds=tuple(pass_fds), check=False)
        if check and done.returncode != 0:
            raise SlurmError(f"{args[0]} failed ({done.returncode}): {done.stderr.strip() or done.stdout.strip()}")
        return done

    def nodes(self) -> list[NodeInfo]:
        return parse_nodes(self._run(["scontrol", "show", "node", "--oneliner"]).stdout, self.partitions)

    def start(self, request: AllocationRequest) -> str:
        if not request.nodes or not request.command:
            raise ValueError("an allocation needs nodes and a command")
        # The batch script and Slurm's output files: the submitting user's alone (the jobs of
        # E31's teams run as other users on the node).
        os.makedirs(request.workdir, mode=0o700, exist_ok=True)
        os.chmod(request.workdir, 0o700)
        script = os.path.join(request.workdir, "e31-slurm-batch.sh")
        with open(script, "w") as f:
            f.write(BATCH_SCRIPT)
        # The environment may hold the job's secrets: it goes to sbatch through a file with no
        # name (read from its descriptor), never on a command line or left on disk.
        with tempfile.TemporaryFile() as env_file:
            env_file.write(export_text(request.environment))
            env_file.flush()
            env_file.seek(0)
            fd = env_file.fileno()
            done = self._run(sbatch_args(request, script, str(fd), self.partitions), pass_fds=[fd])
        # --parsable prints "<job id>[;<cluster>]".
        return done.stdout.strip().split(";")[0]

    def status(self, handles: Iterable[str]) -> dict[str, AllocationStatus]:
        handles = [str(handle) for handle in handles]
        if not handles:
            return {}
        done = self._run(["squeue", "--noheader", "--states=all", f"--jobs={','.join(handles)}", f"--format={SQUEUE_FORMAT}"], check=False)
        statuses = parse_squeue(done.stdout) if done.returncode == 0 else {}
        # squeue prints no exit code: scontrol has it for a finished job still in the controller's memory.
        for handle, status in list(statuses.items()):
            if status.finished:
                job = self._job(handle)
                if job is not None:
                    statuses[handle] = parse_job(job)
        forgotten = [handle for handle in handles if handle not in statuses]
        if forgotten:
            statuses.update(self._sacct(forgotten))
        return {handle: statuses.get(handle, AllocationStatus(state=UNKNOWN, reason="Slurm no longer knows this job")) for handle in handles}

    def _job(self, handle: str) -> dict[str, str] | None:
        done = self._run(["scontrol", "show", "job", "--oneliner", handle], check=False)
        records = parse_records(done.stdout) if done.returncode == 0 else []
        return records[0] if records else None

    def accounted(self, handles: Iterable[str]) -> dict[str, AllocationStatus]:
        """sacct's records of these jobs; {} where accounting is off (asked once: sacct says so)."""
        handles = [str(handle) for handle in handles]
        return self._sacct(handles) if handles else {}

    def _sacct(self, handles: Sequence[str]) -> dict[str, AllocationStatus]:
        """What accounting remembers of jobs ({} where it is off, or does not answer)."""
        if self.accounting is False:
            return {}
        args = ["sacct", "--noheader", "--parsable2", "--allocations", f"--jobs={','.join(handles)}", "--format=JobID,State,Start,End,ExitCode,Reason"]
        try:
            done = self._run(args, check=False)
        except (OSError, subprocess.TimeoutExpired):
            return {}
        if done.returncode != 0 and "accounting storage is disabled" in done.stderr.lower():
            self.accounting = False  # the cluster keeps no accounting: not asked again
        return parse_sacct(done.stdout) if done.returncode == 0 else {}

    def stop(self, handle: str, graceful: bool = True) -> None:
        """Graceful: TERM to the batch shell, which passes it on to the command (the caller stops it
        for good after the grace). Otherwise the job is cancelled (Slurm sends TERM, then KILL
        after its KillWait). A handle that is not an E31 job is refused: E31 never stops another
        user's Slurm job."""
        job = self._job(str(handle))
        if job is None:
            return  # already gone
        if not job.get("JobName", "").startswith(JOB_NAME_PREFIX) or not job.get("Comment", "").startswith("e31 "):
            raise SlurmError(f"Slurm job {handle} is not an E31 allocation; it is left alone")
        status = parse_job(job)
        if status.finished:
            return
        if graceful and status.state == RUNNING:
            self._run(["scancel", "--batch", "--signal=TERM", str(handle)])
        else:
            self._run(["scancel", str(handle)])
