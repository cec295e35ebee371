"""The one way ctxreplay opens DuckDB (the ledger, the columnar loader's in-memory database).

Extension autoloading and autoinstalling are off: DuckDB otherwise downloads an extension from the
network (and writes it under ~/.duckdb/extensions/) when a file or a function asks for one — a
`--ledger x.sqlite` would fetch `sqlite_scanner`. What ctxreplay uses (JSON, Parquet) is built
into the `duckdb` wheel.
"""

from __future__ import annotations

import duckdb

CONFIG = {"autoload_known_extensions": False, "autoinstall_known_extensions": False}


def connect(database: str = ":memory:", *, read_only: bool = False) -> duckdb.DuckDBPyConnection:
    """A DuckDB connection to `database` (a file path, or in memory) without extension autoloading."""
    return duckdb.connect(database, read_only=read_only, config=dict(CONFIG))


__all__ = ["CONFIG", "connect"]
