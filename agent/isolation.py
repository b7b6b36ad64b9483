"""Job isolation on a node: every job in a bubblewrap sandbox, under limits, leaving nothing behind.

Each job's processes run under bubblewrap (`bwrap`, Flatpak's sandbox): new user, PID, IPC, UTS,
cgroup and mount namespaces, and a network namespace unless the job asked for the network. Inside
it sees the system and the Python runtime read-only, its own folder read-write (its staged data and
models read-only), private /tmp, /var/tmp and /dev/shm (memory, counted against its limit), its own
GPUs' device nodes and nothing else: not the var folder, the storage, the cache, other jobs or
their processes. Where the runner is root the job also runs as an unprivileged uid of its own, in
a cgroup of its own (memory with no swap, processes, and CPU = the slots it holds), and every
process in it is killed when the job ends.

What bubblewrap cannot do is done by the shim (agent/jobshim.py) before it becomes bwrap:
joining the cgroup, setting resource limits, dropping to the job's uid. No value the job controls
reaches the shim or bwrap's own environment: the job's environment is handed to bwrap through a
file descriptor and applies only inside the sandbox.

The pure decisions (which uid, which limits, what the sandbox binds) are the functions at the top;
the rest touches the node. It stays one file, over 500 lines, because each mechanism is decided at
the top and applied below (a limit, a bind, a uid): they change together, and one file shows the
whole of what a job can reach.
"""

import ipaddress
import json
import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from django.conf import settings

import e31
from jobs.launch import JobDirs

log = logging.getLogger(__name__)

SHIM = Path(__file__).with_name("jobshim.py")
PROBE_TRUST_SECONDS = 600  # how long a sandbox that started on a node vouches for the next (probe)
CGROUP_ROOT = Path("/sys/fs/cgroup")
SLIRP_DNS = "10.0.2.3"  # slirp4netns's DNS forwarder, inside the job's network
SLIRP_ADDRESSES = ("10.0.2.2", SLIRP_DNS, "10.0.2.100")  # its gateway, DNS and the job's own address
INSTALL_HINT = (
    "install bubblewrap (Debian/Ubuntu: apt-get install bubblewrap; bin/setup does it when run as root), "
    "or set E31_JOB_ISOLATION=0 to run jobs unisolated (for development only)"
)


class IsolationUnavailable(RuntimeError):
    """The runner was asked to isolate jobs and cannot: it refuses to start jobs."""


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
    cpus: float | None = None  # cores' worth of CPU time (cpu.max); None: no limit

    @property
    def memory_text(self):
        return f"{self.memory_bytes // 2**20} MB" if self.memory_bytes else "none"


def node_share(total, held, offered, reserve):
    """A job's share of a node's memory or disk: what the node has less a reserve for the
    system (the web server, the scheduler, the database), in proportion to the devices held."""
    if not total or not offered:
        return None
    usable = max(total - reserve, total // 4)
    return usable * max(1, held) // max(offered, held)


def default_reserve(total, fraction=0.1, floor=2**30):
    """What a node keeps for itself when the operator did not say: a tenth, at least 1 GiB
    (never more than half)."""
    return min(max(int(total * fraction), floor), total // 2) if total else 0


def cpu_share(device_type, held, offered, node_cpus):
    """The CPU a job may use, in cores: on a CPU node the slots it holds (a 1-slot job gets one
    core's worth whatever it forks); on a GPU node the node's cores in proportion to its GPUs."""
    if device_type == "cpu":
        return float(max(1, held))
    if not node_cpus or not offered:
        return None
    return max(1.0, node_cpus * max(1, held) / max(offered, held))


def job_limits(
    *,
    memory_bytes,
    max_processes,
    max_open_files,
    max_file_bytes,
    disk_bytes,
    devices_held,
    devices_total,
    node_memory,
    node_disk=None,
    memory_reserve=None,
    disk_reserve=None,
    device_type="cpu",
    node_cpus=None,
):
    """The job's limits from the settings; memory_bytes or disk_bytes 0 means the job's share of
    the node's (less a reserve), in proportion to the devices it holds."""
    memory = memory_bytes or None
    if memory is None and node_memory:
        reserve = default_reserve(node_memory) if memory_reserve is None else memory_reserve
        memory = node_share(node_memory, devices_held, devices_total, reserve)
    disk = disk_bytes or None
    if disk is None and node_disk:
        reserve = default_reserve(node_disk) if disk_reserve is None else disk_reserve
        disk = node_share(node_disk, devices_held, devices_total, reserve)
    return Limits(
        memory,
        max_processes,
        max_open_files,
        max_file_bytes,
        disk or 1024**4,
        cpu_share(device_type, devices_held, devices_total, node_cpus),
    )


def cpu_quota(cpus, period_us=100_000):
    """cpu.max's "quota period" (microseconds) for cpus cores' worth."""
    return max(1000, int(cpus * period_us)), period_us


def keeps_network(asked, gang, nodes=1):
    """Whether a job keeps the host's network: when it asked for it, and for runs across nodes
    (a gang's processes reach their peers and the rendezvous over the network)."""
    return bool(asked) or gang is not None or nodes > 1


def local_addresses(fib_trie):
    """The node's own IPv4 addresses, from the text of /proc/net/fib_trie (its "/32 host LOCAL"
    entries, each under the line naming the address)."""
    found, last = set(), None
    for line in fib_trie.splitlines():
        text = line.strip()
        if text.startswith("|-- "):
            last = text[4:]
        elif text.startswith("/32 host LOCAL") and last:
            found.add(last)
    return sorted(found, key=ipaddress.IPv4Address)


def parse_networks(text, setting="E31_JOB_NETWORK_DENY"):
    """CIDRs separated by commas or spaces, as IPv4 networks; a ValueError naming the setting and
    the word that is not one."""
    out = []
    for word in text.replace(",", " ").split():
        try:
            network = ipaddress.ip_network(word, strict=False)
        except ValueError:
            raise ValueError(f"{setting}: {word!r} is not a network (write it as 10.0.0.0/8)") from None
        if network.version != 4:
            raise ValueError(f"{setting}: {word!r} is IPv6; a job's uplink carries IPv4 only")
        out.append(network)
    return out


def denied_networks(deny, node_addresses):
    """The unreachable routes in a job's own network (pure): the operator's networks and each of
    the node's own addresses but loopback (the job's loopback is its own), as sorted CIDR text. A
    route that would take in the uplink's own gateway, DNS or the job's address more narrowly than
    the uplink's /24 is left out (a node that is itself a 10.0.2.x guest), so the uplink works."""
    wanted = set(deny) | {ipaddress.ip_network(f"{a}/32") for a in node_addresses if not ipaddress.ip_address(a).is_loopback}
    kept = [n for n in wanted if not (n.prefixlen > 24 and any(ipaddress.ip_address(a) in n for a in SLIRP_ADDRESSES))]
    return [str(n) for n in sorted(kept)]


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


@dataclass(frozen=True)
class View:
    """What a job sees in its sandbox, as plain data (sandbox_args turns it into bwrap's words).

    system: (kind, source, destination) for the host's system folders: ("bind", path, path) read
    only, or ("symlink", target, path) where the host has a link (/bin -> usr/bin). runtime: the
    Python the job runs and the SDK, read-only. root: its folder, read-write, with read_only
    inside it (staged data, models). devices: device nodes bound in (its GPUs)."""

    root: str
    cwd: str
    extra: tuple = ()  # more bwrap arguments, put first (the uplink's --info-fd and --block-fd)
    system: tuple = ()
    runtime: tuple = ()
    read_only: tuple = ()
    devices: tuple = ()
    network: bool = False
    env: tuple = ()  # (name, value) pairs: the job's whole environment
    files: tuple = ()  # (fd, path): a file made from fd's bytes, read-only (resolv.conf)


def sandbox_args(view):
    """bubblewrap's arguments for a view: new namespaces of every kind (the network kept only if
    asked), killed with its parent, a session of its own (no terminal to push keys into), and a
    file system built from nothing but what the view names."""
    # --unshare-all only tries a user namespace; it is asked for outright so that further ones can
    # be refused inside (--disable-userns): a nested one, root there, is where most namespace
    # exploits of the kernel begin.
    args = ["--unshare-all", "--unshare-user", "--disable-userns"]
    if view.network:
        args.append("--share-net")
    args += list(view.extra)
    # The host's name is kept (a UTS namespace of its own all the same): torchrun and gangs
    # look their own name up, and /etc/hosts knows only the host's.
    args += ["--die-with-parent", "--new-session"]
    args += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--tmpfs", "/var/tmp", "--tmpfs", "/run"]
    for kind, source, dest in view.system:
        args += ["--symlink", source, dest] if kind == "symlink" else ["--ro-bind", source, dest]
    for path in view.runtime:
        args += ["--ro-bind", path, path]
    for fd, path in view.files:
        args += ["--ro-bind-data", str(fd), path]
    for device in view.devices:
        args += ["--dev-bind", device, device]
    if view.devices:
        args += ["--ro-bind", "/sys", "/sys"]  # NVML reads the GPUs' PCI details there
    args += ["--bind", view.root, view.root]
    for path in view.read_only:
        args += ["--ro-bind", path, path]
    args += ["--chdir", view.cwd, "--clearenv"]
    for name, value in view.env:
        args += ["--setenv", name, value]
    return args


def gpu_device_nodes(devices, device_type, exists=os.path.exists):
    """The device nodes a job on these GPUs needs: its own /dev/nvidiaN and the driver's shared
    nodes, those that exist. None on a CPU node (a no-op there)."""
    if device_type == "cpu" or not devices:
        return ()
    wanted = [f"/dev/nvidia{d}" for d in devices] + [
        "/dev/nvidiactl",
        "/dev/nvidia-uvm",
        "/dev/nvidia-uvm-tools",
        "/dev/nvidia-modeset",
    ]
    return tuple(path for path in wanted if exists(path))


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

    V1 = ("memory", "pids", "cpu", "cpuacct")

    def __init__(self, node_key, top="e31"):
        """node_key: the node's unique id (not its display name, which two systems on one machine
        may share); top: the folder (under each controller) that holds every runner's cgroups."""
        self.top = "".join(c if c.isalnum() or c in "-_." else "_" for c in top) or "e31"
        self.kind = None
        self.parents = {}
        self.key = None
        if (CGROUP_ROOT / "cgroup.controllers").exists():  # a pure v2 hierarchy
            self.kind = "v2"
        elif (CGROUP_ROOT / "memory" / "cgroup.procs").exists():
            self.kind = "v1"
        if node_key:
            self.use(node_key)

    def use(self, node_key):
        """Keep the cgroups under this node's folder."""
        self.key = "".join(c if c.isalnum() or c in "-_." else "_" for c in str(node_key)) or "runner"
        if self.kind == "v2":
            self.parents = {"unified": CGROUP_ROOT / self.top / self.key}
        elif self.kind == "v1":
            self.parents = {c: CGROUP_ROOT / c / self.top / self.key for c in self.V1 if (CGROUP_ROOT / c / "cgroup.procs").exists()}

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
                self._limit(controller, folder, limits)
        except OSError:
            for folder in made:
                _rmdir(folder)
            raise
        return made

    def _limit(self, controller, folder, limits):
        v2 = self.kind == "v2"
        if controller in ("memory", "unified") and limits.memory_bytes:
            (folder / ("memory.max" if v2 else "memory.limit_in_bytes")).write_text(str(limits.memory_bytes))
            # No swap: a job over its memory is stopped, not paged out onto its neighbours.
            _try_write(folder / ("memory.swap.max" if v2 else "memory.memsw.limit_in_bytes"), "0" if v2 else str(limits.memory_bytes))
        if controller in ("pids", "unified"):
            (folder / "pids.max").write_text(str(limits.processes))
        if controller in ("cpu", "unified") and limits.cpus:
            quota, period = cpu_quota(limits.cpus)
            if v2:
                (folder / "cpu.max").write_text(f"{quota} {period}")
            else:
                (folder / "cpu.cfs_period_us").write_text(str(period))
                (folder / "cpu.cfs_quota_us").write_text(str(quota))

    def _enable_v2(self):
        parent = self.parents["unified"]
        for folder in (CGROUP_ROOT, parent.parent, parent):
            folder.mkdir(exist_ok=True)
            _try_write(folder / "cgroup.subtree_control", "+memory +pids +cpu")

    def pids(self, name):
        found = set()
        for folder in self.folders(name):
            try:
                found |= {int(p) for p in (folder / "cgroup.procs").read_text().split()}
            except (OSError, ValueError):
                pass
        return found

    def cpu_seconds(self, name):
        """CPU time the allocation's processes used (None where it is not counted)."""
        for folder in self.folders(name):
            try:
                if self.kind == "v2":
                    stats = dict(line.split() for line in (folder / "cpu.stat").read_text().splitlines())
                    return int(stats["usage_usec"]) / 1e6
                if folder.parent.parent.parent.name == "cpuacct":
                    return int((folder / "cpuacct.usage").read_text()) / 1e9
            except (OSError, ValueError, KeyError):
                continue
        return None

    def cpu_limit(self, name):
        """The allocation's cpu.max in cores (None: no limit)."""
        for folder in self.folders(name):
            try:
                if self.kind == "v2":
                    quota, period = (folder / "cpu.max").read_text().split()
                else:
                    quota, period = (folder / "cpu.cfs_quota_us").read_text(), (folder / "cpu.cfs_period_us").read_text()
                return None if quota.strip() in ("max", "-1") else int(quota) / int(period)
            except (OSError, ValueError):
                continue
        return None

    def throttled(self, name):
        """How many CPU periods the allocation was held back in for reaching its cpu.max."""
        for folder in self.folders(name):
            try:
                stats = dict(line.split() for line in (folder / "cpu.stat").read_text().splitlines())
                return int(stats["nr_throttled"])
            except (OSError, ValueError, KeyError):
                continue
        return None

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
        """Cgroups a dead runner of this node left (their processes are killed at register)."""
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


def unlinked_open_bytes(pids, device):
    """Disk taken by files on device that the processes hold open after unlinking them (each
    once): a job's folder measured by walking it misses them, and they can be as large as the
    job likes."""
    seen = set()
    total = 0
    for pid in pids:
        try:
            names = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for name in names:
            try:
                st = os.stat(f"/proc/{pid}/fd/{name}")
            except OSError:
                continue
            key = (st.st_dev, st.st_ino)
            if st.st_nlink == 0 and st.st_dev == device and stat.S_ISREG(st.st_mode) and key not in seen:
                seen.add(key)
                total += st.st_blocks * 512
    return total


def reachable_by_others(path):
    try:
        return bool(os.stat(path).st_mode & stat.S_IXOTH)
    except OSError:
        return False


@dataclass
class Sandbox:
    """One allocation's isolation: its uid, cgroup, limits and the view its sandbox gives it."""

    isolation: "Isolation"
    name: str  # the allocation's id: the cgroup's name
    job_id: str
    limits: Limits
    uid: int | None = None
    slot: int | None = None
    network: bool = True
    devices: tuple = ()  # device nodes bound in
    runtime: tuple = ()  # more read-only paths: the job's environment
    uplink: bool = False  # a network of its own, with slirp4netns to the outside
    cgroups: list = field(default_factory=list)
    _ends: dict = field(default_factory=dict)  # the runner's ends of the uplink's pipes
    _slirp: object = None
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
                log.warning("no cgroup for allocation %s (%s): its memory, CPU and processes are not limited", self.name, error)
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

    def command(self, command, dirs, env, cwd=None):
        """(argv, env, fds to pass) that start command in this sandbox: the shim, then bwrap,
        in cwd (a folder of the job's, its code folder by default). The job's environment
        travels to bwrap through a memory file, never through the shim's or bwrap's own
        environment (an LD_PRELOAD of the job's must not reach them)."""
        iso = self.isolation
        cwd = str(Path(cwd or dirs.code).resolve())
        spec = {"cgroups": [str(c) for c in self.cgroups], "cwd": cwd}
        if iso.enabled:
            spec["rlimits"] = rlimits(self.limits, per_user=self.uid is not None, hard=iso.hard)
        fds = ()
        if iso.sandboxed:
            extra, files, passed = (), (), []
            if self.uplink:
                info_r, info_w = os.pipe()
                block_r, block_w = os.pipe()
                resolv = args_file([])
                os.write(resolv, f"nameserver {SLIRP_DNS}\n".encode())
                os.lseek(resolv, 0, os.SEEK_SET)
                self._ends = {"info": info_r, "block": block_w}
                extra = ("--info-fd", str(info_w), "--block-fd", str(block_r))
                files = ((resolv, "/etc/resolv.conf"),) if os.path.isfile("/etc/resolv.conf") and not os.path.islink("/etc/resolv.conf") else ()
                passed = [info_w, block_r, resolv]
                spec.update(netns=True, deny=iso.denied(), pass_fds=passed)
            if self.uid is not None:
                # The job's user, named: libraries ask who runs them (getpass.getuser(), as
                # torch's compile caches do, or pwd.getpwuid()) and fail on a uid the node's
                # /etc/passwd lacks. It reads the node's lines and one for itself.
                env = {**env, "USER": JOB_USER, "LOGNAME": JOB_USER}
                if os.path.isfile("/etc/passwd") and not os.path.islink("/etc/passwd"):
                    passwd = memory_file(job_passwd(Path("/etc/passwd").read_text(errors="replace"), self.uid, env.get("HOME", "/")))
                    files, passed = (*files, (passwd, "/etc/passwd")), [*passed, passwd]
                    spec["pass_fds"] = passed
            view = iso.view(dirs, network=self.network, devices=self.devices, env=env, extra=self.runtime, args=extra, files=files, cwd=cwd)
            fd = args_file(sandbox_args(view))
            spec.update(bwrap=iso.bwrap, args_fd=fd)
            fds = (fd, *passed)
            if self.uid is not None:
                spec["covers"] = iso.covers([view.root, *view.runtime])
        if self.uid is not None:
            spec["uid"] = spec["gid"] = self.uid
        outer = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "E31_JOB_ID": self.job_id, "E31_ALLOCATION_ID": self.name}
        if not iso.sandboxed:
            outer = env  # isolation is off: the job runs as the runner's user, its environment as given
        return shim_command(command, spec), outer, fds

    def connect(self, outer_pid, timeout=30.0):
        """Give a started sandbox that asked for the network its uplink: slirp4netns joins its
        network from outside (NAT to the world, the node's own loopback refused), then the job
        is let go (bwrap waits on --block-fd until then). outer_pid: bwrap's own process, in the
        network the shim made (owned by the node's user namespace, so root may join it; the
        sandbox's processes are in bwrap's user namespace, where root is nobody). A no-op for
        other sandboxes."""
        if not self._ends:
            return
        import select

        info_r, block_w = self._ends["info"], self._ends["block"]
        try:
            buffer, deadline = b"", time.monotonic() + timeout
            while True:
                if not select.select([info_r], [], [], max(0.0, deadline - time.monotonic()))[0]:
                    raise RuntimeError("the sandbox did not start in time")
                chunk = os.read(info_r, 4096)
                buffer += chunk
                try:
                    json.loads(buffer)["child-pid"]  # bwrap is set up, and waits on --block-fd
                    break
                except ValueError:
                    if not chunk:
                        raise RuntimeError("the sandbox ended before it started") from None
            ready_r, ready_w = os.pipe()
            try:
                self._slirp = subprocess.Popen(
                    [self.isolation.slirp, "--configure", "--mtu=65520", "--disable-host-loopback", "--ready-fd", str(ready_w), str(outer_pid), "tap0"],
                    pass_fds=(ready_w,),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                    env={"PATH": "/usr/bin:/bin"},
                    start_new_session=True,
                )
            finally:
                os.close(ready_w)
            try:
                if not select.select([ready_r], [], [], timeout)[0] or os.read(ready_r, 1) != b"1":
                    why = self._slirp.stderr.read1(2000).decode(errors="replace").strip() if self._slirp.poll() is not None else "no answer"
                    raise RuntimeError(f"its network could not be connected: {why}")
            finally:
                os.close(ready_r)
            os.write(block_w, b"go")
        finally:
            for fd in self._ends.values():
                os.close(fd)
            self._ends = {}

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
        for fd in self._ends.values():
            os.close(fd)
        self._ends = {}
        if self._slirp is not None:
            self._slirp.kill()
            self._slirp.wait()
            self._slirp = None
        if self.cgroups:
            self.isolation.cgroups.remove(self.name)
            self.cgroups = []
        if self.slot is not None:
            self.isolation.slots.pop(self.name, None)
            self.isolation.claims.release(self.uid)


JOB_USER = "e31-job"


def job_passwd(host, uid, home):
    """The /etc/passwd a job sees: the node's lines, less any for the job's uid or name, and its
    own user's (no password, no login shell)."""
    kept = [line for line in host.splitlines() if line and line.split(":")[0] != JOB_USER and line.split(":")[2:3] != [str(uid)]]
    return "\n".join([*kept, f"{JOB_USER}:x:{uid}:{uid}:E31 Network job:{home}:/usr/sbin/nologin"]) + "\n"


def memory_file(text):
    """A memory file holding text, read from the start (bwrap --ro-bind-data FD PATH)."""
    fd = os.memfd_create("e31-sandbox", 0)
    os.write(fd, text.encode())
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def args_file(args):
    """A memory file holding args NUL-separated (bwrap --args FD), read from the start."""
    fd = os.memfd_create("e31-sandbox", 0)
    os.write(fd, b"".join(a.encode() + b"\0" for a in args))
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def system_folders(names=("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")):
    """The host's system folders as View.system: links kept as links (a merged /usr), folders
    bound read-only."""
    out = []
    for path in names:
        if os.path.islink(path):
            out.append(("symlink", os.readlink(path), path))
        elif os.path.isdir(path):
            out.append(("bind", path, path))
    return tuple(out)


class Isolation:
    """What this node can do to isolate jobs, probed once when the runner starts."""

    def __init__(self, runner_name, work_dir, cache_dir, settings):
        self.settings = settings
        self.work_dir = Path(work_dir).resolve()
        self.cache_dir = Path(cache_dir).resolve()
        self.enabled = bool(getattr(settings, "E31_JOB_ISOLATION", True))
        self.root = is_root()
        self.bwrap = shutil.which(getattr(settings, "E31_BWRAP", "") or "bwrap")
        self.slirp = shutil.which("slirp4netns")
        self.sandboxed = self.users_on = self.cgroups_on = self.uplinks = False
        self.cgroups = Cgroups(None, getattr(settings, "E31_JOB_CGROUP_PARENT", "e31"))
        self.slots = {}  # allocation id -> uid slot
        self.claims = UidClaims(getattr(settings, "E31_JOB_UID_LOCK_DIR", "/run/e31/job-uids"))
        self.last_slot = (os.getpid() * 7919) % settings.E31_JOB_UID_COUNT
        import resource

        self.hard = {name: resource.getrlimit(getattr(resource, name))[1] for name in ("RLIMIT_NOFILE", "RLIMIT_FSIZE", "RLIMIT_NPROC")}
        self.node_memory = _node_memory()
        self.node_cpus = os.cpu_count()
        self.system = system_folders()
        self.deny = parse_networks(getattr(settings, "E31_JOB_NETWORK_DENY", ""))  # a bad setting stops the runner here

    # Start-up ------------------------------------------------------------------------------

    def probe(self, node_key, known_good=None):
        """Find out which mechanisms work here, one log line for what does not; raises
        IsolationUnavailable where jobs were to be sandboxed and cannot be.

        known_good: a file where a sandbox that started here lately is noted (an agent per
        allocation on a cluster engine's node, whose start is on the meter, trusts it for
        PROBE_TRUST_SECONDS rather than start one more: a sandbox that fails anyway fails the
        job's start, with bubblewrap's reason)."""
        self.cgroups.use(node_key)
        if not self.enabled:
            log.warning(
                "job isolation is OFF (E31_JOB_ISOLATION=0, for development only): jobs run as the runner's user, "
                "see what it sees, keep its network, and have no cgroups or resource limits"
            )
            return
        if not self.bwrap:
            raise IsolationUnavailable(f"this runner cannot sandbox jobs: bubblewrap (bwrap) is not installed; {INSTALL_HINT}")
        self.work_dir.mkdir(parents=True, exist_ok=True)
        if self.root:
            os.chmod(self.work_dir, 0o711)  # a job passes through to its folder, and cannot list the others
            self._probe_cgroups()
            self.users_on = True
        self.sandboxed = True
        ok, why = self._tried(known_good)
        if not ok:
            self.sandboxed = self.users_on = False
            raise IsolationUnavailable(f"this runner cannot sandbox jobs: bubblewrap failed here ({why}); {INSTALL_HINT}")
        if not self.root:
            log.info("job isolation: the runner is not root, so jobs run in the sandbox as its user, without cgroups")
        # A job given the network gets a network of its own with an uplink (slirp4netns), not
        # the node's: where that cannot be, it shares the node's, loopback services included.
        self.uplinks = self.root and bool(self.slirp)
        if not self.uplinks:
            log.warning(
                "job isolation: jobs given the network share this node's network, its loopback included "
                "(%s): install slirp4netns (apt-get install slirp4netns)",
                "slirp4netns is missing" if self.root else "the runner is not root",
            )
        lost = []
        if not self.cgroups_on:
            lost.append("memory, CPU and process limits")
        elif self.cgroups.kind == "v1":
            lost.append("cgroup v1 only: no swap limit unless memsw accounting is on, no pressure figures")
        log.info(
            "job isolation: bubblewrap %s, users %s, cgroups %s%s",
            self.bwrap,
            "on" if self.users_on else "off",
            self.cgroups.kind if self.cgroups_on else "off",
            f" (lost here: {'; '.join(lost)})" if lost else "",
        )

    def _probe_cgroups(self):
        if self.cgroups.kind is None:
            log.info("job isolation: no cgroup hierarchy here, so job memory, CPU and processes are not limited")
            return
        try:
            made = self.cgroups.create("probe", Limits(2**30, 64, 64, 2**20, 2**20, 1.0))
            self.cgroups.remove("probe")
            self.cgroups_on = bool(made)
        except OSError as error:
            log.info("job isolation: cannot make cgroups (%s), so job memory, CPU and processes are not limited", error)
            self.cgroups.remove("probe")

    def _tried(self, known_good):
        """_try, or its success noted in known_good by this user within PROBE_TRUST_SECONDS for the
        same bubblewrap, Python and users."""
        noted = f"{self.bwrap} {sys.executable} users={self.users_on}"
        if known_good is not None:
            try:
                info = known_good.stat()
                if info.st_uid == os.getuid() and time.time() - info.st_mtime < PROBE_TRUST_SECONDS and known_good.read_text() == noted:
                    return True, ""
            except OSError:
                pass
        ok, why = self._try()
        if ok and known_good is not None:
            try:
                known_good.parent.mkdir(parents=True, exist_ok=True)
                partial = known_good.with_name(f"{known_good.name}.{os.getpid()}")
                fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
                with os.fdopen(fd, "w") as f:
                    f.write(noted)
                os.replace(partial, known_good)
            except OSError as error:
                log.info("job isolation: could not note the sandbox's success in %s (%s)", known_good, error)
        return ok, why

    def _try(self):
        """Start a job-like command in a sandbox: it imports the SDK and writes in its folder."""

        dirs = JobDirs(self.work_dir / f".probe-{os.getpid()}")
        uid = job_uid(self.settings.E31_JOB_UID_BASE, self.settings.E31_JOB_UID_COUNT - 1) if self.users_on else None
        try:
            dirs.create()
            sandbox = Sandbox(self, "probe", "probe", Limits(None, 256, 256, 2**20, 2**20), uid=uid, network=False)
            sandbox.prepare(dirs)
            env = {"PATH": f"{os.path.dirname(sys.executable)}:/usr/bin:/bin", "HOME": str(dirs.root)}
            argv, outer, fds = sandbox.command([sys.executable, "-c", "import e31; open('ok', 'w').write('ok')"], dirs, env)
            try:
                result = subprocess.run(
                    argv,
                    cwd="/",
                    capture_output=True,
                    timeout=60,
                    stdin=subprocess.DEVNULL,
                    env=outer,
                    pass_fds=fds,
                )
            except (OSError, subprocess.SubprocessError) as error:
                return False, str(error)
            finally:
                for fd in fds:
                    os.close(fd)
            if result.returncode == 0 and (dirs.code / "ok").exists():
                return True, ""
            return False, (result.stderr.decode(errors="replace").strip().splitlines() or [f"exit {result.returncode}"])[-1]
        finally:
            shutil.rmtree(dirs.root, ignore_errors=True)

    def kill_leftovers(self, own):
        """Processes in the cgroups this node's earlier runner left (it died): killed, but only
        for allocations the database says were this node's (own: their ids)."""
        if not self.cgroups_on:
            return
        for name in self.cgroups.leftovers() & {str(a) for a in own}:
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

    @cached_property
    def runtime(self):
        """The Python the jobs run and the SDK, as read-only paths: never the network's own
        folders (the var folder, the storage, the cache, the jobs), nor a folder holding one.
        The same for every job of this runner: worked out once."""

        hidden = [
            os.path.realpath(p)
            for p in (settings.VAR_DIR, settings.STORAGE_DIR, settings.RUNNER_CACHE_DIR, settings.E31_ENGINE_WORK_DIR, self.cache_dir, self.work_dir)
        ]
        wanted = [sys.prefix, sys.base_prefix, os.path.dirname(os.path.realpath(sys.executable)), os.path.dirname(e31.__file__)]
        wanted += [p for p in sys.path if p and ("site-packages" in p or "dist-packages" in p)]
        out = []
        for path in wanted:
            path = os.path.realpath(path)
            if not os.path.isdir(path) or any(_under(path, h) or _under(h, path) for h in hidden):
                continue
            if not any(_under(path, kept) for kept in out):
                out = [kept for kept in out if not _under(kept, path)] + [path]
        return tuple(sorted(out))

    def view(self, dirs, *, network, devices, env, extra=(), args=(), files=(), cwd=None):
        root = str(Path(dirs.root).resolve())
        read_only = tuple(str(Path(p).resolve()) for p in (dirs.data, dirs.model) if Path(p).is_dir())
        return View(
            root=root,
            cwd=str(Path(cwd or dirs.code).resolve()),
            system=self.system,
            runtime=(*self.runtime, *extra),
            read_only=read_only,
            devices=tuple(devices),
            network=network,
            env=tuple((str(k), str(v)) for k, v in env.items()),
            extra=tuple(args),
            files=tuple(files),
        )

    def denied(self):
        """The networks a job's own network refuses, read when each job starts (the node's
        addresses can change)."""
        try:
            with open("/proc/net/fib_trie") as trie:
                addresses = local_addresses(trie.read())
        except OSError:
            addresses = []
        return denied_networks(self.deny, addresses)

    def covers(self, paths):
        """Where the job's uid cannot pass on its way to a path bwrap binds (Python under /root,
        a job folder under pytest's private /tmp folder): the shim covers that folder with an
        empty tmpfs in a mount namespace of its own and binds the path back, so bwrap (already the
        job's uid) can reach it. Nothing else of the host is changed."""
        return [[folder, mode, kept] for folder, mode, kept in mount_plan(sorted(set(paths)), {}, reachable_by_others)]

    def sandbox(self, allocation, job, gang):
        s = self.settings
        node_disk = _disk_size(self.work_dir)
        limits = job_limits(
            memory_bytes=s.E31_JOB_MEMORY_BYTES,
            max_processes=s.E31_JOB_MAX_PROCESSES,
            max_open_files=s.E31_JOB_MAX_OPEN_FILES,
            max_file_bytes=s.E31_JOB_MAX_FILE_BYTES,
            disk_bytes=s.E31_JOB_DISK_BYTES,
            devices_held=len(allocation.devices),
            devices_total=allocation.node.devices,
            node_memory=self.node_memory,
            node_disk=node_disk,
            memory_reserve=s.E31_NODE_RESERVE_MEMORY_BYTES or None,
            disk_reserve=s.E31_NODE_RESERVE_DISK_BYTES or None,
            device_type=allocation.device_type,
            node_cpus=self.node_cpus,
        )
        network = keeps_network(job.network, gang, allocation.gang_size)
        sandbox = Sandbox(
            self,
            str(allocation.pk),
            str(job.pk),
            limits,
            network=network,
            devices=gpu_device_nodes(allocation.devices, allocation.device_type),
            # A gang's processes are reached by their peers: they keep the node's network.
            uplink=network and gang is None and allocation.gang_size == 1 and self.uplinks,
        )
        self._give_uid(sandbox)
        return sandbox

    def _give_uid(self, sandbox):
        """A uid of its own from the pool, locked machine-wide (where the runner is root)."""
        if not self.users_on:
            return
        s = self.settings
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

    def run_untrusted(self, name, command, folder, env, *, read_only=(), timeout, network=False):
        """Work the node does with code it does not trust (a package's build from source), in a
        sandbox of its own: a uid from the pool, a cgroup with one slot's limits, folder handed
        to that uid and writable, read_only bound beside the runtime, no network. (exit code,
        output). Afterwards nothing of it runs, and folder is root's again: what the uid made is
        taken back, and any other entry (a hard link it made to a file not its own) removed."""

        s = self.settings
        limits = job_limits(
            memory_bytes=s.E31_JOB_MEMORY_BYTES,
            max_processes=s.E31_JOB_MAX_PROCESSES,
            max_open_files=s.E31_JOB_MAX_OPEN_FILES,
            max_file_bytes=s.E31_JOB_MAX_FILE_BYTES,
            disk_bytes=s.E31_JOB_DISK_BYTES,
            devices_held=1,
            devices_total=self.node_cpus or 1,
            node_memory=self.node_memory,
            node_cpus=self.node_cpus,
        )
        sandbox = Sandbox(self, f"{name}-{os.getpid()}", name, limits, network=network, uplink=network and self.uplinks)
        dirs = JobDirs(Path(folder))
        dirs.code.mkdir(parents=True, exist_ok=True)
        self._give_uid(sandbox)
        try:
            sandbox.prepare(dirs)
            sandbox.runtime = tuple(str(Path(p).resolve()) for p in read_only)
            argv, outer, fds = sandbox.command(command, dirs, env)
            try:
                process = subprocess.Popen(
                    argv,
                    env=outer,
                    pass_fds=fds,
                    cwd="/",
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                )
            finally:
                for fd in fds:
                    os.close(fd)
            try:
                sandbox.connect(process.pid)
                output, _ = process.communicate(timeout=timeout)
                code, output = process.returncode, output.decode(errors="replace")
            except (subprocess.TimeoutExpired, RuntimeError) as error:
                process.kill()
                process.communicate()
                code = 124
                output = f"it took longer than {timeout} s" if isinstance(error, subprocess.TimeoutExpired) else str(error)
        finally:
            sandbox.release()
        if sandbox.uid is not None:
            take_back(folder, sandbox.uid)
        os.chmod(folder, 0o755)
        return code, output


def take_back(folder, uid):
    """After an untrusted uid worked in folder (nothing of it running): every entry it made
    becomes root's, and any entry it did not make is removed (a hard link to someone else's
    file: changing that one's owner or mode would change the original). Links are never
    followed."""
    seen = []  # every entry as it was, before any is changed (hard links share an owner)
    for top, dirs, files in os.walk(folder):
        seen += [(os.path.join(top, name), os.lstat(os.path.join(top, name))) for name in dirs + files]
    for path, st in seen:
        if st.st_uid == uid:
            os.lchown(path, 0, 0)
        elif not stat.S_ISDIR(st.st_mode):
            os.unlink(path)
    os.lchown(folder, 0, 0)


def is_root():
    return os.geteuid() == 0


def shim_command(command, spec, python=sys.executable):
    """The command, started through the shim: the job's cgroup joined, its limits set, its user
    taken, killed by the kernel if the runner dies (Linux), then bwrap (or, with isolation off,
    the command itself)."""
    return [python, "-I", "-S", str(SHIM), str(os.getpid()), json.dumps(spec), *command]


def sandbox_group(outer_pid):
    """The process group of the job's processes, seen from the host: bwrap's child (the
    sandbox's init) starts a session of its own, and the job's command runs in it. A signal
    sent to that group from outside reaches the job; the init itself takes only SIGKILL from
    outside its namespace. None until it exists."""
    try:
        children = Path(f"/proc/{outer_pid}/task/{outer_pid}/children").read_text().split()
        return os.getpgid(int(children[0])) if children else None
    except (OSError, ValueError):
        return None


def _disk_size(path):
    try:
        st = os.statvfs(path)
        return st.f_blocks * st.f_frsize
    except OSError:
        return None


def _node_memory():
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
