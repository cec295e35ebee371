"""The `ctxreplay` command's entry point (the console script and `python -m ctxreplay`).

Ctrl-C at start-up (issue 23, item 8) exits quietly: before anything else is imported, SIGINT
gets a handler that prints one line and exits 130. Importing click, polars and our modules takes a
good part of a second on a busy machine, and the default handler would show the KeyboardInterrupt
traceback of whatever import it fell in. This module imports only the standard library, and
`ctxreplay/__init__.py` stays as light, so the window left is Python's own start-up (where SIGINT
still has its system default and a Ctrl-C ends the process as killed by SIGINT, which a shell
shows as 130 too).

While a command runs the CLI replaces this handler by its own (Ctrl-C raises KeyboardInterrupt
there, so that the command cleans up: workers stopped, staging removed, ledger rolled back, then
130 with one paragraph) and puts it back when the command ends.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

INTERRUPTED = b"ctxreplay: interrupted\n"
TERMINATED = b"ctxreplay: terminated (SIGTERM)\n"

# where a stopped worker pool notes the threads of its own that could not end (`STUCK`): a module of
# the standard library only, looked up, not imported (a command that ran no pool never loaded it)
POOL_NOTES = "ctxreplay.pipeline.batch.workerboot"


def exit_at_once(signum: int) -> None:
    """End the process now for SIGINT (130) or SIGTERM (143) with one line, never a traceback.
    os._exit, not SystemExit: a signal handler may run inside a `__del__` or a weakref callback
    (importlib's module-lock callback among them), where an exception would be printed as
    `Exception ignored` with its traceback and then swallowed, the command going on."""
    try:  # what a command printed before is not lost (a reentrant flush fails: then it is)
        sys.stdout.flush()
    except BaseException:  # noqa: BLE001, S110 - nothing may escape a handler that is exiting the process
        pass
    term = signum == signal.SIGTERM
    try:
        os.write(2, TERMINATED if term else INTERRUPTED)
    except OSError:
        pass
    os._exit(143 if term else 130)


def quiet_sigint(signum: int, frame: Any) -> None:
    """SIGINT outside a command (imports, parsing the command line, exiting): nothing of ours is
    half-written there, so exit at once with 130 and one line."""
    exit_at_once(signum)


def install() -> bool:
    """SIGINT quiet, where it has Python's default handler (a shell's background job inherits it
    ignored, and an embedding program may have its own: both are kept). Whether it was put."""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, quiet_sigint)
        return True
    return False


def main() -> None:
    """Quiet Ctrl-C first, then the real command line (pipeline/commands/cli.py). Once the command
    has returned, Ctrl-C is ignored: the command is done (its outputs published, its exit status
    set) and Python only tears down. Python puts the default handler back for that, so a Ctrl-C
    then killed the process by SIGINT after a finished run (3 of 20 SIGINT trials of
    bench/bench_signals.py); an ignored signal is left ignored, and the command's status stands."""
    ours = install()
    from ctxreplay.deferred import defer

    defer("polars")  # imported at its first use: a re-run that reuses every output never needs it
    from ctxreplay.pipeline.commands.cli import main as cli_main

    status = 0
    try:
        cli_main()
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
        raise
    finally:
        if ours:  # (a handler someone else set is theirs to keep)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        notes = sys.modules.get(POOL_NOTES)
        if notes is not None and any(t.is_alive() for t in getattr(notes, "STUCK", ())):
            # the command is done (what it printed is flushed); Python's exit would join those threads
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except BaseException:  # noqa: BLE001, S110 - exiting either way
                    pass
            os._exit(status)
