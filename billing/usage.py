"""A team's month of usage records, and the statement they make (billing.statements): the
usage page, its CSV and the API's usage endpoint show it.

Read as plain rows, in two queries however many records: the records with their jobs' names,
then their credits (issue 24: a month of 720 records as model instances, each with its job row
and a queryset of its credits per figure, took 160 ms of the usage endpoint's 170). Their
times are read for the records a page shows (record_times): the statement needs none of them,
and 1,440 timestamps parsed for a page of 200 records were a fifth of the endpoint's time."""

from datetime import datetime
from decimal import Decimal
from typing import NamedTuple

from django.db.models import DateField, UUIDField

from billing import statements
from billing.models import Credit, UsageRecord
from core.compiled import OneOf, Param, Read


class Record(NamedTuple):
    """A usage record as the usage endpoint lists it: its fields but its times (record_times),
    its job's name, and its credits summed (their reasons joined, each once, in the order they
    were given)."""

    id: int
    job_id: str
    job_name: str
    gpus: int
    gpu_type: str
    held_seconds: int
    rate: Decimal
    amount: Decimal
    credit_seconds: int
    credit_amount: Decimal
    credit_reason: str


def _month(team, period):
    return UsageRecord.objects.filter(team_id=team, period=period)


# The month's records and their credits, their SQL made once (core.compiled).
MONTH_RECORDS = Read(
    lambda: _month(Param("team", UUIDField()), Param("period", DateField())).values_list(
        "id", "job_id", "job__name", "gpus", "gpu_type", "held_seconds", "rate", "amount"
    )
)
MONTH_TIMES = Read(lambda: UsageRecord.objects.filter(OneOf("id", "ids", UsageRecord._meta.pk)).order_by().values_list("id", "started_at", "ended_at"))
MONTH_CREDITS = Read(
    lambda: Credit.objects.filter(usage__in=_month(Param("team", UUIDField()), Param("period", DateField())).values("pk")).values_list(
        "usage_id", "seconds", "amount", "reason"
    )
)


def month_records(team, year, month):
    """The team's records billed in the month, oldest first (the ledger's order), as Records."""
    start, _end = statements.month_bounds(year, month)
    team_id = getattr(team, "pk", team)
    credits = {}
    for usage_id, seconds, amount, reason in MONTH_CREDITS(team=team_id, period=start.date()):
        credits.setdefault(usage_id, []).append((seconds, amount, reason))
    out, none = [], (0, Decimal(0), "")  # most records have no credit
    for pk, job_id, job_name, *rest in MONTH_RECORDS(team=team_id, period=start.date()):
        given = credits.get(pk)
        credited = (
            none if given is None else (sum(c[0] for c in given), sum((c[1] for c in given), Decimal(0)), "; ".join(dict.fromkeys(c[2] for c in given if c[2])))
        )
        out.append(Record(pk, str(job_id), job_name, *rest, *credited))
    return out


def record_times(records) -> dict[int, tuple[datetime, datetime]]:
    """The records' started_at and ended_at by id, in one query."""
    return {pk: (started, ended) for pk, started, ended in MONTH_TIMES(ids=[r.id for r in records])}


def month_usage(team, year, month, records=None):
    """The month's statement: its records are what statements.statement reads (a Billable)."""
    return statements.statement(month_records(team, year, month) if records is None else records)
