"""The web worker's garbage collector: what lives as long as the worker is frozen, again and again.

Python's collector passes over its oldest generation whenever what reached it since the last pass
is a quarter of what lives there. A web worker's requests keep that quarter coming (whatever is
alive while a request runs is promoted), so it passed every 40-60 job lists, and each pass walked
the 68,000 objects the worker made after starting (its caches, pool, lazily imported modules),
25-45 ms each: the job list's and usage's p99 (issue 24). gc.freeze() at the start
(e31web/asgi.py) covers only what the start made.

After the 1st, 2nd, 4th, 8th ... full pass, what survived it is frozen: the collector no longer
walks it, and a pass walks what came since (3-9 ms). Frozen objects are still freed when nothing
refers to them; what a freeze cannot free is a reference cycle that was alive at that moment
(a request under way) and dies later, which is why the freezes grow rarer: a few dozen over a
worker's life, each holding at most what the requests then under way made.
"""

import gc


class Refreeze:
    """A gc callback (gc.callbacks): freezes after the full passes numbered by powers of two."""

    def __init__(self):
        self.passes = 0
        self.next = 1

    def __call__(self, phase, info):
        if phase == "stop" and info["generation"] == 2:
            self.passes += 1
            if self.passes == self.next:
                self.next *= 2
                gc.freeze()


def install():
    """Freeze what exists now, and again as above (once per process)."""
    gc.freeze()
    if not any(isinstance(callback, Refreeze) for callback in gc.callbacks):
        gc.callbacks.append(Refreeze())
