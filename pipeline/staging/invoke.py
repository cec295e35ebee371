"""Running one stage and checking what it returns: the blocks and decisions it gave, against the
declared schemas, with no duplicate decision; any exception it raises becomes a StageFailed that
names the stage, its owner and where its traceback was written. Used by the stage runner
(pipeline/staging/stagerun.py) in-process and by plug-in isolation (pipeline/staging/isolation.py)
in a worker process."""

from __future__ import annotations

from typing import Any

import polars as pl

from ctxreplay.errors import StageFailed, write_traceback
from ctxreplay.pipeline.core.constants import POLARS_ENGINE
from ctxreplay.pipeline.stageapi.registry import RegisteredStage, StageContext, StageResult
from ctxreplay.schemas.blocks import BLOCKS
from ctxreplay.schemas.check import SchemaMismatch, check_frame
from ctxreplay.schemas.decisions import DECISION_KEY, STAGE_DECISION


def check_result(res: object, name: str, position: int, module: str) -> tuple[pl.DataFrame, pl.DataFrame]:
    """The blocks and decisions a stage returned, collected and checked (StageFailed otherwise)."""
    if not (isinstance(getattr(res, "blocks", None), pl.LazyFrame | pl.DataFrame)
            and isinstance(getattr(res, "decisions", None), pl.LazyFrame | pl.DataFrame)):
        msg = (f"stage '{name}' (#{position}, from {module}) returned {type(res).__name__}, not a "
               f"StageResult(blocks, decisions) of polars frames; fix the stage")
        raise StageFailed(name, position, msg, kind="result", message=msg)
    assert isinstance(res, StageResult) or hasattr(res, "blocks")
    try:
        check_frame(res.blocks, BLOCKS, where=f"after stage '{name}' (#{position})")  # type: ignore[attr-defined]
        check_frame(res.decisions, STAGE_DECISION, where=f"decisions of stage '{name}' (#{position})")  # type: ignore[attr-defined]
    except SchemaMismatch as exc:
        raise StageFailed(name, position, exc, kind="schema", message=str(exc)) from exc
    blocks = res.blocks.lazy().collect(engine=POLARS_ENGINE)  # type: ignore[attr-defined]
    decisions = res.decisions.lazy().collect(engine=POLARS_ENGINE)  # type: ignore[attr-defined]
    dupes = decisions.group_by(DECISION_KEY).len().filter(pl.col("len") > 1) if decisions.height else decisions
    if dupes.height:
        msg = (f"stage '{name}' made {dupes.height} duplicate decisions for the same block and call (first: "
               f"{dupes.row(0, named=True)}); this is a bug in the stage")
        raise StageFailed(name, position, msg, kind="duplicates", message=msg)
    return blocks, decisions


def invoke_inline(stage: RegisteredStage, blocks: pl.DataFrame, params: Any, view: pl.DataFrame,
                  ctx: StageContext, name: str, position: int) -> tuple[pl.DataFrame, pl.DataFrame]:
    """Run a stage in this process; any exception becomes a StageFailed."""
    try:
        res = stage.fn(blocks.lazy(), params, view.lazy(), ctx)
        return check_result(res, name, position, stage.module)
    except StageFailed:
        raise
    except Exception as exc:
        raise stage_raised(stage, name, position, exc) from exc


def stage_raised(stage: RegisteredStage, name: str, position: int, exc: BaseException) -> StageFailed:
    path = write_traceback(exc)
    first = (str(exc).strip().splitlines() or [""])[0][:300]
    kept = f"the traceback was written to {path}" if path else "no traceback file could be written"
    whose = "this is a bug in ctxreplay; please report it" if stage.is_builtin else \
        f"it is not a built-in stage: report it to the authors of {stage.owner}, or leave it out of the spec"
    msg = (f"stage '{name}' (#{position}, from {stage.module}) failed with {type(exc).__name__}: {first}. "
           f"Nothing was written; {whose} ({kept})")
    return StageFailed(name, position, exc, kind="raised", message=msg)
