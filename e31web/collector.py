"""The web worker's garbage collector: what lives as long as the worker is frozen, again and again.

Python's collector passes over its oldest generation whenever what reached it since the last pass
is a quarter of what lives there. A web worker's requests keep that quarter coming (whatever is
alive while a request runs is promoted), so it passed every 40-60 job lists, and each pass walked
the 68,000 objects the worker made after starting (its caches, pool, lazily imported modules),
25-45 ms each: the job list's and usage's p99 (issue 24). gc.freeze() at the start
(e31web/asgi.py) covers only what the start made.

After the 1st, 2nd, 4th, 8th ... 1,024th full pass, what survived it is frozen: the collector no
longer walks it, and a pass walks what came since (3-9 ms). Frozen objects are still freed when
nothing refers to them; what a freeze cannot free is a reference cycle that was alive at that
moment and dies later: the requests then under way (a request, its user and session, its parsed
body). So the freezes grow rarer and stop: eleven over a worker's life, the last after about
50,000 requests, when what the worker keeps has long been made; each holds at most what the
requests then under way made, E31_WEB_CONCURRENCY (16) of them at most.
"""

import gc


class Refreeze:
    """A gc callback (gc.callbacks): freezes after the full passes numbered by powers of two, up
    to LAST."""

    LAST = 1024  # the last full pass after which it freezes

    def __init__(self):
        self.passes = 0
        self.next = 1

    def __call__(self, phase, info):
        if phase == "stop" and info["generation"] == 2 and self.next <= self.LAST:
            self.passes += 1
            if self.passes == self.next:
                self.next *= 2
                gc.freeze()


def install():
    """Freeze what exists now, and again as above (once per process)."""
    gc.freeze()
    if not any(isinstance(callback, Refreeze) for callback in gc.callbacks):
        gc.callbacks.append(Refreeze())
