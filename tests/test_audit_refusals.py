"""What an operator looks for after an attack is in the audit log: failed sign-ins and lockouts,
asking for another team's objects, CSRF failures, refused websockets, API tokens made and revoked,
and the names (never the values) of a job's environment variables. Each event names when, who
(or the name they tried), the team it concerns, what, how and from where. The team's owner reads
the team's; staff read all in the admin; a burst of refusals from one address shows on /ops/."""

import io
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from asgiref.sync import async_to_sync
from channels.layers import channel_layers
from channels.testing import WebsocketCommunicator
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.test import Client
from django.urls import reverse
from rest_framework.authtoken.models import Token

from accounts import audit
from accounts.models import AuditEvent
from tests.conftest import PASSWORD, make_job

AUDIT_PAGE = "/accounts/audit/"
ATTACKER = "203.0.113.66"
T0 = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)


def only(action):
    [event] = AuditEvent.objects.filter(action=action)
    return event


def who(event):
    return (event.user, event.actor, event.team, event.via, event.ip)


def api(client, user):
    client.defaults["HTTP_AUTHORIZATION"] = f"Token {Token.objects.get_or_create(user=user)[0].key}"
    return client


# Sign-in -----------------------------------------------------------------------------------------


@pytest.fixture
def few_attempts(settings):
    settings.E31_LOGIN_FAILURES = 3
    settings.E31_LOGIN_WINDOW_SECONDS = 600


def test_a_failed_sign_in_names_the_user_tried_and_the_address(client, alice, team_a):
    assert client.post(reverse("login"), {"username": "alice", "password": "wrong"}, REMOTE_ADDR=ATTACKER).status_code == 200
    event = only("signin.fail")
    assert who(event) == (None, "alice", team_a, "web", ATTACKER)  # it concerns alice's team; nobody signed in
    assert "wrong" not in str(event.__dict__)


def test_a_failed_sign_in_for_nobody_concerns_no_team(client, db):
    client.post(reverse("login"), {"username": "mallory", "password": "guess"}, REMOTE_ADDR=ATTACKER)
    assert who(only("signin.fail")) == (None, "mallory", None, "web", ATTACKER)


def test_a_failed_sign_in_from_the_terminal_is_recorded_as_the_api(client, alice, team_a):
    assert client.post(reverse("api:token"), {"username": "alice", "password": "wrong"}, "application/json", REMOTE_ADDR=ATTACKER).status_code == 401
    assert who(only("signin.fail")) == (None, "alice", team_a, "api", ATTACKER)


def test_a_right_password_after_a_wrong_one_records_only_the_failure(client, alice):
    client.post(reverse("login"), {"username": "alice", "password": "wrong"})
    assert client.post(reverse("login"), {"username": "alice", "password": PASSWORD}).status_code == 302
    assert list(AuditEvent.objects.values_list("action", flat=True)) == ["signin.fail"]


def test_a_name_tried_with_a_nul_is_kept_without_it(client, alice):
    # PostgreSQL refuses a NUL in text: the record of a hostile sign-in must not fail on one.
    assert client.post(reverse("login"), {"username": "ali\x00ce", "password": "x"}).status_code == 200
    event = only("signin.fail")
    assert (event.actor, event.team) == ("alice", None)  # not alice's own name: nothing is looked up


def test_the_failure_that_locks_sign_in_records_one_lockout(client, alice, team_a, few_attempts):
    for _ in range(5):  # three failures lock; the next two are refused (429) unchecked
        client.post(reverse("login"), {"username": "alice", "password": "wrong"}, REMOTE_ADDR=ATTACKER)
    assert AuditEvent.objects.filter(action="signin.fail").count() == 3
    event = only("signin.lockout")
    assert who(event) == (None, "alice", team_a, "web", ATTACKER)
    assert "username" in event.label and "address" in event.label


# Another team's objects --------------------------------------------------------------------------


def test_another_teams_job_is_the_same_404_as_a_missing_one_and_is_recorded(client, alice, charlie, team_a):
    job = make_job(alice, name="alices-secret")
    client.force_login(charlie)
    foreign = client.get(reverse("jobs:detail", args=[job.pk]), REMOTE_ADDR=ATTACKER)
    missing = client.get(reverse("jobs:detail", args=[uuid.uuid4()]), REMOTE_ADDR=ATTACKER)
    assert foreign.status_code == missing.status_code == 404
    assert foreign.content == missing.content
    event = only("object.foreign")  # the missing id records nothing
    assert who(event) == (charlie, "charlie", team_a, "web", ATTACKER)  # the team whose job it is
    assert (event.object_type, event.object_id, event.label) == ("job", str(job.pk), "alices-secret")


def test_another_teams_job_through_the_api_is_recorded_too(client, alice, charlie, team_a):
    job = make_job(alice)
    c = api(client, charlie)
    foreign = c.get(reverse("api:job", args=[job.pk]), REMOTE_ADDR=ATTACKER)
    missing = c.get(reverse("api:job", args=[uuid.uuid4()]), REMOTE_ADDR=ATTACKER)
    assert foreign.status_code == missing.status_code == 404 and foreign.json() == missing.json()
    assert who(only("object.foreign")) == (charlie, "charlie", team_a, "api", ATTACKER)


def test_another_teams_dataset_is_recorded(client, charlie, team_a, dataset):
    client.force_login(charlie)
    assert client.get(reverse("datasets:detail", args=[dataset.pk])).status_code == 404
    event = only("object.foreign")
    assert (event.team, event.object_type, event.object_id) == (team_a, "dataset", str(dataset.pk))


def test_another_teams_invoice_is_recorded_on_the_page_and_the_api(client, alice, charlie, team_a):
    from billing.models import Invoice

    invoice = Invoice.objects.create(team=team_a, team_name=team_a.name, period_start=T0, period_end=T0 + timedelta(days=30), currency="USD")
    c = api(client, charlie)
    assert c.get(reverse("api:invoice", args=[invoice.pk]), REMOTE_ADDR=ATTACKER).status_code == 404
    assert c.get(reverse("api:invoice", args=[uuid.uuid4()]), REMOTE_ADDR=ATTACKER).status_code == 404
    event = only("object.foreign")
    assert (event.team, event.object_type, event.object_id, event.via) == (team_a, "invoice", str(invoice.pk), "api")
    client.force_login(charlie)
    assert client.get(reverse("billing:invoice", args=[invoice.pk])).status_code == 404
    assert AuditEvent.objects.filter(action="object.foreign", via="web", object_id=str(invoice.pk)).count() == 1


def test_another_teams_upload_is_recorded_for_the_team_whose_it_is(client, alice, charlie, team_a):
    mine = api(Client(), alice)
    dataset = mine.post(reverse("api:datasets"), {"name": "pictures"}).json()
    upload = mine.post(reverse("api:dataset-uploads", args=[dataset["id"], 1]), {"path": "a.bin", "size": 3}).json()
    theirs = api(client, charlie)
    response = theirs.put(f"{reverse('api:dataset-upload', args=[upload['id']])}?offset=0", b"abc", content_type="application/octet-stream")
    assert response.status_code == 404
    assert theirs.get(reverse("api:dataset-upload", args=[uuid.uuid4()])).status_code == 404
    event = only("object.foreign")
    assert (event.team, event.user, event.object_type, event.object_id) == (team_a, charlie, "datasetupload", upload["id"])


# CSRF ------------------------------------------------------------------------------------------


def test_a_csrf_failure_on_a_page_is_recorded(alice, team_a):
    job = make_job(alice)
    browser = Client(enforce_csrf_checks=True)
    browser.force_login(alice)
    assert browser.post(reverse("jobs:cancel", args=[job.pk]), REMOTE_ADDR=ATTACKER).status_code == 403
    event = only("csrf.fail")
    assert who(event) == (alice, "alice", team_a, "web", ATTACKER)
    assert event.label  # Django's reason, e.g. "CSRF cookie not set."
    job.refresh_from_db()
    assert job.cancel_requested_at is None


def test_a_csrf_failure_without_a_session_is_recorded(db):
    assert Client(enforce_csrf_checks=True).post(reverse("login"), {"username": "a", "password": "b"}, REMOTE_ADDR=ATTACKER).status_code == 403
    assert who(only("csrf.fail")) == (None, "(anonymous)", None, "web", ATTACKER)


def test_a_csrf_failure_on_the_api_with_a_session_cookie_is_recorded(alice, team_a):
    job = make_job(alice)
    browser = Client(enforce_csrf_checks=True)
    browser.force_login(alice)
    response = browser.post(reverse("api:job-cancel", args=[job.pk]), REMOTE_ADDR=ATTACKER)
    assert response.status_code == 403 and "CSRF" in response.json()["detail"]
    assert who(only("csrf.fail")) == (alice, "alice", team_a, "api", ATTACKER)


# Websockets ------------------------------------------------------------------------------------


@pytest.fixture
def in_memory_layer(settings):
    settings.E31_LIVE_MODE = "db"
    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
    channel_layers.backends = {}
    yield
    channel_layers.backends = {}


def refused(job_id, key=None):
    from e31web.asgi import application

    headers = [(b"authorization", f"Token {key}".encode())] if key else []
    comm = WebsocketCommunicator(application, f"/ws/jobs/{job_id}/", headers=headers)
    comm.scope["client"] = (ATTACKER, 50123)  # the app has not run yet: it reads this scope

    async def connect():
        connected, code = await comm.connect()
        await comm.wait()
        return connected, code

    return async_to_sync(connect)()


@pytest.mark.django_db(transaction=True)
def test_a_websocket_for_another_teams_job_is_refused_and_recorded(in_memory_layer, alice, charlie, team_a, rate):
    job = make_job(alice)
    assert refused(job.pk, Token.objects.create(user=charlie).key) == (False, 4404)
    event = only("ws.refuse")
    assert who(event) == (charlie, "charlie", team_a, "ws", ATTACKER)
    assert (event.object_type, event.object_id) == ("job", str(job.pk))


@pytest.mark.django_db(transaction=True)
def test_an_anonymous_websocket_is_refused_and_recorded(in_memory_layer, alice, team_a, rate):
    job = make_job(alice)
    assert refused(job.pk, "not-a-token") == (False, 4404)
    assert who(only("ws.refuse")) == (None, "(anonymous)", team_a, "ws", ATTACKER)
    refused(uuid.uuid4(), "not-a-token")  # no such job: recorded, for no team (staff see it)
    assert AuditEvent.objects.filter(action="ws.refuse", team=None).count() == 1


@pytest.mark.django_db(transaction=True)
def test_a_cookie_websocket_from_another_site_is_refused_and_recorded(in_memory_layer, alice, team_a, rate, settings):
    from e31web.asgi import application

    settings.ALLOWED_HOSTS = ["localhost"]
    job = make_job(alice)
    client = Client()
    client.force_login(alice)
    cookie = f"sessionid={client.cookies['sessionid'].value}".encode()

    def connect(origin):
        headers = [(b"cookie", cookie), (b"host", b"localhost")] + ([(b"origin", origin)] if origin else [])
        comm = WebsocketCommunicator(application, f"/ws/jobs/{job.pk}/", headers=headers)
        comm.scope["client"] = (ATTACKER, 50123)

        async def go():
            connected, _ = await comm.connect()
            await comm.disconnect()
            return connected

        return async_to_sync(go)()

    assert connect(b"http://localhost")  # our own page
    assert not AuditEvent.objects.filter(action="ws.refuse").exists()
    assert not connect(b"http://evil.example")
    event = only("ws.refuse")
    assert who(event) == (alice, "alice", team_a, "ws", ATTACKER)
    assert "another site's page (http://evil.example)" in event.label and str(job.pk) in event.label
    assert not connect(None)
    assert AuditEvent.objects.filter(action="ws.refuse", label__contains="no Origin header").count() == 1


# API tokens ------------------------------------------------------------------------------------


def test_a_token_made_by_signing_in_from_the_terminal_is_recorded_without_its_key(client, alice, team_a):
    response = client.post(reverse("api:token"), {"username": "alice", "password": PASSWORD}, "application/json", REMOTE_ADDR=ATTACKER)
    key = response.json()["token"]
    event = only("token.create")
    assert who(event) == (alice, "alice", team_a, "api", ATTACKER)
    assert (event.object_type, event.object_id, event.label) == ("user", str(alice.pk), "alice")
    assert key not in str(event.__dict__)
    client.post(reverse("api:token"), {"username": "alice", "password": PASSWORD}, "application/json")  # the same token again: nothing made
    assert AuditEvent.objects.filter(action="token.create").count() == 1


def test_a_token_made_by_the_command_is_recorded_as_the_system(alice, team_a):
    call_command("apitoken", "alice", stdout=io.StringIO())
    assert who(only("token.create")) == (None, "system", team_a, "system", None)


def test_a_token_revoked_by_staff_is_recorded(admin_client, alice, team_a):
    token = Token.objects.create(user=alice)
    admin = get_user_model().objects.get(username="admin")
    response = admin_client.post(reverse("admin:authtoken_tokenproxy_delete", args=[alice.pk]), {"post": "yes"}, REMOTE_ADDR=ATTACKER)
    assert response.status_code == 302 and not Token.objects.filter(pk=token.pk).exists()
    event = only("token.revoke")
    assert who(event) == (admin, "admin", team_a, "web", ATTACKER)  # staff revoked alice's: her team's owner sees it
    assert (event.object_type, event.object_id) == ("user", str(alice.pk))
    assert token.key not in str(event.__dict__)


# A job's environment ---------------------------------------------------------------------------


def code_file():
    f = io.BytesIO(b"print(1)\n")
    f.name = "train.py"
    return f


def data_file():
    f = io.BytesIO(b"x,y\n1,2\n")
    f.name = "train.csv"
    return f


def test_a_jobs_environment_names_are_recorded_never_their_values(client, alice, team_a, rate):
    spec = '{"name": "env-job", "gpus": 1, "span_hours": 1, "env": {"WANDB_API_KEY": "hunter2-secret", "SEED": "7"}}'
    response = api(client, alice).post(reverse("api:jobs"), {"spec": spec, "code": code_file(), "data": data_file()}, REMOTE_ADDR=ATTACKER)
    assert response.status_code == 201, response.content
    event = only("job.env")
    assert who(event) == (alice, "alice", team_a, "api", ATTACKER)
    assert (event.object_type, event.object_id) == ("job", response.json()["id"])
    assert event.label == "SEED, WANDB_API_KEY"
    assert not any("hunter2" in str(e.__dict__) for e in AuditEvent.objects.all())
    # A job without an environment records no names.
    api(client, alice).post(reverse("api:jobs"), {"spec": '{"name": "plain", "gpus": 1, "span_hours": 1}', "code": code_file(), "data": data_file()})
    assert AuditEvent.objects.filter(action="job.submit").count() == 2 and AuditEvent.objects.filter(action="job.env").count() == 1


def test_the_form_records_the_environment_names_too(client, alice, rate):
    client.force_login(alice)
    response = client.post(
        reverse("jobs:new"),
        {
            "name": "form-env",
            "gpus": "1",
            "mode": "span",
            "span_hours": "1",
            "code": code_file(),
            "data": data_file(),
            "env": "HF_TOKEN=hf_abcdef\nDEBUG=1",
        },
    )
    assert response.status_code == 302, response.context["form"].errors if response.context else response
    event = only("job.env")
    assert (event.via, event.label) == ("web", "DEBUG, HF_TOKEN") and "hf_abcdef" not in str(event.__dict__)


# Who reads them --------------------------------------------------------------------------------


def test_the_owner_reads_the_refusals_concerning_the_team_and_nobody_else_does(client, alice, bob, charlie, team_a):
    job = make_job(alice, name="probed-job")
    client.force_login(charlie)
    client.get(reverse("jobs:detail", args=[job.pk]), REMOTE_ADDR=ATTACKER)  # charlie probes team A
    client.logout()
    client.post(reverse("login"), {"username": "bob", "password": "guess"}, REMOTE_ADDR=ATTACKER)
    client.force_login(alice)
    page = client.get(AUDIT_PAGE).content.decode()
    assert "object.foreign" in page and "probed-job" in page and "charlie" in page
    assert "signin.fail" in page and ATTACKER in page
    client.force_login(bob)
    assert client.get(AUDIT_PAGE).status_code == 403  # a member: as for every event
    client.force_login(charlie)
    theirs = client.get(AUDIT_PAGE).content.decode()  # charlie's own owner page: his probe is not there
    assert "probed-job" not in theirs and str(job.pk) not in theirs


def test_staff_read_every_refusal_in_the_admin(admin_client, db):
    Client().post(reverse("login"), {"username": "nobody-at-all", "password": "x"}, REMOTE_ADDR=ATTACKER)
    listing = admin_client.get("/admin/accounts/auditevent/?action=signin.fail").content.decode()
    assert "nobody-at-all" in listing and ATTACKER in listing


# A burst on the operator's page ----------------------------------------------------------------


@pytest.mark.nodb
def test_the_busiest_addresses_come_first_with_their_refusals_by_action():
    rows = [
        ("198.51.100.2", "signin.fail", 2, T0),
        (ATTACKER, "signin.fail", 25, T0 - timedelta(minutes=5)),
        (ATTACKER, "object.foreign", 5, T0 - timedelta(minutes=1)),
        ("192.0.2.9", "csrf.fail", 2, T0 + timedelta(minutes=1)),
        ("192.0.2.1", "ws.refuse", 1, T0),
    ]
    top = audit.busiest_addresses(rows, limit=3)
    assert [(b.ip, b.count) for b in top] == [(ATTACKER, 30), ("192.0.2.9", 2), ("198.51.100.2", 2)]  # a tie: the latest first
    assert top[0].actions == [("signin.fail", 25), ("object.foreign", 5)]
    assert top[0].last == T0 - timedelta(minutes=1)
    assert audit.busiest_addresses([]) == []


@pytest.fixture
def staff(db):
    user = get_user_model().objects.create_user("olga", "olga@example.com", PASSWORD)
    user.is_staff = True
    user.save()
    return user


def test_the_pool_page_shows_a_burst_of_refusals_from_one_address(client, staff, team_a):
    now = datetime.now(UTC)
    for _ in range(12):
        audit.append(None, "signin.fail", actor="alice", ip=ATTACKER, via="web")
    audit.append(None, "csrf.fail", ip="198.51.100.2", via="web")
    AuditEvent.objects.create(at=now - timedelta(hours=2), actor="x", action="signin.fail", via="web", ip="192.0.2.77")  # too old
    AuditEvent.objects.create(actor="alice", team=team_a, action="job.submit", via="web", ip="192.0.2.88")  # not a refusal
    client.force_login(staff)
    page = client.get(reverse("ops:pool")).content.decode()
    section = page[page.index('id="ops-refusals"') :]
    assert f'data-ip="{ATTACKER}"' in section and "12" in section.split(f'data-ip="{ATTACKER}"')[1][:400]
    assert section.index(ATTACKER) < section.index("198.51.100.2")
    assert "192.0.2.77" not in page and "192.0.2.88" not in page
