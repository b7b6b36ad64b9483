"""Datasets as first-class objects: the API and the pages.

A dataset is made by uploading files in chunks into an open version and sealing it, or by
registering a team's bucket and scanning it. Versions are immutable and share unchanged files.
Every endpoint is scoped to the team (the owner alice and the member bob get in; the outsider
charlie gets a 404), and what a user can get wrong is a 4xx with a reason. The chunked uploads
run on both storage backends: the local folder and S3 (a real SeaweedFS).

Over 500 lines: the datasets' API and pages, case by case, on both storage backends.
"""

import hashlib
import json

import pytest
from django.test import Client
from django.urls import reverse
from rest_framework.authtoken.models import Token

from catalog import datasets
from catalog.models import Dataset, DatasetFile, DatasetUpload, DatasetVersion
from core.secrets_box import unseal
from core.storage import blob_key, get_storage

CHUNK = 5 * 1024 * 1024  # S3's smallest part (but the last)
SECRET = "s3cr3t-Never-Shown-0123456789abcdef"


def sha(data):
    return hashlib.sha256(data).hexdigest()


def payload(size, seed=0):
    """size bytes that differ from chunk to chunk (a misplaced chunk changes the digest)."""
    block = hashlib.sha256(str(seed).encode()).digest() * 32  # 1 KiB
    whole, rest = divmod(size, len(block))
    data = bytearray()
    for i in range(whole):
        data += bytes((b + i) % 256 for b in block[:8]) + block[8:]
    return bytes(data + block[:rest])


@pytest.fixture(autouse=True)
def chunk_size(settings):
    settings.E31_UPLOAD_CHUNK_BYTES = CHUNK
    return CHUNK


@pytest.fixture(params=["local", "s3"])
def storage(request, storage_dir):
    """Each chunked-upload test runs on the local folder and on S3."""
    if request.param == "local":
        return get_storage()
    return request.getfixturevalue("s3_storage")


class Api:
    """A client for one persona, with its API token."""

    def __init__(self, user):
        self.client = Client()
        self.headers = {"HTTP_AUTHORIZATION": f"Token {Token.objects.create(user=user).key}"} if user else {}

    def get(self, url):
        return self.client.get(url, **self.headers)

    def post(self, url, data=None):
        return self.client.post(url, json.dumps(data or {}), content_type="application/json", **self.headers)

    def put(self, url, data):
        return self.client.put(url, data, content_type="application/octet-stream", **self.headers)

    def delete(self, url):
        return self.client.delete(url, **self.headers)

    # The chunk protocol, step by step.

    def create(self, name="images", description=""):
        return self.post(reverse("api:datasets"), {"name": name, "description": description})

    def start(self, dataset, path, size, number=1, **extra):
        return self.post(reverse("api:dataset-uploads", args=[dataset.pk, number]), {"path": path, "size": size, **extra})

    def chunk(self, upload_id, offset, data):
        return self.put(f"{reverse('api:dataset-upload', args=[upload_id])}?offset={offset}", data)

    def complete(self, upload_id, **extra):
        return self.post(reverse("api:dataset-upload-complete", args=[upload_id]), extra)

    def seal(self, dataset, number=1):
        return self.post(reverse("api:dataset-seal", args=[dataset.pk, number]))

    def manifest(self, dataset, number=1):
        return self.get(reverse("api:dataset-version", args=[dataset.pk, number]))

    def upload(self, dataset, path, data, number=1):
        """A whole file, chunk by chunk; returns the completed upload's JSON."""
        started = self.start(dataset, path, len(data), number)
        assert started.status_code == 201, started.json()
        upload = started.json()
        for offset in range(0, len(data), upload["chunk_size"]):
            response = self.chunk(upload["id"], offset, data[offset : offset + upload["chunk_size"]])
            assert response.status_code == 200, response.json()
        response = self.complete(upload["id"])
        assert response.status_code == 200, response.json()
        return response.json()


@pytest.fixture
def api(alice):
    return Api(alice)


@pytest.fixture
def outsider(charlie):
    return Api(charlie)


def make_dataset(team, name="images"):
    return datasets.create_upload_dataset(team, name)


def ready_dataset(api, team, files, name="images"):
    dataset = make_dataset(team, name)
    for path, data in files.items():
        api.upload(dataset, path, data)
    assert api.seal(dataset).status_code == 200
    return dataset


# Creating and listing -----------------------------------------------------------------------------


def test_a_dataset_is_created_with_version_1_open(api, alice):
    response = api.create("images", "cats and dogs")
    assert response.status_code == 201, response.json()
    body = response.json()
    assert (body["name"], body["description"], body["source"], body["state"]) == ("images", "cats and dogs", "upload", "open")
    assert body["latest_version"] is None and body["open_version"] == 1
    assert [(v["number"], v["state"]) for v in body["versions"]] == [(1, "open")]
    assert body["versions"][0]["upload_page"].endswith(reverse("datasets:upload", args=[body["id"], 1]))
    assert Dataset.objects.get(pk=body["id"]).team == alice.membership.team


def test_the_list_shows_name_source_latest_version_files_bytes_and_state(api, team_a):
    ready_dataset(api, team_a, {"a.bin": b"a" * 10, "b.bin": b"b" * 5})
    make_dataset(team_a, "pending")
    body = api.get(reverse("api:datasets")).json()["results"]
    rows = {d["name"]: (d["source"], d["latest_version"], d["files"], d["bytes"], d["state"]) for d in body}
    assert rows == {"images": ("upload", 1, 2, 15, "ready"), "pending": ("upload", None, 0, 0, "open")}


@pytest.mark.parametrize(
    "name,reason",
    [
        ("images", "Your team already has a dataset named 'images'."),
        ("  ", "This field is required."),
        ("cats@2", "A dataset's name cannot hold '@' (it picks a version: name@2) or control characters."),
    ],
)
def test_a_bad_name_is_refused_with_a_reason(api, team_a, name, reason):
    make_dataset(team_a, "images")
    response = api.create(name)
    assert response.status_code == 400
    assert response.json()["errors"]["name"] == [reason]


def test_another_team_may_use_the_same_name(api, outsider, team_a):
    make_dataset(team_a, "images")
    assert outsider.create("images").status_code == 201


# Every endpoint: the team gets in, an outsider gets a 404, anonymous users are refused -----------


@pytest.fixture
def things(team_a, alice, storage_dir):
    """An upload dataset with version 1 ready and version 2 open with an upload under way; a
    registered bucket."""
    dataset = make_dataset(team_a, "images")
    version = dataset.versions.get(number=1)
    upload = datasets.start_upload(version, "a.bin", 3, user=alice)
    datasets.put_chunk(upload, 0, b"abc")
    datasets.complete_upload(upload)
    datasets.seal_version(version)
    v2, _ = datasets.open_version(dataset)
    upload = datasets.start_upload(v2, "b.bin", 3, user=alice)
    bucket = datasets.register_s3(team_a, "bucket", "s3://team-bucket/data", "AKIAEXAMPLE", SECRET, endpoint_url="http://127.0.0.1:1")
    return {"dataset": dataset, "upload": upload, "bucket": bucket}


ENDPOINTS = [
    # (method, url name, args from things, body, status the team gets)
    ("get", "api:dataset", lambda t: [t["dataset"].pk], None, 200),
    ("get", "api:dataset-version", lambda t: [t["dataset"].pk, 1], None, 200),
    ("post", "api:dataset-versions", lambda t: [t["dataset"].pk], None, 200),
    ("post", "api:dataset-uploads", lambda t: [t["dataset"].pk, 2], {"path": "c.bin", "size": 1}, 201),
    ("get", "api:dataset-upload", lambda t: [t["upload"].pk], None, 200),
    ("put", "api:dataset-upload", lambda t: [t["upload"].pk], b"xyz", 200),
    ("delete", "api:dataset-upload", lambda t: [t["upload"].pk], None, 200),
    ("post", "api:dataset-upload-complete", lambda t: [t["upload"].pk], None, 409),
    ("post", "api:dataset-seal", lambda t: [t["dataset"].pk, 2], None, 409),
    ("post", "api:dataset-rescan", lambda t: [t["bucket"].pk], None, 202),
]


def call(api, method, name, args, body):
    url = reverse(name, args=args)
    if method == "put":
        return api.put(f"{url}?offset=0", body)
    if method == "post":
        return api.post(url, body)
    return getattr(api, method)(url)


@pytest.mark.parametrize("method,name,args,body,expected", ENDPOINTS)
@pytest.mark.parametrize("persona", ["alice", "bob"])
def test_the_team_gets_in(request, things, persona, method, name, args, body, expected):
    api = Api(request.getfixturevalue(persona))
    response = call(api, method, name, args(things), body)
    assert response.status_code == expected, response.json()


@pytest.mark.parametrize("method,name,args,body,expected", ENDPOINTS)
def test_an_outsider_gets_a_404_and_changes_nothing(things, outsider, method, name, args, body, expected):
    response = call(outsider, method, name, args(things), body)
    assert response.status_code == 404
    things["upload"].refresh_from_db()
    assert (things["upload"].state, things["upload"].received) == ("open", 0)
    assert DatasetVersion.objects.filter(dataset__in=[things["dataset"], things["bucket"]]).count() == 3


@pytest.mark.parametrize("method,name,args,body,expected", ENDPOINTS)
def test_anonymous_users_are_refused(things, method, name, args, body, expected):
    assert call(Api(None), method, name, args(things), body).status_code == 401


def test_lists_are_scoped_to_the_team(api, outsider, things):
    assert {d["name"] for d in api.get(reverse("api:datasets")).json()["results"]} == {"images", "bucket"}
    assert outsider.get(reverse("api:datasets")).json() == {"count": 0, "next": None, "previous": None, "results": []}
    assert outsider.create("mine").status_code == 201
    assert outsider.post(reverse("api:dataset-register-s3"), {"name": "x"}).status_code == 400  # its own, refused on the fields


def test_session_auth_needs_the_csrf_token(alice, team_a):
    dataset = make_dataset(team_a)
    upload = datasets.start_upload(dataset.versions.get(), "a.bin", 3)
    client = Client(enforce_csrf_checks=True)
    client.force_login(alice)
    url = f"{reverse('api:dataset-upload', args=[upload.pk])}?offset=0"
    assert client.put(url, b"abc", content_type="application/octet-stream").status_code == 403
    client.get(reverse("datasets:new"))  # sets the CSRF cookie, as the page does
    token = client.cookies["csrftoken"].value
    response = client.put(url, b"abc", content_type="application/octet-stream", HTTP_X_CSRFTOKEN=token)
    assert response.status_code == 200 and response.json()["received"] == 3


# The chunk protocol, on both storages -----------------------------------------------------------


def test_a_file_goes_up_in_chunks_and_its_manifest_entry_is_right(api, team_a, storage):
    data = payload(2 * CHUNK + 1234)
    dataset = make_dataset(team_a)
    started = api.start(dataset, "train/big.bin", len(data)).json()
    assert (started["chunk_size"], started["received"], started["state"]) == (CHUNK, 0, "open")
    for offset in (0, CHUNK, 2 * CHUNK):
        response = api.chunk(started["id"], offset, data[offset : offset + CHUNK])
        assert response.status_code == 200
        assert response.json()["received"] == min(offset + CHUNK, len(data))
    done = api.complete(started["id"]).json()
    assert (done["state"], done["sha256"], done["received"]) == ("complete", sha(data), len(data))

    assert api.seal(dataset).json()["state"] == "ready"
    manifest = api.manifest(dataset).json()["manifest"]
    assert manifest == [{"path": "train/big.bin", "size": len(data), "sha256": sha(data)}]
    # The bytes are a blob under their digest; the incoming object is gone.
    assert storage.open(blob_key(sha(data))).read() == data
    assert not storage.exists(f"incoming/{started['id']}")


def test_a_retried_chunk_replaces_its_part(api, team_a, storage):
    data = payload(CHUNK + 10, seed=1)
    dataset = make_dataset(team_a)
    upload = api.start(dataset, "a.bin", len(data)).json()
    assert api.chunk(upload["id"], 0, b"\0" * CHUNK).json()["received"] == CHUNK  # garbled on the way
    assert api.chunk(upload["id"], 0, data[:CHUNK]).json()["received"] == CHUNK  # sent again
    assert api.chunk(upload["id"], CHUNK, data[CHUNK:]).json()["received"] == len(data)
    assert api.chunk(upload["id"], CHUNK, data[CHUNK:]).json()["received"] == len(data)  # an answer lost: sent again
    assert api.complete(upload["id"]).json()["sha256"] == sha(data)
    assert [n for n, _etag in DatasetUpload.objects.get(pk=upload["id"]).parts] == [1, 2]


def test_an_interrupted_upload_resumes_from_what_arrived(api, team_a, storage):
    data = payload(3 * CHUNK - 7, seed=2)
    dataset = make_dataset(team_a)
    upload = api.start(dataset, "resume.bin", len(data)).json()
    api.chunk(upload["id"], 0, data[:CHUNK])
    # The connection drops here. Later (another process, another day) the client asks how far
    # the upload got, and continues from there instead of starting over.
    status = api.get(reverse("api:dataset-upload", args=[upload["id"]])).json()
    assert (status["received"], status["size"], status["state"]) == (CHUNK, len(data), "open")
    gap = api.chunk(upload["id"], 2 * CHUNK, data[2 * CHUNK :])
    assert gap.status_code == 409 and gap.json()["received"] == CHUNK
    assert "leaves a gap" in gap.json()["detail"]
    for offset in range(status["received"], len(data), CHUNK):
        assert api.chunk(upload["id"], offset, data[offset : offset + CHUNK]).status_code == 200
    assert api.complete(upload["id"]).json()["sha256"] == sha(data)


def test_the_client_s_sha256_is_checked(api, team_a, storage):
    data = payload(CHUNK + 1, seed=3)
    dataset = make_dataset(team_a)
    good = api.start(dataset, "good.bin", len(data), sha256=sha(data)).json()
    bad = api.start(dataset, "bad.bin", len(data), sha256=sha(b"something else")).json()
    for upload in (good, bad):
        api.chunk(upload["id"], 0, data[:CHUNK])
        api.chunk(upload["id"], CHUNK, data[CHUNK:])
    assert api.complete(good["id"]).json()["state"] == "complete"
    response = api.complete(bad["id"])
    assert response.status_code == 400
    assert f"its SHA-256 is {sha(data)}, not the {sha(b'something else')} given" in response.json()["detail"]
    refused = DatasetUpload.objects.get(pk=bad["id"])
    assert refused.state == "failed" and "upload it again" in refused.error
    assert not storage.exists(refused.key)
    assert [f["path"] for f in api.manifest(dataset).json()["manifest"]] == ["good.bin"]


def test_a_sha256_sent_at_completion_is_checked_too(api, team_a, storage_dir):
    dataset = make_dataset(team_a)
    upload = api.start(dataset, "a.bin", 3).json()
    api.chunk(upload["id"], 0, b"abc")
    assert api.complete(upload["id"], sha256="not hex").status_code == 400
    assert api.complete(upload["id"], sha256="0" * 64).status_code == 400
    assert DatasetUpload.objects.get(pk=upload["id"]).state == "failed"


@pytest.mark.parametrize(
    "offset,length,status,reason",
    [
        (CHUNK, CHUNK, 409, "leaves a gap: 0 bytes have arrived; send the chunk at 0"),
        (100, CHUNK, 409, "is not a multiple of the chunk size"),
        (0, CHUNK - 1, 400, "every chunk but the last must have 5242880"),
        (0, CHUNK + 1, 400, "every chunk but the last must have 5242880"),
        (3 * CHUNK, 1, 400, "is past the end of the file"),
    ],
)
def test_a_chunk_that_does_not_fit_is_refused_with_a_reason(api, team_a, storage_dir, offset, length, status, reason):
    dataset = make_dataset(team_a)
    upload = api.start(dataset, "a.bin", 2 * CHUNK + 5).json()
    response = api.chunk(upload["id"], offset, b"x" * length)
    assert response.status_code == status
    assert reason in response.json()["detail"]
    assert DatasetUpload.objects.get(pk=upload["id"]).received == 0


def test_the_last_chunk_must_be_exactly_the_rest(api, team_a, storage_dir):
    dataset = make_dataset(team_a)
    upload = api.start(dataset, "a.bin", 10).json()
    response = api.chunk(upload["id"], 0, b"x" * 11)
    assert response.status_code == 400 and "the last chunk must have 10" in response.json()["detail"]


def test_an_offset_must_be_given(api, team_a, storage_dir):
    dataset = make_dataset(team_a)
    upload = api.start(dataset, "a.bin", 10).json()
    response = api.put(reverse("api:dataset-upload", args=[upload["id"]]), b"x" * 10)
    assert response.status_code == 400 and response.json()["detail"] == "Give the chunk's offset in bytes: ?offset=N."


def test_completing_before_everything_arrived_is_refused(api, team_a, storage):
    data = payload(CHUNK + 3)
    dataset = make_dataset(team_a)
    upload = api.start(dataset, "a.bin", len(data)).json()
    api.chunk(upload["id"], 0, data[:CHUNK])
    response = api.complete(upload["id"])
    assert response.status_code == 409
    assert response.json() == {"detail": f"Only {CHUNK} of {len(data)} bytes have arrived; send the rest first.", "received": CHUNK}
    api.chunk(upload["id"], CHUNK, data[CHUNK:])
    assert api.complete(upload["id"]).status_code == 200
    assert api.complete(upload["id"]).json()["state"] == "complete"  # a lost answer: asked again


def test_an_empty_file_needs_no_chunks(api, team_a, storage):
    dataset = make_dataset(team_a)
    upload = api.start(dataset, "empty.txt", 0).json()
    assert api.complete(upload["id"]).json()["sha256"] == sha(b"")
    assert api.manifest(dataset).json()["manifest"] == [{"path": "empty.txt", "size": 0, "sha256": sha(b"")}]


@pytest.mark.parametrize(
    "path,size,reason",
    [
        ("../etc/passwd", 3, "'../etc/passwd' is not a usable file path."),
        ("a/../../b", 3, "is not a usable file path"),
        ("", 3, "is not a usable file path"),
        ("a.bin", -1, "Size must be the file's size in bytes, a whole number."),
        ("a.bin", "three", "Size must be the file's size in bytes, a whole number."),
        ("a.bin", 1.5, "Size must be the file's size in bytes, a whole number."),
        ("a.bin", CHUNK * 10_000 + 1, "A file may have at most 52,428,800,000 bytes (10,000 chunks of 5,242,880)."),
    ],
)
def test_a_bad_path_or_size_is_refused(api, team_a, storage_dir, path, size, reason):
    dataset = make_dataset(team_a)
    response = api.start(dataset, path, size)
    assert response.status_code == 400
    assert reason in response.json()["detail"]
    assert not DatasetUpload.objects.exists()


def test_path_and_size_must_be_given(api, team_a, storage_dir):
    dataset = make_dataset(team_a)
    response = api.post(reverse("api:dataset-uploads", args=[dataset.pk, 1]), {"path": "a.bin"})
    assert response.status_code == 400
    assert response.json() == {"detail": "Give the file's path and size (in bytes).", "errors": {"size": ["This field is required."]}}


def test_paths_are_tidied(api, team_a, storage_dir):
    dataset = make_dataset(team_a)
    assert api.start(dataset, "./photos//cat.jpg", 3).json()["path"] == "photos/cat.jpg"


def test_starting_a_file_again_aborts_its_unfinished_upload(api, team_a, storage):
    dataset = make_dataset(team_a)
    first = api.start(dataset, "a.bin", 3).json()
    second = api.start(dataset, "a.bin", 3).json()
    response = api.chunk(first["id"], 0, b"abc")
    assert response.status_code == 409
    assert response.json() == {"detail": "The upload of a.bin is aborted: another upload of the same path took its place."}
    assert api.chunk(second["id"], 0, b"abc").status_code == 200


def test_an_upload_can_be_given_up(api, team_a, storage):
    data = payload(CHUNK + 1)
    dataset = make_dataset(team_a)
    upload = api.start(dataset, "a.bin", len(data)).json()
    api.chunk(upload["id"], 0, data[:CHUNK])
    response = api.delete(reverse("api:dataset-upload", args=[upload["id"]]))
    assert response.status_code == 200 and response.json()["state"] == "aborted"
    assert api.chunk(upload["id"], CHUNK, data[CHUNK:]).status_code == 409
    assert api.complete(upload["id"]).status_code == 409


def test_stale_uploads_are_purged(team_a, storage_dir):
    from django.utils import timezone

    dataset = make_dataset(team_a)
    old = datasets.start_upload(dataset.versions.get(), "old.bin", 3)
    DatasetUpload.objects.filter(pk=old.pk).update(updated_at=timezone.now() - timezone.timedelta(days=3))
    fresh = datasets.start_upload(dataset.versions.get(), "fresh.bin", 3)
    stuck = datasets.start_upload(dataset.versions.get(), "stuck.bin", 3)
    datasets.put_chunk(stuck, 0, b"abc")
    long_ago = timezone.now() - timezone.timedelta(days=3)
    DatasetUpload.objects.filter(pk=stuck.pk).update(state="completing", claimed_at=long_ago, updated_at=long_ago)
    assert datasets.purge_stale_uploads(timezone.now() - timezone.timedelta(days=1)) == 1
    assert DatasetUpload.objects.get(pk=old.pk).state == "aborted"
    assert DatasetUpload.objects.get(pk=fresh.pk).state == "open"
    # Its completion died with its worker: released (still completing), and the next worker
    # finishes it.
    assert DatasetUpload.objects.filter(pk=stuck.pk, state="completing", claimed_at=None).exists()
    [claimed] = datasets.claim_completions()
    assert datasets.finish_completion(claimed).sha256 == sha(b"abc")


# Sealing, versions, immutability ------------------------------------------------------------------


def test_sealing_waits_for_open_uploads(api, team_a, storage_dir):
    dataset = make_dataset(team_a)
    api.upload(dataset, "done.bin", b"done")
    pending = api.start(dataset, "pending.bin", 10).json()
    response = api.seal(dataset)
    assert response.status_code == 409
    assert response.json()["detail"] == "1 upload(s) are not finished: pending.bin; complete or abort them first."
    api.delete(reverse("api:dataset-upload", args=[pending["id"]]))
    sealed = api.seal(dataset).json()
    assert (sealed["state"], sealed["files"], sealed["bytes"]) == ("ready", 1, 4)


def test_a_version_without_files_is_not_sealed(api, team_a, storage_dir):
    dataset = make_dataset(team_a)
    response = api.seal(dataset)
    assert response.status_code == 400
    assert response.json()["detail"] == "The version has no files yet: upload at least one before sealing it."


def test_a_sealed_version_never_changes(api, team_a, storage_dir):
    dataset = ready_dataset(api, team_a, {"a.bin": b"aaa"})
    response = api.start(dataset, "b.bin", 3)
    assert response.status_code == 409
    assert response.json()["detail"] == "Version 1 of images is ready: it cannot change; open a new version to add files."
    assert api.seal(dataset).status_code == 409
    with pytest.raises(ValueError):
        dataset.versions.get().add_file("c.bin", 1, sha(b"c"), blob_key(sha(b"c")))
    assert api.manifest(dataset).json()["manifest"] == [{"path": "a.bin", "size": 3, "sha256": sha(b"aaa")}]


def test_adding_files_makes_a_new_version_sharing_the_unchanged_ones(api, team_a, storage):
    big = payload(CHUNK + 100, seed=4)
    dataset = ready_dataset(api, team_a, {"a.bin": big, "b.txt": b"old b"})
    response = api.post(reverse("api:dataset-versions", args=[dataset.pk]))
    assert response.status_code == 201
    v2 = response.json()
    assert (v2["number"], v2["state"], v2["parent"]) == (2, "open", 1)
    assert [f["path"] for f in v2["manifest"]] == ["a.bin", "b.txt"]
    # Asking again gives the same open version, not a third one.
    again = api.post(reverse("api:dataset-versions", args=[dataset.pk]))
    assert (again.status_code, again.json()["number"]) == (200, 2)

    api.upload(dataset, "b.txt", b"new b", number=2)
    api.upload(dataset, "c.txt", b"c", number=2)
    assert api.seal(dataset, 2).json()["files"] == 3

    v1 = {f["path"]: f for f in api.manifest(dataset, 1).json()["manifest"]}
    v2 = {f["path"]: f for f in api.manifest(dataset, 2).json()["manifest"]}
    assert v1 == {"a.bin": {"path": "a.bin", "size": len(big), "sha256": sha(big)}, "b.txt": {"path": "b.txt", "size": 5, "sha256": sha(b"old b")}}
    assert v2["a.bin"] == v1["a.bin"] and v2["b.txt"]["sha256"] == sha(b"new b") and v2["c.txt"]["sha256"] == sha(b"c")
    keys = {(f.version.number, f.path): f.key for f in DatasetFile.objects.filter(version__dataset=dataset)}
    assert keys[(1, "a.bin")] == keys[(2, "a.bin")] == blob_key(sha(big))  # one blob, two versions
    assert storage.open(keys[(1, "b.txt")]).read() == b"old b"  # the old version's bytes are still there

    body = api.get(reverse("api:dataset", args=[dataset.pk])).json()
    assert (body["latest_version"], body["files"], body["state"]) == (2, 3, "ready")
    assert [(v["number"], v["state"]) for v in body["versions"]] == [(2, "ready"), (1, "ready")]


def test_the_same_bytes_are_kept_once(api, team_a, storage_dir):
    dataset = make_dataset(team_a)
    api.upload(dataset, "one.bin", b"same bytes")
    api.upload(dataset, "two.bin", b"same bytes")
    blobs = [p for p in (storage_dir / "blobs").rglob("*") if p.is_file()]
    assert len(blobs) == 1


def test_a_job_can_name_a_dataset_made_here(api, team_a, storage_dir):
    dataset = ready_dataset(api, team_a, {"a.bin": b"aaa"})
    assert datasets.resolve(team_a, "images@1").dataset == dataset


def test_a_version_number_that_no_version_can_have_is_refused_with_a_reason(api, team_a, storage_dir):
    """A number past what a version may have (SQLite cannot be asked for it) is no version; a
    digit that is not ASCII ("²": a digit to isdigit, not to int) is not a number. Both were
    500s from a spec's dataset reference."""
    ready_dataset(api, team_a, {"a.bin": b"aaa"})
    with pytest.raises(datasets.DatasetError, match="has no ready version 99999999999999999999"):
        datasets.resolve(team_a, "images@99999999999999999999")
    with pytest.raises(datasets.DatasetError, match="must be a number"):
        datasets.resolve(team_a, "images@²")
    with pytest.raises(datasets.DatasetError, match="has no ready version 2147483647"):
        datasets.resolve(team_a, "images@2147483647")


# Registered buckets ---------------------------------------------------------------------------------


def register(api, **fields):
    body = {
        "name": "bucket",
        "uri": "s3://team-bucket/data",
        "endpoint_url": "http://127.0.0.1:9",
        "region": "eu-west-1",
        "access_key_id": "AKIAEXAMPLE",
        "secret_access_key": SECRET,
        **fields,
    }
    return api.post(reverse("api:dataset-register-s3"), body)


def test_a_bucket_is_registered_with_its_credentials_encrypted(api, team_a):
    response = register(api)
    assert response.status_code == 201, response.json()
    body = response.json()
    assert body["s3"] == {"uri": "s3://team-bucket/data", "endpoint_url": "http://127.0.0.1:9", "region": "eu-west-1", "credentials": "stored"}
    assert [(v["number"], v["state"]) for v in body["versions"]] == [(1, "scanning")]
    dataset = Dataset.objects.get(pk=body["id"])
    assert SECRET not in dataset.s3_credentials and "AKIAEXAMPLE" not in dataset.s3_credentials
    assert unseal(dataset.s3_credentials) == {"access_key_id": "AKIAEXAMPLE", "secret_access_key": SECRET}


def test_the_credentials_are_never_shown_back(api, team_a, client, alice):
    dataset = Dataset.objects.get(pk=register(api).json()["id"])
    client.force_login(alice)
    responses = [
        api.get(reverse("api:datasets")),
        api.get(reverse("api:dataset", args=[dataset.pk])),
        api.get(reverse("api:dataset-version", args=[dataset.pk, 1])),
        api.post(reverse("api:dataset-rescan", args=[dataset.pk])),
        client.get(reverse("datasets:list")),
        client.get(reverse("datasets:detail", args=[dataset.pk])),
        client.post(reverse("datasets:new"), {"s3-name": "bucket", "s3-uri": "s3://b/p", "s3-access_key_id": "k", "s3-secret_access_key": SECRET}),
    ]
    for response in responses:
        assert response.status_code in (200, 202)
        assert SECRET not in response.content.decode()
        assert dataset.s3_credentials not in response.content.decode()
    page = responses[5].content.decode()
    assert "s3://team-bucket/data" in page and "http://127.0.0.1:9" in page and "Stored, encrypted" in page
    assert "AKIAEXAMPLE" not in page


@pytest.mark.parametrize(
    "fields,field,reason",
    [
        ({"uri": "https://team-bucket/data"}, "uri", "Give the bucket as s3://bucket/prefix"),
        ({"uri": "s3://A_Bad_Bucket/x"}, "uri", "Give the bucket as s3://bucket/prefix"),
        ({"endpoint_url": "ftp://example.com"}, "endpoint_url", "Give an http:// or https:// address."),
        ({"endpoint_url": "not a url"}, "endpoint_url", "Enter a valid URL."),
        ({"secret_access_key": ""}, "secret_access_key", "This field is required."),
        ({"access_key_id": ""}, "access_key_id", "This field is required."),
        ({"region": "eu west"}, "region", "A region is letters, digits and dashes"),
        ({"name": "images"}, "name", "Your team already has a dataset named 'images'."),
    ],
)
def test_a_bad_registration_is_refused_on_its_field(api, team_a, fields, field, reason):
    make_dataset(team_a, "images")
    response = register(api, **fields)
    assert response.status_code == 400
    assert reason in response.json()["errors"][field][0]
    assert not Dataset.objects.filter(source=Dataset.S3).exists()


def test_nothing_is_uploaded_into_a_registered_bucket_s_version(api, team_a):
    bucket = Dataset.objects.get(pk=register(api).json()["id"])
    response = api.start(bucket, "a.bin", 3)
    assert response.status_code == 400 and "a registered bucket's dataset changes by scanning it again" in response.json()["detail"]


def test_only_a_bucket_is_scanned_again_and_only_an_upload_gets_files(api, team_a):
    uploaded = make_dataset(team_a)
    response = api.post(reverse("api:dataset-rescan", args=[uploaded.pk]))
    assert response.status_code == 400 and response.json()["detail"] == "Only a dataset registered from a bucket can be scanned again."
    bucket = Dataset.objects.get(pk=register(api).json()["id"])
    response = api.post(reverse("api:dataset-versions", args=[bucket.pk]))
    assert response.status_code == 400 and "by scanning it again" in response.json()["detail"]
    rescan = api.post(reverse("api:dataset-rescan", args=[bucket.pk]))
    assert (rescan.status_code, rescan.json()["number"], rescan.json()["state"]) == (202, 2, "scanning")


def test_a_bucket_is_scanned_into_a_manifest(api, team_a, seaweed, client, alice):
    bucket = seaweed.bucket("team")
    s3 = seaweed.client()
    objects = {"data/train/a.csv": b"x,y\n1,2\n", "data/train/b.csv": payload(70_000), "data/readme.txt": b"hello", "other/skip.txt": b"no"}
    for key, body in objects.items():
        s3.put_object(Bucket=bucket, Key=key, Body=body)
    response = register(
        api,
        uri=f"s3://{bucket}/data",
        endpoint_url=seaweed.endpoint,
        region="us-east-1",
        access_key_id=seaweed.access_key,
        secret_access_key=seaweed.secret_key,
    )
    dataset = Dataset.objects.get(pk=response.json()["id"])
    [version] = datasets.claim_scans()
    assert datasets.scan(version).state == "ready"

    manifest = api.manifest(dataset).json()["manifest"]
    assert manifest == [
        {"path": p.removeprefix("data/"), "size": len(objects[p]), "sha256": sha(objects[p])}
        for p in ("data/readme.txt", "data/train/a.csv", "data/train/b.csv")
    ]
    assert api.get(reverse("api:datasets")).json()["results"][0]["files"] == 3
    client.force_login(alice)
    page = client.get(reverse("datasets:detail", args=[dataset.pk])).content.decode()
    assert "train/b.csv" in page and sha(objects["data/train/b.csv"]) in page and seaweed.secret_key not in page


@pytest.mark.parametrize(
    "credentials,reason",
    [
        ({"secret_access_key": "wrong-secret-0000000000000000000000000"}, "the secret key does not match the access key"),
        ({"access_key_id": "AKIANOBODY", "secret_access_key": "x" * 40}, "the access key is not known to that endpoint"),
    ],
)
def test_a_scan_with_bad_credentials_fails_with_a_reason(api, team_a, seaweed, client, alice, credentials, reason):
    bucket = seaweed.bucket("team")
    seaweed.client().put_object(Bucket=bucket, Key="data/a.csv", Body=b"a")
    fields = {"access_key_id": seaweed.access_key, **credentials}
    response = register(api, uri=f"s3://{bucket}/data", endpoint_url=seaweed.endpoint, region="us-east-1", **fields)
    dataset = Dataset.objects.get(pk=response.json()["id"])
    version = datasets.scan(dataset.versions.get())
    assert (version.state, version.error) == ("failed", reason)
    body = api.get(reverse("api:dataset", args=[dataset.pk])).json()
    assert (body["state"], body["versions"][0]["error"]) == ("failed", reason)
    client.force_login(alice)
    assert f"Scan failed: {reason}" in client.get(reverse("datasets:detail", args=[dataset.pk])).content.decode()


def test_a_scan_of_an_empty_prefix_fails_with_a_reason(api, team_a, seaweed):
    bucket = seaweed.bucket("team")
    response = register(
        api, uri=f"s3://{bucket}/nothing", endpoint_url=seaweed.endpoint, access_key_id=seaweed.access_key, secret_access_key=seaweed.secret_key
    )
    version = datasets.scan(Dataset.objects.get(pk=response.json()["id"]).versions.get())
    assert (version.state, version.error) == ("failed", f"there are no objects under s3://{bucket}/nothing/")


# Pages -----------------------------------------------------------------------------------------------


@pytest.fixture
def browser_client(client, alice):
    client.force_login(alice)
    return client


def test_the_list_page_shows_the_team_s_datasets(browser_client, api, team_a, team_b, storage_dir):
    ready_dataset(api, team_a, {"a.bin": b"a" * 2048})
    make_dataset(team_a, "pending")
    make_dataset(team_b, "not-ours")
    page = browser_client.get(reverse("datasets:list")).content.decode()
    assert "images" in page and "2.0\xa0KB" in page and "v1 open" in page
    assert "not-ours" not in page
    assert 'href="/datasets/"' in page  # the nav link


def test_the_new_page_says_what_to_do_without_javascript(browser_client):
    page = browser_client.get(reverse("datasets:new")).content.decode()
    assert "Uploading needs JavaScript, which is off in this browser." in page
    assert '<fieldset class="plain" id="upload-fields" disabled>' in page  # upload.js enables it
    assert 'name="s3-secret_access_key"' in page and "webkitdirectory" in page


def test_a_bucket_is_registered_through_the_page(browser_client, team_a):
    fields = {
        "s3-name": "lake",
        "s3-uri": "s3://lake-bucket/train",
        "s3-endpoint_url": "http://127.0.0.1:9",
        "s3-access_key_id": "AKIAEXAMPLE",
        "s3-secret_access_key": SECRET,
    }
    response = browser_client.post(reverse("datasets:new"), fields)
    dataset = Dataset.objects.get(name="lake")
    assert response.status_code == 302 and response["Location"] == reverse("datasets:detail", args=[dataset.pk])
    assert unseal(dataset.s3_credentials)["secret_access_key"] == SECRET
    page = browser_client.get(response["Location"]).content.decode()
    assert "registered: its objects are being scanned" in page and "Scanning" in page and 'hx-trigger="every 2s"' in page


def test_a_refused_registration_shows_errors_next_to_the_fields_and_forgets_the_secret(browser_client, team_a):
    fields = {"s3-name": "lake", "s3-uri": "http://nope", "s3-access_key_id": "AKIAEXAMPLE", "s3-secret_access_key": SECRET}
    response = browser_client.post(reverse("datasets:new"), fields)
    page = response.content.decode()
    assert response.status_code == 200 and "The bucket was not registered." in page
    assert 'id="field-s3-uri"' in page and "Give the bucket as s3://bucket/prefix" in page
    assert SECRET not in page and 'value="lake"' in page
    assert not Dataset.objects.exists()


def test_add_files_opens_a_version_and_the_upload_page(browser_client, api, team_a, storage_dir):
    dataset = ready_dataset(api, team_a, {"a.bin": b"aaa"})
    response = browser_client.post(reverse("datasets:add", args=[dataset.pk]))
    assert response["Location"] == reverse("datasets:upload", args=[dataset.pk, 2])
    page = browser_client.get(response["Location"]).content.decode()
    assert "Version 2 starts with the 1 file of version 1" in page and "a.bin" in page
    assert f'data-version-url="{reverse("api:dataset-version", args=[dataset.pk, 2])}"' in page
    # The dataset page points at the open version.
    page = browser_client.get(reverse("datasets:detail", args=[dataset.pk])).content.decode()
    assert "Continue uploading v2" in page


def test_the_upload_page_lists_interrupted_uploads(browser_client, team_a, storage_dir):
    dataset = make_dataset(team_a)
    upload = datasets.start_upload(dataset.versions.get(), "half.bin", 2 * CHUNK)
    datasets.put_chunk(upload, 0, b"x" * CHUNK)
    page = browser_client.get(reverse("datasets:upload", args=[dataset.pk, 1])).content.decode()
    assert "1 upload stopped part-way." in page and "half.bin" in page and "5.0\xa0MB of 10.0\xa0MB" in page
    assert reverse("datasets:abort-upload", args=[dataset.pk, upload.pk]) in page


def test_sealing_from_the_page(browser_client, api, team_a, storage_dir):
    dataset = make_dataset(team_a)
    api.upload(dataset, "a.bin", b"aaa")
    pending = api.start(dataset, "b.bin", 3).json()
    response = browser_client.post(reverse("datasets:seal", args=[dataset.pk, 1]), follow=True)
    assert "1 upload(s) are not finished: b.bin" in response.content.decode()
    api.delete(reverse("api:dataset-upload", args=[pending["id"]]))
    response = browser_client.post(reverse("datasets:seal", args=[dataset.pk, 1]), follow=True)
    page = response.content.decode()
    assert "Version 1 of images is sealed" in page and sha(b"aaa") in page
    # A sealed version's upload page sends you to the version.
    response = browser_client.get(reverse("datasets:upload", args=[dataset.pk, 1]))
    assert response["Location"] == reverse("datasets:detail", args=[dataset.pk]) + "?version=1"


def test_an_older_version_can_be_shown(browser_client, api, team_a, storage_dir):
    dataset = ready_dataset(api, team_a, {"a.bin": b"aaa"})
    api.post(reverse("api:dataset-versions", args=[dataset.pk]))
    api.upload(dataset, "b.bin", b"bbb", number=2)
    api.seal(dataset, 2)
    latest = browser_client.get(reverse("datasets:detail", args=[dataset.pk])).content.decode()
    older = browser_client.get(reverse("datasets:detail", args=[dataset.pk]) + "?version=1").content.decode()
    assert "Files of version 2" in latest and "b.bin" in latest
    assert "Files of version 1" in older and "b.bin" not in older.split('id="manifest"')[1]
    assert browser_client.get(reverse("datasets:detail", args=[dataset.pk]) + "?version=9").status_code == 404


DATASET_PAGES = [
    ("get", "datasets:detail", lambda t: [t["dataset"].pk], 200),
    ("post", "datasets:add", lambda t: [t["dataset"].pk], 302),
    ("get", "datasets:upload", lambda t: [t["dataset"].pk, 2], 200),
    ("post", "datasets:seal", lambda t: [t["dataset"].pk, 2], 302),
    ("post", "datasets:rescan", lambda t: [t["bucket"].pk], 302),
    ("post", "datasets:abort-upload", lambda t: [t["dataset"].pk, t["upload"].pk], 302),
]


@pytest.mark.parametrize("method,name,args,expected", DATASET_PAGES)
@pytest.mark.parametrize("persona", ["alice", "bob"])
def test_the_team_gets_the_pages(client, request, things, persona, method, name, args, expected):
    client.force_login(request.getfixturevalue(persona))
    assert getattr(client, method)(reverse(name, args=args(things))).status_code == expected


@pytest.mark.parametrize("method,name,args,expected", DATASET_PAGES)
def test_an_outsider_gets_a_404_from_the_pages(client, charlie, things, method, name, args, expected):
    client.force_login(charlie)
    assert getattr(client, method)(reverse(name, args=args(things))).status_code == 404
    assert DatasetVersion.objects.filter(dataset__in=[things["dataset"], things["bucket"]]).count() == 3
    things["upload"].refresh_from_db()
    assert things["upload"].state == "open"


def test_an_upload_is_given_up_only_through_its_own_dataset(browser_client, things, team_a):
    other = make_dataset(team_a, "other")
    url = reverse("datasets:abort-upload", args=[other.pk, things["upload"].pk])
    assert browser_client.post(url).status_code == 404
    url = reverse("datasets:abort-upload", args=[things["dataset"].pk, things["upload"].pk])
    page = browser_client.post(url, follow=True).content.decode()
    assert "The upload of b.bin was given up." in page and "stopped part-way" not in page
    things["upload"].refresh_from_db()
    assert things["upload"].state == "aborted"


@pytest.mark.parametrize("name", ["datasets:list", "datasets:new"])
def test_the_pages_need_a_login(client, db, name):
    response = client.get(reverse(name))
    assert response.status_code == 302 and response["Location"].startswith(reverse("login"))


def test_storage_errors_never_lose_the_upload(api, team_a, storage_dir, monkeypatch):
    """A storage failure while completing leaves the upload open: completing again finishes it."""
    dataset = make_dataset(team_a)
    upload = api.start(dataset, "a.bin", 3).json()
    api.chunk(upload["id"], 0, b"abc")
    storage = get_storage()
    real_copy = storage.copy  # the joined file becomes a blob by a copy inside the store
    monkeypatch.setattr(storage, "copy", lambda src, dst: (_ for _ in ()).throw(OSError("disk full")))
    response = api.complete(upload["id"])
    assert response.status_code == 503
    assert response.json()["detail"] == "Storage failed while completing a.bin; the upload is kept: complete it again."
    assert DatasetUpload.objects.get(pk=upload["id"]).state == "open"
    monkeypatch.setattr(storage, "copy", real_copy)
    assert api.complete(upload["id"]).json()["sha256"] == sha(b"abc")


def test_chunks_are_read_without_the_request_size_limit(api, team_a, storage_dir, settings):
    """Chunks bigger than Django's DATA_UPLOAD_MAX_MEMORY_SIZE still go through."""
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = CHUNK // 2
    dataset = make_dataset(team_a)
    data = payload(CHUNK + 1)
    assert api.upload(dataset, "a.bin", data)["sha256"] == sha(data)
