"""Webhook signatures: pure functions, no Django, so a receiver may copy this file as it is.

Every webhook request carries

    X-E31-Timestamp: <seconds since the epoch, when this attempt was sent>
    X-E31-Signature: sha256=<hex HMAC-SHA256 of "<timestamp>.<raw body>" keyed with the webhook's secret>
    X-E31-Delivery:  <the delivery's id: the same on every retry, so a receiver can drop repeats>
    X-E31-Event:     <the event's kind, e.g. job.finished>

A receiver verifies a request (like Stripe's and GitHub's):

    from notifications.signing import verify
    ok = verify(SECRET, request.headers["X-E31-Timestamp"], request.body, request.headers["X-E31-Signature"])

that is: compute HMAC-SHA256 over the timestamp, a ".", and the raw body bytes exactly as
received (before any JSON parsing), compare it with the header in constant time, and refuse a
timestamp more than five minutes from its own clock (a replayed old request).
"""

import hashlib
import hmac
import time

SCHEME = "sha256="
TOLERANCE_SECONDS = 300


def sign(secret, timestamp, body):
    """The hex HMAC-SHA256 of '<timestamp>.<body>' keyed with the secret (body: bytes or str)."""
    if isinstance(body, str):
        body = body.encode()
    message = str(timestamp).encode() + b"." + body
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()


def signature_header(secret, timestamp, body):
    return SCHEME + sign(secret, timestamp, body)


def verify(secret, timestamp, body, signature, *, now=None, tolerance=TOLERANCE_SECONDS):
    """Whether `signature` (the X-E31-Signature header) signs this timestamp and body with the
    secret, and the timestamp is within `tolerance` seconds of `now` (time.time() when None;
    tolerance None: any age)."""
    if not signature or not str(signature).startswith(SCHEME):
        return False
    try:
        sent = int(str(timestamp))
    except ValueError:
        return False
    if tolerance is not None and abs((time.time() if now is None else now) - sent) > tolerance:
        return False
    return hmac.compare_digest(str(signature)[len(SCHEME) :], sign(secret, str(timestamp), body))
