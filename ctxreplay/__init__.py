"""ctxreplay: replay, call by call, what an AI agent sent to its model, from transcripts on disk.

This module is the stable API for plug-in stages and for the engine; everything else under
`ctxreplay.pipeline` may change between releases. A plug-in stage needs:

- `stage`, `StageContext`, `StageResult`, `StageRef`: declare a stage and read its context;
- `Quiet`: the stage's optional quick check (`@stage(quiet=...)`), blocks on which it decides
  nothing, proved by one small query so that a pass skips its plan (docs/writing-a-stage.md);
- `LiveRule`, `Live`, `LiveThread`, `LiveRows`: the stage's optional live rule (`@stage(live=...)`),
  what it decides at the new calls of a live session without a pass (docs/writing-a-stage.md);
- `marks` (and its functions re-exported here: `start_marks`, `mark_drop`, `mark_replace`,
  `mark_replace_from`, `finish`, `text_row`, `Insert`, `alive`, `cover_end`,
  `next_message_first_call`, `conflicted`): edit blocks so that every replaced row is recorded in the ledger;
- the errors (`CtxReplayError` and the others of `ctxreplay.errors`);
- `ctxreplay.testkit` for its tests (`make_blocks`, `run_stage`, `check_golden`, ...).

The live engine is `Engine` (docs/engine.md). Names are imported on first use, so that
`import ctxreplay` stays cheap (the `report` command never loads polars).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from ctxreplay.version import __version__ as __version__

# In the repository (or an unpacked sdist) pipeline/, stages/, schemas/ and data/ stand beside this
# folder, not in it; an installed wheel has them inside. Reading them from beside it lets a checkout
# run without an install (tests, `python -m ctxreplay`); installed, this does nothing.
_HERE = Path(__file__).resolve().parent
if not (_HERE / "pipeline").is_dir() and (_HERE.parent / "pipeline" / "__init__.py").is_file():
    __path__.append(str(_HERE.parent))

# public name -> the module that defines it
_HOME = {
    **dict.fromkeys(["CtxReplayError", "InputError", "LedgerError", "LockError", "NothingToDo", "OutputError",
                     "SpecError", "StageFailed"], "ctxreplay.errors"),
    **dict.fromkeys(["Insert", "alive", "conflicted", "cover_end", "finish", "mark_drop", "mark_replace", "mark_replace_from",
                     "next_message_first_call", "start_marks", "text_row"], "ctxreplay.pipeline.stageapi.marks"),
    **dict.fromkeys(["Quiet", "StageContext", "StageRef", "StageResult", "stage"], "ctxreplay.pipeline.stageapi.registry"),
    **dict.fromkeys(["Live", "LiveRows", "LiveRule", "LiveThread"], "ctxreplay.pipeline.stageapi.live"),
    "Engine": "ctxreplay.pipeline.engine.engine",
}
_MODULES = {"marks": "ctxreplay.pipeline.stageapi.marks", "testkit": "ctxreplay.testkit",
            "errors": "ctxreplay.errors"}

__all__ = [
    "CtxReplayError", "Engine", "InputError", "Insert", "LedgerError", "Live", "LiveRows", "LiveRule", "LiveThread",
    "LockError", "NothingToDo", "OutputError", "Quiet",
    "SpecError", "StageContext", "StageFailed", "StageRef", "StageResult", "__version__", "alive", "conflicted",
    "cover_end", "errors", "finish", "mark_drop", "mark_replace", "mark_replace_from", "marks", "next_message_first_call",
    "stage", "start_marks", "testkit", "text_row",
]


def __getattr__(name: str) -> Any:
    if name in _HOME:
        value = getattr(importlib.import_module(_HOME[name]), name)
    elif name in _MODULES:
        value = importlib.import_module(_MODULES[name])
    else:
        raise AttributeError(f"module 'ctxreplay' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return list(__all__)
