import io
from decimal import Decimal

import pytest
from django.contrib.auth import get_user_model
from django.utils import timezone
from rest_framework.authtoken.models import Token

from accounts.models import Membership, Team
from billing.models import Rate
from e31web.demo import add_dataset
from jobs.models import Job, Upload

PASSWORD = "correct horse battery"
SCRIPT = b"print('hello from the job')\n"


@pytest.fixture(autouse=True)
def fast_passwords(settings):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture(autouse=True)
def storage_dir(settings, tmp_path):
    settings.STORAGE_DIR = tmp_path / "storage"
    settings.RUNNER_WORK_DIR = tmp_path / "runs"
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
    from e31web.storage import get_storage

    item = Upload(team=team, uploaded_by=user, role=role, name=name, size=0, sha256="", key="")
    item.key = f"uploads/{team.pk}/{item.pk}/{name}"
    item.size, item.sha256 = get_storage().save(item.key, io.BytesIO(content))
    item.save()
    return item


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
