"""Plain-text renderings shared by pages, emails and invoices. Pure: no Django."""


def format_duration(seconds: float) -> str:
    """H:MM:SS, hours unbounded (a week is 168:00:00)."""
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours:d}:{minutes:02d}:{secs:02d}"
