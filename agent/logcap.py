"""The log cap: a ceiling on the bytes of log one job keeps. Past it, lines are counted, not stored.

One 6-second job that printed as fast as it could grew the database by 94 MB. The job is never
slowed or stopped for its log: the runner reads its pipes as before (a full pipe would block it)
and only stops storing what it reads. Two lines of the network say what happened, in the log
itself (so the job page, the API and the downloaded log all show them): one when the cap is
reached, and one when the run ends, with how much was not stored.

Pure: the runner gives it the bytes the job's log already holds and each batch it read.
"""

# The stream of the network's own lines in a job's log: the job page shows it as it shows notices.
MARKER_STREAM = "sys"


def line_bytes(text):
    """What one line costs against the cap: its UTF-8 bytes and its newline (the bytes it takes in
    the downloaded log). The newline makes empty lines cost something: each is a row too.
    jobs.logs.stored_bytes counts the stored log the same way."""
    return len(text.encode()) + 1


def size_text(count):
    """A size as the settings give it: 100 MB, 50 KB, 1.5 GB (powers of ten, as the cap is set)."""
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if count >= scale:
            return f"{round(count / scale, 2):g} {unit}"
    return f"{count} bytes"


class LogBudget:
    """What is left of one job's log cap for one run on one node.

    stored: the bytes its log holds already (earlier runs of a requeued job).
    shares: the nodes of a gang, which write one job's log at once without asking each other:
    each gets an equal part of what is left, so together they stay under the cap.
    """

    def __init__(self, cap, stored=0, shares=1):
        self.cap = cap
        self.room = max(0, cap - stored) // max(1, shares)
        # Said once: not again by a run that starts with the cap reached (an earlier run said it).
        self.announce = stored < cap
        self.storing = True
        self.dropped_lines = 0
        self.dropped_bytes = 0

    def take(self, batch):
        """The lines of the batch to store, in order, and the rest counted. Lines are (stream, at,
        text, rank). The first line that does not fit ends the storing for good (a log with holes
        in it would mislead): on that batch, the marker line is stored after the last kept one."""
        kept = 0
        while self.storing and kept < len(batch):
            size = line_bytes(batch[kept][2])
            if size > self.room:
                self.storing = False
                break
            self.room -= size
            kept += 1
        if kept == len(batch):
            return batch
        past = batch[kept:]
        self.dropped_lines += len(past)
        self.dropped_bytes += sum(line_bytes(line[2]) for line in past)
        if self.announce:
            self.announce = False
            return [*batch[:kept], self.marker(past[0][1])]
        return batch[:kept]

    def marker(self, at):
        text = f"[e31] the log reached its cap of {size_text(self.cap)}: further lines are counted, not stored; the job keeps running"
        return (MARKER_STREAM, at, text, None)

    def summary(self, at):
        """The run's last line, as a list: how much of its output was not stored ([] if nothing).
        Given once: a finish tried again does not repeat it."""
        if not self.dropped_lines:
            return []
        lines, size = self.dropped_lines, self.dropped_bytes
        self.dropped_lines = self.dropped_bytes = 0
        text = (
            f"[e31] {lines} line{'s' if lines != 1 else ''} ({size} bytes) past the log cap of "
            f"{size_text(self.cap)} {'were' if lines != 1 else 'was'} not stored"
        )
        return [(MARKER_STREAM, at, text, None)]
