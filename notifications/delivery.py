"""The delivery worker: sends what notifications.events queued, with retries.

It runs as a thread of the scheduler process (scheduler/management/commands/scheduler.py), on
its own database connection: a receiver that hangs holds up this thread only (and at most
E31_WEBHOOK_TIMEOUT_SECONDS per attempt), never a scheduling cycle or a runner. Deliveries are
claimed one at a time with a conditional update, so two workers never send the same attempt.
Tests drive handle_one(now) with a clock of their own.

Webhooks go only where core.endpoints allows (public addresses, or the operators'
E31_WEBHOOK_ALLOW): checked again at every attempt after DNS, the connection made to the address
checked, redirects not followed, and of the reply only the status and a short, plain excerpt
kept for the team's delivery log.
"""

import json
import logging
from datetime import timedelta

import httpx
from django.conf import settings
from django.core.mail import EmailMultiAlternatives
from django.template.loader import render_to_string
from django.utils import timezone

from core import endpoints, workers
from notifications import policy, signing
from notifications.models import Delivery

log = logging.getLogger("notifications")
USER_AGENT = "E31-Webhooks/1"
REPLY_BYTES = 4096  # read of a reply at most, for the log's excerpt (the rest is never read)


def webhook_request(delivery, now):
    """(body bytes, headers) of a webhook delivery's attempt at `now`."""
    event = delivery.notification.payload
    body = json.dumps(event, separators=(",", ":"), sort_keys=True).encode()
    timestamp = str(int(now.timestamp()))
    headers = {
        "Content-Type": "application/json",
        "User-Agent": USER_AGENT,
        "Accept-Encoding": "identity",  # the reply's excerpt is read as sent (read_at_most)
        "X-E31-Event": event["kind"],
        "X-E31-Delivery": str(delivery.pk),
        "X-E31-Timestamp": timestamp,
        "X-E31-Signature": signing.signature_header(delivery.webhook.secret, timestamp, body),
    }
    return body, headers


def email_message(delivery):
    event = delivery.notification.payload
    subject, text = policy.subject(event), policy.body(event)
    message = EmailMultiAlternatives(
        subject=f"[E31] {subject}",
        body=text,
        to=[delivery.address],
        headers={"X-E31-Event": event["kind"], "X-E31-Delivery": str(delivery.pk)},
    )
    message.attach_alternative(render_to_string("notifications/email.html", {"event": event, "subject": subject, "text": text}), "text/html")
    return message


def read_at_most(response, limit):
    """The first `limit` bytes of a streamed response's body, as sent (not decompressed: a
    receiver's endless or compressed-bomb reply is not read to its end)."""
    head = b""
    for chunk in response.iter_raw():
        head += chunk
        if len(head) >= limit:
            break
    return head[:limit]


class Worker:
    def __init__(self, client=None, timeout=None):
        self.timeout = settings.E31_WEBHOOK_TIMEOUT_SECONDS if timeout is None else timeout
        # trust_env=False: a proxy from the environment would connect by name, around the check.
        self.client = client or httpx.Client(
            timeout=self.timeout,
            follow_redirects=False,
            trust_env=False,
            transport=endpoints.PinnedTransport("webhook"),
        )

    def claim(self, now):
        """The next due delivery, claimed for this attempt (None when nothing is due)."""
        lease = now + timedelta(seconds=self.timeout + 60)
        due = Delivery.objects.filter(state=Delivery.PENDING, next_attempt_at__lte=now).order_by("next_attempt_at")
        for delivery in due.select_related("notification", "webhook")[:20]:
            # Claimed only if no other worker moved it meanwhile.
            claimed = Delivery.objects.filter(pk=delivery.pk, state=Delivery.PENDING, next_attempt_at=delivery.next_attempt_at)
            if claimed.update(next_attempt_at=lease) == 1:
                return delivery
        return None

    def attempt(self, delivery, now):
        """Send once: (HTTP status or None, error text or '')."""
        if delivery.channel == Delivery.EMAIL:
            try:
                email_message(delivery).send()
            except Exception as error:  # noqa: BLE001 - an SMTP failure is retried like a failing receiver
                return None, f"{type(error).__name__}: {error}"[:2000]
            return None, ""
        if delivery.webhook is None or not delivery.webhook.active:
            return None, "the webhook was removed or turned off"
        body, headers = webhook_request(delivery, now)
        try:
            with self.client.stream("POST", delivery.webhook.url, content=body, headers=headers, timeout=self.timeout) as response:
                status, reply = response.status_code, read_at_most(response, REPLY_BYTES)
        except endpoints.Refused as refused:
            return None, f"not sent: {refused}"
        except httpx.TimeoutException:
            return None, f"no answer within {self.timeout:g} s"
        except (httpx.HTTPError, httpx.InvalidURL) as error:
            return None, policy.excerpt(f"{type(error).__name__}: {error}", 500)
        if policy.succeeded(status):
            return status, ""
        if policy.redirected(status):
            return status, f"the receiver answered {status}, a redirect (not followed)"
        shown = policy.excerpt(reply)
        return status, f"the receiver answered {status}" + (f": {shown}" if shown else "")

    def handle_one(self, now=None):
        """Claim one due delivery and attempt it; False when nothing was due."""
        now = now or timezone.now()
        delivery = self.claim(now)
        if delivery is None:
            return False
        status, error = self.attempt(delivery, now)
        attempts = delivery.attempts + 1
        fields = {"attempts": attempts, "last_attempt_at": now, "last_status": status, "last_error": error}
        if not error:
            fields |= {"state": Delivery.DELIVERED, "delivered_at": now}
        else:
            retry = policy.after_failure(attempts, now, settings.E31_NOTIFY_MAX_ATTEMPTS, settings.E31_NOTIFY_RETRY_SECONDS, policy.MAX_RETRY_SECONDS)
            if retry is None or (delivery.webhook_id and not delivery.webhook.active):
                fields |= {"state": Delivery.FAILED, "last_error": f"{error} (gave up after {attempts} attempts)"}
            else:
                fields["next_attempt_at"] = retry
            log.warning("notification %s to %s failed (attempt %d): %s", delivery.notification.kind, delivery.address, attempts, error)
        Delivery.objects.filter(pk=delivery.pk).update(**fields)
        return True

    def drain(self, now=None, limit=1000):
        """Attempt every delivery due at `now`; how many were attempted."""
        count = 0
        while count < limit and self.handle_one(now):
            count += 1
        return count

    def run(self, stop, interval=1.0):
        """Deliver until `stop` (a threading.Event) is set; idle, look again every `interval` s."""
        try:
            workers.serve(self.handle_one, stop, interval, log, "notification delivery")
        finally:
            self.client.close()


def start_thread(stop, interval=1.0):
    """The worker as a daemon thread (core.workers)."""
    return workers.start_thread(Worker().run, stop, interval, "notify")
