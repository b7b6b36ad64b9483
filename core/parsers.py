"""The API's JSON request bodies, read with limits.

DRF's own JSONParser turns a body nested past Python's stack ("[[[[...", a few hundred KB) into
a RecursionError, which no handler expects: a 500. Here every JSON body is read by json with
NaN and Infinity refused (they are not JSON), and nested at most MAX_DEPTH deep; anything else is
a 400 that says why. The size limit is Django's (DATA_UPLOAD_MAX_MEMORY_SIZE), which holds first.
The API's default (settings.REST_FRAMEWORK); the spec endpoints read theirs with the spec's own,
stricter reader (jobs/api.py).
"""

import json

from django.conf import settings
from rest_framework.exceptions import ParseError
from rest_framework.parsers import JSONParser

MAX_DEPTH = 64  # no body of this API nests more than a spec's 32 levels and a wrapper or two


class TooDeep(ValueError):
    pass


def depth(value, limit):
    """How deep lists and mappings are inside each other (counted without recursion, to limit+1)."""
    deepest, stack = 0, [(value, 1)]
    while stack and deepest <= limit:
        item, level = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, level)
            stack.extend((v, level + 1) for v in (item.values() if isinstance(item, dict) else item))
    return deepest


def _no_constant(name):
    raise ValueError(f"{name} is not a JSON number")


def read_json(text, max_depth=MAX_DEPTH):
    """JSON text as values; raises ValueError (json's own, or TooDeep) with a reason."""
    try:
        value = json.loads(text, parse_constant=_no_constant)
    except RecursionError:  # deeper than the stack: found by the parser before our count
        raise TooDeep(f"nested too deeply (more than {max_depth} levels)") from None
    if depth(value, max_depth) > max_depth:
        raise TooDeep(f"nested too deeply (more than {max_depth} levels)")
    return value


class BoundedJSONParser(JSONParser):
    max_depth = MAX_DEPTH

    def parse(self, stream, media_type=None, parser_context=None):
        encoding = (parser_context or {}).get("encoding", settings.DEFAULT_CHARSET)
        try:
            return read_json(stream.read().decode(encoding), self.max_depth)
        except (UnicodeDecodeError, ValueError) as error:
            raise ParseError(f"JSON parse error - {error}") from None
