from django.conf import settings
from django.utils import timezone
from rest_framework.decorators import api_view
from rest_framework.exceptions import ValidationError
from rest_framework.response import Response

from accounts.access import require_team
from billing import meter, statements
from billing.budget_service import budget_status
from billing.usage import month_of
from core.api import page_of


def record_json(r, times):
    started_at, ended_at = times[r.id]
    return {
        "job_id": r.job_id,
        "started_at": started_at,
        "ended_at": ended_at,
        "gpus": r.gpus,
        "gpu_type": r.gpu_type,
        "held_seconds": r.held_seconds,
        "rate": str(r.rate),
        "amount": str(r.amount),
        "credit_seconds": r.credit_seconds,
        "credit_amount": str(r.credit_amount),
        "credit_reason": r.credit_reason,
    }


@api_view(["GET"])
def usage(request):
    """The month's statement (?month=YYYY-MM, this month by default): its lines, credits and
    total, the team's budget, and the month's usage records, paged (?page=N&page_size=M, 200 a
    page by default)."""
    team = require_team(request.user)
    try:
        year, month = statements.parse_month(request.query_params.get("month", ""), timezone.now())
    except ValueError as error:
        raise ValidationError({"month": [str(error)]}) from None
    kept = month_of(team, year, month)
    statement = kept.statement
    page = page_of(request, kept.records, lambda r: record_json(r, kept.times), default_size=200, max_size=1000, prepare=kept.read_times)
    now = timezone.now()
    budget = budget_status(team, now)
    return Response(
        {
            "month": f"{year:04d}-{month:02d}",
            "currency": settings.E31_CURRENCY,
            "lines": kept.lines_json,
            # The month's usage records, paged: count, next and previous are about them.
            "count": page["count"],
            "next": page["next"],
            "previous": page["previous"],
            "records": page["results"],
            "credits": str(statement.credits),
            "total": str(statement.total),
            # The team's budget against this month's spend (whatever month the statement is of).
            "budget": {
                "month": f"{now.year:04d}-{now.month:02d}",
                "monthly_budget": None if budget.budget is None else str(budget.budget),
                "spent": str(meter.round_money(budget.spent)),
                "committed": str(meter.round_money(budget.committed)),
                "remaining": None if budget.remaining is None else str(meter.round_money(budget.remaining)),
                "percent": budget.percent,
                "level": budget.level,
            },
        }
    )
