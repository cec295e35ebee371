"""Schema checks at every boundary: on load, after every stage, on write."""

from __future__ import annotations

import functools

import polars as pl
import pyarrow as pa

from ctxreplay.errors import SchemaMismatch


def empty_table(declared: pa.Schema) -> pa.Table:
    """A table of no rows in this schema. Not `Schema.empty_table()`: that imports pandas, about
    0.3 s of a run's start (a warm re-run takes about 1 s in all)."""
    return pa.Table.from_batches([], schema=declared)


def polars_schema(declared: pa.Schema) -> pl.Schema:
    """The polars schema of an Arrow schema (strings stay String, not string_view)."""
    return pl.Schema(_polars_schema(declared))  # a copy: the caller may change it


@functools.lru_cache(maxsize=64)
def _polars_schema(declared: pa.Schema) -> pl.Schema:
    # checked after every stage and conformed at every step: made once per schema, not each time
    return pl.Schema(pl.from_arrow(empty_table(declared)).schema)


def check_frame(frame: pl.LazyFrame | pl.DataFrame, declared: pa.Schema, *, where: str) -> None:
    """Raise SchemaMismatch unless the frame has exactly the declared columns and types (any order)."""
    expected = polars_schema(declared)
    actual = frame.collect_schema() if isinstance(frame, pl.LazyFrame) else frame.schema
    missing = [c for c in expected.names() if c not in actual]
    extra = [c for c in actual.names() if c not in expected]
    wrong = [
        (c, str(expected[c]), str(actual[c]))
        for c in expected.names()
        if c in actual and actual[c] != expected[c]
    ]
    if missing or extra or wrong:
        name = (declared.metadata or {}).get(b"name", b"?").decode()
        raise SchemaMismatch(where=where, name=name, missing=missing, extra=extra, wrong=wrong)


def conform(frame: pl.LazyFrame | pl.DataFrame, declared: pa.Schema) -> pl.LazyFrame:
    """Select and cast to the declared columns and order (missing columns raise)."""
    expected = polars_schema(declared)
    lf = frame.lazy() if isinstance(frame, pl.DataFrame) else frame
    return lf.select([pl.col(n).cast(t) for n, t in expected.items()])


def to_arrow(frame: pl.LazyFrame | pl.DataFrame, declared: pa.Schema, *, where: str) -> pa.Table:
    """Collect and cast to the declared Arrow schema, enforcing not-null fields and metadata."""
    df = frame.collect() if isinstance(frame, pl.LazyFrame) else frame
    check_frame(df, declared, where=where)
    table = df.select(declared.names).to_arrow()
    try:
        return table.cast(declared)
    except (pa.ArrowInvalid, ValueError) as exc:
        name = (declared.metadata or {}).get(b"name", b"?").decode()
        nulls = [f.name for f in declared if not f.nullable and table.column(f.name).null_count]
        msg = f"{where}: frame does not fit schema '{name}': null values in not-null columns {nulls}" if nulls \
            else f"{where}: frame does not fit schema '{name}': {exc}"
        raise SchemaMismatch(where=msg, name=name, missing=[], extra=[], wrong=[]) from exc
