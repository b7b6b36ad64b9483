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

The request's thread is lent, not made. ASGIHandler runs each request in a
ThreadSensitiveContext of its own, for which asgiref made a thread (an executor of one worker) at
the request's first sync call and, at its end, another thread to join and shut the first down:
two threads started a request, about 250 us of a worker's CPU (a 404 costs 3 ms). Here each
request is lent a thread kept from an earlier request (RequestThreads), as a WSGI server's
threads serve request after request; its database connection goes back to the pool at the
request's end as before (request_finished).
"""

import collections
from concurrent.futures import ThreadPoolExecutor

import django
from asgiref.sync import ThreadSensitiveContext, sync_to_async
from django.core.handlers.asgi import ASGIHandler


class RequestThreads:
    """Threads lent to requests, one each (an executor of one worker, as asgiref's
    ThreadSensitiveContext takes it), and kept for the next. A thread comes back once it has
    finished all it was given: a request cancelled by its client's disconnect ends while its view
    may still run in the thread, and the next request must not wait behind it."""

    def __init__(self):
        self._idle = collections.deque()  # append and pop are atomic: a worker thread gives back

    def lend(self):
        try:
            return self._idle.pop()
        except IndexError:
            return ThreadPoolExecutor(max_workers=1, thread_name_prefix="e31-request")

    def give_back(self, executor):
        # Queued behind whatever the thread was given: it comes back when that has finished.
        executor.submit(self._idle.append, executor)

    def __len__(self):
        return len(self._idle)


class OneHopASGIHandler(ASGIHandler):
    def __init__(self):
        super().__init__()
        self.threads = RequestThreads()

    def load_middleware(self, is_async=False):
        super().load_middleware(is_async=False)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await super().__call__(scope, receive, send)  # Django refuses it
        executor = self.threads.lend()
        try:
            async with ThreadSensitiveContext(executor=executor):
                await self.handle(scope, receive, send)
        finally:
            self.threads.give_back(executor)

    async def get_response_async(self, request):
        return await sync_to_async(self.get_response, thread_sensitive=True)(request)


def application():
    """What django.core.asgi.get_asgi_application() returns, with this handler."""
    django.setup(set_prefix=False)
    return OneHopASGIHandler()
