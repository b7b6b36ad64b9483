"""daphne's requests leave a POST's body unparsed by twisted.

daphne hands a request's body to the application as it came (Django parses it, streaming files to
disk). twisted's Request, under daphne's, also parses a POST's multipart or URL-encoded body into
`request.args`, which daphne never reads: it reads the whole body into memory and parses it with
the email package. A 200 MB upload took the web worker to 2.8 GB (VmHWM) and left it at 570 MB,
so a few of the 2 GB files a job may send (E31_MAX_UPLOAD_BYTES) would exhaust a node's memory;
and the parse was about 4% of a small submission's CPU. twisted has a switch for it
(Request(parsePOSTFormSubmission=False), "this can use large amounts of memory for large
uploads"), which daphne does not pass: install() makes daphne's requests pass it.
"""

import inspect


def install():
    """Make daphne's WebRequest pass parsePOSTFormSubmission=False to twisted (once)."""
    from daphne.http_protocol import WebRequest
    from twisted.web.http import Request

    if getattr(WebRequest, "_body_unparsed", False):
        return
    if "parsePOSTFormSubmission" not in inspect.signature(Request.__init__).parameters:
        raise RuntimeError("this twisted's Request has no parsePOSTFormSubmission: it would parse every upload in memory")
    made = WebRequest.__init__

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("parsePOSTFormSubmission", False)
        made(self, *args, **kwargs)

    WebRequest.__init__ = __init__
    WebRequest._body_unparsed = True
