from django.urls import path

from sweeps import views

app_name = "sweeps"
urlpatterns = [
    path("", views.sweep_list, name="list"),
    path("<uuid:sweep_id>/", views.sweep_detail, name="detail"),
    path("<uuid:sweep_id>/rerun/", views.sweep_rerun, name="rerun"),
]
