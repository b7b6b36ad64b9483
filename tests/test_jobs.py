"""Job transitions, events and the job pages."""

import threading

import pytest
from django.db import connection
from django.urls import reverse
from django.utils import timezone

from jobs import states
from jobs.models import Job, JobEvent
from scheduler.models import Node
from tests.conftest import make_job, schedule_now


@pytest.fixture
def node(db):
    return Node.objects.create(name="n1", device_type="cpu", devices=2)


def test_each_transition_is_recorded_with_its_time(alice, rate, node):
    job = make_job(alice)
    [_allocation] = schedule_now()
    job.refresh_from_db()
    job.mark_running()
    at = timezone.now()
    job.finish(states.SUCCEEDED, reason="the process exited with code 0", exit_code=0, at=at)
    timeline = list(job.timeline())
    assert [(e.data["from"], e.data["state"]) for e in timeline] == [
        (None, "queued"),
        ("queued", "starting"),
        ("starting", "running"),
        ("running", "succeeded"),
    ]
    assert timeline[-1].at == at == job.finished_at
    assert job.reason == "the process exited with code 0"


def test_a_transition_checks_the_state_in_the_database(alice, rate):
    job = make_job(alice)
    stale = Job.objects.get(pk=job.pk)
    job.request_cancel()
    with pytest.raises(states.InvalidTransition):
        stale.mark_running()
    assert Job.objects.get(pk=job.pk).state == "cancelled"


def test_cancelling_a_held_job_asks_its_runner(alice, rate, node):
    job = make_job(alice)
    schedule_now()
    job.refresh_from_db()
    job.request_cancel()
    assert job.state == "starting" and job.cancel_requested_at is not None
    assert job.events.filter(kind="notice").count() == 1
    job.request_cancel()  # asking twice changes nothing
    assert job.events.filter(kind="notice").count() == 1


def test_sequence_numbers_are_per_job_and_gap_free(alice, rate):
    a, b = make_job(alice, name="a"), make_job(alice, name="b")
    JobEvent.append(a.pk, [JobEvent(kind="log", at=timezone.now(), text=str(i)) for i in range(3)])
    b.record("notice", data={"text": "hi"})
    JobEvent.append(a.pk, [JobEvent(kind="log", at=timezone.now(), text="x")])
    assert list(a.events.values_list("seq", flat=True)) == [1, 2, 3, 4, 5]
    assert list(b.events.values_list("seq", flat=True)) == [1, 2]


@pytest.mark.django_db(transaction=True)
def test_concurrent_writers_never_share_a_sequence_number(alice, rate):
    job = make_job(alice)
    errors = []

    def write(name):
        try:
            for i in range(20):
                JobEvent.append(job.pk, [JobEvent(kind="log", at=timezone.now(), text=f"{name} {i}")])
        except Exception as error:  # noqa: BLE001 - any error of a thread is reported below
            errors.append(error)
        finally:
            connection.close()

    threads = [threading.Thread(target=write, args=(n,)) for n in ("runner", "web", "scheduler")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    seqs = list(job.events.order_by("seq").values_list("seq", flat=True))
    assert seqs == list(range(1, 62))
    for name in ("runner", "web", "scheduler"):
        texts = list(job.events.filter(text__startswith=name).order_by("seq").values_list("text", flat=True))
        assert texts == [f"{name} {i}" for i in range(20)]


def test_the_job_page_shows_state_timeline_log_and_meter(client, alice, rate, node):
    job = make_job(alice, name="visible-run")
    JobEvent.append(job.pk, [JobEvent(kind="log", at=timezone.now(), stream="stdout", text="epoch 1 loss 0.5")])
    schedule_now()
    client.force_login(alice)
    page = client.get(reverse("jobs:detail", args=[job.pk])).content.decode()
    assert "visible-run" in page and "epoch 1 loss 0.5" in page
    assert 'id="job-state" class="state state-starting"' in page
    assert "held 1 cpu device on n1" in page
    assert 'id="meter-amount"' in page and "USD 2.40 per GPU-hour" in page
    assert f'data-after="{Job.objects.get(pk=job.pk).last_seq}"' in page


def test_the_job_list_shows_held_time_and_cost(client, alice, rate, node):
    make_job(alice, name="listed")
    [allocation] = schedule_now()
    allocation.release(allocation.started_at + timezone.timedelta(seconds=3600), "exited")
    client.force_login(alice)
    page = client.get(reverse("jobs:list")).content.decode()
    assert "listed" in page and "1:00:00" in page and "USD 2.4000" in page
    fragment = client.get(reverse("jobs:list"), HTTP_HX_REQUEST="true").content.decode()
    assert fragment.startswith('<tbody id="job-rows"') and "listed" in fragment


def test_the_full_log_streams_as_text(client, alice, rate):
    job = make_job(alice)
    JobEvent.append(job.pk, [JobEvent(kind="log", at=timezone.now(), text=f"line {i}") for i in range(4500)])
    client.force_login(alice)
    response = client.get(reverse("jobs:log", args=[job.pk]))
    assert response.streaming
    body = b"".join(response.streaming_content).decode()
    assert body.splitlines() == [f"line {i}" for i in range(4500)]


def test_an_artifact_downloads_as_a_stream(client, alice, rate, storage_dir):
    import io

    from core.storage import get_storage
    from jobs.models import Artifact

    job = make_job(alice)
    key = f"jobs/{job.pk}/artifacts/sub/model.pt"
    size, sha = get_storage().save(key, io.BytesIO(b"w" * 100_000))
    Artifact.objects.create(job=job, name="sub/model.pt", key=key, size=size, sha256=sha)
    client.force_login(alice)
    response = client.get(reverse("jobs:artifact", args=[job.pk, "sub/model.pt"]))
    assert response.streaming and response["Content-Disposition"].startswith('attachment; filename="model.pt"')
    assert b"".join(response.streaming_content) == b"w" * 100_000
    assert client.get(reverse("jobs:artifact", args=[job.pk, "other.pt"])).status_code == 404
    fragment = client.get(reverse("jobs:detail", args=[job.pk]) + "?part=artifacts", HTTP_HX_REQUEST="true")
    assert "sub/model.pt" in fragment.content.decode() and "<html" not in fragment.content.decode()


def test_cancel_from_the_page(client, alice, rate):
    job = make_job(alice)
    client.force_login(alice)
    response = client.post(reverse("jobs:cancel", args=[job.pk]), follow=True)
    assert "The job is cancelled." in response.content.decode()
    job.refresh_from_db()
    assert job.state == "cancelled"
    response = client.post(reverse("jobs:cancel", args=[job.pk]), follow=True)
    assert "already cancelled" in response.content.decode()


def test_cancel_needs_a_post(client, alice, rate):
    job = make_job(alice)
    client.force_login(alice)
    assert client.get(reverse("jobs:cancel", args=[job.pk])).status_code == 405


def test_the_log_download_name_is_a_safe_header(client, alice, rate):
    job = make_job(alice, name='quote"and\\back')
    client.force_login(alice)
    response = client.get(reverse("jobs:log", args=[job.pk]))
    assert response.status_code == 200
    assert response["Content-Disposition"].startswith("attachment; filename=")
