"""Marks: the one block-edit API. A stage marks drops, replacements and inserted rows on one sorted
working frame, then `finish` turns the marks into (new blocks, decisions).

Why one frame of marks: every edit of the blocks table is versioned (a block's version is seen by
calls first_call <= k < last_call), and an edit "from call k" splits a version in two. Chaining
edits that each join their input back to itself makes a plan that doubles with every step. Here
every mark only adds columns (window functions, no self-joins), and `finish` turns the marks into
the new blocks and one decision per changed version with a fixed, small fan-out.

The API, in the order a stage uses it:

    w = start_marks(blocks)                       # sorted working frame, marks empty
    w = mark_drop(w, mask, "reason")              # drop from the version's first call (it disappears)
    w = mark_drop(w, mask, "reason", from_call=c) # ... or from call c on (the version ends at c)
    w = mark_replace(w, mask, {"text": expr}, "reason")   # new content, from the version's first call
    w = mark_replace_from(w, mask, values, "reason", from_call=c)  # new content from call c on
    res = finish(w, [Insert(when, values, "reason")])     # -> StageResult(blocks, decisions)

- Every mark takes an optional `action` (the decision's `action`: `drop`, `replace`, or a stage's
  own word such as `tombstone`, `truncate`, `snip`); drops and replacements from a call may carry
  the cache `epoch` their decision records (a replacement sets `cache_epoch` among its values).
- An earlier drop wins over a later one; a version dropped from its first call disappears and a
  replacement marked on it is void. `mark_replace` on a version already replaced appends its
  reason (`a+b`) and one decision covers both.
- A replacement that leaves the content hash and `extra_json` unchanged writes no decision (its
  values still apply: mask such rows out when nothing may change, as `mark_replace_from` callers do).
- `next_message_first_call`, `text_row`, `alive` and `cover_end` help build masks and values.

Columns of the working frame (all start with `_`, `finish` drops them):
  _drop_from / _drop_reason / _drop_action / _drop_epoch   drop this version from that call on
  _rep_reason / _rep_action     content columns replaced in place (from the version's first call)
  _late_from / _late_reason / _late_action, _late_v__<col> / _late_s__<col>
                                a new version with new values from that call (mark_replace_from)
  _orig_sha / _orig_len / _orig_extra   the version as it came in
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum

import polars as pl

from ctxreplay.pipeline.core.blockops import (
    block_json_expr,
    block_schema,
    content_len_expr,
    content_sha256,
    decisions_from,
    null_columns,
    sort_blocks,
)
from ctxreplay.pipeline.core.constants import OPEN, PART_KEY, POLARS_ENGINE
from ctxreplay.pipeline.stageapi.registry import StageResult
from ctxreplay.schemas.blocks import CONTENT_COLUMNS
from ctxreplay.schemas.decisions import DECISION_KEY

MSG_NO, THREAD_NO = "_msg_no", "_thread_no"  # integer stand-ins in the working frame (start_marks)

SORT = ["session_id", "thread_id", "order_key", "msg_key", "block_pos", "part_pos", "first_call", "entry_id"]
LATE_VALUE, LATE_SET = "_late_v__", "_late_s__"  # prefixes of the per-column late values and flags

__all__ = [
    "MSG_NO", "OPEN", "THREAD_NO", "Insert", "alive", "cover_end", "finish", "mark_drop", "mark_replace",
    "mark_replace_from", "next_message_first_call", "start_marks", "text_row",
]


def start_marks(blocks: pl.LazyFrame) -> pl.LazyFrame:
    """The working frame: blocks sorted by message and block, with empty marks and message helpers.

    Sorted, a message's rows are contiguous, so integer message and thread numbers (`MSG_NO`,
    `THREAD_NO`) stand in for the string keys in every window function."""
    new_thread = (pl.col("session_id") != pl.col("session_id").shift()) | (pl.col("thread_id") != pl.col("thread_id").shift())
    new_msg = new_thread | (pl.col("order_key") != pl.col("order_key").shift()) | (pl.col("msg_key") != pl.col("msg_key").shift())
    none_str, none_int = pl.lit(None, pl.String), pl.lit(None, pl.Int32)
    return blocks.sort(SORT).with_columns(
        _thread_no=new_thread.fill_null(True).cum_sum(),
        _msg_no=new_msg.fill_null(True).cum_sum(),
    ).with_columns(
        _orig_sha=pl.col("content_sha256"),
        _orig_len=content_len_expr(),
        _orig_extra=pl.col("extra_json"),
        _drop_from=none_int, _drop_reason=none_str, _drop_action=none_str, _drop_epoch=none_int,
        _rep_reason=none_str, _rep_action=none_str,
        _late_from=none_int, _late_reason=none_str, _late_action=none_str,
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


def _lit(v: str | pl.Expr) -> pl.Expr:
    return v if isinstance(v, pl.Expr) else pl.lit(v)


def mark_drop(w: pl.LazyFrame, mask: pl.Expr, reason: str | pl.Expr, from_call: pl.Expr | None = None, *,
              action: str | pl.Expr | None = None, epoch: pl.Expr | None = None) -> pl.LazyFrame:
    """Mark versions to drop from `from_call` (default: their first call); an earlier drop wins.

    `action` is the decision's action (default `drop`); `epoch`, when given, the cache epoch its
    decision records (default: the version's own)."""
    frm = pl.max_horizontal(from_call if from_call is not None else pl.col("first_call"), pl.col("first_call"))
    frm = frm.cast(pl.Int32)
    eff = mask.fill_null(False) & (frm < pl.col("_end")) & (pl.col("_drop_from").is_null() | (frm < pl.col("_drop_from")))
    w = w.with_columns(_md=eff.fill_null(False))
    marks = {"_drop_from": frm, "_drop_reason": _lit(reason),
             "_drop_action": _lit(action) if action is not None else pl.lit(None, pl.String),
             "_drop_epoch": epoch.cast(pl.Int32) if epoch is not None else pl.lit(None, pl.Int32)}
    return w.with_columns(
        **{c: pl.when("_md").then(e).otherwise(pl.col(c)) for c, e in marks.items()}
    ).drop("_md")


def mark_replace(w: pl.LazyFrame, mask: pl.Expr, new_values: dict[str, pl.Expr], reason: str | pl.Expr, *,
                 action: str | pl.Expr | None = None) -> pl.LazyFrame:
    """Replace columns of live versions where `mask` holds (from their first call).

    `action` is the decision's action (default: `finish`'s `replace_action`)."""
    m = (mask.fill_null(False) & alive()).alias("_mr")
    r = _lit(reason)
    w = w.with_columns(m)
    marks = {
        "_rep_reason": pl.when(pl.col("_rep_reason").is_null()).then(r)
        .otherwise(pl.concat_str([pl.col("_rep_reason"), pl.lit("+"), r])),
    }
    if action is not None:
        marks["_rep_action"] = _lit(action)
    return w.with_columns(
        **{c: pl.when("_mr").then(e).otherwise(pl.col(c)) for c, e in {**new_values, **marks}.items()},
    ).drop("_mr")


def mark_replace_from(w: pl.LazyFrame, mask: pl.Expr, new_values: dict[str, pl.Expr], reason: str | pl.Expr,
                      from_call: pl.Expr, *, action: str | pl.Expr = "replace") -> pl.LazyFrame:
    """Replace columns where `mask` holds from call `from_call` on.

    A version that starts at or after that call is replaced in place (`mark_replace`). A version
    that starts before it and is still seen there ends at that call, and a new version with
    `new_values` starts there: one decision from that call, whose `before_sha256` is the version's
    content at that point. A version has at most one such later replacement (the first marked
    wins). The values are evaluated now, on the working row."""
    frm = pl.max_horizontal(from_call, pl.col("first_call")).cast(pl.Int32)
    m = mask.fill_null(False)
    w = mark_replace(w, m & (frm <= pl.col("first_call")), new_values, reason, action=action)
    late = m & alive() & (frm > pl.col("first_call")) & (frm < cover_end()) & pl.col("_late_from").is_null()
    w = w.with_columns(_ml=late.fill_null(False))
    names = set(w.collect_schema().names())
    values: dict[str, pl.Expr] = {}
    for c, e in new_values.items():
        old_v = pl.col(LATE_VALUE + c) if LATE_VALUE + c in names else pl.lit(None, block_schema()[c])
        old_s = pl.col(LATE_SET + c) if LATE_SET + c in names else pl.lit(False)
        values[LATE_VALUE + c] = pl.when("_ml").then(e.cast(block_schema()[c])).otherwise(old_v)
        values[LATE_SET + c] = pl.when("_ml").then(pl.lit(True)).otherwise(old_s)
    marks = {"_late_from": frm, "_late_reason": _lit(reason), "_late_action": _lit(action)}
    return w.with_columns(
        **values, **{c: pl.when("_ml").then(e).otherwise(pl.col(c)) for c, e in marks.items()},
    ).drop("_ml")


def conflicted(ledger: pl.LazyFrame, action: str) -> pl.LazyFrame:
    """The stage's recorded `action` decisions whose row changed under them: the ones the ledger
    view holds a `conflict` (reason `hash_mismatch`) for, at the same part and call. A stage that
    decides a position in time (snip, tombstone) decides them afresh from the same call and in the
    same epoch, whatever the row holds now. Returns one row per such conflict: PART_KEY,
    `from_call`, and the recorded `reason` and `cache_epoch`."""
    redo = ledger.filter((pl.col("action") == "conflict") & (pl.col("reason") == "hash_mismatch"))
    return redo.select(*PART_KEY, "from_call").join(
        ledger.filter(pl.col("action") == action).select(*PART_KEY, "from_call", "reason", "cache_epoch"),
        on=[*PART_KEY, "from_call"])


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


# ---------------------------------------------------------------------------------------------
# finish: each working row is exploded into the output rows it stands for


class Out(IntEnum):
    """What one output row made from a working row is (`finish` explodes each row into these)."""

    KEEP = 0  # the version itself (shortened when dropped or replaced from a later call)
    LATE = 1  # the new version that a replacement from a later call starts
    REPLACED = 2  # decision: replaced in place
    DROPPED = 3  # decision: dropped (from its first call or later)
    LATE_REPLACED = 4  # decision: the later replacement
    INSERT = 10  # INSERT + 2*i: the row of Insert i; INSERT + 2*i + 1: its decision


def _insert_row(i: int) -> int:
    return Out.INSERT + 2 * i


def _insert_decision(i: int) -> int:
    return Out.INSERT + 2 * i + 1


def finish(
    w: pl.LazyFrame, inserts: Sequence[Insert] = (), *,
    replace_action: str | pl.Expr = "replace", late_values: dict[str, pl.Expr] | None = None,
) -> StageResult:
    """Turn the marks into (new blocks, decisions): one decision per changed version.

    A replaced version is rehashed; a decision is written when its content hash or its
    `extra_json` changed. A version dropped from its first call disappears (a replacement of it is
    void); dropped later, it ends at that call. A version with a later replacement
    (`mark_replace_from`, or `_late_from` set by the stage with `late_values`) ends at that call and
    a new version starts there. The working plan runs once (one collect): a row no mark touches
    leaves as it is, and each marked row is exploded into its output rows and decision rows,
    collected once for both outputs (most rows of a batch are unmarked: exploding and rehashing
    all of them cost about a quarter of sanitize's pass on a 5,000-row batch).
    """
    names = set(w.collect_schema().names())
    marked = pl.col("_rep_reason").is_not_null() | pl.col("_drop_from").is_not_null() | pl.col("_late_from").is_not_null()
    for ins in inserts:
        marked = marked | ins.when.fill_null(False)
    wd = w.with_columns(_marked=marked.fill_null(True)).collect(engine=POLARS_ENGINE).lazy()
    as_is = wd.filter(~pl.col("_marked")).with_columns(pl.col("last_call").cast(pl.Int32)).select(block_schema().names())
    x = _explode(_rehash_replaced(wd.filter(pl.col("_marked")).drop("_marked")), inserts)
    # collected once: the blocks and the decisions are both made from it
    x = _new_content(x, inserts, late_values, names).collect(engine=POLARS_ENGINE).lazy()
    return StageResult(sort_blocks(pl.concat([as_is, _blocks_out(x, inserts)])),
                       _decisions_out(x, inserts, replace_action).sort(DECISION_KEY))


def _rehash_replaced(w: pl.LazyFrame) -> pl.LazyFrame:
    """Rehash the versions replaced in place; note which changed and which get a later version."""
    w = w.with_columns(_has_rep=pl.col("_rep_reason").is_not_null())
    w = w.with_columns(
        content_sha256=pl.coalesce(_masked_sha("_has_rep"), pl.col("content_sha256")),
        _cur_len=content_len_expr(),
    )
    is_late = (
        pl.col("_late_from").is_not_null() & (pl.col("_late_from") > pl.col("first_call"))
        & (pl.col("_late_from") < cover_end())
    ).fill_null(False)
    changed = (
        (pl.col("content_sha256") != pl.col("_orig_sha")) | ~pl.col("extra_json").eq_missing(pl.col("_orig_extra"))
    )
    return w.with_columns(_is_late=is_late, _is_alive=alive(), _changed=changed)


def _explode(w: pl.LazyFrame, inserts: Sequence[Insert]) -> pl.LazyFrame:
    """One row per output (`Out`) of each working row, kind in `_kind`."""
    def when(cond: pl.Expr, kind: int) -> pl.Expr:
        return pl.when(cond).then(pl.lit(kind))

    kinds = [
        when(pl.col("_is_alive"), Out.KEEP),
        when(pl.col("_is_late"), Out.LATE),
        when(pl.col("_is_late"), Out.LATE_REPLACED),
        when(pl.col("_has_rep") & pl.col("_changed") & pl.col("_is_alive"), Out.REPLACED),
        when(pl.col("_drop_from").is_not_null(), Out.DROPPED),
    ]
    for i, ins in enumerate(inserts):
        kinds += [when(ins.when.fill_null(False), _insert_row(i)), when(ins.when.fill_null(False), _insert_decision(i))]
    return (
        w.with_columns(_kind=pl.concat_list([k.cast(pl.Int16) for k in kinds]).list.drop_nulls())
        .explode("_kind").filter(pl.col("_kind").is_not_null())
        .with_columns(_prev_sha=pl.col("content_sha256"), _prev_len=pl.col("_cur_len"))
    )


def _late_version_values(late_values: dict[str, pl.Expr] | None, names: set[str]) -> dict[str, pl.Expr]:
    """The values of the version a later replacement starts: the per-row values marked by
    `mark_replace_from`, else the stage's `late_values`, else the working row's own."""
    values: dict[str, pl.Expr] = dict(late_values or {})
    for n in sorted(names):
        if n.startswith(LATE_SET):
            c = n[len(LATE_SET):]
            values[c] = pl.when(pl.col(n).fill_null(False)).then(pl.col(LATE_VALUE + c)).otherwise(
                values.get(c, pl.col(c)))
    values["first_call"] = pl.col("_late_from").cast(pl.Int32)
    return values


def _new_content(x: pl.LazyFrame, inserts: Sequence[Insert], late_values: dict[str, pl.Expr] | None,
                 names: set[str]) -> pl.LazyFrame:
    """Apply the values of later versions and inserted rows (and of their decision rows), rehashed."""
    kind = pl.col("_kind")
    groups: list[tuple[pl.Expr, dict[str, pl.Expr]]] = [
        (kind.is_in([Out.LATE, Out.LATE_REPLACED]), _late_version_values(late_values, names))]
    for i, ins in enumerate(inserts):
        groups.append((kind.is_in([_insert_row(i), _insert_decision(i)]),
                       {**ins.values, "origin": ins.values.get("origin", pl.col("origin"))}))
    touched = sorted({c for _, v in groups for c in v})
    new_content = pl.any_horizontal([cond for cond, _ in groups])
    return x.with_columns(**{
        c: _chain([(cond, v[c]) for cond, v in groups if c in v], pl.col(c)) for c in touched
    }).with_columns(_new_content=new_content).with_columns(
        content_sha256=pl.coalesce(_masked_sha("_new_content"), pl.col("content_sha256"))
    )


def _blocks_out(x: pl.LazyFrame, inserts: Sequence[Insert]) -> pl.LazyFrame:
    """The output block versions: kept (ended at a later replacement or drop), later, inserted."""
    kind = pl.col("_kind")
    is_keep = kind == Out.KEEP
    ends = pl.when(is_keep & pl.col("_is_late")).then(pl.col("_late_from")).when(
        kind.is_in([Out.KEEP, Out.LATE]) & pl.col("_drop_from").is_not_null()).then(pl.col("_drop_from"))
    return (
        x.filter(kind.is_in([Out.KEEP, Out.LATE, *[_insert_row(i) for i in range(len(inserts))]]))
        .with_columns(last_call=ends.otherwise(pl.col("last_call")).cast(pl.Int32))
        .select(block_schema().names())
    )


def _decisions_out(x: pl.LazyFrame, inserts: Sequence[Insert], replace_action: str | pl.Expr) -> pl.LazyFrame:
    """One decision row per decision kind; `before_*` is the version's content before this stage
    (a drop after an in-place replacement: the replaced content; a later replacement: the content
    the version had up to that call)."""
    kind = pl.col("_kind")
    rep, drop, late = kind == Out.REPLACED, kind == Out.DROPPED, kind == Out.LATE_REPLACED
    d = x.filter(kind.is_in([Out.REPLACED, Out.DROPPED, Out.LATE_REPLACED,
                             *[_insert_decision(i) for i in range(len(inserts))]]))
    gone_at_first = pl.col("_drop_from") <= pl.col("first_call")
    ins_reason = _chain([(kind == _insert_decision(i), pl.lit(ins.reason)) for i, ins in enumerate(inserts)],
                        pl.lit(None, pl.String))
    none_str, none_int = pl.lit(None, pl.String), pl.lit(None, pl.Int64)
    return decisions_from(
        d,
        action=pl.when(rep).then(pl.coalesce(pl.col("_rep_action"), _lit(replace_action)))
        .when(drop).then(pl.coalesce(pl.col("_drop_action"), pl.lit("drop")))
        .when(late).then(pl.coalesce(pl.col("_late_action"), pl.lit("replace"))).otherwise(pl.lit("insert")),
        reason=pl.when(rep).then(pl.col("_rep_reason")).when(drop).then(pl.col("_drop_reason"))
        .when(late).then(pl.col("_late_reason")).otherwise(ins_reason),
        from_call=pl.when(drop).then(pl.col("_drop_from")).otherwise(pl.col("first_call")),
        before_sha256=pl.when(rep).then(pl.col("_orig_sha"))
        .when(drop).then(pl.when(gone_at_first).then(pl.col("_orig_sha")).otherwise(pl.col("content_sha256")))
        .when(late).then(pl.col("_prev_sha")).otherwise(none_str),
        after_sha256=pl.when(drop).then(none_str).otherwise(pl.col("content_sha256")),
        before_len=pl.when(rep).then(pl.col("_orig_len"))
        .when(drop).then(pl.when(gone_at_first).then(pl.col("_orig_len")).otherwise(pl.col("_cur_len")))
        .when(late).then(pl.col("_prev_len")).otherwise(none_int),
        after_len=pl.when(drop).then(none_int).otherwise(content_len_expr()),
        replacement=pl.when(drop).then(none_str).otherwise(block_json_expr()),
        cache_epoch=pl.when(drop).then(pl.coalesce(pl.col("_drop_epoch"), pl.col("cache_epoch")))
        .otherwise(pl.col("cache_epoch")),
    )


def _chain(cases: list[tuple[pl.Expr, pl.Expr]], otherwise: pl.Expr) -> pl.Expr:
    if not cases:
        return otherwise
    expr = pl.when(cases[0][0]).then(cases[0][1])
    for cond, val in cases[1:]:
        expr = expr.when(cond).then(val)
    return expr.otherwise(otherwise)
