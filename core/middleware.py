"""Middleware that runs in a sync chain and an async one alike, and an answer's data let go of
once it is written.

BothModes: the web worker's chain is sync (e31web/handler.py), Django's own ASGI handler builds
an async one, where a sync-only middleware would send the rest of the chain to a thread. A
subclass gives call(request) for the first and __acall__(request) for the second.

ReleaseViewMiddleware: DRF's rendering puts the response into its own renderer context, which
also holds the view, and the view holds the response: every answer's data (a page of jobs, a
month's statement) was in a reference cycle, which only the collector frees. It reached the
oldest generation with them, and the passes over it, every 40 requests or so, took 25-45 ms
each: the p99 of the job list and usage (issue 24). Once the answer is rendered (Django renders
it before the middleware sees it), those references are dropped, and the data goes with the
response when daphne has sent it. The response keeps its data, for the tests that read it.
"""

from asgiref.sync import iscoroutinefunction, markcoroutinefunction


class BothModes:
    sync_capable = True
    async_capable = True

    def __init__(self, get_response):
        self.get_response = get_response
        if iscoroutinefunction(get_response):
            markcoroutinefunction(self)

    def __call__(self, request):
        if iscoroutinefunction(self):
            return self.__acall__(request)
        return self.call(request)

    def call(self, request):
        raise NotImplementedError

    async def __acall__(self, request):
        raise NotImplementedError


class ReleaseViewMiddleware(BothModes):
    def call(self, request):
        return release(self.get_response(request))

    async def __acall__(self, request):
        return release(await self.get_response(request))


def release(response):
    context = getattr(response, "renderer_context", None)
    if context and getattr(response, "is_rendered", True):
        context.pop("response", None)  # put there by the rendering: the response, itself
        view = context.pop("view", None)
        if view is not None:
            view.__dict__.pop("response", None)
    return response
