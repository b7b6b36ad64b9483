"""Forms whose fields are copied for each form without copy.deepcopy's machinery.

Django copies a form class's fields for every form it makes (BaseForm.__init__ deep-copies
base_fields), so that a form may change its own fields. Each field's copy goes through copy.copy
(the pickle protocol: __reduce_ex__, copyreg) for the field and again for its widget: about 20 us
a field, 1.0-1.4 ms for the job form's fifty-one, a tenth of a submission's web CPU (issue 24).

Form (and FormMetaclass) make the same copies directly, where a field's and its widget's own
__deepcopy__ are Django's plain ones (Field's, ChoiceField's, Widget's, ChoiceWidget's) and the
class keeps its state in its __dict__ as copy.copy would find it. Any other field or widget, one
with a __deepcopy__ of its own say, is copied by copy.deepcopy as before.
"""

import copy
import decimal
from functools import cache

from django import forms
from django.forms.forms import DeclarativeFieldsMetaclass
from django.forms.widgets import ChoiceWidget
from django.utils.functional import Promise

# What copy.deepcopy returns unchanged (lazy text's proxy returns itself, as does Decimal).
IMMUTABLE = (str, int, float, bool, type(None), decimal.Decimal, Promise)


@cache
def _plain(cls):
    """Whether copy.copy of an instance is a new instance with the same __dict__: no __copy__,
    pickle hooks or slots of its own anywhere in its classes."""
    if hasattr(cls, "__copy__") or hasattr(cls, "__setstate__"):
        return False
    if cls.__reduce_ex__ is not object.__reduce_ex__ or cls.__reduce__ is not object.__reduce__ or cls.__getstate__ is not object.__getstate__:
        return False
    return not any("__slots__" in vars(klass) for klass in cls.__mro__[:-1])


def _shallow(obj):
    cls = type(obj)
    result = cls.__new__(cls)
    result.__dict__.update(obj.__dict__)
    return result


def field_copy(field, memo):
    """forms.Field.__deepcopy__'s copy: the field's attributes shared, its widget, error
    messages and validators its own. For a field class's own __deepcopy__ to build on."""
    if not _plain(type(field)):
        return forms.Field.__deepcopy__(field, memo)
    result = _shallow(field)
    memo[id(field)] = result
    result.widget = widget_copy(field.widget, memo)
    result.error_messages = field.error_messages.copy()
    result.validators = field.validators[:]
    return result


def widget_copy(widget, memo):
    """What copy.deepcopy(widget, memo) returns."""
    if id(widget) in memo:
        return memo[id(widget)]
    method = type(widget).__deepcopy__
    if not _plain(type(widget)) or method not in (forms.Widget.__deepcopy__, ChoiceWidget.__deepcopy__):
        return copy.deepcopy(widget, memo)
    result = _shallow(widget)
    result.attrs = widget.attrs.copy()
    if method is ChoiceWidget.__deepcopy__:
        # Its choices setter normalises them again (about 13 us); normalised (value, label)
        # pairs come out as they went in.
        if _pairs(widget.__dict__.get("_choices")):
            result._choices = list(widget._choices)
        else:
            result.choices = copy.copy(widget.choices)
    memo[id(widget)] = result
    return result


def choices_copy(choices, memo):
    """What copy.deepcopy(choices, memo) returns, where the choices are a list of (value, label)
    of text and numbers: a new list of the same tuples (deepcopy keeps a tuple of immutables)."""
    return list(choices) if _pairs(choices) else copy.deepcopy(choices, memo)


def _pairs(choices):
    """Whether choices are a list of (value, label) pairs of text and numbers, no groups."""
    return type(choices) is list and all(type(c) is tuple and len(c) == 2 and isinstance(c[0], IMMUTABLE) and isinstance(c[1], IMMUTABLE) for c in choices)


def fast_deepcopy(field, memo):
    """What copy.deepcopy(field, memo) returns."""
    if id(field) in memo:
        return memo[id(field)]
    method = type(field).__deepcopy__
    if method is forms.Field.__deepcopy__:
        return field_copy(field, memo)
    if method is forms.ChoiceField.__deepcopy__:
        result = field_copy(field, memo)
        result._choices = choices_copy(field._choices, memo)
        return result
    return copy.deepcopy(field, memo)


class Fields(dict):
    """A form class's base_fields, deep-copied field by field with fast_deepcopy."""

    def __deepcopy__(self, memo):
        return {name: fast_deepcopy(field, memo) for name, field in self.items()}


class FormMetaclass(DeclarativeFieldsMetaclass):
    def __new__(mcs, name, bases, attrs):
        new_class = super().__new__(mcs, name, bases, attrs)
        new_class.base_fields = Fields(new_class.base_fields)
        return new_class


class Form(forms.Form, metaclass=FormMetaclass):
    """A forms.Form whose fields are copied for each form without copy.deepcopy's machinery."""
