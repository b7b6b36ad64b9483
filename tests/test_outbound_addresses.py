"""The addresses the network itself calls (webhooks, bucket endpoints): never loopback, private,
link-local or other internal ones unless the operators allow them. Attacker first: a team that
points its webhook at the network's own metrics, a cloud's metadata service or a name that
rebinds to loopback learns nothing from the delivery log. Refused when saved, checked again
(after DNS) when sent, connected to the address checked, redirects not followed."""

import datetime
import http.server
import socket
import ssl
import threading

import httpx
import pytest
from django.test import Client
from django.urls import reverse

from core import endpoints
from notifications import events, policy
from notifications.delivery import Worker
from notifications.models import Delivery, EmailPreference, Webhook
from tests.conftest import PASSWORD
from tests.test_settings import check

# Pure: the one address policy -----------------------------------------------------------------


@pytest.mark.nodb
@pytest.mark.parametrize(
    "address,kind",
    [
        ("127.0.0.1", "loopback"),
        ("::1", "loopback"),
        ("169.254.169.254", "link-local"),  # a cloud's metadata service
        ("fe80::1", "link-local"),
        ("::ffff:127.0.0.1", "loopback"),  # IPv4-mapped IPv6
        ("::ffff:169.254.169.254", "link-local"),
        ("2002:7f00:1::1", "loopback"),  # 6to4 wrapping 127.0.0.1
        ("64:ff9b::a9fe:a9fe", "link-local"),  # NAT64 wrapping 169.254.169.254
        ("10.1.2.3", "private"),
        ("fd00::1", "private"),
        ("0.0.0.0", "unspecified"),
        ("::", "unspecified"),
        ("224.0.0.1", "multicast"),
        ("ff02::1", "multicast"),
        ("240.0.0.1", "reserved"),
        ("100.64.0.1", "non-public"),
    ],
)
def test_every_internal_kind_of_address_is_named(address, kind):
    assert endpoints.kind_of(address) == kind


@pytest.mark.nodb
@pytest.mark.parametrize("address", ["93.184.215.14", "2606:2800:21f:cb07:6820:80da:af6b:8b2c", "64:ff9b::5db8:d70e"])
def test_a_public_address_is_not_refused(address):
    assert endpoints.kind_of(address) is None
    assert endpoints.refusal("hooks.example", [address], purpose="webhook") is None


@pytest.mark.nodb
def test_a_webhook_refusal_says_why_in_its_own_words():
    reason = endpoints.refusal("hooks.example", ["93.184.215.14", "127.0.0.1"], purpose="webhook")
    assert reason == "the webhook hooks.example (127.0.0.1) is at a loopback address; a webhook must be at a public address"
    assert "cannot be found" in endpoints.refusal("nowhere.invalid", [], purpose="webhook")
    assert endpoints.refusal("hooks.internal", ["10.1.2.3"], ["hooks.internal"], purpose="webhook") is None
    # The bucket endpoints' words are as they were.
    assert "a bucket's endpoint must be at a public address" in endpoints.refusal("127.0.0.1", ["127.0.0.1"])


@pytest.mark.nodb
def test_each_purpose_has_its_own_allow_list():
    assert endpoints.check_url("http://127.0.0.1:8080/", "webhook", allow=[]) is not None
    assert endpoints.check_url("http://127.0.0.1:8080/", "webhook", allow=["127.0.0.1"]) is None
    with pytest.raises(KeyError):
        endpoints.check_url("http://127.0.0.1:8080/", "somewhere else", allow=[])


@pytest.mark.nodb
def test_a_reply_excerpt_is_short_and_plain():
    body = "\x1b[31mroot:x:0:0\x1b[0m\r\n\x00" + "A" * 500 + "SECRET-AT-THE-END"
    text = policy.excerpt(body)
    assert len(text) <= policy.EXCERPT_CHARS + 1 and text.endswith("…")
    assert "root:x:0:0" in text and "SECRET" not in text
    assert not any(ord(c) < 32 or 0x7F <= ord(c) < 0xA0 for c in text)
    assert policy.excerpt(b"ok\n") == "ok" and policy.excerpt("a\u202eb\u200bc") == "a b c"


@pytest.mark.nodb
def test_a_bad_webhook_allow_list_stops_start_up(tmp_path):
    result = check(tmp_path, E31_WEBHOOK_ALLOW="hooks.internal,10.0.0.0/33")
    assert result.returncode != 0
    assert "ImproperlyConfigured" in result.stderr and "E31_WEBHOOK_ALLOW" in result.stderr and "10.0.0.0/33" in result.stderr


# Receivers on loopback ------------------------------------------------------------------------


class Server(http.server.ThreadingHTTPServer):
    """Records each request; answers with `status`, `body` and `headers`."""

    daemon_threads = True

    def __init__(self, host="127.0.0.1", port=0, status=200, body=b"ok", headers=()):
        super().__init__((host, port), Handler)
        self.port = self.server_address[1]
        self.requests, self.status, self.body, self.headers = [], status, body, dict(headers)


class Handler(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.server.requests.append((self.path, dict(self.headers)))
        self.send_response(self.server.status)
        for name, value in self.server.headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(self.server.body)))
        self.end_headers()
        self.wfile.write(self.server.body)

    do_GET = do_POST

    def log_message(self, *args):
        pass


@pytest.fixture
def serve():
    servers = []

    def start(**options):
        server = Server(**options)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


@pytest.fixture
def dns(monkeypatch):
    """Names of our own, resolved as the test says (change the dict to rebind a name); every
    other name as the system resolves it."""
    names, real = {}, socket.getaddrinfo

    def getaddrinfo(host, port, *args, **kwargs):
        if isinstance(host, bytes):
            host = host.decode()
        if host in names:
            answer = names[host]
            if isinstance(answer, list):  # a sequence: one answer per lookup, the last one repeated
                answer = answer.pop(0) if len(answer) > 1 else answer[0]
            family = socket.AF_INET6 if ":" in answer else socket.AF_INET
            return [(family, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", (answer, int(port or 0)))]
        return real(host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return names


@pytest.fixture
def no_allow(settings):
    settings.E31_WEBHOOK_ALLOW = []
    return settings


def login(user):
    client = Client()
    assert client.login(username=user.username, password=PASSWORD)
    return client


def webhook_only(alice):
    EmailPreference.objects.create(user=alice, kinds=[])  # no email deliveries in the way


def send_test_event(webhook, user):
    events.send_test(webhook, user)
    assert Worker(timeout=2).drain() == 1
    return Delivery.objects.get(webhook=webhook)


# Refused when saved ---------------------------------------------------------------------------

INTERNAL = [
    ("http://127.0.0.1:{port}/metrics", "loopback"),
    ("http://[::1]/", "loopback"),
    ("http://169.254.169.254/latest/meta-data/", "link-local"),
    ("http://[::ffff:127.0.0.1]/", "loopback"),
    ("http://localhost:{port}/", "loopback"),  # a name that resolves to loopback
    ("http://sneaky.example/hook", "loopback"),  # resolves to 127.0.0.1 (the dns fixture)
    ("http://10.0.0.5:9090/", "private"),
    ("http://0.0.0.0:{port}/", "unspecified"),
]


@pytest.mark.parametrize("url,kind", INTERNAL)
def test_a_webhook_at_an_internal_address_is_refused_when_added(alice, team_a, no_allow, dns, url, kind):
    dns["sneaky.example"] = "127.0.0.1"
    response = login(alice).post(reverse("notifications:webhook_add"), {"url": url.format(port=8000), "kinds": [], "active": "on"})
    page = response.content.decode()
    assert response.status_code == 400 and f"{kind} address" in page and "a webhook must be at a public address" in page
    assert not Webhook.objects.exists()


@pytest.mark.parametrize("url,kind", INTERNAL)
def test_a_webhook_cannot_be_changed_to_an_internal_address(alice, team_a, no_allow, dns, url, kind):
    dns["sneaky.example"] = "127.0.0.1"
    dns["hooks.example"] = "93.184.215.14"
    client = login(alice)
    assert client.post(reverse("notifications:webhook_add"), {"url": "https://hooks.example/e31", "active": "on"}).status_code == 302
    webhook = Webhook.objects.get()
    response = client.post(reverse("notifications:webhook", args=[webhook.pk]), {"url": url.format(port=8000), "active": "on"})
    assert response.status_code == 400 and f"{kind} address" in response.content.decode()
    webhook.refresh_from_db()
    assert webhook.url == "https://hooks.example/e31"


def test_staff_cannot_point_a_team_s_webhook_at_an_internal_address_in_the_admin(alice, team_a, no_allow, dns):
    from django.contrib.auth import get_user_model

    get_user_model().objects.create_superuser("root", "root@example.com", PASSWORD)
    client = Client()
    assert client.login(username="root", password=PASSWORD)
    dns["hooks.example"] = "93.184.215.14"
    form = {"team": team_a.pk, "kinds": "[]", "active": "on", "created_at_0": "2026-12-01", "created_at_1": "10:00:00"}
    response = client.post(reverse("admin:notifications_webhook_add"), {**form, "url": "http://127.0.0.1:9090/metrics"})
    assert response.status_code == 200 and "loopback address" in response.content.decode()
    assert not Webhook.objects.exists()
    response = client.post(reverse("admin:notifications_webhook_add"), {**form, "url": "https://hooks.example/e31"})
    assert response.status_code == 302, response.content.decode()[:2000]
    assert Webhook.objects.get().url == "https://hooks.example/e31"


def test_the_allow_list_lets_an_operator_s_internal_receiver_be_added(alice, team_a, settings):
    settings.E31_WEBHOOK_ALLOW = ["127.0.0.1", "hooks.internal"]
    client = login(alice)
    for url in ("http://127.0.0.1:8080/hook", "http://hooks.internal/hook"):
        assert client.post(reverse("notifications:webhook_add"), {"url": url, "active": "on"}).status_code == 302
    assert Webhook.objects.count() == 2
    # The buckets' allow-list is another: it lets nothing in here.
    settings.E31_WEBHOOK_ALLOW, settings.E31_S3_ENDPOINT_ALLOW = [], ["127.0.0.1"]
    assert client.post(reverse("notifications:webhook_add"), {"url": "http://127.0.0.1:8080/hook"}).status_code == 400


# Checked again when sent ----------------------------------------------------------------------


@pytest.mark.parametrize("url", ["http://127.0.0.1:{port}/metrics", "http://localhost:{port}/metrics", "http://[::ffff:127.0.0.1]:{port}/metrics"])
def test_a_webhook_saved_while_allowed_is_not_sent_once_the_allow_list_drops_it(alice, team_a, settings, serve, url):
    metrics = serve(body=b"e31_secret_metric 42")
    settings.E31_WEBHOOK_ALLOW = ["127.0.0.1", "localhost"]  # ::ffff:127.0.0.1 is judged as 127.0.0.1
    webhook_only(alice)
    client = login(alice)
    assert client.post(reverse("notifications:webhook_add"), {"url": url.format(port=metrics.port), "active": "on"}).status_code == 302
    webhook = Webhook.objects.get()
    settings.E31_WEBHOOK_ALLOW = []
    delivery = send_test_event(webhook, alice)
    assert metrics.requests == []
    assert delivery.last_status is None and "loopback address" in delivery.last_error and delivery.state == Delivery.PENDING
    page = client.get(reverse("notifications:webhook", args=[webhook.pk])).content.decode()
    assert "e31_secret_metric" not in page and "loopback address" in page


def test_a_name_that_resolves_to_loopback_by_send_time_is_not_sent(alice, team_a, no_allow, serve, dns):
    metrics = serve(body=b"e31_secret_metric 42")
    dns["hooks.example"] = "93.184.215.14"  # public when saved
    webhook_only(alice)
    client = login(alice)
    url = f"http://hooks.example:{metrics.port}/metrics"
    assert client.post(reverse("notifications:webhook_add"), {"url": url, "active": "on"}).status_code == 302
    dns["hooks.example"] = "127.0.0.1"  # and then the team's DNS points it home
    delivery = send_test_event(Webhook.objects.get(), alice)
    assert metrics.requests == []
    assert delivery.last_status is None and "hooks.example (127.0.0.1) is at a loopback address" in delivery.last_error


def test_a_webhook_stored_with_an_internal_url_is_not_sent(alice, team_a, no_allow, serve):
    metrics = serve()
    webhook_only(alice)
    webhook = Webhook.objects.create(team=team_a, url=f"http://127.0.0.1:{metrics.port}/", created_by=alice)  # the admin, say
    delivery = send_test_event(webhook, alice)
    assert metrics.requests == [] and "loopback address" in delivery.last_error


def test_the_address_checked_is_the_address_connected_to(alice, team_a, settings, serve, dns):
    """A name that answers an allowed address to the check and another to a second lookup
    (DNS rebinding) reaches only the address checked: the connection is made to it, with the
    URL's host kept in the Host header."""
    allowed = serve(host="127.0.0.1")
    rebound = serve(host="127.0.0.2", port=allowed.port, body=b"rebound")  # the same port, another loopback address
    settings.E31_WEBHOOK_ALLOW = ["127.0.0.1"]
    dns["rebind.example"] = ["127.0.0.1", "127.0.0.2"]  # the first lookup, then every later one
    webhook_only(alice)
    webhook = Webhook.objects.create(team=team_a, url=f"http://rebind.example:{allowed.port}/hook", created_by=alice)
    delivery = send_test_event(webhook, alice)
    assert rebound.requests == []
    [(path, headers)] = allowed.requests
    assert path == "/hook" and headers["Host"] == f"rebind.example:{allowed.port}"
    assert (delivery.state, delivery.last_status) == (Delivery.DELIVERED, 200)


# Redirects and replies --------------------------------------------------------------------------


@pytest.mark.parametrize("allow,host", [(["localhost"], "localhost"), (["127.0.0.1"], "127.0.0.1")])
def test_a_redirect_is_recorded_not_followed(alice, team_a, settings, serve, allow, host):
    inside = serve(body=b"e31_secret_metric 42")
    outside = serve(status=302, body=b"", headers={"Location": f"http://127.0.0.1:{inside.port}/metrics"})
    settings.E31_WEBHOOK_ALLOW = allow  # the first receiver only (or, second case, loopback: the redirect alone decides)
    webhook_only(alice)
    webhook = Webhook.objects.create(team=team_a, url=f"http://{host}:{outside.port}/hook", created_by=alice)
    delivery = send_test_event(webhook, alice)
    assert len(outside.requests) == 1 and inside.requests == []
    assert delivery.last_status == 302 and "not followed" in delivery.last_error and delivery.state == Delivery.PENDING


def test_the_delivery_log_shows_a_short_plain_excerpt_of_the_reply(alice, team_a, settings, serve):
    body = b"\x1b[2J\x1b[31m" + b"internal detail\r\n" * 40 + b"\x00TAIL-SECRET"
    receiver = serve(status=500, body=body)
    settings.E31_WEBHOOK_ALLOW = ["127.0.0.1"]
    webhook_only(alice)
    webhook = Webhook.objects.create(team=team_a, url=f"http://127.0.0.1:{receiver.port}/hook", created_by=alice)
    delivery = send_test_event(webhook, alice)
    assert delivery.last_status == 500 and delivery.last_error.startswith("the receiver answered 500: ")
    excerpt = delivery.last_error.removeprefix("the receiver answered 500: ")
    assert 0 < len(excerpt) <= policy.EXCERPT_CHARS + 1 and "internal detail" in excerpt and "TAIL-SECRET" not in excerpt
    assert not any(ord(c) < 32 or c == "\x7f" for c in delivery.last_error)


def self_signed(tmp_path, name):
    """(cert file, key file) of a certificate for `name`, signed by itself."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return cert_file, key_file


def test_https_to_the_checked_address_still_verifies_the_host_s_certificate(alice, team_a, settings, serve, dns, tmp_path):
    """Connected by address, the TLS server name is still the URL's host: the receiver sees it
    (SNI) and its certificate is verified for it."""
    cert_file, key_file = self_signed(tmp_path, "hooks.test")
    receiver = serve()
    names = []
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert_file, key_file)
    context.sni_callback = lambda sock, name, ctx: names.append(name)
    receiver.socket = context.wrap_socket(receiver.socket, server_side=True)
    settings.E31_WEBHOOK_ALLOW = ["127.0.0.1"]  # by network: the pinned path
    dns["hooks.test"] = "127.0.0.1"
    webhook_only(alice)
    trust = ssl.create_default_context(cafile=str(cert_file))
    client = httpx.Client(transport=endpoints.PinnedTransport("webhook", verify=trust), trust_env=False, follow_redirects=False)
    webhook = Webhook.objects.create(team=team_a, url=f"https://hooks.test:{receiver.port}/hook", created_by=alice)
    events.send_test(webhook, alice)
    assert Worker(client=client, timeout=5).drain() == 1
    delivery = Delivery.objects.get(webhook=webhook)
    assert (delivery.state, delivery.last_status) == (Delivery.DELIVERED, 200), delivery.last_error
    assert names == ["hooks.test"] and receiver.requests[0][1]["Host"] == f"hooks.test:{receiver.port}"
    # A certificate for another name is refused, address checked or not.
    webhook.url = f"https://other.test:{receiver.port}/hook"
    webhook.save()
    dns["other.test"] = "127.0.0.1"
    events.send_test(webhook, alice)
    assert Worker(client=client, timeout=5).drain() == 1
    refused = Delivery.objects.exclude(pk=delivery.pk).get(webhook=webhook)
    assert refused.last_status is None and "CERTIFICATE_VERIFY_FAILED" in refused.last_error


# A team's bucket: the client the runners keep connects only where it was judged to --------------


def bucket_client(url):
    from core.buckets import team_bucket
    from core.secrets_box import seal

    team_bucket.cache_clear()
    return team_bucket("dataset", seal({"access_key_id": "key", "secret_access_key": "secret"}), url, "")


def test_a_kept_bucket_client_connects_to_the_address_it_checked(settings, serve, dns):
    allowed = serve(host="127.0.0.1", body=b"<ListBucketResult></ListBucketResult>")
    rebound = serve(host="127.0.0.2", port=allowed.port, body=b"<ListBucketResult></ListBucketResult>")
    settings.E31_S3_ENDPOINT_ALLOW = ["127.0.0.1"]
    dns["bucket.example"] = "127.0.0.1"
    client = bucket_client(f"http://bucket.example:{allowed.port}")
    client.list_objects_v2(Bucket="data")
    [(path, headers)] = allowed.requests
    assert path.startswith("/data") and headers["Host"] == f"bucket.example:{allowed.port}"
    # Its DNS changes to an address the operators did not allow, hours later, say: the client
    # made at the check opens no connection there (botocore alone would resolve and connect).
    dns["bucket.example"] = "127.0.0.2"
    client._endpoint.http_session._manager.clear()  # the kept connection closed, as idle ones are
    with pytest.raises(Exception, match="loopback address") as raised:
        client.list_objects_v2(Bucket="data")
    assert rebound.requests == [] and len(allowed.requests) == 1, raised.value
    # And a proxy from the environment is not used for it (it would connect by name).
    assert client._endpoint.http_session._proxy_config.proxy_url_for(f"http://bucket.example:{allowed.port}") is None
