"""The reads a CLI polls and a browser opens cost a fixed number of SQL queries, however many jobs
the team has and however much each logged (issue 24): the job list (API and page), a job's detail
(API and page), its log from a point (?after=), its metrics, and the team's usage. Counted with
CaptureQueriesContext on a small team and on a team with four times the jobs, each with four
times the events, allocations, usage records and outputs. bench/read_load.py times them."""

import io
import re
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from billing import meter
from billing.models import UsageRecord
from core.storage import get_storage
from jobs.models import Artifact, Job, JobEvent
from jobs.serializers import KEPT
from scheduler.models import Allocation, Node
from tests.conftest import make_job

pytestmark = pytest.mark.django_db

STARTED = datetime(2026, 11, 3, tzinfo=UTC)


def held_an_hour(job, node, started, end_reason):
    """An allocation of one CPU slot held for an hour from started, ended for end_reason, and its
    usage record."""
    allocation = Allocation.objects.create(
        job=job, node=node, devices=[0], device_type="cpu", rate=Decimal("2.40"), started_at=started,
        ended_at=started + timedelta(hours=1), end_reason=end_reason,
    )  # fmt: skip
    UsageRecord.objects.create(
        team=job.team, job=job, allocation=allocation, gpu_type="cpu", gpus=1, started_at=started, ended_at=started + timedelta(hours=1),
        held_seconds=3600, rate=Decimal("2.40"), amount=meter.charge(1, 3600, Decimal("2.40")),
    )  # fmt: skip


def busy_job(user, node, n, scale):
    """A job that ran `scale` times (an allocation and a usage record each), printed and logged
    metrics, kept outputs, and runs again now (an open allocation)."""
    job = make_job(user, name=f"job-{n}", hyperparameters={"lr": 0.1}, config={"epochs": 3})
    at = datetime.now(UTC)
    JobEvent.append(job.pk, [JobEvent(kind="log", at=at, stream="stdout", text=f"line {i}") for i in range(20 * scale)])
    JobEvent.append(job.pk, [JobEvent(kind="metric", at=at, data={"step": i, "values": {"loss": 1 / (i + 1), "acc": i / 100}}) for i in range(10 * scale)])
    for i in range(scale):
        held_an_hour(job, node, STARTED + timedelta(hours=2 * i), Allocation.PREEMPTED)
        key, size, sha256 = get_storage().save_blob(io.BytesIO(b"weights %d" % i))
        Artifact.objects.create(job=job, name=f"out/model-{i}.pt", key=key, size=size, sha256=sha256)
    Allocation.objects.create(job=job, node=node, devices=[1], device_type="cpu", rate=Decimal("2.40"), started_at=datetime.now(UTC))
    Job.objects.filter(pk=job.pk).update(state="running")
    return job


def team_of(user, jobs, scale):
    node, _ = Node.objects.get_or_create(name="node", defaults={"device_type": "cpu", "devices": 64})
    return [busy_job(user, node, n, scale) for n in range(jobs)]


def reads(job):
    return {
        "job list (API)": "/api/jobs/",
        "job list (page)": "/jobs/",
        "job (API)": f"/api/jobs/{job.pk}/",
        "job (page)": f"/jobs/{job.pk}/",
        "log after a point (API)": f"/api/jobs/{job.pk}/logs/?after=5",
        "metrics (API)": f"/api/jobs/{job.pk}/metrics/",
        "usage (API)": f"/api/usage/?month={STARTED:%Y-%m}",  # the month the records are billed in
    }


def counts(client, job):
    seen = {}
    for what, path in reads(job).items():
        with CaptureQueriesContext(connection) as queries:
            response = client.get(path)
        assert response.status_code == 200, (what, response.status_code)
        seen[what] = len(queries)
    return seen


def test_a_read_costs_the_same_queries_for_a_small_team_and_a_large_one(client, alice, rate):
    client.force_login(alice)
    small = team_of(alice, 2, 1)
    few = counts(client, small[0])
    large = team_of(alice, 6, 4)  # 8 jobs now, the new ones with four times everything
    many = counts(client, large[-1])
    assert many == few


def first_table(sql):
    found = re.search(r'FROM "(\w+)"', sql)
    return found and found.group(1)


def statements(queries):
    """The SQL statements of captured queries, those sent together (core.compiled.together)
    one by one."""
    return [statement for q in queries for statement in q["sql"].split(";\n")]


def test_a_token_call_reads_its_user_membership_and_team_in_the_tokens_query(client, alice, rate):
    """A CLI polling with its token: who it is and for which team, in one query before the job's."""
    from rest_framework.authtoken.models import Token

    job = make_job(alice)
    token = Token.objects.create(user=alice)
    with CaptureQueriesContext(connection) as queries:
        response = client.get(f"/api/jobs/{job.pk}/", HTTP_AUTHORIZATION=f"Token {token.key}")
    assert response.status_code == 200
    first, *rest = [q["sql"] for q in queries]
    assert first_table(first) == "authtoken_token" and '"accounts_membership"' in first and '"accounts_team"' in first
    assert not [sql for sql in rest if first_table(sql) in ("auth_user", "accounts_membership", "accounts_team")]


def values_of(obj):
    """A model instance's field values (its __dict__ less Django's _state and caches)."""
    return {name: value for name, value in vars(obj).items() if not name.startswith("_")}


def test_a_token_is_read_by_its_compiled_query_as_the_orm_reads_it(client, alice, bob, rate, django_assert_num_queries):
    """accounts.authentication.TokenRead: the same token, user, membership and team, field by
    field, as select_related gives them, with nothing left to read; a user without a team, an
    unknown key and an inactive user as before."""
    from django.contrib.auth import get_user_model
    from rest_framework.authtoken.models import Token

    from accounts.authentication import TokenRead

    mine = Token.objects.create(user=alice)
    read = TokenRead.of(Token)
    assert TokenRead.of(Token) is read  # made once in the process
    for _ in range(2):
        with django_assert_num_queries(1):
            token = read(mine.key)
            membership = token.user.membership
            team = membership.team
        orm = Token.objects.select_related("user__membership__team").get(key=mine.key)
        assert values_of(token) == values_of(orm) and values_of(token.user) == values_of(orm.user)
        assert values_of(token)["key"] == mine.key and values_of(token.user)["username"] == "alice" and "password" in values_of(token.user)
        assert values_of(membership) == values_of(orm.user.membership) and values_of(team) == values_of(orm.user.membership.team)
        assert team.name == "Team A" and membership.role == "owner"
    lone = get_user_model().objects.create_user("lone", "lone@example.com", "pw")
    theirs = Token.objects.create(user=lone)
    with django_assert_num_queries(1):
        token = read(theirs.key)
        assert token.user == lone and not hasattr(token.user, "membership")  # no team: cached as none
    assert read("0" * 40) is None and read(mine.key[:-1]) is None
    answers = [client.get("/api/me/", HTTP_AUTHORIZATION=f"Token {key}") for key in (mine.key, "f" * 40)]
    assert [a.status_code for a in answers] == [200, 401] and answers[1].json()["detail"].startswith("Invalid token.")
    get_user_model().objects.filter(pk=alice.pk).update(is_active=False)
    refused = client.get("/api/me/", HTTP_AUTHORIZATION=f"Token {mine.key}")
    assert refused.status_code == 401 and refused.json()["detail"].startswith("User inactive or deleted.")
    bob.membership.delete()
    assert client.get("/api/me/", HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=bob).key}").json()["team"] is None


@pytest.mark.django_db(transaction=True)
def test_a_token_read_made_on_one_thread_reads_on_another_with_that_threads_connection():
    """Under ASGI each request has a thread and a connection of its own: the compiled read is
    the process's, the query runs on the caller's connection."""
    import threading

    from django.contrib.auth import get_user_model
    from django.db import connections
    from rest_framework.authtoken.models import Token

    from accounts.authentication import TokenRead

    key = Token.objects.create(user=get_user_model().objects.create_user("threaded", "t@example.com", "pw")).key
    TokenRead.made.clear()
    read = TokenRead.of(Token)  # compiled on this thread's connection
    seen = []

    def request():
        try:
            seen.append(read(key).user.username)
        finally:
            connections.close_all()

    worker = threading.Thread(target=request)
    worker.start()
    worker.join()
    assert seen == ["threaded"]


def test_a_signed_in_page_reads_the_membership_with_its_team(client, alice, rate):
    client.force_login(alice)
    job = make_job(alice)
    with CaptureQueriesContext(connection) as queries:
        response = client.get(f"/jobs/{job.pk}/")
    assert response.status_code == 200
    # The session's user with its membership and team, in one query (accounts.backends).
    read = [first_table(q["sql"]) for q in queries]
    [user] = [q["sql"] for q in queries if first_table(q["sql"]) == "auth_user"]
    assert '"accounts_membership"' in user and '"accounts_team"' in user
    assert "accounts_membership" not in read and "accounts_team" not in read, read


def test_a_signed_in_page_reads_its_session_user_and_files_without_compiling_their_sql(client, alice, rate):
    """The session (core.sessions), its user with membership and team (accounts.backends) and the
    job's files are Reads: their SQL made once per process, not compiled by Django at each page."""
    from unittest import mock

    from django.db.models.sql.compiler import SQLCompiler

    client.force_login(alice)
    job = make_job(alice)
    assert client.get(f"/jobs/{job.pk}/").status_code == 200  # each Read compiled once
    compiled = []
    real = SQLCompiler.as_sql

    def as_sql(self, *args, **kwargs):
        sql, params = real(self, *args, **kwargs)
        compiled.append(first_table(sql))
        return sql, params

    with mock.patch.object(SQLCompiler, "as_sql", as_sql), CaptureQueriesContext(connection) as queries:
        assert client.get(f"/jobs/{job.pk}/").status_code == 200
    read = [first_table(statement) for statement in statements(queries)]
    assert {"django_session", "auth_user", "jobs_upload"} <= set(read), read
    assert not {"django_session", "auth_user", "jobs_upload"} & set(compiled), compiled


def test_an_expired_or_unknown_session_signs_nobody_in_and_a_new_one_is_made(client, alice, rate):
    from datetime import timedelta

    from django.conf import settings
    from django.contrib.sessions.models import Session

    client.force_login(alice)
    key = client.cookies[settings.SESSION_COOKIE_NAME].value
    assert client.get("/api/me/").status_code == 200
    Session.objects.filter(session_key=key).update(expire_date=datetime.now(UTC) - timedelta(seconds=1))
    assert client.get("/api/me/").status_code in (401, 403)
    client.cookies[settings.SESSION_COOKIE_NAME] = "x" * 32
    assert client.get("/jobs/").status_code == 302
    from tests.conftest import PASSWORD

    assert client.login(username=alice.username, password=PASSWORD)
    assert client.cookies[settings.SESSION_COOKIE_NAME].value not in (key, "x" * 32)
    assert client.get("/api/me/").status_code == 200


def test_a_session_key_django_never_makes_and_a_user_id_past_64_bits_sign_nobody_in(alice, django_assert_num_queries):
    """A cookie's key of characters no session key has (a NUL failed PostgreSQL's query, a 500)
    is not asked of the database; a user id no user can have is no user (SQLite could not be
    asked for it)."""
    from accounts.backends import TeamModelBackend
    from core.sessions import SessionStore

    for key in ("abcdefgh\x00", "ABCDEFGHIJ", "abcdefgh'; --", "a" * 41):
        store = SessionStore(key)
        with django_assert_num_queries(0):
            assert store.load() == {}
        assert store.session_key is None
    for user_id in (2**63, 2**70, -(2**63) - 1, "x", None):
        assert TeamModelBackend().get_user(user_id) is None
    assert TeamModelBackend().get_user(str(alice.pk)).pk == alice.pk


def test_a_session_of_an_inactive_or_removed_user_signs_nobody_in(client, alice, rate):
    client.force_login(alice)
    assert client.get("/api/me/").status_code == 200
    alice.is_active = False
    alice.save(update_fields=["is_active"])
    assert client.get("/api/me/").status_code in (401, 403)
    alice.is_active = True
    alice.save(update_fields=["is_active"])
    client.force_login(alice)
    alice.membership.delete()
    body = client.get("/api/me/")
    assert body.status_code == 200 and body.json()["team"] is None


def test_the_job_page_reads_its_log_lines_timeline_and_notices_in_one_round_trip(client, alice, rate):
    """One line more than the page shows says there are earlier ones; the state changes, the
    unisolated notice and the environment's latest notice come in one query; on PostgreSQL the
    page's reads of the job's rows go in one round trip (core.compiled.together)."""
    from jobs import views

    client.force_login(alice)
    job = make_job(alice, packages="numpy\n")
    at = datetime.now(UTC)
    JobEvent.append(
        job.pk,
        [
            JobEvent(kind="notice", at=at, data={"text": "building on node-1: 1 requirement(s)", "environment": ""}),
            JobEvent(kind="notice", at=at, data={"text": "ran WITHOUT isolation", "isolation": "off"}),
            JobEvent(kind="state", at=at, data={"state": "running", "from": "queued", "reason": "started"}),
            JobEvent(kind="notice", at=at, data={"text": "ready (cached): numpy==2.0", "environment": "key"}),
            *[JobEvent(kind="log", at=at, stream="stdout", text=f"line {i}") for i in range(views.LOG_LINES_ON_PAGE)],
        ],
    )

    def page():
        with CaptureQueriesContext(connection) as queries:
            html = client.get(f"/jobs/{job.pk}/").content.decode()
        if connection.vendor == "postgresql":  # the log lines, the metric points, the rest, the allocations, files and other parts
            [batch] = [q["sql"] for q in queries if q["sql"].count(";\n") == 5]
            assert [first_table(s) for s in batch.split(";\n")] == ["jobs_jobevent"] * 3 + ["scheduler_allocation", "jobs_upload", "billing_credit"]
        return html, [s for s in statements(queries) if first_table(s) == "jobs_jobevent"]

    html, events = page()
    assert len(events) == 3, events  # the metric points, the log lines, the rest
    assert 'id="unisolated">Ran WITHOUT isolation.' in html
    assert "Environment: ready (cached): numpy==2.0" in html
    assert "Earlier lines are in the full log." not in html and "line 0\n" in html
    assert html.index("queued") < html.index("running")
    JobEvent.append(job.pk, [JobEvent(kind="log", at=at, stream="stdout", text="one more")])
    html, events = page()
    assert len(events) == 3
    assert "Earlier lines are in the full log." in html and "line 0\n" not in html and "line 1\n" in html and "one more" in html


def test_a_page_reverses_each_kind_of_url_once(rf):
    """absolute_url: the first object's URL of each view is reversed, the others' made from it,
    the same as reversing each."""
    import uuid
    from unittest import mock

    from django.urls import reverse

    from core import serializers

    request = rf.get("/api/jobs/", HTTP_HOST="127.0.0.1:8000")
    ids = [uuid.uuid4() for _ in range(5)]
    with mock.patch.object(serializers, "reverse", wraps=reverse) as reversing:
        urls = [serializers.absolute_url(request, "jobs:detail", pk) for pk in ids]
        assert reversing.call_count == 1
        assert [serializers.absolute_url(request, "api:dataset", pk) for pk in ids[:2]] == [
            request.build_absolute_uri(reverse("api:dataset", args=[pk])) for pk in ids[:2]
        ]
        assert reversing.call_count == 2  # one more, for the datasets' view
    assert urls == [request.build_absolute_uri(reverse("jobs:detail", args=[pk])) for pk in ids]


def test_a_link_is_reversed_once_per_view_and_is_what_url_makes(rf):
    """{% link %} (jobs/templatetags/e31.py): the first id's URL of each view is reversed, the
    others' made from it; the same text as {% url %}, for a view with no id, one id of either
    type, an id that is neither, and under a script prefix."""
    import uuid
    from unittest import mock

    from django.template import engines
    from django.urls import reverse, set_script_prefix

    from jobs.templatetags import e31

    ids = [uuid.uuid4() for _ in range(4)]
    link = engines["django"].from_string(
        "{% load e31 %}{% link 'jobs:list' %} {% for pk in ids %}{% link 'jobs:detail' pk %} {% endfor %}{% link 'jobs:log' ids.0 %}"
    )
    url = engines["django"].from_string("{% url 'jobs:list' %} {% for pk in ids %}{% url 'jobs:detail' pk %} {% endfor %}{% url 'jobs:log' ids.0 %}")
    with mock.patch.dict(e31._LINKS, clear=True), mock.patch.object(e31, "reverse", wraps=reverse) as reversing:
        assert link.render({"ids": ids}) == url.render({"ids": ids})
        assert reversing.call_count == 3  # the list, a job's page, its log
        assert link.render({"ids": ids}) == url.render({"ids": ids})
        assert reversing.call_count == 3
        try:
            set_script_prefix("/e31/")
            assert link.render({"ids": ids[:1]}) == url.render({"ids": ids[:1]}) and "/e31/jobs/" in url.render({"ids": ids[:1]})
        finally:
            set_script_prefix("/")
        # Not an id: reversed each time, as {% url %} would (here: refused as it refuses).
        from django.urls import NoReverseMatch

        with pytest.raises(NoReverseMatch):
            engines["django"].from_string("{% load e31 %}{% link 'jobs:detail' name %}").render({"name": "not-a-uuid"})


# The job page's log lines, made in Python (jobs.logs.lines_html), not by a template loop.
LOOP = (
    '{% for line in lines %}<span class="line {{ line.stream }}" data-seq="{{ line.seq }}"{% if line.rank is not None %} data-rank="{{ line.rank }}"'
    '{% endif %}>{% if line.rank is not None %}<span class="rank">[{{ line.rank }}]</span> {% endif %}{{ line.text }}\n</span>{% endfor %}'
)
LINES = [
    {"seq": 1, "stream": "stdout", "rank": None, "text": "epoch 1: loss 0.25"},
    {"seq": 2, "stream": "stderr", "rank": 0, "text": "<script>alert('x')</script> & \"quoted\""},
    {"seq": 12345, "stream": "stdout", "rank": 3, "text": "naïve ünïcode ✓\tand a tab  "},
    {"seq": 12346, "stream": "stdout", "rank": None, "text": ""},
]


@pytest.mark.nodb
def test_the_log_lines_html_is_what_the_template_loop_wrote():
    from django.template import engines

    from jobs.logs import lines_html

    rows = [(line["seq"], line["stream"], line["rank"], line["text"]) for line in LINES]
    assert lines_html(rows) == engines["django"].from_string(LOOP).render({"lines": LINES})
    assert lines_html([]) == ""


def test_the_job_page_shows_its_log_lines_escaped(client, alice):
    job = make_job(alice)
    at = datetime.now(UTC)
    JobEvent.append(job.pk, [JobEvent(kind="log", at=at, stream=line["stream"], rank=line["rank"], text=line["text"]) for line in LINES])
    client.force_login(alice)
    page = client.get(f"/jobs/{job.pk}/").content.decode()
    log = page.split('<pre class="log" id="log">', 1)[1].split("</pre>", 1)[0]
    assert "<script>" not in log and "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt; &amp; &quot;quoted&quot;" in log
    assert '<span class="line stdout" data-seq="' in log and '<span class="rank">[3]</span> naïve ünïcode ✓\tand a tab  \n</span>' in log


# Serializers read plain fields with one getattr (core.serializers.DirectSerializer): the same
# answers as DRF's own reads.


def test_the_job_list_and_details_answer_as_drf_s_own_reads_would(client, alice, rate, dataset, monkeypatch):
    """Jobs with allocations (ended and open), usage, outputs, events; a dataset: their answers
    through DirectSerializer equal those with DRF's Serializer.to_representation put back."""
    from rest_framework import serializers as drf

    from core.serializers import DirectSerializer

    client.force_login(alice)
    jobs = team_of(alice, 3, 2)
    make_job(alice, name="queued", gpus=2, span_hours=1)
    paths = ["/api/jobs/", *[f"/api/jobs/{job.pk}/" for job in jobs], "/api/datasets/", f"/api/datasets/{dataset.pk}/"]

    def answers():
        replies = [client.get(path) for path in paths]
        assert all(r.status_code == 200 for r in replies), [(p, r.status_code) for p, r in zip(paths, replies, strict=True)]
        return [r.json() for r in replies]

    direct = answers()
    monkeypatch.setattr(DirectSerializer, "to_representation", drf.Serializer.to_representation)
    KEPT.clear()  # the ended jobs' JSON kept on PostgreSQL (jobs.written): written again, DRF's way
    assert answers() == direct
    assert direct[0]["results"] and direct[1]["allocations"]


def test_a_jobs_own_values_are_read_from_its_facts_not_through_getattr(client, alice, rate, monkeypatch):
    """Facts copy the object's values in: a serializer reads a job's fields with one lookup
    each, and __getattr__ reaches the job only for what is not a value (a property)."""
    from core.serializers import Facts

    client.force_login(alice)
    team_of(alice, 3, 1)
    asked, real = [], Facts.__getattr__
    monkeypatch.setattr(Facts, "__getattr__", lambda facts, name: asked.append(name) or real(facts, name))
    assert len(client.get("/api/jobs/").json()["results"]) == 3
    fields = {f.attname for f in Job._meta.concrete_fields}
    assert not fields & set(asked), sorted(fields & set(asked))


def test_a_pages_credits_are_added_up_from_its_credits_not_in_its_query(client, alice, rate):
    """The page's query reads the jobs alone; a job with credits gets them, summed, from its
    credits' rows (to the amount's 8 places), and the others none."""
    from billing.models import Credit, UsageRecord

    client.force_login(alice)
    jobs = team_of(alice, 3, 1)
    usage = UsageRecord.objects.filter(job=jobs[1]).first()
    for seconds, amount in ((600, "0.4"), (30, "0.02")):
        Credit.objects.create(team=jobs[1].team, job=jobs[1], usage=usage, seconds=seconds, amount=Decimal(amount), reason="node lost", period=usage.period)
    with CaptureQueriesContext(connection) as captured:
        listed = {j["id"]: j for j in client.get("/api/jobs/").json()["results"]}
    page = [q["sql"] for q in captured.captured_queries if q["sql"].startswith('SELECT "jobs_job"."id"')]
    assert len(page) == 1 and "billing_credit" not in page[0]
    assert (listed[str(jobs[1].pk)]["credited_seconds"], listed[str(jobs[1].pk)]["credited"]) == (630, "0.42000000")
    assert (listed[str(jobs[0].pk)]["credited_seconds"], listed[str(jobs[0].pk)]["credited"]) == (0, "0")
    assert client.get(f"/api/jobs/{jobs[1].pk}/").json()["credited"] == "0.42000000"  # one job alone: the same
    Credit.objects.create(team=jobs[2].team, job=jobs[2], usage=usage, seconds=0, amount=Decimal(0), reason="", period=usage.period)
    listed = {j["id"]: j for j in client.get("/api/jobs/").json()["results"]}
    assert listed[str(jobs[2].pk)]["credited"] == "0"  # credits of nothing: 0, as no credit
    assert client.get(f"/api/jobs/{jobs[2].pk}/").json()["credited"] == "0"


class Thing:
    plain = "a"
    none = None
    number = 7

    def method(self):
        return "called"

    def needs(self, x):
        return x

    @property
    def gone(self):
        from django.core.exceptions import ObjectDoesNotExist

        raise ObjectDoesNotExist("none here")

    @property
    def broken(self):
        raise ValueError("broken")

    class Inner:
        name = "inner"

    inner = Inner()


def fields_of(base):
    from rest_framework import serializers as s

    class Whole(s.Serializer):
        plain = s.CharField()

    class Reads(base):
        plain = s.CharField()
        none = s.CharField(allow_null=True)
        number = s.IntegerField()
        renamed = s.CharField(source="plain")
        method = s.CharField()
        needs = s.CharField()
        gone = s.CharField(allow_null=True)
        missing_default = s.CharField(default="d")
        missing_null = s.CharField(allow_null=True)
        missing_skipped = s.CharField(required=False)
        inner_name = s.CharField(source="inner.name")
        whole = Whole(source="*")

    return Reads


def test_direct_reads_give_what_drf_s_reads_give_field_by_field():
    """Callables (called or not, as DRF decides), a missing attribute (its default, None, or
    skipped), ObjectDoesNotExist, a source path, a Mapping instance, and errors: as DRF has them."""
    from rest_framework import serializers as s

    from core.serializers import DirectSerializer

    direct, drf = fields_of(DirectSerializer)(), fields_of(s.Serializer)()
    thing = Thing()
    assert direct.to_representation(thing) == drf.to_representation(thing)
    mapping = {"plain": "p", "number": 1, "method": "m", "needs": "n", "items": "not dict.items", "inner": {"name": "x"}, "gone": None}
    assert direct.to_representation(mapping) == drf.to_representation(mapping)
    assert list(direct.to_representation(thing)) == list(drf.to_representation(thing))  # the same order

    class Record(dict):
        plain = "an attribute: DRF reads a Mapping's keys"

    record = Record(mapping, plain="the key")
    assert direct.to_representation(record) == drf.to_representation(record)
    assert direct.to_representation(record)["plain"] == "the key"

    class Broken(DirectSerializer):
        broken = s.CharField()

    with pytest.raises(ValueError, match="broken"):
        Broken().to_representation(thing)

    class Required(DirectSerializer):
        absent = s.CharField()

    with pytest.raises(AttributeError, match="absent"):
        Required().to_representation(thing)


def test_the_job_serializers_fields_are_made_once_not_per_request(client, alice, rate, monkeypatch):
    """DRF deep-copies a serializer's declared fields for each serializer made (one a request);
    shared_fields makes them once per class. A second job list and job copy no field."""
    import copy

    from rest_framework import serializers as s

    from core.serializers import DirectSerializer, FactsSerializer
    from jobs.serializers import JobSerializer

    client.force_login(alice)
    jobs = team_of(alice, 3, 2)
    assert client.get("/api/jobs/").status_code == client.get(f"/api/jobs/{jobs[0].pk}/").status_code == 200
    copies, deepcopy = [], copy.deepcopy

    def counted(value, *args):
        if isinstance(value, s.Field) or (isinstance(value, dict) and any(isinstance(v, s.Field) for v in value.values())):
            copies.append(value)
        return deepcopy(value, *args)

    monkeypatch.setattr(copy, "deepcopy", counted)
    listed, shown = client.get("/api/jobs/"), client.get(f"/api/jobs/{jobs[0].pk}/")
    assert listed.json()["results"][0]["allocations"] and shown.json()["allocation"]
    assert copies == []
    assert JobSerializer(context={"request": 1})._reads() is JobSerializer(context={"request": 2})._reads()

    class Nested(FactsSerializer):
        name = s.CharField()

    class Unfit(DirectSerializer):  # a FactsSerializer inside reads the request from the context
        shared_fields = True
        inner = Nested(many=True)

    with pytest.raises(TypeError, match="Unfit.shared_fields: inner may read the context"):
        Unfit().to_representation(Thing())

    class Inner(DirectSerializer):  # not shared itself: its file's URL needs the request
        file = s.FileField()

    class Holder(DirectSerializer):
        shared_fields = True
        plain = s.CharField()
        inner = Inner()

    with pytest.raises(TypeError, match="Holder.shared_fields: inner may read the context"):
        Holder().to_representation(Thing())


# A page's relations that none of its jobs has rows in are not asked for (core.prefetch).


def test_a_page_asks_only_for_the_relations_its_jobs_have_rows_in(client, alice, rate, monkeypatch):
    """The probe answers as the prefetches would: the same job list and job answers as with
    every relation prefetched; a page with no models, inputs, uploads, stagings or credits makes
    none of those queries, and a job that has some gets them."""
    from django.db.models import prefetch_related_objects

    from core.prefetch import ReadPrefetch
    from jobs import serializers as job_serializers
    from jobs.models import JobModel

    client.force_login(alice)
    jobs = team_of(alice, 3, 1)
    paths = ["/api/jobs/", *[f"/api/jobs/{job.pk}/" for job in jobs]]

    def answers():
        return [client.get(path).json() for path in paths]

    def tables_read(path):
        """The tables whose rows the request's queries select (their first column's table)."""
        with CaptureQueriesContext(connection) as queries:
            assert client.get(path).status_code == 200
        return {found.group(1) for q in queries if (found := re.match(r'SELECT (?:DISTINCT )?"(\w+)"\.', q["sql"]))}

    sparse = answers()
    read = tables_read("/api/jobs/")
    assert not read & {"jobs_jobmodel", "jobs_jobinput", "scheduler_staging", "billing_credit"}, read
    assert {"scheduler_allocation", "jobs_jobevent"} <= read  # every job has these
    JobModel.objects.create(job=jobs[0], label="start", files=[{"name": "w.pt", "size": 1, "sha256": "0" * 64}])
    assert "jobs_jobmodel" in tables_read("/api/jobs/") and "jobs_jobmodel" in tables_read(f"/api/jobs/{jobs[0].pk}/")
    assert "jobs_jobmodel" not in tables_read(f"/api/jobs/{jobs[1].pk}/")
    sparse = answers()
    assert [m["label"] for m in sparse[0]["results"][-1]["models"]] == ["start"]

    def djangos(instances, *prefetches):  # every relation by Django's own prefetch, no probe
        prefetch_related_objects(instances, *(p.prefetch() if isinstance(p, ReadPrefetch) else p for p in prefetches))

    monkeypatch.setattr(job_serializers, "prefetch_sparse", djangos)
    assert answers() == sparse


def test_the_probe_passes_a_pages_ids_as_one_array_on_postgresql(client, alice, rate):
    """psycopg parses a statement of over 50 parameters anew each time: on PostgreSQL the probe
    passes a page's ids as one array per relation, whatever the page's size."""
    if connection.vendor != "postgresql":
        pytest.skip("SQLite has no arrays: the probe lists the ids")
    client.force_login(alice)
    team_of(alice, 12, 1)
    with CaptureQueriesContext(connection) as captured:
        assert len(client.get("/api/jobs/").json()["results"]) == 12
    probes = [q["sql"] for q in captured.captured_queries if "UNION ALL" in q["sql"]]
    assert len(probes) == 1 and "= ANY(" in probes[0] and " IN (" not in probes[0]


def test_the_timelines_are_read_as_plain_rows_and_list_what_job_timeline_lists(client, alice, rate, monkeypatch):
    """A page's timelines (its jobs' state changes, checkpoints and resumes) are read without
    making an event instance each, and list, in order, what Job.timeline() holds."""
    from jobs.serializers import timeline_entry

    client.force_login(alice)
    jobs = team_of(alice, 3, 1)
    JobEvent.append(jobs[1].pk, [JobEvent(kind="checkpoint", at=datetime.now(UTC), data={"name": "step-2.pt", "step": 2, "text": "kept step-2.pt"})])
    made = []
    real_from_db = JobEvent.from_db.__func__
    monkeypatch.setattr(JobEvent, "from_db", classmethod(lambda cls, *args: made.append(args) or real_from_db(cls, *args)))
    listed = {job["id"]: job["timeline"] for job in client.get("/api/jobs/").json()["results"]}
    shown = client.get(f"/api/jobs/{jobs[1].pk}/").json()["timeline"]
    assert made == []
    monkeypatch.undo()
    for job in jobs:
        expected = [timeline_entry(e.seq, e.at, e.kind, e.data) for e in job.timeline()]
        assert [{**entry, "at": None} for entry in listed[str(job.pk)]] == [{**entry, "at": None} for entry in expected]
        assert [datetime.fromisoformat(entry["at"].replace("Z", "+00:00")) for entry in listed[str(job.pk)]] == [e["at"] for e in expected]
    assert [entry["kind"] for entry in shown][-1] == "checkpoint" and shown == listed[str(jobs[1].pk)]


def test_the_probe_reads_sqlite_and_postgres_ids_back_as_the_model_has_them(alice, rate):
    """having_rows: UUID ids (stored as text on SQLite) come back as the model's own values."""
    from core.prefetch import having_rows
    from jobs.models import JobEvent

    job, other = make_job(alice, name="a"), make_job(alice, name="b")
    JobEvent.objects.filter(job=other).delete()
    JobEvent.append(job.pk, [JobEvent(kind="log", at=datetime.now(UTC), stream="stdout", text="x")])
    found, none = having_rows([job, other], [(JobEvent._meta.db_table, "job_id"), (Artifact._meta.db_table, "job_id")])
    assert found == {job.pk} and none == set()


def test_the_job_page_reads_its_allocations_once_and_only_the_parts_the_job_has(client, alice, rate, monkeypatch):
    """The same page as with every part read; a job without credits, stagings, checkpoints,
    models or utilization reads none of those tables, and its allocations once."""
    from core import prefetch

    client.force_login(alice)
    [job] = team_of(alice, 1, 2)
    Allocation.objects.filter(job=job, ended_at__isnull=True).update(ended_at=datetime.now(UTC), end_reason=Allocation.EXITED)
    Job.objects.filter(pk=job.pk).update(state="succeeded", finished_at=datetime.now(UTC))
    path = f"/jobs/{job.pk}/"

    def page():
        with CaptureQueriesContext(connection) as queries:
            response = client.get(path)
        assert response.status_code == 200
        html = re.sub(r'(csrfmiddlewaretoken" value="|CSRFToken": ")[^"]+', r"\\1", response.content.decode())  # a new token each time
        # Every table a statement reads (the probe of its parts aside)
        return html, [table for s in statements(queries) if not s.startswith("SELECT 0 WHERE EXISTS") for table in re.findall(r'FROM "(\w+)"', s)]

    html, tables = page()
    assert tables.count("scheduler_allocation") == 1, tables
    unread = {"billing_credit", "scheduler_staging", "jobs_checkpoint", "jobs_jobmodel", "jobs_utilization"}
    assert not unread & set(tables), unread & set(tables)
    assert "jobs_artifact" in tables and "out/model-1.pt" in html
    monkeypatch.setattr(prefetch._RowsInSQL, "result", lambda self, rows: set(self.names))  # every part read
    every_part, tables = page()
    assert unread <= set(tables)
    assert every_part == html


def test_a_pages_related_rows_are_read_by_sql_made_once_whatever_its_size(client, alice, rate, monkeypatch):
    """The allocations, the other relations a job has rows in and the timelines of a page of
    jobs (and of one job) are read by SQL made once per process, the ids as one parameter: Django's
    prefetch built and compiled each query anew, with a placeholder per id (core.prefetch)."""
    from django.db.models.sql.compiler import SQLCompiler

    from jobs.models import JobModel

    client.force_login(alice)
    jobs = team_of(alice, 12, 1)
    JobModel.objects.create(job=jobs[0], label="start", files=[{"name": "w.pt", "size": 1, "sha256": "0" * 64}])
    paths = ["/api/jobs/", f"/api/jobs/{jobs[0].pk}/", "/api/jobs/?page_size=5"]
    for path in paths:  # each query made once, on first use
        assert client.get(path).status_code == 200
    compiled = []
    real = SQLCompiler.as_sql

    def as_sql(self, *args, **kwargs):
        compiled.append(self.query.model._meta.db_table if self.query.model else None)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(SQLCompiler, "as_sql", as_sql)
    with CaptureQueriesContext(connection) as queries:
        for path in paths:
            assert client.get(path).status_code == 200
    assert not {"scheduler_allocation", "jobs_jobevent", "jobs_jobmodel"} & set(compiled), compiled
    related = [q["sql"] for q in queries if re.match(r'SELECT "(scheduler_allocation|jobs_jobevent|jobs_jobmodel)"\.', q["sql"])]
    assert len(related) == 8  # allocations and timelines of each, and the model of the two that show jobs[0]
    marker = "= ANY(" if connection.vendor == "postgresql" else "json_each("
    assert all(marker in sql for sql in related), related


def test_one_of_reads_the_rows_an_in_of_the_list_reads(alice, rate):
    """core.compiled.OneOf: a list of any length (none, one, many; UUIDs stored as text on
    SQLite) as one parameter, the same rows as filter(job_id__in=...)."""
    from core.compiled import OneOf, Read

    jobs = [make_job(alice, name=f"j{n}") for n in range(4)]
    JobEvent.append(jobs[1].pk, [JobEvent(kind="log", at=datetime.now(UTC), stream="stdout", text="x")])
    read = Read(lambda: JobEvent.objects.filter(OneOf("job_id", "jobs", Job._meta.pk)).order_by("job_id", "seq").values_list("job_id", "seq"))
    for ids in ([], [jobs[1].pk], [job.pk for job in jobs], [job.pk for job in jobs] * 30):
        expected = list(JobEvent.objects.filter(job_id__in=ids).order_by("job_id", "seq").values_list("job_id", "seq"))
        assert read(jobs=ids) == expected
    assert read(jobs=[str(jobs[1].pk)]) == read(jobs=[jobs[1].pk]) != []  # ids as text, prepared as the field prepares them


def test_one_of_ids_go_as_an_arrays_text_and_other_values_as_a_list(alice, rate):
    """On PostgreSQL a list of ids (UUIDs, integers) goes as the array's text, written at once,
    not item by item (core.compiled.pg_array); any other list, as psycopg writes it, quoting
    what needs it. Each reads the rows an IN reads, on either database."""
    import uuid

    from core.compiled import OneOf, Read, pg_array

    ids = [uuid.UUID(int=1), uuid.UUID(int=2)]
    assert pg_array(ids) == "{00000000-0000-0000-0000-000000000001,00000000-0000-0000-0000-000000000002}"
    assert pg_array([3, 1]) == "{3,1}" and pg_array([]) == "{}" and pg_array([-(2**63)]) == "{-9223372036854775808}"
    assert pg_array([1, 2**63]) == [1, 2**63] and pg_array([-(2**63) - 1]) == [-(2**63) - 1]  # past a bigint: as before
    assert pg_array(["a,b}", 'q"']) == ["a,b}", 'q"'] and pg_array([True]) == [True]
    job = make_job(alice)
    JobEvent.append(job.pk, [JobEvent(kind="log", at=datetime.now(UTC), stream="stdout", text="x") for _ in range(3)])
    JobEvent.append(job.pk, [JobEvent(kind="notice", at=datetime.now(UTC), data={})])
    by_seq = Read(
        lambda: (
            JobEvent.objects.filter(job_id=job.pk).filter(OneOf("seq", "seqs", JobEvent._meta.get_field("seq"))).order_by("seq").values_list("seq", flat=True)
        )
    )
    assert by_seq(seqs=[4, 2, 99]) == [2, 4]
    by_kind = Read(
        lambda: (
            JobEvent.objects.filter(job_id=job.pk)
            .filter(OneOf("kind", "kinds", JobEvent._meta.get_field("kind")))
            .order_by("seq")
            .values_list("seq", flat=True)
        )
    )
    assert by_kind(kinds=["notice", "a,b}", 'q"', "{}"]) == [5]


def test_a_value_its_field_would_give_back_unchanged_is_written_as_it_is(client, alice, rate, monkeypatch):
    """A str of a CharField, an int of an IntegerField, a bool, a float, a Moment's time: DRF's
    to_representation gives each back unchanged (str(a str)), and a page of 50 jobs made 4,000
    such calls. The answers are DRF's (test_the_job_list_and_details_answer_as_drf_s_own_reads_would)."""
    from rest_framework import serializers as s

    from core.serializers import Moment

    calls = []
    for cls in (s.CharField, s.IntegerField, s.BooleanField, s.FloatField, Moment):
        real = cls.to_representation
        monkeypatch.setattr(cls, "to_representation", lambda self, value, real=real: calls.append((type(self), type(value))) or real(self, value))
    client.force_login(alice)
    team_of(alice, 3, 1)
    assert len(client.get("/api/jobs/").json()["results"]) == 3
    same = [
        (field, kind) for field, kind in calls if (field, kind) in {(s.CharField, str), (s.IntegerField, int), (s.BooleanField, bool), (s.FloatField, float)}
    ]
    # Only list items (a job's args: a ListField's child) are still written by their field.
    assert len(same) <= 3 * 2, same
    assert not [field for field, _ in calls if field is Moment]


def test_the_unfiltered_list_pages_as_the_querysets_pages_by_sql_made_once(client, alice, rate, monkeypatch):
    """GET /api/jobs/ without a filter reads its page by a paged Read (jobs.api.TEAM_JOBS) and its
    count by a Read: the same jobs on each page as the queryset's, the last page short, past it a
    404, and neither query compiled again."""
    from django.db.models.sql.compiler import SQLCompiler

    from core.compiled import Pages
    from jobs.api import TEAM_JOB_COUNT, TEAM_JOBS

    client.force_login(alice)
    for n in range(7):
        make_job(alice, name=f"p{n}")
    expected = [str(pk) for pk in Job.objects.filter(team=alice.membership.team).order_by("-created_at").values_list("pk", flat=True)]
    pages = [client.get(f"/api/jobs/?page_size=3&page={n}").json() for n in (1, 2, 3)]
    assert [[j["id"] for j in page["results"]] for page in pages] == [expected[0:3], expected[3:6], expected[6:7]]
    assert [page["count"] for page in pages] == [7, 7, 7] and pages[2]["next"] is None and "page=2" in pages[2]["previous"]
    assert client.get("/api/jobs/?page_size=3&page=4").status_code == 404
    assert [j["id"] for j in client.get("/api/jobs/?page_size=200").json()["results"]] == expected
    compiled = []
    real = SQLCompiler.as_sql
    monkeypatch.setattr(SQLCompiler, "as_sql", lambda self, *a, **k: compiled.append(self.query.model) or real(self, *a, **k))
    assert client.get("/api/jobs/?page=2&page_size=2").status_code == 200
    assert Job not in compiled  # the page and the count are TEAM_JOBS' and TEAM_JOB_COUNT's
    assert client.get("/api/jobs/?state=queued").json()["count"] == 7  # a filter: the queryset's own
    from accounts.models import Team

    empty = Team.objects.create(name="no-jobs-yet")
    assert Pages(TEAM_JOBS, TEAM_JOB_COUNT, team=empty.pk).count() == 0
    with pytest.raises(TypeError):
        Pages(TEAM_JOBS, TEAM_JOB_COUNT, team=alice.membership.team.pk)[2]


def test_a_jobs_metric_points_are_found_without_reading_through_its_log_lines(alice, rate):
    """The job page's chart and the metrics endpoint read a job's metric points by an index of
    its metric events alone (jobs.models.JobEvent: job_event_metrics): by the job's index of all
    its events, PostgreSQL read a thousand log lines to find a hundred points (1.3 ms)."""
    if connection.vendor != "postgresql":
        pytest.skip("the plan is PostgreSQL's")
    from jobs.run_data import LAST_SEQ, metric_points

    job = make_job(alice)
    at = datetime.now(UTC)
    JobEvent.append(
        job.pk,
        [
            JobEvent(kind="metric", at=at, data={"step": n, "values": {"loss": 1 / (n + 1)}})
            if n % 11 == 10
            else JobEvent(kind="log", at=at, stream="stdout", text=f"line {n}")
            for n in range(1100)
        ],
    )
    read = metric_points(2000)
    compiled = read.compiled()
    values = {"job": job.pk, "after": 0, "upto": LAST_SEQ}
    params = list(compiled.params)
    for i, name, field in compiled.slots:
        params[i] = field.get_db_prep_value(values[name], connection, prepared=False)
    assert len(read(job=job.pk, after=0, upto=LAST_SEQ)) == 100
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE jobs_jobevent")
        # A test database's table is small enough to read whole: which index is the question.
        cursor.execute("SET LOCAL enable_seqscan = off")
        cursor.execute("EXPLAIN (ANALYZE, BUFFERS) " + compiled.sql, params)
        plan = "\n".join(row[0] for row in cursor.fetchall())
    assert "job_event_metrics" in plan and "Rows Removed by Filter" not in plan, plan


def test_the_metric_points_index_is_built_without_holding_back_writes_on_postgresql():
    """jobs/0024: CREATE INDEX CONCURRENTLY on PostgreSQL (the event table is the largest, and a
    plain CREATE INDEX holds back the runners' writes until it is built). SQLite builds it
    plainly, as every test database there shows."""
    if connection.vendor != "postgresql":
        pytest.skip("CONCURRENTLY is PostgreSQL's")
    from django.core.management import call_command

    out = io.StringIO()
    call_command("sqlmigrate", "jobs", "0024", stdout=out)
    sql = out.getvalue()
    assert "job_event_metrics" in sql
    assert "CREATE INDEX CONCURRENTLY" in sql, sql
    out = io.StringIO()
    call_command("sqlmigrate", "jobs", "0024", backwards=True, stdout=out)
    assert "DROP INDEX CONCURRENTLY" in out.getvalue(), out.getvalue()


def test_usage_reads_the_times_of_the_records_its_page_shows_alone(client, alice, team_a, rate, monkeypatch):
    """The statement needs no record's times: they are read for the page's records (a month of
    720 records has 1,440 of them, a page 200), in one query, and each record gets its own."""
    from billing import usage

    client.force_login(alice)
    team_of(alice, 3, 2)  # six records, two a job, at two times
    asked = []
    real = usage.record_times
    monkeypatch.setattr(usage, "record_times", lambda records: asked.append(len(records)) or real(records))
    with CaptureQueriesContext(connection) as captured:
        data = client.get(f"/api/usage/?month={STARTED:%Y-%m}&page_size=2&page=2").json()
    assert asked == [2] and data["count"] == 6 and len(data["lines"]) == 3
    final = [q["sql"] for q in captured.captured_queries if 'NOT "billing_usagerecord"."provisional"' in q["sql"]]  # the budget reads the running ones
    reading_times = [sql for sql in final if '"billing_usagerecord"."started_at"' in sql.split(" FROM ")[0]]
    assert len(reading_times) == 1, "\n".join(reading_times)
    ledger = list(UsageRecord.objects.filter(team=team_a).order_by("ended_at", "id"))[2:4]
    shown = [(r["job_id"], datetime.fromisoformat(r["started_at"]), datetime.fromisoformat(r["ended_at"])) for r in data["records"]]
    assert shown == [(str(r.job_id), r.started_at, r.ended_at) for r in ledger]
