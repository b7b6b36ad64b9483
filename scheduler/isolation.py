"""Job isolation on a node: a user of its own, limits, no network, nothing left behind.

Where the runner runs as root, each job runs as an unprivileged uid of its own (no supplementary
groups), in a cgroup of its own (memory and process limits; every process in it is killed when
the job ends), in a network namespace of its own unless it asked for the network, and in a mount
namespace where the network's folders (the var folder, the cache, the storage, other jobs'
folders, /tmp, /dev/shm) are covered by empty tmpfs and only its own folder and the Python it runs
are put back. Every mechanism is probed once when the runner starts and becomes a no-op, with one
log line, where the runner is not root or the kernel lacks it.

The pure decisions (which uid, which limits, whether to cut the network, what to cover) are the
small functions at the top; the rest touches the node.
"""

import json
import logging
import os
import signal
import stat
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

SHIM = Path(__file__).with_name("jobshim.py")
CGROUP_ROOT = Path("/sys/fs/cgroup")

# Pure decisions ------------------------------------------------------------------------------


def pick_slot(in_use, after, span):
    """The next uid offset after `after` (cycling through 0..span-1) that is not in use, or None.
    Cycling, rather than reusing the lowest, keeps a uid unused for as long as possible after its
    job ended (anything it left in a shared place belongs to nobody running)."""
    for step in range(1, span + 1):
        slot = (after + step) % span
        if slot not in in_use:
            return slot
    return None


class UidClaims:
    """Uids claimed by this process, machine-wide: one lock file per uid in a folder all runners
    of the machine share, locked (flock) for as long as a job runs as that uid. Two runners on
    one machine can then never hand one uid to two jobs, even in the moment before the first
    job's process exists; a runner that dies drops its locks with it."""

    def __init__(self, folder):
        self.folder = Path(folder)
        self.fds = {}

    def claim(self, uid):
        """True if this process now holds uid; False if another process does."""
        import fcntl

        self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(self.folder / str(uid), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return False
        self.fds[uid] = fd
        return True

    def release(self, uid):
        fd = self.fds.pop(uid, None)
        if fd is not None:
            os.close(fd)


def job_uid(base, slot):
    """The uid (and gid) a job runs as: base + its slot."""
    return base + slot


@dataclass(frozen=True)
class Limits:
    memory_bytes: int | None  # None: no limit
    processes: int
    open_files: int
    file_bytes: int
    disk_bytes: int

    @property
    def memory_text(self):
        return f"{self.memory_bytes // 2**20} MB" if self.memory_bytes else "none"


def job_limits(*, memory_bytes, max_processes, max_open_files, max_file_bytes, disk_bytes, devices_held, devices_total, node_memory):
    """The job's limits from the settings: memory_bytes 0 means the job's share of the node's
    memory, in proportion to the devices it holds."""
    memory = memory_bytes or None
    if memory is None and node_memory and devices_total:
        memory = node_memory * max(1, devices_held) // max(devices_total, devices_held)
    return Limits(memory, max_processes, max_open_files, max_file_bytes, disk_bytes)


def keeps_network(asked, gang, nodes=1):
    """Whether a job keeps the host's network: when it asked for it, and for runs across nodes
    (a gang's processes reach their peers and the rendezvous over the network)."""
    return bool(asked) or gang is not None or nodes > 1


def rlimits(limits, *, per_user, hard=None):
    """The resource limits set in the job's process: {name: (soft, hard)}. The process limit is
    per uid, so it is set only where the job has a uid of its own. hard: {name: the runner's own
    hard limit (-1: none)}; a limit is never raised past it (that takes CAP_SYS_RESOURCE)."""
    wanted = {"RLIMIT_NOFILE": limits.open_files, "RLIMIT_FSIZE": limits.file_bytes}
    if per_user:
        wanted["RLIMIT_NPROC"] = limits.processes
    out = {}
    for name, value in wanted.items():
        ceiling = (hard or {}).get(name, -1)
        value = value if ceiling is None or ceiling < 0 else min(value, ceiling)
        out[name] = (value, value)
    return out


def _under(path, top):
    return path == top or path.startswith(top.rstrip("/") + "/")


def _depth(path):
    return len([p for p in path.split("/") if p])


def mount_plan(keep, hidden, reachable):
    """What to cover in the job's mount namespace: [(folder, mode, [kept paths bound back])].

    keep: absolute paths the job needs (its folder, the Python it runs). hidden: {folder: mode}
    the job must not see (each covered with an empty tmpfs of that mode). reachable(path): whether
    users other than root may pass through a folder; a kept path behind one that is not (Python
    under /root, say) is reached by covering that folder and binding the path back. A folder
    already hidden under an outer cover is dropped, unless it lies inside a path bound back."""
    covers = dict(hidden)
    for path in keep:
        parts = [p for p in path.split("/") if p]
        for i in range(1, len(parts)):  # strict ancestors, outermost first
            ancestor = "/" + "/".join(parts[:i])
            if not reachable(ancestor):
                covers.setdefault(ancestor, 0o711)
                break
    accepted = []
    for folder in sorted(covers, key=_depth):
        enclosing = [c for c in accepted if _under(folder, c) and c != folder]
        if enclosing:
            outer = max(enclosing, key=_depth)
            if not any(_under(folder, k) and k != folder for k in keep if _under(k, outer)):
                continue  # already out of sight
        accepted.append(folder)
    plan = {folder: [] for folder in accepted}
    for path in sorted(set(keep), key=_depth):
        containing = [c for c in accepted if _under(path, c) and c != path]
        if not containing:
            continue
        owner = max(containing, key=_depth)
        if not any(_under(path, k) for k in plan[owner]):
            plan[owner].append(path)
    return [(folder, covers[folder], plan[folder]) for folder in accepted]


def gb_text(size):
    return f"{size / 1e9:.3g} GB"


def disk_message(limit):
    return f"used more than {gb_text(limit)} of disk in its folder"


def oom_message(limits):
    return f"ran out of memory (limit {limits.memory_text})"


# The node ------------------------------------------------------------------------------------


class Cgroups:
    """The cgroups of the runner's jobs: v1 (one folder per controller) or v2 (one folder)."""

    def __init__(self, runner_name, top="e31"):
        """top: the folder (under each controller) that holds every runner's cgroups; a runner
        kills what it finds under its own name there at start (a dead predecessor's jobs)."""
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in runner_name) or "runner"
        top = "".join(c if c.isalnum() or c in "-_." else "_" for c in top) or "e31"
        self.kind = None
        self.parents = {}
        if (CGROUP_ROOT / "cgroup.controllers").exists():  # a pure v2 hierarchy
            self.kind = "v2"
            self.parents = {"unified": CGROUP_ROOT / top / safe}
        elif (CGROUP_ROOT / "memory" / "cgroup.procs").exists():
            self.kind = "v1"
            self.parents = {c: CGROUP_ROOT / c / top / safe for c in ("memory", "pids") if (CGROUP_ROOT / c / "cgroup.procs").exists()}

    def folders(self, name):
        return [parent / name for parent in self.parents.values()]

    def create(self, name, limits):
        """The allocation's cgroup folders, with its limits set."""
        if self.kind == "v2":
            self._enable_v2()
        made = []
        try:
            for controller, parent in self.parents.items():
                folder = parent / name
                folder.mkdir(parents=True, exist_ok=True)
                made.append(folder)
                if controller in ("memory", "unified") and limits.memory_bytes:
                    limit_file = "memory.max" if self.kind == "v2" else "memory.limit_in_bytes"
                    (folder / limit_file).write_text(str(limits.memory_bytes))
                    if self.kind == "v2":
                        _try_write(folder / "memory.swap.max", "0")
                if controller in ("pids", "unified"):
                    (folder / "pids.max").write_text(str(limits.processes))
        except OSError:
            for folder in made:
                _rmdir(folder)
            raise
        return made

    def _enable_v2(self):
        parent = self.parents["unified"]
        for folder in (CGROUP_ROOT, parent.parent, parent):
            folder.mkdir(exist_ok=True)
            _try_write(folder / "cgroup.subtree_control", "+memory +pids")

    def pids(self, name):
        found = set()
        for folder in self.folders(name):
            try:
                found |= {int(p) for p in (folder / "cgroup.procs").read_text().split()}
            except (OSError, ValueError):
                pass
        return found

    def oom_kills(self, name):
        """How many processes the kernel killed in the cgroup for want of memory."""
        for folder in self.folders(name):
            for stats in ("memory.oom_control", "memory.events"):
                try:
                    for line in (folder / stats).read_text().splitlines():
                        key, _, value = line.partition(" ")
                        if key == "oom_kill":
                            return int(value)
                except (OSError, ValueError):
                    continue
        return 0

    def remove(self, name):
        for folder in self.folders(name):
            _rmdir(folder)

    def remove_runner(self):
        """The runner's own folder of cgroups, once its jobs' are gone (the runner stops)."""
        for parent in self.parents.values():
            try:
                parent.rmdir()
            except OSError:
                pass

    def leftovers(self):
        """Cgroups a dead runner of this name left (their processes are killed at register)."""
        names = set()
        for parent in self.parents.values():
            try:
                names |= {p.name for p in parent.iterdir() if p.is_dir()}
            except OSError:
                pass
        return names


def _try_write(path, text):
    try:
        Path(path).write_text(text)
        return True
    except OSError:
        return False


def _rmdir(folder, attempts=50):
    for _ in range(attempts):
        try:
            folder.rmdir()
            return True
        except FileNotFoundError:
            return True
        except OSError:
            time.sleep(0.02)  # its last processes are still exiting
    log.warning("could not remove the cgroup %s", folder)
    return False


def pids_of_uid(uid):
    """Live (not zombie) processes running as uid."""
    found = set()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            status = Path(f"/proc/{entry.name}/status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if fields.get("State", "").strip().startswith("Z"):
            continue
        if int(fields.get("Uid", "-1").split()[0]) == uid:
            found.add(int(entry.name))
    return found


def uids_in_use(low, high):
    """The uids in [low, high) that own a live process on this machine."""
    used = set()
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                uid = os.stat(entry.path).st_uid
            except OSError:
                continue
            if low <= uid < high:
                used.add(uid)
    return used


def pids_with_env(marker):
    """Processes whose environment holds marker (b"NAME=value"): the only way to find a job's
    processes that left its process group where there is neither a cgroup nor a uid of its own."""
    me = os.getpid()
    found = set()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            environ = Path(f"/proc/{entry.name}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if marker in environ:
            found.add(int(entry.name))
    return found


def reachable_by_others(path):
    try:
        return bool(os.stat(path).st_mode & stat.S_IXOTH)
    except OSError:
        return False


def disk_used(root, skip_inodes=frozenset()):
    """Bytes of disk the files under root take (each inode once; the staged files, shared with
    the cache, not counted). Symlinks are not followed."""
    seen = set()
    total = 0
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            try:
                st = os.lstat(os.path.join(folder, name))
            except OSError:
                continue
            key = (st.st_dev, st.st_ino)
            if key in seen or key in skip_inodes:
                continue
            seen.add(key)
            total += st.st_blocks * 512
    return total


@dataclass
class Sandbox:
    """One allocation's isolation: its uid, cgroup, limits and namespaces."""

    isolation: "Isolation"
    name: str  # the allocation's id: the cgroup's name
    job_id: str
    limits: Limits
    uid: int | None = None
    slot: int | None = None
    network: bool = True
    cgroups: list = field(default_factory=list)
    staged_inodes: frozenset = frozenset()

    @property
    def env_marker(self):
        return f"E31_ALLOCATION_ID={self.name}".encode()

    def prepare(self, dirs):
        """Before the job starts: the cgroup made, the folder handed to the job's uid."""
        if self.isolation.cgroups_on:
            try:
                self.cgroups = self.isolation.cgroups.create(self.name, self.limits)
            except OSError as error:
                log.warning("no cgroup for allocation %s (%s): its memory and processes are not limited", self.name, error)
                self.cgroups = []
        staged = set()
        for folder, dirnames, files in os.walk(dirs.root):
            for name in dirnames + files:
                path = os.path.join(folder, name)
                st = os.lstat(path)
                if stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
                    staged.add((st.st_dev, st.st_ino))  # shared with the cache: stays root's, read-only
                elif self.uid is not None:
                    os.lchown(path, self.uid, self.uid)
        self.staged_inodes = frozenset(staged)
        if self.uid is not None:
            os.chown(dirs.root, self.uid, self.uid)
        os.chmod(dirs.root, 0o700)

    def shim_spec(self, dirs):
        """What the shim does before it runs the job's command (see jobshim.py)."""
        iso = self.isolation
        spec = {"cgroups": [str(c) for c in self.cgroups], "cwd": str(dirs.code)}
        if iso.enabled:
            spec["rlimits"] = rlimits(self.limits, per_user=self.uid is not None, hard=iso.hard)
        if iso.netns_on and not self.network:
            spec["netns"] = True
        if self.uid is not None:
            spec["uid"] = spec["gid"] = self.uid
            if iso.mounts_on:
                spec["mounts"] = iso.mounts_for(dirs.root)
        return spec

    def pids(self):
        found = set()
        if self.cgroups:
            found |= self.isolation.cgroups.pids(self.name)
        if self.uid is not None:
            found |= pids_of_uid(self.uid)
        if not self.cgroups and self.uid is None:
            found |= pids_with_env(self.env_marker)
        found.discard(os.getpid())
        return found

    def kill_all(self, timeout=3.0):
        """Kill every process of the job (daemons, processes that left its group, that ignore
        SIGTERM) until none is left."""
        deadline = time.monotonic() + timeout
        while True:
            pids = self.pids()
            if not pids:
                return True
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            if time.monotonic() > deadline:
                log.error("job %s: processes %s outlived SIGKILL", self.job_id, sorted(pids))
                return False
            time.sleep(0.01)

    def oom_kills(self):
        return self.isolation.cgroups.oom_kills(self.name) if self.cgroups else 0

    def release(self):
        """After the job: nothing of it left running, its cgroup removed, its uid free again."""
        self.kill_all()
        if self.cgroups:
            self.isolation.cgroups.remove(self.name)
            self.cgroups = []
        if self.slot is not None:
            self.isolation.slots.pop(self.name, None)
            self.isolation.claims.release(self.uid)


class Isolation:
    """What this node can do to isolate jobs, probed once when the runner starts."""

    def __init__(self, runner_name, work_dir, cache_dir, settings):
        self.settings = settings
        self.work_dir = Path(work_dir).resolve()
        self.cache_dir = Path(cache_dir).resolve()
        self.enabled = bool(getattr(settings, "E31_JOB_ISOLATION", True))
        self.root = is_root()
        self.users_on = self.mounts_on = self.netns_on = self.cgroups_on = False
        self.cgroups = Cgroups(runner_name, getattr(settings, "E31_JOB_CGROUP_PARENT", "e31"))
        self.slots = {}  # allocation id -> uid slot
        self.claims = UidClaims(getattr(settings, "E31_JOB_UID_LOCK_DIR", "/run/e31/job-uids"))
        self.last_slot = (os.getpid() * 7919) % settings.E31_JOB_UID_COUNT
        import resource

        self.hard = {name: resource.getrlimit(getattr(resource, name))[1] for name in ("RLIMIT_NOFILE", "RLIMIT_FSIZE", "RLIMIT_NPROC")}
        self.node_memory = _node_memory()

    # Start-up ------------------------------------------------------------------------------

    def probe(self):
        """Find out which mechanisms work here; one log line for each that does not."""
        if not self.enabled:
            log.info("job isolation is off (E31_JOB_ISOLATION): jobs run as the runner's user, with its network, and no cgroups or resource limits")
            return
        if not self.root:
            log.info(
                "job isolation: the runner is not root, so jobs run as its user, with the host's network, and "
                "no memory or process limits (open files and file size are limited; leftovers found by their environment)"
            )
            return
        if self.cgroups.kind is None:
            log.info("job isolation: no cgroup hierarchy here, so job memory and processes are not limited")
        else:
            try:
                made = self.cgroups.create("probe", Limits(2**30, 64, 64, 2**20, 2**20))
                self.cgroups.remove("probe")
                self.cgroups_on = bool(made)
            except OSError as error:
                log.info("job isolation: cannot make cgroups (%s), so job memory and processes are not limited", error)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.work_dir, 0o711)  # a job passes through to its folder, and cannot list the others
        ok, why = self._try({"netns": True})
        self.netns_on = ok
        if not ok:
            log.info("job isolation: no network namespaces here (%s), so jobs keep the host's network", why)
        uid = job_uid(self.settings.E31_JOB_UID_BASE, self.settings.E31_JOB_UID_COUNT - 1)
        limits = rlimits(Limits(None, 64, 256, 2**20, 2**20), per_user=True, hard=self.hard)
        ok, why = self._try({"uid": uid, "gid": uid, "mounts": True, "rlimits": limits}, uid=uid)
        if ok:
            self.users_on = self.mounts_on = True
        else:
            ok2, why2 = self._try({"uid": uid, "gid": uid, "rlimits": limits}, uid=uid)
            self.users_on = ok2
            if ok2:
                log.info("job isolation: no mount namespaces here (%s); jobs run as users of their own without them", why)
            else:
                log.info("job isolation: jobs cannot run as a user of their own here (%s; %s), so they run as root", why, why2)
        log.info(
            "job isolation: users %s, cgroups %s, network namespaces %s, mount namespaces %s",
            *("on" if x else "off" for x in (self.users_on, self.cgroups_on, self.netns_on, self.mounts_on)),
        )

    def _try(self, spec, uid=None):
        """Run the shim with spec and a command that imports the e31 package and writes a file
        in a folder like a job's."""
        folder = self.work_dir / f".probe-{os.getpid()}"
        folder.mkdir(exist_ok=True)
        try:
            if uid is not None:
                os.chown(folder, uid, uid)
            os.chmod(folder, 0o700)
            spec = {**spec, "cwd": str(folder)}
            if spec.get("mounts"):
                spec["mounts"] = self.mounts_for(folder)
            command = [sys.executable, "-c", "import e31; open('ok', 'w').write('ok')"]
            try:
                result = subprocess.run(
                    shim_command(command, spec), cwd=folder, capture_output=True, timeout=60, stdin=subprocess.DEVNULL,
                    env={"PATH": "/usr/bin:/bin", "HOME": str(folder)},
                )
            except (OSError, subprocess.SubprocessError) as error:
                return False, str(error)
            if result.returncode == 0 and (folder / "ok").exists():
                return True, ""
            return False, (result.stderr.decode(errors="replace").strip().splitlines() or [f"exit {result.returncode}"])[-1]
        finally:
            import shutil

            shutil.rmtree(folder, ignore_errors=True)

    def kill_leftovers(self):
        """Processes in the cgroups of an earlier runner of this name (it died): killed."""
        if not self.cgroups_on:
            return
        for name in self.cgroups.leftovers():
            pids = self.cgroups.pids(name)
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            if pids:
                log.warning("killed %s leftover processes of allocation %s", len(pids), name)
            self.cgroups.remove(name)

    # Per job --------------------------------------------------------------------------------

    def mounts_for(self, job_root):
        """The mount plan of a job whose folder is job_root."""
        from django.conf import settings

        keep = {str(Path(job_root).resolve())}
        for path in [*sys.path, sys.prefix, sys.base_prefix, os.path.dirname(os.path.realpath(sys.executable)), str(settings.BASE_DIR)]:
            if path and os.path.isdir(path):
                keep.add(os.path.realpath(path))
        hidden = {"/tmp": 0o1777, "/dev/shm": 0o1777}
        for folder in (settings.VAR_DIR, settings.STORAGE_DIR, settings.RUNNER_CACHE_DIR, self.cache_dir, self.work_dir):
            path = os.path.realpath(folder)
            if os.path.isdir(path) and path != "/":
                hidden.setdefault(path, 0o711)
        return [[folder, mode, paths] for folder, mode, paths in mount_plan(sorted(keep), hidden, reachable_by_others)]

    def sandbox(self, allocation, job, gang):
        s = self.settings
        limits = job_limits(
            memory_bytes=s.E31_JOB_MEMORY_BYTES, max_processes=s.E31_JOB_MAX_PROCESSES, max_open_files=s.E31_JOB_MAX_OPEN_FILES,
            max_file_bytes=s.E31_JOB_MAX_FILE_BYTES, disk_bytes=s.E31_JOB_DISK_BYTES,
            devices_held=len(allocation.devices), devices_total=allocation.node.devices, node_memory=self.node_memory,
        )
        sandbox = Sandbox(
            self, str(allocation.pk), str(job.pk), limits, network=keeps_network(job.network, gang, allocation.gang_size),
        )
        if self.users_on:
            base, span = s.E31_JOB_UID_BASE, s.E31_JOB_UID_COUNT
            busy = set(self.slots.values()) | {uid - base for uid in uids_in_use(base, base + span)}
            while True:
                slot = pick_slot(busy, self.last_slot, span)
                if slot is None:
                    raise RuntimeError("no free job uid on this node")
                self.last_slot = slot
                if self.claims.claim(job_uid(base, slot)):
                    break
                busy.add(slot)  # another runner of this machine holds it
            self.slots[sandbox.name] = slot
            sandbox.slot, sandbox.uid = slot, job_uid(base, slot)
        return sandbox


def is_root():
    return os.geteuid() == 0


def shim_command(command, spec, python=sys.executable):
    """The command, started through the shim: the job's cgroup joined, its limits set, its
    namespaces made, its user taken, and killed by the kernel if the runner dies (Linux)."""
    return [python, "-I", "-S", str(SHIM), str(os.getpid()), json.dumps(spec), *command]


def _node_memory():
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
