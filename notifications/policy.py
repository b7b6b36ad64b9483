"""What the team is told, and when: pure functions over plain data (no database, no Django).

The ORM (notifications.events, notifications.delivery) and the scheduler wrap these.
"""

import re
import unicodedata
from datetime import timedelta
from decimal import Decimal

from core.text import format_duration

STARTED = "job.started"
FINISHED = "job.finished"
FAILED = "job.failed"
STOPPED = "job.stopped"
DEADLINE_AT_RISK = "job.deadline_at_risk"
IDLE = "job.idle"
BUDGET_80 = "budget.80"
BUDGET_100 = "budget.100"
INVOICE_ISSUED = "invoice.issued"
TEST = "test"  # "send test event" on a webhook: never emailed

KINDS = [
    (STARTED, "Job started (compute held, the meter runs)"),
    (FINISHED, "Job finished"),
    (FAILED, "Job failed"),
    (STOPPED, "Job stopped at its ceiling or span"),
    (DEADLINE_AT_RISK, "Deadline at risk (predicted to finish after it)"),
    (IDLE, "Job idle (holding compute, doing nothing)"),
    (BUDGET_80, "Budget at 80% this month"),
    (BUDGET_100, "Budget reached (100%) this month"),
    (INVOICE_ISSUED, "Invoice issued"),
]
LABELS = dict(KINDS) | {TEST: "Test event"}
EMAIL_KINDS = [kind for kind, _ in KINDS]
DEFAULT_EMAIL_KINDS = [kind for kind in EMAIL_KINDS if kind != STARTED]

# Job states (jobs.states) to the event they make; requeues and cancellations (the team's own
# act) are not told.
BY_STATE = {"starting": STARTED, "succeeded": FINISHED, "failed": FAILED, "stopped": STOPPED}

BUDGET_THRESHOLDS = (80, 100)


def kind_for_transition(previous, target, reason=""):
    """The event a job's state change makes, or None."""
    return BY_STATE.get(target)


def wants(chosen, kind):
    """Whether a filter (a list of kinds; empty: every kind) lets `kind` through."""
    return not chosen or kind in chosen


# Deliveries --------------------------------------------------------------------------------

MAX_ATTEMPTS = 8
FIRST_RETRY_SECONDS = 30.0
MAX_RETRY_SECONDS = 6 * 3600.0


def retry_delay(attempts, first=FIRST_RETRY_SECONDS, cap=MAX_RETRY_SECONDS):
    """Seconds to wait after the `attempts`-th failed attempt: first, 2 x first, 4 x first, ...
    never more than cap."""
    return min(cap, first * 2 ** max(0, attempts - 1))


def after_failure(attempts, now, max_attempts=MAX_ATTEMPTS, first=FIRST_RETRY_SECONDS, cap=MAX_RETRY_SECONDS):
    """When to try again after the `attempts`-th failed attempt (a datetime), or None: give up."""
    if attempts >= max_attempts:
        return None
    return now + timedelta(seconds=retry_delay(attempts, first, cap))


def succeeded(status):
    """Whether an HTTP status means the receiver took the event (any 2xx)."""
    return status is not None and 200 <= status < 300


def redirected(status):
    """Whether an HTTP status is a redirect (3xx): recorded as the delivery's status, never
    followed (it could lead anywhere, an internal address too)."""
    return status is not None and 300 <= status < 400


EXCERPT_CHARS = 200
TERMINAL_ESCAPE = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")


def excerpt(reply, limit=EXCERPT_CHARS):
    """What the delivery log shows of a receiver's reply (bytes or text): at most `limit`
    characters (and an ellipsis), control and formatting characters (terminal escapes,
    bidirectional overrides, NULs) made spaces and runs of space made one. A log the team reads
    shows that the receiver answered, not a copy of whatever it answered."""
    if isinstance(reply, bytes):
        reply = reply.decode("utf-8", errors="replace")
    reply = TERMINAL_ESCAPE.sub(" ", reply)
    plain = "".join(" " if unicodedata.category(c)[0] in "CZ" else c for c in reply)
    text = " ".join(plain.split())
    return text if len(text) <= limit else text[:limit].rstrip() + "…"


# Event sources ------------------------------------------------------------------------------


def deadline_at_risk(predicted_finish, deadline):
    """A queued job's deadline is at risk when its predicted finish is after it."""
    return predicted_finish is not None and deadline is not None and predicted_finish > deadline


def budget_alert(spent, budget, already=()):
    """The budget threshold (80 or 100, in percent) to tell the team about now, or None.

    spent: the month's spend so far; already: the thresholds told this month. Only the highest
    threshold reached is told: a month that jumps past 100% gets one message, not two, and a
    lower threshold is never told after a higher one. A zero budget tells nothing (it is a
    stop, not a spend)."""
    if budget is None or Decimal(budget) <= 0:
        return None
    reached = [t for t in BUDGET_THRESHOLDS if Decimal(spent) * 100 >= Decimal(budget) * t]
    if not reached:
        return None
    highest = max(reached)
    if any(t >= highest for t in already):
        return None
    return highest


def budget_key(team_id, year, month, threshold):
    """The once-only key of a budget alert: once per team, month and threshold."""
    return f"budget:{team_id}:{year:04d}-{month:02d}:{threshold}"


def deadline_key(job_id):
    return f"deadline:{job_id}"


# Email content --------------------------------------------------------------------------------


def _money(amount, currency):
    if amount in (None, ""):
        return ""
    return f"{currency} {Decimal(str(amount)).quantize(Decimal('0.01')):,}"


def subject(event):
    """The subject line of an event's email (event: the payload as stored, see events.payload)."""
    kind, job, data = event["kind"], event.get("job") or {}, event.get("data") or {}
    name = job.get("name", "")
    if kind == STARTED:
        return f"{name} started"
    if kind == FINISHED:
        return f"{name} finished"
    if kind == FAILED:
        return f"{name} failed"
    if kind == STOPPED:
        return f"{name} stopped at its {job.get('limit', 'ceiling')}"
    if kind == DEADLINE_AT_RISK:
        return f"{name} may miss its deadline"
    if kind == IDLE:
        return f"{name} is idle"
    if kind in (BUDGET_80, BUDGET_100):
        return f"{event['team']['name']} has spent {data.get('percent')}% of its monthly budget"
    if kind == INVOICE_ISSUED:
        return f"{data.get('title', 'Invoice')} {data.get('number', '')} issued".strip()
    return LABELS.get(kind, kind)


def body(event):
    """The plain-text body of an event's email: what happened, the figures, and a link."""
    kind, job, data = event["kind"], event.get("job") or {}, event.get("data") or {}
    lines = [subject(event) + ".", ""]
    if job:
        lines.append(f"Job:      {job['name']} ({job['id'][:8]})")
        lines.append(f"State:    {job['state']}")
        if job.get("reason"):
            lines.append(f"Reason:   {job['reason']}")
        if job.get("held_seconds") is not None and kind in (FINISHED, FAILED, STOPPED, IDLE):
            lines.append(f"Held:     {format_duration(job['held_seconds'])} on {job['gpus']} GPU(s)")
            lines.append(f"Cost:     {_money(job.get('amount'), job.get('currency', ''))}")
    if kind == DEADLINE_AT_RISK:
        lines.append(f"Deadline: {data.get('deadline')}")
        lines.append(f"Predicted finish: {data.get('predicted_finish')}")
    if kind == IDLE and data.get("text"):
        lines.append(str(data["text"]))
    if kind in (BUDGET_80, BUDGET_100):
        currency = data.get("currency", "")
        lines.append(f"Spent this month: {_money(data.get('spent'), currency)} of {_money(data.get('budget'), currency)}")
        if kind == BUDGET_100:
            lines.append("Jobs whose worst case would take the month further past it wait until next month.")
    if kind == INVOICE_ISSUED:
        lines.append(f"Period:   {data.get('period')}")
        lines.append(f"Total:    {_money(data.get('total'), data.get('currency', ''))}")
    url = job.get("url") or data.get("url")
    if url:
        lines += ["", url]
    lines += ["", "-- ", "E31 Network. Choose what you are emailed about on your Settings page."]
    return "\n".join(lines) + "\n"
