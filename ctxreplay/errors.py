"""Exceptions that carry facts; cli.py maps them to exit codes.

Every error a user can see derives from `CtxReplayError` (exit 2, one paragraph on stderr). An
exception that is not one is a bug: `internal_error` writes its traceback to a file and gives the
one paragraph that names that file.
"""

from __future__ import annotations

import datetime as _dt
import os
import tempfile
import traceback
from pathlib import Path


class CtxReplayError(Exception):
    """Base class: the run could not be done (exit 2)."""

    exit_code = 2

    def __init__(self, *args: object) -> None:
        super().__init__(*args)
        # polars' in-memory engine raises an exception from inside a plan (the ledger opened by the
        # token cache, a token file missing) as a new one of its class, its message followed by
        # "This error occurred in the following expression: ..." (the plan's expressions): what
        # the user reads is our paragraph alone
        said = str(args[0]) if len(args) == 1 else None
        self._said = said.split(_POLARS_CONTEXT, 1)[0] if said is not None else None

    def __str__(self) -> str:
        said = getattr(self, "_said", None)
        return said if said is not None else super().__str__()


_POLARS_CONTEXT = "\n\nThis error occurred in the following expression:"


class SpecError(CtxReplayError):
    """The pipeline spec is invalid."""


class InputError(CtxReplayError):
    """An input path cannot be read or is not a transcript."""


class NothingToDo(InputError):
    """The inputs hold no transcript line at all (an empty directory, only skipped files)."""


class LedgerError(CtxReplayError):
    """The ledger cannot be opened or conflicts with this run."""


class OutputError(CtxReplayError):
    """The output directory cannot be written (a file in its place, no permission, disk full)."""


class LockError(CtxReplayError):
    """Another ctxreplay run holds the output directory or the ledger."""


class StageFailed(CtxReplayError):
    """A stage failed at a position of the pipeline: it raised, returned something other than a
    StageResult of frames in the declared schemas, or ran past its time budget.

    Facts: `stage` (its name in the run, e.g. `pairing#2`), `position` (1-based), `cause` (the
    exception, or a short text), `kind` (`raised`, `result`, `schema`, `duplicates`, `timeout`,
    `worker`). A built-in stage's failure stops the run (a bug in ctxreplay); a plug-in's is
    quarantined by the runner (pipeline/staging/stagerun.py).
    """

    def __init__(self, stage: str, position: int, cause: BaseException | str, *, kind: str = "raised",
                 message: str | None = None) -> None:
        self.stage, self.position, self.cause, self.kind = stage, position, cause, kind
        if message is None:
            what = f"{type(cause).__name__}: {_first_line(cause)}" if isinstance(cause, BaseException) else cause
            message = f"stage '{stage}' (#{position}) failed: {what}"
        self.message = message
        super().__init__(message)

    def __str__(self) -> str:
        return self.message


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0][:300]


class CheckFailed(CtxReplayError):
    """A count or invariant check failed: a bug in ctxreplay, never bad input."""


def write_traceback(exc: BaseException) -> Path | None:
    """Write `exc`'s traceback to a new file in the temp directory; None when even that fails."""
    stamp = _dt.datetime.now(_dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    try:
        fd, name = tempfile.mkstemp(prefix=f"ctxreplay-traceback-{stamp}-{os.getpid()}-", suffix=".txt")
        with os.fdopen(fd, "w", encoding="utf-8", errors="backslashreplace") as f:
            f.write("".join(traceback.format_exception(exc)))
        return Path(name)
    except OSError:
        return None


def internal_error(exc: BaseException, where: str = "") -> CheckFailed:
    """A one-paragraph CheckFailed for an exception that is a bug, its traceback kept in a file."""
    path = write_traceback(exc)
    first = _first_line(exc)
    kept = f"the traceback was written to {path}" if path else "the traceback could not be written to a file"
    place = f" {where}" if where else ""
    err = CheckFailed(f"internal error{place} ({type(exc).__name__}: {first}): this is a bug in ctxreplay; {kept}. "
                      f"Please report it with that file")
    err.traceback_file = path  # type: ignore[attr-defined]
    return err
