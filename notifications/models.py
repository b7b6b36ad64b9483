"""The outbox: an event is a Notification row, written in the transaction of the change it
tells about, with one Delivery per channel (an email to each member who wants it, a POST to
each of the team's webhooks that wants it). A worker beside the scheduler sends them
(notifications.delivery), so nothing is sent for a change that was rolled back and a slow or
failing receiver never holds up the scheduler or a runner."""

import secrets
import uuid

from django.conf import settings
from django.db import models
from django.utils import timezone

from core import secrets_box
from core.jsonfield import JSONField
from notifications import policy


def new_secret():
    return "whsec_" + secrets.token_hex(32)


def sealed_new_secret():
    return secrets_box.seal({"secret": new_secret()})


class EmailPreference(models.Model):
    """Which events a user is emailed about (without a row: policy.DEFAULT_EMAIL_KINDS)."""

    user = models.OneToOneField(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="notification_preference")
    kinds = JSONField(default=list, blank=True, help_text="the kinds emailed (see notifications.policy.KINDS)")

    def __str__(self):
        return f"{self.user}: {', '.join(self.kinds) or 'nothing'}"

    @staticmethod
    def kinds_for(user):
        try:
            return list(user.notification_preference.kinds)
        except EmailPreference.DoesNotExist:
            return list(policy.DEFAULT_EMAIL_KINDS)


class Webhook(models.Model):
    """A team's receiver: every event it wants is POSTed to its URL, signed with its secret."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    team = models.ForeignKey("accounts.Team", on_delete=models.CASCADE, related_name="webhooks")
    url = models.URLField(max_length=500)
    # The signing secret, encrypted (core.secrets_box, as teams' S3 credentials are): read it
    # through .secret. Shown to the team once, when the webhook is added or its secret rotated.
    sealed_secret = models.TextField(default=sealed_new_secret, editable=False)
    kinds = JSONField(default=list, blank=True, help_text="the kinds sent; empty: every kind")
    active = models.BooleanField(default=True)
    created_at = models.DateTimeField(default=timezone.now)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")

    class Meta:
        ordering = ["created_at"]

    def __str__(self):
        return self.url

    @property
    def secret(self):
        return secrets_box.unseal(self.sealed_secret)["secret"]

    @secret.setter
    def secret(self, value):
        self.sealed_secret = secrets_box.seal({"secret": value})

    def rotate_secret(self):
        self.secret = new_secret()
        self.save(update_fields=["sealed_secret"])
        return self.secret

    @property
    def kinds_text(self):
        return ", ".join(policy.LABELS.get(k, k) for k in self.kinds) if self.kinds else "every event"


class Notification(models.Model):
    """One event, as sent (payload: see notifications.events.payload)."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    team = models.ForeignKey("accounts.Team", on_delete=models.CASCADE, related_name="notifications")
    job = models.ForeignKey("jobs.Job", null=True, blank=True, on_delete=models.CASCADE, related_name="notifications")
    kind = models.CharField(max_length=40, db_index=True)
    created_at = models.DateTimeField(default=timezone.now)
    payload = JSONField()
    # Events told once only (a budget threshold in a month, a job's deadline at risk) carry a
    # key; the unique constraint makes "once" hold with two schedulers too.
    key = models.CharField(max_length=200, null=True, blank=True, unique=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self):
        return f"{self.kind} at {self.created_at:%Y-%m-%d %H:%M:%S}"


class Delivery(models.Model):
    """One event to one receiver: an email address or a webhook. Its id is the webhook's
    X-E31-Delivery header, the same on every retry."""

    EMAIL, WEBHOOK = "email", "webhook"
    CHANNELS = [(EMAIL, "Email"), (WEBHOOK, "Webhook")]
    PENDING, DELIVERED, FAILED = "pending", "delivered", "failed"
    STATES = [(PENDING, "Pending"), (DELIVERED, "Delivered"), (FAILED, "Gave up")]

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    notification = models.ForeignKey(Notification, on_delete=models.CASCADE, related_name="deliveries")
    channel = models.CharField(max_length=10, choices=CHANNELS)
    webhook = models.ForeignKey(Webhook, null=True, blank=True, on_delete=models.CASCADE, related_name="deliveries")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.CASCADE, related_name="+")
    address = models.CharField(max_length=500, help_text="the email address or the URL, as when it was queued")
    state = models.CharField(max_length=10, choices=STATES, default=PENDING)
    attempts = models.PositiveIntegerField(default=0)
    # When it is due next; a worker claims it by moving this past the attempt (a lease), so a
    # worker that dies mid-attempt leaves it to be tried again.
    next_attempt_at = models.DateTimeField(default=timezone.now)
    last_attempt_at = models.DateTimeField(null=True, blank=True)
    last_status = models.PositiveIntegerField(null=True, blank=True, help_text="the receiver's HTTP status")
    last_error = models.TextField(blank=True)
    delivered_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-notification__created_at", "id"]
        indexes = [models.Index(fields=["state", "next_attempt_at"], name="delivery_due")]
        verbose_name_plural = "deliveries"

    def __str__(self):
        return f"{self.notification.kind} to {self.address}: {self.state}"
