"""Request bodies under daphne: never parsed by twisted, and read from twisted's file as the
application reads them, not queued whole in memory.

daphne hands a request's body to the application as it came (Django parses it, streaming files to
disk). Two things stood between a large upload and the disk:

- twisted's Request, under daphne's, also parsed a POST's multipart or URL-encoded body into
  `request.args`, which daphne never reads: it read the whole body into memory and parsed it with
  the email package. A 200 MB upload took the web worker to 2.8 GB (VmHWM) and left it at 570 MB,
  and the parse was about 4% of a small submission's CPU. twisted has a switch for it
  (Request(parsePOSTFormSubmission=False), "this can use large amounts of memory for large
  uploads"), which daphne does not pass: install() makes daphne's requests pass it.
- daphne then read the body from twisted's file (a temporary file on disk past 100 kB) and put
  all of it, in 8 kB messages, on the application's queue at once, before the application read
  any: the body whole in the worker's memory, with a dict for every 8 kB, before authentication.
  A 200 MB upload still took the worker to about 1.7x the body. install() makes the queue keep
  where each message's bytes lie in the file, and read them (up to READ_AT_ONCE at a time, so
  Django writes the body to disk in a few large writes, not one thread hop per 8 kB) when the
  application takes the message.
"""

import asyncio
import inspect
from typing import NamedTuple

# The most a body message read from the file holds: consecutive messages daphne queued are one.
READ_AT_ONCE = 1024 * 1024


class _Span(NamedTuple):
    """A body message daphne queued, as where its bytes lie in the request's file."""

    start: int
    length: int
    more_body: bool


class FileBodyQueue(asyncio.Queue):
    """An HTTP request's queue to the application whose body messages stay in twisted's file
    (`content`) until the application takes them. Other messages (a disconnect) pass as they are."""

    content = None
    _offset = 0  # daphne reads the file from its start, in order: where its next message begins

    def _put(self, message):
        if self.content is not None and message.get("type") == "http.request" and "body" in message:
            length = len(message["body"])
            message = _Span(self._offset, length, bool(message.get("more_body", False)))
            self._offset += length
        super()._put(message)

    def _get(self):
        item = super()._get()
        if not isinstance(item, _Span):
            return item
        start, length, more_body = item
        while more_body and length < READ_AT_ONCE and self._queue and isinstance(self._queue[0], _Span):
            _, extra, more_body = self._queue.popleft()
            length += extra
        try:
            self.content.seek(start)
            body = self.content.read(length)
        except (OSError, ValueError):  # twisted closed the file: the client went away
            body = None
        if body is None or len(body) != length:
            self._queue = type(self._queue)(m for m in self._queue if not isinstance(m, _Span))
            return {"type": "http.disconnect"}
        return {"type": "http.request", "body": body, "more_body": more_body}


def install():
    """Make daphne's WebRequest pass parsePOSTFormSubmission=False to twisted, and its HTTP
    requests' queues FileBodyQueues (once)."""
    from daphne.http_protocol import WebRequest
    from daphne.server import Server
    from twisted.web.http import Request

    if getattr(WebRequest, "_body_unparsed", False):
        return
    if "parsePOSTFormSubmission" not in inspect.signature(Request.__init__).parameters:
        raise RuntimeError("this twisted's Request has no parsePOSTFormSubmission: it would parse every upload in memory")
    made = WebRequest.__init__

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("parsePOSTFormSubmission", False)
        made(self, *args, **kwargs)

    create = Server.create_application

    def create_application(self, protocol, scope):
        queue = create(self, protocol, scope)
        content = getattr(protocol, "content", None)
        if type(queue) is asyncio.Queue and scope.get("type") == "http" and content is not None:
            # The application's receive is this queue's get, bound already: its class is what
            # can change (asyncio.Queue's _put and _get are its subclasses' to override).
            queue.__class__ = FileBodyQueue
            queue.content = content
        return queue

    WebRequest.__init__ = __init__
    Server.create_application = create_application
    WebRequest._body_unparsed = True
