from django.contrib import admin
from django.urls import include, path
from django.views.generic import RedirectView

from notifications import views as notification_views
from scheduler.ops import views as ops_views

# Every app's admin module, registered here rather than when the apps load (the admin's app is
# SimpleAdminConfig): a process that never serves a page, such as a node agent, skips them.
admin.autodiscover()

urlpatterns = [
    path("", RedirectView.as_view(pattern_name="jobs:list", permanent=False)),
    # The settings page shows accounts' and notifications' settings: notifications, above accounts, serves it.
    path("accounts/settings/", notification_views.user_settings, name="settings"),
    path("accounts/", include("accounts.urls")),
    path("jobs/", include("jobs.urls")),
    path("datasets/", include("catalog.urls")),
    path("sweeps/", include("sweeps.urls")),
    path("billing/", include("billing.urls")),
    path("api/", include("e31web.api_urls")),
    path("notifications/", include("notifications.urls")),
    path("tracking/", include("tracking.urls")),
    path("ops/", include("scheduler.ops.urls")),
    path("metrics", ops_views.metrics, name="metrics"),
    path("admin/", admin.site.urls),
]

# Under /api/ a missing route or a crash answers JSON in the API's error shape; elsewhere, the
# usual pages.
handler400 = "core.api.bad_request"
handler403 = "core.api.permission_denied"
handler404 = "core.api.page_not_found"
handler500 = "core.api.server_error"
