"""auto_compact: a simulated auto-compaction at a token threshold (docs/layers.md).

What an agent such as Claude Code does near the end of its window, replayed offline: when a
call's request would pass `threshold_tokens`, the conversation before the current step is replaced
by a summary. The summary a model would write cannot be replayed, so a placeholder of the
configured size (`summary_tokens`, by the run's token counter) stands for it, marked as simulated
in its text and its decision; the cache simulator prices the summarisation request itself (the
history it reads plus `summary_tokens` of output, pipeline/cost/cachesim.py). Compactions the
transcript recorded stay as recorded.

Per thread, a forward walk over the calls (inside `map_batches`; O((calls + rows) log rows): a
Fenwick tree over the droppable rows visible at the call, by order) finds the firings; the drops
are joined to the rows columnar (`join_asof` on the frontier), the summaries inserted with the
marks API. Each firing takes a new cache epoch.
"""

from __future__ import annotations

import functools
import re
from bisect import bisect_left
from dataclasses import dataclass
from typing import Any

import polars as pl

from ctxreplay.pipeline.core.blockops import block_schema, null_columns, synthetic_id_expr
from ctxreplay.pipeline.core.constants import (
    AUTO_COMPACT_FILLER,
    AUTO_COMPACT_RE,
    AUTO_COMPACT_TEXT,
    BLOCK_KEY,
    MESSAGE_OVERHEAD_TOKENS,
    NO_CALL,
    POLARS_ENGINE,
    THREAD,
)
from ctxreplay.pipeline.core.fenwick import Fenwick
from ctxreplay.pipeline.stageapi.calls import (
    call_grid,
    firing_epoch,
    forward_by_call,
    materialize,
    messages,
    open_max,
    request_tokens,
    row_tokens_expr,
    text_tokens,
    walk_parts,
)
from ctxreplay.pipeline.stageapi.marks import Insert, finish, mark_drop, start_marks
from ctxreplay.pipeline.stageapi.registry import StageContext, StageResult, stage
from ctxreplay.schemas.blocks import CONTENT_COLUMNS

ORIGIN = "auto_compact"
SUMMARY_HEADER = AUTO_COMPACT_TEXT
SUMMARY_RE = re.compile(AUTO_COMPACT_RE)
FILLER = AUTO_COMPACT_FILLER


@dataclass(frozen=True, slots=True, kw_only=True)
class AutoCompact:
    threshold_tokens: int = 160_000
    """Compact when the estimated request (after this stage's earlier compactions) exceeds this many tokens."""
    summary_tokens: int = 20_000
    """Size of the summary that replaces the history (a placeholder of that many tokens)."""
    keep_recent_turns: int = 0
    """Whole recent turns kept as they are besides the current step (0: only the latest assistant message and what follows it)."""

    def validate(self) -> None:
        if self.threshold_tokens <= 0:
            raise ValueError(f"threshold_tokens must be positive; got {self.threshold_tokens}")
        if self.summary_tokens < 0 or self.keep_recent_turns < 0:
            raise ValueError("summary_tokens and keep_recent_turns must not be negative")
        if self.summary_tokens >= self.threshold_tokens:
            raise ValueError(f"summary_tokens ({self.summary_tokens}) must be below threshold_tokens "
                             f"({self.threshold_tokens}), or every request would compact again")


def parse_summary(text: str | None) -> tuple[int, int, int] | None:
    """(tokens dropped, summary tokens, request tokens at the firing) from a summary's text."""
    m = SUMMARY_RE.match(text or "")
    if m is None:
        return None
    dropped, summary, request = (int(x.replace(",", "")) for x in m.groups())
    return dropped, summary, request


# ---------------------------------------------------------------------------------------------
# the walk


@functools.cache
def _firing_schema() -> dict[str, Any]:
    return {"session_id": pl.String, "thread_id": pl.String, "call": pl.Int32, "frontier": pl.Int64,
            "dropped": pl.Int64, "request": pl.Int64, "epoch": pl.Int32}


def _scan(df: pl.DataFrame, p: AutoCompact, summary_cost: int) -> pl.DataFrame:
    """Per thread: the calls (`call` rows: tokens, keep = order of the first kept row, ep, s_end =
    when an earlier summary leaves) and the droppable rows (`row` rows: order, first, last, tok)
    -> one row per firing (call, frontier, tokens dropped, request tokens, epoch)."""
    out: dict[str, list[Any]] = {k: [] for k in _firing_schema()}
    rows_by = walk_parts(df, "row", ["order"], {"last": NO_CALL})
    for (sid, tid), calls in walk_parts(df, "call", ["call"], {"tokens": 0, "ep": 0, "anchor_end": NO_CALL}).items():
        rows = rows_by.get((sid, tid))
        if rows is None or calls.height == 0 or rows.height == 0:
            continue
        order = rows["order"].to_list()
        first = rows["first"].to_list()
        last = rows["last"].to_list()
        tok = rows["tok"].to_list()
        fen = Fenwick(len(order))
        appear = sorted((first[i], i) for i in range(len(order)))
        leave = sorted((last[i], i) for i in range(len(order)) if last[i] < NO_CALL)
        ai = li = 0
        f_idx = 0                        # rows[:f_idx] are below the frontier (dropped)
        frontier = None
        last_epoch = 0
        summary_end = -1                 # the call from which the summary in force is gone
        ks, toks = calls["call"].to_list(), calls["tokens"].to_list()
        keep, ep = calls["keep"].to_list(), calls["ep"].to_list()
        anchor_end = calls["anchor_end"].to_list()
        for j, k in enumerate(ks):
            while ai < len(appear) and appear[ai][0] <= k:
                fen.add(appear[ai][1], tok[appear[ai][1]])
                ai += 1
            while li < len(leave) and leave[li][0] <= k:
                fen.add(leave[li][1], -tok[leave[li][1]])
                li += 1
            removed = fen.prefix(f_idx)
            est = toks[j] - removed + (summary_cost if k < summary_end else 0)
            if est <= p.threshold_tokens or keep[j] is None or (frontier is not None and keep[j] <= frontier):
                continue
            k_idx = bisect_left(order, keep[j])
            dropped = fen.prefix(k_idx) - removed
            if dropped <= 0:
                continue
            epoch = firing_epoch(k, ep, last_epoch)
            for key, v in zip(_firing_schema(), (sid, tid, k, keep[j], dropped, est, epoch)):
                out[key].append(v)
            frontier, f_idx, last_epoch = keep[j], k_idx, epoch
            summary_end = anchor_end[j]
    return pl.DataFrame(out, schema=_firing_schema())


# ---------------------------------------------------------------------------------------------
# the stage


COMPACTION_AGENT = "agent-acompact-"   # the loaders' name for a recorded compaction request's thread


def _droppable(blocks: pl.LazyFrame) -> pl.Expr:
    return (pl.col("role") != "system") & (pl.col("origin") != ORIGIN)


def _compacts(thread_id: pl.Expr) -> pl.Expr:
    """A thread this stage may compact: not a recorded compaction agent's (that request is the
    summarisation itself, and stays as recorded)."""
    return ~thread_id.str.starts_with(COMPACTION_AGENT)


def _per_call(blocks: pl.LazyFrame, msgs: pl.LazyFrame, params: AutoCompact, ctx: StageContext) -> pl.LazyFrame:
    """Per call: request tokens, the order where the kept part starts (the latest assistant message;
    with keep_recent_turns the start of that many turns, if earlier), the block end of the row
    there (a summary lasts no longer than what follows it) and the highest cache epoch so far."""
    grid = materialize(call_grid(blocks))
    tokens = request_tokens(blocks, ctx, grid, msgs)
    at_call = [*THREAD, pl.col("first").alias("call")]
    asst = msgs.filter((pl.col("role") == "assistant") & (pl.col("origin") != ORIGIN)).group_by(at_call).agg(
        a_order=pl.col("order").max())
    real = msgs.filter("is_real_user").group_by(at_call).agg(cur_turn=pl.col("turn").max())
    ep = blocks.group_by([*THREAD, pl.col("first_call").alias("call")]).agg(ep=pl.col("cache_epoch").max())
    per = forward_by_call(asst.join(real, on=[*THREAD, "call"], how="full", coalesce=True), grid,
                          ["a_order", "cur_turn"]).sort([*THREAD, "call"]).with_columns(
        pl.col("a_order").cum_max().over(THREAD, order_by="call"),
        pl.col("cur_turn").cum_max().over(THREAD, order_by="call"))
    if params.keep_recent_turns > 0:
        starts = msgs.filter("is_real_user").group_by([*THREAD, "turn"]).agg(t_order=pl.col("order").min())
        per = per.with_columns(_t=(pl.col("cur_turn") - params.keep_recent_turns + 1).cast(pl.Int32)).join(
            starts.with_columns(pl.col("turn").cast(pl.Int32)), left_on=[*THREAD, "_t"], right_on=[*THREAD, "turn"],
            how="left").with_columns(keep=pl.min_horizontal("a_order", "t_order"))
    else:
        per = per.with_columns(keep=pl.col("a_order"))
    # where the summary of a firing at this call would end: when the block it is placed before goes
    ends = blocks.group_by([*THREAD, "order_key"]).agg(anchor_end=open_max("last_call"))
    per = per.join(ends, left_on=[*THREAD, "keep"], right_on=[*THREAD, "order_key"], how="left")
    per = per.join(ep, on=[*THREAD, "call"], how="left").join(tokens, on=[*THREAD, "call"], how="left") \
        .sort([*THREAD, "call"]).with_columns(pl.col("ep").fill_null(0).cum_max().over(THREAD, order_by="call"))
    return per.filter(_compacts(pl.col("thread_id"))).select(
        *THREAD, kind=pl.lit("call"), call="call", tokens="tokens", keep="keep", ep="ep", anchor_end="anchor_end")


def _rows(blocks: pl.LazyFrame, msgs: pl.LazyFrame, ctx: StageContext) -> pl.LazyFrame:
    """What dropping each row frees: its tokens, and one message overhead per message."""
    tok = blocks.filter(_droppable(blocks)).select(
        *THREAD, order="order_key", first="first_call", last="last_call", tok=row_tokens_expr(ctx))
    over = msgs.filter((pl.col("role") != "system") & (pl.col("origin") != ORIGIN)).select(
        *THREAD, "order", "first", "last", tok=pl.lit(MESSAGE_OVERHEAD_TOKENS, pl.Int64))
    return pl.concat([tok, over.select(tok.collect_schema().names())]).with_columns(kind=pl.lit("row"))


def _summary_text(dropped: int, summary: int, request: int, ctx: StageContext) -> str:
    """The placeholder: the header, then filler words up to `summary` tokens by the run's counter
    (exactly, where the counter allows it)."""
    header = SUMMARY_HEADER.format(dropped=dropped, summary=summary, request=request)

    def count(t: str) -> int:
        return text_tokens([t], ctx)[0]

    per100 = max(count(FILLER * 100), 1)
    n = max(0, (summary - count(header)) * 100 // per100)
    text = header + "\n" + (FILLER * n).strip()
    while n > 0 and count(text) > summary:      # the counter may merge the joint
        n -= 1
        text = header + "\n" + (FILLER * n).strip()
    for pad in (" x", "x"):                     # then the last tokens, one short step at a time
        for _ in range(64):
            if count(text) >= summary or count(text + pad) > summary:
                break
            text += pad
    return text


def _summary_row() -> dict[str, pl.Expr]:
    """A user text block placed just before the anchor row, from the firing's call (`_s_call`) to
    `_s_end`, with the text `_s_text` and the firing's epoch."""
    keep = (*THREAD, "source_format", "source_file", "source_line", "entry_order", "timestamp", "is_sidechain")
    content = {c: pl.lit(None) for c in CONTENT_COLUMNS}
    content.update(block_type=pl.lit("text"), text=pl.col("_s_text"))
    values: dict[str, pl.Expr] = {
        **null_columns(c for c in block_schema().names() if c not in keep and c not in CONTENT_COLUMNS),
        **content,
        "raw_line": pl.lit(""),
        "order_key": pl.col("order_key") - 3,
        "entry_id": pl.col("_s_id"),
        "msg_key": pl.col("_s_id"),
        "role": pl.lit("user"),
        "is_call": pl.lit(False),
        "first_call": pl.col("_s_call"),
        "last_call": pl.col("_s_end"),
        "block_pos": pl.lit(0),
        "part_pos": pl.lit(0),
        "is_meta": pl.lit(False),
        "is_compact_summary": pl.lit(False),
        "is_display_only": pl.lit(False),
        "content_sha256": pl.lit(""),    # finish hashes inserted rows
        "origin": pl.lit(ORIGIN),
        "cache_epoch": pl.col("_s_epoch"),
    }
    return {c: v.cast(block_schema()[c]) for c, v in values.items()}


def plan(blocks: pl.LazyFrame, params: AutoCompact, ctx: StageContext) -> StageResult:
    blocks = materialize(blocks)
    msgs = materialize(messages(blocks))
    cost = params.summary_tokens + MESSAGE_OVERHEAD_TOKENS
    scan_in = pl.concat([_per_call(blocks, msgs, params, ctx), _rows(blocks, msgs, ctx)], how="diagonal_relaxed")
    firings = scan_in.map_batches(lambda df: _scan(df, params, cost), schema=_firing_schema()).collect(engine=POLARS_ENGINE)
    if firings.height == 0:
        return finish(start_marks(blocks))
    texts = [_summary_text(d, params.summary_tokens, r, ctx)
             for d, r in zip(firings["dropped"].to_list(), firings["request"].to_list(), strict=True)]
    f = firings.with_columns(_s_text=pl.Series(texts, dtype=pl.String)).sort([*THREAD, "call"]).with_columns(
        _next=pl.col("call").shift(-1).over(THREAD, order_by="call")).lazy()
    # drops: each droppable row goes at the first firing whose frontier passes it, from that call on
    # (or from its first call when it appears later), unless it is gone by then
    rows = blocks.filter(_droppable(blocks)).select(*BLOCK_KEY, "part_pos", "first_call", "last_call",
                                                    _o="order_key").sort("_o")
    hit = rows.join_asof(f.select(*THREAD, _f="frontier", _k="call", _e="epoch").sort("_f"),
                         left_on="_o", right_on="_f", by=THREAD, strategy="forward", allow_exact_matches=False,
                         check_sortedness=False) \
        .filter(pl.col("_k").is_not_null() & (pl.col("last_call").is_null() | (pl.col("_k") < pl.col("last_call")))) \
        .select(*BLOCK_KEY, "part_pos", "first_call", _d_call=pl.max_horizontal("_k", "first_call").cast(pl.Int32),
                _d_epoch="_e")
    # the summary goes before the first row of the kept part (the version visible at the firing)
    anchors = blocks.join(f.select(*THREAD, "frontier", "call"), left_on=[*THREAD, "order_key"],
                          right_on=[*THREAD, "frontier"]).filter(
        (pl.col("first_call") <= pl.col("call")) & (pl.col("last_call").is_null() | (pl.col("last_call") > pl.col("call"))))
    anchors = anchors.group_by([*THREAD, "call"]).agg(
        pl.col(c).sort_by("msg_key", "block_pos", "part_pos").first() for c in ("entry_id", "block_pos", "part_pos",
                                                                                "first_call"))
    anchors = anchors.join(f.select(*THREAD, "call", "epoch", "_s_text", "_next"), on=[*THREAD, "call"]).join(
        blocks.group_by([*THREAD, "order_key"]).agg(_end=open_max("last_call")).join(
            f.select(*THREAD, "frontier", "call"), left_on=[*THREAD, "order_key"], right_on=[*THREAD, "frontier"]
        ).select(*THREAD, "call", "_end"), on=[*THREAD, "call"], how="left")
    anchors = anchors.select(
        *THREAD, "entry_id", "block_pos", "part_pos", "first_call", _s_call="call", _s_epoch="epoch", _s_text="_s_text",
        _s_end=pl.min_horizontal(pl.col("_next"), pl.col("_end")).cast(pl.Int32),
        _s_occ=pl.col("call").cast(pl.Int64))
    w = blocks.join(hit, on=[*BLOCK_KEY, "part_pos", "first_call"], how="left") \
        .join(anchors, on=[*BLOCK_KEY, "part_pos", "first_call"], how="left") \
        .with_columns(_s_id=synthetic_id_expr(ORIGIN, "summary", pl.col("thread_id"), pl.col("_s_occ")))
    w = start_marks(w)
    w = mark_drop(w, pl.col("_d_call").is_not_null(), "threshold", from_call=pl.col("_d_call"), action="compact",
                  epoch=pl.col("_d_epoch"))
    return finish(w, [Insert(when=pl.col("_s_call").is_not_null(), values=_summary_row(), reason="simulated_summary")])


@stage("auto_compact", version=1, params=AutoCompact, requires=("pairing",))
def auto_compact(blocks: pl.LazyFrame, params: AutoCompact, ledger: pl.LazyFrame, ctx: StageContext) -> StageResult:
    """Simulated auto-compaction: past `threshold_tokens`, the history becomes a summary placeholder.

    When a call's estimated request (after this stage's earlier compactions) exceeds
    `threshold_tokens`, every message before the current step (the latest assistant message, or
    `keep_recent_turns` whole turns) but the system prompt is dropped from that call on (decision
    `compact`, reason `threshold`) and one user message stands for it: `[Simulated auto-compaction:
    ...]` followed by filler up to `summary_tokens` tokens (decision `insert`, reason
    `simulated_summary`). The next compaction replaces that summary too. Nothing is written by a
    model: the text says it is simulated, and the cache simulator prices the summarisation request
    (the history it reads, `summary_tokens` of output). Each firing takes a new cache epoch.
    Compactions the transcript recorded stay as they are, and so does the thread of a recorded
    compaction agent (`agent-acompact-*`: its request is the summarisation itself).
    """
    return plan(blocks, params, ctx)
