"""The building blocks of the API's serializers (jobs.serializers, catalog.serializers): an
object read through its Facts, times as stored, and the schema of a page of a list.

A serializer reads an object through its Facts: the model's own fields, and what the API shows
beyond them, worked out once per object. Times go out as stored (UTC) and the JSON renderer
writes them ("2026-11-03T10:30:00Z"), whatever time zone the request activated (Moment).
"""

import uuid
from collections.abc import Mapping

from django.urls import reverse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, inline_serializer
from rest_framework import serializers as s
from rest_framework.fields import Field, SkipField
from rest_framework.relations import ManyRelatedField, PKOnlyObject, RelatedField


def absolute_url(request, viewname, pk):
    """request.build_absolute_uri(reverse(viewname, args=[pk])), reversed once per request and
    view: each later object of a page puts its id into the first one's URL. reverse() costs about
    90 us here (it reads asgiref's Locals), 4.5 ms of a page of 50 jobs; this, 1 us."""
    if not isinstance(pk, uuid.UUID | int):  # only ids that need no quoting
        return request.build_absolute_uri(reverse(viewname, args=[pk]))
    made, key = request.__dict__.setdefault("_absolute_urls", {}), str(pk)
    if viewname in made:
        before, after = made[viewname]
        return before + key + after
    url = request.build_absolute_uri(reverse(viewname, args=[pk]))
    if url.count(key) == 1:
        made[viewname] = tuple(url.split(key))
    return url


class Moment(s.DateTimeField):
    """A time as stored (UTC), written by the JSON renderer; DRF's DateTimeField would move it
    into the request's time zone (a token's user's own, jobs.api activates it)."""

    def to_representation(self, value):
        return value


def nullable_str(**kwargs):
    return s.CharField(allow_null=True, allow_blank=True, **kwargs)


class DirectSerializer(s.Serializer):
    """A serializer that reads each plain field (one attribute, DRF's own way of reading it) with
    one getattr. DRF's read of a field (get_attribute: a Mapping test, the source's path walked,
    a callable inspected) cost a page of 50 jobs, 83 fields each, about a quarter of its CPU
    (issue 24). Whatever is not a plain value is read DRF's way, so the output is DRF's: a
    callable (DRF calls it or not), an attribute that is missing or raises (DRF's default, None,
    skip or error), any field with a source path or a read of its own, and any Mapping instance."""

    # True: the class's fields are made once, not per serializer (see _reads). DRF deep-copies
    # every declared field for each serializer made, a serializer per request: 1.2 ms of a job
    # list's CPU (issue 24). Only where no field reads the serializer's context (its request),
    # which _reads checks.
    shared_fields = False

    def _reads(self):
        """_reads_of this serializer: made once per class where its fields are shared."""
        reads = self.__dict__.get("_direct_reads")
        if reads is None:
            cls = type(self)
            if not cls.shared_fields:
                reads = _reads_of(self)
            elif (reads := cls.__dict__.get("_shared_reads")) is None:
                reads = _reads_of(cls())  # fields bound to a serializer with no context
                if unfit := [name for name, _, field, _ in reads if not _context_free(field)]:
                    raise TypeError(f"{cls.__name__}.shared_fields: {', '.join(unfit)} may read the context")
                cls._shared_reads = reads
            self.__dict__["_direct_reads"] = reads
        return reads

    def to_representation(self, instance):
        if isinstance(instance, Mapping):
            return super().to_representation(instance)
        ret = {}
        for name, attribute, field, kept in self._reads():
            value = _UNREAD
            if attribute is not None:
                try:
                    value = getattr(instance, attribute)
                except Exception:  # noqa: BLE001, S110 - DRF's read below says what it means
                    pass
                else:
                    if callable(value):
                        value = _UNREAD
            if value is _UNREAD:
                try:
                    value = field.get_attribute(instance)
                except SkipField:
                    continue
            if kept is not None and (kept is _ANY or type(value) is kept):
                ret[name] = value  # what the field's to_representation would give back
                continue
            check_for_none = value.pk if isinstance(value, PKOnlyObject) else value
            ret[name] = None if check_for_none is None else field.to_representation(value)
        return ret


_UNREAD = object()
_ANY = object()


def _kept(field):
    """The type of value the field writes as it is (its to_representation gives it back
    unchanged: str(a str), int(an int), float(a float), a bool's own truth; a Moment anything), or
    None. A page of 50 jobs called to_representation 4,000 times, mostly to give back its value."""
    if type(field) is Moment:
        return _ANY
    return {s.CharField: str, s.IntegerField: int, s.FloatField: float, s.BooleanField: bool}.get(type(field))


def _reads_of(serializer):
    """(name, attribute, field, kept) of each readable field: attribute None, read DRF's way;
    kept, the type of value written as it is (_kept)."""
    return [
        (
            field.field_name,
            field.source_attrs[0] if type(field).get_attribute is Field.get_attribute and len(field.source_attrs) == 1 else None,
            field,
            _kept(field),
        )
        for field in serializer._readable_fields
    ]


def _context_free(field):
    """Whether a field writes its value without the serializer's context: a plain field (not a
    method field, a relation or a file, whose URL needs the request), a list or dict of such, or
    a DirectSerializer whose fields all are (a FactsSerializer reads the request)."""
    if isinstance(field, s.ListSerializer | s.ListField | s.DictField):
        return _context_free(field.child)
    if isinstance(field, s.BaseSerializer):
        return isinstance(field, DirectSerializer) and not isinstance(field, FactsSerializer) and all(map(_context_free, field.fields.values()))
    return not isinstance(field, s.SerializerMethodField | RelatedField | ManyRelatedField | s.FileField)


class Facts:
    """An object as a serializer reads it: its own attributes, and the API's figures about it
    (set in a subclass's __init__), which take precedence.

    The object's own values (a model's fields) are copied in, so a serializer reads each with
    one lookup: through __getattr__, a page of 50 jobs read 2,300 of them at 0.5 us each (issue
    24). What the object has beyond its values (a property, a method) is still read from it."""

    def __init__(self, obj):
        self.__dict__.update(getattr(obj, "__dict__", ()))
        self.obj = obj

    def __getattr__(self, name):  # only for what the facts do not have themselves
        if name == "obj":
            raise AttributeError(name)
        return getattr(self.obj, name)


class FactsSerializer(DirectSerializer):
    """A serializer of an object's Facts (facts_class), made once per object shown."""

    facts_class = Facts

    def to_representation(self, instance):
        facts = instance if isinstance(instance, Facts) else self.facts_class(instance, self.context["request"])
        return super().to_representation(facts)


def page_params():
    return [
        OpenApiParameter("page", OpenApiTypes.INT, description="Page number, from 1 (a page past the last one is a 404)."),
        OpenApiParameter("page_size", OpenApiTypes.INT, description="Items per page."),
    ]


def paged(name, item):
    """The schema of a page of items (core.api.page_of)."""
    return inline_serializer(
        name=name,
        fields={
            "count": s.IntegerField(help_text="How many items there are in all."),
            "next": s.URLField(allow_null=True, help_text="The next page's URL; null on the last page."),
            "previous": s.URLField(allow_null=True, help_text="The previous page's URL; null on the first page."),
            "results": item(many=True),
        },
    )
