"""A real single-node Slurm for tests: Debian's slurm-wlm and munge (bin/setup installs them),
started as DESIGN.md describes, on loopback ports of its own, and stopped at the end.

Everything lives in one temporary folder: the munge key, munged's socket, slurm.conf, the
controller's state, slurmd's spool, pid files and logs. munged listens on a socket in that folder
(slurm.conf names it in AuthInfo), so the machine's own /etc/munge and any munged or Slurm already
running there are left alone; only the daemons started here are stopped, by their process ids.
"""

import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "sinfo", "squeue", "scancel")


def missing_tools():
    return [name for name in DAEMONS if shutil.which(name, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin") is None]


def _free_ports(count):
    ports = set()
    while len(ports) < count:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.add(s.getsockname()[1])
    return sorted(ports)


def _memory_mb():
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) // 1024
    raise RuntimeError("no MemTotal in /proc/meminfo")


def _which(name):
    return shutil.which(name, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")


class SlurmCluster:
    """One controller and one node (this machine, its CPUs as the slots) in one partition; with
    nodes=N, N nodes on this machine (a slurmd each, `slurmd -N`, on ports of their own), the
    machine's CPUs shared out between them: for runs across nodes through srun."""

    partition = "e31test"

    def __init__(self, nodes=1):
        self.root = Path(tempfile.mkdtemp(prefix="e31-slurm-"))
        self.root.chmod(0o755)  # munged (as the munge user) must reach its socket folder
        self.host = socket.gethostname().split(".")[0]
        self.names = [self.host] if nodes == 1 else [f"e31n{i}" for i in range(1, nodes + 1)]
        self.node = self.names[0]
        self.cpus = max(1, (os.cpu_count() or 1) // nodes)
        # slurmd drains a node whose configured memory is more than it finds: leave a reserve.
        total = _memory_mb()
        self.memory_mb = total - max(512, total // 10)
        self.conf = self.root / "slurm.conf"
        self.munge_socket = self.root / "munge" / "munge.socket"
        self.ctld_port, self.slurmd_port, *self.node_ports = _free_ports(2 + len(self.names))
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.processes: dict[str, subprocess.Popen] = {}

    # -- the daemons ---------------------------------------------------------------------------

    def start(self, timeout=60):
        started = time.monotonic()
        self._start_munged()
        self._write_conf()
        for folder in ("state", "spool", "log", "run"):
            (self.root / folder).mkdir()
        if len(self.names) > 1:
            for name in self.names:
                (self.root / "spool" / name).mkdir()
        self.processes["slurmctld"] = self._daemon("slurmctld", [_which("slurmctld"), "-D", "-i"])
        self.start_slurmd()
        self.wait_for_state("idle", timeout=timeout - (time.monotonic() - started))
        self.started_in = time.monotonic() - started
        return self

    def _start_munged(self):
        folder = self.munge_socket.parent
        folder.mkdir()
        munge = pwd.getpwnam("munge")
        key = folder / "munge.key"
        key.write_bytes(os.urandom(1024))
        for path in (folder, key):
            os.chown(path, munge.pw_uid, munge.pw_gid)
        key.chmod(0o400)
        folder.chmod(0o755)  # munged insists that everyone may reach its socket
        args = [
            _which("munged"),
            "--foreground",
            f"--socket={self.munge_socket}",
            f"--key-file={key}",
            f"--pid-file={folder / 'munged.pid'}",
            f"--seed-file={folder / 'munged.seed'}",
            f"--log-file={folder / 'munged.log'}",
        ]
        log = open(self.root / "munged.out", "ab")  # noqa: SIM115 - open for the daemon's life
        self.processes["munged"] = subprocess.Popen(
            args, user=munge.pw_uid, group=munge.pw_gid, extra_groups=[], stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + 10
        while not self.munge_socket.exists():
            if self.processes["munged"].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"munged did not start: {self._tail(folder / 'munged.log')}")
            time.sleep(0.05)

    def _write_conf(self):
        r = self.root
        many = len(self.names) > 1
        self.conf.write_text(
            "\n".join(
                [
                    "ClusterName=e31test",
                    f"SlurmctldHost={self.host}(127.0.0.1)",
                    "SlurmUser=root",
                    f"SlurmctldPort={self.ctld_port}",
                    f"SlurmdPort={self.slurmd_port}",
                    "AuthType=auth/munge",
                    "CredType=cred/munge",
                    f"AuthInfo=socket={self.munge_socket}",
                    f"StateSaveLocation={r / 'state'}",
                    f"SlurmdSpoolDir={r / 'spool' / ('%n' if many else '')}".rstrip("/"),
                    f"SlurmctldPidFile={r / 'run' / 'slurmctld.pid'}",
                    f"SlurmdPidFile={r / 'run' / ('slurmd-%n.pid' if many else 'slurmd.pid')}",
                    f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}",
                    f"SlurmdLogFile={r / 'log' / ('slurmd-%n.log' if many else 'slurmd.log')}",
                    "ProctrackType=proctrack/linuxproc",
                    "TaskPlugin=task/none",
                    "SelectType=select/cons_tres",
                    "SelectTypeParameters=CR_Core_Memory",
                    "ReturnToService=2",
                    "MpiDefault=none",
                    "JobAcctGatherType=jobacct_gather/none",
                    "AccountingStorageType=accounting_storage/none",
                    # A lost slurmd is noticed in seconds, not the default five minutes (the
                    # node-failure tests stop it); scancel's TERM-to-KILL wait is short too.
                    "SlurmdTimeout=20",
                    "KillWait=5",
                    "MinJobAge=600",  # finished jobs stay visible to scontrol/squeue for the tests
                    "DefMemPerCPU=64",  # a job that asks for no memory does not take the whole node's
                    *(
                        [f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory={self.memory_mb} State=UNKNOWN"]
                        if not many
                        else [
                            f"NodeName={name} NodeHostname={self.host} NodeAddr=127.0.0.1 Port={port} CPUs={self.cpus} "
                            f"RealMemory={self.memory_mb // len(self.names)} State=UNKNOWN"
                            for name, port in zip(self.names, self.node_ports, strict=True)
                        ]
                    ),
                    f"PartitionName={self.partition} Nodes={','.join(self.names)} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO",
                    "",
                ]
            )
        )

    def _daemon(self, name, args):
        log = open(self.root / f"{name}.out", "ab")  # noqa: SIM115 - open for the daemon's life
        return subprocess.Popen(args, env=self.env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, cwd=self.root)

    def start_slurmd(self):
        """Start (or restart, after stop_slurmd) the nodes' daemons."""
        if len(self.names) == 1:
            self.processes["slurmd"] = self._daemon("slurmd", [_which("slurmd"), "-D"])
            return
        for name in self.names:
            self.processes[f"slurmd-{name}"] = self._daemon(f"slurmd-{name}", [_which("slurmd"), "-D", "-N", name])

    def stop_slurmd(self, sig=signal.SIGKILL):
        """Stop the nodes' daemons as a node failure would (SIGKILL by default): jobs' steps go on
        until the controller gives the nodes up."""
        for key in [key for key in self.processes if key.startswith("slurmd")]:
            process = self.processes.pop(key)
            if process.poll() is None:
                process.send_signal(sig)
                process.wait(timeout=30)

    def stop(self):
        # Jobs first (so their steps end while slurmd is there to end them), then the daemons,
        # newest first; then the folder.
        if self.processes.get("slurmctld") and self.processes["slurmctld"].poll() is None:
            subprocess.run(["scancel", "--full", "--partition", self.partition], env=self.env, capture_output=True, timeout=30)
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and self.squeue_ids():
                time.sleep(0.5)
        for name in [key for key in self.processes if key.startswith("slurmd")] + ["slurmctld", "munged"]:
            process = self.processes.pop(name, None)
            if process is None or process.poll() is not None:
                continue
            process.terminate()
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=15)
        shutil.rmtree(self.root, ignore_errors=True)

    # -- looking at it -------------------------------------------------------------------------

    def run(self, *args, check=True):
        return subprocess.run(list(args), env=self.env, capture_output=True, text=True, timeout=30, check=check)

    def node_state(self):
        """The node's state as sinfo prints it (idle, mixed, alloc, drain, down*, ...), or "" when
        the controller does not answer yet."""
        done = self.run("sinfo", "--noheader", "--nodes", ",".join(self.names), "--format=%t", check=False)
        states = set(done.stdout.split()) if done.returncode == 0 else set()
        return states.pop() if len(states) == 1 else ""  # every node in one state, or not yet

    def wait_for_state(self, *states, timeout=60):
        deadline = time.monotonic() + timeout
        while (state := self.node_state()) not in states:
            for name, process in self.processes.items():
                if process.poll() is not None:
                    raise RuntimeError(f"{name} exited ({process.returncode}): {self.logs()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the node is {state or 'not answering'}, not {'/'.join(states)}, after {timeout:.0f} s: {self.logs()}")
            time.sleep(0.2)

    def squeue_ids(self):
        done = self.run("squeue", "--noheader", "--format=%i", check=False)
        return done.stdout.split() if done.returncode == 0 else []

    def logs(self):
        return "\n".join(f"--- {path.name}\n{self._tail(path)}" for path in sorted(self.root.glob("**/*.log")) + sorted(self.root.glob("*.out")))

    @staticmethod
    def _tail(path, lines=20):
        try:
            return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        except OSError as error:
            return str(error)


@pytest.fixture(scope="session")
def slurm():
    """A running single-node Slurm for the session: skipped where slurm-wlm and munge are not
    installed (bin/setup test installs them), except in CI, where that is a failure."""
    yield from _running(nodes=1)


@pytest.fixture(scope="module")
def slurm_pair():
    """A running Slurm of two nodes on this machine (a slurmd each), for runs across nodes."""
    yield from _running(nodes=2)


def _running(nodes):
    missing = missing_tools()
    if missing:
        reason = f"Slurm is not installed here (missing {', '.join(missing)}): run bin/setup test, or apt-get install slurm-wlm munge"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    if os.geteuid() != 0:
        reason = "a test Slurm cluster is started as root (SlurmUser=root, munged as the munge user)"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    cluster = SlurmCluster(nodes=nodes)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
