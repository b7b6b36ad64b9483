"""The node agent on a node's own Python, installed from an offline wheelhouse (bin/wheelhouse,
then bin/node-install): for Python 3.11 and 3.12, with no network at install time (bubblewrap
unshares it), never carrying torch, keeping the torch of a node Python that is itself a virtual
environment, and a runner started on Python 3.12 that registers, runs a job and bills it.

The interpreters are pyenv's (as on CI); the wheelhouses are downloaded from PyPI once per Python
for the module (pip's cache makes a second run quick)."""

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from decimal import Decimal
from pathlib import Path

import pytest

from tests.system import ROOT, LiveSystem

# Minutes of downloads and installs: run once, in bin/test's lane beside the SQLite pass (see the bench marker).
pytestmark = [pytest.mark.timeout(900), pytest.mark.bench]

PLATFORM = "manylinux_2_28_x86_64"
BWRAP = shutil.which("bwrap")


def pyenv_python(version):
    """pyenv's interpreter of a minor version (its newest patch release), or None."""
    root = os.environ.get("PYENV_ROOT")
    if not root and shutil.which("pyenv"):
        root = subprocess.run(["pyenv", "root"], capture_output=True, text=True).stdout.strip()
    found = sorted(Path(root or Path.home() / ".pyenv", "versions").glob(f"{version}.*/bin/python{version}"))
    return str(found[-1]) if found else None


def needs(version):
    python = pyenv_python(version)
    if python is None:
        pytest.skip(f"pyenv has no Python {version}")
    if BWRAP is None:
        pytest.skip("bubblewrap (bwrap) is missing: cannot prove the install needs no network")
    return python


def run(*args, offline=False, check=True, timeout=600):
    """A command from the checkout; offline: in a network namespace of its own (no network at all)."""
    command = [BWRAP, "--unshare-net", "--dev-bind", "/", "/", "--", *map(str, args)] if offline else list(map(str, args))
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if check:
        assert done.returncode == 0, f"{' '.join(command)} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def wheelhouse(folder, version, have=None):
    extra = ["--have", have] if have else []
    run(sys.executable, "bin/wheelhouse", "--python", version, "--platform", PLATFORM, *extra, folder)
    return json.loads((folder / "wheelhouse.json").read_text())


def node_install(folder, python, venv, offline=True, check=True):
    """bin/node-install run by the node's own Python, as an operator on the node would. Offline,
    pip must not so much as try an index: without --no-index it still succeeds here, from
    --find-links, but only after retrying PyPI for every package (minutes of warnings)."""
    done = run(python, "bin/node-install", folder, "--python", python, "--venv", venv, offline=offline, check=check)
    if check:
        assert "Retrying" not in done.stderr and "/simple/" not in done.stderr, done.stderr[-2000:]
    return done


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """installed(version): (wheelhouse folder, venv) made once per Python for this module: the
    agent's wheelhouse for pyenv's Python of that version, installed into a fresh venv offline."""
    made = {}

    def get(version, install=True):
        python = needs(version)
        if version not in made:
            folder = tmp_path_factory.mktemp(f"wheelhouse-{version}")
            made[version] = {"dir": folder, "python": python, "venv": None}
            wheelhouse(folder, version)
        entry = made[version]
        if install and entry["venv"] is None:
            venv = tmp_path_factory.mktemp(f"venv-{version}") / "venv"
            entry["install"] = node_install(entry["dir"], python, venv)
            entry["venv"] = venv
        return entry

    return get


@pytest.mark.nodb
@pytest.mark.parametrize("version", ["3.11", "3.12"])
def test_a_wheelhouse_installs_the_agent_offline_on_the_nodes_python(installed, version):
    entry = installed(version)
    folder, venv = entry["dir"], entry["venv"]
    manifest = json.loads((folder / "wheelhouse.json").read_text())
    assert manifest["python"] == version and manifest["platform"] == PLATFORM and manifest["left_out"] == []
    # Every wheel listed, with its file's own digest; nothing else in the folder; never torch.
    wheels = {p.name for p in folder.glob("*.whl")}
    assert set(manifest["wheels"]) == wheels and any(name.startswith("e31_network-") for name in wheels)
    for name, digest in manifest["wheels"].items():
        assert hashlib.sha256((folder / name).read_bytes()).hexdigest() == digest, name
    assert not [name for name in wheels if re.match(r"(torch|triton|nvidia_(?!ml_py))", name)]
    own = f"cp{version.replace('.', '')}"
    for name in wheels:  # built for this Python (or any): name-version-python-abi-platform.whl
        python, abi = name.split("-")[-3:-1]
        assert abi in ("none", "abi3", own) and (abi != own or python == own), name

    # The install ran with no network at all (bwrap --unshare-net): it used the folder alone.
    assert f"node Python {version}" in entry["install"].stdout
    python = venv / "bin" / "python"
    # torch is the node's or none: the install never brings it.
    where = "import importlib.util as u; spec = u.find_spec('torch'); print(spec and spec.origin)"
    assert run(python, "-c", where).stdout == run(entry["python"], "-c", where).stdout
    assert run(python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])").stdout.strip() == version
    assert run(python, "-c", "import django, e31; print(e31.__file__)").returncode == 0
    help_text = run(python, "manage.py", "runner", "--help")
    assert "usage" in help_text.stdout and "--devices" in help_text.stdout


@pytest.mark.nodb
def test_a_wheelhouse_for_another_python_is_refused_naming_both(installed, tmp_path):
    entry = installed("3.12", install=False)
    manifest = json.loads((entry["dir"] / "wheelhouse.json").read_text())
    other = tmp_path / "other"
    other.mkdir()
    (other / "wheelhouse.json").write_text(json.dumps({**manifest, "python": "3.11"}))
    done = node_install(other, entry["python"], tmp_path / "venv", check=False)
    assert done.returncode != 0
    assert "made for Python 3.11" in done.stderr and "is 3.12" in done.stderr and "bin/wheelhouse --python 3.12" in done.stderr
    assert not (tmp_path / "venv").exists()


@pytest.mark.nodb
def test_a_damaged_or_added_wheel_is_refused_before_anything_is_installed(installed, tmp_path):
    entry = installed("3.12", install=False)
    manifest = json.loads((entry["dir"] / "wheelhouse.json").read_text())
    (own,) = [name for name in manifest["wheels"] if name.startswith("e31_network-")]
    folder = tmp_path / "wheelhouse"
    folder.mkdir()
    wheel = bytearray((entry["dir"] / own).read_bytes())
    wheel[len(wheel) // 2] ^= 0xFF  # one flipped byte, as a broken copy to the node would leave
    (folder / own).write_bytes(wheel)
    (folder / "wheelhouse.json").write_text(json.dumps({**manifest, "wheels": {own: manifest["wheels"][own]}}))
    done = node_install(folder, entry["python"], tmp_path / "venv", check=False)
    assert done.returncode != 0 and f"{own} is not the wheel bin/wheelhouse fetched" in done.stderr
    assert not (tmp_path / "venv").exists()

    (folder / own).write_bytes((entry["dir"] / own).read_bytes())
    (folder / "extra-1.0-py3-none-any.whl").write_bytes(b"not listed")
    done = node_install(folder, entry["python"], tmp_path / "venv", check=False)
    assert done.returncode != 0 and "not listed: ['extra-1.0-py3-none-any.whl']" in done.stderr
    assert not (tmp_path / "venv").exists()


@pytest.mark.nodb
def test_node_install_keeps_a_folder_it_did_not_make(installed, tmp_path):
    entry = installed("3.12", install=False)
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "keep.txt").write_text("mine")
    done = node_install(entry["dir"], entry["python"], theirs, check=False)
    assert done.returncode != 0 and "was not made by bin/node-install" in done.stderr
    assert [p.name for p in theirs.iterdir()] == ["keep.txt"]


@pytest.mark.nodb
def test_wheelhouse_refuses_an_unsupported_python(tmp_path):
    done = run(sys.executable, "bin/wheelhouse", "--python", "3.10", "--platform", PLATFORM, tmp_path / "wh", check=False)
    assert done.returncode != 0 and "--python 3.10" in done.stderr and "3.11, 3.12 or 3.13" in done.stderr
    assert not (tmp_path / "wh").exists()


@pytest.mark.nodb
def test_a_node_python_in_a_venv_keeps_its_own_packages_and_torch(tmp_path):
    """The node's Python is itself a virtual environment (as a GPU image's /opt/.../.venv is):
    its packages, torch above all, are what the agent's venv sees. This checkout's .venv plays
    the node (torch 2.13 CPU); the wheelhouse is made --have its pip freeze, with sqlparse as a
    bare name, so it holds our own wheel and nothing the node has."""
    needs("3.11")
    node = ROOT / ".venv" / "bin" / "python"
    if not node.exists() or run(node, "-c", "import sys; print(sys.version_info[:2] == (3, 11))").stdout.strip() != "True":
        pytest.skip("this checkout's .venv is not a Python 3.11 virtual environment")
    freeze = run(node, "-m", "pip", "freeze", "--exclude-editable").stdout
    assert re.search(r"(?im)^sqlparse==", freeze) and re.search(r"(?im)^torch==", freeze)
    have = tmp_path / "have.txt"
    have.write_text(re.sub(r"(?im)^sqlparse==\S+$", "sqlparse", freeze))
    folder = tmp_path / "wh"
    manifest = wheelhouse(folder, "3.11", have=have)
    assert {"sqlparse", "django", "numpy"} <= set(manifest["left_out"])
    assert "torch" not in manifest["left_out"]  # never resolved: the agent does not need it
    assert [name.split("-")[0] for name in manifest["wheels"]] == ["e31_network"]

    venv = tmp_path / "venv"
    done = node_install(folder, node, venv)
    assert "torch 2.13" in done.stdout and "kept as it is" in done.stdout
    where = "import sqlparse, torch; print(torch.__file__); print(torch.__version__); print(sqlparse.__file__)"
    assert run(venv / "bin" / "python", "-c", where).stdout == run(node, "-c", where).stdout
    assert str(ROOT / ".venv") in run(venv / "bin" / "python", "-c", "import torch; print(torch.__file__)").stdout
    assert "usage" in run(venv / "bin" / "python", "manage.py", "runner", "--help").stdout


JOB = """
import os, sys, time
print("python", "%d.%d" % sys.version_info[:2], sys.version.split()[0], flush=True)
with open(os.path.join(os.environ["E31_OUTPUT_DIR"], "version.txt"), "w") as out:
    out.write(sys.version)
time.sleep(2)  # held for whole seconds: a bill above nothing
"""

RECORDS = """
import json
from scheduler.models import Allocation, Node
node = Node.objects.get(name="py312-node")
print(json.dumps({{
    "node": dict(devices=node.devices, device_type=node.device_type, stopped=node.stopped_at is not None),
    "allocations": [dict(node=a.node.name, started=a.started_at is not None, ended=a.ended_at is not None,
                         seconds=(a.ended_at - a.started_at).total_seconds() if a.ended_at else None)
                    for a in Allocation.objects.filter(job_id="{job}")],
}}))
"""


@pytest.mark.e2e
def test_a_runner_on_python_312_registers_runs_a_job_and_bills_it(installed, tmp_path):
    """The web server and the scheduler run on this checkout's Python; the runner on the 3.12
    venv made offline above, against the same database (the system's SQLite file)."""
    venv = installed("3.12")["venv"]
    script = tmp_path / "train.py"
    script.write_text(JOB)
    data = tmp_path / "points.csv"
    data.write_text("x\n1\n")
    system = LiveSystem(devices=1)
    try:
        system.start(runner=False)
        system.spawn("runner", [str(venv / "bin" / "python"), "manage.py", "runner", "--devices", "1", "--device-type", "cpu", "--name", "py312-node"])
        job = system.submit({"name": "on-3.12", "gpus": 1, "span_hours": 0.1}, script, [data])
        done = system.wait_for_state(job["id"], timeout=180)
        assert done["state"] == "succeeded", f"{done}\n{system.logs()}"

        lines = system.log_lines(job["id"])
        assert any(line.startswith("python 3.12 ") for line in lines), lines
        artifacts = {a["name"]: a for a in system.api("GET", f"/api/jobs/{job['id']}/artifacts/").json()}
        assert "version.txt" in artifacts
        records = json.loads(system.manage("shell", "-c", RECORDS.format(job=job["id"])).strip().splitlines()[-1])
        assert records["node"] == {"devices": 1, "device_type": "cpu", "stopped": False}
        (allocation,) = records["allocations"]
        assert allocation["node"] == "py312-node" and allocation["started"] and allocation["ended"]
        assert done["allocation"]["ended_at"] is not None and done["held_seconds"] >= 2
        assert abs(done["held_seconds"] - allocation["seconds"]) <= 1
        (usage,) = [r for r in system.api("GET", "/api/usage/").json()["records"] if r["job_id"] == job["id"]]
        assert usage["held_seconds"] == done["held_seconds"] and Decimal(usage["amount"]) > 0
    finally:
        system.stop()
