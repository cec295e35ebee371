"""What the runner keeps between batches: the output writers (one Parquet file per output, a row
group appended per batch; on a re-run, the row group of a batch whose groups are all reused is
copied as bytes from the previous run's file: Writers.keep, pipeline/batch/rgcopy.py), and the totals and per-call facts that only make sense over the whole
run (the summary's counts, the prompt-cache simulation). See pipeline/batch/batchrun.py.
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from ctxreplay.pipeline.assembly.store import CALL_MESSAGES_FILE, MESSAGES_FILE
from ctxreplay.pipeline.batch.batchrun import BLOCK_ORDER, DECISION_ORDER, BatchResult, output_error
from ctxreplay.pipeline.core import crashpoints
from ctxreplay.pipeline.loaders import LoadResult
from ctxreplay.pipeline.staging.stagerun import StageFailure
from ctxreplay.pipeline.targets import Violation
from ctxreplay.schemas.blocks import BLOCKS
from ctxreplay.schemas.check import empty_table, view_dictionary

RUN_ID_KEY = b"ctxreplay_run_id"

# output name -> file, in the order they are written
FILES = {"blocks": "blocks.parquet", "quarantine": "quarantine.parquet", "decisions": "decisions.parquet",
         "messages": MESSAGES_FILE, "call_messages": CALL_MESSAGES_FILE}


class Writers:
    """One ParquetWriter per output file in the staging directory, opened at the first batch; each
    batch appends its rows. messages.parquet holds each distinct message once over the run."""

    def __init__(self, staging: Path, run_id: str, out_dir: Path) -> None:
        self.staging, self.run_id, self.out_dir = staging, run_id, out_dir
        self.open: dict[str, pq.ParquetWriter] = {}
        self.seen: set[str] = set()  # sha256 of the messages written
        self.kinds: Counter[str] = Counter()
        self.bytes = 0
        # per file: the batch index of each row group written (one row group per batch that has rows),
        # so that a re-run reads back only the row groups of the batches it reuses (manifest.json)
        self.row_groups: dict[str, list[int]] = {}
        # per file, its row groups in order: ("new", i) the i-th this run encoded, or ("old", path, j)
        # the j-th of a previous run's file, copied as bytes at close (pipeline/batch/rgcopy.py)
        self.entries: dict[str, list[tuple[Any, ...]]] = {}
        # the writes go to one thread of their own, in the order asked: Parquet's encoding and
        # compression let go of the GIL, so a batch is written while the next one is loaded, staged
        # and replayed (and the last one while the cache is simulated). A batch's writes start once
        # the previous batch's are done (`write_batch` waits), so at most one batch's tables wait.
        self._pool: ThreadPoolExecutor | None = None
        self._pending: list[tuple[Future[None], int]] = []  # each write asked, and its output files

    def _later(self, files: int, fn: Callable[..., None], *args: Any) -> None:
        """`fn(*args)` on the writer thread, after what was asked before; it writes `files` output
        files (their crash points are hit when it is waited for)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="ctxreplay-writer")
        self._pending.append((self._pool.submit(fn, *args), files))

    def wait(self) -> None:
        """Until everything asked is written; a write's error (an OutputError) is raised here. The
        crash points of the files written are hit here, on the runner's thread (in the run's order
        whatever the threads' timing; pipeline/core/crashpoints.py)."""
        while self._pending:
            f, files = self._pending[0]
            f.result()
            self._pending.pop(0)
            if files:
                crashpoints.phase("write")
                for _ in range(files):
                    crashpoints.point("write")

    def write_batch(self, tables: Mapping[str, pa.Table] | Callable[[], Mapping[str, pa.Table]], batch: int,
                    kept: dict[str, tuple[Path, int | None]] | None = None) -> None:
        """A batch's rows appended to each output, on the writer thread once the previous batch's
        are written (`wait` for them); see `_write_batch`. `tables`: the batch's output tables, or
        a function that makes them, called on the writer thread (sorting a batch's blocks lets go
        of the GIL too)."""
        self.wait()
        self._later(len(FILES), self._write_batch, tables, batch, kept)

    def append(self, name: str, table: pa.Table, batch: int) -> None:
        """`table` appended to the output `name` as this batch's row group, on the writer thread."""
        self._later(0, self._append, name, table, batch)

    def keep(self, name: str, path: Path, rg: int | None, batch: int) -> None:
        """The `rg`-th row group of `path` (a previous run's output) as this batch's rows of `name`,
        after what was asked before."""
        self._later(0, self._keep, name, path, rg, batch)

    def _write_batch(self, tables: Mapping[str, pa.Table] | Callable[[], Mapping[str, pa.Table]], batch: int,
                     kept: dict[str, tuple[Path, int | None]] | None = None) -> None:
        """A batch's rows appended to each output (FILES). `kept`:
        output name -> (previous run's file, the row group of this batch there, or None when it had
        none): the batch's rows are those of that row group (every group reused, the batch made of
        the same groups), so the row group is copied as it is, not encoded again; `tables[name]` is
        not written then (blocks need not even be read). messages.parquet's row group is copied
        only when this run keeps the same messages in it (a message is written once, in the first
        batch that has it)."""
        if callable(tables):
            tables = tables()
        for name in FILES:
            table = tables[name]
            if name == "messages":
                table = self._new_messages(table)
            if kept is not None and name in kept and self._keepable(name, table, *kept[name]):
                self._keep(name, *kept[name], batch)
            else:
                self._append(name, table, batch)

    @staticmethod
    def _keepable(name: str, table: pa.Table, path: Path, rg: int | None) -> bool:
        if name == "blocks":  # not read back: the previous run's row group is the batch's rows
            return True
        if rg is None:
            return not table.num_rows
        if name != "messages":
            return True
        # the messages this run writes for the batch must be those the previous run wrote there
        old = pq.ParquetFile(path).read_row_group(rg, columns=["sha256"]).column(0)
        return old.to_pylist() == table.column("sha256").to_pylist()

    def _keep(self, name: str, path: Path, rg: int | None, batch: int) -> None:
        if rg is None:
            return
        file = FILES.get(name, f"{name}.parquet")
        if name not in self.open:  # this run's footer (its schema, its run id) needs a writer
            self._open(name, pq.ParquetFile(path).schema_arrow)
        self.entries.setdefault(file, []).append(("old", path, rg))
        self.row_groups.setdefault(file, []).append(batch)

    def _new_messages(self, t: pa.Table) -> pa.Table:
        import pyarrow.compute as pc  # imported when used: a warm run never needs it (~40 ms)
        keep = []
        for sha in t.column("sha256").to_pylist():  # a batch's parts may share a message: once
            keep.append(sha not in self.seen)
            self.seen.add(sha)
        t = t.filter(pa.array(keep, pa.bool_()))
        self.kinds.update(t.column("kind").to_pylist())
        self.bytes += int(pc.sum(pc.binary_length(t.column("canonical_json"))).as_py() or 0)
        return t

    def _append(self, name: str, table: pa.Table, batch: int) -> None:
        file = FILES.get(name, f"{name}.parquet")
        try:
            w = self.open.get(name) or self._open(name, table.schema)
            if table.num_rows or w.schema is None:
                if not table.schema.equals(w.schema, check_metadata=False):
                    table = table.cast(w.schema)
                w.write_table(table.replace_schema_metadata(w.schema.metadata), row_group_size=max(table.num_rows, 1))
                self.row_groups.setdefault(file, []).append(batch)
                entries = self.entries.setdefault(file, [])
                entries.append(("new", sum(1 for e in entries if e[0] == "new")))
        except OSError as exc:
            raise output_error(self.out_dir, exc) from exc

    def _open(self, name: str, schema: pa.Schema) -> pq.ParquetWriter:
        path = self.staging / FILES.get(name, f"{name}.parquet")
        try:
            meta = {**(schema.metadata or {}), RUN_ID_KEY: self.run_id.encode()}
            schema = schema.with_metadata(meta)
            # without the Arrow schema in the file, dictionary-encoded columns read back as strings
            plain = name == "call_messages" or any(f.name in SHARED for f in schema)
            w = self.open[name] = pq.ParquetWriter(path, schema, store_schema=not plain,
                                                   write_statistics=statistics_columns(schema),
                                                   use_dictionary=dictionary_columns(schema), **COMPRESSION)
            if plain:  # no Arrow schema: the run id (and the schema's own metadata) go in as the file's
                w.add_key_value_metadata(meta if name != "call_messages" else {RUN_ID_KEY: self.run_id.encode()})
        except OSError as exc:
            raise output_error(self.out_dir, exc) from exc
        return w

    def request_store(self, totals: Totals) -> dict[str, Any]:
        """The summary's `request_store` section."""
        self.wait()
        n = self.kinds["message"]
        return {"messages": n, "envelopes": sum(self.kinds.values()) - n, "call_message_rows": totals.call_message_rows,
                "bytes": self.bytes, "token_conflicts": totals.token_conflicts}

    def close(self) -> None:
        self.wait()
        self._stop()
        try:
            for w in self.open.values():
                w.close()
            self.open = {}
            for file, entries in self.entries.items():
                if any(e[0] == "old" for e in entries):
                    _assemble(self.staging / file, entries)
        except OSError as exc:
            raise output_error(self.out_dir, exc) from exc
        self.open = {}

    def abort(self) -> None:
        if self._pending:  # the writes under way end before their writers close
            futures_wait([f for f, _ in self._pending])
            self._pending = []
        self._stop()
        for w in self.open.values():
            with contextlib.suppress(Exception):  # the run failed already; the staging dir is discarded
                w.close()
        self.open = {}

    def _stop(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _assemble(path: Path, entries: list[tuple[Any, ...]]) -> None:
    """`path` (this run's row groups, as written) made into the output: its row groups and the
    previous run's kept ones in batch order, copied as bytes (rgcopy.splice); when the files are
    not of a shape that copies, every row group read and written again (the same rows)."""
    from ctxreplay.pipeline.batch.rgcopy import splice

    parts = [(path, e[1]) if e[0] == "new" else (e[1], e[2]) for e in entries]
    if splice(path, path, parts):
        return
    f = pq.ParquetFile(path)
    schema = f.schema_arrow
    tmp = path.with_name(f".{path.name}.rebuilt")
    store_schema = b"ARROW:schema" in (f.metadata.metadata or {})
    with pq.ParquetWriter(tmp, schema, store_schema=store_schema, write_statistics=statistics_columns(schema),
                          use_dictionary=dictionary_columns(schema), **COMPRESSION) as w:
        if not store_schema:
            w.add_key_value_metadata(f.metadata.metadata or {})
        for src, i in parts:
            t = pq.ParquetFile(src).read_row_group(i) if src != path else f.read_row_group(i)
            if not t.schema.equals(schema, check_metadata=False):
                t = t.cast(schema)
            w.write_table(t.replace_schema_metadata(schema.metadata), row_group_size=max(t.num_rows, 1))
    os.replace(tmp, path)


# every output file's compression: zstd at its fastest level writes the 190 MB tree's blocks.parquet in
# less time than snappy (the writer's CPU 0.39 -> 0.30 s) and a third of the bytes (51.6 -> 18.5 MB);
# every Parquet reader of today reads it (bench: docs/benchmarks.md, "Output files")
COMPRESSION: dict[str, Any] = {"compression": "zstd", "compression_level": 1}


# free-text columns (a block's text, a line, a message's canonical JSON, ...): no min / max statistics.
# They would prune nothing, and computing them copies a column chunk's smallest and largest values
# on top of its page buffers: writing one 200 MB text took four copies of it with them, two without
# (issue 23, item 6)
NO_STATISTICS = frozenset({"raw_line", "text", "signature", "tool_input", "image_data", "extra_json",
                           "canonical_json", "raw", "raw_base64", "replacement"})


def statistics_columns(schema: pa.Schema) -> list[str]:
    """The columns of an output file that get Parquet statistics: all but NO_STATISTICS."""
    return [f.name for f in schema if f.name not in NO_STATISTICS]


def dictionary_columns(schema: pa.Schema) -> list[str]:
    """The columns of an output file written with Parquet dictionary encoding: all but the free-text
    ones (a writer drops a column chunk's dictionary past 1 MB anyway, after copying a long text into
    it); the SHARED ones, dictionaries in memory, keep theirs."""
    return [f.name for f in schema if f.name not in NO_STATISTICS or f.name in SHARED]


def _scalar_columns(t: pa.Table, first: list[str]) -> list[str]:
    rest = [f.name for f in t.schema if f.name not in first
            and (pa.types.is_integer(f.type) or pa.types.is_string(f.type) or pa.types.is_large_string(f.type)
                 or pa.types.is_boolean(f.type) or pa.types.is_floating(f.type) or pa.types.is_timestamp(f.type))]
    return [c for c in first if c in t.column_names] + rest


# columns a value of which repeats on many rows of one message (a line's text on each of its blocks):
# dictionary-encoded in memory from the shared views the pipeline holds them as, and written as
# their dictionary and indices, so a message of N blocks costs its line once, not N times (issue 23,
# item 5); a previous run's file is read back so too (pipeline/batch/reuse.py). Strings on disk.
SHARED = frozenset({"raw_line"})


def _decoded(t: pa.Table) -> pa.Table:
    """Dictionary-encoded columns as plain values (batches from a run and from the previous run's
    files then concatenate; on disk they are plain strings either way), but the SHARED ones, which
    become (or stay) dictionary-encoded."""
    import pyarrow.compute as pc  # imported when used: a warm run never needs it (~40 ms)
    for i, f in enumerate(t.schema):
        if f.name in SHARED:
            if pa.types.is_string_view(f.type):
                d = view_dictionary(t.column(i))
                t = t.set_column(i, pa.field(f.name, d.type, nullable=f.nullable, metadata=f.metadata), d)
            continue
        if pa.types.is_dictionary(f.type):
            t = t.set_column(i, f.name, pc.cast(t.column(i), f.type.value_type))
    return t


SORT_KEYS = {
    "blocks": BLOCK_ORDER, "decisions": DECISION_ORDER, "quarantine": ["file", "line"], "messages": ["sha256"],
    "call_messages": ["thread_key", "slot", "first_call"],
}


def sorted_tables(parts: list[dict[str, pa.Table]], presorted: bool = False,
                  names: Iterable[str] | None = None) -> dict[str, pa.Table]:
    """Each output of a batch (from one or more sources) in one order fixed by its keys and then
    every other plain column, so that the rows come out the same whatever the run. `presorted`:
    one source whose rows (but its messages) are in that order already (rows of one row group of
    the previous run, pipeline/batch/reuse.py). `names`: these outputs only (default: every one)."""
    import pyarrow.compute as pc  # imported when used: a warm run never needs it (~40 ms)
    out: dict[str, pa.Table] = {}
    for name in SORT_KEYS if names is None else names:
        first = SORT_KEYS[name]
        tables = [_decoded(p[name]) for p in parts if p[name].num_rows] or [_decoded(parts[0][name])]
        t = pa.concat_tables(tables, promote_options="permissive") if len(tables) > 1 else tables[0]
        if presorted and len(parts) == 1 and name != "messages":
            out[name] = t
            continue
        # blocks, messages and call_messages: their keys are unique; decisions and quarantine: every column
        keys = _scalar_columns(t, first) if name in ("decisions", "quarantine") else first
        out[name] = _in_order(t, pc.sort_indices(t, sort_keys=[(k, "ascending", "at_end") for k in keys])) \
            if t.num_rows > 1 else t
    return out


def _in_order(t: pa.Table, order: pa.Array) -> pa.Table:
    """`t.take(order)`, or `t` itself when its rows are in that order already (a take copies every
    value: a batch's texts once more while they are written)."""
    return t if np.array_equal(order.to_numpy(), np.arange(len(order))) else t.take(order)


@dataclass
class Totals:
    """The batches' results summed, and the per-call facts for the cache simulation."""

    loads: list[Any] = field(default_factory=list)
    skipped: list[dict[str, str]] = field(default_factory=list)
    stats: Counter[str] = field(default_factory=Counter)
    calls: list[pl.DataFrame] = field(default_factory=list)
    facts: list[pl.DataFrame] = field(default_factory=list)
    groups: list[dict[str, Any]] = field(default_factory=list)  # manifest records, in group order
    applied: list[pl.DataFrame] = field(default_factory=list)
    stage_stats: dict[str, dict[str, Any]] = field(default_factory=dict)
    failures: list[StageFailure] = field(default_factory=list)
    violations: list[Violation] = field(default_factory=list)
    threads: int = 0
    loaded_threads: int = 0
    call_message_rows: int = 0
    token_conflicts: int = 0
    seconds: Counter[str] = field(default_factory=Counter)
    sim_store: Any = None
    request_store: dict[str, Any] | None = None  # the summary's, when taken from the previous run
    aliases: dict[str, str] = field(default_factory=dict)  # cache edits: message sha256 -> the one it replaces
    # the batches' new ledger rows (rows, stage, stage_version, config_digest), queued at the end
    new_decisions: list[tuple[pl.DataFrame, str, int, str]] = field(default_factory=list)
    profile: dict[str, Any] | None = None  # with `run --profile`: the passes' figures summed (merge_profile)

    def add(self, b: BatchResult) -> None:
        ld = b.loaded
        self.loads.extend(ld.loads)
        self.skipped.extend(ld.skipped)
        self.stats.update(ld.stats)
        self.loaded_threads += ld.threads
        self.groups.extend(b.groups)
        r = b.out
        if r is None:
            return
        self.calls.append(r.calls)
        self.facts.append(r.facts)
        self.applied.append(r.applied)
        for name, st in r.stage_stats.items():
            self.stage_stats[name] = merge_stats(self.stage_stats.get(name), st)
        self.failures = _merge_failures(self.failures, r.failures)
        self.violations.extend(r.violations)
        rs = r.replay_stats
        self.threads += rs["threads"]
        self.call_message_rows += rs["request_store"]["call_message_rows"]
        self.token_conflicts += rs["request_store"]["token_conflicts"]
        self.seconds.update(r.seconds)
        if r.profile is not None:
            self.profile = merge_profile(self.profile, r.profile)

    def add_store(self, tables: dict[str, pa.Table], applied: pl.DataFrame, calls: pl.DataFrame) -> None:
        """A batch's request store into the cache simulation's (each batch once), without the
        messages' bytes (SimStore.absorb: what the simulation needs of them is taken now, from the
        batch's `calls`), and the aliases of its cache edits (cachesim.cache_edit_aliases: per
        thread, so per batch)."""
        from ctxreplay.pipeline.cost.cachesim import SimStore, cache_edit_aliases

        if self.sim_store is None:
            self.sim_store = SimStore()
        part = SimStore()
        _add_to_sim(part, tables["messages"], tables["call_messages"])
        self.sim_store.absorb(part, calls)
        del part
        for new, old in cache_edit_aliases(applied, tables["call_messages"], tables["messages"]).items():
            self.aliases.setdefault(new, old)

    @property
    def n_calls(self) -> int:
        return sum(c.height for c in self.calls)

    def load_result(self) -> LoadResult:
        loads = sorted(self.loads, key=lambda ld: ld.path)
        return LoadResult(empty_table(BLOCKS), loads, self.skipped, dict(self.stats), threads=self.loaded_threads)

    @staticmethod
    def frame(parts: list[pl.DataFrame]) -> pl.DataFrame:
        return pl.concat(parts, how="vertical_relaxed") if len(parts) > 1 else parts[0]


def _add_to_sim(st: Any, messages: pa.Table, call_messages: pa.Table) -> None:
    """SimStore.from_tables, one batch at a time (messages already in the store are kept once)."""
    import pyarrow.compute as pc  # imported when used: a warm run never needs it (~40 ms)
    cols = [messages.column(c).to_pylist() for c in ("sha256", "kind", "role", "n_blocks", "tokens",
                                                      "canonical_json")]
    for sha, kind, role, nb, tok, data in zip(*cols, strict=True):
        st.add_message(sha, tok, nb, data, role=role if kind == "message" else None)
    cm = call_messages
    rc = [pc.cast(cm.column(c), pa.string()).to_pylist() if pa.types.is_dictionary(cm.schema.field(c).type)
          else cm.column(c).to_pylist() for c in ("thread_key", "slot", "first_call", "last_call", "sha256")]
    ids = st.ids
    for key, slot, first, last, sha in zip(*rc, strict=True):
        st.add_span(key, slot, first, last, ids[sha])


def merge_profile(a: dict[str, Any] | None, b: dict[str, Any]) -> dict[str, Any]:
    """Two passes' profiles (StagesResult.profile, with phases and passes) summed key by key."""
    if a is None:
        return b
    out = dict(a)
    for k, v in b.items():
        out[k] = merge_profile(a.get(k), v) if isinstance(v, dict) else a.get(k, 0) + v
    return out


def merge_stats(a: dict[str, Any] | None, b: dict[str, Any]) -> dict[str, Any]:
    if a is None:
        return dict(b)
    out = dict(a)
    for k, v in b.items():
        if k == "by_reason":
            out[k] = dict(sorted((Counter(a.get(k, {})) + Counter(v)).items()))
        elif k == "seconds":
            out[k] = round(a.get(k, 0) + v, 3)
        else:
            out[k] = a.get(k, 0) + v
    return out


def _merge_failures(a: list[StageFailure], b: list[StageFailure]) -> list[StageFailure]:
    out = list(a)
    for f in b:
        for i, g in enumerate(out):
            if (g.stage, g.position, g.owner, g.kind, g.message) == (f.stage, f.position, f.owner, f.kind, f.message):
                out[i] = StageFailure(g.stage, g.position, g.owner, g.kind, g.message,
                                      tuple(sorted(set(g.sessions) | set(f.sessions))))
                break
        else:
            out.append(f)
    return out


__all__ = ["FILES", "RUN_ID_KEY", "Totals", "Writers"]
