"""Exceptions that carry facts; cli.py maps them to exit codes."""

from __future__ import annotations


class CtxReplayError(Exception):
    """Base class: the run could not be done (exit 2)."""

    exit_code = 2


class SpecError(CtxReplayError):
    """The pipeline spec is invalid."""


class InputError(CtxReplayError):
    """An input path cannot be read or is not a transcript."""


class LedgerError(CtxReplayError):
    """The ledger cannot be opened or conflicts with this run."""


class CheckFailed(CtxReplayError):
    """A count or invariant check failed: a bug in ctxreplay, never bad input."""
