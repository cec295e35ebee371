"""L2 inter_session: mark user rows that came from another session (docs/layers.md).

OpenClaw injects what a subagent or another session produced as a *user* message with
`provenance.kind = "inter_session"`; without a marker the model takes it for its user's words.
This layer prepends a one-line header naming the source, and (v2) an explanation line, to the
first text block of each such row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import polars as pl

from ctxreplay.pipeline.core.constants import (
    INTER_SESSION_EXPLANATION,
    INTER_SESSION_HEADER,
    INTER_SESSION_NO_TEXT_BODY,
)
from ctxreplay.pipeline.stageapi.live import Live, LiveRows, LiveRule, LiveThread
from ctxreplay.pipeline.stageapi.marks import (
    MSG_NO,
    Insert,
    alive,
    finish,
    mark_drop,
    mark_replace,
    start_marks,
    text_row,
)
from ctxreplay.pipeline.stageapi.registry import Quiet, StageContext, StageResult, stage

HEADER_BASE = INTER_SESSION_HEADER
EXPLANATION = INTER_SESSION_EXPLANATION
NO_TEXT_BODY = INTER_SESSION_NO_TEXT_BODY
FIELDS = (("sourceSession", "provenance_source_session"), ("sourceChannel", "provenance_channel"),
          ("sourceTool", "provenance_tool"))

# Characters percent-encoded in header values: '%' first (so encoding is reversible), space, '=',
# C0 and C1 controls, DEL, and the Unicode line/paragraph separators, so that a value can never
# break the header's single line whatever the reader's idea of a line break is.
_ENCODED = ["%", " ", "="] + [chr(c) for c in range(0x20)] + ["\x7f"] + [chr(c) for c in range(0x80, 0xA0)] \
    + ["\u2028", "\u2029"]


_ENCODE_MAP = {ch: "".join(f"%{b:02X}" for b in ch.encode("utf-8")) for ch in _ENCODED}


def percent_encode_text(value: str) -> str:
    """Percent-encode (UTF-8 bytes, upper-case hex) the characters of `_ENCODED` in a value."""
    return "".join(_ENCODE_MAP.get(ch, ch) for ch in value)


def _encode_batch(s: pl.Series) -> pl.Series:
    return pl.Series([None if v is None else percent_encode_text(v) for v in s.to_list()], dtype=pl.String)


def percent_encode(value: pl.Expr) -> pl.Expr:
    """`percent_encode_text` over a column (provenance values are few; nulls pass through)."""
    return value.map_batches(_encode_batch, return_dtype=pl.String)


@dataclass(frozen=True, slots=True, kw_only=True)
class InterSession:
    prefix_version: Literal["v2", "v1"] = "v2"
    """v2: header with ` isUser=false` plus an explanation line; v1: header only (byte parity)."""


def header_expr(prefix_version: str) -> pl.Expr:
    """The one-line header of a row, from its provenance columns."""
    parts: list[pl.Expr] = [pl.lit(HEADER_BASE)]
    for label, col in FIELDS:
        parts.append(
            pl.when(pl.col(col).is_not_null())
            .then(pl.concat_str([pl.lit(f" {label}="), percent_encode(pl.col(col))]))
            .otherwise(pl.lit(""))
        )
    if prefix_version == "v2":
        parts.append(pl.lit(" isUser=false"))
    return pl.concat_str(parts)


def _envelope_tail(prefix_version: str) -> str:
    """What follows the header in the envelope prepended to the first text block: a newline and,
    in v2, the explanation line."""
    return "\n" + EXPLANATION + "\n" if prefix_version == "v2" else "\n"


def _envelope_facts(w: pl.LazyFrame, params: InterSession) -> pl.LazyFrame:
    """Per row: is it a target, its header and envelope, is it the message's first text block, and
    per message: is the envelope already at the top, or found elsewhere."""
    target = (pl.col("role") == "user") & (pl.col("provenance_kind") == "inter_session")
    is_text = target & (pl.col("block_type") == "text") & alive() & pl.col("text").is_not_null()
    w = w.with_columns(
        _target=target.fill_null(False),
        _hdr=pl.when(target).then(header_expr(params.prefix_version)).otherwise(None),
        _is_text=is_text.fill_null(False),
    ).with_columns(
        _env=pl.concat_str([pl.col("_hdr"), pl.lit(_envelope_tail(params.prefix_version))]),
        _hdr_line=pl.concat_str([pl.col("_hdr"), pl.lit("\n")]),
    ).with_columns(
        _first_text_pos=pl.when("_is_text").then(pl.col("block_pos")).otherwise(None).min().over(MSG_NO),
    ).with_columns(
        _is_first_text=pl.col("_is_text") & (pl.col("block_pos") == pl.col("_first_text_pos")),
    ).with_columns(
        _at_top=pl.col("_is_first_text") & pl.col("text").str.starts_with(pl.col("_env")),
        _has_hdr=pl.col("_is_text") & pl.col("text").str.contains(pl.col("_hdr_line"), literal=True),
    ).with_columns(
        _msg_at_top=(pl.col("_at_top") | ~pl.col("_is_first_text")).all().over(MSG_NO)
        & pl.col("_is_first_text").any().over(MSG_NO),
        _msg_elsewhere=(pl.col("_has_hdr") & ~pl.col("_at_top")).any().over(MSG_NO),
        _msg_has_text=pl.col("_is_text").any().over(MSG_NO),
    )
    return w


def live_start(thread: LiveThread, params: InterSession, ctx: StageContext) -> None:
    return None


def live_step(carry: None, new: LiveRows, params: InterSession, ctx: StageContext) -> Live:
    """The live rule: quiet unless a new row comes from another session (the header it prepends)."""
    if any(r["provenance_kind"] == "inter_session" for r in new.rows):
        return Live.full_pass("a message from another session")
    return Live.quiet()


def quiet_check(blocks: pl.LazyFrame, params: InterSession, ctx: StageContext) -> pl.Expr:
    """Nothing to do (ctxreplay.pipeline.stageapi.quiet): no user row routed from another session."""
    return ~((pl.col("role") == "user") & (pl.col("provenance_kind") == "inter_session")).fill_null(False).any()


@stage("inter_session", version=1, params=InterSession, live=LiveRule(live_start, live_step), quiet=Quiet(quiet_check))
def inter_session(blocks: pl.LazyFrame, params: InterSession, ledger: pl.LazyFrame, ctx: StageContext) -> StageResult:
    """Prepend the inter-session header (and v2 explanation) to user rows routed from elsewhere.

    The first text block gets the envelope (`annotate`); a row without text gets a new text block
    before its first block (`insert`); an envelope found elsewhere in the row is moved to the top
    (`move_envelope`). A row whose first text block already starts with it is left alone.
    """
    w = _envelope_facts(start_marks(blocks), params)
    todo = pl.col("_target") & pl.col("_msg_has_text") & ~pl.col("_msg_at_top")
    move = todo & pl.col("_msg_elsewhere")

    # move: strip the envelope (or a bare header line) wherever it is, then re-add it at the top;
    # a header is only recognised as a whole line, so a v1 header never matches inside a v2 one
    stripped = (
        pl.col("text").str.split(pl.col("_env")).list.join("")
        .str.split(pl.col("_hdr_line")).list.join("")
    )
    w = w.with_columns(
        _new_text=pl.when(move & pl.col("_is_text")).then(stripped).otherwise(pl.col("text")),
    )
    w = w.with_columns(
        _new_text=pl.when(todo & pl.col("_is_first_text"))
        .then(pl.concat_str([pl.col("_env"), pl.col("_new_text")]))
        .otherwise(pl.col("_new_text")),
    )
    # a block that held only the envelope and is not the first text block is left empty: drop it
    w = mark_drop(w, move & pl.col("_is_text") & ~pl.col("_is_first_text")
                  & (pl.col("_new_text").str.strip_chars() == ""), "move_envelope")
    w = mark_replace(
        w, todo & pl.col("_is_text") & (pl.col("_new_text") != pl.col("text")),
        {"text": pl.col("_new_text")},
        pl.when(move).then(pl.lit("move_envelope")).otherwise(pl.lit("inter_session_header")),
    )

    # a row without any text block gets one before its first block
    body = "\n" + EXPLANATION + "\n" + NO_TEXT_BODY if params.prefix_version == "v2" else "\n" + NO_TEXT_BODY
    insert = Insert(
        when=pl.col("_target") & pl.col("_is_first_row") & ~pl.col("_msg_has_text"),
        values={**text_row(pl.concat_str([pl.col("_hdr"), pl.lit(body)]), origin="inter_session"),
                "block_pos": (pl.col("_min_pos") - 1).cast(pl.Int32)},
        reason="inter_session_header",
    )
    action = pl.when(pl.col("_rep_reason") == "move_envelope").then(pl.lit("move_envelope")).otherwise(pl.lit("annotate"))
    return finish(w, [insert], replace_action=action)
