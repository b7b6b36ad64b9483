"""The blob sweep: blobs that no row refers to any more are freed once they are old.

The decision is a pure function, tested on plain data. The sweep itself runs on both storage
backends (the local folder and a real SeaweedFS). Blobs are made "old" by sweeping as if later
(a `now` past the grace period) rather than by waiting; where a test needs storage's clock to
move (S3 keeps last-modified times to the second), it waits for the next second.
"""

import hashlib
import io
import time
from datetime import UTC, datetime, timedelta

import pytest
from django.core.management import CommandError, call_command
from django.utils import timezone

from catalog import datasets
from catalog.models import DatasetUpload
from core.storage import NotFound, blob_key, get_storage
from jobs.models import Artifact, JobModel, Upload
from jobs.sweep import decide, sweep
from tests.conftest import make_job, upload

GRACE = timedelta(hours=24)
T0 = datetime(2030, 1, 1, tzinfo=UTC)


def sha(data):
    return hashlib.sha256(data).hexdigest()


@pytest.fixture(params=["local", "s3"])
def storage(request, storage_dir):
    if request.param == "local":
        return get_storage()
    return request.getfixturevalue("s3_storage")


def when_all_old(storage):
    """A moment at which every blob kept now is past the grace period."""
    return max(modified for _, _, modified in storage.list_blobs()) + GRACE + timedelta(seconds=1)


def wait_past(storage, moment):
    """Until storage's clock has moved past moment (S3 keeps last-modified to the second)."""
    step = timedelta(seconds=1) if storage.kind == "s3" else timedelta(milliseconds=20)
    while timezone.now() < moment + step:
        time.sleep(0.05)


# The decision, on plain data ------------------------------------------------------------------


def test_an_unreferenced_blob_older_than_the_grace_period_is_doomed():
    plan = decide([("blobs/a", 10, T0 - GRACE - timedelta(seconds=1))], set(), T0, GRACE)
    assert plan.doomed == {"blobs/a": 10} and plan.doomed_bytes == 10


def test_a_referenced_blob_is_kept_however_old():
    plan = decide([("blobs/a", 10, T0 - timedelta(days=365))], {"blobs/a"}, T0, GRACE)
    assert plan.doomed == {} and plan.referenced == 1


def test_a_young_unreferenced_blob_is_kept():
    blobs = [("blobs/a", 10, T0 - timedelta(hours=1)), ("blobs/b", 5, T0 - GRACE)]  # b: exactly the grace period
    plan = decide(blobs, set(), T0, GRACE)
    assert plan.doomed == {} and plan.young == 2


def test_the_plan_counts_what_it_saw():
    blobs = [
        ("blobs/kept", 1, T0 - timedelta(days=9)),
        ("blobs/young", 20, T0),
        ("blobs/old", 300, T0 - timedelta(days=2)),
        ("blobs/older", 4000, T0 - timedelta(days=3)),
    ]
    plan = decide(blobs, {"blobs/kept", "jobs/x/model.pt"}, T0, GRACE)
    assert (plan.seen, plan.seen_bytes, plan.referenced, plan.young) == (4, 4321, 1, 1)
    assert plan.doomed == {"blobs/old": 300, "blobs/older": 4000} and plan.doomed_bytes == 4300


# The storage's part: listing, ages, touching ------------------------------------------------------


def test_blobs_are_listed_with_their_size_and_age(storage):
    key, _, _ = storage.save_blob(io.BytesIO(b"twelve bytes"))
    storage.save("jobs/j/model.pt", io.BytesIO(b"not a blob"))
    listed = list(storage.list_blobs())
    assert [(k, size) for k, size, _ in listed] == [(key, 12)]
    modified = listed[0][2]
    assert modified.tzinfo is not None and abs(timezone.now() - modified) < timedelta(minutes=1)
    assert storage.last_modified(key) == modified


def test_touching_a_blob_makes_it_young(storage):
    key, _, _ = storage.save_blob(io.BytesIO(b"bytes"))
    before = storage.last_modified(key)
    wait_past(storage, before)
    storage.touch(key)
    assert storage.last_modified(key) > before
    assert storage.open(key).read() == b"bytes"
    with pytest.raises(NotFound):
        storage.touch(blob_key(sha(b"never kept")))


def test_touching_an_object_too_large_for_one_copy_copies_it_in_parts(s3_storage):
    key, _, _ = s3_storage.save_blob(io.BytesIO(b"w" * 1000))
    before = s3_storage.last_modified(key)
    wait_past(s3_storage, before)
    s3_storage.COPY_LIMIT = 100  # this instance only: as if the blob were over 5 GiB
    try:
        s3_storage.touch(key)
    finally:
        del s3_storage.COPY_LIMIT
    assert s3_storage.last_modified(key) > before
    assert s3_storage.open(key).read() == b"w" * 1000


# The sweep ---------------------------------------------------------------------------------------


def test_an_unreferenced_old_blob_is_deleted(storage, db):
    key, _, _ = storage.save_blob(io.BytesIO(b"nobody's"))
    summary = sweep(now=when_all_old(storage), grace=GRACE)
    assert not storage.exists(key)
    assert (summary["seen"], summary["deleted"], summary["freed_bytes"], summary["skipped"]) == (1, 1, 8, 0)


def _refer(kind, team, user, key, data):
    """A row of the given kind that refers to the blob key."""
    if kind == "upload":
        return upload(team, user, Upload.TRAIN, "train.csv", data)
    if kind == "dataset":
        return datasets.create_dataset(team, "numbers", {"numbers.csv": data})
    job = make_job(user)
    files = [{"name": "model.pt", "key": key, "size": len(data), "sha256": sha(data)}]
    if kind == "model":
        return JobModel.objects.create(job=job, label="start", files=files)
    return Artifact.objects.create(job=job, name="model.pt", key=key, size=len(data), sha256=sha(data))


@pytest.mark.parametrize("kind", ["upload", "dataset", "model", "artifact"])
def test_a_referenced_blob_stays_and_goes_with_its_row(storage, alice, kind):
    data = f"the {kind}'s bytes".encode()
    key, _, _ = storage.save_blob(io.BytesIO(data))
    row = _refer(kind, alice.membership.team, alice, key, data)
    later = when_all_old(storage)
    summary = sweep(now=later, grace=GRACE)
    assert storage.exists(key) and summary["deleted"] == 0
    row.delete()
    sweep(now=later, grace=GRACE)
    assert not storage.exists(key)


def test_a_shared_blob_stays_until_its_last_row_goes(storage, alice):
    team = alice.membership.team
    first = upload(team, alice, Upload.CODE, "a.py", b"shared")
    second = upload(team, alice, Upload.CODE, "b.py", b"shared")
    later = when_all_old(storage)
    first.delete()
    sweep(now=later, grace=GRACE)
    assert storage.exists(second.key)
    second.delete()
    sweep(now=later, grace=GRACE)
    assert not storage.exists(second.key)


def test_a_registered_buckets_keys_do_not_keep_our_blobs(storage, alice):
    """A registered dataset's keys name objects in the team's bucket: one that happens to read
    like a blob key of ours keeps nothing here."""
    key, _, _ = storage.save_blob(io.BytesIO(b"ours"))
    dataset = datasets.register_s3(alice.membership.team, "theirs", "s3://their-bucket/data", "AKIDEXAMPLE", "secret")
    dataset.versions.get().add_file("x.bin", 4, sha(b"ours"), key)
    sweep(now=when_all_old(storage), grace=GRACE)
    assert not storage.exists(key)


def test_a_young_unreferenced_blob_stays(storage, db):
    key, _, _ = storage.save_blob(io.BytesIO(b"just written"))
    summary = sweep(grace=GRACE)
    assert storage.exists(key) and (summary["young"], summary["deleted"]) == (1, 0)


def test_a_blob_kept_again_through_save_blob_is_young_again(storage, db):
    """The dedup path touches the blob: a new row is about to refer to it."""
    reused, _, _ = storage.save_blob(io.BytesIO(b"reused"))
    forgotten, _, _ = storage.save_blob(io.BytesIO(b"forgotten"))
    first = max(storage.last_modified(reused), storage.last_modified(forgotten))
    wait_past(storage, first)
    assert storage.save_blob(io.BytesIO(b"reused"))[0] == reused
    touched = storage.last_modified(reused)
    assert touched > first
    # Swept when everything written at first is past the grace period, the touched one not.
    summary = sweep(now=touched + GRACE, grace=GRACE)
    assert storage.exists(reused) and not storage.exists(forgotten)
    assert (summary["young"], summary["deleted"]) == (1, 1)


def test_a_blob_used_again_after_the_listing_is_skipped(storage, db):
    """The listing may be old by the time a blob's turn comes: its age is read again first."""
    key, _, _ = storage.save_blob(io.BytesIO(b"about to be used"))
    modified = storage.last_modified(key)

    class StaleListing:
        def __init__(self, inner):
            self.inner = inner

        def list_blobs(self):
            return [(k, size, modified - timedelta(days=30)) for k, size, _ in self.inner.list_blobs()]

        def __getattr__(self, name):
            return getattr(self.inner, name)

    summary = sweep(now=modified + GRACE, grace=GRACE, storage=StaleListing(storage))
    assert storage.exists(key) and (summary["skipped"], summary["deleted"]) == (1, 0)


def test_completing_an_upload_of_bytes_kept_already_touches_their_blob(storage, alice):
    data = b"already here"
    key, _, _ = storage.save_blob(io.BytesIO(data))
    before = storage.last_modified(key)
    wait_past(storage, before)
    dataset = datasets.create_upload_dataset(alice.membership.team, "again")
    version, _ = datasets.open_version(dataset)
    done = datasets.complete_upload(datasets.put_chunk(datasets.start_upload(version, "a.txt", len(data)), 0, data))
    assert done.state == DatasetUpload.COMPLETE
    assert storage.last_modified(key) > before


def test_the_blob_an_unfinished_upload_announced_stays(storage, alice):
    data = b"on its way"
    key, _, _ = storage.save_blob(io.BytesIO(data))
    dataset = datasets.create_upload_dataset(alice.membership.team, "incoming")
    version, _ = datasets.open_version(dataset)
    datasets.start_upload(version, "a.txt", len(data), sha256=sha(data))
    sweep(now=when_all_old(storage), grace=GRACE)
    assert storage.exists(key)


def test_a_dry_run_deletes_nothing(storage, db):
    key, _, _ = storage.save_blob(io.BytesIO(b"nobody's"))
    summary = sweep(dry_run=True, now=when_all_old(storage), grace=GRACE)
    assert storage.exists(key)
    assert (summary["unreferenced_old"], summary["unreferenced_old_bytes"], summary["deleted"]) == (1, 8, 0)


def test_the_grace_period_comes_from_the_settings(storage, db, settings):
    key, _, _ = storage.save_blob(io.BytesIO(b"nobody's"))
    now = storage.last_modified(key) + timedelta(hours=3)
    settings.E31_BLOB_SWEEP_GRACE_HOURS = 4
    sweep(now=now)
    assert storage.exists(key)
    settings.E31_BLOB_SWEEP_GRACE_HOURS = 2
    sweep(now=now)
    assert not storage.exists(key)


# The command and the scheduler --------------------------------------------------------------------


def test_the_command_prints_the_summary(storage, alice):
    upload(alice.membership.team, alice, Upload.CODE, "kept.py", b"kept")
    key, _, _ = storage.save_blob(io.BytesIO(b"nobody's"))
    wait_past(storage, storage.last_modified(key))
    out = io.StringIO()
    call_command("sweep_blobs", "--dry-run", "--grace-hours", "0", stdout=out)
    assert out.getvalue().strip() == "2 blobs (12 bytes): 1 referenced, 0 unreferenced but within the grace period; would delete 1 (8 bytes)"
    assert storage.exists(key)
    out = io.StringIO()
    call_command("sweep_blobs", "--grace-hours", "0", stdout=out)
    assert out.getvalue().strip().endswith("deleted 1 (8 bytes freed)")
    assert not storage.exists(key)
    out = io.StringIO()
    call_command("sweep_blobs", stdout=out)  # the default grace period: nothing is that old
    assert "1 blobs (4 bytes): 1 referenced" in out.getvalue()


@pytest.mark.parametrize("hours", ["-1", "nan"])
def test_the_command_refuses_a_grace_period_that_is_not_one(db, hours):
    with pytest.raises(CommandError, match="--grace-hours must be a number of hours, 0 or more"):
        call_command("sweep_blobs", "--grace-hours", hours)


@pytest.mark.django_db(transaction=True)  # the sweep runs on a thread of its own, with its own connection
def test_the_scheduler_sweeps_in_its_housekeeping(alice, settings):
    storage = get_storage()
    kept = upload(alice.membership.team, alice, Upload.CODE, "kept.py", b"kept")
    forgotten, _, _ = storage.save_blob(io.BytesIO(b"forgotten"))
    wait_past(storage, storage.last_modified(forgotten))
    settings.E31_BLOB_SWEEP_GRACE_HOURS = 0  # below what the environment allows: for the test
    call_command("scheduler", "--once")
    assert storage.exists(kept.key) and not storage.exists(forgotten)


def test_the_scheduler_clears_expired_sessions_in_its_housekeeping(alice):
    from datetime import timedelta

    from django.contrib.sessions.models import Session
    from django.utils import timezone

    from core.sessions import SessionStore

    live, expired = SessionStore(), SessionStore()
    for store in (live, expired):
        store["who"] = "alice"
        store.create()
    Session.objects.filter(session_key=expired.session_key).update(expire_date=timezone.now() - timedelta(seconds=1))
    call_command("scheduler", "--once")
    assert list(Session.objects.values_list("session_key", flat=True)) == [live.session_key]
    assert SessionStore(live.session_key).load() == {"who": "alice"}


def test_the_grace_setting_refuses_less_than_an_hour(tmp_path):
    from tests.test_settings import check

    result = check(tmp_path, E31_BLOB_SWEEP_GRACE_HOURS="0.5")
    assert result.returncode != 0 and "E31_BLOB_SWEEP_GRACE_HOURS=0.5 must be at least 1.0" in result.stderr
