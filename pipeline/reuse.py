"""Groups reused from the previous run (issue 10, point 2; pipeline/manifest.py): their rows read
back from the previous run's outputs by session (quarantined lines by file), their requests/ and
spills linked, their accounting rebuilt from the manifest, as one BatchResult that the runner
writes with the batch's groups that ran again."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.batchout import merge_stats
from pipeline.batchrun import BatchOutputs, BatchResult
from pipeline.loaders import LoadResult
from pipeline.loaders.base import QuarantineRow
from pipeline.manifest import FACTS_FILE, Prior, load_from_dict
from pipeline.store import CALL_MESSAGES_FILE, MESSAGES_FILE
from pipeline.targets import Violation
from schemas.blocks import BLOCKS

KEYS = ["session_id", "thread_id", "call"]


def _read(path: Path, column: str, values: list[Any]) -> pa.Table:
    return pq.read_table(path, filters=[(column, "in", values)]) if values else pq.read_table(path).slice(0, 0)


def reuse_batch(index: int, records: list[dict[str, Any]], prior: Prior, staging: Path) -> BatchResult:
    """The reused groups of one batch as a BatchResult (no new decisions, no stage time)."""
    run = prior.run_dir
    sessions = sorted({s for r in records for s in r["sessions"]})
    files = sorted({ld["path"] for r in records for ld in r["loads"]})
    quarantine = _read(run / "quarantine.parquet", "file", files)
    loaded = _loaded(records, quarantine)
    call_messages = _read(run / CALL_MESSAGES_FILE, "session_id", sessions)
    shas = sorted(set(call_messages.column("sha256").to_pylist()))
    calls = pl.from_arrow(_read(run / "calls.parquet", "session_id", sessions))
    decisions = _read(run / "decisions.parquet", "session_id", sessions)
    assert isinstance(calls, pl.DataFrame)
    tables = {"blocks": _read(run / "blocks.parquet", "session_id", sessions), "quarantine": quarantine,
              "decisions": decisions, "messages": _read(run / MESSAGES_FILE, "sha256", shas),
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
    return BatchResult(index, loaded, out, [], reused=True)


def _loaded(records: list[dict[str, Any]], quarantine: pa.Table) -> LoadResult:
    by_file: dict[str, list[QuarantineRow]] = {}
    for q in quarantine.to_pylist():
        by_file.setdefault(q["file"], []).append(QuarantineRow(q["file"], q["line"], q["raw"], q["reason"], q["code"],
                                                               q["raw_base64"]))
    for rows in by_file.values():
        rows.sort(key=lambda q: q.line)
    stats: dict[str, int] = {}
    for r in records:
        for k, v in r["stats"].items():
            stats[k] = stats.get(k, 0) + v
    loads = [load_from_dict(ld, by_file.get(ld["path"], [])) for r in records for ld in r["loads"]]
    return LoadResult(BLOCKS.empty_table(), loads, [s for r in records for s in r["skipped"]], stats,
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


def copy_parquet(src: Path, dest: Path, run_id: str, *, store_schema: bool = True) -> None:
    """A whole output file of the previous run, row group by row group, under this run's id."""
    from pipeline.batchout import RUN_ID_KEY

    f = pq.ParquetFile(src)
    schema = f.schema_arrow
    schema = schema.with_metadata({**(schema.metadata or {}), RUN_ID_KEY: run_id.encode()})
    with pq.ParquetWriter(dest, schema, store_schema=store_schema) as w:
        for i in range(f.num_row_groups):
            w.write_table(f.read_row_group(i).replace_schema_metadata(schema.metadata))


def reuse_all(records: list[dict[str, Any]], prior: Prior, staging: Path, run_id: str) -> tuple[LoadResult, Any]:
    """Every group reused: the previous run's outputs copied whole; its accounting rebuilt."""
    from pipeline.batchout import FILES

    run = prior.run_dir
    for name, file in [*FILES.items(), ("calls", "calls.parquet"), ("call_facts", FACTS_FILE)]:
        copy_parquet(run / file, staging / file, run_id, store_schema=name != "call_messages")
    keys = pq.read_table(run / "calls.parquet", columns=["thread_key"]).column("thread_key").to_pylist()
    link_requests(run, staging, sorted(set(keys)))
    link_spills(run, staging)
    return _loaded(records, pq.read_table(run / "quarantine.parquet")), None


__all__ = ["copy_parquet", "link_requests", "link_spills", "reuse_all", "reuse_batch"]
