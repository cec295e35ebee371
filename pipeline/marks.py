"""Marks: one sorted working frame in which a stage marks drops, in-place replacements and
inserted rows, then `finish` turns it into (new blocks, decisions).

A stage works on one sorted frame of marks instead of chaining `drop_where` / `replace_where`:
each of those references its input several times, so a chain of n of them is a plan of 2**n
nodes. Here every sub-step adds columns (window functions only, no self-joins), and `finish`
turns the marks into the new blocks and the decision rows with a fixed, small fan-out.
  _drop_from / _drop_reason   drop this version from that call on (the earliest drop wins)
  _rep_reason                 content columns were replaced in place (from the version's first call)
  _orig_sha / _orig_len / _orig_extra   the version as it came in
  _late_from / _late_reason   (optional, with `finish(late_values=...)`) a new version from that call
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import polars as pl

from pipeline.blockops import (
    BLOCK_SCHEMA,
    block_json_expr,
    content_len_expr,
    content_sha256,
    decisions_from,
    null_columns,
    sort_blocks,
)
from pipeline.registry import StageResult
from schemas.blocks import CONTENT_COLUMNS
from schemas.decisions import DECISION_KEY

MSG_NO, THREAD_NO = "_msg_no", "_thread_no"  # integer stand-ins in the working frame (start_marks)
OPEN = 2**31 - 1  # stands for a null (open) last_call in comparisons

SORT = ["session_id", "thread_id", "order_key", "msg_key", "block_pos", "part_pos", "first_call", "entry_id"]


def start_marks(blocks: pl.LazyFrame) -> pl.LazyFrame:
    """The working frame: blocks sorted by message and block, with empty marks and message helpers.

    Sorted, a message's rows are contiguous, so integer message and thread numbers (`MSG_NO`,
    `THREAD_NO`) stand in for the string keys in every window function."""
    new_thread = (pl.col("session_id") != pl.col("session_id").shift()) | (pl.col("thread_id") != pl.col("thread_id").shift())
    new_msg = new_thread | (pl.col("order_key") != pl.col("order_key").shift()) | (pl.col("msg_key") != pl.col("msg_key").shift())
    return blocks.sort(SORT).with_columns(
        _thread_no=new_thread.fill_null(True).cum_sum(),
        _msg_no=new_msg.fill_null(True).cum_sum(),
    ).with_columns(
        _orig_sha=pl.col("content_sha256"),
        _orig_len=content_len_expr(),
        _orig_extra=pl.col("extra_json"),
        _drop_from=pl.lit(None, pl.Int32),
        _drop_reason=pl.lit(None, pl.String),
        _rep_reason=pl.lit(None, pl.String),
        _end=pl.col("last_call").fill_null(OPEN),
        _is_first_row=pl.int_range(pl.len()).over(MSG_NO) == 0,
        _msg_first=pl.col("first_call").min().over(MSG_NO),
        _min_pos=pl.col("block_pos").min().over(MSG_NO),
    )


def cover_end() -> pl.Expr:
    """The first call that no longer sees this version, after the drops marked so far."""
    return pl.min_horizontal(pl.col("_end"), pl.col("_drop_from").fill_null(OPEN))


def alive() -> pl.Expr:
    """The version is still seen by at least its first call."""
    return pl.col("_drop_from").is_null() | (pl.col("_drop_from") > pl.col("first_call"))


def mark_drop(w: pl.LazyFrame, mask: pl.Expr, reason: str | pl.Expr, from_call: pl.Expr | None = None) -> pl.LazyFrame:
    """Mark versions to drop from `from_call` (default: their first call); an earlier drop wins."""
    frm = pl.max_horizontal(from_call if from_call is not None else pl.col("first_call"), pl.col("first_call"))
    frm = frm.cast(pl.Int32)
    eff = mask.fill_null(False) & (frm < pl.col("_end")) & (pl.col("_drop_from").is_null() | (frm < pl.col("_drop_from")))
    eff = eff.fill_null(False)
    r = reason if isinstance(reason, pl.Expr) else pl.lit(reason)
    return w.with_columns(
        _drop_from=pl.when(eff).then(frm).otherwise(pl.col("_drop_from")),
        _drop_reason=pl.when(eff).then(r).otherwise(pl.col("_drop_reason")),
    )


def mark_replace(w: pl.LazyFrame, mask: pl.Expr, new_values: dict[str, pl.Expr], reason: str | pl.Expr) -> pl.LazyFrame:
    """Replace columns of live versions where `mask` holds (from their first call)."""
    m = (mask.fill_null(False) & alive()).alias("_mr")
    r = reason if isinstance(reason, pl.Expr) else pl.lit(reason)
    w = w.with_columns(m)
    return w.with_columns(
        **{c: pl.when("_mr").then(e).otherwise(pl.col(c)) for c, e in new_values.items()},
        _rep_reason=pl.when("_mr").then(
            pl.when(pl.col("_rep_reason").is_null()).then(r).otherwise(pl.concat_str([pl.col("_rep_reason"), pl.lit("+"), r]))
        ).otherwise(pl.col("_rep_reason")),
    ).drop("_mr")


def next_message_first_call(cond: str) -> pl.Expr:
    """First call of the next message (by order) in the thread whose boolean column `cond` holds.

    Needs the working frame sorted by SORT (start_marks): the value sits on each message's first row,
    so the next non-null value after any row of a message belongs to a later message."""
    return (
        pl.when(pl.col("_is_first_row") & pl.col(cond)).then(pl.col("_msg_first")).otherwise(None)
        .shift(-1).backward_fill().over(THREAD_NO)
    )


def text_row(text: str | pl.Expr, *, origin: str) -> dict[str, pl.Expr]:
    """Column values that turn a template row into a plain text block."""
    values: dict[str, pl.Expr] = {
        "part_pos": pl.lit(0, pl.Int32), "block_type": pl.lit("text"),
        "text": text if isinstance(text, pl.Expr) else pl.lit(text), "origin": pl.lit(origin),
    }
    values.update(null_columns(("part_type", "signature", "tool_use_id", "tool_name", "tool_input", "is_error",
                                "image_media_type", "image_bytes", "image_width", "image_height", "image_data",
                                "extra_json")))
    return values


@dataclass(frozen=True, slots=True)
class Insert:
    """Rows to insert: one per working row where `when` holds, that row with `values` applied
    (`values` must set block_pos and may set first_call / last_call); one `insert` decision each."""

    when: pl.Expr
    values: dict[str, pl.Expr]
    reason: str


def _masked_sha(mask: str) -> pl.Expr:
    """content_sha256 recomputed for the rows where boolean column `mask` holds (null elsewhere);
    only those rows are hashed."""
    def run(s: pl.Series) -> pl.Series:
        df = s.struct.unnest()
        m = df.get_column("_mask").fill_null(False)
        out = pl.Series("sha", [None] * df.height, dtype=pl.String)
        if m.any():
            rows = df.filter(m).drop("_mask").to_dicts()
            out = out.scatter(m.arg_true(), [content_sha256(r) for r in rows])
        return out

    return pl.struct(pl.col(mask).alias("_mask"), *CONTENT_COLUMNS).map_batches(run, return_dtype=pl.String)


# kinds of output rows made from one working row (finish explodes each row into its outputs)
_KEEP, _LATE, _D_REP, _D_DROP, _D_LATE = 0, 1, 2, 3, 4
_INS = 10  # _INS + 2*i: inserted row of Insert i; _INS + 2*i + 1: its decision


def finish(
    w: pl.LazyFrame, inserts: Sequence[Insert] = (), *,
    replace_action: str | pl.Expr = "replace", late_values: dict[str, pl.Expr] | None = None,
) -> StageResult:
    """Turn the marks into (new blocks, decisions): one decision per changed version.

    A replaced version is rehashed; a decision is written when its content hash or its
    `extra_json` changed. A version dropped from its first call disappears (a replacement of it is
    void); dropped later, it ends at that call. With `late_values`, a version whose `_late_from`
    lies after its first call ends there and a new version with those values starts there (one
    `replace` decision from that call). Each working row is exploded into its output rows and
    decision rows, so the working plan is referenced twice (blocks, decisions), never more.
    """
    cols = BLOCK_SCHEMA.names()
    w = w.with_columns(_has_rep=pl.col("_rep_reason").is_not_null())
    w = w.with_columns(
        content_sha256=pl.coalesce(_masked_sha("_has_rep"), pl.col("content_sha256")),
        _cur_len=content_len_expr(),
    )
    changed = (
        (pl.col("content_sha256") != pl.col("_orig_sha")) | ~pl.col("extra_json").eq_missing(pl.col("_orig_extra"))
    )
    if late_values is None:
        w = w.with_columns(_late_from=pl.lit(None, pl.Int32), _late_reason=pl.lit(None, pl.String))
    is_late = (
        pl.col("_late_from").is_not_null() & (pl.col("_late_from") > pl.col("first_call"))
        & (pl.col("_late_from") < cover_end())
    ).fill_null(False)
    w = w.with_columns(_is_late=is_late, _is_alive=alive())
    kinds = [
        pl.when(pl.col("_is_alive")).then(pl.lit(_KEEP)),
        pl.when(pl.col("_is_late")).then(pl.lit(_LATE)),
        pl.when(pl.col("_is_late")).then(pl.lit(_D_LATE)),
        pl.when(pl.col("_has_rep") & changed & pl.col("_is_alive")).then(pl.lit(_D_REP)),
        pl.when(pl.col("_drop_from").is_not_null()).then(pl.lit(_D_DROP)),
    ]
    for i, ins in enumerate(inserts):
        kinds.append(pl.when(ins.when.fill_null(False)).then(pl.lit(_INS + 2 * i)))
        kinds.append(pl.when(ins.when.fill_null(False)).then(pl.lit(_INS + 2 * i + 1)))
    x = (
        w.with_columns(_kind=pl.concat_list([k.cast(pl.Int16) for k in kinds]).list.drop_nulls())
        .explode("_kind").filter(pl.col("_kind").is_not_null())
        .with_columns(_prev_sha=pl.col("content_sha256"), _prev_len=pl.col("_cur_len"))
    )
    # new content of late versions and inserted rows (and of their decision rows)
    kind = pl.col("_kind")
    groups: list[tuple[pl.Expr, dict[str, pl.Expr]]] = []
    if late_values is not None:
        groups.append((kind.is_in([_LATE, _D_LATE]),
                       {**late_values, "first_call": pl.col("_late_from").cast(pl.Int32)}))
    for i, ins in enumerate(inserts):
        groups.append((kind.is_in([_INS + 2 * i, _INS + 2 * i + 1]),
                       {**ins.values, "origin": ins.values.get("origin", pl.col("origin"))}))
    new_content = pl.lit(False)
    for cond, values in groups:
        new_content = new_content | cond
    touched = sorted({c for _, v in groups for c in v})
    if groups:
        x = x.with_columns(**{
            c: _chain([(cond, v[c]) for cond, v in groups if c in v], pl.col(c)) for c in touched
        })
        x = x.with_columns(_new_content=new_content).with_columns(
            content_sha256=pl.coalesce(_masked_sha("_new_content"), pl.col("content_sha256"))
        )
    is_keep = kind == _KEEP
    ends = pl.when(is_keep & pl.col("_is_late")).then(pl.col("_late_from")).when(
        kind.is_in([_KEEP, _LATE]) & pl.col("_drop_from").is_not_null()).then(pl.col("_drop_from"))
    ins_block_kinds = [_INS + 2 * i for i in range(len(inserts))]
    blocks_out = (
        x.filter(kind.is_in([_KEEP, _LATE, *ins_block_kinds]))
        .with_columns(last_call=ends.otherwise(pl.col("last_call")).cast(pl.Int32))
        .select(cols)
    )
    d = x.filter(kind.is_in([_D_REP, _D_DROP, _D_LATE, *[k + 1 for k in ins_block_kinds]]))
    gone_at_first = pl.col("_drop_from") <= pl.col("first_call")
    rep_action = replace_action if isinstance(replace_action, pl.Expr) else pl.lit(replace_action)
    ins_reason = _chain([(kind == _INS + 2 * i + 1, pl.lit(ins.reason)) for i, ins in enumerate(inserts)],
                        pl.lit(None, pl.String))
    decisions = decisions_from(
        d,
        action=pl.when(kind == _D_REP).then(rep_action).when(kind == _D_DROP).then(pl.lit("drop"))
        .when(kind == _D_LATE).then(pl.lit("replace")).otherwise(pl.lit("insert")),
        reason=pl.when(kind == _D_REP).then(pl.col("_rep_reason")).when(kind == _D_DROP).then(pl.col("_drop_reason"))
        .when(kind == _D_LATE).then(pl.col("_late_reason")).otherwise(ins_reason),
        from_call=pl.when(kind == _D_DROP).then(pl.col("_drop_from")).otherwise(pl.col("first_call")),
        before_sha256=pl.when(kind == _D_REP).then(pl.col("_orig_sha"))
        .when(kind == _D_DROP).then(pl.when(gone_at_first).then(pl.col("_orig_sha")).otherwise(pl.col("content_sha256")))
        .when(kind == _D_LATE).then(pl.col("_prev_sha")).otherwise(pl.lit(None, pl.String)),
        after_sha256=pl.when(kind == _D_DROP).then(pl.lit(None, pl.String)).otherwise(pl.col("content_sha256")),
        before_len=pl.when(kind == _D_REP).then(pl.col("_orig_len"))
        .when(kind == _D_DROP).then(pl.when(gone_at_first).then(pl.col("_orig_len")).otherwise(pl.col("_cur_len")))
        .when(kind == _D_LATE).then(pl.col("_prev_len")).otherwise(pl.lit(None, pl.Int64)),
        after_len=pl.when(kind == _D_DROP).then(pl.lit(None, pl.Int64)).otherwise(content_len_expr()),
        replacement=pl.when(kind == _D_DROP).then(pl.lit(None, pl.String)).otherwise(block_json_expr()),
    )
    return StageResult(sort_blocks(blocks_out), decisions.sort(DECISION_KEY))


def _chain(cases: list[tuple[pl.Expr, pl.Expr]], otherwise: pl.Expr) -> pl.Expr:
    if not cases:
        return otherwise
    expr = pl.when(cases[0][0]).then(cases[0][1])
    for cond, val in cases[1:]:
        expr = expr.when(cond).then(val)
    return expr.otherwise(otherwise)
