"""Staging's internals, at unit level: parts read in any order and hashed in order, nothing
unverified in the cache, reads resumed after a lost connection, and the S3 ranged reads."""

import hashlib
import io
import os
import threading

import pytest

from agent import staging
from agent.cache import BlobCache
from agent.staging import StagingError, stage
from core import buffers
from core.storage import (
    NotFound,
    RangeNotSatisfiable,
    RangeStream,
    blob_key,
    get_storage,
)
from jobs.manifest import Item


def sha(data):
    return hashlib.sha256(data).hexdigest()


class Stream:
    """Bytes [start, end) of an object, handed out at most `step` at a time, as a socket does;
    it breaks (ConnectionResetError) once `break_after` bytes have been read, if set."""

    def __init__(self, data, start, end, step=700, break_after=None, object_size=None):
        self.data, self.position, self.end = data, start, len(data) if end is None else end
        self.step, self.break_after = step, break_after
        self.object_size = len(data) if object_size is None else object_size
        self.read = 0
        self.closed = False

    def readinto(self, buffer):
        if self.break_after is not None and self.read >= self.break_after:
            raise ConnectionResetError("connection reset by peer")
        n = min(len(buffer), self.step, self.end - self.position)
        buffer[:n] = self.data[self.position : self.position + n]
        self.position += n
        self.read += n
        return n

    def close(self):
        self.closed = True


class Store:
    """An object store holding one object per item; records every open."""

    def __init__(self):
        self.objects = {}
        self.opens = []
        self.breaks = {}  # dest -> bytes after which the first stream opened breaks
        self.lock = threading.Lock()

    def add(self, dest, data, stored=None):
        item = Item(dest, len(data), sha(data), ("fake", dest), "train")
        self.objects[dest] = data if stored is None else stored
        return item

    def source(self, item, ranged=True):
        def open_range(start, end):
            data = self.objects.get(item.dest)
            if data is None:
                raise NotFound(item.dest)
            with self.lock:
                self.opens.append((item.dest, start, end))
                break_after = self.breaks.pop(item.dest, None)
            return Stream(data, start, end, break_after=break_after)

        return staging._Source(item, open_range, f"{item.dest}: the stored object is missing", ranged=ranged)


@pytest.fixture
def cache(tmp_path):
    return BlobCache(tmp_path / "cache", limit_bytes=1 << 30)


@pytest.fixture
def store(monkeypatch):
    store = Store()
    monkeypatch.setattr(staging, "_source", lambda item, datasets: store.source(item))
    return store


def test_parts_finished_in_any_order_are_hashed_in_order(cache):
    store = Store()
    data = os.urandom(10_000)
    item = store.add("data/train/big.bin", data)
    fetch = staging._Fetch(item, store.source(item), cache, part_size=1000)
    assert len(fetch.parts) == 10
    never = threading.Event()
    order = [9, 3, 5, 0, 1, 4, 2, 8, 6, 7]
    completed = [fetch.fetch_part(index, never) for index in order]
    assert completed == [False] * 9 + [True]  # only the last part written completes the file
    assert cache.path(item.sha256).read_bytes() == data
    assert oct(cache.path(item.sha256).stat().st_mode & 0o777) == "0o444"
    assert not fetch.tmp.exists() and list(cache.tmp.iterdir()) == []
    # Each part was one ranged request.
    assert sorted(start for _, start, _ in store.opens) == list(range(0, 10_000, 1000))


@pytest.mark.parametrize("direct_io", [True, False])
def test_aligned_blocks_go_to_the_disk_directly_and_the_rest_through_the_page_cache(tmp_path, direct_io, monkeypatch):
    monkeypatch.setattr(buffers, "BUFFER_SIZE", 16384)
    cache = BlobCache(tmp_path / "cache", limit_bytes=1 << 30, direct_io=direct_io)
    assert cache.direct_io == direct_io  # this machine's disk takes O_DIRECT
    store = Store()
    data = os.urandom(5 * 8192 + 1234)  # the last part ends in a partial block
    item = store.add("data/train/big.bin", data)
    fetch = staging._Fetch(item, store.source(item), cache, part_size=8192)
    never = threading.Event()
    completed = [fetch.fetch_part(index, never) for index in [5, 2, 0, 1, 4, 3]]
    assert completed[-1] and not any(completed[:-1])
    assert cache.path(item.sha256).read_bytes() == data
    # Every whole block went straight to the disk; only the last 1234 bytes through the page cache.
    assert fetch.direct_bytes == (5 * 8192 if direct_io else 0)


def test_a_file_system_without_direct_io_is_written_through_the_page_cache(tmp_path, monkeypatch):
    import errno

    real_open = os.open

    def refusing_direct(path, flags, *args):  # as some file systems answer O_DIRECT
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", refusing_direct)
    cache = BlobCache(tmp_path / "cache", limit_bytes=1 << 30)
    assert not cache.direct_io
    store = Store()
    data = os.urandom(20_000)
    item = store.add("data/train/a.bin", data)
    fetch = staging._Fetch(item, store.source(item), cache, part_size=8192)
    assert [fetch.fetch_part(i, threading.Event()) for i in range(3)][-1]
    assert cache.path(item.sha256).read_bytes() == data and fetch.direct_bytes == 0


def test_a_file_no_larger_than_a_part_is_one_request_for_the_whole_object(cache):
    store = Store()
    item = store.add("data/train/small.bin", b"s" * 1000)
    fetch = staging._Fetch(item, store.source(item), cache, part_size=1000)
    assert fetch.fetch_part(0, threading.Event())
    assert store.opens == [("data/train/small.bin", 0, None)]
    assert cache.path(item.sha256).read_bytes() == b"s" * 1000


def test_an_empty_file_is_fetched_and_checked(cache):
    store = Store()
    item = store.add("data/train/empty", b"")
    fetch = staging._Fetch(item, store.source(item), cache, part_size=1000)
    assert fetch.parts == [(0, 0)]
    assert fetch.fetch_part(0, threading.Event())
    assert cache.has(item.sha256) and cache.path(item.sha256).read_bytes() == b""


def test_bytes_that_do_not_match_the_manifest_never_enter_the_cache(cache):
    store = Store()
    item = store.add("data/train/x.bin", b"a" * 5000, stored=b"b" * 5000)
    fetch = staging._Fetch(item, store.source(item), cache, part_size=2000)
    never = threading.Event()
    fetch.fetch_part(1, never)
    fetch.fetch_part(2, never)
    with pytest.raises(StagingError, match="x.bin: its SHA-256 does not match the manifest"):
        fetch.fetch_part(0, never)
    fetch.discard()
    assert not cache.has(item.sha256) and list(cache.tmp.iterdir()) == []


def test_an_object_of_another_size_is_refused_before_its_bytes_move(cache):
    store = Store()
    item = store.add("data/train/x.bin", b"a" * 5000, stored=b"a" * 6000)
    fetch = staging._Fetch(item, store.source(item), cache, part_size=10_000)
    with pytest.raises(StagingError, match=r"x.bin: expected 5000 bytes, got 6000"):
        fetch.fetch_part(0, threading.Event())
    assert store.opens == [(item.dest, 0, None)]  # opened, and closed unread
    fetch.discard()
    assert not cache.has(item.sha256) and list(cache.tmp.iterdir()) == []


def test_a_connection_lost_in_a_part_is_read_on_from_where_it_stopped(cache):
    store = Store()
    data = os.urandom(8000)
    item = store.add("data/train/x.bin", data)
    store.breaks[item.dest] = 2100
    fetch = staging._Fetch(item, store.source(item), cache, part_size=4000)
    never = threading.Event()
    assert not fetch.fetch_part(0, never)
    assert fetch.fetch_part(1, never)
    assert cache.path(item.sha256).read_bytes() == data
    assert store.opens == [(item.dest, 0, 4000), (item.dest, 2100, 4000), (item.dest, 4000, 8000)]


def test_a_connection_that_keeps_failing_fails_the_file(cache, monkeypatch):
    monkeypatch.setattr(staging.time, "sleep", lambda seconds: None)
    data = b"z" * 3000
    item = Item("data/train/z.bin", len(data), sha(data), ("fake",), "train")
    source = staging._Source(item, lambda start, end: Stream(data, start, end, break_after=0), "missing", ranged=True)
    fetch = staging._Fetch(item, source, cache, part_size=10_000)
    with pytest.raises(StagingError, match="z.bin: reading it failed: connection reset"):
        fetch.fetch_part(0, threading.Event())
    fetch.discard()
    assert list(cache.tmp.iterdir()) == []


def test_stage_reads_large_files_in_parallel_parts_and_small_ones_whole(cache, store):
    big = os.urandom(50_000)
    items = [store.add("data/train/big.bin", big)]
    items += [store.add(f"data/train/small-{i}.bin", os.urandom(3000 + i)) for i in range(6)]
    items.append(Item("data/heldout/copy.bin", len(big), sha(big), ("fake", "data/train/big.bin"), "heldout"))
    seen = []
    progress = stage(items, cache, {}, workers=4, part_size=4096, on_progress=lambda p: seen.append(p.bytes_done))
    assert progress.files_done == progress.files_total == 8
    assert progress.bytes_done == progress.bytes_total
    assert progress.bytes_moved == 50_000 + sum(3000 + i for i in range(6))  # the duplicate moved once
    assert cache.path(sha(big)).read_bytes() == big
    big_opens = [o for o in store.opens if o[0] == "data/train/big.bin"]
    assert len(big_opens) == 13 and all(end is not None for _, _, end in big_opens)
    assert [end for dest, _, end in store.opens if dest != "data/train/big.bin"] == [None] * 6
    assert seen[-1] == progress.bytes_total
    assert list(cache.tmp.iterdir()) == []
    # Again: everything is a cache hit, nothing moves.
    store.opens.clear()
    again = stage(items, cache, {}, workers=4, part_size=4096)
    assert again.bytes_moved == 0 and again.files_done == 8 and store.opens == []


def test_stage_fails_on_a_corrupt_file_and_leaves_nothing_half_fetched(cache, store):
    items = [store.add(f"data/train/ok-{i}.bin", os.urandom(20_000)) for i in range(4)]
    items.append(store.add("data/train/bad.bin", b"x" * 20_000, stored=b"y" * 20_000))
    with pytest.raises(StagingError, match="data/train/bad.bin: its SHA-256 does not match"):
        stage(items, cache, {}, workers=3, part_size=3000)
    assert not cache.has(items[-1].sha256)
    assert list(cache.tmp.iterdir()) == []
    for item in items[:-1]:  # what was verified may stay; what is there is whole
        if cache.has(item.sha256):
            assert sha(cache.path(item.sha256).read_bytes()) == item.sha256


def test_stage_names_a_missing_object(cache, store):
    item = store.add("code/train.py", b"print(1)\n")
    del store.objects["code/train.py"]
    with pytest.raises(StagingError, match="^code/train.py: the stored object is missing$"):
        stage([item], cache, {}, workers=2)


def test_stage_stops_when_asked(cache, store):
    items = [store.add(f"data/train/{i}.bin", b"%d" % i * 1000) for i in range(3)]
    with pytest.raises(StagingError, match="staging was stopped"):
        stage(items, cache, {}, workers=2, should_stop=lambda: True)
    assert list(cache.tmp.iterdir()) == []


def test_stage_from_the_local_folder(cache):
    storage = get_storage()
    assert storage.kind == "local"
    data = os.urandom(300_000)
    key, size, digest = storage.save_blob(io.BytesIO(data))
    item = Item("data/train/a.bin", size, digest, ("storage", key), "train")
    progress = stage([item], cache, {}, workers=2, part_size=4096)  # local files are read whole
    assert progress.bytes_moved == size and cache.path(digest).read_bytes() == data
    gone = Item("data/train/gone.bin", 5, sha(b"gone!"), ("storage", blob_key(sha(b"gone!"))), "train")
    with pytest.raises(StagingError, match="^data/train/gone.bin: the stored object is missing$"):
        stage([gone], cache, {}, workers=2)


def test_temporary_names_are_never_shared(cache):
    names = {cache.temp_path("ab" * 32) for _ in range(100)}
    assert len(names) == 100 and all(name.parent == cache.tmp for name in names)


def test_a_range_stream_over_a_plain_body_reads_through_it():
    body = io.BytesIO(b"hello world")
    stream = RangeStream(body, length=11, object_size=11)
    buffer = memoryview(bytearray(4))
    parts = []
    while n := stream.readinto(buffer):
        parts.append(bytes(buffer[:n]))
    assert b"".join(parts) == b"hello world" and stream.received == 11
    stream.close()
    assert body.closed


def test_s3_ranged_reads_on_a_real_server(s3_storage):
    data = os.urandom(100_000)
    s3_storage.save("blobs/x", io.BytesIO(data))

    def read_all(stream):
        buffer = memoryview(bytearray(8192))
        out = bytearray()
        with stream:
            while n := stream.readinto(buffer):
                out += buffer[:n]
        return bytes(out)

    whole = s3_storage.open_range("blobs/x")
    assert whole._fp is not None  # read straight from the connection
    assert (whole.length, whole.object_size) == (100_000, 100_000)
    assert read_all(whole) == data
    part = s3_storage.open_range("blobs/x", 1000, 31_000)
    assert (part.length, part.object_size) == (30_000, 100_000)
    assert read_all(part) == data[1000:31_000]
    with pytest.raises(RangeNotSatisfiable):
        s3_storage.open_range("blobs/x", 200_000, 300_000)
    with pytest.raises(NotFound):
        s3_storage.open_range("blobs/missing")
    # Connections read to their end go back to the pool: many reads, few connections.
    pools = s3_storage.client._endpoint.http_session._manager.pools
    before = sum(pool.num_connections for pool in pools._container.values())
    for start in range(0, 100_000, 10_000):
        assert read_all(s3_storage.open_range("blobs/x", start, start + 10_000)) == data[start : start + 10_000]
    assert sum(pool.num_connections for pool in pools._container.values()) - before <= 1


def test_bytes_count_part_by_part_before_a_large_file_is_done(cache, store, monkeypatch):
    big = os.urandom(40_000)
    items = [store.add("data/train/big.bin", big)]
    release = threading.Event()
    plain = store.source(items[0])

    def held_back(item, datasets):
        def open_range(start, end):
            if start >= 36_000:  # the last part waits until the test has looked
                assert release.wait(20)
            return plain.open(start, end)

        return staging._Source(item, open_range, plain.missing, ranged=True)

    monkeypatch.setattr(staging, "_source", held_back)
    seen = []

    def on_progress(progress):
        seen.append((progress.files_done, progress.bytes_done))
        if progress.bytes_done:
            release.set()

    progress = stage(items, cache, {}, workers=4, part_size=4000, on_progress=on_progress)
    assert (0, 36_000) in seen  # nine of ten parts in, the file not yet done
    assert seen[-1] == (1, 40_000) and progress.bytes_moved == 40_000
