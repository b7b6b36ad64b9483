"""The loop of a worker thread beside the scheduler (notifications.delivery, tracking.worker): it
takes one piece of work at a time until told to stop, and when there is none, or a round failed
(the database away, say), it waits and looks again on a fresh connection."""

import threading

from django.db import close_old_connections, connection


def serve(handle_one, stop, interval, log, what):
    """Call handle_one() (True: it did something, look again at once) until `stop` (a
    threading.Event) is set; idle or failed, wait `interval` s. what: how a failure is logged."""
    try:
        while not stop.is_set():
            try:
                busy = handle_one()
            except Exception:
                # The database away, say: the next round retries on a fresh connection.
                log.exception("%s failed", what)
                connection.close()
                busy = False
            if not busy:
                close_old_connections()
                stop.wait(interval)
    finally:
        connection.close()


def start_thread(run, stop, interval, name):
    """run(stop, interval) as a daemon thread (its own database connection, as every thread has)."""
    thread = threading.Thread(target=run, args=(stop, interval), name=name, daemon=True)
    thread.start()
    return thread
