"""Invoices and the month's statement: pages, downloads (PDF, CSV) and the API. Team-only:
another team's invoice is a 404 everywhere."""

from django.contrib.auth.decorators import login_required
from django.http import HttpResponse, HttpResponseBadRequest
from django.shortcuts import render
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.http import require_GET
from rest_framework.decorators import api_view
from rest_framework.exceptions import ValidationError
from rest_framework.response import Response

from accounts import audit
from accounts.access import get_for_team, require_team
from billing import invoice_service, invoices, statements
from billing.models import Invoice
from core.api import paginate


def _invoice(user, invoice_id):
    return get_for_team(Invoice.objects.select_related("corrects"), user, pk=invoice_id)


def _filename(document, ext):
    name = document.number or f"statement-{document.month}"
    kind = "credit-note" if document.kind == Invoice.CREDIT_NOTE else "invoice"
    return f"e31-{kind}-{name}.{ext}" if document.number else f"e31-{name}.{ext}"


def _download(document, ext):
    if ext == "pdf":
        response = HttpResponse(invoices.render_pdf(document), content_type="application/pdf")
    else:
        response = HttpResponse(invoices.render_csv(document), content_type="text/csv; charset=utf-8")
    response["Content-Disposition"] = f'attachment; filename="{_filename(document, ext)}"'
    return response


def _label(invoice, ext):
    return f"{invoice.number or invoice.month} ({ext})"


def _month(text):
    return statements.parse_month(text, timezone.now())


def _statement(user, month_text):
    team = require_team(user)
    year, month = _month(month_text)
    return invoice_service.statement(team, year, month)


# Pages ---------------------------------------------------------------------------------------


@login_required
@require_GET
def invoice_list(request):
    team = require_team(request.user)
    month = f"{timezone.now():%Y-%m}"
    rows = Invoice.objects.filter(team=team).select_related("corrects").order_by("-period_start", "-issued_at")
    return render(request, "billing/invoice_list.html", {"invoices": rows, "month": month})


@login_required
@require_GET
def invoice_detail(request, invoice_id):
    invoice = _invoice(request.user, invoice_id)
    context = {
        "invoice": invoice,
        "document": invoice_service.document(invoice),
        "pdf_url": reverse("billing:invoice_pdf", args=[invoice.pk]),
        "csv_url": reverse("billing:invoice_csv", args=[invoice.pk]),
    }
    return render(request, "billing/invoice_detail.html", context)


@login_required
@require_GET
def invoice_download(request, invoice_id, ext):
    invoice = _invoice(request.user, invoice_id)
    return audit.recorded(_download(invoice_service.document(invoice), ext), request, "invoice.download", invoice, label=_label(invoice, ext))


@login_required
@require_GET
def statement_page(request):
    try:
        document = _statement(request.user, request.GET.get("month", ""))
    except ValueError as error:
        return HttpResponseBadRequest(str(error))
    query = f"?month={document.month}"
    context = {
        "invoice": None,
        "document": document,
        "pdf_url": reverse("billing:statement_pdf") + query,
        "csv_url": reverse("billing:statement_csv") + query,
    }
    return render(request, "billing/invoice_detail.html", context)


@login_required
@require_GET
def statement_download(request, ext):
    try:
        document = _statement(request.user, request.GET.get("month", ""))
    except ValueError as error:
        return HttpResponseBadRequest(str(error))
    return audit.recorded(_download(document, ext), request, "statement.download", label=f"statement {document.month} ({ext})")


# API -----------------------------------------------------------------------------------------


def _summary(invoice):
    return {
        "id": str(invoice.pk),
        "number": invoice.number,
        "kind": invoice.kind,
        "state": invoice.state,
        "team": invoice.team_name,
        "period": invoice.month,
        "issued_at": invoice.issued_at,
        "currency": invoice.currency,
        "subtotal": str(invoice.subtotal),
        "credits": str(invoice.credits),
        "total": str(invoice.total),
        "corrects": str(invoice.corrects_id) if invoice.corrects_id else None,
        "corrects_number": invoice.corrects.number if invoice.corrects_id else None,
        "reason": invoice.reason,
        "pdf": reverse("api:invoice-pdf", args=[invoice.pk]),
        "csv": reverse("api:invoice-csv", args=[invoice.pk]),
    }


def _lines(document):
    return [
        {
            "kind": line.kind,
            "job_id": line.job_id,
            "job": line.job_name,
            "description": line.description,
            "gpu_type": line.gpu_type,
            "gpus": line.gpus,
            "seconds": line.seconds,
            "gpu_seconds": line.gpu_seconds,
            "rates": [str(r) for r in line.rates],
            "amount": str(line.amount),
        }
        for line in document.lines
    ]


@api_view(["GET"])
def api_invoices(request):
    """The team's invoices and credit notes, newest first, paged (?page=N&page_size=M)."""
    team = require_team(request.user)
    rows = Invoice.objects.filter(team=team).select_related("corrects").order_by("-period_start", "-issued_at")
    return paginate(request, rows, _summary)


@api_view(["GET"])
def api_invoice(request, invoice_id):
    invoice = _invoice(request.user, invoice_id)
    return Response({**_summary(invoice), "lines": _lines(invoice_service.document(invoice))})


@api_view(["GET"])
def api_invoice_download(request, invoice_id, ext):
    invoice = _invoice(request.user, invoice_id)
    return audit.recorded(_download(invoice_service.document(invoice), ext), request, "invoice.download", invoice, label=_label(invoice, ext))


@api_view(["GET"])
def api_statement(request):
    try:
        document = _statement(request.user, request.query_params.get("month", ""))
    except ValueError as error:
        raise ValidationError({"month": [str(error)]}) from None
    return Response(
        {
            "kind": "statement",
            "state": "draft",
            "period": document.month,
            "currency": document.currency,
            "subtotal": str(document.subtotal),
            "credits": str(document.credits),
            "total": str(document.total),
            "lines": _lines(document),
        }
    )
