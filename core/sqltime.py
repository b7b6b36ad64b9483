"""Times written by the database as the API writes them, for reads of many rows at once.

A page of log lines read its times as datetimes (psycopg's parser, then Django's time zone) only for
the JSON renderer to write them out again: about 9 us a line, half of a 500-line log page's CPU
(issue 24). IsoUtc has the database write the text itself.
"""

from functools import cache

from django.db.models import CharField, Func


class IsoUtc(Func):
    """A time column as DRF's JSON writes a UTC datetime: ISO 8601, "T", the microseconds only
    where there are any (datetime.isoformat), "Z" for UTC ("2026-12-05T07:00:00.123456Z"); with
    zone="+00:00", as datetime.isoformat writes it (the websocket's events)."""

    output_field = CharField()

    def __init__(self, expression, zone="Z"):
        if zone not in ("Z", "+00:00"):
            raise ValueError(f"zone {zone!r}: Z or +00:00")
        self.zone = zone
        super().__init__(expression)

    def as_sql(self, compiler, connection, **extra):
        raise NotImplementedError(f"IsoUtc has no SQL for {connection.vendor}")

    def as_postgresql(self, compiler, connection, **extra):
        column, params = compiler.compile(self.source_expressions[0])
        utc = f"(({column}) AT TIME ZONE 'UTC')"
        whole = f"to_char({utc}, 'YYYY-MM-DD\"T\"HH24:MI:SS')"
        fraction = f"CASE WHEN date_part('microseconds', {utc})::bigint %% 1000000 = 0 THEN '' ELSE to_char({utc}, '.US') END"
        return f"({whole} || {fraction} || '{self.zone}')", [*params, *params, *params]

    def as_sqlite(self, compiler, connection, **extra):
        # Django keeps an aware time in SQLite as its UTC wall clock, str()'d: "YYYY-MM-DD
        # HH:MM:SS[.ffffff]", the fraction only where there is one, as isoformat writes it.
        column, params = compiler.compile(self.source_expressions[0])
        return f"(replace({column}, ' ', 'T') || '{self.zone}')", params


@cache
def utc_loader():
    """PostgreSQL's timestamptz text read by datetime.fromisoformat (C), for a connection whose
    session time zone is UTC, as Django sets it under USE_TZ.

    Django reads it with a subclass of psycopg's pure-Python loader (a regular expression, then
    its time zone put on): about 4 us a time. A month of 720 usage records has 1,440 of them,
    3 of the usage endpoint's 8 ms of reading them (in-process, bench/read_load.py's data); 5 so.
    A text it does not take (BC, infinity) or at another offset goes to Django's own loader, so
    every value reads as Django's would."""
    from datetime import UTC, datetime, timedelta

    from django.db.backends.postgresql.psycopg_any import BaseTzLoader

    parse, zero = datetime.fromisoformat, timedelta(0)

    class UtcTimestamptzLoader(BaseTzLoader):
        timezone = UTC

        def load(self, data):
            try:
                value = parse(bytes(data).decode())
            except ValueError:
                return super().load(data)
            if value.utcoffset() != zero:
                return super().load(data)
            return value.replace(tzinfo=self.timezone)

    return UtcTimestamptzLoader


def use_utc_loader(sender, connection, **kwargs):
    """connection_created's receiver (e31web.apps): the faster loader on a PostgreSQL connection
    whose times Django reads in UTC (DATABASES' TIME_ZONE unset)."""
    from datetime import UTC

    if connection.vendor == "postgresql" and connection.timezone is UTC:
        connection.connection.adapters.register_loader("timestamptz", utc_loader())
