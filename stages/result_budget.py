"""L5a result_budget: cap each tool result, and the results of one assistant turn (docs/layers.md).

Decided once: a result is judged the first time it appears in a request (the version of each of
its parts that starts there) and the decision applies from that call on, so the prefix that
later calls send never changes because of this layer. Re-runs decide the same thing (the
decision is a function of that first version and the params); the runner re-applies the
ledger's decisions byte-identically all the same, and a changed input is a `conflict`.

Lengths are in characters (code points): cuts never split a multi-byte character or a surrogate
pair, because polars slices strings by code point.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import polars as pl

from ctxreplay.pipeline.core.blockops import sha256_expr
from ctxreplay.pipeline.core.constants import BLOCK_KEY, PART_KEY, SPILL_PREFIX, SPILL_URI, THREAD
from ctxreplay.pipeline.core.constants import TRUNCATION_MARKER_RE as MARKER_RE
from ctxreplay.pipeline.stageapi.calls import materialize, visible_at
from ctxreplay.pipeline.stageapi.live import Live, LiveRows, LiveRule, LiveThread
from ctxreplay.pipeline.stageapi.marks import finish, mark_replace, start_marks
from ctxreplay.pipeline.stageapi.registry import Quiet, StageContext, StageResult, stage

MARKER_FIXED_CHARS = 20  # "\n…" + " chars truncated…\n"; plus the digits of the count
SPILL_WRAPPER_CHARS = 160  # upper bound of the <persisted-output …> wrapper around a preview


@dataclass(frozen=True, slots=True, kw_only=True)
class ResultBudget:
    max_result_chars: int = 50_000
    """Cap per tool result, in characters."""
    max_window_share: float = 0.3
    """The cap is at most this share of the window (window_tokens × 4 characters)."""
    head_ratio: float = 0.5
    """Share of the kept characters taken from the head; the rest from the tail."""
    snap_newline_within: float = 0.2
    """Snap each cut to a newline when one lies within this share of its budget."""
    aggregate_max_chars: int = 200_000
    """Cap for all results of one assistant turn that first appear together (0: no cap)."""
    spill: bool = False
    """Move over-cap results (not errors) to a content-addressed store; a preview stays."""
    spill_preview_chars: int = 2_000
    """Characters of a spilled result kept as its preview."""

    def validate(self) -> None:
        if self.max_result_chars <= 0 or self.spill_preview_chars < 0 or self.aggregate_max_chars < 0:
            raise ValueError("max_result_chars must be positive; spill_preview_chars and aggregate_max_chars >= 0")
        for name in ("max_window_share", "head_ratio", "snap_newline_within"):
            v = getattr(self, name)
            if not 0 <= v <= 1:
                raise ValueError(f"{name} must be between 0 and 1; got {v}")


def _digits(n: pl.Expr) -> pl.Expr:
    return n.cast(pl.String).str.len_chars().cast(pl.Int64)


def _snapped_head(text: pl.Expr, budget: pl.Expr, snap: float) -> pl.Expr:
    """The first `budget` characters, cut at the last newline when it lies within `snap` of the end."""
    head = text.str.slice(0, budget)
    before_nl = head.str.extract(r"(?s)^(.*)\n", 1)
    ok = before_nl.is_not_null() & (before_nl.str.len_chars().cast(pl.Int64) >= budget - (budget * snap).floor())
    return pl.when(budget <= 0).then(pl.lit("")).when(ok).then(before_nl).otherwise(head)


def _snapped_tail(text: pl.Expr, length: pl.Expr, budget: pl.Expr, snap: float) -> pl.Expr:
    """The last `budget` characters, cut after the first newline when it lies within `snap` of the start."""
    tail = text.str.slice(length - budget)
    first_line = tail.str.extract(r"^([^\n]*)\n", 1)
    q = first_line.str.len_chars().cast(pl.Int64)
    ok = first_line.is_not_null() & (q <= (budget * snap).floor())
    return pl.when(budget <= 0).then(pl.lit("")).when(ok).then(tail.str.slice(q + 1)).otherwise(tail)


def truncate_expr(text: pl.Expr, budget: pl.Expr, p: ResultBudget) -> pl.Expr:
    """Head + `\\n…<n> chars truncated…\\n` + tail, at most `budget` characters (never less than the marker)."""
    length = text.str.len_chars().cast(pl.Int64)
    kept = (budget - MARKER_FIXED_CHARS - _digits(length)).clip(lower_bound=0)
    hb = (kept * p.head_ratio).floor().cast(pl.Int64)
    tb = kept - hb
    head = _snapped_head(text, hb, p.snap_newline_within)
    tail = _snapped_tail(text, length, tb, p.snap_newline_within)
    removed = length - head.str.len_chars().cast(pl.Int64) - tail.str.len_chars().cast(pl.Int64)
    return pl.concat_str([head, pl.lit("\n…"), removed.cast(pl.String), pl.lit(" chars truncated…\n"), tail])


def spill_expr(text: pl.Expr, preview_budget: pl.Expr, p: ResultBudget) -> pl.Expr:
    """`<persisted-output ref="spill://sha256/<hex>" chars="<n>" sha256="<12 hex>">` + preview."""
    sha = sha256_expr(text)
    preview = _snapped_head(text, preview_budget, p.snap_newline_within)
    return pl.concat_str([
        pl.lit(f'{SPILL_PREFIX}"{SPILL_URI}'), sha, pl.lit('" chars="'),
        text.str.len_chars().cast(pl.String), pl.lit('" sha256="'), sha.str.slice(0, 12), pl.lit('">\n'),
        preview, pl.lit("\n</persisted-output>"),
    ])


def spilled_texts(blocks_before: pl.LazyFrame, decisions: pl.LazyFrame) -> pl.LazyFrame:
    """What the runner must write to the spill store: (sha256, ref, text) of every spilled block,
    read from the blocks this stage received (a stage itself does no I/O)."""
    spills = decisions.filter(pl.col("action") == "spill").select(*PART_KEY, "from_call")
    rows = blocks_before.join(spills, on=PART_KEY, how="inner").filter(visible_at("from_call"))
    sha = sha256_expr(pl.col("text"))
    return rows.select(sha256=sha, text="text").unique("sha256").with_columns(ref=pl.lit(SPILL_URI) + pl.col("sha256"))


def plan(blocks: pl.LazyFrame, params: ResultBudget, ctx: StageContext) -> StageResult:
    """The budget: per-result caps, then per-group caps, applied to each result's first version."""
    cap = max(1, min(params.max_result_chars, int(params.max_window_share * ctx.window_tokens * 4)))
    results = _results(blocks, params, cap)
    if params.aggregate_max_chars > 0:
        group = [*THREAD, "_asst", "_c0"]
        if params.spill:
            results = _aggregate_spill(results, params, group)
        results = _water_fill(results, params, group)
    todo = results.filter(pl.col("_reason").is_not_null()).select(*BLOCK_KEY, "_size", "_spill", "_budget", "_reason")
    return _apply(blocks, materialize(todo), params)


def _first_call_of_result() -> pl.Expr:
    return pl.col("first_call").min().over(BLOCK_KEY)


def _has_text() -> pl.Expr:
    return pl.col("text").is_not_null() & (pl.col("part_type").fill_null("text") != "image")


def _decided() -> pl.Expr:
    """Already truncated or spilled (a re-run, or a frozen decision re-applied)."""
    return pl.col("text").str.contains(MARKER_RE) | pl.col("text").str.starts_with(SPILL_PREFIX)


def _results(blocks: pl.LazyFrame, params: ResultBudget, cap: int) -> pl.LazyFrame:
    """One row per tool result: the size of the version of its parts that its first request holds,
    the assistant row it answers (`_asst`), and its own cap (`_reason`, `_budget`, `_spill`,
    `_after`: its size once decided)."""
    rows = blocks.filter(pl.col("block_type") == "tool_result").with_columns(_c0=_first_call_of_result()) \
        .filter(visible_at("_c0"))
    parts = rows.filter(_has_text()).select(
        *PART_KEY, "first_call", "_c0", "msg_key", "is_error", _len=pl.col("text").str.len_chars().cast(pl.Int64),
        _decided=_decided().fill_null(False),
    )
    # the assistant row each result answers: the latest assistant message before it
    msgs = blocks.group_by([*THREAD, "msg_key"]).agg(_order=pl.col("order_key").min(), _role=pl.col("role").first()) \
        .sort([*THREAD, "_order"]).with_columns(
            _asst=pl.when(pl.col("_role") == "assistant").then(pl.col("msg_key")).forward_fill().over(THREAD, order_by="_order"))
    results = parts.group_by(BLOCK_KEY).agg(
        _size=pl.col("_len").sum(), _c0=pl.col("_c0").first(), msg_key=pl.col("msg_key").first(),
        _err=pl.col("is_error").fill_null(False).any(), _decided=pl.col("_decided").any(),
    ).join(msgs.select(*THREAD, "msg_key", "_asst"), on=[*THREAD, "msg_key"], how="left")
    over = (pl.col("_size") > cap) & ~pl.col("_decided")
    spill_me = over & ~pl.col("_err") if params.spill else pl.lit(False)
    return results.with_columns(
        _spill=spill_me, _reason=pl.when(over).then(pl.lit("max_result_chars")),
        _budget=pl.when(over).then(pl.lit(cap, pl.Int64)),
    ).with_columns(
        _after=pl.when(pl.col("_spill")).then(pl.min_horizontal("_size", _spilled_size(params)))
        .when(over).then(pl.lit(cap, pl.Int64)).otherwise(pl.col("_size")),
    )


def _spilled_size(params: ResultBudget) -> pl.Expr:
    return pl.lit(params.spill_preview_chars + SPILL_WRAPPER_CHARS, pl.Int64)


def _aggregate_spill(results: pl.LazyFrame, params: ResultBudget, group: list[str]) -> pl.LazyFrame:
    """Spill the largest results of a group first, until the group fits `aggregate_max_chars`."""
    limit, spilled_size = params.aggregate_max_chars, _spilled_size(params)
    total = pl.col("_after").sum().over(group)
    cand = ~pl.col("_decided") & ~pl.col("_spill") & ~pl.col("_err") & (pl.col("_after") > spilled_size)
    saving = pl.when("_cand").then(pl.col("_after") - spilled_size).otherwise(0)
    return results.with_columns(_total=total, _cand=cand).with_columns(
        _rank=pl.when("_cand").then(pl.col("_after")).otherwise(None).rank("ordinal", descending=True).over(group),
    ).sort([*group, "_rank"]).with_columns(
        _saved=saving.cum_sum().over(group, order_by="_rank"),
    ).with_columns(
        # spill rank r when the results ranked before it did not yet bring the group under the cap
        _agg_spill=(pl.col("_total") > limit) & pl.col("_cand") & ((pl.col("_total") - pl.col("_saved") + saving) > limit),
    ).with_columns(
        _spill=pl.col("_spill") | pl.col("_agg_spill"),
        _reason=pl.when(pl.col("_agg_spill")).then(pl.lit("aggregate")).otherwise(pl.col("_reason")),
        _after=pl.when(pl.col("_agg_spill")).then(spilled_size).otherwise(pl.col("_after")),
    ).drop("_cand", "_rank", "_saved", "_agg_spill")


def _water_fill(results: pl.LazyFrame, params: ResultBudget, group: list[str]) -> pl.LazyFrame:
    """Cut the largest reducible results of a group to one level so that the group fits; one shared
    elision reserve per group (room for the markers)."""
    limit = params.aggregate_max_chars
    reducible = ~pl.col("_decided") & ~pl.col("_spill")
    fixed = pl.when(reducible).then(0).otherwise(pl.col("_after")).sum().over(group)
    m = reducible.cast(pl.Int64).sum().over(group)
    reserve = m * (MARKER_FIXED_CHARS + 12)
    ok = pl.col("_ok").fill_null(False)
    return results.with_columns(
        _total=pl.col("_after").sum().over(group), _room=pl.lit(limit, pl.Int64) - fixed - reserve, _m=m,
        _red=reducible, _x=pl.when(reducible).then(pl.col("_after")),
    ).sort([*group, "_x"], nulls_last=True).with_columns(
        _r=pl.when("_red").then(pl.col("_x").cum_count().over(group, order_by="_x")),
        _P=pl.when("_red").then(pl.col("_x").cum_sum().over(group, order_by="_x")),
    ).with_columns(
        _ok=pl.when("_red").then(pl.col("_P") + (pl.col("_m") - pl.col("_r")) * pl.col("_x") <= pl.col("_room")),
    ).with_columns(
        _j=ok.cast(pl.Int64).sum().over(group),
        _Pj=pl.when(ok).then(pl.col("_P")).otherwise(0).max().over(group),
    ).with_columns(
        _level=pl.when((pl.col("_total") > limit) & (pl.col("_m") > pl.col("_j")))
        .then(((pl.col("_room") - pl.col("_Pj")) // (pl.col("_m") - pl.col("_j"))).clip(lower_bound=0)),
    ).with_columns(
        _cut=pl.col("_red") & pl.col("_level").is_not_null() & (pl.col("_after") > pl.col("_level")),
    ).with_columns(
        _budget=pl.when("_cut").then(pl.col("_level")).otherwise(pl.col("_budget")),
        _reason=pl.when("_cut").then(pl.lit("aggregate")).otherwise(pl.col("_reason")),
    )


def _apply(blocks: pl.LazyFrame, todo: pl.LazyFrame, params: ResultBudget) -> StageResult:
    """Truncate or spill the first version of each decided result, its budget shared by its parts
    in proportion to their length."""
    w = start_marks(blocks.join(todo, on=BLOCK_KEY, how="left").with_columns(_c0=_first_call_of_result()))
    target = pl.col("_reason").is_not_null() & (pl.col("block_type") == "tool_result") & visible_at("_c0") \
        & _has_text() & ~_decided().fill_null(False)
    share = pl.col("text").str.len_chars().cast(pl.Int64) / pl.col("_size").cast(pl.Float64)
    part_budget = (pl.col("_budget").cast(pl.Float64) * share).floor().cast(pl.Int64)
    preview_budget = (pl.lit(float(params.spill_preview_chars)) * share).floor().cast(pl.Int64)
    text = pl.when(target).then(pl.col("text"))  # only targets are cut or hashed: the rest stay null here
    new_text = pl.when(pl.col("_spill")).then(spill_expr(text, preview_budget, params)) \
        .otherwise(truncate_expr(text, part_budget, params))
    w = mark_replace(w, target, {"text": new_text}, pl.col("_reason"),
                     action=pl.when(pl.col("_spill")).then(pl.lit("spill")).otherwise(pl.lit("truncate")))
    return finish(w)


def live_start(thread: LiveThread, params: ResultBudget, ctx: StageContext) -> None:
    return None


def live_step(carry: None, new: LiveRows, p: ResultBudget, ctx: StageContext) -> Live:
    """The live rule: quiet when every new tool result is within the cap and the results of each new
    turn within aggregate_max_chars (the characters this stage counts)."""
    cap = max(1, min(p.max_result_chars, int(p.max_window_share * ctx.window_tokens * 4)))
    groups: dict[Any, int] = {}
    sizes: dict[tuple[str, int], int] = {}
    frame = None
    for r in new.rows:
        if r["role"] == "assistant":
            frame = r["msg_key"]
        if r["block_type"] != "tool_result" or r["text"] is None or (r["part_type"] or "text") == "image":
            continue
        key = (r["msg_key"], r["block_pos"])
        sizes[key] = sizes.get(key, 0) + len(r["text"])
        if sizes[key] > cap:
            return Live.full_pass("a tool result over max_result_chars")
        groups[(frame, r["first_call"])] = groups.get((frame, r["first_call"]), 0) + len(r["text"])
    if p.aggregate_max_chars > 0 and any(v > p.aggregate_max_chars for v in groups.values()):
        return Live.full_pass("the results of one turn over aggregate_max_chars")
    return Live.quiet()


def quiet_check(blocks: pl.LazyFrame, params: ResultBudget, ctx: StageContext) -> pl.LazyFrame:
    """Nothing to do (ctxreplay.pipeline.stageapi.quiet): every tool result within the cap, and the
    results that first appear at one call within aggregate_max_chars, each counted with all its
    parts and versions (a result's first version, and one assistant turn's results, are within
    these). Then no result and no turn's results are over."""
    cap = max(1, min(params.max_result_chars, int(params.max_window_share * ctx.window_tokens * 4)))
    # the lengths are taken before the filter: filtering the text column copied every text kept (a
    # 200 MB tool result twice, issue 23 item 6)
    rows = blocks.select(*BLOCK_KEY, "first_call", _keep=(pl.col("block_type") == "tool_result") & _has_text(),
                         _len=pl.col("text").str.len_chars().cast(pl.Int64)).filter("_keep").select(
        *BLOCK_KEY, _c0=pl.col("first_call").min().over(BLOCK_KEY), _len="_len")
    ok = pl.col("_len").sum().over(BLOCK_KEY) <= cap
    if params.aggregate_max_chars > 0:
        ok = ok & (pl.col("_len").sum().over([*THREAD, "_c0"]) <= params.aggregate_max_chars)
    return rows.select(_q=ok.fill_null(False).all())


@stage("result_budget", version=1, params=ResultBudget, requires=("pairing",), frozen=("truncate", "spill"),
       spilled_texts=spilled_texts, live=LiveRule(live_start, live_step), quiet=Quiet(quiet_check))
def result_budget(blocks: pl.LazyFrame, params: ResultBudget, ledger: pl.LazyFrame, ctx: StageContext) -> StageResult:
    """Cap tool results: head and tail around `…<n> chars truncated…`, or spill to the store.

    Per result: over the cap (`min(max_result_chars, max_window_share × window × 4)` characters)
    it is cut to head + tail (snapped to newlines, never inside a character) or, with `spill`,
    replaced by a `<persisted-output …>` preview (errors are never spilled). Per assistant turn:
    while its results exceed `aggregate_max_chars`, the largest are spilled or cut to one shared
    level. Decided at the result's first appearance and recorded as `truncate` / `spill`
    (reason `max_result_chars` or `aggregate`); the runner re-applies the ledger's decisions first
    (frozen), and a result already cut is never cut again.
    """
    return plan(blocks, params, ctx)
