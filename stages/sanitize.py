"""L1 sanitize: per-provider message cleaning before any other layer (docs/layers.md).

Nine sub-steps, in the documented order, each a set of column expressions over the blocks table:

1. structural: drop null blocks (a `null` entry of a content list, a text block without text);
2. blank text: drop whitespace-only text blocks of user and assistant rows (a user row left
   without blocks disappears with them);
3. row filter `drop_rows_where` (default: assistant rows marked display-only);
4. failed empty assistant turns get the text `[assistant turn failed before producing content]`,
   except for the calls where such a row is the last row of the request (there it is dropped);
5a. foreign items: blocks of a type the target cannot carry (another provider's server-side tool
   calls and results, hosted-tool items such as `web_search_call`, refusals, files; see
   `ctxreplay.pipeline.targets.NATIVE_BLOCK_TYPES`) become text when they hold text (`foreign_items =
   "to_text"`), else are dropped; for Anthropic, tool-result parts of a foreign type become text;
5. thinking policy and foreign-provider thinking; a row left empty gets
   `[assistant reasoning omitted]`; a kept thinking block is never edited;
6. invalid tool calls (missing id or input, bad or disallowed name): dropped or marked; a row with
   signed thinking and an invalid call is dropped whole; the results of a call this stage drops
   go with it (never left to answer another call); a name valid once trimmed is written trimmed,
   on the call and on its results;
7. non-model fields of tool results (`details`, UI metadata in `extra_json`) are stripped;
8. normalised usage columns u_* and usage_stale (`normalized_usage`, no decisions: raw usage is
   never changed);
9. magic-string scrub in user text and tool-result text, never inside thinking.

Messages are the blocks sharing `msg_key`. Decisions that depend on what follows a row (the
"latest" assistant row, the current tool loop, the last row of a request) take effect from the
first call that sees the later row, so a decision for call k depends only on rows visible at k.
Every changed block version gets exactly one decision; a second pass decides nothing.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import orjson
import polars as pl

from ctxreplay.pipeline.core.blockops import block_schema, sort_blocks
from ctxreplay.pipeline.core.constants import (
    FAILED_TURN_TEXT,
    MAGIC_STRING_PATTERN,
    REASONING_OMITTED_TEXT,
    REDACTED_TEXT,
    THINKING_TYPES,
    THREAD,
    TOOL_CALL_TYPES,
    TOOL_NAME_PATTERN,
    UNAVAILABLE_TOOL_TEXT,
    polars_format,
)
from ctxreplay.pipeline.stageapi.live import Live, LiveRows, LiveRule, LiveThread, nonblank
from ctxreplay.pipeline.stageapi.marks import (
    MSG_NO,
    OPEN,
    THREAD_NO,
    Insert,
    alive,
    cover_end,
    finish,
    mark_drop,
    mark_replace,
    next_message_first_call,
    start_marks,
    text_row,
)
from ctxreplay.pipeline.stageapi.registry import Quiet, StageContext, StageResult, stage
from ctxreplay.pipeline.targets import (
    ANTHROPIC_RESULT_PART_TYPES,
    PORTABLE_BLOCK_TYPES,
    native_block_types,
    target_family,
)

REDACTED = REDACTED_TEXT
MAGIC_PATTERN = MAGIC_STRING_PATTERN

NULL_BLOCK_TYPES = ("null", "none", "")
# A message recorded with no content at all is represented by one row of this type (a loader
# placeholder); the request view skips it.
EMPTY_PLACEHOLDER = "empty"
# Keys of a tool result's extra_json that are never model input: OpenClaw `details`, Claude Code
# `toolUseResult`, UI metadata. (Other keys stay: an unknown part's `part` is what the model saw.)
NON_MODEL_RESULT_KEYS = ("details", "toolUseResult", "display", "ui", "uiMetadata", "metadata")

MSG = ["session_id", "thread_id", "msg_key"]

RowFilter = Literal["assistant_display_only", "display_only", "meta", "sidechain"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Sanitize:
    drop_rows_where: tuple[RowFilter, ...] = ("assistant_display_only",)
    """Rows to drop: assistant_display_only (default), display_only (any role), meta, sidechain."""
    thinking_policy: Literal[
        "keep_signed", "drop_all_but_latest", "drop_all_but_current_tool_turn", "drop_all"
    ] = "keep_signed"
    """Which native thinking blocks stay; unsigned ones never do. Kept blocks are byte-identical."""
    foreign_thinking: Literal["drop", "to_text"] = "drop"
    """Thinking from another provider or API family than the target: drop it or keep its text as text."""
    allowed_tools: tuple[str, ...] | None = None
    """Tool names a call may use (case-insensitive); unset: every valid name."""
    unknown_tool_policy: Literal["drop", "mark"] = "drop"
    """A call with a bad or disallowed name: drop it, or replace it by a text marker naming the tool."""
    scrub_magic: Literal["anthropic", "always", "off"] = "anthropic"
    """Replace refusal/redacted-thinking trigger strings: for Anthropic targets, always, or never."""
    foreign_items: Literal["to_text", "drop"] = "to_text"
    """Blocks of a type the target cannot carry (another provider's server tools, hosted-tool items, refusals): keep their text as text (else drop), or drop them."""


# ----------------------------------------------------------------------------- shared helpers


def row_family_expr() -> pl.Expr:
    """API family that produced a row, from api / provider / source format (null: unknown)."""
    api = pl.col("api").str.to_lowercase()
    provider = pl.col("provider").str.to_lowercase()
    return (
        pl.when(pl.col("source_format").is_in(["claude_code", "anthropic_request"])).then(pl.lit("anthropic"))
        .when(pl.col("source_format") == "codex").then(pl.lit("openai_responses"))
        .when(pl.col("source_format") == "openai_chat_request").then(pl.lit("openai_chat"))
        .when(api.is_not_null() & (api == "anthropic-messages")).then(pl.lit("anthropic"))
        .when(api.is_not_null() & api.str.starts_with("bedrock")).then(pl.lit("anthropic"))
        .when(api.is_not_null() & api.str.contains("responses")).then(pl.lit("openai_responses"))
        .when(api.is_not_null() & api.str.starts_with("openai")).then(pl.lit("openai_chat"))
        .when(api.is_not_null() & api.str.starts_with("google")).then(pl.lit("gemini"))
        .when(api.is_not_null() & api.str.starts_with("mistral")).then(pl.lit("mistral"))
        .when(api.is_null() & provider.is_in(["anthropic", "amazon-bedrock", "bedrock"])).then(pl.lit("anthropic"))
        .otherwise(pl.lit(None, pl.String))
    )


def is_blank(col: str) -> pl.Expr:
    r"""Null, or no character that is not white space. (strip_chars() == "" copied every text, a
    200 MB tool result too; Rust's trim and the regex's \s both mean Unicode White_Space: the two
    agree on every code point.)"""
    return pl.col(col).is_null() | ~pl.col(col).str.contains(r"\S")


def signed_expr() -> pl.Expr:
    """A thinking block carries a signature (redacted thinking: its `data`, kept in text or signature)."""
    return (
        pl.when(pl.col("block_type") == "redacted_thinking")
        .then(~is_blank("signature") | ~is_blank("text"))
        .otherwise(~is_blank("signature"))
    )


# ----------------------------------------------------------------------------- usage (sub-step 8)

USAGE_FIELDS = {
    "u_input": "usage_input",
    "u_output": "usage_output",
    "u_cache_read": "usage_cache_read",
    "u_cache_write": "usage_cache_write",
}


def normalized_usage(blocks: pl.LazyFrame) -> pl.LazyFrame:
    """The blocks with normalised usage columns added (sub-step 8); raw usage columns untouched.

    `u_input, u_output, u_cache_read, u_cache_write` (missing = 0) and `u_total` (their sum) per
    message: of the copies a split message repeats, the one with the largest total counts.
    `usage_stale` is true for assistant rows before the latest compaction-summary row of their
    thread (their recorded usage describes a context that no longer exists).
    """
    filled = {k: pl.col(v).fill_null(0) for k, v in USAGE_FIELDS.items()}
    row_total = pl.sum_horizontal(*filled.values())
    out = blocks.with_columns(_row_total=row_total, **{f"_{k}": e for k, e in filled.items()})
    out = out.with_columns(
        **{k: pl.col(f"_{k}").sort_by("_row_total").last().over(MSG) for k in USAGE_FIELDS},
    ).with_columns(u_total=pl.sum_horizontal(*[pl.col(k) for k in USAGE_FIELDS]))
    latest_summary = (
        pl.when(pl.col("is_compact_summary")).then(pl.col("order_key")).otherwise(None).max().over(THREAD)
    )
    out = out.with_columns(
        usage_stale=(pl.col("role") == "assistant")
        & latest_summary.is_not_null()
        & (pl.col("order_key") < latest_summary).fill_null(False)
    )
    return out.drop("_row_total", *[f"_{k}" for k in USAGE_FIELDS])


# ----------------------------------------------------------------------------- the stage


# ---------------------------------------------------------------------------------------------
# the live rule (ctxreplay.pipeline.stageapi.live): no decision at the new calls of a live step


@dataclass(frozen=True, slots=True)
class LiveCarry:
    """What sanitize carries between live steps."""

    has_thinking: bool  # thinking in the thread (the drop_all_but_* policies decide on later calls)
    unsettled_tail: bool  # an assistant message without content after the last message with content


def unsettled_tail(rows: pl.DataFrame) -> bool:
    """Sanitize decides a failed (empty) assistant turn from the first call that sees a later
    message with content: true when such a message could still come for one (an assistant message
    after the last message with content; content as sanitize counts it, blank texts and
    placeholders not)."""
    content = ~pl.col("block_type").str.to_lowercase().is_in(["null", "none", "", "empty"]) & ~(
        (pl.col("block_type") == "text") & is_blank("text"))
    # a message has content when one of its rows has: the last such message is the last entry_order
    # of a row with content; an assistant row after it (or anywhere, with none) is the unsettled turn
    last = pl.col("entry_order").filter(content.fill_null(False)).max()
    after = (pl.col("entry_order") > last).fill_null(True)
    return bool(rows.select(((pl.col("role") == "assistant") & after).any()).item())


def live_start(thread: LiveThread, params: Sanitize, ctx: StageContext) -> LiveCarry:
    rows = thread.loaded
    return LiveCarry(bool(rows.get_column("block_type").is_in(["thinking", "redacted_thinking"]).any()),
                     unsettled_tail(rows))


_MAGIC_HEAD = "ANTHROPIC_MAGIC_STRING_TRIGGER"
_TOOL_NAME = re.compile(TOOL_NAME_PATTERN.removeprefix("^").removesuffix("$"))  # matched whole (fullmatch)


def live_step(carry: LiveCarry, new: LiveRows, p: Sanitize, ctx: StageContext) -> Live:
    """Quiet when every new row is one sanitize keeps as it is: a non-blank text without a magic
    string, signed thinking it keeps, a well-formed allowed tool call, a plain text tool result;
    no row its row filter drops; and no empty assistant turn waiting for a later message."""
    family = target_family(ctx.target or "anthropic")
    scrub = p.scrub_magic == "always" or (p.scrub_magic == "anthropic" and family == "anthropic")
    if carry.unsettled_tail:
        return Live.full_pass("the thread ends with an assistant turn without content (sanitize decides it at the "
                              "next message)")
    keeps_thinking = p.thinking_policy == "keep_signed" and family == "anthropic"
    if p.thinking_policy in ("drop_all_but_latest", "drop_all_but_current_tool_turn") and carry.has_thinking:
        return Live.full_pass(f"thinking in the thread under thinking_policy {p.thinking_policy}")
    filters = set(p.drop_rows_where)
    allowed = {t.strip().lower() for t in p.allowed_tools} if p.allowed_tools is not None else None
    for r in new.rows:
        bt, role, text = r["block_type"], r["role"], r["text"]
        if (r["is_display_only"] and ("display_only" in filters or ("assistant_display_only" in filters
                                                                    and role == "assistant"))) \
                or (r["is_meta"] and "meta" in filters) or (r["is_sidechain"] and "sidechain" in filters):
            return Live.full_pass("a row the row filter drops")
        if bt == "text":
            if not nonblank(text):
                return Live.full_pass("a blank text block")
            if scrub and role == "user" and _MAGIC_HEAD in text:
                return Live.full_pass("a magic string")
        elif bt == "thinking":
            if not (keeps_thinking and nonblank(r["signature"])):
                return Live.full_pass("a thinking block the thinking policy drops")
        elif bt == "tool_use":
            name = r["tool_name"]
            if not (nonblank(r["tool_use_id"]) and nonblank(r["tool_input"]) and r["tool_input"].strip() != "null"
                    and isinstance(name, str) and _TOOL_NAME.fullmatch(name)
                    and (allowed is None or name.lower() in allowed)):
                return Live.full_pass("a tool call sanitize drops or renames")
        elif bt == "tool_result":
            if r["extra_json"] is not None or r["part_type"] not in ("string", "text"):
                return Live.full_pass("a tool result with fields or parts sanitize changes")
            if scrub and isinstance(text, str) and _MAGIC_HEAD in text:
                return Live.full_pass("a magic string")
        else:
            return Live.full_pass(f"a block of type {bt}")
    has_thinking = carry.has_thinking or any(r["block_type"] == "thinking" for r in new.rows)
    return Live.quiet(LiveCarry(has_thinking, unsettled_tail(new.frame)))


def quiet_check(blocks: pl.LazyFrame, params: Sanitize, ctx: StageContext) -> pl.Expr:
    """Nothing to do but the usage columns (ctxreplay.pipeline.stageapi.quiet): no row any sub-step
    drops, replaces or inserts for. No null, blank or placeholder block, no row the row filter takes,
    no item the target cannot carry, no thinking but native signed thinking kept as it is, every tool
    call with an id, an input and a valid, allowed, trimmed name, no tool result with a non-model
    field (or an escaped key that could hide one), no magic string. Then sub-steps 1-7 and 9 change
    nothing."""
    family = target_family(ctx.target)
    bt = pl.col("block_type")
    is_result = bt == "tool_result"
    flags = [
        bt.is_null() | bt.str.to_lowercase().is_in([*NULL_BLOCK_TYPES, EMPTY_PLACEHOLDER]),
        (bt == "text") & is_blank("text"),
        ~bt.is_in(sorted(PORTABLE_BLOCK_TYPES)),  # (a type only some targets carry: not quiet, the plan decides)
        pl.col("text").str.contains("ANTHROPIC_MAGIC_STRING_TRIGGER_", literal=True),
        is_result & pl.col("extra_json").is_not_null() & (
            pl.col("extra_json").str.contains("\\u", literal=True)
            | pl.any_horizontal([pl.col("extra_json").str.contains(f'"{k}"', literal=True) for k in NON_MODEL_RESULT_KEYS])),
    ]
    if family == "anthropic":
        flags.append(is_result & (pl.col("part_type") == "other"))
    filt = _row_filter_expr(params.drop_rows_where)
    if filt is not None:
        flags.append(filt)
    thinking = bt.is_in(list(THINKING_TYPES))
    if params.thinking_policy == "keep_signed":
        thinking = thinking & ~((row_family_expr() == family).fill_null(False) & signed_expr().fill_null(False))
    flags.append(thinking)
    name = pl.col("tool_name").str.strip_chars()
    bad_call = is_blank("tool_use_id") | is_blank("tool_input") | (pl.col("tool_input").str.strip_chars() == "null") \
        | name.is_null() | ~name.str.contains(TOOL_NAME_PATTERN).fill_null(False) | (name != pl.col("tool_name"))
    if params.allowed_tools is not None:
        bad_call = bad_call | ~name.str.to_lowercase().is_in(sorted({t.strip().lower() for t in params.allowed_tools}))
    flags.append(bt.is_in(list(TOOL_CALL_TYPES)) & bad_call)
    return ~pl.any_horizontal([f.fill_null(False) for f in flags]).any()


def quiet_blocks(blocks: pl.LazyFrame, params: Sanitize, ctx: StageContext) -> pl.LazyFrame:
    """Where the check holds: the blocks in block order with the usage columns filled (sub-step 8)."""
    return normalized_usage(sort_blocks(blocks)).select(block_schema().names())


@stage("sanitize", version=2, params=Sanitize, live=LiveRule(live_start, live_step),  # the first layer: it needs no other
       quiet=Quiet(quiet_check, quiet_blocks, sorted=True))
def sanitize(blocks: pl.LazyFrame, params: Sanitize, ledger: pl.LazyFrame, ctx: StageContext) -> StageResult:
    """Clean messages per provider rules: null and blank blocks, display-only rows, failed turns,
    thinking policy, invalid tool calls, non-model tool-result fields, magic strings.

    Drops, replacements and inserted placeholder rows each get one decision whose reason names the
    sub-step; kept signed thinking is byte-identical; raw columns never change. Normalised usage
    (sub-step 8) fills the u_* and usage_stale columns; it changes no block content.
    """
    family = target_family(ctx.target)
    w = start_marks(blocks)

    # 1. structural: null blocks
    w = mark_drop(
        w,
        pl.col("block_type").str.to_lowercase().is_in(list(NULL_BLOCK_TYPES))
        | ((pl.col("block_type") == "text") & pl.col("text").is_null()),
        "null_block",
    )
    # 2. blank text in user and assistant rows
    w = mark_drop(
        w,
        pl.col("role").is_in(["user", "assistant"]) & (pl.col("block_type") == "text")
        & ~pl.col("text").str.contains(r"\S"),  # blank, as is_blank says it (a null text: step 1)
        "blank_text",
    )
    # 3. row filter
    filt = _row_filter_expr(params.drop_rows_where)
    w = w.with_columns(_filtered=filt.fill_null(False).any().over(MSG_NO) if filt is not None else pl.lit(False))
    w = mark_drop(w, pl.col("_filtered"), "row_filter")
    # 4. failed empty assistant turns
    w, failed_insert = _failed_turns(w)
    # 5a. items the target cannot carry
    w = _foreign_items(w, params, ctx.target or "anthropic")
    # 5. thinking
    w, omitted_insert = _thinking(w, params, family)
    # 6. invalid tool calls
    w = _tool_calls(w, params)
    # 7 + 9. non-model result fields and magic strings (a block changed by both: one decision)
    w = _strip_and_scrub(w, params, family)
    res = finish(w, [failed_insert, omitted_insert])
    # 8. normalised usage columns (derived metadata: no block content changes, no decision)
    return StageResult(normalized_usage(res.blocks).select(block_schema().names()), res.decisions)


def _row_filter_expr(names: Sequence[str]) -> pl.Expr | None:
    exprs = []
    for n in names:
        if n == "assistant_display_only":
            exprs.append((pl.col("role") == "assistant") & pl.col("is_display_only"))
        elif n == "display_only":
            exprs.append(pl.col("is_display_only"))
        elif n == "meta":
            exprs.append(pl.col("is_meta"))
        elif n == "sidechain":
            exprs.append(pl.col("is_sidechain"))
    if not exprs:
        return None
    out = exprs[0]
    for e in exprs[1:]:
        out = out | e
    return out


def _failed_turns(w: pl.LazyFrame) -> tuple[pl.LazyFrame, Insert]:
    """Sub-step 4. A failed empty assistant row loses its placeholders; from the first call that sees
    a later message it reads FAILED_TURN_TEXT. While it is the last row of a request it is absent
    (a trailing failed turn is dropped), so the decision for call k depends only on rows seen at k."""
    usage = [pl.col(c) for c in ("usage_input", "usage_output", "usage_cache_read", "usage_cache_write")]
    w = w.with_columns(
        _n_content=(alive() & (pl.col("block_type") != EMPTY_PLACEHOLDER)).sum().over(MSG_NO),
        _stop=pl.col("stop_reason").max().over(MSG_NO),
        _usage_max=pl.max_horizontal([u.fill_null(0) for u in usage]).max().over(MSG_NO),
        _usage_known=pl.any_horizontal([u.is_not_null() for u in usage]).any().over(MSG_NO),
    ).with_columns(
        _failed=(
            (pl.col("role") == "assistant") & (pl.col("_n_content") == 0) & ~pl.col("_filtered")
            & (
                (pl.col("_stop") == "error")
                | (pl.col("_stop").is_in(["stop", "end_turn"]) & pl.col("_usage_known") & (pl.col("_usage_max") == 0))
            )
        ).fill_null(False),
        _has_content=(pl.col("_n_content") > 0) & ~pl.col("_filtered"),
    ).with_columns(_next_content=next_message_first_call("_has_content"))
    w = mark_drop(w, pl.col("_failed") & (pl.col("block_type") == EMPTY_PLACEHOLDER), "failed_turn")
    start = pl.max_horizontal(pl.col("_next_content"), pl.col("first_call"))
    insert = Insert(
        when=pl.col("_is_first_row") & pl.col("_failed") & pl.col("_next_content").is_not_null() & (start < pl.col("_end")),
        values={**text_row(FAILED_TURN_TEXT, origin="sanitize"),
                "block_pos": (pl.col("_min_pos") - 1).cast(pl.Int32), "first_call": start.cast(pl.Int32)},
        reason="failed_turn",
    )
    return w, insert


def _thinking(w: pl.LazyFrame, params: Sanitize, family: str) -> tuple[pl.LazyFrame, Insert]:
    """Sub-step 5: foreign thinking, the thinking policy, and the reasoning-omitted text for a row
    that this sub-step leaves empty (from the call at which it becomes empty)."""
    is_thinking = pl.col("block_type").is_in(list(THINKING_TYPES))
    w = w.with_columns(
        _native=(row_family_expr() == family).fill_null(False),
        _signed=signed_expr(),
        _is_assistant=pl.col("role") == "assistant",
        _is_real_user=((pl.col("role") == "user") & ~(pl.col("block_type") == "tool_result").any().over(MSG_NO)),
        _cover_before=cover_end(),
    ).with_columns(
        _next_assistant=next_message_first_call("_is_assistant"),
        _next_user=next_message_first_call("_is_real_user"),
    )
    foreign = is_thinking & ~pl.col("_native")
    if params.foreign_thinking == "to_text":
        convertible = foreign & (pl.col("block_type") != "redacted_thinking") & ~is_blank("text")
        w = mark_replace(
            w, convertible,
            {"block_type": pl.lit("text"), "signature": pl.lit(None, pl.String)},
            "foreign_thinking",
        )
        foreign = foreign & ~convertible
    native = is_thinking & pl.col("_native")
    unsigned = native & ~pl.col("_signed")
    w = mark_drop(w, foreign, "foreign_thinking")
    w = mark_drop(w, unsigned, "thinking_unsigned")
    pol = params.thinking_policy
    reason = f"thinking_policy:{pol}"
    if pol == "drop_all":
        w = mark_drop(w, native, reason)
    elif pol == "drop_all_but_latest":
        w = mark_drop(w, native & pl.col("_next_assistant").is_not_null(), reason, pl.col("_next_assistant"))
    elif pol == "drop_all_but_current_tool_turn":
        w = mark_drop(w, native & pl.col("_next_user").is_not_null(), reason, pl.col("_next_user"))

    # a row this sub-step leaves without content gets REASONING_OMITTED_TEXT from then on
    visible_before = pl.col("_cover_before") > pl.col("first_call")
    after = cover_end()
    w = w.with_columns(
        _tail_before=pl.when(visible_before).then(pl.col("_cover_before")).otherwise(None).max().over(MSG_NO),
        _first_before=pl.when(visible_before).then(pl.col("first_call")).otherwise(None).min().over(MSG_NO),
        _tail_after=pl.when(after > pl.col("first_call")).then(after).otherwise(None).max().over(MSG_NO),
        _lost=(is_thinking & visible_before & (after < pl.col("_cover_before"))).any().over(MSG_NO),
    ).with_columns(
        _omit_from=pl.coalesce(pl.col("_tail_after"), pl.col("_first_before")),
    )
    insert = Insert(
        when=pl.col("_is_first_row") & (pl.col("role") == "assistant") & pl.col("_lost")
        & (pl.col("_omit_from") < pl.col("_tail_before")),
        values={**text_row(REASONING_OMITTED_TEXT, origin="sanitize"),
                "block_pos": (pl.col("_min_pos") - 1).cast(pl.Int32),
                "first_call": pl.col("_omit_from").cast(pl.Int32),
                "last_call": pl.when(pl.col("_tail_before") == OPEN).then(None).otherwise(pl.col("_tail_before")).cast(pl.Int32)},
        reason="reasoning_omitted",
    )
    return w, insert


_TEXT_NULLS = ("part_type", "signature", "tool_use_id", "tool_name", "tool_input", "is_error", "image_media_type",
               "image_bytes", "image_width", "image_height", "image_data", "extra_json")


def foreign_expr(target: str) -> pl.Expr:
    """A block of a type this target cannot carry: not portable, and not one of the target's
    provider-specific types coming from its own API family."""
    family = target_family(target)
    bt = pl.col("block_type")
    native = bt.is_in(sorted(native_block_types(target))) & (row_family_expr() == family).fill_null(False)
    return ~bt.is_in(sorted(PORTABLE_BLOCK_TYPES)) & ~native


def _foreign_items(w: pl.LazyFrame, params: Sanitize, target: str) -> pl.LazyFrame:
    """Sub-step 5a: blocks the target cannot carry become text (when they hold text and the policy
    is to_text) or are dropped, reason `foreign_item`. For Anthropic, whose tool results carry their
    parts as they are, a part of a type it does not take (or from another provider) becomes text."""
    foreign = foreign_expr(target) & alive()
    if params.foreign_items == "to_text":
        w = w.with_columns(_f_text=(foreign & ~is_blank("text")).fill_null(False))
        values = {"block_type": pl.lit("text"), **{c: pl.lit(None, block_schema()[c]) for c in _TEXT_NULLS}}
        w = mark_replace(w, pl.col("_f_text"), values, "foreign_item")
        foreign = foreign & ~pl.col("_f_text")
    w = mark_drop(w, foreign, "foreign_item")
    if target_family(target) == "anthropic":
        part = pl.col("extra_json").str.json_path_match("$.part.type")
        own = part.is_in(sorted(ANTHROPIC_RESULT_PART_TYPES)) & (row_family_expr() == "anthropic")
        foreign_part = (
            (pl.col("block_type") == "tool_result") & (pl.col("part_type") == "other") & ~own.fill_null(False)
            & alive() & pl.col("text").is_not_null()
        )
        w = mark_replace(w, foreign_part, {"part_type": pl.lit("text"), "extra_json": pl.lit(None, pl.String)},
                         "foreign_item")
    return w


def _tool_calls(w: pl.LazyFrame, params: Sanitize) -> pl.LazyFrame:
    """Sub-step 6: invalid tool calls are dropped (or marked); a row with signed thinking and an
    invalid call is dropped whole; a row left empty disappears with its blocks. The results that
    answer a call dropped here (or before: a filtered row) are dropped with it, so no later layer
    can take them for another call's result; a call whose name is valid only once trimmed gets the
    trimmed name, and so do its results."""
    is_call = pl.col("block_type").is_in(list(TOOL_CALL_TYPES))
    raw_name = pl.col("tool_name")
    name = raw_name.str.strip_chars()
    missing = is_blank("tool_use_id") | is_blank("tool_input") | (pl.col("tool_input").str.strip_chars() == "null")
    bad_name = name.is_null() | ~name.str.contains(TOOL_NAME_PATTERN).fill_null(False)
    if params.allowed_tools is not None:
        allowed = sorted({t.strip().lower() for t in params.allowed_tools})
        bad_name = bad_name | ~name.str.to_lowercase().is_in(allowed).fill_null(False)
    w = w.with_columns(
        _invalid=(is_call & alive() & (missing | bad_name)).fill_null(False),
        _missing=(is_call & missing).fill_null(False),
    ).with_columns(
        _row_invalid=pl.col("_invalid").any().over(MSG_NO),
        _row_signed=(pl.col("block_type").is_in(list(THINKING_TYPES)) & alive() & signed_expr()).any().over(MSG_NO),
    )
    # per call occurrence (the latest earlier call with the result's id, in thread order): does the
    # call leave the request here, is its name trimmed
    has_id = ~is_blank("tool_use_id")
    is_result = (pl.col("block_type") == "tool_result") & has_id
    w = w.with_columns(
        _call_gone=pl.when(is_call & has_id).then(
            ~alive() | pl.col("_invalid") | (pl.col("_row_invalid") & pl.col("_row_signed"))),
        _call_trim=pl.when(is_call & has_id).then(
            alive() & ~pl.col("_invalid") & (raw_name != name).fill_null(False)),
    ).with_columns(
        _call_gone=pl.col("_call_gone").forward_fill().over([THREAD_NO, "tool_use_id"]),
        _call_trim=pl.col("_call_trim").forward_fill().over([THREAD_NO, "tool_use_id"]),
    )
    w = mark_drop(w, pl.col("_row_invalid") & pl.col("_row_signed"), "invalid_tool_call_in_signed_row")
    w = mark_drop(w, is_result & pl.col("_call_gone").fill_null(False), "call_dropped")
    trim_result = is_result & pl.col("_call_trim").fill_null(False) & pl.col("part_type").ne_missing("tool_reference") \
        & (raw_name != name).fill_null(False)
    w = mark_replace(w, (is_call & pl.col("_call_trim").fill_null(False) & ~pl.col("_invalid")) | trim_result,
                     {"tool_name": name}, "tool_name")
    if params.unknown_tool_policy == "mark":
        w = w.with_columns(_markable=pl.col("_invalid") & ~pl.col("_missing") & ~is_blank("tool_name") & alive())
        values = text_row(pl.format(polars_format(UNAVAILABLE_TOOL_TEXT), name), origin="sanitize")
        values.pop("origin")
        values.pop("part_pos")
        w = mark_replace(w, pl.col("_markable"), values, "unknown_tool")
        w = w.with_columns(_invalid=pl.col("_invalid") & ~pl.col("_markable"))
    return mark_drop(w, pl.col("_invalid"), "invalid_tool_call")


def _strip_extra(s: pl.Series) -> pl.Series:
    out: list[str | None] = []
    for v in s.to_list():
        if v is None:
            out.append(None)
            continue
        try:
            obj = orjson.loads(v)
        except orjson.JSONDecodeError:
            out.append(v)
            continue
        if not isinstance(obj, dict):
            out.append(v)
            continue
        if not any(k in obj for k in NON_MODEL_RESULT_KEYS):
            out.append(v)
            continue
        kept = {k: x for k, x in obj.items() if k not in NON_MODEL_RESULT_KEYS}
        out.append(orjson.dumps(kept, option=orjson.OPT_SORT_KEYS).decode() if kept else None)
    return pl.Series(out, dtype=pl.String)


def _strip_extra_masked(s: pl.Series) -> pl.Series:
    """`extra_json` with `_strip_extra` applied where `_mask` holds (only those rows are parsed)."""
    df = s.struct.unnest()
    extra = df.get_column("extra_json").clone()
    m = df.get_column("_mask").fill_null(False)
    if m.any():
        idx = m.arg_true()
        extra = extra.scatter(idx, _strip_extra(extra.gather(idx)))
    return extra


def _strip_and_scrub(w: pl.LazyFrame, params: Sanitize, family: str) -> pl.LazyFrame:
    """Sub-steps 7 and 9: non-model fields of tool results; magic strings in user and result text."""
    is_result = pl.col("block_type") == "tool_result"
    strip = is_result & pl.col("extra_json").is_not_null()
    w = w.with_columns(
        _new_extra=pl.struct(strip.alias("_mask"), "extra_json").map_batches(_strip_extra_masked, return_dtype=pl.String)
    )
    w = mark_replace(w, ~pl.col("_new_extra").eq_missing(pl.col("extra_json")),
                     {"extra_json": pl.col("_new_extra")}, "strip_result_fields")
    scrub_on = params.scrub_magic == "always" or (params.scrub_magic == "anthropic" and family == "anthropic")
    if scrub_on:
        scrub = (
            (((pl.col("role") == "user") & (pl.col("block_type") == "text")) | is_result)
            & pl.col("text").str.contains(MAGIC_PATTERN).fill_null(False)
        )
        w = mark_replace(w, scrub, {"text": pl.col("text").str.replace_all(MAGIC_PATTERN, REDACTED)}, "magic_string")
    return w
