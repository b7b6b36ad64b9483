"""Notifications: the pure decisions and signatures; the outbox written in the caller's
transaction; emails with the right content; webhooks signed, verified by a real receiver on
loopback and retried with growing waits; the event sources (job states, deadline at risk,
budget, invoices); the settings page and owner-only webhook changes.

Over 500 lines: each channel and each event source, case by case."""

import http.server
import json
import re
import threading
import time
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from django.core import mail
from django.core.exceptions import ImproperlyConfigured
from django.db import transaction
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from billing import budget_service, invoice_service
from billing.models import UsageRecord
from jobs import states
from jobs.models import Job
from notifications import events, policy, signing
from notifications.delivery import Worker, start_thread
from notifications.mailconfig import email_settings
from notifications.models import Delivery, EmailPreference, Notification, Webhook
from scheduler import allocations, predictions
from scheduler.models import Allocation, Node
from tests.conftest import PASSWORD, make_job, schedule_now

D = Decimal
UTC = UTC


# Pure: signatures ---------------------------------------------------------------------------


@pytest.mark.nodb
def test_a_signature_verifies_with_the_secret_and_nothing_else():
    body = b'{"kind":"job.finished"}'
    header = signing.signature_header("whsec_x", "1700000000", body)
    assert header == "sha256=" + signing.sign("whsec_x", 1700000000, body)
    assert signing.verify("whsec_x", "1700000000", body, header, now=1700000010)
    assert not signing.verify("whsec_y", "1700000000", body, header, now=1700000010)  # another secret
    assert not signing.verify("whsec_x", "1700000000", body + b" ", header, now=1700000010)  # another body
    assert not signing.verify("whsec_x", "1700000001", body, header, now=1700000010)  # another timestamp
    assert not signing.verify("whsec_x", "1700000000", body, header, now=1700000000 + 301)  # too old: a replay
    assert signing.verify("whsec_x", "1700000000", body, header, tolerance=None)
    assert not signing.verify("whsec_x", "soon", body, header) and not signing.verify("whsec_x", "1700000000", body, "md5=abc")


# Pure: policy -------------------------------------------------------------------------------


@pytest.mark.nodb
def test_failed_attempts_wait_longer_each_time_then_give_up():
    now = datetime(2026, 12, 3, 12, 0, tzinfo=UTC)
    waits = [policy.retry_delay(n, first=30) for n in range(1, 6)]
    assert waits == [30, 60, 120, 240, 480]
    assert policy.retry_delay(30, first=30, cap=3600) == 3600
    assert policy.after_failure(1, now, max_attempts=3, first=30) == now + timedelta(seconds=30)
    assert policy.after_failure(3, now, max_attempts=3, first=30) is None
    assert policy.succeeded(204) and not policy.succeeded(301) and not policy.succeeded(None)


@pytest.mark.nodb
def test_each_budget_threshold_is_told_once_and_only_the_highest():
    assert policy.budget_alert(D("79.99"), D("100")) is None
    assert policy.budget_alert(D("80"), D("100")) == 80
    assert policy.budget_alert(D("85"), D("100"), already={80}) is None
    assert policy.budget_alert(D("100"), D("100"), already={80}) == 100
    assert policy.budget_alert(D("130"), D("100")) == 100  # past both at once: one message
    assert policy.budget_alert(D("90"), D("100"), already={100}) is None
    assert policy.budget_alert(D("5"), None) is None and policy.budget_alert(D("0"), D("0")) is None


@pytest.mark.nodb
def test_which_changes_are_told():
    now = datetime(2026, 12, 3, 12, 0, tzinfo=UTC)
    assert policy.deadline_at_risk(now + timedelta(minutes=1), now) and not policy.deadline_at_risk(now, now)
    assert not policy.deadline_at_risk(None, now) and not policy.deadline_at_risk(now, None)
    assert [policy.kind_for_transition("running", s) for s in ("succeeded", "failed", "stopped", "cancelled", "queued")] == [
        "job.finished",
        "job.failed",
        "job.stopped",
        None,
        None,
    ]
    assert policy.kind_for_transition("queued", "starting") == "job.started"
    assert policy.STARTED not in policy.DEFAULT_EMAIL_KINDS and policy.FINISHED in policy.DEFAULT_EMAIL_KINDS
    assert policy.wants([], "job.failed") and not policy.wants(["job.finished"], "job.failed")


@pytest.mark.nodb
def test_a_stopped_job_s_email_names_its_limit_held_time_and_cost():
    event = {
        "kind": "job.stopped",
        "team": {"id": "t", "name": "Team A"},
        "data": {},
        "job": {
            "id": "0123456789",
            "name": "digits",
            "state": "stopped",
            "reason": "the job's ceiling is reached: stopping it",
            "gpus": 2,
            "limit": "ceiling",
            "held_seconds": 5400,
            "amount": "7.2",
            "currency": "USD",
            "url": "https://e31.example/jobs/0123/",
        },
    }
    assert policy.subject(event) == "digits stopped at its ceiling"
    text = policy.body(event)
    assert "Reason:   the job's ceiling is reached" in text
    assert "Held:     1:30:00 on 2 GPU(s)" in text and "Cost:     USD 7.20" in text
    assert "https://e31.example/jobs/0123/" in text


@pytest.mark.nodb
def test_email_settings_come_from_the_environment():
    assert email_settings() == {"EMAIL_BACKEND": "django.core.mail.backends.console.EmailBackend"}
    smtp = email_settings("smtp://mailer:p%40ss@mail.example:587?tls=1")
    assert (smtp["EMAIL_HOST"], smtp["EMAIL_PORT"], smtp["EMAIL_HOST_USER"], smtp["EMAIL_HOST_PASSWORD"]) == ("mail.example", 587, "mailer", "p@ss")
    assert smtp["EMAIL_USE_TLS"] and not smtp["EMAIL_USE_SSL"]
    assert email_settings("smtps://mail.example")["EMAIL_PORT"] == 465
    assert email_settings(host="relay", port=2525)["EMAIL_HOST"] == "relay"
    with pytest.raises(ImproperlyConfigured, match="EMAIL_URL"):
        email_settings("http://mail.example")


# A real receiver on loopback ----------------------------------------------------------------


class Receiver(http.server.ThreadingHTTPServer):
    """Answers each POST with the next of `statuses` (then 200); with `secret`, answers 401 to a
    request whose signature does not verify; with `hang`, answers nothing until released."""

    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}/hook"
        self.requests, self.statuses, self.secret = [], [], None
        self.hang, self.release = False, threading.Event()


class Handler(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        server = self.server
        if server.hang:
            server.release.wait(10)
            return
        server.requests.append((dict(self.headers), body))
        status = server.statuses.pop(0) if server.statuses else 200
        if server.secret is not None and not signing.verify(server.secret, self.headers["X-E31-Timestamp"], body, self.headers["X-E31-Signature"]):
            status = 401
        self.send_response(status)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args):
        pass


@pytest.fixture
def receiver(settings):
    settings.E31_WEBHOOK_ALLOW = ["127.0.0.1"]  # webhooks are refused at loopback unless allowed (core/endpoints.py)
    server = Receiver()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.release.set()
    server.shutdown()
    server.server_close()


@pytest.fixture
def node(db):
    return Node.objects.create(name="n1", device_type="cpu", devices=4)


def webhook_for(team, url, **fields):
    return Webhook.objects.create(team=team, url=url, **fields)


def failed_job(user, name="broken"):
    """A job that failed before it started (queued -> failed): a job.failed event."""
    job = make_job(user, name=name)
    return job.finish(states.FAILED, reason="its data could not be staged")


# The outbox ---------------------------------------------------------------------------------


def test_an_event_in_a_rolled_back_transaction_is_never_sent(alice, team_a, receiver):
    webhook_for(team_a, receiver.url)
    job = make_job(alice, name="idle-one")
    with pytest.raises(RuntimeError), transaction.atomic():
        events.emit("job.idle", team=team_a, job=job, data={"text": "no GPU use for 30 minutes"})
        assert Delivery.objects.count() == 2  # alice's email and the webhook, queued with the change
        raise RuntimeError("the change is rolled back")
    assert Notification.objects.count() == 0
    assert Worker().drain() == 0
    assert receiver.requests == [] and mail.outbox == []


def test_an_idle_job_is_emailed_and_posted(alice, team_a, receiver):
    webhook_for(team_a, receiver.url)
    job = make_job(alice, name="idle-one")
    events.emit("job.idle", team=team_a, job=job, data={"text": "no GPU use for 30 minutes"})
    assert Worker().drain() == 2
    [message] = mail.outbox
    assert message.subject == "[E31] idle-one is idle" and "no GPU use for 30 minutes" in message.body
    [(headers, body)] = receiver.requests
    assert headers["X-E31-Event"] == "job.idle" and json.loads(body)["data"]["text"] == "no GPU use for 30 minutes"


def test_a_finished_job_emails_the_members_who_want_it(alice, bob, rate, node, settings):
    settings.E31_SITE_URL = "https://e31.example"
    EmailPreference.objects.create(user=bob, kinds=[policy.FAILED])  # bob: failures only
    job = make_job(alice, name="digits")
    [allocation] = schedule_now()  # job.started: nobody emailed by default
    job.refresh_from_db()
    job.mark_running()
    end = allocation.started_at + timedelta(minutes=90)
    allocations.end_allocation(allocation, end, Allocation.EXITED, states.SUCCEEDED, "exited with code 0", exit_code=0)
    assert Worker().drain() == 1
    [message] = mail.outbox
    assert message.to == ["alice@example.com"]
    assert message.subject == "[E31] digits finished"
    assert "State:    succeeded" in message.body and "Reason:   exited with code 0" in message.body
    assert "Held:     1:30:00 on 1 GPU(s)" in message.body and "Cost:     USD 3.60" in message.body  # 1.5 h x 2.40
    assert f"https://e31.example/jobs/{job.pk}/" in message.body
    html, mime = message.alternatives[0]
    assert mime == "text/html" and f'href="https://e31.example/jobs/{job.pk}/"' in html
    # job.started told nobody, so it was not written at all
    assert set(Notification.objects.filter(job=job).values_list("kind", flat=True)) == {"job.finished"}


# Webhooks -----------------------------------------------------------------------------------


def test_a_receiver_verifies_the_signature_with_the_webhook_s_secret(alice, team_a, receiver):
    webhook = webhook_for(team_a, receiver.url)
    receiver.secret = webhook.secret  # the receiver answers 401 unless signing.verify() passes
    job = failed_job(alice)
    assert Worker().drain() == 2  # alice's email and the webhook
    delivery = Delivery.objects.get(channel=Delivery.WEBHOOK)
    assert (delivery.state, delivery.attempts, delivery.last_status) == (Delivery.DELIVERED, 1, 200)
    [(headers, body)] = receiver.requests
    assert headers["X-E31-Delivery"] == str(delivery.pk) and headers["X-E31-Event"] == "job.failed"
    event = json.loads(body)
    assert set(event) == {"id", "kind", "created_at", "team", "job", "data"}
    assert event["job"]["id"] == str(job.pk) and event["job"]["state"] == "failed" and event["team"]["name"] == "Team A"
    assert event["job"]["url"].endswith(f"/jobs/{job.pk}/")
    # A receiver with another secret refuses it, and it is retried.
    receiver.secret = "whsec_wrong"
    failed_job(alice, name="second")
    assert Worker().drain() == 2
    refused = Delivery.objects.filter(channel=Delivery.WEBHOOK).exclude(pk=delivery.pk).get()
    assert (refused.state, refused.last_status) == (Delivery.PENDING, 401)


def test_a_failing_receiver_is_tried_again_with_growing_waits(alice, team_a, receiver, settings):
    settings.E31_NOTIFY_RETRY_SECONDS = 30
    webhook = webhook_for(team_a, receiver.url, kinds=[policy.FAILED])
    receiver.statuses = [500, 503]  # then 200
    EmailPreference.objects.create(user=alice, kinds=[])  # the webhook only
    failed_job(alice)
    worker, t0 = Worker(), timezone.now() + timedelta(seconds=1)
    assert worker.handle_one(t0)
    delivery = Delivery.objects.get(webhook=webhook)
    assert (delivery.attempts, delivery.last_status, delivery.state) == (1, 500, Delivery.PENDING)
    first_wait = delivery.next_attempt_at - t0
    assert not worker.handle_one(delivery.next_attempt_at - timedelta(seconds=1))  # not due yet
    t1 = delivery.next_attempt_at
    assert worker.handle_one(t1)
    delivery.refresh_from_db()
    assert (delivery.attempts, delivery.last_status) == (2, 503) and "503" in delivery.last_error
    second_wait = delivery.next_attempt_at - t1
    assert first_wait == timedelta(seconds=30) and second_wait == timedelta(seconds=60)
    assert not worker.handle_one(delivery.next_attempt_at - timedelta(seconds=1))
    assert worker.handle_one(delivery.next_attempt_at)
    delivery.refresh_from_db()
    assert (delivery.state, delivery.attempts, delivery.last_status, delivery.last_error) == (Delivery.DELIVERED, 3, 200, "")
    ids = {headers["X-E31-Delivery"] for headers, _ in receiver.requests}
    stamps = [int(headers["X-E31-Timestamp"]) for headers, _ in receiver.requests]
    assert ids == {str(delivery.pk)} and stamps == sorted(stamps) and len(set(stamps)) == 3  # one id to dedupe on; fresh timestamps
    for headers, body in receiver.requests:
        assert signing.verify(webhook.secret, headers["X-E31-Timestamp"], body, headers["X-E31-Signature"], tolerance=None)


def test_a_receiver_that_keeps_failing_is_given_up_and_the_log_says_so(client, alice, team_a, receiver, settings):
    settings.E31_NOTIFY_MAX_ATTEMPTS = 2
    settings.E31_NOTIFY_RETRY_SECONDS = 0
    webhook = webhook_for(team_a, receiver.url, kinds=[policy.FAILED])
    receiver.statuses = [500] * 5
    EmailPreference.objects.create(user=alice, kinds=[])  # the webhook only
    failed_job(alice)
    worker = Worker()
    later = timezone.now() + timedelta(seconds=1)
    assert worker.handle_one(later) and worker.handle_one(later) and not worker.handle_one(later)
    delivery = Delivery.objects.get(webhook=webhook)
    assert delivery.state == Delivery.FAILED and "gave up after 2 attempts" in delivery.last_error
    client.force_login(alice)
    page = client.get(reverse("notifications:webhook", args=[webhook.pk])).content.decode()
    assert "Gave up" in page and "the receiver answered 500" in page


def test_a_hanging_receiver_never_holds_up_a_scheduling_cycle(alice, team_a, receiver):
    from concurrent.futures import ThreadPoolExecutor

    from scheduler.management.commands.scheduler import Command

    receiver.hang = True
    webhook = webhook_for(team_a, receiver.url)
    EmailPreference.objects.create(user=alice, kinds=[])  # the webhook only
    failed_job(alice)
    command = Command()
    command.next_housekeeping = command.next_prediction = 0.0
    command.last_failure_at = None
    command.scans = ThreadPoolExecutor(max_workers=1)
    command.handle_one_cycle()  # the scheduler's cycle sends nothing itself
    assert command.last_failure_at is None
    delivery = Delivery.objects.get(webhook=webhook)
    assert (delivery.attempts, delivery.state) == (0, Delivery.PENDING)
    assert Worker(timeout=0.3).handle_one()  # the worker gives up on this attempt at its timeout
    delivery.refresh_from_db()
    assert (delivery.attempts, delivery.state) == (1, Delivery.PENDING) and delivery.last_error == "no answer within 0.3 s"


@pytest.mark.django_db(transaction=True)
def test_the_worker_thread_delivers_in_the_background(receiver):
    from accounts.models import Membership, Team
    from tests.conftest import make_user

    team = Team.objects.create(name="Team T")
    user = make_user("tess", team, Membership.OWNER)
    webhook_for(team, receiver.url)
    failed_job(user)
    stop = threading.Event()
    thread = start_thread(stop, interval=0.05)
    try:
        deadline = time.monotonic() + 20
        while Delivery.objects.filter(state=Delivery.PENDING).count() != 0 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        stop.set()
        thread.join(10)
    assert len(receiver.requests) == 1 and Delivery.objects.filter(state=Delivery.DELIVERED).count() == 2  # email and webhook


# Event sources ------------------------------------------------------------------------------


def spent(team, job, amount, at=None):
    """A released allocation of the job billed `amount` this month."""
    at = at or timezone.now()
    old = Node.objects.create(name=f"old-{amount}-{job.pk}", device_type="cpu", devices=1, stopped_at=at)
    allocation = Allocation.objects.create(
        job=job,
        node=old,
        devices=[0],
        device_type="cpu",
        rate=D("2.40"),
        started_at=at - timedelta(hours=1),
        ended_at=at,
        end_reason="exited",
    )
    UsageRecord.objects.create(
        team=team,
        job=job,
        allocation=allocation,
        gpu_type="cpu",
        gpus=1,
        started_at=allocation.started_at,
        ended_at=at,
        held_seconds=3600,
        rate=D("2.40"),
        amount=D(amount),
    )


def test_the_budget_at_80_and_100_percent_is_told_once_a_month(alice, team_a, rate):
    team_a.monthly_budget = D("100")
    team_a.save()
    job = make_job(alice, name="spender")
    Job.objects.filter(pk=job.pk).update(state=states.SUCCEEDED)
    spent(team_a, job, "70")
    assert budget_service.notify_budgets() == []
    spent(team_a, job, "15")  # 85%
    [warning] = budget_service.notify_budgets()
    assert warning.kind == "budget.80" and warning.payload["data"]["percent"] == 85
    assert budget_service.notify_budgets() == []  # once
    spent(team_a, job, "20")  # 105%
    [over] = budget_service.notify_budgets()
    assert over.kind == "budget.100" and budget_service.notify_budgets() == []
    assert Worker().drain() == 2
    assert [m.subject for m in mail.outbox] == [
        "[E31] Team A has spent 85% of its monthly budget",
        "[E31] Team A has spent 105% of its monthly budget",
    ]
    assert "Spent this month: USD 105.00 of USD 100.00" in mail.outbox[1].body
    # A new month starts afresh: nothing spent in it, nothing told.
    assert budget_service.notify_budgets(timezone.now() + timedelta(days=32)) == []


def test_a_deadline_at_risk_is_told_once(alice, rate, node):
    deadline = timezone.now() + timedelta(minutes=10)
    job = make_job(alice, name="late", span_hours=D("1"), deadline=deadline)  # an hour of work, due in 10 minutes
    on_time = make_job(alice, name="on-time", span_hours=D("1"), deadline=timezone.now() + timedelta(days=1))
    predictions.update_predictions()
    predictions.update_predictions()
    [notification] = Notification.objects.filter(kind="job.deadline_at_risk")
    assert notification.job_id == job.pk and notification.payload["data"]["predicted_finish"] > notification.payload["data"]["deadline"]
    assert not Notification.objects.filter(job=on_time).exists()
    Worker().drain()
    assert [m.subject for m in mail.outbox] == ["[E31] late may miss its deadline"]


def test_issuing_an_invoice_tells_the_team(alice, team_a, settings):
    settings.E31_SITE_URL = "https://e31.example"
    invoice = invoice_service.issue(invoice_service.draft(team_a, 2026, 11))
    [notification] = Notification.objects.filter(kind="invoice.issued")
    assert notification.payload["data"]["number"] == invoice.number and notification.payload["data"]["period"] == "2026-11"
    Worker().drain()
    [message] = mail.outbox
    assert message.subject == f"[E31] Invoice {invoice.number} issued"
    assert f"https://e31.example/billing/invoices/{invoice.pk}/" in message.body


# Pages --------------------------------------------------------------------------------------


def login(user):
    client = Client()
    assert client.login(username=user.username, password=PASSWORD)
    return client


def test_a_user_chooses_what_they_are_emailed_about(alice, team_a):
    client = login(alice)
    page = client.get(reverse("settings")).content.decode()
    checked = set(re.findall(r'<input type="checkbox" name="kinds" value="([a-z0-9._]+)"[^>]*checked', page))
    assert checked == set(policy.DEFAULT_EMAIL_KINDS) and "job.started" not in checked  # the defaults
    response = client.post(reverse("settings"), {"form": "email", "kinds": ["job.failed", "job.started"]})
    assert response.status_code == 302
    assert EmailPreference.kinds_for(alice) == ["job.failed", "job.started"]
    response = client.post(reverse("settings"), {"form": "email", "kinds": ["job.nope"]})
    assert response.status_code == 400 and "not one of the available choices" in response.content.decode()
    # The time zone form is unchanged by it.
    assert client.post(reverse("settings"), {"time_zone": "Asia/Tokyo"}).status_code == 302


def test_the_owner_adds_rotates_tests_and_removes_a_webhook(alice, team_a, receiver):
    client = login(alice)
    response = client.post(reverse("notifications:webhook_add"), {"url": "ftp://example.com/x", "kinds": []})
    assert response.status_code == 400 and "Enter an http:// or https:// URL" in response.content.decode()
    response = client.post(reverse("notifications:webhook_add"), {"url": receiver.url, "kinds": ["job.failed"], "active": "on"}, follow=True)
    webhook = Webhook.objects.get(team=team_a)
    assert webhook.kinds == ["job.failed"] and webhook.active
    assert webhook.secret in response.content.decode()  # shown once, on the page after adding
    assert webhook.secret not in client.get(reverse("notifications:webhook", args=[webhook.pk])).content.decode()
    old = webhook.secret
    client.post(reverse("notifications:webhook_rotate", args=[webhook.pk]))
    webhook.refresh_from_db()
    assert webhook.secret != old
    client.post(reverse("notifications:webhook_test", args=[webhook.pk]))
    receiver.secret = webhook.secret
    assert Worker().drain() == 1
    [(headers, _)] = receiver.requests
    assert headers["X-E31-Event"] == "test"
    assert client.post(reverse("notifications:webhook", args=[webhook.pk]), {"url": "nonsense"}).status_code == 400
    client.post(reverse("notifications:webhook_delete", args=[webhook.pk]))
    assert not Webhook.objects.exists()


def test_a_member_sees_the_webhooks_but_cannot_change_them(alice, bob, team_a):
    webhook = webhook_for(team_a, "https://hooks.example/e31")
    client = login(bob)
    assert "https://hooks.example/e31" in client.get(reverse("settings")).content.decode()
    assert client.get(reverse("notifications:webhook", args=[webhook.pk])).status_code == 200
    assert client.post(reverse("notifications:webhook_add"), {"url": "https://evil.example/"}).status_code == 403
    for name in ("webhook_rotate", "webhook_test", "webhook_delete"):
        assert client.post(reverse(f"notifications:{name}", args=[webhook.pk])).status_code == 403
    assert client.post(reverse("notifications:webhook", args=[webhook.pk]), {"url": "https://evil.example/"}).status_code == 403
    webhook.refresh_from_db()
    assert webhook.url == "https://hooks.example/e31" and Webhook.objects.count() == 1


def test_an_outsider_cannot_see_a_team_s_webhook(charlie, team_a):
    webhook = webhook_for(team_a, "https://hooks.example/e31")
    client = login(charlie)
    assert client.get(reverse("notifications:webhook", args=[webhook.pk])).status_code == 404
    assert client.post(reverse("notifications:webhook_delete", args=[webhook.pk])).status_code == 404
    assert "hooks.example" not in client.get(reverse("settings")).content.decode()


def test_a_webhook_s_secret_is_kept_encrypted(alice, team_a):
    webhook = Webhook.objects.create(team=team_a, url="https://hooks.example/e31", created_by=alice)
    stored = Webhook.objects.filter(pk=webhook.pk).values_list("sealed_secret", flat=True).get()
    assert webhook.secret.startswith("whsec_") and webhook.secret not in stored
    assert Webhook.objects.get(pk=webhook.pk).secret == webhook.secret
    old = webhook.secret
    assert webhook.rotate_secret() != old and Webhook.objects.get(pk=webhook.pk).secret == webhook.secret
