"""A team's month of usage records, and the statement they make (billing.statements): the
usage page, its CSV and the API's usage endpoint show it.

Read as plain rows, in two queries however many records: the records with their jobs' names,
then their credits (issue 24: a month of 720 records as model instances, each with its job row
and a queryset of its credits per figure, took 160 ms of the usage endpoint's 170). Their
times are read for the records a page shows (record_times): the statement needs none of them,
and 1,440 timestamps parsed for a page of 200 records were a fifth of the endpoint's time.

The ledger is append-only (billing.models: a final record and a credit are never changed nor
deleted), so a month's records and statement are the same for as long as its counts of final
records and of credits are: month_of keeps each worker's recent months (KEPT_RECORDS records in
all) under those counts, read in one small query, and reads the month again when they move (a
month of 720 records: its records and statement took 11 of the endpoint's 17 ms in-process, and
its CLI polls it)."""

import threading
from collections import OrderedDict
from datetime import datetime
from decimal import Decimal
from functools import cached_property
from typing import NamedTuple

from django.db import connection
from django.db.models import Count, DateField, UUIDField

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
# How many final records and credits the month has: while they are the same, so is the month.
MONTH_COUNTS = Read(
    lambda: (
        _month(Param("team", UUIDField()), Param("period", DateField()))
        .order_by()
        .values("team_id")
        .annotate(records=Count("pk", distinct=True), credits=Count("credits"))
        .values_list("records", "credits")
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


class Month:
    """A month's records (month_records, in the ledger's order) and statement, and what is made
    of them once and kept with them: the statement's lines as the API writes them, and the
    times of the records a page has shown."""

    def __init__(self, records: tuple[Record, ...], statement: statements.Statement):
        self.records = records
        self.statement = statement
        self.times: dict[int, tuple[datetime, datetime]] = {}  # by record id, as read_times read them

    @cached_property
    def lines_json(self) -> list[dict]:
        return [
            {
                "job_id": line.job_id,
                "job": line.job_name,
                "gpus": line.gpus,
                "gpu_type": line.gpu_type,
                "held_seconds": line.held_seconds,
                "rates": [str(r) for r in line.rates],
                "amount": str(line.amount),
                "credit_seconds": line.credit_seconds,
                "credit": str(line.credit),
                "billed": str(line.billed),
            }
            for line in self.statement.lines
        ]

    def read_times(self, records) -> None:
        """Read into .times the started_at and ended_at of those of the records not read
        before, in one query."""
        missing = [r for r in records if r.id not in self.times]
        if missing:
            self.times.update(record_times(missing))


# A worker keeps recent months of at most this many records in all, each month counted as one
# more (its own cost: about 1 kB, a record's with its line and times 1.9 kB): 40 MB at most.
KEPT_RECORDS = 20_000


def _weight(month: Month) -> int:
    return len(month.records) + 1


class _Kept:
    """Months by (team, month): each with the counts it was read at, most recently used last,
    the oldest let go while they weigh more than `most` (_weight; a month heavier is not kept)."""

    def __init__(self, most: int):
        self.most = most
        self._months: OrderedDict[tuple[str, object], tuple[tuple[int, int], Month]] = OrderedDict()
        self._held = 0
        self._lock = threading.Lock()

    def get(self, key, counts) -> Month | None:
        with self._lock:
            kept = self._months.get(key)
            if kept is None or kept[0] != counts:
                return None
            self._months.move_to_end(key)
            return kept[1]

    def put(self, key, counts, month: Month) -> None:
        size = _weight(month)
        with self._lock:
            old = self._months.pop(key, None)
            if old is not None:
                self._held -= _weight(old[1])
            if size > self.most:
                return
            self._months[key] = (counts, month)
            self._held += size
            while self._held > self.most:
                _, (_, gone) = self._months.popitem(last=False)
                self._held -= _weight(gone)


KEPT = _Kept(KEPT_RECORDS)


def month_of(team, year, month) -> Month:
    """The month's records (month_records) and statement: read and made again only when its
    counts of final records and credits moved since this worker last read it. Whatever is
    written while it reads (the counts first) is at most newer than the counts it is kept under,
    and counts only grow: the next call reads it again.

    Not kept: a month with no records (two queries that find nothing read it again; a client
    asking for every month since 1970 must not fill the worker), and a month read inside a
    transaction of the caller's, which may yet roll back what it read (a test's own transaction
    aside)."""
    start, _end = statements.month_bounds(year, month)
    team_id = getattr(team, "pk", team)
    found = MONTH_COUNTS(team=team_id, period=start.date())
    counts = tuple(found[0]) if found else (0, 0)
    key = (str(team_id), start.date())
    kept = KEPT.get(key, counts)
    if kept is None:
        records = tuple(month_records(team_id, year, month))
        kept = Month(records, statements.statement(records))
        if records and not _in_transaction():
            KEPT.put(key, counts, kept)
    return kept


def _in_transaction() -> bool:
    """Inside an atomic block, other than those a Django test case wraps each test in."""
    return any(not getattr(block, "_from_testcase", False) for block in connection.atomic_blocks)


def month_usage(team, year, month):
    """The month's statement: its records are what statements.statement reads (a Billable)."""
    return month_of(team, year, month).statement
