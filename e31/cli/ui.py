"""Output helpers: rich tables and progress bars on a terminal, plain JSON with --json."""

import json
import sys
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import IO, TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress, TaskID


class ProgressBar(Protocol):
    """What the commands move as bytes go: a Bar on a terminal, else a NullBar."""

    def advance(self, amount: float) -> None: ...

    def update(self, **kwargs: Any) -> None: ...


def stderr_console() -> "Console":
    from rich.console import Console

    return Console(stderr=True)


def print_json(value: object) -> None:
    sys.stdout.write(json.dumps(value, indent=2, default=str) + "\n")
    sys.stdout.flush()


def print_table(columns: Iterable[str], rows: Iterable[Sequence[object]], title: str | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, show_lines=False, header_style="bold")
    for column in columns:
        table.add_column(column, overflow="fold")
    for row in rows:
        table.add_row(*["" if v is None else str(v) for v in row])
    Console().print(table)


def print_fields(pairs: Iterable[tuple[str, object]], title: str | None = None) -> None:
    """A two-column table of name, value."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold")
    table.add_column(overflow="fold")
    for name, value in pairs:
        if value is None or value == "" or value == []:
            continue
        table.add_row(str(name), value if isinstance(value, str) else json.dumps(value, default=str))
    Console().print(table)


class NullBar:
    def advance(self, amount: float) -> None:
        pass

    def update(self, **kwargs: Any) -> None:
        pass


class Bar:
    def __init__(self, progress: "Progress", task: "TaskID") -> None:
        self.progress = progress
        self.task = task

    def advance(self, amount: float) -> None:
        self.progress.advance(self.task, amount)

    def update(self, **kwargs: Any) -> None:
        self.progress.update(self.task, **kwargs)


@contextmanager
def progress_bar(total: float | None, description: str, enabled: bool = True) -> Iterator[ProgressBar]:
    """A bar over bytes on stderr, shown only on a terminal."""
    console = stderr_console()
    if not enabled or not console.is_terminal:
        yield NullBar()
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=False,
    ) as progress:
        yield Bar(progress, progress.add_task(description, total=total))


class ProgressReader:
    """A binary file whose reads advance a progress bar (httpx reads multipart files so)."""

    def __init__(self, fileobj: IO[bytes], bar: ProgressBar) -> None:
        self.fileobj = fileobj
        self.bar = bar
        self.counted = 0

    def read(self, size: int = -1) -> bytes:
        data = self.fileobj.read(size)
        self.counted += len(data)
        self.bar.advance(len(data))
        return data

    def seek(self, offset: int, whence: int = 0) -> int:
        result = self.fileobj.seek(offset, whence)
        if whence == 0 and offset == 0 and self.counted:
            self.bar.advance(-self.counted)  # read again from the start (a retried request)
            self.counted = 0
        return result

    def tell(self) -> int:
        return self.fileobj.tell()

    def fileno(self) -> int:
        return self.fileobj.fileno()

    def close(self) -> None:
        self.fileobj.close()

    def __iter__(self) -> Iterator[bytes]:
        while chunk := self.read(64 * 1024):
            yield chunk
