"""A job's run as its page and the API read it: its metric series (from its metric events, built
by jobs.metrics) and its checkpoints, kept and pruned."""

from functools import cache

from django.db.models import BigIntegerField, F, UUIDField
from django.http import Http404

from core.compiled import Param, Read
from core.storage import get_storage
from jobs import metrics
from jobs.models import JobEvent, event_message

# Metrics ------------------------------------------------------------------------------------


METRIC_CHUNK = 2000  # metric events read at a time
LAST_SEQ = 2**63 - 1  # the largest seq there can be (a bigint)


@cache
def metric_points(chunk):
    """A job's metric points after a seq and up to one, `chunk` at most, their SQL made once
    (core.compiled)."""
    return Read(
        lambda: (
            JobEvent.objects.filter(
                job_id=Param("job", UUIDField()), kind="metric", seq__gt=Param("after", BigIntegerField()), seq__lte=Param("upto", BigIntegerField())
            )
            .order_by("seq")
            .values_list("seq", "at", "data")[:chunk]
        )
    )


def metric_events(job, after=0, upto=None, chunk=METRIC_CHUNK, first=None):
    """The job's metric events after seq `after` (up to `upto`), in order, as the websocket
    sends them; read `chunk` at a time, each chunk after the last seq read (events are only
    appended, with growing seqs), so a job with many thousands of points is not held as rows.
    A job's page reads its usual hundred points in one query, where a server-side cursor cost
    three round trips (DECLARE, FETCH, CLOSE) and a copy of the rows into the cursor.
    first: the first chunk, where the caller read it (metric_points(chunk) with these values)."""
    read = metric_points(chunk)
    while True:
        if first is None:
            page = read(job=job.pk, after=after, upto=LAST_SEQ if upto is None else upto)
        else:
            page, first = first, None
        for seq, at, data in page:
            yield event_message(seq, "metric", at, "", "", data)
        if len(page) < chunk:
            return
        after = page[-1][0]


def metric_modes(job):
    """Which way is better for the job's early-stopping metric, when it has one."""
    return {job.early_stop_metric: job.early_stop_mode} if job.early_stop_metric else {}


def metrics_data(job, after=0, upto=None, names=None, limit=None, first=None):
    """{"series", "summary", "events", "last_seq"} of the job's metric points after seq `after`
    (see jobs.metrics); events: how many metric events the job had up to the last one read
    (the x of step-less points continues from there). first: metric_events'."""
    offset = job.events.filter(kind="metric", seq__lte=after).count() if after else 0
    counted = []

    def counting(events):
        for event in events:
            counted.append(event["seq"])
            yield event

    data = metrics.build(counting(metric_events(job, after, upto, first=first)), names=names, offset=offset, limit=limit, modes=metric_modes(job))
    data["events"] = offset + len(counted)
    data["last_seq"] = max(counted[-1] if counted else 0, after, upto or 0)
    return data


# Checkpoints --------------------------------------------------------------------------------


def job_checkpoints(job):
    """Kept and pruned checkpoints, the newest first."""
    return job.checkpoints.select_related("allocation__node").order_by("-written_at", "-id")


def get_checkpoint(job, name):
    """The job's checkpoint of that name (a kept one before a pruned one), or Http404."""
    checkpoint = job.checkpoints.filter(name=name).order_by(F("pruned_at").desc(nulls_first=True), "-written_at", "-id").first()
    if checkpoint is None:
        raise Http404("No such checkpoint.")
    return checkpoint


def gone_message(job, checkpoint):
    when = checkpoint.pruned_at.strftime("%Y-%m-%d %H:%M UTC") if checkpoint.pruned_at else "earlier"
    return (
        f"Checkpoint {checkpoint.name} was deleted from storage ({when}): a job keeps only its latest "
        f"{job.keep_checkpoints} checkpoint{'s' if job.keep_checkpoints != 1 else ''}."
    )


def checkpoint_is_gone(checkpoint):
    return checkpoint.pruned_at is not None or not get_storage().exists(checkpoint.key)
