"""The operator's pool page in a real browser: a burst of refusals from one address (failed
sign-ins, another team's ids asked for) shows as a row of its own, busiest first, linking to the
audit log filtered by that address. Screenshot: test-artifacts/ops-refusals.png."""

import textwrap

import pytest
from playwright.sync_api import expect

from tests.browser import shot

pytestmark = [pytest.mark.browser, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def system(web_system):
    return web_system


# Written as the actions write them (accounts/audit.py), from two addresses: real failed
# sign-ins from the browser would lock the shared system's own address out.
BURST = """
    from accounts import audit
    from accounts.models import AuditEvent, Team

    team = Team.objects.get(memberships__user__username="demo")
    for _ in range(12):
        audit.append(None, "signin.fail", actor="mallory", team=None, via="web", ip="198.51.100.7", label="mallory")
    for _ in range(3):
        audit.append(None, "object.foreign", actor="mallory", team=team, via="api", ip="198.51.100.7", ref=("job", "0"))
    audit.append(None, "csrf.fail", actor="someone", team=None, via="web", ip="192.0.2.44", label="CSRF token missing")
"""


def test_the_pool_page_shows_a_burst_of_refusals_by_address(page, system):
    system.manage("shell", "-c", textwrap.dedent(BURST))
    page.goto("/accounts/login/")
    page.fill("#id_username", "operator")
    page.fill("#id_password", "operator-e31")
    page.get_by_role("button", name="Log in").click()
    # The operator is on no team: signing in lands on the pool's page, not a team's jobs (a 404).
    expect(page.locator(".topbar .who")).to_contain_text("operator")
    expect(page.locator("h1")).to_contain_text("The pool")
    section = page.locator("#ops-refusals")
    rows = section.locator("tbody tr")
    expect(rows.first).to_have_attribute("data-ip", "198.51.100.7")
    expect(rows.first).to_contain_text("15")
    expect(rows.first).to_contain_text("signin.fail 12")
    expect(rows.first).to_contain_text("object.foreign 3")
    expect(section.locator('tr[data-ip="192.0.2.44"]')).to_contain_text("csrf.fail 1")
    section.scroll_into_view_if_needed()
    shot(page, "ops-refusals.png")
    page.locator('tr[data-ip="198.51.100.7"] a').click()
    assert "ip=198.51.100.7" in page.url or page.wait_for_url("**ip=198.51.100.7**") is None
    expect(page.locator("#result_list")).to_contain_text("mallory")
