"""Per-thread read buffers for hashing and copying large files without fresh objects."""

import mmap
import threading

from core.storage import CHUNK

BUFFER_SIZE = CHUNK  # each worker's buffer: filled from the network (hashed piece by piece, while hot), then written at once

_buffers = threading.local()


def read_buffer():
    """This thread's buffer: bytes are read into it, hashed and written from it, never copied
    into fresh objects (on a small machine that costs as much as hashing them). Page-aligned
    (anonymous mmap), so it can be written with O_DIRECT."""
    buffer = getattr(_buffers, "buffer", None)
    if buffer is None or len(buffer) != BUFFER_SIZE:
        buffer = _buffers.buffer = memoryview(mmap.mmap(-1, BUFFER_SIZE))
    return buffer
