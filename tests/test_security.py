"""Deployment security: production settings pass Django's deploy checks, pages carry the
security headers, and sign-in is refused for a while after too many failures."""

import os
import secrets
import subprocess
import sys
import time

import pytest
from django.urls import reverse

from tests.conftest import PASSWORD
from tests.system import ROOT


@pytest.mark.nodb
def test_production_settings_pass_the_deploy_checks(tmp_path):
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "E31_VAR_DIR": str(tmp_path),
        "SECRET_KEY": secrets.token_urlsafe(50),
        "E31_HTTPS": "1",
        "ALLOWED_HOSTS": "e31.example.com",
    }
    result = subprocess.run([sys.executable, "manage.py", "check", "--deploy", "--fail-level", "WARNING"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    # The embedded default (plain http on localhost) is what the same check warns about.
    plain = subprocess.run(
        [sys.executable, "manage.py", "check", "--deploy", "--fail-level", "WARNING"],
        cwd=ROOT,
        env={k: v for k, v in env.items() if k != "E31_HTTPS"},
        capture_output=True,
        text=True,
    )
    assert plain.returncode != 0 and "SECURE_SSL_REDIRECT" in plain.stdout + plain.stderr


def test_pages_carry_the_security_headers(client, alice):
    client.force_login(alice)
    response = client.get(reverse("jobs:list"))
    assert response["X-Frame-Options"] == "DENY"
    assert response["X-Content-Type-Options"] == "nosniff"
    assert response["Referrer-Policy"] == "same-origin"
    assert response["Cross-Origin-Opener-Policy"] == "same-origin"


def test_https_settings_redirect_and_send_hsts(client, settings):
    settings.SECURE_SSL_REDIRECT = True
    settings.SECURE_HSTS_SECONDS = 3600
    assert client.get("/accounts/login/").status_code == 301
    secure = client.get("/accounts/login/", secure=True)
    assert secure.status_code == 200 and secure["Strict-Transport-Security"] == "max-age=3600"


@pytest.fixture
def few_attempts(settings):
    settings.E31_LOGIN_FAILURES = 3
    settings.E31_LOGIN_WINDOW_SECONDS = 600


def test_the_sign_in_page_refuses_after_too_many_failures(client, alice, few_attempts):
    for _ in range(3):
        assert client.post(reverse("login"), {"username": "alice", "password": "wrong"}).status_code == 200
    refused = client.post(reverse("login"), {"username": "alice", "password": PASSWORD})
    assert refused.status_code == 429 and "Too many failed sign-ins: try again in 10 minutes." in refused.content.decode()
    assert int(refused["Retry-After"]) > 590
    assert "_auth_user_id" not in client.session  # even the right password waits out the window


def test_a_right_password_clears_the_username_not_the_address(client, alice, bob, few_attempts):
    from accounts import signin

    for _ in range(2):
        client.post(reverse("login"), {"username": "alice", "password": "wrong"})
    assert client.post(reverse("login"), {"username": "alice", "password": PASSWORD}).status_code == 302
    client.logout()
    assert signin.retry_after("alice", "10.0.0.9") == 0  # alice's count is cleared
    # The address has had 2 failures; a third (for bob) locks the address for every username.
    assert client.post(reverse("login"), {"username": "bob", "password": "wrong"}).status_code == 200
    assert client.post(reverse("login"), {"username": "alice", "password": PASSWORD}).status_code == 429
    # The window passes.
    assert signin.retry_after("alice", "127.0.0.1", now=time.time() + 601) == 0


def test_the_token_endpoint_shares_the_limit(client, alice, few_attempts):
    url = reverse("api:token")
    for _ in range(3):
        assert client.post(url, {"username": "alice", "password": "wrong"}, content_type="application/json").status_code == 401
    refused = client.post(url, {"username": "alice", "password": PASSWORD}, content_type="application/json")
    assert refused.status_code == 429 and refused.json()["retry_after"] > 0 and "token" not in refused.json()
