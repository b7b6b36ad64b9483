import hashlib
import importlib.util
import os
import signal
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest
from django.contrib.auth import authenticate

from billing.models import Rate
from catalog.models import Dataset
from core.storage import get_storage
from e31web import demo
from tests.system import ROOT, free_port


def test_the_demo_has_a_team_a_user_the_digits_and_a_rate(db):
    made = demo.seed()
    user = authenticate(username=demo.DEMO_USER[0], password=demo.DEMO_USER[1])
    assert user is not None and user.membership.team == made["team"]
    assert authenticate(username=demo.OPERATOR[0], password=demo.OPERATOR[1]).is_staff
    digits = Dataset.objects.get(team=made["team"], name="digits")
    [item] = digits.latest_version().files.all()
    content = get_storage().path(item.key).read_bytes()
    assert item.size == len(content) and item.sha256 == hashlib.sha256(content).hexdigest()
    assert content.count(b"\n") == 1 + 1437  # header + 80% of 1,797 images
    assert Dataset.objects.get(name="digits-heldout").latest_version().files.get().path == "digits-heldout.csv"
    assert Rate.objects.count() == 1


def test_the_demo_can_be_seeded_again(db):
    demo.seed()
    Rate.objects.update(per_gpu_hour=7)  # an operator changed it
    demo.seed()
    assert Dataset.objects.count() == 2
    assert list(Rate.objects.values_list("per_gpu_hour", flat=True)) == [7]


def test_the_example_and_the_demo_split_the_digits_the_same_way():
    spec = importlib.util.spec_from_file_location("digits_train", ROOT / "examples/digits/train.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    (xe, ye), (xh, yh) = example.split_digits()
    (xd, yd), (xdh, ydh) = demo.digits_split()
    assert np.array_equal(ye, yd) and np.array_equal(yh, ydh)
    assert np.allclose(xe * 16, xd) and np.allclose(xh * 16, xdh)


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_one_command_starts_everything_and_ctrl_c_stops_it(tmp_path):
    port = free_port()
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "E31_VAR_DIR": str(tmp_path / "var"), "PYTHONUNBUFFERED": "1"}
    up = subprocess.Popen(
        [sys.executable, "manage.py", "up", "--port", str(port), "--devices", "1"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    output = []
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = up.stdout.readline()
            output.append(line)
            if "log in as demo / demo-e31" in line:
                break
        assert f"E31 Network is running at http://127.0.0.1:{port}/" in "".join(output)
        for _ in range(100):
            try:
                if httpx.get(f"http://127.0.0.1:{port}/accounts/login/").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        children = _children(up.pid)
        assert len(children) >= 3, children  # web, scheduler, runner
        os.killpg(up.pid, signal.SIGINT)  # what Ctrl-C in the terminal does
        assert up.wait(30) == 0
        for pid in children:
            assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)


def _children(pid):
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]
