"""Budget holds: the jobs the scheduler must not start now because their worst case would take
their team's spend this month past its budget. The decision is billing.budgets.hold_back (pure);
the spend and the rates come from billing.budget_service."""

from django.conf import settings

from billing import budgets, meter
from billing.budget_service import Rates, month_spend, remaining_allowance
from jobs.models import Job


def budget_holds(entries, now, cumulative=True):
    """{job id: why it waits} for the jobs that must not start because their worst case would
    take their team's spend this month past its budget (see billing.budgets).

    entries: (job id, device type of the node it would start on, or None when not known yet: the
    rate of the job's type, the highest when it takes any type), in the order they would start.
    Only jobs of teams with a budget are looked at."""
    ids = [job_id for job_id, _ in entries]
    jobs = {str(job.pk): job for job in Job.objects.filter(pk__in=ids, team__monthly_budget__isnull=False).select_related("team")}
    if not jobs:
        return {}
    team_budgets = {str(job.team_id): job.team.monthly_budget for job in jobs.values()}
    spends = month_spend(team_budgets, now)
    rates = Rates(now)
    candidates = []
    for job_id, device_type in entries:
        job = jobs.get(job_id)
        if job is None:
            continue
        rate = rates.for_job(job) if device_type is None else rates.for_type(device_type, job.preemptible)
        if rate is None:
            continue  # it cannot start anyway; placing it tells why
        if job.restarts:
            limit, cap = remaining_allowance(job, rate)  # a requeued job: what is left of it
        else:
            limit, cap = meter.remaining_allowance(job.meter_request(), rate)
        candidates.append(budgets.Candidate(job_id, str(job.team_id), budgets.worst_case(job.gpus, rate, limit, cap)))
    return budgets.hold_back(candidates, team_budgets, spends, settings.E31_CURRENCY, cumulative=cumulative)
