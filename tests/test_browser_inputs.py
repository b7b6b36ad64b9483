"""Named inputs in a real browser: a SageMaker-style script reads one channel from a dataset
(named on the form, "training: digits") and one from files added as an input of their own
("Add an input of files", named testing); the job runs and says what it read.
Screenshots: test-artifacts/named-inputs-form.png, named-inputs-job.png."""

import re

import pytest
from playwright.sync_api import expect

from tests.browser import log_in, shot

pytestmark = [pytest.mark.browser, pytest.mark.timeout(300)]

JOB_URL = re.compile(r"/jobs/[0-9a-f-]{36}/$")
SCRIPT = """\
import os
count = lambda channel: sum(len(open(os.path.join(channel, f)).read().splitlines()) for f in os.listdir(channel))
print(f"channels: training {count(os.environ['SM_CHANNEL_TRAINING'])} lines, testing {count(os.environ['SM_CHANNEL_TESTING'])} lines")
"""


@pytest.fixture(scope="module")
def system(runner_system):
    return runner_system


def test_an_input_of_files_is_added_on_the_form_and_read_as_a_channel(page, tmp_path):
    (tmp_path / "train.py").write_text(SCRIPT)
    (tmp_path / "probe.csv").write_text("x\n1\n2\n")
    log_in(page)
    page.goto("/jobs/new/")
    page.fill("#id_name", "channels-browser")
    page.set_input_files("#id_code", tmp_path / "train.py")
    page.fill("#id_inputs", "training: digits")
    page.get_by_role("button", name="Add an input of files").click()
    page.fill("#input-files .input-name", "testing")
    page.set_input_files("#input-files .input-files", tmp_path / "probe.csv")
    page.fill("#id_span_hours", "0.25")
    shot(page, "named-inputs-form.png")
    page.get_by_role("button", name="Submit job").click()
    expect(page).to_have_url(JOB_URL, timeout=60_000)
    expect(page.locator("#job-state")).to_have_text("Succeeded", timeout=180_000)
    expect(page.locator("#log")).to_contain_text("channels: training")
    expect(page.locator("#log")).to_contain_text("testing 3 lines")
    expect(page.locator(".job-input")).to_contain_text("digits@")
    shot(page, "named-inputs-job.png")
