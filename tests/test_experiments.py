"""Experiments: every job belongs to one (by default its name; a sweep's trials, the sweep's; a
copy, its source's), and an experiment's page compares its runs side by side with what each
improvement over the first run cost. The comparison is pure and tested first, without a database."""

from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from django.urls import reverse

from jobs import experiments, lineage
from jobs.experiments import Run, compare, default_metric, flat_params, param_names
from jobs.models import Job, JobEvent
from scheduler.models import Allocation, Node
from tests.conftest import make_job

# The comparison --------------------------------------------------------------------------------


def run(name, cost, **metrics):
    return Run(id=name, name=name, state="succeeded", params={}, metrics=metrics, held_seconds=60, cost=Decimal(cost))


def test_each_run_is_measured_against_the_first_and_pays_per_unit_of_improvement():
    rows = compare([run("a", "1.00", loss=0.50), run("b", "2.00", loss=0.30), run("c", "3.00", loss=0.60), run("d", "1.00")], "loss", "min")
    assert [r.improvement for r in rows] == [0.0, pytest.approx(0.2), pytest.approx(-0.1), None]
    # The first is the baseline: no improvement of its own; a run no better bought nothing; a run
    # without the metric has no value to compare.
    assert [r.cost_per_unit for r in rows] == [None, Decimal("10.0000"), None, None]
    higher = compare([run("a", "1.00", acc=0.8), run("b", "0.50", acc=0.9)], "acc", "max")
    assert higher[1].improvement == pytest.approx(0.1) and higher[1].cost_per_unit == Decimal("5.0000")
    assert compare([], "loss", "min") == []


def test_the_default_metric_is_the_one_most_runs_logged_preferring_one_whose_direction_is_known():
    assert default_metric([run("a", "0", loss=1, steps=3), run("b", "0", loss=1, steps=4), run("c", "0", steps=5)]) == "steps"
    assert default_metric([run("a", "0", loss=1, widgets=3), run("b", "0", loss=1, widgets=4)]) == "loss"
    assert default_metric([run("a", "0")]) is None


def test_the_parameters_that_differ_come_first_and_nested_config_keys_are_flattened():
    one = Run("a", "a", "succeeded", {"lr": 0.1, "seed": 0, "width": 64})
    two = Run("b", "b", "succeeded", {"lr": 0.2, "seed": 0})
    assert param_names([one, two]) == ["lr", "width", "seed"]
    job = Job(hyperparameters={"lr": 0.1}, config={"model": {"hidden": 64, "layers": 2}, "epochs": 3, "empty": {}})
    assert flat_params(job) == {"lr": 0.1, "model.hidden": 64, "model.layers": 2, "epochs": 3, "empty": {}}


# Jobs and the page -----------------------------------------------------------------------------


def finished(job, seconds, losses):
    """The job ran for seconds on a 2.40/h slot and logged these losses, one per step."""
    node, _ = Node.objects.get_or_create(name="exp-node", defaults={"device_type": "cpu", "devices": 4})
    started = datetime(2026, 11, 3, tzinfo=UTC)
    Allocation.objects.create(
        job=job,
        node=node,
        devices=[0],
        device_type="cpu",
        rate=Decimal("2.40"),
        started_at=started,
        ended_at=started + timedelta(seconds=seconds),
        end_reason=Allocation.EXITED,
    )
    JobEvent.append(job.pk, [JobEvent(kind="metric", at=started, data={"step": i, "values": {"val_loss": v}}) for i, v in enumerate(losses)])
    Job.objects.filter(pk=job.pk).update(state="succeeded")
    return job


@pytest.mark.django_db
def test_a_job_is_in_the_experiment_of_its_name_its_copies_stay_in_their_source_s(alice, rate):
    job = make_job(alice, name="mlp")
    assert job.experiment == "mlp"
    copy = lineage.copy_job(job, alice, name="mlp, longer")
    assert copy.experiment == "mlp"
    named = make_job(alice, name="other")
    Job.objects.filter(pk=named.pk).update(experiment="mlp")
    assert {e["experiment"]: e["runs"] for e in experiments.experiments_of(alice.membership.team)} == {"mlp": 3}


@pytest.mark.django_db
def test_the_experiment_page_compares_the_runs_and_what_each_improvement_cost(client, alice, charlie, rate):
    first = finished(make_job(alice, name="mlp", hyperparameters={"lr": 0.1, "width": 64}), 3600, [0.9, 0.5])
    better = finished(make_job(alice, name="mlp", hyperparameters={"lr": 0.01, "width": 64}), 1800, [0.8, 0.25])
    worse = finished(make_job(alice, name="mlp", hyperparameters={"lr": 1.0, "width": 64}), 600, [0.7])
    elsewhere = make_job(alice, name="cnn")
    client.force_login(alice)
    page = client.get(reverse("jobs:experiment", args=[better.pk]))
    text = page.content.decode()
    assert page.status_code == 200 and "mlp" in text and "3 runs" in text
    rows = text.split('<tr data-run="')[1:]
    assert [r.split('"')[0] for r in rows] == [str(first.pk), str(better.pk), str(worse.pk)] and str(elsewhere.pk) not in text
    # lr differs and comes first; every run's last val_loss; held time and cost.
    assert text.index(">lr<") < text.index(">width<")
    assert ">0.5<" in rows[0] and ">0.25<" in rows[1] and ">0.7<" in rows[2]
    assert "2.40" in rows[0] and "1.20" in rows[1] and "the baseline" in rows[0]
    # The better run: 0.25 better for 1.20, 4.80 per unit; the worse one bought nothing.
    assert rows[1].split("</td>")[-3].endswith(">0.25") and "USD 4.8000" in rows[1] and "no improvement" in rows[2]
    # Another direction, asked for: now the worse run is the better.
    asked = client.get(reverse("jobs:experiment", args=[better.pk]), {"metric": "val_loss", "direction": "max"}).content.decode()
    assert "no improvement" in asked.split('<tr data-run="')[2]
    listing = client.get(reverse("jobs:experiments")).content.decode()
    assert reverse("jobs:experiment", args=[worse.pk]) in listing and ">3<" in listing  # through its latest run
    assert 'id="experiment-link"' in client.get(reverse("jobs:detail", args=[first.pk])).content.decode()
    # Another team's experiment cannot be reached through its jobs, nor listed.
    client.force_login(charlie)
    assert client.get(reverse("jobs:experiment", args=[better.pk])).status_code == 404
    assert "mlp" not in client.get(reverse("jobs:experiments")).content.decode()


@pytest.mark.django_db
def test_the_page_costs_the_same_queries_however_many_runs(client, alice, rate):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    jobs = [finished(make_job(alice, name="mlp", hyperparameters={"lr": i / 10}), 60, [0.5, 0.4]) for i in range(2)]
    client.force_login(alice)

    def queries():
        with CaptureQueriesContext(connection) as seen:
            assert client.get(reverse("jobs:experiment", args=[jobs[0].pk])).status_code == 200
        return len(seen)

    few = queries()
    jobs += [finished(make_job(alice, name="mlp", hyperparameters={"lr": i / 10}), 60, [0.5, 0.4]) for i in range(2, 8)]
    assert queries() == few


@pytest.mark.django_db(transaction=True)
def test_the_jobs_made_before_experiments_are_in_their_name_s_and_trials_in_their_sweep_s():
    """jobs 0020 adds the field and 0021 fills it: a database at jobs 0019, filled, then migrated forward
    (on PostgreSQL too, where one migration doing both could not create the index)."""
    from django.db import connection
    from django.db.migrations.executor import MigrationExecutor

    before = [("jobs", "0019_datasets_to_catalog")]
    MigrationExecutor(connection).migrate(before)
    loader = MigrationExecutor(connection).loader
    apps = loader.project_state(list(loader.applied_migrations), at_end=True).apps
    user = apps.get_model("auth", "User").objects.create(username="alice")
    team = apps.get_model("accounts", "Team").objects.create(name="Team A")
    OldJob = apps.get_model("jobs", "Job")
    plain = OldJob.objects.create(team=team, created_by=user, name="mlp", gpus=1)
    trial_job = OldJob.objects.create(team=team, created_by=user, name="lr #1", gpus=1)
    sweep = apps.get_model("sweeps", "Sweep").objects.create(
        team=team, name="lr", template=plain, space={}, method="grid", objective="loss", max_trials=1, ceiling_amount=1
    )
    apps.get_model("sweeps", "Trial").objects.create(sweep=sweep, number=1, params={}, job=trial_job)
    executor = MigrationExecutor(connection)
    executor.migrate(executor.loader.graph.leaf_nodes())
    assert Job.objects.get(pk=plain.pk).experiment == "mlp" and Job.objects.get(pk=trial_job.pk).experiment == "lr"
