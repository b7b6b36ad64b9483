"""A script's smoke run (issue 21): a job of its own on a sample of each input (agent/smoke.py
decides which files and lines), with E31_SMOKE=1, for at most E31_SMOKE_MINUTES; it passes if
it has not failed by then, and the full run, on all of its data, starts only if it passes."""

import io
import json
import os
from decimal import Decimal

import pytest
from django.urls import reverse
from hypothesis import given
from hypothesis import strategies as st

from agent import smoke
from catalog import datasets
from jobs import lineage
from jobs.models import Job
from scheduler.models import Allocation
from tests.conftest import make_job
from tests.test_staging import drive

ROWS = b"x,y\n" + b"".join(f"{i},{i * i}\n".encode() for i in range(1000))

SEE_DATA = b"""
import json, os
root = os.path.join(os.environ["E31_DATA_DIR"], "train")
seen = {}
for name in sorted(os.listdir(root)):
    with open(os.path.join(root, name), "rb") as f:
        lines = f.read().splitlines()
    seen[name] = {"lines": len(lines), "size": os.path.getsize(os.path.join(root, name)), "first": lines[0].decode() if name.endswith(".csv") else None}
print(json.dumps({"smoke": os.environ.get("E31_SMOKE"), "files": seen}))
"""


# Which files and which lines: pure decisions ------------------------------------------------------


@pytest.mark.nodb
def test_a_smoke_run_keeps_one_percent_and_at_least_one():
    assert [smoke.sample_size(n) for n in (0, 1, 99, 100, 101, 700, 1000, 12345)] == [0, 1, 1, 1, 2, 7, 10, 124]


@pytest.mark.nodb
def test_a_csv_keeps_its_header_and_one_percent_of_its_lines():
    lines = smoke.choose_lines(1001, True, "job-1:data/train/rows.csv")
    assert lines[0] == 0 and len(lines) == 11
    assert lines == sorted(set(lines)) and lines[1] > 0 and lines[-1] < 1001
    # The same job sees the same sample; another job another.
    assert smoke.choose_lines(1001, True, "job-1:data/train/rows.csv") == lines
    assert smoke.choose_lines(1001, True, "job-2:data/train/rows.csv") != lines
    # JSONL and text files have no header line.
    assert smoke.line_kind("data/train/rows.CSV") is True and smoke.line_kind("data/x/a.jsonl") is False
    assert smoke.line_kind("data/x/notes.txt") is False and smoke.line_kind("data/x/a.npz") is None
    assert len(smoke.choose_lines(1000, False, "s")) == 10


@pytest.mark.nodb
def test_a_small_file_keeps_at_least_one_data_line():
    assert smoke.choose_lines(3, True, "s")[0] == 0 and len(smoke.choose_lines(3, True, "s")) == 2
    assert smoke.choose_lines(1, True, "s") == [0]  # a header alone
    assert len(smoke.choose_lines(5, False, "s")) == 1
    assert smoke.choose_lines(0, True, "s") == smoke.choose_lines(0, False, "s") == []


@pytest.mark.nodb
def test_other_files_are_sampled_per_input_and_the_rest_is_kept():
    dests = [f"data/train/images/{i:03}.png" for i in range(250)] + [
        "data/train/labels.csv",
        "data/heldout/only.bin",
        "code/train.py",
        "model/start/model.pt",
    ]
    dropped = smoke.choose_files(dests, "job-1")
    kept = [d for d in dests if d not in dropped]
    assert len([d for d in kept if d.endswith(".png")]) == 3  # 1% of 250, rounded up
    assert {"data/train/labels.csv", "data/heldout/only.bin", "code/train.py", "model/start/model.pt"} <= set(kept)
    assert smoke.choose_files(dests, "job-1") == dropped
    assert smoke.choose_files(dests, "job-2") != dropped


@pytest.mark.nodb
@given(count=st.integers(0, 5000), header=st.booleans(), seed=st.text(max_size=8))
def test_a_sample_of_lines_is_in_order_in_range_and_one_percent(count, header, seed):
    lines = smoke.choose_lines(count, header, seed)
    assert lines == sorted(set(lines)) and all(0 <= n < count for n in lines)
    kept_header = header and count > 0
    assert (0 in lines) >= kept_header
    assert len(lines) == kept_header + smoke.sample_size(count - kept_header)


@pytest.mark.nodb
def test_cutting_writes_new_files_and_never_touches_the_cached_blobs(tmp_path, monkeypatch):
    monkeypatch.setattr(smoke, "CHUNK", 7)  # lines across chunk boundaries
    blobs = tmp_path / "cache"
    blobs.mkdir()
    (blobs / "rows").write_bytes(ROWS)
    (blobs / "text").write_bytes(b"".join(f"line {i}\n".encode() for i in range(299)) + b"last, without a newline")
    for i in range(3):
        (blobs / f"part-{i}").write_bytes(bytes([i]) * 100)
    root = tmp_path / "job"
    links = {"data/train/rows.csv": "rows", "data/train/notes.txt": "text", **{f"data/train/part-{i}.bin": f"part-{i}" for i in range(3)}}
    for dest, blob in links.items():
        (root / dest).parent.mkdir(parents=True, exist_ok=True)
        os.link(blobs / blob, root / dest)
        os.chmod(blobs / blob, 0o444)
    summary = smoke.cut(root, list(links), seed="job-1")
    rows = (root / "data/train/rows.csv").read_bytes().splitlines(keepends=True)
    assert rows[0] == b"x,y\n" and len(rows) == 11 and set(rows[1:]) <= set(ROWS.splitlines(keepends=True))
    notes = (root / "data/train/notes.txt").read_bytes().splitlines()
    assert len(notes) == 3 and all(line.startswith(b"line ") or line == b"last, without a newline" for line in notes)
    assert len(list((root / "data/train").glob("*.bin"))) == 1
    assert summary == {"train": [3, 5, 14, 1301]}
    assert smoke.describe(summary) == "train: 3 of 5 files, 14 of 1301 lines"
    # The blobs are whole, and the job's files are new ones, readable by the job's uid.
    assert (blobs / "rows").read_bytes() == ROWS and (blobs / "part-2").read_bytes() == bytes([2]) * 100
    assert os.stat(root / "data/train/rows.csv").st_ino != os.stat(blobs / "rows").st_ino
    assert os.stat(root / "data/train/rows.csv").st_mode & 0o777 == 0o444
    assert not list(root.rglob(".smoke-*"))
    # Cut again (a restarted smoke run, staged afresh): the same sample.
    for dest, blob in links.items():
        (root / dest).unlink(missing_ok=True)
        os.link(blobs / blob, root / dest)
    smoke.cut(root, list(links), seed="job-1")
    assert (root / "data/train/rows.csv").read_bytes().splitlines(keepends=True) == rows


# Asking for one -------------------------------------------------------------------------------------


def test_a_script_job_asks_for_a_smoke_run_through_the_api(client, token, rate, alice):
    client.defaults["HTTP_AUTHORIZATION"] = f"Token {token}"
    code, data = io.BytesIO(b"print(1)\n"), io.BytesIO(ROWS)
    code.name, data.name = "train.py", "rows.csv"
    spec = {"name": "full", "gpus": 2, "span_hours": 3, "smoke_first": True, "config": {"epochs": 3}}
    response = client.post(reverse("api:jobs"), {"spec": json.dumps(spec), "code": code, "data": data})
    assert response.status_code == 201, response.json()
    job = Job.objects.get(pk=response.json()["id"])
    smoke_job = job.smoke_run
    assert response.json()["smoke_run"] == str(smoke_job.pk)
    assert smoke_job.name == "full (smoke run)" and smoke_job.entrypoint == "train.py" and smoke_job.parent_id == job.pk
    assert smoke_job.config == {"epochs": 3}  # a script's config is its own: no smoke option added
    assert smoke_job.gpus == 1 and smoke_job.span_hours == Decimal("0.0833")  # 5 minutes, at most
    assert sorted(smoke_job.uploads.values_list("role", "name")) == [("code", "train.py"), ("train", "rows.csv")]
    assert smoke_job.is_smoke_run() and not job.is_smoke_run()


# Real runs ------------------------------------------------------------------------------------------


def log_lines(job):
    return [e.text for e in job.events.filter(kind="log").order_by("seq")]


def notices(job):
    return [e.data["text"] for e in job.events.filter(kind="notice").order_by("seq")]


@pytest.mark.runs_jobs
@pytest.mark.timeout(180)
@pytest.mark.django_db(transaction=True)
def test_a_smoke_run_sees_a_sample_and_the_full_run_all_of_the_data(make_runner, alice, rate, team_a):
    runner = make_runner()
    files = {"rows.csv": ROWS, **{f"part-{i}.bin": bytes([i]) * 1000 for i in range(3)}}
    dataset = datasets.create_dataset(team_a, "rows", files)
    job = make_job(alice, script=SEE_DATA, name="full", train_version=dataset.latest_version())
    smoke_job = lineage.smoke_run(job)
    drive([runner], lambda: Job.objects.get(pk=job.pk).is_terminal, timeout=120)
    job.refresh_from_db()
    smoke_job.refresh_from_db()
    assert smoke_job.state == "succeeded" and job.state == "succeeded", (smoke_job.reason, job.reason)
    seen = json.loads(log_lines(smoke_job)[0])
    assert seen["smoke"] == "1"
    assert seen["files"]["rows.csv"]["lines"] == 11 and seen["files"]["rows.csv"]["first"] == "x,y"  # the header and 1% of 1000
    assert len([name for name in seen["files"] if name.endswith(".bin")]) == 1
    assert any(t.startswith("smoke run: a sample of its data (train: 2 of 4 files, 11 of 1001 lines)") for t in notices(smoke_job))
    # The full run: all of it, from the same cache, not a smoke run.
    full = json.loads(log_lines(job)[0])
    assert full == {
        "smoke": None,
        "files": {
            **{f"part-{i}.bin": {"lines": 1, "size": 1000, "first": None} for i in range(3)},
            "rows.csv": {"lines": 1001, "size": len(ROWS), "first": "x,y"},
        },
    }
    # Two jobs, each billed for its own allocation, the full run's after the smoke run's.
    first, second = smoke_job.allocations.get(), job.allocations.get()
    assert first.ended_at <= second.started_at


@pytest.mark.runs_jobs
@pytest.mark.timeout(180)
@pytest.mark.django_db(transaction=True)
def test_a_failed_smoke_run_keeps_the_full_run_from_starting(make_runner, alice, rate):
    runner = make_runner()
    script = b"import os, sys\nprint('trying')\nsys.exit(3 if os.environ.get('E31_SMOKE') == '1' else 0)\n"
    job = make_job(alice, script=script, name="full")
    smoke_job = lineage.smoke_run(job)
    drive([runner], lambda: Job.objects.get(pk=job.pk).is_terminal, timeout=120)
    job.refresh_from_db()
    smoke_job.refresh_from_db()
    assert smoke_job.state == "failed" and "exited with code 3" in smoke_job.reason
    assert job.state == "failed" and job.reason.startswith(f"its smoke run {smoke_job.short_id} failed")
    assert not job.allocations.exists() and smoke_job.allocations.count() == 1


@pytest.mark.runs_jobs
@pytest.mark.timeout(180)
@pytest.mark.django_db(transaction=True)
def test_a_smoke_run_still_running_at_its_time_passes(make_runner, alice, rate, settings):
    settings.E31_SMOKE_MINUTES = 0.15  # 9 seconds
    runner = make_runner()
    script = b"import os, time\nprint('smoke' if os.environ.get('E31_SMOKE') else 'full')\nif os.environ.get('E31_SMOKE'):\n    time.sleep(300)\n"
    job = make_job(alice, script=script, name="full")
    smoke_job = lineage.smoke_run(job)
    assert smoke_job.span_hours == Decimal("0.0025")
    drive([runner], lambda: Job.objects.get(pk=job.pk).is_terminal, timeout=120)
    job.refresh_from_db()
    smoke_job.refresh_from_db()
    assert smoke_job.state == "succeeded" and "it passes" in smoke_job.reason, smoke_job.reason
    allocation = smoke_job.allocations.get()
    assert allocation.end_reason == Allocation.LIMIT
    assert (allocation.ended_at - allocation.started_at).total_seconds() <= 9
    assert any("time is up (0.15 minutes at most) and it has not failed: it passes" in t for t in notices(smoke_job))
    assert job.state == "succeeded" and log_lines(job) == ["full"]
