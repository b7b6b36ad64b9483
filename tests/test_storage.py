"""The storage interface, the same contract on the local folder and on a real S3 server."""

import hashlib
import io

import httpx
import pytest
from django.test import RequestFactory

from core.downloads import Unsatisfiable, download_response, parse_range
from core.storage import LocalStorage, NotFound, S3Storage, StorageError, blob_key, get_storage


@pytest.fixture(params=["local", "s3"])
def storage(request, storage_dir):
    if request.param == "local":
        return get_storage()
    return request.getfixturevalue("s3_storage")


def test_the_backend_follows_the_settings(storage):
    assert isinstance(storage, LocalStorage if storage.kind == "local" else S3Storage)


def test_save_open_size_delete(storage):
    data = b"weights" * 1000
    size, sha = storage.save("jobs/x/model.pt", io.BytesIO(data))
    assert (size, sha) == (len(data), hashlib.sha256(data).hexdigest())
    assert storage.exists("jobs/x/model.pt") and storage.size("jobs/x/model.pt") == len(data)
    assert storage.open("jobs/x/model.pt").read() == data
    storage.delete("jobs/x/model.pt")
    assert not storage.exists("jobs/x/model.pt")
    with pytest.raises(NotFound):
        storage.open("jobs/x/model.pt")
    with pytest.raises(NotFound):
        storage.size("jobs/x/model.pt")


def test_large_objects_go_in_parts_and_come_back_whole(storage, tmp_path):
    data = bytes(range(256)) * (40 * 1024 * 4)  # 40 MiB: several 16 MiB parts on S3
    source = tmp_path / "big.bin"
    source.write_bytes(data)
    size, sha = storage.save_file("datasets/big.bin", source)
    assert size == len(data)
    storage.download("datasets/big.bin", tmp_path / "back" / "big.bin")
    assert hashlib.sha256((tmp_path / "back" / "big.bin").read_bytes()).hexdigest() == sha


def test_blobs_are_kept_once_under_their_hash(storage):
    key, size, sha = storage.save_blob(io.BytesIO(b"same bytes"))
    again = storage.save_blob(io.BytesIO(b"same bytes"))
    assert key == blob_key(sha) == again[0] and size == 10
    assert storage.open(key).read() == b"same bytes"


def test_chunked_uploads_are_joined_in_order(storage):
    key = "incoming/upload-1"
    upload_id = storage.start_multipart(key)
    parts = [b"a" * (5 * 1024 * 1024), b"b" * (5 * 1024 * 1024), b"tail"]  # S3's 5 MiB minimum part
    etags = [storage.put_part(key, upload_id, n, data) for n, data in enumerate(parts, start=1)]
    storage.put_part(key, upload_id, 2, parts[1])  # a retried part replaces the first try
    etags[1] = storage.put_part(key, upload_id, 2, parts[1])
    storage.complete_multipart(key, upload_id, list(zip(range(1, 4), etags)))
    assert storage.open(key).read() == b"".join(parts)


def test_an_unknown_upload_is_not_found(storage):
    with pytest.raises((NotFound, Exception)):
        storage.put_part("incoming/x", "no-such-upload", 1, b"x")


@pytest.mark.parametrize("key", ["../etc/passwd", "/abs", "a//b", "a/./b", "a\\b", ""])
def test_keys_cannot_escape(storage, key):
    with pytest.raises(StorageError):
        storage.exists(key)


def test_s3_downloads_are_short_lived_presigned_urls(s3_storage):
    s3_storage.save("jobs/j/model.pt", io.BytesIO(b"w" * 100))
    request = RequestFactory().get("/")
    response = download_response(request, "jobs/j/model.pt", "model.pt")
    assert response.status_code == 302
    url = response["Location"]
    assert "X-Amz-Expires=300" in url and "X-Amz-Signature" in url
    fetched = httpx.get(url)
    assert fetched.status_code == 200 and fetched.content == b"w" * 100
    assert 'filename="model.pt"' in fetched.headers["content-disposition"]


def test_local_downloads_support_ranges(storage_dir):
    storage = get_storage()
    storage.save("jobs/j/model.pt", io.BytesIO(bytes(range(100))))
    factory = RequestFactory()

    def fetch(range_header=None):
        headers = {"HTTP_RANGE": range_header} if range_header else {}
        return download_response(factory.get("/", **headers), "jobs/j/model.pt", "model.pt")

    whole = fetch()
    assert whole.status_code == 200 and b"".join(whole.streaming_content) == bytes(range(100))
    assert whole["Accept-Ranges"] == "bytes"
    part = fetch("bytes=10-19")
    assert part.status_code == 206 and part["Content-Range"] == "bytes 10-19/100"
    assert b"".join(part.streaming_content) == bytes(range(10, 20))
    tail = fetch("bytes=-5")
    assert b"".join(tail.streaming_content) == bytes(range(95, 100))
    assert fetch("bytes=200-").status_code == 416


def test_range_parsing():
    assert parse_range(None, 100) is None
    assert parse_range("bytes=0-", 100) == (0, 99)
    assert parse_range("bytes=90-500", 100) == (90, 99)
    assert parse_range("bytes=-10", 100) == (90, 99)
    assert parse_range("bytes=0-1,5-6", 100) is None  # several ranges: the whole file
    assert parse_range("items=0-1", 100) is None
    for bad in ("bytes=100-", "bytes=5-2", "bytes=-0"):
        with pytest.raises(Unsatisfiable):
            parse_range(bad, 100)
