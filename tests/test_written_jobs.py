"""The JSON of ended jobs kept between job lists (jobs.written): read again only while none of the
rows it is written from has changed, whoever changed them and however (an update of a queryset,
a delete, raw SQL); on SQLite nothing is kept."""

from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from billing.models import Credit, UsageRecord, billing_month
from jobs.models import Job, JobEvent, Upload
from jobs.serializers import KEPT
from scheduler.models import Allocation, Node, Staging
from tests.conftest import make_job
from tests.test_read_queries import held_an_hour

pytestmark = pytest.mark.django_db

STARTED = datetime(2026, 11, 3, tzinfo=UTC)


@pytest.fixture(autouse=True)
def nothing_kept():
    KEPT.clear()
    yield
    KEPT.clear()


def ended_job(user, node, name, state="succeeded"):
    job = make_job(user, name=name)
    held_an_hour(job, node, STARTED, Allocation.EXITED)
    job.record("state", data={"state": state, "from": "running", "reason": "process exited 0"})
    Job.objects.filter(pk=job.pk).update(state=state, finished_at=STARTED + timedelta(hours=1))
    return job


def listed(client):
    response = client.get("/api/jobs/")
    assert response.status_code == 200, response.content
    return {job["id"]: job for job in response.json()["results"]}


def written_now(client):
    """The list as written from the rows, nothing kept."""
    KEPT.clear()
    return listed(client)


@pytest.fixture
def jobs(client, alice, rate):
    client.force_login(alice)
    return [ended_job(alice, Node.objects.create(name=f"node-{n}", device_type="cpu", devices=8), f"ended-{n}") for n in range(3)]


def reads_of(queries, table):
    return [q["sql"] for q in queries if q["sql"].startswith(f'SELECT "{table}"')]


@pytest.mark.skipif("connection.vendor != 'postgresql'")
def test_an_ended_jobs_json_is_kept_and_read_again_without_its_rows(client, jobs, alice):
    first = listed(client)
    assert len(KEPT) == 3
    with CaptureQueriesContext(connection) as queries:
        assert listed(client) == first
    assert not reads_of(queries, "scheduler_allocation") and not reads_of(queries, "jobs_jobevent"), "every job kept: none of their rows read"

    fingerprints = [sql for sql in queries_of_a_cold_read(client) if "md5(" in sql]
    # Nothing kept: only those of the jobs it writes, in the snapshot their rows are read in;
    # each part passes the ids as one array.
    assert len(fingerprints) == 1 and fingerprints[0].count("= ANY(") == fingerprints[0].count("SELECT ") == 7
    # One kept, one changed since: the page's, then the changed one's again with its rows.
    KEPT.clear()
    listed(client)
    change_job_row(jobs[0])
    with CaptureQueriesContext(connection) as queries:
        shown = listed(client)
    assert len([q for q in queries if "md5(" in q["sql"]]) == 2
    assert shown == written_now(client)

    running = make_job(alice, name="running")
    Allocation.objects.create(
        job=running, node=Node.objects.get(name="node-0"), devices=[1], device_type="cpu", rate=Decimal("2.40"), started_at=datetime.now(UTC)
    )
    Job.objects.filter(pk=running.pk).update(state="running")
    listed(client)
    assert len(KEPT) == 3, "a running job's JSON is not kept: its meter runs"
    with CaptureQueriesContext(connection) as queries:
        again = listed(client)
    assert {k: v for k, v in again.items() if k != str(running.pk)} == shown
    [allocations] = reads_of(queries, "scheduler_allocation")
    assert str(running.pk) in allocations and not any(str(job.pk) in allocations for job in jobs)


def queries_of_a_cold_read(client):
    KEPT.clear()
    with CaptureQueriesContext(connection) as queries:
        listed(client)
    return [q["sql"] for q in queries]


def test_a_page_of_jobs_still_queued_or_running_asks_for_no_fingerprint(client, alice, rate):
    client.force_login(alice)
    make_job(alice, name="queued")
    running = make_job(alice, name="running")
    Job.objects.filter(pk=running.pk).update(state="running")
    assert not [sql for sql in queries_of_a_cold_read(client) if "md5(" in sql]
    assert len(KEPT) == 0


@pytest.mark.skipif("connection.vendor != 'postgresql'")
def test_an_ended_job_whose_staging_still_counts_its_seconds_is_not_kept(client, jobs):
    Staging.objects.create(job=jobs[0], node=Node.objects.get(name="node-0"), state=Staging.STAGING, started_at=STARTED)
    listed(client)
    assert len(KEPT) == 2, "its staging's seconds run on with the clock"


@pytest.mark.skipif("connection.vendor != 'postgresql'")
@pytest.mark.django_db(transaction=True)
def test_a_row_committed_while_a_page_is_written_is_in_both_its_fingerprint_and_its_json_or_in_neither(client, jobs, monkeypatch):
    """Another writer's row committed between the page's fingerprints and its rows, then deleted:
    the JSON kept had it, under the fingerprint without it, which the delete brought back."""
    import threading

    from jobs import serializers

    job = jobs[1]
    real = serializers.prefetch_sparse

    def meanwhile(*args, **kwargs):
        def write():
            try:
                add_input(job)
            finally:
                connection.close()

        writer = threading.Thread(target=write)
        writer.start()
        writer.join()
        return real(*args, **kwargs)

    monkeypatch.setattr(serializers, "prefetch_sparse", meanwhile)
    listed(client)
    monkeypatch.setattr(serializers, "prefetch_sparse", real)
    Upload.objects.filter(job=job, role=Upload.INPUT).delete()
    assert listed(client)[str(job.pk)] == written_now(client)[str(job.pk)]


@pytest.mark.skipif("connection.vendor != 'postgresql'")
def test_the_url_is_the_requests_own(client, jobs, settings):
    settings.ALLOWED_HOSTS = ["testserver", "other.example"]
    listed(client)
    other = client.get("/api/jobs/", HTTP_HOST="other.example").json()["results"]
    assert all(job["url"].startswith("http://other.example/") for job in other)
    assert all(job["url"].startswith("http://testserver/") for job in listed(client).values())


def change_job_row(job):
    Job.objects.filter(pk=job.pk).update(reason="rewritten by an operator")


def change_allocation(job):
    Allocation.objects.filter(job=job).update(end_reason=Allocation.PREEMPTED)


def rename_node(job):
    Node.objects.filter(allocations__job=job).update(name="renamed")


def credit(job):
    usage = UsageRecord.objects.get(job=job)
    Credit.objects.create(team=job.team, job=job, usage=usage, seconds=600, amount=Decimal("0.40"), reason="lost time", period=billing_month(STARTED))


def add_input(job):
    Upload.objects.create(
        team=job.team, uploaded_by=job.created_by, job=job, role=Upload.INPUT, channel="extra", name="more.csv", key="k", size=1, sha256="0" * 64
    )


def delete_a_state_change(job):
    JobEvent.objects.filter(job=job, kind="state").order_by("-seq")[:1].get().delete()


def stage(job):
    Staging.objects.create(job=job, node=Node.objects.get(allocations__job=job), state=Staging.STAGED)


def twice_in_one_transaction(job):
    # Two updates of one row in one transaction: the same xmin, a new place (ctid).
    Job.objects.filter(pk=job.pk).update(reason="first")
    Job.objects.filter(pk=job.pk).update(reason="second")


CHANGES = [change_job_row, change_allocation, rename_node, credit, add_input, delete_a_state_change, stage, twice_in_one_transaction]


@pytest.mark.parametrize("change", CHANGES, ids=lambda change: change.__name__)
def test_any_change_to_a_row_a_kept_job_is_written_from_shows_at_the_next_read(client, jobs, change):
    before = listed(client)
    listed(client)  # kept (PostgreSQL)
    change(jobs[1])
    after = listed(client)
    assert after == written_now(client)
    assert after[str(jobs[1].pk)] != before[str(jobs[1].pk)], "the change shows"
    assert after[str(jobs[0].pk)] == before[str(jobs[0].pk)]


def test_nothing_is_kept_where_the_database_has_no_row_versions(client, jobs):
    listed(client)
    assert len(KEPT) == (3 if connection.vendor == "postgresql" else 0)


@pytest.mark.nodb
def test_kept_json_goes_least_recently_read_first():
    from jobs.written import KeptJobs

    kept = KeptJobs((), "jobs_jobevent", ("state",), size=2)
    kept.put(("a", 1), {"n": 1})
    kept.put(("b", 1), {"n": 2})
    assert kept.get(("a", 1)) == {"n": 1}
    kept.put(("c", 1), {"n": 3})
    assert kept.get(("b", 1)) is None and kept.get(("a", 1)) == {"n": 1} and kept.get(("c", 1)) == {"n": 3}
    assert not kept.holds("b") and kept.holds("a") and kept.holds("c")
    kept.put(("a", 2), {"n": 4})  # a second version of a: its first goes, a is still held
    assert kept.get(("a", 1)) is None and kept.holds("a") and kept.holds("c")
    kept.put(("d", 1), {"n": 5})
    kept.put(("d", 2), {"n": 6})
    assert not kept.holds("a") and not kept.holds("c") and kept.holds("d")
    kept.put(None, {"n": 7})
    assert kept.get(None) is None and len(kept) == 2
