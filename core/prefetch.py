"""Prefetching where most relations are empty: ask once which objects have any rows at all.

A page of 50 jobs prefetches seven relations, and most jobs have nothing in most of them (no
models, named inputs, stagings or credits). Each prefetch is a query Django builds for the page's
ids, 1.4-3 ms of CPU even when it finds nothing (issue 24). prefetch_sparse asks one plain SQL
query which of the objects have rows in each relation, gives the others an empty list at once,
and prefetches only for those that have some. The answers are the same: a relation's prefetch
only narrows the rows its table holds for an object, so an object with none there has none.

A relation given as a ReadPrefetch is read by a Read (core.compiled), its SQL made once with the
objects' ids as one value: Django's prefetch builds its queryset, compiles it with a placeholder
per id and runs its prefetch machinery at every call, which cost a page of 50 jobs about 3 ms for
its allocations alone (issue 24).
"""

from functools import cached_property

from django.db import DEFAULT_DB_ALIAS, connections
from django.db.models import Prefetch, prefetch_related_objects
from django.db.models.fields.reverse_related import ManyToOneRel

from core.compiled import OneOf, Read, pg_array, run_alone


class ReadPrefetch:
    """A reverse foreign key of `model` (`through`), read for many of its objects at once into a
    list on each (`to_attr`), as Prefetch(through, queryset, to_attr) would, by a Read whose SQL
    is made once: the related model's default manager's rows, in its order, as Django's prefetch
    reads them, with the relations named in `select_related`."""

    def __init__(self, model, through, to_attr, select_related=()):
        self.model, self.through, self.to_attr, self.select_related = model, through, to_attr, tuple(select_related)

    @cached_property
    def field(self):
        """The foreign key on the related model that points at `model`."""
        relation = self.model._meta.get_field(self.through)
        if not isinstance(relation, ManyToOneRel):
            raise TypeError(f"{self.through} is not a reverse foreign key of {self.model.__name__}")
        return relation.field

    @cached_property
    def read(self):
        return Read(lambda: self.queryset().filter(OneOf(self.field.attname, "of", self.field.target_field)))

    def queryset(self):
        return self.field.model._default_manager.select_related(*self.select_related)

    def prefetch(self):
        """The Prefetch it stands for (a fresh one: Django's prefetch changes its queryset)."""
        return Prefetch(self.through, self.queryset(), to_attr=self.to_attr)

    def __call__(self, instances):
        """Set each instance's list, and each row's cached object (row.job: its job, no query)."""
        key = self.field.target_field.attname
        owners = {getattr(instance, key): instance for instance in instances}
        by_value = {value: [] for value in owners}
        for row in self.read(of=list(owners)):
            value = getattr(row, self.field.attname)
            by_value[value].append(row)
            self.field.set_cached_value(row, owners[value])
        for instance in instances:
            setattr(instance, self.to_attr, by_value[getattr(instance, key)])


def _where(model, name):
    """(table, column) holding the model's ids for its relation `name`: a reverse foreign key to
    its primary key; None for any other relation."""
    relation = model._meta.get_field(name)
    if not isinstance(relation, ManyToOneRel) or relation.field_name != model._meta.pk.name:
        return None
    return relation.related_model._meta.db_table, relation.field.column


def _probed(model, prefetch):
    """_where of a prefetch this module can probe: a list (to_attr) of one reverse foreign key."""
    if isinstance(prefetch, ReadPrefetch):
        return _where(model, prefetch.through)
    if not isinstance(prefetch, Prefetch) or not prefetch.to_attr or "__" in prefetch.prefetch_through:
        return None
    return _where(model, prefetch.prefetch_through)


def having_rows(instances, tables):
    """For each (table, column): the ids of the instances that have a row there, in one query."""
    model = type(instances[0])
    connection = connections[instances[0]._state.db or "default"]
    pk = model._meta.pk
    ids = [pk.get_db_prep_value(instance.pk, connection) for instance in instances]
    quote = connection.ops.quote_name
    if connection.vendor == "postgresql":
        # The ids as one array: psycopg parses a statement of more than 50 parameters anew each
        # time (a page's 50 ids in six relations: 300), 0.5 ms of the job list (issue 24).
        within, params = "= ANY(%s)", [pg_array(ids)] * len(tables)
    else:
        within, params = f"IN ({', '.join(['%s'] * len(ids))})", ids * len(tables)
    sql = " UNION ALL ".join(
        f"SELECT DISTINCT {n}, {quote(column)} FROM {quote(table)} WHERE {quote(column)} {within}" for n, (table, column) in enumerate(tables)
    )
    found = [set() for _ in tables]
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        for n, value in cursor.fetchall():
            found[n].add(pk.to_python(value))
    return found


class RowsIn:
    """Which of an object's reverse foreign keys (of `model`, the `names` given) have rows, in
    one query: a set of those names. Called with the object's id (`of`), or sent beside Reads by
    core.compiled.together, as a Read is ((RowsIn, {"of": id}))."""

    def __init__(self, model, names):
        self.model, self.names = model, tuple(names)
        self._made = {}

    def compiled(self, using=DEFAULT_DB_ALIAS):
        made = self._made.get(using)
        if made is None:
            made = self._made[using] = _RowsInSQL(self, connections[using])
        return made

    def __call__(self, using=DEFAULT_DB_ALIAS, known=None, **values):
        return run_alone(self.compiled(using), values, using)


class _RowsInSQL:
    """A RowsIn's SQL for one database: what core.compiled.together reads of a Read's."""

    def __init__(self, rows_in, connection):
        quote = connection.ops.quote_name
        tables = [_where(rows_in.model, name) for name in rows_in.names]
        self.names, self.field = rows_in.names, rows_in.model._meta.pk
        self.sql = " UNION ALL ".join(
            f"SELECT {n} WHERE EXISTS (SELECT 1 FROM {quote(table)} WHERE {quote(column)} = %s)" for n, (table, column) in enumerate(tables)
        )

    def bind(self, values, connection):
        if set(values) != {"of"}:
            raise TypeError("a RowsIn takes of (the object's id)")
        return [self.field.get_db_prep_value(values["of"], connection)] * len(self.names)

    def result(self, rows):
        return {self.names[n] for (n,) in rows}


def prefetch_sparse(instances, *prefetches):
    """prefetch_related_objects(instances, *prefetches), with each probed relation (a Prefetch
    to a list of a reverse foreign key, or a ReadPrefetch) prefetched only for the instances that
    have rows in it; the others get an empty list. Other lookups are prefetched as Django does."""
    instances = list(instances)
    if not instances:
        return
    model = type(instances[0])
    probed, plain = [], []
    for prefetch in prefetches:
        where = _probed(model, prefetch)
        (probed if where else plain).append((prefetch, where))
    for prefetch, _ in plain:
        if isinstance(prefetch, ReadPrefetch):
            prefetch(instances)
    if others := [prefetch for prefetch, _ in plain if not isinstance(prefetch, ReadPrefetch)]:
        prefetch_related_objects(instances, *others)
    if not probed:
        return
    found = having_rows(instances, [where for _, where in probed])
    for (prefetch, _), ids in zip(probed, found, strict=True):
        having = [instance for instance in instances if instance.pk in ids]
        for instance in instances:
            if instance.pk not in ids:
                setattr(instance, prefetch.to_attr, [])
        if having and isinstance(prefetch, ReadPrefetch):
            prefetch(having)
        elif having:
            prefetch_related_objects(having, prefetch)
