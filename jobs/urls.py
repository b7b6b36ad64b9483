from django.urls import path

from jobs import views

app_name = "jobs"
urlpatterns = [
    path("", views.job_list, name="list"),
    path("new/", views.job_new, name="new"),
    path("estimate/", views.job_estimate, name="estimate"),
    path("<uuid:job_id>/", views.job_detail, name="detail"),
    path("<uuid:job_id>/cancel/", views.job_cancel, name="cancel"),
    path("<uuid:job_id>/log.txt", views.job_log, name="log"),
    path("<uuid:job_id>/artifacts/<path:name>", views.artifact_download, name="artifact"),
    path("<uuid:job_id>/checkpoints/<path:name>", views.checkpoint_download, name="checkpoint"),
]
