"""The job pages in a real browser: Chromium, driven by Playwright, against a live system.

Log in, fill the new-job form with the digits example (watching the htmx cost estimate follow
the request), submit it, and watch the job page live: log lines and meter ticks over the
websocket, the state badge, and the output files listed when the job ends. Also a refused form:
the error shows next to the field and the uploaded script is kept, so it need not be sent again.

Screenshots go to test-artifacts/ at the repository root (git-ignored).
"""

import re
import time

import pytest
from playwright.sync_api import expect

from tests.browser import log_in, shot
from tests.system import ROOT

pytestmark = [pytest.mark.browser, pytest.mark.timeout(300)]

EXAMPLE = ROOT / "examples" / "digits" / "train.py"
# 300 epochs keep the job running for several seconds on a 2-core machine (30 take about half a
# second after the imports), long enough to read the meter twice while it runs.
CONFIG = "epochs: 300\n"
JOB_URL = re.compile(r"/jobs/[0-9a-f-]{36}/$")


@pytest.fixture(scope="module")
def system(runner_system):
    return runner_system


def open_new_job(page):
    page.get_by_role("navigation").get_by_role("link", name="New job").click()
    expect(page).to_have_url(re.compile(r"/jobs/new/$"))
    expect(page.get_by_role("heading", name="New training job")).to_be_visible()


def fill_work_and_data(page, gpus, span_hours):
    page.fill("#id_name", "digits-browser")
    page.set_input_files("#id_code", EXAMPLE)
    page.fill("#id_config", CONFIG)
    page.select_option("#id_train_dataset", label="digits")
    page.select_option("#id_heldout_dataset", label="digits-heldout")
    page.fill("#id_gpus", str(gpus))
    page.fill("#id_span_hours", str(span_hours))


def held_seconds(text):
    hours, minutes, seconds = (int(part) for part in text.strip().split(":"))
    return hours * 3600 + minutes * 60 + seconds


def amount(text):
    currency, value = text.strip().split(" ", 1)
    assert currency == "USD", text
    return float(value.replace(",", ""))


def test_a_refused_form_keeps_the_uploaded_script(page):
    log_in(page)
    open_new_job(page)
    fill_work_and_data(page, gpus=0, span_hours=0.25)
    page.get_by_role("button", name="Submit job").click()

    # Back on the form, with the error next to the GPUs field.
    expect(page.locator("#field-gpus")).to_have_class(re.compile(r"\bhas-error\b"))
    expect(page.locator("#field-gpus .error")).to_have_text("Ask for at least 1 GPU.")
    # The script is kept, ticked, so it need not be uploaded again.
    kept = page.locator('input[type="checkbox"][name="kept_code"]')
    expect(kept).to_have_count(1)
    expect(kept).to_be_checked()
    expect(page.locator("ul.kept")).to_contain_text("train.py")
    # What was entered is still there.
    expect(page.locator("#id_train_dataset option:checked")).to_have_text("digits")
    expect(page.locator("#id_heldout_dataset option:checked")).to_have_text("digits-heldout")
    expect(page.locator("#id_gpus")).to_have_value("0")
    expect(page.locator("#id_config")).to_have_value(re.compile(r"epochs: 300"))
    shot(page, "new-job-refused.png")


def test_submit_the_digits_example_and_watch_it_run(page, system):
    log_in(page)
    open_new_job(page)

    # The estimate for the form's defaults (1 GPU x 1 h at the demo's USD 2.50), then following the GPUs.
    estimate = page.locator("#estimate")
    expect(estimate).to_contain_text("USD 2.50")
    page.fill("#id_gpus", "2")
    expect(estimate).to_contain_text("USD 5.00")
    expect(estimate).to_contain_text("2 GPUs")
    expect(estimate).to_contain_text("USD 2.50 per GPU-hour")

    # The real request: 1 GPU for half an hour, USD 1.25 at most.
    fill_work_and_data(page, gpus=1, span_hours=0.5)
    with page.expect_response(lambda response: response.url.endswith("/jobs/estimate/")):
        page.locator("#id_span_hours").blur()  # a change event: the estimate is asked for once more
    expect(estimate).to_contain_text("USD 1.25")
    expect(estimate).to_contain_text("1 GPU ×")
    expect(estimate).to_contain_text("0.5 h")
    shot(page, "new-job-estimate.png")

    page.get_by_role("button", name="Submit job").click()
    expect(page).to_have_url(JOB_URL, timeout=60_000)
    expect(page.locator(".flash")).to_contain_text("submitted")
    expect(page.get_by_role("heading", level=1)).to_contain_text("digits-browser")

    # Live: log lines arrive, and the meter runs while the job does.
    state = page.locator("#job-state")
    log = page.locator("#log")
    expect(log).to_contain_text("epoch", timeout=120_000)
    expect(state).to_have_text("Running", timeout=30_000)
    held, cost = page.locator("#meter-held"), page.locator("#meter-amount")
    first = (held.inner_text(), cost.inner_text())
    time.sleep(2)
    second = (held.inner_text(), cost.inner_text())
    expect(state).to_have_text("Running", timeout=1_000)
    shot(page, "job-running.png")
    assert held_seconds(second[0]) > held_seconds(first[0]), (first, second)
    assert amount(second[1]) > amount(first[1]), (first, second)
    expect(page.locator("#meter-note")).to_contain_text("Running: 1 device at USD 2.50 per GPU-hour")
    # The metrics' header follows the meter (no credit here): it was written once, at load.
    expect(page.locator("#metrics-cost-label")).to_have_text("cost so far")
    expect(page.locator("#metrics-cost-amount")).not_to_have_text("USD 0.0000")

    # The end: the badge, the last log line, the meter stopped, and the output listed.
    expect(state).to_have_text("Succeeded", timeout=180_000)
    expect(log).to_contain_text("epoch 300/300")
    expect(log).to_contain_text("done:")
    expect(page.locator("#meter-note")).to_have_text("Stopped: compute released.")
    expect(page.locator("#metrics-cost-label")).to_have_text("final cost")
    expect(page.locator("#metrics-cost-amount")).to_have_text(cost.inner_text())
    expect(page.locator("#cancel-form")).to_have_count(0)
    artifacts = page.locator("#artifacts")
    expect(artifacts.get_by_role("link", name="model.pt")).to_be_visible(timeout=30_000)
    expect(artifacts.get_by_role("link", name="metrics.json")).to_be_visible()
    shot(page, "job-finished.png")
