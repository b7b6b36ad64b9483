"""A job's log, printed as it grows: the websocket /ws/jobs/<id>/?after=<seq>, reconnected with
backoff after any drop from the last event seen, so no line is printed twice or lost. While
compute is held, a line on stderr now and then gives the meter: held time, cost and what is left
of the job's ceiling."""

import json
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from decimal import Decimal
from typing import TYPE_CHECKING, Any, Protocol, TextIO

from e31.cli.errors import SERVER, CliError

if TYPE_CHECKING:
    from websockets.sync.client import ClientConnection

    from e31.cli.client import Client

TERMINAL = {"succeeded", "failed", "stopped", "cancelled"}
LOG_PAGE = 1000
METER_EVERY = 60.0  # seconds between meter lines while the meter runs (it ticks every second)


class Socket(Protocol):
    """What Follower reads events from: a websocket connection (websockets' sync client)."""

    def recv(self, timeout: float | None = ...) -> str | bytes: ...


def format_line(event: dict[str, Any]) -> str:
    text = event.get("text") or ""
    if text.endswith("\n"):
        text = text[:-1]
    rank = event.get("rank")
    return f"[rank{rank}] {text}" if rank is not None else text


def format_money(value: object, currency: str, places: int = 4) -> str:
    return f"{currency} {Decimal(str(value)).quantize(Decimal(1).scaleb(-places)):,}".strip()


def format_held(seconds: float | None) -> str:
    seconds = int(seconds or 0)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def format_meter(job: dict[str, Any]) -> str | None:
    """The meter of a job as GET /api/jobs/<id>/ gives it, in one line: held time, cost, and
    what is left of its ceiling (nothing about a ceiling when it has none). None without a cost."""
    if job.get("cost") is None:
        return None
    currency = job.get("currency") or ""
    text = f"meter: held {format_held(job.get('held_seconds'))}, cost {format_money(job['cost'], currency)}"
    left = []
    if job.get("ceiling_amount_left") is not None:
        left.append(format_money(job["ceiling_amount_left"], currency))
    if job.get("ceiling_gpu_hours_left") is not None:
        left.append(f"{Decimal(str(job['ceiling_gpu_hours_left'])).normalize():f} GPU-hours")
    if left and job.get("ceiling_used_fraction") is not None:
        used = int(Decimal(str(job["ceiling_used_fraction"])) * 100)
        text += f"; {' and '.join(left)} left of the ceiling ({used}% used)"
    return text


class Printer:
    """Prints events: log lines on stdout, state changes on stderr (or everything as JSON lines)."""

    def __init__(self, as_json: bool = False, out: TextIO | None = None, err: TextIO | None = None, quiet_states: bool = False) -> None:
        self.as_json = as_json
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        self.quiet_states = quiet_states

    def event(self, event: dict[str, Any]) -> None:
        if self.as_json:
            self.out.write(json.dumps(event) + "\n")
            self.out.flush()
            return
        kind = event.get("kind")
        if kind == "log":
            self.out.write(format_line(event) + "\n")
            self.out.flush()
        elif kind == "state" and not self.quiet_states:
            reason = f" ({event['reason']})" if event.get("reason") else ""
            self.err.write(f"-- {event.get('state')}{reason}\n")
            self.err.flush()

    def meter(self, job: dict[str, Any]) -> None:
        """A meter line on stderr, from the job's API figures."""
        line = format_meter(job)
        if line and not self.as_json and not self.quiet_states:
            self.err.write(f"-- {line}\n")
            self.err.flush()

    def log_lines(self, lines: Iterable[dict[str, Any]]) -> None:
        for line in lines:
            self.event({"kind": "log", **line})


def print_logs(client: "Client", job_id: str, printer: Printer, after: int = 0) -> tuple[int, str | None]:
    """Every log line after seq `after` over HTTP, page by page; returns (last seq, state)."""
    state: str | None = None
    while True:
        page = client.get(f"/api/jobs/{job_id}/logs/", params={"after": after, "limit": LOG_PAGE})
        printer.log_lines(page.get("lines", []))
        state = page.get("state", state)
        after = max(after, page.get("next_after") or after)
        if not page.get("more"):
            return after, state


def default_connect(url: str, token: str | None) -> "AbstractContextManager[ClientConnection]":
    from websockets.sync.client import connect

    return connect(url, additional_headers={"Authorization": f"Token {token}"}, open_timeout=15, max_size=2**24)


def connection_errors() -> tuple[type[BaseException], ...]:
    from websockets.exceptions import WebSocketException

    return (WebSocketException, OSError, EOFError, ValueError)


class Follower:
    """Follows one job to its end. connect(url, token) and sleep are replaceable for tests."""

    def __init__(
        self,
        client: "Client",
        job_id: str,
        printer: Printer,
        after: int = 0,
        connect: Callable[[str, str | None], AbstractContextManager[Socket]] | None = None,
        sleep: Callable[[float], None] = time.sleep,
        backoff: Sequence[float] = (0.5, 1, 2, 4, 8),
        idle_check: float = 30.0,
        meter_every: float = METER_EVERY,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        self.job_id = job_id
        self.printer = printer
        self.last_seq = after
        self.connect: Callable[[str, str | None], AbstractContextManager[Socket]] = connect or default_connect
        self.sleep = sleep
        self.backoff = backoff
        self.idle_check = idle_check
        self.reconnects = 0
        self.meter_every = meter_every
        self.clock = clock
        self.meter_shown_at: float | None = None

    def url(self) -> str:
        return self.client.ws_url(f"/ws/jobs/{self.job_id}/?after={self.last_seq}")

    def handle(self, events: Iterable[dict[str, Any]]) -> str | None:
        """Print new events; returns the terminal state if one arrived."""
        ended = None
        for event in events:
            seq = event.get("seq")
            if seq is not None:
                if seq <= self.last_seq:
                    continue  # seen before a reconnect
                self.last_seq = seq
            self.printer.event(event)
            if event.get("kind") == "meter" and self.meter_due(event):
                self.show_meter()
            if event.get("kind") == "state" and event.get("state") in TERMINAL:
                ended = event["state"]
        return ended

    def meter_due(self, event: dict[str, Any]) -> bool:
        """A meter line for the first tick seen, every meter_every seconds, and when the meter
        stops (compute released: the final figures)."""
        if self.printer.as_json or self.printer.quiet_states:
            return False
        return self.meter_shown_at is None or not event.get("running") or self.clock() - self.meter_shown_at >= self.meter_every

    def show_meter(self) -> None:
        """The meter as the API counts it: a tick carries the cost, not what is left of the
        ceiling, which takes every allocation and credit of the job."""
        self.meter_shown_at = self.clock()
        try:
            job = self.client.job(self.job_id)
        except CliError as http_error:
            if http_error.code != SERVER:
                raise
            return  # the server is out of reach for a moment: the next line will come
        self.printer.meter(job)

    def finish_over_http(self) -> str | None:
        """If the job has ended, print the lines not seen yet and return its state."""
        state = self.client.job(self.job_id).get("state")
        if state not in TERMINAL:
            return None
        self.last_seq, _ = print_logs(self.client, self.job_id, self.printer, after=self.last_seq)
        if not self.printer.as_json and not self.printer.quiet_states:
            self.printer.err.write(f"-- {state}\n")
        return state

    def run(self) -> str:
        """Follow until the job ends; returns its final state."""
        failures = 0
        errors = connection_errors()
        while True:
            try:
                with self.connect(self.url(), self.client.token) as websocket:
                    while True:
                        try:
                            raw = websocket.recv(timeout=self.idle_check)
                        except TimeoutError:
                            # Quiet for a while: make sure the job has not ended unseen.
                            try:
                                state = self.finish_over_http()
                            except CliError as http_error:
                                if http_error.code != SERVER:
                                    raise
                                state = None
                            if state:
                                return state
                            continue
                        message = json.loads(raw)
                        failures = 0
                        if message.get("type") != "events":
                            continue
                        state = self.handle(message.get("events") or [])
                        if state:
                            return state
            except errors as error:
                failures += 1
                self.reconnects += 1
                try:
                    state = self.finish_over_http()
                    if state:
                        return state
                    if failures >= 3:
                        # The websocket keeps failing: keep the lines coming over HTTP meanwhile.
                        self.last_seq, _ = print_logs(self.client, self.job_id, self.printer, after=self.last_seq)
                except CliError as http_error:
                    if http_error.code != SERVER:  # not found, not allowed: no use trying again
                        raise
                delay = self.backoff[min(failures - 1, len(self.backoff) - 1)]
                if not self.printer.as_json:
                    self.printer.err.write(f"-- connection lost ({type(error).__name__}); reconnecting in {delay:g} s\n")
                    self.printer.err.flush()
                self.sleep(delay)
