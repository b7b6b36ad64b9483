"""Every route of the API, called by an outsider (another team's token) on a team's objects:
always a 404 (or 403), never a 2xx and never a word of the team's data; and without a token:
401. The routes are read from e31web.api_urls, so a new endpoint is covered (or fails here,
asking for a value of its path parameters) without being listed."""

import pytest
from django.urls import URLPattern, reverse
from rest_framework.authtoken.models import Token

from e31web import api_urls
from tests.api_world import make_world

# Routes anyone may call: the schema, its docs page, and trading a password for a token.
PUBLIC = {"schema": ["GET"], "docs": ["GET"], "token": ["POST"]}
BODY_METHODS = {"POST", "PUT", "PATCH"}


def routes():
    for pattern in api_urls.urlpatterns:
        assert isinstance(pattern, URLPattern), f"{pattern}: nested URL includes are not walked here; add them"
        yield pattern


def methods(pattern):
    """The methods the view answers (other than OPTIONS/HEAD)."""
    view = pattern.callback
    cls = getattr(view, "cls", None) or getattr(view, "view_class", None)
    assert cls is not None, f"{pattern.name}: not a DRF view"
    return [m.upper() for m in cls.http_method_names if m not in ("options", "head", "trace") and hasattr(cls, m)]


def path_params(pattern):
    return list(pattern.pattern.converters)


def url_of(pattern, values):
    missing = [p for p in path_params(pattern) if p not in values]
    assert not missing, f"api:{pattern.name}: give a value for the path parameter(s) {missing} in tests/api_world.py"
    return reverse(f"api:{pattern.name}", kwargs={p: values[p] for p in path_params(pattern)})


def call(client, method, url, key=None):
    headers = {"HTTP_AUTHORIZATION": f"Token {key}"} if key else {}
    if method in BODY_METHODS:
        return client.generic(method, url, b"{}", content_type="application/json", **headers)
    return client.generic(method, url, **headers)


@pytest.fixture
def world(alice, rate):
    return make_world(alice, "zanzibar")


@pytest.fixture
def outsider_key(charlie):
    make_world(charlie, "quokka")  # the outsider's own things, to make sure lists are not empty by accident
    return Token.objects.create(user=charlie).key


def test_every_route_is_known():
    names = [p.name for p in routes()]
    assert len(names) == len(set(names)), "every API route needs a unique name"
    for name in PUBLIC:
        assert name in names
    assert all(methods(p) for p in routes())


def test_an_outsiders_token_reaches_nothing_of_another_team(client, world, outsider_key):
    values, secrets = world.path_values(), world.secrets()
    checked = 0
    for pattern in routes():
        if pattern.name in ("schema", "docs"):
            continue
        url = url_of(pattern, values)
        for method in methods(pattern):
            response = call(client, method, url, outsider_key)
            where = f"{method} {url} (api:{pattern.name})"
            body = b"".join(response.streaming_content) if response.streaming else response.content
            text = body.decode(errors="replace")
            assert response.status_code < 500, f"{where}: {response.status_code} {text[:500]}"
            if path_params(pattern) and pattern.name != "token":
                assert response.status_code in (403, 404), f"{where}: an outsider got {response.status_code}: {text[:300]}"
                assert "detail" in response.json(), where
            for secret in secrets:
                assert secret not in text, f"{where}: the answer names {secret!r} of the other team: {text[:300]}"
            checked += 1
    assert checked >= 35


def test_without_a_token_every_route_is_a_401(client, world):
    values = world.path_values()
    for pattern in routes():
        url = url_of(pattern, values)
        for method in methods(pattern):
            if method in PUBLIC.get(pattern.name, []):
                continue
            response = call(client, method, url)
            where = f"{method} {url} (api:{pattern.name})"
            assert response.status_code == 401, f"{where}: {response.status_code}"
            body = response.json()
            assert "Token" in body["detail"] and response["WWW-Authenticate"].startswith("Token"), where


def test_a_bad_token_is_a_401_in_the_shape(client, world):
    response = client.get(reverse("api:jobs"), HTTP_AUTHORIZATION="Token not-a-token")
    assert response.status_code == 401
    assert response.json()["detail"].startswith("Invalid token.")


def test_the_public_routes_are_public(client):
    assert client.get(reverse("api:schema")).status_code == 200
    assert client.get(reverse("api:docs")).status_code == 200
    response = client.post(reverse("api:token"), {}, content_type="application/json")
    assert response.status_code == 400 and "detail" in response.json()
