"""PostgreSQL's times read by datetime.fromisoformat (core.sqltime.utc_loader), each exactly as
Django's own loader reads it (issue 24: 1,440 times of a month's usage records were 3 ms)."""

from datetime import UTC, datetime

import psycopg
import pytest
from django.db import connection
from django.db.backends.postgresql.psycopg_any import register_tzloader

from core.sqltime import use_utc_loader, utc_loader
from jobs.models import Job

pytestmark = [pytest.mark.django_db, pytest.mark.skipif("connection.vendor != 'postgresql'")]

TEXTS = [
    "2026-11-03 10:30:00+00",
    "2026-11-03 10:30:00.000001+00",
    "2026-11-03 10:30:00.123456+00",
    "0001-01-01 00:00:00+00",
    "9999-12-31 23:59:59.999999+00",
    "2026-03-29 01:30:00+00",
]


def djangos(data):
    """What Django's loader makes of data, on the same connection."""
    from django.db.backends.postgresql.psycopg_any import BaseTzLoader

    class Django(BaseTzLoader):
        timezone = UTC

    return Django(psycopg.adapters.types["timestamptz"].oid, connection.connection).load(data)


def test_a_postgresql_connection_reads_its_times_with_the_faster_loader():
    connection.ensure_connection()
    loader = connection.connection.adapters.get_loader(psycopg.adapters.types["timestamptz"].oid, psycopg.pq.Format.TEXT)
    assert loader is not None and loader.__name__ == "UtcTimestamptzLoader"


@pytest.mark.parametrize("text", TEXTS)
def test_every_time_reads_as_djangos_loader_reads_it(text):
    with connection.cursor() as cursor:
        cursor.execute("SELECT %s::timestamptz", [text])
        fast = cursor.fetchone()[0]
    assert fast == djangos(text.encode()) and fast.tzinfo is UTC


@pytest.mark.parametrize("data", [b"2026-11-03 10:30:00+05:30", b"2026-11-03 10:30:00-08", b"0044-03-15 12:00:00+00 BC", b"infinity"])
def test_what_fromisoformat_does_not_take_or_another_offset_goes_to_djangos_loader(data):
    connection.ensure_connection()
    loader = utc_loader()(psycopg.adapters.types["timestamptz"].oid, connection.connection)
    try:
        expected = djangos(data)
    except Exception as error:  # noqa: BLE001 - the same refusal, whatever it is
        with pytest.raises(type(error)):
            loader.load(data)
    else:
        assert loader.load(data) == expected and loader.load(data).tzinfo == expected.tzinfo


def test_a_model_reads_the_same_times_either_way(alice):
    from tests.conftest import make_job

    job = make_job(alice)
    finished = datetime(2026, 11, 3, 10, 30, 0, 123456, tzinfo=UTC)
    Job.objects.filter(pk=job.pk).update(finished_at=finished)
    fast = Job.objects.values_list("created_at", "finished_at").get(pk=job.pk)
    register_tzloader(UTC, connection.connection)  # Django's own, on this connection
    try:
        assert Job.objects.values_list("created_at", "finished_at").get(pk=job.pk) == fast and fast[1] == finished
    finally:
        use_utc_loader(None, connection)
