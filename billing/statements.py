"""Monthly usage statements: pure functions over plain records, no database."""

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, date, datetime
from decimal import Decimal
from typing import Protocol

from billing import meter


@dataclass(frozen=True)
class Usage:
    job_id: str
    job_name: str
    gpus: int
    gpu_type: str
    held_seconds: int
    rate: Decimal
    amount: Decimal
    credit_seconds: int = 0
    credit_amount: Decimal = Decimal(0)
    credit_reason: str = ""


class Billable(Protocol):
    """What a statement reads of each record: a Usage, or anything with its fields (the usage
    endpoint's rows, billing.usage.Record, which need no copying into Usages first)."""

    @property
    def job_id(self) -> str: ...
    @property
    def job_name(self) -> str: ...
    @property
    def gpus(self) -> int: ...
    @property
    def gpu_type(self) -> str: ...
    @property
    def held_seconds(self) -> int: ...
    @property
    def rate(self) -> Decimal: ...
    @property
    def amount(self) -> Decimal: ...
    @property
    def credit_seconds(self) -> int: ...
    @property
    def credit_amount(self) -> Decimal: ...


@dataclass(frozen=True)
class Line:
    job_id: str
    job_name: str
    gpus: int
    gpu_type: str
    held_seconds: int
    gpu_seconds: int
    rates: tuple[Decimal, ...]
    amount: Decimal  # what the held time cost, rounded once, here
    credit_seconds: int = 0
    credit: Decimal = Decimal("0.00")  # lost through the network's fault, rounded once

    @property
    def billed(self) -> Decimal:
        return self.amount - self.credit

    @property
    def held_hours(self) -> Decimal:
        return Decimal(self.held_seconds) / 3600

    @property
    def gpu_hours(self) -> Decimal:
        return Decimal(self.gpu_seconds) / 3600


@dataclass(frozen=True)
class Statement:
    lines: list[Line]
    total: Decimal  # the sum of the rounded lines, less their credits

    @property
    def credits(self) -> Decimal:
        return sum((line.credit for line in self.lines), Decimal("0.00"))

    @property
    def held_seconds(self) -> int:
        return sum(line.held_seconds for line in self.lines)


def statement(usages: Iterable[Billable]) -> Statement:
    """One line per job (its allocations summed), each amount and credit rounded once; the
    total sums what the lines bill (amount less credit)."""
    by_job: dict[str, list[Billable]] = {}
    for usage in usages:
        by_job.setdefault(usage.job_id, []).append(usage)
    lines = []
    for job_id, items in by_job.items():
        first = items[0]
        if len(items) == 1:  # most jobs ran once: the same line, without the sums' generators
            lines.append(
                Line(
                    job_id=job_id,
                    job_name=first.job_name,
                    gpus=first.gpus,
                    gpu_type=first.gpu_type,
                    held_seconds=first.held_seconds,
                    gpu_seconds=first.held_seconds * first.gpus,
                    rates=(first.rate,),
                    amount=meter.round_money(first.amount),
                    credit_seconds=first.credit_seconds,
                    credit=meter.round_money(first.credit_amount),
                )
            )
            continue
        lines.append(
            Line(
                job_id=job_id,
                job_name=first.job_name,
                gpus=max(u.gpus for u in items),
                gpu_type=", ".join(sorted({u.gpu_type for u in items})),
                held_seconds=sum(u.held_seconds for u in items),
                gpu_seconds=sum(u.held_seconds * u.gpus for u in items),
                rates=tuple(sorted({u.rate for u in items})),
                amount=meter.round_money(sum((u.amount for u in items), Decimal(0))),
                credit_seconds=sum(u.credit_seconds for u in items),
                credit=meter.round_money(sum((u.credit_amount for u in items), Decimal(0))),
            )
        )
    return Statement(lines=lines, total=sum((line.billed for line in lines), Decimal("0.00")))


def month_bounds(year: int, month: int) -> tuple[datetime, datetime]:
    start = datetime(year, month, 1, tzinfo=UTC)
    end = datetime(year + (month == 12), month % 12 + 1, 1, tzinfo=UTC)
    return start, end


def parse_month(text: str, today: date) -> tuple[int, int]:
    """'YYYY-MM' to (year, month); today's month when empty. ValueError on anything else."""
    if not text:
        return today.year, today.month
    year, sep, month = text.partition("-")
    if not (sep and year.isdigit() and month.isdigit() and len(year) == 4 and 1 <= int(month) <= 12):
        raise ValueError(f"{text!r} is not a month: use YYYY-MM")
    if not 1970 <= int(year) <= 9998:
        raise ValueError(f"{text!r} is out of range: use a year from 1970 to 9998")
    return int(year), int(month)
