"""What every endpoint of the API shares: errors in one shape, Django's own 404/500 as JSON under
/api/ (and pages elsewhere), pagination, and the rate limit per token."""

import pytest
from django.core.cache import cache
from django.urls import path, reverse
from rest_framework.authtoken.models import Token
from rest_framework.decorators import api_view

from catalog.models import Dataset
from core import api
from core.env import parse_rate
from tests.conftest import make_user


@pytest.fixture
def api_client(client, alice):
    key = Token.objects.create(user=alice).key
    client.defaults["HTTP_AUTHORIZATION"] = f"Token {key}"
    return client


@pytest.fixture(autouse=True)
def fresh_cache():
    cache.clear()
    yield
    cache.clear()


def test_a_validation_error_names_the_fields_and_says_what_to_do(api_client):
    response = api_client.get(reverse("api:usage") + "?month=2026-13")
    body = response.json()
    assert response.status_code == 400 and set(body) == {"detail", "errors"}
    assert body["detail"].startswith("The request was refused: month: ") and body["detail"].endswith(".")
    assert list(body["errors"]) == ["month"] and body["errors"]["month"]


def test_a_form_error_has_a_detail_too(api_client, team_a):
    response = api_client.post(reverse("api:datasets"), {"description": "no name"}, content_type="application/json")
    body = response.json()
    assert response.status_code == 400 and body["errors"] == {"name": ["This field is required."]}
    assert body["detail"] == "The request was refused: name: This field is required."
    response = api_client.post(reverse("api:datasets"), [1, 2], content_type="application/json")
    assert response.status_code == 400 and "non_field_errors" in response.json()["errors"]


def test_form_errors_response_takes_a_dict():
    response = api.form_errors_response({"__all__": ["Pick one"], "gpus": ["Ask for at least 1 GPU."]})
    assert response.status_code == 400
    assert response.data == {
        "detail": "The request was refused: Pick one. gpus: Ask for at least 1 GPU.",
        "errors": {"non_field_errors": ["Pick one"], "gpus": ["Ask for at least 1 GPU."]},
    }


@pytest.mark.parametrize(
    "method, url, body, content_type, status, words",
    [
        ("patch", "/api/usage/", None, None, 405, "GET"),
        ("post", "/api/datasets/", b"{not json", "application/json", 400, "could not be read"),
        ("post", "/api/datasets/", b"<x/>", "application/xml", 415, "application/json"),
        ("get", "/api/jobs/00000000-0000-0000-0000-000000000000/", None, None, 404, "No such job"),
        ("get", "/api/no-such-endpoint/", None, None, 404, "/api/docs/"),
        ("get", "/api/jobs/not-a-uuid/", None, None, 404, "Nothing is at this address"),
    ],
)
def test_errors_have_one_shape(api_client, team_a, method, url, body, content_type, status, words):
    kwargs = {"data": body, "content_type": content_type} if body is not None else {}
    response = getattr(api_client, method)(url, **kwargs)
    assert response.status_code == status and response["Content-Type"].startswith("application/json")
    assert words in response.json()["detail"]


def test_outside_the_api_a_404_is_a_page(client, alice):
    client.force_login(alice)
    response = client.get("/no-such-page/")
    assert response.status_code == 404 and not response["Content-Type"].startswith("application/json")


def crash(request):
    raise RuntimeError("a bug")


@api_view(["GET"])
def api_crash(request):
    raise RuntimeError("a bug")


urlpatterns = [path("api/crash/", api_crash), path("api/plain-crash/", crash), path("crash/", crash)]
handler404 = "core.api.page_not_found"
handler500 = "core.api.server_error"


@pytest.mark.urls("tests.test_api_conventions")
def test_a_crash_under_the_api_is_a_json_500(client, alice):
    client.raise_request_exception = False
    client.force_login(alice)
    for url in ("/api/crash/", "/api/plain-crash/"):
        response = client.get(url)
        assert response.status_code == 500 and "Try again later" in response.json()["detail"], url
    response = client.get("/crash/")
    assert response.status_code == 500 and not response["Content-Type"].startswith("application/json")


def test_lists_are_paginated(api_client, team_a):
    for i in range(5):
        Dataset.objects.create(team=team_a, name=f"set-{i}")
    first = api_client.get(reverse("api:datasets") + "?page_size=2").json()
    assert first["count"] == 5 and [d["name"] for d in first["results"]] == ["set-0", "set-1"]
    assert first["previous"] is None and "page=2" in first["next"] and "page_size=2" in first["next"]
    last = api_client.get(first["next"].replace("page=2", "page=3")).json()
    assert [d["name"] for d in last["results"]] == ["set-4"] and last["next"] is None and "page=2" in last["previous"]
    response = api_client.get(reverse("api:datasets") + "?page=4&page_size=2")
    assert response.status_code == 404 and "the last page is 3" in response.json()["detail"]
    for bad in ("page=0", "page=x", "page_size=0", "page_size=201"):
        response = api_client.get(reverse("api:datasets") + "?" + bad)
        assert response.status_code == 400 and bad.split("=")[0] in response.json()["errors"], bad
    assert api_client.get(reverse("api:invoices")).json() == {"count": 0, "next": None, "previous": None, "results": []}
    usage = api_client.get(reverse("api:usage")).json()
    assert usage["count"] == 0 and usage["records"] == [] and usage["next"] is None


def test_the_rate_limit_is_per_token(client, settings, alice, charlie):
    settings.E31_API_RATE = "3/min"
    first, second = Token.objects.create(user=alice).key, Token.objects.create(user=charlie).key
    url = reverse("api:usage")
    for _ in range(3):
        assert client.get(url, HTTP_AUTHORIZATION=f"Token {first}").status_code == 200
    response = client.get(url, HTTP_AUTHORIZATION=f"Token {first}")
    assert response.status_code == 429
    body = response.json()
    assert 1 <= body["retry_after"] <= 60 and response["Retry-After"] == str(body["retry_after"])
    assert body["detail"] == f"Too many requests: try again in {body['retry_after']} seconds."
    # Another user's token is not limited by the first one's calls.
    assert client.get(url, HTTP_AUTHORIZATION=f"Token {second}").status_code == 200
    # A session counts per user.
    bob = make_user("bob", alice.membership.team)
    client.force_login(bob)
    assert [client.get(url).status_code for _ in range(4)] == [200, 200, 200, 429]
    settings.E31_API_RATE = None  # off
    assert client.get(url, HTTP_AUTHORIZATION=f"Token {first}").status_code == 200


def test_rates_are_read_strictly():
    assert parse_rate("1200/min") == (1200, 60) and parse_rate("20/s") == (20, 1) and parse_rate("5/hour") == (5, 3600)
    assert parse_rate("off") is None and parse_rate(None) is None
    with pytest.raises(ValueError):
        parse_rate("fast")
