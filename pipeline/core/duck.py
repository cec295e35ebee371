"""The one way ctxreplay opens DuckDB (the ledger).

Extension autoloading and autoinstalling are off: DuckDB otherwise downloads an extension from the
network (and writes it under ~/.duckdb/extensions/) when a file or a function asks for one — a
`--ledger x.sqlite` would fetch `sqlite_scanner`. What ctxreplay uses (JSON, Parquet) is built
into the `duckdb` wheel.
"""

from __future__ import annotations

import os
import tempfile

import duckdb

CONFIG = {"autoload_known_extensions": False, "autoinstall_known_extensions": False}


def connect(database: str = ":memory:", *, read_only: bool = False) -> duckdb.DuckDBPyConnection:
    """A DuckDB connection to `database` (a file path, or in memory) without extension autoloading,
    and without DuckDB's progress bar (it draws it on stdout for a query of more than 2 s: into
    `run --json`). An in-memory database spills to `ctxreplay-duckdb-<pid>` in the temp directory
    (DuckDB removes it on close), not to DuckDB's default `.tmp` in the current directory."""
    config: dict[str, object] = dict(CONFIG)
    if database == ":memory:":
        config["temp_directory"] = os.path.join(tempfile.gettempdir(), f"ctxreplay-duckdb-{os.getpid()}")
    con = duckdb.connect(database, read_only=read_only, config=config)
    con.execute("SET enable_progress_bar = false")
    return con


__all__ = ["CONFIG", "connect"]
