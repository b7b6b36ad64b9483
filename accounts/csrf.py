"""CSRF failures, recorded in the audit log: a page elsewhere riding a user's session looks like
one. The pages' through Django's failure view (settings.CSRF_FAILURE_VIEW); the API's, with a
session cookie, through its session authentication (DRF refuses those itself, without the view).

Apart from accounts.audit_views: DRF's settings import the authentication class, and a module
of @api_view functions imports DRF's settings."""

from django.views import csrf
from drf_spectacular.authentication import SessionScheme
from rest_framework import exceptions
from rest_framework.authentication import SessionAuthentication

from accounts import audit


def csrf_failure(request, reason=""):
    """Django's 403 for a form posted without its CSRF token, recorded."""
    audit.csrf_failed(request, reason)
    return csrf.csrf_failure(request, reason)


class AuditedSessionAuthentication(SessionAuthentication):
    """DRF's session authentication, its CSRF failures recorded."""

    def enforce_csrf(self, request):
        try:
            super().enforce_csrf(request)
        except exceptions.PermissionDenied as refused:
            # request.user would authenticate again from here: the Django request has the user.
            audit.csrf_failed(request._request, str(refused.detail))
            raise


class AuditedSessionScheme(SessionScheme):
    """The OpenAPI schema's cookieAuth, as for DRF's own session authentication."""

    target_class = "accounts.csrf.AuditedSessionAuthentication"
