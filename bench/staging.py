"""How fast a runner stages a dataset from S3 into its cache, against a plain boto3 loop and cp.

A real S3 server (SeaweedFS on loopback, tests.seaweed) holds a dataset of --files files of
random bytes, --size-mib in all (1 GiB of 64 files of 16 MiB by default), uploaded through our
S3Storage as content-addressed blobs, the way datasets are kept. Then, in rounds whose order
rotates so that drift on a noisy machine hits all three alike:

- ours: agent.staging.stage() of the dataset's manifest into an empty BlobCache (fetch,
  verify size and SHA-256, move into the cache), with the runner's default number of workers;
- boto3: a fresh boto3 client with default settings (default TransferConfig) calling
  download_file for each object, one after the other, into an empty folder;
- cp: `cp -r` of the generated folder (the same bytes, as local files) to a new folder.

Before each timed transfer everything is flushed (sync) and, where the kernel lets us, the page
cache is dropped, so every source is read from the disk. Each transfer is timed to its return
and, separately, to the end of a `sync` after it (its bytes on the disk). Our staging fsyncs
every file before the cache takes it, so its two times are the same; the comparison with cp is
made to the bytes on the disk (the disk's rate), and the one to the return is printed beside it. Then, on the cache of
the last round: the time to stage the same manifest again (everything a cache hit), and the
bytes moved for a manifest where 10% of the files are new (counted by stage() and, apart from
it, as the bytes of the GetObject responses our storage client received). MB is 10^6 bytes.

The last line is the ratio of the medians: our staging throughput / the plain boto3 loop's. It
exits 1 if the delta's bytes moved, received and added to the cache are not the new files' bytes.

    .venv/bin/python bench/staging.py [--size-mib 1024] [--files 64] [--repeat 5] [--workers N] [--quick]

--quick (CI: the benchmark still works, in about 10 s): 8 MiB in 10 files, one round, and the page
cache left alone (dropping it would slow everything else on the machine, CI's other tests among
them); the figures are meaningless.
"""

import argparse
import contextlib
import hashlib
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.seaweed import SeaweedFS  # noqa: E402 - after the repository root is on sys.path

MB = 1e6
TARGET_VS_BOTO3 = 1.5
TARGET_VS_CP = 0.60
TARGET_HIT_SECONDS = 1.0


@contextlib.contextmanager
def seaweed(extra_args, tries=3):
    """A SeaweedFS server, started again on other ports if it exits at once: the free ports
    tests.seaweed picks may be taken before the server binds them (by another program, or by
    the server itself: one port's gRPC port, port + 10000, can be another of its ports)."""
    for attempt in range(1, tries + 1):
        server = SeaweedFS(extra_args=extra_args)
        try:
            server.start()
            break
        except RuntimeError as error:
            server.stop()
            if attempt == tries or "SeaweedFS exited" not in str(error):
                raise
            why = [line for line in str(error).splitlines() if "error" in line.lower()] or [""]
            print(f"SeaweedFS exited as it started (try {attempt}: {why[-1].strip()[:200]}): again, on other ports", flush=True)
    try:
        yield server
    finally:
        server.stop()


def drop_caches(drop=True):
    """Flush dirty pages and drop the page cache (unless drop is false); False where the kernel
    does not let us, or we were told not to."""
    os.sync()
    if not drop:
        return False
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def cpu_seconds(pid):
    """User + system CPU seconds of a process so far (from /proc)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except OSError:
        return float("nan")


def own_cpu_seconds():
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def make_files(folder, count, size, start=0):
    """count files of size random bytes in folder; returns [(path, size, sha256)]."""
    folder.mkdir(parents=True, exist_ok=True)
    made = []
    for i in range(start, start + count):
        path = folder / f"part-{i:04d}.bin"
        digest = hashlib.sha256()
        with open(path, "wb") as f:
            left = size
            while left:
                block = os.urandom(min(left, 4 << 20))
                digest.update(block)
                f.write(block)
                left -= len(block)
        made.append((path, size, digest.hexdigest()))
    return made


def upload(storage, files):
    """Keep each file as a blob through our S3Storage; returns the staging Items."""
    from core.storage import blob_key
    from jobs.manifest import Item

    items = []
    for path, size, sha in files:
        key = blob_key(sha)
        stored_size, stored_sha = storage.save_file(key, path)
        assert (stored_size, stored_sha) == (size, sha), f"{path}: stored {stored_size} bytes, {stored_sha}"
        items.append(Item(f"data/train/{path.name}", size, sha, ("storage", key), "train"))
    return items


class Timed:
    """One timed transfer: seconds to return, seconds to return plus a sync, CPU seconds used by
    this process (and its children) and by the S3 server meanwhile."""

    def __init__(self, server_pid):
        self.server_pid = server_pid

    def __enter__(self):
        self.cpu0, self.server0 = own_cpu_seconds(), cpu_seconds(self.server_pid)
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if exc[0] is not None:
            return
        self.seconds = time.perf_counter() - self.t0
        self.cpu = own_cpu_seconds() - self.cpu0
        self.server_cpu = cpu_seconds(self.server_pid) - self.server0
        os.sync()
        self.synced = time.perf_counter() - self.t0


def run_ours(items, cache_root, workers, server_pid):
    from agent.cache import BlobCache
    from agent.staging import stage

    cache = BlobCache(cache_root, limit_bytes=1 << 50)
    with Timed(server_pid) as timed:
        progress = stage(items, cache, {}, workers=workers)
    assert progress.files_done == len(items) and progress.bytes_moved == sum(i.size for i in items), progress
    assert all(cache.path(i.sha256).stat().st_size == i.size for i in items)
    return timed, cache


def run_boto3(sea, bucket, keys, dest, server_pid):
    import boto3
    from botocore.config import Config

    # A fresh client with default settings; path-style addressing is what SeaweedFS on loopback
    # needs. download_file with no Config: boto3's default TransferConfig.
    client = boto3.client(
        "s3",
        endpoint_url=sea.endpoint,
        aws_access_key_id=sea.access_key,
        aws_secret_access_key=sea.secret_key,
        region_name="us-east-1",
        config=Config(s3={"addressing_style": "path"}),
    )
    dest.mkdir(parents=True)
    with Timed(server_pid) as timed:
        for i, key in enumerate(keys):
            client.download_file(bucket, key, str(dest / f"part-{i:04d}.bin"))
    client.close()
    return timed


def run_cp(src, dest, server_pid):
    with Timed(server_pid) as timed:
        subprocess.run(["cp", "-r", str(src), str(dest)], check=True)
    return timed


def describe(name, timed, total):
    return (
        f"  {name:<6} {total / timed.seconds / MB:8.1f} MB/s  ({timed.seconds:6.2f} s; "
        f"{total / timed.synced / MB:7.1f} MB/s to the end of a sync after it, {timed.synced:6.2f} s); "
        f"CPU: this process {timed.cpu:5.2f} s, S3 server {timed.server_cpu:5.2f} s"
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=1024, help="the dataset's size in all (MiB)")
    parser.add_argument("--files", type=int, default=64, help="how many files it has")
    parser.add_argument("--repeat", type=int, default=5, help="rounds of the three transfers")
    parser.add_argument("--workers", type=int, default=None, help="stage()'s workers (default: the runner's setting)")
    parser.add_argument("--weed-arg", action="append", default=[], help="an extra `weed server` flag (repeatable), e.g. -filer.maxMB=16")
    parser.add_argument("--quick", action="store_true", help="8 MiB in 10 files, one round, the page cache left alone (CI: the benchmark still works)")
    args = parser.parse_args()
    if args.quick:
        args.size_mib, args.files, args.repeat = 8, 10, 1
    drop = not args.quick
    if args.files < 1 or args.size_mib < 1 or args.repeat < 1:
        parser.error("--size-mib, --files and --repeat must be at least 1")
    file_size = args.size_mib * 1024 * 1024 // args.files
    total = file_size * args.files
    new_count = max(1, round(args.files * 0.10))

    work = Path(tempfile.mkdtemp(prefix="e31-bench-staging-"))
    try:
        with seaweed(args.weed_arg) as sea:
            bucket = sea.bucket("bench")
            os.environ.update(sea.settings_env(bucket, prefix="store"))
            os.environ["E31_VAR_DIR"] = str(work / "var")
            os.environ.setdefault("DJANGO_SETTINGS_MODULE", "e31web.settings")
            import django

            django.setup()
            from django.conf import settings

            from core.storage import get_storage

            workers = args.workers or settings.E31_STAGING_WORKERS
            storage = get_storage()
            server_pid = sea.process.pid

            started = time.perf_counter()
            files = make_files(work / "dataset", args.files, file_size)
            generated = time.perf_counter() - started
            items = upload(storage, files)
            uploaded = time.perf_counter() - started - generated
            keys = [storage._key(item.source[1]) for item in items]
            print(
                f"dataset: {args.files} files of {file_size / MB:.2f} MB, {total / MB:,.1f} MB in all "
                f"(generated in {generated:.1f} s, uploaded through S3Storage in {uploaded:.1f} s, "
                f"{total / uploaded / MB:.1f} MB/s); staging with {workers} workers",
                flush=True,
            )
            dropped = drop_caches(drop)
            print(
                "page cache dropped before each transfer (sources read from the disk)"
                if dropped
                else "quick: the page cache left alone: sources may be read from memory"
                if not drop
                else "could not drop the page cache (not root?): sources may be read from memory",
                flush=True,
            )

            runs = {"ours": [], "boto3": [], "cp": []}
            cache = None
            for r in range(args.repeat):
                order = ["ours", "boto3", "cp"]
                order = order[r % 3 :] + order[: r % 3]
                print(f"round {r + 1}:", flush=True)
                for name in order:
                    if name == "ours" and cache is not None:
                        shutil.rmtree(cache.root)
                    target = work / f"{name}-{r}"
                    drop_caches(drop)
                    if name == "ours":
                        timed, cache = run_ours(items, target, workers, server_pid)
                    elif name == "boto3":
                        timed = run_boto3(sea, bucket, keys, target, server_pid)
                    else:
                        timed = run_cp(work / "dataset", target, server_pid)
                    runs[name].append(timed)
                    print(describe(name, timed, total), flush=True)
                    if name != "ours":
                        shutil.rmtree(target)

            from agent.cache import BlobCache
            from agent.staging import stage

            # The same manifest again: every file is a cache hit.
            hits = []
            for _ in range(3):
                t0 = time.perf_counter()
                progress = stage(items, BlobCache(cache.root, cache.limit_bytes), {}, workers=workers)
                hits.append(time.perf_counter() - t0)
                assert progress.bytes_moved == 0 and progress.files_done == len(items), progress

            # A new version: 10% of the files new, the rest as before.
            new_files = make_files(work / "new", new_count, file_size, start=args.files)
            new_items = upload(storage, new_files)
            delta = items[: args.files - new_count] + new_items
            wire = []

            def count_get(parsed=None, **kwargs):
                if parsed and "ContentLength" in parsed:
                    wire.append(parsed["ContentLength"])

            storage.client.meta.events.register("after-call.s3.GetObject", count_get)
            try:
                cache = BlobCache(cache.root, cache.limit_bytes)
                before = set(cache.sizes)
                drop_caches(drop)
                t0 = time.perf_counter()
                progress = stage(delta, cache, {}, workers=workers)
                delta_seconds = time.perf_counter() - t0
            finally:
                storage.client.meta.events.unregister("after-call.s3.GetObject", count_get)
            added = sum(size for sha, size in cache.sizes.items() if sha not in before)
            new_bytes = sum(item.size for item in new_items)

        def median(name, attr="seconds"):
            return statistics.median(total / getattr(t, attr) for t in runs[name]) / MB

        ours, boto, cp = median("ours"), median("boto3"), median("cp")
        ours_s, boto_s, cp_s = median("ours", "synced"), median("boto3", "synced"), median("cp", "synced")
        n = args.repeat
        print(f"our staging, median of {n}: {ours:.1f} MB/s ({ours_s:.1f} MB/s to the end of a sync)")
        print(f"plain boto3 download_file loop (default settings), median of {n}: {boto:.1f} MB/s ({boto_s:.1f} MB/s to the end of a sync)")
        print(f"local cp -r of the same bytes, median of {n}: {cp:.1f} MB/s ({cp_s:.1f} MB/s to the end of a sync)")
        # Our staging returns with its bytes on the disk (each file is fsynced before the cache
        # trusts it); cp returns with them in the page cache. The disk's rate is cp's to the end
        # of its sync, so that is the comparison the target is about; both are printed.
        print(
            f"our staging / local cp, both to their bytes on the disk: {ours_s / cp_s:.2f}   target >= {TARGET_VS_CP:.2f}   "
            f"(to their return: {ours / cp:.2f}; cp's return leaves its bytes in memory)"
        )
        print(
            f"stage again (all cache hits): {statistics.median(hits) * 1000:.1f} ms median of {len(hits)} "
            f"(max {max(hits) * 1000:.1f} ms)   target < {TARGET_HIT_SECONDS:.0f} s"
        )
        print(
            f"delta ({args.files - new_count} old + {new_count} new files): moved {progress.bytes_moved:,} bytes "
            f"in {delta_seconds:.2f} s (GetObject responses {sum(wire):,} bytes in {len(wire)}, "
            f"added to the cache {added:,}); the new files hold {new_bytes:,} bytes   "
            f"{'equal' if progress.bytes_moved == sum(wire) == added == new_bytes else 'NOT EQUAL'}"
        )
        print(f"ratio (our staging / plain boto3 loop): {ours / boto:.2f}   target >= {TARGET_VS_BOTO3:.1f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if not progress.bytes_moved == sum(wire) == added == new_bytes:
        sys.exit("the delta moved other bytes than its new files'")


if __name__ == "__main__":
    main()
