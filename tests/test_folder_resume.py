"""A folder uploaded ahead of the job form, resumably (jobs/folder_uploads.py, jobs/folder_api.py).

The browser announces the folder's paths and sizes (checked before a byte is sent: jobs.folders.plan,
tested here without a database), sends each file in chunks through the dataset uploads' machinery,
asks after a break how far each file got and goes on from there; the form then carries only the
folder's id, and the folder is packed into the zip the job unpacks. Another team can neither see,
send to, nor use a team's folder. The chunk protocol runs on the local folder and on S3.
"""

import hashlib
import io
import json
import zipfile

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import Client
from django.urls import reverse
from django.utils import timezone
from rest_framework.authtoken.models import Token

from accounts.models import AuditEvent
from catalog.models import DatasetUpload
from core.storage import get_storage
from jobs import folder_uploads, folders
from jobs.models import FolderUpload, Job, Upload

CHUNK = 5 * 1024 * 1024  # S3's smallest part (but the last)
FORM = reverse("jobs:new")
LIMITS = {"max_bytes": 10_000, "max_entries": 10, "max_file_bytes": 5_000}


def payload(size, seed=0):
    """size bytes that differ from chunk to chunk (a misplaced chunk changes the digest)."""
    out, counter = bytearray(), 0
    while len(out) < size:
        out += hashlib.sha256(f"{seed}-{counter}".encode()).digest() * 64
        counter += 1
    return bytes(out[:size])


# Planning a folder, without a database ----------------------------------------------------------


def test_a_plan_checks_the_paths_and_leaves_out_what_is_skipped():
    entries = [("p/train.py", 10), ("p/__pycache__/a.pyc", 99_999), ("p/pkg/m.py", 0), ("p/.git/HEAD", 5)]
    assert folders.plan(entries, **LIMITS) == ("p", [("p/train.py", 10), ("p/pkg/m.py", 0)])
    assert folders.plan([("a.py", 1), ("b/c.py", 2)], **LIMITS) == ("", [("a.py", 1), ("b/c.py", 2)])


@pytest.mark.parametrize(
    "entries,reason",
    [
        ([("p/a.py", 1), ("../x.py", 1)], "points outside the folder"),
        ([("p/a.py", 1), ("p/a.py", 1)], "is sent twice"),
        ([("p/__pycache__/a.pyc", 1)], "the folder has no files to send"),
        ([("p/a.py", -1)], "must be its size in bytes"),
        ([("p/a.py", "12")], "must be its size in bytes"),
        ([("p/a.py", True)], "must be its size in bytes"),
        ([("p/a.py", 1.5)], "must be its size in bytes"),
        ([("p/a.py", 5_001)], "'p/a.py' holds 5.0 kB, more than the 5.0 kB one file may hold"),
        ([(f"p/{n}.py", 1) for n in range(11)], "the folder has 11 files, more than the 10 an archive may hold"),
        ([("p/a.py", 5_000), ("p/b.py", 5_000), ("p/c.py", 1)], "the folder holds 10.0 kB, more than the 10.0 kB a job's folder may hold"),
    ],
)
def test_a_plan_refuses_with_the_reason(entries, reason):
    with pytest.raises(folders.FolderError) as error:
        folders.plan(entries, **LIMITS)
    assert reason in str(error.value)


def test_a_plan_at_the_limits_is_taken():
    assert folders.plan([(f"p/{n}.py", 1_000) for n in range(10)], **LIMITS)[1]


def test_the_announced_files_are_read_as_objects_or_pairs():
    assert folder_uploads.parse_entries([{"path": "a", "size": 1}, ["b", 2]]) == [("a", 1), ("b", 2)]
    for bad in (None, "a.py", {"path": "a"}, [["a"]], ["a.py"]):
        with pytest.raises(folders.FolderError):
            folder_uploads.parse_entries(bad)


# The API ------------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def chunk_size(settings):
    settings.E31_UPLOAD_CHUNK_BYTES = CHUNK
    return CHUNK


@pytest.fixture(params=["local", "s3"])
def storage(request, storage_dir):
    if request.param == "local":
        return get_storage()
    return request.getfixturevalue("s3_storage")


class Api:
    """One persona's API client (its token)."""

    def __init__(self, user):
        self.client = Client()
        self.headers = {"HTTP_AUTHORIZATION": f"Token {Token.objects.create(user=user).key}"}

    def open(self, files):
        body = {"files": [{"path": path, "size": len(data) if isinstance(data, bytes) else data} for path, data in files.items()]}
        return self.client.post(reverse("api:folders"), json.dumps(body), content_type="application/json", **self.headers)

    def status(self, folder_id):
        return self.client.get(reverse("api:folder", args=[folder_id]), **self.headers)

    def file(self, folder_id, file_id):
        return self.client.get(reverse("api:folder-file", args=[folder_id, file_id]), **self.headers)

    def chunk(self, folder_id, file_id, offset, data):
        url = f"{reverse('api:folder-file', args=[folder_id, file_id])}?offset={offset}"
        return self.client.put(url, data, content_type="application/octet-stream", **self.headers)

    def abort(self, folder_id):
        return self.client.delete(reverse("api:folder", args=[folder_id]), **self.headers)

    def send(self, folder, files, skip=()):
        """Every file's chunks from where it has arrived; returns the folder's status."""
        for entry in folder["files"]:
            data = files[entry["path"]]
            for offset in range(entry["received"], len(data), entry["chunk_size"]):
                if (entry["path"], offset) in skip:
                    continue
                response = self.chunk(folder["id"], entry["id"], offset, data[offset : offset + entry["chunk_size"]])
                assert response.status_code == 200, response.json()
        return self.status(folder["id"]).json()


@pytest.fixture
def api(alice):
    return Api(alice)


@pytest.fixture
def outsider(charlie):
    return Api(charlie)


@pytest.fixture
def web(client, alice, rate):
    client.force_login(alice)
    return client


def post_form(client, **fields):
    data = {"gpus": "1", "mode": "span", "span_hours": "1", "data": SimpleUploadedFile("train.csv", b"x,y\n1,2\n"), **fields}
    return client.post(FORM, {k: v for k, v in data.items() if v is not None})


def errors_of(response):
    return {name: [str(e) for e in errs] for name, errs in response.context["form"].errors.items()}


def zip_of(upload):
    with get_storage().open(upload.key) as stream:
        archive = zipfile.ZipFile(io.BytesIO(stream.read()))
    return {name: archive.read(name) for name in archive.namelist()}


def by_path(folder):
    return {f["path"]: f for f in folder["files"]}


def project():
    return {
        "myproj/train.py": b"from pkg.model import fit\nprint(fit())\n",
        "myproj/pkg/__init__.py": b"",
        "myproj/pkg/model.py": b"def fit():\n    return 1\n",
        "myproj/weights.bin": payload(2 * CHUNK + 1234),
    }


def test_a_folder_goes_up_in_chunks_resumes_after_a_break_and_becomes_the_job_s_code(api, web, storage):
    files = project()
    opened = api.open({**files, "myproj/__pycache__/model.cpython-311.pyc": 77})
    assert opened.status_code == 201, opened.json()
    folder = opened.json()
    assert (folder["state"], folder["top"], folder["file_count"], folder["received"], folder["complete"]) == ("open", "myproj", 4, 0, False)
    assert sorted(by_path(folder)) == sorted(files)  # the skipped file is not asked for
    assert {f["chunk_size"] for f in folder["files"]} == {CHUNK}
    big = by_path(folder)["myproj/weights.bin"]

    # Everything but the weights' last two chunks, and then the connection drops.
    api.send(folder, files, skip={("myproj/weights.bin", CHUNK), ("myproj/weights.bin", 2 * CHUNK)})
    # Later (a reload, another day) the browser asks how far the folder got.
    status = api.status(folder["id"]).json()
    assert by_path(status)["myproj/weights.bin"]["received"] == CHUNK
    assert (status["files_arrived"], status["complete"], status["state"]) == (3, False, "open")
    assert status["received"] == sum(len(d) for d in files.values()) - (len(files["myproj/weights.bin"]) - CHUNK)
    assert api.file(folder["id"], big["id"]).json()["received"] == CHUNK
    # A chunk past what arrived is refused, with where to continue.
    gap = api.chunk(folder["id"], big["id"], 2 * CHUNK, files["myproj/weights.bin"][2 * CHUNK :])
    assert gap.status_code == 409 and gap.json()["received"] == CHUNK
    assert "send the chunk at 5242880" in gap.json()["detail"]
    misplaced = api.chunk(folder["id"], big["id"], 7, b"x")
    assert misplaced.status_code == 409 and misplaced.json()["received"] == CHUNK
    # A chunk sent again (its answer lost) replaces its part.
    assert api.chunk(folder["id"], big["id"], 0, files["myproj/weights.bin"][:CHUNK]).json()["received"] == CHUNK

    # The form sent too early is refused, and nothing that arrived is lost.
    response = post_form(web, entrypoint="train.py", code_folder_upload=folder["id"])
    assert response.status_code == 200 and not Job.objects.exists()
    [error] = errors_of(response)["code_folder"]
    assert error.startswith("The folder has not all arrived yet: 3 of 4 files, 5.2 MB of 10.5 MB")
    assert api.status(folder["id"]).json()["received"] == status["received"]
    assert not Upload.objects.filter(role=Upload.CODE).exists()

    # The rest, from where it stopped; then the form goes through with the folder's id alone.
    done = api.send(api.status(folder["id"]).json(), files)
    assert (done["complete"], done["files_arrived"], done["received"]) == (True, 4, sum(len(d) for d in files.values()))
    response = post_form(web, entrypoint="train.py", code_folder_upload=folder["id"])
    assert response.status_code == 302, errors_of(response)
    job = Job.objects.get()
    code = job.uploads.get(role=Upload.CODE)
    assert (code.name, job.entrypoint) == ("myproj.zip", "train.py")
    assert zip_of(code) == {path.removeprefix("myproj/"): data for path, data in files.items()}
    packed = api.status(folder["id"]).json()
    assert (packed["state"], packed["packed_as"], packed["complete"]) == ("packed", "myproj.zip", True)
    # The zip holds the bytes now: the files' own storage is freed.
    for row in DatasetUpload.objects.filter(folder_id=folder["id"]):
        assert not storage.exists(row.key)
    if storage.kind == "local":
        assert not any((storage.root / ".multipart").iterdir())


def test_a_refused_form_keeps_the_packed_folder_and_its_id_answers_it_again(api, web):
    files = project()
    folder = api.open(files).json()
    api.send(folder, files)
    response = post_form(web, gpus="0", entrypoint="train.py", code_folder_upload=folder["id"])
    assert "Ask for at least 1 GPU." in errors_of(response)["gpus"]
    kept = Upload.objects.get(job__isnull=True, role=Upload.CODE)
    page = response.content.decode()
    assert "myproj.zip" in page and f'name="kept_code" value="{kept.pk}" checked' in page
    # The fixed form: by the kept zip, as any kept upload; or by the folder again (the page
    # sends its id when the same folder is chosen again): the same zip, not packed twice.
    response = post_form(web, entrypoint="train.py", code_folder_upload=folder["id"])
    assert response.status_code == 302, errors_of(response)
    assert Job.objects.get().uploads.get(role=Upload.CODE) == kept
    # A second job from the same folder gets the same bytes (a row of its own, the blob shared).
    response = post_form(web, entrypoint="train.py", code_folder_upload=folder["id"])
    assert response.status_code == 302, errors_of(response)
    second = Job.objects.order_by("-created_at").first().uploads.get(role=Upload.CODE)
    assert second != kept and (second.key, second.name) == (kept.key, kept.name)


def test_a_folder_and_files_or_a_script_together_are_refused(api, web):
    files = project()
    folder = api.open(files).json()
    api.send(folder, files)
    script = SimpleUploadedFile("other.py", b"")
    response = post_form(web, entrypoint="train.py", code=script, code_folder_upload=folder["id"])
    assert errors_of(response)["code_folder"] == ["Send a script or an archive, or a folder, not both."]
    response = post_form(web, entrypoint="train.py", code_folder_upload=folder["id"], code_folder=[SimpleUploadedFile("a.py", b"")], code_paths=["p/a.py"])
    assert errors_of(response)["code_folder"][0].startswith("Send the folder once")
    assert not Job.objects.exists() and FolderUpload.objects.get().state == "open"


@pytest.mark.parametrize(
    "files,reason",
    [
        ({"myproj/train.py": 1, "../evil.py": 1}, "points outside the folder ('..')"),
        ({"myproj/train.py": 1, "/etc/cron.d/evil": 1}, "is absolute"),
        ({"myproj/train.py": -1}, "must be its size in bytes"),
        ({"myproj/train.py": 1, "myproj/big.bin": 3000}, "more than the 2.0 kB a job's folder may hold"),
        ({f"p/{n}.py": 1 for n in range(4)}, "the folder has 4 files, more than the 3 an archive may hold"),
    ],
)
def test_a_folder_that_may_not_be_sent_is_refused_before_a_byte(api, settings, files, reason):
    settings.E31_ARCHIVE_MAX_BYTES, settings.E31_ARCHIVE_MAX_ENTRIES = 2048, 3
    response = api.open(files)
    assert response.status_code == 400
    assert response.json()["detail"].startswith("The folder was not accepted: ") and reason in response.json()["detail"]
    assert not FolderUpload.objects.exists() and not DatasetUpload.objects.exists()


@pytest.mark.parametrize("body", [{}, {"files": "train.py"}, {"files": [{"path": "a.py"}]}, {"files": [["a.py"]]}, {"files": []}])
def test_a_malformed_announcement_is_a_400_with_a_reason(api, body):
    response = api.client.post(reverse("api:folders"), json.dumps(body), content_type="application/json", **api.headers)
    assert response.status_code == 400 and response.json()["detail"].startswith("The folder was not accepted: ")


def test_a_chunk_that_does_not_fit_is_refused_with_a_reason(api):
    files = {"p/a.bin": payload(CHUNK + 10)}
    folder = api.open(files).json()
    entry = folder["files"][0]
    short = api.chunk(folder["id"], entry["id"], 0, b"abc")
    assert short.status_code == 400 and "every chunk but the last must have 5242880" in short.json()["detail"]
    url = reverse("api:folder-file", args=[folder["id"], entry["id"]])
    missing = api.client.put(url, b"abc", content_type="application/octet-stream", **api.headers)
    assert missing.status_code == 400 and missing.json() == {"detail": "Give the chunk's offset in bytes: ?offset=N.", "received": 0}


def test_a_folder_given_up_takes_no_chunk_and_no_form(api, web):
    files = project()
    folder = api.open(files).json()
    api.send(folder, files, skip={("myproj/weights.bin", CHUNK), ("myproj/weights.bin", 2 * CHUNK)})
    aborted = api.abort(folder["id"])
    assert aborted.status_code == 200 and aborted.json()["state"] == "aborted"
    big = by_path(folder)["myproj/weights.bin"]
    late = api.chunk(folder["id"], big["id"], CHUNK, files["myproj/weights.bin"][CHUNK : 2 * CHUNK])
    assert late.status_code == 409 and "received" not in late.json()  # nowhere to continue
    response = post_form(web, entrypoint="train.py", code_folder_upload=folder["id"])
    assert "The folder's upload was given up (given up by its client): choose the folder again." in errors_of(response)["code_folder"]
    for row in DatasetUpload.objects.filter(folder_id=folder["id"]):
        assert row.state == "aborted" and not get_storage().exists(row.key)


def test_what_arrived_that_cannot_be_packed_gives_the_folder_up_with_the_reason(api, web, settings):
    files = project()
    folder = api.open(files).json()
    api.send(folder, files)
    settings.E31_ARCHIVE_MAX_BYTES = 1024 * 1024  # lowered since the folder was announced
    response = post_form(web, entrypoint="train.py", code_folder_upload=folder["id"])
    [error] = errors_of(response)["code_folder"]
    assert error.startswith("The folder was not packed: the folder holds at least") and "choose it again" in error
    assert FolderUpload.objects.get().state == "aborted" and not Upload.objects.filter(role=Upload.CODE).exists()


# Teams ---------------------------------------------------------------------------------------------


def test_another_team_can_neither_see_nor_send_to_nor_use_a_folder(api, outsider, web, charlie, rate):
    files = project()
    folder = api.open(files).json()
    api.send(folder, files, skip={("myproj/weights.bin", CHUNK), ("myproj/weights.bin", 2 * CHUNK)})
    big = by_path(folder)["myproj/weights.bin"]
    before = api.status(folder["id"]).json()

    assert outsider.status(folder["id"]).status_code == 404
    assert outsider.file(folder["id"], big["id"]).status_code == 404
    assert outsider.chunk(folder["id"], big["id"], CHUNK, files["myproj/weights.bin"][CHUNK : 2 * CHUNK]).status_code == 404
    assert outsider.chunk(folder["id"], big["id"], 0, b"\0" * CHUNK).status_code == 404  # nor overwrite what arrived
    assert outsider.abort(folder["id"]).status_code == 404
    # Nor through a folder of its own: a file is found only under its own folder.
    theirs = outsider.open({"q/a.py": b"x"}).json()
    assert outsider.chunk(theirs["id"], big["id"], CHUNK, files["myproj/weights.bin"][CHUNK : 2 * CHUNK]).status_code == 404
    # Nor name it in a job form of its own.
    other = Client()
    other.force_login(charlie)
    response = post_form(other, entrypoint="train.py", code_folder_upload=folder["id"])
    assert errors_of(response)["code_folder"][0].startswith("The folder's upload was not found")
    assert not Job.objects.exists() and not Upload.objects.filter(role=Upload.CODE).exists()
    # Nor reach a folder's file as a dataset's upload (nobody can: it is not one).
    assert api.client.get(reverse("api:dataset-upload", args=[big["id"]]), **api.headers).status_code == 404

    assert api.status(folder["id"]).json() == before  # untouched
    asked = AuditEvent.objects.filter(action="object.foreign", object_id=folder["id"])
    assert asked.count() >= 5 and {e.team_id for e in asked} == {folder_team(folder)}


def folder_team(folder):
    return FolderUpload.objects.get(pk=folder["id"]).team_id


# The API's job submission ----------------------------------------------------------------------------


def test_the_api_submits_a_job_with_a_folder_uploaded_ahead(api, alice, rate, dataset):
    files = project()
    folder = api.open(files).json()
    api.send(folder, files)
    spec = {"gpus": 1, "span_hours": 1, "entrypoint": "train.py", "train_dataset": "numbers"}
    refused = api.client.post(reverse("api:jobs"), {"spec": json.dumps({**spec, "gpus": 0}), "code_folder_upload": folder["id"]}, **api.headers)
    assert refused.status_code == 400
    # A refused spec keeps nothing half-made, but the folder's zip is the folder's: still there.
    response = api.client.post(reverse("api:jobs"), {"spec": json.dumps(spec), "code_folder_upload": folder["id"]}, **api.headers)
    assert response.status_code == 201, response.json()
    code = Job.objects.get().uploads.get(role=Upload.CODE)
    assert sorted(zip_of(code)) == ["pkg/__init__.py", "pkg/model.py", "train.py", "weights.bin"]
    assert Upload.objects.filter(role=Upload.CODE).count() == 1  # packed once


# The sweep of abandoned uploads ---------------------------------------------------------------------


def test_a_folder_no_chunk_reached_for_too_long_is_given_up_by_the_sweep(api, storage_dir):
    files = project()
    stale = api.open(files).json()
    api.send(stale, files, skip={("myproj/weights.bin", CHUNK), ("myproj/weights.bin", 2 * CHUNK)})
    busy = api.open(files).json()
    api.send(busy, files, skip={("myproj/weights.bin", CHUNK), ("myproj/weights.bin", 2 * CHUNK)})
    long_ago = timezone.now() - timezone.timedelta(days=3)
    FolderUpload.objects.filter(pk=stale["id"]).update(updated_at=long_ago)
    # In the busy folder a file waits its turn (no chunk of its own for days) while the others
    # are sent: the folder's clock is what counts.
    DatasetUpload.objects.filter(folder_id=busy["id"]).update(updated_at=long_ago)
    keys = list(DatasetUpload.objects.filter(folder_id=stale["id"]).values_list("key", "multipart_id"))

    assert folder_uploads.purge_stale_uploads(timezone.now() - timezone.timedelta(days=2)) == 4
    assert not FolderUpload.objects.filter(pk=stale["id"]).exists()
    assert not DatasetUpload.objects.filter(folder_id=stale["id"]).exists()
    storage = get_storage()
    for key, multipart_id in keys:
        assert not storage.exists(key) and not (multipart_id and (storage.root / ".multipart" / multipart_id).exists())
    assert api.status(busy["id"]).json()["state"] == "open"
    assert set(DatasetUpload.objects.filter(folder_id=busy["id"]).values_list("state", flat=True)) == {"open"}
    assert api.status(stale["id"]).status_code == 404
