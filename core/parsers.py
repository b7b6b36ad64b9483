"""The API's JSON request bodies, read with limits.

DRF's own JSONParser turns a body nested past Python's stack ("[[[[...", a few hundred KB) into
a RecursionError, which no handler expects: a 500. Here every JSON body is read by json with
NaN and Infinity refused (they are not JSON), and nested at most MAX_DEPTH deep; anything else is
a 400 that says why. The size limit is Django's (DATA_UPLOAD_MAX_MEMORY_SIZE), which holds first.
The API's default (settings.REST_FRAMEWORK); the spec endpoints read theirs with the spec's own,
stricter reader (jobs/api.py).
"""

from django.conf import settings
from rest_framework.exceptions import ParseError
from rest_framework.parsers import JSONParser

from core.json_limits import MAX_DEPTH, read_json


class BoundedJSONParser(JSONParser):
    max_depth = MAX_DEPTH

    def parse(self, stream, media_type=None, parser_context=None):
        encoding = (parser_context or {}).get("encoding", settings.DEFAULT_CHARSET)
        try:
            return read_json(stream.read().decode(encoding), self.max_depth)
        except (UnicodeDecodeError, ValueError) as error:
            raise ParseError(f"JSON parse error - {error}") from None
