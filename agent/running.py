"""A job running on a node: its process, its output and metrics, its meter, its stopping and
its end.

agent.runner.Runner launches a job's process and keeps a RunningJob for it until it ends.
The RunningJob owns everything about that one process from then on: it stores every line the
process prints with a sequence number before it is announced (agent.logcap caps the log)
and every metric point it writes, ticks the meter once a second while compute is held, samples
its devices (the idle watch), stops it (its span or ceiling, early stopping, a cancellation, a
full disk: SIGTERM, the grace period, SIGKILL), and once it has exited keeps its checkpoints and
output files, stops the meter and sets the job's state. It stays one file, over 500 lines,
because those steps share the one process's state (the stop asked for, when it exited, the
lines still pending, the metric watch, its sandbox): split, each part would need all of it.
"""

import io
import json
import logging
import os
import queue
import re
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from agent import checkpoints, jobfiles, sampling, stopping
from agent.isolation import disk_message, oom_message, sandbox_group, unlinked_open_bytes
from agent.logcap import LogBudget
from core.storage import get_storage
from jobs import live, states, utilization
from jobs.launch import artifact_name_problem
from jobs.logs import stored_bytes
from jobs.models import Artifact, Job, JobEvent, Utilization
from notifications import events as notifications
from scheduler.allocations import end_allocation, waits_for_node_zero
from scheduler.models import Allocation

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

RANKED_LINE = re.compile(r"^\[rank(\d{1,9})\]:")  # torchrun's mark: a rank, not a number to overflow a column


class OutputReader:
    """Reads a process's stdout and stderr line by line on two threads into one queue.

    ranked: the process is torchrun, which marks each worker's line "[rankN]:"; the mark is
    taken off and kept as the line's rank. wake: an Event set when a pipe has been read to its end
    (the runner's loop, waiting for its next turn, then finishes the job at once)."""

    def __init__(self, process, max_line_bytes, ranked=False, wake=None):
        self.ranked = ranked
        self.wake = wake
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
            if self.wake is not None:
                self.wake.set()

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


class ExitClock:
    """When a process exited, to the moment: a thread waits on it, and the meter stops at the
    exit, not at the moment the runner's loop noticed it. wake: an Event set at the exit, which
    ends the loop's wait for its next turn (on a cluster engine the meter runs until the agent
    is done with the job: a tenth of a second slept through there was billed)."""

    def __init__(self, process, wake=None):
        self.process = process
        self.wake = wake
        self.stamp = None  # (datetime, monotonic) just after the process was reaped
        threading.Thread(target=self._wait, daemon=True, name=f"exit-{process.pid}").start()

    def _wait(self):
        self.process.wait()
        self.stamp = (timezone.now(), time.monotonic())
        if self.wake is not None:
            self.wake.set()

    def exited(self):
        """(datetime, monotonic) of the exit, or None while it runs. An exit reaped by another
        caller just now, before the thread stamped it, is stamped now."""
        if self.process.poll() is None:
            return None
        return self.stamp or (timezone.now(), time.monotonic())


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
    held_until_done = False  # on a cluster engine: the meter stops when the agent is done (finish)

    def __init__(self, allocation, process, dirs, max_line_bytes, keeper=None, watch=None, ranked=False, sandbox=None, disk_pool=None, wake=None):
        self.linked = set()  # digests of the cache's files hard-linked into its folder
        self.group = None  # the process group of the job inside its sandbox (found when first signalled)
        self.env_pin = None  # holds its environment against eviction while it runs (EnvironmentCache.pin)
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
        self.reader = OutputReader(process, max_line_bytes, ranked=ranked, wake=wake)
        self.exit_clock = ExitClock(process, wake=wake)
        self.stop = None
        self.smoke = False  # a script's smoke run: reaching its limit is a pass
        self.exited_at = None
        self.exited_monotonic = None
        self.last_tick = 0.0
        self.pending = []  # lines taken from the reader, not yet committed
        self.pending_metrics = None  # (points, bytes read, rest): points parsed, not yet committed
        self.tried = {}  # lines or metrics: the last seq stored when its store raised (it may have committed all the same)
        self.stored_seq = allocation.job.last_seq or 0  # at or past the last seq this runner stored
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
        self.store("lines", self.pending, JobEvent.append_lines)
        self.pending = []
        return more

    def store(self, what, events, append):
        """Store a batch of the job's events with append(job, events), exactly once: a store
        that raised may have committed (JobEvent.stored_batch), so its retry asks first."""
        last = None
        if what in self.tried:
            # Looked for after what was stored when it first raised: lines stored since (the other
            # kind's store runs between tries) may have come after it.
            last = JobEvent.stored_batch(self.job.pk, self.tried[what], events)
            if last is not None:
                live.announce(self.job.pk, last)  # the try that raised announced nothing
        if last is None:
            self.tried.setdefault(what, self.stored_seq)
            last = append(self.job.pk, events)
        self.tried.pop(what, None)
        if last is not None:
            self.stored_seq = max(self.stored_seq, last)

    def read_metrics(self, limit=METRICS_READ_BYTES):
        """Store the metric points the job wrote since the last call, and stop the job if a
        point says so (early stopping, a NaN loss). True if there may be more to read."""
        if self.keeper is not None:
            self.keeper.watch = self.watch  # the checkpoint of the best step is never pruned
        if self.pending_metrics is None:
            self.pending_metrics = self.parse_metrics(limit)
            if self.pending_metrics is None:
                return False
        points, read, rest = self.pending_metrics
        # New instances at each try: a failed bulk_create may have given the last ones keys.
        self.store("metrics", [JobEvent(kind="metric", at=at, data={"step": step, "values": values}) for step, at, values in points], JobEvent.append)
        # Only now, with the points stored, is the file read this far.
        self.pending_metrics = None
        self.metrics_pos += read
        self.metrics_rest = rest
        for step, _, values in points:
            verdict = self.watch.add(step, values)
            if verdict is not None and self.stop is None:
                state = states.FAILED if verdict.failed else states.SUCCEEDED
                self.request_stop(Allocation.EARLY_STOP, state, verdict.message, on_metric=not verdict.failed)
        return read == limit

    def parse_metrics(self, limit):
        """The metric points the job wrote since the last store, as (points, bytes read, what
        is left of a line not yet ended), or None if it wrote nothing. They are kept until they
        are stored: a store that raised is retried with the same events, times and all."""
        try:
            # Not through a link the job put in any part of the path (its .e31 folder swapped
            # for a link to another job's), only a regular file, never blocking on a pipe.
            fd = jobfiles.open_file(self.dirs.root, self.dirs.metrics.relative_to(self.dirs.root))
        except OSError:
            return None
        with open(fd, "rb") as source:
            source.seek(self.metrics_pos)
            chunk = source.read(limit)
        if not chunk:
            return None
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
        return points, len(chunk), rest

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
        if self.exited_at is None and (exited := self.exit_clock.exited()) is not None:
            self.exited_at, self.exited_monotonic = exited
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
        # later than the job's limit. On a cluster engine the compute is the engine's to hold
        # until our agent ends, and what it holds is what is billed (and reconciled with its
        # accounting): then the meter stops now.
        if self.held_until_done and waits_for_node_zero(self.allocation, state):
            self.hold_with_node_zero()
        release_at = timezone.now() if self.held_until_done else self.exited_at
        if self.limit_at is not None:
            release_at = min(release_at, self.limit_at)
        self.end_utilization()
        end_allocation(self.allocation, release_at, reason, state, message, exit_code=self.process.returncode)
        self.cleanup()

    def hold_with_node_zero(self, poll=0.2):
        """On a cluster engine a gang is one engine job over its nodes: the engine holds this node
        until node 0's part has ended (and its agent exited), and so does the meter. Waits for it,
        or for this part to be ended for it (the scheduler, from the engine's word), or its limit."""
        gang = Allocation.objects.filter(gang=self.allocation.gang)
        while gang.filter(node_rank=0, ended_at__isnull=True).exists() and gang.filter(pk=self.allocation.pk, ended_at__isnull=True).exists():
            if self.limit_at is not None and timezone.now() >= self.limit_at:
                return
            time.sleep(poll)

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
        if self.env_pin is not None:
            self.env_pin.close()


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
