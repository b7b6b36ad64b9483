"""Django under daphne with one thread hop a request, not one per middleware method.

Django's ASGI handler builds its middleware chain async. Its own middleware (security, sessions,
common, CSRF, authentication, messages, clickjacking) is MiddlewareMixin's, whose async call
runs each process_request and process_response through sync_to_async: twelve trips from the
event loop to a thread and back for every request, before and after the view's own. This
handler builds the chain sync, as under WSGI, and runs it, view and all, in one sync_to_async:
the request's thread does everything a WSGI worker would, and the event loop reads the request
and writes the response. /api/me/, one client over HTTP: p50 5.1 -> 3.5 ms, the worker's CPU
4.5 -> 3.0 ms a request (issue 24).

What stays async: reading the body, request_started, sending the response (a streamed one's
chunks as well) and closing it, and the disconnect watch, all ASGIHandler's. Our own middleware
runs sync here: the chain is sync from its first layer to the view.
"""

import django
from asgiref.sync import sync_to_async
from django.core.handlers.asgi import ASGIHandler


class OneHopASGIHandler(ASGIHandler):
    def load_middleware(self, is_async=False):
        super().load_middleware(is_async=False)

    async def get_response_async(self, request):
        return await sync_to_async(self.get_response, thread_sensitive=True)(request)


def application():
    """What django.core.asgi.get_asgi_application() returns, with this handler."""
    django.setup(set_prefix=False)
    return OneHopASGIHandler()
