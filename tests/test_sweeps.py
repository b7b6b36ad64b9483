"""Sweeps (issue 23, first part): the money ceiling's arithmetic, the search space and Optuna's
samplers rebuilt from our rows, and whole sweeps whose trials are real jobs run by a runner."""

import json
import time
from datetime import timedelta
from decimal import Decimal

import pytest
from django.utils import timezone

from billing.models import Rate
from jobs.models import Job
from scheduler import services
from sweeps import ceiling, search
from sweeps import services as sweeps
from sweeps.models import Sweep, Trial
from tests.conftest import make_job

# The ceiling's arithmetic ---------------------------------------------------------------------


def cost(spent, worst, running):
    return ceiling.TrialCost(Decimal(spent), Decimal(worst), running)


@pytest.mark.nodb
def test_a_trial_starts_only_while_spend_and_running_worst_cases_leave_room_for_its_own():
    trials = [cost("0.40", "1.00", False), cost("0.30", "1.00", True)]
    # Spent 0.40 by the ended one; the running one may still reach its 1.00: 1.40 committed.
    assert ceiling.committed(trials) == Decimal("1.40")
    assert ceiling.may_start(trials, Decimal("1.00"), Decimal("2.40"))
    assert not ceiling.may_start(trials, Decimal("1.01"), Decimal("2.40"))
    # A running trial already past its worst case (it cannot be, but the meter may lag) counts what it spent.
    assert ceiling.committed([cost("1.20", "1.00", True)]) == Decimal("1.20")
    assert ceiling.spent(trials) == Decimal("0.70")


# The search -------------------------------------------------------------------------------------


@pytest.mark.nodb
@pytest.mark.parametrize(
    ("space", "method", "why"),
    [
        ({}, "random", "at least one parameter"),
        ({"lr": {"type": "float", "low": 0.1, "high": 0.01}}, "random", "low must be below high"),
        ({"lr": {"type": "float", "low": 0, "high": 1, "log": True}}, "tpe", "log scale needs low above 0"),
        ({"n": {"type": "int", "low": 1.5, "high": 3}}, "random", "low must be an integer"),
        ({"n": {"type": "choice", "choices": []}}, "random", "choices must be a list"),
        ({"n": {"type": "choice", "choices": [1, 1]}}, "grid", "repeated"),
        ({"lr": {"type": "float", "low": 0.1, "high": 1}}, "grid", "grid search takes choices only"),
        ({"bad name": {"type": "choice", "choices": [1]}}, "grid", "a parameter's name"),
        ({"n": {"type": "choice", "choices": [1], "target": "env"}}, "grid", "target must be"),
        ({"n": {"type": "choice", "choices": [1]}}, "bayes", "method must be one of"),
    ],
)
def test_a_bad_space_is_refused_with_the_reason(space, method, why):
    with pytest.raises(search.SpaceError, match=why):
        search.check(space, method)


def asked(space, method, count, seed=0):
    past = []
    for n in range(count):
        params, attrs = search.ask(space, method, "min", seed, past)
        params, attrs = json.loads(json.dumps(params)), json.loads(json.dumps(attrs))  # as the database keeps them
        past.append(search.Past(params, attrs, "complete" if n % 2 else "running", float(n)))
    return [p.params for p in past]


@pytest.mark.nodb
def test_a_grid_rebuilt_from_the_rows_visits_every_cell_once_even_with_trials_still_running():
    space = {"lr": {"type": "choice", "choices": [0.001, 0.01, 0.1]}, "hidden": {"type": "choice", "choices": [32, 64]}}
    cells = asked(space, "grid", 6)
    assert len({(c["lr"], c["hidden"]) for c in cells}) == 6 == search.grid_size(space)


@pytest.mark.nodb
@pytest.mark.parametrize("method", ["random", "tpe"])
def test_random_and_model_based_search_never_repeat_a_draw_and_are_the_same_for_a_seed(method):
    space = {"lr": {"type": "float", "low": 1e-4, "high": 1e-1, "log": True}, "layers": {"type": "int", "low": 1, "high": 4}}
    first = asked(space, method, 8)
    assert len({c["lr"] for c in first}) == 8
    assert all(1e-4 <= c["lr"] <= 1e-1 and 1 <= c["layers"] <= 4 for c in first)
    assert asked(space, method, 8) == first  # a scheduler that restarts asks the same
    assert asked(space, method, 8, seed=1) != first


@pytest.mark.nodb
def test_the_model_based_search_moves_towards_better_trials():
    space = {"x": {"type": "float", "low": -10, "high": 10}}
    past = []
    for _ in range(30):
        params, attrs = search.ask(space, "tpe", "min", 0, past)
        past.append(search.Past(params, attrs, "complete", (params["x"] - 3) ** 2))
    late = [p.params["x"] for p in past[-10:]]
    assert sum(abs(x - 3) for x in late) / len(late) < 2.5  # random draws on [-10, 10] average about 7 away


# Whole sweeps ----------------------------------------------------------------------------------

pytestmark_db = pytest.mark.django_db(transaction=True)

TRIAL = b"""
import json, os
import e31
hp = json.loads(os.environ["SM_HPS"])
lr, width = float(hp["lr"]), int(hp["width"])
for step in range(3):
    e31.log_metric(step, loss=(lr - 0.01) ** 2 * 1000 + width / 1000 + (2 - step))
print("done", lr, width)
"""


def run_sweep(runner, sweep, timeout=180):
    """Drive the scheduler's cycle (sweeps first, as the scheduler command does) and the runner
    until the sweep ends; the runner heartbeats as its own loop does, so a sweep longer than
    the node timeout does not lose its node."""
    deadline = time.monotonic() + timeout
    beat = time.monotonic()
    while time.monotonic() < deadline:
        sweeps.advance_all()
        services.line_up()
        services.schedule()
        runner.step()
        if time.monotonic() - beat > 5:
            runner.heartbeat()
            beat = time.monotonic()
        sweep.refresh_from_db()
        if sweep.state != Sweep.RUNNING:
            return sweep
        time.sleep(0.05)
    from scheduler.models import Allocation

    held = list(Allocation.objects.filter(ended_at__isnull=True).values_list("job__name", "devices"))
    trials = list(sweep.trials.values_list("number", "state", "job__state", "job__reason"))
    raise TimeoutError(f"the sweep did not end ({sweep.reason}): {trials}; allocations held: {held}")


@pytestmark_db
@pytest.mark.runs_jobs
@pytest.mark.timeout(300)
def test_a_sweep_runs_its_trials_as_jobs_and_finds_the_best(make_runner, alice, rate, settings):
    settings.E31_STOP_GRACE_SECONDS = 1.0
    runner = make_runner(devices=2)
    template = make_job(alice, script=TRIAL, name="mlp", span_hours=Decimal("0.1"), hyperparameters={"lr": 0.5, "width": 64})
    space = {"lr": {"type": "choice", "choices": [0.001, 0.01, 0.1]}, "width": {"type": "choice", "choices": [32, 64]}}
    sweep = sweeps.create(
        alice.membership.team, alice, name="lr-width", template=template, space=space, method="grid",
        objective="loss", direction="min", max_trials=10, parallel=2, ceiling_amount=Decimal("5.00"),
        prune=False,  # every cell runs to its end here (pruning has tests of its own below)
    )  # fmt: skip
    sweep = run_sweep(runner, sweep)
    trials = list(sweep.trials.select_related("job"))
    # The grid has 6 cells: 6 trials, each a job that ran the template's script with its cell.
    assert sweep.state == Sweep.DONE and len(trials) == 6
    assert {(t.params["lr"], t.params["width"]) for t in trials} == {(lr, w) for lr in (0.001, 0.01, 0.1) for w in (32, 64)}
    assert all(t.state == Trial.COMPLETE and t.job.state == "succeeded" for t in trials)
    assert all(t.job.hyperparameters == t.params for t in trials)
    for t in trials:  # the objective is the last value the job logged
        assert t.value == pytest.approx((t.params["lr"] - 0.01) ** 2 * 1000 + t.params["width"] / 1000)
    best = sweeps.best(sweep)
    assert best.params == {"lr": 0.01, "width": 32}
    # Never more than `parallel` trials at once: each trial was queued only once the earlier ones ended.
    # The template's worst case is its span's: 0.1 h x 1 GPU x 2.40 = 0.24 per trial, its ceiling.
    assert {t.job.ceiling_amount for t in trials} == {Decimal("0.24")}
    assert Job.objects.filter(trial__sweep=sweep).count() == 6


@pytestmark_db
@pytest.mark.runs_jobs
@pytest.mark.timeout(300)
def test_no_trial_starts_that_could_pass_the_ceiling_and_the_sweep_says_why_it_ended(make_runner, alice, rate):
    # A dear rate, so that a trial of a second or two costs something: 1.00 a second.
    Rate.objects.create(gpu_type="", per_gpu_hour=Decimal("3600.00"), effective_from=timezone.now() - timedelta(hours=1))
    runner = make_runner(devices=4)
    slow = TRIAL + b"import time; time.sleep(2.2)\n"  # a trial holds its device about 2 s: about 2.00
    template = make_job(alice, script=slow, name="mlp", ceiling_amount=Decimal("3.00"), hyperparameters={"lr": 0.5, "width": 64})
    space = {"lr": {"type": "float", "low": 0.001, "high": 0.1, "log": True}, "width": {"type": "int", "low": 16, "high": 128}}
    # Each trial may cost up to 3.00 (its own ceiling): with 10.00, three may be committed at once, never a fourth.
    sweep = sweeps.create(
        alice.membership.team, alice, name="capped", template=template, space=space, method="tpe",
        objective="loss", direction="min", max_trials=50, parallel=4, ceiling_amount=Decimal("10.00"),
    )  # fmt: skip
    started = sweeps.advance(sweep)
    assert len(started) == 3  # parallel 4, but a fourth would commit 12.00
    assert sweeps.advance(sweep) == []  # asked again (a restarted scheduler): nothing doubled
    sweep = run_sweep(runner, sweep)
    trials = list(sweep.trials.select_related("job"))
    billed = sum((t.job.held()[1] for t in trials), Decimal(0))
    assert sweep.state == Sweep.CEILING and "would pass the ceiling" in sweep.reason, sweep.reason
    assert billed <= Decimal("10.00")
    assert Decimal("10.00") - billed < Decimal("3.00")  # it stopped only when another trial could not fit
    assert 3 < len(trials) < 50 and all(t.job.state in ("succeeded", "stopped") for t in trials)


@pytestmark_db
def test_a_sweep_is_refused_when_one_trial_could_pass_its_ceiling_or_its_template_is_not_the_team_s(alice, charlie, rate):
    template = make_job(alice, script=TRIAL, span_hours=Decimal("1"))  # up to 2.40 a trial
    space = {"lr": {"type": "choice", "choices": [0.1]}}
    team = alice.membership.team
    with pytest.raises(sweeps.SweepError, match="up to 2.40, more than the sweep's ceiling of 1"):
        sweeps.create(
            team,
            alice,
            name="s",
            template=template,
            space=space,
            method="grid",
            objective="loss",
            direction="min",
            max_trials=1,
            parallel=1,
            ceiling_amount="1",
        )
    with pytest.raises(sweeps.SweepError, match="one of the team's jobs"):
        sweeps.create(
            charlie.membership.team,
            charlie,
            name="s",
            template=template,
            space=space,
            method="grid",
            objective="loss",
            direction="min",
            max_trials=1,
            parallel=1,
            ceiling_amount="10",
        )
    with pytest.raises(sweeps.SweepError, match="grid search takes choices only"):
        sweeps.create(
            team,
            alice,
            name="s",
            template=template,
            space={"lr": {"type": "float", "low": 0.1, "high": 1}},
            method="grid",
            objective="loss",
            direction="min",
            max_trials=1,
            parallel=1,
            ceiling_amount="10",
        )


@pytestmark_db
def test_the_api_starts_a_sweep_follows_its_trials_and_keeps_it_to_the_team(client, alice, charlie, rate):
    from django.urls import reverse
    from rest_framework.authtoken.models import Token

    template = make_job(alice, script=TRIAL, span_hours=Decimal("0.1"), hyperparameters={"lr": 0.5, "width": 64})
    body = {
        "name": "lr",
        "template": str(template.pk),
        "space": {"lr": {"type": "float", "low": 0.001, "high": 0.1, "log": True}},
        "method": "random",
        "objective": "loss",
        "max_trials": 4,
        "parallel": 2,
        "ceiling": "1.00",
    }
    as_alice = {"HTTP_AUTHORIZATION": f"Token {Token.objects.create(user=alice).key}"}
    as_charlie = {"HTTP_AUTHORIZATION": f"Token {Token.objects.create(user=charlie).key}"}
    refused = client.post(reverse("api:sweeps"), {**body, "space": {"lr": {"type": "float", "low": 1, "high": 0}}}, content_type="application/json", **as_alice)
    assert refused.status_code == 400 and "low must be below high" in refused.json()["detail"]
    foreign = client.post(reverse("api:sweeps"), body, content_type="application/json", **as_charlie)
    assert foreign.status_code == 400 and foreign.json()["errors"] == {"template": ["No job of your team has that id."]}
    created = client.post(reverse("api:sweeps"), body, content_type="application/json", **as_alice)
    assert created.status_code == 201, created.json()
    sweep = created.json()
    assert sweep["state"] == "running" and sweep["trials"] == [] and sweep["ceiling"] == "1.00" and sweep["committed"] == "0"
    sweeps.advance(Sweep.objects.get(pk=sweep["id"]))
    detail = client.get(reverse("api:sweep", args=[sweep["id"]]), **as_alice).json()
    # Two trials queued (parallel 2), each with its worst case of 0.24 committed against the 1.00.
    assert [t["number"] for t in detail["trials"]] == [1, 2] and {t["state"] for t in detail["trials"]} == {"running"}
    assert detail["committed"] == "0.48" and detail["spent"] == "0" and detail["best"] is None
    assert all(0.001 <= t["params"]["lr"] <= 0.1 and t["job_state"] == "queued" for t in detail["trials"])
    assert client.get(reverse("api:sweep", args=[sweep["id"]]), **as_charlie).status_code == 404
    assert client.get(reverse("api:sweeps"), **as_charlie).json()["count"] == 0
    assert [s["name"] for s in client.get(reverse("api:sweeps"), **as_alice).json()["results"]] == ["lr"]


def make_sweep(user, template, name="lr", choices=(0.1, 0.2), **changes):
    """A grid sweep over the template's lr (one trial per choice, all at once) under 1.00."""
    fields = {
        "name": name, "template": template, "space": {"lr": {"type": "choice", "choices": list(choices)}}, "method": "grid",
        "objective": "loss", "direction": "min", "max_trials": len(choices), "parallel": len(choices), "ceiling_amount": Decimal("1.00"),
    }  # fmt: skip
    return sweeps.create(user.membership.team, user, **{**fields, **changes})


@pytestmark_db
def test_the_sweep_list_and_a_sweep_cost_the_same_queries_however_many_sweeps_and_trials(client, alice, rate):
    """The list reads every sweep's trials, their jobs and allocations (for spend and the best):
    loaded together, not once per sweep or per trial."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext
    from django.urls import reverse

    template = make_job(alice, script=TRIAL, span_hours=Decimal("0.1"), hyperparameters={"lr": 0.5, "width": 64})
    client.force_login(alice)

    def queries(path):
        with CaptureQueriesContext(connection) as seen:
            assert client.get(path).status_code == 200
        return len(seen)

    first = make_sweep(alice, template, name="one")
    sweeps.advance(first)
    few = queries(reverse("api:sweeps")), queries(reverse("api:sweep", args=[first.pk])), queries(reverse("sweeps:detail", args=[first.pk]))
    for n in range(4):
        more = make_sweep(alice, template, name=f"more-{n}", choices=(0.1, 0.2, 0.3, 0.4))
        sweeps.advance(more)
    assert Trial.objects.count() == 2 + 4 * 4
    many = queries(reverse("api:sweeps")), queries(reverse("api:sweep", args=[more.pk])), queries(reverse("sweeps:detail", args=[more.pk]))
    assert many == few


@pytestmark_db
def test_a_look_reads_only_what_a_trial_logged_since_the_last_and_judges_it_only_then(alice, rate, monkeypatch):
    """The scheduler looks at a sweep every cycle: a running trial's objective is read a few
    events at a time (the step-less point's x carrying on from those before), the same series a
    whole read gives, and the pruner is asked only when the trial logged something new."""
    from jobs.models import JobEvent

    template = make_job(alice, script=TRIAL, span_hours=Decimal("0.1"), hyperparameters={"lr": 0.5, "width": 64})
    sweep = make_sweep(alice, template, choices=(0.1,))
    (trial,) = sweeps.advance(sweep)
    Job.objects.filter(pk=trial.job_id).update(state="running")
    asked = []
    real = search.should_prune
    monkeypatch.setattr(search, "should_prune", lambda *a: asked.append(a[-1]) or real(*a))

    def log(*points):
        JobEvent.append(trial.job_id, [JobEvent(kind="metric", at=timezone.now(), data={"step": s, "values": v}) for s, v in points])

    def look():
        sweep.refresh_from_db()
        trials = list(sweep.trials.select_related("job"))
        sweeps.prune(sweep, trials, timezone.now())
        return trials[0]

    log((1, {"loss": 0.9}), (None, {"acc": 0.1}), (3, {"loss": 0.7}))
    seen = look()
    assert sweeps.finite(seen.intermediate) == {1: 0.9, 3: 0.7} and asked == [0]
    assert look().seen_seq == seen.seen_seq and asked == [0]  # nothing new: no rebuilt search
    log((None, {"loss": 0.6}), (9, {"loss": "nan"}), (9, {"loss": 0.5}))
    seen = look()
    whole = dict(sweeps.objective_points(seen.job, "loss"))
    assert sweeps.finite(seen.intermediate) == whole == {1: 0.9, 3: 0.7, 4: 0.6, 9: 0.5}  # a step-less point goes after the last
    assert asked == [0, 0] and seen.seen_points == 6
    log((2, {"loss": 0.8}))  # resumed from its checkpoint at step 2: what came after is redone
    assert sweeps.finite(look().intermediate) == dict(sweeps.objective_points(seen.job, "loss")) == {1: 0.9, 2: 0.8}


PRUNABLE = b"""
import json, os, time
import e31
lr = float(json.loads(os.environ["SM_HPS"])["lr"])
for step in range(1, 13):
    e31.log_metric(step, loss=lr * 10 + (13 - step) * 0.01)
    time.sleep(0.25)
print("ran all 12 steps")
"""


@pytestmark_db
@pytest.mark.runs_jobs
@pytest.mark.timeout(300)
def test_trials_that_fall_behind_are_stopped_early_their_weights_kept_and_billed_for_what_they_held(make_runner, alice, rate):
    runner = make_runner(devices=1)
    template = make_job(alice, script=PRUNABLE, name="mlp", span_hours=Decimal("0.1"), hyperparameters={"lr": 0.5})
    space = {"lr": {"type": "choice", "choices": [0.01, 0.1, 0.5, 1.0, 2.0, 4.0]}}
    sweep = sweeps.create(
        alice.membership.team, alice, name="pruned", template=template, space=space, method="grid",
        objective="loss", direction="min", max_trials=6, parallel=1, ceiling_amount=Decimal("5.00"),
    )  # fmt: skip
    sweep = run_sweep(runner, sweep)
    trials = list(sweep.trials.select_related("job"))
    pruned = [t for t in trials if t.state == Trial.PRUNED]
    complete = [t for t in trials if t.state == Trial.COMPLETE]
    assert sweep.state == Sweep.DONE and len(trials) == 6 and len(pruned) + len(complete) == 6
    # One at a time: a trial worse, at a rung, than the best third of those before it is stopped there.
    assert pruned, [(t.params, t.state) for t in trials]
    for t in pruned:
        assert t.job.state == "stopped" and "pruned by its sweep" in t.job.reason
        assert any(t.params["lr"] > c.params["lr"] for c in complete if c.number < t.number)
        logs = list(t.job.events.filter(kind="log").values_list("text", flat=True))
        assert "ran all 12 steps" not in logs  # stopped before its end
        assert t.job.held()[0] < min(c.job.held()[0] for c in complete) + 1
    assert sweeps.best(sweep).params["lr"] == min(t.params["lr"] for t in complete)
    # The first trial always runs its course: there is nothing to compare it with.
    assert trials[0].state == Trial.COMPLETE


@pytest.mark.nodb
def test_the_charts_put_better_trials_higher_and_mark_the_best():
    from sweeps import chart

    space = {"lr": {"type": "float", "low": 1e-4, "high": 1e-1, "log": True}, "act": {"type": "choice", "choices": ["relu", "gelu"]}}
    trials = [({"lr": 1e-4, "act": "relu"}, 3.0), ({"lr": 1e-2, "act": "gelu"}, 1.0), ({"lr": 1e-1, "act": "relu"}, 2.0), ({"lr": 1e-3, "act": "gelu"}, None)]
    lr, act = chart.charts(space, trials, "min")
    assert [p.best for p in lr.points] == [False, True, False]  # the trial without an objective is left out
    ys = [p.y for p in lr.points]
    assert ys[1] < ys[2] < ys[0]  # lower loss, higher on the chart (SVG's y grows downwards)
    xs = [p.x for p in lr.points]
    assert xs[0] < xs[1] < xs[2] and xs[1] - xs[0] > xs[2] - xs[1]  # a log axis: 1e-4..1e-2 is twice 1e-2..1e-1
    assert (lr.low, lr.high) == ("0.0001", "0.1") and (act.low, act.high) == ("relu", "gelu")
    assert [p.x for p in act.points] == [
        chart.PAD + 0.25 * (chart.WIDTH - 2 * chart.PAD),
        chart.PAD + 0.75 * (chart.WIDTH - 2 * chart.PAD),
        chart.PAD + 0.25 * (chart.WIDTH - 2 * chart.PAD),
    ]
    assert chart.charts(space, [({"lr": 0.1, "act": "relu"}, None)], "min") == []


@pytestmark_db
def test_the_sweep_pages_show_the_team_s_sweeps_their_trials_and_their_spend(client, alice, charlie, rate):
    from django.urls import reverse

    template = make_job(alice, script=TRIAL, span_hours=Decimal("0.1"), hyperparameters={"lr": 0.5, "width": 64})
    space = {"lr": {"type": "choice", "choices": [0.01, 0.1]}, "width": {"type": "choice", "choices": [32]}}
    sweep = sweeps.create(
        alice.membership.team, alice, name="page-sweep", template=template, space=space, method="grid",
        objective="loss", direction="min", max_trials=2, parallel=2, ceiling_amount=Decimal("1.00"),
    )  # fmt: skip
    first, _second = sweeps.advance(sweep)
    Trial.objects.filter(pk=first.pk).update(state=Trial.COMPLETE, value=0.25)
    client.force_login(alice)
    listing = client.get(reverse("sweeps:list"))
    assert listing.status_code == 200 and "page-sweep" in listing.content.decode()
    page = client.get(reverse("sweeps:detail", args=[sweep.pk]))
    text = page.content.decode()
    assert page.status_code == 200 and 'hx-trigger="every 3s"' in text  # running: it refreshes itself
    assert 'id="sweep-best"' in text and "0.25" in text and f"trial {first.number}" in text
    assert text.count('<tr data-trial="') == 2 and 'class="trial-complete trial-best"' in text
    assert "Spent <strong" in text and "committed" in text
    partial = client.get(reverse("sweeps:detail", args=[sweep.pk]), HTTP_HX_REQUEST="true").content.decode()
    assert "<html" not in partial and 'id="sweep-trials"' in partial
    client.force_login(charlie)
    assert client.get(reverse("sweeps:detail", args=[sweep.pk])).status_code == 404
    assert "page-sweep" not in client.get(reverse("sweeps:list")).content.decode()


@pytestmark_db
def test_the_best_configuration_runs_again_as_a_job_of_its_own_with_changes(client, alice, charlie, rate):
    from django.urls import reverse
    from rest_framework.authtoken.models import Token

    template = make_job(alice, script=TRIAL, span_hours=Decimal("0.5"), ceiling_amount=Decimal("0.80"), hyperparameters={"lr": 0.5, "width": 64})
    space = {"lr": {"type": "choice", "choices": [0.01, 0.1]}}
    sweep = sweeps.create(
        alice.membership.team, alice, name="again", template=template, space=space, method="grid",
        objective="loss", direction="min", max_trials=2, parallel=2, ceiling_amount=Decimal("2.00"),
    )  # fmt: skip
    first, second = sweeps.advance(sweep)
    as_alice = {"HTTP_AUTHORIZATION": f"Token {Token.objects.create(user=alice).key}"}
    url = reverse("api:sweep-rerun", args=[sweep.pk])
    early = client.post(url, {}, content_type="application/json", **as_alice)
    assert early.status_code == 409 and "no trial has completed" in early.json()["detail"]
    Trial.objects.filter(pk=first.pk).update(state=Trial.COMPLETE, value=0.9)
    Trial.objects.filter(pk=second.pk).update(state=Trial.COMPLETE, value=0.2)
    answer = client.post(url, {"hyperparameters": {"epochs": 100}}, content_type="application/json", **as_alice)
    assert answer.status_code == 201, answer.json()
    job = Job.objects.get(pk=answer.json()["job"])
    assert job.hyperparameters == {"lr": second.params["lr"], "width": 64, "epochs": 100}
    assert job.parent_id == second.job_id and job.state == "queued"
    # The template's own ceiling, not the trial's share of the sweep's: it is not a trial.
    assert job.ceiling_amount == Decimal("0.80") and not hasattr(job, "trial")
    assert sorted(job.uploads.values_list("role", flat=True)) == ["code"]
    as_charlie = {"HTTP_AUTHORIZATION": f"Token {Token.objects.create(user=charlie).key}"}
    assert client.post(url, {}, content_type="application/json", **as_charlie).status_code == 404
    client.force_login(alice)
    page = client.post(reverse("sweeps:rerun", args=[sweep.pk]))
    assert page.status_code == 302 and "/jobs/" in page["Location"]


@pytestmark_db
def test_the_scheduler_advances_sweeps_on_its_turn(alice, rate):
    from django.core.management import call_command

    template = make_job(alice, script=TRIAL, span_hours=Decimal("0.1"), hyperparameters={"lr": 0.5, "width": 64})
    sweep = sweeps.create(
        alice.membership.team, alice, name="turn", template=template, space={"lr": {"type": "choice", "choices": [0.1, 0.2, 0.3]}},
        method="grid", objective="loss", direction="min", max_trials=3, parallel=2, ceiling_amount=Decimal("1.00"),
    )  # fmt: skip
    call_command("scheduler", "--once")
    assert sweep.trials.count() == 2 and Job.objects.filter(trial__sweep=sweep, state="queued").count() == 2
    assert set(Job.objects.filter(trial__sweep=sweep).values_list("experiment", flat=True)) == {"turn"}  # the sweep is the experiment


@pytestmark_db
def test_the_form_starts_a_sweep_from_a_job_and_a_refused_one_keeps_what_was_written(client, alice, charlie, rate):
    from django.urls import reverse

    template = make_job(alice, script=TRIAL, name="mlp", span_hours=Decimal("0.1"), hyperparameters={"lr": 0.5, "width": 64})
    client.force_login(alice)
    # The job's page offers it; the form comes with the job chosen and an example space.
    assert f"{reverse('sweeps:new')}?template={template.pk}" in client.get(reverse("jobs:detail", args=[template.pk])).content.decode()
    page = client.get(reverse("sweeps:new"), {"template": template.pk}).content.decode()
    assert f'<option value="{template.pk}" selected>' in page and "lr: {type: float" in page
    fields = {
        "name": "lr-form", "template": template.pk, "space": "lr: {type: float, low: 0.001, high: 0.1, log: true}\nwidth: {type: choice, choices: [32, 64]}",
        "method": "tpe", "objective": "loss", "direction": "min", "max_trials": 8, "parallel": 2, "ceiling": "1.00", "prune": "on",
    }  # fmt: skip
    refused = client.post(reverse("sweeps:new"), {**fields, "space": "lr: {type: float, low: 1, high: 0}"})
    text = refused.content.decode()
    assert refused.status_code == 400 and "The sweep was not started" in text and "low must be below high" in text and "lr-form" in text
    assert "not YAML or JSON" in client.post(reverse("sweeps:new"), {**fields, "space": "lr: [1,"}).content.decode()
    dear = client.post(reverse("sweeps:new"), {**fields, "ceiling": "0.10"})  # one trial's worst case is 0.24
    assert dear.status_code == 400 and "ceiling" in dear.content.decode() and not Sweep.objects.exists()
    started = client.post(reverse("sweeps:new"), fields)
    sweep = Sweep.objects.get()
    assert started.status_code == 302 and started["Location"] == reverse("sweeps:detail", args=[sweep.pk])
    assert (sweep.name, sweep.method, sweep.max_trials, sweep.prune, sweep.ceiling_amount) == ("lr-form", "tpe", 8, True, Decimal("1.00"))
    assert sweep.space["width"] == {"type": "choice", "choices": [32, 64]}
    # Another team's job is no choice at all.
    client.force_login(charlie)
    foreign = client.post(reverse("sweeps:new"), {**fields, "name": "theirs"})
    assert foreign.status_code == 400 and "Select a valid choice" in foreign.content.decode() and Sweep.objects.count() == 1
