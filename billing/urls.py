from django.urls import path

from billing import invoice_views, views

app_name = "billing"
urlpatterns = [
    path("", views.usage_page, name="usage"),
    path("usage.csv", views.usage_csv, name="usage_csv"),
    path("invoices/", invoice_views.invoice_list, name="invoices"),
    path("invoices/statement/", invoice_views.statement_page, name="statement"),
    path("invoices/statement.pdf", invoice_views.statement_download, {"ext": "pdf"}, name="statement_pdf"),
    path("invoices/statement.csv", invoice_views.statement_download, {"ext": "csv"}, name="statement_csv"),
    path("invoices/<uuid:invoice_id>/", invoice_views.invoice_detail, name="invoice"),
    path("invoices/<uuid:invoice_id>.pdf", invoice_views.invoice_download, {"ext": "pdf"}, name="invoice_pdf"),
    path("invoices/<uuid:invoice_id>.csv", invoice_views.invoice_download, {"ext": "csv"}, name="invoice_csv"),
]
