"""A sweep of the classifier recipe on the digits data (issue 23): a model-based search with
pruning on, cut short by its money ceiling. No trial starts that could pass the ceiling, what is
billed stays under it, trials that fall behind are stopped, and the best trial's weights download
and load. (Random search over the same recipe runs in bench/sweep.py --quick.)"""

import json
from datetime import timedelta
from decimal import Decimal

import pytest
import safetensors.torch
import torch
from django.utils import timezone

from billing.models import Rate
from catalog import datasets
from e31web.demo import digits_csv, digits_split
from jobs.models import Job, Upload
from sweeps import services as sweeps
from sweeps.models import Sweep, Trial
from tests.conftest import make_job
from tests.test_sweeps import run_sweep

# A sweep of real recipe runs (a minute or so): once, in bin/test's lane beside the SQLite pass.
pytestmark = [pytest.mark.bench, pytest.mark.runs_jobs, pytest.mark.timeout(400), pytest.mark.django_db(transaction=True)]

SPACE = {
    "lr": {"type": "float", "low": 1e-4, "high": 0.5, "log": True},
    "hidden": {"type": "choice", "choices": [8, 32, 128]},
}


def test_a_classifier_sweep_stops_at_its_ceiling_prunes_and_returns_the_best_weights(make_runner, alice, team_a, client):
    # A dear rate, so that a trial of a few seconds costs a few units: 1.00 a device-second.
    Rate.objects.create(gpu_type="", per_gpu_hour=Decimal("3600.00"), effective_from=timezone.now() - timedelta(hours=1))
    (x_train, y_train), (x_held, y_held) = digits_split()
    train = datasets.create_dataset(team_a, "digits", {"digits-train.csv": digits_csv(x_train, y_train)}).latest_version()
    heldout = datasets.create_dataset(team_a, "digits-heldout", {"digits-heldout.csv": digits_csv(x_held, y_held)}).latest_version()
    template = make_job(alice, name="digits", ceiling_amount=Decimal("60.00"), train_version=train, heldout_version=heldout)
    config = {"max_steps": 120, "eval_every": 20, "batch_size": 64, "seed": 0}
    Job.objects.filter(pk=template.pk).update(entrypoint="recipe:classifier", config=config)
    template.uploads.filter(role=Upload.CODE).delete()
    template.refresh_from_db()
    # Each trial may cost up to 60.00 (its ceiling: a minute held, room for a trial on a busy
    # machine): with 100.00 one is committed at a time, and the sweep ends once what the ended
    # ones spent leaves no room for another (a few trials, however slow the machine).
    sweep = sweeps.create(
        alice.membership.team, alice, name="digits-tpe", template=template, space=SPACE, method="tpe",
        objective="val_loss", direction="min", max_trials=40, parallel=2, ceiling_amount=Decimal("100.00"), seed=3,
    )  # fmt: skip
    sweep = run_sweep(make_runner(devices=2), sweep, timeout=360)
    trials = list(sweep.trials.select_related("job"))
    billed = sum((t.job.held()[1] for t in trials), Decimal(0))
    assert sweep.state == Sweep.CEILING and "would pass the ceiling" in sweep.reason, sweep.reason
    assert 2 < len(trials) < 40, [(t.number, t.state, t.job.state, t.job.reason) for t in trials]
    assert billed <= Decimal("100.00") and Decimal("100.00") - billed < Decimal("60.00")  # ended only when another could not fit
    assert all(t.job.state in ("succeeded", "stopped") for t in trials), [(t.number, t.job.state, t.job.reason) for t in trials]
    assert {t.job.config["hidden"] for t in trials} <= {8, 32, 128} and all(t.job.config["max_steps"] == 120 for t in trials)
    # Pruning on: a trial is judged at each evaluation; those behind stop with their weights.
    for t in trials:
        if t.state == Trial.PRUNED:
            assert t.job.state == "stopped" and "pruned by its sweep: val_loss" in t.job.reason
    # The best trial's weights, downloaded as the team would, load as a model's state.
    best = sweeps.best(sweep)
    assert best is not None and best.value == min(t.value for t in trials if t.state == Trial.COMPLETE)
    client.force_login(alice)
    shown = client.get(f"/api/sweeps/{sweep.pk}/").json()
    assert shown["best"]["number"] == best.number
    names = [a.name for a in best.job.artifacts.all()]
    assert "model.safetensors" in names, names
    response = client.get(f"/jobs/{best.job.pk}/artifacts/model.safetensors")
    assert response.status_code == 200
    state = safetensors.torch.load(b"".join(response.streaming_content))
    assert state and all(isinstance(v, torch.Tensor) for v in state.values())
    metrics = json.loads(b"".join(client.get(f"/jobs/{best.job.pk}/artifacts/metrics.json").streaming_content))
    assert metrics["val_loss"] == pytest.approx(best.value, rel=1e-4)  # the weights the objective was measured on
