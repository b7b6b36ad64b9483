"""A job's log: every line is a JobEvent row; a finished job's log is also kept as a file."""

from jobs.models import JobEvent

LOG_CHUNK = 2000


def log_key(job_id):
    """Where a finished job's whole log is kept as a file in storage."""
    return f"jobs/{job_id}/log.txt"


def stream_log(job):
    """The job's whole log as text, read from the database in chunks (never all in memory).
    A line of a run under torchrun keeps its rank, as torchrun writes it: "[rank1]:text"."""
    after = 0
    while True:
        rows = list(
            JobEvent.objects.filter(job=job, kind="log", seq__gt=after).order_by("seq").values_list("seq", "rank", "text")[
                :LOG_CHUNK
            ]
        )
        if not rows:
            return
        after = rows[-1][0]
        yield "".join(f"{text}\n" if rank is None else f"[rank{rank}]:{text}\n" for _, rank, text in rows)
