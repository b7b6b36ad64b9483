"""Times written by the database as the API writes them, for reads of many rows at once.

A page of log lines read its times as datetimes (psycopg's parser, then Django's time zone) only for
the JSON renderer to write them out again: about 9 us a line, half of a 500-line log page's CPU
(issue 24). IsoUtc has the database write the text itself.
"""

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
