"""How a re-run reads the previous run's messages back (pipeline/batch/reuse.py): from the row
groups that hold the asked sha256, found by an index of the file's sha256 column read once per run."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from ctxreplay.pipeline.assembly.store import MESSAGES_FILE
from ctxreplay.pipeline.batch.manifest import Prior
from ctxreplay.pipeline.batch.reuse import _messages


def _write(run: Path, groups: list[list[str]]) -> None:
    run.mkdir(parents=True, exist_ok=True)
    schema = pa.schema([("sha256", pa.string()), ("group", pa.int32())])
    with pq.ParquetWriter(run / MESSAGES_FILE, schema) as w:
        for g, shas in enumerate(groups):
            w.write_table(pa.table({"sha256": shas, "group": [g] * len(shas)}, schema=schema))


def _read(prior: Prior, shas: list[str]) -> list[tuple[str, int]]:
    t = _messages(prior, shas)
    return sorted(zip(t.column("sha256").to_pylist(), t.column("group").to_pylist(), strict=True))


def test_the_rows_come_from_the_row_groups_that_hold_them(tmp_path: Path) -> None:
    _write(tmp_path, [["a", "b"], ["c"], ["d", "e"]])
    prior = Prior(tmp_path, {}, {})
    assert _read(prior, ["e", "a"]) == [("a", 0), ("e", 2)]
    assert _read(prior, ["c"]) == [("c", 1)]
    assert sorted(prior.cache["message_groups"]) == [0, 1, 2]  # each group read once, kept
    assert _read(prior, []) == []


def test_a_sha256_in_two_row_groups_is_read_from_the_first(tmp_path: Path) -> None:
    # the same message written by two batches: the index keeps the first row group that holds it
    _write(tmp_path, [["x"], ["a"], ["a", "y"]])
    prior = Prior(tmp_path, {}, {})
    assert _read(prior, ["a"]) == [("a", 1)]
    assert list(prior.cache["message_groups"]) == [1]


def test_a_sha256_the_file_lacks_reads_the_file_by_a_filter(tmp_path: Path) -> None:
    # outputs that do not belong together: the rows that are there, found by a scan of the file
    _write(tmp_path, [["a"], ["b"]])
    prior = Prior(tmp_path, {}, {})
    assert _read(prior, ["b", "zz"]) == [("b", 1)]
    assert "message_groups" not in prior.cache  # not through the row-group path
