"""Who may do what, over the whole site: every page, API call, download, websocket and presigned
URL, called by the team's owner, a team member, an outsider (another team's owner) and an
anonymous visitor.

The routes are walked from the root URLconf, and each must be classified in ACCESS below, so a new
page or endpoint fails here until someone has said who may reach it.

- TEAM: the owner and members get in; an outsider gets a 404 (a page) or 403/404 (the API) on
  another team's object and sees nothing of it in a list; anonymous visitors are sent to log in
  (a page) or get a 401 (the API).
- OWNER: as TEAM, but a member is refused (403).
- {"GET": ..., "POST": ...}: per method.
- STAFF: the network's operators only: nobody here gets in.
- PUBLIC: anyone (the sign-in page, the token call, the API schema).
"""

import io
import json
import re
from datetime import timedelta

import httpx
import pytest
from asgiref.sync import async_to_sync
from channels.testing import WebsocketCommunicator
from django.urls import URLPattern, URLResolver, get_resolver, reverse
from django.utils import timezone
from rest_framework.authtoken.models import Token

from core.storage import get_storage
from jobs.comparisons import EVALUATION_FILE
from jobs.models import Artifact, Checkpoint, Job
from notifications.models import Webhook
from tests.api_world import make_world
from tests.conftest import make_job
from tracking.models import Tracker

TEAM, OWNER, STAFF, PUBLIC = "team", "owner", "staff", "public"

ACCESS = {
    # Pages
    "login": PUBLIC,
    "logout": PUBLIC,
    "settings": TEAM,
    "audit": OWNER,
    "jobs:list": TEAM,
    "jobs:new": TEAM,
    "jobs:estimate": TEAM,
    "jobs:detail": TEAM,
    "jobs:cancel": TEAM,
    "jobs:retrain": TEAM,
    "jobs:experiments": TEAM,
    "jobs:experiment": TEAM,
    "jobs:compare": TEAM,
    "jobs:comparison": TEAM,
    "jobs:log": TEAM,
    "jobs:spec": TEAM,
    "jobs:artifact": TEAM,
    "jobs:checkpoint": TEAM,
    "datasets:list": TEAM,
    "datasets:new": TEAM,
    "datasets:detail": TEAM,
    "datasets:add": TEAM,
    "datasets:rescan": TEAM,
    "datasets:credentials": OWNER,
    "datasets:delete": OWNER,
    "datasets:upload": TEAM,
    "datasets:seal": TEAM,
    "datasets:abort-upload": TEAM,
    "billing:usage": {"GET": TEAM, "POST": OWNER},  # the POST sets the team's monthly budget
    "billing:usage_csv": TEAM,
    "billing:invoices": TEAM,
    "billing:statement": TEAM,
    "billing:statement_pdf": TEAM,
    "billing:statement_csv": TEAM,
    "billing:invoice": TEAM,
    "billing:invoice_pdf": TEAM,
    "billing:invoice_csv": TEAM,
    # Notifications: members see the team's webhooks and their deliveries; the owner changes them
    "notifications:webhooks": TEAM,
    "notifications:webhook_add": OWNER,
    "notifications:webhook": {"GET": TEAM, "POST": OWNER},
    "notifications:webhook_delete": OWNER,
    "notifications:webhook_rotate": OWNER,
    "notifications:webhook_test": OWNER,
    # The team's experiment tracker: members see it and its deliveries; the owner changes it
    "tracking:tracker": {"GET": TEAM, "POST": OWNER},
    "tracking:tracker_remove": OWNER,
    # The network's operators: the pool page, and its Prometheus metrics (a staff token or session)
    "ops:pool": STAFF,
    "metrics": STAFF,
    # The API
    "api:schema": PUBLIC,
    "api:docs": PUBLIC,
    "api:token": PUBLIC,
    "api:me": TEAM,
    "api:audit": OWNER,
    "api:jobs": TEAM,
    "api:job": TEAM,
    "api:job-spec": TEAM,
    "api:estimate": TEAM,
    "api:job-logs": TEAM,
    "api:job-log": TEAM,
    "api:job-cancel": TEAM,
    "api:job-retrain": TEAM,
    "api:job-compare": TEAM,
    "api:job-comparison": TEAM,
    "api:job-artifacts": TEAM,
    "api:job-artifact": TEAM,
    "api:job-metrics": TEAM,
    "api:job-checkpoints": TEAM,
    "api:job-checkpoint": TEAM,
    "api:datasets": TEAM,
    "api:dataset-register-s3": TEAM,
    "api:dataset": TEAM,  # its DELETE is the owner's (tests/test_dataset_manage.py)
    "api:dataset-rescan": TEAM,
    "api:dataset-credentials": OWNER,
    "api:dataset-versions": TEAM,
    "api:dataset-version": TEAM,
    "api:dataset-uploads": TEAM,
    "api:dataset-seal": TEAM,
    "api:dataset-upload": TEAM,
    "api:dataset-upload-complete": TEAM,
    "api:folders": TEAM,
    "api:folder": TEAM,
    "api:folder-file": TEAM,
    "api:usage": TEAM,
    "api:invoices": TEAM,
    "api:invoice-statement": TEAM,
    "api:invoice": TEAM,
    "api:invoice-pdf": TEAM,
    "api:invoice-csv": TEAM,
    "api:sweeps": TEAM,
    "api:sweep": TEAM,
    "api:sweep-rerun": TEAM,
    "sweeps:list": TEAM,
    "sweeps:new": TEAM,
    "sweeps:detail": TEAM,
    "sweeps:rerun": TEAM,
}
PERSONAS = ["owner", "member", "outsider", "anonymous"]
LAST = {"notifications:webhook_delete", "tracking:tracker_remove"}  # routes that take away what the others need: called last
REFUSED = (401, 403, 404)


def routes(patterns=None, namespace=""):
    """(name, pattern) of every route of the site but the admin's (checked on its own below)."""
    for entry in get_resolver().url_patterns if patterns is None else patterns:
        if isinstance(entry, URLResolver):
            if entry.namespace == "admin":
                continue
            inner = f"{namespace}:{entry.namespace}" if namespace and entry.namespace else entry.namespace or namespace
            yield from routes(entry.url_patterns, inner)
        elif isinstance(entry, URLPattern) and entry.name:
            yield (f"{namespace}:{entry.name}" if namespace else entry.name), entry


def is_api(name):
    """Answered to programs: a token, JSON, a 401 rather than a sign-in page."""
    return name.startswith("api:") or name == "metrics"


def path_params(pattern):
    return list(pattern.pattern.converters)


def test_every_route_is_classified():
    names = [name for name, _ in routes()]
    unknown = sorted(set(names) - set(ACCESS))
    assert not unknown, f"say who may reach these routes in ACCESS: {unknown}"
    assert not set(ACCESS) - set(names), f"routes gone: {sorted(set(ACCESS) - set(names))}"


def test_object_ids_in_urls_cannot_be_guessed():
    """Every path names its object by a UUID, or by a name or number within an object named by a
    UUID: counting through ids reaches nothing."""
    for name, pattern in routes():
        converters = pattern.pattern.converters
        kinds = [type(converters[p]).__name__ for p in path_params(pattern)]
        if kinds:
            assert kinds[0] == "UUIDConverter", f"{name}: its first path parameter is a {kinds[0]}, not a UUID"


@pytest.fixture
def world(alice, rate, storage_dir):
    world = make_world(alice, "zanzibar")
    key, size, sha256 = get_storage().save_blob(io.BytesIO(b"checkpoint bytes"))
    Checkpoint.objects.create(job=world.job, name="step-1.pt", step=1, key=key, size=size, sha256=sha256, written_at=timezone.now() - timedelta(minutes=1))
    # An evaluation job that wrote its evaluation, for the comparison routes.
    world.evaluation = make_job(alice, name="zanzibar-evaluation", kind=Job.KIND_EVALUATE)
    result = {"metric": "accuracy", "higher_is_better": True, "models": {"new": {"per_example": [1, 1, 0, 1]}, "previous": {"per_example": [1, 0, 0, 1]}}}
    key, size, sha256 = get_storage().save_blob(io.BytesIO(json.dumps(result).encode()))
    Artifact.objects.create(job=world.evaluation, name=EVALUATION_FILE, key=key, size=size, sha256=sha256)
    world.webhook = Webhook.objects.create(team=alice.membership.team, url="https://hooks.example/zanzibar", created_by=alice)
    world.tracker = Tracker(team=alice.membership.team, url="https://mlflow.example/zanzibar", created_by=alice)
    world.tracker.set_token("mlflow-token-zanzibar")
    world.tracker.save()
    return world


@pytest.fixture
def persona_client(client, alice, bob, charlie):
    """A client logged in (pages) and holding a token (API) as the persona."""

    def login(persona):
        user = {"owner": alice, "member": bob, "outsider": charlie, "anonymous": None}[persona]
        if user is None:
            return client, None
        make_world(charlie, "quokka") if persona == "outsider" else None  # the outsider's own things
        client.force_login(user)
        return client, Token.objects.create(user=user).key

    return login


def url_of(name, pattern, world):
    values = {**world.path_values(), "name": world.artifact.name, "webhook_id": world.webhook.pk}
    if name.endswith("checkpoint"):
        values["name"] = "step-1.pt"
    if name.endswith("comparison"):
        values["job_id"] = world.evaluation.pk
    return reverse(name, kwargs={p: values[p] for p in path_params(pattern)})


def body_of(response):
    content = b"".join(response.streaming_content) if response.streaming else response.content
    return content.decode(errors="replace")


def call(client, name, method, url, key):
    headers = {"HTTP_AUTHORIZATION": f"Token {key}"} if key and is_api(name) else {}
    if method == "POST":
        return client.generic(
            "POST", url, b"{}" if is_api(name) else b"", content_type="application/json" if is_api(name) else "application/x-www-form-urlencoded", **headers
        )
    return client.generic(method, url, **headers)


def expectation(access, persona, name, has_object):
    """What the persona must get: 'in' (not refused), 'refused' (401/403/404), 'login', '401'."""
    api = is_api(name)
    if access == PUBLIC:
        return "in"
    if persona == "anonymous":
        return "401" if api else "login"
    if access == STAFF:
        return "refused"
    if persona == "outsider":
        return "refused" if has_object else "in"
    if access == OWNER and persona == "member":
        return "refused"
    return "in"


@pytest.mark.parametrize("persona", PERSONAS)
def test_every_route_answers_each_persona_as_the_table_says(world, persona_client, persona):
    client, key = persona_client(persona)
    secrets = [*world.secrets(), world.webhook.url, str(world.webhook.pk), world.tracker.url]
    checked = 0
    # Reads first, then the calls that change things (a cancel, a seal), so each read sees the
    # world as made.
    everything = sorted(routes(), key=lambda route: route[0] in LAST)
    for method in ("GET", "POST"):
        for name, pattern in everything:
            if name == "logout":
                continue  # would end the persona's session half way through the table
            url = url_of(name, pattern, world)
            response = call(client, name, method, url, key)
            status, text = response.status_code, body_of(response)
            where = f"{persona}: {method} {url} ({name})"
            assert status < 500, f"{where}: {status} {text[:300]}"
            if status == 405:
                continue  # the route does not take this method, whoever asks
            access = ACCESS[name][method] if isinstance(ACCESS[name], dict) else ACCESS[name]
            want = expectation(access, persona, name, bool(path_params(pattern)))
            if want == "in":
                assert status not in REFUSED, f"{where}: refused with {status}: {text[:300]}"
            elif want == "refused":
                assert status in REFUSED, f"{where}: should be refused, got {status}: {text[:300]}"
                if not is_api(name):
                    assert status == 404 or (access in (OWNER, STAFF) and status == 403), f"{where}: pages refuse with a 404"
            elif want == "login":
                assert status == 302 and response["Location"].startswith(reverse("login")), f"{where}: {status}"
            elif want == "401":
                assert status == 401, f"{where}: {status}"
            if persona in ("outsider", "anonymous") or want == "refused":
                for secret in secrets:
                    assert secret not in text, f"{where}: the answer names {secret!r}: {text[:300]}"
            if method == "GET":  # (a rotation shows its new secret once, after the POST)
                assert world.webhook.secret not in text, f"{where}: a webhook's secret is shown again"
            assert "mlflow-token-zanzibar" not in text, f"{where}: the tracker's token is shown"
            checked += 1
    assert checked >= 70


@pytest.mark.parametrize("persona", PERSONAS)
def test_the_admin_is_for_staff_only(client, alice, bob, charlie, persona):
    user = {"owner": alice, "member": bob, "outsider": charlie, "anonymous": None}[persona]
    if user is not None:
        client.force_login(user)
    response = client.get(reverse("admin:index"))
    assert response.status_code == 302 and response["Location"].startswith(reverse("admin:login"))


@pytest.mark.django_db(transaction=True)
def test_the_job_websocket_admits_the_team_only(settings, alice, bob, charlie, rate):
    from channels.layers import channel_layers

    from e31web.asgi import application
    from jobs import live

    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
    channel_layers.backends = {}
    job = make_job(alice, name="zanzibar-job")
    keys = {p: Token.objects.create(user=u).key for p, u in (("owner", alice), ("member", bob), ("outsider", charlie))}

    async def connect(persona):
        headers = [(b"origin", b"http://localhost")]
        if persona in keys:
            headers.append((b"authorization", f"Token {keys[persona]}".encode()))
        comm = WebsocketCommunicator(application, f"/ws/jobs/{job.pk}/", headers=headers)
        connected, code = await comm.connect()
        first = await comm.receive_json_from(timeout=5) if connected else None
        await comm.disconnect()
        return connected, code, first

    try:
        for persona in PERSONAS:
            connected, code, first = async_to_sync(connect)(persona)
            if persona in ("owner", "member"):
                assert connected, persona
                assert first["type"] == "events" and first["events"][0]["kind"] == "state"
            else:
                assert not connected and code == 4404, (persona, code)
    finally:
        if live.relay.task is not None:
            live.relay.task.cancel()
            live.relay.task = None
        channel_layers.backends = {}


def test_presigned_urls_go_to_the_team_only_and_cannot_be_bent_to_another_object(client, alice, bob, charlie, rate, s3_storage):
    """On S3 a download is a redirect to a short-lived presigned URL: the team gets one, an outsider
    gets a 404 and no URL; a presigned URL with its key changed to another object, or with its
    signature removed, is refused by the store."""
    world = make_world(alice, "zanzibar")
    other_key, _, _ = get_storage().save_blob(io.BytesIO(b"another team's weights"))
    url = reverse("jobs:artifact", args=[world.job.pk, world.artifact.name])
    for user in (alice, bob):
        client.force_login(user)
        response = client.get(url)
        assert response.status_code == 302, user
        fetched = httpx.get(response["Location"])
        assert fetched.status_code == 200 and fetched.content == b"weights"
    presigned = response["Location"]
    api = client.get(reverse("api:job-artifact", args=[world.job.pk, world.artifact.name]), HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=bob).key}")
    assert api.status_code == 302 and httpx.get(api["Location"]).status_code == 200

    client.force_login(charlie)
    refused = client.get(url)
    assert refused.status_code == 404 and "Location" not in refused
    # Another object's key put into the team's presigned URL: the signature no longer fits.
    bent = presigned.replace(world.artifact.key, other_key)
    assert bent != presigned
    assert httpx.get(bent).status_code == 403
    unsigned = re.sub(r"X-Amz-Signature=[0-9a-f]+", "X-Amz-Signature=" + "0" * 64, presigned)
    assert httpx.get(unsigned).status_code == 403


def test_every_form_needs_its_csrf_token(world, alice):
    """Every page that takes a POST refuses one without the CSRF token (a session's API calls
    too), and every POST form the pages draw carries the token."""
    from django.test import Client

    client = Client(enforce_csrf_checks=True)
    client.force_login(alice)
    posted = drawn = 0
    for name, pattern in routes():
        if ACCESS.get(name) == PUBLIC and name != "login":
            continue
        url = url_of(name, pattern, world)
        page = client.get(url, HTTP_ACCEPT="text/html")
        if page.status_code == 200 and page.get("Content-Type", "").startswith("text/html"):
            html = body_of(page)
            for form in re.findall(r"<form\b[^>]*>.*?</form>", html, flags=re.S | re.I):
                if re.search(r'method="?post', form, flags=re.I):
                    assert "csrfmiddlewaretoken" in form, f"{name}: a POST form without the CSRF token: {form[:300]}"
                    drawn += 1
        if is_api(name):
            response = client.post(url, b"{}", content_type="application/json")
        else:
            response = client.post(url, {}, HTTP_ACCEPT="text/html")
        if response.status_code == 405:
            continue
        if is_api(name) and response.status_code == 401:
            continue  # not signed in through the session here (the API's own login is its token)
        assert response.status_code == 403, f"POST {url} ({name}) without the CSRF token: {response.status_code}"
        posted += 1
    assert posted >= 15 and drawn >= 5, (posted, drawn)
