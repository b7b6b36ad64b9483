"""Completing a large dataset upload outside the HTTP request.

Joining and hashing a file of gigabytes outlasts an HTTP request, so the request only checks
what it can at once (the state, every byte arrived, the SHA-256) and queues the completion: a
file up to E31_UPLOAD_INLINE_COMPLETE_BYTES is completed within the request as before (200), a
larger one answers 202 "completing" and the scheduler's worker finishes it (claim_completions,
finish_completion) while the client polls. The joined object is read once: its SHA-256 is the
check, and the blob is made from those bytes inside the store (a copy in S3, a hard link in the
local folder). Each runs on the local folder and on a real S3 (SeaweedFS).
"""

import hashlib
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from django.core.management import call_command
from django.urls import reverse
from django.utils import timezone

from catalog import datasets
from catalog.models import DatasetUpload
from core.storage import NotFound, blob_key, get_storage
from tests.test_datasets import CHUNK, Api, make_dataset, payload, sha

BIG = CHUNK + 1234  # over the lowered inline limit: completed by the worker


@pytest.fixture(autouse=True)
def small_limits(settings):
    settings.E31_UPLOAD_CHUNK_BYTES = CHUNK
    settings.E31_UPLOAD_INLINE_COMPLETE_BYTES = CHUNK


@pytest.fixture(params=["local", "s3"])
def storage(request, storage_dir):
    if request.param == "local":
        return get_storage()
    return request.getfixturevalue("s3_storage")


@pytest.fixture
def api(alice):
    return Api(alice)


def sent(api, dataset, path, data, **extra):
    """An upload with every chunk arrived, not completed yet: its JSON."""
    upload = api.start(dataset, path, len(data), **extra).json()
    for offset in range(0, len(data), CHUNK):
        assert api.chunk(upload["id"], offset, data[offset : offset + CHUNK]).status_code == 200
    return upload


def upload_url(upload_id):
    return reverse("api:dataset-upload", args=[upload_id])


def test_only_files_over_the_limit_leave_the_request():
    assert datasets.completes_inline(0, 0)
    assert datasets.completes_inline(64, 64)
    assert not datasets.completes_inline(65, 64)


def test_a_large_file_is_accepted_then_completed_by_the_worker(api, team_a, storage):
    data = payload(BIG, seed=7)
    dataset = make_dataset(team_a)
    upload = sent(api, dataset, "train/big.bin", data)
    response = api.complete(upload["id"])
    assert response.status_code == 202
    body = response.json()
    assert (body["state"], body["received"]) == ("completing", len(data))
    assert response["Location"] == body["url"] and body["url"].endswith(upload_url(upload["id"]))
    # Asked again (a lost answer), it is the same queued completion.
    again = api.complete(upload["id"])
    assert (again.status_code, again.json()["state"]) == (202, "completing")
    assert api.get(upload_url(upload["id"])).json()["state"] == "completing"
    # The version cannot be sealed while the file is completing.
    refused = api.seal(dataset)
    assert refused.status_code == 409
    assert refused.json()["detail"] == "1 upload(s) are not finished: train/big.bin; complete or abort them first."

    [claimed] = datasets.claim_completions(limit=5)
    assert claimed.pk == DatasetUpload.objects.get(pk=upload["id"]).pk
    assert datasets.claim_completions(limit=5) == []  # never taken twice
    done = datasets.finish_completion(claimed)
    assert (done.state, done.sha256) == ("complete", sha(data))

    status = api.get(upload_url(upload["id"])).json()
    assert (status["state"], status["sha256"]) == ("complete", sha(data))
    assert api.manifest(dataset).json()["manifest"] == [{"path": "train/big.bin", "size": len(data), "sha256": sha(data)}]
    assert storage.open(blob_key(sha(data))).read() == data
    assert not storage.exists(f"incoming/{upload['id']}")
    assert api.seal(dataset).json()["state"] == "ready"
    assert api.complete(upload["id"]).status_code == 200  # completed: just the upload again


def test_a_small_file_is_still_completed_in_the_request(api, team_a, storage):
    dataset = make_dataset(team_a)
    upload = sent(api, dataset, "small.bin", b"tiny")
    response = api.complete(upload["id"])
    assert (response.status_code, response.json()["state"], response.json()["sha256"]) == (200, "complete", sha(b"tiny"))
    assert datasets.claim_completions(limit=5) == []


def test_bytes_that_are_not_the_announced_ones_fail_with_the_reason(api, team_a, storage):
    data = payload(BIG, seed=8)
    wrong = sha(b"something else")
    dataset = make_dataset(team_a)
    upload = sent(api, dataset, "bad.bin", data, sha256=wrong)
    assert api.complete(upload["id"]).status_code == 202
    [claimed] = datasets.claim_completions()
    with pytest.raises(datasets.DatasetError, match="the bytes changed on the way"):
        datasets.finish_completion(claimed)
    status = api.get(upload_url(upload["id"])).json()
    assert status["state"] == "failed"
    assert status["error"] == f"bad.bin: its SHA-256 is {sha(data)}, not the {wrong} given: the bytes changed on the way; upload it again"
    assert not storage.exists(f"incoming/{upload['id']}")
    assert not storage.exists(blob_key(sha(data)))
    assert api.manifest(dataset).json()["manifest"] == []


def test_a_sha256_given_at_completion_is_checked_by_the_worker(api, team_a, storage_dir):
    data = payload(BIG, seed=9)
    dataset = make_dataset(team_a)
    upload = sent(api, dataset, "late.bin", data)
    assert api.complete(upload["id"], sha256="0" * 64).status_code == 202
    [claimed] = datasets.claim_completions()
    with pytest.raises(datasets.DatasetError, match=f"its SHA-256 is {sha(data)}, not the {'0' * 64} given"):
        datasets.finish_completion(claimed)
    assert DatasetUpload.objects.get(pk=upload["id"]).state == "failed"


def test_storage_trouble_in_the_worker_opens_the_upload_again(api, team_a, storage_dir, monkeypatch):
    data = payload(BIG, seed=10)
    dataset = make_dataset(team_a)
    upload = sent(api, dataset, "a.bin", data)
    api.complete(upload["id"])
    storage = get_storage()
    real_copy = storage.copy
    monkeypatch.setattr(storage, "copy", lambda src, dst: (_ for _ in ()).throw(OSError("disk full")))
    [claimed] = datasets.claim_completions()
    with pytest.raises(OSError):
        datasets.finish_completion(claimed)
    status = api.get(upload_url(upload["id"])).json()
    assert (status["state"], status["received"]) == ("open", len(data))
    assert status["error"] == "storage failed while completing it: complete it again"
    monkeypatch.setattr(storage, "copy", real_copy)
    # Completed again: queued again (error cleared), and the joined object is found, not joined twice.
    again = api.complete(upload["id"]).json()
    assert (again["state"], again["error"]) == ("completing", "")
    [claimed] = datasets.claim_completions()
    assert datasets.finish_completion(claimed).sha256 == sha(data)


def test_a_stale_claim_is_released_and_taken_again(team_a, storage_dir):
    dataset = make_dataset(team_a)
    version = dataset.versions.get()
    uploads = {}
    for name in ("stale", "busy", "queued"):
        upload = datasets.start_upload(version, f"{name}.bin", 3)
        datasets.put_chunk(upload, 0, b"abc")
        uploads[name] = upload
    long_ago = timezone.now() - timezone.timedelta(days=3)
    # stale: its worker died two hours ago; busy: a worker took it ten minutes ago; queued: no
    # worker has taken it yet, for days (the scheduler was down).
    DatasetUpload.objects.filter(pk=uploads["stale"].pk).update(
        state="completing", claimed_at=timezone.now() - timezone.timedelta(hours=2), updated_at=long_ago
    )
    DatasetUpload.objects.filter(pk=uploads["busy"].pk).update(
        state="completing", claimed_at=timezone.now() - timezone.timedelta(minutes=10), updated_at=long_ago
    )
    DatasetUpload.objects.filter(pk=uploads["queued"].pk).update(state="completing", claimed_at=None, updated_at=long_ago)

    assert datasets.purge_stale_uploads(timezone.now() - timezone.timedelta(days=2)) == 0  # none aborted nor reopened
    states = {name: DatasetUpload.objects.get(pk=u.pk) for name, u in uploads.items()}
    assert {name: u.state for name, u in states.items()} == {"stale": "completing", "busy": "completing", "queued": "completing"}
    assert states["stale"].claimed_at is None
    assert states["busy"].claimed_at is not None

    claimed = datasets.claim_completions(limit=5)
    assert sorted(u.path for u in claimed) == ["queued.bin", "stale.bin"]
    for upload in claimed:
        assert datasets.finish_completion(upload).state == "complete"
    assert sorted(version.files.values_list("path", flat=True)) == ["queued.bin", "stale.bin"]


def test_a_long_read_renews_its_claim(team_a, storage_dir, monkeypatch):
    """A worker still reading keeps its claim fresh: it is not taken for a dead one."""
    monkeypatch.setattr(datasets, "CLAIM_RENEW_SECONDS", 0)
    dataset = make_dataset(team_a)
    upload = datasets.start_upload(dataset.versions.get(), "a.bin", 3)
    datasets.put_chunk(upload, 0, b"abc")
    two_hours_ago = timezone.now() - timezone.timedelta(hours=2)
    DatasetUpload.objects.filter(pk=upload.pk).update(state="completing", claimed_at=two_hours_ago)
    renew = datasets._claim_renewer(upload)
    renew()
    assert DatasetUpload.objects.get(pk=upload.pk).claimed_at > two_hours_ago


def test_the_joined_file_is_read_once(api, team_a, storage, monkeypatch):
    data = payload(BIG, seed=11)
    dataset = make_dataset(team_a)
    upload = sent(api, dataset, "once.bin", data)
    opened = []
    real_open = storage.open
    monkeypatch.setattr(storage, "open", lambda key: opened.append(key) or real_open(key))
    api.complete(upload["id"])
    datasets.finish_completion(datasets.claim_completions()[0])
    assert opened == [f"incoming/{upload['id']}"]
    assert storage.open(blob_key(sha(data))).read() == data


def test_the_local_blob_is_a_link_to_the_joined_file(storage_dir):
    storage = get_storage()
    storage.save("incoming/x", io.BytesIO(b"joined bytes"))
    storage.copy("incoming/x", "blobs/sha256/ab/x")
    src, dest = storage.path("incoming/x"), storage.path("blobs/sha256/ab/x")
    assert dest.read_bytes() == b"joined bytes" and dest.stat().st_ino == src.stat().st_ino
    storage.delete("incoming/x")
    assert storage.open("blobs/sha256/ab/x").read() == b"joined bytes"
    with pytest.raises(NotFound):
        storage.copy("incoming/missing", "blobs/y")


@pytest.mark.parametrize("multipart", [False, True], ids=["copy-object", "upload-part-copy"])
def test_s3_copies_inside_the_store(s3_storage, monkeypatch, multipart):
    """Up to COPY_LIMIT one CopyObject, above it a copy in parts (UploadPartCopy): the limits
    are lowered here so a 12 MiB object takes the second way in three parts."""
    storage = s3_storage
    data = payload(2 * CHUNK + 2 * 1024 * 1024, seed=12)
    storage.save("incoming/big", io.BytesIO(data))
    if multipart:
        monkeypatch.setattr(storage, "COPY_LIMIT", CHUNK)
        monkeypatch.setattr(storage, "COPY_PART_BYTES", CHUNK)
    storage.copy("incoming/big", blob_key(sha(data)))
    assert storage.open(blob_key(sha(data))).read() == data
    head = storage.client.head_object(Bucket=storage.bucket, Key=storage._key(blob_key(sha(data))))
    # A copy in parts has a multipart ETag ("...-3"); CopyObject's has none.
    assert head["ETag"].strip('"').endswith("-3") == multipart


@pytest.mark.django_db(transaction=True)
def test_the_scheduler_completes_queued_uploads(alice, team_a, storage_dir):
    api = Api(alice)
    data = payload(BIG, seed=13)
    dataset = make_dataset(team_a)
    upload = sent(api, dataset, "worker.bin", data)
    assert api.complete(upload["id"]).status_code == 202
    call_command("scheduler", "--once")  # claims it, and waits for its worker
    status = api.get(upload_url(upload["id"])).json()
    assert (status["state"], status["sha256"]) == ("complete", sha(data))
    assert DatasetUpload.objects.get(pk=upload["id"]).claimed_at is not None


# In a real browser -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def system():
    """The web server and the scheduler (its worker completes the large file), 5 MiB chunks
    and files over 6 MiB completed by the worker."""
    from tests.system import LiveSystem

    live = LiveSystem(env={"E31_UPLOAD_CHUNK_BYTES": str(CHUNK), "E31_UPLOAD_INLINE_COMPLETE_BYTES": str(6 * 1024 * 1024)})
    try:
        live.start(runner=False)
        yield live
    finally:
        live.stop()


@pytest.mark.browser
@pytest.mark.timeout(300)
def test_a_large_file_shows_verifying_then_done(page, tmp_path):
    from playwright.sync_api import expect

    from tests.browser import log_in, shot
    from tests.test_browser_datasets import new_dataset, watch_progress

    big = tmp_path / "big.bin"
    big.write_bytes(payload(12 * 1024 * 1024, seed=14))  # over 6 MiB: the worker's
    small = tmp_path / "small.csv"
    small.write_bytes(b"a,b\n1,2\n")  # completed within the request
    log_in(page)
    new_dataset(page, "verified-set")
    page.set_input_files("#upload-files", [big, small])
    watch_progress(page)
    answers = []
    page.on("response", lambda r: answers.append(r.status) if r.url.endswith("/complete/") else None)
    page.get_by_role("button", name="Upload and seal").click()
    expect(page.locator(".upload-file[data-path='big.bin'] .status")).to_have_text("verifying…", timeout=60_000)
    expect(page.locator("#upload-done")).to_contain_text("Version 1 is sealed: 2 files", timeout=60_000)
    expect(page.locator(".upload-file[data-path='big.bin'] .status")).to_have_text("done")
    expect(page.locator("#overall-text")).to_contain_text("(100%) · 2 of 2 files done")
    assert sorted(answers) == [200, 202]
    seen = page.evaluate("window.__seen")
    assert "verifying…" in seen, seen
    # The overall bar reached 100% only with both files complete.
    overall = [text for text in seen if re.search(r"\(\d+%\) · \d of 2 files", text)]
    assert all("2 of 2 files done" in text for text in overall if "(100%)" in text), overall
    assert any("(99%) · 1 of 2 files done" in text for text in overall), overall
    shot(page, "dataset-upload-verified.png")
    page.get_by_role("link", name="View the dataset").click()
    row = page.locator("#manifest tbody tr", has=page.locator("td.path", has_text="big.bin"))
    expect(row.locator("td.sha")).to_have_text(hashlib.sha256(big.read_bytes()).hexdigest())


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_the_cli_waits_for_a_large_file(system, tmp_path):
    folder = tmp_path / "shards"
    folder.mkdir()
    (folder / "big.bin").write_bytes(payload(12 * 1024 * 1024, seed=15))  # completed by the worker
    (folder / "notes.txt").write_text("one large file and a note\n")
    local = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir()}
    env = {**os.environ, "E31_SERVER": system.url, "E31_TOKEN": system.token, "E31_CONFIG_DIR": str(tmp_path / "config")}
    env.pop("E31_CLI_STOP_AFTER_CHUNKS", None)
    command = [str(Path(sys.executable).with_name("e31"))]
    if not Path(command[0]).exists():
        command = [sys.executable, "-m", "e31.cli"]
    done = subprocess.run(
        [*command, "datasets", "upload", str(folder), "--name", "cli-verified", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,
        check=False,
    )
    assert done.returncode == 0, (done.stdout, done.stderr)
    result = json.loads(done.stdout)
    assert (result["state"], result["ref"]) == ("ready", "cli-verified@1")
    assert {f["path"]: f["sha256"] for f in result["manifest"]} == local
