"""The operator's pool page in a real browser: a burst of refusals from one address (failed
sign-ins, another team's ids asked for) shows as a row of its own, busiest first, linking to the
audit log filtered by that address; Slurm's nodes and an allocation off its accounting. Screenshots:
test-artifacts/ops-refusals.png, ops-slurm.png."""

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


# Two nodes of a Slurm cluster, as the scheduler reads them with E31_EXECUTOR=slurm: one whose
# CPUs other users' jobs hold (nothing free: the shared system's scheduler places nothing
# there), one drained; and a finished allocation billed 6 s more than Slurm's accounting says.
SLURM = """
    from datetime import timedelta
    from decimal import Decimal
    from django.contrib.auth import get_user_model
    from django.utils import timezone
    from accounts.models import Membership, Team
    from jobs.models import Job
    from scheduler.models import Allocation, Node

    now = timezone.now()
    busy = Node.objects.create(name="slurm-c1", device_type="cpu", devices=8, executor="slurm", busy_elsewhere=8, engine_state="up", last_heartbeat=now)
    Node.objects.create(name="slurm-c2", device_type="cpu", devices=8, executor="slurm", engine_state="drained", engine_reason="bad fan", last_heartbeat=now)
    team = Team.objects.create(name="Slurm users")
    user = get_user_model().objects.create_user("slurmer", "slurmer@example.com", "slurm-password")
    Membership.objects.create(user=user, team=team)
    job = Job.objects.create(team=team, created_by=user, name="run-on-slurm", entrypoint="train.py", gpus=1, state="succeeded")
    started = now - timedelta(hours=1)
    Allocation.objects.create(
        job=job, node=busy, devices=[0], device_type="cpu", rate=Decimal("2.40"), started_at=started,
        ended_at=started + timedelta(seconds=306), end_reason="exited", engine_handle="4242", engine_seconds=300.0,
    )
"""


# The shared system's other tests must not see these nodes (a queued job's reason, say).
SLURM_GONE = """
    from accounts.models import Team
    from jobs.models import Job
    from scheduler.models import Allocation, Node

    Allocation.objects.filter(node__executor="slurm").delete()
    Job.objects.filter(team__name="Slurm users").delete()
    Node.objects.filter(executor="slurm").delete()
"""


@pytest.fixture
def slurm_nodes(system):
    system.manage("shell", "-c", textwrap.dedent(SLURM))
    yield
    system.manage("shell", "-c", textwrap.dedent(SLURM_GONE))


def test_the_pool_page_shows_slurms_nodes_and_an_allocation_off_its_accounting(page, system, slurm_nodes):
    page.goto("/accounts/login/")
    page.fill("#id_username", "operator")
    page.fill("#id_password", "operator-e31")
    page.get_by_role("button", name="Log in").click()
    expect(page.locator("h1")).to_contain_text("The pool")
    busy = page.locator('tr[data-node="slurm-c1"]')
    expect(busy).to_contain_text("(slurm)")
    expect(busy).to_contain_text("+ 8 others'")
    expect(busy).to_contain_text("read from slurm")
    drained = page.locator('tr[data-node="slurm-c2"]')
    expect(drained).to_contain_text("drained")
    expect(drained).to_contain_text("bad fan")
    section = page.locator("#ops-engine")
    expect(section.locator("tbody tr")).to_have_count(1)
    expect(section).to_contain_text("4242")
    expect(section).to_contain_text("6.0")
    page.locator("#ops-nodes").scroll_into_view_if_needed()
    shot(page, "ops-slurm.png")
