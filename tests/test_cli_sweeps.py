"""`e31 sweep ...` against the real API: the client's requests go through an httpx transport into
Django's test client (the whole API, its checks and the database; no server process)."""

from decimal import Decimal

import httpx
import pytest
from django.test import Client as DjangoClient
from rest_framework.authtoken.models import Token

from e31.cli import client as client_module
from e31.cli import commands
from e31.cli.errors import USAGE
from jobs.models import Job
from sweeps import services as sweeps
from sweeps.models import Sweep, Trial
from tests.conftest import make_job

pytestmark = pytest.mark.django_db

SWEEP = """\
sweep:
  name: lr-width
  template: {template}
  space:
    lr: {{type: float, low: 0.001, high: 0.1, log: true}}
    width: {{type: choice, choices: [32, 64]}}
  method: random
  objective: loss
  max_trials: 4
  parallel: 2
  ceiling: 1.00
"""


@pytest.fixture
def api(monkeypatch, tmp_path, alice):
    """The CLI as alice, its every request answered by the real API in this process."""
    django = DjangoClient()

    def handle(request):
        answer = django.generic(
            request.method,
            request.url.raw_path.decode(),
            data=request.content,
            content_type=request.headers.get("content-type", ""),
            HTTP_AUTHORIZATION=request.headers.get("authorization", ""),
        )
        return httpx.Response(answer.status_code, content=answer.content, headers={"content-type": answer.get("Content-Type", "")})

    monkeypatch.setattr(client_module, "DEFAULT_TRANSPORT", httpx.MockTransport(handle))
    monkeypatch.setenv("E31_SERVER", "http://e31.test")
    monkeypatch.setenv("E31_TOKEN", Token.objects.create(user=alice).key)
    monkeypatch.setenv("E31_CONFIG_DIR", str(tmp_path / "config"))
    return commands.main


@pytest.fixture
def template(alice, rate):
    return make_job(alice, script=b"print('trial')\n", span_hours=Decimal("0.1"), hyperparameters={"lr": 0.5, "width": 64})


def test_a_sweep_file_starts_a_sweep_and_its_trials_show_with_the_best(api, template, tmp_path, capsys, alice):
    spec = tmp_path / "sweep.yaml"
    spec.write_text(SWEEP.format(template=str(template.pk)[:8]))  # the start of the id is enough
    assert api(["sweep", "start", str(spec)]) == 0
    assert "Started sweep lr-width" in capsys.readouterr().out
    sweep = Sweep.objects.get()
    assert (sweep.template_id, sweep.method, sweep.max_trials, sweep.ceiling_amount) == (template.pk, "random", 4, Decimal("1.00"))
    assert sweep.space["width"] == {"type": "choice", "choices": [32, 64]}

    first, _ = sweeps.advance(sweep)
    Trial.objects.filter(pk=first.pk).update(state=Trial.COMPLETE, value=0.125)
    assert api(["sweep", "show", str(sweep.pk)[:6]]) == 0
    shown = capsys.readouterr().out
    assert "lr-width" in shown and "trial 1: 0.125" in shown and "complete" in shown and "of 1.00" in shown
    assert api(["sweep", "list"]) == 0
    listed = capsys.readouterr().out
    assert str(sweep.pk)[:8] in listed and "0.125" in listed

    # The best configuration again, with a change: a job of its own, the best trial's its parent.
    assert api(["sweep", "rerun", str(sweep.pk)[:8], "--hp", "width=128", "--name", "longer"]) == 0
    assert "Queued longer" in capsys.readouterr().out
    again = Job.objects.get(name="longer")
    assert again.hyperparameters == {**first.job.hyperparameters, "width": 128} and again.parent_id == first.job_id


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("name: x\n", "no `sweep:` section"),
        ("sweep: {name: x, template: abc, space: {}, method: grid, objective: loss, max_trials: 2, ceiling: 1, budget: 3}\n", "sweep has no field budget"),
        ("sweep: {name: x, space: {}, method: grid}\n", "sweep needs template, objective, max_trials, ceiling"),
        ("sweep: [\n", "Cannot read"),
    ],
)
def test_a_sweep_file_that_cannot_be_one_is_refused_saying_why(api, tmp_path, capsys, text, says):
    spec = tmp_path / "sweep.yaml"
    spec.write_text(text)
    assert api(["sweep", "start", str(spec)]) == USAGE
    assert says in capsys.readouterr().err
    assert not Sweep.objects.exists()


def test_what_the_api_refuses_is_said_and_nothing_is_started(api, template, tmp_path, capsys):
    spec = tmp_path / "sweep.yaml"
    spec.write_text(SWEEP.format(template=template.pk).replace("low: 0.001", "low: 1"))
    assert api(["sweep", "start", str(spec)]) != 0
    assert "low must be below high" in capsys.readouterr().err
    spec.write_text(SWEEP.format(template=template.pk))
    assert api(["sweep", "start", str(spec)]) == 0
    sweep = Sweep.objects.get()
    capsys.readouterr()
    assert api(["sweep", "rerun", str(sweep.pk)]) != 0  # no trial has completed
    assert "no trial has completed" in capsys.readouterr().err
