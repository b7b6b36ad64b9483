"""The runner: the agent of one node. It holds the node's devices, runs the jobs placed on it,
and reports everything.

One runner per node (Runner; its loop is run()). It registers the node and heartbeats, stages
the data of the jobs lined up for the node while they wait (on threads of its own), launches
each allocation placed here (its working folder, its sandbox, its process in its own session),
follows the orders in the database (cancellations, preemptions, allocations ended elsewhere), and
stops everything when it goes away. A launched job is a agent.running.RunningJob: its
output, metrics, meter, stopping and end are owned there. It stays one file, over 500 lines,
because Runner is one object whose steps share its state (the jobs running here, the blob cache
and its lock, the thread pools, the node's row, shutting down): split, staging and launching
would each need all of it.
"""

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from functools import cached_property
from pathlib import Path, PurePosixPath

from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone

from agent import checkpoints, smoke, stopping
from agent.cache import BlobCache
from agent.environments import (
    BuildError,
    EnvironmentCache,
    index_arguments,
)
from agent.isolation import Isolation
from agent.running import READER_JOIN_SECONDS, RunningJob
from agent.staging import (
    StagingError,
    Throttle,
    stage,
)
from core.storage import get_storage
from e31 import unpack
from jobs import archive, states
from jobs.launch import (
    RANK_PREFIX_TEMPLATE,
    Gang,
    JobDirs,
    build_environment,
    job_command,
    process_count,
    uses_torchrun,
    working_folder,
)
from jobs.logs import log_key, stream_log
from jobs.manifest import job_manifest, manifest_digests
from jobs.models import Job, input_names
from jobs.packages import requirements_of
from scheduler.allocations import end_allocation, gang_broken, release_node
from scheduler.engine import held as engine_held
from scheduler.models import Allocation, CachedBlob, Node, Staging

log = logging.getLogger(__name__)


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


def _close(pin):
    if pin is not None:
        pin.close()


# Where a job's archive waits, linked read-only into its folder, until its sandbox unpacks it.
WORK_ARCHIVES = ".work"
UNPACKER = unpack.__file__  # standard library only: run with -I -S inside the sandbox
UNPACK_SECONDS = 600

UNISOLATED_NOTICE = (
    "this node runs jobs WITHOUT isolation (E31_JOB_ISOLATION=0, for development only): the job runs as the runner's user, with its network and without limits"
)


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
    def __init__(self, name, devices, work_dir, device_type=None, cache_dir=None, cache_bytes=None, address=None, shared_cache=False):
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
            shared=shared_cache,
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
        # Set when a job's process exits or its output ends: the loop's wait for its next turn
        # ends then, and the job is finished at once rather than up to a turn later.
        self.wake = threading.Event()

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
        started = time.monotonic()
        if not self.envs.lookup(requirements):
            job.record("notice", data={"text": f"building on {self.name}: {len(requirements)} requirement(s)", "environment": ""})
        key, built = self.envs.ensure(requirements)  # never evicting one a job runs in (pinned_environment)
        if built:
            self.publish_environments()
        resolved = self.envs.resolved(key)
        if not built and not announce_cached:
            return key
        how = f"built in {time.monotonic() - started:.1f} s" if built else "from this node's cache"
        job.record("notice", data={"text": f"ready ({how}): {' '.join(resolved) or 'nothing beyond the runtime'}", "environment": key})
        return key

    def pinned_environment(self, job):
        """(key, pin) of the job's environment, ready here (built now if it is not) and held
        against eviction by any process on the node until the pin is closed; (None, None) where
        it asked for no packages."""
        for _ in range(2):  # evicted by another agent between the build and the pin: once more
            key = self.prepare_environment(job, announce_cached=False)  # ready already, unless not staged here
            if key is None:
                return None, None
            pin = self.envs.pin(key)
            if pin is not None:
                return key, pin
        raise BuildError("its environment was evicted on this node as it started, twice: the node's environment budget is too small")

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
        env_pin = None
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
            env_key, env_pin = self.pinned_environment(job)
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
            _close(env_pin)
            return None
        except BaseException:
            _kill_group(process)
            _release(sandbox)
            shutil.rmtree(dirs.root, ignore_errors=True)
            _close(env_pin)
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
            wake=self.wake,
        )
        running.linked = linked  # the cache's files the job saw: checked when it ends
        running.env_pin = env_pin
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
        with self.cache.using():  # a cache shared with other agents is not evicted meanwhile
            return self._stage(job, dirs, items)

    def _stage(self, job, dirs, items):
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
        """A script's smoke run sees a sample of its staged inputs (agent/smoke.py), said in
        its log; True for one, False for any other job (a recipe cuts its own data)."""
        if job.recipe or not job.is_smoke_run():
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
                job.record("staging", data=record.progress(progress))

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
            "pk", "ended_at", "job__cancel_requested_at", "preempt_requested_at", "gang", "job__state", "job__stop_requested_at", "job__stop_reason"
        )
        rows = list(rows)
        gangs = [row[4] for row in rows if row[4]]
        ended = defaultdict(list)  # gang: the end reasons of its parts that ended
        for gang, reason in Allocation.objects.filter(gang__in=gangs, ended_at__isnull=False).values_list("gang", "end_reason") if gangs else ():
            ended[gang].append(reason)
        for pk, ended_at, cancel_requested_at, preempt_requested_at, gang, job_state, stop_requested_at, stop_reason in rows:
            running = self.running[pk]
            if ended_at is None and gang and gang_broken(job_state, ended.get(gang, ())):
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
            elif stop_requested_at is not None:
                running.request_stop(Allocation.EARLY_STOP, states.STOPPED, stop_reason or "stopped by the network")
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
                    self.wake.wait(interval)
                self.wake.clear()  # before the next step, which sees whatever set it
        finally:
            self.stop_all()
            self.stop_heartbeats()


class AllocationAgent(Runner):
    """Our agent for one allocation a cluster engine started on this node (E31_EXECUTOR=slurm,
    scheduler/engine.py): it runs the job exactly as a runner would (sandbox, environment,
    staging, logs, metrics, checkpoints, outputs), then exits. The engine owns the node: no
    registration, no heartbeats (the scheduler reads the node from the engine), a cgroup folder
    of its own, the node's cache and environments shared with the other agents there (other
    allocations may run on the node beside it), and the meter runs
    until the agent is done, for that long the engine holds the compute."""

    def __init__(self, allocation_id, work_dir, node_name=None):
        allocation = Allocation.objects.select_related("node").get(pk=allocation_id)
        if allocation.gang:
            # One engine job over a gang's nodes: each node's agent takes its own part.
            name = node_name or os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]
            allocation = Allocation.objects.select_related("node").get(gang=allocation.gang, node__name=name)
        self.allocation_id = allocation.pk
        self.engine_dir = Path(work_dir)
        # The node's staged data and job environments are kept for every later allocation there
        # (the folder may be shared by all the nodes: each node has its own, nodes/<node>/cache
        # and cache.envs), shared by its agents, a process each. Other users of the cluster's
        # machines reach none of it, nor the locks that guard it.
        node_dir = self.engine_dir / "nodes" / allocation.node.name
        node_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        for folder in (node_dir.parent, node_dir):
            os.chmod(folder, 0o700)
        super().__init__(
            name=allocation.node.name,
            devices=allocation.node.devices,
            work_dir=self.engine_dir / str(allocation.pk) / "runs",
            device_type=allocation.node.device_type,
            cache_dir=node_dir / "cache",
            address=None,
            shared_cache=True,
        )
        self.node = allocation.node
        self.done = False
        self.terminating = False  # Slurm sent TERM (terminate)

    def attach(self, started_at=None, precise=False):
        """Take the allocation over: the meter from when the engine started it (started_at, or
        now), unless the scheduler has already read that from the engine; precise: started_at is
        the batch script's own instant, which refines the engine's whole second (engine.held)."""
        self.work_dir.mkdir(parents=True, exist_ok=True)
        # cgroups under the allocation's own folder; the sandbox trusted where an agent of the
        # last minutes started one on this node (the folder may be shared by all the nodes: the
        # note is the node's own)
        self.isolation.probe(self.allocation_id, known_good=self.engine_dir / f".sandbox-started-{self.name}")
        engine_held(Allocation.objects.get(pk=self.allocation_id), started_at or timezone.now(), precise=precise)

    def start_heartbeats(self):
        pass  # the scheduler reads the node from the engine

    def stop_heartbeats(self):
        pass

    # The node's stagings are not this agent's: it stages what its job needs and the node's
    # shared cache lacks, and builds the environment the node lacks (both while the meter runs),
    # and tells the scheduler nothing of it.
    def claim_stagings(self):
        pass

    def publish_cache(self, known_before):
        pass

    def publish_environments(self):
        pass

    def launch_new(self):
        if self.done or self.allocation_id in self.running:
            return
        allocation = Allocation.objects.select_related("job", "node").get(pk=self.allocation_id)
        if allocation.ended_at is not None:
            self.done = True  # ended while the engine started it (cancelled, requeued)
            return
        if allocation.gang and allocation.node_rank > 0 and not allocation.rendezvous:
            return  # node 0's agent has not opened the gang's rendezvous yet
        try:
            running = self.launch(allocation)
        except Exception as error:  # noqa: BLE001 - whatever it was, the compute goes back
            log.exception("job %s could not start", allocation.job_id)
            end_allocation(allocation, timezone.now(), Allocation.START_FAILED, states.FAILED, f"could not start: {error}")
            running = None
        if running is None:
            self.done = True
        else:
            running.held_until_done = True

    def terminate(self):
        """Slurm sent TERM (its --signal at the span, a scancel, a preemption): the job is asked
        to stop and ends through the usual path (outputs kept, the meter stopped), never requeued
        blindly as a runner that went away would be."""
        self.terminating = True

    def step(self):
        if self.terminating and self.allocation_id in self.running:
            running = self.running[self.allocation_id]
            running.enforce_limit(timezone.now(), self.grace)  # at its span: the span's stop
            if running.stop is None:
                job = Job.objects.only("cancel_requested_at").get(pk=running.job.pk)
                if job.cancel_requested_at is not None:
                    running.request_stop(Allocation.CANCELLED, states.CANCELLED, "cancelled by the team")
                else:
                    running.request_stop(
                        Allocation.RUNNER_STOPPED,
                        states.QUEUED,
                        "Slurm is ending its job (cancelled or preempted there): the job goes back to the queue and resumes from its latest checkpoint",
                    )
        busy = super().step()
        if self.allocation_id not in self.running and (self.done or Allocation.objects.filter(pk=self.allocation_id, ended_at__isnull=False).exists()):
            self.done = self.shutdown = True
        elif self.terminating and self.allocation_id not in self.running:
            self.shutdown = True  # TERM before its job started: nothing to stop, the allocation goes back
        return busy

    def stop_all(self, reason=Allocation.RUNNER_STOPPED):
        node, self.node = self.node, None  # the node is the engine's: not stopped with this agent
        try:
            super().stop_all(reason)
        finally:
            self.node = node
            shutil.rmtree(self.work_dir, ignore_errors=True)  # not Slurm's files beside it
            # The meter has stopped: the node's cache is brought back within its limit (skipped
            # while another agent stages or links: that one does it when it is done).
            self.cache.evict()
