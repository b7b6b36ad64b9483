"""A job's log: every line is a JobEvent row; a finished job's log is also kept as a file."""

from html import escape

from django.db.models import Count, Func, IntegerField, Sum
from django.utils.safestring import mark_safe

from jobs.models import JobEvent

LOG_CHUNK = 2000


def lines_html(lines):
    """The job page's log lines ((seq, stream, rank, text) rows) as its HTML: what the
    template's loop over them wrote, made here. Each line went through the template's machinery
    (escaping, localizing the numbers, the rank's two tests): with 500 lines the page took 25.8 ms
    of CPU, so 18.9 (in-process, bench/read_load.py's data). escape is html.escape, as Django's."""
    out = []
    for seq, stream, rank, text in lines:
        ranked = f' data-rank="{rank}"><span class="rank">[{rank}]</span> ' if rank is not None else ">"
        out.append(f'<span class="line {escape(stream)}" data-seq="{seq}"{ranked}{escape(text)}\n</span>')
    return mark_safe("".join(out))  # noqa: S308 - every value above is escaped or a number


def log_key(job_id):
    """Where a finished job's whole log is kept as a file in storage."""
    return f"jobs/{job_id}/log.txt"


class OctetLength(Func):
    """A text's length in UTF-8 bytes (LENGTH counts characters)."""

    function = "OCTET_LENGTH"
    output_field = IntegerField()

    def as_sqlite(self, compiler, connection, **extra):
        return self.as_sql(compiler, connection, template="LENGTH(CAST(%(expressions)s AS BLOB))", **extra)


def stored_bytes(job_id):
    """The bytes of the job's stored log as its log cap counts them (agent/logcap.py
    line_bytes): each line's UTF-8 text and its newline. One aggregate query, when a run starts."""
    found = JobEvent.objects.filter(job_id=job_id, kind="log").aggregate(text=Sum(OctetLength("text")), lines=Count("pk"))
    return (found["text"] or 0) + found["lines"]


def stream_log(job):
    """The job's whole log as text, read from the database in chunks (never all in memory).
    A line of a run under torchrun keeps its rank, as torchrun writes it: "[rank1]:text"."""
    after = 0
    while True:
        rows = list(JobEvent.objects.filter(job=job, kind="log", seq__gt=after).order_by("seq").values_list("seq", "rank", "text")[:LOG_CHUNK])
        if not rows:
            return
        after = rows[-1][0]
        yield "".join(f"{text}\n" if rank is None else f"[rank{rank}]:{text}\n" for _, rank, text in rows)
