import ast
import io
import json
import os
import subprocess
import sys
import tarfile
import warnings
import zipfile
from pathlib import Path

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.urls import reverse

from e31 import unpack
from jobs import archive
from jobs.models import Job


def make_zip(path, entries, symlink=None):
    with zipfile.ZipFile(path, "w") as z:
        for name, content in entries.items():
            z.writestr(name, content)
        if symlink:
            info = zipfile.ZipInfo(symlink)
            info.external_attr = 0o120777 << 16
            z.writestr(info, "/etc/passwd")
    return path


def make_tar(path, entries, link=None):
    with tarfile.open(path, "w:gz") as t:
        for name, content in entries.items():
            info = tarfile.TarInfo(name)
            info.size = len(content)
            t.addfile(info, io.BytesIO(content))
        if link:
            info = tarfile.TarInfo(link)
            info.type = tarfile.SYMTYPE
            info.linkname = "/etc/passwd"
            t.addfile(info)
    return path


def test_a_script_is_its_own_entrypoint(tmp_path):
    path = tmp_path / "x"
    path.write_text("print(1)")
    assert archive.list_entries(path, "train.py") == ["train.py"]


def test_zip_and_tar_entries_are_listed(tmp_path):
    z = make_zip(tmp_path / "a.zip", {"pkg/train.py": "x", "pkg/util.py": "y", "README": "z"})
    assert sorted(archive.list_entries(z, "a.zip")) == ["README", "pkg/train.py", "pkg/util.py"]
    t = make_tar(tmp_path / "a.tar.gz", {"src/main.py": b"x"})
    assert archive.list_entries(t, "a.tar.gz") == ["src/main.py"]


@pytest.mark.parametrize("bad", ["../evil.py", "a/../../evil.py", "/etc/cron.d/evil"])
def test_entries_outside_the_folder_are_refused(tmp_path, bad):
    z = make_zip(tmp_path / "a.zip", {bad: "x", "train.py": "y"})
    with pytest.raises(archive.ArchiveError, match="outside|absolute"):
        archive.list_entries(z, "a.zip")
    t = make_tar(tmp_path / "a.tar.gz", {bad: b"x"})
    with pytest.raises(archive.ArchiveError, match="outside|absolute"):
        archive.list_entries(t, "a.tar.gz")


def test_links_are_refused(tmp_path):
    with pytest.raises(archive.ArchiveError, match="link"):
        archive.list_entries(make_zip(tmp_path / "a.zip", {"a.py": "x"}, symlink="b.py"), "a.zip")
    with pytest.raises(archive.ArchiveError, match="link"):
        archive.list_entries(make_tar(tmp_path / "a.tar.gz", {"a.py": b"x"}, link="b.py"), "a.tar.gz")


def test_a_broken_archive_is_refused_with_a_reason(tmp_path):
    path = tmp_path / "a.zip"
    path.write_bytes(b"not a zip at all")
    with pytest.raises(archive.ArchiveError, match="cannot be read"):
        archive.list_entries(path, "a.zip")


def test_other_files_are_refused(tmp_path):
    path = tmp_path / "w"
    path.write_text("x")
    with pytest.raises(archive.ArchiveError, match=r"\.py script or a \.zip or \.tar\.gz"):
        archive.list_entries(path, "weights.bin")


def test_the_entrypoint_must_be_in_the_archive_and_runnable():
    entries = ["pkg/train.py", "pkg/data.txt"]
    assert archive.check_entrypoint(entries, "pkg/train.py") == "pkg/train.py"
    with pytest.raises(archive.ArchiveError, match="is not in the archive.*pkg/train.py"):
        archive.check_entrypoint(entries, "train.py")
    with pytest.raises(archive.ArchiveError, match=r"\.py or \.sh"):
        archive.check_entrypoint(entries, "pkg/data.txt")
    with pytest.raises(archive.ArchiveError, match="name the entrypoint"):
        archive.check_entrypoint(entries, "  ")


def test_extraction_unpacks_into_the_folder(tmp_path):
    z = make_zip(tmp_path / "a.zip", {"pkg/train.py": "print(1)"})
    dest = tmp_path / "code"
    dest.mkdir()
    archive.extract(z, "a.zip", dest)
    assert (dest / "pkg" / "train.py").read_text() == "print(1)"


def test_extraction_refuses_an_unsafe_archive_before_writing(tmp_path):
    t = make_tar(tmp_path / "a.tar.gz", {"ok.py": b"x", "../evil.py": b"y"})
    dest = tmp_path / "code"
    dest.mkdir()
    with pytest.raises(archive.ArchiveError):
        archive.extract(t, "a.tar.gz", dest)
    assert list(dest.iterdir()) == [] and not (tmp_path / "evil.py").exists()


# Zip bombs and other archives too big to unpack ---------------------------------------------------

MiB = 1024**2
UNPACK_SCRIPT = Path(unpack.__file__)


def make_bomb(path, size=2 * MiB, name="zeros.bin"):
    """A zip of `size` zero bytes: a few kB on disk, `size` once unpacked."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as z:
        z.writestr("train.py", "print(1)")
        z.writestr(name, bytes(size))
    return path


def make_many(path, count):
    return make_tar(path, {f"f{i}.txt": b"" for i in range(count)})


def with_a_broken_tail(path, tail=256 * 1024):
    """The tar.gz at path, plus an incompressible member cut in half: reading to the end fails."""
    with tarfile.open(path, "r:gz") as t:
        members = [(m, t.extractfile(m).read() if m.isfile() else None) for m in t]
    with tarfile.open(path, "w:gz") as t:
        for member, content in members:
            t.addfile(member, io.BytesIO(content) if content is not None else None)
        info = tarfile.TarInfo("tail.bin")
        info.size = tail
        t.addfile(info, io.BytesIO(os.urandom(tail)))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - tail // 2])
    return path


def written(folder):
    return sum(f.stat().st_size for f in Path(folder).rglob("*") if f.is_file())


@pytest.fixture
def small_limits(settings):
    settings.E31_ARCHIVE_MAX_BYTES = MiB
    settings.E31_ARCHIVE_MAX_ENTRIES = 50


def test_a_zip_bomb_is_refused_from_its_headers(tmp_path, small_limits):
    bomb = make_bomb(tmp_path / "bomb.zip")
    assert bomb.stat().st_size < 20_000
    with pytest.raises(archive.ArchiveError, match=r"unpacks to 2\.1 MB, more than the 1\.0 MB a job's folder may hold"):
        archive.list_entries(bomb, "bomb.zip")


def test_the_limits_can_be_given_as_arguments(tmp_path):
    bomb = make_bomb(tmp_path / "bomb.zip")
    assert sorted(archive.list_entries(bomb, "bomb.zip")) == ["train.py", "zeros.bin"]
    with pytest.raises(archive.ArchiveError, match="more than the 1.0 MB"):
        archive.list_entries(bomb, "bomb.zip", max_bytes=MiB)
    with pytest.raises(archive.ArchiveError, match="the archive has 2 entries, more than 1$"):
        archive.list_entries(bomb, "bomb.zip", max_entries=1)


def test_an_archive_never_unpacks_to_more_than_a_jobs_folder_may_hold(tmp_path, settings):
    settings.E31_ARCHIVE_MAX_BYTES = 10 * 1024**3
    settings.E31_JOB_DISK_BYTES = MiB
    assert archive.limits()[0] == MiB
    settings.E31_JOB_DISK_BYTES = 0  # a share of the node's disk, unknown until the job is placed
    assert archive.limits()[0] == 10 * 1024**3
    settings.E31_JOB_DISK_BYTES = MiB
    with pytest.raises(archive.ArchiveError, match="more than the 1.0 MB"):
        archive.list_entries(make_bomb(tmp_path / "bomb.zip"), "bomb.zip")


def test_close_sizes_are_shown_in_bytes(tmp_path):
    with pytest.raises(archive.ArchiveError, match=r"unpacks to 1,000,008 bytes, more than the 1,000,000 bytes"):
        archive.list_entries(make_bomb(tmp_path / "b.zip", size=1_000_000), "b.zip", max_bytes=1_000_000)


def test_a_tar_with_too_many_entries_is_refused_before_it_is_all_read(tmp_path, small_limits):
    assert len(archive.list_entries(make_many(tmp_path / "ok.tar.gz", 50), "ok.tar.gz")) == 50
    # The broken tail proves the headers are read one by one and reading stops at the limit.
    tar = with_a_broken_tail(make_many(tmp_path / "many.tar.gz", 60))
    with pytest.raises(archive.ArchiveError, match="the archive has at least 51 entries, more than 50"):
        archive.list_entries(tar, "many.tar.gz")


def test_a_tar_bomb_is_refused_at_its_first_oversized_header(tmp_path, small_limits):
    tar = with_a_broken_tail(make_tar(tmp_path / "bomb.tar.gz", {"zeros.bin": bytes(2 * MiB)}))
    with pytest.raises(archive.ArchiveError, match=r"unpacks to at least 2\.1 MB, more than the 1\.0 MB"):
        archive.list_entries(tar, "bomb.tar.gz")


def test_extraction_refuses_a_bomb_before_writing(tmp_path, small_limits):
    dest = tmp_path / "code"
    dest.mkdir()
    with pytest.raises(archive.ArchiveError, match="more than the 1.0 MB"):
        archive.extract(make_bomb(tmp_path / "bomb.zip"), "bomb.zip", dest)
    assert list(dest.iterdir()) == []


def lying_zip(path, size=MiB, claimed=10):
    """A zip whose headers say its one file holds `claimed` bytes; it inflates to `size`."""
    make_bomb(path, size=size)
    data = bytearray(path.read_bytes())
    for signature, offset in ((b"PK\x01\x02", 24), (b"PK\x03\x04", 22)):  # central, local header
        at = data.rfind(signature)  # the last entry: zeros.bin
        data[at + offset : at + offset + 4] = claimed.to_bytes(4, "little")
    path.write_bytes(bytes(data))
    return path


def test_extraction_never_writes_more_than_the_limit_when_a_header_lies(tmp_path):
    liar = lying_zip(tmp_path / "liar.zip")
    assert archive.list_entries(liar, "liar.zip", max_bytes=1000) == ["train.py", "zeros.bin"]
    dest = tmp_path / "code"
    dest.mkdir()
    with pytest.raises(archive.ArchiveError):
        archive.extract_limited(liar, "liar.zip", dest, 1000, 10)
    assert written(dest) <= 1000


def test_extraction_counts_the_bytes_it_writes_not_the_headers(tmp_path, monkeypatch):
    monkeypatch.setattr(unpack, "check", lambda *args: [])  # as if every header lied
    dest = tmp_path / "code"
    dest.mkdir()
    # train.py's 8 bytes, then the first MiB of zeros would pass the limit: it is not written.
    with pytest.raises(archive.ArchiveError, match="unpacks to at least 1,048,584 bytes, more than the 1,048,576 bytes"):
        archive.extract_limited(make_bomb(tmp_path / "bomb.zip"), "bomb.zip", dest, MiB, 10)
    assert (dest / "train.py").exists() and written(dest) <= MiB
    with pytest.raises(archive.ArchiveError, match="at least 6 entries, more than 5"):
        archive.extract_limited(make_many(tmp_path / "many.tar.gz", 10), "many.tar.gz", tmp_path, MiB, 5)


def test_extraction_within_the_limits_writes_every_file(tmp_path):
    tar = make_tar(tmp_path / "a.tar.gz", {"pkg/run.sh": b"echo hi", "pkg/data/x.bin": bytes(1000)})
    dest = tmp_path / "code"
    dest.mkdir()
    archive.extract_limited(tar, "a.tar.gz", dest, 1007, 2)
    assert (dest / "pkg" / "run.sh").read_bytes() == b"echo hi" and written(dest) == 1007


def test_extraction_refuses_an_entry_named_twice(tmp_path):
    z = tmp_path / "twice.zip"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zipfile warns of the duplicate name
        make_zip(z, {"a.py": "x"})
        with zipfile.ZipFile(z, "a") as again:
            again.writestr("a.py", "y")
    dest = tmp_path / "code"
    dest.mkdir()
    with pytest.raises(archive.ArchiveError, match="'a.py' clashes"):
        archive.extract_limited(z, "twice.zip", dest, MiB, 10)


def run_unpack(*args):
    return subprocess.run([sys.executable, "-I", "-S", str(UNPACK_SCRIPT), *map(str, args)], capture_output=True, text=True, timeout=60)


def test_the_unpack_script_runs_alone_with_the_standard_library(tmp_path):
    imported = set()
    for node in ast.walk(ast.parse(UNPACK_SCRIPT.read_text())):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add((node.module or ".").split(".")[0])
    assert imported <= sys.stdlib_module_names
    z = make_zip(tmp_path / "a.zip", {"pkg/train.py": "print(1)"})
    dest = tmp_path / "code"
    dest.mkdir()
    done = run_unpack(z, "a.zip", dest, MiB, 10)
    assert (done.returncode, done.stderr) == (0, "")
    assert (dest / "pkg" / "train.py").read_text() == "print(1)"


def test_the_unpack_script_refuses_a_bomb_with_one_line(tmp_path):
    dest = tmp_path / "code"
    dest.mkdir()
    done = run_unpack(make_bomb(tmp_path / "bomb.zip"), "bomb.zip", dest, MiB, 10)
    assert done.returncode == 2
    assert done.stderr == "bomb.zip: the archive unpacks to 2.1 MB, more than the 1.0 MB a job's folder may hold\n"
    assert list(dest.iterdir()) == []
    done = run_unpack(with_a_broken_tail(make_many(tmp_path / "m.tar.gz", 20)), "m.tar.gz", dest, MiB, 10)
    assert (done.returncode, done.stderr.count("\n")) == (2, 1) and "more than 10" in done.stderr


def upload(content, name):
    return SimpleUploadedFile(name, content, content_type="application/octet-stream")


def test_the_job_form_refuses_a_bomb_with_the_reason(client, alice, rate, small_limits, tmp_path):
    client.force_login(alice)
    bomb = make_bomb(tmp_path / "bomb.zip").read_bytes()
    data = {"gpus": "1", "mode": "span", "span_hours": "1", "entrypoint": "train.py"}
    response = client.post(reverse("jobs:new"), {**data, "code": upload(bomb, "bomb.zip"), "data": upload(b"x\n", "t.csv")})
    errors = [str(e) for e in response.context["form"].errors["code"]]
    assert errors == ["bomb.zip: the archive unpacks to 2.1 MB, more than the 1.0 MB a job's folder may hold"]
    assert not Job.objects.exists()


def test_the_api_refuses_a_bomb_with_a_400_and_the_reason(client, token, rate, small_limits, tmp_path):
    bomb = make_bomb(tmp_path / "bomb.zip").read_bytes()
    spec = json.dumps({"gpus": 1, "span_hours": 1, "entrypoint": "train.py"})
    payload = {"spec": spec, "code": upload(bomb, "bomb.zip"), "data": upload(b"x\n", "t.csv")}
    response = client.post(reverse("api:jobs"), payload, HTTP_AUTHORIZATION=f"Token {token}")
    assert response.status_code == 400
    reason = "bomb.zip: the archive unpacks to 2.1 MB, more than the 1.0 MB a job's folder may hold"
    assert response.json()["errors"]["code"] == [f"work.code: {reason}"] and reason in response.json()["detail"]
    assert not Job.objects.exists()
