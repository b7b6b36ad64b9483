"""Invoices: pure functions over plain data, no database.

An invoice has one line per job (its allocations in the month summed, the amount rounded once,
half-even, to cents), one credit line per job with a credit (negative, with the reason), and,
for information, each job's queue time and staging time at no charge. Its total is the sum of
its rounded lines. The same lines make the statement of the month so far (a draft, never
numbered), the issued invoice's stored rows, its PDF and its CSV.
"""

import csv
import io
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

from billing import meter, statements
from core.text import format_duration

USAGE = "usage"
CREDIT = "credit"
QUEUE = "queue"
STAGING = "staging"
BILLED_KINDS = (USAGE, CREDIT)
ZERO = Decimal("0.00")


# One usage record (one allocation released in the month): the statement's, shared.
Usage = statements.Usage


@dataclass(frozen=True)
class JobTimes:
    """A job's waiting, shown on the invoice and not billed."""

    queue_seconds: int = 0
    staging_seconds: int | None = None  # None: the job was never staged


@dataclass(frozen=True)
class Line:
    kind: str
    job_id: str
    job_name: str
    amount: Decimal
    description: str = ""
    gpu_type: str = ""
    gpus: int = 0
    seconds: int = 0
    gpu_seconds: int = 0
    rates: tuple[Decimal, ...] = ()

    @property
    def hours(self) -> Decimal:
        return Decimal(self.seconds) / 3600

    @property
    def duration(self) -> str:
        return format_duration(self.seconds)

    @property
    def rates_text(self) -> str:
        return " ".join(str(r) for r in self.rates)


@dataclass(frozen=True)
class Document:
    """An invoice, a credit note or a statement (a draft: no number, no issue date)."""

    team_name: str
    period_start: datetime
    period_end: datetime
    currency: str
    lines: tuple[Line, ...]
    kind: str = "invoice"  # or "credit_note"
    state: str = "draft"  # or "issued"
    number: str = ""
    issued_at: datetime | None = None
    corrects_number: str = ""
    reason: str = ""
    extra: dict[str, object] = field(default_factory=dict, compare=False)

    @property
    def subtotal(self) -> Decimal:
        return sum((line.amount for line in self.lines if line.kind == USAGE), ZERO)

    @property
    def credits(self) -> Decimal:
        return sum((line.amount for line in self.lines if line.kind == CREDIT), ZERO)

    @property
    def total(self) -> Decimal:
        return sum((line.amount for line in self.lines), ZERO)

    @property
    def month(self) -> str:
        return f"{self.period_start:%Y-%m}"

    @property
    def title(self) -> str:
        if self.kind == "credit_note":
            return "Credit note"
        return "Invoice" if self.state == "issued" else "Statement"


def number(year: int, sequence: int) -> str:
    """The invoice number: the year of issue and the team's sequence within it."""
    return f"{year:04d}-{sequence:04d}"


def queue_seconds(submitted_at: datetime | None, first_start: datetime | None) -> int:
    """Seconds from submission to the first allocation's start (0 when not known)."""
    if submitted_at is None or first_start is None:
        return 0
    return meter.held_seconds(submitted_at, first_start)


def staging_seconds(intervals: Iterable[tuple[datetime | None, datetime | None]]) -> int | None:
    """Whole seconds a job's stagings took: the sum over (started_at, finished_at) pairs of
    the finished ones; None when there were none."""
    spans = [(a, b) for a, b in intervals if a is not None and b is not None]
    if not spans:
        return None
    return sum(meter.held_seconds(a, b) for a, b in spans)


def lines(usages: Iterable[Usage], times: Mapping[str, JobTimes] | None = None) -> tuple[Line, ...]:
    """The lines of the usages: per job, in the order of its first record, a usage line, a
    credit line when it has a credit, then its queue and staging times (amount 0)."""
    times = times or {}
    by_job: dict[str, list[Usage]] = {}
    for usage in usages:
        by_job.setdefault(usage.job_id, []).append(usage)
    out: list[Line] = []
    for job_id, items in by_job.items():
        name = items[0].job_name
        out.append(
            Line(
                kind=USAGE,
                job_id=job_id,
                job_name=name,
                gpu_type=", ".join(sorted({u.gpu_type for u in items})),
                gpus=max(u.gpus for u in items),
                seconds=sum(u.held_seconds for u in items),
                gpu_seconds=sum(u.held_seconds * u.gpus for u in items),
                rates=tuple(sorted({Decimal(u.rate) for u in items})),
                amount=meter.round_money(sum((Decimal(u.amount) for u in items), Decimal(0))),
            )
        )
        credited = [u for u in items if u.credit_amount]
        if credited:
            credit = meter.round_money(sum((Decimal(u.credit_amount) for u in credited), Decimal(0)))
            reasons = list(dict.fromkeys(u.credit_reason or "credit" for u in credited))
            out.append(
                Line(
                    kind=CREDIT,
                    job_id=job_id,
                    job_name=name,
                    description="; ".join(reasons),
                    seconds=sum(u.credit_seconds for u in credited),
                    amount=-credit if credit else ZERO,  # never "-0.00"
                )
            )
        waited = times.get(job_id)
        if waited is not None:
            out.append(Line(kind=QUEUE, job_id=job_id, job_name=name, description="queue time, not billed", seconds=waited.queue_seconds, amount=ZERO))
            if waited.staging_seconds is not None:
                out.append(
                    Line(kind=STAGING, job_id=job_id, job_name=name, description="staging time, not billed", seconds=waited.staging_seconds, amount=ZERO)
                )
    return tuple(out)


def credit_note_lines(original_lines: Iterable[Line], reason: str) -> tuple[Line, ...]:
    """A credit note reversing an invoice: each billed line negated (the informational ones
    left out), with the reason."""
    return tuple(
        replace(
            line, amount=-line.amount, description=f"{reason}: reverses " + ("the compute held" if line.kind == USAGE else f"the credit ({line.description})")
        )
        for line in original_lines
        if line.kind in BILLED_KINDS and line.amount
    )


# CSV -----------------------------------------------------------------------------------------

CSV_HEADER = [
    "document",
    "number",
    "state",
    "team",
    "period",
    "issued_at",
    "kind",
    "job_id",
    "job",
    "description",
    "gpu_type",
    "gpus",
    "seconds",
    "duration",
    "gpu_hours",
    "rates_per_gpu_hour",
    "amount",
    "currency",
]


def render_csv(document: Document) -> str:
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(CSV_HEADER)
    head = [
        document.title.lower(),
        document.number,
        document.state,
        document.team_name,
        document.month,
        document.issued_at.isoformat() if document.issued_at else "",
    ]
    for line in document.lines:
        writer.writerow(
            [
                *head,
                line.kind,
                line.job_id,
                line.job_name,
                line.description,
                line.gpu_type,
                line.gpus or "",
                line.seconds,
                line.duration,
                f"{Decimal(line.gpu_seconds) / 3600:.4f}" if line.kind == USAGE else "",
                line.rates_text,
                f"{line.amount:.2f}",
                document.currency,
            ]
        )
    for label, value in (("subtotal", document.subtotal), ("credits", document.credits), ("total", document.total)):
        writer.writerow(head + [label] + [""] * 9 + [f"{value:.2f}", document.currency])
    return out.getvalue()


# PDF -----------------------------------------------------------------------------------------


def _money(value: Decimal, currency: str) -> str:
    value = Decimal(value).quantize(meter.CENTS)
    sign = "-" if value < 0 else ""
    return f"{sign}{currency} {abs(value):,.2f}"


def _rate(value: Decimal) -> str:
    value = Decimal(value).normalize()
    exponent = value.as_tuple().exponent  # a str ('n', 'N', 'F') for NaN and infinities
    if isinstance(exponent, int) and exponent > -2:
        value = value.quantize(meter.CENTS)
    return f"{value:,f}"


def render_pdf(document: Document) -> bytes:
    """The document as a PDF (A4): bytes."""
    from reportlab.lib import colors
    from reportlab.lib.enums import TA_RIGHT
    from reportlab.lib.pagesizes import A4
    from reportlab.lib.styles import ParagraphStyle, getSampleStyleSheet
    from reportlab.lib.units import mm
    from reportlab.platypus import Paragraph, SimpleDocTemplate, Spacer, Table, TableStyle

    buffer = io.BytesIO()
    title = document.title
    label = f"{title} {document.number}" if document.number else f"{title} (draft, not an invoice)"
    doc = SimpleDocTemplate(
        buffer,
        pagesize=A4,
        leftMargin=16 * mm,
        rightMargin=16 * mm,
        topMargin=16 * mm,
        bottomMargin=18 * mm,
        title=f"E31 Network {label}",
        author="E31 Network",
        invariant=1,  # no creation time or random id inside: the same invoice, the same bytes
    )
    styles = getSampleStyleSheet()
    small = ParagraphStyle("small", parent=styles["Normal"], fontSize=8, leading=10)
    cell = ParagraphStyle("cell", parent=styles["Normal"], fontSize=8.5, leading=10.5)
    muted = ParagraphStyle("muted", parent=cell, textColor=colors.HexColor("#666666"))
    right = ParagraphStyle("right", parent=styles["Normal"], alignment=TA_RIGHT, fontSize=9.5, leading=13)
    brand = ParagraphStyle("brand", parent=styles["Title"], alignment=0, fontSize=20, leading=24, spaceAfter=0, textColor=colors.HexColor("#1f3a5f"))

    def esc(text: object) -> str:
        return str(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")

    last_day = document.period_end - timedelta(seconds=1)
    period = f"{document.period_start:%d %b %Y} – {last_day:%d %b %Y} ({document.month})"
    facts = [
        f"<b>{esc(title)}</b> {esc(document.number) if document.number else '(draft)'}",
        f"Team: <b>{esc(document.team_name)}</b>",
        f"Period: {period}",
        f"Issued: {document.issued_at:%d %b %Y %H:%M} UTC" if document.issued_at else "Not issued: the figures so far",
        f"Currency: {esc(document.currency)}",
    ]
    if document.corrects_number:
        facts.append(f"Corrects invoice {esc(document.corrects_number)}")
    header = Table(
        [[Paragraph("E31 Network", brand), Paragraph("<br/>".join(facts), right)]],
        colWidths=[80 * mm, None],
    )
    header.setStyle(TableStyle([("VALIGN", (0, 0), (-1, -1), "TOP"), ("LEFTPADDING", (0, 0), (-1, -1), 0), ("RIGHTPADDING", (0, 0), (-1, -1), 0)]))
    story = [header, Spacer(1, 3 * mm)]
    story.append(
        Paragraph(
            "Compute rented on E31 Network: GPUs × hours held, billed per second. Waiting in the queue and staging data are free and shown for information.",
            small,
        )
    )
    if document.reason:
        story.append(Paragraph(f"Reason: {esc(document.reason)}", small))
    story.append(Spacer(1, 5 * mm))

    rows = [["Job", "Type", "GPUs", "Time", "Rate / GPU-h", f"Amount ({document.currency})"]]
    styles_cmds = [
        ("FONT", (0, 0), (-1, 0), "Helvetica-Bold", 8.5),
        ("FONTSIZE", (0, 1), (-1, -1), 8.5),
        ("LINEBELOW", (0, 0), (-1, 0), 0.8, colors.HexColor("#1f3a5f")),
        ("ALIGN", (2, 0), (-1, -1), "RIGHT"),
        ("VALIGN", (0, 0), (-1, -1), "TOP"),
        ("TOPPADDING", (0, 0), (-1, -1), 2.5),
        ("BOTTOMPADDING", (0, 0), (-1, -1), 2.5),
    ]
    for line in document.lines:
        r = len(rows)
        amount = f"{line.amount:,.2f}"
        if line.kind == USAGE:
            job = Paragraph(f"<b>{esc(line.job_name)}</b><br/><font size=6.5 color='#666666'>{esc(line.job_id)}</font>", cell)
            rows.append([job, Paragraph(esc(line.gpu_type), cell), str(line.gpus), line.duration, ", ".join(_rate(x) for x in line.rates), amount])
            if r > 1:
                styles_cmds.append(("LINEABOVE", (0, r), (-1, r), 0.25, colors.HexColor("#cccccc")))
        elif line.kind == CREDIT:
            what = line.description if document.kind == "credit_note" else f"Credit: {line.description}"
            rows.append([Paragraph(f"&nbsp;&nbsp;{esc(what)}", cell), "", "", line.duration, "", amount])
            styles_cmds += [("TEXTCOLOR", (5, r), (5, r), colors.HexColor("#8a1c1c")), ("SPAN", (0, r), (2, r))]
        else:
            rows.append([Paragraph(f"&nbsp;&nbsp;{esc(line.description.capitalize())}", muted), "", "", line.duration, "", amount])
            styles_cmds += [("TEXTCOLOR", (0, r), (-1, r), colors.HexColor("#666666")), ("SPAN", (0, r), (2, r))]
    if len(rows) == 1:
        rows.append([Paragraph("No compute was released to the team in this period.", muted), "", "", "", "", "0.00"])
    table = Table(rows, colWidths=[62 * mm, 30 * mm, 12 * mm, 20 * mm, 24 * mm, None], repeatRows=1)
    table.setStyle(TableStyle(styles_cmds))
    story.append(table)
    story.append(Spacer(1, 5 * mm))

    totals = [
        ["Subtotal", _money(document.subtotal, document.currency)],
        ["Credits", _money(document.credits, document.currency)],
        ["Total" if document.kind != "credit_note" else "Total credited", _money(document.total, document.currency)],
    ]
    totals_table = Table(totals, colWidths=[None, 40 * mm], hAlign="RIGHT")
    totals_table.setStyle(
        TableStyle(
            [
                ("ALIGN", (0, 0), (-1, -1), "RIGHT"),
                ("FONTSIZE", (0, 0), (-1, -1), 9.5),
                ("FONT", (0, 2), (-1, 2), "Helvetica-Bold", 11),
                ("LINEABOVE", (0, 2), (-1, 2), 0.8, colors.HexColor("#1f3a5f")),
                ("TOPPADDING", (0, 2), (-1, 2), 5),
            ]
        )
    )
    story.append(totals_table)
    story.append(Spacer(1, 8 * mm))
    story.append(
        Paragraph(
            "Amounts are rounded once per line, half to even, to the cent; the total is the sum of the rounded lines. "
            "Credits return time lost through the network's fault (a node lost, a preemption) since a job's last checkpoint.",
            small,
        )
    )

    def footer(canvas: Any, doc_: Any) -> None:  # reportlab's Canvas and doc template (reportlab has no type hints)
        canvas.saveState()
        canvas.setFont("Helvetica", 7.5)
        canvas.setFillColor(colors.HexColor("#666666"))
        canvas.drawString(16 * mm, 10 * mm, f"E31 Network · {label} · {document.team_name} · {document.month}")
        canvas.drawRightString(A4[0] - 16 * mm, 10 * mm, f"Page {doc_.page}")
        canvas.restoreState()

    doc.build(story, onFirstPage=footer, onLaterPages=footer)
    return buffer.getvalue()
