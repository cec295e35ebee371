"""Worker functions for tests/test_signals_workers.py's pool tests (a spawned worker imports them by name)."""

from __future__ import annotations

import gc
import os
import struct
from multiprocessing.queues import SimpleQueue


def die_mid_result() -> None:
    """A worker that dies while writing its result: the header of a 1 MiB message and 10 bytes of
    it into the pool's result pipe, then gone (as a worker killed mid-write)."""
    q = next(o for o in gc.get_objects() if isinstance(o, SimpleQueue))
    fd = q._writer.fileno()  # type: ignore[attr-defined]
    os.write(fd, struct.pack("!i", 1 << 20) + b"x" * 10)
    os._exit(1)
