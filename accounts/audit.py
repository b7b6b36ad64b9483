"""The audit log: who did what, when, from where (accounts.models.AuditEvent, append-only).

Views call record() once an action has succeeded (the permission check passed, the answer is
about to be sent); a download's view calls recorded(), which records only a successful answer.
Another team's object is a 404 before either is reached, so it records nothing.
"""

import ipaddress

from accounts.access import team_of
from accounts.models import AuditEvent


def via_of(request):
    """How the request came: "api" under /api/ (the CLI is an API client), else "web";
    "system" without a request."""
    if request is None:
        return AuditEvent.SYSTEM
    return AuditEvent.API if request.path.startswith("/api/") else AuditEvent.WEB


def client_ip(request):
    """The client's address: REMOTE_ADDR (X-Forwarded-For is not trusted); None if not an IP."""
    if request is None:
        return None
    raw = (request.META.get("REMOTE_ADDR") or "").strip()
    try:
        return str(ipaddress.ip_address(raw))
    except ValueError:
        return None


def object_ref(obj):
    """(type, id) of an object as text: ("job", "<uuid>"); ("", "") for none."""
    if obj is None:
        return "", ""
    return obj._meta.model_name, str(obj.pk)


def default_label(obj):
    """A human label for an object: its name, number or path, else its text."""
    if obj is None:
        return ""
    for field in ("name", "number", "path"):
        value = getattr(obj, field, None)
        if value:
            return str(value)
    return str(obj)


def counts_as_download(method, status_code, range_header=""):
    """Whether an answer is a download worth recording: a GET answered with the file (200), a
    redirect to it (3xx), or the first range of it (206 from byte 0; a client fetching the rest
    in ranges is the same download)."""
    if method != "GET" or status_code >= 400:
        return False
    if status_code == 206:
        return (range_header or "").replace(" ", "").startswith("bytes=0-")
    return True


def record(request, action, obj=None, team=None, label="", via=None, actor=None):
    """Append one event: the request's user (None without a request: then actor names who,
    e.g. the management command), its team (given, the object's, or the user's), the object,
    how (web, api or system) and the client's address."""
    user = getattr(request, "user", None) if request is not None else None
    if user is not None and not user.is_authenticated:
        user = None
    if team is None:
        team = getattr(obj, "team", None) if obj is not None else None
    if team is None:
        team = team_of(user)
    object_type, object_id = object_ref(obj)
    return AuditEvent.objects.create(
        user=user,
        actor=(user.get_username() if user is not None else (actor or "system"))[:150],
        team=team,
        action=action,
        object_type=object_type,
        object_id=object_id[:100],
        label=(label or default_label(obj))[:300],
        via=via or via_of(request),
        ip=client_ip(request),
    )


def recorded(response, request, action, obj=None, **kwargs):
    """The download's answer, recorded when it is one (see counts_as_download)."""
    if counts_as_download(request.method, response.status_code, request.META.get("HTTP_RANGE", "")):
        record(request, action, obj, **kwargs)
    return response
