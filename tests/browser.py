"""Browser tests' common parts: Debian's Chromium driven by Playwright (one for the session),
a page per test (a context of its own) that keeps a screenshot, the browser console and the
system's logs when the test fails, and the live systems the browser tests share.

Test modules define their own `system`: one of the shared systems (web_system, runner_system),
or one of their own where a test needs something no other does. Tests on a shared system keep to
their own names (jobs, datasets), so that what one leaves behind is not what another looks at.
"""

import contextlib

import pytest
from playwright.sync_api import expect, sync_playwright

from tests.system import ROOT, LiveSystem

SHOTS = ROOT / "test-artifacts"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]


# The smallest chunk S3 takes: the dataset upload tests' files stay small.
UPLOAD_CHUNK_BYTES = 5 * 1024 * 1024


@pytest.fixture(scope="session")
def web_system():
    """The web server and the scheduler, no runner (no job runs), with 5 MiB upload chunks."""
    live = LiveSystem(env={"E31_UPLOAD_CHUNK_BYTES": str(UPLOAD_CHUNK_BYTES)})
    try:
        live.start(runner=False)
        yield live
    finally:
        live.stop()


@pytest.fixture(scope="session")
def runner_system():
    """The web server, the scheduler and a runner with two devices, for tests that run jobs."""
    with LiveSystem(devices=2) as live:
        yield live


@pytest.fixture(scope="session")
def browser():
    SHOTS.mkdir(exist_ok=True)
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser, system, request):
    context = browser.new_context(base_url=system.url, viewport={"width": 1280, "height": 900})
    context.set_default_timeout(30_000)
    page = context.new_page()
    console = []
    page.on("console", lambda message: console.append(f"{message.type}: {message.text}"))
    page.on("pageerror", lambda error: console.append(f"pageerror: {error}"))
    failures_before = request.session.testsfailed
    yield page
    if request.session.testsfailed > failures_before:  # this test failed: keep what helps to see why
        with contextlib.suppress(Exception):
            page.screenshot(path=SHOTS / f"failed-{request.node.name}.png", full_page=True)
        print("browser console:", *console, sep="\n  ")
        for name, text in system.logs().items():
            print(f"----- {name} log -----\n{text}")
    context.close()


def log_in(page):
    page.goto("/accounts/login/")
    page.fill("#id_username", "demo")
    page.fill("#id_password", "demo-e31")
    page.get_by_role("button", name="Log in").click()
    expect(page.locator(".topbar .who")).to_contain_text("demo")


def shot(page, name):
    """A full-page screenshot into test-artifacts/.

    Chromium takes it by resizing the viewport, and on the next input scrolls the focused field
    back into view, which can move a button from under a click: so nothing stays focused."""
    page.evaluate("document.activeElement?.blur()")
    page.screenshot(path=SHOTS / name, full_page=True)
