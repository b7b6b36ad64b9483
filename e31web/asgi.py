import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "e31web.settings")
# The web server keeps its PostgreSQL connections in a pool (e31web/settings.py, E31_DB_POOL):
# room for the E31_WEB_CONCURRENCY (16) requests let in at once, the websockets' reads and the
# live hub's kept connection. Only the connections in use are open, and idle ones close in time.
os.environ.setdefault("E31_DB_POOL", "32")
from e31web.handler import application as django_application  # noqa: E402

django_asgi_app = django_application()

from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from django.conf import settings  # noqa: E402
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler  # noqa: E402

from accounts.ws_auth import TokenOrSessionAuth  # noqa: E402
from e31web import collector, http_bodies  # noqa: E402
from e31web.admission import Admission  # noqa: E402
from jobs.routing import websocket_urlpatterns  # noqa: E402

http_bodies.install()  # twisted, under daphne, parses no upload in memory

application = ProtocolTypeRouter(
    {
        # Static files are served by the app itself in the embedded default; a production
        # deployment may put them behind a CDN with collectstatic instead.
        "http": Admission(ASGIStaticFilesHandler(django_asgi_app), settings.E31_WEB_CONCURRENCY, settings.E31_WEB_QUEUE_SECONDS),
        "websocket": TokenOrSessionAuth(URLRouter(websocket_urlpatterns)),
    }
)

# What the start made (Django, the URL modules, DRF, the models) lives as long as the worker:
# frozen, the collector's full passes no longer walk it. bench/read_load.py, 2,000 jobs: the job
# list's p99 135.6 -> 89.6 ms, usage's 111.5 -> 72.6 ms (their p50s unchanged). What the worker
# makes to last after it starts is frozen as it comes (e31web/collector.py): the job list's p99
# 40-59 -> 20 ms, usage's 66-76 -> 33 ms (1,000 jobs, one client).
collector.install()
