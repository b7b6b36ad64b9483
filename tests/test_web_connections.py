"""What one web request costs before its view runs (issue 24): the connections it opens and the
threads it crosses. Under daphne each request ran in a thread and context of its own, so it
opened a PostgreSQL connection and a Redis connection and hung both up, and two sync-only
middlewares sent it between the event loop and a thread twice more than needed."""

import asyncio
import contextvars
import json
import logging
import os
import subprocess
import sys
import threading
import time
import zoneinfo
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import redis
from asgiref.sync import async_to_sync
from django.core.handlers.base import BaseHandler
from django.http import HttpRequest, HttpResponse
from django.utils import timezone

from accounts import audit
from accounts.middleware import AuditRequestMiddleware, UserTimeZoneMiddleware
from core.cache import SharedRedisCache
from e31web.settings import _database
from tests.system import POSTGRES_ADMIN_URL, REDIS_URL, ROOT, LiveSystem

# The pool ---------------------------------------------------------------------------------------


@pytest.mark.nodb
def test_a_pool_is_a_setting_of_postgresql_with_each_connection_checked_before_it_is_lent():
    pooled = _database("postgres://u@db.example:5432/e31", pool=24)
    assert pooled["OPTIONS"] == {"pool": {"min_size": 1, "max_size": 24}}
    assert pooled["CONN_HEALTH_CHECKS"] is True and pooled["CONN_MAX_AGE"] == 0  # Django refuses a pool with persistent connections
    plain = _database("postgres://u@db.example:5432/e31")
    assert "pool" not in plain.get("OPTIONS", {}) and plain["CONN_HEALTH_CHECKS"] is False
    assert "pool" not in _database("sqlite:///x.sqlite3", pool=24)["OPTIONS"]  # SQLite has nothing to connect to


@pytest.mark.nodb
def test_the_web_server_pools_its_connections_and_the_other_processes_do_not(tmp_path):
    code = "import {module}; from django.conf import settings; print(json.dumps(settings.DATABASES['default'].get('OPTIONS', {{}})))"
    env = {"PATH": os.environ["PATH"], "E31_VAR_DIR": str(tmp_path), "DJANGO_SETTINGS_MODULE": "e31web.settings", "DATABASE_URL": POSTGRES_ADMIN_URL}

    def options(module, **more):
        setup = "import json, django; django.setup(); " if module != "e31web.asgi" else "import json; "
        result = subprocess.run(
            [sys.executable, "-c", setup + code.format(module=module)], cwd=ROOT, env={**env, **more}, capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)

    assert options("e31web.asgi") == {"pool": {"min_size": 1, "max_size": 32}}
    assert options("e31web.asgi", E31_DB_POOL="0") == {}  # an operator may turn it off
    assert options("jobs.models") == {}  # manage.py scheduler, runner, agent: one connection each, as before


@pytest.mark.e2e
@pytest.mark.timeout(180)
def test_requests_to_the_web_server_reuse_its_postgresql_connections():
    def sessions(name):
        import psycopg

        with psycopg.connect(POSTGRES_ADMIN_URL, autocommit=True) as conn:
            conn.execute("SELECT pg_stat_clear_snapshot()")
            return conn.execute("SELECT sessions FROM pg_stat_database WHERE datname = %s", [name]).fetchone()[0]

    with LiveSystem(database="postgres") as system:
        system.processes["scheduler"].terminate()  # only the web server's connections are counted
        system.processes["runner"].terminate()
        for _ in range(5):
            assert system.api("GET", "/api/me/").status_code == 200
        time.sleep(1.5)  # PostgreSQL counts a session at its start, in statistics flushed within a second
        before = sessions(system.pg_name)
        with httpx.Client(base_url=system.url, headers={"Authorization": f"Token {system.token}"}) as client:
            for _ in range(40):
                assert client.get("/api/jobs/").status_code == 200
        time.sleep(1.5)
        opened = sessions(system.pg_name) - before
    # Without the pool: 40 or more, one a request.
    assert opened <= 4, f"{opened} connections opened for 40 requests"


# The Redis cache --------------------------------------------------------------------------------


def test_the_rate_limits_counts_share_one_redis_connection_pool_across_requests():
    """Each request has its own context, so its own cache backend (Django's `caches` is a
    context-local): Django's RedisCache connected to Redis anew for every request's first count."""
    client = redis.Redis.from_url(REDIS_URL)
    made = lambda: client.info("stats")["total_connections_received"]  # noqa: E731
    before = made()
    for n in range(20):
        backend = SharedRedisCache(REDIS_URL, {"KEY_PREFIX": "e31-test-shared"})  # what each request's context makes
        contextvars.copy_context().run(backend.set, f"count-{n}", n, 5)
        assert backend.get(f"count-{n}") == n
    assert made() - before <= 2  # one for the process, whatever the number of requests (and the info's own)


# The middlewares under ASGI ---------------------------------------------------------------------


def test_under_asgi_no_middleware_sends_the_request_to_a_thread_before_its_view(settings, caplog):
    """Django adapts a sync-only middleware in an async chain by running it, and all the chain
    after it, in a thread, and logs so (at DEBUG) when settings.DEBUG is on."""
    settings.DEBUG = True
    with caplog.at_level(logging.DEBUG, logger="django.request"):
        BaseHandler().load_middleware(is_async=True)
    adapted = [r.getMessage() for r in caplog.records if "adapted" in r.getMessage()]
    assert adapted == [], adapted


def _serve(app, path="/accounts/login/", headers=(), sent=None, disconnect=None):
    """The messages an ASGI app sends for a GET of path, run on a thread of its own (a browser
    test's session-wide loop may be this thread's running loop). sent: the list they go into
    (kept when the app raises); disconnect: an Event the client leaves on (else it stays until
    it is answered)."""
    sent = [] if sent is None else sent
    received = []

    async def receive():
        if received:
            if disconnect is None:
                await asyncio.Event().wait()
            await asyncio.get_running_loop().run_in_executor(None, disconnect.wait, 30)
            return {"type": "http.disconnect"}
        received.append(True)
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "GET", "path": path, "query_string": b"", "headers": [(b"host", b"testserver"), *headers], "server": ("testserver", 80)}
    with ThreadPoolExecutor(1) as thread:
        thread.submit(async_to_sync(app), scope, receive, send).result()
    return sent


def _served(app, path, headers=()):
    """(status, headers) of a GET of path through an ASGI app."""
    start = next(m for m in _serve(app, path, headers) if m["type"] == "http.response.start")
    return start["status"], [(k.decode().lower(), v.decode()) for k, v in start["headers"]]


@pytest.mark.django_db(transaction=True)
def test_under_daphne_a_request_goes_to_a_thread_once_not_per_middleware_method(monkeypatch):
    """e31web.handler: the chain is built sync and run in one sync_to_async. Django's own ASGI
    handler has MiddlewareMixin send each process_request and process_response to a thread."""
    from django.core.handlers.asgi import ASGIHandler
    from django.utils import deprecation

    from e31web import handler

    hops = {"middleware": 0, "handler": 0}

    def counting(module, key):
        real = module.sync_to_async

        def counted(*args, **kwargs):
            hops[key] += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(module, "sync_to_async", counted)

    counting(deprecation, "middleware")
    counting(handler, "handler")
    status, headers = _served(handler.OneHopASGIHandler(), "/accounts/login/")
    assert status == 200 and hops == {"middleware": 0, "handler": 1}
    # Every layer ran: the clickjacking, security and CSRF middleware's marks are on the answer.
    assert ("x-frame-options", "DENY") in headers and ("x-content-type-options", "nosniff") in headers
    assert any(k == "set-cookie" and v.startswith("csrftoken=") for k, v in headers)
    assert _served(ASGIHandler(), "/accounts/login/")[0] == 200 and hops["middleware"] >= 10
    from e31web import asgi  # the web worker's

    assert isinstance(asgi.django_asgi_app, handler.OneHopASGIHandler)


def _signals_and_hops(app, get_response=None, disconnect=None):
    """Serve one GET of the login page through app (a OneHopASGIHandler), its view replaced by
    get_response if given; (the messages sent, the threads request_started and
    request_finished were sent in, the tasks given to the request's lent thread). disconnect:
    an Event the client's disconnect waits for (else it stays until answered)."""
    from django.core.signals import request_finished, request_started

    from e31web.handler import RequestThreads

    if get_response is not None:
        app.get_response = get_response
    started, finished, given = [], [], []
    lend = RequestThreads.lend

    def counted_lend(threads):
        executor = lend(threads)
        submit = executor.submit

        def counted(*args, **kwargs):
            given.append(args[0])
            return submit(*args, **kwargs)

        executor.submit = counted
        return executor

    def on_started(**kwargs):
        started.append(threading.current_thread())

    def on_finished(**kwargs):
        finished.append(threading.current_thread())

    request_started.connect(on_started)
    request_finished.connect(on_finished)
    RequestThreads.lend = counted_lend
    try:
        sent = _serve(app, disconnect=disconnect)
    finally:
        RequestThreads.lend = lend
        request_started.disconnect(on_started)
        request_finished.disconnect(on_finished)
    return sent, started, finished, given


@pytest.mark.django_db(transaction=True)
def test_under_daphne_a_request_goes_to_its_thread_once_in_all():
    """Django's handler sends request_started (sync receivers) and closes the response
    (request_finished) each in a hop to the thread of its own, besides the one that makes the
    response: three, where one does (e31web.handler.OneHopASGIHandler.handle)."""
    from e31web.handler import OneHopASGIHandler

    sent, started, finished, given = _signals_and_hops(OneHopASGIHandler())
    assert sent[0]["status"] == 200 and b"<form" in b"".join(m.get("body", b"") for m in sent[1:])
    # One hop, and the lent thread's own return to the kept ones (RequestThreads.give_back).
    assert len(given) == 2, given
    assert len(started) == len(finished) == 1 and started == finished and started[0] is not threading.current_thread()


@pytest.mark.django_db(transaction=True)
def test_a_streamed_answer_is_closed_once_it_is_sent():
    from django.http import StreamingHttpResponse

    from e31web.handler import OneHopASGIHandler

    order = []

    async def chunks():
        order.append("first chunk")
        yield b"a"
        order.append("second chunk")
        yield b"b"

    def get_response(request):
        return StreamingHttpResponse(chunks())

    app = OneHopASGIHandler()
    from django.core.signals import request_finished

    def closed(**kwargs):
        order.append("closed")

    request_finished.connect(closed)
    try:
        sent, started, finished, _ = _signals_and_hops(app, get_response)
    finally:
        request_finished.disconnect(closed)
    assert b"".join(m.get("body", b"") for m in sent[1:]) == b"ab"
    assert order == ["first chunk", "second chunk", "closed"] and len(started) == len(finished) == 1


@pytest.mark.django_db(transaction=True)
def test_a_request_whose_client_left_while_its_view_ran_is_finished_once():
    """The client goes away while the view runs: request_finished is sent once, once the view
    has returned (the thread closes its response), not a second time by the handler."""
    from django.http import HttpResponse as Response

    from e31web.handler import OneHopASGIHandler

    left, view_returned = threading.Event(), []

    def get_response(request):
        left.set()  # the client leaves now
        time.sleep(0.3)  # the view is still running when the handler hears of it
        view_returned.append(True)
        return Response("late")

    app = OneHopASGIHandler()
    sent, started, finished, _ = _signals_and_hops(app, get_response, disconnect=left)
    assert view_returned and len(started) == 1
    assert not [m for m in sent if m["type"] == "http.response.start"]  # no answer to a client gone
    assert _eventually(lambda: len(finished) >= 1)
    time.sleep(0.2)  # a second would come now
    assert len(finished) == 1, finished


@pytest.mark.django_db(transaction=True)
def test_an_answer_goes_out_even_when_closing_it_raises():
    """The handler closes an answer (request_finished) before it is sent: what that raises is
    raised once the answer is out, as Django's handler, which closes after sending, does."""
    from django.core.signals import request_finished

    from e31web.handler import OneHopASGIHandler

    sent = []

    def broken(**kwargs):
        raise RuntimeError("a receiver of request_finished failed")

    request_finished.connect(broken)
    try:
        with pytest.raises(RuntimeError, match="receiver of request_finished"):
            _serve(OneHopASGIHandler(), sent=sent)
    finally:
        request_finished.disconnect(broken)
    assert sent[0]["status"] == 200 and b"<form" in b"".join(m.get("body", b"") for m in sent[1:])


def _eventually(check, seconds=10):
    end = time.monotonic() + seconds
    while not check():
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


def _threads_of_requests(app, requests):
    """The threads the app ran its requests' sync code in (request_started's receivers run in
    the request's thread), one request after another."""
    from django.core.signals import request_started

    seen = []  # the threads themselves, held: a dead thread's ident may be a new thread's

    def started(**kwargs):
        seen.append(threading.current_thread())

    request_started.connect(started)
    try:
        for _ in range(requests):
            assert _served(app, "/accounts/login/")[0] == 200
    finally:
        request_started.disconnect(started)
    return seen


@pytest.mark.django_db(transaction=True)
def test_under_daphne_each_request_is_lent_a_kept_thread_not_given_a_new_one():
    """asgiref's ThreadSensitiveContext, as Django's ASGI handler enters it, started a thread for
    each request's sync code and another to shut it down: about 250 us a request."""
    from django.core.handlers.asgi import ASGIHandler

    from e31web.handler import OneHopASGIHandler

    # Served once first, so that what the first request starts for good (a database pool's
    # workers, on PostgreSQL with a pool) is running before the count: a CI run counted 7 threads
    # where 6 were allowed.
    _threads_of_requests(OneHopASGIHandler(), 2)
    before = threading.active_count()
    app = OneHopASGIHandler()
    seen = _threads_of_requests(app, 12)
    # A thread comes back a moment after its request (once it has finished all it was given):
    # the next request may find it not back yet, and be lent a second one. Never more.
    assert len(set(seen)) <= 2, seen
    assert _eventually(lambda: len(app.threads) == len(set(seen)))  # all kept
    assert threading.active_count() <= before + 2
    assert len(set(_threads_of_requests(ASGIHandler(), 4))) == 4  # Django's own: a new thread each time


@pytest.mark.nodb
def test_a_thread_comes_back_only_once_it_has_finished_what_it_was_given():
    """A request its client left ends while its view may still run: the next request is lent
    another thread, not queued behind that view."""
    from e31web.handler import RequestThreads

    threads = RequestThreads()
    first = threads.lend()
    go = threading.Event()
    running = first.submit(go.wait, 30)  # the abandoned request's view, still running
    threads.give_back(first)
    second = threads.lend()
    assert second is not first and len(threads) == 0
    go.set()
    assert running.result(timeout=30) is True
    assert _eventually(lambda: len(threads) == 1)  # the first comes back once its view has returned
    assert threads.lend() is first
    for executor in (first, second):
        executor.shutdown()


@pytest.mark.django_db(transaction=True)
def test_an_answer_and_its_jobs_are_freed_when_sent_not_left_in_cycles_for_the_collector(alice, rate):
    """The view, the response and its renderer context made a cycle holding every answer's
    data, and each job of a page a cycle with the rows prefetched for it: the collector's to
    free, in its oldest generation (core.middleware, JobSerializer.release)."""
    import gc

    from rest_framework.authtoken.models import Token

    from e31web.handler import OneHopASGIHandler
    from jobs.models import Job
    from tests.test_read_queries import team_of

    team_of(alice, 3, 1)
    auth = [(b"authorization", f"Token {Token.objects.create(user=alice).key}".encode())]
    app = OneHopASGIHandler()
    assert _served(app, "/api/jobs/", auth)[0] == 200
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        for _ in range(3):
            assert _served(app, "/api/jobs/", auth)[0] == 200
        gc.collect()
        pages = [o for o in gc.garbage if isinstance(o, dict) and "results" in o]
        jobs = [o for o in gc.garbage if isinstance(o, Job)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert (len(pages), len(jobs)) == (0, 0)


def test_what_survives_the_collectors_full_passes_is_frozen_ever_more_rarely(monkeypatch):
    import gc

    from e31web import asgi, collector

    frozen = []
    refreeze = collector.Refreeze()
    monkeypatch.setattr(gc, "freeze", lambda: frozen.append(refreeze.passes))
    for generation in (0, 1, 2, 2, 1, 2, 2, 2, 2, 2, 2, 2, 2):
        refreeze("start", {"generation": generation})
        refreeze("stop", {"generation": generation})
    assert frozen == [1, 2, 4, 8]  # after the full passes numbered by powers of two
    for _ in range(5000):
        refreeze("stop", {"generation": 2})
    assert frozen == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]  # and no more
    assert sum(isinstance(c, collector.Refreeze) for c in gc.callbacks) == 1  # the web worker's (asgi)
    collector.install()
    assert sum(isinstance(c, collector.Refreeze) for c in gc.callbacks) == 1 and asgi.application


def _asgi_chain(middleware, seen):
    async def view(request):
        seen.update(zone=timezone.get_current_timezone_name(), request=audit.current_request())
        return HttpResponse("ok")

    return middleware(view)


@pytest.mark.django_db
def test_a_signed_in_users_time_zone_is_active_in_the_asgi_chain(django_user_model, django_assert_num_queries):
    from accounts.models import Membership, Team

    user = django_user_model.objects.create_user("tz", password="x")
    Membership.objects.create(user=user, team=Team.objects.create(name="tz-team"), time_zone="Asia/Tokyo")
    seen = {}
    chain = _asgi_chain(UserTimeZoneMiddleware, seen)
    request = HttpRequest()
    request.COOKIES["sessionid"] = "anything"
    request.user = django_user_model.objects.get(pk=user.pk)
    async_to_sync(chain)(request)
    assert seen["zone"] == "Asia/Tokyo"

    # A request without a session cookie (an API client with a token) names no user here: no
    # query and no thread; the view activates its token's user's zone (jobs/api.py).
    timezone.activate(zoneinfo.ZoneInfo("Europe/Paris"))
    anonymous = HttpRequest()
    anonymous.user = None  # never looked at
    with django_assert_num_queries(0):
        async_to_sync(chain)(anonymous)
    assert seen["zone"] == timezone.get_default_timezone_name()


def test_the_audit_sees_the_request_in_the_asgi_chain():
    seen = {}
    request = HttpRequest()
    # On a thread of its own: after a browser test, Playwright's event loop (session-wide) is the
    # running loop of this one, where async_to_sync refuses to run.
    with ThreadPoolExecutor(1) as thread:
        thread.submit(async_to_sync(_asgi_chain(AuditRequestMiddleware, seen)), request).result()
    assert seen["request"] is request
    assert audit.current_request() is None  # and only while it is answered


def test_a_queue_layer_waits_past_redis_pys_socket_timeout_for_a_message():
    """redis-py 8 reads with a 5 s socket timeout; channels_redis's queue layer waits up to 5 s in
    BZPOPMIN: with nothing to receive, the wait ended in "Timeout reading from ..." and the
    socket's consumer failed (a clean clone's CI, tests/test_stream_fanout.py)."""
    import asyncio

    from channels_redis.core import RedisChannelLayer

    from e31web.settings import layer_hosts

    async def wait():
        layer = RedisChannelLayer(hosts=layer_hosts(REDIS_URL))
        try:
            channel = await layer.new_channel()
            await asyncio.wait_for(layer.receive(channel), 7)
        except TimeoutError:  # the test's own: nothing came, and nothing failed
            return "waited"
        finally:
            await layer.close_pools()

    with ThreadPoolExecutor(1) as thread:  # its own loop: see the audit test above
        assert thread.submit(asyncio.run, wait()).result() == "waited"
