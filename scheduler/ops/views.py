"""The operator's view: a staff-only page of the pool (/ops/) and the same figures as Prometheus
metrics (/metrics), for a staff user's API token or a staff session."""

from datetime import timedelta

from django.conf import settings
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import HttpResponse
from django.shortcuts import render
from django.utils import timezone
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET
from rest_framework.authtoken.models import Token

from accounts import audit
from scheduler.ops import figures, prom
from scheduler.ops import snapshot as ops

CHART_WIDTH, CHART_HEIGHT = 720, 120
DAY, WEEK = 24 * 3600, 7 * 24 * 3600
REFUSALS_SECONDS = 3600


def require_staff(user):
    if not user.is_staff:
        raise PermissionDenied("The operator's view is for staff only.")


def chart(buckets, label_seconds, label_format):
    return {
        "bars": figures.bars(buckets, CHART_WIDTH, CHART_HEIGHT, label_seconds=label_seconds, label_format=label_format),
        "mean": figures.mean_utilization(buckets),
        "width": CHART_WIDTH,
        "height": CHART_HEIGHT,
    }


@login_required
@require_GET
@never_cache
def pool_page(request):
    require_staff(request.user)
    now = timezone.now()
    timeout = settings.E31_NODE_TIMEOUT_SECONDS
    nodes = ops.nodes()
    queued = ops.queued()
    offered, allocated = figures.pool_totals(nodes, now, timeout)
    days = ops.daily(now, days=14)
    context = {
        "now": now,
        "nodes": [(node, node.status(now, timeout)) for node in nodes],
        "engine_nodes": any(node.executor for node in nodes),
        "disagreements": ops.engine_disagreements(now),
        "offered": offered,
        "allocated": allocated,
        "queue": figures.queue_by_team(queued),
        "queued_count": len(queued),
        "oldest_wait": figures.human(figures.oldest_wait_seconds(queued, now)),
        "stuck": ops.stuck(now),
        "thresholds": ops.thresholds(),
        "day_chart": chart(ops.utilization(now, DAY, 3600), label_seconds=3 * 3600, label_format="%H:%M"),
        "week_chart": chart(ops.utilization(now, WEEK, 6 * 3600), label_seconds=DAY, label_format="%a %d"),
        "days": list(reversed(days)),
        "days_total": figures.Day(
            day=None, device_seconds=sum(d.device_seconds for d in days), amount=sum(d.amount for d in days), credits=sum(d.credits for d in days)
        ),
        "job_counts": ops.job_counts(),
        # A burst of refusals (failed sign-ins, other teams' ids, CSRF, websockets) from one address.
        "refusals": audit.busiest_addresses(audit.refusal_counts(now - timedelta(seconds=REFUSALS_SECONDS))),
        "refusals_minutes": REFUSALS_SECONDS // 60,
    }
    return render(request, "ops/pool.html", context)


def token_user(request):
    """The user of an `Authorization: Token <key>` or `Bearer <key>` header; None without
    one; False for a key that is no (active user's) token."""
    header = request.headers.get("Authorization", "")
    scheme, _, key = header.partition(" ")
    if scheme.lower() not in ("token", "bearer") or not key.strip():
        return None
    token = Token.objects.select_related("user").filter(key=key.strip()).first()
    if token is None or not token.user.is_active:
        return False
    return token.user


@require_GET
@never_cache
def metrics(request):
    """The pool in the Prometheus text format: for a staff user's API token (or session)."""
    user = token_user(request)
    if user is False:
        return refuse(401, "Invalid token.")
    if user is None:
        user = request.user if request.user.is_authenticated else None
    if user is None:
        return refuse(401, "Authenticate with a staff user's API token: Authorization: Token <key> (or Bearer <key>).")
    if not user.is_staff:
        return refuse(403, "The metrics are for staff only.")
    return HttpResponse(prom.exposition(ops.snapshot()), content_type=prom.CONTENT_TYPE)


def refuse(status, reason):
    response = HttpResponse(reason + "\n", status=status, content_type="text/plain; charset=utf-8")
    if status == 401:
        response["WWW-Authenticate"] = 'Token realm="metrics"'
    return response
