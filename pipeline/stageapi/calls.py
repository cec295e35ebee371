"""Per-call helpers that the stages of layers 4 to 6 share.

Time in the blocks table: call k's request = the versions with first_call <= k < last_call (null
last_call = open). These helpers build per-call quantities (the fast token estimate, request
tokens, messages and turns, carried-forward values) columnar from first_call / last_call deltas.
(The runner re-applies frozen ledger decisions: pipeline/staging/stagerun.py.)
"""

from __future__ import annotations

from typing import Any

import polars as pl

from ctxreplay.pipeline.core import tokens

# re-exported for the stages that import them from here (ctxreplay.pipeline.core.constants is their home)
from ctxreplay.pipeline.core.constants import (  # noqa: F401
    BLOCK_KEY,
    MESSAGE_OVERHEAD_TOKENS,
    NO_CALL,
    PART_KEY,
    POLARS_ENGINE,
    SERVER_TOOL_CALL_TYPES,
    THINKING_TYPES,
    THREAD,
    TOOL_CALL_TYPES,
    VERSION_KEY,
    chars4_tokens,
)
from ctxreplay.pipeline.stageapi.registry import StageContext


def visible_at(call: pl.Expr | str) -> pl.Expr:
    """The version is in the request of `call` (first_call <= call < last_call, null = open)."""
    c = pl.col(call) if isinstance(call, str) else call
    return (pl.col("first_call") <= c) & (pl.col("last_call").is_null() | (pl.col("last_call") > c))


def open_max(col: str) -> pl.Expr:
    """max(col) in an aggregation where null means open (+infinity): null when any value is null."""
    return pl.when(pl.col(col).is_null().any()).then(None).otherwise(pl.col(col).max())


def materialize(lf: pl.LazyFrame) -> pl.LazyFrame:
    """Run a plan once and continue from its result.

    These stages use the blocks several times (joins, per-call aggregates, versioned
    replacement); left lazy, every use would re-run the whole upstream plan, and the plan grows
    with each nested use. Materialising at a few points keeps a stage's cost linear in its input.
    """
    return lf.collect(engine=POLARS_ENGINE).lazy()


def walk_parts(df: pl.DataFrame, kind: str, order: list[str], fill: dict[str, Any] | None = None,
               ) -> dict[tuple[str, str], pl.DataFrame]:
    """The rows of one `kind` of a sequential walk's input (one frame of several kinds: a stage's
    calls, results, rows...), per thread (THREAD values -> its rows), each thread's sorted by
    `order`, with the nulls of `fill`'s columns filled: one filter, sort and split for the batch. A
    frame operation costs polars 0.1-0.2 ms however small the frame; done per thread, a dozen of
    them were most of tombstone's walk on the 190 MB tree's batches of about 17 threads."""
    part = df.filter(pl.col("kind") == kind)
    if fill:
        part = part.with_columns(pl.col(c).fill_null(v) for c, v in fill.items())
    return part.sort(*THREAD, *order).partition_by(THREAD, as_dict=True)  # type: ignore[return-value]


# ---------------------------------------------------------------------------------------------
# tokens


def row_tokens_expr(ctx: StageContext) -> pl.Expr:
    """Estimated tokens of one block, the estimate the replay uses too (ctxreplay.pipeline.core.tokens)."""
    return tokens.row_tokens_expr(ctx.count_tokens)


def text_tokens(texts: list[str], ctx: StageContext) -> list[int]:
    """Tokens of a few literal texts (placeholders, markers) with the same counter."""
    if ctx.count_tokens is None:
        return [chars4_tokens(len(t)) for t in texts]
    return [int(x) for x in ctx.count_tokens(pl.Series(texts, dtype=pl.String)).to_list()]


def firing_epoch(k: int, ep: list[int], last_epoch: int) -> int:
    """The cache epoch of a firing at call k: k + 1, or more when an earlier call already holds a
    higher epoch, and above this stage's previous firing.

    Tying the epoch to the call keeps epochs ordered like the calls across layers: snip cannot see
    the epochs tombstone will use later, yet each prefix break at call k must carry an epoch above
    every epoch of call k-1, whichever layer made it.
    """
    before = int(ep[k - 1]) if k > 0 else 0
    return max(k + 1, before + 1, last_epoch + 1)


# ---------------------------------------------------------------------------------------------
# messages, turns and per-call series


def messages(blocks: pl.LazyFrame) -> pl.LazyFrame:
    """One row per message: order, visible span, role, flags, turn index.

    A turn starts at a user message that carries no tool result (docs/layers.md); rows before
    the first such message are turn 0. Snip markers never start a turn.
    """
    m = blocks.group_by([*THREAD, "msg_key"]).agg(
        order=pl.col("order_key").min(),
        first=pl.col("first_call").min(),
        last=open_max("last_call"),
        role=pl.col("role").first(),
        origin=pl.col("origin").first(),
        is_compact_summary=pl.col("is_compact_summary").any(),
        has_result=(pl.col("block_type") == "tool_result").any(),
        timestamp=pl.col("timestamp").sort_by("order_key").first(),
    )
    m = m.with_columns(
        is_real_user=(pl.col("role") == "user") & ~pl.col("has_result") & (pl.col("origin") != "snip"),
    )
    return m.sort([*THREAD, "order", "msg_key"]).with_columns(
        turn=pl.col("is_real_user").cast(pl.Int32).cum_sum().over(THREAD, order_by=["order", "msg_key"]),
    )


def call_grid(blocks: pl.LazyFrame) -> pl.LazyFrame:
    """Calls 0..n of every thread (n = the pending call = the largest first_call)."""
    return (
        blocks.group_by(THREAD)
        .agg(call=pl.int_ranges(0, pl.col("first_call").max().cast(pl.Int32) + 1, dtype=pl.Int32).first())
        .explode("call")
    )


def signed_deltas(rows: pl.LazyFrame, value: str, *, first: str = "first_call", last: str = "last_call",
                  ) -> pl.LazyFrame:
    """Each row's change of the sum of `value` over the visible rows: +v at `first`, -v at `last`
    (THREAD, `call`, `_d`), not yet summed per call."""
    plus = rows.select(*THREAD, call=pl.col(first).cast(pl.Int32), _d=pl.col(value).cast(pl.Int64))
    minus = rows.filter(pl.col(last).is_not_null()).select(
        *THREAD, call=pl.col(last).cast(pl.Int32), _d=-pl.col(value).cast(pl.Int64))
    return pl.concat([plus, minus])


def call_deltas(rows: pl.LazyFrame, value: str, *, first: str = "first_call", last: str = "last_call") -> pl.LazyFrame:
    """Per thread and call, the change of the sum of `value` over the visible rows (signed_deltas
    summed per call), as `_d`: cumulated over the calls, the sum at each call (per_call_sum)."""
    return signed_deltas(rows, value, first=first, last=last).group_by([*THREAD, "call"]).agg(_d=pl.col("_d").sum())


def per_call_sum(rows: pl.LazyFrame, value: str, grid: pl.LazyFrame, *, first: str = "first_call",
                 last: str = "last_call") -> pl.LazyFrame:
    """Sum of `value` over the rows visible at each call (+v at `first`, -v at `last`, cumulated)."""
    deltas = call_deltas(rows, value, first=first, last=last)
    return (
        grid.join(deltas, on=[*THREAD, "call"], how="left")
        .sort([*THREAD, "call"])
        .with_columns(pl.col("_d").fill_null(0).cum_sum().over(THREAD, order_by="call").alias(value))
        .drop("_d")
    )


def request_tokens(blocks: pl.LazyFrame, ctx: StageContext, grid: pl.LazyFrame | None = None,
                   msgs: pl.LazyFrame | None = None) -> pl.LazyFrame:
    """Estimated request tokens per call: blocks visible at the call plus a per-message overhead."""
    grid = call_grid(blocks) if grid is None else grid
    msgs = messages(blocks) if msgs is None else msgs
    return per_call_sum(request_rows(blocks, ctx, msgs), "_t", grid).rename({"_t": "tokens"})


def request_rows(blocks: pl.LazyFrame, ctx: StageContext, msgs: pl.LazyFrame, tokens: pl.Expr | None = None,
                 ) -> pl.LazyFrame:
    """What a request counts: each row's tokens (`tokens`, default `row_tokens_expr(ctx)`) and each
    message's overhead (`msgs`: per message its thread, `first` and `last` call), with their
    visible span (THREAD, first_call, last_call, `_t`)."""
    rows = blocks.select(*THREAD, "first_call", "last_call", _t=row_tokens_expr(ctx) if tokens is None else tokens)
    over = msgs.select(*THREAD, first_call="first", last_call="last", _t=pl.lit(MESSAGE_OVERHEAD_TOKENS, pl.Int64))
    return pl.concat([rows, over])


def forward_by_call(events: pl.LazyFrame, grid: pl.LazyFrame, cols: list[str]) -> pl.LazyFrame:
    """Join per-call events (at most one row per thread and call) to the grid and carry the last
    value forward over the calls of each thread."""
    return (
        grid.join(events, on=[*THREAD, "call"], how="left")
        .sort([*THREAD, "call"])
        .with_columns([pl.col(c).forward_fill().over(THREAD, order_by="call") for c in cols])
    )
