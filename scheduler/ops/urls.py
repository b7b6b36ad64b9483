from django.urls import path

from scheduler.ops import views as ops_views

app_name = "ops"
urlpatterns = [
    path("", ops_views.pool_page, name="pool"),
]
