"""Staging with real runners, a real cache and real S3 (SeaweedFS): data moves before compute
is held, the cache spares repeat transfers, deltas move only new bytes, and a corrupt or
missing object fails the job before it costs anything."""

import json
import time
from datetime import timedelta

import pytest
from django.urls import reverse
from django.utils import timezone

from agent.cache import BlobCache
from billing.models import UsageRecord
from catalog import datasets
from jobs.models import Job
from scheduler import allocations, policy, services
from scheduler.models import Allocation, CachedBlob, Node, Staging
from tests.conftest import make_job

pytestmark = [pytest.mark.runs_jobs, pytest.mark.timeout(180), pytest.mark.django_db(transaction=True)]

READ_DATA = b"""
import json, os
root = os.path.join(os.environ["E31_DATA_DIR"], "train")
print(json.dumps(sorted((os.path.relpath(os.path.join(d, f), root), os.path.getsize(os.path.join(d, f)))
                        for d, _, files in os.walk(root) for f in files)))
print(json.dumps(dict(os.environ)))
"""


def drive(runners, done, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        services.line_up()
        services.schedule()
        for runner in runners:
            runner.step()
        if done():
            return
        time.sleep(0.05)
    raise TimeoutError("not there in time")


def run(runners, job):
    drive(runners, lambda: Job.objects.get(pk=job.pk).is_terminal)
    job.refresh_from_db()
    return job


def files_seen(job):
    first = job.events.filter(kind="log").order_by("seq").first()
    return [tuple(pair) for pair in json.loads(first.text)]


def test_data_is_staged_before_compute_is_held(make_runner, alice, rate, team_a):
    runner = make_runner()
    dataset = datasets.create_dataset(team_a, "blocks", {f"part-{i}.bin": bytes([i]) * 50_000 for i in range(5)})
    job = run([runner], make_job(alice, script=READ_DATA, train_version=dataset.latest_version()))
    assert job.state == "succeeded"
    assert files_seen(job) == [(f"part-{i}.bin", 50_000) for i in range(5)]
    staging = job.stagings.get()
    allocation = job.allocations.get()
    assert staging.state == "staged" and staging.files_done == staging.files_total == 6  # 5 data files + the script
    assert staging.bytes_moved == staging.bytes_total == 250_000 + len(READ_DATA)
    assert staging.finished_at <= allocation.started_at, "the meter started only once the data was in place"
    progress = [e.data for e in job.events.filter(kind="staging").order_by("seq")]
    assert progress[-1]["state"] == "staged" and progress[-1]["bytes_done"] == staging.bytes_total


def test_a_second_job_on_the_same_data_stages_nothing(make_runner, alice, rate, team_a):
    runner = make_runner()
    dataset = datasets.create_dataset(team_a, "blocks", {f"part-{i}.bin": bytes([i]) * 40_000 for i in range(4)})
    first = run([runner], make_job(alice, script=READ_DATA, train_version=dataset.latest_version()))
    second = run([runner], make_job(alice, script=READ_DATA, train_version=dataset.latest_version()))
    assert first.state == second.state == "succeeded"
    assert first.stagings.get().bytes_moved > 160_000
    assert second.stagings.get().bytes_moved == 0
    assert files_seen(second) == files_seen(first)


def test_a_delta_moves_only_the_new_bytes(make_runner, alice, rate, team_a):
    runner = make_runner()
    dataset = datasets.create_dataset(team_a, "grows", {f"old-{i}.bin": bytes([i]) * 30_000 for i in range(6)})
    run([runner], make_job(alice, script=READ_DATA, train_version=dataset.latest_version()))
    new_files = {"new-0.bin": b"n" * 12_345, "new-1.bin": b"m" * 6_789}
    version = datasets.add_files(dataset, new_files)
    assert version.number == 2 and version.file_count == 8
    job = run([runner], make_job(alice, script=READ_DATA, train_version=version))
    assert job.state == "succeeded"
    assert job.stagings.get().bytes_moved == 12_345 + 6_789
    assert len(files_seen(job)) == 8


def test_the_scheduler_lines_a_job_up_where_its_data_already_is(alice, rate, team_a):
    empty = Node.objects.create(name="empty", device_type="cpu", devices=4)
    holder = Node.objects.create(name="holder", device_type="cpu", devices=1)
    dataset = datasets.create_dataset(team_a, "big", {"a.bin": b"a" * 1000, "b.bin": b"b" * 1000})
    for item in dataset.latest_version().files.all():
        CachedBlob.objects.create(node=holder, sha256=item.sha256, size=item.size)
    job = make_job(alice, train_version=dataset.latest_version())
    [staging] = services.line_up()
    assert staging.job == job and staging.node == holder
    # All else equal (nothing cached anywhere), the node with fewer jobs lined up is chosen.
    other = make_job(alice, name="other")
    [staging] = services.line_up()
    assert staging.job == other and staging.node == empty


def test_choosing_a_staging_node_prefers_cached_bytes_then_fewer_lined_up():
    now = timezone.now()
    job = policy.QueuedJob(id="j", gpus=2, submitted_at=now)
    nodes = [
        policy.NodeState(id="a", device_type="cpu", devices=8, free=tuple(range(8))),
        policy.NodeState(id="b", device_type="cpu", devices=2, free=()),
        policy.NodeState(id="c", device_type="cpu", devices=1, free=(0,)),  # too small
    ]
    assert policy.choose_staging_node(job, nodes, {"b": 10, "c": 999}, {}) == "b"
    assert policy.choose_staging_node(job, nodes, {}, {"a": 3}) == "b"
    assert policy.choose_staging_node(job, nodes, {}, {}) == "a"
    assert policy.choose_staging_node(policy.QueuedJob(id="x", gpus=9, submitted_at=now), nodes, {}, {}) is None


def test_a_job_is_placed_only_where_its_data_is_staged(alice, rate):
    busy_but_staged = Node.objects.create(name="staged", device_type="cpu", devices=1)
    Node.objects.create(name="idle", device_type="cpu", devices=1)
    job = make_job(alice)
    Staging.objects.create(job=job, node=busy_but_staged, state=Staging.STAGING, bytes_total=100, bytes_done=40)
    assert services.schedule() == []
    job.refresh_from_db()
    assert job.wait_reason == "staging its data on staged: 40% done"
    Staging.objects.update(state=Staging.STAGED)
    [allocation] = services.schedule()
    assert allocation.node == busy_but_staged


def test_another_staging_node_is_chosen_only_when_the_staged_ones_are_busy_and_another_is_free():
    now = timezone.now()
    job = policy.QueuedJob(id="j", gpus=2, submitted_at=now, gpu_type="cpu")
    nodes = [
        policy.NodeState(id="a", device_type="cpu", devices=2, free=()),
        policy.NodeState(id="b", device_type="cpu", devices=4, free=(0, 1, 2, 3)),
        policy.NodeState(id="c", device_type="cpu", devices=2, free=(0, 1)),
        policy.NodeState(id="g", device_type="gpu", devices=8, free=tuple(range(8))),
    ]
    choose = policy.choose_another_staging_node
    spare = {"a": 0, "b": 4, "c": 2, "g": 8}
    assert choose(job, nodes, frozenset({"a"}), spare, {}, {}) == "b"  # the most spare devices, all else equal
    assert choose(job, nodes, frozenset({"a"}), spare, {"c": 10}, {}) == "c"  # where its data already is
    assert choose(job, nodes, frozenset({"a"}), spare, {}, {"b": 2}) == "c"  # fewer lined up
    assert choose(job, nodes, frozenset({"a"}), {**spare, "a": 2}, {}, {}) is None  # its own node has room
    assert choose(job, nodes, frozenset({"a"}), {"a": 0, "b": 1, "c": 1, "g": 8}, {}, {}) is None  # none spare enough
    assert choose(job, nodes, frozenset({"a"}), {"g": 8}, {}, {}) is None  # only another type is free
    untyped = policy.QueuedJob(id="t", gpus=2, submitted_at=now)
    assert choose(untyped, nodes, frozenset({"a"}), {"g": 8}, {}, {}) == "g"  # any type will do
    assert choose(job, nodes, frozenset({"a", "b", "c"}), {"g": 8}, {}, {}) is None  # on MAX_STAGING_NODES already
    assert choose(policy.QueuedJob(id="w", gpus=16, submitted_at=now), nodes, frozenset({"g"}), spare, {}, {}) is None  # a gang


def test_a_job_whose_staged_node_is_busy_is_staged_on_a_free_one_too(alice, rate):
    busy = Node.objects.create(name="busy", device_type="cpu", devices=1)
    blocker = make_job(alice, name="blocker")
    Job.objects.filter(pk=blocker.pk).update(state="running")
    Allocation.objects.create(job=blocker, node=busy, devices=[0], device_type="cpu", rate=rate.per_gpu_hour, started_at=timezone.now())
    waiting = make_job(alice, name="waiting")
    Staging.objects.create(job=waiting, node=busy, state=Staging.STAGED)
    behind = make_job(alice, name="behind")
    Staging.objects.create(job=behind, node=busy, state=Staging.STAGED)
    assert services.line_up() == []  # no other node: it waits for its own
    free = Node.objects.create(name="free", device_type="cpu", devices=1)
    [second] = services.line_up()
    # The first in the queue gets the free node; the one behind it does not pile onto the same device.
    assert (second.job, second.node) == (waiting, free)
    assert services.line_up() == []
    Staging.objects.filter(pk=second.pk).update(state=Staging.STAGED)
    [allocation] = services.schedule()
    assert (allocation.job, allocation.node) == (waiting, free)


def test_a_staging_whose_job_left_the_queue_is_abandoned_not_failed(make_runner, alice, rate):
    runner = make_runner()
    job = make_job(alice)
    staging = Staging.objects.create(job=job, node=runner.node)
    job.request_cancel()
    runner.run_staging(staging.pk)
    staging.refresh_from_db()
    job.refresh_from_db()
    assert staging.state == "abandoned" and "left the queue" in staging.error
    assert job.state == "cancelled" and runner.cache.total_bytes == 0


def test_a_staging_on_a_lost_node_is_abandoned_and_the_job_lined_up_again(alice, rate, settings):
    lost = Node.objects.create(name="lost", device_type="cpu", devices=1)
    job = make_job(alice)
    [first] = services.line_up()
    assert first.node == lost
    alive = Node.objects.create(name="alive", device_type="cpu", devices=1)
    Node.objects.filter(pk=lost.pk).update(last_heartbeat=timezone.now() - timedelta(seconds=settings.E31_NODE_TIMEOUT_SECONDS + 1))
    allocations.expire_lost_nodes()
    first.refresh_from_db()
    assert first.state == "abandoned" and "was lost" in first.error
    [second] = services.line_up()
    assert second.job == job and second.node == alive


def test_the_cache_evicts_the_least_recently_used_but_never_what_is_needed(tmp_path):
    import hashlib
    import os

    cache = BlobCache(tmp_path / "cache", limit_bytes=250)
    digests = []
    for i in range(3):
        data = bytes([i]) * 100
        sha = hashlib.sha256(data).hexdigest()
        tmp = cache.temp_path(sha)
        tmp.write_bytes(data)
        cache.put(tmp, sha)
        os.utime(cache.path(sha), (1000 + i, 1000 + i))  # put at distinct times
        digests.append(sha)
    assert cache.total_bytes == 300
    assert cache.evict(protect={digests[0]}) == [digests[1]]  # the oldest is needed; the next goes
    assert cache.has(digests[0]) and not cache.has(digests[1]) and cache.has(digests[2])
    assert oct(cache.path(digests[0]).stat().st_mode & 0o777) == "0o444"
    # A new cache over the same folder knows what is there.
    assert set(BlobCache(tmp_path / "cache", 1000).sizes) == {digests[0], digests[2]}


def put_bytes(cache, data):
    import hashlib

    sha = hashlib.sha256(data).hexdigest()
    tmp = cache.temp_path(sha)
    tmp.write_bytes(data)
    cache.put(tmp, sha)
    return sha


def test_a_cache_file_changed_since_it_entered_is_dropped(tmp_path):
    import os

    cache = BlobCache(tmp_path / "cache", limit_bytes=10_000)
    kept, changed, chmodded = (put_bytes(cache, bytes([i]) * 100) for i in range(3))
    mtime = cache.path(kept).stat().st_mtime_ns
    assert cache.has(kept) and cache.path(kept).stat().st_mtime_ns == mtime  # use moves the atime only
    # A job running as the runner's user can chmod its hard link back to writable and write.
    os.chmod(cache.path(changed), 0o644)
    cache.path(changed).write_bytes(b"tampered" * 10)
    os.chmod(cache.path(changed), 0o444)
    os.chmod(cache.path(chmodded), 0o644)
    assert sorted(cache.check([kept, changed, chmodded])) == sorted([changed, chmodded])
    assert cache.has(kept) and not cache.has(changed) and not cache.has(chmodded)
    assert not cache.path(changed).exists()
    # After a restart, a file left writable is not trusted either.
    os.chmod(cache.path(kept), 0o644)
    assert BlobCache(tmp_path / "cache", 10_000).sizes == {}


def test_a_shared_cache_sees_what_another_agent_put_and_keeps_its_half_fetched_files(tmp_path):
    """The node's agents under Slurm, a process each, keep one cache: a file one of them put is
    there for the others, and a new one never removes a file another is still fetching."""
    import subprocess
    import sys

    first = BlobCache(tmp_path / "cache", 10_000, shared=True)
    second = BlobCache(tmp_path / "cache", 10_000, shared=True)
    sha = put_bytes(first, b"x" * 100)
    assert second.has(sha) and second.sizes == {sha: 100}
    fetching = first.temp_path("a" * 64)
    fetching.write_bytes(b"half")
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    abandoned = first.tmp / f"{'b' * 64}.{finished.stdout.strip()}.0"  # its fetcher has gone
    abandoned.write_bytes(b"half")
    BlobCache(tmp_path / "cache", 10_000, shared=True)
    assert fetching.exists() and not abandoned.exists()
    # A runner's own cache (one process) takes every leftover as an earlier run's.
    BlobCache(tmp_path / "cache", 10_000)
    assert not fetching.exists()


def test_a_shared_cache_is_evicted_only_while_no_agent_stages_or_links(tmp_path):
    import os

    agent = BlobCache(tmp_path / "cache", limit_bytes=250, shared=True)
    other = BlobCache(tmp_path / "cache", limit_bytes=250, shared=True)
    digests = [put_bytes(agent, bytes([i]) * 100) for i in range(2)]
    digests.append(put_bytes(other, bytes([2]) * 100))  # put by another agent since
    for at, sha in enumerate(digests):
        os.utime(agent.path(sha), (1000 + at, 1000 + at))
    with other.using():  # the other agent is staging or linking
        assert agent.evict() == []
        assert all(agent.path(sha).exists() for sha in digests)
    assert agent.evict() == [digests[0]]  # the folder read again: 300 bytes, the oldest goes
    assert not other.has(digests[0]) and other.has(digests[1]) and other.has(digests[2])


def test_a_job_that_writes_to_its_data_does_not_spoil_the_cache(make_runner, alice, rate, team_a, settings):
    settings.E31_JOB_ISOLATION = False  # the job runs as the runner's user: it could chmod the link
    runner = make_runner()
    dataset = datasets.create_dataset(team_a, "fragile", {"a.bin": b"a" * 5000})
    spoil = b"""
import os
path = os.path.join(os.environ["E31_DATA_DIR"], "train", "a.bin")
os.chmod(path, 0o644)
with open(path, "wb") as f:
    f.write(b"spoiled")
"""
    first = run([runner], make_job(alice, script=spoil, train_version=dataset.latest_version()))
    assert first.state == "succeeded"
    second = run([runner], make_job(alice, script=READ_DATA, train_version=dataset.latest_version()))
    assert second.state == "succeeded"
    assert files_seen(second) == [("a.bin", 5000)]  # the original bytes, staged again
    assert second.stagings.get().bytes_moved == 5000 + len(READ_DATA)  # its script, and a.bin again
    assert CachedBlob.objects.filter(node=runner.node, sha256=dataset.latest_version().files.get().sha256).exists()


def test_the_runner_keeps_the_scheduler_informed_of_its_cache(make_runner, alice, rate, team_a):
    runner = make_runner(cache_bytes=10_000_000)
    dataset = datasets.create_dataset(team_a, "tiny", {"x.bin": b"x" * 1000})
    run([runner], make_job(alice, train_version=dataset.latest_version()))
    [item] = dataset.latest_version().files.all()
    assert CachedBlob.objects.filter(node=runner.node, sha256=item.sha256, size=1000).exists()


# Registered buckets and S3 storage ---------------------------------------------------------


@pytest.fixture
def team_bucket(seaweed):
    bucket = seaweed.bucket("team")
    client = seaweed.client()
    for i in range(3):
        client.put_object(Bucket=bucket, Key=f"corpus/shard-{i}.txt", Body=f"shard {i}\n".encode() * 1000)
    client.put_object(Bucket=bucket, Key="corpus/nested/extra.txt", Body=b"extra\n")
    return bucket


def register(team, seaweed, bucket, name="corpus"):
    dataset = datasets.register_s3(team, name, f"s3://{bucket}/corpus", seaweed.access_key, seaweed.secret_key, endpoint_url=seaweed.endpoint)
    [version] = datasets.claim_scans()
    return dataset, datasets.scan(version)


def test_a_registered_bucket_is_scanned_staged_and_read_by_the_job(make_runner, alice, rate, team_a, seaweed, team_bucket, s3_storage):
    _dataset, version = register(team_a, seaweed, team_bucket)
    assert version.state == "ready", version.error
    assert sorted(version.files.values_list("path", "size")) == [("nested/extra.txt", 6), ("shard-0.txt", 8000), ("shard-1.txt", 8000), ("shard-2.txt", 8000)]
    runner = make_runner()
    job = run([runner], make_job(alice, script=READ_DATA, train_version=version))
    assert job.state == "succeeded", job.reason
    assert files_seen(job) == [("nested/extra.txt", 6), ("shard-0.txt", 8000), ("shard-1.txt", 8000), ("shard-2.txt", 8000)]
    # Neither the team's keys nor the network's storage keys reach the job.
    env_line = job.events.filter(kind="log").order_by("seq")[1].text
    env = json.loads(env_line)
    assert seaweed.access_key not in env_line and seaweed.secret_key not in env_line
    assert not any(name.startswith(("AWS_", "E31_S3", "E31_STORAGE")) for name in env)


READ_CHANNEL = b"""
import json, os
root = os.environ["SM_CHANNEL_CORPUS"]
print(json.dumps(sorted((os.path.relpath(os.path.join(d, f), root), os.path.getsize(os.path.join(d, f)))
                        for d, _, files in os.walk(root) for f in files)))
print(json.dumps([root, os.environ["SM_CHANNELS"]]))
"""


def test_a_registered_bucket_is_a_named_input_too(make_runner, alice, rate, team_a, seaweed, team_bucket, s3_storage):
    """A named input may be a prefix the team registered (SageMaker's S3 channels): staged from
    the team's bucket into data/<name> like any dataset version, with no training set at all."""
    from jobs.models import JobInput

    _dataset, version = register(team_a, seaweed, team_bucket)
    runner = make_runner()
    job = make_job(alice, script=READ_CHANNEL)
    JobInput.objects.create(job=job, name="corpus", version=version, label=version.label)
    job = run([runner], job)
    assert job.state == "succeeded", job.reason
    assert files_seen(job) == [("nested/extra.txt", 6), ("shard-0.txt", 8000), ("shard-1.txt", 8000), ("shard-2.txt", 8000)]
    root, channels = json.loads(job.events.filter(kind="log").order_by("seq")[1].text)
    assert root.endswith("/data/corpus") and "corpus" in json.loads(channels)
    assert job.stagings.get().bytes_total >= 3 * 8000 + 6


def test_a_corrupted_object_fails_the_job_before_any_charge(make_runner, alice, rate, team_a, seaweed, team_bucket):
    _dataset, version = register(team_a, seaweed, team_bucket)
    seaweed.client().put_object(Bucket=team_bucket, Key="corpus/shard-1.txt", Body=b"tampered" * 1000)
    runner = make_runner()
    job = run([runner], make_job(alice, script=READ_DATA, train_version=version))
    assert job.state == "failed"
    assert "data/train/shard-1.txt" in job.reason and "SHA-256 does not match" in job.reason
    assert not job.allocations.exists() and not UsageRecord.objects.filter(job=job).exists()
    assert job.stagings.get().state == "failed"


def test_a_vanished_object_fails_the_job_with_its_name(make_runner, alice, rate, team_a, seaweed, team_bucket):
    _dataset, version = register(team_a, seaweed, team_bucket)
    seaweed.client().delete_object(Bucket=team_bucket, Key="corpus/shard-2.txt")
    runner = make_runner()
    job = run([runner], make_job(alice, script=READ_DATA, train_version=version))
    assert job.state == "failed" and "shard-2.txt is missing" in job.reason


def test_the_job_page_and_api_show_the_staging(make_runner, alice, rate, team_a, client):
    runner = make_runner()
    dataset = datasets.create_dataset(team_a, "blocks", {"a.bin": b"a" * 2048})
    job = run([runner], make_job(alice, train_version=dataset.latest_version()))
    client.force_login(alice)
    page = client.get(reverse("jobs:detail", args=[job.pk])).content.decode()
    assert 'id="staging"' in page and "state-staged" in page and "on node-a" in page
    assert "blocks@1" in page  # the training set, as specs and the API name it
    body = client.get(reverse("api:job", args=[job.pk])).json()
    assert body["staging"]["state"] == "staged" and body["staging"]["bytes_total"] == 2048 + job.uploads.get().size
    assert body["train_dataset"] == "blocks@1"
