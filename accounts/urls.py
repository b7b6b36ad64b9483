from django.contrib.auth import views as auth_views
from django.urls import path

from accounts import audit_views, views

urlpatterns = [
    path("login/", views.LoginView.as_view(), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("audit/", audit_views.audit_page, name="audit"),
]
