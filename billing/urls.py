from django.urls import path

from billing import views

app_name = "billing"
urlpatterns = [
    path("", views.usage_page, name="usage"),
    path("usage.csv", views.usage_csv, name="usage_csv"),
]
