"""Job environments: the packages a job names, built with uv on its node while it waits.

The wheels are built here, in the test, and served from a local folder: no network is used.
"""

import base64
import hashlib
import shutil
import zipfile
from pathlib import Path

import pytest

from scheduler.environments import Entry, base_pins, environment_key, evictions, torch_problem

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
    return [t for t in job.events.filter(kind="log").order_by("seq").values_list("text", flat=True)]


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
    from scheduler import services
    from scheduler.environments import packages_digest
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
    from scheduler.environments import packages_digest
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

    from scheduler.environments import EnvironmentCache

    wheels = tmp_path / "wheels"
    wheels.mkdir()
    marker = tmp_path / "ran-as-the-runner"
    path = make_wheel(wheels, "sneaky", "1.0", "X = 1\n")
    with zf.ZipFile(path, "a") as wheel:  # RECORD need not list it for uv to install it
        wheel.writestr("sneaky_hook.pth", f"import os; open({str(marker)!r}, 'w').write(str(os.getuid()))\n")
    cache = EnvironmentCache(
        tmp_path / "envs", 10**10, uv=find_uv_bin(), python=sys.executable, base_sites=site.getsitepackages(),
        index=["--find-links", str(wheels), "--no-index"],
    )
    key, built = cache.ensure(["sneaky==1.0"])
    assert built and cache.resolved(key) == ["sneaky==1.0"]
    assert not marker.exists(), "a package's code ran during the build"
