"""The runner: holds a node's devices, runs the jobs placed on it, and reports everything.

One runner per node. Each job runs as a child process in its own session (process group) and
its own working folder. Every line it prints is stored with a sequence number before it is
announced; the meter ticks once a second while compute is held.
"""

import io
import json
import logging
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import cached_property
from pathlib import Path, PurePosixPath

from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone

from e31 import unpack
from e31web.storage import get_storage
from jobs import archive, lineage, states
from jobs.logs import log_key, stored_bytes, stream_log
from jobs.models import Artifact, Job, JobEvent, Utilization, input_names
from notifications import events as notifications
from scheduler import checkpoints, jobfiles, sampling, smoke, stopping, utilization
from scheduler.cache import BlobCache
from scheduler.environments import (
    BuildError,
    EnvironmentCache,
    index_arguments,
    requirements_of,
)
from scheduler.isolation import (
    Isolation,
    disk_message,
    oom_message,
    sandbox_group,
    unlinked_open_bytes,
)
from scheduler.launch import (
    RANK_PREFIX_TEMPLATE,
    Gang,
    JobDirs,
    artifact_name_problem,
    build_environment,
    job_command,
    process_count,
    uses_torchrun,
    working_folder,
)
from scheduler.logcap import LogBudget
from scheduler.models import Allocation, CachedBlob, Node, Staging
from scheduler.services import end_allocation, release_node
from scheduler.staging import (
    StagingError,
    Throttle,
    job_manifest,
    manifest_digests,
    stage,
)

log = logging.getLogger(__name__)

PUMP_BATCH = 5000
# Lines read but not yet stored. When it is full the reader waits, the pipe fills, and the job
# blocks on its next write: back-pressure instead of a runner that grows without bound.
QUEUE_LINES = 100_000
# After the process exits, how long its pipes may stay open (a daemon that left the process
# group holding them) before the runner stops reading and finishes the job.
READER_JOIN_SECONDS = 5.0
# Metric points read from a job's metrics file per step, at most.
METRICS_READ_BYTES = 1 << 20
MAX_METRIC_VALUES = 50
MAX_METRIC_NAME = 100


def detect_device_type():
    """'cpu', or the name of the first GPU where NVIDIA's tools are present."""
    if shutil.which("nvidia-smi") is None:
        return "cpu"
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "cpu"
    names = [line.strip() for line in out.stdout.splitlines() if line.strip()]
    return names[0] if out.returncode == 0 and names else "cpu"


class AllocationGone(Exception):
    """The allocation was ended elsewhere (its node declared lost) while its job was starting."""


def _kill_group(process):
    if process is not None and process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        process.wait()


def _release(sandbox):
    if sandbox is not None:
        try:
            sandbox.release()
        except Exception:  # noqa: BLE001 - the job's failure to start is what is reported
            log.exception("could not release the sandbox of allocation %s", sandbox.name)


# Where a job's archive waits, linked read-only into its folder, until its sandbox unpacks it.
WORK_ARCHIVES = ".work"
UNPACKER = unpack.__file__  # standard library only: run with -I -S inside the sandbox
UNPACK_SECONDS = 600

UNISOLATED_NOTICE = (
    "this node runs jobs WITHOUT isolation (E31_JOB_ISOLATION=0, for development only): the job runs as the runner's user, with its network and without limits"
)

RANKED_LINE = re.compile(r"^\[rank(\d+)\]:")


class OutputReader:
    """Reads a process's stdout and stderr line by line on two threads into one queue.

    ranked: the process is torchrun, which marks each worker's line "[rankN]:"; the mark is
    taken off and kept as the line's rank."""

    def __init__(self, process, max_line_bytes, ranked=False):
        self.ranked = ranked
        self.lines = queue.Queue(maxsize=QUEUE_LINES)
        self.threads = [
            threading.Thread(target=self._read, args=(pipe, name, max_line_bytes), daemon=True)
            for pipe, name in ((process.stdout, "stdout"), (process.stderr, "stderr"))
        ]
        for thread in self.threads:
            thread.start()

    def _read(self, pipe, stream, max_line_bytes):
        try:
            # A line longer than max_line_bytes comes through as several lines: split, never dropped.
            for raw in iter(lambda: pipe.readline(max_line_bytes), b""):
                # NUL cannot be stored in a PostgreSQL text column: shown as U+FFFD, like bad UTF-8.
                text = raw.decode("utf-8", errors="replace").rstrip("\r\n").replace("\x00", "\ufffd")
                rank = None
                if self.ranked and (mark := RANKED_LINE.match(text)):
                    rank, text = int(mark.group(1)), text[mark.end() :]
                self.lines.put((stream, timezone.now(), text, rank))
        finally:
            pipe.close()

    def drain(self, limit):
        batch = []
        while len(batch) < limit:
            try:
                batch.append(self.lines.get_nowait())
            except queue.Empty:
                break
        return batch

    def join(self, timeout):
        deadline = time.monotonic() + timeout
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    @property
    def done(self):
        """Both pipes read to the end and every line taken from the queue."""
        return not any(thread.is_alive() for thread in self.threads) and self.lines.empty()


@dataclass
class StopRequest:
    reason: str  # an Allocation end reason
    state: str  # the job's final state
    message: str
    term_sent_at: float  # monotonic
    release_at: object = None  # when the meter stops (datetime), if fixed in advance
    on_metric: bool = False  # early stopping on the job's metric: the weights of its best step come back


def parse_metric_line(raw, now):
    """One line of a job's metrics file as (step, at, values), or None if it is not one.
    Non-finite values are kept as the strings "NaN", "Infinity", "-Infinity"."""
    try:
        point = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    if not isinstance(point, dict) or not isinstance(point.get("values"), dict):
        return None
    step = point.get("step")
    if isinstance(step, bool) or not (step is None or isinstance(step, int)):
        return None
    values = {}
    for name, value in list(point["values"].items())[:MAX_METRIC_VALUES]:
        if not isinstance(name, str) or not name or len(name) > MAX_METRIC_NAME:
            continue
        stored = stopping.as_stored(value)
        if stored is not None:
            values[name] = stored
    if not values:
        return None
    at = now
    stamp = point.get("at")
    if isinstance(stamp, (int, float)) and not isinstance(stamp, bool) and 0 < stamp < 1e11:
        at = min(datetime.fromtimestamp(stamp, tz=UTC), now)
    return step, at, values


class RunningJob:
    def __init__(self, allocation, process, dirs, max_line_bytes, keeper=None, watch=None, ranked=False, sandbox=None, disk_pool=None):
        self.linked = set()  # digests of the cache's files hard-linked into its folder
        self.group = None  # the process group of the job inside its sandbox (found when first signalled)
        self.env_key = None  # its environment (scheduler/environments.py): never evicted while it runs
        self.allocation = allocation
        self.sandbox = sandbox
        self.disk_pool = disk_pool
        self.disk_check = None  # the folder's size being measured (a future)
        self.disk_checked_at = time.monotonic()
        self.over_disk = False
        self.job = allocation.job
        self.process = process
        self.dirs = dirs
        self.keeper = keeper
        self.watch = watch or stopping.Watch()
        self.metrics_pos = 0
        self.metrics_rest = b""
        self.bad_metric_lines = 0
        self.reader = OutputReader(process, max_line_bytes, ranked=ranked)
        self.stop = None
        self.smoke = False  # a script's smoke run: reaching its limit is a pass
        self.exited_at = None
        self.exited_monotonic = None
        self.last_tick = 0.0
        self.pending = []  # lines taken from the reader, not yet committed
        self.log_budget = None  # what is left of the job's log cap: made by the first pump()
        limit = allocation.limit_seconds
        self.limit_at = allocation.started_at + timedelta(seconds=limit) if limit is not None else None
        self.sampler = self.recorder = None
        self.idle = utilization.IdleWatch(settings.E31_UTIL_IDLE_PERCENT)
        self.idle_flagged = False
        self.sampled_at = time.monotonic()
        if settings.E31_UTIL_SAMPLE_SECONDS > 0:
            self.start_sampling(settings.E31_UTIL_SAMPLE_SECONDS)

    # Output and the meter -------------------------------------------------------------------

    def pump(self):
        """Store what the process printed since the last call; True if there may be more.

        A batch stays pending until its write commits: if the database refuses it (locked, gone
        for a moment), the same lines are written on the next try, not dropped. Lines past the
        job's log cap are counted as they are taken, never stored, and still read as fast: the
        job must not block on a full pipe because its log is full."""
        more = True  # a batch written again after a failure: more may be waiting behind it
        if self.log_budget is None:
            # It counts what the job's earlier runs stored: one query, made here rather than when
            # the process is launched, so that if it fails the next step tries it again.
            self.log_budget = LogBudget(settings.E31_JOB_LOG_MAX_BYTES, stored_bytes(self.job.pk), shares=self.allocation.gang_size)
        if not self.pending:
            batch = self.reader.drain(PUMP_BATCH)
            more = len(batch) == PUMP_BATCH
            self.pending = self.log_budget.take(batch)
        JobEvent.append_lines(self.job.pk, self.pending)
        self.pending = []
        return more

    def read_metrics(self, limit=METRICS_READ_BYTES):
        """Store the metric points the job wrote since the last call, and stop the job if a
        point says so (early stopping, a NaN loss). True if there may be more to read."""
        if self.keeper is not None:
            self.keeper.watch = self.watch  # the checkpoint of the best step is never pruned
        try:
            # Not through a link the job put in any part of the path (its .e31 folder swapped
            # for a link to another job's), only a regular file, never blocking on a pipe.
            fd = jobfiles.open_file(self.dirs.root, self.dirs.metrics.relative_to(self.dirs.root))
        except OSError:
            return False
        with open(fd, "rb") as source:
            source.seek(self.metrics_pos)
            chunk = source.read(limit)
        if not chunk:
            return False
        lines = (self.metrics_rest + chunk).split(b"\n")
        rest = lines.pop()
        if len(rest) > limit:  # a "line" that never ends is not a metric
            rest = b""
            self.bad_metric_lines += 1
        now = timezone.now()
        points = []
        for raw in lines:
            if not raw.strip():
                continue
            point = parse_metric_line(raw, now)
            if point is None:
                self.bad_metric_lines += 1
                if self.bad_metric_lines == 1:
                    self.job.record("notice", data={"text": "a line of the metrics file is not a metric point; such lines are skipped"})
                continue
            points.append(point)
        JobEvent.append(self.job.pk, [JobEvent(kind="metric", at=at, data={"step": step, "values": values}) for step, at, values in points])
        # Only now, with the points stored, is the file read this far.
        self.metrics_pos += len(chunk)
        self.metrics_rest = rest
        for step, _, values in points:
            verdict = self.watch.add(step, values)
            if verdict is not None and self.stop is None:
                state = states.FAILED if verdict.failed else states.SUCCEEDED
                self.request_stop(Allocation.EARLY_STOP, state, verdict.message, on_metric=not verdict.failed)
        return len(chunk) == limit

    def tick(self, now_monotonic):
        if now_monotonic - self.last_tick >= 1.0:
            self.last_tick = now_monotonic
            self.job.record("meter", data=self.job.meter_event())

    # Utilization -----------------------------------------------------------------------------

    def start_sampling(self, every):
        allocation, sandbox = self.allocation, self.sandbox
        pids = None
        if sandbox is not None and sandbox.cgroups:  # every process of the job, daemons too
            pids = lambda: sandbox.isolation.cgroups.pids(sandbox.name)  # noqa: E731
        try:
            self.sampler = sampling.sampler_for(
                pid=self.process.pid,
                devices=allocation.devices,
                device_type=allocation.device_type,
                prefix=f"node{allocation.node_rank}:" if allocation.gang_size > 1 else "",
                pids=pids,
                memory_total=sandbox.limits.memory_bytes if sandbox is not None else None,
            )
        except Exception:  # noqa: BLE001 - a job runs without its chart rather than not at all
            log.exception("cannot sample the devices of job %s", self.job.pk)
            return
        width = max(settings.E31_UTIL_WINDOW_SECONDS, every)
        self.recorder = utilization.Recorder(every=every, width=width, limit=settings.E31_UTIL_MAX_WINDOWS)

    def sample(self, now_monotonic):
        """Read the job's devices every few seconds: windows stored as they close, idle watched."""
        if self.recorder is None or now_monotonic - self.sampled_at < self.recorder.every:
            return
        self.sampled_at = now_monotonic
        try:
            readings = self.sampler.read()
        except Exception:  # noqa: BLE001 - read again next time
            log.exception("could not sample the devices of job %s", self.job.pk)
            return
        if not readings:
            return
        t = (timezone.now() - self.allocation.started_at).total_seconds()
        if self.recorder.add(t, readings):
            self.store_utilization()
        self.watch_idle(t, readings)

    def store_utilization(self, summary=False):
        """The windows so far in the allocation's row; with summary, the job's mean and peak per
        device over all its runs too (under the job's row lock, so the last node of a gang to
        finish writes a summary that counts every node's windows)."""
        if self.recorder is None:
            return
        windows = self.recorder.snapshot()
        if windows:
            Utilization.objects.update_or_create(
                allocation_id=self.allocation.pk,
                defaults={
                    "job_id": self.job.pk,
                    "started_at": self.allocation.started_at,
                    "every": self.recorder.every,
                    "width": self.recorder.width,
                    "series": self.sampler.series,
                    "windows": windows,
                },
            )
        if summary:
            with transaction.atomic():
                Job.objects.select_for_update().filter(pk=self.job.pk).values_list("pk").get()
                runs = [(u.series, u.windows) for u in Utilization.objects.filter(job_id=self.job.pk)]
                found = utilization.summarize(runs)
                Job.objects.filter(pk=self.job.pk).update(utilization=found.as_data() if found else None)

    def watch_idle(self, t, readings):
        """Flag the job (and tell its team) once every device has been idle for its idle
        minutes; stop it, with a checkpoint, if it said so. Busy again: the flag comes off."""
        since = self.idle.add(t, readings)
        if since is None:
            if self.idle_flagged:
                self.idle_flagged = False
                Job.objects.filter(pk=self.job.pk).update(idle_since=None)
                self.job.record("notice", data={"text": "busy again: no longer idle"})
            return
        minutes = self.job.idle_minutes
        if self.idle_flagged or not minutes or t - since < minutes * settings.E31_UTIL_IDLE_MINUTE_SECONDS:
            return
        self.idle_flagged = True
        at = self.allocation.started_at + timedelta(seconds=since)
        text = (
            f"idle: every device below {settings.E31_UTIL_IDLE_PERCENT:g}% busy since {at:%Y-%m-%d %H:%M:%S} UTC "
            f"({minutes} minute{'s' if minutes != 1 else ''} or more)"
        )
        with transaction.atomic():
            Job.objects.filter(pk=self.job.pk).update(idle_since=at)
            self.job.record("notice", data={"text": text, "idle_since": at.isoformat()})
            notifications.emit(
                "job.idle",
                team=self.job.team,
                job=self.job,
                data={"idle_since": at.isoformat(), "idle_minutes": minutes, "stop_if_idle": self.job.stop_if_idle},
            )
        if self.job.stop_if_idle:
            self.request_stop(
                Allocation.EARLY_STOP,
                states.STOPPED,
                f"idle for {minutes} minute{'s' if minutes != 1 else ''} (stop if idle): stopping it",
            )

    # Stopping ---------------------------------------------------------------------------------

    def signal_group(self, sig):
        """sig to the job's process group. In a sandbox that is the group of the job's own first
        process (bwrap gave it a session of its own); bwrap itself is never sent a SIGTERM, which
        would end the sandbox at once, with no grace."""
        group = self.process.pid
        if self.sandbox is not None and self.sandbox.isolation.sandboxed:
            self.group = self.group or sandbox_group(self.process.pid)
            if self.group is None:
                if sig == signal.SIGKILL:
                    self.sandbox.kill_all()
                return
            group = self.group
        try:
            os.killpg(group, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def request_stop(self, reason, state, message, release_at=None, on_metric=False):
        """on_metric: early stopping on the job's metric; the notice says so (and the best point
        so far), so that a recipe returns the weights of its best step itself."""
        if self.stop is not None:
            return
        log.info("stopping job %s: %s", self.job.pk, message)
        self.job.record("notice", data={"text": message})
        early_stop = stopping.early_stop_notice(self.watch.metric, self.watch.mode, self.watch.best()) if on_metric else None
        self.write_stop_file(message, early_stop)
        self.signal_group(signal.SIGTERM)
        self.stop = StopRequest(reason, state, message, time.monotonic(), release_at, on_metric=on_metric)

    def write_stop_file(self, message, early_stop=None):
        """The notice the SDK's should_stop() sees, written whole (temporary name, rename);
        early_stop: what a stop on the job's metric adds (stopping.early_stop_notice)."""
        content = {"reason": message, "deadline": time.time() + settings.E31_STOP_GRACE_SECONDS}
        if early_stop is not None:
            content["early_stop"] = early_stop
        notice = json.dumps(content).encode()
        # The runner may be root and the folder is the job's: every step refuses a symlink the
        # job put in its place, so the notice is never written anywhere else.
        opened = []
        try:
            opened.append(os.open(self.dirs.root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW))
            try:
                os.mkdir(self.dirs.control.name, 0o755, dir_fd=opened[0])
                if self.sandbox is not None and self.sandbox.uid is not None:  # the job writes its metrics there
                    os.chown(self.dirs.control.name, self.sandbox.uid, self.sandbox.uid, dir_fd=opened[0], follow_symlinks=False)
            except FileExistsError:
                pass
            control = os.open(self.dirs.control.name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=opened[0])
            opened.append(control)
            try:
                os.unlink(".stop.tmp", dir_fd=control)
            except FileNotFoundError:
                pass
            fd = os.open(".stop.tmp", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644, dir_fd=control)
            with open(fd, "wb") as partial:
                partial.write(notice)
            os.replace(".stop.tmp", self.dirs.stop_file.name, src_dir_fd=control, dst_dir_fd=control)
        except OSError:
            log.exception("could not write the stop notice of job %s", self.job.pk)
        finally:
            for fd in opened:
                os.close(fd)

    def enforce_limit(self, now, grace):
        """Stop the job so that it is down by the end of its span or ceiling: SIGTERM goes out a
        grace period before, and the meter is never run past the limit."""
        if self.limit_at is None or self.stop is not None:
            return
        if now >= self.limit_at - timedelta(seconds=grace) and self.smoke:
            # A script's smoke run passes if it has not failed in its time: it ends succeeded.
            message = f"the smoke run's time is up ({settings.E31_SMOKE_MINUTES:g} minutes at most) and it has not failed: it passes; stopping it"
            self.request_stop(Allocation.LIMIT, states.SUCCEEDED, message, release_at=self.limit_at)
        elif now >= self.limit_at - timedelta(seconds=grace):
            what = "span" if self.job.span_hours is not None else "ceiling"
            self.request_stop(Allocation.LIMIT, states.STOPPED, f"the job's {what} is reached: stopping it", release_at=self.limit_at)

    def escalate(self, grace):
        if self.stop is not None and self.exited_at is None and time.monotonic() - self.stop.term_sent_at >= grace:
            self.signal_group(signal.SIGKILL)

    def check_disk(self, now_monotonic, every):
        """Measure the job's folder every few seconds (on a thread of its own); a job over its
        disk limit is killed at once and ends failed, and its folder goes with it."""
        if self.sandbox is None or self.disk_pool is None or self.exited_at is not None or self.over_disk:
            return
        if self.disk_check is not None and self.disk_check.done():
            check, self.disk_check = self.disk_check, None
            try:
                used = check.result()
            except Exception:  # noqa: BLE001 - measured again next time
                log.exception("could not measure the folder of job %s", self.job.pk)
                used = 0
            limit = self.sandbox.limits.disk_bytes
            if used > limit:
                self.over_disk = True
                self.stop = None  # whatever else was asked of it, this is why it ends
                self.request_stop(Allocation.EXITED, states.FAILED, disk_message(limit))
                self.signal_group(signal.SIGKILL)
                self.sandbox.kill_all()
                return
        if self.disk_check is None and now_monotonic - self.disk_checked_at >= every:
            self.disk_checked_at = now_monotonic
            self.disk_check = self.disk_pool.submit(self.disk_taken)

    def disk_taken(self):
        """What the job takes of the disk: its folder, and the files it unlinked but holds open."""
        used = jobfiles.disk_used(self.dirs.root, self.sandbox.staged_inodes)
        return used + unlinked_open_bytes(self.sandbox.pids(), os.stat(self.dirs.root).st_dev)

    def poll(self):
        if self.exited_at is None and self.process.poll() is not None:
            self.exited_at = timezone.now()
            self.exited_monotonic = time.monotonic()
            # Whatever the job left behind goes with it: its process group, and every process
            # in its cgroup, of its uid, or (as a last resort) with its allocation in its environment.
            self.signal_group(signal.SIGKILL)
            if self.sandbox is not None:
                self.sandbox.kill_all()
        return self.exited_at is not None

    def ready_to_finish(self):
        """Exited, and every line it printed is stored (or its pipes outlived it too long)."""
        if self.exited_at is None or self.pending:
            return False
        if self.reader.done:
            return True
        return time.monotonic() - self.exited_monotonic > READER_JOIN_SECONDS

    def kill(self):
        self.signal_group(signal.SIGKILL)
        if self.sandbox is not None:
            self.sandbox.kill_all()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            log.error("job %s process %s did not die", self.job.pk, self.process.pid)
        if self.exited_at is None:
            self.exited_at = timezone.now()
            self.exited_monotonic = time.monotonic()

    # The end ------------------------------------------------------------------------------------

    def drain_output(self):
        """Store every line still in the pipes or the queue (the runner is stopping)."""
        deadline = time.monotonic() + READER_JOIN_SECONDS
        while not self.reader.done and time.monotonic() < deadline:
            if not self.pump():
                time.sleep(0.01)
        while self.pump():
            pass

    def outcome(self):
        """(allocation end reason, job state, reason text) from how the process ended."""
        code = self.process.returncode
        if code is not None and code > 128 and self.sandbox is not None and self.sandbox.isolation.sandboxed:
            code = -(code - 128)  # bwrap reports a job killed by signal N as 128 + N, as a shell does
        if self.stop is not None:
            return self.stop.reason, self.stop.state, self.stop.message
        if code == 0:
            return Allocation.EXITED, states.SUCCEEDED, "the process exited with code 0"
        how = f"was killed by signal {signal.Signals(-code).name}" if code is not None and code < 0 else f"exited with code {code}"
        out_of_memory = self.sandbox is not None and self.sandbox.oom_kills() > 0
        if out_of_memory:
            how = oom_message(self.sandbox.limits)
        elif code == -signal.SIGXFSZ and self.sandbox is not None:
            how = f"wrote a file larger than its limit ({self.sandbox.limits.file_bytes // 2**20} MB)"
        if self.allocation.gang_size > 1:
            # A rank failed: the whole gang stops and the job resumes from its latest checkpoint
            # (counted against its restarts).
            return (
                Allocation.EXITED,
                states.QUEUED,
                f"requeued: its processes on {self.allocation.node.name} (node {self.allocation.node_rank} of its gang) {how}; "
                "the whole gang stops and the job resumes from its latest checkpoint",
            )
        if out_of_memory:
            return Allocation.EXITED, states.FAILED, how
        return Allocation.EXITED, states.FAILED, f"the process {how}"

    def store_artifacts(self, prefix=""):
        """Keep every file of the output folder, each named with prefix before its path;
        returns (kept, [skipped name: why])."""
        storage = get_storage()
        kept, skipped = 0, []
        try:
            output = jobfiles.open_dir(self.dirs.root, self.dirs.output.relative_to(self.dirs.root))
        except OSError:
            if self.dirs.output.is_symlink():  # the job swapped its output folder for a link: nothing there is its output
                return kept, ["the output folder: it was replaced by a link"]
            return kept, skipped  # gone, or not a folder: no output
        try:
            # Every file read through a descriptor reached from the output folder's, one component
            # at a time: a subfolder swapped for a link (even after the look) is never entered,
            # and nothing but a regular file is read. The runner may be root.
            # What the outputs may add up to, by their length (not the disk they take: a sparse
            # file of 50 GB takes nothing on the job's disk and 50 GB in storage).
            room = self.sandbox.limits.disk_bytes if self.sandbox is not None else None
            for name, fd in jobfiles.regular_files(output):
                name = prefix + name
                problem = artifact_name_problem(name)
                length = os.fstat(fd).st_size
                if problem is None and room is not None and length > room:
                    problem = f"the outputs pass the job's disk limit ({self.sandbox.limits.disk_bytes / 1e9:.3g} GB) by their length"
                if problem:
                    skipped.append(f"{name!r}: {problem}")
                    continue
                if room is not None:
                    room -= length
                key = f"jobs/{self.job.pk}/artifacts/{name}"
                with open(fd, "rb", closefd=False) as source:
                    size, sha256 = storage.save(key, source)
                Artifact.objects.update_or_create(job=self.job, name=name, defaults={"key": key, "size": size, "sha256": sha256})
                kept += 1
        finally:
            os.close(output)
        return kept, skipped

    def keep_last_checkpoints(self):
        """The job has exited: upload what its checkpoint folder holds that is not up yet
        (the checkpoint it wrote when told to stop, say), and wait for every upload."""
        if self.keeper is None:
            return
        try:
            self.keeper.poll(time.monotonic(), final=True)
        except Exception:  # noqa: BLE001 - the job must still end
            log.exception("could not look at the checkpoints of job %s", self.job.pk)
        self.keeper.wait()

    def return_latest_checkpoint(self):
        """A job stopped by the network (ceiling, span, early stopping) that left no output
        files gets its latest checkpoint back as its output: the weights so far."""
        found = checkpoints.scan(self.dirs.checkpoints)
        if not found:
            return None
        name = max(found, key=lambda n: (found[n][1], checkpoints.step_of(n) or 0))
        artifact_name = f"checkpoints/{name}"
        key = f"jobs/{self.job.pk}/artifacts/{artifact_name}"
        try:
            # Read from the job's folder one component at a time: the folder swapped for a link
            # since the look (to another job's checkpoints, say) is not followed.
            fd = jobfiles.open_file(self.dirs.root, self.dirs.checkpoints.relative_to(self.dirs.root) / name)
        except OSError:
            return None
        with open(fd, "rb") as source:
            size, sha256 = get_storage().save(key, source)
        Artifact.objects.update_or_create(job=self.job, name=artifact_name, defaults={"key": key, "size": size, "sha256": sha256})
        return artifact_name

    def best_to_return(self):
        """(the best (step, value) of its metric, the kept checkpoint at or before that step) for
        a job stopped early on its metric; (None, None) for any other end."""
        best = self.watch.best() if self.stop is not None and self.stop.on_metric else None
        if best is None or self.job.recipe:
            # A recipe returns them itself, told by the stop notice (e31.recipes.common.fit): its
            # output is the best step's weights beside recipe.json (which a retraining and a
            # comparison need), LoRA merged, the last ones under last/, named in its log and its
            # metrics.json. Stored as they are.
            return None, None
        return best, checkpoints.best_kept(self.job.pk, best[0])

    def return_best(self, best, checkpoint, kept):
        """The job stopped early on its metric: its output is the checkpoint holding its best
        step (or the latest before it), named in the log and in metrics.json beside it; its own
        output files (kept: how many) are under last/ (store_artifacts)."""
        storage = get_storage()
        # The job chose the name: one an output file could not have is replaced.
        name = checkpoint.name if artifact_name_problem(checkpoint.name) is None else f"checkpoint-{checkpoint.step}"
        key = f"jobs/{self.job.pk}/artifacts/{name}"
        storage.copy(checkpoint.key, key)
        Artifact.objects.update_or_create(job=self.job, name=name, defaults={"key": key, "size": checkpoint.size, "sha256": checkpoint.sha256})
        metric, last_step = self.job.early_stop_metric, last_step_logged(self.job)
        values = metric_values_at(self.job, checkpoint.step)
        report = stopping.best_report(metric, self.job.early_stop_mode, best, name, checkpoint.step, values, last_step)
        key = f"jobs/{self.job.pk}/artifacts/metrics.json"
        size, sha256 = storage.save(key, io.BytesIO(json.dumps(report, indent=2).encode()))
        Artifact.objects.update_or_create(job=self.job, name="metrics.json", defaults={"key": key, "size": size, "sha256": sha256})
        text = stopping.returned_message(metric, best, name, checkpoint.step, last_step, last_kept=kept > 0)
        self.job.record("notice", data={"text": text, "checkpoint": name, "step": checkpoint.step})

    def finish(self):
        """After the process ended and its output is stored: keep its checkpoints and output
        files, stop the meter (at the moment it exited), set the state. Whatever goes wrong
        with the files, the compute is released and the job ends."""
        while self.pump():
            pass
        # The run's last line: what the log cap kept out. Pending, so a failed write is tried
        # again; given once, so a finish tried again does not repeat it.
        self.pending = self.log_budget.summary(timezone.now())
        self.pump()
        while self.read_metrics():
            pass
        if not self.over_disk:  # a job that filled its folder has nothing of it kept
            self.keep_last_checkpoints()
        reason, state, message = self.outcome()
        try:
            if state != states.QUEUED and not self.over_disk:  # a requeued run's outputs are not the job's output
                best, chosen = self.best_to_return()
                prefix = stopping.LAST if chosen is not None else ""
                kept, skipped = self.store_artifacts(prefix)
                if kept:
                    where = f" under {prefix}" if prefix else ""
                    self.job.record("notice", data={"text": f"kept {kept} output file{'s' if kept != 1 else ''}{where}"})
                for item in skipped:
                    self.job.record("notice", data={"text": f"output file not kept: {item}"})
                if chosen is not None:
                    self.return_best(best, chosen, kept)
                elif best is not None:
                    self.job.record("notice", data={"text": stopping.unmatched_message(self.job.early_stop_metric, best, kept > 0)})
                if chosen is None and not kept and reason in (Allocation.LIMIT, Allocation.EARLY_STOP):
                    returned = self.return_latest_checkpoint()
                    if returned:
                        self.job.record("notice", data={"text": f"no output files: its latest checkpoint is returned as {returned}"})
        except Exception as error:  # noqa: BLE001 - the job must still end and its compute be released
            log.exception("could not keep the outputs of job %s", self.job.pk)
            state, message = states.FAILED, f"its output files could not be kept: {error}"
        # The meter stops when the process ended (not after the outputs were copied), and never
        # later than the job's limit.
        release_at = self.exited_at
        if self.limit_at is not None:
            release_at = min(release_at, self.limit_at)
        self.end_utilization()
        end_allocation(self.allocation, release_at, reason, state, message, exit_code=self.process.returncode)
        self.cleanup()

    def end_utilization(self):
        """The last windows and the job's summary stored; the idle flag off. Never in the way
        of the job ending."""
        try:
            self.store_utilization(summary=True)
            if self.idle_flagged:
                Job.objects.filter(pk=self.job.pk).update(idle_since=None)
        except Exception:  # noqa: BLE001 - the chart is lost, the job still ends
            log.exception("could not store the utilization of job %s", self.job.pk)

    def cleanup(self):
        """Nothing of the job left on the node: its processes, its folder, its cgroup."""
        if self.sandbox is not None:
            self.sandbox.release()
        shutil.rmtree(self.dirs.root, ignore_errors=True)


def metric_values_at(job, step):
    """Every value the job logged at this step (the latest of each name), in all its runs."""
    values = {}
    for data in job.events.filter(kind="metric", data__step=step).order_by("seq").values_list("data", flat=True):
        if isinstance(data, dict) and data.get("step") == step and isinstance(data.get("values"), dict):
            values.update(data["values"])
    return values


def last_step_logged(job):
    """The step of the job's latest metric point that has one (None: none has)."""
    for data in job.events.filter(kind="metric").order_by("-seq").values_list("data", flat=True)[:1000]:
        step = data.get("step") if isinstance(data, dict) else None
        if isinstance(step, int) and not isinstance(step, bool):
            return step
    return None


def early_stop_watched(job):
    """(metric, mode) the network watches to stop the job early, or None."""
    return (job.early_stop_metric, job.early_stop_mode) if job.early_stop_metric and job.early_stop_patience else None


def metric_watch(job):
    """The job's early-stopping and NaN checks, primed with the points of its earlier runs."""
    watch = stopping.Watch(metric=job.early_stop_metric, mode=job.early_stop_mode, patience=job.early_stop_patience, stop_on_nan=job.stop_on_nan)
    if job.early_stop_metric and job.early_stop_patience:
        for data in job.events.filter(kind="metric").order_by("seq").values_list("data", flat=True).iterator():
            values = (data or {}).get("values", {})
            if job.early_stop_metric in values:
                watch.add(data.get("step"), {job.early_stop_metric: values[job.early_stop_metric]})
    return watch


def kill_leftover(pid, job_id):
    """Kill what a dead runner left of a job (its process group), if that process is still
    the job's: a reused pid belongs to someone else and is left alone."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False
    if f"E31_JOB_ID={job_id}".encode() not in environ:
        return False
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return False
    log.warning("killed the leftover processes of job %s (pid %s)", job_id, pid)
    return True


def own_allocations(node, names):
    """Of the cgroup names a runner found under its node's folder, those the database says are
    allocations of this node: the only leftovers it may kill."""
    ids = []
    for name in names:
        try:
            ids.append(uuid.UUID(name))
        except ValueError:
            continue
    return {str(pk) for pk in Allocation.objects.filter(node=node, pk__in=ids).values_list("pk", flat=True)}


def archive_log(job_id):
    """Keep a finished job's whole log as a file in storage, so downloads need not read the
    database (and can be ranged or presigned). Until it is there, downloads stream from the
    database, which stays the record."""
    try:
        job = Job.objects.get(pk=job_id)
        with tempfile.NamedTemporaryFile() as out:
            for chunk in stream_log(job):
                out.write(chunk.encode())
            out.flush()
            get_storage().save_file(log_key(job_id), out.name)
    except Exception:  # noqa: BLE001 - the database still has every line
        log.exception("could not archive the log of job %s", job_id)
    finally:
        connection.close()


class Runner:
    def __init__(self, name, devices, work_dir, device_type=None, cache_dir=None, cache_bytes=None, address=None):
        self.name = name
        self.address = address or settings.E31_RUNNER_ADDRESS
        self.devices = devices
        self.device_type = device_type or detect_device_type()
        self.work_dir = Path(work_dir)
        self.running = {}  # allocation id -> RunningJob
        self.node = None
        self.shutdown = False
        self.grace = settings.E31_STOP_GRACE_SECONDS
        self.max_line_bytes = settings.E31_LOG_LINE_MAX_BYTES
        self._heartbeat_stop = threading.Event()
        self._heartbeat_thread = None
        self.cache = BlobCache(
            Path(cache_dir or settings.RUNNER_CACHE_DIR / name),
            settings.E31_RUNNER_CACHE_BYTES if cache_bytes is None else cache_bytes,
            direct_io=settings.E31_STAGING_DIRECT_IO,
        )
        # Stagings run on threads of their own, so a long copy never holds up the jobs running here.
        self.staging_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="staging")
        self.stagings = {}  # staging id -> future
        self._cache_lock = threading.Lock()
        # Checkpoint uploads, so a training run never waits for its checkpoint to reach storage.
        self.upload_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="checkpoint")
        self.spool = self.work_dir / ".spool"
        # What this node can do to keep jobs apart (a user each, limits, no network): probed at
        # registration; each mechanism a no-op, with a log line, where it cannot work.
        self.isolation = Isolation(name, self.work_dir, self.cache.root, settings)
        self.env_root = self.cache.root.with_name(self.cache.root.name + ".envs")
        self._published_envs = set()
        self.disk_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="disk")

    @cached_property
    def envs(self):
        """The node's job environments (made when a job first asks for packages)."""
        import site

        from uv import find_uv_bin

        source_builds = None
        if settings.E31_ENV_SOURCE_BUILDS:
            # A package built from source runs its own code: in a sandbox, as a uid of the pool.
            def source_builds(command, folder, env, read_only, timeout):
                return self.isolation.run_untrusted(
                    "env-build",
                    command,
                    folder,
                    env,
                    read_only=read_only,
                    timeout=timeout,
                    network=not settings.E31_ENV_NO_INDEX,
                )

        return EnvironmentCache(
            self.env_root,
            settings.E31_ENV_CACHE_BYTES,
            uv=find_uv_bin(),
            python=sys.executable,
            base_sites=site.getsitepackages(),
            index=index_arguments(settings),
            timeout=settings.E31_ENV_BUILD_SECONDS,
            source_builds=source_builds,
        )

    def prepare_environment(self, job, announce_cached=True):
        """The job's environment on this node, built now if it is not here (None: it asked for
        no packages). Raises BuildError with the resolver's message. announce_cached:
        say so on the job page when it was here already (at launch it was said when staged)."""
        requirements = requirements_of(job)
        if not requirements:
            return None
        in_use = {r.env_key for r in self.running.values() if r.env_key}
        started = time.monotonic()
        if not self.envs.lookup(requirements):
            job.record("notice", data={"text": f"building on {self.name}: {len(requirements)} requirement(s)", "environment": ""})
        key, built = self.envs.ensure(requirements, keep=in_use)
        if built:
            self.publish_environments()
        resolved = self.envs.resolved(key)
        if not built and not announce_cached:
            return key
        how = f"built in {time.monotonic() - started:.1f} s" if built else "from this node's cache"
        job.record("notice", data={"text": f"ready ({how}): {' '.join(resolved) or 'nothing beyond the runtime'}", "environment": key})
        return key

    def publish_environments(self):
        """Tell the scheduler which environments this node holds (as cached blobs under their
        packages digest), so it lines jobs that ask the same up here; and which it no longer does."""
        if not self.env_root.is_dir():
            return
        held = self.envs.held()
        with self._cache_lock:
            gone = self._published_envs - set(held)
            if gone:
                CachedBlob.objects.filter(node=self.node, sha256__in=gone).delete()
            for digest, size in held.items():
                CachedBlob.objects.update_or_create(node=self.node, sha256=digest, defaults={"size": size})
            self._published_envs = set(held)

    # Registration and heartbeats ----------------------------------------------------------------

    def register(self):
        now = timezone.now()
        node = Node.objects.filter(name=self.name).first()
        if node is not None and node.stopped_at is None and Node.objects.live(now).filter(pk=node.pk).exists():
            age = (now - node.last_heartbeat).total_seconds()
            raise RuntimeError(f"a runner named {self.name!r} is already running (heartbeat {age:.0f} s ago)")
        last_seen = node.last_heartbeat if node is not None else now
        # The node's unique id keys its cgroups (two systems on one machine may both name their
        # runner "local"). Checked before the node is offered: a runner that cannot sandbox its
        # jobs refuses to start rather than take any.
        key = node.pk if node is not None else uuid.uuid4()
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.isolation.probe(key)
        if node is not None:
            for pid, job_id in Allocation.objects.filter(node=node, ended_at__isnull=True, pid__isnull=False).values_list("pid", "job_id"):
                kill_leftover(pid, job_id)
        fields = {
            "hostname": socket.gethostname(),
            "address": self.address,
            "device_type": self.device_type,
            "devices": self.devices,
            "registered_at": now,
            "last_heartbeat": now,
            "lost_at": None,
            "stopped_at": None,
        }
        node, _ = Node.objects.update_or_create(name=self.name, defaults=fields, create_defaults={**fields, "id": key})
        self.node = node
        # Allocations left open by an earlier runner of this node died with it: they end when it
        # was last heard from, and their jobs go back to the queue.
        release_node(node, at=last_seen, reason=Allocation.RUNNER_STOPPED, why="its runner restarted")
        # Stagings the earlier runner had begun start again (what reached the cache stays there).
        Staging.objects.filter(node=node, state=Staging.STAGING).update(state=Staging.WAITING)
        # What the cache holds, as the scheduler sees it.
        CachedBlob.objects.filter(node=node).delete()
        CachedBlob.objects.bulk_create([CachedBlob(node=node, sha256=sha, size=size) for sha, size in self.cache.sizes.items()], batch_size=500)
        self.isolation.kill_leftovers(own_allocations(node, self.isolation.cgroups.leftovers()))
        self.publish_environments()
        return node

    def heartbeat(self):
        now = timezone.now()
        Node.objects.filter(pk=self.node.pk).update(last_heartbeat=now, lost_at=None)
        Allocation.bring_usage_up_to_date(self.node.pk, now)

    def start_heartbeats(self):
        """Heartbeat on a thread of its own, so a long copy in the main loop cannot make the
        node look lost."""

        def beat():
            while not self._heartbeat_stop.wait(settings.E31_HEARTBEAT_SECONDS):
                try:
                    self.heartbeat()
                except Exception:  # noqa: BLE001 - a missed beat is retried on the next one
                    log.exception("heartbeat failed")
                    connection.close()
            connection.close()

        self._heartbeat_thread = threading.Thread(target=beat, name="heartbeat", daemon=True)
        self._heartbeat_thread.start()

    def stop_heartbeats(self):
        self._heartbeat_stop.set()
        if self._heartbeat_thread is not None:
            self._heartbeat_thread.join(5)

    # Launching ----------------------------------------------------------------------------------

    def launch_new(self):
        """Launch the allocations the scheduler placed on this node, one claimed at a time: an
        allocation that cannot be launched is released at once, never left holding compute."""
        fresh = Allocation.objects.filter(node=self.node, launched_at__isnull=True, ended_at__isnull=True)
        for allocation in fresh.select_related("job", "node"):
            if allocation.gang and allocation.node_rank > 0 and not allocation.rendezvous:
                continue  # node 0's runner has not opened the gang's rendezvous yet
            if Allocation.objects.filter(pk=allocation.pk, launched_at__isnull=True).update(launched_at=timezone.now()) != 1:
                continue
            try:
                self.launch(allocation)
            except Exception as error:  # noqa: BLE001 - whatever it was, the compute goes back
                log.exception("job %s could not start", allocation.job_id)
                end_allocation(allocation, timezone.now(), Allocation.START_FAILED, states.FAILED, f"could not start: {error}")

    def launch(self, allocation):
        job = Job.objects.get(pk=allocation.job_id)
        if job.cancel_requested_at is not None:
            end_allocation(allocation, timezone.now(), Allocation.CANCELLED, states.CANCELLED, "cancelled before its process started")
            return None
        dirs = JobDirs(self.work_dir / f"{job.pk}-{str(allocation.pk)[:8]}")
        process = None
        sandbox = None
        try:
            linked = self.stage(job, dirs)
            is_smoke = self.cut_for_smoke(job, dirs)
            watch = metric_watch(job)
            # A recipe returns its best weights itself when the network stops it early on its
            # metric: the checkpoint holding them goes back too, if it is not the latest.
            best = watch.best() if job.recipe else None
            restored = checkpoints.restore(job, dirs.checkpoints, best_step=best[0] if best else None)
            if restored is not None:
                at = f" (step {restored.step})" if restored.step is not None else ""
                job.record("resume", data={"name": restored.name, "step": restored.step, "text": f"resumed from {restored.name}{at}"})
            keeper = checkpoints.CheckpointKeeper(job, allocation, dirs.checkpoints, self.spool / str(allocation.pk), self.upload_pool, self.name)
            keeper.ignore_existing()
            gang = self.gang_of(allocation)
            sandbox = self.isolation.sandbox(allocation, job, gang)
            sandbox.prepare(dirs)  # the folder handed to the job's user, its cgroup made
            keeper.max_bytes = sandbox.limits.disk_bytes
            self.unpack_work(sandbox, dirs)
            processes = process_count(job.processes, len(allocation.devices), allocation.device_type)
            torchrun = uses_torchrun(processes, gang)
            cwd, script = self.working_folder(job, dirs)
            env_key = self.prepare_environment(job, announce_cached=False)  # ready here already, unless not staged here
            python = str(self.envs.python_of(env_key)) if env_key else sys.executable
            if env_key:
                self.envs.touch(env_key)
                sandbox.runtime = (str(self.envs.path(env_key)),)
            env = build_environment(
                job_id=job.pk,
                dirs=dirs,
                devices=allocation.devices,
                device_type=allocation.device_type,
                declared=job.env,
                config=job.config,
                restart=job.restarts,
                python=python,
                hyperparameters=job.hyperparameters,
                processes=processes,
                precision=job.precision,
                inputs=input_names(job),
                early_stop=early_stop_watched(job),
            )
            env["E31_ALLOCATION_ID"] = str(allocation.pk)
            if is_smoke:
                env["E31_SMOKE"] = "1"
            if torchrun:
                env["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"] = RANK_PREFIX_TEMPLATE
            if not self.isolation.enabled:
                job.record("notice", data={"text": UNISOLATED_NOTICE, "isolation": "off"})
            argv, outer_env, fds = sandbox.command(
                job_command(job, script, python=python, processes=processes, gang=gang, log_dir=dirs.tmp / "torchrun", env=env),
                dirs,
                env,
                cwd=cwd,
            )
            try:
                process = subprocess.Popen(
                    argv,
                    cwd=cwd,
                    env=outer_env,
                    pass_fds=fds,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    start_new_session=True,  # its own process group: signals reach all of it, and only it
                )
            finally:
                for fd in fds:
                    os.close(fd)
            sandbox.connect(process.pid)  # a job given the network: its uplink, before it runs
            # Running only if the allocation is still ours: the node may have been declared
            # lost (and the job requeued) while we staged.
            with transaction.atomic():
                if not Allocation.objects.select_for_update().filter(pk=allocation.pk, ended_at__isnull=True).exists():
                    raise AllocationGone()
                Allocation.objects.filter(pk=allocation.pk).update(pid=process.pid)
                # The first node of a gang to start its processes marks the job running.
                if Job.objects.select_for_update().get(pk=job.pk).state == states.STARTING:
                    job.mark_running()
        except AllocationGone:
            log.warning("allocation %s ended while its job was starting; stopping it", allocation.pk)
            _kill_group(process)
            _release(sandbox)
            shutil.rmtree(dirs.root, ignore_errors=True)
            return None
        except BaseException:
            _kill_group(process)
            _release(sandbox)
            shutil.rmtree(dirs.root, ignore_errors=True)
            raise
        running = RunningJob(
            allocation,
            process,
            dirs,
            self.max_line_bytes,
            keeper=keeper,
            watch=watch,
            ranked=torchrun,
            sandbox=sandbox,
            disk_pool=self.disk_pool,
        )
        running.linked = linked  # the cache's files the job saw: checked when it ends
        running.env_key = env_key
        running.smoke = is_smoke
        self.running[allocation.pk] = running
        return running

    @staticmethod
    def working_folder(job, dirs):
        """(the folder the job starts in, its entrypoint's path from there): the entrypoint's
        own folder, or the job's workdir, inside its code (checked after unpacking: no link out)."""
        relative = working_folder(job.entrypoint, job.workdir)
        code = dirs.code.resolve()
        cwd = (code / relative).resolve() if relative else code
        if not cwd.is_dir() or (cwd != code and code not in cwd.parents):
            raise ValueError(f"the working folder {relative!r} is not a folder of the job's code")
        if job.command or job.entrypoint.startswith(Job.RECIPE_PREFIX):
            return cwd, job.entrypoint
        return cwd, os.path.relpath(code / job.entrypoint, cwd)

    def unpack_work(self, sandbox, dirs):
        """Unpack the job's archive into its code folder, in its sandbox, as its uid, under its
        limits: a zip bomb fills only its own folder, and stops at the archive limit."""
        folder = dirs.root / WORK_ARCHIVES
        if not folder.is_dir():
            return
        max_bytes, max_entries = archive.limits()
        max_bytes = min(max_bytes, sandbox.limits.disk_bytes)
        for path in sorted(folder.iterdir()):
            command = [sys.executable, "-I", "-S", UNPACKER, str(path), path.name, str(dirs.code), str(max_bytes), str(max_entries)]
            argv, env, fds = sandbox.command(command, dirs, {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})
            try:
                result = subprocess.run(
                    argv,
                    env=env,
                    pass_fds=fds,
                    cwd=dirs.root,
                    stdin=subprocess.DEVNULL,
                    capture_output=True,
                    timeout=UNPACK_SECONDS,
                )
            except subprocess.TimeoutExpired:
                raise archive.ArchiveError(f"unpacking the work took longer than {UNPACK_SECONDS} s") from None
            finally:
                for fd in fds:
                    os.close(fd)
                sandbox.kill_all()
            if result.returncode != 0:
                why = (result.stderr.decode(errors="replace").strip().splitlines() or [f"exit {result.returncode}"])[-1]
                raise archive.ArchiveError(f"the work could not be unpacked: {why.removeprefix('e31: ')}")
        shutil.rmtree(folder)

    def gang_of(self, allocation):
        """The torchrun view of an allocation's gang (None for a run on one node). Node 0's
        runner opens the rendezvous: a free port on its address, told to the other nodes."""
        if not allocation.gang:
            return None
        if allocation.node_rank == 0:
            with socket.socket() as probe:
                probe.bind(("" if self.address not in ("127.0.0.1", "localhost") else self.address, 0))
                port = probe.getsockname()[1]
            endpoint = f"{self.address}:{port}"
            Allocation.objects.filter(gang=allocation.gang).update(rendezvous=endpoint)
        else:
            endpoint = allocation.rendezvous
        return Gang(
            nodes=allocation.gang_size,
            endpoint=endpoint,
            run_id=str(allocation.gang),
            is_host=allocation.node_rank == 0,
            rank=allocation.node_rank,
        )

    def stage(self, job, dirs):
        """Put the work, the config and the data in the job's folder, from the cache. Data the
        cache lacks (the job was not staged here beforehand) is staged now, while the meter runs."""
        items = job_manifest(job)
        missing = [item for item in items if not self.cache.has(item.sha256)]
        if missing:
            record = Staging.objects.create(
                job=job,
                node=self.node,
                state=Staging.STAGING,
                started_at=timezone.now(),
                files_total=len(items),
                bytes_total=sum(i.size for i in items),
            )
            self.run_staging(record.pk, queued=False)
            record.refresh_from_db()
            if record.state != Staging.STAGED:
                raise StagingError(record.error or "staging failed")
        dirs.create()
        dirs.config.write_text(json.dumps(job.config, indent=2))
        linked = set()
        for item in items:
            if item.role == "code" and archive.kind_of(item.dest) == "script":
                shutil.copyfile(self.cache.path(item.sha256), dirs.code / PurePosixPath(item.dest).name)
            elif item.role == "code":
                # An archive is unpacked later, in the job's sandbox as its uid (unpack_work),
                # never by the runner: here it is only linked in, read-only, as staged data is.
                self.cache.link_into(item.sha256, dirs.root / WORK_ARCHIVES / PurePosixPath(item.dest).name)
                linked.add(item.sha256)
            else:
                self.cache.link_into(item.sha256, dirs.root / item.dest)
                linked.add(item.sha256)
        return linked

    @staticmethod
    def cut_for_smoke(job, dirs):
        """A script's smoke run sees a sample of its staged inputs (scheduler/smoke.py), said in
        its log; True for one, False for any other job (a recipe cuts its own data)."""
        if job.recipe or not lineage.is_smoke_run(job):
            return False
        sample = smoke.cut(dirs.root, [item.dest for item in job_manifest(job)], seed=job.pk)
        minutes = f"{settings.E31_SMOKE_MINUTES:g}"
        text = f"smoke run: a sample of its data ({smoke.describe(sample)}), E31_SMOKE=1, at most {minutes} minutes; it passes if it has not failed by then"
        job.record("notice", data={"text": text})
        return True

    # Staging --------------------------------------------------------------------------------------

    def claim_stagings(self):
        """Stage the data of jobs the scheduler lined up for this node, while they wait."""
        for pk in Staging.objects.filter(node=self.node, state=Staging.WAITING).values_list("pk", flat=True):
            claimed = Staging.objects.filter(pk=pk, state=Staging.WAITING).update(state=Staging.STAGING, started_at=timezone.now())
            if claimed == 1:
                self.stagings[pk] = self.staging_pool.submit(self._staging_thread, pk)
        for pk, future in list(self.stagings.items()):
            if future.done():
                del self.stagings[pk]
                if future.exception() is not None:
                    log.error("staging %s crashed", pk, exc_info=future.exception())

    def _staging_thread(self, pk):
        try:
            self.run_staging(pk)
        finally:
            connection.close()

    LEFT_THE_QUEUE = "the job left the queue (it started on another node that staged it, or was cancelled)"

    def run_staging(self, pk, queued=True):
        """Stage one job's manifest into the cache, reporting progress; the job fails, uncharged,
        if an object is missing or corrupt. A staging of a queued job is given up when the job
        leaves the queue (queued=False: the job is starting here and stages now)."""
        record = Staging.objects.select_related("job", "node").get(pk=pk)
        job = record.job
        if queued and job.state != states.QUEUED:
            Staging.objects.filter(pk=pk).update(state=Staging.ABANDONED, finished_at=timezone.now(), error=self.LEFT_THE_QUEUE)
            return
        items = job_manifest(job)
        versions = (job.train_version, job.heldout_version, *(i.version for i in job.inputs.select_related("version__dataset")))
        datasets = {str(v.dataset_id): v.dataset for v in versions if v is not None}
        throttle = Throttle(0.5)
        known = set(self.cache.sizes)
        gone = []  # the job left the queue: started on another node that staged it, or cancelled

        def on_progress(progress):
            if throttle.ready():
                Staging.objects.filter(pk=pk).update(files_done=progress.files_done, bytes_done=progress.bytes_done, bytes_moved=progress.bytes_moved)
                if queued and not Job.objects.filter(pk=job.pk, state=states.QUEUED).exists():
                    gone.append(True)
                    return
                job.record("staging", data=self._staging_event(record, progress))

        try:
            progress = stage(
                items,
                self.cache,
                datasets,
                workers=settings.E31_STAGING_WORKERS,
                on_progress=on_progress,
                should_stop=lambda: self.shutdown or bool(gone),
            )
            try:
                self.prepare_environment(job)  # while it waits: not billed
            except BuildError as error:
                raise StagingError(f"its environment could not be built: {error}") from None
        except StagingError as error:
            if self.shutdown:
                Staging.objects.filter(pk=pk).update(state=Staging.WAITING)  # the next runner here starts again
                return
            if gone:
                Staging.objects.filter(pk=pk).update(state=Staging.ABANDONED, finished_at=timezone.now(), error=self.LEFT_THE_QUEUE)
                return
            now = timezone.now()
            # One transaction: the scheduler never sees a queued job whose staging failed (it
            # would line it up again).
            with transaction.atomic():
                locked = Job.objects.select_for_update().get(pk=job.pk)
                Staging.objects.filter(pk=pk).update(state=Staging.FAILED, finished_at=now, error=str(error)[:2000])
                record.refresh_from_db()
                job.record("staging", data=record.progress())
                if locked.state == states.QUEUED:
                    locked.finish(states.FAILED, reason=f"staging failed: {error}")
            return
        finally:
            self.publish_cache(known)
        now = timezone.now()
        Staging.objects.filter(pk=pk).update(
            state=Staging.STAGED,
            finished_at=now,
            files_done=progress.files_done,
            bytes_done=progress.bytes_done,
            bytes_moved=progress.bytes_moved,
        )
        record.refresh_from_db()
        job.record("staging", data=record.progress())

    @staticmethod
    def _staging_event(record, progress):
        seconds = (timezone.now() - record.started_at).total_seconds() if record.started_at else None
        return {
            "state": Staging.STAGING,
            "node": record.node.name,
            "files_done": progress.files_done,
            "files_total": progress.files_total,
            "bytes_done": progress.bytes_done,
            "bytes_total": progress.bytes_total,
            "bytes_moved": progress.bytes_moved,
            "seconds": round(seconds, 3) if seconds is not None else None,
            "throughput": round(progress.bytes_moved / seconds) if seconds else None,
            "error": "",
        }

    def publish_cache(self, known_before):
        """Tell the scheduler what the cache gained, evict what it must, and tell that too."""
        with self._cache_lock:
            added = {sha: size for sha, size in self.cache.sizes.items() if sha not in known_before}
            CachedBlob.objects.bulk_create(
                [CachedBlob(node=self.node, sha256=sha, size=size) for sha, size in added.items()],
                ignore_conflicts=True,
                batch_size=500,
            )
            removed = self.cache.evict(protect=self.needed_digests())
            if removed:
                CachedBlob.objects.filter(node=self.node, sha256__in=removed).delete()

    def needed_digests(self):
        """Files jobs staged, staging or running here still need: never evicted."""
        jobs = Job.objects.filter(stagings__node=self.node, stagings__state__in=Staging.LIVE, state__in=states.ACTIVE).distinct()
        needed = set()
        for job in list(jobs) + [r.job for r in self.running.values()]:
            needed |= manifest_digests(job_manifest(job))
        return needed

    # The loop -------------------------------------------------------------------------------------

    def check_orders(self):
        """Cancellations asked for, and allocations ended elsewhere (node declared lost)."""
        if not self.running:
            return
        rows = Allocation.objects.filter(pk__in=list(self.running)).values_list(
            "pk", "ended_at", "job__cancel_requested_at", "preempt_requested_at", "gang", "job__state"
        )
        rows = list(rows)
        gangs = [gang for *_, gang, _ in rows if gang]
        broken = set(Allocation.objects.filter(gang__in=gangs, ended_at__isnull=False).values_list("gang", flat=True)) if gangs else set()
        for pk, ended_at, cancel_requested_at, preempt_requested_at, gang, job_state in rows:
            running = self.running[pk]
            if ended_at is None and gang in broken and job_state != states.SUCCEEDED:
                # Another node of the gang ended (failed, lost, stopped): the gang lives and dies
                # as one, so this part stops too (its job was already requeued or ended there).
                running.request_stop(Allocation.GANG_STOPPED, states.QUEUED, "another node of its gang stopped: stopping this one too")
                continue
            if ended_at is not None:
                log.warning("allocation %s was ended elsewhere; killing its process", pk)
                running.kill()
                running.reader.join(READER_JOIN_SECONDS)
                running.cleanup()
                del self.running[pk]
            elif cancel_requested_at is not None:
                running.request_stop(Allocation.CANCELLED, states.CANCELLED, "cancelled by the team")
            elif preempt_requested_at is not None:
                running.request_stop(Allocation.PREEMPTED, states.QUEUED, "preempted: checkpoint now; the job goes back to the queue and resumes")

    def step(self):
        """One pass over the node's work; returns True if there is more output waiting."""
        self.claim_stagings()
        self.launch_new()
        self.check_orders()
        now = timezone.now()
        busy = False
        for pk, running in list(self.running.items()):
            try:
                busy |= self.step_one(pk, running, now)
            except Exception:  # noqa: BLE001 - one job's trouble must not stall the others
                log.exception("runner step failed for job %s", running.job.pk)
        return busy

    def step_one(self, pk, running, now):
        busy = running.pump()
        busy |= running.read_metrics()
        if running.keeper is not None and running.exited_at is None:
            running.keeper.poll(time.monotonic())
        if not running.poll():
            running.enforce_limit(now, self.grace)
            running.escalate(self.grace)
            running.check_disk(time.monotonic(), settings.E31_JOB_DISK_CHECK_SECONDS)
            running.sample(time.monotonic())
            running.tick(time.monotonic())
        elif running.ready_to_finish():
            # Lines still coming out of the pipes are stored over the next steps, so a job that
            # printed a lot does not hold up the rest of the node while it drains.
            running.finish()
            del self.running[pk]
            dropped = self.cache.check(running.linked)
            if dropped:
                CachedBlob.objects.filter(node=self.node, sha256__in=dropped).delete()
            self.staging_pool.submit(archive_log, running.job.pk)
        return busy

    def stop_all(self, reason=Allocation.RUNNER_STOPPED):
        """The runner is going away: stop every job, release its compute, and requeue it."""
        for running in self.running.values():
            running.request_stop(reason, states.QUEUED, "the runner is stopping; the job goes back to the queue")
        deadline = time.monotonic() + self.grace
        while any(r.process.poll() is None for r in self.running.values()) and time.monotonic() < deadline:
            time.sleep(0.05)
        for running in self.running.values():
            running.kill()
            try:
                running.drain_output()
                running.keep_last_checkpoints()
                running.end_utilization()
                end_allocation(running.allocation, running.exited_at, reason, states.QUEUED, "requeued: its runner stopped")
            except Exception:  # noqa: BLE001 - the next runner of this node releases what is left
                log.exception("could not release job %s while stopping", running.job.pk)
            running.cleanup()
        self.running.clear()
        self.shutdown = True  # stagings in progress stop between files and go back to waiting
        self.staging_pool.shutdown(wait=True, cancel_futures=True)
        self.upload_pool.shutdown(wait=True)
        self.disk_pool.shutdown(wait=False, cancel_futures=True)
        self.isolation.cgroups.remove_runner()
        if self.node is not None:
            Staging.objects.filter(node=self.node, state=Staging.STAGING).update(state=Staging.WAITING)
            Node.objects.filter(pk=self.node.pk).update(stopped_at=timezone.now())

    def run(self, interval=0.1):
        if self.node is None:
            self.register()
        self.start_heartbeats()
        try:
            while not self.shutdown:
                try:
                    busy = self.step()
                except Exception:
                    # A database hiccup must not take the node's jobs down: log it, reconnect,
                    # and go on; every step can be repeated.
                    log.exception("runner step failed")
                    connection.close()
                    busy = False
                    time.sleep(1)
                if not busy:
                    time.sleep(interval)
        finally:
            self.stop_all()
            self.stop_heartbeats()
