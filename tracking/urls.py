from django.urls import path

from tracking import views

app_name = "tracking"
urlpatterns = [
    path("tracker/", views.tracker_settings, name="tracker"),
    path("tracker/remove/", views.tracker_remove, name="tracker_remove"),
]
