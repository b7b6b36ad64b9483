"""A real single-node Slurm for tests: Debian's slurm-wlm and munge (bin/setup installs them),
started as DESIGN.md describes, on loopback ports of its own, and stopped at the end.

Everything lives in one temporary folder: the munge key, munged's socket, slurm.conf, the
controller's state, slurmd's spool, pid files and logs. munged listens on a socket in that folder
(slurm.conf names it in AuthInfo), so the machine's own /etc/munge and any munged or Slurm already
running there are left alone; only the daemons started here are stopped, by their process ids.
"""

import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "sinfo", "squeue", "scancel")
# Accounting: slurmdbd on a MariaDB server of the cluster's own (bin/setup test installs them).
ACCOUNTING = ("slurmdbd", "sacct", "mariadbd", "mariadb-install-db", "my_print_defaults")
DB_NAME, DB_USER = "slurm_acct_db", "slurm"


def missing_tools(accounting=False):
    tools = DAEMONS + (ACCOUNTING if accounting else ())
    return [name for name in tools if shutil.which(name, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin") is None]


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


def _has_user(name):
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


def _which(name):
    return shutil.which(name, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")


class SlurmCluster:
    """One controller and one node (this machine, its CPUs as the slots) in one partition; with
    nodes=N, N nodes on this machine (a slurmd each, `slurmd -N`, on ports of their own), the
    machine's CPUs shared out between them: for runs across nodes through srun. With
    accounting=True, Slurm's accounting is on, as on most production clusters: slurmdbd, on a
    MariaDB server of its own in the same folder (on a loopback port, the machine's own MariaDB
    and /etc/mysql never read), so that sacct answers."""

    partition = "e31test"

    def __init__(self, nodes=1, accounting=False):
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
        self.accounting = accounting
        self.ctld_port, self.slurmd_port, self.db_port, self.dbd_port, *self.node_ports = _free_ports(4 + len(self.names))
        self.db_dir = self.root / "mariadb"
        self.db_password = secrets.token_hex(12)
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
        if self.accounting:
            self._start_accounting()
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
                    *(
                        [
                            "AccountingStorageType=accounting_storage/slurmdbd",
                            "AccountingStorageHost=127.0.0.1",
                            f"AccountingStoragePort={self.dbd_port}",
                            # The clients (sacct) and slurmctld reach slurmdbd with this munge
                            # socket, not AuthInfo's: without it, the machine's own.
                            f"AccountingStoragePass=socket={self.munge_socket}",
                        ]
                        if self.accounting
                        else ["AccountingStorageType=accounting_storage/none"]
                    ),
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

    def _start_accounting(self):
        """A MariaDB server and slurmdbd, from this folder; the cluster registers itself with
        slurmdbd when slurmctld starts, and jobs are recorded without accounts (no enforcement)."""
        owner = pwd.getpwnam("mysql") if _has_user("mysql") else pwd.getpwnam("root")  # mariadb-server-core alone makes no mysql user
        self.db_dir.mkdir()
        os.chown(self.db_dir, owner.pw_uid, owner.pw_gid)
        data = self.db_dir / "data"
        # --no-defaults first, always: the machine's /etc/mysql names its own socket, data and port.
        small = ["--innodb-log-file-size=8M", "--innodb-buffer-pool-size=32M"]
        subprocess.run(
            [_which("mariadb-install-db"), "--no-defaults", f"--datadir={data}", f"--user={owner.pw_name}", "--skip-test-db", *small],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        init = self.db_dir / "init.sql"  # run by the server before it takes a client: slurmdbd's user
        init.write_text(
            f"CREATE USER IF NOT EXISTS '{DB_USER}'@'127.0.0.1' IDENTIFIED BY '{self.db_password}';\nGRANT ALL ON `{DB_NAME}`.* TO '{DB_USER}'@'127.0.0.1';\n"
        )
        init.chmod(0o644)
        self.processes["mariadbd"] = self._daemon(
            "mariadbd",
            [
                _which("mariadbd"),
                "--no-defaults",
                f"--user={owner.pw_name}",
                f"--datadir={data}",
                f"--socket={self.db_dir / 'mariadbd.sock'}",
                f"--pid-file={self.db_dir / 'mariadbd.pid'}",
                f"--log-error={self.db_dir / 'mariadbd.log'}",
                f"--port={self.db_port}",
                "--bind-address=127.0.0.1",
                "--skip-name-resolve",
                f"--init-file={init}",
                *small,
            ],
        )
        self._wait_for_port("mariadbd", self.db_port)
        # slurmdbd reads slurmdbd.conf beside slurm.conf, and refuses one others can read.
        dbd_conf = self.root / "slurmdbd.conf"
        dbd_conf.touch(mode=0o600)
        dbd_conf.write_text(
            "\n".join(
                [
                    "SlurmUser=root",
                    "DbdHost=localhost",
                    "DbdAddr=127.0.0.1",
                    f"DbdPort={self.dbd_port}",
                    "AuthType=auth/munge",
                    f"AuthInfo=socket={self.munge_socket}",
                    "StorageType=accounting_storage/mysql",
                    "StorageHost=127.0.0.1",  # "localhost" would be the machine's own MariaDB socket
                    f"StoragePort={self.db_port}",
                    f"StorageUser={DB_USER}",
                    f"StoragePass={self.db_password}",
                    f"StorageLoc={DB_NAME}",
                    f"PidFile={self.root / 'run' / 'slurmdbd.pid'}",
                    f"LogFile={self.root / 'log' / 'slurmdbd.log'}",
                    "",
                ]
            )
        )
        self.processes["slurmdbd"] = self._daemon("slurmdbd", [_which("slurmdbd"), "-D"])
        self._wait_for_port("slurmdbd", self.dbd_port)

    def _wait_for_port(self, name, port, timeout=60):
        deadline = time.monotonic() + timeout
        while True:
            with socket.socket() as probe:
                probe.settimeout(0.2)
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    return
            if self.processes[name].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not start: {self.logs()}")
            time.sleep(0.05)

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
        for key in [key for key in self.processes if key.startswith("slurmd-") or key == "slurmd"]:
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
        for name in [key for key in self.processes if key.startswith("slurmd-") or key == "slurmd"] + ["slurmctld", "slurmdbd", "mariadbd", "munged"]:
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
        logs = [p for p in sorted(self.root.glob("**/*.log")) if self.db_dir / "data" not in p.parents]  # the database's own are binary
        return "\n".join(f"--- {path.name}\n{self._tail(path)}" for path in logs + sorted(self.root.glob("*.out")))

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


@pytest.fixture(scope="module")
def slurm_accounting():
    """A running single-node Slurm with accounting on (slurmdbd, sacct)."""
    yield from _running(nodes=1, accounting=True)


def _running(nodes, accounting=False):
    missing = missing_tools(accounting)
    if missing:
        reason = f"Slurm is not installed here (missing {', '.join(missing)}): run bin/setup test, or apt-get install slurm-wlm munge slurmdbd mariadb-server-core mariadb-client-core"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    if os.geteuid() != 0:
        reason = "a test Slurm cluster is started as root (SlurmUser=root, munged as the munge user)"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    cluster = SlurmCluster(nodes=nodes, accounting=accounting)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
