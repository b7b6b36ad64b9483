"""The e31 command-line client: unit tests against fake servers (no database), then the real
command against a whole system (web server, scheduler, runner) as processes.

Over 500 lines: one or more cases per command, then the whole system."""

import hashlib
import io
import json
import os
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from e31.cli import client as client_module
from e31.cli import commands
from e31.cli.client import Client
from e31.cli.errors import CliError, code_for_status
from e31.cli.follow import Follower, Printer
from e31.cli.spec import check_exist, local_refs

ROOT = Path(__file__).resolve().parent.parent
JOB_ID = "0f5c2b4e-9a1d-4c3b-8e7f-123456789abc"

SPEC = """\
name: cli-test
kind: train
work:
  code: src/train.py
  entrypoint: train.py
data:
  train: digits@2
  train_files: [data/, extra.csv]
  heldout_files: held.csv
  base_model:
    - weights/model.safetensors
request: {gpus: 1, span_hours: 1}
"""


@pytest.fixture
def fake_server(monkeypatch, tmp_path):
    """Every Client talks to handler(request) -> httpx.Response; E31_* point at a fake server."""
    routes = {}

    def handle(request):
        for (method, path), answer in routes.items():
            if request.method == method and request.url.path == path:
                return answer(request) if callable(answer) else answer
        return httpx.Response(404, json={"detail": "Not found."})

    monkeypatch.setattr(client_module, "DEFAULT_TRANSPORT", httpx.MockTransport(handle))
    monkeypatch.setenv("E31_SERVER", "http://e31.test")
    monkeypatch.setenv("E31_TOKEN", "secret-token")
    monkeypatch.setenv("E31_CONFIG_DIR", str(tmp_path / "config"))
    return routes


def make_tree(folder):
    (folder / "src").mkdir(parents=True)
    (folder / "src" / "train.py").write_text("print('hi')\n")
    (folder / "data" / "sub").mkdir(parents=True)
    (folder / "data" / "a.csv").write_text("x\n1\n")
    (folder / "data" / "sub" / "b.csv").write_text("x\n2\n")
    (folder / "extra.csv").write_text("x\n3\n")
    (folder / "held.csv").write_text("x\n4\n")
    (folder / "weights").mkdir()
    (folder / "weights" / "model.safetensors").write_bytes(b"\0" * 8)


# Unit tests ---------------------------------------------------------------------------------


@pytest.mark.nodb
def test_spec_names_local_files_with_their_lines(tmp_path):
    make_tree(tmp_path)
    refs = local_refs(SPEC, "job.yaml", tmp_path)
    assert [(r.field, r.text, r.line) for r in refs] == [
        ("code", "src/train.py", 4),
        ("data", "data/", 8),
        ("data", "extra.csv", 8),
        ("heldout", "held.csv", 9),
        ("base_model", "weights/model.safetensors", 11),
    ]
    assert refs[0].path == tmp_path / "src" / "train.py"
    check_exist(refs, "job.yaml")  # all there

    (tmp_path / "held.csv").unlink()
    with pytest.raises(CliError) as refused:
        check_exist(local_refs(SPEC, "job.yaml", tmp_path), "job.yaml")
    assert refused.value.message == "job.yaml line 9: held.csv does not exist"
    assert refused.value.code == 2

    # A JSON spec is read the same way, with its lines.
    as_json = json.dumps({"name": "j", "work": {"code": "nope.py"}}, indent=2)
    assert [(r.text, r.line) for r in local_refs(as_json, "job.json", tmp_path)] == [("nope.py", 4)]


@pytest.mark.nodb
def test_submit_refuses_a_missing_file_before_uploading_anything(fake_server, tmp_path, capsys):
    calls = []
    fake_server[("POST", "/api/jobs/")] = lambda request: calls.append(request) or httpx.Response(201, json={"id": JOB_ID})
    make_tree(tmp_path)
    (tmp_path / "data" / "sub" / "b.csv").unlink()
    (tmp_path / "extra.csv").unlink()
    spec = tmp_path / "job.yaml"
    spec.write_text(SPEC)
    assert commands.main(["submit", str(spec)]) == 2
    assert "job.yaml line 8: extra.csv does not exist" in capsys.readouterr().err
    assert calls == []


@pytest.mark.nodb
def test_submit_sends_the_spec_unchanged_and_every_file(fake_server, tmp_path, capsys):
    sent = {}

    def accept(request):
        body = request.read()
        sent["body"] = body
        sent["type"] = request.headers["content-type"]
        return httpx.Response(201, json={"id": JOB_ID, "name": "cli-test", "state": "queued", "url": f"http://e31.test/jobs/{JOB_ID}/"})

    fake_server[("POST", "/api/jobs/")] = accept
    make_tree(tmp_path)
    spec = tmp_path / "job.yaml"
    spec.write_text(SPEC)
    assert commands.main(["submit", str(spec)]) == 0
    assert JOB_ID in capsys.readouterr().out
    from email.parser import BytesParser

    message = BytesParser().parsebytes(b"Content-Type: " + sent["type"].encode() + b"\r\n\r\n" + sent["body"])
    parts = [(p.get_param("name", header="content-disposition"), p.get_filename(), p.get_payload(decode=True)) for p in message.get_payload()]
    assert ("spec", None, SPEC.encode()) in parts
    assert ("spec_name", None, b"job.yaml") in parts
    files = sorted((name, filename) for name, filename, _ in parts if filename)
    assert files == [
        ("base_model", "model.safetensors"),
        ("code", "train.py"),
        ("data", "a.csv"),
        ("data", "extra.csv"),
        ("data", "sub/b.csv"),
        ("heldout", "held.csv"),
    ]


@pytest.mark.nodb
def test_login_keeps_the_token_in_a_file_only_its_owner_reads(fake_server, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("E31_TOKEN")
    seen = {}

    def token(request):
        seen["credentials"] = json.loads(request.read())
        return httpx.Response(200, json={"token": "t0k3n", "username": "alice"})

    def me(request):
        seen["auth"] = request.headers.get("authorization")
        return httpx.Response(200, json={"username": "alice", "team": {"id": "x", "name": "Team A"}})

    fake_server[("POST", "/api/token/")] = token
    fake_server[("GET", "/api/me/")] = me
    monkeypatch.setattr("getpass.getpass", lambda prompt="": "pw")
    assert commands.main(["login", "--username", "alice"]) == 0
    assert seen == {"credentials": {"username": "alice", "password": "pw"}, "auth": "Token t0k3n"}
    path = tmp_path / "config" / "config.json"
    assert json.loads(path.read_text()) == {"server": "http://e31.test", "token": "t0k3n"}
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert "Team A" in capsys.readouterr().out

    # The environment overrides the file; without it the file's token is used.
    from e31.cli import config

    assert config.load()["token"] == "t0k3n"
    monkeypatch.setenv("E31_TOKEN", "from-env")
    assert config.load()["token"] == "from-env"


@pytest.mark.nodb
def test_exit_codes(fake_server, capsys):
    assert [code_for_status(s) for s in (400, 401, 403, 404, 409, 500, 503)] == [2, 3, 3, 4, 1, 5, 5]
    path = f"/api/jobs/{JOB_ID}/"
    answers = {
        400: ({"detail": "The job was refused: ...", "errors": {"gpus": ["job.yaml line 9: request.gpus: Enter a whole number."]}}, 2),
        401: ({"detail": "Invalid token."}, 3),
        403: ({"detail": "You are not on a team."}, 3),
        404: ({"detail": "Not found."}, 4),
        500: (None, 5),
    }
    for status, (body, code) in answers.items():
        fake_server[("GET", path)] = httpx.Response(status, json=body) if body else httpx.Response(status, text="boom")
        assert commands.main(["status", JOB_ID]) == code, status
        err = capsys.readouterr().err
        if body:
            assert (body.get("errors", {}).get("gpus", [None])[0] or body["detail"]) in err
    # The 400's summary is not printed twice.
    fake_server[("GET", path)] = httpx.Response(400, json=answers[400][0])
    commands.main(["status", JOB_ID])
    assert "The job was refused" not in capsys.readouterr().err

    def unreachable(request):
        raise httpx.ConnectError("connection refused")

    fake_server[("GET", path)] = unreachable
    assert commands.main(["status", JOB_ID]) == 5
    assert commands.main(["status", "--bogus"]) == 2  # usage
    fake_server[("POST", f"/api/jobs/{JOB_ID}/cancel/")] = httpx.Response(409, json={"detail": "The job has already ended (succeeded)."})
    assert commands.main(["cancel", JOB_ID]) == 1
    assert "already ended" in capsys.readouterr().err


@pytest.mark.nodb
def test_a_job_prefix_must_match_exactly_one_job(fake_server, capsys):
    other = "0f5c9999-9a1d-4c3b-8e7f-123456789abc"
    listing = {"count": 2, "next": None, "previous": None, "results": [{"id": JOB_ID, "name": "a"}, {"id": other, "name": "b"}]}

    def jobs(request):
        prefix = request.url.params.get("id_prefix", "")
        results = [j for j in listing["results"] if j["id"].startswith(prefix)]
        return httpx.Response(200, json={**listing, "count": len(results), "results": results})

    fake_server[("GET", "/api/jobs/")] = jobs
    fake_server[("GET", f"/api/jobs/{JOB_ID}/")] = httpx.Response(200, json={"id": JOB_ID, "name": "a", "state": "running"})
    assert commands.main(["status", "0f5c2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["id"] == JOB_ID
    assert commands.main(["status", "0f5c"]) == 2
    assert "2 jobs" in capsys.readouterr().err
    assert commands.main(["status", "abc"]) == 4


@pytest.mark.nodb
def test_download_refuses_names_that_escape_the_folder(tmp_path):
    assert commands.safe_target(tmp_path, "sub/model.pt") == (tmp_path / "sub" / "model.pt").resolve()
    for name in ("../evil", "/etc/passwd", "a/../../b", "a\\..\\b", ""):
        with pytest.raises(CliError):
            commands.safe_target(tmp_path, name)


@pytest.mark.nodb
def test_download_checks_sha256_and_skips_files_already_there(fake_server, tmp_path):
    content = b"weights" * 100
    digest = hashlib.sha256(content).hexdigest()
    got = []
    fake_server[("GET", f"/api/jobs/{JOB_ID}/")] = httpx.Response(200, json={"id": JOB_ID, "name": "run"})
    fake_server[("GET", f"/api/jobs/{JOB_ID}/artifacts/")] = httpx.Response(
        200, json=[{"name": "out/model.pt", "size": len(content), "sha256": digest, "url": "ignored"}]
    )
    fake_server[("GET", f"/api/jobs/{JOB_ID}/artifacts/out/model.pt")] = lambda r: got.append(1) or httpx.Response(200, content=content)
    assert commands.main(["download", JOB_ID, "--to", str(tmp_path / "d")]) == 0
    assert (tmp_path / "d" / "out" / "model.pt").read_bytes() == content
    assert commands.main(["download", JOB_ID, "--to", str(tmp_path / "d")]) == 0
    assert got == [1]  # the second run found it there
    fake_server[("GET", f"/api/jobs/{JOB_ID}/artifacts/out/model.pt")] = httpx.Response(200, content=b"corrupt")
    assert commands.main(["download", JOB_ID, "--to", str(tmp_path / "e")]) == 5
    assert not (tmp_path / "e" / "out" / "model.pt").exists()


def serve_events(connections):
    """A local websocket server: the n-th connection sends connections[n](path) then closes
    (the connection dropped). Returns (server, port, paths seen)."""
    from websockets.sync.server import serve

    paths = []

    def handler(websocket):
        index = len(paths)
        paths.append((websocket.request.path, websocket.request.headers.get("Authorization")))
        for message in connections[min(index, len(connections) - 1)]:
            websocket.send(json.dumps({"type": "events", "events": message}))
        time.sleep(0.05)
        websocket.socket.close()  # dropped, not closed politely

    server = serve(handler, "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, server.socket.getsockname()[1], paths


def log(seq, text, rank=None):
    return {"seq": seq, "kind": "log", "at": "2025-01-01T00:00:00Z", "stream": "stdout", "text": text, "rank": rank}


@pytest.mark.nodb
def test_following_logs_reconnects_after_a_drop_without_duplicates(fake_server):
    connections = [
        [[log(1, "one"), log(2, "two")], [{"seq": 3, "kind": "meter", "at": "x", "seconds": 5}]],
        # The second connection repeats what it was not asked for, and goes on to the end.
        [[log(2, "two"), log(3, "three?"), log(4, "four", rank=1)], [{"seq": 5, "kind": "state", "at": "x", "state": "failed", "from": "running"}]],
    ]
    server, port, paths = serve_events(connections)
    fake_server[("GET", f"/api/jobs/{JOB_ID}/")] = httpx.Response(200, json={"id": JOB_ID, "state": "running"})
    out, err = io.StringIO(), io.StringIO()
    sleeps = []
    try:
        with Client(f"http://127.0.0.1:{port}", "secret-token") as client:
            follower = Follower(client, JOB_ID, Printer(out=out, err=err), sleep=sleeps.append)
            assert follower.run() == "failed"
    finally:
        server.shutdown()
    assert out.getvalue().splitlines() == ["one", "two", "[rank1] four"]
    assert [p for p, _ in paths] == [f"/ws/jobs/{JOB_ID}/?after=0", f"/ws/jobs/{JOB_ID}/?after=3"]
    assert {a for _, a in paths} == {"Token secret-token"}
    assert follower.reconnects == 1 and sleeps == [0.5]
    assert "-- failed" in err.getvalue()


@pytest.mark.nodb
def test_following_a_job_that_ended_while_disconnected_prints_the_rest_over_http(fake_server):
    server, port, _paths = serve_events([[[log(1, "one")]]])
    fake_server[("GET", f"/api/jobs/{JOB_ID}/")] = httpx.Response(200, json={"id": JOB_ID, "state": "succeeded"})
    fake_server[("GET", f"/api/jobs/{JOB_ID}/logs/")] = lambda request: httpx.Response(
        200,
        json={
            "lines": [log(2, "two")] if request.url.params["after"] == "1" else [],
            "next_after": 2,
            "more": False,
            "state": "succeeded",
            "done": True,
        },
    )
    out = io.StringIO()
    try:
        with Client(f"http://127.0.0.1:{port}", "secret-token") as client:
            assert Follower(client, JOB_ID, Printer(out=out, err=io.StringIO()), sleep=lambda s: None).run() == "succeeded"
    finally:
        server.shutdown()
    assert out.getvalue().splitlines() == ["one", "two"]


@pytest.mark.nodb
def test_following_survives_the_server_being_briefly_unreachable(fake_server):
    server, port, _paths = serve_events([[[log(1, "one")]], [[log(2, "two"), {"seq": 3, "kind": "state", "at": "x", "state": "succeeded"}]]])
    answers = iter([httpx.ConnectError("down"), httpx.Response(200, json={"id": JOB_ID, "state": "running"})])

    def job(request):
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    fake_server[("GET", f"/api/jobs/{JOB_ID}/")] = job
    out = io.StringIO()
    try:
        with Client(f"http://127.0.0.1:{port}", "secret-token") as client:
            assert Follower(client, JOB_ID, Printer(out=out, err=io.StringIO()), sleep=lambda s: None).run() == "succeeded"
    finally:
        server.shutdown()
    assert out.getvalue().splitlines() == ["one", "two"]


@pytest.mark.nodb
def test_retrain_sends_overrides_and_new_data(fake_server, tmp_path, capsys):
    (tmp_path / "more" / "sub").mkdir(parents=True)
    (tmp_path / "more" / "a.csv").write_text("1\n")
    (tmp_path / "more" / "sub" / "b.csv").write_text("2\n")
    sent = {}

    def retrain(request):
        from email.parser import BytesParser

        message = BytesParser().parsebytes(b"Content-Type: " + request.headers["content-type"].encode() + b"\r\n\r\n" + request.read())
        sent["parts"] = [(p.get_param("name", header="content-disposition"), p.get_filename(), p.get_payload(decode=True)) for p in message.get_payload()]
        return httpx.Response(201, json={"id": JOB_ID, "name": "again", "state": "queued"})

    fake_server[("POST", f"/api/jobs/{JOB_ID}/retrain/")] = retrain
    assert commands.main(["retrain", JOB_ID, "--add-data", str(tmp_path / "more"), "--gpus", "2", "--by", "morning", "--no-preemptible"]) == 0
    spec = next(json.loads(value) for name, _, value in sent["parts"] if name == "spec")
    assert spec == {"gpus": 2, "by": "morning", "preemptible": False}
    assert sorted((name, filename) for name, filename, _ in sent["parts"] if filename) == [("data", "a.csv"), ("data", "sub/b.csv")]


@pytest.mark.nodb
def test_retrain_changes_hyperparameters_config_and_inputs_keeping_the_rest(fake_server, capsys):
    sent = {}
    fake_server[("GET", f"/api/jobs/{JOB_ID}/")] = lambda request: httpx.Response(
        200, json={"id": JOB_ID, "hyperparameters": {"lr": 0.1, "epochs": 3}, "config": {"mode": "train", "depth": 2}}
    )

    def retrain(request):
        sent["spec"] = json.loads(dict(httpx.QueryParams(request.read().decode()))["spec"])
        return httpx.Response(201, json={"id": JOB_ID, "name": "again", "state": "queued"})

    fake_server[("POST", f"/api/jobs/{JOB_ID}/retrain/")] = retrain
    argv = ["retrain", JOB_ID, "--hp", "lr=0.01", "--set", "depth=4", "--set", "note=fast run", "--input", "training=digits@2", "--args=--fast"]
    assert commands.main(argv) == 0
    assert sent["spec"] == {
        "args": "--fast",
        "hyperparameters": {"lr": 0.01, "epochs": 3},
        "config": {"depth": 4, "note": "fast run"},
        "inputs": {"training": "digits@2"},
    }
    assert commands.main(["retrain", JOB_ID, "--hp", "nonsense"]) != 0


@pytest.mark.nodb
@pytest.mark.parametrize("shape", ["list", "paged", "named"])
def test_invoices_in_any_shape_and_their_pdfs(fake_server, tmp_path, capsys, shape):
    invoice = {"id": JOB_ID, "number": "E31-2025-0001", "period": "2025-01", "kind": "invoice", "state": "issued", "total": "12.00", "currency": "EUR"}
    body = {"list": [invoice], "paged": {"count": 1, "next": None, "previous": None, "results": [invoice]}, "named": {"invoices": [invoice]}}[shape]
    fake_server[("GET", "/api/invoices/")] = httpx.Response(200, json=body)
    fake_server[("GET", f"/api/invoices/{JOB_ID}.pdf")] = httpx.Response(200, content=b"%PDF-1.4 fake")
    assert commands.main(["invoices", "--pdf", "--to", str(tmp_path / "pdfs")]) == 0
    assert "E31-2025-0001" in capsys.readouterr().out
    assert (tmp_path / "pdfs" / "E31-2025-0001.pdf").read_bytes() == b"%PDF-1.4 fake"


@pytest.mark.nodb
def test_the_client_imports_without_django_or_torch():
    code = "import sys, e31.cli.commands, e31.cli.datasets, e31.cli.follow; print(sorted(m for m in ('django', 'torch') if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert result.stdout.strip() == "[]"


# End to end: the real command against a whole system --------------------------------------

TRAIN = """\
import os

import torch

torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(64, 4)
y = x @ torch.ones(4, 2)
for step in range(5):
    loss = ((model(x) - y) ** 2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    print(f"step {step} loss {loss.item():.4f}", flush=True)
torch.save(model.state_dict(), os.path.join(os.environ["E31_OUTPUT_DIR"], "model.pt"))
print("saved the weights", flush=True)
"""

JOB_SPEC = """\
# A tiny CPU training run.
name: cli-e2e
kind: train
work:
  code: code/train.py
  entrypoint: train.py
request:
  span_hours: 0.1
  gpus: {gpus}
data:
  train_files: [data/]
"""
CHUNK = 5 * 1024 * 1024  # the smallest chunk the server allows


@pytest.fixture(scope="module")
def live():
    from tests.system import LiveSystem

    with LiveSystem(env={"E31_UPLOAD_CHUNK_BYTES": str(CHUNK)}) as system:
        yield system


@pytest.fixture
def e31(live, tmp_path):
    """Runs the installed `e31` command against the live system."""
    env = {**os.environ, "E31_SERVER": live.url, "E31_TOKEN": live.token, "E31_CONFIG_DIR": str(tmp_path / "config")}
    env.pop("E31_CLI_STOP_AFTER_CHUNKS", None)
    command = [str(Path(sys.executable).with_name("e31"))]
    if not Path(command[0]).exists():
        command = [sys.executable, "-m", "e31.cli"]

    def run(*args, extra_env=None, timeout=180, stdin=None):
        return subprocess.run(
            [*command, *args],
            env={**env, **(extra_env or {})},
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=tmp_path,
            input=stdin,
        )

    return run


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_submit_follow_then_download_the_weights(live, e31, tmp_path):
    import torch

    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "train.py").write_text(TRAIN)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "points.csv").write_text("x,y\n1,2\n")
    (tmp_path / "job.yaml").write_text(JOB_SPEC.format(gpus=1))
    done = e31("submit", "job.yaml", "--follow")
    assert done.returncode == 0, (done.stdout, done.stderr, live.logs())
    lines = done.stdout.splitlines()
    # Every line the job printed, once, in order.
    assert [line.split()[1] for line in lines if line.startswith("step ")] == ["0", "1", "2", "3", "4"]
    last_step = max(i for i, line in enumerate(lines) if line.startswith("step "))
    assert lines.count("saved the weights") == 1 and lines.index("saved the weights") > last_step
    job_id = lines[0].split()[2]
    assert len(job_id) == 36

    listed = e31("status", "--json")
    assert listed.returncode == 0 and job_id in {j["id"] for j in json.loads(listed.stdout)}
    shown = e31("status", job_id[:8], "--json")
    assert shown.returncode == 0 and json.loads(shown.stdout)["state"] == "succeeded"
    again = e31("logs", job_id[:8])
    assert again.returncode == 0 and again.stdout.splitlines() == [line for line in lines if not line.startswith(("Submitted", "http"))]

    fetched = e31("download", job_id[:8], "--to", "out")
    assert fetched.returncode == 0, fetched.stderr
    model = torch.nn.Linear(4, 2)
    model.load_state_dict(torch.load(tmp_path / "out" / "model.pt", weights_only=True))
    assert not torch.equal(model.weight, torch.nn.Linear(4, 2).weight)
    assert "1 already there" in e31("download", job_id, "--to", "out").stdout

    # Retrain it on more data: a new job starting from these weights, with the new file added.
    (tmp_path / "more").mkdir()
    (tmp_path / "more" / "extra.csv").write_text("x,y\n3,4\n")
    retrained = e31("retrain", job_id[:8], "--add-data", "more", "--name", "cli-retrain", "--json")
    assert retrained.returncode == 0, retrained.stderr
    child = json.loads(retrained.stdout)
    assert (child["parent"], child["kind"], child["name"]) == (job_id, "finetune", "cli-retrain")
    assert [m["files"][0]["name"] for m in child["models"]] == ["model.pt"]
    cancelled = e31("cancel", child["id"][:8])
    assert cancelled.returncode == 0, cancelled.stderr


@pytest.mark.e2e
def test_login_with_a_password_keeps_a_token_the_next_command_uses(live, e31, tmp_path):
    from e31web.demo import DEMO_USER

    wrong = e31("login", "--server", live.url, "--username", DEMO_USER[0], "--password-stdin", stdin="nope\n", extra_env={"E31_TOKEN": ""})
    assert wrong.returncode == 3 and "Wrong username or password" in wrong.stderr
    logged = e31(
        "login", "--server", live.url, "--username", DEMO_USER[0], "--password-stdin", stdin=DEMO_USER[1] + "\n", extra_env={"E31_TOKEN": "", "E31_SERVER": ""}
    )
    assert logged.returncode == 0, logged.stderr
    stored = tmp_path / "config" / "config.json"
    assert stat.S_IMODE(stored.stat().st_mode) == 0o600 and json.loads(stored.read_text())["server"] == live.url
    listed = e31("status", "--json", extra_env={"E31_TOKEN": "", "E31_SERVER": ""})
    assert listed.returncode == 0, listed.stderr


@pytest.mark.e2e
def test_a_bad_spec_is_refused_naming_its_line(live, e31, tmp_path):
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "train.py").write_text(TRAIN)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "points.csv").write_text("x,y\n1,2\n")
    (tmp_path / "job.yaml").write_text(JOB_SPEC.format(gpus="zero"))
    refused = e31("submit", "job.yaml")
    assert refused.returncode == 2, (refused.stdout, refused.stderr)
    assert "job.yaml line 9" in refused.stderr
    estimate = e31("estimate", "job.yaml")
    assert estimate.returncode == 2 and "job.yaml line 9" in estimate.stderr
    (tmp_path / "job.yaml").write_text(JOB_SPEC.format(gpus=1))
    estimate = e31("estimate", "job.yaml", "--json")
    assert estimate.returncode == 0, estimate.stderr
    assert json.loads(estimate.stdout)["worst_case"]


@pytest.mark.e2e
def test_an_interrupted_dataset_upload_resumes(live, e31, tmp_path):
    folder = tmp_path / "shards"
    folder.mkdir()
    (folder / "big.bin").write_bytes(os.urandom(2 * CHUNK + 12345))
    (folder / "notes").mkdir()
    (folder / "notes" / "readme.txt").write_text("three chunks and a note\n")
    local = {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.rglob("*") if p.is_file()}
    total = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())

    stopped = e31("datasets", "upload", str(folder), "--name", "shards", extra_env={"E31_CLI_STOP_AFTER_CHUNKS": "1"})
    assert stopped.returncode == 130, (stopped.stdout, stopped.stderr)
    listing = live.api("GET", "/api/datasets/").json()
    dataset = next(d for d in (listing["results"] if isinstance(listing, dict) else listing) if d["name"] == "shards")
    version = live.api("POST", f"/api/datasets/{dataset['id']}/versions/").json()
    assert [(u["path"], u["received"]) for u in version["uploads"]] == [("big.bin", CHUNK)]

    resumed = e31("datasets", "upload", str(folder), "--name", "shards", "--json")
    assert resumed.returncode == 0, resumed.stderr
    result = json.loads(resumed.stdout)
    assert result["resumed_bytes"] == CHUNK and result["sent_bytes"] == total - CHUNK
    assert result["state"] == "ready" and result["ref"] == "shards@1"
    assert {f["path"]: f["sha256"] for f in result["manifest"]} == local

    listed = e31("datasets", "list", "--json")
    assert {d["name"]: d["latest_version"] for d in json.loads(listed.stdout)}["shards"] == 1
    unchanged = e31("datasets", "upload", str(folder), "--name", "shards", "--json")
    assert json.loads(unchanged.stdout)["up_to_date"] is True
