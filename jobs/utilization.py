"""Device utilization: samples in; compact windows, summaries, right-size hints and idle out.

Pure functions over plain data (no ORM, no processes): the runner feeds readings in, the job
page and the form read the results; tests use recorded samples.

A *series* is one device a job holds: a GPU (utilization 0-100, its memory), or, on a CPU node,
the job's whole process tree as one series whose utilization counts the cores it keeps busy
(100 = one core, 250 = two and a half). Either way, utilization / 100 is "devices' worth busy".

A *window* is stored as a list, to keep a job-hour a few KB:
    [start, seconds, [[mean %, peak %, mean MiB, peak MiB], ...one per series]]
start: seconds since the allocation started; seconds: how long its samples cover.
"""

import json
import math
from dataclasses import dataclass, field
from decimal import ROUND_HALF_UP, Decimal

MIB = 1024 * 1024


@dataclass(frozen=True)
class Reading:
    """One sample of one series."""

    util: float  # percent of one device
    memory: int  # bytes in use


# Windows ------------------------------------------------------------------------------------------


def _num(value):
    """A number rounded to a tenth, written without ".0" when whole (bytes count when stored)."""
    value = round(value, 1)
    return int(value) if value == int(value) else value


def merge(windows):
    """Windows (of the same series) as one: means weighted by the seconds each covers, peaks kept."""
    seconds = sum(w[1] for w in windows) or 0
    count = len(windows[0][2])
    merged = []
    for i in range(count):
        weight = seconds or len(windows)
        mean_util = sum(w[2][i][0] * (w[1] if seconds else 1) for w in windows) / weight
        mean_mem = sum(w[2][i][2] * (w[1] if seconds else 1) for w in windows) / weight
        merged.append([_num(mean_util), max(w[2][i][1] for w in windows), round(mean_mem), max(w[2][i][3] for w in windows)])
    return [windows[0][0], _num(seconds), merged]


def coarsen(windows, width):
    """Windows of `width` seconds merged two by two into windows of twice the width (aligned on
    the allocation's start, so windows on either side of a gap are never merged)."""
    groups = {}
    for window in windows:
        groups.setdefault(int(window[0] // (2 * width)), []).append(window)
    return [merge(group) for _, group in sorted(groups.items())]


@dataclass
class Recorder:
    """Samples of one allocation into windows of `width` seconds. When more than `limit`
    windows are kept, they are merged two by two and the width doubles: a long run keeps an
    even, coarser picture in at most `limit` windows."""

    every: float = 2.0  # seconds between samples: each sample stands for this long
    width: float = 30.0
    limit: int = 240
    windows: list = field(default_factory=list)
    _open: dict | None = None

    def add(self, t, readings):
        """One sample, t seconds after the start. True when a window was closed (worth storing)."""
        closed = False
        index = int(t // self.width)
        if self._open is not None and (self._open["index"] != index or len(self._open["sums"]) != len(readings)):
            self.windows.append(self._close())
            closed = True
            while len(self.windows) > self.limit:
                self.windows = coarsen(self.windows, self.width)
                self.width *= 2
                index = int(t // self.width)
        if self._open is None:
            self._open = {
                "index": index,
                "count": 0,
                "sums": [[0.0, 0.0] for _ in readings],
                "peaks": [[0.0, 0] for _ in readings],
            }
        self._add(t, readings)
        return closed

    def _add(self, t, readings):
        o = self._open
        o["count"] += 1
        for sums, peaks, reading in zip(o["sums"], o["peaks"], readings):
            sums[0] += reading.util
            sums[1] += reading.memory
            peaks[0] = max(peaks[0], reading.util)
            peaks[1] = max(peaks[1], reading.memory)

    def _close(self):
        o, self._open = self._open, None
        start = o["index"] * self.width
        seconds = min(o["count"] * self.every, self.width)
        series = [[_num(s[0] / o["count"]), _num(p[0]), round(s[1] / o["count"] / MIB), round(p[1] / MIB)] for s, p in zip(o["sums"], o["peaks"])]
        return [_num(start), _num(seconds), series]

    def snapshot(self):
        """Every window, the one still open included (what is stored)."""
        if self._open is None:
            return list(self.windows)
        open_copy = dict(self._open, sums=[list(s) for s in self._open["sums"]], peaks=[list(p) for p in self._open["peaks"]])
        last = self._close()
        self._open = open_copy
        return [*self.windows, last]


def stored_bytes(windows):
    """What the windows take as JSON (compact separators)."""
    return len(json.dumps(windows, separators=(",", ":")))


# Summary ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SeriesSummary:
    name: str
    mean: float  # percent of one device
    peak: float
    memory_mean: int  # bytes
    memory_peak: int
    memory_total: int | None  # the device's memory (or the job's memory limit), if known


@dataclass(frozen=True)
class Summary:
    series: list
    seconds: float  # time the samples cover

    @property
    def busy(self):
        """Devices' worth kept busy: the sum of the mean utilizations, in devices."""
        return sum(s.mean for s in self.series) / 100

    @property
    def memory_peak(self):
        return max((s.memory_peak for s in self.series), default=0)

    def as_data(self):
        return {
            "seconds": round(self.seconds, 1),
            "busy": round(self.busy, 2),
            "series": [
                {"name": s.name, "mean": s.mean, "peak": s.peak, "memory_mean": s.memory_mean, "memory_peak": s.memory_peak, "memory_total": s.memory_total}
                for s in self.series
            ],
        }

    @classmethod
    def from_data(cls, data):
        if not data or not data.get("series"):
            return None
        return cls([SeriesSummary(**s) for s in data["series"]], data.get("seconds", 0))


def summarize(runs):
    """The mean and peak of every series over one or more runs (allocations).

    runs: [(series, windows)], series: [{"name", "memory_total"}], windows as stored. A series of
    the same name in several runs (the job restarted) is one series, weighted by time."""
    acc = {}
    total = 0.0
    for series, windows in runs:
        for window in windows:
            _start, seconds, values = window
            total += seconds
            for meta, (mean, peak, mem_mean, mem_peak) in zip(series, values):
                a = acc.setdefault(meta["name"], {"s": 0.0, "u": 0.0, "m": 0.0, "peak": 0.0, "mpeak": 0, "total": None})
                a["s"] += seconds
                a["u"] += mean * seconds
                a["m"] += mem_mean * seconds
                a["peak"] = max(a["peak"], peak)
                a["mpeak"] = max(a["mpeak"], mem_peak)
                a["total"] = meta.get("memory_total") or a["total"]
    if not acc:
        return None
    summaries = [
        SeriesSummary(
            name=name,
            mean=round(a["u"] / a["s"], 1) if a["s"] else 0.0,
            peak=a["peak"],
            memory_mean=round(a["m"] / a["s"] * MIB) if a["s"] else 0,
            memory_peak=a["mpeak"] * MIB,
            memory_total=a["total"],
        )
        for name, a in acc.items()
    ]
    return Summary(summaries, total)


# Right-size hints ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Hint:
    kind: str  # "devices", "memory", "low"
    text: str
    suggested: int | None = None
    saving: Decimal | None = None


# A device counts as needed when at least this much of it was busy on average: a job keeping
# 2.05 devices' worth busy is a 2-device job, one keeping 2.2 needs 3.
SLACK = 0.1
# A job keeping less than this share of its only device busy is probably waiting on its data.
LOW_PERCENT = 30.0


def gb(size):
    """A memory size for a hint: GB down to 1 GB, then MB ("11 GB", "2.5 GB", "340 MB")."""
    value = size / 1024**3
    if value >= 10:
        return f"{value:.0f} GB"
    if value >= 1:
        return f"{value:.1f} GB"
    return f"{max(size / MIB, 0):.0f} MB"


def amount_text(amount, currency):
    return f"{currency} {amount.quantize(Decimal('0.01'), ROUND_HALF_UP)}" if currency else f"{amount.quantize(Decimal('0.01'), ROUND_HALF_UP)}"


def suggested_devices(busy, held):
    """The smallest request that would have carried the load: devices' worth busy, rounded up
    past a little slack, at least one, at most what was held."""
    return min(held, max(1, math.ceil(busy - SLACK)))


def right_size(summary, *, devices, held_seconds, rate=None, unit="GPU", currency=""):
    """Hints for a finished job (or for the next run of it) from its utilization summary.

    devices: what the job held; held_seconds: how long; rate: the price per device-hour
    (Decimal), for the saving. Returns [Hint], most useful first; [] when nothing to say."""
    if summary is None or not summary.series or devices < 1:
        return []
    hints = []
    busy = summary.busy
    suggested = suggested_devices(busy, devices)
    if suggested < devices:
        saving = None
        text = f"this {devices}-{unit} job kept {busy:.1f} {unit}s' worth busy"
        if rate is not None and held_seconds:
            saving = (Decimal(devices - suggested) * Decimal(held_seconds) / 3600 * Decimal(rate)).quantize(Decimal("0.01"), ROUND_HALF_UP)
            text += f": a {suggested}-{unit} request would have cost about {amount_text(saving, currency)} less"
        else:
            text += f": a {suggested}-{unit} request would have done"
        hints.append(Hint("devices", text, suggested=suggested, saving=saving))
    elif devices == 1 and summary.series[0].mean < LOW_PERCENT:
        hints.append(Hint("low", f"its {unit} was {summary.series[0].mean:.0f}% busy on average: the job may be waiting on its data"))
    peak = max(summary.series, key=lambda s: s.memory_peak)
    if peak.memory_total:
        hints.append(Hint("memory", f"peak memory {gb(peak.memory_peak)} of {gb(peak.memory_total)}"))
    return hints


# Idle -------------------------------------------------------------------------------------------


def is_idle(readings, threshold):
    """Every device below the threshold (percent of one device)."""
    return all(r.util < threshold for r in readings)


@dataclass
class IdleWatch:
    """Since when a job's devices have all been idle (None while any is busy)."""

    threshold: float = 5.0
    since: float | None = None

    def add(self, t, readings):
        if readings and is_idle(readings, self.threshold):
            if self.since is None:
                self.since = t
        else:
            self.since = None
        return self.since

    def idle_for(self, t):
        return 0.0 if self.since is None else t - self.since


# The chart ---------------------------------------------------------------------------------------


def chart(runs, width=600, height=140, memory=False):
    """Polylines over the job's held time for a small SVG: utilization (percent, the axis topped
    at 100 or the next hundred above the peak) or, with memory, each window's peak memory (MiB,
    topped at the largest device memory known, else the peak).

    runs: [(offset seconds of the run from the first run's start, series, windows)]. Returns
    {"width", "height", "top", "top_bytes" (memory), "seconds", "lines": [{"name", "points"}]}, or None with
    no windows."""
    points, totals = {}, [0]
    end = peak = 0.0
    for offset, series, windows in runs:
        totals += [(meta.get("memory_total") or 0) / MIB for meta in series]
        for start, seconds, values in windows:
            x = offset + start + seconds / 2
            end = max(end, offset + start + seconds)
            for meta, value in zip(series, values):
                y = value[3] if memory else value[0]
                points.setdefault(meta["name"], []).append((x, y))
                peak = max(peak, y)
    if not points or end <= 0:
        return None
    if memory:
        top = max(max(totals), peak) or 1.0
    else:
        top = 100.0 * max(1, math.ceil(peak / 100.0))

    def line(pts):
        return " ".join(f"{x / end * width:.1f},{height - min(y, top) / top * height:.1f}" for x, y in pts)

    return {
        "width": width,
        "height": height,
        "top": top,
        "top_bytes": round(top * MIB) if memory else None,
        "seconds": end,
        "lines": [{"name": name, "points": line(pts)} for name, pts in points.items()],
    }
