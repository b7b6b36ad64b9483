"""The sweep page in a real browser: a finished grid search's trials, the best marked, its spend
against its ceiling, and the objective against each parameter. Screenshot:
test-artifacts/sweep.png."""

import textwrap

import pytest
from playwright.sync_api import expect

from tests.browser import log_in, shot

pytestmark = [pytest.mark.browser, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def system(web_system):
    return web_system


# A grid of learning rates and widths, as the scheduler leaves it once every trial has run
# (written directly: the shared system has no runner).
SWEEP = """
    from decimal import Decimal
    from django.utils import timezone
    from accounts.models import Team
    from jobs import lineage
    from jobs.models import Job
    from sweeps.models import Sweep, Trial

    team = Team.objects.get(memberships__user__username="demo")
    user = team.memberships.first().user
    template = Job.objects.create(team=team, created_by=user, name="sweep-template", entrypoint="train.py", gpus=1, span_hours=Decimal("0.1"))
    space = {"lr": {"type": "choice", "choices": [0.001, 0.01, 0.1]}, "width": {"type": "choice", "choices": [32, 64]}}
    sweep = Sweep.objects.create(
        team=team, created_by=user, name="lr-width", template=template, space=space, method="grid", objective="heldout_loss",
        max_trials=6, parallel=2, ceiling_amount=Decimal("5.00"), state="done", reason="6 trials run", finished_at=timezone.now(),
    )
    for number, (lr, width, state, value) in enumerate(
        [(0.001, 32, "complete", 0.41), (0.01, 32, "complete", 0.12), (0.1, 32, "pruned", 0.93),
         (0.001, 64, "complete", 0.38), (0.01, 64, "complete", 0.15), (0.1, 64, "pruned", 1.20)], 1
    ):
        job = lineage.copy_job(template, user, name=f"lr-width #{number}", hyperparameters={"lr": lr, "width": width})
        Job.objects.filter(pk=job.pk).update(state="stopped" if state == "pruned" else "succeeded")
        Trial.objects.create(sweep=sweep, number=number, params={"lr": lr, "width": width}, job=job, state=state, value=value)
"""


def test_the_sweep_page_shows_its_trials_the_best_and_the_charts(page, system):
    system.manage("shell", "-c", textwrap.dedent(SWEEP))
    log_in(page)
    page.get_by_role("link", name="Sweeps").click()
    page.get_by_role("link", name="lr-width").click()
    expect(page.locator("h1")).to_contain_text("Sweep lr-width")
    expect(page.locator("#sweep-state h2")).to_contain_text("Done")
    expect(page.locator("#sweep-best")).to_contain_text("trial 2")
    expect(page.locator("#sweep-best")).to_contain_text("lr=0.01")
    expect(page.locator("#sweep-trials tbody tr")).to_have_count(6)
    expect(page.locator("tr.trial-best")).to_have_attribute("data-trial", "2")
    expect(page.locator("tr.trial-pruned")).to_have_count(2)
    expect(page.locator(".sweep-chart")).to_have_count(2)
    expect(page.locator(".sweep-point.best")).to_have_count(2)  # one per chart
    shot(page, "sweep.png")


# Three runs of one experiment, as they are once they ended: their learning rates, their last
# heldout_loss and an hour's worth of allocations (written directly, as above).
EXPERIMENT = """
    from datetime import timedelta
    from decimal import Decimal
    from django.utils import timezone
    from accounts.models import Team
    from jobs.models import Job, JobEvent
    from scheduler.models import Allocation, Node

    team = Team.objects.get(memberships__user__username="demo")
    user = team.memberships.first().user
    node, _ = Node.objects.get_or_create(name="browser-node", defaults={"device_type": "cpu", "devices": 4})
    started = timezone.now() - timedelta(days=1)
    for lr, minutes, losses in [(0.1, 60, [0.9, 0.52]), (0.01, 45, [0.8, 0.31]), (1.0, 20, [1.1, 0.97])]:
        job = Job.objects.create(team=team, created_by=user, name="digits-mlp", entrypoint="train.py", gpus=1, span_hours=Decimal("1"),
                                 hyperparameters={"lr": lr, "epochs": 10}, state="succeeded")
        Allocation.objects.create(job=job, node=node, devices=[0], device_type="cpu", rate=Decimal("2.40"), started_at=started,
                                  ended_at=started + timedelta(minutes=minutes), end_reason="exited")
        JobEvent.append(job.pk, [JobEvent(kind="metric", at=started, data={"step": i, "values": {"heldout_loss": v, "accuracy": 1 - v / 2}})
                                 for i, v in enumerate(losses)])
"""


def test_a_sweep_is_started_from_a_job_s_page_and_an_experiment_compares_its_runs(page, system):
    system.manage("shell", "-c", textwrap.dedent(EXPERIMENT))
    log_in(page)
    page.get_by_role("link", name="Experiments").click()
    page.get_by_role("link", name="digits-mlp").click()
    expect(page.locator("h1")).to_contain_text("digits-mlp")
    expect(page.locator("#experiment-runs tbody tr")).to_have_count(3)
    expect(page.locator("#experiment-runs tbody tr").nth(0)).to_contain_text("the baseline")
    expect(page.locator("#experiment-runs tbody tr").nth(1)).to_contain_text("0.105")  # accuracy, first by name: 0.845 - 0.74
    page.select_option("#experiment-metric select[name=metric]", "heldout_loss")
    page.get_by_role("button", name="Compare").click()
    expect(page.locator("#experiment-runs tbody tr").nth(1)).to_contain_text("0.21")  # 0.52 - 0.31, lower better by its name
    expect(page.locator("#experiment-runs tbody tr").nth(1)).to_contain_text("USD 8.5714")  # 1.80 for 0.21
    expect(page.locator("#experiment-runs tbody tr").nth(2)).to_contain_text("no improvement")
    shot(page, "experiment.png")

    # From the better run's page, a sweep over its learning rate; a space that is not one first.
    page.locator("#experiment-runs tbody tr").nth(1).get_by_role("link", name="digits-mlp").click()
    page.locator("#sweep-link").click()
    page.fill("#id_name", "digits-lr")
    page.fill("#id_space", "lr: {type: float, low: 1, high: 0.001}")
    page.fill("#id_objective", "heldout_loss")
    page.fill("#id_ceiling", "20")
    page.get_by_role("button", name="Start the sweep").click()
    expect(page.locator("#form-errors")).to_contain_text("low must be below high")
    expect(page.locator("#id_name")).to_have_value("digits-lr")  # what was written is kept
    shot(page, "sweep-form.png")
    page.fill("#id_space", "lr: {type: float, low: 0.001, high: 1, log: true}")
    page.get_by_role("button", name="Start the sweep").click()
    expect(page.locator("h1")).to_contain_text("Sweep digits-lr")


def test_the_team_registers_its_tracker_and_a_refused_address_says_why(page, system):
    """Settings -> Experiment tracker: an address inside the network is refused beside the field,
    what was written kept and the token never shown back. Screenshot: tracker.png."""
    log_in(page)
    page.locator(".topbar").get_by_role("link", name="Settings").click()
    page.locator("#tracker").get_by_role("link", name="experiment tracker").click()
    expect(page.locator("h1")).to_contain_text("Experiment tracker")
    page.fill("#id_url", "http://127.0.0.1:5000")
    page.fill("#id_token", "mlflow-secret-token")
    page.get_by_role("button", name="Save").click()
    expect(page.locator("#tracker-form")).to_contain_text("must be at a public address")
    expect(page.locator("#id_url")).to_have_value("http://127.0.0.1:5000")
    expect(page.locator("#id_token")).to_have_value("")  # a secret is never sent back to the page
    shot(page, "tracker.png")
