"""A folder sent from the browser: its files, with their paths, packed into a zip the job unpacks.

The packing (jobs/folders.py) is tested over plain pairs, without a database, hostile paths
first; then the form, as the page posts a folder: the files under `code_folder`, their paths
under `code_paths`, in the same order.
"""

import io
import stat
import zipfile

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.urls import reverse

from e31 import unpack
from jobs import folders
from jobs.models import Job, Upload

URL = reverse("jobs:new")
LIMITS = {"max_bytes": 10_000, "max_entries": 10}
PROJECT = {
    "myproj/train.py": b"from pkg.model import Model\nprint(Model())\n",
    "myproj/pkg/__init__.py": b"",
    "myproj/pkg/model.py": b"class Model:\n    pass\n",
}


def packed(pairs, **limits):
    out = io.BytesIO()
    top, paths = folders.pack(pairs, out, **{**LIMITS, **limits})
    return top, paths, zipfile.ZipFile(io.BytesIO(out.getvalue()))


def refusal(pairs, **limits):
    with pytest.raises(folders.FolderError) as error:
        folders.pack(pairs, io.BytesIO(), **{**LIMITS, **limits})
    return str(error.value)


# Packing, without a database.


def test_it_packs_the_files_with_their_paths_relative_to_the_folder_chosen():
    pairs = list(PROJECT.items())
    pairs[2] = (pairs[2][0], io.BytesIO(pairs[2][1]))  # a file as well as bytes
    top, paths, archive = packed(pairs)
    assert top == "myproj"
    assert paths == ["pkg/__init__.py", "pkg/model.py", "train.py"]
    assert archive.namelist() == paths
    for path, content in PROJECT.items():
        assert archive.read(path.removeprefix("myproj/")) == content


def test_only_regular_files_go_in():
    _, _, archive = packed(list(PROJECT.items()))
    for info in archive.infolist():
        mode = info.external_attr >> 16
        assert stat.S_ISREG(mode) and not stat.S_ISLNK(mode) and mode & 0o777 == 0o644, (info.filename, oct(mode))


def test_the_job_unpacks_it_as_an_uploaded_zip(tmp_path):
    out = tmp_path / "myproj.zip"
    with open(out, "wb") as file:
        folders.pack(list(PROJECT.items()), file, **LIMITS)
    listed = unpack.check(out, "myproj.zip", LIMITS["max_bytes"], LIMITS["max_entries"])
    assert sorted(listed) == ["pkg/__init__.py", "pkg/model.py", "train.py"]
    dest = tmp_path / "work"
    dest.mkdir()
    unpack.extract_limited(out, "myproj.zip", dest, LIMITS["max_bytes"], LIMITS["max_entries"])
    assert (dest / "pkg" / "model.py").read_bytes() == PROJECT["myproj/pkg/model.py"]
    assert (dest / "train.py").read_bytes() == PROJECT["myproj/train.py"]


def test_the_same_folder_packs_to_the_same_bytes():
    first, second = io.BytesIO(), io.BytesIO()
    folders.pack(list(PROJECT.items()), first, **LIMITS)
    folders.pack(list(reversed(PROJECT.items())), second, **LIMITS)
    assert first.getvalue() == second.getvalue()


@pytest.mark.parametrize(
    "paths,top,relative",
    [
        (["p/a.py", "q/b.py"], "", ["p/a.py", "q/b.py"]),  # two top folders: nothing taken off
        (["a.py", "p/b.py"], "", ["a.py", "p/b.py"]),  # a file at the top: nothing taken off
        (["a.py"], "", ["a.py"]),
        (["p/src/a.py", "p/src/b.py"], "p", ["src/a.py", "src/b.py"]),  # the one top folder, once
        (["p/a.py", "p/__pycache__/a.pyc", "p/.git/HEAD", "p/.DS_Store"], "p", ["a.py"]),  # as `e31 submit` skips them
        (["p/a.py", ".git/HEAD"], "p", ["a.py"]),
    ],
)
def test_the_paths_are_relative_to_the_folder_chosen(paths, top, relative):
    assert folders.relative_paths(paths) == (top, relative)


@pytest.mark.parametrize(
    "path,reason",
    [
        ("../x.py", "points outside the folder ('..')"),
        ("myproj/../../x.py", "points outside the folder ('..')"),
        ("..", "points outside the folder ('..')"),
        ("/etc/passwd", "is absolute"),
        ("C:/Windows/x.py", "is absolute"),
        ("myproj\\train.py", "holds a backslash"),
        ("..\\..\\x.py", "holds a backslash"),
        ("\\\\server\\share\\x.py", "holds a backslash"),
        ("train.py\x00.txt", "holds a NUL or another control character"),
        ("train\n.py", "holds a NUL or another control character"),
        ("", "came without its path"),
        ("myproj//train.py", "has an empty or '.' part"),
        ("./train.py", "has an empty or '.' part"),
        ("myproj/", "has an empty or '.' part"),
        ("a" * 256 + "/x.py", "has a name longer than 255 bytes"),
        ("a/" * 600 + "x.py", "longer than 1024 characters"),
    ],
)
def test_hostile_paths_are_refused_with_the_reason(path, reason):
    message = refusal([("myproj/train.py", b"x"), (path, b"y")])
    assert reason in message, message


def test_a_path_sent_twice_is_refused():
    assert refusal([("p/train.py", b"x"), ("p/train.py", b"y")]) == "the path 'train.py' is sent twice"


def test_a_path_that_is_a_file_and_a_folder_is_refused():
    assert refusal([("p/pkg", b"x"), ("p/pkg/model.py", b"y")]) == "'pkg' is both a file and a folder"


def test_a_folder_with_nothing_to_send_is_refused():
    assert refusal([("p/__pycache__/a.pyc", b"x")]) == "the folder has no files to send"
    assert refusal([]) == "the folder has no files to send"


def test_the_archive_limits_hold():
    assert refusal([(f"p/{n}.py", b"") for n in range(11)]) == "the folder has 11 files, more than the 10 an archive may hold"
    assert packed([(f"p/{n}.py", b"") for n in range(10)])[1]  # at the limit: taken
    message = refusal([("p/a.bin", b"x" * 6_000), ("p/b.bin", io.BytesIO(b"y" * 6_000))])
    assert message == "the folder holds at least 12.0 kB, more than the 10.0 kB a job's folder may hold"
    assert packed([("p/a.bin", b"x" * 5_000), ("p/b.bin", b"y" * 5_000)])[1]


def test_the_bytes_are_counted_as_read_not_as_declared():
    class Lying(io.BytesIO):
        size = 1  # as an UploadedFile would say

    assert "more than the 10.0 kB" in refusal([("p/a.bin", Lying(b"x" * 20_000))])


def test_paths_are_checked_before_a_byte_is_read():
    class Unreadable:
        def read(self, size=-1):
            raise AssertionError("read before the paths were checked")

    assert "points outside" in refusal([("p/a.py", Unreadable()), ("../b.py", b"")])


# The form, as the page posts a folder.


@pytest.fixture
def client_a(client, alice, rate):
    client.force_login(alice)
    return client


def folder_files(files):
    """The form's fields for a folder: the files (named as a browser would, their bare names are
    all Django keeps) and their paths in the same order."""
    return {
        "code_folder": [SimpleUploadedFile(path.rsplit("/", 1)[-1], content) for path, content in files.items()],
        "code_paths": list(files),
    }


def post(client, **fields):
    data = {"gpus": "1", "mode": "span", "span_hours": "1", "data": SimpleUploadedFile("train.csv", b"x,y\n1,2\n"), **fields}
    return client.post(URL, {k: v for k, v in data.items() if v is not None})


def errors_of(response):
    return {name: [str(e) for e in errs] for name, errs in response.context["form"].errors.items()}


def zip_of(upload):
    from core.storage import get_storage

    with get_storage().local_copy(upload.key) as path:
        with zipfile.ZipFile(path) as archive:
            return {name: archive.read(name) for name in archive.namelist()}


def test_a_folder_posted_with_its_paths_becomes_the_job_s_code(client_a):
    response = post(client_a, entrypoint="train.py", **folder_files(PROJECT))
    assert response.status_code == 302, errors_of(response)
    job = Job.objects.get()
    assert (job.entrypoint, job.name) == ("train.py", "train")
    code = job.uploads.get(role=Upload.CODE)
    assert code.name == "myproj.zip"
    assert zip_of(code) == {path.removeprefix("myproj/"): content for path, content in PROJECT.items()}


def test_the_entrypoint_is_a_path_in_the_folder(client_a):
    files = {"proj/src/train.py": b"print(1)\n", "proj/src/util.py": b"", "proj/README.md": b"hi"}
    response = post(client_a, entrypoint="proj/src/train.py", **folder_files(files))
    expected = "'proj/src/train.py' is not in the archive (runnable files there: src/train.py, src/util.py)"
    assert expected in errors_of(response)["entrypoint"][0]
    # The folder was kept: the fixed form sends it back, not the files again.
    kept = Upload.objects.get(job__isnull=True, role=Upload.CODE)
    assert kept.name == "proj.zip" and f'value="{kept.pk}"' in response.content.decode()
    response = post(client_a, entrypoint="src/train.py", kept_code=str(kept.pk))
    assert response.status_code == 302, errors_of(response)
    assert Job.objects.get().uploads.get(role=Upload.CODE) == kept


def test_a_refused_form_keeps_the_packed_folder(client_a):
    response = post(client_a, gpus="0", entrypoint="train.py", **folder_files(PROJECT))
    assert "Ask for at least 1 GPU." in errors_of(response)["gpus"]
    kept = Upload.objects.get(job__isnull=True, role=Upload.CODE)
    page = response.content.decode()
    assert "myproj.zip" in page and f'name="kept_code" value="{kept.pk}" checked' in page
    response = post(client_a, entrypoint="train.py", kept_code=str(kept.pk))
    assert response.status_code == 302, errors_of(response)
    assert zip_of(Job.objects.get().uploads.get(role=Upload.CODE))["pkg/model.py"] == PROJECT["myproj/pkg/model.py"]


@pytest.mark.parametrize("path", ["../evil.py", "/etc/cron.d/evil", "myproj\\evil.py", "myproj/evil\x00.py", "myproj/train.py"])
def test_a_hostile_or_doubled_path_refuses_the_folder_and_keeps_nothing_of_it(client_a, path):
    files = folder_files(PROJECT)
    files["code_folder"].append(SimpleUploadedFile("evil.py", b"import os"))
    files["code_paths"].append(path)
    response = post(client_a, entrypoint="train.py", **files)
    assert response.status_code == 200 and not Job.objects.exists()
    [error] = errors_of(response)["code_folder"]
    assert error.startswith("The folder was not packed: the path ")
    assert not Upload.objects.filter(role=Upload.CODE).exists()
    assert "The folder was not packed" in response.content.decode()


def test_files_without_their_paths_are_refused(client_a):
    files = folder_files(PROJECT)
    files["code_paths"].pop()
    response = post(client_a, entrypoint="train.py", **files)
    assert "came without their paths" in errors_of(response)["code_folder"][0]
    assert not Upload.objects.filter(role=Upload.CODE).exists()


def test_a_folder_and_a_script_together_are_refused(client_a):
    response = post(client_a, entrypoint="train.py", code=SimpleUploadedFile("other.py", b""), **folder_files(PROJECT))
    assert errors_of(response)["code_folder"] == ["Send a script or an archive, or a folder, not both."]
    assert not Job.objects.exists()


def test_a_folder_over_the_archive_limits_is_refused(client_a, settings):
    settings.E31_ARCHIVE_MAX_ENTRIES = 2
    response = post(client_a, entrypoint="train.py", **folder_files(PROJECT))
    assert errors_of(response)["code_folder"] == ["The folder was not packed: the folder has 3 files, more than the 2 an archive may hold."]
    settings.E31_ARCHIVE_MAX_ENTRIES, settings.E31_ARCHIVE_MAX_BYTES = 10, 1024
    response = post(client_a, entrypoint="train.py", **folder_files({"p/train.py": b"x" * 2000}))
    assert "more than the 1.0 kB a job's folder may hold" in errors_of(response)["code_folder"][0]
    assert not Upload.objects.filter(role=Upload.CODE).exists()


def test_the_page_offers_a_folder_only_where_javascript_runs(client_a):
    page = client_a.get(URL).content.decode()
    # Hidden until static/js/folder.js shows it: without JavaScript the paths could not be sent.
    assert '<div class="field" id="field-code_folder" hidden>' in page
    assert 'type="file" name="code_folder"' in page and "webkitdirectory" in page and "multiple" in page
    assert "js/folder.js" in page
    assert "myproj/src/train.py is src/train.py" in page


@pytest.mark.django_db
def test_the_api_takes_a_folder_with_its_paths_too(client, token, rate, dataset):
    import io
    import json
    import zipfile

    from django.urls import reverse

    from core.storage import get_storage
    from jobs.models import Job

    client.defaults["HTTP_AUTHORIZATION"] = f"Token {token}"
    files = []
    for name, content in (("train.py", b"import pkg.m\n"), ("__init__.py", b""), ("m.py", b"X = 1\n")):
        handle = io.BytesIO(content)
        handle.name = name
        files.append(handle)
    spec = {"gpus": 1, "span_hours": 1, "entrypoint": "train.py", "train_dataset": "numbers"}
    response = client.post(
        reverse("api:jobs"), {"spec": json.dumps(spec), "code_folder": files, "code_paths": ["proj/train.py", "proj/pkg/__init__.py", "proj/pkg/m.py"]}
    )
    assert response.status_code == 201, response.json()
    code = Job.objects.get().uploads.get(role="code")
    with get_storage().open(code.key) as stream:
        assert sorted(zipfile.ZipFile(io.BytesIO(stream.read())).namelist()) == ["pkg/__init__.py", "pkg/m.py", "train.py"]
