"""Job isolation on a node: a user of its own, no secrets, limits, no network, nothing left behind.

The pure decisions run everywhere; the rest needs a runner that is root on Linux with cgroups and
namespaces (as CI is) and is skipped elsewhere. One test runs the whole system as processes and
submits a job that hunts for the network's secrets.

Over 500 lines: one attack or limit per test, side by side as the security model lists them.
"""

import json
import os
import stat
import time
import uuid
from pathlib import Path

import pytest

from agent.isolation import (
    Limits,
    View,
    cpu_quota,
    cpu_share,
    denied_networks,
    disk_message,
    gpu_device_nodes,
    job_limits,
    job_uid,
    keeps_network,
    local_addresses,
    mount_plan,
    oom_message,
    parse_networks,
    pick_slot,
    rlimits,
    sandbox_args,
)

ROOT = os.geteuid() == 0
CGROUPS = Path("/sys/fs/cgroup/memory/cgroup.procs").exists() or Path("/sys/fs/cgroup/cgroup.controllers").exists()
needs_root = pytest.mark.skipif(not (ROOT and CGROUPS), reason="needs a root runner with cgroups (as on CI)")


# The pure decisions ---------------------------------------------------------------------------


@pytest.mark.nodb
def test_uid_slots_cycle_and_never_collide():
    assert pick_slot(set(), after=4, span=10) == 5
    assert pick_slot({5, 6}, after=4, span=10) == 7
    assert pick_slot({0, 1}, after=9, span=10) == 2  # wraps
    assert pick_slot(set(range(10)), after=3, span=10) is None
    taken, last = set(), 0
    for _ in range(10):
        last = pick_slot(taken, last, 10)
        taken.add(last)
    assert taken == set(range(10))
    assert job_uid(200000, 7) == 200007


@pytest.mark.nodb
def test_limits_come_from_the_settings_or_the_job_s_share_of_the_node_less_a_reserve():
    share = job_limits(
        memory_bytes=0,
        max_processes=100,
        max_open_files=1000,
        max_file_bytes=10,
        disk_bytes=0,
        devices_held=2,
        devices_total=8,
        node_memory=64 * 2**30,
        node_disk=1000 * 2**30,
        memory_reserve=4 * 2**30,
    )
    # (64 - 4) GiB x 2/8; the disk's reserve is a tenth: 900 GiB x 2/8.
    assert share == Limits(15 * 2**30, 100, 1000, 10, 225 * 2**30, 2.0)
    # Two 1-slot jobs on a 2-slot node of 24 GiB leave the system its reserve (2.4 GiB), not nothing.
    half = job_limits(
        memory_bytes=0,
        max_processes=1,
        max_open_files=1,
        max_file_bytes=1,
        disk_bytes=1,
        devices_held=1,
        devices_total=2,
        node_memory=24 * 2**30,
    )
    assert 2 * half.memory_bytes <= 24 * 2**30 - 2**30 and half.cpus == 1.0 and half.disk_bytes == 1
    fixed = job_limits(
        memory_bytes=2**30,
        max_processes=1,
        max_open_files=1,
        max_file_bytes=1,
        disk_bytes=1,
        devices_held=1,
        devices_total=8,
        node_memory=None,
    )
    assert fixed.memory_bytes == 2**30 and fixed.memory_text == "1024 MB"
    assert (
        job_limits(
            memory_bytes=0, max_processes=1, max_open_files=1, max_file_bytes=1, disk_bytes=1, devices_held=1, devices_total=2, node_memory=None
        ).memory_bytes
        is None
    )
    assert oom_message(fixed) == "ran out of memory (limit 1024 MB)"
    assert disk_message(5 * 10**9) == "used more than 5 GB of disk in its folder"


@pytest.mark.nodb
def test_cpu_follows_the_slots_held_or_the_gpus_share_of_the_node():
    assert cpu_share("cpu", 1, 2, node_cpus=64) == 1.0  # one slot, one core's worth, whatever it forks
    assert cpu_share("cpu", 3, 4, node_cpus=2) == 3.0
    assert cpu_share("h100", 2, 8, node_cpus=64) == 16.0
    assert cpu_share("h100", 1, 8, node_cpus=4) == 1.0  # never below one core
    assert cpu_share("h100", 1, 8, node_cpus=None) is None
    assert cpu_quota(1.0) == (100_000, 100_000)
    assert cpu_quota(2.5) == (250_000, 100_000)


@pytest.mark.nodb
def test_the_sandbox_binds_only_what_the_view_names_and_cuts_the_network():
    view = View(
        root="/srv/e31/runs/7-ab",
        cwd="/srv/e31/runs/7-ab/code",
        system=(("bind", "/usr", "/usr"), ("symlink", "usr/bin", "/bin"), ("bind", "/etc", "/etc")),
        runtime=("/opt/venv",),
        read_only=("/srv/e31/runs/7-ab/data",),
        env=(("LD_PRELOAD", "./evil.so"), ("A", "1")),
    )
    args = sandbox_args(view)
    assert args[:3] == ["--unshare-all", "--unshare-user", "--disable-userns"] and "--share-net" not in args
    for flag in ("--die-with-parent", "--new-session", "--clearenv"):
        assert flag in args
    binds = [(args[i], args[i + 1], args[i + 2]) for i in range(len(args) - 2) if args[i] in ("--bind", "--ro-bind", "--dev-bind", "--symlink")]
    assert binds == [
        ("--ro-bind", "/usr", "/usr"),
        ("--symlink", "usr/bin", "/bin"),
        ("--ro-bind", "/etc", "/etc"),
        ("--ro-bind", "/opt/venv", "/opt/venv"),
        ("--bind", "/srv/e31/runs/7-ab", "/srv/e31/runs/7-ab"),
        ("--ro-bind", "/srv/e31/runs/7-ab/data", "/srv/e31/runs/7-ab/data"),
    ]
    # Private /tmp, /var/tmp and /run come before anything is bound (a runtime under /tmp stays).
    assert args.index("/var/tmp") < args.index("/opt/venv")
    # The job's environment is set inside only, after --clearenv.
    assert args[args.index("--clearenv") :] == ["--clearenv", "--setenv", "LD_PRELOAD", "./evil.so", "--setenv", "A", "1"]
    assert "--share-net" in sandbox_args(View(root="/r", cwd="/r", network=True))


@pytest.mark.nodb
def test_a_gpu_job_gets_only_its_own_device_nodes_and_a_cpu_job_none():
    present = {"/dev/nvidia0", "/dev/nvidia1", "/dev/nvidia2", "/dev/nvidiactl", "/dev/nvidia-uvm"}
    assert gpu_device_nodes([1, 2], "h100", exists=present.__contains__) == (
        "/dev/nvidia1",
        "/dev/nvidia2",
        "/dev/nvidiactl",
        "/dev/nvidia-uvm",
    )
    assert gpu_device_nodes([0, 1], "cpu", exists=present.__contains__) == ()
    view = View(root="/r", cwd="/r", devices=("/dev/nvidia1", "/dev/nvidiactl"))
    args = sandbox_args(view)
    assert args[args.index("--dev-bind") : args.index("--dev-bind") + 3] == ["--dev-bind", "/dev/nvidia1", "/dev/nvidia1"]
    assert "/dev/nvidia0" not in args


@pytest.mark.nodb
def test_resource_limits_never_pass_the_runner_s_own_and_processes_only_per_user():
    limits = Limits(None, 500, 65536, 2**40, 1)
    assert rlimits(limits, per_user=False, hard={"RLIMIT_NOFILE": 20000, "RLIMIT_FSIZE": -1}) == {
        "RLIMIT_NOFILE": (20000, 20000),
        "RLIMIT_FSIZE": (2**40, 2**40),
    }
    assert rlimits(limits, per_user=True)["RLIMIT_NPROC"] == (500, 500)


@pytest.mark.nodb
def test_the_network_is_cut_unless_asked_for_or_the_run_spans_nodes():
    assert keeps_network(False, None) is False
    assert keeps_network(True, None) is True
    assert keeps_network(False, gang=object()) is True
    assert keeps_network(False, None, nodes=2) is True


FIB_TRIE = """Main:
  +-- 0.0.0.0/0 3 0 5
     |-- 0.0.0.0
        /0 universe UNICAST
     +-- 127.0.0.0/8 2 0 2
           |-- 127.0.0.1
              /32 host LOCAL
     +-- 192.0.2.0/24 2 0 2
           |-- 192.0.2.0
              /24 link UNICAST
           |-- 192.0.2.7
              /32 host LOCAL
        |-- 192.0.2.255
           /32 link BROADCAST
Local:
           |-- 203.0.113.9
              /32 host LOCAL
           |-- 192.0.2.7
              /32 host LOCAL
"""


@pytest.mark.nodb
def test_a_job_s_own_network_refuses_the_node_s_addresses_and_the_operator_s_networks():
    assert local_addresses(FIB_TRIE) == ["127.0.0.1", "192.0.2.7", "203.0.113.9"]
    deny = parse_networks("10.0.0.0/8, 169.254.0.0/16 100.64.0.0/10")
    assert denied_networks(deny, local_addresses(FIB_TRIE)) == [
        "10.0.0.0/8",
        "100.64.0.0/10",
        "169.254.0.0/16",
        "192.0.2.7/32",
        "203.0.113.9/32",
    ]  # never the job's own loopback
    # A node that is itself a slirp guest (10.0.2.15): its address is refused, the uplink's
    # gateway, DNS and the job's own address never are (the broad 10/8 route loses to the uplink's
    # own /24 in the job's network).
    assert denied_networks([], ["10.0.2.15", "10.0.2.2"]) == ["10.0.2.15/32"]
    assert denied_networks(parse_networks(""), []) == []
    with pytest.raises(ValueError, match="E31_JOB_NETWORK_DENY: 'intranet'"):
        parse_networks("10.0.0.0/8 intranet")
    with pytest.raises(ValueError, match="IPv6"):
        parse_networks("fd00::/8")


@pytest.mark.nodb
def test_on_cgroup_v2_an_allocation_gets_memory_swap_processes_and_cpu_limits_in_one_folder(tmp_path, monkeypatch):
    """This machine has cgroup v1, so the v2 writes are checked against a tree laid out as the
    kernel lays out a v2 hierarchy: the node's folder under e31/, controllers enabled on the way
    down, one folder per allocation with memory.max, no swap, pids.max and cpu.max = the slots."""
    from agent import isolation

    monkeypatch.setattr(isolation, "CGROUP_ROOT", tmp_path)
    (tmp_path / "cgroup.controllers").write_text("cpuset cpu io memory hugetlb pids rdma misc\n")
    cgroups = isolation.Cgroups("node-7f3a", top="e31")
    assert cgroups.kind == "v2" and cgroups.parents == {"unified": tmp_path / "e31" / "node-7f3a"}
    [folder] = cgroups.create("alloc-12", Limits(3 * 2**30, 512, 1024, 2**30, 2**31, cpus=1.5))
    assert folder == tmp_path / "e31" / "node-7f3a" / "alloc-12"
    for level in (tmp_path, tmp_path / "e31", tmp_path / "e31" / "node-7f3a"):
        assert (level / "cgroup.subtree_control").read_text() == "+memory +pids +cpu"
    assert (folder / "memory.max").read_text() == str(3 * 2**30)
    assert (folder / "memory.swap.max").read_text() == "0"
    assert (folder / "pids.max").read_text() == "512"
    assert (folder / "cpu.max").read_text() == "150000 100000"
    assert cgroups.cpu_limit("alloc-12") == 1.5
    (folder / "cpu.stat").write_text("usage_usec 2500000\nuser_usec 2000000\nsystem_usec 500000\nnr_periods 40\nnr_throttled 7\n")
    (folder / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n")
    (folder / "cgroup.procs").write_text("4242\n4243\n")
    assert cgroups.cpu_seconds("alloc-12") == 2.5 and cgroups.throttled("alloc-12") == 7
    assert cgroups.oom_kills("alloc-12") == 1 and cgroups.pids("alloc-12") == {4242, 4243}
    # Another system's runner on the same machine keeps its own folder: neither sees the other's.
    other = isolation.Cgroups("node-09bc", top="e31")
    other.create("alloc-12", Limits(None, 64, 64, 2**20, 2**20))
    assert cgroups.leftovers() == {"alloc-12"} and other.leftovers() == {"alloc-12"}
    assert not (tmp_path / "e31" / "node-09bc" / "alloc-12" / "memory.max").exists()  # no memory limit asked
    assert (tmp_path / "e31" / "node-09bc" / "alloc-12" / "cpu.max").exists() is False  # nor a CPU one


@pytest.mark.nodb
def test_mount_plan_hides_the_network_s_folders_and_binds_back_what_the_job_needs():
    reachable = {"/root": False, "/tmp/pytest-of-root": False}
    plan = mount_plan(
        keep=["/srv/e31/var/runs/7-ab", "/root/.pyenv/versions/3.11", "/work/app"],
        hidden={"/tmp": 0o1777, "/srv/e31/var": 0o711, "/srv/e31/var/runs": 0o711, "/srv/e31/var/cache": 0o711},
        reachable=lambda p: reachable.get(p, True),
    )
    assert plan == [
        ("/tmp", 0o1777, []),
        ("/root", 0o711, ["/root/.pyenv/versions/3.11"]),
        ("/srv/e31/var", 0o711, ["/srv/e31/var/runs/7-ab"]),  # runs/ and cache/ are out of sight already
    ]
    # A job folder behind a folder others cannot pass (pytest's): bound into the outer cover.
    plan = mount_plan(["/tmp/pytest-of-root/t/runs/1"], {"/tmp": 0o1777}, lambda p: reachable.get(p, True))
    assert plan == [("/tmp", 0o1777, ["/tmp/pytest-of-root/t/runs/1"])]
    # A hidden folder inside a path bound back is covered again, after it.
    plan = mount_plan(["/root/app", "/root/app/var/runs/1"], {"/root/app/var": 0o711}, lambda p: p != "/root")
    assert plan == [("/root", 0o711, ["/root/app"]), ("/root/app/var", 0o711, ["/root/app/var/runs/1"])]


# A runner in this process ---------------------------------------------------------------------


@pytest.fixture
def node(make_runner, settings):
    settings.E31_JOB_DISK_CHECK_SECONDS = 0.3
    return make_runner("iso-node", devices=2)


def run(node, job, until=None, timeout=30):
    from jobs.models import Job
    from tests.test_runner import run_until

    run_until(node, until or (lambda: Job.objects.get(pk=job.pk).is_terminal), timeout)
    job.refresh_from_db()
    return job


def lines(job):
    return [t for _, t in job.events.filter(kind="log").order_by("seq").values_list("stream", "text")]


def host_pids_with(marker):
    """Live processes of this machine with marker in their arguments (a job's own pids are those
    of its PID namespace, so the job cannot tell them)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "cmdline").read_bytes() and alive(int(entry.name)):
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as stat_file:
            return stat_file.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead, just not reaped
    except FileNotFoundError:
        return False


@pytest.mark.django_db(transaction=True)
@needs_root
def test_a_job_s_user_has_a_name_as_libraries_that_ask_who_runs_them_expect(node, alice, rate, team_a):
    """torch's compile caches call getpass.getuser(): on a GPU node a job's own uid, unknown to
    the node's /etc/passwd, failed every bf16 recipe there with KeyError: getpwuid(): uid not
    found. The job is told its user's name and finds its line; the node's lines are still there,
    and the job cannot change the file."""
    from tests.conftest import make_job

    script = b"""
import getpass, json, os, pwd
os.environ.pop("USER"); os.environ.pop("LOGNAME")  # pwd's answer, not the variables'
entry = pwd.getpwuid(os.getuid())
try:
    open("/etc/passwd", "a").write("x"); wrote = True
except OSError:
    wrote = False
print(json.dumps({"user": getpass.getuser(), "name": entry.pw_name, "home": entry.pw_dir, "uid": os.getuid(), "root": pwd.getpwuid(0).pw_name, "wrote": wrote}))
"""
    job = run(node, make_job(alice, script=script))
    assert job.state == "succeeded", (job.reason, lines(job))
    seen = json.loads(lines(job)[-1])
    assert seen["user"] == seen["name"] == "e31-job" and seen["uid"] >= 200000
    assert seen["root"] == "root" and seen["wrote"] is False
    assert seen["home"].endswith(str(job.pk) + "-" + str(job.allocations.get().pk)[:8])


@pytest.mark.django_db(transaction=True)
@needs_root
def test_each_job_runs_as_a_user_of_its_own_in_a_private_folder(node, alice, rate, team_a):
    from e31web.demo import add_dataset
    from tests.conftest import make_job

    script = b"""
import json, os
data = os.path.join(os.environ["E31_DATA_DIR"], "train", "numbers.csv")
def can(f):
    try:
        f(); return True
    except OSError:
        return False
print(json.dumps({
    "uid": os.getuid(), "gid": os.getgid(), "groups": os.getgroups(), "euid": os.geteuid(),
    "data": open(data).read(), "write_data": can(lambda: open(data, "a")),
    "folder": oct(os.stat(os.environ["HOME"]).st_mode & 0o777), "owner": os.stat(os.environ["HOME"]).st_uid,
    "list_runs": can(lambda: os.listdir(os.path.dirname(os.environ["HOME"]))),
    "runs": sorted(os.listdir(os.path.dirname(os.environ["HOME"]))) if can(lambda: os.listdir(os.path.dirname(os.environ["HOME"]))) else None,
}))
open(os.path.join(os.environ["E31_OUTPUT_DIR"], "out.txt"), "w").write("mine")
open(os.path.join(os.environ["E31_CHECKPOINT_DIR"], "step-1.ckpt"), "w").write("ckpt")
"""
    dataset = add_dataset(team_a, "numbers", {"numbers.csv": b"1,2\n"})
    first = run(node, make_job(alice, script=script, train_version=dataset.latest_version()))
    second = run(node, make_job(alice, script=script, train_version=dataset.latest_version()))
    assert first.state == second.state == "succeeded", (first.reason, lines(first))
    one, two = (json.loads(lines(j)[-1]) for j in (first, second))
    assert one["uid"] >= 200000 and one["uid"] == one["euid"] == one["gid"] == one["owner"] and one["groups"] == []
    assert two["uid"] >= 200000 and two["uid"] != one["uid"], "each job a uid of its own"
    assert one["data"] == "1,2\n" and one["write_data"] is False, "the staged data readable, not writable"
    assert one["folder"] == "0o700"
    own = f"{first.pk}-{str(first.allocations.get().pk)[:8]}"
    assert one["runs"] in (None, [own]), "the job sees no other job's folder"
    # The runner, as root, still reads what the job wrote.
    assert sorted(first.artifacts.values_list("name", flat=True)) == ["out.txt"]
    assert first.checkpoints.count() == 1
    # The runner's own folders: the cache private, the work folder passable but not listable.
    assert stat.S_IMODE(node.cache.root.stat().st_mode) == 0o700
    assert stat.S_IMODE(node.work_dir.stat().st_mode) == 0o711
    from django.conf import settings

    assert not list(Path("/sys/fs/cgroup/memory", settings.E31_JOB_CGROUP_PARENT, "iso-node").glob("*-*")), "the cgroups are removed"


@pytest.mark.django_db(transaction=True)
@needs_root
def test_the_network_is_off_unless_asked_for_and_the_loopback_works(node, alice, rate):
    from tests.conftest import make_job

    script = b"""
import socket
names = sorted(n for _, n in socket.if_nameindex())
server = socket.socket(); server.bind(("127.0.0.1", 0)); server.listen()
client = socket.create_connection(server.getsockname(), timeout=2)
print(" ".join(names), "loopback-ok")
"""
    cut = run(node, make_job(alice, script=script))
    kept = run(node, make_job(alice, script=script, network=True))
    assert cut.state == kept.state == "succeeded", (cut.reason, lines(cut), lines(kept))
    assert lines(cut)[-1] == "lo loopback-ok", "only its own loopback, up"
    assert lines(kept)[-1] != "lo loopback-ok" and lines(kept)[-1].endswith("loopback-ok"), "the host's interfaces"


@pytest.mark.django_db(transaction=True)
@needs_root
def test_a_job_over_its_memory_limit_fails_with_the_reason(node, alice, rate, settings):
    from tests.conftest import make_job

    settings.E31_JOB_MEMORY_BYTES = 64 * 2**20
    script = b"""
import time
hog = []
while True:
    hog.append(bytearray(8 * 2**20))
"""
    job = run(node, make_job(alice, script=script))
    assert job.state == "failed" and job.reason == "ran out of memory (limit 64 MB)", (job.reason, lines(job))


@pytest.mark.django_db(transaction=True)
@needs_root
def test_processes_open_files_and_file_size_are_limited(node, alice, rate, settings):
    from tests.conftest import make_job

    settings.E31_JOB_MAX_PROCESSES = 40
    settings.E31_JOB_MAX_OPEN_FILES = 100
    settings.E31_JOB_MAX_FILE_BYTES = 2**20
    script = b"""
import os, resource, signal
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
print("nofile", resource.getrlimit(resource.RLIMIT_NOFILE)[1])
pids, forks = [], "ok"
try:
    for _ in range(100):
        pid = os.fork()
        if pid == 0:
            signal.pause()
        pids.append(pid)
except OSError:
    forks = "refused"
for pid in pids:
    os.kill(pid, 9)
print("forks", forks, len(pids) < 40)
try:
    with open("big", "wb") as f:
        f.write(b"x" * (2 * 2**20))
    print("file ok")
except OSError:
    print("file refused")
"""
    job = run(node, make_job(alice, script=script))
    assert job.state == "succeeded", (job.reason, lines(job))
    assert lines(job) == ["nofile 100", "forks refused True", "file refused"]


@pytest.mark.django_db(transaction=True)
@needs_root
def test_a_job_over_its_disk_limit_is_stopped_and_its_folder_removed(node, alice, rate, settings):
    from tests.conftest import make_job

    settings.E31_JOB_DISK_BYTES = 20 * 10**6
    script = b"""
import os, time
print("writing", flush=True)
for i in range(100):
    with open(os.path.join(os.environ["E31_OUTPUT_DIR"], f"part{i}"), "wb") as f:
        f.write(os.urandom(10**6))
    time.sleep(0.05)
time.sleep(60)
"""
    job = run(node, make_job(alice, script=script))
    assert job.state == "failed" and job.reason == "used more than 0.02 GB of disk in its folder", job.reason
    assert not job.artifacts.exists()
    assert not [p for p in node.work_dir.iterdir() if not p.name.startswith(".")], "its folder is gone"


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("as_root", [True, False], ids=["root", "not-root"])
def test_a_daemon_the_job_left_does_not_survive_it(db, alice, rate, settings, tmp_path, monkeypatch, as_root):
    from agent import isolation
    from agent.runner import Runner
    from tests.conftest import make_job

    if as_root and not ROOT:
        pytest.skip("needs root")
    if not as_root:
        monkeypatch.setattr(isolation, "is_root", lambda: False)  # a runner that is not root finds it by its environment
    node = Runner(name="daemon-node", devices=1, work_dir=tmp_path / "runs", device_type="cpu", cache_dir=tmp_path / "cache")
    node.register()
    marker = f"e31-daemon-{uuid.uuid4().hex}"
    script = f"""
import os, sys, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.close(1); os.close(2)
        os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(600)", "{marker}"])
    os._exit(0)
time.sleep(1.0)
print("done")
""".encode()
    try:
        job = run(node, make_job(alice, script=script))
        assert job.state == "succeeded", (job.reason, lines(job))
        assert not host_pids_with(marker), "the daemon outlived its job"
    finally:
        node.stop_all()


@pytest.mark.django_db(transaction=True)
@needs_root
def test_a_cancelled_job_that_ignores_sigterm_leaves_nothing(node, alice, rate):
    from tests.conftest import make_job

    marker = f"e31-stubborn-{uuid.uuid4().hex}"
    script = f"""
import os, signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c", "import os, signal, time; os.setsid(); signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)", "{marker}"])
print("up", flush=True)
while True:
    time.sleep(0.1)
""".encode()
    job = make_job(alice, script=script)
    run(node, job, until=lambda: "up" in lines(job))
    assert host_pids_with(marker), "the job's child is running"
    job.request_cancel()
    job = run(node, job)
    assert job.state == "cancelled"
    assert not host_pids_with(marker), "a process of the cancelled job survived"


# The whole system as processes ----------------------------------------------------------------

SECRETS = {
    "SECRET_KEY": "s3cr3t-django-key-" + "x" * 40,
    "DJANGO_SECRET_KEY": "dj-secret-value-123",
    "AWS_ACCESS_KEY_ID": "AKIASECRETKEYID",
    "AWS_SECRET_ACCESS_KEY": "aws-secret-access-value",
    "E31_S3_ACCESS_KEY_ID": "s3-access-key-value",
    "E31_S3_SECRET_ACCESS_KEY": "s3-secret-value",
}

HUNTER = r"""
import glob, json, os, sys
found = []
names = ("DATABASE_URL", "REDIS_URL", "E31_STORAGE_URL", "SECRET_KEY", "DJANGO_SECRET_KEY")
for name, value in os.environ.items():
    if name.startswith("HUNT_"):
        continue  # what the test told it to look for
    if name in names or name.startswith("AWS_") or "S3" in name or "SECRET" in name or "PASSWORD" in name:
        found.append(f"env {name}")
    for secret in json.loads(os.environ["HUNT_VALUES"]):
        if secret in value:
            found.append(f"env value of {name}")
def attempt(what, action):
    try:
        result = action()
    except OSError:
        return
    if result:
        found.append(what)
runner = os.environ["HUNT_RUNNER_PID"]
attempt("the runner's environment", lambda: open(f"/proc/{runner}/environ", "rb").read())
attempt("the runner's open files", lambda: os.listdir(f"/proc/{runner}/fd"))
for path in json.loads(os.environ["HUNT_FILES"]):
    attempt(f"read {path}", lambda: open(path, "rb").read(1) or b"empty")
for path in json.loads(os.environ["HUNT_FOLDERS"]):
    attempt(f"listed {path}", lambda: [n for n in os.listdir(path) if not os.environ["HOME"].startswith(os.path.join(path, n))])
for pattern in ("/tmp/*", "/dev/shm/*"):
    # Only what is on the way to its own folder and to the Python it runs (bound back in) may show.
    own = (os.environ["HOME"], sys.prefix, os.path.realpath(sys.executable))
    attempt(f"glob {pattern}", lambda: [p for p in glob.glob(pattern) if not any(o.startswith(p + "/") or o == p for o in own)])
with open(os.path.join(os.environ["E31_OUTPUT_DIR"], "found.json"), "w") as out:
    json.dump({"found": found, "uid": os.getuid()}, out)
print("hunted", len(found))
"""


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    from tests.system import LiveSystem

    system = LiveSystem(devices=2, env=dict(SECRETS))
    # The runner is told its database as production is (the default file, named).
    system.env["DATABASE_URL"] = f"sqlite:///{system.var_dir}/e31.sqlite3"
    try:
        system.start()
    except BaseException:
        system.stop()
        raise
    yield system
    system.stop()


@pytest.mark.e2e
@pytest.mark.timeout(120)
@needs_root
def test_a_job_finds_none_of_the_network_s_secrets(live, tmp_path):
    sleeper = tmp_path / "sleep.py"
    sleeper.write_text(
        "import os, time\nopen(os.path.join(os.environ['E31_OUTPUT_DIR'], 'mine'), 'w').write('private')\nprint('up', flush=True)\ntime.sleep(60)\n"
    )
    other = live.submit({"name": "other", "train_dataset": "digits", "gpus": 1, "span_hours": 0.25}, sleeper)
    live.wait_for_state(other["id"], "running", timeout=60)
    runs = live.var_dir / "runs"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not list(runs.glob(f"{other['id']}-*/output/mine")):
        time.sleep(0.1)
    other_folder = next(runs.glob(f"{other['id']}-*"))
    cache = live.var_dir / "cache"
    files = [
        live.var_dir / "e31.sqlite3",
        live.var_dir / "secret_key",
        other_folder / "output" / "mine",
        other_folder / "config.json",
        *(p for p in cache.rglob("*") if p.is_file()),
    ]
    folders = [live.var_dir, runs, other_folder, other_folder / "output", cache, live.var_dir / "storage"]
    hunter = tmp_path / "hunt.py"
    hunter.write_text(HUNTER)
    spec = {
        "name": "hunter",
        "train_dataset": "digits",
        "gpus": 1,
        "span_hours": 0.25,
        "env": {
            "HUNT_VALUES": json.dumps([*list(SECRETS.values()), "e31.sqlite3"]),
            "HUNT_RUNNER_PID": str(live.processes["runner"].pid),
            "HUNT_FILES": json.dumps([str(p) for p in files]),
            "HUNT_FOLDERS": json.dumps([str(p) for p in folders]),
        },
    }
    job = live.submit(spec, hunter)
    done = live.wait_for_state(job["id"], timeout=60)
    live.api("POST", f"/api/jobs/{other['id']}/cancel/")
    assert done["state"] == "succeeded", done
    response = live.api("GET", f"/api/jobs/{job['id']}/artifacts/found.json", follow_redirects=True)
    assert response.status_code == 200, response.text
    report = json.loads(response.content)
    assert report["uid"] >= 200000
    assert report["found"] == [], report


@pytest.mark.django_db(transaction=True)
@pytest.mark.timeout(120)
@needs_root
def test_torchrun_on_one_node_works_without_the_network(node, alice, rate):
    from tests.conftest import make_job

    script = b"""
import os, socket, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1) * (dist.get_rank() + 1)
dist.all_reduce(t)
print("sum", int(t.item()), "interfaces", len(socket.if_nameindex()), flush=True)
dist.destroy_process_group()
"""
    job = run(node, make_job(alice, script=script, gpus=2, processes=2), timeout=90)
    assert job.state == "succeeded", (job.reason, lines(job)[-20:])
    assert lines(job).count("sum 3 interfaces 1") == 2


@pytest.mark.nodb
def test_a_uid_claimed_by_one_runner_is_not_given_out_by_another(tmp_path):
    """Two runners on one machine share the uid range: a uid held by one (a lock file kept
    locked while its job runs) is refused to the other until the first lets go or dies."""
    import subprocess
    import sys

    from agent.isolation import UidClaims

    folder = tmp_path / "uids"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from agent.isolation import UidClaims; c = UidClaims(sys.argv[1]); print(c.claim(200005), flush=True); sys.stdin.read()",
            str(folder),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "True"
        mine = UidClaims(folder)
        assert not mine.claim(200005)
        assert mine.claim(200006)
        mine.release(200006)
        assert UidClaims(folder).claim(200006)
    finally:
        holder.kill()
        holder.wait()
    assert mine.claim(200005)  # the other runner died: its uids are free


@pytest.mark.e2e
@pytest.mark.timeout(120)
@needs_root
@pytest.mark.django_db(transaction=True)
def test_two_systems_on_one_machine_never_touch_each_other_s_jobs(live, tmp_path):
    """Seen: two `bin/up` in different folders; the second runner's start-up cleanup SIGKILLed
    the first one's running job (cgroups were keyed by the runner's display name, which both
    share). Now they are keyed by the node's unique id, and a runner kills only leftovers of
    allocations its own database says were its node's."""
    from agent.runner import Runner

    sleeper = tmp_path / "sleep.py"
    sleeper.write_text("import os, time\nprint('up', flush=True)\ntime.sleep(8)\nopen(os.path.join(os.environ['E31_OUTPUT_DIR'], 'done'), 'w').write('ok')\n")
    job = live.submit({"name": "neighbour", "train_dataset": "digits", "gpus": 1, "span_hours": 0.25}, sleeper)
    live.wait_for_state(job["id"], "running", timeout=60)
    # The other system: its own database (this test's), a runner of the same name on this machine.
    other = Runner(name="e2e-runner", devices=1, work_dir=tmp_path / "runs", device_type="cpu", cache_dir=tmp_path / "cache")
    other.register()
    other.stop_all()
    other.register()  # and once more, as after a crash
    other.stop_all()
    done = live.wait_for_state(job["id"], timeout=60)
    assert done["state"] == "succeeded", done


@pytest.mark.nodb
def test_an_agent_trusts_a_sandbox_started_on_its_node_lately_and_nothing_else(tmp_path, monkeypatch):
    """An agent per allocation (a Slurm job) starts on the meter: it skips starting a trial
    sandbox where one started on this node within PROBE_TRUST_SECONDS, as noted by this user for
    the same bubblewrap and Python; anything else noted there is tried again."""
    from django.conf import settings

    from agent import isolation

    tried = []
    isolation_ = isolation.Isolation("agent", tmp_path / "runs", tmp_path / "cache", settings)
    isolation_.bwrap = isolation_.bwrap or "/usr/bin/bwrap"
    monkeypatch.setattr(isolation_, "_probe_cgroups", lambda: None)
    monkeypatch.setattr(isolation_, "_try", lambda: tried.append(1) or (True, ""))
    noted = tmp_path / ".sandbox-started"

    isolation_.probe("a1", known_good=noted)
    assert len(tried) == 1 and stat.S_IMODE(noted.stat().st_mode) == 0o600
    isolation_.probe("a2", known_good=noted)
    assert len(tried) == 1, "trusted: started here a moment ago"
    old = time.time() - isolation.PROBE_TRUST_SECONDS - 5
    os.utime(noted, (old, old))
    isolation_.probe("a3", known_good=noted)
    assert len(tried) == 2, "too long ago: tried again"
    noted.write_text("/elsewhere/bwrap /elsewhere/python users=True")
    isolation_.probe("a4", known_good=noted)
    assert len(tried) == 3, "noted for another bubblewrap or Python: tried again"
    isolation_.probe("a5")
    assert len(tried) == 4, "a runner (nothing noted) always tries"
    # A failure is never noted, and raises as before.
    noted.unlink()
    monkeypatch.setattr(isolation_, "_try", lambda: (False, "no user namespaces"))
    with pytest.raises(isolation.IsolationUnavailable, match="no user namespaces"):
        isolation_.probe("a6", known_good=noted)
    assert not noted.exists()


@pytest.mark.nodb
def test_no_folder_holding_the_engines_work_folder_is_bound_into_a_job(tmp_path, settings):
    """Under Slurm the agents keep the node's staged data, environments and their locks in
    E31_ENGINE_WORK_DIR: where an operator put it inside the runtime (the virtual environment
    here), that folder is not bound into the jobs' sandboxes."""
    import sys

    from agent import isolation

    def runtime():
        return isolation.Isolation("agent", tmp_path / "runs", tmp_path / "cache", settings).runtime

    assert os.path.realpath(sys.prefix) in runtime()
    settings.E31_ENGINE_WORK_DIR = Path(sys.prefix) / "e31-engine"
    assert not any(Path(os.path.realpath(sys.prefix)).is_relative_to(path) for path in runtime())
