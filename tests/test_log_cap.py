"""The log cap: a job's stored log stops at E31_JOB_LOG_MAX_BYTES; past it, lines are counted,
not stored, and the job keeps running. One line marks where storing stopped; the run's last line
says how much was not stored; a requeued job's new run counts what its earlier runs stored."""

from datetime import UTC, datetime

import pytest

from agent.logcap import MARKER_STREAM, LogBudget, line_bytes, size_text
from jobs.logs import stored_bytes
from jobs.models import JobEvent
from tests.conftest import make_job

AT = datetime(2025, 1, 1, tzinfo=UTC)


def lines(*texts, stream="stdout"):
    return [(stream, AT, text, None) for text in texts]


def texts(batch):
    return [line[2] for line in batch]


# The budget, without a database -----------------------------------------------------------------


@pytest.mark.nodb
def test_a_line_costs_its_utf8_bytes_and_its_newline():
    assert line_bytes("") == 1
    assert line_bytes("abc") == 4
    assert line_bytes("é") == 3  # two bytes in UTF-8, one character
    assert line_bytes("日本") == 7
    assert line_bytes("🔥") == 5


@pytest.mark.nodb
def test_sizes_read_as_the_cap_is_set():
    assert size_text(100 * 10**6) == "100 MB"
    assert size_text(50_000) == "50 KB"
    assert size_text(1024) == "1.02 KB"
    assert size_text(1_500_000_000) == "1.5 GB"
    assert size_text(999) == "999 bytes"


@pytest.mark.nodb
def test_under_the_cap_every_line_is_stored_and_nothing_is_said():
    budget = LogBudget(cap=100)
    batch = lines("a" * 9, "b" * 9)
    assert budget.take(batch) == batch
    assert budget.take([]) == []
    assert budget.summary(AT) == []


@pytest.mark.nodb
def test_a_line_that_reaches_the_cap_exactly_is_stored_and_the_next_is_not():
    budget = LogBudget(cap=20)
    assert texts(budget.take(lines("a" * 9, "b" * 9))) == ["a" * 9, "b" * 9]  # 10 + 10 = 20: exactly full
    stored = budget.take(lines(""))  # even an empty line costs a byte
    assert [line[0] for line in stored] == [MARKER_STREAM]
    assert stored[0][2].startswith("[e31] the log reached its cap of 20 bytes")
    assert (budget.dropped_lines, budget.dropped_bytes) == (1, 1)


@pytest.mark.nodb
def test_a_batch_straddling_the_cap_keeps_its_head_then_one_marker():
    budget = LogBudget(cap=25)
    at_drop = datetime(2025, 1, 1, 0, 0, 7, tzinfo=UTC)
    batch = [*lines("0" * 9, "1" * 9), ("stderr", at_drop, "2" * 9, None), *lines("3" * 9)]
    stored = budget.take(batch)
    assert stored[:2] == batch[:2]
    assert len(stored) == 3 and stored[2][0] == MARKER_STREAM and stored[2][1] == at_drop  # where it stopped
    assert (budget.dropped_lines, budget.dropped_bytes) == (2, 20)
    # Past the cap nothing is stored, not even a line that would still fit, and the marker is not repeated.
    assert budget.take(lines("x" * 5, "", "y")) == []
    assert (budget.dropped_lines, budget.dropped_bytes) == (5, 20 + 6 + 1 + 2)


@pytest.mark.nodb
def test_multibyte_text_is_counted_in_bytes_not_characters():
    budget = LogBudget(cap=12)
    stored = budget.take(lines("日本語", "é"))  # 9 bytes in 3 characters (and a newline), then 3 bytes
    assert texts(stored)[0] == "日本語" and stored[1][0] == MARKER_STREAM
    assert (budget.dropped_lines, budget.dropped_bytes) == (1, 3)


@pytest.mark.nodb
def test_the_run_s_last_line_says_how_much_was_not_stored_once():
    budget = LogBudget(cap=100 * 10**6, stored=100 * 10**6 - 5)
    budget.take(lines("ok!", "past", "past too"))
    [summary] = budget.summary(AT)
    assert summary == (MARKER_STREAM, AT, "[e31] 2 lines (14 bytes) past the log cap of 100 MB were not stored", None)
    assert budget.summary(AT) == []  # a finish tried again does not repeat it
    budget.take(lines("one more"))
    assert texts(budget.summary(AT)) == ["[e31] 1 line (9 bytes) past the log cap of 100 MB was not stored"]


@pytest.mark.nodb
def test_a_resumed_run_counts_what_earlier_runs_stored():
    budget = LogBudget(cap=100, stored=90)
    stored = budget.take(lines("a" * 8, "b"))  # 9 bytes fit in the 10 left; 2 more do not
    assert texts(stored)[0] == "a" * 8 and stored[1][0] == MARKER_STREAM
    assert budget.dropped_lines == 1


@pytest.mark.nodb
def test_a_run_that_starts_with_the_cap_reached_stores_nothing_and_does_not_say_it_again():
    for stored in (100, 250):  # exactly at the cap, and past it (an earlier run's marker lines)
        budget = LogBudget(cap=100, stored=stored)
        assert budget.take(lines("", "a")) == []
        assert (budget.dropped_lines, budget.dropped_bytes) == (2, 3)
        assert len(budget.summary(AT)) == 1


@pytest.mark.nodb
def test_each_node_of_a_gang_gets_an_equal_part_of_what_is_left():
    budgets = [LogBudget(cap=100, stored=40, shares=3) for _ in range(3)]
    for budget in budgets:
        assert texts(budget.take(lines("a" * 19)))[0] == "a" * 19  # 20 bytes each: 60 in all
        assert budget.take(lines(""))[0][0] == MARKER_STREAM


# The stored log, counted in the database as the budget counts it --------------------------------


@pytest.mark.django_db
def test_the_stored_log_is_counted_in_utf8_bytes_as_the_budget_counts_it(alice):
    job = make_job(alice)
    assert stored_bytes(job.pk) == 0
    texts_ = ["plain", "", "日本語 and é", "🔥" * 3]
    JobEvent.append_lines(job.pk, lines(*texts_))
    job.record("notice", data={"text": "not a log line: not counted"})
    other = make_job(alice, name="other")
    JobEvent.append_lines(other.pk, lines("another job's line"))
    assert stored_bytes(job.pk) == sum(line_bytes(t) for t in texts_) == 6 + 1 + 17 + 13


# A runner in this process ---------------------------------------------------------------------


@pytest.fixture
def runner(make_runner, settings):
    settings.E31_JOB_LOG_MAX_BYTES = 50_000
    return make_runner("log-cap-node")


def run_job(runner, job):
    from tests.test_runner import run_job as run

    return run(runner, job, timeout=90)


def log(job):
    return list(job.events.filter(kind="log").order_by("seq").values_list("stream", "text"))


PRINTED = 200_000
FAST_PRINTER = f"""
import sys
for i in range({PRINTED}):
    print(f"line {{i}}")
print("the end", file=sys.stderr)
""".encode()


@pytest.mark.timeout(120)
@pytest.mark.django_db(transaction=True)
def test_a_job_printing_fast_keeps_its_log_under_the_cap_and_succeeds(runner, alice, rate):
    job = run_job(runner, make_job(alice, script=FAST_PRINTER))
    assert job.state == "succeeded", job.reason
    stored = log(job)
    assert len(stored) < 10_000, "the log was not capped"
    *kept, (marker_stream, marker), (summary_stream, summary) = stored
    # What was stored is the log's head, in order, with no holes.
    assert kept == [("stdout", f"line {i}") for i in range(len(kept))]
    assert sum(line_bytes(text) for _, text in kept) <= 50_000 < sum(line_bytes(text) for _, text in kept) + line_bytes(f"line {len(kept)}")
    assert marker_stream == summary_stream == MARKER_STREAM
    assert marker.startswith("[e31] the log reached its cap of 50 KB")
    assert stored_bytes(job.pk) == sum(line_bytes(t) for _, t in kept) + line_bytes(marker) + line_bytes(summary)
    # The one line that says how much was not stored: everything printed, less what was kept.
    printed = [f"line {i}" for i in range(PRINTED)] + ["the end"]
    not_stored = sum(line_bytes(text) for text in printed[len(kept) :])
    assert summary == f"[e31] {len(printed) - len(kept)} lines ({not_stored} bytes) past the log cap of 50 KB were not stored"


# Prints past the cap on every run; the first run then waits to be preempted (and requeued).
RUN_TWICE = b"""
import os, sys, time
restart = os.environ["E31_RESTART"]
for i in range(4000):  # 16 bytes a line: 64,000 in all
    print(f"run {restart} line {i:04d}")
sys.stdout.flush()
if restart == "0":
    time.sleep(600)
"""


@pytest.mark.timeout(120)
@pytest.mark.django_db(transaction=True)
def test_a_requeued_job_counts_what_its_earlier_runs_stored(runner, alice, rate):
    from django.utils import timezone as django_timezone

    from scheduler.models import Allocation
    from tests.test_runner import run_until

    job = make_job(alice, script=RUN_TWICE)
    run_until(runner, lambda: job.events.filter(kind="log", stream=MARKER_STREAM).exists())
    Allocation.objects.filter(job=job).update(preempt_requested_at=django_timezone.now())
    job = run_job(runner, job)
    assert job.state == "succeeded" and job.allocations.count() == 2, job.reason
    stored = log(job)
    first_run = [text for stream, text in stored if stream == "stdout"]
    assert first_run == [f"run 0 line {i:04d}" for i in range(len(first_run))]  # nothing of the second run
    assert stored_bytes(job.pk) <= 50_000 + sum(line_bytes(text) for stream, text in stored if stream == MARKER_STREAM)
    # The cap is said to be reached once; each run says what of its own output was not stored.
    assert [text for stream, text in stored[len(first_run) :]] == [
        "[e31] the log reached its cap of 50 KB: further lines are counted, not stored; the job keeps running",
        f"[e31] {4000 - len(first_run)} lines ({(4000 - len(first_run)) * 16} bytes) past the log cap of 50 KB were not stored",
        "[e31] 4000 lines (64000 bytes) past the log cap of 50 KB were not stored",
    ]
