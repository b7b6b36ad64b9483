"""Reads, and a new row's INSERT (Insert, below), whose SQL Django makes once per process, not at
every call (issue 24).

Django builds a queryset and compiles its SQL anew at every call. For the job page's reads that
was most of each read's CPU: a job's last log lines as values() cost 0.72 ms, of which building
the queryset 0.19, compiling it 0.14 and turning its rows into dicts 0.25, where executing the
SQL and fetching the rows cost 0.15 (bench/read_load.py's data, PostgreSQL).

A Read is a queryset built once, with a Param where each value goes. Compiled on first use for a
database, its SQL and the compiler are kept; a call puts the values into the params (each
prepared by its Param's field, as a lookup prepares it), runs the SQL on the calling thread's own
connection, and gives back what the queryset would: model instances (Model.from_db, with
select_related's related objects and annotations, as Django's ModelIterable makes them), dicts
for values(), tuples or values for values_list(). Rows go through the compiler's converters, so
every value reads as the ORM reads it. Under ASGI each request has a thread and a connection of
its own, so the Read is the process's: the compiler, made on the first caller's connection, only
converts values (the backend's pure functions).

What a Read refuses (TypeError when it is made): prefetch_related (a second query per call) and
iterables other than those four.
A Read's shape is fixed: what varies between calls goes in Params. An IN of a list is compiled
with one placeholder per item, so a list whose length varies goes in as one value: OneOf.
"""

import json
import threading
import uuid

from django.db import DEFAULT_DB_ALIAS, connections
from django.db.models import NOT_PROVIDED, BooleanField, Expression, F, Field, PositiveIntegerField
from django.db.models.query import FlatValuesListIterable, ModelIterable, ValuesIterable, ValuesListIterable, get_related_populators
from django.db.models.signals import post_save, pre_save
from django.db.models.sql import InsertQuery


class Param(Expression):
    """Where a Read's value named `name` goes; `field` (a model field instance) prepares it for
    the database as a lookup on such a field would (a UUID's text becomes a UUID)."""

    def __init__(self, name, field):
        super().__init__(output_field=field)
        self.name = name

    def as_sql(self, compiler, connection):
        return "%s", [self]

    def __repr__(self):
        return f"Param({self.name!r})"


class IdList(Field):
    """A list of values of one field, as one parameter: an array on PostgreSQL, JSON text
    elsewhere (SQLite has no arrays), each item prepared by `item` as a lookup on it would."""

    def __init__(self, item):
        super().__init__()
        self.item = item

    def get_db_prep_value(self, value, connection, prepared=False):
        items = [self.item.get_db_prep_value(v, connection, prepared=False) for v in value]
        return pg_array(items) if connection.vendor == "postgresql" else json.dumps(items)


def pg_array(items):
    """A list of values as one PostgreSQL array parameter: of ids (UUIDs, integers), the array's
    text ("{id,id}", its type the column's), else the list for psycopg to write. psycopg writes a
    list item by item, each searched for what needs quoting, which an id never does: a page of
    50 jobs passes 400 ids a request, about 0.3 ms of the job list's CPU (issue 24). An integer
    past a bigint's range goes in the list, as before (the text would fail the column's type)."""
    if all(type(item) is uuid.UUID or (type(item) is int and -(2**63) <= item < 2**63) for item in items):
        return "{" + ",".join(map(str, items)) + "}"
    return items


class OneOf(Expression):
    """A condition for a Read: `column` is one of the list given as its value `name` (items of
    the model field `field`, prepared as it prepares them). One parameter whatever the list's
    length: PostgreSQL's `= ANY(array)`, SQLite's `IN (SELECT value FROM json_each(text))`."""

    conditional = True

    def __init__(self, column, name, field):
        super().__init__(output_field=BooleanField())
        self.column = F(column) if isinstance(column, str) else column
        self.param = Param(name, IdList(field))

    def get_source_expressions(self):
        return [self.column]

    def set_source_expressions(self, exprs):
        [self.column] = exprs

    def as_sql(self, compiler, connection):
        sql, params = compiler.compile(self.column)
        if connection.vendor == "postgresql":
            return f"{sql} = ANY(%s)", [*params, self.param]
        return f"{sql} IN (SELECT value FROM json_each(%s))", [*params, self.param]


class Read:
    """A queryset read with its SQL made once per process and database (the module's
    docstring). `build`: a function of no arguments that returns the queryset, with Params; it
    is called when the Read is first used (after Django's apps are ready)."""

    def __init__(self, build, paged=False):
        self.build = build
        self.paged = paged  # True: the SQL ends with LIMIT and OFFSET, the call's `limit` and `offset`
        self._made = {}  # alias -> _Compiled
        self._lock = threading.Lock()

    def compiled(self, using=DEFAULT_DB_ALIAS):
        """Its compiled form for the database, made on first use (once, whatever the threads)."""
        compiled = self._made.get(using)
        if compiled is None:
            with self._lock:
                compiled = self._made.get(using) or self._made.setdefault(using, _Compiled(self.build(), using, self.paged))
        return compiled

    def __call__(self, using=DEFAULT_DB_ALIAS, known=None, **values):
        """The rows for these values, as a list of what the queryset gives. known: {attribute:
        object} set on each model instance, as a related manager's queryset sets the object it
        was read through (allocation.job: the job, with no query)."""
        return _knowing(self.compiled(using).run(values), known)

    def first(self, using=DEFAULT_DB_ALIAS, known=None, **values):
        """The first row, or None (the queryset should be sliced [:1])."""
        rows = self(using, known, **values)
        return rows[0] if rows else None


class _Compiled:
    def __init__(self, queryset, alias, paged=False):
        if queryset._prefetch_related_lookups:
            raise TypeError("a Read cannot prefetch_related: a query per relation at each call")
        if paged and queryset.query.is_sliced:
            raise TypeError("a paged Read is sliced by its call's limit and offset, not by the queryset")
        self.kind = queryset._iterable_class
        if self.kind not in (ModelIterable, ValuesIterable, ValuesListIterable, FlatValuesListIterable):
            raise TypeError(f"a Read gives model instances, values() or values_list(), not {self.kind.__name__}")
        query = queryset.query
        self.alias = alias
        self.compiler = query.get_compiler(using=alias)
        self.sql, params = self.compiler.as_sql()
        self.params = list(params)
        if paged:  # the same clause in PostgreSQL and SQLite, after the ORDER BY
            self.sql += " LIMIT %s OFFSET %s"
            self.params += [Param("limit", PositiveIntegerField()), Param("offset", PositiveIntegerField())]
        self.slots = [(i, p.name, p.output_field) for i, p in enumerate(self.params) if isinstance(p, Param)]
        self.names = frozenset(name for _, name, _ in self.slots)
        if reserved := self.names & {"using", "known"}:
            raise TypeError(f"a Read's Param cannot be named {', '.join(sorted(reserved))}: the call's own arguments")
        if self.kind is ModelIterable:
            select, klass_info = self.compiler.select, self.compiler.klass_info
            self.model = klass_info["model"]
            fields = klass_info["select_fields"]
            self.start, self.end = fields[0], fields[-1] + 1
            self.attnames = [column[0].target.attname for column in select[self.start : self.end]]
            self.populators = get_related_populators(klass_info, select, alias)
            self.annotations = dict(self.compiler.annotation_col_map or {})
        else:  # the columns' names, in the SQL's order (as Django's ValuesIterable names them)
            self.fields = list(query.selected) if query.selected else [*query.extra_select, *query.values_select, *query.annotation_select]
        # What results_iter works out at every call, once: each column's converters (a Job's 60
        # columns asked their fields for theirs at every read, about a twentieth of a
        # submission's CPU, issue 24), and whether a composite key's columns make tuples.
        self.columns = [column[0] for column in self.compiler.select[0 : self.compiler.col_count]]
        self.converters = self.compiler.get_converters(self.columns)
        self.composite = self.compiler.has_composite_fields(self.columns)

    def run(self, values):
        return run_alone(self, values, self.alias)

    def bind(self, values, connection):
        """The SQL's params for these values (each prepared by its Param's field)."""
        if set(values) != self.names:
            missing, unknown = sorted(self.names - set(values)), sorted(set(values) - self.names)
            raise TypeError(
                f"a Read takes {', '.join(sorted(self.names)) or 'no values'}"
                + (f"; missing {', '.join(missing)}" if missing else "")
                + (f"; unknown {', '.join(unknown)}" if unknown else "")
            )
        params = list(self.params)
        for i, name, field in self.slots:
            params[i] = field.get_db_prep_value(values[name], connection, prepared=False)
        return params

    def result(self, rows):
        """The rows as the queryset gives them."""
        if not rows:
            return []
        converted = self.compiler.apply_converters(rows, self.converters) if self.converters else rows
        if self.composite:
            converted = self.compiler.composite_fields_to_tuples(converted, self.columns)
        if self.kind is ModelIterable:
            out = []
            for row in converted:
                obj = self.model.from_db(self.alias, self.attnames, row[self.start : self.end])
                for populator in self.populators:
                    populator.populate(row, obj)
                for name, at in self.annotations.items():
                    setattr(obj, name, row[at])
                out.append(obj)
            return out
        if self.kind is ValuesIterable:
            return [dict(zip(self.fields, row, strict=True)) for row in converted]
        if self.kind is FlatValuesListIterable:
            return [row[0] for row in converted]
        return [tuple(row) for row in converted]


def run_alone(compiled, values, using):
    """A compiled statement (what together() reads of one: its sql, bind and result) run in a
    query of its own: its rows, as it gives them."""
    connection = connections[using]
    with connection.cursor() as cursor:
        cursor.execute(compiled.sql, compiled.bind(values, connection))
        return compiled.result(cursor.fetchall())


def together(*calls, using=DEFAULT_DB_ALIAS):
    """Several Reads in one round trip: each call (read, values) or (read, values, known) gives
    what read(known=known, **values) would, in a list in the calls' order. On PostgreSQL their
    statements go in one query, each statement's rows a result set of its own (Django's psycopg
    cursors bind client-side and send the query as a simple query, which may hold several): a
    job's page read its log lines, metric points, timeline, allocations, files and which other
    parts it has rows in (core.prefetch.RowsIn) in six round trips. Elsewhere (SQLite, in the
    process: no round trip to save) one after the other."""
    calls = [(call[0], call[1], call[2] if len(call) > 2 else None) for call in calls]
    connection = connections[using]
    # Server-side binding (an option of Django's psycopg backend, not ours) sends each query
    # as a prepared statement, which holds one statement.
    if connection.vendor != "postgresql" or len(calls) < 2 or connection.settings_dict["OPTIONS"].get("server_side_binding"):
        return [read(using, known, **values) for read, values, known in calls]
    made = [read.compiled(using) for read, _, _ in calls]
    sql, params = [], []
    for compiled, (_, values, _) in zip(made, calls, strict=True):
        sql.append(compiled.sql)
        params += compiled.bind(values, connection)
    results = []
    with connection.cursor() as cursor:
        cursor.execute(";\n".join(sql), params)
        for i, compiled in enumerate(made):
            if i:
                cursor.nextset()
            results.append(compiled.result(cursor.fetchall()))
    return [_knowing(rows, known) for rows, (_, _, known) in zip(results, calls, strict=True)]


def _knowing(rows, known):
    """The rows, each model instance given the known objects ({attribute: object})."""
    if known:
        for row in rows:
            for name, obj in known.items():
                setattr(row, name, obj)
    return rows


class Insert:
    """A new row's INSERT with its SQL made once per process and database, which gives back the
    row as stored (RETURNING every column, through the columns' converters, as a read finds it).

    Model.save(force_insert=True) builds an InsertQuery and compiles it at every save: for a Job
    (59 columns) about 0.6 ms of CPU, half of its save, and then the submission read the row back
    (a query more) for its values as stored (issue 24). A call sends what save() sends (the same
    signals, each value from its field's pre_save and get_db_prep_save) and sets the object's
    fields to the stored values, as refresh_from_db() would.

    An auto-increment key is left to the database, as save() leaves it, and read back with the
    rest. What it refuses (TypeError): a db_default or a generated column (when first used), and
    a value that is an expression (save() compiles those). Where the database cannot return
    columns from an INSERT (SQLite before 3.35), it saves and reads the row back."""

    def __init__(self, model):
        self.model = model
        self._made = {}  # alias -> (sql, fields sent, fields returned, compiler, converters)
        self._lock = threading.Lock()

    def compiled(self, connection):
        made = self._made.get(connection.alias)
        if made is None:
            with self._lock:
                made = self._made.get(connection.alias) or self._made.setdefault(connection.alias, self._compile(connection))
        return made

    def _compile(self, connection):
        meta = self.model._meta
        returned = list(meta.local_concrete_fields)
        for field in returned:
            if field.db_default is not NOT_PROVIDED or getattr(field, "generated", False):
                raise TypeError(f"an Insert sends every column's value but an auto-increment key's; the database makes {meta.label}.{field.name}'s")
        sent = [field for field in returned if field not in meta.db_returning_fields]
        quote = connection.ops.quote_name
        returning, _ = connection.ops.return_insert_columns(returned)
        columns = ", ".join(quote(field.column) for field in sent)
        sql = f"INSERT INTO {quote(meta.db_table)} ({columns}) VALUES ({', '.join(['%s'] * len(sent))}) {returning}"
        compiler = InsertQuery(self.model).get_compiler(connection=connection)
        converters = compiler.get_converters([field.get_col(meta.db_table) for field in returned])
        return sql, sent, returned, compiler, converters

    def __call__(self, obj, using=DEFAULT_DB_ALIAS):
        """Inserts obj (a new instance of the model) and sets its fields as stored; obj."""
        connection = connections[using]
        if not connection.features.can_return_columns_from_insert:
            obj.save(force_insert=True, using=using)
            obj.refresh_from_db(using=using)
            return obj
        sql, sent, returned, compiler, converters = self.compiled(connection)
        obj._prepare_related_fields_for_save(operation_name="save")
        pre_save.send(sender=self.model, instance=obj, raw=False, using=using, update_fields=None)
        values = []
        for field in sent:
            value = field.pre_save(obj, add=True)
            if hasattr(value, "resolve_expression"):
                raise TypeError(f"an Insert sends values, not expressions ({self.model._meta.label}.{field.name}): save() compiles those")
            values.append(field.get_db_prep_save(value, connection))
        with connection.cursor() as cursor:
            cursor.execute(sql, values)
            rows = cursor.fetchall()
        [row] = compiler.apply_converters(rows, converters) if converters else rows
        for field, value in zip(returned, row, strict=True):
            setattr(obj, field.attname, value)
        obj._state.adding, obj._state.db = False, using
        post_save.send(sender=self.model, instance=obj, created=True, update_fields=None, raw=False, using=using)
        return obj


class Pages:
    """A paged Read's rows as Django's Paginator takes a list: count() is `counted`'s one
    number (a Read of the rows' COUNT(*)), a slice reads the rows by the Read (its LIMIT and
    OFFSET); both with `values`."""

    ordered = True  # the Read's queryset orders its rows (the Paginator warns of an unordered list)

    def __init__(self, read, counted, **values):
        if not read.paged:
            raise TypeError("Pages reads a paged Read")
        self.read, self.counted, self.values = read, counted, values

    def count(self):
        return self.counted(**self.values)[0]

    def __getitem__(self, index):
        if not isinstance(index, slice) or index.step not in (None, 1) or (index.start or 0) < 0 or index.stop is None:
            raise TypeError("Pages are read by a slice [start:stop]")
        start = index.start or 0
        return self.read(limit=max(0, index.stop - start), offset=start, **self.values)
