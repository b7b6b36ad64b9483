from django.urls import path

from jobs import experiment_views, lineage_views, views

app_name = "jobs"
urlpatterns = [
    path("", views.job_list, name="list"),
    path("experiments/", experiment_views.experiment_list, name="experiments"),
    path("<uuid:job_id>/experiment/", experiment_views.experiment_detail, name="experiment"),
    path("new/", views.job_new, name="new"),
    path("estimate/", views.job_estimate, name="estimate"),
    path("<uuid:job_id>/", views.job_detail, name="detail"),
    path("<uuid:job_id>/cancel/", views.job_cancel, name="cancel"),
    path("<uuid:job_id>/retrain/", lineage_views.job_retrain, name="retrain"),
    path("<uuid:job_id>/compare/", lineage_views.job_compare, name="compare"),
    path("<uuid:job_id>/comparison.json", lineage_views.job_comparison_json, name="comparison"),
    path("<uuid:job_id>/log.txt", views.job_log, name="log"),
    path("<uuid:job_id>/spec.yaml", views.job_spec_download, name="spec"),
    path("<uuid:job_id>/artifacts/<path:name>", views.artifact_download, name="artifact"),
    path("<uuid:job_id>/checkpoints/<path:name>", views.checkpoint_download, name="checkpoint"),
]
