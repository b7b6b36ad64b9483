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

import asyncio
import collections
from concurrent.futures import ThreadPoolExecutor

import django
from asgiref.sync import ThreadSensitiveContext, sync_to_async
from django.core import signals
from django.core.exceptions import RequestAborted
from django.core.handlers.asgi import ASGIHandler, get_script_prefix
from django.http import FileResponse
from django.urls import set_script_prefix


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

    def _finish(self, finished):
        if not finished:
            signals.request_finished.send(sender=self.__class__)

    async def handle(self, scope, receive, send):
        """ASGIHandler.handle with one hop to the request's thread, not three: Django sends
        request_started (its receivers are sync) and closes the response (request_finished) each
        in a hop of its own, before and after the one that makes the response. Here the thread
        sends request_started, makes the response and, when its body is in memory (not
        streamed), closes it, so the database connection goes back before the body is written,
        not after. A streamed response is closed once sent, as Django does. The rest is
        Django's: the disconnect watch, and request_finished sent for a request whose client
        went away (unless its thread sent it already).
        """
        try:
            body_file = await self.read_body(receive)
        except RequestAborted:
            return
        set_script_prefix(get_script_prefix(scope))
        # Before request_started, where Django makes it after: it reads the scope and the body only.
        request, error_response = self.create_request(scope, body_file)
        if request is None:
            await signals.request_started.asend(sender=self.__class__, scope=scope)
            body_file.close()
            await self.send_response(error_response, send)
            await sync_to_async(error_response.close)()
            return
        finished = []  # the thread appends once it has sent request_finished
        failed = []  # what closing the response raised: raised once it is sent, as Django does

        def respond():
            signals.request_started.send(sender=self.__class__, scope=scope)
            response = self.get_response(request)
            response._handler_class = self.__class__
            if isinstance(response, FileResponse):
                response.block_size = self.chunk_size
            if not response.streaming:
                try:
                    response.close()
                except Exception as error:  # noqa: BLE001 - the answer goes out first all the same
                    failed.append(error)
                finished.append(True)
            return response

        async def process_request():
            response = await sync_to_async(respond, thread_sensitive=True)()
            try:
                await self.send_response(response, send)
            except asyncio.CancelledError:
                pass  # the client went away while the response was sent
            if failed:
                raise failed[0]
            return response

        tasks = [asyncio.create_task(self.listen_for_disconnect(receive)), asyncio.create_task(process_request())]
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in tasks:
            if task.done():
                try:
                    task.result()
                except RequestAborted:
                    pass
                except AssertionError:
                    body_file.close()
                    raise
            else:
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass
        try:
            response = tasks[1].result()
        except asyncio.CancelledError:
            # Queued behind the view if it is still running (the thread is the request's own):
            # whether the thread closed the response is known only then.
            await sync_to_async(self._finish, thread_sensitive=True)(finished)
        else:
            if not finished:
                await sync_to_async(response.close)()
        body_file.close()


def application():
    """What django.core.asgi.get_asgi_application() returns, with this handler."""
    django.setup(set_prefix=False)
    return OneHopASGIHandler()
