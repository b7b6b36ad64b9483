"""Django's JSONField, its values read by orjson: the same values, in a sixth of the time.

A JSON column's value comes from the database as text and Django reads it with json.loads, about
1.4 us for a state change's {"state", "from", "reason"} where orjson takes 0.2. A page of 50 jobs
reads some 400 of them (each job's arguments, settings, variables and environment, its
allocations' devices, its timeline's events), about 0.5 ms of the job list's CPU (issue 24).

The values are json.loads' own: where orjson would read a text otherwise, json.loads reads it.
orjson refuses what is not strict JSON (a number past a float's range, which json reads as an
infinity; a lone surrogate) and reads an integer past 64 bits as a float, so a text with 19 or
more digits in a row that are not a fraction's or before one (an integer's, an exponent's, or
in a string) goes to json.loads too. tests/test_jsonfield.py compares the two.

Migrations see Django's own field (deconstruct): the column and its SQL are the same.
"""

import json
import re

import orjson
from django.db import models
from django.db.models.fields.json import KeyTransform

_LONG_NUMBER = re.compile(r"(?<![\d.])\d{19,}(?![\d.eE])")  # may be an integer past 64 bits


def loads(text):
    """json.loads(text), through orjson where that reads the same."""
    if not _LONG_NUMBER.search(text):
        try:
            return orjson.loads(text)
        except orjson.JSONDecodeError:
            pass
    return json.loads(text)


class JSONField(models.JSONField):
    def from_db_value(self, value, expression, connection):
        if self.decoder is not None or not isinstance(value, str) or isinstance(expression, KeyTransform):
            return super().from_db_value(value, expression, connection)
        try:
            return loads(value)
        except json.JSONDecodeError:  # as Django's: a text that is not JSON comes back as it is
            return value

    def deconstruct(self):
        name, _path, args, kwargs = super().deconstruct()
        return name, "django.db.models.JSONField", args, kwargs
