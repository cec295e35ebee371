"""Groups reused from the previous run (issue 10, point 2; pipeline/batch/manifest.py): their rows read
back from the previous run's outputs by session (quarantined lines by file), their requests/ and
spills linked, their accounting rebuilt from the manifest, as one BatchResult that the runner
writes with the batch's groups that ran again."""

from __future__ import annotations

import os
import shutil
from collections import OrderedDict
from pathlib import Path
from typing import Any

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from ctxreplay.pipeline.assembly.store import CALL_MESSAGES_FILE, MESSAGES_FILE
from ctxreplay.pipeline.batch.batchout import SHARED, merge_stats
from ctxreplay.pipeline.batch.batchrun import BatchOutputs, BatchResult
from ctxreplay.pipeline.batch.manifest import FACTS_FILE, Prior, load_from_dict
from ctxreplay.pipeline.loaders import LoadResult
from ctxreplay.pipeline.loaders.base import QuarantineRow
from ctxreplay.pipeline.targets import Violation
from ctxreplay.schemas.blocks import BLOCKS
from ctxreplay.schemas.check import empty_table

KEYS = ["session_id", "thread_id", "call"]
# row groups of the previous messages.parquet kept decoded between batches (a batch's messages lie in
# its own row group and a few earlier ones; on the 190 MB tree 1-3 of 13, one of them always the first)
KEEP_MESSAGE_GROUPS = 4


def _reader(prior: Prior, batches: set[int]) -> Any:
    """read(file, column, values): the rows of a previous output whose `column` is in `values`,
    from the row groups of these previous batches only (where the manifest says which they are)."""

    def read(path: Path, column: str, values: list[Any]) -> pa.Table:
        import pyarrow.compute as pc  # imported when used: a warm run never needs it (~40 ms)
        shared, f = _opened(prior, path)
        if not values:
            return empty_table(f.schema_arrow)
        if not f.num_row_groups:
            return empty_table(f.schema_arrow)
        where = prior.row_groups.get(path.name)
        if path.name == "calls.parquet" and where is None:
            # written once at the end of the run (not per batch): read once, kept for the re-run's batches
            whole = prior.cache.get("calls")
            if whole is None:
                whole = prior.cache["calls"] = f.read()
            return whole.filter(pc.is_in(pc.cast(whole.column(column), pa.string()), pa.array(values, pa.string())))
        if where is None or len(where) != f.num_row_groups or None in batches:
            read.scanned = True  # type: ignore[attr-defined]
            return pq.read_table(path, filters=[(column, "in", values)], read_dictionary=shared)
        t = f.read_row_groups([i for i, b in enumerate(where) if b in batches])
        return t.filter(pc.is_in(pc.cast(t.column(column), pa.string()), pa.array(values, pa.string())))

    read.scanned = False  # type: ignore[attr-defined]
    return read


def _opened(prior: Prior, path: Path) -> tuple[list[str], Any]:
    """(the columns read as dictionaries, the file opened) of a previous output, its footer parsed
    once per run and not once per batch that reads it (the previous run's files do not change while
    this one reads them; the file itself is opened per read, so no handle outlives it). A line's
    text, repeated on each of its blocks, is read as a dictionary, once (batchout.SHARED)."""
    shared, meta = _footer(prior, path)
    return shared, pq.ParquetFile(path, metadata=meta, read_dictionary=shared)


def _footer(prior: Prior, path: Path) -> tuple[list[str], Any]:
    """(the columns read as dictionaries, the parsed footer) of a previous output, once per run."""
    files = prior.cache.setdefault("footers", {})
    got = files.get(path)
    if got is None:
        meta = pq.read_metadata(path)
        got = files[path] = (sorted(SHARED & set(meta.schema.to_arrow_schema().names)), meta)
    return got


def _messages(prior: Prior, shas: list[str]) -> pa.Table:
    """The rows of the previous messages.parquet with these sha256: read from the row groups that
    hold them (an index of its sha256 column, read once per run), not by a filtered scan of the
    whole file per batch (what made an append re-run read every message once per batch)."""
    import numpy as np
    import pyarrow.compute as pc  # imported when used: a warm run never needs it (~40 ms)

    path = prior.run_dir / MESSAGES_FILE
    f = _opened(prior, path)[1]
    if not shas:
        return empty_table(f.schema_arrow)
    index = prior.cache.get("messages")
    if index is None:  # every sha256 of the file, and the row group of each
        parts = [f.read_row_group(i, columns=["sha256"]).column(0) for i in range(f.num_row_groups)]
        shas_all = pa.chunked_array([ch for c in parts for ch in c.chunks], f.schema_arrow.field("sha256").type)
        index = prior.cache["messages"] = (pc.cast(shas_all, pa.string()).combine_chunks(),
                                           np.repeat(np.arange(len(parts)), [len(c) for c in parts]))
    found = pc.index_in(pa.array(shas, pa.string()), value_set=index[0])  # its first row group
    if found.null_count:  # not in the previous run's store: that run's outputs do not belong together
        return _reader(prior, {None})(path, "sha256", shas)
    where = set(index[1][found.to_numpy()].tolist())
    # a batch's messages lie in its own row group and in a few earlier ones (the first batch's most
    # of all: what every session shares), so the last row groups read are kept for the next batches
    recent = prior.cache.setdefault("message_groups", OrderedDict())
    parts = []
    for i in sorted(where):  # type: ignore[type-var]
        got = recent.get(i)
        if got is None:
            got = recent[i] = f.read_row_group(i)
            if len(recent) > KEEP_MESSAGE_GROUPS:
                recent.popitem(last=False)
        else:
            recent.move_to_end(i)
        parts.append(got)
    t = pa.concat_tables(parts) if len(parts) > 1 else parts[0]
    return t.filter(pc.is_in(t.column("sha256"), pa.array(shas, t.schema.field("sha256").type)))


def reuse_batch(index: int, records: list[dict[str, Any]], prior: Prior, staging: Path,
                kept: dict[str, tuple[Path, int | None]] | None = None) -> BatchResult:
    """The reused groups of one batch as a BatchResult (no new decisions, no stage time). `kept`
    (kept_row_groups): the batch's row groups are copied as they are, so its blocks, which
    nothing else needs, are not read."""
    run = prior.run_dir
    batches = {r.get("batch") for r in records}
    _read = _reader(prior, batches)
    sessions = sorted({s for r in records for s in r["sessions"]})
    files = sorted({ld["path"] for r in records for ld in r["loads"]})
    quarantine = _read(run / "quarantine.parquet", "file", files)
    loaded = _loaded(records, quarantine)
    call_messages = _read(run / CALL_MESSAGES_FILE, "session_id", sessions)
    # messages.parquet holds what some call_messages row lists, nothing else (store_tables)
    shas = sorted(set(call_messages.column("sha256").to_pylist()))
    calls = pl.from_arrow(_read(run / "calls.parquet", "session_id", sessions))
    decisions = _read(run / "decisions.parquet", "session_id", sessions)
    assert isinstance(calls, pl.DataFrame)
    blocks = empty_table(pq.read_schema(run / "blocks.parquet")) if kept is not None \
        else _read(run / "blocks.parquet", "session_id", sessions)
    tables = {"blocks": blocks, "quarantine": quarantine,
              "decisions": decisions, "messages": _messages(prior, shas),
              "call_messages": call_messages}
    facts = pl.from_arrow(_read(run / FACTS_FILE, "session_id", sessions))
    assert isinstance(facts, pl.DataFrame)
    link_requests(run, staging, sorted(set(calls.get_column("thread_key").to_list())))
    stage_stats: dict[str, dict[str, Any]] = {}
    for r in records:
        for name, st in r["stage_stats"].items():
            stage_stats[name] = merge_stats(stage_stats.get(name), st)
    violations = [Violation(**v) for r in records for v in r["violations"]]
    applied = pl.from_arrow(decisions)
    assert isinstance(applied, pl.DataFrame)
    out = BatchOutputs(tables, calls, facts, [], pl.DataFrame(schema={"sha256": pl.String, "text": pl.String}),
                       stage_stats, [], violations,
                       {"threads": sum(r["threads"] for r in records),
                        "request_store": {"call_message_rows": call_messages.num_rows, "token_conflicts": 0}},
                       applied)
    # the rows of one previous row group each, in the order they were written (sorted_tables')
    presorted = len(batches) == 1 and not _read.scanned  # type: ignore[attr-defined]
    return BatchResult(index, loaded, out, [], reused=True, presorted=presorted, kept=kept)


def kept_row_groups(index: int, keys: set[str], reused: dict[str, dict[str, Any]], prior: Prior,
                    ) -> dict[str, tuple[Path, int | None]] | None:
    """Output name -> (previous file, the row group of batch `index` there, or None when it had
    no rows there), when batch `index` is made of the groups `keys` exactly as in the previous
    run and all of them are reused: its rows are then that row group of each file, as a cold run
    would write them (the groups' rows are kept whole, sorted within the batch). None otherwise."""
    from ctxreplay.pipeline.batch.batchout import FILES

    before = {k for k, r in prior.groups.items() if r.get("batch") == index}
    if not keys or before != keys or any(k not in reused for k in keys):
        return None
    out: dict[str, tuple[Path, int | None]] = {}
    for name, file in [*FILES.items(), ("call_facts", FACTS_FILE)]:
        path = prior.run_dir / file
        n = _footer(prior, path)[1].num_row_groups
        where = prior.row_groups.get(file, [] if n == 0 else None)  # no row group: not listed
        if where is None or len(where) != n or where.count(index) > 1:
            return None
        out[name] = (path, where.index(index) if index in where else None)
    return out


def _loaded(records: list[dict[str, Any]], quarantine: pa.Table) -> LoadResult:
    by_file: dict[str, list[QuarantineRow]] = {}
    for q in quarantine.to_pylist():
        by_file.setdefault(q["file"], []).append(QuarantineRow(q["file"], q["line"], q["raw"], q["reason"], q["code"],
                                                               q["raw_base64"], q.get("line_bytes")))
    for rows in by_file.values():
        rows.sort(key=lambda q: q.line)
    stats: dict[str, int] = {}
    for r in records:
        for k, v in r["stats"].items():
            stats[k] = stats.get(k, 0) + v
    loads = [load_from_dict(ld, by_file.get(ld["path"], [])) for r in records for ld in r["loads"]]
    return LoadResult(empty_table(BLOCKS), loads, [s for r in records for s in r["skipped"]], stats,
                      threads=sum(r["loaded_threads"] for r in records))


def _link(src: Path, dest: Path) -> None:
    try:
        os.link(src, dest)
    except OSError:
        shutil.copy2(src, dest)


def link_requests(run: Path, staging: Path, keys: list[str]) -> None:
    """requests/<key>.json and .jsonl of these threads, from the previous run."""
    src, dest = run / "requests", staging / "requests"
    dest.mkdir(parents=True, exist_ok=True)
    for key in keys:
        for ext in (".json", ".jsonl"):
            p = src / f"{key}{ext}"
            if p.is_file() and not (dest / p.name).exists():
                _link(p, dest / p.name)


def link_spills(run: Path, staging: Path) -> None:
    """The previous run's spilled texts (content-addressed: the reused groups' are among them)."""
    src = run / "spill"
    if not src.is_dir():
        return
    dest = staging / "spill"
    dest.mkdir(parents=True, exist_ok=True)
    for p in src.iterdir():
        if not (dest / p.name).exists():
            _link(p, dest / p.name)


def _relabel(src: Path, dest: Path, run_id: str) -> bool:
    """Copy a Parquet file of the previous run and put this run's id in its footer in place of the
    old one (same length: the data pages are not read). False when that cannot be done safely."""
    from ctxreplay.pipeline.batch.batchout import RUN_ID_KEY

    old = (pq.read_schema(src).metadata or {}).get(RUN_ID_KEY)
    new = run_id.encode()
    if old is None or len(old) != len(new):
        return False
    shutil.copyfile(src, dest)
    with open(dest, "r+b") as fh:
        fh.seek(-8, os.SEEK_END)
        n = int.from_bytes(fh.read(4), "little")
        if fh.read(4) != b"PAR1":
            return False
        fh.seek(-8 - n, os.SEEK_END)
        footer = fh.read(n)
        patched = _patch_footer(footer, old, new)
        if patched is None or len(patched) != n:
            return False
        fh.seek(-8 - n, os.SEEK_END)
        fh.write(patched)
    meta = pq.read_schema(dest).metadata or {}
    return meta.get(RUN_ID_KEY) == new and pq.ParquetFile(dest).metadata.num_rows == pq.ParquetFile(src).metadata.num_rows


def _patch_footer(footer: bytes, old: bytes, new: bytes) -> bytes | None:
    """The footer with the run id replaced: in the key-value metadata and inside the base64 Arrow
    schema (a thrift binary after the key `ARROW:schema`: field header 0x18, varint length)."""
    import base64

    out = footer.replace(old, new)
    at = out.find(b"ARROW:schema")
    if at < 0:
        return out
    i = at + len(b"ARROW:schema")
    if out[i] != 0x18:
        return None
    i += 1
    length, shift = 0, 0
    while True:
        b = out[i]
        i += 1
        length |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            break
    raw = base64.b64decode(out[i:i + length])
    if old not in raw:
        return None
    enc = base64.b64encode(raw.replace(old, new))
    if len(enc) != length:
        return None
    return out[:i] + enc + out[i + length:]


def copy_parquet(src: Path, dest: Path, run_id: str, *, store_schema: bool = True) -> None:
    """A whole output file of the previous run under this run's id: relabelled in place when it
    can be, else rewritten row group by row group."""
    from ctxreplay.pipeline.batch.batchout import (
        COMPRESSION,
        RUN_ID_KEY,
        dictionary_columns,
        statistics_columns,
    )

    if _relabel(src, dest, run_id):
        return
    dest.unlink(missing_ok=True)
    f = pq.ParquetFile(src)
    schema = f.schema_arrow
    schema = schema.with_metadata({**(schema.metadata or {}), RUN_ID_KEY: run_id.encode()})
    with pq.ParquetWriter(dest, schema, store_schema=store_schema, write_statistics=statistics_columns(schema),
                          use_dictionary=dictionary_columns(schema), **COMPRESSION) as w:
        if not store_schema:  # no Arrow schema to carry it: the run id as the file's own metadata
            w.add_key_value_metadata({RUN_ID_KEY: run_id.encode()})
        for i in range(f.num_row_groups):
            w.write_table(f.read_row_group(i).replace_schema_metadata(schema.metadata))


def reuse_all(records: list[dict[str, Any]], prior: Prior, staging: Path, run_id: str,
              ) -> tuple[LoadResult, pa.Table]:
    """Every group reused: the previous run's outputs copied whole; its accounting rebuilt, and
    its calls (calls.parquet, read once)."""
    from ctxreplay.pipeline.batch.batchout import FILES

    run = prior.run_dir
    for name, file in [*FILES.items(), ("calls", "calls.parquet"), ("call_facts", FACTS_FILE)]:
        copy_parquet(run / file, staging / file, run_id, store_schema=name != "call_messages")
    # ParquetFile, not pq.read_table: that loads pyarrow.dataset and pandas (0.3 s of a ~1 s run)
    calls = pq.ParquetFile(run / "calls.parquet").read()
    link_requests(run, staging, sorted(set(calls.column("thread_key").to_pylist())))
    link_spills(run, staging)
    return _loaded(records, pq.ParquetFile(run / "quarantine.parquet").read()), calls


__all__ = ["copy_parquet", "kept_row_groups", "link_requests", "link_spills", "reuse_all", "reuse_batch"]
