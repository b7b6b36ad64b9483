"""Retrain by morning, in a real browser against a live system with a runner: a classifier
trained with the built-in recipe is retrained from its job page (its weights as the starting
model, a new file added to its data, "by 08:00 tomorrow"), the retraining runs from those
weights, and "Compare with previous" gives a verdict on the held-out set.

Screenshots go to test-artifacts/ at the repository root (git-ignored).
"""

import json
import random

import pytest
from playwright.sync_api import expect

from tests.browser import log_in, shot

pytestmark = [pytest.mark.browser, pytest.mark.timeout(400)]


@pytest.fixture(scope="module")
def system(runner_system):
    return runner_system


def table(rows, seed):
    """Two features; the label is which side of a line a point is on."""
    rng = random.Random(seed)
    lines = ["a,b,label"]
    for _ in range(rows):
        a, b = rng.uniform(-1, 1), rng.uniform(-1, 1)
        lines.append(f"{a:.4f},{b:.4f},{int(a + 0.5 * b > 0)}")
    return ("\n".join(lines) + "\n").encode()


def test_retrain_a_finished_job_by_morning_and_compare(page, system, tmp_path):
    spec = {
        "name": "lines",
        "recipe": "classifier",
        "gpus": 1,
        "span_hours": 1,
        "config": {"max_steps": 30, "eval_every": 10, "batch_size": 32, "hidden": 16},
    }
    response = system.api(
        "POST",
        "/api/jobs/",
        data={"spec": json.dumps(spec)},
        files=[("data", ("part-0.csv", table(200, 1))), ("heldout", ("test.csv", table(300, 2)))],
    )
    assert response.status_code == 201, response.text
    base = system.wait_for_state(response.json()["id"])
    assert base["state"] == "succeeded", (base["reason"], system.logs())

    log_in(page)
    page.goto(f"/jobs/{base['id']}/")
    page.locator("#retrain-link").click()
    expect(page.locator("h1")).to_contain_text("Retrain lines")
    expect(page.locator("#old-files")).to_contain_text("part-0.csv")
    expect(page.locator("#id_span_hours")).to_have_value("1")
    new_file = tmp_path / "part-1.csv"
    new_file.write_bytes(table(400, 3))
    page.set_input_files("#id_data", str(new_file))
    page.select_option("#id_by", "morning")
    page.fill("#id_name", "lines, retrained overnight")
    shot(page, "retrain-form.png")
    page.get_by_role("button", name="Submit retraining").click()

    expect(page.locator("h1")).to_contain_text("lines, retrained overnight")
    expect(page.locator("#job-kind")).to_contain_text("Fine-tune")
    expect(page.locator("#job-parent")).to_contain_text("lines")
    expect(page.locator(".job-model")).to_contain_text("model.safetensors")
    retrained_id = page.url.rstrip("/").rsplit("/", 1)[-1]
    retrained = system.wait_for_state(retrained_id)
    assert retrained["state"] == "succeeded", (retrained["reason"], system.logs())
    assert retrained["deadline"] is not None and retrained["deadline"].endswith(("08:00:00Z", "08:00:00+00:00"))
    page.reload()
    shot(page, "retrained-job.png")

    page.get_by_role("button", name="Compare with previous").click()
    expect(page.locator("#job-kind")).to_contain_text("Evaluate")
    comparison_id = page.url.rstrip("/").rsplit("/", 1)[-1]
    done = system.wait_for_state(comparison_id)
    assert done["state"] == "succeeded", (done["reason"], system.logs())
    page.reload()
    expect(page.locator("#verdict")).to_contain_text("McNemar")
    expect(page.locator("#comparison-table")).to_contain_text("new")
    shot(page, "comparison.png")
    verdict = system.browser_session().get(f"/jobs/{comparison_id}/comparison.json").json()["verdict"]
    assert verdict["verdict"] in ("better", "worse", "no significant difference") and verdict["n"] == 300
