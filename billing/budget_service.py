"""Budgets and rates over the database: the rates in force, what a team's month has spent, which
jobs its budget holds back, and the budget alerts. The decisions come from billing.budgets and
billing.meter (pure); the scheduler asks this module before it places a job, and the usage page
shows its figures.

Billing does not import the scheduler (the scheduler builds on billing): the running allocations
a month's spend counts are reached through the ledger's own relation to them
(UsageRecord.allocation)."""

from datetime import UTC
from decimal import Decimal

from django.conf import settings
from django.db.models import DateField, Sum, UUIDField
from django.urls import reverse
from django.utils import timezone

from accounts.models import Team
from billing import budgets, meter, statements
from billing.models import Credit, NoRateInForce, Rate, UsageRecord
from core.compiled import Param, Read
from notifications import events as notify
from notifications import policy as notify_policy
from notifications.models import Notification


class Rates:
    """The rates in force, looked up once per cycle per device type."""

    def __init__(self, now):
        self.now = now
        self.cache = {}

    def for_job(self, job):
        """The rate the job pays on devices of its type (the highest, when it takes any type)."""
        return self.for_type(job.gpu_type, job.preemptible, any_type=not job.gpu_type)

    def for_type(self, device_type, preemptible, any_type=False):
        """The rate on devices of a type; None when no rate is in force."""
        key = (device_type, preemptible, any_type)
        if key not in self.cache:
            try:
                rate = Rate.objects.worst_case(self.now) if any_type else Rate.objects.in_force(device_type, self.now)
                self.cache[key] = rate.for_job(preemptible)
            except NoRateInForce:
                self.cache[key] = None
        return self.cache[key]


def remaining_allowance(job, rate):
    """What is left of the job's span or ceiling after its earlier allocations (if requeued).
    Time credited for the network's faults is given back: it was not billed."""
    held_before, spent_before = job.held()
    credit_seconds, credit_amount = job.credited()
    return meter.remaining_allowance(job.meter_request(), rate, max(0, held_before - credit_seconds), max(Decimal(0), spent_before - credit_amount))


def _held_now(team_ids):
    """The usage records of these teams' allocations holding devices now: those still
    the live meter's (provisional), written when each started and made final when it ends."""
    return UsageRecord.ledger.filter(provisional=True, team_id__in=team_ids).select_related("allocation")


def _sums(model, **lookup):
    """(team id, summed amount) of the model's rows (usage records, credits) matching lookup."""
    return model.objects.filter(**lookup).values("team_id").annotate(a=Sum("amount")).values_list("team_id", "a")


# month_spend's reads for one team (core.compiled): what it was billed in a month and credited,
# and its records the live meter still holds.
TEAM_SPENT, TEAM_CREDITED = (
    Read(lambda model=model: _sums(model, team_id=Param("team", UUIDField()), period=Param("period", DateField()))) for model in (UsageRecord, Credit)
)
TEAM_HELD = Read(lambda: UsageRecord.ledger.filter(provisional=True, team_id=Param("team", UUIDField())).select_related("allocation"))


def month_spend(team_ids, now=None):
    """{team id: billing.budgets.Spend} for the calendar month (UTC) of `now`: released usage
    billed this month, and what the allocations running now have cost so far and may cost in
    all (an allocation that nothing bounds counts what it cost so far)."""
    now = now or timezone.now()
    utc = now.astimezone(UTC)
    start, _end = statements.month_bounds(utc.year, utc.month)
    team_ids = [str(team) for team in team_ids]
    period = start.date()
    if len(team_ids) == 1:  # one team's page or estimate: the same three reads, their SQL made once
        team = team_ids[0]
        spent, credits, held = TEAM_SPENT(team=team, period=period), TEAM_CREDITED(team=team, period=period), TEAM_HELD(team=team)
    else:
        spent, credits = (_sums(model, team_id__in=team_ids, period=period) for model in (UsageRecord, Credit))
        held = _held_now(team_ids)
    released = {str(team): amount or Decimal(0) for team, amount in spent}
    for team, credit in credits:
        released[str(team)] = released.get(str(team), Decimal(0)) - (credit or Decimal(0))
    so_far, worst = {}, {}
    for record in held:
        team, allocation = str(record.team_id), record.allocation
        spent = allocation.meter(now)[1]
        most = budgets.worst_case(allocation.gpus, allocation.rate, allocation.limit_seconds, allocation.cost_cap)
        so_far[team] = so_far.get(team, Decimal(0)) + spent
        worst[team] = worst.get(team, Decimal(0)) + (spent if most is None else max(most, spent))
    return {
        team: budgets.Spend(
            released=released.get(team, Decimal(0)),
            running_so_far=so_far.get(team, Decimal(0)),
            running_worst_case=worst.get(team, Decimal(0)),
        )
        for team in team_ids
    }


def notify_budgets(now=None):
    """Tell each team with a budget when its month's spend so far reaches 80% and 100% of it:
    once per team, month and threshold (the once-only keys hold that across schedulers)."""
    now = now or timezone.now()
    team_budgets = dict(Team.objects.filter(monthly_budget__isnull=False).values_list("pk", "monthly_budget"))
    if not team_budgets:
        return []
    utc = now.astimezone(UTC)
    spends = month_spend(team_budgets, now)
    keys = {
        notify_policy.budget_key(team, utc.year, utc.month, threshold): (str(team), threshold)
        for team in team_budgets
        for threshold in notify_policy.BUDGET_THRESHOLDS
    }
    told = {}
    for key in Notification.objects.filter(key__in=list(keys)).values_list("key", flat=True):
        team, threshold = keys[key]
        told.setdefault(team, set()).add(threshold)
    sent = []
    for team_id, budget in team_budgets.items():
        spent = spends[str(team_id)].so_far
        threshold = notify_policy.budget_alert(spent, budget, told.get(str(team_id), set()))
        if threshold is None:
            continue
        team = Team.objects.get(pk=team_id)
        kind = notify_policy.BUDGET_100 if threshold >= 100 else notify_policy.BUDGET_80
        status = budgets.status(budget, spends[str(team_id)])
        notification = notify.emit(
            kind,
            team=team,
            once=notify_policy.budget_key(team_id, utc.year, utc.month, threshold),
            at=now,
            data={
                "threshold": threshold,
                "percent": status.percent,
                "spent": meter.round_money(spent),
                "budget": budget,
                "currency": settings.E31_CURRENCY,
                "month": f"{utc.year:04d}-{utc.month:02d}",
                "url": notify.site_url(reverse("billing:usage")),
            },
        )
        if notification is not None:
            sent.append(notification)
    return sent


def budget_status(team, now=None):
    """The team's budget and this month's spend (billing.budgets.Status)."""
    now = now or timezone.now()
    return budgets.status(team.monthly_budget, month_spend([team.pk], now)[str(team.pk)])
