"""Schema checks at every boundary: on load, after every stage, on write."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
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
    expected = _polars_schema(declared)  # read only: no copy
    actual = frame.collect_schema() if isinstance(frame, pl.LazyFrame) else frame.schema
    if actual == expected:
        return
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
    expected = _polars_schema(declared)  # read only: no copy
    lf = frame.lazy() if isinstance(frame, pl.DataFrame) else frame
    return lf.select([pl.col(n).cast(t) for n, t in expected.items()])


def to_arrow(frame: pl.LazyFrame | pl.DataFrame, declared: pa.Schema, *, where: str) -> pa.Table:
    """Collect and cast to the declared Arrow schema, enforcing not-null fields and metadata."""
    # the in-memory engine, as every plan of ours (ctxreplay.pipeline.core.constants.POLARS_ENGINE;
    # polars' default, streaming, pays a fixed cost per plan several times as large on small frames)
    df = frame.collect(engine="in-memory") if isinstance(frame, pl.LazyFrame) else frame
    check_frame(df, declared, where=where)
    views = [f.name for f in declared if pa.types.is_string_view(f.type)]
    table = df.select(declared.names).drop(views).to_arrow()
    if views:  # polars holds strings as views: these come out sharing their bytes, not copied
        shared = df.select(views).to_arrow(compat_level=pl.CompatLevel.newest())
        table = pa.Table.from_arrays([(shared if f.name in views else table).column(f.name) for f in declared],
                                     names=declared.names)
    try:
        return table.cast(declared)
    except (pa.ArrowInvalid, ValueError) as exc:
        name = (declared.metadata or {}).get(b"name", b"?").decode()
        nulls = [f.name for f in declared if not f.nullable and table.column(f.name).null_count]
        msg = f"{where}: frame does not fit schema '{name}': null values in not-null columns {nulls}" if nulls \
            else f"{where}: frame does not fit schema '{name}': {exc}"
        raise SchemaMismatch(where=msg, name=name, missing=[], extra=[], wrong=[]) from exc


def shared_strings(values: Sequence[str]) -> pa.Array:
    """A string_view array of these values in which the rows holding one value share one copy of its
    bytes (in a string array each row has its own): a line's text repeated on every block of the
    line (`raw_line`) then costs the line once, not once per block (issue 23, item 5). Equal values
    are found with a dict, which hashes one str object once, however many rows repeat it."""
    index: dict[str, int] = {}
    rows = [index.setdefault(v, len(index)) for v in values]
    series = pl.Series(list(index), dtype=pl.String).gather(pl.Series(rows, dtype=pl.UInt32))
    return series.to_arrow(compat_level=pl.CompatLevel.newest())


def view_dictionary(column: pa.Array | pa.ChunkedArray) -> pa.DictionaryArray:
    """A string_view column (without nulls) dictionary-encoded without reading its strings: rows
    whose 16-byte views are equal (the same bytes in the same buffer, or the same short value inlined)
    hold one value, which the dictionary keeps once. The Parquet writer writes such a column as its
    dictionary and the indices (a string_view column would be hashed row by row, and a value over the
    dictionary page limit, 1 MiB, would fall back to being written whole on every row)."""
    arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if arr.null_count:
        raise ValueError("view_dictionary: a column without nulls")
    n = len(arr)
    if n == 0:
        return pa.DictionaryArray.from_arrays(pa.array([], pa.int32()), pa.array([], pa.string()))
    views = np.frombuffer(arr.buffers()[1], dtype=np.uint64, count=2 * (arr.offset + n)).reshape(-1, 2)[arr.offset:]
    _, first, inverse = np.unique(views, axis=0, return_index=True, return_inverse=True)
    values = pl.Series(pl.from_arrow(arr)).gather(pl.Series(first, dtype=pl.UInt32)).to_arrow().cast(pa.string())
    return pa.DictionaryArray.from_arrays(pa.array(inverse.reshape(-1).astype(np.int32)), values)


def take_rows(table: pa.Table, indices: pa.Array | pa.ChunkedArray) -> pa.Table:
    """`table.take(indices)` for a table with string_view columns too (raw_line): Arrow has no take
    (nor filter) kernel for views; polars gathers them as views, sharing the bytes, not copying them."""
    views = [f.name for f in table.schema if pa.types.is_string_view(f.type)]
    if not views:
        return table.take(indices)
    rest = table.drop_columns(views).take(indices)
    frame = pl.from_arrow(table.select(views))
    assert isinstance(frame, pl.DataFrame)
    got = frame.select(pl.all().gather(pl.Series(indices, dtype=pl.Int64))).to_arrow(
        compat_level=pl.CompatLevel.newest())
    cols = [(got if f.name in views else rest).column(f.name) for f in table.schema]
    return pa.Table.from_arrays(cols, schema=table.schema)


def filter_rows(table: pa.Table, mask: pa.Array | pa.ChunkedArray) -> pa.Table:
    """`table.filter(mask)` (a null mask value drops the row), for string_view columns too (take_rows)."""
    import pyarrow.compute as pc  # imported when used: a warm run never needs it (~40 ms)
    if not any(pa.types.is_string_view(f.type) for f in table.schema):
        return table.filter(mask)
    return take_rows(table, pc.indices_nonzero(pc.fill_null(mask, False)))
