"""A worker process's first steps, before any heavy import (issue 23, item 8).

A spawned worker unpickles what it is given, and unpickling the pipeline's state imports polars,
DuckDB and the stages: seconds on a busy machine. Were the worker to learn only after that that it
must die with its parent, a parent killed meanwhile (SIGKILL, the OOM killer) would leave it running
for as long as those imports take. So the pool's initializer lives here, in a module of the standard
library only: it ignores Ctrl-C (the parent handles it for the whole process group), binds the
worker's life to its parent's, and only then unpickles its state and hands it to the named function
of the batch module (`pipeline/batch/workers.py`, imported by name so that this module stays light).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import pickle
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1

# Threads of a stopped worker pool that could not end (pipeline/batch/workers.py `_stop`): a worker
# killed while it was writing a result leaves its message cut in the result pipe, whose write end
# the parent holds too, so the pool's thread waits for the rest of it for good, and Python's exit
# would join it. The command line's entry point (ctxreplay/entry.py) then ends the process itself
# once the command is done.
STUCK: list[threading.Thread] = []


def die_with_parent(parent: int) -> None:
    """A worker exits when the process that started it dies (killed with SIGKILL, or by the OOM
    killer: it can clean nothing up). On Linux the kernel kills it (prctl PR_SET_PDEATHSIG; the
    workers are spawned from the parent's main thread, which lives as long as the parent); elsewhere
    a thread checks once a second whether its parent changed. Either way a parent already gone by
    now is noticed at once."""
    done = False
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            done = libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    if os.getppid() != parent:
        os._exit(1)
    if not done:
        def watch() -> None:
            while os.getppid() == parent:
                time.sleep(1.0)
            os._exit(1)

        threading.Thread(target=watch, name="ctxreplay-parent-watch", daemon=True).start()


STATE_FILE = ".worker-state.pickle"


def write_state(staging: os.PathLike[str] | str, data: bytes) -> str:
    """The workers' state written to a file of the run's staging directory (removed by the parent
    once the pool is done; a staging directory a killed run left is removed by the next run)."""
    path = os.path.join(os.fspath(staging), STATE_FILE)
    with open(path, "wb") as fh:
        fh.write(data)
    return path


def boot(init: str, state: bytes | str, parent: int | None = None) -> None:
    """The pool's initializer (`state`: the pickled state, or the path of the file holding it): Ctrl-C ignored (also one pending since the spawn: the parent held it
    back while spawning), the worker bound to its parent, then `init` ("module:function") called with
    the unpickled state."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    if parent is not None:
        die_with_parent(parent)
    if isinstance(state, str):  # the path of a file that holds it (write_state)
        with open(state, "rb") as fh:
            state = fh.read()
    module, _, name = init.partition(":")
    getattr(importlib.import_module(module), name)(pickle.loads(state))
