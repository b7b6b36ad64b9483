import importlib.util
import io
import os
from decimal import Decimal
from pathlib import Path

import pytest
from django.conf import settings as django_settings
from django.contrib.auth import get_user_model
from django.utils import timezone
from rest_framework.authtoken.models import Token

from accounts.models import Membership, Team
from billing.models import Rate
from e31web.demo import add_dataset
from jobs.models import Job, Upload

# The browser tests' fixtures (browser, page) live in tests/browser.py.
# The browser fixtures need Playwright, which a GPU node proving its paths (tests/test_gpu.py,
# tests/test_precision.py, with the node's pytest) does not have: there they are left out, and a
# browser test would fail for want of its `page` fixture, never pass unseen.
pytest_plugins = ["tests.browser"] if importlib.util.find_spec("playwright") else []

PASSWORD = "correct horse battery"
SCRIPT = b"print('hello from the job')\n"


@pytest.fixture(scope="session")
def seaweed():
    """A real S3 server (SeaweedFS) for the whole test session."""
    from tests.seaweed import SeaweedFS

    with SeaweedFS() as server:
        yield server


@pytest.fixture
def s3_storage(settings, seaweed):
    """Point the network's storage at a fresh bucket on the test S3 server."""
    from core.storage import get_storage

    env = seaweed.settings_env(seaweed.bucket())
    settings.STORAGE_URL = env["E31_STORAGE_URL"]
    settings.E31_S3 = {
        "endpoint_url": seaweed.endpoint,
        "public_endpoint_url": None,
        "access_key": seaweed.access_key,
        "secret_key": seaweed.secret_key,
        "region": "us-east-1",
    }
    return get_storage()


# This test run's runners keep their jobs' cgroups apart from those of any other run on the
# machine (bin/test runs its SQLite and PostgreSQL passes at once): a runner kills whatever it
# finds under its own name when it starts, and the tests' runners share names. The live
# systems' runner processes get the same (tests/system.py passes the variable on).
CGROUP_PARENT = f"e31-test-{os.getpid()}"
os.environ["E31_JOB_CGROUP_PARENT"] = django_settings.E31_JOB_CGROUP_PARENT = CGROUP_PARENT

# The tests' S3 servers (SeaweedFS) listen on loopback, which a team's bucket may not be at unless
# allowed (core/endpoints.py). tests/system.py gives the live systems the same.
TEST_ENDPOINT_ALLOW = "127.0.0.1"
django_settings.E31_S3_ENDPOINT_ALLOW = [TEST_ENDPOINT_ALLOW]


def pytest_configure(config):
    # The benchmarks' marker (tests/test_bench_quick.py); the others are in pyproject.toml.
    config.addinivalue_line(
        "markers",
        "bench: runs a benchmark (bench/*.py) in its --quick mode, or a long round trip of the scripts around it (a wheelhouse installed offline; a real Slurm cluster; "
        "bench/gpu_check.py on the CPU, a real MLflow server, a sweep of recipe runs): once, in a lane of bin/test's own, beside the SQLite and PostgreSQL passes",
    )
    config.addinivalue_line(
        "markers",
        "slurm_engine: a whole system running jobs through a real Slurm (tests/test_slurm_engine.py); with bench, run after the PostgreSQL pass "
        "in its lane of bin/test, to balance the lanes",
    )


def pytest_sessionfinish(session, exitstatus):
    """This run's cgroup folders removed, deepest first (a runner the tests did not stop leaves
    its own folder behind; an empty cgroup folder is removed with rmdir, files and all)."""
    for top in [*Path("/sys/fs/cgroup").glob(f"*/{CGROUP_PARENT}"), Path("/sys/fs/cgroup", CGROUP_PARENT)]:
        if not top.is_dir():
            continue
        for folder, _, _ in sorted(os.walk(top), key=lambda entry: -entry[0].count(os.sep)):
            try:
                os.rmdir(folder)
            except OSError:
                pass


@pytest.fixture(autouse=True)
def fresh_cache():
    """Each test starts with an empty cache: the API's rate-limit counts of one test (user ids
    are reused across tests) never throttle the next."""
    from django.core.cache import cache

    cache.clear()


@pytest.fixture(autouse=True)
def fast_passwords(settings):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture(autouse=True)
def storage_dir(settings, tmp_path):
    settings.STORAGE_DIR = tmp_path / "storage"
    settings.STORAGE_URL = None
    settings.RUNNER_WORK_DIR = tmp_path / "runs"
    settings.RUNNER_CACHE_DIR = tmp_path / "cache"
    return settings.STORAGE_DIR


def make_user(name, team, role=Membership.MEMBER):
    user = get_user_model().objects.create_user(name, f"{name}@example.com", PASSWORD)
    if team is not None:
        Membership.objects.create(user=user, team=team, role=role)
    return user


@pytest.fixture
def team_a(db):
    return Team.objects.create(name="Team A")


@pytest.fixture
def team_b(db):
    return Team.objects.create(name="Team B")


@pytest.fixture
def alice(team_a):
    """The owner of Team A, who submits the jobs."""
    return make_user("alice", team_a, Membership.OWNER)


@pytest.fixture
def bob(team_a):
    """A member of Team A."""
    return make_user("bob", team_a)


@pytest.fixture
def charlie(team_b):
    """An outsider: on Team B."""
    return make_user("charlie", team_b, Membership.OWNER)


@pytest.fixture
def rate(db):
    return Rate.objects.create(gpu_type="", per_gpu_hour=Decimal("2.40"), effective_from=timezone.now() - timezone.timedelta(days=1))


@pytest.fixture
def token(alice):
    return Token.objects.create(user=alice).key


@pytest.fixture
def dataset(team_a):
    return add_dataset(team_a, "numbers", {"numbers.csv": b"x,y\n1,2\n"})


def upload(team, user, role, name, content):
    from core.storage import get_storage

    key, size, sha256 = get_storage().save_blob(io.BytesIO(content))
    return Upload.objects.create(team=team, uploaded_by=user, role=role, name=name, size=size, sha256=sha256, key=key)


def make_job(user, script=SCRIPT, name="job", gpus=1, span_hours=Decimal("1"), **fields):
    """A queued job with a script of the given source, as the form would create it."""
    team = user.membership.team
    job = Job.objects.create(team=team, created_by=user, name=name, entrypoint="train.py", gpus=gpus, span_hours=span_hours, **fields)
    code = upload(team, user, Upload.CODE, "train.py", script)
    code.job = job
    code.save()
    job.record("state", data={"state": "queued", "from": None, "reason": "submitted"})
    job.refresh_from_db()
    return job


def schedule_now(now=None):
    """A scheduling cycle as if every queued job's data were already staged on its node: for
    tests of placement, billing and pages, where staging is not the point."""
    from scheduler import services
    from scheduler.models import Staging

    services.line_up(now)
    Staging.objects.filter(state=Staging.WAITING).update(state=Staging.STAGED)
    return services.schedule(now)


@pytest.fixture
def make_runner(db, settings, tmp_path):
    """Runners in this process, registered, each with folders of its own (named after it), and
    stopped when the test ends. A second runner of a name reuses its folders (a restart)."""
    from agent.runner import Runner

    settings.E31_STOP_GRACE_SECONDS = 1.0
    runners = []

    def make(name="node-a", devices=1, cache_bytes=None):
        runner = Runner(
            name=name,
            devices=devices,
            work_dir=tmp_path / "runs" / name,
            device_type="cpu",
            cache_dir=tmp_path / "cache" / name,
            cache_bytes=cache_bytes,
        )
        runner.register()
        runners.append(runner)
        return runner

    yield make
    for runner in runners:
        runner.stop_all()
