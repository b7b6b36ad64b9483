"""Settings for E31 Network, read from environment variables.

The embedded default (no variables set) is one machine: a SQLite file, a local storage folder
and no Redis, all under E31_VAR_DIR. Production sets DATABASE_URL (PostgreSQL), REDIS_URL,
SECRET_KEY and ALLOWED_HOSTS. A malformed value stops start-up with a message.
"""

import secrets
from pathlib import Path

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

from core import endpoints as _endpoints
from core.env import (
    env_bool,
    env_float,
    env_int,
    env_list,
    env_rate,
    env_str,
    env_url,
)

BASE_DIR = Path(__file__).resolve().parent.parent

VAR_DIR = Path(env_str("E31_VAR_DIR", str(BASE_DIR / "var"))).resolve()
STORAGE_DIR = Path(env_str("E31_STORAGE_DIR", str(VAR_DIR / "storage"))).resolve()
# Object storage instead of the folder: s3://bucket/prefix on any S3-compatible endpoint.
STORAGE_URL = env_url("E31_STORAGE_URL", None, {"s3"})
E31_S3 = {
    "endpoint_url": env_url("E31_S3_ENDPOINT_URL", None, {"http", "https"}),
    "public_endpoint_url": env_url("E31_S3_PUBLIC_ENDPOINT_URL", None, {"http", "https"}),
    "access_key": env_str("E31_S3_ACCESS_KEY_ID"),
    "secret_key": env_str("E31_S3_SECRET_ACCESS_KEY"),
    "region": env_str("E31_S3_REGION", "us-east-1"),
}
# The runner's cache of staged dataset files (content-addressed, least recently used evicted).
RUNNER_CACHE_DIR = Path(env_str("E31_RUNNER_CACHE_DIR", str(VAR_DIR / "cache"))).resolve()
RUNNER_WORK_DIR = Path(env_str("E31_RUNNER_WORK_DIR", str(VAR_DIR / "runs"))).resolve()

DEBUG = env_bool("DEBUG", False)


def _secret_key():
    key = env_str("SECRET_KEY")
    if key is not None:
        if len(key) < 32:
            raise ImproperlyConfigured("SECRET_KEY must be at least 32 characters long")
        return key
    # Embedded default: a random key kept in the var folder, so sessions survive a restart
    # and no key is ever written in code.
    path = VAR_DIR / "secret_key"
    if not path.exists():
        VAR_DIR.mkdir(parents=True, exist_ok=True)
        path.write_text(secrets.token_urlsafe(50))
        path.chmod(0o600)
    return path.read_text().strip()


SECRET_KEY = _secret_key()
# Encrypts credentials teams register (their S3 buckets); defaults to one derived from SECRET_KEY.
E31_CREDENTIALS_KEY = env_str("E31_CREDENTIALS_KEY")
# Hosts and networks a registered bucket's endpoint may be at although they are not public
# ("minio.internal,10.1.0.0/16"); by default none, so a team cannot point the scanner or the
# runners at internal addresses (core/endpoints.py).
E31_S3_ENDPOINT_ALLOW = env_list("E31_S3_ENDPOINT_ALLOW", [])
try:
    _endpoints.parse_allow_list(E31_S3_ENDPOINT_ALLOW)
except ValueError as _error:
    raise ImproperlyConfigured(f"E31_S3_ENDPOINT_ALLOW: {_error}") from None
ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", ["localhost", "127.0.0.1", "[::1]"])
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS", [])
CSRF_FAILURE_VIEW = "accounts.csrf.csrf_failure"  # Django's 403, recorded in the audit log

# Daphne serves the web through its own command (`manage.py up`, e31web.asgi), so its app, whose
# one job is an ASGI runserver, is not listed: loading it brings Twisted into every process (a
# sixth of a second at each start, on the meter for an agent inside a Slurm job). The admin is
# the one that does not look for the apps' admin modules when it loads (they bring the admin's
# forms and templates: 15 ms): e31web/urls.py does, the first time a URL is resolved.
INSTALLED_APPS = [
    "django.contrib.admin.apps.SimpleAdminConfig",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django.contrib.humanize",
    "rest_framework",
    "rest_framework.authtoken",
    "drf_spectacular",
    "drf_spectacular_sidecar",  # Swagger UI's files, served from here: /api/docs/ works offline
    "django_htmx",
    "channels",
    "e31web",
    "accounts",
    "catalog",
    "jobs",
    "scheduler",
    "agent",
    "sweeps",
    "billing",
    "notifications",
    "tracking",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "accounts.middleware.UserTimeZoneMiddleware",
    "accounts.middleware.AuditRequestMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "django_htmx.middleware.HtmxMiddleware",
    # Last: the view lets go of its rendered answer, which it held in a cycle (core/middleware.py).
    "core.middleware.ReleaseViewMiddleware",
]

ROOT_URLCONF = "e31web.urls"
ASGI_APPLICATION = "e31web.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "accounts.context_processors.team",
            ],
        },
    },
]


def _database(url, pool=0):
    config = dj_database_url.parse(url, conn_max_age=0)
    if config["ENGINE"] == "django.db.backends.sqlite3":
        # The web server, the scheduler and the runner write at once: WAL lets readers go on
        # while one writes, IMMEDIATE takes the write lock at BEGIN (no upgrade deadlocks),
        # and the busy timeout makes a writer wait instead of failing with "database is locked".
        config["OPTIONS"] = {
            "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
            "transaction_mode": "IMMEDIATE",
            "timeout": 30,
        }
        # Tests use a file too: an in-memory database has table locks that ignore the busy
        # timeout, so concurrent writers would fail there where they wait here.
        config["TEST"] = {"NAME": str(VAR_DIR / "test.sqlite3")}
    elif config["ENGINE"] != "django.db.backends.postgresql":
        raise ImproperlyConfigured("DATABASE_URL must be a sqlite:// or postgres:// URL")
    elif pool:
        # A pool of connections in the process (psycopg_pool), each checked before it is lent:
        # one broken while it waited (PostgreSQL restarted) is replaced, never handed to a
        # request. Django lends one per thread and takes it back at the request's end.
        config["OPTIONS"] = {"pool": {"min_size": 1, "max_size": pool}}
        config["CONN_HEALTH_CHECKS"] = True
    return config


# PostgreSQL connections per process kept open in a pool, at most this many (0: none, each
# request connects and hangs up, as Django does by default). e31web/asgi.py sets it for the web
# server: under ASGI each request runs in a thread lent to it, so without a pool every request
# opened a connection. Measured (one daphne worker, a team of 10,000 jobs, one client): p50 of
# GET /api/me/ 10.0 -> 5.7 ms, of a job's GET 19.5 -> 13.7 ms.
E31_DB_POOL = env_int("E31_DB_POOL", 0, minimum=0)
DATABASE_URL = env_url("DATABASE_URL", f"sqlite:///{VAR_DIR / 'e31.sqlite3'}", {"sqlite", "postgres", "postgresql", "pgsql"})
DATABASES = {"default": _database(DATABASE_URL, E31_DB_POOL)}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

REDIS_URL = env_url("REDIS_URL", None, {"redis", "rediss"})


def layer_hosts(url):
    """The channel layers' Redis, read without a socket timeout, as before redis-py 8.

    redis-py 8 reads with a 5 s socket timeout by default. channels_redis's queue layer ("core")
    waits for a message with BZPOPMIN for up to 5 s, and its pub/sub layer reads a subscription
    that may say nothing for longer: a wait with nothing to receive ended in "Timeout reading
    from ...", and the socket's consumer failed or an announcement was lost while the layer
    subscribed again. Redis answers each of the queue layer's waits within its own 5 s."""
    return [{"address": url, "socket_timeout": None}]


if REDIS_URL:
    # "core": channels_redis's queue per channel; "pubsub": Redis PUBLISH/SUBSCRIBE, one
    # subscription per process (what a live announcement needs: no queue to drain per message).
    E31_CHANNEL_LAYER = env_str("E31_CHANNEL_LAYER", "pubsub")
    if E31_CHANNEL_LAYER == "pubsub":
        CHANNEL_LAYERS = {"default": {"BACKEND": "channels_redis.pubsub.RedisPubSubChannelLayer", "CONFIG": {"hosts": layer_hosts(REDIS_URL)}}}
    elif E31_CHANNEL_LAYER == "core":
        CHANNEL_LAYERS = {"default": {"BACKEND": "channels_redis.core.RedisChannelLayer", "CONFIG": {"hosts": layer_hosts(REDIS_URL), "capacity": 5000}}}
    else:
        raise ImproperlyConfigured(f"E31_CHANNEL_LAYER={E31_CHANNEL_LAYER!r} must be core or pubsub")
    E31_LIVE_MODE = "redis"
else:
    # The in-memory layer lives in one process; runners and the scheduler run elsewhere, so each
    # web process relays events by tailing the event table (see jobs/live.py).
    CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
    E31_LIVE_MODE = "db"

# The cache holds the API's rate-limit counts: Redis, when there is one, so that the limits hold
# across the server's processes; else each process's memory.
if REDIS_URL:
    CACHES = {"default": {"BACKEND": "core.cache.SharedRedisCache", "LOCATION": REDIS_URL, "KEY_PREFIX": "e31"}}
else:
    CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache", "LOCATION": "e31"}}

# Django's ModelBackend, a session's user read with its membership and team (one query, not two).
# Sessions signed in under another backend's name are signed out (once, at the change).
AUTHENTICATION_BACKENDS = ["accounts.backends.TeamModelBackend"]
SESSION_ENGINE = "core.sessions"  # Django's database sessions, read by a Read

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
]
LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "jobs:list"
LOGOUT_REDIRECT_URL = "login"

LANGUAGE_CODE = "en-us"
TIME_ZONE = env_str("TIME_ZONE", "UTC")
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATICFILES_DIRS = [BASE_DIR / "static"]
STATIC_ROOT = VAR_DIR / "static"

SESSION_COOKIE_HTTPONLY = True
# Production is served over HTTPS, behind a proxy that ends TLS and sets X-Forwarded-Proto (and
# drops a client's own): E31_HTTPS=1 redirects plain http, sends HSTS and keeps cookies to https.
# The embedded default serves plain http on localhost and sets none of it.
E31_HTTPS = env_bool("E31_HTTPS", False)
SESSION_COOKIE_SECURE = env_bool("SESSION_COOKIE_SECURE", E31_HTTPS or (not DEBUG and bool(env_str("SECRET_KEY"))))
CSRF_COOKIE_SECURE = SESSION_COOKIE_SECURE
if E31_HTTPS:
    SECURE_SSL_REDIRECT = True
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    SECURE_HSTS_SECONDS = env_int("E31_HSTS_SECONDS", 365 * 24 * 3600, minimum=0)
    # The network's own domain: its subdomains are ours too, and it may go on the preload list.
    SECURE_HSTS_INCLUDE_SUBDOMAINS = env_bool("E31_HSTS_INCLUDE_SUBDOMAINS", True)
    SECURE_HSTS_PRELOAD = env_bool("E31_HSTS_PRELOAD", True)
# Sign-in attempts: after this many failures for one username, or from one address, within the
# window, the form and POST /api/token/ refuse until the window has passed.
E31_LOGIN_FAILURES = env_int("E31_LOGIN_FAILURES", 10, minimum=1)
E31_LOGIN_WINDOW_SECONDS = env_int("E31_LOGIN_WINDOW_SECONDS", 900, minimum=1)

# Uploads over this size go to a temporary file instead of memory.
FILE_UPLOAD_MAX_MEMORY_SIZE = 2_621_440
DATA_UPLOAD_MAX_MEMORY_SIZE = 10 * 1024 * 1024
# A folder chosen in the browser arrives as one file per path (packed on arrival, jobs/folders.py):
# Django's default of 100 files would refuse a small project with a bare 400.
DATA_UPLOAD_MAX_NUMBER_FILES = 10_000
# Its paths too arrive as fields (code_paths), one per file.
DATA_UPLOAD_MAX_NUMBER_FIELDS = 12_000
E31_MAX_UPLOAD_BYTES = env_int("E31_MAX_UPLOAD_BYTES", 2 * 1024**3, minimum=1)

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "accounts.authentication.TeamTokenAuthentication",  # DRF's, the user's team in the same query
        "accounts.csrf.AuditedSessionAuthentication",  # DRF's, its CSRF failures audited
    ],
    # A team endpoint refuses a user on no team (a staff operator's token) with a 403 and why.
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated", "accounts.permissions.OnATeam"],
    # DRF's JSON, written by orjson (core/renderers.py).
    "DEFAULT_RENDERER_CLASSES": ["core.renderers.FastJSONRenderer"],
    # JSON bodies read with a depth limit: nested past the stack is a 400, not a 500.
    "DEFAULT_PARSER_CLASSES": [
        "core.parsers.BoundedJSONParser",
        "rest_framework.parsers.FormParser",
        "rest_framework.parsers.MultiPartParser",
    ],
    "UNAUTHENTICATED_USER": None,
    # Every 4xx/5xx as {"detail": "...", "errors": {field: [...]}} (see core/api.py).
    "EXCEPTION_HANDLER": "core.api.exception_handler",
    "DEFAULT_THROTTLE_CLASSES": ["core.throttling.TokenRateThrottle"],
    "DEFAULT_SCHEMA_CLASS": "core.api.AutoSchema",
}
# Requests per API token (or signed-in user, or address) and period: 1200/min, 20/s, 50000/day,
# or off. Counted in the cache below (Redis when REDIS_URL is set: one count for all processes).
E31_API_RATE = env_rate("E31_API_RATE", "1200/min")
# HTTP requests one web worker lets into Django at once (each holds a thread and a database
# connection): the others wait their turn, and one that waited E31_WEB_QUEUE_SECONDS gets a 503
# with Retry-After (e31web/admission.py). Workers x this, plus the scheduler's and runners'
# connections, must stay under PostgreSQL's max_connections (100 by default).
E31_WEB_CONCURRENCY = env_int("E31_WEB_CONCURRENCY", 16, minimum=1)
E31_WEB_QUEUE_SECONDS = env_float("E31_WEB_QUEUE_SECONDS", 30.0, minimum=0.1)

SPECTACULAR_SETTINGS = {
    "TITLE": "E31 Network API",
    "DESCRIPTION": (
        "Submit training jobs to rented GPUs, follow them, and manage datasets and invoices. "
        "Authenticate with `Authorization: Token <key>` (`POST /api/token/` or `e31 login` gives one). Every error is JSON: "
        '`{"detail": "<what to do>", "errors": {"<field>": ["<message>"]}}`. '
        "Lists are paginated with `?page=N&page_size=M`."
    ),
    "VERSION": "1",
    "SERVE_INCLUDE_SCHEMA": False,
    "SERVE_PERMISSIONS": ["rest_framework.permissions.AllowAny"],
    "SCHEMA_PATH_PREFIX": "/api/",
    "COMPONENT_SPLIT_REQUEST": True,
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    "POSTPROCESSING_HOOKS": ["drf_spectacular.hooks.postprocess_schema_enums", "e31web.api_schema.add_error_responses"],
}

# The network's own knobs.
E31_CURRENCY = env_str("E31_CURRENCY", "USD")
E31_HEARTBEAT_SECONDS = env_float("E31_HEARTBEAT_SECONDS", 1.0, minimum=0.1)
E31_NODE_TIMEOUT_SECONDS = env_float("E31_NODE_TIMEOUT_SECONDS", 30.0, minimum=1.0)
E31_SCHEDULER_INTERVAL_SECONDS = env_float("E31_SCHEDULER_INTERVAL_SECONDS", 1.0, minimum=0.05)
E31_STOP_GRACE_SECONDS = env_float("E31_STOP_GRACE_SECONDS", 2.0, minimum=0.0)
# A script's smoke run runs at most this long (jobs/lineage.py smoke_run); decimals allowed.
E31_SMOKE_MINUTES = env_float("E31_SMOKE_MINUTES", 5.0, minimum=0.1)
# Fair share: a team's past usage counts half as much after this many hours.
E31_FAIR_SHARE_HALF_LIFE_HOURS = env_float("E31_FAIR_SHARE_HALF_LIFE_HOURS", 168.0, minimum=0.01)
E31_SCHEDULER_POLICY = env_str("E31_SCHEDULER_POLICY", "ours")
# Where compute comes from (scheduler/executors/): "local", our runner on each node (the
# embedded default), or "slurm", an existing Slurm cluster (in progress: docs/operator-guide.md).
E31_EXECUTOR = env_str("E31_EXECUTOR", "local")
if E31_EXECUTOR not in ("local", "slurm"):
    raise ImproperlyConfigured(f"E31_EXECUTOR={E31_EXECUTOR!r} must be local or slurm")
# The Slurm cluster's slurm.conf (unset: Slurm's own default), the partitions E31 may place on
# (none: every partition), and each team's Slurm account ("Team A=acct_a,Team B=acct_b").
E31_SLURM_CONF = env_str("E31_SLURM_CONF")
E31_SLURM_PARTITIONS = env_list("E31_SLURM_PARTITIONS", [])
E31_SLURM_ACCOUNTS = {}
for _item in env_list("E31_SLURM_ACCOUNTS", []):
    _team, _sep, _account = (part.strip() for part in _item.partition("="))
    if not (_team and _sep and _account):
        raise ImproperlyConfigured(f"E31_SLURM_ACCOUNTS: {_item!r} is not team=account")
    E31_SLURM_ACCOUNTS[_team] = _account
# On an engine (scheduler/engine.py): how often its nodes and jobs are read; how long a job it
# leaves pending goes on before E31 takes it back (nothing is billed while it waits); the time
# limit of a job with no span or ceiling; the seconds after the job's own grace for our agent to
# keep its outputs; the memory asked for per device; where the agent's jobs keep Slurm's files
# (a path every node reaches); the Python that runs the agent on the nodes (blank: this one).
E31_ENGINE_SECONDS = env_float("E31_ENGINE_SECONDS", 3.0, minimum=0.1)
E31_ENGINE_PENDING_SECONDS = env_float("E31_ENGINE_PENDING_SECONDS", 60.0, minimum=1.0)
E31_ENGINE_MAX_SECONDS = env_int("E31_ENGINE_MAX_SECONDS", 7 * 86400, minimum=60)
E31_ENGINE_GRACE_SECONDS = env_int("E31_ENGINE_GRACE_SECONDS", 120, minimum=0)
E31_ENGINE_MEMORY_MB_PER_DEVICE = env_int("E31_ENGINE_MEMORY_MB_PER_DEVICE", 4096, minimum=0)
E31_ENGINE_WORK_DIR = Path(env_str("E31_ENGINE_WORK_DIR", str(VAR_DIR / "engine"))).resolve()
E31_ENGINE_PYTHON = env_str("E31_ENGINE_PYTHON")
# A preemptible job is preempted at most once in this many seconds (it keeps some progress).
E31_PREEMPT_EVERY_SECONDS = env_float("E31_PREEMPT_EVERY_SECONDS", 3600.0, minimum=0.0)
# How often the scheduler refreshes the predicted start and finish of queued jobs.
E31_PREDICT_SECONDS = env_float("E31_PREDICT_SECONDS", 5.0, minimum=0.1)
E31_LOG_LINE_MAX_BYTES = env_int("E31_LOG_LINE_MAX_BYTES", 16384, minimum=256)
# The log cap: a job's stored log stops growing at this many bytes (agent/logcap.py); lines
# past it are counted, not stored, and the job keeps running.
E31_JOB_LOG_MAX_BYTES = env_int("E31_JOB_LOG_MAX_BYTES", 100 * 10**6, minimum=1024)
E31_RUNNER_CACHE_BYTES = env_int("E31_RUNNER_CACHE_BYTES", 50 * 1024**3, minimum=0)
# Where the other runners of a gang reach this one (the torchrun rendezvous of runs across nodes).
E31_RUNNER_ADDRESS = env_str("E31_RUNNER_ADDRESS", "127.0.0.1")
E31_STAGING_WORKERS = env_int("E31_STAGING_WORKERS", 16, minimum=1)  # reads at once (files, or parts of large ones); bench/staging.py
# Staged bytes go to the disk with O_DIRECT where the cache's file system takes it (less CPU).
E31_STAGING_DIRECT_IO = env_bool("E31_STAGING_DIRECT_IO", True)
E31_UPLOAD_CHUNK_BYTES = env_int("E31_UPLOAD_CHUNK_BYTES", 8 * 1024 * 1024, minimum=5 * 1024 * 1024)
# Completing a dataset file's upload joins and hashes it: up to this size within the request
# (200), above it by the scheduler's worker (202, the client polls the upload).
E31_UPLOAD_INLINE_COMPLETE_BYTES = env_int("E31_UPLOAD_INLINE_COMPLETE_BYTES", 64 * 1024 * 1024, minimum=0)
# The blob sweep (jobs/sweep.py) frees blobs nothing refers to once they are this old: a blob is
# written (or touched) a moment before the row that refers to it, and a large one can take a
# while to copy, so the wait is never shorter than an hour.
E31_BLOB_SWEEP_GRACE_HOURS = env_float("E31_BLOB_SWEEP_GRACE_HOURS", 24.0, minimum=1.0)
# Job isolation on a node (agent/isolation.py): every job in a bubblewrap sandbox; a root
# runner also gives each a uid (BASE.. BASE+COUNT-1, one per running job) and a cgroup. Off
# (E31_JOB_ISOLATION=0) is for development only: the runner then refuses nothing, and says so.
E31_JOB_ISOLATION = env_bool("E31_JOB_ISOLATION", True)
E31_JOB_UID_BASE = env_int("E31_JOB_UID_BASE", 200000, minimum=1000)
E31_JOB_UID_COUNT = env_int("E31_JOB_UID_COUNT", 65536, minimum=1)
# Lock files (one per uid in use) shared by every runner of a machine, so no two jobs get one uid.
E31_JOB_UID_LOCK_DIR = env_str("E31_JOB_UID_LOCK_DIR", "/run/e31/job-uids")
# The cgroup folder (under each controller) holding the runners' job cgroups.
E31_JOB_CGROUP_PARENT = env_str("E31_JOB_CGROUP_PARENT", "e31")
E31_JOB_MEMORY_BYTES = env_int("E31_JOB_MEMORY_BYTES", 0, minimum=0)  # 0: (the node's memory - reserve) x devices held / devices
E31_JOB_MAX_PROCESSES = env_int("E31_JOB_MAX_PROCESSES", 4096, minimum=16)  # processes and threads
E31_JOB_MAX_OPEN_FILES = env_int("E31_JOB_MAX_OPEN_FILES", 65536, minimum=64)
E31_JOB_MAX_FILE_BYTES = env_int("E31_JOB_MAX_FILE_BYTES", 256 * 1024**3, minimum=1024**2)
# The job's folder, checked every few seconds. 0: the job's share of the work folder's disk.
E31_JOB_DISK_BYTES = env_int("E31_JOB_DISK_BYTES", 0, minimum=0)
# What a node keeps for itself (the web server, scheduler, database) before sharing its memory
# and disk among the jobs by the devices they hold. 0: a tenth, at least 1 GiB.
E31_NODE_RESERVE_MEMORY_BYTES = env_int("E31_NODE_RESERVE_MEMORY_BYTES", 0, minimum=0)
E31_NODE_RESERVE_DISK_BYTES = env_int("E31_NODE_RESERVE_DISK_BYTES", 0, minimum=0)
# Where a job given the network (its own network, with a slirp4netns uplink) may not connect:
# these networks, and every address of the node itself, are unreachable routes in its network
# (private ranges, link-local with the clouds' metadata service at 169.254.169.254, shared NAT).
# Comma- or space-separated CIDRs; an operator whose jobs must reach an internal mirror removes
# its range here.
E31_JOB_NETWORK_DENY = env_str("E31_JOB_NETWORK_DENY", "10.0.0.0/8, 172.16.0.0/12, 192.168.0.0/16, 169.254.0.0/16, 100.64.0.0/10, 0.0.0.0/8")
# The bubblewrap binary every job runs under (found on PATH when empty).
E31_BWRAP = env_str("E31_BWRAP", "")
# Job environments (agent/environments.py): the packages a job names, built with uv on the
# node while it waits, from wheels only, cached per node within a size budget. The index: uv's
# default (PyPI) unless an index URL is set; FIND_LINKS: folders of wheels (comma-separated);
# NO_INDEX: only those folders (an offline node).
E31_ENV_CACHE_BYTES = env_int("E31_ENV_CACHE_BYTES", 20 * 1024**3, minimum=0)
E31_ENV_INDEX_URL = env_str("E31_ENV_INDEX_URL", "")
E31_ENV_FIND_LINKS = env_str("E31_ENV_FIND_LINKS", "")
E31_ENV_NO_INDEX = env_bool("E31_ENV_NO_INDEX", False)
# Source builds (sdists): off, wheels only, so no package code runs while installing. On, uv
# runs in a sandbox as an unprivileged uid of the pool with a private cache (never as the runner).
E31_ENV_SOURCE_BUILDS = env_bool("E31_ENV_SOURCE_BUILDS", False)
E31_ENV_BUILD_SECONDS = env_int("E31_ENV_BUILD_SECONDS", 1800, minimum=10)
E31_JOB_DISK_CHECK_SECONDS = env_float("E31_JOB_DISK_CHECK_SECONDS", 5.0, minimum=0.1)
# A code archive's unpacked size and entry count, from its headers at upload and counted again as
# it is unpacked (jobs/archive.py): a zip bomb is refused, not unpacked. The bytes never exceed
# E31_JOB_DISK_BYTES where that is set (jobs.archive.limits() takes the smaller of the two).
E31_ARCHIVE_MAX_BYTES = env_int("E31_ARCHIVE_MAX_BYTES", 10 * 1024**3, minimum=1024)
E31_ARCHIVE_MAX_ENTRIES = env_int("E31_ARCHIVE_MAX_ENTRIES", 100_000, minimum=1)
# Device utilization (jobs/utilization.py): the runner samples each job's devices every
# SAMPLE seconds (0: never) into windows of WINDOW seconds, at most MAX_WINDOWS per run (a long
# run's windows merge into coarser ones). Devices below IDLE_PERCENT are idle; a job idle for its
# idle_minutes is flagged. IDLE_MINUTE_SECONDS is how long such a minute lasts (tests shorten it).
E31_UTIL_SAMPLE_SECONDS = env_float("E31_UTIL_SAMPLE_SECONDS", 2.0, minimum=0.0)
E31_UTIL_WINDOW_SECONDS = env_float("E31_UTIL_WINDOW_SECONDS", 30.0, minimum=0.1)
E31_UTIL_MAX_WINDOWS = env_int("E31_UTIL_MAX_WINDOWS", 240, minimum=2)
E31_UTIL_IDLE_PERCENT = env_float("E31_UTIL_IDLE_PERCENT", 5.0, minimum=0.0)
E31_UTIL_IDLE_MINUTE_SECONDS = env_float("E31_UTIL_IDLE_MINUTE_SECONDS", 60.0, minimum=0.01)

# Notifications (notifications/): email and signed webhooks, sent by a worker thread of the
# scheduler. The site's address, for the links in emails and webhook payloads.
E31_SITE_URL = env_url("E31_SITE_URL", "http://127.0.0.1:8000", {"http", "https"})
E31_WEBHOOK_TIMEOUT_SECONDS = env_float("E31_WEBHOOK_TIMEOUT_SECONDS", 5.0, minimum=0.1)
# Hosts and networks a team's webhook may be at although they are not public, in the form of
# E31_S3_ENDPOINT_ALLOW (a list of its own: a bucket endpoint allowed is not a webhook allowed);
# by default none, so the network never POSTs to its own or internal addresses (core/endpoints.py).
E31_WEBHOOK_ALLOW = env_list("E31_WEBHOOK_ALLOW", [])
try:
    _endpoints.parse_allow_list(E31_WEBHOOK_ALLOW)
except ValueError as _error:
    raise ImproperlyConfigured(f"E31_WEBHOOK_ALLOW: {_error}") from None
E31_NOTIFY_RETRY_SECONDS = env_float("E31_NOTIFY_RETRY_SECONDS", 30.0, minimum=0.0)  # doubled after each failure
E31_NOTIFY_MAX_ATTEMPTS = env_int("E31_NOTIFY_MAX_ATTEMPTS", 8, minimum=1)
# A team's experiment tracker (tracking/): an MLflow tracking server each job is sent to as a
# run, by a worker thread of the scheduler. Its address passes the same policy as webhooks, with
# an allow-list of its own (E31_TRACKER_ALLOW, in the form of E31_S3_ENDPOINT_ALLOW). A failed
# delivery is retried after RETRY seconds, doubled each time up to RETRY_MAX, for as long as it
# takes: the outbox loses nothing while a tracker is down.
E31_TRACKER_ALLOW = env_list("E31_TRACKER_ALLOW", [])
try:
    _endpoints.parse_allow_list(E31_TRACKER_ALLOW)
except ValueError as _error:
    raise ImproperlyConfigured(f"E31_TRACKER_ALLOW: {_error}") from None
E31_TRACKER_TIMEOUT_SECONDS = env_float("E31_TRACKER_TIMEOUT_SECONDS", 10.0, minimum=0.1)
E31_TRACKER_RETRY_SECONDS = env_float("E31_TRACKER_RETRY_SECONDS", 5.0, minimum=0.0)
E31_TRACKER_RETRY_MAX_SECONDS = env_float("E31_TRACKER_RETRY_MAX_SECONDS", 300.0, minimum=0.0)
DEFAULT_FROM_EMAIL = env_str("E31_EMAIL_FROM", "E31 Network <noreply@localhost>")
# Email: printed to the console by default; EMAIL_URL (smtp://user:password@host:587, with
# ?tls=1, or smtps:// for SSL) or EMAIL_HOST (with EMAIL_PORT, EMAIL_HOST_USER,
# EMAIL_HOST_PASSWORD, EMAIL_USE_TLS) send through an SMTP server.
from notifications.mailconfig import email_settings  # noqa: E402 - pure, no Django models

_EMAIL = email_settings(
    env_str("EMAIL_URL"),
    env_str("EMAIL_HOST"),
    env_int("EMAIL_PORT", 25, minimum=1),
    env_str("EMAIL_HOST_USER", ""),
    env_str("EMAIL_HOST_PASSWORD", ""),
    env_bool("EMAIL_USE_TLS", False),
)
EMAIL_BACKEND = _EMAIL["EMAIL_BACKEND"]
EMAIL_HOST = _EMAIL.get("EMAIL_HOST", "localhost")
EMAIL_PORT = _EMAIL.get("EMAIL_PORT", 25)
EMAIL_HOST_USER = _EMAIL.get("EMAIL_HOST_USER", "")
EMAIL_HOST_PASSWORD = _EMAIL.get("EMAIL_HOST_PASSWORD", "")
EMAIL_USE_TLS = _EMAIL.get("EMAIL_USE_TLS", False)
EMAIL_USE_SSL = _EMAIL.get("EMAIL_USE_SSL", False)
EMAIL_TIMEOUT = _EMAIL.get("EMAIL_TIMEOUT")

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(name)s %(levelname)s %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": env_str("LOG_LEVEL", "INFO")},
    "loggers": {"django.channels.server": {"level": "WARNING"}},
}

# The operator's view (/ops/, /metrics): a job is listed as stuck when it has been starting this
# long, queued this long past its predicted start, running this long past its predicted finish,
# or holding compute this long past the end of its span or ceiling.
E31_STUCK_STARTING_SECONDS = env_float("E31_STUCK_STARTING_SECONDS", 600.0, minimum=1.0)
E31_STUCK_QUEUED_SECONDS = env_float("E31_STUCK_QUEUED_SECONDS", 1800.0, minimum=0.0)
E31_STUCK_RUNNING_SECONDS = env_float("E31_STUCK_RUNNING_SECONDS", 3600.0, minimum=0.0)
E31_STUCK_OVERRUN_SECONDS = env_float("E31_STUCK_OVERRUN_SECONDS", 300.0, minimum=0.0)
