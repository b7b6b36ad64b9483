"""Monthly team budgets: the pure decision, the scheduler holding jobs back, the billing page's
warnings and form, the API; and the cost of each job on its page and in the sorted job list."""

from datetime import timedelta
from decimal import Decimal

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

from billing import budgets
from billing.models import Credit, UsageRecord
from jobs.models import Job
from scheduler import allocations, predictions
from scheduler.models import Allocation, Node
from tests.conftest import make_job, schedule_now

D = Decimal


# The pure function ---------------------------------------------------------------------------


def test_the_worst_case_is_the_limit_at_the_rate_capped():
    assert budgets.worst_case(2, D("2.40"), limit_seconds=9000) == D("12.00")  # 2 GPUs x 2.5 h x 2.40
    assert budgets.worst_case(2, D("2.40"), limit_seconds=9000, cost_cap=D("5")) == D("5")
    assert budgets.worst_case(1, D("2.40"), cost_cap=D("7.5")) == D("7.5")
    assert budgets.worst_case(1, D("2.40")) is None


def test_a_job_past_the_budget_is_held_back_with_the_reason():
    spends = {"A": budgets.Spend(released=D("90"), running_so_far=D("1"), running_worst_case=D("3"))}
    held = budgets.hold_back([budgets.Candidate("j1", "A", D("12"))], {"A": D("100")}, spends)
    assert held == {"j1": "held back: its worst case of USD 12.00 would take this month's spend to USD 105.00, past the team's budget of USD 100.00"}


def test_jobs_under_the_budget_or_without_one_start():
    spends = {"A": budgets.Spend(released=D("90"))}
    candidates = [budgets.Candidate("j1", "A", D("10")), budgets.Candidate("j2", "B", D("1000"))]
    assert budgets.hold_back(candidates, {"A": D("100"), "B": None}, spends) == {}


def test_two_jobs_cannot_both_squeeze_under():
    candidates = [budgets.Candidate("j1", "A", D("6")), budgets.Candidate("j2", "A", D("6")), budgets.Candidate("j3", "A", D("4"))]
    held = budgets.hold_back(candidates, {"A": D("10")}, {})
    assert set(held) == {"j2"}  # j1 takes 6 of 10; j2 would make 12; j3 fits in what is left
    assert set(budgets.hold_back(candidates, {"A": D("10")}, {}, cumulative=False)) == set()


def test_an_unbounded_job_is_held_back_under_a_budget():
    held = budgets.hold_back([budgets.Candidate("j1", "A", None)], {"A": D("100")}, {})
    assert "no span or ceiling" in held["j1"]


def test_the_spend_counts_what_running_jobs_may_still_cost():
    spend = budgets.Spend(released=D("10"), running_so_far=D("2"), running_worst_case=D("5"))
    assert spend.so_far == D("12") and spend.committed == D("15")


@pytest.mark.parametrize("spent,level", [("0", ""), ("79.99", ""), ("80", "warning"), ("99.99", "warning"), ("100", "over"), ("150", "over")])
def test_warnings_at_80_and_100_percent(spent, level):
    status = budgets.status(D("100"), budgets.Spend(released=D(spent)))
    assert status.level == level
    assert status.bar_percent <= 100


def test_without_a_budget_there_is_no_warning():
    status = budgets.status(None, budgets.Spend(released=D("1000")))
    assert status.level == "" and status.percent is None and status.remaining is None


# Through the scheduler -------------------------------------------------------------------------


@pytest.fixture
def node(db):
    return Node.objects.create(name="n1", device_type="cpu", devices=4)


def spent_this_month(job, amount, credit="0"):
    """A released allocation of the (then succeeded) job, billed `amount` (less `credit`), ended now."""
    Job.objects.filter(pk=job.pk).update(state="succeeded", finished_at=timezone.now())
    old = Node.objects.create(name=f"old-{job.pk}", device_type="cpu", devices=1, stopped_at=timezone.now())
    ended = timezone.now()
    allocation = Allocation.objects.create(
        job=job,
        node=old,
        devices=[0],
        device_type="cpu",
        rate=D("2.40"),
        started_at=ended - timedelta(hours=1),
        ended_at=ended,
        end_reason="exited",
    )
    usage = UsageRecord.objects.create(
        team=job.team,
        job=job,
        allocation=allocation,
        gpu_type="cpu",
        gpus=1,
        started_at=allocation.started_at,
        ended_at=ended,
        held_seconds=3600,
        rate=D("2.40"),
        amount=D(amount),
    )
    if D(credit):
        Credit.objects.create(team=job.team, job=job, usage=usage, seconds=1, amount=D(credit), reason="node lost")
    return usage


def set_budget(team, amount):
    team.monthly_budget = None if amount is None else D(amount)
    team.save()


def test_a_team_budget_holds_a_job_back(alice, team_a, rate, node):
    spent_this_month(make_job(alice, name="earlier"), "95", credit="2")  # billed 93
    set_budget(team_a, "100")
    job = make_job(alice, name="big", gpus=2, span_hours=D("2.5"))  # worst case 2 x 2.5 h x 2.40 = 12.00
    assert schedule_now() == []
    job.refresh_from_db()
    assert job.state == "queued"
    assert job.wait_reason == ("held back: its worst case of USD 12.00 would take this month's spend to USD 105.00, past the team's budget of USD 100.00")
    # Held back, it has no start to predict.

    predictions.update_predictions()
    job.refresh_from_db()
    assert job.predicted_start is None and job.predicted_finish is None
    # Another team, without a budget, is not held back by team A's.
    set_budget(team_a, None)
    [allocation] = schedule_now()
    assert allocation.job_id == job.pk


def test_a_job_that_fits_under_the_budget_starts(alice, team_a, rate, node):
    spent_this_month(make_job(alice, name="earlier"), "93")
    set_budget(team_a, "100")
    job = make_job(alice, name="small", gpus=2, span_hours=D("1"))  # 4.80: 97.80 of 100
    [allocation] = schedule_now()
    assert allocation.job_id == job.pk


def test_running_jobs_count_with_their_worst_case(alice, team_a, rate, node):
    set_budget(team_a, "5")
    first, second, third = (make_job(alice, name=n) for n in ("first", "second", "third"))  # 2.40 each
    placed = schedule_now()
    assert {a.job_id for a in placed} == {first.pk, second.pk}  # 4.80; the third would make 7.20
    third.refresh_from_db()
    assert third.state == "queued" and "would take this month's spend to USD 7.20" in third.wait_reason
    # The next cycle: the two running jobs have cost nearly nothing yet, but may still cost 4.80.
    assert schedule_now() == []
    third.refresh_from_db()
    assert "USD 7.20, past the team's budget of USD 5.00" in third.wait_reason


def test_a_requeued_job_counts_what_is_left_of_it(alice, team_a, rate, node):
    job = make_job(alice, name="resumed", span_hours=D("2"))  # 4.80 in all
    [allocation] = schedule_now()
    Allocation.objects.filter(pk=allocation.pk).update(started_at=timezone.now() - timedelta(hours=1))
    allocation.refresh_from_db()
    # Back to the queue after an hour, billed (no credit): 2.40 spent, an hour (2.40) left of its span.
    allocations.end_allocation(allocation, timezone.now(), Allocation.EXITED, "queued", "requeued")
    job.refresh_from_db()
    assert job.state == "queued" and job.usage.get().amount == D("2.40")
    set_budget(team_a, "4.79")
    assert schedule_now() == []
    job.refresh_from_db()
    assert "worst case of USD 2.40 would take this month's spend to USD 4.80" in job.wait_reason
    set_budget(team_a, "4.80")  # 2.40 spent + 2.40 left fits; the whole span again (7.20) would not
    [again] = schedule_now()
    assert again.job_id == job.pk


# The billing page ----------------------------------------------------------------------------


def test_the_billing_page_warns_at_80_percent(client, alice, team_a, rate, node):
    set_budget(team_a, "10")
    spent_this_month(make_job(alice, name="earlier"), "8.50")
    client.force_login(alice)
    page = client.get(reverse("billing:usage")).content.decode()
    assert 'id="budget-spent">USD 8.50<' in page and 'id="budget-amount">USD 10.00<' in page
    assert 'id="budget-warning"' in page and "85%" in page and "past 80%" in page
    assert 'style="width: 85%' in page


def test_the_billing_page_shows_100_percent_with_a_running_job_s_cost_so_far(client, alice, team_a, rate, node):
    spent_this_month(make_job(alice, name="earlier"), "8.50")
    make_job(alice, name="running", span_hours=D("2"))
    [allocation] = schedule_now()
    Allocation.objects.filter(pk=allocation.pk).update(started_at=timezone.now() - timedelta(minutes=40))  # 1.60 so far
    set_budget(team_a, "10")
    client.force_login(alice)
    page = client.get(reverse("billing:usage")).content.decode()
    assert 'id="budget-spent">USD 10.10<' in page
    assert "spent 100% or more of its budget" in page and "background: var(--bad)" in page


def test_without_a_budget_the_page_says_so(client, alice, rate):
    client.force_login(alice)
    page = client.get(reverse("billing:usage")).content.decode()
    assert 'id="budget-none"' in page and 'id="budget-warning"' not in page


def test_the_owner_sets_and_clears_the_budget(client, alice, team_a):
    client.force_login(alice)
    page = client.get(reverse("billing:usage")).content.decode()
    assert 'id="budget-form"' in page
    response = client.post(reverse("billing:usage"), {"budget": "250.50"})
    assert response.status_code == 302
    team_a.refresh_from_db()
    assert team_a.monthly_budget == D("250.50")
    assert 'id="budget-amount">USD 250.50<' in client.get(reverse("billing:usage")).content.decode()
    client.post(reverse("billing:usage"), {"budget": ""})
    team_a.refresh_from_db()
    assert team_a.monthly_budget is None


def test_a_bad_budget_is_a_form_error(client, alice, team_a):
    client.force_login(alice)
    response = client.post(reverse("billing:usage"), {"budget": "-5"})
    assert response.status_code == 400 and 'class="error"' in response.content.decode()
    team_a.refresh_from_db()
    assert team_a.monthly_budget is None


def test_a_member_sees_the_budget_but_cannot_set_it(client, alice, bob, team_a):
    set_budget(team_a, "100")
    client.force_login(bob)
    page = client.get(reverse("billing:usage")).content.decode()
    assert 'id="budget-amount">USD 100.00<' in page and 'id="budget-form"' not in page
    assert client.post(reverse("billing:usage"), {"budget": "1000"}).status_code == 403
    team_a.refresh_from_db()
    assert team_a.monthly_budget == D("100")


def test_another_team_cannot_touch_the_budget(client, alice, charlie, team_a, team_b):
    set_budget(team_a, "100")
    client.force_login(charlie)  # the owner of team B sets team B's budget, never team A's
    assert client.post(reverse("billing:usage"), {"budget": "5", "team": str(team_a.pk)}).status_code == 302
    team_a.refresh_from_db()
    team_b.refresh_from_db()
    assert team_a.monthly_budget == D("100") and team_b.monthly_budget == D("5")
    assert "USD 100.00" not in client.get(reverse("billing:usage")).content.decode()


def test_the_api_gives_the_budget_and_the_spend(client, alice, team_a, rate, node):
    from rest_framework.authtoken.models import Token

    set_budget(team_a, "10")
    spent_this_month(make_job(alice, name="earlier"), "9", credit="0.5")
    key = Token.objects.create(user=alice).key
    budget = client.get(reverse("api:usage"), HTTP_AUTHORIZATION=f"Token {key}").json()["budget"]
    assert budget["monthly_budget"] == "10.00" and budget["spent"] == "8.50"
    assert budget["percent"] == 85 and budget["level"] == "warning" and budget["remaining"] == "1.50"


# Cost per experiment ---------------------------------------------------------------------------


def test_the_job_page_shows_the_cost_beside_the_metrics(client, alice, rate, node):
    job = make_job(alice, name="costed")
    [allocation] = schedule_now()
    client.force_login(alice)
    page = client.get(reverse("jobs:detail", args=[job.pk])).content.decode()
    # With the meter's four places: a running job's first minutes cost less than a cent.
    assert '<span id="metrics-cost-label">cost so far</span> <span id="metrics-cost-amount">USD 0.0000</span>' in page
    allocation.release(allocation.started_at + timedelta(seconds=600), "exited")  # 10 min x 2.40 = 0.40
    Job.objects.filter(pk=job.pk).update(state="succeeded")
    page = client.get(reverse("jobs:detail", args=[job.pk])).content.decode()
    assert '<span id="metrics-cost-label">final cost</span> <span id="metrics-cost-amount">USD 0.4000</span>' in page


def test_the_job_list_sorts_by_cost(client, alice, rate, node):
    cheap, dear, free = make_job(alice, name="cheap"), make_job(alice, name="dear"), make_job(alice, name="free-job")
    spent_this_month(cheap, "1")
    spent_this_month(dear, "30")
    Job.objects.filter(pk=free.pk).update(state="cancelled")
    running = make_job(alice, name="running", span_hours=D("10"))
    [allocation] = schedule_now()
    Allocation.objects.filter(pk=allocation.pk).update(started_at=timezone.now() - timedelta(hours=2))  # 4.80 so far
    client.force_login(alice)

    def order(page):
        names = ["dear", "running", "cheap", "free-job"]
        return sorted(names, key=lambda name: page.index(f">{name}</a>"))

    page = client.get(reverse("jobs:list") + "?sort=-cost").content.decode()
    assert order(page) == ["dear", "running", "cheap", "free-job"]
    assert f'href="{reverse("jobs:list")}?sort=cost"' in page
    page = client.get(reverse("jobs:list") + "?sort=cost").content.decode()
    assert order(page) == ["free-job", "cheap", "running", "dear"]
    # The htmx refresh keeps the sort.
    fragment = client.get(reverse("jobs:list") + "?sort=-cost", HTTP_HX_REQUEST="true").content.decode()
    assert fragment.startswith('<tbody id="job-rows"') and "?sort=-cost" in fragment
    assert order(fragment) == ["dear", "running", "cheap", "free-job"]
    # An unknown sort is the default order, newest first.
    page = client.get(reverse("jobs:list") + "?sort=bogus").content.decode()
    assert page.index(">running</a>") < page.index(">cheap</a>")
    assert str(running.pk)[:8] in page


def test_sorting_by_cost_is_not_a_query_per_job(client, alice, rate, node):
    client.force_login(alice)
    for i in range(2):
        spent_this_month(make_job(alice, name=f"a{i}"), str(i + 1))
    with CaptureQueriesContext(connection) as few:
        client.get(reverse("jobs:list") + "?sort=-cost")
    for i in range(5):
        spent_this_month(make_job(alice, name=f"b{i}"), str(i + 1))
    with CaptureQueriesContext(connection) as many:
        client.get(reverse("jobs:list") + "?sort=-cost")
    assert len(many) == len(few)


def test_the_form_shows_what_the_budget_leaves(client, alice, team_a, rate, node):
    spent_this_month(make_job(alice, name="earlier"), "95")
    client.force_login(alice)
    request = {"gpus": "1", "mode": "span", "span_hours": "1"}  # 2.40
    assert 'id="budget-left"' not in client.post(reverse("jobs:estimate"), request).content.decode()
    set_budget(team_a, "100")
    body = client.post(reverse("jobs:estimate"), request).content.decode()
    assert "This month's budget leaves USD 5.00 for new jobs." in body
    body = client.post(reverse("jobs:estimate"), {**request, "span_hours": "3"}).content.decode()  # 7.20
    assert "Over budget" in body and "USD 5.00" in body


def test_the_operator_sets_a_budget_in_the_admin(admin_client, team_a):
    url = reverse("admin:accounts_team_change", args=[team_a.pk])
    assert 'name="monthly_budget"' in admin_client.get(url).content.decode()
    data = {
        "name": team_a.name,
        "share": "1",
        "monthly_budget": "75.00",
        "memberships-TOTAL_FORMS": "0",
        "memberships-INITIAL_FORMS": "0",
        "memberships-MIN_NUM_FORMS": "0",
        "memberships-MAX_NUM_FORMS": "1000",
    }
    assert admin_client.post(url, data).status_code == 302
    team_a.refresh_from_db()
    assert team_a.monthly_budget == D("75.00")
