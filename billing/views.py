import csv

from django.conf import settings
from django.contrib.auth.decorators import login_required
from django.http import HttpResponse, HttpResponseBadRequest
from django.shortcuts import render
from django.utils import timezone
from django.views.decorators.http import require_GET

from accounts.access import require_team
from billing import statements
from billing.models import UsageRecord
from jobs import states
from jobs.models import Job


def month_records(team, year, month):
    start, end = statements.month_bounds(year, month)
    return UsageRecord.objects.filter(team=team, ended_at__gte=start, ended_at__lt=end).select_related("job")


def month_usage(team, year, month, records=None):
    records = month_records(team, year, month) if records is None else records
    return statements.statement(
        statements.Usage(
            job_id=str(r.job_id),
            job_name=r.job.name,
            gpus=r.gpus,
            gpu_type=r.gpu_type,
            held_seconds=r.held_seconds,
            rate=r.rate,
            amount=r.amount,
            credit_seconds=r.credit_seconds,
            credit_amount=r.credit_amount,
        )
        for r in records
    )


def month_from_request(request):
    return statements.parse_month(request.GET.get("month", ""), timezone.now())


@login_required
@require_GET
def usage_page(request):
    team = require_team(request.user)
    try:
        year, month = month_from_request(request)
    except ValueError as error:
        return HttpResponseBadRequest(str(error))
    holding = Job.objects.filter(team=team, state__in=states.HOLDING).prefetch_related("allocations")
    context = {
        "statement": month_usage(team, year, month),
        "month": f"{year:04d}-{month:02d}",
        "holding": [(job, *job.held()) for job in holding],
        "currency": settings.E31_CURRENCY,
    }
    return render(request, "billing/usage.html", context)


@login_required
@require_GET
def usage_csv(request):
    team = require_team(request.user)
    try:
        year, month = month_from_request(request)
    except ValueError as error:
        return HttpResponseBadRequest(str(error))
    statement = month_usage(team, year, month)
    response = HttpResponse(content_type="text/csv; charset=utf-8")
    response["Content-Disposition"] = f'attachment; filename="usage-{team.name}-{year:04d}-{month:02d}.csv"'
    writer = csv.writer(response)
    writer.writerow(["job_id", "job", "gpus", "gpu_type", "held_seconds", "held_hours", "gpu_hours", "rate_per_gpu_hour", "amount", "credit_seconds", "credit", "billed", "currency"])
    for line in statement.lines:
        writer.writerow(
            [
                line.job_id,
                line.job_name,
                line.gpus,
                line.gpu_type,
                line.held_seconds,
                f"{line.held_hours:.4f}",
                f"{line.gpu_hours:.4f}",
                " ".join(str(r) for r in line.rates),
                f"{line.amount:.2f}",
                line.credit_seconds,
                f"{line.credit:.2f}",
                f"{line.billed:.2f}",
                settings.E31_CURRENCY,
            ]
        )
    writer.writerow(
        [
            "", "total", "", "", statement.held_seconds, "", "", "", f"{sum(line.amount for line in statement.lines):.2f}",
            sum(line.credit_seconds for line in statement.lines), f"{statement.credits:.2f}", f"{statement.total:.2f}",
            settings.E31_CURRENCY,
        ]
    )
    return response
