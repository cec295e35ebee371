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
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

import polars as pl

from pipeline.blockops import (
    BLOCK_SCHEMA,
    block_json_expr,
    content_len_expr,
    content_sha_expr,
    decisions_from,
    drop_where,
    new_rows,
    sha256_hex,
    synthetic_id_expr,
)
from pipeline.calls import BLOCK_KEY, THREAD, TOOL_CALL_TYPES, materialize, open_max
from pipeline.registry import StageContext, StageResult, stage
from pipeline.targets import target_family
from schemas.decisions import STAGE_DECISION

MISSING_TEXT_OPENAI = "aborted"
MISSING_TEXT = "[tool result missing: the call was interrupted or its result was not recorded]"
FAILED_STOP_REASONS = ("error", "aborted")

BLOCK = BLOCK_KEY
MSG = ["session_id", "thread_id", "msg_key"]
POS_SHIFT = 1 << 20  # position of a block in its thread: order_key * POS_SHIFT + block_pos

ANTHROPIC_ID = re.compile(r"^[A-Za-z0-9_-]+$")


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


@stage("pairing", version=2, params=Pairing, requires=("sanitize",))
def pairing(blocks: pl.LazyFrame, params: Pairing, ledger: pl.LazyFrame, ctx: StageContext) -> StageResult:
    """Pair every tool call with exactly one result, right after it, in call order.

    Moves displaced results (`move`/`displaced`), drops orphans, duplicates and failed frames
    (`drop`/`orphan`, `duplicate`, `failed_frame`), inserts synthetic results for calls never
    answered (`insert`/`missing`, closed by `drop`/`superseded` when the real result arrives),
    rewrites tool-call ids per target (`replace`/`tool_id`), re-attaches results without a call
    (`replace`/`reattached`) and trims result names (`replace`/`result_name`).
    """
    target = ctx.target
    mode = resolve_id_mode(params.tool_id_mode, target)
    text = missing_text(params, target)

    b = blocks.with_columns(
        _pos=pl.col("order_key") * POS_SHIFT + pl.col("block_pos"),
        _failed=(
            (pl.col("role") == "assistant")
            & pl.col("stop_reason").str.to_lowercase().is_in(FAILED_STOP_REASONS).fill_null(False)
        ).any().over(MSG),
    )
    b = materialize(b)
    is_call = pl.col("block_type").is_in(list(TOOL_CALL_TYPES)) & (pl.col("role") == "assistant")
    is_synthetic = (pl.col("block_type") == "tool_result") & (pl.col("origin") == "pairing")
    is_result = (pl.col("block_type") == "tool_result") & (pl.col("origin") != "pairing")

    # ---- calls: one row per tool_use block (all its versions)
    calls = (
        b.filter(is_call)
        .group_by(BLOCK)
        .agg(
            pl.col("msg_key").first(),
            pl.col("order_key").min(),
            pl.col("_pos").min(),
            pl.col("tool_use_id").sort_by("first_call").first().alias("_cid"),
            pl.col("tool_name").sort_by("first_call").first().alias("_cname"),
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
    # ids: map per occurrence, then resolve collisions first come first kept
    calls = calls.with_columns(_cand=pl.when("_has_id").then(_map_ids_expr(mode, target)))
    calls = calls.with_columns(
        _collides=(pl.col("_pos").rank("ordinal").over([*THREAD, "_cand"]) > 1) & pl.col("_has_id"))
    calls = calls.with_columns(_new_cid=pl.when("_has_id").then(_collision_expr(mode))).drop("_cand", "_collides")
    calls = materialize(calls)

    # ---- results: one row per tool_result block (all its versions)
    results = (
        b.filter(is_result)
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

    # 1. match by id, per occurrence: the latest earlier call with this id
    call_ids = calls.filter("_has_id").select(
        *THREAD, pl.col("_cid").alias("_rid"), "_pos",
        pl.col("entry_id").alias("_c_entry"), pl.col("block_pos").alias("_c_bp"),
    )
    results = _latest_before(results, call_ids, by=[*THREAD, "_rid"], cols=["_c_entry", "_c_bp"])

    # 2. orphans: the frame they sit in (latest tool-call assistant row before them)
    frames = (
        calls.filter(~pl.col("_drop_frame"))
        .group_by(MSG)
        .agg(pl.col("order_key").min().alias("_fok"))
        .select(*THREAD, pl.col("msg_key").alias("_frame"), _pos=pl.col("_fok") * POS_SHIFT)
    )
    results = _latest_before(results, frames, by=THREAD, cols=["_frame"])
    # a call is resolved from the first call that sees a result carrying its own id
    first_match = (
        results.filter(pl.col("_c_entry").is_not_null())
        .group_by(*THREAD, "_c_entry", "_c_bp")
        .agg(pl.col("_fr").min().alias("_first_match"))
    )
    owners = calls.filter(pl.col("_has_id") & ~pl.col("_drop_frame")).join(
        first_match, left_on=BLOCK, right_on=[*THREAD, "_c_entry", "_c_bp"], how="left",
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
    results = results.join(cand, on=BLOCK, how="left").with_columns(
        _attached=pl.col("_c_entry").is_null() & pl.col("_o_entry").is_not_null(),
        _c_entry=pl.coalesce("_c_entry", "_o_entry"),
        _c_bp=pl.coalesce("_c_bp", "_o_bp"),
    ).drop("_o_entry", "_o_bp", "_frame")

    # 3. duplicates (first real result by position wins) and fates
    cinfo = calls.select(
        *THREAD, pl.col("entry_id").alias("_c_entry"), pl.col("block_pos").alias("_c_bp"),
        "_new_cid", "_cname", "_drop_frame", "_lc", "_fc",
    )
    results = results.join(cinfo, on=[*THREAD, "_c_entry", "_c_bp"], how="left")
    # The call's own result (matched by its id) always wins over a re-attached one; a result that
    # an earlier pass closed before its call leaves (a stand-in, see below) ranks after the others.
    per_call = [*THREAD, "_c_entry", "_c_bp"]
    results = results.with_columns(
        _stand_in=(pl.col("_lr").is_not_null() & _lt_open(pl.col("_lr"), pl.col("_lc"))),
    ).with_columns(
        _rank=pl.struct(pl.col("_attached").cast(pl.Int8), pl.col("_stand_in").cast(pl.Int8), "_pos", "_fr")
        .rank("ordinal").over(per_call),
    ).with_columns(
        _p_fr=pl.col("_fr").filter(pl.col("_rank") == 1).first().over(per_call),
    ).with_columns(
        # a re-attached result (or one an earlier pass made a stand-in) seen before the call's own
        # result stands in for it until then, like a synthetic one: it never sits beside it
        _interim=(pl.col("_rank") > 1) & (pl.col("_attached") | pl.col("_stand_in"))
        & (pl.col("_fr") < pl.col("_p_fr")),
    ).with_columns(
        # one stand-in per call: the first candidate
        _interim=pl.col("_interim")
        & (pl.col("_rank") == pl.col("_rank").filter(pl.col("_interim")).min().over(per_call)),
    )
    results = results.with_columns(
        _drop_reason=pl.when(pl.col("_c_entry").is_null()).then(pl.lit("orphan"))
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
        _drop_from=pl.when(pl.col("_drop_reason").is_not_null() & pl.col("_c_entry").is_not_null()
                           & ~pl.col("_drop_frame") & (pl.col("_rank") == 1))
        .then(pl.col("_lc"))
        .when(pl.col("_interim") & ~pl.col("_drop_frame"))
        .then(pl.min_horizontal(pl.col("_p_fr"), pl.col("_lc")))
        .otherwise(pl.lit(None, pl.Int32)),
        _chosen=pl.col("_c_entry").is_not_null() & ~pl.col("_drop_frame").fill_null(False) & (pl.col("_rank") == 1),
    ).with_columns(_interim=pl.col("_interim") & pl.col("_c_entry").is_not_null()
                   & ~pl.col("_drop_frame").fill_null(False))
    results = materialize(results)

    # ---- per call: its chosen result, synthetic need, slot
    chosen = results.filter("_chosen").select(
        *THREAD, "_c_entry", "_c_bp", "_rok", pl.col("_pos").alias("_rpos"), "_fr", "_lr",
    )
    # the first call that sees an answer (its own result, or a stand-in before it)
    answered = results.filter(pl.col("_chosen") | pl.col("_interim")).group_by(per_call).agg(
        _first_answer=pl.col("_fr").min())
    cf = calls.filter(pl.col("_has_id") & ~pl.col("_drop_frame")).join(
        chosen, left_on=BLOCK, right_on=[*THREAD, "_c_entry", "_c_bp"], how="left",
    ).join(answered, left_on=BLOCK, right_on=per_call, how="left").with_columns(_present=pl.col("_rok").is_not_null())
    synth_end = pl.min_horizontal(pl.col("_first_answer"), pl.col("_lc"))
    cf = cf.with_columns(
        _s_end=synth_end,
        _need=~pl.col("_no_synth") & _lt_open(pl.col("_fc"), synth_end),
    )
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
    dropped_blocks = results.filter(pl.col("_drop_reason").is_not_null() & pl.col("_drop_from").is_null()).select(BLOCK)
    chosen_blocks = results.filter(pl.col("_chosen") | pl.col("_interim")).select(BLOCK)
    dropped_msgs = calls.filter("_drop_frame").select(MSG).unique()
    others = (
        b.filter(pl.col("origin") != "pairing")
        .join(chosen_blocks, on=BLOCK, how="anti")
        .join(dropped_blocks, on=BLOCK, how="anti")
        .join(dropped_msgs, on=MSG, how="anti")
        .group_by(*THREAD, "order_key").agg(_n=pl.len())
    )
    fr = cf.group_by(MSG).agg(pl.col("order_key").first().alias("_a"), pl.col("_span_end").first(),
                              pl.col("_row_ok").all())
    fr = _count_upto(fr, others, at="_a", out="_cum_a")
    fr = _count_upto(fr, others, at="_span_end", out="_cum_l")
    fr = fr.with_columns(_in_place=pl.col("_row_ok") & (pl.col("_cum_l") == pl.col("_cum_a"))).select(*MSG, "_in_place")
    cf = cf.join(fr, on=MSG, how="left").with_columns(
        _slot=pl.when("_in_place").then(pl.col("_slot_in")).otherwise(pl.col("order_key") + pl.col("_crank")),
    )
    cf = materialize(cf)

    # ---- row updates
    res_upd = results.join(
        cf.select(*THREAD, pl.col("entry_id").alias("_c_entry"), pl.col("block_pos").alias("_c_bp"), "_slot"),
        on=[*THREAD, "_c_entry", "_c_bp"], how="left",
    ).with_columns(_answers=pl.col("_chosen") | pl.col("_interim")).with_columns(
        _u_id=pl.when("_answers").then("_new_cid"),
        _u_name=pl.when(pl.col("_answers") & pl.col("_attached")).then(
            pl.when(_blank("_rname")).then(pl.coalesce(pl.col("_cname").str.strip_chars(), pl.lit("unknown")))
            .otherwise(pl.col("_rname").str.strip_chars()))
        .when(pl.col("_answers") & pl.col("_rname").is_not_null()).then(
            pl.when(_blank("_rname")).then(
                pl.when(_blank("_cname")).then(pl.lit("unknown")).otherwise(pl.col("_cname").str.strip_chars()))
            .otherwise(pl.col("_rname").str.strip_chars())),
        _u_err=pl.when(pl.col("_answers") & pl.col("_attached") & ~pl.col("_rhas_id")).then(pl.lit(True)),
        _u_ok=pl.when("_answers").then(pl.col("_slot")),
        _u_reason=pl.when(pl.col("_attached")).then(pl.lit("reattached")).otherwise(pl.lit(None, pl.String)),
    ).select(*BLOCK, "_u_id", "_u_name", "_u_err", "_u_ok", "_u_reason", "_drop_reason", "_drop_from")
    call_upd = calls.select(*BLOCK, _u_cid=pl.when(~pl.col("_drop_frame")).then(pl.col("_new_cid")))
    msg_drop = dropped_msgs.with_columns(_drop_msg=pl.lit("failed_frame"))

    x = (
        b.join(res_upd, on=BLOCK, how="left")
        .join(call_upd, on=BLOCK, how="left")
        .join(msg_drop, on=MSG, how="left")
        .with_columns(
            _u_id=pl.when(is_call).then(pl.col("_u_cid")).when(is_result).then(pl.col("_u_id")),
            _u_name=pl.when(pl.col("part_type").ne_missing("tool_reference")).then(pl.col("_u_name")),
            _drop_reason=pl.when(is_synthetic).then(pl.lit(None, pl.String))
            .otherwise(pl.coalesce("_drop_msg", "_drop_reason")),
            _drop_from=pl.when(pl.col("_drop_msg").is_not_null()).then(pl.lit(None, pl.Int32))
            .otherwise(pl.col("_drop_from")),
        )
    )
    cols = list(BLOCK_SCHEMA.names())

    # content and order updates (on every version; ids are decided when the call first appears)
    touch = (pl.col("_u_id").is_not_null() & (pl.col("_u_id") != pl.col("tool_use_id")).fill_null(True)) \
        | (pl.col("_u_name").is_not_null() & (pl.col("_u_name") != pl.col("tool_name")).fill_null(True)) \
        | (pl.col("_u_err").is_not_null() & (pl.col("_u_err") != pl.col("is_error")).fill_null(True)) \
        | (pl.col("_u_ok").is_not_null() & (pl.col("_u_ok") != pl.col("order_key")))
    x = materialize(x.with_columns(_touch=touch.fill_null(False)))
    rest = x.filter(~pl.col("_touch"))
    t = x.filter("_touch").with_columns(_old_sha=pl.col("content_sha256"), _old_len=content_len_expr(),
                                        _old_ok=pl.col("order_key"), _old_id=pl.col("tool_use_id"))
    t = t.with_columns(
        tool_use_id=pl.coalesce("_u_id", "tool_use_id"),
        tool_name=pl.coalesce("_u_name", "tool_name"),
        is_error=pl.coalesce("_u_err", "is_error"),
        order_key=pl.coalesce("_u_ok", "order_key"),
    ).with_columns(content_sha256=content_sha_expr())
    t = t.with_columns(
        _changed=pl.col("content_sha256") != pl.col("_old_sha"),
        _moved=pl.col("order_key") != pl.col("_old_ok"),
    )
    content_reason = pl.when(pl.col("_u_reason").is_not_null()).then(pl.col("_u_reason")) \
        .when(pl.col("_u_id").is_not_null() & (pl.col("_u_id") != pl.col("_old_id")).fill_null(True)) \
        .then(pl.lit("tool_id")).otherwise(pl.lit("result_name"))
    upd_dec = decisions_from(
        t.filter(pl.col("_changed") | pl.col("_moved")),
        action=pl.when("_changed").then(pl.lit("replace")).otherwise(pl.lit("move")),
        reason=pl.concat_str(
            [pl.when("_changed").then(content_reason), pl.when("_moved").then(pl.lit("displaced"))],
            separator="+", ignore_nulls=True),
        before_sha256=pl.col("_old_sha"),
        after_sha256=pl.col("content_sha256"),
        before_len=pl.col("_old_len"),
        after_len=content_len_expr(),
        replacement=pl.when("_changed").then(block_json_expr()),
    )
    t = materialize(t)
    x = pl.concat([rest.select(*cols, "_drop_reason", "_drop_from"), t.select(*cols, "_drop_reason", "_drop_from")])

    # drops (whole, or from the call where the row's call leaves the request)
    kept, drop_dec = drop_where(materialize(x), pl.col("_drop_reason").is_not_null(), reason=pl.col("_drop_reason"),
                                from_call=pl.coalesce("_drop_from", "first_call"))
    kept = materialize(kept)

    # ---- synthetic results: desired (D) against existing (E)
    call_rows = (
        b.filter(is_call)
        .sort("first_call", "part_pos")
        .group_by(BLOCK).agg(pl.all().first())
        .select(*BLOCK, "source_format", "source_file", "source_line", "entry_order", "timestamp",
                "is_sidechain", "cache_epoch")
    )
    d = (
        cf.filter("_need")
        .join(call_rows, on=BLOCK, how="left")
        .with_columns(
            _src=pl.concat_str([pl.col("entry_id"), pl.col("block_pos").cast(pl.String)], separator="#"),
        )
        .with_columns(_sid=synthetic_id_expr("pairing", "missing_result", pl.col("_src"), 0))
    )
    d = new_rows(
        d,
        keep=(*THREAD, "source_format", "source_file", "source_line", "entry_order", "timestamp", "is_sidechain",
              "cache_epoch"),
        raw_line=pl.lit(""),
        order_key=pl.col("_slot"),
        entry_id=pl.col("_sid"),
        parent_id=pl.col("entry_id"),
        msg_key=pl.col("_sid"),
        role=pl.lit("tool"),
        is_call=pl.lit(False),
        first_call=pl.col("_fc").cast(pl.Int32),
        last_call=pl.col("_s_end").cast(pl.Int32),
        block_pos=pl.lit(0, pl.Int32),
        part_pos=pl.lit(0, pl.Int32),
        block_type=pl.lit("tool_result"),
        part_type=pl.lit("string"),
        text=pl.lit(text),
        tool_use_id=pl.col("_new_cid"),
        tool_name=pl.when(_blank("_cname")).then(pl.lit("unknown")).otherwise(pl.col("_cname").str.strip_chars()),
        is_error=pl.lit(True),
        is_meta=pl.lit(False),
        is_compact_summary=pl.lit(False),
        is_display_only=pl.lit(False),
        content_sha256=pl.lit(""),
        origin=pl.lit("pairing"),
    ).with_columns(content_sha256=content_sha_expr())
    existing = kept.filter(is_synthetic)
    kept = kept.filter(~is_synthetic)
    e_sum = existing.group_by(THREAD + ["entry_id"]).agg(
        _e_start=pl.col("first_call").min(),
        _e_end=open_max("last_call"),
        _e_sha=pl.col("content_sha256").sort_by("first_call").first(),
        _e_ok=pl.col("order_key").first(),
    )
    dk = d.select(*THREAD, "entry_id", pl.col("first_call").alias("_d_start"), pl.col("last_call").alias("_d_end"),
                  pl.col("content_sha256").alias("_d_sha"), pl.col("order_key").alias("_d_ok"))
    both = e_sum.join(dk, on=[*THREAD, "entry_id"], how="full", coalesce=True, nulls_equal=True).with_columns(
        _same_start=(pl.col("_e_start") == pl.col("_d_start")).fill_null(False),
        _same_sha=(pl.col("_e_sha") == pl.col("_d_sha")).fill_null(False),
    ).with_columns(
        # E kept (possibly shortened / re-slotted) when it starts where D starts with D's content
        _keep_e=pl.col("_e_start").is_not_null() & pl.col("_d_start").is_not_null() & pl.col("_same_start")
        & pl.col("_same_sha")
        & (pl.col("_e_end").is_null() | (pl.col("_d_end").is_not_null() & (pl.col("_d_end") <= pl.col("_e_end")))),
    )
    keep_e = both.filter("_keep_e").select(*THREAD, "entry_id", "_d_end", "_d_ok")
    ex = existing.join(keep_e, on=[*THREAD, "entry_id"], how="left", nulls_equal=True)
    # E rows not kept: dropped whole (superseded)
    e_gone = ex.join(keep_e.select(*THREAD, "entry_id"), on=[*THREAD, "entry_id"], how="anti")
    e_keep = ex.join(keep_e.select(*THREAD, "entry_id"), on=[*THREAD, "entry_id"], how="semi")
    gone_dec = decisions_from(e_gone, action="drop", reason="superseded", before_sha256=pl.col("content_sha256"),
                              before_len=content_len_expr())
    # kept E rows: close at D's end (the real result arrived), follow D's slot
    e_keep = e_keep.with_columns(
        _close=pl.col("_d_end").is_not_null() & (pl.col("last_call").is_null() | (pl.col("last_call") > pl.col("_d_end"))),
        _moved=pl.col("order_key") != pl.col("_d_ok"),
    )
    close_dec = decisions_from(
        e_keep.filter("_close").with_columns(first_call=pl.max_horizontal("first_call", "_d_end").cast(pl.Int32)),
        action="drop", reason="superseded", before_sha256=pl.col("content_sha256"), before_len=content_len_expr(),
    )
    move_dec = decisions_from(
        e_keep.filter(pl.col("_moved") & ~(pl.col("_close") & (pl.col("_d_end") <= pl.col("first_call")))),
        action="move", reason="displaced", before_sha256=pl.col("content_sha256"),
        after_sha256=pl.col("content_sha256"), before_len=content_len_expr(), after_len=content_len_expr(),
    )
    e_out = (
        e_keep.filter(~(pl.col("_close") & (pl.col("_d_end") <= pl.col("first_call"))))
        .with_columns(
            last_call=pl.when("_close").then(pl.col("_d_end")).otherwise(pl.col("last_call")).cast(pl.Int32),
            order_key=pl.col("_d_ok"),
        )
        .select(cols)
    )
    new_d = d.join(keep_e.select(*THREAD, "entry_id"), on=[*THREAD, "entry_id"], how="anti")
    ins_dec = decisions_from(new_d, action="insert", reason="missing", after_sha256=pl.col("content_sha256"),
                             after_len=content_len_expr(), replacement=block_json_expr())

    out = pl.concat([kept, e_out, new_d.select(cols)]).select(cols)
    decisions = pl.concat([upd_dec, drop_dec, gone_dec, close_dec, move_dec, ins_dec]).select(
        list(STAGE_DECISION.names))
    return StageResult(out, decisions)
