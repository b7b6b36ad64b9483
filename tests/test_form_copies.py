"""The job and request forms copy their fields for each form without copy.deepcopy's machinery
(core.forms, issue 24): the copies are what Django's own deep copy makes, each form's its own,
and a plain field's copy goes through no copy.copy."""

import copy

import pytest
from django import forms

from core import forms as core_forms
from jobs.forms import JobForm, RequestForm
from jobs.retrain_form import RetrainForm

FORMS = [JobForm, RequestForm, RetrainForm]
# What Django's Field.__deepcopy__, ChoiceField's and the widgets' give each copy of its own.
OWN = {"widget", "error_messages", "validators", "_choices", "attrs"}


def plain(form_class):
    """The fields whose deep copy is Django's Field's or ChoiceField's (the rest, with a
    __deepcopy__ of their own, are copied by it either way)."""
    return {n: f for n, f in form_class.base_fields.items() if type(f).__deepcopy__ in (forms.Field.__deepcopy__, forms.ChoiceField.__deepcopy__)}


def same(a, b, path):
    """The copies a and b (Django's and ours) agree: the same class, and the same attributes,
    shared where Django shares them."""
    assert type(a) is type(b), path
    assert a.__dict__.keys() == b.__dict__.keys(), path
    for name, value in a.__dict__.items():
        other = b.__dict__[name]
        if name == "widget":
            same(value, other, f"{path}.widget")
        elif name in OWN:
            assert value == other and value is not other, f"{path}.{name}"
        else:
            assert value is other, f"{path}.{name}"


@pytest.mark.parametrize("form_class", FORMS, ids=lambda c: c.__name__)
def test_fields_are_copied_as_django_copies_them(form_class):
    ours = copy.deepcopy(form_class.base_fields)
    assert ours.keys() == form_class.base_fields.keys()
    djangos = copy.deepcopy(plain(form_class))
    for name, field in plain(form_class).items():
        same(djangos[name], ours[name], name)
        copied = ours[name]
        assert copied is not field and copied.widget is not field.widget, name
        assert copied.error_messages is not field.error_messages and copied.validators is not field.validators, name
        assert copied.widget.attrs is not field.widget.attrs, name
        if isinstance(field, forms.ChoiceField):
            assert copied._choices == field._choices and copied._choices is not field._choices, name
            assert copied.widget.choices == field.widget.choices and copied.widget.choices is not field.widget.choices, name


def test_a_form_changing_its_fields_leaves_the_class_and_other_forms_alone():
    first, second = JobForm({}, team=None, chosen_recipe_only=True), JobForm({}, team=None, chosen_recipe_only=True)
    first.fields["name"].widget.attrs["placeholder"] = "changed"
    first.fields["name"].error_messages["required"] = "changed"
    first.fields["name"].validators.append(lambda value: None)
    first.fields["precision"].choices = [("x", "X")]
    first.fields["mode"].widget.choices.append(("x", "X"))
    for fields in (second.fields, JobForm.base_fields):
        assert fields["name"].widget.attrs.get("placeholder") != "changed"
        assert fields["name"].error_messages["required"] != "changed"
        assert len(fields["name"].validators) == len(JobForm.base_fields["name"].validators)
        assert ("x", "X") not in fields["precision"].choices
        assert ("x", "X") not in fields["mode"].widget.choices


def test_a_plain_fields_copy_goes_through_no_copy_copy(monkeypatch):
    """Django's deep copy of a field reaches copy.copy twice (the field, its widget): about 20 us
    a field through the pickle protocol. The job form's plain fields are copied directly."""
    calls = []
    real = copy.copy
    monkeypatch.setattr(copy, "copy", lambda obj: calls.append(type(obj).__name__) or real(obj))
    fields = plain(JobForm)
    assert len(fields) >= 30  # most of the form's fields
    copy.deepcopy(core_forms.Fields(fields))
    assert calls == []
    copy.deepcopy(dict(fields))  # Django's own: the count the test would see without core.forms
    assert len(calls) >= 2 * len(fields)


def test_a_subclass_of_a_form_keeps_the_quick_copies():
    class Seen(JobForm):
        extra = forms.CharField(required=False)

    assert isinstance(Seen.base_fields, core_forms.Fields)
    assert "extra" in copy.deepcopy(Seen.base_fields) and "name" in Seen.base_fields


def test_a_field_with_its_own_copy_or_an_unusual_class_is_copied_by_deepcopy():
    class Slotted(forms.Widget):
        __slots__ = ("extra",)

    class OwnCopy(forms.CharField):
        copies = 0

        def __deepcopy__(self, memo):
            OwnCopy.copies += 1
            return super().__deepcopy__(memo)

    widget_field = forms.CharField(widget=Slotted())
    widget_field.widget.extra = "kept"
    fields = core_forms.Fields(own=OwnCopy(), slotted=widget_field, grouped=forms.ChoiceField(choices=[("Group", [("a", "A")])]))
    copied = copy.deepcopy(fields)
    assert OwnCopy.copies == 1
    assert copied["slotted"].widget.extra == "kept" and copied["slotted"].widget is not widget_field.widget
    assert copied["grouped"].choices == [("Group", [("a", "A")])]
    assert copied["grouped"].choices[0][1] is not fields["grouped"].choices[0][1]  # a group's list, deep-copied
