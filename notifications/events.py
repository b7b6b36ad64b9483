"""Events the team is told about, by email and signed webhooks.

emit() writes the event and its deliveries in the caller's transaction (an outbox): a change
that is rolled back tells nobody, and one that commits is told however long the receivers
take, by the delivery worker (notifications.delivery) that runs beside the scheduler.
"""

import json
import logging

from django.conf import settings
from django.core.serializers.json import DjangoJSONEncoder
from django.db import IntegrityError, transaction
from django.urls import reverse
from django.utils import timezone

from accounts.models import Membership
from notifications import policy
from notifications.models import Delivery, EmailPreference, Notification, Webhook

log = logging.getLogger(__name__)


def site_url(path):
    return settings.E31_SITE_URL.rstrip("/") + path


def plain(data):
    """Data as JSON would carry it (Decimals and datetimes as text)."""
    return json.loads(json.dumps(data or {}, cls=DjangoJSONEncoder))


def job_data(job, with_meter=True):
    """A job as an event shows it."""
    data = {
        "id": str(job.pk),
        "name": job.name,
        "kind": job.kind,
        "state": job.state,
        "reason": job.reason,
        "gpus": job.gpus,
        "limit": "span" if job.span_hours is not None else "ceiling",
        "url": site_url(reverse("jobs:detail", args=[job.pk])),
        "created_at": job.created_at,
        "finished_at": job.finished_at,
        "deadline": job.deadline,
    }
    if with_meter:
        seconds, amount = job.held()
        data |= {"held_seconds": seconds, "amount": amount, "currency": settings.E31_CURRENCY}
    return data


def payload(notification_id, kind, at, team, job, data):
    """The event as emailed and POSTed: {id, kind, created_at, team, job, data}."""
    return plain(
        {
            "id": str(notification_id),
            "kind": kind,
            "created_at": at,
            "team": {"id": str(team.pk), "name": team.name},
            "job": job_data(job) if job is not None else None,
            "data": data,
        }
    )


def emit(kind, *, team, job=None, data=None, once=None, at=None, keep=False):
    """Record that `kind` happened (inside the caller's transaction); delivery happens elsewhere.

    An event nobody is to be told of (no member wants it by email, no webhook takes it) is not
    written at all: a job starting, which by default tells nobody, costs the scheduler two reads
    rather than a row. once: a key making the event happen at most once (a second emit with it
    does nothing and returns None); such events are always written, as the record that they
    happened. keep: write it even with nobody to tell. Returns the Notification, or None."""

    at = at or timezone.now()
    deliveries = recipients(team, kind, at)
    if not deliveries and once is None and not keep:
        return None
    notification = Notification(team=team, job=job, kind=kind, created_at=at, key=once)
    notification.payload = payload(notification.pk, kind, at, team, job, data)
    try:
        with transaction.atomic():  # a savepoint: a repeated `once` leaves the caller's transaction usable
            notification.save(force_insert=True)
    except IntegrityError:
        if once is not None and Notification.objects.filter(key=once).exists():
            return None
        raise
    for delivery in deliveries:
        delivery.notification = notification
    Delivery.objects.bulk_create(deliveries)
    return notification


def recipients(team, kind, at):
    """Unsaved deliveries: one per team member who wants this kind by email, and one per
    active webhook of the team whose filter lets it through."""
    return recipients_of_teams([team.pk], kind, at).get(team.pk, [])


def recipients_of_teams(team_ids, kind, at):
    """{team id: unsaved deliveries} as recipients() picks them, for many teams in two queries
    (a month's invoices, say); a team nobody is to be told of is left out."""
    rows = {}
    if kind in policy.EMAIL_KINDS:
        for member in Membership.objects.filter(team_id__in=team_ids).select_related("user", "user__notification_preference"):
            user = member.user
            if user.is_active and user.email and kind in EmailPreference.kinds_for(user):
                rows.setdefault(member.team_id, []).append(Delivery(channel=Delivery.EMAIL, user=user, address=user.email, next_attempt_at=at))
    for webhook in Webhook.objects.filter(team_id__in=team_ids, active=True):
        if kind != policy.TEST and policy.wants(webhook.kinds, kind):
            rows.setdefault(webhook.team_id, []).append(Delivery(channel=Delivery.WEBHOOK, webhook=webhook, address=webhook.url, next_attempt_at=at))
    return rows


def send_test(webhook, user=None):
    """A test event to one webhook ("send test event" on the settings page)."""

    with transaction.atomic():
        notification = emit(policy.TEST, team=webhook.team, keep=True, data={"text": "A test event from E31 Network.", "by": getattr(user, "username", "")})
        return Delivery.objects.create(
            notification=notification,
            channel=Delivery.WEBHOOK,
            webhook=webhook,
            address=webhook.url,
            next_attempt_at=notification.created_at,
        )


def job_changed(job, previous, target, reason):
    """Called by Job._transition inside its transaction for every state change."""
    kind = policy.kind_for_transition(previous, target, reason)
    if kind is None:
        return None
    return emit(kind, team=job.team, job=job, data={"from": previous, "reason": reason, "restarts": job.restarts})
