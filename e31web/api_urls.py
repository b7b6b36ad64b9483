from django.urls import path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from accounts import api as accounts_api
from accounts import audit_views
from billing import api as billing_api
from billing import invoice_views
from catalog import api as catalog_api
from e31web import api_schema  # noqa: F401  (describes the views above for the OpenAPI schema)
from jobs import api as jobs_api
from jobs import folder_api, run_api
from sweeps import api as sweeps_api

app_name = "api"
urlpatterns = [
    # The OpenAPI 3 schema (YAML; ?format=json for JSON) and its Swagger UI: public.
    path("schema/", SpectacularAPIView.as_view(), name="schema"),
    path("docs/", SpectacularSwaggerView.as_view(url_name="api:schema"), name="docs"),
    path("token/", accounts_api.token, name="token"),
    path("me/", accounts_api.me, name="me"),
    path("audit/", audit_views.api_audit, name="audit"),
    path("jobs/", jobs_api.jobs, name="jobs"),
    path("jobs/<uuid:job_id>/", jobs_api.job_detail, name="job"),
    path("jobs/<uuid:job_id>/spec/", jobs_api.job_spec, name="job-spec"),
    path("estimate/", jobs_api.estimate, name="estimate"),
    path("jobs/<uuid:job_id>/logs/", jobs_api.job_logs, name="job-logs"),
    path("jobs/<uuid:job_id>/log/", jobs_api.job_log, name="job-log"),
    path("jobs/<uuid:job_id>/cancel/", jobs_api.job_cancel, name="job-cancel"),
    path("jobs/<uuid:job_id>/retrain/", jobs_api.job_retrain, name="job-retrain"),
    path("jobs/<uuid:job_id>/compare/", jobs_api.job_compare, name="job-compare"),
    path("jobs/<uuid:job_id>/comparison/", jobs_api.job_comparison, name="job-comparison"),
    path("jobs/<uuid:job_id>/artifacts/", jobs_api.job_artifacts, name="job-artifacts"),
    path("jobs/<uuid:job_id>/artifacts/<path:name>", jobs_api.job_artifact, name="job-artifact"),
    path("jobs/<uuid:job_id>/metrics/", run_api.job_metrics, name="job-metrics"),
    path("jobs/<uuid:job_id>/checkpoints/", run_api.job_checkpoints, name="job-checkpoints"),
    path("jobs/<uuid:job_id>/checkpoints/<path:name>", run_api.job_checkpoint, name="job-checkpoint"),
    path("datasets/", catalog_api.dataset_list, name="datasets"),
    path("datasets/s3/", catalog_api.dataset_register_s3, name="dataset-register-s3"),
    path("datasets/<uuid:dataset_id>/", catalog_api.dataset_detail, name="dataset"),
    path("datasets/<uuid:dataset_id>/rescan/", catalog_api.dataset_rescan, name="dataset-rescan"),
    path("datasets/<uuid:dataset_id>/credentials/", catalog_api.dataset_credentials, name="dataset-credentials"),
    path("datasets/<uuid:dataset_id>/versions/", catalog_api.version_open, name="dataset-versions"),
    path("datasets/<uuid:dataset_id>/versions/<int:number>/", catalog_api.version_detail, name="dataset-version"),
    path("datasets/<uuid:dataset_id>/versions/<int:number>/uploads/", catalog_api.upload_start, name="dataset-uploads"),
    path("datasets/<uuid:dataset_id>/versions/<int:number>/seal/", catalog_api.version_seal, name="dataset-seal"),
    path("datasets/uploads/<uuid:upload_id>/", catalog_api.upload_detail, name="dataset-upload"),
    path("datasets/uploads/<uuid:upload_id>/complete/", catalog_api.upload_complete, name="dataset-upload-complete"),
    path("folders/", folder_api.folder_open, name="folders"),
    path("folders/<uuid:folder_id>/", folder_api.folder_detail, name="folder"),
    path("folders/<uuid:folder_id>/files/<uuid:file_id>/", folder_api.folder_file, name="folder-file"),
    path("sweeps/", sweeps_api.sweep_list, name="sweeps"),
    path("sweeps/<uuid:sweep_id>/", sweeps_api.sweep_detail, name="sweep"),
    path("sweeps/<uuid:sweep_id>/rerun/", sweeps_api.sweep_rerun, name="sweep-rerun"),
    path("usage/", billing_api.usage, name="usage"),
    path("invoices/", invoice_views.api_invoices, name="invoices"),
    path("invoices/statement/", invoice_views.api_statement, name="invoice-statement"),
    path("invoices/<uuid:invoice_id>/", invoice_views.api_invoice, name="invoice"),
    path("invoices/<uuid:invoice_id>.pdf", invoice_views.api_invoice_download, {"ext": "pdf"}, name="invoice-pdf"),
    path("invoices/<uuid:invoice_id>.csv", invoice_views.api_invoice_download, {"ext": "csv"}, name="invoice-csv"),
]
