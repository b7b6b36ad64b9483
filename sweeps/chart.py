"""The sweep page's charts: the objective against each parameter, as points in an SVG box. Pure
arithmetic on plain data, no Django."""

import math
from dataclasses import dataclass

WIDTH, HEIGHT, PAD = 320, 160, 8


@dataclass(frozen=True)
class Point:
    x: float
    y: float
    title: str
    best: bool


@dataclass(frozen=True)
class Chart:
    name: str
    points: list
    low: str  # the axis ends, as shown
    high: str
    width: int = WIDTH
    height: int = HEIGHT


def _scale(values, spec):
    """Each value's place between 0 and 1: on a (log) axis for a range, evenly in the order of
    its choices for a choice."""
    if spec.get("type") == "choice" and isinstance(spec.get("choices"), list):
        order = [repr(c) for c in spec["choices"]]
        places = {r: (i + 0.5) / len(order) for i, r in enumerate(order)}
        return [places.get(repr(v), 0.5) for v in values], f"{spec['choices'][0]}", f"{spec['choices'][-1]}"
    log = bool(spec.get("log"))
    if all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
        numbers = [math.log10(v) if log and v > 0 else float(v) for v in values]
        low, high = min(numbers), max(numbers)
        span = (high - low) or 1.0
        return [(n - low) / span for n in numbers], f"{min(values):g}", f"{max(values):g}"
    order = sorted({repr(v) for v in values})
    places = {r: (i + 0.5) / len(order) for i, r in enumerate(order)}
    return [places[repr(v)] for v in values], order[0], order[-1]


def charts(space, trials, direction):
    """One chart per parameter. trials: (params, value) of the trials with an objective; the
    best (lowest for "min") is marked. Higher on the chart is better."""
    done = [(params, value) for params, value in trials if value is not None and math.isfinite(value)]
    if not done:
        return []
    values = [value for _, value in done]
    best = (min if direction == "min" else max)(values)
    low, high = min(values), max(values)
    span = (high - low) or 1.0
    result = []
    for name, spec in space.items():
        xs, left, right = _scale([params.get(name) for params, _ in done], spec)
        points = []
        for x, (params, value) in zip(xs, done, strict=True):
            goodness = (high - value) / span if direction == "min" else (value - low) / span
            points.append(
                Point(
                    x=round(PAD + x * (WIDTH - 2 * PAD), 1),
                    y=round(PAD + (1 - goodness) * (HEIGHT - 2 * PAD), 1),
                    title=f"{name}={params.get(name)!r}: {value:g}",
                    best=value == best,
                )
            )
        result.append(Chart(name=name, points=points, low=left, high=right))
    return result
