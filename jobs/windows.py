"""The window of a request, from the form's quick choices ("by 08:00 tomorrow"), in the user's
time zone: pure functions over aware datetimes."""

from datetime import datetime, time, timedelta

CHOICES = [
    ("", "No quick choice"),
    ("tonight", "By 23:00 tonight"),
    ("morning", "By 08:00 tomorrow"),
    ("monday", "By Monday 09:00"),
]


def deadline_for(choice, now):
    """The deadline a quick choice means at `now` (an aware datetime in the user's zone): the
    next such wall-clock time after now. None for no choice; ValueError for an unknown one."""
    if not choice:
        return None
    zone = now.tzinfo
    if choice == "tonight":
        day, at = now.date(), time(23, 0)
        if now.time() >= at:
            day += timedelta(days=1)
    elif choice == "morning":
        day, at = now.date() + timedelta(days=1), time(8, 0)
        if now.time() < time(4, 0):  # in the small hours, "tomorrow morning" is this morning
            day = now.date()
    elif choice == "monday":
        days = (7 - now.weekday()) % 7 or 7
        day, at = now.date() + timedelta(days=days), time(9, 0)
    else:
        raise ValueError(f"unknown window {choice!r}")
    return datetime.combine(day, at).replace(tzinfo=zone)
