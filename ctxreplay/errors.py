"""Every error ctxreplay lets a user see, in one place, under one root: `CtxReplayError`.

The CLI (`ctxreplay.pipeline.commands.cli`, `_Main.invoke`) maps them to exit codes in one place:
an error's `exit_code` (2, "could not run", unless the class says otherwise) and its message as one
paragraph on stderr, `ctxreplay: <message>`. The engine (`ctxreplay.Engine`) raises them as they
are. An exception that is not one is a bug: `internal_error` writes its traceback to a file and
gives the one paragraph that names that file (the CLI and the engine both do this).

Hierarchy (this module is part of the stable plug-in API; the names do not change):

    CtxReplayError                  exit 2: the run could not be done
    ├── SpecError                   the pipeline spec is invalid
    ├── InputError                  an input path cannot be read or is not a transcript
    │   └── NothingToDo             the inputs hold no transcript line at all
    ├── LedgerError                 the ledger cannot be opened or conflicts with this run
    ├── OutputError                 the output directory cannot be written
    ├── LockError                   another run or engine holds the output directory or ledger
    ├── StageFailed                 a stage raised, returned a bad result or ran out of time
    ├── CheckFailed                 a count or invariant check failed (a bug: see internal_error)
    ├── ArgumentError               a command's arguments cannot be used as given
    ├── Interrupted                 exit 130: Ctrl-C
    ├── UnknownStage                no stage of that name (a KeyError too)
    ├── StageRegistrationError      a stage cannot be registered
    │   └── StageNameTaken          its name belongs to another package
    ├── UnknownTarget               no target (wire shape) of that name
    ├── TargetError                 a target's shape breaks the request contract
    ├── SchemaMismatch              a frame does not match its declared schema
    ├── StoreError                  a run's request store cannot rebuild a request
    ├── UnknownRef                  a thread or session the run does not hold
    ├── AmbiguousRef                a prefix that matches more than one thread or session
    ├── SourceChanged               a transcript on disk is not the one the run read
    ├── GoldenError                 golden files missing, of another format, or not writable
    ├── CompareError                `compare` cannot run with these arguments
    ├── PriceError                  a prices file cannot be used
    ├── SimError                    the cache simulator (or its calibration) cannot run on these inputs
    └── RayEngineError              Ray is missing, unreachable, or failed during the run

Internal control-flow exceptions that never reach a user stay private where they are raised and
caught, and are not part of this hierarchy: `WorkerBug` (ctxreplay.pipeline.batch.rayengine: a
worker's bug carried back as a traceback), `_Remote` (ctxreplay.pipeline.staging.isolation: a stand-in that carries a plug-in's
traceback text out of its process into a file), `NotToml` (ctxreplay.pipeline.staging.spec_init: a
value with no TOML form, shown as its repr instead), `NotARegularFile` (ctxreplay.pipeline.loaders.inputs:
an OSError for a listed input that turned out a FIFO, a device or a directory; the run lists the file
under skipped_files and goes on) and `_Unexpected` (ctxreplay.pipeline.batch.rgcopy: a previous
output's Parquet footer it does not expect; the batch is then encoded again instead of copied).
"""

from __future__ import annotations

import datetime as _dt
import difflib
import os
import tempfile
import traceback
from collections.abc import Iterable
from pathlib import Path


def did_you_mean(value: str, names: Iterable[str]) -> str:
    """` Did you mean 'x'?` when one of `names` is close to `value`, else '' (every "unknown NAME"
    error says it the same way)."""
    close = difflib.get_close_matches(value, list(names), n=1)
    return f" Did you mean '{close[0]}'?" if close else ""

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


class ArgumentError(CtxReplayError):
    """A command's arguments cannot be used as given: a flag without the one it needs, an unknown
    choice (`unknown preset 'defualt'. Did you mean 'default'? ...`), no PATHS and no default
    transcript directory."""


class Interrupted(CtxReplayError):
    """The user interrupted the command (Ctrl-C): exit 130."""

    exit_code = 130


# ------------------------------------------------------------------------------ stages and targets


class UnknownStage(CtxReplayError, KeyError):
    """No stage of that name is registered (a KeyError too, for callers that look names up).

    `plugin`: (package, message) of the plug-in that provides a stage of that name but failed to
    load, when one did."""

    def __init__(self, name: str, known: list[str], plugin: tuple[str, str] | None = None) -> None:
        self.name, self.known = name, known
        hint = did_you_mean(name, known)
        plugins = f" (the plug-in {plugin[0]} that provides it failed to load: {plugin[1]})" if plugin else ""
        self.message = (f"Unknown stage '{name}'.{hint}{plugins} Known stages: "
                        f"{', '.join(sorted(known)) or 'none'}")
        super().__init__(self.message)

    def __str__(self) -> str:
        return self.message


class StageRegistrationError(CtxReplayError):
    """A stage cannot be registered (bad params class, or a name that belongs to another package)."""


class StageNameTaken(StageRegistrationError):
    """A package registers a stage name that another package holds.

    `held_by` and `wanted_by` are the modules; `held_owner` and `wanted_owner` describe them in
    words (distribution, version, module); `built_in`: the holder is a built-in stage."""

    def __init__(self, name: str, held_by: str, wanted_by: str, *, held_owner: str, wanted_owner: str,
                 built_in: bool) -> None:
        self.name, self.held_by, self.wanted_by = name, held_by, wanted_by
        whose = "a built-in stage of ctxreplay; built-in names belong to the core" if built_in else \
            "registered by another plug-in"
        super().__init__(f"stage name '{name}' is taken: {held_owner} holds it ({whose}), so "
                         f"{wanted_owner} cannot register it. Give the plug-in's stage another "
                         f"name, e.g. '{wanted_by.split('.')[0]}_{name}'")


class UnknownTarget(CtxReplayError):
    """No target (wire shape) of that name is registered."""


class TargetError(CtxReplayError):
    """A target's shape breaks the request contract ctxreplay relies on (a plug-in target: its
    envelope's keys, its stand-in messages)."""


class SchemaMismatch(CtxReplayError):
    """A frame does not match its declared schema (exit 2: a stage or a writer broke the contract)."""

    def __init__(self, *, where: str, name: str, missing: list[str], extra: list[str],
                 wrong: list[tuple[str, str, str]]) -> None:
        self.where, self.name, self.missing, self.extra, self.wrong = where, name, missing, extra, wrong
        parts = [f"{where}: frame does not match schema '{name}'"]
        if missing:
            parts.append(f"missing columns: {missing}")
        if extra:
            parts.append(f"unexpected columns: {extra}")
        for col, exp, got in wrong:
            parts.append(f"wrong type: {col}: expected {exp}, got {got}")
        super().__init__(" / ".join(parts))


# ------------------------------------------------------------------------------ a run's outputs


class StoreError(CtxReplayError):
    """A run's request store cannot give the request asked for (no such thread or call, a store that is
    missing or does not hold it)."""


class UnknownRef(CtxReplayError):
    """A thread or session that the run does not hold."""


class AmbiguousRef(CtxReplayError):
    """A prefix that matches more than one thread or session; `candidates` lists them."""

    def __init__(self, message: str, candidates: list[str]) -> None:
        self.candidates = candidates
        super().__init__(message)


class SourceChanged(CtxReplayError):
    """The transcript on disk is not the one the run read."""


class GoldenError(CtxReplayError):
    """The golden directory is missing, of another format or target, or cannot be written (exit 2)."""


# ------------------------------------------------------------------------------ cost and execution


class CompareError(CtxReplayError):
    """compare cannot run with these arguments."""


class PriceError(CtxReplayError):
    """The overrides file cannot be used."""


class SimError(CtxReplayError):
    """The simulator (or its calibration) cannot run on these inputs or with these arguments."""


class RayEngineError(CtxReplayError):
    """Ray is not installed, the cluster cannot be reached, or it failed during the run."""


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
