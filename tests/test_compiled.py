"""core.compiled.Read: a queryset's SQL made once, its rows what the ORM gives."""

from datetime import UTC, datetime, timedelta
from decimal import Decimal
from unittest import mock

import pytest
from django.contrib.auth import get_user_model
from django.db import connection
from django.db.models import BigIntegerField, Count, UUIDField
from django.db.models.signals import post_save, pre_save
from django.test.utils import isolate_apps

from core.compiled import Insert, Param, Read
from jobs.models import Job, JobEvent
from scheduler.models import Allocation, Node
from tests.conftest import make_job


def values_of(obj):
    return {name: value for name, value in vars(obj).items() if not name.startswith("_")}


@pytest.fixture
def job(alice, rate):
    job = make_job(alice)
    now = datetime(2026, 12, 1, tzinfo=UTC)
    JobEvent.append(job.pk, [JobEvent(kind="log", stream="stdout", text=f"line {n}", at=now) for n in range(5)])
    JobEvent.append(job.pk, [JobEvent(kind="metric", data={"step": 1, "values": {"loss": 0.5}}, at=now)])
    node = Node.objects.create(name="n1", device_type="a100", devices=8)
    start = datetime(2026, 12, 1, tzinfo=UTC)
    for n in range(2):
        Allocation.objects.create(job=job, node=node, devices=[n], device_type="a100", rate=Decimal("2.40"), started_at=start + timedelta(hours=n))
    job.refresh_from_db()
    return job


def test_model_instances_with_their_related_rows_are_the_orms_own(job, django_assert_num_queries):
    built = []

    def build():
        built.append(1)
        return Allocation.objects.filter(job_id=Param("job", UUIDField())).select_related("node", "job").order_by("started_at")

    read = Read(build)
    orm = list(Allocation.objects.filter(job=job).select_related("node", "job").order_by("started_at"))
    for given in (job.pk, str(job.pk)):  # a UUID's text is prepared as a lookup prepares it
        with django_assert_num_queries(1):
            rows = read(job=given)
            assert [r.node.name for r in rows] == ["n1", "n1"] and rows[0].job.name == job.name  # nothing left to read
        assert [values_of(r) for r in rows] == [values_of(o) for o in orm]
        assert [values_of(r.node) for r in rows] == [values_of(o.node) for o in orm]
        assert [values_of(r.job) for r in rows] == [values_of(o.job) for o in orm]
        assert all(not r._state.adding and r._state.db == "default" for r in rows)
    assert built == [1]  # built and compiled once
    assert read(job=Job.objects.exclude(pk=job.pk).values_list("pk", flat=True).first() or "00000000-0000-0000-0000-000000000000") == []


def test_known_objects_are_set_on_each_instance_with_no_query(job, django_assert_num_queries):
    read = Read(lambda: Allocation.objects.filter(job_id=Param("job", UUIDField())))
    with django_assert_num_queries(1):
        rows = read(job=job.pk, known={"job": job})
        assert all(r.job is job for r in rows)


def test_annotations_values_and_values_lists_read_as_the_orm_reads_them(job):
    annotated = Read(lambda: Job.objects.filter(pk=Param("job", UUIDField())).annotate(held=Count("allocations")))
    assert annotated(job=job.pk)[0].held == 2
    upto = BigIntegerField()
    as_dicts = Read(
        lambda: JobEvent.objects.filter(job_id=Param("job", UUIDField()), seq__lte=Param("upto", upto)).order_by("-seq").values("seq", "kind", "data")[:3]
    )
    assert as_dicts(job=job.pk, upto=job.last_seq) == list(job.events.order_by("-seq").values("seq", "kind", "data")[:3])
    as_tuples = Read(lambda: JobEvent.objects.filter(job_id=Param("job", UUIDField()), kind="metric").values_list("seq", "at", "data"))
    ((seq, at, data),) = as_tuples(job=job.pk)
    assert (seq, at, data) == job.events.filter(kind="metric").values_list("seq", "at", "data").get()
    assert at.tzinfo is not None and data["values"] == {"loss": 0.5}  # the converters ran (aware time, JSON)
    flat = Read(lambda: JobEvent.objects.filter(job_id=Param("job", UUIDField()), kind="log").order_by("seq").values_list("text", flat=True))
    assert flat(job=job.pk) == [f"line {n}" for n in range(5)]
    # Annotated columns come where values() and values_list() put them (the SQL has them last).
    counted = Read(lambda: Job.objects.filter(pk=Param("job", UUIDField())).annotate(n=Count("allocations")).values("n", "name"))
    assert counted(job=job.pk) == list(Job.objects.filter(pk=job.pk).annotate(n=Count("allocations")).values("n", "name")) == [{"n": 2, "name": job.name}]
    pairs = Read(lambda: Job.objects.filter(pk=Param("job", UUIDField())).annotate(n=Count("allocations")).values_list("n", "name"))
    assert pairs(job=job.pk) == list(Job.objects.filter(pk=job.pk).annotate(n=Count("allocations")).values_list("n", "name")) == [(2, job.name)]
    grouped = Read(lambda: Allocation.objects.filter(job_id=Param("job", UUIDField())).values("job_id").annotate(n=Count("pk")).values_list("n", flat=True))
    assert grouped(job=job.pk) == [2]
    first = Read(lambda: JobEvent.objects.filter(job_id=Param("job", UUIDField()), kind="nothing")[:1])
    assert first.first(job=job.pk) is None


def test_what_a_read_cannot_do_is_refused_with_a_reason(job):
    read = Read(lambda: Job.objects.filter(pk=Param("job", UUIDField()), team_id=Param("team", UUIDField())))
    with pytest.raises(TypeError, match="takes job, team; missing team"):
        read(job=job.pk)
    with pytest.raises(TypeError, match="unknown other"):
        read(job=job.pk, team=job.team_id, other=1)
    with pytest.raises(TypeError, match="prefetch_related"):
        Read(lambda: Job.objects.prefetch_related("allocations"))()
    with pytest.raises(TypeError, match="not NamedValuesListIterable"):
        Read(lambda: Job.objects.values_list("name", named=True))()
    with pytest.raises(TypeError, match="cannot be named using"):
        Read(lambda: Job.objects.filter(pk=Param("using", UUIDField())))(job=job.pk)


def test_a_reads_converters_are_worked_out_once_and_still_convert(job):
    """The columns' converters (a JSON column's decoding, a decimal's places) are asked of the
    fields when the Read is compiled, not at every call (issue 24)."""
    from django.db.models.sql.compiler import SQLCompiler

    read = Read(lambda: Job.objects.filter(pk=Param("job", UUIDField()))[:1])
    read(job=job.pk)
    with mock.patch.object(SQLCompiler, "get_converters", side_effect=AssertionError("converters worked out again")):
        [again] = read(job=job.pk)
    orm = Job.objects.get(pk=job.pk)
    assert values_of(again) == values_of(orm) and again.config == orm.config and again.span_hours == orm.span_hours


def test_reads_together_give_what_each_gives_alone_in_one_round_trip_on_postgresql(job, django_assert_num_queries):
    """core.compiled.together: model instances with related rows and known objects, dicts, tuples
    and flat values, an empty result between others, a value with a quote, a percent sign and a
    semicolon; one query on PostgreSQL (the statements in one), one per Read elsewhere."""
    from django.db import connection

    from core.compiled import together

    UUID = UUIDField()
    allocations = Read(lambda: Allocation.objects.filter(job_id=Param("job", UUID)).select_related("node").order_by("started_at"))
    lines = Read(lambda: JobEvent.objects.filter(job_id=Param("job", UUID), kind="log").order_by("-seq").values("seq", "text")[:3])
    nothing = Read(lambda: JobEvent.objects.filter(job_id=Param("job", UUID), kind="nothing").values_list("seq", "at"))
    metrics = Read(lambda: JobEvent.objects.filter(job_id=Param("job", UUID), kind="metric").values_list("seq", "at", "data"))
    named = Read(lambda: Job.objects.filter(name=Param("name", Job._meta.get_field("name"))).values_list("pk", flat=True))
    calls = [
        (allocations, {"job": job.pk}, {"job": job}),
        (lines, {"job": job.pk}),
        (nothing, {"job": job.pk}),
        (metrics, {"job": job.pk}),
        (named, {"name": "it's 100%; DROP TABLE jobs_job; --"}),
        (named, {"name": job.name}),
    ]
    alone = [read(known=rest[1] if len(rest) > 1 else None, **rest[0]) for read, *rest in calls]
    with django_assert_num_queries(1 if connection.vendor == "postgresql" else len(calls)):
        got = together(*calls)
        assert all(a.job is job and a.node.name == "n1" for a in got[0])  # nothing left to read
    assert [[values_of(a) for a in got[0]], *got[1:]] == [[values_of(a) for a in alone[0]], *alone[1:]]
    assert got[1][0]["text"] == "line 4" and got[2] == [] and got[3][0][2]["values"] == {"loss": 0.5} and got[4] == [] and got[5] == [job.pk]
    assert Job.objects.filter(pk=job.pk).exists()
    assert together((lines, {"job": job.pk})) == [alone[1]]
    # With server-side binding (prepared statements, one statement each) they go one by one.
    with mock.patch.dict(connection.settings_dict["OPTIONS"], server_side_binding=True), django_assert_num_queries(len(calls)):
        assert together(*calls)[1:] == alone[1:]
    with pytest.raises(TypeError, match="missing job"):
        together((lines, {}), (metrics, {"job": job.pk}))


# Insert ---------------------------------------------------------------------------------------


def a_job(alice, name="inserted", **fields):
    team = alice.membership.team
    return Job(
        team=team, created_by=alice, name=name, entrypoint="train.py", gpus=2, span_hours=Decimal("1.5"), args=["--lr", "0.1"],
        config={"lr": 0.1, "layers": [1, 2]}, env={"A": "1"}, ceiling_amount=Decimal("12.5"), last_seq=1, **fields,
    )  # fmt: skip


def test_an_insert_stores_what_save_stores_and_reads_back_as_stored_in_one_query(alice, django_assert_num_queries):
    insert = Insert(Job)
    saved = a_job(alice, name="saved")
    saved.save(force_insert=True)
    saved.refresh_from_db()
    with django_assert_num_queries(1):
        ours = insert(a_job(alice, name="ours"))
    assert not ours._state.adding and ours._state.db == "default"
    read = Job.objects.get(pk=ours.pk)
    differ = {"id", "name", "experiment", "created_at"}
    assert {k: v for k, v in values_of(ours).items() if k not in differ} == {k: v for k, v in values_of(saved).items() if k not in differ}
    assert values_of(ours) == values_of(read)  # as a read finds it: decimals to their places
    assert ours.span_hours == Decimal("1.50") and str(ours.ceiling_amount) == str(read.ceiling_amount)
    assert ours.created_at == read.created_at and ours.experiment == ""  # fill_derived is the caller's
    with django_assert_num_queries(1):
        insert(a_job(alice, name="again"))  # the SQL made once: the same one query


def test_an_insert_sends_saves_signals_and_refuses_unsaved_related_objects(alice):
    seen = []

    def pre(sender, instance, **kw):
        seen.append(("pre", instance.name, instance._state.adding))

    def post(sender, instance, created, **kw):
        seen.append(("post", instance.name, created))

    pre_save.connect(pre, sender=Job)
    post_save.connect(post, sender=Job)
    try:
        Insert(Job)(a_job(alice, name="signalled"))
    finally:
        pre_save.disconnect(pre, sender=Job)
        post_save.disconnect(post, sender=Job)
    assert seen == [("pre", "signalled", True), ("post", "signalled", True)]
    unsaved = a_job(alice)
    unsaved.created_by = get_user_model()(username="never-saved")
    with pytest.raises(ValueError, match="unsaved related object"):
        Insert(Job)(unsaved)
    assert not Job.objects.filter(name="inserted").exists()


def test_an_insert_leaves_an_auto_increment_key_to_the_database_and_reads_it_back(alice, django_assert_num_queries):
    from accounts.models import AuditEvent

    insert = Insert(AuditEvent)
    with django_assert_num_queries(2):
        first = insert(AuditEvent(user=alice, actor="alice", team=alice.membership.team, action="job.submit", label="a job"))
        second = insert(AuditEvent(user=alice, actor="alice", team=alice.membership.team, action="job.cancel"))
    assert isinstance(first.pk, int) and second.pk > first.pk
    assert values_of(first) == values_of(AuditEvent.objects.get(pk=first.pk))


@isolate_apps("jobs")  # a model of the test's own, not left among the app's
def test_an_insert_refuses_a_model_whose_database_makes_a_columns_value():
    from django.db import models

    class Defaulted(models.Model):
        made = models.IntegerField(db_default=7)

        class Meta:
            app_label = "jobs"

        def __str__(self):
            return str(self.made)

    with pytest.raises(TypeError, match="the database makes jobs.Defaulted.made's"):
        Insert(Defaulted)(Defaulted())


def test_an_insert_refuses_an_expression_for_save_to_compile(alice):
    from django.db.models import Value

    with pytest.raises(TypeError, match=r"not expressions \(jobs.Job.name\)"):
        Insert(Job)(a_job(alice, name=Value("made by the database")))
    assert not Job.objects.exists()


def test_where_the_database_cannot_return_columns_an_insert_saves_and_reads_back(alice, django_assert_num_queries):
    with mock.patch.object(connection.features, "can_return_columns_from_insert", False), django_assert_num_queries(2):
        job = Insert(Job)(a_job(alice))
    assert values_of(job) == values_of(Job.objects.get(pk=job.pk)) and job.span_hours == Decimal("1.50")
