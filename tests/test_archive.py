import io
import tarfile
import zipfile

import pytest

from jobs import archive


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
