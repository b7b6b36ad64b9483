"""Job environments: the packages a job names, built with uv on its node while it waits.

The wheels are built here, in the test, and served from a local folder: no network is used.
"""

import base64
import hashlib
import os
import shutil
import zipfile
from pathlib import Path

import pytest

from agent.environments import Entry, base_pins, environment_key, evictions, torch_problem

ROOT = os.geteuid() == 0

# The pure decisions ---------------------------------------------------------------------------


@pytest.mark.nodb
def test_the_key_is_the_same_for_the_same_request_in_any_order_and_changes_with_the_base():
    base = base_pins([("NumPy", "2.4.6"), ("torch", "2.13.0"), ("numpy", "2.4.6")])
    assert base == ["numpy==2.4.6", "torch==2.13.0"]
    one = environment_key(["einops==0.8.0", "rich"], base, "3.11", ["--no-index"])
    assert one == environment_key(["rich", "einops==0.8.0"], base, "3.11", ["--no-index"])
    assert one != environment_key(["rich", "einops==0.8.0"], ["numpy==2.5.0", "torch==2.13.0"], "3.11", ["--no-index"])
    assert one != environment_key(["rich", "einops==0.8.0"], base, "3.12", ["--no-index"])
    assert one != environment_key(["rich"], base, "3.11", ["--no-index"])


@pytest.mark.nodb
def test_a_request_for_another_torch_is_refused_naming_the_node_s():
    assert torch_problem(["numpy", "torch"], "2.13.0") is None  # torch without a version: the node's
    assert torch_problem(["torch>=2.10,<3"], "2.13.0+cpu") is None
    problem = torch_problem(["torch==2.1.0"], "2.13.0")
    assert "torch==2.1.0" in problem and "2.13.0 here" in problem
    assert "has none" in torch_problem(["torch>=2"], None)


@pytest.mark.nodb
def test_eviction_drops_the_least_recently_used_to_fit_and_never_one_in_use():
    entries = [Entry("a", 40, used_at=1.0), Entry("b", 40, used_at=2.0), Entry("c", 40, used_at=3.0)]
    assert evictions(entries, budget=200) == []
    assert evictions(entries, budget=100) == ["a"]
    assert evictions(entries, budget=100, keep={"a"}) == ["b"]
    assert evictions(entries, budget=100, incoming=40) == ["a", "b"]
    assert evictions(entries, budget=0, keep={"a", "b", "c"}) == []


# Wheels made here -----------------------------------------------------------------------------


def make_wheel(folder, name, version, code, requires=()):
    """A pure-Python wheel of one module, as a build backend would write it."""
    dist = f"{name}-{version}.dist-info"
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(f"Requires-Dist: {r}\n" for r in requires)
    files = {
        f"{name}/__init__.py": code.encode(),
        f"{dist}/METADATA": metadata.encode(),
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: e31-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }

    def digest(data):
        return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()

    record = "".join(f"{path},sha256={digest(data)},{len(data)}\n" for path, data in files.items()) + f"{dist}/RECORD,,\n"
    path = Path(folder) / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        for name_in, data in files.items():
            wheel.writestr(name_in, data)
        wheel.writestr(f"{dist}/RECORD", record)
    return path


@pytest.fixture
def wheelhouse(tmp_path, settings):
    folder = tmp_path / "wheels"
    folder.mkdir()
    # It needs numpy, which the runtime has: resolved against the base, not downloaded.
    make_wheel(folder, "e31demo", "1.0", "VALUE = 42\n", requires=["numpy>=1.20"])
    settings.E31_ENV_FIND_LINKS = str(folder)
    settings.E31_ENV_NO_INDEX = True
    return folder


@pytest.fixture
def node(make_runner, wheelhouse):
    return make_runner("env-node", devices=2)


def run(node, job, timeout=90):
    from tests.test_isolation import run as run_job

    return run_job(node, job, timeout=timeout)


def lines(job):
    return list(job.events.filter(kind="log").order_by("seq").values_list("text", flat=True))


def notices(job):
    return [(d or {}).get("text", "") for d in job.events.filter(kind="notice").order_by("seq").values_list("data", flat=True)]


SCRIPT = b"import sys, e31demo, numpy, torch, e31\nprint('value', e31demo.VALUE, 'numpy', numpy.__version__, 'prefix', sys.prefix, flush=True)\n"


@pytest.mark.django_db(transaction=True)
@pytest.mark.skipif(not shutil.which("bwrap"), reason="needs bubblewrap")
def test_a_job_s_packages_are_built_while_it_waits_and_a_second_job_reuses_them(node, alice, rate, client):
    import numpy

    from tests.conftest import make_job

    first = run(node, make_job(alice, script=SCRIPT, packages="e31demo==1.0"))
    assert first.state == "succeeded", (first.reason, lines(first), notices(first))
    value = next(line for line in lines(first) if line.startswith("value"))
    assert value.startswith(f"value 42 numpy {numpy.__version__} prefix {node.env_root}")  # the runtime's numpy, not another
    assert any(text.startswith("ready (built in") and "e31demo==1.0" in text for text in notices(first))
    # Built before compute was held: the notice comes before the job's first allocation started.
    built_at = first.events.filter(kind="notice", data__text__startswith="ready (built in").order_by("seq").first().at
    assert built_at <= first.allocations.get().started_at
    (key,) = [p.name for p in node.env_root.iterdir() if not p.name.startswith(".")]
    stamp = (node.env_root / key / ".complete").read_text()

    second = run(node, make_job(alice, script=SCRIPT, packages="e31demo==1.0"))
    assert second.state == "succeeded", (second.reason, lines(second))
    assert any("from this node's cache" in text for text in notices(second))
    assert not any(text.startswith("building on") for text in notices(second))
    assert (node.env_root / key / ".complete").read_text() == stamp, "not built again"
    client.force_login(alice)
    page = client.get(f"/jobs/{first.pk}/").content.decode()
    assert "Environment: ready (built in" in page and "e31demo==1.0" in page


@pytest.mark.django_db(transaction=True)
@pytest.mark.skipif(not shutil.which("bwrap"), reason="needs bubblewrap")
def test_a_requirement_that_cannot_be_met_fails_the_job_before_compute_is_held_billed_nothing(node, alice, rate):
    from billing.models import UsageRecord
    from tests.conftest import make_job

    job = run(node, make_job(alice, script=SCRIPT, packages="e31demo==1.0\nno-such-package==3.1"))
    assert job.state == "failed"
    assert "environment could not be built" in job.reason and "no-such-package" in job.reason, job.reason
    assert not job.allocations.exists(), "no compute was held"
    assert not UsageRecord.objects.filter(job=job).exists()

    torch = run(node, make_job(alice, script=SCRIPT, packages="torch==1.0.0"))
    assert torch.state == "failed" and "torch is the node's own" in torch.reason, torch.reason
    assert not torch.allocations.exists()


@pytest.mark.django_db
def test_the_scheduler_lines_a_job_up_where_its_environment_already_is(alice, rate):
    from jobs.packages import packages_digest
    from scheduler import services
    from scheduler.models import CachedBlob, Node
    from tests.conftest import make_job

    Node.objects.create(name="empty", device_type="cpu", devices=4)
    holder = Node.objects.create(name="holder", device_type="cpu", devices=1)
    CachedBlob.objects.create(node=holder, sha256=packages_digest(["e31demo==1.0", "rich"]), size=300 * 10**6)
    job = make_job(alice, packages="rich\ne31demo==1.0")
    [staging] = services.line_up()
    assert staging.job == job and staging.node == holder


@pytest.mark.django_db(transaction=True)
@pytest.mark.skipif(not shutil.which("bwrap"), reason="needs bubblewrap")
def test_a_node_tells_the_scheduler_which_environments_it_holds_even_after_a_restart(node, make_runner, alice, rate):
    from jobs.packages import packages_digest
    from scheduler.models import CachedBlob
    from tests.conftest import make_job

    job = run(node, make_job(alice, script=SCRIPT, packages="e31demo==1.0"))
    assert job.state == "succeeded", job.reason
    digest = packages_digest(["e31demo==1.0"])
    assert CachedBlob.objects.filter(node=node.node, sha256=digest).exists()
    node.stop_all()
    again = make_runner("env-node", devices=2)  # its folders, its environments: a restart
    assert CachedBlob.objects.filter(node=again.node, sha256=digest).exists()


@pytest.mark.nodb
def test_building_never_runs_a_package_s_code_as_the_runner(tmp_path):
    """A wheel may carry a .pth file, which Python runs at every start of the environment's
    interpreter: the build (as root) must not start it once packages are in."""
    import site
    import sys
    import zipfile as zf

    from uv import find_uv_bin

    from agent.environments import EnvironmentCache

    wheels = tmp_path / "wheels"
    wheels.mkdir()
    marker = tmp_path / "ran-as-the-runner"
    path = make_wheel(wheels, "sneaky", "1.0", "X = 1\n")
    with zf.ZipFile(path, "a") as wheel:  # RECORD need not list it for uv to install it
        wheel.writestr("sneaky_hook.pth", f"import os; open({str(marker)!r}, 'w').write(str(os.getuid()))\n")
    cache = EnvironmentCache(
        tmp_path / "envs",
        10**10,
        uv=find_uv_bin(),
        python=sys.executable,
        base_sites=site.getsitepackages(),
        index=["--find-links", str(wheels), "--no-index"],
    )
    key, built = cache.ensure(["sneaky==1.0"])
    assert built and cache.resolved(key) == ["sneaky==1.0"]
    assert not marker.exists(), "a package's code ran during the build"


def local_cache(tmp_path, wheels, **options):
    import site
    import sys

    from uv import find_uv_bin

    from agent.environments import EnvironmentCache

    return EnvironmentCache(
        tmp_path / "envs",
        10**10,
        uv=find_uv_bin(),
        python=sys.executable,
        base_sites=site.getsitepackages(),
        index=["--find-links", str(wheels), "--no-index"],
        **options,
    )


@pytest.mark.nodb
def test_requests_that_resolve_the_same_share_one_environment_keyed_by_what_was_resolved(tmp_path):
    from agent.environments import environment_key
    from jobs.packages import packages_digest

    wheels = tmp_path / "wheels"
    wheels.mkdir()
    make_wheel(wheels, "e31demo", "1.0", "VALUE = 42\n")
    cache = local_cache(tmp_path, wheels)
    key, built = cache.ensure(["e31demo==1.0"])
    assert built and cache.resolved(key) == ["e31demo==1.0"]
    assert key == environment_key(["e31demo==1.0"], cache.pins, cache.python_version, cache.index)  # what was resolved
    # Asked another way, it resolves the same: the one environment serves both.
    other, built = cache.ensure(["E31Demo>=0.5"])
    assert (other, built) == (key, False)
    assert [p.name for p in (tmp_path / "envs").iterdir() if not p.name.startswith(".")] == [key]
    assert not list((tmp_path / "envs" / ".building").iterdir())  # no build left behind
    # Both requests are known now: neither builds again, and the scheduler hears of both.
    assert cache.lookup(["E31Demo>=0.5"]) == key == cache.lookup(["e31demo==1.0"])
    assert set(cache.held()) == {packages_digest(["e31demo==1.0"]), packages_digest(["E31Demo>=0.5"])}
    # The environment was built elsewhere and moved: its scripts and Python still work there.
    import subprocess

    python = cache.python_of(key)
    assert subprocess.run([python, "-c", "import e31demo, numpy; print(e31demo.VALUE)"], capture_output=True, text=True).stdout == "42\n"
    # Evicted, the requests go with it.
    cache.budget = 0
    cache.make_room()
    assert cache.lookup(["e31demo==1.0"]) is None and cache.held() == {}


BACKEND = """
import base64, hashlib, os, zipfile

SECRET = {secret!r}


def _probe():
    try:
        open(SECRET).read()
        read = "read"
    except OSError as error:
        read = type(error).__name__
    return f"UID = {{os.getuid()}}\\nSECRET = {{read!r}}\\n"


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    dist = "built-1.0.dist-info"
    files = {{
        "built/__init__.py": _probe().encode(),
        dist + "/METADATA": b"Metadata-Version: 2.1\\nName: built\\nVersion: 1.0\\n",
        dist + "/WHEEL": b"Wheel-Version: 1.0\\nGenerator: e31-tests\\nRoot-Is-Purelib: true\\nTag: py3-none-any\\n",
    }}
    digest = lambda data: base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    record = "".join(f"{{p}},sha256={{digest(d)}},{{len(d)}}\\n" for p, d in files.items()) + dist + "/RECORD,,\\n"
    name = "built-1.0-py3-none-any.whl"
    with zipfile.ZipFile(os.path.join(wheel_directory, name), "w") as wheel:
        for path, data in files.items():
            wheel.writestr(path, data)
        wheel.writestr(dist + "/RECORD", record)
    return name
"""


def make_sdist(folder, secret):
    """built-1.0.tar.gz, whose in-tree build backend writes into the package the uid it ran as
    and whether it could read secret."""
    import io
    import tarfile

    files = {
        "pyproject.toml": b'[build-system]\nrequires = []\nbuild-backend = "backend"\nbackend-path = ["."]\n',
        "PKG-INFO": b"Metadata-Version: 2.1\nName: built\nVersion: 1.0\n",
        "backend.py": BACKEND.format(secret=str(secret)).encode(),
    }
    with tarfile.open(Path(folder) / "built-1.0.tar.gz", "w:gz") as archive:
        for name, data in files.items():
            info = tarfile.TarInfo(f"built-1.0/{name}")
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))


@pytest.mark.django_db(transaction=True)
@pytest.mark.skipif(not (ROOT and shutil.which("bwrap")), reason="needs a root runner with bubblewrap")
def test_a_source_build_runs_only_where_allowed_and_then_in_a_sandbox_as_a_uid_of_the_pool(make_runner, settings, tmp_path):
    import subprocess

    from agent.environments import BuildError

    wheels = tmp_path / "sdists"
    wheels.mkdir()
    secret = tmp_path / "root-only"
    secret.write_text("the node's")
    secret.chmod(0o600)
    make_sdist(wheels, secret)
    settings.E31_ENV_FIND_LINKS = str(wheels)
    settings.E31_ENV_NO_INDEX = True
    # Off (the default): wheels only, refused with uv's own words; nothing of the package ran.
    with pytest.raises(BuildError, match="built"):
        make_runner("wheels-only").envs.ensure(["built==1.0"])
    settings.E31_ENV_SOURCE_BUILDS = True
    node = make_runner("source-builds")
    key, built = node.envs.ensure(["built==1.0"])
    assert built and node.envs.resolved(key) == ["built==1.0"]
    probe = subprocess.run(
        [node.envs.python_of(key), "-c", "import built; print(built.UID, built.SECRET)"],
        capture_output=True,
        text=True,
    ).stdout.split()
    assert int(probe[0]) >= settings.E31_JOB_UID_BASE, probe  # never root, never the runner
    assert probe[1] in ("FileNotFoundError", "PermissionError"), probe  # the node's files are not in its sandbox
    # What it made is the node's now, read-only for everyone; no uv cache of its is kept.
    for path in node.envs.path(key).rglob("*"):
        assert path.lstat().st_uid == 0, path
    assert not list((node.env_root / ".building").iterdir())


@pytest.mark.nodb
@pytest.mark.skipif(not ROOT, reason="needs root")
def test_taking_a_folder_back_from_an_untrusted_uid_removes_links_to_files_not_its_own(tmp_path):
    from agent.isolation import take_back

    folder = tmp_path / "work"
    (folder / "sub").mkdir(parents=True)
    made = folder / "sub" / "made"
    made.write_text("x")
    outside = tmp_path / "outside"
    outside.write_text("someone else's")
    os.chmod(outside, 0o4755)
    os.link(outside, folder / "linked")
    os.symlink(outside, folder / "pointer")
    os.link(made, folder / "twin")  # its own file twice (uv links from its cache): both kept
    for path in (folder, folder / "sub", made):
        os.lchown(path, 4242, 4242)
    os.lchown(folder / "pointer", 4242, 4242)
    take_back(folder, 4242)
    assert not (folder / "linked").exists()  # removed: its owner and mode are outside's
    assert outside.stat().st_mode & 0o7777 == 0o4755 and outside.stat().st_uid == 0
    assert (folder / "twin").read_text() == "x"
    assert made.stat().st_uid == 0 and folder.stat().st_uid == 0 and (folder / "pointer").lstat().st_uid == 0


def ready_environment(cache, key, used_at):
    """An environment as a finished build leaves it (what eviction looks at), without building."""
    from agent.environments import COMPLETE, USED

    folder = cache.path(key)
    (folder / "bin").mkdir(parents=True)
    (folder / COMPLETE).write_text("built")
    (folder / USED).touch()
    os.utime(folder / USED, (used_at, used_at))


@pytest.mark.nodb
def test_an_environment_a_job_uses_is_never_evicted_by_another_agent_on_the_node(tmp_path):
    """Under Slurm the node's agents, a process each, share its environments: one building for
    its job must not evict the environment another's job is running in."""
    running_here, building_there = local_cache(tmp_path, tmp_path), local_cache(tmp_path, tmp_path)
    ready_environment(running_here, "old", used_at=1000)
    ready_environment(running_here, "new", used_at=2000)
    running_here.budget = building_there.budget = 1  # every environment is over the budget
    pin = running_here.pin("old")
    building_there.make_room()
    assert running_here.ready("old") and not running_here.ready("new")  # the least recently used, but in use
    pin.close()  # the job is done
    building_there.make_room()
    assert not running_here.ready("old")
    assert running_here.pin("old") is None, "evicted since it was looked up: to be built again"
