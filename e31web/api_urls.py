from django.urls import path

from billing import api as billing_api
from jobs import api as jobs_api

app_name = "api"
urlpatterns = [
    path("jobs/", jobs_api.jobs, name="jobs"),
    path("jobs/<uuid:job_id>/", jobs_api.job_detail, name="job"),
    path("jobs/<uuid:job_id>/logs/", jobs_api.job_logs, name="job-logs"),
    path("jobs/<uuid:job_id>/log/", jobs_api.job_log, name="job-log"),
    path("jobs/<uuid:job_id>/cancel/", jobs_api.job_cancel, name="job-cancel"),
    path("jobs/<uuid:job_id>/artifacts/", jobs_api.job_artifacts, name="job-artifacts"),
    path("jobs/<uuid:job_id>/artifacts/<path:name>", jobs_api.job_artifact, name="job-artifact"),
    path("usage/", billing_api.usage, name="usage"),
]
