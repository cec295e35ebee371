"""L4 pairing: every tool call answered right after it, exactly once (layer-semantics §6).

Per thread, vectorised over all threads of a batch:

1. Calls (`tool_use` blocks of assistant rows) are numbered per id **occurrence**: the same id used
   again later is a new pair. A result is matched to the latest earlier call occurrence with its id.
2. Results that match no call (no id, or an id no earlier call carries) are re-attached when exactly
   one unresolved call of their frame (the latest tool-call assistant row before them) can own them:
   names agree (an unrecorded name agrees with any; `unknown` with none), for a result without an
   id the frame has a single call, and the call has no result of its own (by id) visible where the
   orphan first is; such a result also gets `is_error = true` (no id). Otherwise it is dropped as
   `orphan`: a result never answers a call that has its own result.
3. Duplicates: a call's own result (by id) always wins; of several, the first by position is kept,
   later ones are dropped as `duplicate`. A re-attached result seen before the call's own result
   stands in for it only until then (dropped from the call that sees the own result, reason
   `superseded`, like a synthetic one); another re-attached result of the same call is an `orphan`.
   A result whose call leaves the request (compaction) is dropped from then on.
4. Failed frames (assistant `stop_reason` error/aborted with tool calls), `failed_frame_policy`:
   `drop` drops the assistant row and its results (`failed_frame`); `keep_with_synthetic` treats
   them like any frame; `preserve` keeps them and never synthesises their missing results.
5. Missing results: a synthetic `tool_result` row (`origin = "pairing"`, `is_error = true`, text per
   target) is visible from the first call that sees the assistant row until the call that first
   sees the real result (which replaces it from there on: the synthetic row is closed with a `drop`
   decision, reason `superseded`), so pairing stays causal.
6. Order: when a frame's results are not already its call-ordered next rows, every result of the
   frame moves right after the assistant row (order_key + call rank; `move`, reason `displaced`),
   the frame's other rows follow. Synthetic rows take the slot of their call.
7. Tool-call ids per `tool_id_mode`, rewritten on calls and results together, occurrence-aware:
   every later occurrence of a reused id gets a distinct id; `preserve` keeps ids (for Anthropic
   and Bedrock, characters outside `[A-Za-z0-9_-]` become `_`), `strict` keeps `[A-Za-z0-9]`, at
   most 40, `strict9` exactly 9 alphanumerics; collisions get a sha256-derived suffix, first come
   first kept; native `toolu_` ids stay for Anthropic.
8. Result names: trimmed; blank → the call's name → `unknown` (an unrecorded name stays unrecorded
   unless the result is re-attached).

Every changed block version gets one decision; a second pass (the stage runs again after snip)
decides nothing: synthetic ids are uuid5 over the call's entry id and block position, and rewritten
ids map to themselves.

Each step is a named function below (`_calls`, `_call_ids`, `_results`, `_match_by_id`,
`_reattach_orphans`, `_fates`, `_answers`, `_slots`, `_mark_rows`, `_synthetic_results`), working on
one row per call and one row per result; the changes are marked on the working frame of
`ctxreplay.pipeline.stageapi.marks` (`mark_replace`, `mark_drop`, an `Insert` for synthetic results) and `finish` turns
them into blocks and decisions. A move alone changes no content, so its `move` decision is written
here (`_move_decisions`); a move with a content change is one `replace` decision (`tool_id+displaced`).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any, Literal

import polars as pl

from ctxreplay.pipeline.core.blockops import (
    block_schema,
    content_len_expr,
    content_sha_expr,
    decisions_from,
    null_columns,
    sha256_hex,
    synthetic_id_expr,
)
from ctxreplay.pipeline.core.constants import ANTHROPIC_TOOL_ID_PATTERN
from ctxreplay.pipeline.core.constants import MISSING_RESULT_TEXT as MISSING_TEXT
from ctxreplay.pipeline.core.constants import MISSING_RESULT_TEXT_OPENAI as MISSING_TEXT_OPENAI
from ctxreplay.pipeline.stageapi.calls import BLOCK_KEY, THREAD, TOOL_CALL_TYPES, materialize, open_max
from ctxreplay.pipeline.stageapi.live import Live, LiveRows, LiveRule, LiveThread, nonblank
from ctxreplay.pipeline.stageapi.marks import Insert, alive, finish, mark_drop, mark_replace, start_marks
from ctxreplay.pipeline.stageapi.registry import Quiet, StageContext, StageResult, stage
from ctxreplay.pipeline.targets import target_family
from ctxreplay.schemas.blocks import CONTENT_COLUMNS
from ctxreplay.schemas.decisions import DECISION_KEY

FAILED_STOP_REASONS = ("error", "aborted")

BLOCK = BLOCK_KEY
MSG = ["session_id", "thread_id", "msg_key"]
POS_SHIFT = 1 << 20  # position of a block in its thread: order_key * POS_SHIFT + block_pos

ANTHROPIC_ID = re.compile(ANTHROPIC_TOOL_ID_PATTERN)


@dataclass(frozen=True, slots=True, kw_only=True)
class Pairing:
    failed_frame_policy: Literal["drop", "keep_with_synthetic", "preserve"] = "drop"
    """Assistant rows that stopped with error/aborted and hold tool calls: drop them with their results, pair them like any frame, or keep them unpaired."""
    missing_result_text: str | None = None
    """Text of a synthetic result for a call never answered; unset: `aborted` for OpenAI targets, the §12 placeholder for the others."""
    tool_id_mode: Literal["auto", "preserve", "strict", "strict9"] = "auto"
    """Tool-call ids: auto (per target: gemini strict, mistral strict9, others preserve), preserve, strict ([A-Za-z0-9], ≤ 40) or strict9 (9 alphanumerics)."""


# ----------------------------------------------------------------------------- ids


def _family(target: str) -> str:
    """The target's API family (an unset target is Anthropic)."""
    return target_family(target or "anthropic")


def resolve_id_mode(mode: str, target: str) -> str:
    if mode != "auto":
        return mode
    family = _family(target)
    if family == "gemini":
        return "strict"
    if family == "mistral":
        return "strict9"
    return "preserve"


def missing_text(params: Pairing, target: str) -> str:
    if params.missing_result_text is not None:
        return params.missing_result_text
    return MISSING_TEXT_OPENAI if _family(target) in ("openai_chat", "openai_responses") else MISSING_TEXT


def map_tool_id(tool_id: str, occurrence: int, mode: str, target: str) -> str:
    """The id a call occurrence gets (before collisions are resolved)."""
    anthropic_like = _family(target) == "anthropic"
    if mode != "preserve" and anthropic_like and occurrence == 0 and tool_id.startswith("toolu_") \
            and ANTHROPIC_ID.match(tool_id):
        return tool_id  # native Anthropic ids stay
    if mode == "preserve":
        new = tool_id
        if anthropic_like and not ANTHROPIC_ID.match(new):
            new = re.sub(r"[^A-Za-z0-9_-]", "_", new)
        if occurrence > 0:
            new = f"{new}_{sha256_hex(f'{tool_id}|{occurrence}')[:8]}"
        return new
    alnum = re.sub(r"[^A-Za-z0-9]", "", tool_id)
    if mode == "strict":
        if occurrence > 0 or not alnum:
            return alnum[:32] + sha256_hex(f"{tool_id}|{occurrence}")[:8]
        return alnum[:40]
    # strict9
    if occurrence > 0 or len(alnum) < 9:
        return sha256_hex(f"{tool_id}|{occurrence}")[:9]
    return alnum[:9]


def collision_id(candidate: str, tool_id: str, occurrence: int, mode: str) -> str:
    """The id of a later call occurrence whose mapped id an earlier one already holds."""
    h = sha256_hex(f"{tool_id}|{occurrence}|collision")
    if mode == "strict":
        return candidate[:32] + h[:8]
    if mode == "strict9":
        return h[:9]
    return f"{candidate}_{h[:8]}"


def _map_ids_expr(mode: str, target: str) -> pl.Expr:
    def fn(s: pl.Series) -> pl.Series:
        return pl.Series([None if r["i"] is None or not r["i"].strip() else map_tool_id(r["i"], r["o"] or 0, mode, target)
                          for r in s.to_list()], dtype=pl.String)

    return pl.struct(i=pl.col("_cid"), o=pl.col("_occ")).map_batches(fn, return_dtype=pl.String)


def same_id_expr(mode: str, target: str) -> pl.Expr:
    """`map_tool_id(_cid, 0, mode, target) == _cid` without calling it per row: True only where the
    first occurrence keeps its id (null for a blank id, as the plan has it). Conservative where
    Python and polars read a string differently (an id of unusual whitespace, a line break before
    the end): False there, and the plan decides."""
    cid = pl.col("_cid")
    anthropic_like = _family(target) == "anthropic"
    if mode == "preserve":
        same = cid.str.contains(ANTHROPIC_TOOL_ID_PATTERN) if anthropic_like else cid.str.contains("[!-~]")
    else:
        native = (cid.str.starts_with("toolu_") & cid.str.contains(ANTHROPIC_TOOL_ID_PATTERN)) if anthropic_like \
            else pl.lit(False)
        n = cid.str.len_chars()
        same = native | (cid.str.contains("^[A-Za-z0-9]+$") & ((n <= 40) if mode == "strict" else (n == 9)))
    return pl.when(cid.is_null() | (cid.str.strip_chars() == "")).then(None).otherwise(same)


def _collision_expr(mode: str) -> pl.Expr:
    def fn(s: pl.Series) -> pl.Series:
        return pl.Series([r["c"] if not r["x"] else collision_id(r["c"], r["i"], r["o"], mode)
                          for r in s.to_list()], dtype=pl.String)

    return pl.struct(c=pl.col("_cand"), i=pl.col("_cid"), o=pl.col("_occ"), x=pl.col("_collides")).map_batches(
        fn, return_dtype=pl.String)


# ----------------------------------------------------------------------------- helpers


def _blank(col: str) -> pl.Expr:
    return pl.col(col).is_null() | (pl.col(col).str.strip_chars() == "")


def _lt_open(a: pl.Expr, b: pl.Expr) -> pl.Expr:
    """a < b where a null-free and b null = +infinity."""
    return b.is_null() | (a < b)


def _latest_before(left: pl.LazyFrame, right: pl.LazyFrame, *, by: list[str], cols: list[str]) -> pl.LazyFrame:
    """For each row of `left`, `cols` of the latest `right` row with the same `by` at or before its `_pos`.

    (An as-of join written as a forward fill over one event stream: polars' join_asof cannot check
    the sort order of grouped keys.)
    """
    lt = left.with_columns(_k=pl.col("_pos") * 2 + 1, _left=pl.lit(True))
    rt = right.select(*by, *cols, _k=pl.col("_pos") * 2, _left=pl.lit(False))
    ev = pl.concat([lt, rt], how="diagonal_relaxed")
    ev = ev.with_columns([pl.col(c).forward_fill().over(by, order_by="_k") for c in cols])
    return ev.filter("_left").drop("_k", "_left")


def _count_upto(frames: pl.LazyFrame, counts: pl.LazyFrame, *, at: str, out: str) -> pl.LazyFrame:
    """For each row of `frames`, the number of rows counted in `counts` (per thread, `_n` rows at
    `order_key`) with order_key <= frames[at]."""
    q = frames.with_columns(_k=pl.col(at) * 2 + 1, _n=pl.lit(0, pl.UInt32), _left=pl.lit(True))
    c = counts.select(*THREAD, "_n", _k=pl.col("order_key") * 2, _left=pl.lit(False))
    ev = pl.concat([q, c], how="diagonal_relaxed")
    ev = ev.with_columns(pl.col("_n").cast(pl.Int64).cum_sum().over(THREAD, order_by="_k").alias(out))
    return ev.filter("_left").drop("_k", "_n", "_left")


# ----------------------------------------------------------------------------- the stage


def live_start(thread: LiveThread, params: Pairing, ctx: StageContext) -> frozenset[str]:
    """The live rule carries the thread's tool-call ids, as loaded and as this position left them."""
    ids = pl.concat([thread.loaded.get_column("tool_use_id"), thread.blocks.get_column("tool_use_id")])
    return frozenset(ids.drop_nulls().unique().to_list())


def live_step(ids: frozenset[str], new: LiveRows, p: Pairing, ctx: StageContext) -> Live:
    """Quiet when the new messages pair as they stand: each answer's tool calls (new ids that the
    id mode keeps) answered in order by the next tool message, no tool block elsewhere, no failed
    turn with calls, every call answered by the end."""
    target = ctx.target or "anthropic"
    mode = resolve_id_mode(p.tool_id_mode, target)
    expecting: list[str] = []
    seen: set[str] = set()
    for msg in new.messages:
        role = msg[0]["role"]
        calls = [r for r in msg if r["block_type"] == "tool_use"]
        results = [r for r in msg if r["block_type"] == "tool_result"]
        if role == "assistant":
            if expecting:
                return Live.full_pass("a tool call not answered before the next answer")
            stop = msg[0]["stop_reason"]
            if calls and isinstance(stop, str) and stop.lower() in FAILED_STOP_REASONS:
                return Live.full_pass("a failed turn with tool calls")
            for r in calls:
                tid = r["tool_use_id"]
                if not nonblank(tid) or tid in ids or tid in seen or map_tool_id(tid, 0, mode, target) != tid:
                    return Live.full_pass("a tool-call id pairing rewrites")
                seen.add(tid)
                expecting.append(tid)
            if results:
                return Live.full_pass("a tool result in an assistant message")
        elif role == "tool":
            blocks: dict[int, list[dict[str, Any]]] = {}
            for r in results:
                blocks.setdefault(r["block_pos"], []).append(r)
            for parts in blocks.values():
                tid = parts[0]["tool_use_id"]
                if not expecting or any(r["tool_use_id"] != tid for r in parts) or tid != expecting[0]:
                    return Live.full_pass("a tool result out of its call's order")
                expecting.pop(0)
                for r in parts:
                    name = r["tool_name"]
                    if name is not None and not (nonblank(name) and name.strip() == name):
                        return Live.full_pass("a tool result name pairing rewrites")
        else:
            if expecting:
                return Live.full_pass("a message between a tool call and its result")
            if calls or results:
                return Live.full_pass("a tool block in a user message")
    if expecting:
        return Live.full_pass("a tool call whose result has not arrived (pairing stands one in)")
    return Live.quiet(ids | {r["tool_use_id"] for r in new.rows if r["tool_use_id"] is not None})


def quiet_check(blocks: pl.LazyFrame, params: Pairing, ctx: StageContext) -> pl.LazyFrame:
    """Nothing to do (ctxreplay.pipeline.stageapi.quiet), a plan whose values must all hold: every
    tool call already has exactly one result, right after it, in call order, seen from the call's
    first request on and leaving the requests with it (both kept to the end, or both gone from the
    same call: a compaction that removes the pair); ids are unique in their thread and map to
    themselves; result names are trimmed; and nothing needs a version of its own (no synthetic
    result, failed frame, or call or result that leaves the requests without the other). Then no
    step of the stage changes anything: a result that outlives its call is an orphan from the call's
    end, one that leaves first a stand-in, and neither happens when both end at the same call."""
    mode = resolve_id_mode(params.tool_id_mode, ctx.target)
    failed = (pl.col("role") == "assistant") & pl.col("stop_reason").str.to_lowercase().is_in(FAILED_STOP_REASONS)
    is_result = pl.col("block_type") == "tool_result"
    name = pl.col("tool_name")
    rows = blocks.select(_q=~(
        (pl.col("origin") == "pairing").fill_null(False) | failed.fill_null(False)
        | ((_is_call() | is_result) & _blank("tool_use_id")).fill_null(False)
        | (is_result & name.is_not_null() & (_blank("tool_name") | (name.str.strip_chars() != name))).fill_null(False)
    ).any())  # no such row
    calls = blocks.filter(_is_call()).group_by(BLOCK).agg(
        msg_key=pl.col("msg_key").first(), order_key=pl.col("order_key").min(), _cid=pl.col("tool_use_id").first(),
        _fc=pl.col("first_call").min(), _lc=open_max("last_call"),
    ).with_columns(_same=same_id_expr(mode, ctx.target))
    results = blocks.filter(is_result).group_by(BLOCK).agg(
        _cid=pl.col("tool_use_id").first(), _rok=pl.col("order_key").min(), _rpos=_pos().min(),
        _fr=pl.col("first_call").min(), _lr=open_max("last_call"),
    )
    pairs = calls.join(results.drop("entry_id", "block_pos"), on=[*THREAD, "_cid"], how="full", coalesce=True)
    # each id once among the calls and once among the results of its thread: with both sides on
    # every row of the full join, as many rows as calls and as results (an id of c calls and r
    # results gives c * r rows, so c * r summed equal to c summed and to r summed means each is 1)
    paired = pl.concat([
        pairs.select(_all=(pl.col("_same") & (pl.col("_rok") > pl.col("order_key")) & (pl.col("_fr") <= pl.col("_fc"))
                           & pl.col("_lc").eq_missing(pl.col("_lr"))).fill_null(False).all(), _np=pl.len()),
        calls.select(_nc=pl.len()), results.select(_nr=pl.len())], how="horizontal")
    ok_pairs = paired.select(_q=pl.col("_all") & (pl.col("_np") == pl.col("_nc")) & (pl.col("_np") == pl.col("_nr")))
    # in place: results in call order, and no other row between the assistant row and its last slot
    # (from the frame's first row: the stage takes any of them; in place from the first is in place from any)
    framed = pairs.filter(pl.col("msg_key").is_not_null())
    # in call order: along each frame's calls (by block), each result after the one before (where
    # every call has its result, which ok_pairs requires); shifts over the sorted calls, no per-frame sort
    by_call = framed.select(*MSG, "block_pos", "_rpos").sort([*MSG, "block_pos"])
    same_frame = pl.all_horizontal([pl.col(c) == pl.col(c).shift(1) for c in MSG]).fill_null(False)
    ordered = by_call.select(_q=(~same_frame | (pl.col("_rpos") > pl.col("_rpos").shift(1))).fill_null(True).all())
    # a frame's last slot: its first row's order plus its calls (one row each where ok_pairs holds;
    # where it does not, the check fails whatever this part says)
    frames = framed.group_by(MSG).agg(_a=pl.col("order_key").min(), _span_end=pl.col("_rok").max() + pl.len())
    # no other row after the frame's up to its last slot: the next order_key of a row that is not a
    # result comes after the span (one as-of lookup: both sides sorted by the key, so by thread too)
    others = blocks.filter(~is_result).select(*THREAD, _next="order_key").unique().sort("_next")
    nxt = frames.sort("_a").join_asof(others, left_on="_a", right_on="_next", by=THREAD, strategy="forward",
                                      allow_exact_matches=False, check_sortedness=False)
    clear = pl.col("_span_end").is_not_null() & (pl.col("_next").is_null() | (pl.col("_next") > pl.col("_span_end")))
    in_place = nxt.select(_q=clear.fill_null(False).all())
    return pl.concat([rows, ok_pairs, ordered, in_place])


@stage("pairing", version=2, params=Pairing, requires=("sanitize",), live=LiveRule(live_start, live_step),
       quiet=Quiet(quiet_check))
def pairing(blocks: pl.LazyFrame, params: Pairing, ledger: pl.LazyFrame, ctx: StageContext) -> StageResult:
    """Pair every tool call with exactly one result, right after it, in call order.

    Moves displaced results (`move`/`displaced`), drops orphans, duplicates and failed frames
    (`drop`/`orphan`, `duplicate`, `failed_frame`), inserts synthetic results for calls never
    answered (`insert`/`missing`, closed by `drop`/`superseded` when the real result arrives),
    rewrites tool-call ids per target (`replace`/`tool_id`), re-attaches results without a call
    (`replace`/`reattached`) and trims result names (`replace`/`result_name`).
    """
    mode = resolve_id_mode(params.tool_id_mode, ctx.target)
    w = materialize(_working_frame(blocks))
    calls = materialize(_call_ids(_calls(w, params), mode, ctx.target))  # steps 1 and 7
    results = _match_by_id(_results(w), calls)  # step 1
    results = _reattach_orphans(results, calls)  # step 2
    results = materialize(_fates(results, calls))  # steps 3 and 4
    answers = _answers(calls, results)  # step 5
    slots = materialize(_slots(w, answers, calls, results))  # step 6
    w = _mark_rows(w, calls, results, slots)  # steps 6-8 and the drops of steps 2-4
    w, insert = _synthetic_results(w, slots, missing_text(params, ctx.target))  # step 5
    w = materialize(w)
    res = finish(w, [insert])
    decisions = pl.concat([res.decisions, _move_decisions(w)]).sort(DECISION_KEY)
    return StageResult(res.blocks, decisions)


# (these expressions are made at first use, not at import: ctxreplay/deferred.py)
@functools.cache
def _pos() -> pl.Expr:
    """The position of a block in its thread: an as-of key across rows and the blocks of a row."""
    return pl.col("order_key") * POS_SHIFT + pl.col("block_pos")


@functools.cache
def _is_call() -> pl.Expr:
    return pl.col("block_type").is_in(list(TOOL_CALL_TYPES)) & (pl.col("role") == "assistant")


@functools.cache
def _is_synthetic() -> pl.Expr:
    return (pl.col("block_type") == "tool_result") & (pl.col("origin") == "pairing")


@functools.cache
def _is_result() -> pl.Expr:
    return (pl.col("block_type") == "tool_result") & (pl.col("origin") != "pairing")


# a call block's columns under the names a result row refers to it by
_PER_CALL = [*THREAD, "_c_entry", "_c_bp"]


def _working_frame(blocks: pl.LazyFrame) -> pl.LazyFrame:
    """The marks working frame plus each block's position and whether its message is a failed
    assistant row (stop_reason error/aborted)."""
    failed = (
        (pl.col("role") == "assistant")
        & pl.col("stop_reason").str.to_lowercase().is_in(FAILED_STOP_REASONS).fill_null(False)
    )
    return start_marks(blocks).with_columns(_pos=_pos(), _failed=failed.any().over(MSG))


def _calls(w: pl.LazyFrame, params: Pairing) -> pl.LazyFrame:
    """Step 1: one row per tool call block (all its versions): its id and name as first seen, its
    occurrence of that id in the thread, its rank in its message, the span of calls that see it,
    and its frame's fate under `failed_frame_policy` (step 4)."""
    return (
        w.filter(_is_call())
        .group_by(BLOCK)
        .agg(
            pl.col("msg_key").first(),
            pl.col("order_key").min(),
            pl.col("_pos").min(),
            pl.col("tool_use_id").sort_by("first_call").first().alias("_cid"),
            pl.col("tool_name").sort_by("first_call").first().alias("_cname"),
            pl.col("part_pos").sort_by("first_call", "part_pos").first().alias("_cpart"),
            pl.col("_failed").any(),
            pl.col("first_call").min().alias("_fc"),
            open_max("last_call").alias("_lc"),
        )
        .with_columns(_has_id=~_blank("_cid"))
        .with_columns(
            _occ=(pl.col("_pos").rank("ordinal").over([*THREAD, "_cid"]) - 1).cast(pl.Int64),
            _crank=pl.col("block_pos").rank("dense").over(MSG).cast(pl.Int64),
            _m=pl.len().over(MSG).cast(pl.Int64),
            _drop_frame=pl.col("_failed") & pl.lit(params.failed_frame_policy == "drop"),
            _no_synth=pl.col("_failed") & pl.lit(params.failed_frame_policy == "preserve"),
        )
    )


def _call_ids(calls: pl.LazyFrame, mode: str, target: str) -> pl.LazyFrame:
    """Step 7: the id each call occurrence gets (`_new_cid`): mapped per `tool_id_mode`, then
    collisions resolved in thread order, first come first kept."""
    calls = calls.with_columns(_cand=pl.when("_has_id").then(_map_ids_expr(mode, target)))
    calls = calls.with_columns(
        _collides=(pl.col("_pos").rank("ordinal").over([*THREAD, "_cand"]) > 1) & pl.col("_has_id"))
    return calls.with_columns(_new_cid=pl.when("_has_id").then(_collision_expr(mode))).drop("_cand", "_collides")


def _results(w: pl.LazyFrame) -> pl.LazyFrame:
    """Step 1: one row per recorded tool result block (all its versions): its id and name as first
    seen, its position and the span of calls that see it."""
    return (
        w.filter(_is_result())
        .group_by(BLOCK)
        .agg(
            pl.col("msg_key").first(),
            pl.col("order_key").min().alias("_rok"),
            pl.col("_pos").min(),
            pl.col("tool_use_id").sort_by("first_call").first().alias("_rid"),
            # a tool_reference part's tool_name names the referenced tool, not the result
            pl.col("tool_name").sort_by("first_call", "part_pos")
            .filter(pl.col("part_type").sort_by("first_call", "part_pos").ne_missing("tool_reference"))
            .first().alias("_rname"),
            pl.col("first_call").min().alias("_fr"),
            open_max("last_call").alias("_lr"),
        )
        .with_columns(_rhas_id=~_blank("_rid"))
    )


def _match_by_id(results: pl.LazyFrame, calls: pl.LazyFrame) -> pl.LazyFrame:
    """Step 1: each result's call by id, per occurrence: the latest earlier call with its id
    (`_c_entry`, `_c_bp`; null when none)."""
    call_ids = calls.filter("_has_id").select(
        *THREAD, pl.col("_cid").alias("_rid"), "_pos",
        pl.col("entry_id").alias("_c_entry"), pl.col("block_pos").alias("_c_bp"),
    )
    return _latest_before(results, call_ids, by=[*THREAD, "_rid"], cols=["_c_entry", "_c_bp"])


def _reattach_orphans(results: pl.LazyFrame, calls: pl.LazyFrame) -> pl.LazyFrame:
    """Step 2 (results outside their frame): a result that matches no call by id is re-attached
    (`_attached`) to the one unresolved call of its frame that can own it: names agree, a result
    without an id needs a single-call frame, and the call's own result is not visible yet where the
    orphan first is. Otherwise it stays unmatched (an orphan)."""
    frames = (
        calls.filter(~pl.col("_drop_frame"))
        .group_by(MSG)
        .agg(pl.col("order_key").min().alias("_fok"))
        .select(*THREAD, pl.col("msg_key").alias("_frame"), _pos=pl.col("_fok") * POS_SHIFT)
    )
    # the frame a result sits in: the latest tool-call assistant row before it
    results = _latest_before(results, frames, by=THREAD, cols=["_frame"])
    # a call is resolved from the first call that sees a result carrying its own id
    first_match = (
        results.filter(pl.col("_c_entry").is_not_null())
        .group_by(_PER_CALL)
        .agg(pl.col("_fr").min().alias("_first_match"))
    )
    owners = calls.filter(pl.col("_has_id") & ~pl.col("_drop_frame")).join(
        first_match, left_on=BLOCK, right_on=_PER_CALL, how="left",
    ).select(*THREAD, pl.col("msg_key").alias("_frame"), pl.col("entry_id").alias("_o_entry"),
             pl.col("block_pos").alias("_o_bp"), "_cname", "_m", "_first_match")
    orphans = results.filter(pl.col("_c_entry").is_null() & pl.col("_frame").is_not_null())
    name_agrees = (
        (pl.col("_rname").is_null() | (pl.col("_rname").str.strip_chars() == ""))
        | (pl.col("_rname").str.strip_chars().str.to_lowercase()
           == pl.col("_cname").str.strip_chars().str.to_lowercase()).fill_null(False)
    )
    cand = (
        orphans.join(owners, on=[*THREAD, "_frame"], how="inner")
        .filter(
            # never a call whose own result is already visible where the orphan first is
            (pl.col("_first_match").is_null() | (pl.col("_first_match") > pl.col("_fr")))
            & name_agrees
            & (pl.col("_rhas_id") | (pl.col("_m") == 1))
        )
        .with_columns(_n=pl.len().over(BLOCK))
        .filter(pl.col("_n") == 1)
        .select(*BLOCK, "_o_entry", "_o_bp")
    )
    return results.join(cand, on=BLOCK, how="left").with_columns(
        _attached=pl.col("_c_entry").is_null() & pl.col("_o_entry").is_not_null(),
        _c_entry=pl.coalesce("_c_entry", "_o_entry"),
        _c_bp=pl.coalesce("_c_bp", "_o_bp"),
    ).drop("_o_entry", "_o_bp", "_frame")


def _fates(results: pl.LazyFrame, calls: pl.LazyFrame) -> pl.LazyFrame:
    """Steps 3 and 4: duplicates and failed frames. Per call, its results ranked (its own result
    first, then the first by position); the first is `_chosen`, a re-attached one seen before it
    stands in for it until then (`_interim`); every other result gets a `_fate` (a drop reason)
    and `_fate_from` (the call it is dropped from; null: from its first call)."""
    cinfo = calls.select(
        *THREAD, pl.col("entry_id").alias("_c_entry"), pl.col("block_pos").alias("_c_bp"),
        "_new_cid", "_cname", "_drop_frame", "_lc", "_fc",
    )
    results = results.join(cinfo, on=_PER_CALL, how="left")
    results = _rank_per_call(results)
    results = results.with_columns(
        _fate=pl.when(pl.col("_c_entry").is_null()).then(pl.lit("orphan"))
        .when(pl.col("_drop_frame")).then(pl.lit("failed_frame"))
        .when(pl.col("_interim")).then(pl.lit("superseded"))
        .when((pl.col("_rank") > 1) & pl.col("_attached")).then(pl.lit("orphan"))
        .when(pl.col("_rank") > 1).then(pl.lit("duplicate"))
        .when(pl.col("_lc").is_not_null() & (pl.col("_lr").is_null() | (pl.col("_lr") > pl.col("_lc"))))
        .then(pl.lit("orphan"))
        .otherwise(pl.lit(None, pl.String)),
    ).with_columns(
        # a result whose call leaves the request (compaction, snip) goes with it, from then on; a
        # stand-in goes when the call's own result arrives
        _fate_from=pl.when(pl.col("_fate").is_not_null() & pl.col("_c_entry").is_not_null()
                           & ~pl.col("_drop_frame") & (pl.col("_rank") == 1))
        .then(pl.col("_lc"))
        .when(pl.col("_interim") & ~pl.col("_drop_frame"))
        .then(pl.min_horizontal(pl.col("_p_fr"), pl.col("_lc")))
        .otherwise(pl.lit(None, pl.Int32)),
        _chosen=pl.col("_c_entry").is_not_null() & ~pl.col("_drop_frame").fill_null(False) & (pl.col("_rank") == 1),
    )
    return results.with_columns(_interim=pl.col("_interim") & pl.col("_c_entry").is_not_null()
                                & ~pl.col("_drop_frame").fill_null(False))


def _rank_per_call(results: pl.LazyFrame) -> pl.LazyFrame:
    """Step 3: rank the results of each call (`_rank`; 1 wins) and mark the one stand-in
    (`_interim`): the call's own result (matched by its id) always wins over a re-attached one; a
    result that an earlier pass closed before its call leaves (a stand-in) ranks after the others."""
    results = results.with_columns(
        _stand_in=(pl.col("_lr").is_not_null() & _lt_open(pl.col("_lr"), pl.col("_lc"))),
    ).with_columns(
        _rank=pl.struct(pl.col("_attached").cast(pl.Int8), pl.col("_stand_in").cast(pl.Int8), "_pos", "_fr")
        .rank("ordinal").over(_PER_CALL),
    ).with_columns(
        _p_fr=pl.col("_fr").filter(pl.col("_rank") == 1).first().over(_PER_CALL),
    ).with_columns(
        # a re-attached result (or one an earlier pass made a stand-in) seen before the call's own
        # result stands in for it until then, like a synthetic one: it never sits beside it
        _interim=(pl.col("_rank") > 1) & (pl.col("_attached") | pl.col("_stand_in"))
        & (pl.col("_fr") < pl.col("_p_fr")),
    )
    # one stand-in per call: the first candidate
    return results.with_columns(
        _interim=pl.col("_interim")
        & (pl.col("_rank") == pl.col("_rank").filter(pl.col("_interim")).min().over(_PER_CALL)),
    )


def _answers(calls: pl.LazyFrame, results: pl.LazyFrame) -> pl.LazyFrame:
    """Step 5: per kept call with an id, its chosen result (`_present`, `_rok`, `_rpos`) and whether
    it needs a synthetic result (`_need`) from its first call until the call that first sees an
    answer (its own result or a stand-in) or that no longer sees the call (`_s_end`)."""
    chosen = results.filter("_chosen").select(
        *THREAD, "_c_entry", "_c_bp", "_rok", pl.col("_pos").alias("_rpos"), "_fr", "_lr",
    )
    answered = results.filter(pl.col("_chosen") | pl.col("_interim")).group_by(_PER_CALL).agg(
        _first_answer=pl.col("_fr").min())
    cf = calls.filter(pl.col("_has_id") & ~pl.col("_drop_frame")).join(
        chosen, left_on=BLOCK, right_on=_PER_CALL, how="left",
    ).join(answered, left_on=BLOCK, right_on=_PER_CALL, how="left").with_columns(
        _present=pl.col("_rok").is_not_null())
    synth_end = pl.min_horizontal(pl.col("_first_answer"), pl.col("_lc"))
    return cf.with_columns(
        _s_end=synth_end,
        _need=~pl.col("_no_synth") & _lt_open(pl.col("_fc"), synth_end),
    )


def _slots(w: pl.LazyFrame, cf: pl.LazyFrame, calls: pl.LazyFrame, results: pl.LazyFrame) -> pl.LazyFrame:
    """Step 6 (emit per frame): each answered call's slot (`_slot`), the order_key its result (or
    synthetic result) takes. A frame whose results already follow the assistant row in call order,
    with no other row between, keeps its order_keys (`_in_place`); any other frame has every result
    moved right after the assistant row (order_key + call rank), its other rows following."""
    frame_w = {"partition_by": MSG, "order_by": "_crank"}
    cf = cf.with_columns(
        _hold_ok=pl.when("_present").then(pl.col("_rok")).forward_fill().over(**frame_w),
        _hold_rank=pl.when("_present").then(pl.col("_crank")).forward_fill().over(**frame_w),
        _next_ok=pl.when("_present").then(pl.col("_rok")).backward_fill().over(**frame_w),
        _prev_rpos=pl.when("_present").then(pl.col("_rpos")).forward_fill().shift(1).over(**frame_w),
    )
    cf = cf.with_columns(
        _slot_in=pl.when("_present").then(pl.col("_rok")).otherwise(
            pl.coalesce("_hold_ok", "order_key") + pl.col("_crank") - pl.coalesce("_hold_rank", pl.lit(0, pl.Int64))),
    ).with_columns(
        _row_ok=(
            (~pl.col("_present") | pl.col("_prev_rpos").is_null() | (pl.col("_rpos") > pl.col("_prev_rpos")))
            & (pl.col("_present") | ~pl.col("_need") | pl.col("_next_ok").is_null()
               | (pl.col("_slot_in") < pl.col("_next_ok")))
        ),
        _span_end=pl.coalesce(pl.col("_rok").max().over(MSG), pl.col("order_key")) + pl.col("_m"),
    )
    # rows that would sit between the assistant row and its last slot
    dropped_blocks = results.filter(pl.col("_fate").is_not_null() & pl.col("_fate_from").is_null()).select(BLOCK)
    chosen_blocks = results.filter(pl.col("_chosen") | pl.col("_interim")).select(BLOCK)
    others = (
        w.filter(pl.col("origin") != "pairing")
        .join(chosen_blocks, on=BLOCK, how="anti")
        .join(dropped_blocks, on=BLOCK, how="anti")
        .join(_dropped_frames(calls), on=MSG, how="anti")
        .group_by(*THREAD, "order_key").agg(_n=pl.len())
    )
    fr = cf.group_by(MSG).agg(pl.col("order_key").first().alias("_a"), pl.col("_span_end").first(),
                              pl.col("_row_ok").all())
    fr = _count_upto(fr, others, at="_a", out="_cum_a")
    fr = _count_upto(fr, others, at="_span_end", out="_cum_l")
    fr = fr.with_columns(_in_place=pl.col("_row_ok") & (pl.col("_cum_l") == pl.col("_cum_a"))).select(*MSG, "_in_place")
    return cf.join(fr, on=MSG, how="left").with_columns(
        _slot=pl.when("_in_place").then(pl.col("_slot_in")).otherwise(pl.col("order_key") + pl.col("_crank")),
    )


def _dropped_frames(calls: pl.LazyFrame) -> pl.LazyFrame:
    """Step 4: the failed assistant messages `failed_frame_policy = "drop"` removes whole."""
    return calls.filter("_drop_frame").select(MSG).unique()


def _mark_rows(w: pl.LazyFrame, calls: pl.LazyFrame, results: pl.LazyFrame, slots: pl.LazyFrame) -> pl.LazyFrame:
    """Mark the recorded rows: the new ids of calls and of the results that answer them (step 7),
    result names (step 8), re-attached results (an error without an id), results moved to their
    slot (step 6), then the drops of steps 2-4 (orphans, duplicates, stand-ins, failed frames).
    Every version of a block gets the same change; content changes are `replace` decisions (reason
    `reattached`, else `tool_id`, else `result_name`, plus `+displaced` when moved)."""
    res_upd = _result_updates(results, slots)
    call_upd = calls.select(*BLOCK, _u_cid=pl.when(~pl.col("_drop_frame")).then(pl.col("_new_cid")))
    msg_drop = _dropped_frames(calls).with_columns(_drop_msg=pl.lit("failed_frame"))
    w = (
        w.join(res_upd, on=BLOCK, how="left")
        .join(call_upd, on=BLOCK, how="left")
        .join(msg_drop, on=MSG, how="left")
        .with_columns(
            _u_id=pl.when(_is_call()).then(pl.col("_u_cid")).when(_is_result()).then(pl.col("_u_id")),
            _u_name=pl.when(pl.col("part_type").ne_missing("tool_reference")).then(pl.col("_u_name")),
            _fate=pl.when(_is_synthetic()).then(pl.lit(None, pl.String)).otherwise(pl.coalesce("_drop_msg", "_fate")),
            _fate_from=pl.when(pl.col("_drop_msg").is_not_null()).then(pl.lit(None, pl.Int32))
            .otherwise(pl.col("_fate_from")),
        )
    )
    differs = {  # a value to set that differs from the row's (a null current value differs)
        c: pl.col(u).is_not_null() & (pl.col(u) != pl.col(c)).fill_null(True)
        for u, c in (("_u_id", "tool_use_id"), ("_u_name", "tool_name"), ("_u_err", "is_error"))
    }
    content_reason = (
        pl.when(pl.col("_u_reason").is_not_null()).then(pl.col("_u_reason"))
        .when(differs["tool_use_id"]).then(pl.lit("tool_id"))
        .otherwise(pl.lit("result_name"))
    )
    w = mark_replace(
        w, differs["tool_use_id"] | differs["tool_name"] | differs["is_error"],
        {"tool_use_id": pl.coalesce("_u_id", "tool_use_id"), "tool_name": pl.coalesce("_u_name", "tool_name"),
         "is_error": pl.coalesce("_u_err", "is_error")},
        content_reason,
    )
    w = mark_replace(w, pl.col("_u_ok").is_not_null() & (pl.col("_u_ok") != pl.col("order_key")),
                     {"order_key": pl.col("_u_ok")}, "displaced")
    w = mark_drop(w, pl.col("_fate").is_not_null(), pl.col("_fate"), pl.coalesce("_fate_from", "first_call"))
    return w.drop("_pos", "_failed", "_u_id", "_u_name", "_u_err", "_u_ok", "_u_reason", "_u_cid", "_fate", "_fate_from",
                  "_drop_msg")


def _result_updates(results: pl.LazyFrame, slots: pl.LazyFrame) -> pl.LazyFrame:
    """Per recorded result block, what changes: the id of the call it answers (`_u_id`), its name
    (`_u_name`: trimmed; blank → the call's name → `unknown`), `is_error` for a re-attached result
    without an id (`_u_err`), its slot (`_u_ok`), and its fate (a drop reason)."""
    answers = pl.col("_chosen") | pl.col("_interim")
    trimmed = pl.col("_rname").str.strip_chars()
    return results.join(
        slots.select(*THREAD, pl.col("entry_id").alias("_c_entry"), pl.col("block_pos").alias("_c_bp"), "_slot"),
        on=_PER_CALL, how="left",
    ).with_columns(
        _u_id=pl.when(answers).then("_new_cid"),
        _u_name=pl.when(answers & pl.col("_attached")).then(
            pl.when(_blank("_rname")).then(pl.coalesce(pl.col("_cname").str.strip_chars(), pl.lit("unknown")))
            .otherwise(trimmed))
        .when(answers & pl.col("_rname").is_not_null()).then(
            pl.when(_blank("_rname")).then(
                pl.when(_blank("_cname")).then(pl.lit("unknown")).otherwise(pl.col("_cname").str.strip_chars()))
            .otherwise(trimmed)),
        _u_err=pl.when(answers & pl.col("_attached") & ~pl.col("_rhas_id")).then(pl.lit(True)),
        _u_ok=pl.when(answers).then(pl.col("_slot")),
        _u_reason=pl.when(pl.col("_attached")).then(pl.lit("reattached")).otherwise(pl.lit(None, pl.String)),
    ).select(*BLOCK, "_u_id", "_u_name", "_u_err", "_u_ok", "_u_reason", "_fate", "_fate_from")


# ----------------------------------------------------------------------------- synthetic results

# the columns a synthetic result copies from its call's first version; every other column is set
_SYNTHETIC_KEEP = (*THREAD, "source_format", "source_file", "source_line", "entry_order", "timestamp",
                   "is_sidechain", "cache_epoch")


def _synthetic_content(text: str) -> dict[str, pl.Expr]:
    """The content columns of a synthetic result, from its call's `_new_cid` and `_cname`."""
    values = {
        "block_type": pl.lit("tool_result"),
        "part_type": pl.lit("string"),
        "text": pl.lit(text),
        "tool_use_id": pl.col("_new_cid"),
        "tool_name": pl.when(_blank("_cname")).then(pl.lit("unknown")).otherwise(pl.col("_cname").str.strip_chars()),
        "is_error": pl.lit(True),
    }
    return {c: values.get(c, pl.lit(None)).cast(block_schema()[c]) for c in CONTENT_COLUMNS}


def _synthetic_row(text: str) -> dict[str, pl.Expr]:
    """Every column of a synthetic result built on its call's row (the call's columns `_slot`,
    `_sid`, `_fc`, `_s_end` joined on), but those copied from the call (_SYNTHETIC_KEEP)."""
    values: dict[str, pl.Expr] = {
        **null_columns(c for c in block_schema().names() if c not in _SYNTHETIC_KEEP),
        **_synthetic_content(text),
        "raw_line": pl.lit(""),
        "order_key": pl.col("_slot"),
        "entry_id": pl.col("_sid"),
        "parent_id": pl.col("entry_id"),
        "msg_key": pl.col("_sid"),
        "role": pl.lit("tool"),
        "is_call": pl.lit(False),
        "first_call": pl.col("_fc"),
        "last_call": pl.col("_s_end"),
        "block_pos": pl.lit(0),
        "part_pos": pl.lit(0),
        "is_meta": pl.lit(False),
        "is_compact_summary": pl.lit(False),
        "is_display_only": pl.lit(False),
        "content_sha256": pl.lit(""),  # finish hashes inserted rows
        "origin": pl.lit("pairing"),
    }
    return {c: v.cast(block_schema()[c]) for c, v in values.items()}


def _synthetic_results(w: pl.LazyFrame, slots: pl.LazyFrame, text: str) -> tuple[pl.LazyFrame, Insert]:
    """Step 5: the synthetic results the calls need (desired) against those an earlier pass
    inserted (existing, `origin = "pairing"`). An existing one that starts where the desired one
    starts, with its content, is kept: closed where the desired one ends (`drop`/`superseded` from
    that call) and moved to its slot (`move`/`displaced`); any other existing one is dropped
    (`drop`/`superseded`); a desired one with no existing one is inserted (`insert`/`missing`)
    on its call's first version (uuid5 id over the call's entry id and block position)."""
    desired = slots.filter("_need").with_columns(
        _sid=synthetic_id_expr("pairing", "missing_result",
                               pl.concat_str([pl.col("entry_id"), pl.col("block_pos").cast(pl.String)], separator="#"),
                               0),
    )
    keep_e = _kept_existing(w, desired, text)
    w = w.join(keep_e.with_columns(_keep_e=pl.lit(True)), on=[*THREAD, "entry_id"], how="left",
               nulls_equal=True).with_columns(_keep_e=_is_synthetic() & pl.col("_keep_e").fill_null(False))
    w = mark_replace(w, pl.col("_keep_e") & (pl.col("order_key") != pl.col("_d_ok")),
                     {"order_key": pl.col("_d_ok")}, "displaced")
    w = mark_drop(w, _is_synthetic() & ~pl.col("_keep_e"), "superseded")
    close = pl.col("_keep_e") & pl.col("_d_end").is_not_null() & (
        pl.col("last_call").is_null() | (pl.col("last_call") > pl.col("_d_end")))
    w = mark_drop(w, close, "superseded", pl.col("_d_end"))

    new = desired.join(keep_e.select(*THREAD, pl.col("entry_id").alias("_sid")), on=[*THREAD, "_sid"], how="anti")
    # the call's first version carries the new row
    w = w.join(new.select(*BLOCK, "_new_cid", "_cname", "_slot", "_sid", "_fc", "_s_end", "_cpart"),
               on=BLOCK, how="left").with_columns(
        _insert=_is_call() & (pl.col("first_call") == pl.col("_fc")) & (pl.col("part_pos") == pl.col("_cpart")),
    ).drop("_keep_e", "_d_end", "_d_ok", "_cpart")
    return w, Insert(when=pl.col("_insert"), values=_synthetic_row(text), reason="missing")


def _kept_existing(w: pl.LazyFrame, desired: pl.LazyFrame, text: str) -> pl.LazyFrame:
    """The existing synthetic results that stay (per entry id: the desired end `_d_end` and slot
    `_d_ok`): one starts where the desired one starts, with its content, and ends no earlier."""
    existing = w.filter(_is_synthetic()).group_by(THREAD + ["entry_id"]).agg(
        _e_start=pl.col("first_call").min(),
        _e_end=open_max("last_call"),
        _e_sha=pl.col("content_sha256").sort_by("first_call").first(),
    )
    d = desired.select(*THREAD, pl.col("_sid").alias("entry_id"), _d_start=pl.col("_fc").cast(pl.Int32),
                       _d_end=pl.col("_s_end").cast(pl.Int32), _d_ok="_slot", **_synthetic_content(text))
    d = d.with_columns(_d_sha=content_sha_expr())
    both = existing.join(d, on=[*THREAD, "entry_id"], how="inner", nulls_equal=True)
    keep = (
        (pl.col("_e_start") == pl.col("_d_start")) & (pl.col("_e_sha") == pl.col("_d_sha"))
        & (pl.col("_e_end").is_null() | (pl.col("_d_end").is_not_null() & (pl.col("_d_end") <= pl.col("_e_end"))))
    ).fill_null(False)
    return both.filter(keep).select(*THREAD, "entry_id", "_d_end", "_d_ok")


def _move_decisions(w: pl.LazyFrame) -> pl.LazyFrame:
    """`move`/`displaced` for the versions whose only change is their order_key (finish records
    content changes only); a version dropped from its first call is not moved."""
    moved = w.filter(alive() & (pl.col("_rep_reason") == "displaced"))
    return decisions_from(moved, action="move", reason="displaced",
                          before_sha256=pl.col("content_sha256"), after_sha256=pl.col("content_sha256"),
                          before_len=content_len_expr(), after_len=content_len_expr())
