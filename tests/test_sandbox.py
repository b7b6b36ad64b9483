"""Hostile jobs against the sandbox: each escape seen on a default install (a root runner,
isolation on), written as the job that tried it. Each is contained, and a neighbour is not touched.

Needs a root runner with cgroups and bubblewrap, as CI has; skipped elsewhere.
"""

import io
import shutil
import subprocess
import time
import uuid
import zipfile
from pathlib import Path

import pytest

from tests.test_isolation import CGROUPS, ROOT, lines, run

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(not (ROOT and CGROUPS and shutil.which("bwrap")), reason="needs a root runner with cgroups and bubblewrap"),
]


@pytest.fixture
def node(make_runner):
    return make_runner("sandbox-node", devices=2)


def zip_job(user, files, entrypoint="train.py", **fields):
    """A queued job whose work is a zip of files {name: bytes}."""
    from jobs.models import Job, Upload
    from tests.conftest import upload

    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, content in files.items():
            archive.writestr(name, content)
    team = user.membership.team
    job = Job.objects.create(team=team, created_by=user, name="hostile", entrypoint=entrypoint, gpus=1, span_hours=1, **fields)
    code = upload(team, user, Upload.CODE, "work.zip", buffer.getvalue())
    code.job = job
    code.save()
    job.record("state", data={"state": "queued", "from": None, "reason": "submitted"})
    return job


def wait_for_line(node, job, text, timeout=30):
    return run(node, job, until=lambda: any(text in line for line in lines(job)), timeout=timeout)


def test_an_ld_preload_set_by_the_job_loads_only_into_the_job_never_as_root(node, alice, rate, tmp_path):
    """Seen: `env: {LD_PRELOAD: ./evil.so}` with the library in the job's zip was loaded into
    the root shim, which copied var/secret_key out."""
    witness = tmp_path / "ran-as"
    source = tmp_path / "evil.c"
    source.write_text(
        "#include <stdio.h>\n#include <unistd.h>\n"
        "__attribute__((constructor)) static void evil(void) {\n"
        f'  FILE *f = fopen("{witness}", "a"); if (f) {{ fprintf(f, "%d\\n", (int)getuid()); fclose(f); }}\n'
        '  fprintf(stderr, "evil loaded as uid %d\\n", (int)getuid());\n}\n'
    )
    library = tmp_path / "evil.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    job = zip_job(
        alice,
        {"train.py": b"print('trained', flush=True)\n", "evil.so": library.read_bytes()},
        env={"LD_PRELOAD": "./evil.so"},
    )
    job = run(node, job)
    assert job.state == "succeeded", (job.reason, lines(job))
    loaded = [line for line in lines(job) if line.startswith("evil loaded as uid")]
    assert loaded and all(int(line.split()[-1]) >= 200000 for line in loaded), loaded  # the job's own processes only
    assert not witness.exists(), f"the library ran outside the sandbox as uid {witness.read_text().split()}"


def test_a_job_sees_only_its_own_processes_not_a_neighbour_s_arguments(node, alice, rate):
    """Seen: without a PID namespace a job read /proc/*/cmdline of other teams' jobs (their
    --api-key=... arguments) and of the runner."""
    from tests.conftest import make_job

    secret = f"--api-key={uuid.uuid4().hex}"
    neighbour = make_job(alice, script=b"import time\nprint('up', flush=True)\ntime.sleep(60)\n", args=[secret])
    wait_for_line(node, neighbour, "up")
    snoop = b"""
import os
pids = [p for p in os.listdir('/proc') if p.isdigit()]
for pid in pids:
    try:
        print('proc', pid, open(f'/proc/{pid}/cmdline', 'rb').read().replace(b'\\0', b' ').decode(), flush=True)
    except OSError:
        pass
"""
    job = run(node, make_job(alice, script=snoop), until=None)
    neighbour.request_cancel()
    run(node, neighbour)
    assert job.state == "succeeded", (job.reason, lines(job))
    seen = [line for line in lines(job) if line.startswith("proc ")]
    assert seen, lines(job)
    assert not any(secret in line for line in seen), seen
    assert not any("manage.py" in line or "pytest" in line for line in seen), seen
    assert len(seen) <= 3, seen  # the sandbox's init and the job itself (and a process it started)


def test_a_job_cannot_make_namespaces_of_its_own_inside_the_sandbox(node, alice, rate):
    """Hardening found missing by attacking the sandbox: a job could make a nested user namespace
    (and in it mount, network and PID namespaces, root there), which is how most kernel exploits
    against namespaces begin. Further user namespaces are refused inside the sandbox."""
    from tests.conftest import make_job

    script = b"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
result = libc.unshare(0x10000000)  # CLONE_NEWUSER
print("nested", result, os.strerror(ctypes.get_errno()) if result else "made", flush=True)
"""
    job = run(node, make_job(alice, script=script))
    assert job.state == "succeeded", (job.reason, lines(job))
    said = [line for line in lines(job) if line.startswith("nested ")]
    assert said and said[0].startswith("nested -1"), lines(job)


def test_busy_processes_in_new_sessions_get_one_core_s_worth_for_one_slot(node, alice, rate):
    """Seen: a 1-slot job starting 8 busy processes, each in a new session, made a neighbour's
    1-slot job 3x slower. Checked through the cgroups' own CPU counters, not wall time."""
    from tests.conftest import make_job

    hog = b"""
import subprocess, sys, time
for _ in range(8):
    subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
print("busy", flush=True)
time.sleep(60)
"""
    busy = make_job(alice, script=hog)
    neighbour = make_job(alice, script=b"import time\nprint('busy', flush=True)\nwhile True: pass\n")
    wait_for_line(node, busy, "busy")
    wait_for_line(node, neighbour, "busy")
    cgroups = node.isolation.cgroups
    names = {str(r.job.pk): r.sandbox.name for r in node.running.values()}
    hog_name, neighbour_name = names[str(busy.pk)], names[str(neighbour.pk)]
    time.sleep(1.0)  # every hog running
    start = time.monotonic(), cgroups.cpu_seconds(hog_name), cgroups.cpu_seconds(neighbour_name)
    time.sleep(3.0)
    end = time.monotonic(), cgroups.cpu_seconds(hog_name), cgroups.cpu_seconds(neighbour_name)
    wall = end[0] - start[0]
    hog_cores, neighbour_cores = (end[1] - start[1]) / wall, (end[2] - start[2]) / wall
    throttled, limit = cgroups.throttled(hog_name), cgroups.cpu_limit(hog_name)
    for job in (busy, neighbour):
        job.request_cancel()
    run(node, busy)
    run(node, neighbour)
    assert limit == 1.0, f"a 1-slot job's cpu.max is {limit} cores"
    assert hog_cores <= 1.25, f"a 1-slot job used {hog_cores:.2f} cores"
    # On a machine busy with other work the hog may not reach its cap; when it ran near it, the
    # kernel must have held it back.
    assert hog_cores < 0.9 or throttled > 0, "the hog was never held back by its cpu.max"
    # Loose on purpose (CI runs two test passes on two cores): 8 unlimited hogs left it a ninth.
    assert neighbour_cores >= 0.15, f"the neighbour got {neighbour_cores:.2f} of a core"


def test_nothing_the_job_writes_outside_its_folder_outlives_it(node, alice, rate):
    """Seen: /var/tmp and /run/lock were writable, and what was written there outlived the job
    and escaped its disk limit."""
    from tests.conftest import make_job

    marker = f"e31-left-{uuid.uuid4().hex}"
    places = ["/var/tmp", "/run/lock", "/tmp", "/dev/shm", "/run"]
    script = f"""
import os
for folder in {places!r}:
    try:
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "{marker}"), "w") as out:
            out.write("left behind")
        print("wrote", folder, flush=True)
    except OSError as error:
        print("refused", folder, error, flush=True)
""".encode()
    job = run(node, make_job(alice, script=script))
    assert job.state == "succeeded", (job.reason, lines(job))
    left = [folder for folder in places if Path(folder, marker).exists()]
    for folder in left:
        Path(folder, marker).unlink()
    assert not left, f"the job left files in {left}"


def test_a_runner_without_bubblewrap_refuses_to_start_and_says_how_to_install_it(db, settings, tmp_path):
    from django.core.management import CommandError, call_command

    from agent.isolation import IsolationUnavailable
    from agent.runner import Runner
    from scheduler.models import Node

    settings.E31_BWRAP = str(tmp_path / "no-bwrap-here")
    runner = Runner(name="bare-node", devices=1, work_dir=tmp_path / "runs", device_type="cpu", cache_dir=tmp_path / "cache")
    with pytest.raises(IsolationUnavailable, match="apt-get install bubblewrap"):
        runner.register()
    assert not Node.objects.filter(name="bare-node").exists(), "a node that cannot sandbox is never offered"
    with pytest.raises(CommandError, match="E31_JOB_ISOLATION=0"):
        call_command("runner", "--devices", "1", "--name", "bare-node", "--work-dir", str(tmp_path / "runs2"))


def test_with_isolation_off_the_job_page_says_so(db, alice, rate, settings, tmp_path, client):
    from agent.runner import UNISOLATED_NOTICE, Runner
    from tests.conftest import make_job

    settings.E31_JOB_ISOLATION = False
    runner = Runner(name="dev-node", devices=1, work_dir=tmp_path / "runs", device_type="cpu", cache_dir=tmp_path / "cache")
    runner.register()
    try:
        job = run(runner, make_job(alice))
    finally:
        runner.stop_all()
    assert job.state == "succeeded", job.reason
    assert any((data or {}).get("text") == UNISOLATED_NOTICE for data in job.events.filter(kind="notice").values_list("data", flat=True))
    client.force_login(alice)
    page = client.get(f"/jobs/{job.pk}/")
    assert page.status_code == 200
    assert "WITHOUT isolation" in page.content.decode()


def test_an_archive_is_unpacked_in_the_sandbox_as_the_job_s_uid_and_a_bomb_stops_at_the_limit(node, alice, rate, settings):
    """Seen: a 1.5 MB zip expanding to 1.5 GiB was unpacked by the root runner before any limit
    applied. An archive that got past the upload check (an older upload, a lowered limit) is
    still unpacked only in the job's sandbox, as its uid, counting the bytes written."""
    check = b"import os\nprint('owner', os.stat('train.py').st_uid, 'me', os.getuid(), flush=True)\n"
    job = run(node, zip_job(alice, {"train.py": check, "lib/helper.py": b"x = 1\n"}))
    assert job.state == "succeeded", (job.reason, lines(job))
    owner, me = (int(w) for w in next(line for line in lines(job) if line.startswith("owner")).split()[1::2])
    assert owner == me >= 200000, "unpacked by the job's uid, not root"

    settings.E31_ARCHIVE_MAX_BYTES = 5 * 10**6
    bomb = zip_job(alice, {"train.py": b"print('never')\n", "zeros.bin": bytes(50 * 10**6)})
    bomb = run(node, bomb)
    assert bomb.state == "failed"
    assert "could not be unpacked" in bomb.reason and "more than" in bomb.reason, bomb.reason
    assert "never" not in lines(bomb)


def test_sparse_outputs_are_kept_only_up_to_the_disk_limit_by_their_length(node, alice, rate, settings):
    """Found by attacking the sandbox: four sparse 50 MB files take no disk in the job's folder
    (so its disk limit never sees them) and were copied to storage in full, 200 MB from a job
    with a 1 MB limit."""
    from tests.conftest import make_job

    settings.E31_JOB_DISK_BYTES = 10**6
    script = b"""
import os
out = os.environ["E31_OUTPUT_DIR"]
open(os.path.join(out, "model.pt"), "wb").write(b"w" * 1000)
for i in range(4):
    with open(os.path.join(out, f"sparse-{i}.bin"), "wb") as f:
        f.truncate(50 * 10**6)
print("blocks", sum(os.stat(os.path.join(out, n)).st_blocks for n in os.listdir(out)), flush=True)
"""
    job = run(node, make_job(alice, script=script))
    assert job.state == "succeeded", (job.reason, lines(job))
    assert list(job.artifacts.values_list("name", flat=True)) == ["model.pt"]
    texts = [(d or {}).get("text", "") for d in job.events.filter(kind="notice").values_list("data", flat=True)]
    assert sum("pass the job's disk limit" in t for t in texts) == 4, texts


@pytest.mark.skipif(not shutil.which("slirp4netns"), reason="needs slirp4netns")
def test_a_job_given_the_network_never_reaches_the_node_s_own_services(node, alice, rate):
    """Found by attacking the sandbox: a job given the network shared the node's, so 127.0.0.1
    was the node itself: it talked to the host's Redis and PostgreSQL (trust authentication) and,
    through the cache's pickles in Redis, could run code in the web server. Now it has a network
    of its own (its own loopback) with an uplink to the outside that refuses the node's loopback."""
    import socket

    from agent.isolation import local_addresses
    from tests.conftest import make_job

    service = socket.socket()
    service.bind(("0.0.0.0", 0))  # the node's loopback and its other addresses
    service.listen()
    port = service.getsockname()[1]
    outside = [a for a in local_addresses(Path("/proc/net/fib_trie").read_text()) if not a.startswith("127.")]
    script = f"""
import socket, threading
def reach(host, port):
    s = socket.socket(); s.settimeout(3)
    try:
        s.connect((host, port)); return "reached"
    except OSError as error:
        return f"refused ({{error.__class__.__name__}})"
print("node", reach("127.0.0.1", {port}), flush=True)
print("gateway", reach("10.0.2.2", {port}), flush=True)
for address in {outside!r}:
    print("address", address, reach(address, {port}), flush=True)
import subprocess
removed = subprocess.run(["ip", "route", "del", "169.254.0.0/16"], capture_output=True, text=True)
print("remove", removed.returncode, removed.stderr.strip(), flush=True)
print("metadata", reach("169.254.169.254", 80), flush=True)
own = socket.socket(); own.bind(("127.0.0.1", 0)); own.listen()
print("own", reach("127.0.0.1", own.getsockname()[1]), flush=True)
print("interfaces", sorted(name for _, name in socket.if_nameindex()), flush=True)
print("unix", len(open("/proc/net/unix").read().splitlines()) - 1, flush=True)
""".encode()
    try:
        job = run(node, make_job(alice, script=script, network=True))
    finally:
        service.close()
    assert job.state == "succeeded", (job.reason, lines(job))
    said = dict(line.split(" ", 1) for line in lines(job) if line.split(" ", 1)[0] in ("node", "gateway", "own", "interfaces", "unix", "metadata", "remove"))
    assert said["node"].startswith("refused") and said["gateway"].startswith("refused"), said
    # Found by attacking it again: slirp4netns connects as root on the node, so the node's other
    # addresses (and the clouds' metadata service) were reachable through the uplink. They are
    # unreachable routes in the job's network now: refused at once, never handed to the uplink.
    tried = [line for line in lines(job) if line.startswith("address ")]
    assert len(tried) == len(outside) and all("refused (OSError)" in line for line in tried), tried
    assert said["metadata"] == "refused (OSError)", said
    assert not said["remove"].startswith("0"), said  # root only in its own user namespace: the routes stay
    assert said["own"] == "reached", said  # its own loopback works (torchrun on one node uses it)
    assert said["interfaces"] == "['lo', 'tap0']", said  # the uplink
    assert said["unix"] == "0", said  # no abstract socket of the node's is in its network


def test_files_unlinked_but_held_open_count_against_the_disk_limit(node, alice, rate, settings):
    """Found by attacking the sandbox: the folder's size was measured by walking it, so files the
    job unlinked and kept open (60 MB against a 10 MB limit) were never counted."""
    from tests.conftest import make_job

    settings.E31_JOB_DISK_BYTES = 10 * 10**6
    settings.E31_JOB_DISK_CHECK_SECONDS = 0.3
    script = b"""
import os, tempfile, time
held = []
for i in range(3):
    f = tempfile.TemporaryFile(dir=os.environ["E31_OUTPUT_DIR"])  # unlinked at once, held open
    f.write(os.urandom(6 * 10**6)); f.flush(); os.fsync(f.fileno())
    held.append(f)
print("holding", flush=True)
time.sleep(30)
print("still here", flush=True)
"""
    job = run(node, make_job(alice, script=script), timeout=60)
    assert job.state == "failed" and "disk" in job.reason, (job.reason, lines(job))
    assert "still here" not in lines(job)


def test_a_sparse_checkpoint_longer_than_the_disk_limit_is_not_uploaded(node, alice, rate, settings):
    from jobs.models import Checkpoint
    from tests.conftest import make_job

    settings.E31_JOB_DISK_BYTES = 10**6
    script = b"""
import os, time
folder = os.environ["E31_CHECKPOINT_DIR"]
with open(os.path.join(folder, "step-1.pt"), "wb") as f:
    f.truncate(200 * 10**6)
open(os.path.join(folder, "step-2.pt"), "wb").write(b"c" * 1000)
time.sleep(2)
"""
    job = run(node, make_job(alice, script=script))
    assert job.state == "succeeded", (job.reason, lines(job))
    assert list(Checkpoint.objects.filter(job=job).values_list("name", flat=True)) == ["step-2.pt"]
