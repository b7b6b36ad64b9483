from django.urls import path

from catalog import views

# The namespace is the one the pages and templates have always named: datasets:detail ...
app_name = "datasets"
urlpatterns = [
    path("", views.dataset_list, name="list"),
    path("new/", views.dataset_new, name="new"),
    path("<uuid:dataset_id>/", views.dataset_detail, name="detail"),
    path("<uuid:dataset_id>/add/", views.dataset_add_files, name="add"),
    path("<uuid:dataset_id>/rescan/", views.dataset_rescan, name="rescan"),
    path("<uuid:dataset_id>/credentials/", views.dataset_credentials, name="credentials"),
    path("<uuid:dataset_id>/delete/", views.dataset_delete, name="delete"),
    path("<uuid:dataset_id>/versions/<int:number>/upload/", views.version_upload, name="upload"),
    path("<uuid:dataset_id>/versions/<int:number>/seal/", views.version_seal, name="seal"),
    path("<uuid:dataset_id>/uploads/<uuid:upload_id>/abort/", views.upload_abort, name="abort-upload"),
]
