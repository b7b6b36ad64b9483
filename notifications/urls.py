from django.urls import path

from notifications import views

app_name = "notifications"
urlpatterns = [
    path("webhooks/", views.webhook_list, name="webhooks"),
    path("webhooks/add/", views.webhook_add, name="webhook_add"),
    path("webhooks/<uuid:webhook_id>/", views.webhook_detail, name="webhook"),
    path("webhooks/<uuid:webhook_id>/delete/", views.webhook_delete, name="webhook_delete"),
    path("webhooks/<uuid:webhook_id>/rotate/", views.webhook_rotate, name="webhook_rotate"),
    path("webhooks/<uuid:webhook_id>/test/", views.webhook_test, name="webhook_test"),
]
