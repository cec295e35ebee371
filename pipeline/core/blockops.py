"""Shared tools for stages: content hashes, decision rows, versioned replacement of blocks.

All functions take and return polars LazyFrames and stay pure (no I/O, clock or randomness).
"""

from __future__ import annotations

import functools
import hashlib
import uuid
from collections.abc import Iterable, Mapping

import orjson
import polars as pl

from ctxreplay.schemas.blocks import BLOCKS, CONTENT_COLUMNS
from ctxreplay.schemas.check import conform, polars_schema
from ctxreplay.schemas.decisions import STAGE_DECISION

# Fixed namespace for synthetic ids: never change it (it is part of every synthetic row id).
PIPELINE_NS = uuid.UUID("6f1c2a9e-5b7d-4c3e-9a41-7d2e8b0c5f13")



# The polars schemas are made at their first use, not at import: a run that reuses every output
# computes no frame and does not import polars at all (ctxreplay/deferred.py).
@functools.cache
def block_schema() -> pl.Schema:
    """The blocks table's polars schema (BLOCKS). Shared: never change it, copy it."""
    return polars_schema(BLOCKS)


@functools.cache
def decision_schema() -> pl.Schema:
    """A stage's decisions' polars schema (STAGE_DECISION). Shared: never change it, copy it."""
    return polars_schema(STAGE_DECISION)


def __getattr__(name: str) -> object:
    """BLOCK_SCHEMA and DECISION_SCHEMA, the names a stage of one's own may import."""
    if name == "BLOCK_SCHEMA":
        return block_schema()
    if name == "DECISION_SCHEMA":
        return decision_schema()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def canonical_json(obj: object) -> bytes:
    """Canonical JSON: sorted keys, UTF-8, no insignificant whitespace."""
    return orjson.dumps(obj, option=orjson.OPT_SORT_KEYS)


def sha256_hex(data: bytes | str) -> str:
    if isinstance(data, str):
        data = data.encode("utf-8", "surrogatepass")
    return hashlib.sha256(data).hexdigest()


def content_dict(row: Mapping[str, object]) -> dict[str, object]:
    """The content of a block row: CONTENT_COLUMNS without nulls (what content_sha256 covers)."""
    return {c: row.get(c) for c in CONTENT_COLUMNS if row.get(c) is not None}


def content_sha256(row: Mapping[str, object]) -> str:
    return sha256_hex(canonical_json(content_dict(row)))


def _sha_batch(s: pl.Series) -> pl.Series:
    return pl.Series([content_sha256(r) for r in s.to_list()], dtype=pl.String)


def content_sha_expr() -> pl.Expr:
    """Expression recomputing content_sha256 from the content columns."""
    return pl.struct(CONTENT_COLUMNS).map_batches(_sha_batch, return_dtype=pl.String)


def rehash(blocks: pl.LazyFrame, mask: pl.Expr | str | None = None) -> pl.LazyFrame:
    """Recompute content_sha256 (only where `mask` holds, when given)."""
    new = content_sha_expr()
    if mask is None:
        return blocks.with_columns(content_sha256=new)
    m = pl.col(mask) if isinstance(mask, str) else mask
    return blocks.with_columns(content_sha256=pl.when(m).then(new).otherwise(pl.col("content_sha256")))


def sha256_expr(text: pl.Expr) -> pl.Expr:
    """`sha256_hex` of a string column (nulls stay null)."""
    return text.map_batches(
        lambda s: pl.Series([None if t is None else sha256_hex(t) for t in s.to_list()], dtype=pl.String),
        return_dtype=pl.String,
    )


def null_columns(cols: Iterable[str]) -> dict[str, pl.Expr]:
    """A typed null (BLOCK_SCHEMA dtype) for each of `cols`."""
    return {c: pl.lit(None, block_schema()[c]) for c in cols}


def new_rows(frame: pl.LazyFrame, *, keep: Iterable[str] = (), **values: pl.Expr) -> pl.LazyFrame:
    """New block rows, one per row of `frame`: the columns in `values` set, those in `keep` copied
    from `frame`, every other BLOCK_SCHEMA column a typed null; in schema order and dtypes.
    (content_sha256 is whatever `values` gives: rehash after.)"""
    kept = set(keep)
    unknown = (kept | set(values)) - set(block_schema().names())
    if unknown:
        raise ValueError(f"new_rows: not block columns: {sorted(unknown)}")
    return frame.select([
        (values[c] if c in values else pl.col(c) if c in kept else pl.lit(None, dt)).cast(dt).alias(c)
        for c, dt in block_schema().items()
    ])


def synthetic_id(session_id: str, layer: str, kind: str, source_id: str, occurrence: int) -> str:
    """uuid5 over `session_id|layer|kind|source_id|occurrence` in the fixed namespace."""
    return str(uuid.uuid5(PIPELINE_NS, f"{session_id}|{layer}|{kind}|{source_id}|{occurrence}"))


def synthetic_id_expr(layer: str, kind: str, source: pl.Expr, occurrence: pl.Expr | int = 0) -> pl.Expr:
    occ = occurrence if isinstance(occurrence, pl.Expr) else pl.lit(occurrence)
    return (
        pl.struct(s=pl.col("session_id"), src=source.cast(pl.String), occ=occ.cast(pl.Int64))
        .map_batches(
            lambda s: pl.Series(
                [synthetic_id(r["s"], layer, kind, r["src"] or "", r["occ"] or 0) for r in s.to_list()],
                dtype=pl.String,
            ),
            return_dtype=pl.String,
        )
    )


def block_json_expr() -> pl.Expr:
    """Canonical JSON of a row's content (for the ledger's `replacement`)."""
    return pl.struct(CONTENT_COLUMNS).map_batches(
        lambda s: pl.Series([canonical_json(content_dict(r)).decode() for r in s.to_list()], dtype=pl.String),
        return_dtype=pl.String,
    )


def content_len_expr() -> pl.Expr:
    """Length in bytes of a row's main payload (text, tool input or image data)."""
    return pl.coalesce(
        pl.col("text").str.len_bytes(),
        pl.col("image_data").str.len_bytes(),
        pl.col("tool_input").str.len_bytes(),
        pl.lit(0, pl.UInt32),
    ).cast(pl.Int64)


@functools.cache
def _no_decisions() -> pl.DataFrame:
    return pl.DataFrame(schema=decision_schema())  # made once: a frame from a schema costs ~0.3 ms


def empty_decisions() -> pl.LazyFrame:
    return _no_decisions().lazy()


def decisions_from(
    changed: pl.LazyFrame,
    *,
    action: str | pl.Expr,
    reason: str | pl.Expr,
    before_sha256: pl.Expr | None = None,
    after_sha256: pl.Expr | None = None,
    before_len: pl.Expr | None = None,
    after_len: pl.Expr | None = None,
    replacement: pl.Expr | None = None,
    from_call: pl.Expr | None = None,
    cache_epoch: pl.Expr | None = None,
) -> pl.LazyFrame:
    """Decision rows for the blocks in `changed` (a blocks-shaped frame); returns STAGE_DECISION."""
    def lit(v: str | pl.Expr) -> pl.Expr:
        return pl.lit(v) if isinstance(v, str) else v

    return conform(
        changed.select(
            "session_id", "thread_id", "entry_id", "block_pos", "part_pos", "tool_use_id",
            from_call=from_call if from_call is not None else pl.col("first_call"),
            action=lit(action),
            reason=lit(reason),
            before_sha256=before_sha256 if before_sha256 is not None else pl.lit(None, pl.String),
            after_sha256=after_sha256 if after_sha256 is not None else pl.lit(None, pl.String),
            before_len=before_len if before_len is not None else pl.lit(None, pl.Int64),
            after_len=after_len if after_len is not None else pl.lit(None, pl.Int64),
            replacement=replacement if replacement is not None else pl.lit(None, pl.String),
            cache_epoch=cache_epoch if cache_epoch is not None else pl.col("cache_epoch"),
        ),
        STAGE_DECISION,
    )


BLOCK_ORDER = ["session_id", "thread_id", "order_key", "block_pos", "part_pos", "first_call", "entry_id"]


def sort_blocks(blocks: pl.LazyFrame) -> pl.LazyFrame:
    """Deterministic order: thread, working order, block, part, version."""
    return blocks.sort(BLOCK_ORDER)


def append_sorted(ordered: pl.DataFrame, rows: pl.DataFrame) -> pl.DataFrame:
    """sort_blocks over `ordered` (in block order already) and `rows`: where the rows, sorted, all come
    after the last of `ordered` (a live session's new rows), the two one after the other, without
    sorting the whole frame again. (Python's order of strings is polars': by code point, UTF-8's
    byte order; a null in either key compared sorts the whole.)"""
    if not rows.height:
        return ordered
    rows = rows.sort(BLOCK_ORDER)
    if ordered.height:
        last, first = ordered.select(BLOCK_ORDER).row(-1), rows.select(BLOCK_ORDER).row(0)
        if None in last or None in first or not last < first:
            return pl.concat([ordered, rows]).sort(BLOCK_ORDER)
    return pl.concat([ordered, rows])
