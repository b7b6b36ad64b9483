"""Every page, API call and download is scoped to the user's team: the owner and a team member
get in, an outsider gets a 404 (the object's existence is not revealed), anonymous users are
sent to log in (pages) or refused (API)."""

import pytest
from django.urls import reverse
from rest_framework.authtoken.models import Token

from jobs.models import Artifact
from tests.conftest import make_job

JOB_PAGES = [
    ("get", "jobs:detail", ()),
    ("get", "jobs:log", ()),
    ("post", "jobs:cancel", ()),
    ("get", "jobs:artifact", ("model.pt",)),
]
JOB_API = [
    ("get", "api:job", ()),
    ("get", "api:job-logs", ()),
    ("get", "api:job-log", ()),
    ("post", "api:job-cancel", ()),
    ("get", "api:job-artifacts", ()),
    ("get", "api:job-artifact", ("model.pt",)),
]


@pytest.fixture
def job(alice, rate, storage_dir):
    job = make_job(alice, name="alices-secret-run")
    key = f"jobs/{job.pk}/artifacts/model.pt"
    from io import BytesIO

    from core.storage import get_storage

    size, sha = get_storage().save(key, BytesIO(b"weights"))
    Artifact.objects.create(job=job, name="model.pt", key=key, size=size, sha256=sha)
    return job


def call(client, method, name, job, extra):
    return getattr(client, method)(reverse(name, args=[job.pk, *extra]))


@pytest.mark.parametrize("method,name,extra", JOB_PAGES)
@pytest.mark.parametrize("persona", ["alice", "bob"])
def test_the_team_gets_in(client, request, job, persona, method, name, extra):
    client.force_login(request.getfixturevalue(persona))
    response = call(client, method, name, job, extra)
    assert response.status_code in (200, 302)
    if name == "jobs:cancel":
        job.refresh_from_db()
        assert job.state == "cancelled"


@pytest.mark.parametrize("method,name,extra", JOB_PAGES)
def test_an_outsider_gets_a_404(client, charlie, job, method, name, extra):
    client.force_login(charlie)
    assert call(client, method, name, job, extra).status_code == 404
    job.refresh_from_db()
    assert job.state == "queued"


@pytest.mark.parametrize("method,name,extra", JOB_PAGES)
def test_anonymous_users_are_sent_to_log_in(client, job, method, name, extra):
    response = call(client, method, name, job, extra)
    assert response.status_code == 302 and response["Location"].startswith(reverse("login"))


@pytest.mark.parametrize("method,name,extra", JOB_API)
@pytest.mark.parametrize("persona", ["alice", "bob"])
def test_the_team_gets_in_through_the_api(client, request, job, persona, method, name, extra):
    key = Token.objects.create(user=request.getfixturevalue(persona)).key
    response = getattr(client, method)(reverse(name, args=[job.pk, *extra]), HTTP_AUTHORIZATION=f"Token {key}")
    assert response.status_code in (200, 202)


@pytest.mark.parametrize("method,name,extra", JOB_API)
def test_an_outsider_gets_a_404_from_the_api(client, charlie, job, method, name, extra):
    key = Token.objects.create(user=charlie).key
    response = getattr(client, method)(reverse(name, args=[job.pk, *extra]), HTTP_AUTHORIZATION=f"Token {key}")
    assert response.status_code == 404
    assert "detail" in response.json()


@pytest.mark.parametrize("method,name,extra", JOB_API)
def test_the_api_refuses_anonymous_users(client, job, method, name, extra):
    response = getattr(client, method)(reverse(name, args=[job.pk, *extra]))
    assert response.status_code == 401


@pytest.mark.parametrize("name", ["jobs:list", "jobs:new", "billing:usage", "billing:usage_csv"])
def test_team_pages_need_a_login(client, db, name):
    response = client.get(reverse(name))
    assert response.status_code == 302 and response["Location"].startswith(reverse("login"))


@pytest.mark.parametrize("name", ["jobs:list", "jobs:new", "billing:usage", "billing:usage_csv"])
def test_team_pages_show_only_the_team_s_things(client, charlie, job, name):
    client.force_login(charlie)
    response = client.get(reverse(name))
    assert response.status_code == 200
    assert job.name not in response.content.decode()
    assert str(job.pk) not in response.content.decode()


def test_lists_are_scoped_to_the_team(client, alice, bob, charlie, job):
    client.force_login(bob)
    assert str(job.pk) in client.get(reverse("jobs:list")).content.decode()
    key = Token.objects.create(user=charlie).key
    assert client.get(reverse("api:jobs"), HTTP_AUTHORIZATION=f"Token {key}").json()["results"] == []
    assert client.get(reverse("api:usage"), HTTP_AUTHORIZATION=f"Token {key}").json()["records"] == []


def test_a_user_without_a_team_sees_nothing(client, django_user_model, job):
    loner = django_user_model.objects.create_user("loner", password="x")
    client.force_login(loner)
    assert client.get(reverse("jobs:list")).status_code == 404
    assert client.get(reverse("jobs:detail", args=[job.pk])).status_code == 404


def test_login_and_logout_pages(client, alice):
    from tests.conftest import PASSWORD

    assert client.get(reverse("login")).status_code == 200
    response = client.post(reverse("login"), {"username": "alice", "password": PASSWORD})
    assert response.status_code == 302 and response["Location"] == reverse("jobs:list")
    assert client.get(reverse("jobs:list")).status_code == 200
    response = client.post(reverse("logout"))
    assert response.status_code == 302
    assert client.get(reverse("jobs:list")).status_code == 302


def test_a_wrong_password_is_refused_with_a_message(client, alice):
    response = client.post(reverse("login"), {"username": "alice", "password": "nope"})
    assert response.status_code == 200
    assert "Please enter a correct username and password" in response.content.decode()
