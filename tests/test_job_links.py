"""A job's links are never followed by its runner (issue 19).

The runner is often root and reads what a job wrote in its own folder. A job that puts a
symlink anywhere on such a path (not only as its last component), or swaps a folder for one
between the runner's look and its read, must not get the runner to read another job's files or
a file only root may read. The hostile jobs come first; the helpers that stop them after.
"""

import json
import os
import shutil
import stat
import threading

import pytest

from agent import jobfiles
from core.storage import get_storage

ROOT = os.geteuid() == 0


def stored_bytes(keys):
    storage = get_storage()
    out = []
    for key in keys:
        with storage.open(key) as source:
            out.append(source.read())
    return out


def job_bytes(job):
    """Everything of the job the network stored: its artifacts and its checkpoints."""
    keys = list(job.artifacts.values_list("key", flat=True)) + list(job.checkpoints.values_list("key", flat=True))
    return stored_bytes(keys)


def secret_folder(tmp_path, name, files, mode=0o700):
    """A folder of the runner's (or of another job's) that the hostile job points its links at."""
    folder = tmp_path / name
    folder.mkdir(parents=True)
    for filename, content in files.items():
        path = folder / filename
        path.write_bytes(content)
        path.chmod(0o600)
    folder.chmod(mode)
    return folder


def swap_for_link(path, target):
    shutil.rmtree(path)
    os.symlink(target, path)


# Hostile jobs, run by a runner in this process --------------------------------------------------


@pytest.fixture
def node(make_runner):
    return make_runner("links-node", devices=2)


def run(node, job, timeout=60):
    from tests.test_isolation import run as run_job

    return run_job(node, job, timeout=timeout)


def lines(job):
    return [t for _, t in job.events.filter(kind="log").order_by("seq").values_list("stream", "text")]


STEAL_METRICS = """
import os, shutil, time
control = os.path.dirname(os.environ["E31_METRICS_FILE"])
shutil.rmtree(control, ignore_errors=True)
os.symlink({victim!r}, control)
print("swapped", flush=True)
time.sleep(1.5)
"""


@pytest.mark.runs_jobs
@pytest.mark.timeout(120)
@pytest.mark.django_db(transaction=True)
def test_a_job_that_links_its_control_folder_to_another_job_s_gets_none_of_its_metrics(node, alice, rate, tmp_path, client):
    from rest_framework.authtoken.models import Token

    from tests.conftest import make_job

    point = {"step": 7, "values": {"victim_secret_accuracy": 0.987}}
    metrics = {"metrics.jsonl": (json.dumps(point) + "\n").encode()}
    victim = secret_folder(tmp_path, "runs-of-team-b/42-abcdef01/.e31", metrics, 0o755)
    job = run(node, make_job(alice, script=STEAL_METRICS.format(victim=str(victim)).encode()))
    assert "swapped" in lines(job), (job.reason, lines(job))
    events = [e.data for e in job.events.filter(kind="metric")]
    assert not any("victim_secret_accuracy" in e["values"] for e in events), events
    # And so not through the API the attack was seen on.
    token = Token.objects.create(user=alice).key
    body = client.get(f"/api/jobs/{job.pk}/metrics/", HTTP_AUTHORIZATION=f"Token {token}").content
    assert b"victim_secret" not in body
    assert (victim / "metrics.jsonl").exists(), "the other job's file is left as it was"


KEEP_OUTPUT = b"""
import os
out = os.environ["E31_OUTPUT_DIR"]
open(os.path.join(out, "a.txt"), "w").write("mine")
os.makedirs(os.path.join(out, "data"), exist_ok=True)
open(os.path.join(out, "data", "secret.txt"), "w").write("decoy")
"""


@pytest.mark.runs_jobs
@pytest.mark.timeout(120)
@pytest.mark.django_db(transaction=True)
def test_an_output_folder_swapped_for_a_link_after_the_look_keeps_no_root_only_file(node, alice, rate, tmp_path, monkeypatch):
    """The job's last act lands between the runner's look at its output folder and its read:
    output/data becomes a link to a folder only root may read, holding a file of the name the
    runner already listed. The swap is made by the test at that moment, so it happens every run."""
    from agent import running as running_module
    from tests.conftest import make_job

    secret = secret_folder(tmp_path, "root-only", {"secret.txt": b"ROOT-ONLY-SECRET"})
    real = running_module.artifact_name_problem
    swapped = []

    def look_then_swap(name):
        if not swapped:
            (running,) = node.running.values()
            swap_for_link(running.dirs.output / "data", secret)
            swapped.append(name)
        return real(name)

    monkeypatch.setattr(running_module, "artifact_name_problem", look_then_swap)
    job = run(node, make_job(alice, script=KEEP_OUTPUT))
    assert swapped == ["a.txt"], (swapped, job.reason, lines(job))
    assert list(job.artifacts.values_list("name", flat=True)) == ["a.txt"]
    assert not any(b"ROOT-ONLY" in content for content in job_bytes(job))
    assert job.state == "succeeded", job.reason


# Writes a checkpoint, then a NaN loss: stopped early with no output files, so its latest
# checkpoint is returned as its output.
NAN_AFTER_CHECKPOINT = b"""
import json, os, time
folder = os.environ["E31_CHECKPOINT_DIR"]
with open(os.path.join(folder, ".ckpt-1.tmp"), "w") as f:
    f.write("my own weights")
os.replace(os.path.join(folder, ".ckpt-1.tmp"), os.path.join(folder, "ckpt-1.bin"))
time.sleep(0.6)
print("writing nan", flush=True)
with open(os.environ["E31_METRICS_FILE"], "a") as out:
    out.write(json.dumps({"step": 1, "values": {"loss": float("nan")}}) + "\\n")
time.sleep(30)
"""


@pytest.mark.runs_jobs
@pytest.mark.timeout(120)
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("by", ["job", "race"])
def test_a_checkpoint_folder_swapped_for_a_link_uploads_and_returns_nothing_outside(node, alice, rate, tmp_path, monkeypatch, by):
    """by=job: the job itself puts the link in place of its checkpoint folder before it is stopped.
    by=race: the swap lands after the runner looked at the folder and before it read the
    checkpoint to return (made by the test at that moment); the other job's folder holds a file
    of the same name."""
    from agent import checkpoints
    from tests.conftest import make_job

    other = secret_folder(tmp_path, "other-job/checkpoints", {"ckpt-1.bin": b"VICTIM-WEIGHTS", "ckpt-9.bin": b"VICTIM-WEIGHTS-9"})
    script = NAN_AFTER_CHECKPOINT
    if by == "job":
        script = script.replace(
            b'print("writing nan"',
            f'import shutil; shutil.rmtree(folder); os.symlink({str(other)!r}, folder)\nprint("writing nan"'.encode(),
        )
    else:
        real_scan = checkpoints.scan
        swapped = []

        def scan_then_swap(folder):
            found = real_scan(folder)
            import sys

            if sys._getframe(1).f_code.co_name == "return_latest_checkpoint" and found and not swapped:
                swap_for_link(folder, other)
                swapped.append(sorted(found))
            return found

        monkeypatch.setattr(checkpoints, "scan", scan_then_swap)
    job = run(node, make_job(alice, script=script))
    # Printed after the swap and before the NaN that stops it: the job stood as the test meant it
    # to when stopped (printed after the NaN, under load the stop came first and the line never).
    assert "writing nan" in lines(job), (job.reason, lines(job))
    assert job.allocations.get().end_reason == "early_stop", job.reason
    if by == "race":
        assert swapped == [["ckpt-1.bin"]]
    contents = job_bytes(job)
    assert not any(b"VICTIM" in content for content in contents), contents
    assert set(contents) <= {b"my own weights"}


# The helpers ------------------------------------------------------------------------------------


@pytest.fixture
def folder(tmp_path):
    """A job's folder: a.txt, sub/b.txt, sub/deep/c.txt; and a secret beside it."""
    root = tmp_path / "job"
    (root / "sub" / "deep").mkdir(parents=True)
    (root / "a.txt").write_text("a")
    (root / "sub" / "b.txt").write_text("b")
    (root / "sub" / "deep" / "c.txt").write_text("c")
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "b.txt").write_text("SECRET")
    (secret / "deep").mkdir()
    (secret / "deep" / "c.txt").write_text("SECRET")
    return root


def read(fd):
    with open(os.dup(fd), "rb") as f:
        return f.read()


@pytest.mark.nodb
def test_open_file_reads_a_regular_file_through_the_folder_s_descriptor(folder):
    fd = jobfiles.open_file(folder, "sub/deep/c.txt")
    try:
        assert read(fd) == b"c"
    finally:
        os.close(fd)
    root = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fd = jobfiles.open_file(root, "a.txt")  # a descriptor of the folder will do as well
        assert read(fd) == b"a"
        os.close(fd)
    finally:
        os.close(root)


@pytest.mark.nodb
@pytest.mark.parametrize("relative", ["sub/b.txt", "sub/deep/c.txt"])
def test_a_link_in_a_middle_component_is_not_followed(folder, relative):
    swap_for_link(folder / "sub", folder.parent / "secret")
    assert (folder / relative).read_text() == "SECRET"  # what a plain open (even with O_NOFOLLOW) reads
    with pytest.raises(OSError):
        os.close(jobfiles.open_file(folder, relative))
    with pytest.raises(OSError):
        os.close(jobfiles.open_dir(folder, "sub"))
    assert [name for name, _ in jobfiles.regular_files(folder)] == ["a.txt"]


@pytest.mark.nodb
def test_a_link_as_the_last_component_or_the_folder_asked_for_is_refused(folder):
    os.symlink(folder.parent / "secret" / "b.txt", folder / "link.txt")
    with pytest.raises(OSError):
        os.close(jobfiles.open_file(folder, "link.txt"))
    os.symlink(folder.parent / "secret", folder / "linked")
    with pytest.raises(OSError):
        list(jobfiles.regular_files(folder, "linked"))
    assert sorted(name for name, _ in jobfiles.regular_files(folder)) == ["a.txt", "sub/b.txt", "sub/deep/c.txt"]


@pytest.mark.nodb
@pytest.mark.timeout(10)
def test_a_fifo_is_refused_without_blocking(folder):
    os.mkfifo(folder / "sub" / "pipe")
    done = []

    def attempt():
        try:
            os.close(jobfiles.open_file(folder, "sub/pipe"))
            done.append("opened")
        except OSError as error:
            done.append(error)

    reader = threading.Thread(target=attempt, daemon=True)
    reader.start()
    reader.join(3)
    assert done and isinstance(done[0], jobfiles.NotRegularFile), done or "blocked on the pipe"
    assert "sub/pipe" not in [name for name, _ in jobfiles.regular_files(folder)]


@pytest.mark.nodb
def test_a_folder_where_a_file_was_expected_is_refused(folder):
    with pytest.raises(OSError):
        os.close(jobfiles.open_file(folder, "sub"))
    with pytest.raises(OSError):
        os.close(jobfiles.open_file(folder, "sub/deep"))
    with pytest.raises(OSError):
        os.close(jobfiles.open_dir(folder, "a.txt"))
    with pytest.raises(ValueError):
        jobfiles.open_file(folder, "../secret/b.txt")
    with pytest.raises(ValueError):
        jobfiles.open_file(folder, "/etc/passwd")


@pytest.mark.nodb
def test_regular_files_never_enters_a_folder_swapped_for_a_link_after_the_look(folder):
    names = []
    for name, fd in jobfiles.regular_files(folder):
        names.append((name, read(fd)))
        if name == "a.txt":  # listed already: sub is a folder at the look, a link at the read
            swap_for_link(folder / "sub", folder.parent / "secret")
    assert names == [("a.txt", b"a")]


@pytest.mark.nodb
def test_regular_files_walks_deep_trees_with_few_descriptors(tmp_path, monkeypatch):
    monkeypatch.setattr(jobfiles, "KEEP_OPEN", 4)
    root = tmp_path / "deep"
    path = root
    expected = []
    for depth in range(40):
        path = path / f"d{depth}"
        path.mkdir(parents=True)
        (path / "f").write_text(str(depth))
        (path / "side").mkdir()
        (path / "side" / "g").write_text(str(depth))
        rel = path.relative_to(root).as_posix()
        expected += [f"{rel}/f", f"{rel}/side/g"]
    before = len(os.listdir("/proc/self/fd"))
    most = 0
    found = []
    for name, _fd in jobfiles.regular_files(root):
        most = max(most, len(os.listdir("/proc/self/fd")) - before)
        found.append(name)
    assert sorted(found) == sorted(expected)
    assert most <= 4 + 6
    assert len(os.listdir("/proc/self/fd")) == before, "every descriptor closed"


@pytest.mark.nodb
def test_disk_used_counts_each_inode_once_skips_the_staged_and_follows_no_link(tmp_path):
    root = tmp_path / "job"
    (root / "data").mkdir(parents=True)
    (root / "data" / "big").write_bytes(os.urandom(200_000))
    os.link(root / "data" / "big", root / "data" / "same")
    staged = tmp_path / "staged"
    staged.write_bytes(os.urandom(300_000))
    os.link(staged, root / "data" / "staged")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "huge").write_bytes(os.urandom(5_000_000))
    os.symlink(elsewhere, root / "link")
    st = os.stat(staged)
    used = jobfiles.disk_used(root, frozenset({(st.st_dev, st.st_ino)}))
    big = os.stat(root / "data" / "big").st_blocks * 512
    assert big <= used < 1_000_000
    assert jobfiles.disk_used(root) >= used + st.st_blocks * 512
    assert jobfiles.disk_used(tmp_path / "missing") == 0

    # The same figure as the path-based measure it replaces, where there is nothing to race.
    def measured_by_path(root, skip_inodes=frozenset()):
        seen, total = set(), 0
        for top, dirs, files in os.walk(root):
            for name in dirs + files:
                st = os.lstat(os.path.join(top, name))
                if (st.st_dev, st.st_ino) not in seen | skip_inodes:
                    seen.add((st.st_dev, st.st_ino))
                    total += st.st_blocks * 512
        return total

    skip = frozenset({(st.st_dev, st.st_ino)})
    assert jobfiles.disk_used(root) == measured_by_path(root)
    assert jobfiles.disk_used(root, skip) == measured_by_path(root, skip)


@pytest.mark.nodb
def test_disk_used_is_not_fooled_by_a_folder_swapped_for_a_link(tmp_path):
    root = tmp_path / "job"
    (root / "sub").mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "huge").write_bytes(os.urandom(3_000_000))
    swap_for_link(root / "sub", elsewhere)
    assert jobfiles.disk_used(root) < 100_000


@pytest.mark.nodb
@pytest.mark.skipif(not ROOT, reason="a root-only file needs a root reader to matter")
def test_a_root_only_file_behind_a_linked_folder_is_not_read(tmp_path):
    root = tmp_path / "job"
    root.mkdir()
    secret = secret_folder(tmp_path, "root-only", {"key": b"ROOT-KEY"})
    assert stat.S_IMODE(secret.stat().st_mode) == 0o700
    os.symlink(secret, root / "output")
    with pytest.raises(OSError):
        os.close(jobfiles.open_file(root, "output/key"))
    with pytest.raises(OSError):
        list(jobfiles.regular_files(root, "output"))
    assert [name for name, _ in jobfiles.regular_files(root)] == []


@pytest.mark.nodb
def test_the_cache_check_after_a_job_sees_a_link_put_in_a_file_s_place(tmp_path):
    """A job run as the runner's own user (no isolation) swaps a cached file for a link to a
    file it made with the same size, time and mode: the check must not look through the link."""
    import hashlib

    from agent.cache import BlobCache

    cache = BlobCache(tmp_path / "cache", 10**9, direct_io=False)
    content = b"staged bytes"
    sha = hashlib.sha256(content).hexdigest()
    tmp = cache.temp_path(sha)
    tmp.write_bytes(content)
    cache.put(tmp, sha)
    entered = os.stat(cache.path(sha))
    forged = tmp_path / "forged"
    forged.write_bytes(b"other bytes!")
    forged.chmod(0o444)
    os.utime(forged, ns=(entered.st_atime_ns, entered.st_mtime_ns))
    cache.path(sha).unlink()
    os.symlink(forged, cache.path(sha))
    assert cache.check({sha}) == [sha]
    assert not os.path.lexists(cache.path(sha)) and forged.exists()
