"""A stage's quick "nothing to do" check: one small query over the blocks, before the stage's plan.

A pipeline pass pays a fixed cost per stage whatever the input's size: a stage's plan is dozens of
joins, windows and marks, and polars plans and runs each of them even on a session of ten calls
(~50 ms a stage, ~0.4 s a pass). Most passes decide little: a short session trips no token
trigger, holds no image, no inter-session row, no oversized result. A stage that can prove from a
few aggregates that its plan would decide nothing declares it (`@stage(quiet=Quiet(check))`,
ctxreplay.pipeline.stageapi.registry.Quiet); the runner asks the check first and, where it holds,
takes the blocks as the plan would have left them (sorted, unchanged) and no decision, at the cost
of one small query. The checks of consecutive positions are asked in one query (`ask`): a quiet
position leaves the rows as they were, so the next position's check reads the same rows.

The check must be conservative: `quiet` only where the stage's plan decides nothing and changes no
row (tests/test_stage_quiet.py runs each stage's check against its plan on both sides of every
threshold). A stage with earlier decisions in its ledger view (re-applied, or in conflict) always
runs its plan.
"""

from __future__ import annotations

import functools
from typing import Any

import polars as pl

from ctxreplay.pipeline.core.blockops import empty_decisions, sort_blocks
from ctxreplay.pipeline.core.constants import (
    CHARS4_COUNTER,
    POLARS_ENGINE,
    THREAD,
)
from ctxreplay.pipeline.core.tokens import (
    IMAGE_MAX_TOKENS,
    fast_token_estimate,
    is_image_expr,
    per_token_text,
    row_tokens_expr,
)
from ctxreplay.pipeline.stageapi.calls import open_max, request_rows, signed_deltas
from ctxreplay.pipeline.stageapi.registry import Quiet, StageContext, StageResult


def plans(blocks: pl.LazyFrame, checks: list[pl.Expr | pl.LazyFrame]) -> pl.LazyFrame:
    """One plan of one row that answers every check (column `_q<i>` for check i): the aggregates
    in one select over the blocks, each plan of its own reduced to whether all its values hold."""
    exprs = {f"_q{i}": c.fill_null(False).all() for i, c in enumerate(checks) if isinstance(c, pl.Expr)}
    parts = [blocks.select(**exprs)] if exprs else []
    for i, c in enumerate(checks):
        if isinstance(c, pl.LazyFrame):  # its first column (no schema resolved to name it)
            parts.append(c.select(pl.first().fill_null(False).all().alias(f"_q{i}")))
    return pl.concat(parts, how="horizontal").select([f"_q{i}" for i in range(len(checks))])


def ask(blocks: pl.LazyFrame, checks: list[pl.Expr | pl.LazyFrame]) -> list[bool]:
    """Each check's answer over the blocks, in one query."""
    if not checks:
        return []
    return [bool(v) for v in plans(blocks, checks).collect(engine=POLARS_ENGINE).row(0)]


def stage_check(q: Quiet, blocks: pl.LazyFrame, params: Any, ctx: StageContext) -> pl.Expr | pl.LazyFrame:
    """The stage's check over these blocks."""
    return q.check(blocks, params, ctx)


def quiet_blocks(q: Quiet, blocks: pl.LazyFrame, params: Any, ctx: StageContext) -> pl.LazyFrame:
    """What the stage returns where its check holds."""
    return sort_blocks(blocks) if q.blocks is None else q.blocks(blocks, params, ctx)


def quiet(blocks: pl.LazyFrame, ledger: pl.LazyFrame, check: pl.Expr | pl.LazyFrame) -> bool:
    """True when the stage's ledger view is empty and `check` holds (one query for both)."""
    own = plans(blocks, [check])
    q = pl.concat([ledger.select(_q0=pl.len() == 0), own])
    return bool(q.select(pl.col("_q0").all()).collect(engine=POLARS_ENGINE).item())


def unchanged(blocks: pl.LazyFrame) -> StageResult:
    """What a stage's plan returns when it decides nothing: the blocks in the block order of
    `finish` (ctxreplay.pipeline.stageapi.marks), no decision."""
    return StageResult(sort_blocks(blocks), empty_decisions())


def row_tokens_bound(ctx: StageContext) -> pl.Expr:
    """At least the tokens `row_tokens_expr(ctx.count_tokens)` gives a row: chars/4 exactly for the
    fast counter, without asking it; any other counter (tiktoken) is asked, exact: it counts each
    distinct text once per run (a batch's texts are counted before its stages, for the recorded
    facts; the engine's at the pass or step that brought them), so the check looks them up."""
    if ctx.count_tokens is not None and ctx.token_counter_version != CHARS4_COUNTER:
        return row_tokens_expr(ctx.count_tokens)
    return _fast_row_tokens_bound()


@functools.cache
def _fast_row_tokens_bound() -> pl.Expr:
    per_text = per_token_text(lambda t: fast_token_estimate(t.str.len_chars().fill_null(0)))
    return pl.when(is_image_expr()).then(pl.lit(IMAGE_MAX_TOKENS, pl.Int64)).otherwise(per_text).cast(pl.Int64)


def request_tokens_max(blocks: pl.LazyFrame, ctx: StageContext) -> pl.LazyFrame:
    """Per thread (its THREAD columns and `tokens`): at least the estimated tokens of its largest
    request (ctxreplay.pipeline.stageapi.calls.request_tokens, each row's tokens bounded by
    `row_tokens_bound`). Each row and each message counts from its first call to its last, as a
    request counts them, and the largest running sum over the calls is taken: rows that a
    compaction took away do not count at the calls after it (a bound summing every row of the
    thread held no compacted session within a token trigger)."""
    spans = blocks.group_by([*THREAD, "msg_key"]).agg(  # messages()' spans alone (no turns, no sort)
        first=pl.col("first_call").min(), last=open_max("last_call"))
    deltas = signed_deltas(request_rows(blocks, ctx, spans, tokens=row_tokens_bound(ctx)), "_t")
    # the running sum over a thread's deltas in call order, a call's decreases before its increases:
    # within a call it falls from the last call's sum, then rises to this call's, so its largest
    # value is the largest request (one group_by, no per-call sum first)
    return deltas.group_by(THREAD).agg(tokens=pl.col("_d").sort_by(["call", "_d"]).cum_sum().max())


