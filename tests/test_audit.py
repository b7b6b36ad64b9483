"""The audit log: every audited action, through the pages and the API, leaves exactly one event
naming who, which team, what and how; another team's object records no action (only the probe:
tests/test_audit_refusals.py); events cannot be changed or deleted; the team's owner reads them
(page and API), a member gets a 403."""

import io

import pytest
from django.core.management import call_command
from django.urls import reverse
from django.utils import timezone
from rest_framework.authtoken.models import Token

from accounts import audit
from accounts.models import AuditEvent, AuditImmutable
from catalog import datasets
from core.storage import get_storage
from jobs import lineage
from jobs.models import Checkpoint
from jobs.retrain_form import RetrainForm
from tests.api_world import make_world
from tests.conftest import make_job

AUDIT_PAGE = "/accounts/audit/"  # accounts/urls.py: path("audit/", audit_views.audit_page, name="audit")


@pytest.fixture
def world(alice, rate):
    w = make_world(alice, "zanzibar")
    key, size, sha256 = get_storage().save_blob(io.BytesIO(b"checkpoint bytes"))
    w.checkpoint = Checkpoint.objects.create(job=w.job, name="ckpt/step-1.pt", step=1, key=key, size=size, sha256=sha256, written_at=timezone.now())
    return w


@pytest.fixture
def fake_lineage(monkeypatch, alice):
    """Retraining and comparing without a finished run: the audit is the views' business."""
    made = []

    def new_job(job, user, **kwargs):
        made.append(make_job(user, name=f"{job.name}-next"))
        return made[-1]

    monkeypatch.setattr(lineage, "weights_of", lambda job: ["model.pt"])
    monkeypatch.setattr(lineage, "retrain", new_job)
    monkeypatch.setattr(lineage, "compare", new_job)
    return made


def web(client, user):
    client.force_login(user)
    return client


def api(client, user):
    client.defaults["HTTP_AUTHORIZATION"] = f"Token {Token.objects.get_or_create(user=user)[0].key}"
    return client


def code_file():
    f = io.BytesIO(b"print(1)\n")
    f.name = "train.py"
    return f


def data_file():
    f = io.BytesIO(b"x,y\n1,2\n")
    f.name = "train.csv"
    return f


def retrain_data(job):
    return {k: v for k, v in RetrainForm.initial_from(job).items() if v not in (None, False)}


def finish_upload(w):
    datasets.put_chunk(w.upload, 0, b"0123456789")
    datasets.complete_upload(w.upload)


# Each: (via, action, setup(world) or None, call(client, world) -> response, the object (type, id, label part)).
ACTIONS = {
    "web job.submit": (
        "web",
        "job.submit",
        None,
        lambda c, w: c.post(reverse("jobs:new"), {"name": "fresh", "gpus": "1", "mode": "span", "span_hours": "1", "code": code_file(), "data": data_file()}),
        lambda w: ("job", None, "fresh"),
    ),
    "api job.submit": (
        "api",
        "job.submit",
        None,
        lambda c, w: c.post(reverse("api:jobs"), {"spec": '{"name": "fresh", "gpus": 1, "span_hours": 1}', "code": code_file(), "data": data_file()}),
        lambda w: ("job", None, "fresh"),
    ),
    "web job.cancel": ("web", "job.cancel", None, lambda c, w: c.post(reverse("jobs:cancel", args=[w.job.pk])), lambda w: ("job", w.job.pk, w.job.name)),
    "api job.cancel": ("api", "job.cancel", None, lambda c, w: c.post(reverse("api:job-cancel", args=[w.job.pk])), lambda w: ("job", w.job.pk, w.job.name)),
    "web job.retrain": (
        "web",
        "job.retrain",
        None,
        lambda c, w: c.post(reverse("jobs:retrain", args=[w.job.pk]), retrain_data(w.job)),
        lambda w: ("job", w.job.pk, w.job.name),
    ),
    "api job.retrain": (
        "api",
        "job.retrain",
        None,
        lambda c, w: c.post(reverse("api:job-retrain", args=[w.job.pk]), {}, content_type="application/json"),
        lambda w: ("job", w.job.pk, w.job.name),
    ),
    "web job.compare": ("web", "job.compare", None, lambda c, w: c.post(reverse("jobs:compare", args=[w.job.pk])), lambda w: ("job", w.job.pk, w.job.name)),
    "api job.compare": ("api", "job.compare", None, lambda c, w: c.post(reverse("api:job-compare", args=[w.job.pk])), lambda w: ("job", w.job.pk, w.job.name)),
    "web artifact.download": (
        "web",
        "artifact.download",
        None,
        lambda c, w: c.get(reverse("jobs:artifact", args=[w.job.pk, w.artifact.name])),
        lambda w: ("artifact", w.artifact.pk, "model.pt"),
    ),
    "api artifact.download": (
        "api",
        "artifact.download",
        None,
        lambda c, w: c.get(reverse("api:job-artifact", args=[w.job.pk, w.artifact.name])),
        lambda w: ("artifact", w.artifact.pk, "model.pt"),
    ),
    "web checkpoint.download": (
        "web",
        "checkpoint.download",
        None,
        lambda c, w: c.get(reverse("jobs:checkpoint", args=[w.job.pk, w.checkpoint.name])),
        lambda w: ("checkpoint", w.checkpoint.pk, "step-1.pt"),
    ),
    "api checkpoint.download": (
        "api",
        "checkpoint.download",
        None,
        lambda c, w: c.get(reverse("api:job-checkpoint", args=[w.job.pk, w.checkpoint.name])),
        lambda w: ("checkpoint", w.checkpoint.pk, "step-1.pt"),
    ),
    "web log.download": ("web", "log.download", None, lambda c, w: c.get(reverse("jobs:log", args=[w.job.pk])), lambda w: ("job", w.job.pk, w.job.name)),
    "api log.download": ("api", "log.download", None, lambda c, w: c.get(reverse("api:job-log", args=[w.job.pk])), lambda w: ("job", w.job.pk, w.job.name)),
    "web spec.download": ("web", "spec.download", None, lambda c, w: c.get(reverse("jobs:spec", args=[w.job.pk])), lambda w: ("job", w.job.pk, w.job.name)),
    "api spec.download": ("api", "spec.download", None, lambda c, w: c.get(reverse("api:job-spec", args=[w.job.pk])), lambda w: ("job", w.job.pk, w.job.name)),
    "web invoice.download pdf": (
        "web",
        "invoice.download",
        None,
        lambda c, w: c.get(reverse("billing:invoice_pdf", args=[w.invoice.pk])),
        lambda w: ("invoice", w.invoice.pk, w.invoice.number),
    ),
    "web invoice.download csv": (
        "web",
        "invoice.download",
        None,
        lambda c, w: c.get(reverse("billing:invoice_csv", args=[w.invoice.pk])),
        lambda w: ("invoice", w.invoice.pk, "(csv)"),
    ),
    "api invoice.download": (
        "api",
        "invoice.download",
        None,
        lambda c, w: c.get(reverse("api:invoice-pdf", args=[w.invoice.pk])),
        lambda w: ("invoice", w.invoice.pk, "(pdf)"),
    ),
    "web statement.download pdf": (
        "web",
        "statement.download",
        None,
        lambda c, w: c.get(reverse("billing:statement_pdf") + "?month=2026-11"),
        lambda w: ("", "", "2026-11"),
    ),
    "web statement.download csv": (
        "web",
        "statement.download",
        None,
        lambda c, w: c.get(reverse("billing:statement_csv") + "?month=2026-11"),
        lambda w: ("", "", "2026-11"),
    ),
    "web usage.download": ("web", "usage.download", None, lambda c, w: c.get(reverse("billing:usage_csv") + "?month=2026-11"), lambda w: ("", "", "2026-11")),
    "api dataset.create": (
        "api",
        "dataset.create",
        None,
        lambda c, w: c.post(reverse("api:datasets"), {"name": "fresh-data"}, content_type="application/json"),
        lambda w: ("dataset", None, "fresh-data"),
    ),
    "api dataset.upload.complete": (
        "api",
        "dataset.upload.complete",
        lambda w: datasets.put_chunk(w.upload, 0, b"0123456789"),
        lambda c, w: c.post(reverse("api:dataset-upload-complete", args=[w.upload.pk]), {}, content_type="application/json"),
        lambda w: ("datasetupload", w.upload.pk, "more.csv"),
    ),
    "api dataset.seal": (
        "api",
        "dataset.seal",
        finish_upload,
        lambda c, w: c.post(reverse("api:dataset-seal", args=[w.dataset.pk, w.upload.version.number])),
        lambda w: ("datasetversion", w.upload.version.pk, f"{w.dataset.name}@{w.upload.version.number}"),
    ),
    "web dataset.seal": (
        "web",
        "dataset.seal",
        finish_upload,
        lambda c, w: c.post(reverse("datasets:seal", args=[w.dataset.pk, w.upload.version.number])),
        lambda w: ("datasetversion", w.upload.version.pk, f"{w.dataset.name}@{w.upload.version.number}"),
    ),
}


@pytest.mark.parametrize("case", list(ACTIONS))
def test_each_action_records_exactly_one_event(case, client, world, alice, team_a, fake_lineage):
    via, action, setup, call, expected = ACTIONS[case]
    if setup is not None:
        setup(world)
    assert not AuditEvent.objects.filter(action=action).exists()
    c = web(client, alice) if via == "web" else api(client, alice)  # the API's token made: an event of its own
    before = AuditEvent.objects.count()
    response = call(c, world)
    assert response.status_code < 400, getattr(response, "content", b"")[:300]
    if via == "web" and action.startswith(("job.", "dataset.")):  # a form that worked redirects
        assert response.status_code == 302, response.context["form"].errors if response.context and "form" in response.context else response
    if response.streaming:
        b"".join(response.streaming_content)
    assert AuditEvent.objects.count() == before + 1, list(AuditEvent.objects.values_list("action", flat=True))
    event = AuditEvent.objects.get(action=action)
    object_type, object_id, label = expected(world)
    assert (event.user, event.actor, event.team, event.via, event.ip) == (alice, "alice", team_a, via, "127.0.0.1")
    assert event.object_type == object_type
    if object_id is not None:
        assert event.object_id == str(object_id)
    elif object_type:
        assert event.object_id  # a new object: its id
    assert label in event.label
    assert event.at <= timezone.now()


def test_a_submission_and_retraining_name_the_new_job(client, world, alice, fake_lineage):
    api(client, alice).post(reverse("api:job-retrain", args=[world.job.pk]), {}, content_type="application/json")
    [new] = fake_lineage
    assert str(new.pk) in AuditEvent.objects.get(action="job.retrain").label


def test_refusals_and_failures_record_nothing(client, world, alice):
    c = web(client, alice)
    assert c.get(reverse("jobs:artifact", args=[world.job.pk, "nothing.bin"])).status_code == 404
    assert c.get(reverse("billing:usage_csv") + "?month=nonsense").status_code == 400
    assert c.post(reverse("jobs:new"), {"name": "no-code", "gpus": "1", "mode": "span", "span_hours": "1"}).status_code == 200
    world.job.request_cancel()  # a queued job: cancelled at once
    assert api(client, alice).post(reverse("api:job-cancel", args=[world.job.pk])).status_code == 409
    assert not AuditEvent.objects.exclude(action__in=["invoice.issue", "token.create"]).exists()


def test_another_teams_objects_are_404s_and_record_only_the_probe(client, world, charlie, team_a):
    """Each is a 404, as for a missing id; none records the action, only (where the object is
    looked up through get_for_team) that charlie asked for team A's object (tests/test_audit_refusals.py)."""
    probes = ["object.foreign", "token.create"]
    before = AuditEvent.objects.exclude(action__in=probes).count()
    w = world
    c = web(client, charlie)
    for url in [
        reverse("jobs:artifact", args=[w.job.pk, w.artifact.name]),
        reverse("jobs:checkpoint", args=[w.job.pk, w.checkpoint.name]),
        reverse("jobs:log", args=[w.job.pk]),
        reverse("jobs:spec", args=[w.job.pk]),
        reverse("billing:invoice_pdf", args=[w.invoice.pk]),
    ]:
        assert c.get(url).status_code == 404, url
    assert c.post(reverse("jobs:cancel", args=[w.job.pk])).status_code == 404
    assert c.post(reverse("datasets:seal", args=[w.dataset.pk, w.upload.version.number])).status_code == 404
    c = api(client, charlie)
    for url in [
        reverse("api:job-artifact", args=[w.job.pk, w.artifact.name]),
        reverse("api:job-checkpoint", args=[w.job.pk, w.checkpoint.name]),
        reverse("api:job-log", args=[w.job.pk]),
        reverse("api:job-spec", args=[w.job.pk]),
        reverse("api:invoice-csv", args=[w.invoice.pk]),
    ]:
        assert c.get(url).status_code == 404, url
    for url in [
        reverse("api:job-cancel", args=[w.job.pk]),
        reverse("api:job-retrain", args=[w.job.pk]),
        reverse("api:job-compare", args=[w.job.pk]),
        reverse("api:dataset-upload-complete", args=[w.upload.pk]),
        reverse("api:dataset-seal", args=[w.dataset.pk, w.upload.version.number]),
    ]:
        assert c.post(url, {}, content_type="application/json").status_code == 404, url
    assert AuditEvent.objects.exclude(action__in=probes).count() == before
    assert set(AuditEvent.objects.filter(action="object.foreign").values_list("user__username", "team")) == {("charlie", team_a.pk)}


def test_issuing_invoices_is_recorded_as_the_system(world, team_a):
    # The world's invoice was issued without a request: by the system.
    event = AuditEvent.objects.get(action="invoice.issue")
    assert (event.user, event.actor, event.team, event.via, event.ip) == (None, "system", team_a, "system", None)
    assert (event.object_type, event.object_id, event.label) == ("invoice", str(world.invoice.pk), world.invoice.number)
    # The management command names itself.
    call_command("invoices", "--credit-note", str(world.invoice.pk), "--reason", "a mistake", stdout=io.StringIO())
    note = AuditEvent.objects.filter(action="invoice.issue").exclude(pk=event.pk).get()
    assert (note.user, note.actor, note.team, note.via) == (None, "manage.py invoices", team_a, "system")


def test_the_month_command_records_each_invoice(alice, rate, team_a):
    make_world(alice, "kiwi")  # its November invoice: one event
    assert AuditEvent.objects.filter(action="invoice.issue").count() == 1
    call_command("invoices", "--month", "2026-11", stdout=io.StringIO())  # already invoiced: nothing new
    assert AuditEvent.objects.filter(action="invoice.issue").count() == 1


def test_events_cannot_be_changed_or_deleted(alice, team_a):
    event = audit.record(None, "job.submit", team=team_a, label="x", actor="test")
    event.label = "y"
    with pytest.raises(AuditImmutable):
        event.save()
    with pytest.raises(AuditImmutable):
        event.delete()
    with pytest.raises(AuditImmutable):
        AuditEvent.objects.filter(pk=event.pk).update(label="y")
    with pytest.raises(AuditImmutable):
        AuditEvent.objects.all().delete()
    event.refresh_from_db()
    assert event.label == "x"


def test_the_admin_is_read_only(admin_client, alice, team_a):
    event = audit.record(None, "job.submit", team=team_a, label="visible", actor="test")
    listing = admin_client.get("/admin/accounts/auditevent/?action=job.submit&q=visible")
    assert listing.status_code == 200 and "visible" in listing.content.decode()
    assert admin_client.get("/admin/accounts/auditevent/add/").status_code == 403
    assert admin_client.post(f"/admin/accounts/auditevent/{event.pk}/delete/", {"post": "yes"}).status_code == 403
    assert AuditEvent.objects.filter(pk=event.pk).exists()


def test_the_pure_helpers():
    assert audit.counts_as_download("GET", 200)
    assert audit.counts_as_download("GET", 302)
    assert audit.counts_as_download("GET", 206, "bytes=0-99")
    assert not audit.counts_as_download("GET", 206, "bytes=100-199")
    assert not audit.counts_as_download("HEAD", 200)
    assert not audit.counts_as_download("GET", 404)


def test_only_remote_addr_is_trusted(client, world, alice):
    web(client, alice).get(reverse("jobs:spec", args=[world.job.pk]), REMOTE_ADDR="203.0.113.7", HTTP_X_FORWARDED_FOR="198.51.100.1")
    assert AuditEvent.objects.get(action="spec.download").ip == "203.0.113.7"


def test_a_later_range_of_a_download_is_not_another_event(client, world, alice):
    c = web(client, alice)
    url = reverse("jobs:artifact", args=[world.job.pk, world.artifact.name])
    assert c.get(url, HTTP_RANGE="bytes=0-2").status_code == 206
    assert c.get(url, HTTP_RANGE="bytes=3-").status_code == 206
    assert AuditEvent.objects.filter(action="artifact.download").count() == 1


# Reading it -------------------------------------------------------------------------------------


def some_events(team_a, team_b, alice, charlie):
    for i in range(3):
        audit.record(None, "job.submit", team=team_a, label=f"a-job-{i}", actor="alice")
    audit.record(None, "invoice.download", team=team_a, label="an-invoice", actor="alice")
    audit.record(None, "job.submit", team=team_b, label="quokka-secret", actor="charlie")


def test_the_owner_page_lists_the_teams_events_newest_first(client, alice, bob, charlie, team_a, team_b):
    some_events(team_a, team_b, alice, charlie)
    page = web(client, alice).get(AUDIT_PAGE)
    assert page.status_code == 200
    text = page.content.decode()
    assert text.index("a-job-2") < text.index("a-job-0") and "an-invoice" in text and "quokka-secret" not in text
    filtered = client.get(AUDIT_PAGE + "?action=invoice.download").content.decode()
    assert "an-invoice" in filtered and "a-job-0" not in filtered


def test_the_page_is_paged_by_100(client, alice, team_a):
    for i in range(105):
        audit.record(None, "job.cancel", team=team_a, label=f"n{i:03d}", actor="alice")
    c = web(client, alice)
    first, second = c.get(AUDIT_PAGE).content.decode(), c.get(AUDIT_PAGE + "?page=2").content.decode()
    assert "n104" in first and "n005" in first and "n004" not in first
    assert "n004" in second and "n000" in second and "n104" not in second


def test_a_member_gets_a_403(client, bob):
    assert web(client, bob).get(AUDIT_PAGE).status_code == 403
    client.logout()
    assert api(client, bob).get(reverse("api:audit")).status_code == 403


def test_the_api_lists_the_owners_team_only(client, alice, charlie, team_a, team_b):
    api(client, alice)  # her token made: the team's first event
    some_events(team_a, team_b, alice, charlie)
    body = client.get(reverse("api:audit")).json()
    assert body["count"] == 5
    assert [e["label"] for e in body["results"]] == ["an-invoice", "a-job-2", "a-job-1", "a-job-0", "alice"]
    first = body["results"][0]
    assert set(first) == {"id", "at", "user", "actor", "action", "object_type", "object_id", "label", "via", "ip"}
    assert (first["action"], first["actor"], first["via"], first["user"]) == ("invoice.download", "alice", "system", None)
    only = client.get(reverse("api:audit") + "?action=job.submit").json()
    assert only["count"] == 3
    assert client.get(reverse("api:audit") + "?action=nonsense").status_code == 400
    paged = client.get(reverse("api:audit") + "?page_size=2").json()
    assert len(paged["results"]) == 2 and paged["next"]
    theirs = api(client, charlie).get(reverse("api:audit")).json()
    assert [e["label"] for e in theirs["results"]] == ["charlie", "quokka-secret"]  # newest first: his token, made just now


def test_the_api_records_the_user_when_there_is_one(client, world, alice):
    api(client, alice).get(reverse("api:job-spec", args=[world.job.pk]) + "?format=json")
    [row] = list(client.get(reverse("api:audit") + "?action=spec.download").json()["results"])
    assert (row["user"], row["actor"], row["via"], row["object_id"], row["label"]) == ("alice", "alice", "api", str(world.job.pk), world.job.name)


def test_the_audit_link_is_in_the_owners_menu_only(client, alice, bob):
    client.force_login(alice)
    assert 'href="/accounts/audit/"' in client.get("/jobs/").content.decode()
    client.force_login(bob)
    assert 'href="/accounts/audit/"' not in client.get("/jobs/").content.decode()
