"""A staff operator without a team gets an API token through the API (as `e31 login` does); it
reaches the operator's endpoints (/metrics) and `GET /api/me/`, and every team endpoint refuses
it with a 403 that says why. A user on a team (staff or not) is unchanged."""

import pytest
from django.urls import reverse
from rest_framework.authtoken.models import Token

from tests.api_world import make_world
from tests.conftest import PASSWORD, make_user
from tests.test_api_permissions import PUBLIC, call, methods, routes, url_of

# Routes a signed-in user without a team may call: who they are.
ANYONE_SIGNED_IN = {"me"}


@pytest.fixture
def olivia(db):
    """A staff operator, on no team."""
    user = make_user("olivia", None)
    user.is_staff = True
    user.save()
    return user


def sign_in(client, username):
    return client.post(reverse("api:token"), {"username": username, "password": PASSWORD}, content_type="application/json")


def test_a_staff_user_without_a_team_gets_a_token(client, olivia):
    response = sign_in(client, "olivia")
    assert response.status_code == 200, response.content
    assert response.json() == {"token": Token.objects.get(user=olivia).key, "username": "olivia"}


def test_the_staff_token_reaches_the_metrics(client, olivia):
    key = sign_in(client, "olivia").json()["token"]
    response = client.get("/metrics", HTTP_AUTHORIZATION=f"Token {key}")
    assert response.status_code == 200 and b"e31_" in response.content
    me = client.get(reverse("api:me"), HTTP_AUTHORIZATION=f"Token {key}")
    assert me.status_code == 200 and me.json()["username"] == "olivia" and me.json()["team"] is None


def test_every_team_endpoint_refuses_the_staff_token_with_a_reason(client, olivia, alice, rate):
    world = make_world(alice, "zanzibar")
    key = sign_in(client, "olivia").json()["token"]
    checked = 0
    for pattern in routes():
        if pattern.name in PUBLIC or pattern.name in ANYONE_SIGNED_IN:
            continue
        url = url_of(pattern, world.path_values())
        for method in methods(pattern):
            response = call(client, method, url, key)
            where = f"{method} {url} (api:{pattern.name})"
            assert response.status_code == 403, f"{where}: {response.status_code}"
            assert "staff" in response.json()["detail"] and "team" in response.json()["detail"], where
            checked += 1
    assert checked > 20


def test_a_user_on_no_team_who_is_not_staff_still_gets_no_token(client, db):
    make_user("loner", None)
    response = sign_in(client, "loner")
    assert response.status_code == 403 and "not on a team" in response.json()["detail"]
    assert not Token.objects.exists()


def test_a_session_without_a_team_is_refused_with_a_reason(client, db):
    loner = make_user("loner", None)
    client.force_login(loner)
    response = client.get(reverse("api:jobs"))
    assert response.status_code == 403 and "not on a team" in response.json()["detail"]


def test_a_staff_user_on_a_team_keeps_both(client, alice, rate):
    alice.is_staff = True
    alice.save()
    key = sign_in(client, "alice").json()["token"]
    assert client.get(reverse("api:jobs"), HTTP_AUTHORIZATION=f"Token {key}").status_code == 200
    assert client.get("/metrics", HTTP_AUTHORIZATION=f"Token {key}").status_code == 200
