import signal
from contextlib import contextmanager


@contextmanager
def stop_on_signals(on_stop):
    """Call on_stop on SIGINT/SIGTERM while inside the block; restore the old handlers after."""
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

    def handler(signum, frame):
        on_stop()

    for sig in previous:
        signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
