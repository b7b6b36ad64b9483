"""The API's JSON of jobs that can no longer change, kept per web process and checked against the
database's row versions at every read (PostgreSQL).

A page of 50 jobs costs most of its CPU in reading each job's rows (allocations and their nodes,
timelines, uploads, credits) and writing 83 fields a job (issue 24), while a CLI polling its
team's jobs asks again and again for a page of jobs that have ended. A job that has ended (a
terminal state, every allocation ended) writes the same JSON until a row it is written from
changes: its own row, or one of its allocations, models, inputs, uploads, stagings, credits or
timeline events. PostgreSQL gives every row version the transaction that wrote it (xmin) and a
place of its own (ctid: a second update in one transaction makes a new version in a new place),
so a fingerprint of those rows' ids, xmins and ctids, read in one query for the page, changes
with any insert, update or delete of them by any writer (the ORM, a bulk update, raw SQL, the
admin), and the JSON kept under the old fingerprint is never read again. No writer has to say
what it changed.

The JSON is kept under the fingerprint of the rows it was written from: a page reads the
fingerprints of the jobs whose JSON it has to write again, and then their rows, in one snapshot
(one_snapshot: a REPEATABLE READ transaction), so a change committed meanwhile is in both or in
neither. (Read one after the other, a row inserted in between and deleted later would have left
JSON with the row under the fingerprint without it, which the delete brings back.) The job's own
row and its version come in one query (the page's): a JSON written from an older row than the
snapshot's is kept under that row's version, which no later read finds.

What a job's JSON reads beyond those rows is in the key, too: the currency (a setting). Of a
related row the page shows a column of (an allocation's or staging's node, a credit's usage
record), the fingerprint takes that column, not the row's version: a node's row changes at every
heartbeat. The request's part (the job's URL, its host) is written at each read.

SQLite has no row versions: nothing is kept there, and every page is written as before.
"""

import threading
from collections import Counter, OrderedDict
from contextlib import contextmanager

from django.conf import settings
from django.db import connections, transaction
from django.db.models.expressions import RawSQL

from core.compiled import pg_array

# Kept per process: 4,096 jobs' JSON, a few KB each.
KEPT_JOBS = 4096

# The version of a job's row as read, in the page's query (PostgreSQL): its xmin and its ctid.
ROW_VERSION = "row_version"


def row_version(connection):
    """The annotation that reads a job row's version with the row, or None where there is none."""
    if connection.vendor != "postgresql":
        return None
    return RawSQL('"jobs_job"."xmin"::text || \'/\' || "jobs_job"."ctid"::text', ())


# The related columns a job's JSON shows (select_related of its prefetches): in the fingerprint
# as their values, not as their rows' versions.
SHOWN_COLUMNS = {"node": "name", "usage": "gpus"}


def fingerprint_sql(relations, events_table, events_kinds, quote):
    """One query: per relation (a ReadPrefetch) and job, an md5 of its rows' ids and versions (and
    the shown columns of what they select_related), ordered; then the same of the job's timeline
    events. %s: the page's ids, once per part."""
    parts = []
    for n, relation in enumerate(relations):
        model, column = relation.field.model, relation.field.column
        pk = quote(model._meta.pk.column)
        joins, shown = [], ""
        for i, name in enumerate(relation.select_related):
            field = model._meta.get_field(name)
            target = field.related_model._meta
            joins.append(f"LEFT JOIN {quote(target.db_table)} r{i} ON r{i}.{quote(target.pk.column)} = t.{quote(field.column)}")
            shown += f" || ':' || COALESCE(r{i}.{quote(SHOWN_COLUMNS[name])}::text, '')"
        parts.append(
            f"SELECT {n}, t.{quote(column)}, md5(string_agg(t.{pk}::text || ':' || t.xmin::text || '/' || t.ctid::text{shown}, ',' ORDER BY t.{pk})) "
            f"FROM {quote(model._meta.db_table)} t {' '.join(joins)} WHERE t.{quote(column)} = ANY(%s) GROUP BY t.{quote(column)}"
        )
    kinds = ", ".join(f"'{kind}'" for kind in events_kinds)
    parts.append(
        f"SELECT {len(relations)}, job_id, md5(string_agg(seq::text || ':' || xmin::text || '/' || ctid::text, ',' ORDER BY seq)) "
        f"FROM {quote(events_table)} WHERE job_id = ANY(%s) AND kind IN ({kinds}) GROUP BY job_id"
    )
    return " UNION ALL ".join(parts)


@contextmanager
def one_snapshot(using):
    """The reads inside see one snapshot of the database: a REPEATABLE READ transaction of their
    own on PostgreSQL; inside a caller's transaction (or elsewhere), the caller's reads as they
    are."""
    connection = connections[using]
    if connection.vendor != "postgresql" or connection.in_atomic_block:
        yield
        return
    with transaction.atomic(using=using):
        with connection.cursor() as cursor:
            cursor.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        yield


class KeptJobs:
    """JSON of ended jobs by (id, row version, currency, fingerprint), least recently read out
    first."""

    def __init__(self, relations, events_table, events_kinds, size=KEPT_JOBS):
        """relations: the ReadPrefetches a job's JSON is written from; events_table and
        events_kinds: its timeline events' table and kinds."""
        self.relations, self.events_table, self.events_kinds = tuple(relations), events_table, tuple(events_kinds)
        self.size = size
        self._kept = OrderedDict()
        self._held = Counter()  # the jobs' ids: how many of their versions are kept
        self._lock = threading.Lock()
        self._sql = {}

    def clear(self):
        with self._lock:
            self._kept.clear()
            self._held.clear()

    def holds(self, job_id):
        """Whether some version of the job's JSON is kept (else its fingerprint need not be read
        before its rows)."""
        return str(job_id) in self._held

    def __len__(self):
        return len(self._kept)

    def keys(self, jobs):
        """Each job's key (on job.written_key), for jobs read with their row version: one query
        (none for no such job). Jobs read without one (SQLite) get None."""
        versioned = [job for job in jobs if getattr(job, ROW_VERSION, None) is not None]
        for job in jobs:
            job.written_key = None
        if not versioned:
            return
        connection = connections[versioned[0]._state.db or "default"]
        sql = self._sql.get(connection.alias)
        if sql is None:
            sql = self._sql[connection.alias] = fingerprint_sql(self.relations, self.events_table, self.events_kinds, connection.ops.quote_name)
        pk = type(versioned[0])._meta.pk
        ids = pg_array([pk.get_db_prep_value(job.pk, connection) for job in versioned])
        parts = len(self.relations) + 1
        found = {}
        with connection.cursor() as cursor:
            cursor.execute(sql, [ids] * parts)
            for n, job_id, digest in cursor.fetchall():
                found[(n, str(job_id))] = digest
        currency = settings.E31_CURRENCY
        for job in versioned:
            key = str(job.pk)
            job.written_key = (key, getattr(job, ROW_VERSION), currency, tuple(found.get((n, key)) for n in range(parts)))

    def get(self, key):
        if key is None:
            return None
        with self._lock:
            written = self._kept.get(key)
            if written is not None:
                self._kept.move_to_end(key)
            return written

    def put(self, key, written):
        if key is None:
            return
        with self._lock:
            if key not in self._kept:
                self._held[key[0]] += 1
            self._kept[key] = written
            self._kept.move_to_end(key)
            while len(self._kept) > self.size:
                gone, _ = self._kept.popitem(last=False)
                self._held[gone[0]] -= 1
                if not self._held[gone[0]]:
                    del self._held[gone[0]]
