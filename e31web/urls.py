from django.contrib import admin
from django.urls import include, path
from django.views.generic import RedirectView

urlpatterns = [
    path("", RedirectView.as_view(pattern_name="jobs:list", permanent=False)),
    path("accounts/", include("accounts.urls")),
    path("jobs/", include("jobs.urls")),
    path("billing/", include("billing.urls")),
    path("api/", include("e31web.api_urls")),
    path("admin/", admin.site.urls),
]
