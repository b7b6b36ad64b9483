"""What a job sends its team's MLflow tracker, decided over plain data: no Django, no HTTP.

- metric_points: a job's metric events (the rows the runner stores) as MLflow metrics, one point
  per value, in sequence order, each remembering the event it came from.
- next_batch: the points of one log-batch request (MLflow takes at most 1000 metrics in one),
  cut on event boundaries, so the worker's cursor (the last event delivered) moves only over
  events sent whole. An event with more values than a batch holds is sent in parts, the cursor
  then counting the points of it already delivered.
- missing: of a batch whose earlier send got no answer (the server may have stored it), the
  points the server's history does not have yet: a resend doubles none.
- params: a job's hyperparameters and config as MLflow parameters (flattened, stringified,
  cut to MLflow's limits).
- retry_delay: the backoff after failed attempts.
"""

import json
import math
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

# MLflow's limits (mlflow/utils/validation.py).
MAX_METRICS_PER_BATCH = 1000
MAX_PARAMS_PER_BATCH = 100
MAX_KEY_LENGTH = 250
MAX_PARAM_VALUE_LENGTH = 6000
MAX_TAG_VALUE_LENGTH = 8000

# A job's state, as the run's status when it ends.
RUN_STATUS = {"succeeded": "FINISHED", "stopped": "FINISHED", "failed": "FAILED", "cancelled": "KILLED"}

NON_FINITE = ("NaN", "Infinity", "-Infinity")  # as the SDK writes them, and as MLflow's JSON takes them

Value = float | str  # a float, or one of NON_FINITE


@dataclass(frozen=True)
class Point:
    seq: int  # the job event it came from
    key: str
    value: Value
    timestamp: int  # milliseconds since the epoch
    step: int

    def as_mlflow(self) -> dict[str, Any]:
        return {"key": self.key, "value": self.value, "timestamp": self.timestamp, "step": self.step}

    def identity(self) -> tuple[str, int, int, str]:
        return identity(self.key, self.step, self.timestamp, self.value)


def identity(key: str, step: int, timestamp: int, value: Any) -> tuple[str, int, int, str]:
    """What tells one stored point from another: a point the server has with the same key,
    step, timestamp and value is the one sent. Values compare by repr, so NaN equals NaN."""
    if isinstance(value, str):
        number = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}.get(value)
        value = number if number is not None else value
    return key, int(step), int(timestamp), repr(float(value)) if isinstance(value, (int, float)) else str(value)


def millis(at: datetime) -> int:
    return round(at.timestamp() * 1000)


_BAD = re.compile(r"[^\w.\- /]")


def key_of(name: str) -> str:
    """A metric or parameter name as MLflow takes it: letters, digits, _ - . space and /, at
    most 250 characters, and no path that resolves to another name ("a//b", "./a", "/a")."""
    key = _BAD.sub("_", str(name))[:MAX_KEY_LENGTH]
    parts = key.split("/")
    if any(part in ("", ".", "..") for part in parts):
        key = key.replace("/", "_")
    if key in ("", ".", ".."):
        key = f"_{key}"
    return key


def number(raw: Any) -> Value | None:
    """A metric value as MLflow takes it: a finite float, a non-finite one as its name, None
    for what is no number (a bool, some text): no point."""
    if isinstance(raw, bool):
        return None
    if isinstance(raw, (int, float)):
        value = float(raw)
        if math.isfinite(value):
            return value
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(raw, str) and raw in NON_FINITE:
        return raw
    return None


def metric_points(events: Iterable[tuple[int, datetime, Any]], ordinal: int = 0) -> list[Point]:
    """The points of metric events given as (seq, at, data) in sequence order, data being
    {"step": int or None, "values": {name: value}}. A point logged without a step gets the
    ordinal of its event among the job's metric events (`ordinal`: how many came before these),
    as the job's page places it."""
    points = []
    for index, (seq, at, data) in enumerate(events):
        data = data if isinstance(data, Mapping) else {}
        step = data.get("step")
        step = step if isinstance(step, int) and not isinstance(step, bool) else ordinal + index
        values = data.get("values")
        for name, raw in values.items() if isinstance(values, Mapping) else ():
            value = number(raw)
            if value is not None:
                points.append(Point(seq, key_of(name), value, millis(at), step))
    return points


@dataclass(frozen=True)
class Batch:
    points: list[Point]
    cursor: int  # the last event delivered once this batch is
    partial: int  # and how many points of the event after it (0: none)


def next_batch(points: Sequence[Point], cursor: int, partial: int = 0, limit: int = MAX_METRICS_PER_BATCH) -> Batch:
    """The next batch of points (all after `cursor`, in order, the first `partial` points of the
    first event already delivered): whole events while they fit; an event larger than a batch
    alone, in parts. Its cursor and partial are where delivery stands once it is sent."""
    first = points[0].seq if points else None
    pending = _skip(list(points), first, partial) if partial and first is not None else list(points)
    taken: list[Point] = []
    index = 0
    while index < len(pending):
        seq = pending[index].seq
        end = index
        while end < len(pending) and pending[end].seq == seq:
            end += 1
        event = pending[index:end]
        if len(taken) + len(event) <= limit:
            taken += event
            cursor, index = seq, end
            continue
        if not taken:  # an event larger than a batch: its first points now, the rest after
            return Batch(event[:limit], cursor, (partial if seq == first else 0) + limit)
        break
    return Batch(taken, cursor, 0 if taken else partial)


def _skip(points: list[Point], seq: int, count: int) -> list[Point]:
    """points without the first `count` of event `seq` (delivered in an earlier batch)."""
    kept, skipped = [], 0
    for point in points:
        if point.seq == seq and skipped < count:
            skipped += 1
            continue
        kept.append(point)
    return kept


def missing(points: Sequence[Point], history: Iterable[Mapping[str, Any]]) -> list[Point]:
    """The points a server's history (its stored metrics as get-history returns them, for the
    keys concerned) does not have: each stored point answers for one point sent."""
    stored = Counter(identity(m["key"], m.get("step", 0), m.get("timestamp", 0), m.get("value")) for m in history)
    left = []
    for point in points:
        mark = point.identity()
        if stored[mark]:
            stored[mark] -= 1
        else:
            left.append(point)
    return left


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)


def _flatten(prefix: str, value: Any, into: dict[str, str]) -> None:
    if isinstance(value, Mapping) and (value or not prefix):  # an empty mapping inside: "{}"
        for name, inner in value.items():
            _flatten(f"{prefix}.{name}" if prefix else str(name), inner, into)
        return
    key = key_of(prefix)
    if key not in into:  # two names cut or cleaned to one key: the first stays (MLflow refuses a second value)
        into[key] = _text(value)[:MAX_PARAM_VALUE_LENGTH]


def params(hyperparameters: Any, config: Any) -> list[dict[str, str]]:
    """A job's hyperparameters (by their names) and config (under "config.") as MLflow
    parameters: nested mappings flattened with dots, other values as JSON text."""
    flat: dict[str, str] = {}
    if isinstance(hyperparameters, Mapping):
        _flatten("", hyperparameters, flat)
    if isinstance(config, Mapping) and config:
        _flatten("config", config, flat)
    return [{"key": key, "value": value} for key, value in flat.items()]


def chunks(items: Sequence[Any], size: int) -> list[Sequence[Any]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def retry_delay(attempts: int, first: float = 5.0, cap: float = 300.0) -> float:
    """Seconds to wait after the `attempts`-th failure in a row: first, doubled each time, at most cap."""
    if attempts < 1:
        return 0.0
    return min(cap, first * 2 ** min(attempts - 1, 32))
