"""Output helpers: rich tables and progress bars on a terminal, plain JSON with --json."""

import json
import sys
from contextlib import contextmanager


def stderr_console():
    from rich.console import Console

    return Console(stderr=True)


def print_json(value):
    sys.stdout.write(json.dumps(value, indent=2, default=str) + "\n")
    sys.stdout.flush()


def print_table(columns, rows, title=None):
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, show_lines=False, header_style="bold")
    for column in columns:
        table.add_column(column, overflow="fold")
    for row in rows:
        table.add_row(*["" if v is None else str(v) for v in row])
    Console().print(table)


def print_fields(pairs, title=None):
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
    def advance(self, amount):
        pass

    def update(self, **kwargs):
        pass


class Bar:
    def __init__(self, progress, task):
        self.progress = progress
        self.task = task

    def advance(self, amount):
        self.progress.advance(self.task, amount)

    def update(self, **kwargs):
        self.progress.update(self.task, **kwargs)


@contextmanager
def progress_bar(total, description, enabled=True):
    """A bar over bytes on stderr, shown only on a terminal."""
    console = stderr_console()
    if not enabled or not console.is_terminal:
        yield NullBar()
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    with Progress(
        TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn(),
        console=console, transient=False,
    ) as progress:
        yield Bar(progress, progress.add_task(description, total=total))


class ProgressReader:
    """A binary file whose reads advance a progress bar (httpx reads multipart files so)."""

    def __init__(self, fileobj, bar):
        self.fileobj = fileobj
        self.bar = bar
        self.counted = 0

    def read(self, size=-1):
        data = self.fileobj.read(size)
        self.counted += len(data)
        self.bar.advance(len(data))
        return data

    def seek(self, offset, whence=0):
        result = self.fileobj.seek(offset, whence)
        if whence == 0 and offset == 0 and self.counted:
            self.bar.advance(-self.counted)  # read again from the start (a retried request)
            self.counted = 0
        return result

    def tell(self):
        return self.fileobj.tell()

    def fileno(self):
        return self.fileobj.fileno()

    def close(self):
        self.fileobj.close()

    def __iter__(self):
        while chunk := self.read(64 * 1024):
            yield chunk
