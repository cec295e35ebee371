"""The content-replacement ledger: an embedded DuckDB file (default OUT/ledger.duckdb).

Tables: `decisions` (append-only, namespaced by spec_sha256), `decision_calls` (the call key of each
decision: the message that answers the call it applies from, so a decision follows its history
whatever the thread is named in a later run), `runs` (one row per completed run,
with the `run_id` of its outputs), `specs` (resolved spec per sha256), `token_cache` (token counts
by text sha256 and counter). A run writes everything in one transaction: a crash leaves the ledger
as before or after the run. Two runs never share a ledger at once: the runner holds a lock on it
(pipeline/core/outdir.py).

A ledger is known by its `meta` row `format = ctxreplay-ledger` (ledgers written before that row
by their `schema_version` row and tables that are all ledger tables; they gain the row when next
opened for writing). Before DuckDB opens a file, its header is checked (`check_file`): a path
that does not exist yet, an empty file, or a DuckDB file (b"DUCK" at byte 8 of its main header);
anything else (a Parquet file, a SQLite database, ...) is refused, and so is a DuckDB database
that holds tables of its own: ctxreplay never adds its tables to someone else's file. DuckDB is
opened with extension autoloading off (pipeline/core/duck.py), and a read that fails on a damaged
file is a LedgerError naming the file, not an internal error.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import duckdb
import numpy as np
import orjson
import polars as pl
import pyarrow as pa

from ctxreplay.errors import LedgerError
from ctxreplay.pipeline.core import crashpoints
from ctxreplay.pipeline.core.duck import connect
from ctxreplay.schemas.check import conform, polars_schema, to_arrow
from ctxreplay.schemas.decisions import DECISIONS, STAGE_DECISION

SCHEMA_VERSION = 1

_DDL = """
CREATE TABLE IF NOT EXISTS meta (key VARCHAR PRIMARY KEY, value VARCHAR);
CREATE TABLE IF NOT EXISTS decisions (
    spec_sha256 VARCHAR NOT NULL, seq BIGINT NOT NULL, stage VARCHAR NOT NULL,
    stage_version INTEGER NOT NULL, config_digest VARCHAR NOT NULL,
    session_id VARCHAR NOT NULL, thread_id VARCHAR NOT NULL, entry_id VARCHAR NOT NULL,
    block_pos INTEGER NOT NULL, part_pos INTEGER NOT NULL, tool_use_id VARCHAR,
    from_call INTEGER NOT NULL, action VARCHAR NOT NULL, reason VARCHAR NOT NULL,
    before_sha256 VARCHAR, after_sha256 VARCHAR, before_len BIGINT, after_len BIGINT,
    replacement VARCHAR, cache_epoch INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS runs (
    run_seq BIGINT NOT NULL, spec_sha256 VARCHAR NOT NULL, spec_name VARCHAR, started_at VARCHAR,
    finished_at VARCHAR, input_files VARCHAR, versions VARCHAR, counts VARCHAR
);
CREATE TABLE IF NOT EXISTS decision_calls (
    spec_sha256 VARCHAR NOT NULL, seq BIGINT NOT NULL, call_key VARCHAR NOT NULL
);
CREATE TABLE IF NOT EXISTS specs (spec_sha256 VARCHAR PRIMARY KEY, resolved VARCHAR);
CREATE TABLE IF NOT EXISTS token_cache (
    counter VARCHAR NOT NULL, sha256 VARCHAR NOT NULL, tokens BIGINT NOT NULL, PRIMARY KEY (counter, sha256)
);
ALTER TABLE runs ADD COLUMN IF NOT EXISTS run_id VARCHAR;
"""
FORMAT = "ctxreplay-ledger"
# the tables a ctxreplay ledger may hold (engine_usage: the live engine's, pipeline/engine/engine.py)
TABLES = frozenset({"meta", "decisions", "runs", "decision_calls", "specs", "token_cache", "engine_usage"})
# a DuckDB database file: its main header holds this magic at this offset (DuckDB storage format)
DUCKDB_MAGIC, DUCKDB_MAGIC_AT = b"DUCK", 8
# what a file that is not DuckDB is, by its first bytes (for the message)
_KNOWN_MAGIC = ((b"PAR1", "a Parquet file"), (b"SQLite format 3\x00", "a SQLite database"),
                (b"\x89HDF", "an HDF5 file"), (b"PK\x03\x04", "a ZIP file"), (b"ARROW1", "an Arrow file"))
_USE_ANOTHER = ("Pass --ledger a new file (it becomes a new, empty ledger) or an existing ctxreplay ledger, or "
                "leave --ledger out to use OUT/ledger.duckdb")

T = TypeVar("T")


def _what_file(head: bytes) -> str:
    for magic, what in _KNOWN_MAGIC:
        if head.startswith(magic):
            return what
    if head.lstrip()[:1] in (b"{", b"["):
        return "a JSON file"
    return "not a DuckDB database"


def check_file(path: Path, *, read_only: bool = False) -> str:
    """What `path` is, before DuckDB opens it: "new" (no such file), "empty" (0 bytes) or "duckdb";
    a LedgerError for anything else (and, read-only, for a new or empty file too)."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(64)
    except FileNotFoundError:
        if read_only:
            raise LedgerError(f"{path}: no ledger here; run `ctxreplay run ... --ledger {path}` first, or pass "
                              f"the ledger a run wrote") from None
        return "new"
    except IsADirectoryError:
        raise LedgerError(f"ledger {path} is a directory, not a file: pass a file path") from None
    except OSError as exc:
        raise LedgerError(f"{path}: cannot read the ledger: {exc.strerror or exc}. Pass a ledger file you can "
                          f"read and write") from exc
    if not head:
        if read_only:
            raise LedgerError(f"{path} is an empty file: no ctxreplay run has written this ledger yet")
        return "empty"
    if head[DUCKDB_MAGIC_AT:DUCKDB_MAGIC_AT + len(DUCKDB_MAGIC)] != DUCKDB_MAGIC:
        raise LedgerError(f"{path} is {_what_file(head)}, not a ctxreplay ledger (a DuckDB file): ctxreplay "
                          f"never writes into a file it did not make. {_USE_ANOTHER}")
    return "duckdb"


def _reads(method: Callable[..., T]) -> Callable[..., T]:
    """A DuckDB error while reading the ledger (a file cut short, overwritten) as a LedgerError."""

    @functools.wraps(method)
    def guarded(self: Ledger, *args: Any, **kwargs: Any) -> T:
        try:
            return method(self, *args, **kwargs)
        except duckdb.Error as exc:
            raise self.damaged(exc) from exc

    return guarded


RUN_COLUMNS = ("run_seq", "spec_sha256", "spec_name", "started_at", "finished_at", "input_files", "versions",
               "counts", "run_id")


def _listed(names: list[str], limit: int = 5) -> str:
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _digests(shas: list[str]) -> np.ndarray:
    """sha256s (hex) as their 32-byte digests, one numpy bytes value each (`Ledger.cached_tokens`)."""
    return np.frombuffer(bytes.fromhex("".join(shas)), dtype="S32") if shas else np.empty(0, dtype="S32")


class Ledger:
    def __init__(self, path: str | Path, *, read_only: bool = False) -> None:
        self.path = Path(path)
        kind = check_file(self.path, read_only=read_only)
        try:
            if not read_only:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                if kind == "empty":  # DuckDB refuses a 0-byte file: it becomes a new ledger
                    self.path.unlink()
            self.con = connect(str(self.path), read_only=read_only)
        except (duckdb.Error, OSError) as exc:
            msg = (f"{self.path}: cannot open the ledger: {exc}. Is another ctxreplay run using it, or is it "
                   f"not a ctxreplay ledger? Pass another file with --ledger")
            raise LedgerError(msg) from exc
        try:
            ours = self._identify()
        except LedgerError:
            self.con.close()
            raise
        if read_only and ours == "new":
            self.con.close()
            raise LedgerError(f"{self.path} is an empty DuckDB database: no ctxreplay run has written this ledger yet")
        if not read_only:
            try:
                # in one transaction, so that a crash never leaves half the tables
                self.con.execute("BEGIN TRANSACTION")
                self.con.execute(_DDL)
                row = self.con.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchall()
                if not row:
                    self.con.execute("INSERT INTO meta VALUES ('schema_version', ?)", [str(SCHEMA_VERSION)])
                elif row[0][0] != str(SCHEMA_VERSION):
                    self.con.execute("ROLLBACK")
                    self.con.close()
                    raise LedgerError(f"{self.path}: ledger schema version {row[0][0]}, this ctxreplay writes "
                                      f"{SCHEMA_VERSION}; use a new --ledger file")
                self.con.execute("INSERT OR IGNORE INTO meta VALUES ('format', ?)", [FORMAT])
                self.con.execute("COMMIT")
            except duckdb.Error as exc:
                self.con.close()
                raise LedgerError(f"{self.path}: not a usable ctxreplay ledger: {exc}. Pass another file with "
                                  f"--ledger") from exc
        self._pending: list[pa.Table] = []
        self._pending_calls: list[pa.Table] = []
        self._pending_tokens: dict[str, dict[str, int]] = {}  # counter -> sha256 -> tokens, not written yet
        self._earlier_all: tuple[tuple[Any, ...], pl.DataFrame] | None = None  # the last earlier_all, with its stamp
        # True when no one else writes this file while this object lives (the live engine holds the
        # ledger's lock): what it read stays true until its own next commit (`earlier_all`)
        self.exclusive = False
        self._commits = 0  # commits made through this object
        # per counter, every count its token_cache rows hold, by sha256 (read once: `_token_table`)
        self._token_tables: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    def _identify(self) -> str:
        """"ours" (a ctxreplay ledger) or "new" (a database without any table or view); a
        LedgerError for a DuckDB database of someone else's."""
        try:
            tables = sorted(r[0] for r in self.con.execute(
                "SELECT table_name FROM duckdb_tables() WHERE database_name = current_database()").fetchall())
            views = self.con.execute("SELECT count(*) FROM duckdb_views() WHERE NOT internal "
                                     "AND database_name = current_database()").fetchall()[0][0]
        except duckdb.Error as exc:
            raise self.damaged(exc) from exc
        meta: dict[str, str] = {}
        if "meta" in tables:
            try:
                meta = {str(k): str(v) for k, v in self.con.execute("SELECT key, value FROM meta").fetchall()}
            except duckdb.IOException as exc:
                raise self.damaged(exc) from exc
            except duckdb.Error:
                meta = {}  # a `meta` table of another shape: not ours
        if not tables and not views:
            return "new"
        if meta.get("format") == FORMAT or ("schema_version" in meta and set(tables) <= TABLES and not views):
            return "ours"
        what = f"tables {_listed(tables)}" if tables else f"{views} views"
        raise LedgerError(f"{self.path} is a DuckDB database but not a ctxreplay ledger: it holds {what} and no "
                          f"ctxreplay marker (a `meta` table with format = {FORMAT}). ctxreplay does not add its "
                          f"tables to another database. {_USE_ANOTHER}")

    def damaged(self, exc: BaseException) -> LedgerError:
        return LedgerError(f"{self.path}: the ledger cannot be read ({str(exc).strip().splitlines()[0][:300]}): the "
                           f"file is damaged (cut short, or overwritten). Restore it from a copy, or pass --ledger a "
                           f"new file (the run then starts an empty ledger: earlier decisions are not reused)")

    def close(self) -> None:
        self.con.close()

    # ------------------------------------------------------------------ decisions

    @_reads
    def earlier(self, spec_sha256: str, stage: str, sessions: list[str]) -> pl.LazyFrame:
        """This stage's decisions in this namespace for these sessions (STAGE_DECISION columns)."""
        cols = ", ".join(f.name for f in STAGE_DECISION)
        if not sessions:
            return pl.LazyFrame(schema=polars_schema(STAGE_DECISION))
        self.con.register("_sessions", pa.table({"session_id": sessions}))
        try:
            t = self.con.sql(
                f"SELECT {cols} FROM decisions WHERE spec_sha256 = $spec AND stage = $stage "
                f"AND session_id IN (SELECT session_id FROM _sessions) ORDER BY seq",
                params={"spec": spec_sha256, "stage": stage},
            ).to_arrow_table()
        finally:
            self.con.unregister("_sessions")
        return conform(pl.from_arrow(t), STAGE_DECISION)  # type: ignore[arg-type]

    @_reads
    def earlier_all(self, spec_sha256: str, sessions: list[str]) -> pl.DataFrame:
        """Every decision of this namespace for these sessions, in seq order: STAGE_DECISION columns
        plus `stage`, `seq` and `call_key` (null for decisions written before call keys)."""
        schema = {**polars_schema(STAGE_DECISION), "stage": pl.String, "seq": pl.Int64, "call_key": pl.String}
        if not sessions:
            return pl.DataFrame(schema=schema)
        # the rows are only ever added: the same count and last seq of the namespace's decisions and
        # call keys mean the same rows (the live engine asks at every pass; reading them again costs
        # more); with no other writer, no commit of its own since means the same rows too
        stamp = ("commits", self._commits) if self.exclusive else self.con.execute(
            "SELECT (SELECT count(*) FROM decisions WHERE spec_sha256 = $spec), "
            "(SELECT max(seq) FROM decisions WHERE spec_sha256 = $spec), "
            "(SELECT count(*) FROM decision_calls WHERE spec_sha256 = $spec)", {"spec": spec_sha256}).fetchall()[0]
        key = (spec_sha256, tuple(sessions), stamp)
        if self._earlier_all is not None and self._earlier_all[0] == key:
            return self._earlier_all[1]
        got = self._read_earlier_all(spec_sha256, sessions, schema)
        self._earlier_all = (key, got)
        return got

    def _read_earlier_all(self, spec_sha256: str, sessions: list[str], schema: dict[str, Any]) -> pl.DataFrame:
        cols = ", ".join(f"d.{f.name}" for f in STAGE_DECISION)
        self.con.register("_sessions", pa.table({"session_id": sessions}))
        try:
            t = self.con.sql(
                f"SELECT {cols}, d.stage, d.seq, c.call_key FROM decisions d LEFT JOIN decision_calls c "
                f"ON c.spec_sha256 = d.spec_sha256 AND c.seq = d.seq WHERE d.spec_sha256 = $spec "
                f"AND d.session_id IN (SELECT session_id FROM _sessions) ORDER BY d.seq",
                params={"spec": spec_sha256},
            ).to_arrow_table()
        finally:
            self.con.unregister("_sessions")
        return pl.from_arrow(t).cast(schema)  # type: ignore[union-attr,arg-type]

    @_reads
    def next_seq(self, spec_sha256: str) -> int:
        """The next free seq of this namespace, counting the rows queued for this run's commit."""
        rows = self.con.execute("SELECT coalesce(max(seq), -1) FROM decisions WHERE spec_sha256 = ?",
                                [spec_sha256]).fetchall()
        queued = sum(t.num_rows for t in self._pending if t.column("spec_sha256")[0].as_py() == spec_sha256)
        return int(rows[0][0]) + 1 + queued

    def stage(self, rows: pl.DataFrame, *, spec_sha256: str, stage: str, stage_version: int,
              config_digest: str) -> int:
        """Queue new decision rows (STAGE_DECISION columns, and `call_key` where known) of one stage
        for the commit at the end of the run: tagged with the namespace, the stage and the next seq
        numbers. Returns how many."""
        if rows.height == 0:
            return 0
        seq = self.next_seq(spec_sha256)
        seqs = pl.int_range(seq, seq + rows.height, dtype=pl.Int64)
        tagged = conform(rows, STAGE_DECISION).with_columns(
            spec_sha256=pl.lit(spec_sha256), seq=seqs,
            stage=pl.lit(stage), stage_version=pl.lit(stage_version, pl.Int32), config_digest=pl.lit(config_digest))
        self._pending.append(to_arrow(tagged, DECISIONS, where=f"ledger rows of stage '{stage}'"))
        if "call_key" in rows.columns:
            keys = rows.select(spec_sha256=pl.lit(spec_sha256), seq=seqs, call_key="call_key").filter(
                pl.col("call_key").is_not_null())
            if keys.height:
                self._pending_calls.append(keys.to_arrow().cast(pa.schema(
                    [("spec_sha256", pa.string()), ("seq", pa.int64()), ("call_key", pa.string())])))
        return rows.height

    def commit_run(self, run: dict[str, Any] | None, spec_resolved: dict[str, Any],
                   spec_sha256: str | None = None) -> None:
        """Write the queued decisions, the spec and the run row in one transaction. Without a run
        row (`run=None`, the live engine: pipeline/engine/engine.py) it writes the decisions, the token
        counts and the spec, under `spec_sha256`."""
        con = self.con
        crashpoints.point("ledger")
        try:
            con.execute("BEGIN TRANSACTION")
            for i, t in enumerate(self._pending):
                con.register(f"_new{i}", t)
                con.execute(f"INSERT INTO decisions SELECT {', '.join(DECISIONS.names)} FROM _new{i}")
                con.unregister(f"_new{i}")
                crashpoints.point("ledger")
            for i, t in enumerate(self._pending_calls):
                con.register(f"_call{i}", t)
                con.execute(f"INSERT INTO decision_calls SELECT spec_sha256, seq, call_key FROM _call{i}")
                con.unregister(f"_call{i}")
            for i, (counter, counts) in enumerate(self._pending_tokens.items()):
                t = pa.table({"counter": [counter] * len(counts), "sha256": list(counts),
                              "tokens": pa.array(list(counts.values()), pa.int64())})
                con.register(f"_tok{i}", t)
                con.execute(f"INSERT OR IGNORE INTO token_cache SELECT counter, sha256, tokens FROM _tok{i}")
                con.unregister(f"_tok{i}")
                crashpoints.point("ledger")
            con.execute("INSERT OR IGNORE INTO specs VALUES (?, ?)",
                        [run["spec_sha256"] if run is not None else spec_sha256,
                         orjson.dumps(spec_resolved, option=orjson.OPT_SORT_KEYS).decode()])
            if run is None:
                con.execute("COMMIT")
                self._committed()
                return
            seq = con.execute("SELECT coalesce(max(run_seq), -1) + 1 FROM runs").fetchall()[0][0]
            con.execute(f"INSERT INTO runs ({', '.join(RUN_COLUMNS)}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", [
                seq, run["spec_sha256"], run.get("spec_name"), run.get("started_at"), run.get("finished_at"),
                orjson.dumps(run.get("input_files", [])).decode(), orjson.dumps(run.get("versions", {})).decode(),
                orjson.dumps(run.get("counts", {})).decode(), run.get("run_id"),
            ])
            crashpoints.point("ledger")
            con.execute("COMMIT")
            self._committed()
        except Exception as exc:
            try:
                con.execute("ROLLBACK")
            except duckdb.Error:
                pass  # the failed statement may have ended the transaction already
            if isinstance(exc, duckdb.Error):
                raise LedgerError(f"{self.path}: the run could not be written to the ledger ({exc}); the ledger "
                                  f"is as it was before the run, and so are the outputs") from exc
            raise
        finally:
            self._pending = []
            self._pending_calls = []
            self._pending_tokens = {}

    def _where(self, stage: str | None, session_id: str | None) -> tuple[str, dict[str, str]]:
        conds, params = [], {}
        if stage:
            conds.append("stage = $stage")
            params["stage"] = stage
        if session_id:
            conds.append("session_id = $session")
            params["session"] = session_id
        return (" WHERE " + " AND ".join(conds) if conds else ""), params

    @_reads
    def decisions(self, *, stage: str | None = None, session_id: str | None = None,
                  with_replacement: bool = True, limit: int | None = None) -> pl.DataFrame:
        """Decision rows (all namespaces), in namespace and seq order; filtered and cut in DuckDB."""
        cols = ", ".join(c for c in DECISIONS.names if with_replacement or c != "replacement")
        where, params = self._where(stage, session_id)
        q = f"SELECT {cols} FROM decisions{where} ORDER BY spec_sha256, seq" + (f" LIMIT {int(limit)}" if limit else "")
        return pl.from_arrow(self.con.sql(q, params=params or None).to_arrow_table())  # type: ignore[return-value]

    @_reads
    def decision_counts(self, *, stage: str | None = None, session_id: str | None = None) -> pl.DataFrame:
        """How many decisions per namespace, stage, action and reason."""
        where, params = self._where(stage, session_id)
        q = (f"SELECT spec_sha256, stage, action, reason, count(*) AS len FROM decisions{where} "
             f"GROUP BY ALL ORDER BY spec_sha256, stage, action, reason")
        return pl.from_arrow(self.con.sql(q, params=params or None).to_arrow_table())  # type: ignore[return-value]

    @_reads
    def runs(self) -> pl.DataFrame:
        """One row per completed run (older ledgers, opened read-only, may lack `run_id`)."""
        return pl.from_arrow(self.con.sql("SELECT * FROM runs ORDER BY run_seq").to_arrow_table())  # type: ignore[return-value]

    # ------------------------------------------------------------------ token cache

    @_reads
    def cached_tokens(self, counter: str, shas: list[str]) -> dict[str, int]:
        """The cached counts of these texts (by sha256) that the cache holds, from the counter's rows
        read once into memory (`_token_table`): a lookup is a search in sorted arrays, not a query
        (a query for a few texts, as a live step or a snip marker asks, cost 1-3 ms, more than
        counting them)."""
        if not shas:
            return {}
        digests, tokens = self._token_table(counter)
        if not len(digests):
            return {}
        q = _digests(shas)
        at = np.searchsorted(digests, q).clip(max=len(digests) - 1)
        hit = (digests[at] == q).tolist()
        return {s: int(tokens[i]) for s, i, h in zip(shas, at.tolist(), hit, strict=True) if h}

    def _token_table(self, counter: str) -> tuple[np.ndarray, np.ndarray]:
        """The counter's token_cache rows as (sha256 digests, 32 bytes each, sorted; their counts),
        read at the first lookup (40 bytes a row); commits add theirs."""
        got = self._token_tables.get(counter)
        if got is None:
            r = self.con.execute("SELECT sha256, tokens FROM token_cache WHERE counter = ?", [counter]).fetchnumpy()
            digests = _digests(r["sha256"].tolist())
            order = np.argsort(digests, kind="stable")
            got = self._token_tables[counter] = (digests[order], np.asarray(r["tokens"], dtype=np.int64)[order])
        return got

    def _committed(self) -> None:
        """After a commit: one more commit of this object's, and the token counts it wrote join the
        counts read before, those the cache held already left as they were (INSERT OR IGNORE); the
        other counters' are read when asked."""
        self._commits += 1
        for counter, counts in self._pending_tokens.items():
            if counter not in self._token_tables:
                continue
            digests, tokens = self._token_tables[counter]
            new = _digests(list(counts))
            vals = np.fromiter(counts.values(), np.int64, len(counts))
            order = np.argsort(new, kind="stable")
            new, vals = new[order], vals[order]
            if len(digests):
                at = np.searchsorted(digests, new).clip(max=len(digests) - 1)
                fresh = digests[at] != new
                new, vals = new[fresh], vals[fresh]
            at = np.searchsorted(digests, new)
            self._token_tables[counter] = (np.insert(digests, at, new), np.insert(tokens, at, vals))

    @property
    def pending_tokens(self) -> int:
        """How many token counts are queued, not written yet."""
        return sum(len(c) for c in self._pending_tokens.values())

    def store_tokens(self, counter: str, counts: dict[str, int]) -> None:
        """Queue new token counts; written with the run's commit (same transaction)."""
        if counts:
            self._pending_tokens.setdefault(counter, {}).update(counts)
