"""A job's metric points as chart series: pure functions over event dicts, no database.

The input is a job's `metric` events in sequence order, as the websocket sends them
(jobs.models.event_message): {"seq", "kind", "at", "step", "values": {name: value}}; "at" may
be an ISO string or a datetime. Each name in "values" is one series.

A series is a list of points [x, value, at]:
- x is the point's step; a point logged without one (step None) gets the ordinal of its event
  among the job's metric events (0 for the first; `offset` is how many came before the events
  given), so it still has a place on the x axis (after the series' last point, if that is
  further on).
- value is a float, or None when the job logged a non-finite value ("NaN", "Infinity",
  "-Infinity" as the SDK writes them). Such a point has a fourth item, that string, so it is
  reported as what it was while a chart just leaves a gap: [x, None, at, "NaN"].
  A value that is no number at all (a bool, an arbitrary string) is no point.
- A job resumed from a checkpoint logs some steps again: a point at or before the last x of its
  series rewinds the series to before it (as agent.stopping.Watch does), so each series
  has increasing x and shows the run's surviving history. A client appending newer points
  (the job page, an API client using ?after=) rewinds the same way.

downsample() bounds a series for the page: min/max buckets (see there). summarize() gives the
count, last, min/max and best value of each series.
"""

import math
from datetime import datetime

NON_FINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}

# Which way is better for a series, from its name, when the job's early stopping does not say.
LOWER_IS_BETTER = ("loss", "err", "perplexity", "ppl", "mse", "mae", "rmse", "nll", "wer", "cer")
HIGHER_IS_BETTER = ("acc", "f1", "auc", "precision", "recall", "score", "bleu", "rouge", "map", "iou", "r2", "reward")


def parse_value(raw):
    """(number, label): a finite float and None; None and "NaN"/"Infinity"/"-Infinity" for a
    non-finite value (given as that string or as a float); (None, None) for no number at all."""
    if isinstance(raw, bool):
        return None, None
    if isinstance(raw, (int, float)):
        value = float(raw)
        if math.isfinite(value):
            return value, None
        return None, "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(raw, str) and raw in NON_FINITE:
        return None, raw
    return None, None


def _iso(at):
    return at.isoformat() if isinstance(at, datetime) else at


def _payload(event):
    """An event dict as event_message makes it, or a stored row's {"at", "data": {...}}."""
    if "values" not in event and isinstance(event.get("data"), dict):
        return {**event["data"], "at": event.get("at"), "seq": event.get("seq")}
    return event


def add_point(points, x, value, at, label=None, step=True):
    """Append a point to a series, first rewinding it past x (a resumed run's repeated steps).
    A step-less point (step=False) never rewinds: it goes after the last point."""
    if not step:
        x = max(x, points[-1][0] + 1) if points else x
    while points and points[-1][0] >= x:
        points.pop()
    points.append([x, value, at] if label is None else [x, None, at, label])


def series_from_events(events, names=None, offset=0, into=None):
    """{name: [[x, value_or_None, at_iso(, label)], ...]} from metric events in order.

    names: only these series (an iterable of names; None for all). offset: how many of the job's
    metric events came before these (the x of step-less points continues from there). into: the
    series read from those earlier events, which these continue (and may rewind); extended in
    place."""
    wanted = set(names) if names is not None else None
    series = {} if into is None else into
    ordinal = offset
    for event in events:
        event = _payload(event)
        if event.get("kind", "metric") != "metric":
            continue
        step = event.get("step")
        has_step = isinstance(step, int) and not isinstance(step, bool)
        x = step if has_step else ordinal
        ordinal += 1
        at = _iso(event.get("at"))
        for name, raw in (event.get("values") or {}).items():
            if wanted is not None and name not in wanted:
                continue
            value, label = parse_value(raw)
            if value is None and label is None:
                continue
            add_point(series.setdefault(name, []), x, value, at, label, step=has_step)
    return series


def downsample(points, limit):
    """At most `limit` points of a series, for drawing (the series itself when it is shorter).

    The points are cut into equal runs (buckets) of consecutive points; each bucket keeps its
    first and last point, its lowest and highest value and its first non-finite point (a gap in
    the chart), in their original order: 5 at most, so there are limit // 5 buckets. A chart
    of the result has the same shape, spikes and gaps as the whole series, the first and last
    points are always kept, and the series' min and max (so its best value) survive exactly.
    """
    limit = int(limit)
    if limit <= 0 or len(points) <= limit:
        return list(points)
    if limit < 5:
        return [points[0], points[-1]][:limit] if limit > 1 else [points[-1]]
    buckets = limit // 5
    size = len(points) / buckets
    kept = []
    for b in range(buckets):
        start, end = int(b * size), int((b + 1) * size) if b < buckets - 1 else len(points)
        if start >= end:
            continue
        chosen = {start, end - 1}
        low = high = gap = None
        for i in range(start, end):
            value = points[i][1]
            if value is None:
                if gap is None:
                    gap = i
                continue
            if low is None or value < points[low][1]:
                low = i
            if high is None or value > points[high][1]:
                high = i
        chosen.update(i for i in (low, high, gap) if i is not None)
        kept.extend(points[i] for i in sorted(chosen))
    return kept


def best_mode(name, early_stop_metric="", early_stop_mode="min"):
    """ "min" or "max": which way is better for a series; None when its name does not say.

    The job's early-stopping metric goes its configured way; otherwise a name holding "loss",
    "err", ... is better lower, and one holding "acc", "f1", "auc", ... higher."""
    if early_stop_metric and name == early_stop_metric:
        return early_stop_mode
    lowered = name.lower()
    if any(word in lowered for word in LOWER_IS_BETTER):
        return "min"
    if any(word in lowered for word in HIGHER_IS_BETTER):
        return "max"
    return None


def summarize(series, modes=None):
    """{name: {...}} for each series: count (points), last (the last value: a float, or its
    "NaN"/"Infinity"/"-Infinity" string), last_x, last_at, min, max (finite values; None when
    none), non_finite (how many points were not finite), mode ("min", "max" or None: which way
    is better) and best, best_x (the best finite value and where; None without a mode).

    modes: {name: "min"|"max"} for series whose direction is known (else from best_mode)."""
    modes = modes or {}
    summary = {}
    for name, points in series.items():
        mode = modes.get(name) or best_mode(name)
        low = high = None
        non_finite = 0
        for point in points:
            if point[1] is None:
                non_finite += 1
            else:
                if low is None or point[1] < low[1]:
                    low = point
                if high is None or point[1] > high[1]:
                    high = point
        best = low if mode == "min" else high if mode == "max" else None
        last = points[-1] if points else None
        summary[name] = {
            "count": len(points),
            "last": (last[1] if last[1] is not None else last[3]) if last else None,
            "last_x": last[0] if last else None,
            "last_at": last[2] if last else None,
            "min": low[1] if low else None,
            "max": high[1] if high else None,
            "non_finite": non_finite,
            "mode": mode,
            "best": best[1] if best else None,
            "best_x": best[0] if best else None,
        }
    return summary


def build(events, names=None, offset=0, limit=None, modes=None):
    """{"series": ..., "summary": ...}: the series (each downsampled to `limit` points when
    given) and the summary of the whole series (before downsampling)."""
    series = series_from_events(events, names=names, offset=offset)
    summary = summarize(series, modes)
    if limit:
        series = {name: downsample(points, limit) for name, points in series.items()}
    return {"series": series, "summary": summary}


def format_value(value):
    """A metric value as text: 6 significant digits, or its non-finite name."""
    if value is None:
        return "–"
    if isinstance(value, str):
        return value
    return f"{value:.6g}"
