"""A third-party-like stage for the plug-in isolation tests (tests/test_plugins.py).

`shout` upper-cases user text (an effect the tests can see) and misbehaves as its params say: it
raises, returns a frame off the schema, returns a tuple, or sleeps, for the sessions whose id
starts with `only_for` (every session when empty). It is importable by module and name, so the
runner runs it in a worker process.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal

import polars as pl

from ctxreplay.pipeline.stageapi.marks import finish, mark_replace, start_marks
from ctxreplay.pipeline.stageapi.registry import StageContext, StageResult, stage


@dataclass(frozen=True, slots=True, kw_only=True)
class Shout:
    mode: Literal["ok", "raise", "schema", "tuple", "sleep"] = "ok"
    """How to misbehave."""
    only_for: str = ""
    """Misbehave only when a session id starts with this (empty: always)."""
    sleep_seconds: float = 0.0
    """How long `sleep` sleeps."""


@stage("shout", version=1, params=Shout, requires=("sanitize",))
def shout(blocks: pl.LazyFrame, params: Shout, ledger: pl.LazyFrame, ctx: StageContext) -> StageResult:
    """Upper-case the text of user rows (a test plug-in that can be told to fail)."""
    sessions = blocks.select("session_id").unique().collect().get_column("session_id").to_list()
    hit = params.mode != "ok" and any(s.startswith(params.only_for) for s in sessions)
    if hit and params.mode == "raise":
        raise RuntimeError(f"shout cannot handle session {min(sessions)[:8]}")
    if hit and params.mode == "sleep":
        time.sleep(params.sleep_seconds)
    w = start_marks(blocks)
    w = mark_replace(w, (pl.col("role") == "user") & (pl.col("block_type") == "text"),
                     {"text": pl.col("text").str.to_uppercase()}, "shout")
    res = finish(w)
    if hit and params.mode == "schema":
        return StageResult(res.blocks.with_columns(loud=pl.lit(True)), res.decisions)
    if hit and params.mode == "tuple":
        return (res.blocks, res.decisions)  # type: ignore[return-value]
    return res
