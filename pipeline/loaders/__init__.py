"""Find transcript files, detect each file's format, load them into one blocks table.

`load_paths(paths)` walks files and directories (recursively), detects the format of every file
(Claude Code, OpenClaw / pi, Codex rollout, Gemini CLI session in either of its formats, single
Anthropic / OpenAI chat request JSON), loads
Claude Code files session by session (a session's subagent files link into its main file), and
returns the blocks table plus the accounting of every file and every line.

Hostile input never stops a batch: a file that cannot be read is skipped with the reason, a line
that cannot be understood is quarantined with a specific reason code, and a session found in
several files (a backup copy) is read once: the fullest file is replayed and the lines of the
others that it already holds are counted as `duplicate_entry` other lines (a copy that differs
is kept apart as session `<id>~<hash>` and reported).

`default_roots()` (loaders/roots.py) gives the directories read when a command has no PATHS.
Importing this package is light: `load_paths`, `LoadResult`, `discover` and the rest of
loaders/load.py (pyarrow, the format loaders) are imported on first use, so that `ctxreplay
report` finds transcripts here without loading polars, pyarrow or DuckDB.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ctxreplay.pipeline.loaders.roots import ROOTS_TEXT, default_roots

if TYPE_CHECKING:
    from ctxreplay.pipeline.loaders.load import (
        FILE_LOADERS,
        LoadResult,
        discover,
        is_transcript_name,
        load_paths,
    )

__all__ = ["FILE_LOADERS", "ROOTS_TEXT", "LoadResult", "default_roots", "discover", "is_transcript_name", "load_paths"]


def __getattr__(name: str) -> Any:
    """A name of loaders/load.py, imported on first use (then kept in this module)."""
    if name.startswith("__"):
        raise AttributeError(name)
    value = getattr(importlib.import_module("ctxreplay.pipeline.loaders.load"), name)
    globals()[name] = value
    return value
