"""The audit log: who did what, when, from where (accounts.models.AuditEvent, append-only).

Views call record() once an action has succeeded (the permission check passed, the answer is
about to be sent); a download's view calls recorded(), which records only a successful answer.

What an operator looks for after an attack is recorded where it is refused, in one place each:
a failed sign-in and the lockout it causes (accounts.signin), another team's object asked for
(accounts.access.get_for_team: the same 404 as a missing one, which records nothing), a CSRF
failure (the page's and the API's, accounts.csrf), a refused websocket (the consumer),
API tokens made and revoked (any way: signals), and the names of a job's environment variables.
"""

import contextvars
import ipaddress
from collections import namedtuple
from contextlib import contextmanager

from channels.db import database_sync_to_async
from django.contrib.auth import get_user_model
from django.db.models import Count, Max

from accounts.access import team_of
from accounts.models import AuditEvent
from core.compiled import Insert

# An event's INSERT, its SQL made once (a submission records one: core.compiled.Insert).
INSERT_EVENT = Insert(AuditEvent)

ANONYMOUS = "(anonymous)"  # not a username: Django's allow only letters, digits and @.+-_
_request = contextvars.ContextVar("audit_request", default=None)


def current_request():
    """The request being answered (accounts.middleware.AuditRequestMiddleware), or None. The
    helpers that record refusals deep down (the sign-in counter, get_for_team, a token's signals)
    are given a user or nothing, yet the event needs the address and how the request came."""
    return _request.get()


@contextmanager
def answering(request):
    token = _request.set(request)
    try:
        yield request
    finally:
        _request.reset(token)


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
    return ip_or_none(request.META.get("REMOTE_ADDR"))


def ip_or_none(raw):
    try:
        return str(ipaddress.ip_address((raw or "").strip()))
    except ValueError:
        return None


def text(value, length):
    """Text as a column takes it: no NUL (PostgreSQL refuses one; a name tried at sign-in is
    anyone's), at most length characters."""
    return str(value or "").replace("\x00", "")[:length]


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
    return INSERT_EVENT(
        AuditEvent(
            user=user,
            actor=text(user.get_username() if user is not None else (actor or "system"), 150),
            team=team,
            action=action,
            object_type=object_type,
            object_id=object_id[:100],
            label=text(label or default_label(obj), 300),
            via=via or via_of(request),
            ip=client_ip(request),
        )
    )


def recorded(response, request, action, obj=None, **kwargs):
    """The download's answer, recorded when it is one (see counts_as_download)."""
    if counts_as_download(request.method, response.status_code, request.META.get("HTTP_RANGE", "")):
        record(request, action, obj, **kwargs)
    return response


def append(request, action, obj=None, *, user=None, actor="", team=None, label="", via=None, ip=None, ref=None):
    """Append one event with who and the team given, not taken from the request: a failed
    sign-in's actor is the name tried; the team is the one the event concerns (for another
    team's object, the object's). ip: the request's unless given; ref: (type, id) without obj."""
    if user is not None and not user.is_authenticated:
        user = None
    object_type, object_id = ref or object_ref(obj)
    return INSERT_EVENT(
        AuditEvent(
            user=user,
            actor=text(user.get_username() if user is not None else (actor or ANONYMOUS), 150),
            team=team,
            action=action,
            object_type=object_type,
            object_id=text(object_id, 100),
            label=text(label or default_label(obj), 300),
            via=via or via_of(request),
            ip=ip if ip is not None else client_ip(request),
        )
    )


def job_env(request, job):
    """The names of the environment variables a job sets, when it sets any; never their values
    (often secrets: keys, tokens)."""
    if job.env:
        return record(request, "job.env", job, label=", ".join(sorted(job.env)))
    return None


# Refusals -----------------------------------------------------------------------------------------


def sign_in_failed(username, address, locked=()):
    """A sign-in refused for username from address (accounts.signin.failed); locked: what this
    failure locked ("username", "address"), also recorded. Both concern the team of the user of
    that name, if there is one (its owner sees someone guessing a member's password)."""
    request, User = current_request(), get_user_model()
    clean = "\x00" not in (username or "")  # PostgreSQL cannot even look a NUL up
    tried = User._default_manager.filter(**{User.USERNAME_FIELD: username}).first() if clean else None
    team, ip = team_of(tried), ip_or_none(address)
    append(request, "signin.fail", tried, actor=username, team=team, ip=ip, label="" if tried else "no such user")
    if locked:
        what = " and ".join(f"{kind} {username if kind == 'username' else address}" for kind in locked)
        append(request, "signin.lockout", tried, actor=username, team=team, ip=ip, label=f"{what} locked")


def foreign_object(user, obj, team):
    """user asked for obj, of another team (get_for_team answered 404, as for a missing one).
    Recorded for that team: the requester's own team is not told that the id exists."""
    return append(current_request(), "object.foreign", obj, user=user, team=team)


def csrf_failed(request, reason):
    """A request refused by the CSRF check (a page's, or the API's with a session cookie)."""
    user = getattr(request, "user", None)
    user = user if user is not None and user.is_authenticated else None
    return append(request, "csrf.fail", user=user, team=team_of(user), label=reason)


@database_sync_to_async
def websocket_refused(scope, model, object_id):
    """A websocket for the model's object_id refused (the consumer closes it). Recorded for the
    object's team when there is such an object, else for no team (staff see it)."""
    user = scope.get("user")
    user = user if user is not None and user.is_authenticated else None
    obj = model.objects.filter(pk=object_id).first()
    if user is None:
        reason = "not signed in"
    elif obj is None:
        reason = f"no such {model._meta.verbose_name}"
    else:
        reason = "another team's"
    return append(
        None,
        "ws.refuse",
        obj,
        user=user,
        team=getattr(obj, "team", None),
        via=AuditEvent.WS,
        ip=ip_or_none((scope.get("client") or [None])[0]),
        ref=None if obj else (model._meta.model_name, str(object_id)),
        label=f"{default_label(obj)}: {reason}" if obj else reason,
    )


@database_sync_to_async
def websocket_cross_origin(scope, origin):
    """A websocket with a session cookie refused for coming from another site's page (origin:
    its Origin header, or None). Recorded for the user whose cookie it carried, and their team."""
    user = scope.get("user")
    user = user if user is not None and user.is_authenticated else None
    shown = text(origin, 120) if origin else "no Origin header"
    return append(
        None,
        "ws.refuse",
        user=user,
        team=team_of(user),
        via=AuditEvent.WS,
        ip=ip_or_none((scope.get("client") or [None])[0]),
        label=f"from another site's page ({shown}): {scope.get('path', '')}",
    )


def token_changed(action, token):
    """An API token made or revoked (the signals below: by signing in from the terminal, the
    admin, `manage.py apitoken`, or revoking it): by the request's user, else, for a token made
    by signing in, its own user; without a request, the system. Never its key."""
    request = current_request()
    owner = token.user
    user = getattr(request, "user", None)
    if (user is None or not user.is_authenticated) and request is not None and action == "token.create":
        user = owner  # who signed in (a revoked token's owner may be being deleted: never them)
    actor = "" if request is not None else "system"
    return append(request, action, owner, user=user, actor=actor, team=team_of(owner), label=owner.get_username())


def token_saved(sender, instance, created, raw=False, **kwargs):
    if created and not raw:
        token_changed("token.create", instance)


def token_deleted(sender, instance, **kwargs):
    token_changed("token.revoke", instance)


# The operator's page -----------------------------------------------------------------------------

Burst = namedtuple("Burst", "ip count actions last")


def refusal_counts(since):
    """(ip, action, count, last) of the refusals since then, by address and action."""
    rows = AuditEvent.objects.filter(action__in=AuditEvent.REFUSALS, at__gte=since, ip__isnull=False).order_by()
    return list(rows.values_list("ip", "action").annotate(count=Count("id"), last=Max("at")))


def busiest_addresses(rows, limit=10):
    """The addresses refused most, most first (a tie: the latest refused first, then by address),
    each with its total, its counts by action (most first) and when it was last refused.
    rows: (ip, action, count, last), as refusal_counts gives them."""
    actions, last = {}, {}
    for ip, action, count, at in rows:
        actions.setdefault(ip, {})
        actions[ip][action] = actions[ip].get(action, 0) + count
        last[ip] = max(last.get(ip, at), at)
    bursts = [Burst(ip, sum(counts.values()), sorted(counts.items(), key=lambda item: (-item[1], item[0])), last[ip]) for ip, counts in actions.items()]
    bursts.sort(key=lambda b: (-b.count, -b.last.timestamp(), b.ip))
    return bursts[:limit]
