"""What a request as filled in would mean before it is submitted: when it would run behind
today's queue, and what the team's budget leaves for it (the new-job page and the API's estimate)."""

from billing.budget_service import budget_status
from jobs.compute import compute


def budget_left(team, worst_case):
    """What the team's monthly budget leaves for new jobs, and whether the request's worst case
    fits in it (the scheduler holds it back when it does not)."""
    if team.monthly_budget is None:
        return {}
    remaining = budget_status(team).remaining
    return {"budget_remaining": remaining, "over_budget": worst_case > remaining}


def prediction(team, form):
    """When the request as filled in would start and finish behind today's queue, and whether
    that misses its deadline."""
    cleaned = form.cleaned_data
    start, finish = compute().predict(
        team,
        form.meter_request(),
        gpu_type=cleaned.get("gpu_type") or "",
        not_before=cleaned.get("not_before"),
        deadline=cleaned.get("deadline"),
        preemptible=bool(cleaned.get("preemptible")),
        rate=form.rate,
    )
    deadline = cleaned.get("deadline")
    return {
        "predicted_start": start,
        "predicted_finish": finish,
        "deadline_at_risk": deadline is not None and (finish is None or finish > deadline),
    }
