"""Named points in a run where the crash-safety and concurrency tests stop or hold the process.

Inert unless one of these environment variables is set (the tests set them on a subprocess):

- `CTXREPLAY_CRASH_AT=<point>:<n>` — SIGKILL this process at the n-th (1-based) hit of `point`;
  `CTXREPLAY_CRASH_AT=<phase>@<seconds>` — SIGKILL it that many seconds after `phase` begins,
  wherever the run is then (for phases whose inner loops live in other modules: load, replay).
- `CTXREPLAY_CRASH_LOG=<file>` — where the kill appends the phase and point it happened in.
- `CTXREPLAY_CRASH_TRACE=<file>` — append every phase start and point hit, with times (the tests
  use one uninterrupted run's trace to draw crash points from every phase).
- `CTXREPLAY_HOLD_AT=<point>:<n>` with `CTXREPLAY_HOLD_FILE=<file>` — at that hit, create
  `<file>.reached` and wait (at most 120 s) until `<file>.go` exists.

Phases: lock, load, stages, replay, write, ledger, publish. Points: `stage` (before and after each
stage), `write` (after each output file), `ledger` (between the statements of the commit),
`publish` (between the steps of publishing).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import Counter
from pathlib import Path

_hits: Counter[str] = Counter()
_phase = "start"
_last_point = ""
_t0 = time.monotonic()


def _env(name: str) -> str:
    return os.environ.get(name, "")


def _log(var: str, line: str) -> None:
    path = _env(var)
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(line + "\n")
            f.flush()


def _die(why: str) -> None:
    _log("CTXREPLAY_CRASH_LOG", f"{_phase}\t{_last_point}\t{why}")
    os.kill(os.getpid(), signal.SIGKILL)


def begin() -> None:
    """A run starts: hits count from zero again (several runs in one process)."""
    global _phase, _last_point, _t0
    _hits.clear()
    _phase, _last_point, _t0 = "start", "", time.monotonic()


def phase(name: str) -> None:
    """The run enters phase `name`."""
    global _phase
    _phase = name
    _log("CTXREPLAY_CRASH_TRACE", f"phase\t{name}\t{time.monotonic() - _t0:.4f}")
    at = _env("CTXREPLAY_CRASH_AT")
    if "@" in at and at.split("@", 1)[0] == name:
        delay = float(at.split("@", 1)[1])
        timer = threading.Timer(delay, _die, args=(at,))
        timer.daemon = True
        timer.start()


def point(name: str) -> None:
    """A named point of the run: counted, and where a crash or a hold may be asked for."""
    global _last_point
    _hits[name] += 1
    here = f"{name}:{_hits[name]}"
    _last_point = here
    _log("CTXREPLAY_CRASH_TRACE", f"point\t{here}\t{time.monotonic() - _t0:.4f}")
    if _env("CTXREPLAY_CRASH_AT") == here:
        _die(here)
    if _env("CTXREPLAY_HOLD_AT") == here and _env("CTXREPLAY_HOLD_FILE"):
        hold = Path(_env("CTXREPLAY_HOLD_FILE"))
        Path(f"{hold}.reached").write_text(str(os.getpid()))
        deadline = time.monotonic() + 120
        while not Path(f"{hold}.go").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
