import csv

from django import forms
from django.conf import settings
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import HttpResponse, HttpResponseBadRequest, HttpResponseForbidden
from django.shortcuts import redirect, render
from django.utils import timezone
from django.views.decorators.http import require_GET, require_http_methods

from accounts import audit
from accounts.access import is_owner, require_team
from billing import statements
from billing.budget_service import budget_status
from billing.models import UsageRecord
from billing.usage import month_usage


def month_from_request(request):
    return statements.parse_month(request.GET.get("month", ""), timezone.now())


class BudgetForm(forms.Form):
    budget = forms.DecimalField(
        required=False,
        min_value=0,
        max_digits=14,
        decimal_places=2,
        label="Monthly budget",
        help_text="Blank: no budget.",
    )


@login_required
@require_http_methods(["GET", "POST"])
def usage_page(request):
    team = require_team(request.user)
    owner = is_owner(request.user)
    budget_form = None
    if request.method == "POST":
        # The budget of the user's own team, set by its owner; members see it read-only.
        if not owner:
            return HttpResponseForbidden("Only the team's owner can set its budget.")
        budget_form = BudgetForm(request.POST)
        if budget_form.is_valid():
            team.monthly_budget = budget_form.cleaned_data["budget"]
            team.save(update_fields=["monthly_budget"])
            if team.monthly_budget is None:
                messages.success(request, "The team has no monthly budget now.")
            else:
                messages.success(request, f"The team's monthly budget is {settings.E31_CURRENCY} {team.monthly_budget:,.2f}.")
            return redirect("billing:usage")
    try:
        year, month = month_from_request(request)
    except ValueError as error:
        return HttpResponseBadRequest(str(error))
    if owner and budget_form is None:
        budget_form = BudgetForm(initial={"budget": team.monthly_budget})
    now = timezone.now()
    # The jobs holding compute now: those with a usage record still the live meter's.
    live = UsageRecord.ledger.filter(team=team, provisional=True).select_related("job").prefetch_related("job__allocations").order_by("started_at")
    holding = list({record.job_id: record.job for record in live}.values())
    context = {
        "statement": month_usage(team, year, month),
        "month": f"{year:04d}-{month:02d}",
        "this_month": f"{now.year:04d}-{now.month:02d}",
        "holding": [(job, *job.held()) for job in holding],
        "currency": settings.E31_CURRENCY,
        "budget": budget_status(team, now),
        "budget_form": budget_form,
        "is_owner": owner,
    }
    return render(request, "billing/usage.html", context, status=400 if request.method == "POST" else 200)


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
    writer.writerow(
        [
            "job_id",
            "job",
            "gpus",
            "gpu_type",
            "held_seconds",
            "held_hours",
            "gpu_hours",
            "rate_per_gpu_hour",
            "amount",
            "credit_seconds",
            "credit",
            "billed",
            "currency",
        ]
    )
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
            "",
            "total",
            "",
            "",
            statement.held_seconds,
            "",
            "",
            "",
            f"{sum(line.amount for line in statement.lines):.2f}",
            sum(line.credit_seconds for line in statement.lines),
            f"{statement.credits:.2f}",
            f"{statement.total:.2f}",
            settings.E31_CURRENCY,
        ]
    )
    return audit.recorded(response, request, "usage.download", label=f"usage {year:04d}-{month:02d}")
