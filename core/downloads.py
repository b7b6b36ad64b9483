"""Sending stored files to a user: a short-lived presigned URL where the store offers one (S3),
else streamed by the app with HTTP Range support (the local folder)."""

import re

from django.http import FileResponse, HttpResponse, HttpResponseRedirect, StreamingHttpResponse
from django.utils.http import content_disposition_header

from core.storage import CHUNK, get_storage

RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")


class Unsatisfiable(Exception):
    pass


def parse_range(header, size):
    """(start, end) inclusive for a single 'bytes=' range, None to send the whole file.

    Raises Unsatisfiable for a range that starts past the end. Several ranges at once are
    answered with the whole file, as RFC 9110 allows."""
    if not header:
        return None
    match = RANGE.match(header.strip())
    if not match or match.group(1) == match.group(2) == "":
        return None
    first, last = match.groups()
    if first == "":  # the last N bytes
        length = int(last)
        if length == 0:
            raise Unsatisfiable()
        return max(0, size - length), size - 1
    start = int(first)
    end = size - 1 if last == "" else min(int(last), size - 1)
    if start >= size or (last != "" and int(last) < start):
        raise Unsatisfiable()
    return start, end


def _slice(path, start, length):
    with open(path, "rb") as f:
        f.seek(start)
        while length > 0:
            chunk = f.read(min(CHUNK, length))
            if not chunk:
                return
            length -= len(chunk)
            yield chunk


def download_response(request, key, filename):
    storage = get_storage()
    url = storage.presigned_url(key, filename)
    if url is not None:
        return HttpResponseRedirect(url)
    path = storage.local_path(key)
    size = path.stat().st_size
    try:
        wanted = parse_range(request.headers.get("Range"), size)
    except Unsatisfiable:
        response = HttpResponse(status=416)
        response["Content-Range"] = f"bytes */{size}"
        return response
    if wanted is None:
        response = FileResponse(open(path, "rb"), as_attachment=True, filename=filename)  # noqa: SIM115 - the response closes it
    else:
        start, end = wanted
        response = StreamingHttpResponse(_slice(path, start, end - start + 1), status=206, content_type="application/octet-stream")
        response["Content-Range"] = f"bytes {start}-{end}/{size}"
        response["Content-Length"] = str(end - start + 1)
        response["Content-Disposition"] = content_disposition_header(True, filename)
    response["Accept-Ranges"] = "bytes"
    return response
