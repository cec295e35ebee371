"""Memory linear in the blocks of one message (issue 23, item 5).

A user message of N tiny text blocks is one line of about 31 N bytes; every block row carries that
line (`raw_line`). Held as a plain string column, the line was copied once per block: N x 31 N bytes
(388 MB at 1,000 blocks, 2.8 GB at 6,000, 100,000 exhausted 24 GB). Now the rows share the line's
bytes (a string_view column) from the loaders through the stages and replay, and blocks.parquet gets
the line once (a dictionary). These tests measure what is held, not time: the bytes of the raw_line
column after each boundary, the dictionary written, and the peak memory of a whole run at two sizes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bench.sessiongen import BLOCKS_SESSION, many_blocks_lines
from ctxreplay.pipeline.loaders import base, claude_code
from ctxreplay.pipeline.loaders.load import load_paths
from ctxreplay.schemas.blocks import BLOCKS
from ctxreplay.schemas.check import filter_rows, shared_strings, take_rows, to_arrow, view_dictionary

N = 2000  # blocks in the message: a 62 kB line, 124 MB if copied on every block


def _write(d: Path, n: int, turns: int = 1) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    f = d / f"{BLOCKS_SESSION}.jsonl"
    f.write_text("\n".join(many_blocks_lines(n, turns)) + "\n")
    return f


def _held(col: pa.Array | pa.ChunkedArray) -> int:
    """Bytes of the column's buffers (data and views), each buffer counted once."""
    chunks = col.chunks if isinstance(col, pa.ChunkedArray) else [col]
    seen: dict[int, int] = {}
    for c in chunks:
        for b in c.buffers():
            if b is not None:
                seen[b.address] = max(seen.get(b.address, 0), b.size)
        if pa.types.is_dictionary(c.type):
            seen[id(c)] = _held(c.dictionary)
    return sum(seen.values())


@pytest.mark.parametrize("way", ["fits", "coerced", "careful"])
def test_a_line_is_held_once_whatever_its_blocks(tmp_path: Path, way: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Every way the Claude Code loader makes its table shares a line's bytes between its block rows:
    gathered from the entries' columns; made as values (a value that does not fit its column, here a
    number where a text is read, sends the load that way); and `careful`: the long line read the
    careful way (`read_line`) beside lines read the plain way, so the raw lines come from two
    sources (gathered from both as they were, the columnar loader copied the long line once per
    block)."""
    f = _write(tmp_path / "in", N)
    if way == "coerced":
        f.write_text(f.read_text().replace('"text": "x"', '"text": 1', 1))
    if way == "careful":
        plain = claude_code.plain_object
        monkeypatch.setattr(claude_code, "plain_object",
                            lambda data, view, s, e, first: base.NOT_PLAIN if e - s > 1000 else plain(data, view, s, e, first))
    res = load_paths([tmp_path / "in"])
    assert bool(res.stats.get("fields_coerced")) is (way == "coerced")
    lines = f.read_text().splitlines()
    size = f.stat().st_size
    raw = res.blocks.column("raw_line")
    assert res.blocks.num_rows == N + 1
    assert Counter(raw.to_pylist()) == {lines[0]: N, lines[1]: 1}
    # the file's bytes (a few times over at most) and a 16-byte view per row: not the line per block
    assert _held(raw) < 4 * size + 16 * res.blocks.num_rows
    # through polars and back (the stages' frames, the table replay reads and the writer gets)
    frame = pl.from_arrow(res.blocks)
    assert isinstance(frame, pl.DataFrame)
    back = to_arrow(frame, BLOCKS, where="test")
    assert back.schema == BLOCKS
    assert _held(back.column("raw_line")) < 4 * size + 16 * back.num_rows
    assert back.column("raw_line").to_pylist() == frame.get_column("raw_line").to_list()
    # written as a dictionary: the line once
    d = view_dictionary(back.column("raw_line"))
    assert sorted(d.dictionary.to_pylist()) == sorted(lines)
    assert d.to_pylist() == raw.to_pylist()


def test_shared_columns_keep_values_through_take_filter_and_dictionary() -> None:
    long_a, long_b = "a" * 40, "b" * 40
    values = [long_a, "short", long_b, long_a, "short", "", long_b, long_a]
    arr = shared_strings(values)
    assert arr.type == pa.string_view() and arr.to_pylist() == values
    t = pa.table({"raw": arr, "k": list(range(len(values)))})
    assert take_rows(t, pa.array([7, 0, 2])).to_pylist() == [t.slice(i, 1).to_pylist()[0] for i in (7, 0, 2)]
    kept = filter_rows(t, pa.array([True, None, False, True, True, False, True, False]))
    assert kept.column("k").to_pylist() == [0, 3, 4, 6]
    assert kept.column("raw").to_pylist() == [values[i] for i in (0, 3, 4, 6)]
    # a sliced, chunked column: the dictionary maps every row back to its own value
    chunked = pa.chunked_array([arr.slice(1), arr.slice(0, 3)])
    d = view_dictionary(chunked)
    assert d.to_pylist() == values[1:] + values[:3]
    assert len(d.dictionary) <= 2 * len(set(values))
    assert view_dictionary(arr).dictionary.to_pylist().count(long_a) == 1  # one buffer: the value once


def test_blocks_parquet_holds_every_rows_line_as_before(tmp_path: Path) -> None:
    """A modest message (and a second turn) gives the blocks file it gave before: each row's exact
    line, plain strings on disk (no dictionary type for readers), not-null, the schema's metadata; a
    re-run that reuses the batch writes the same rows."""
    f = _write(tmp_path / "in", 40, turns=2)
    lines = f.read_text().splitlines()
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "ctxreplay", "run", str(tmp_path / "in"), "--out", str(out), "--no-cache"]
    subprocess.run(cmd, check=True, capture_output=True, cwd=tmp_path)
    path = out / "blocks.parquet"
    schema = pq.read_schema(path)
    assert schema.field("raw_line").type == pa.string() and not schema.field("raw_line").nullable
    assert schema.metadata[b"name"] == BLOCKS.metadata[b"name"] and b"ctxreplay_run_id" in schema.metadata
    blocks = pl.read_parquet(path)
    assert blocks.schema["raw_line"] == pl.String
    by_line = dict(zip(blocks.get_column("source_line").to_list(), blocks.get_column("raw_line").to_list(),
                       strict=True))
    assert by_line == {i + 1: line for i, line in enumerate(lines)}
    assert blocks.filter(pl.col("source_line") == 1).height == 40
    assert json.loads(by_line[3])["message"]["content"] == [{"type": "text", "text": "x"}] * 40
    first = blocks.sort(blocks.columns)
    subprocess.run(cmd, check=True, capture_output=True, cwd=tmp_path)  # reuses the batch
    summary = json.loads((out / "summary.json").read_text())
    assert summary["groups"]["reused"] == 1, summary["groups"]
    assert pl.read_parquet(path).sort(blocks.columns).equals(first)


_PEAK = """
import resource, sys
from pathlib import Path
from ctxreplay.pipeline.batch import runner
from ctxreplay.pipeline.staging.spec import load_spec
runner.run([Path(sys.argv[1])], load_spec(preset="default"), runner.RunOptions(out_dir=Path(sys.argv[2]), jobs=1))
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def _peak_kib(tmp_path: Path, n: int) -> int:
    _write(tmp_path / f"in{n}", n)
    p = subprocess.run([sys.executable, "-c", _PEAK, str(tmp_path / f"in{n}"), str(tmp_path / f"out{n}")],
                       check=True, capture_output=True, text=True, cwd=tmp_path, timeout=600)
    return int(p.stdout.split()[-1])


def test_a_whole_run_grows_linearly_with_the_blocks_of_one_message(tmp_path: Path) -> None:
    """Peak memory of a whole run (load, stages, replay, cache simulation, outputs) at 500 and at
    4,000 blocks in one message: the 3,500 more blocks cost a few kB each (about 20 MB), where one
    copy of the line per block cost over 1 GB more (a 124 kB line on 4,000 rows, copied at several
    boundaries)."""
    small, big = _peak_kib(tmp_path, 500), _peak_kib(tmp_path, 4000)
    assert big - small < 200 * 1024, f"peak {small / 1024:.0f} MiB at 500 blocks, {big / 1024:.0f} MiB at 4,000"


def test_the_table_keeps_the_message_lines_not_the_file(tmp_path: Path) -> None:
    """raw_line views point into the file's bytes only where its message lines are most of them:
    beside a large line that is no message (1 MB of progress), the table holds the messages' lines
    (a few hundred bytes), not the file."""
    f = _write(tmp_path / "in", 3)
    lines = f.read_text().splitlines()
    big = json.dumps({"type": "progress", "uuid": "p1", "parentUuid": None, "sessionId": BLOCKS_SESSION,
                      "data": {"type": "hook_progress", "output": "z" * 1_000_000}})
    f.write_text("\n".join([big, *lines]) + "\n")
    res = load_paths([tmp_path / "in"])
    raw = res.blocks.column("raw_line")
    assert sorted(set(raw.to_pylist())) == sorted(lines)
    assert _held(raw) < 4 * sum(len(x) for x in lines) + 16 * res.blocks.num_rows
    f.write_text("\n".join([*lines, json.dumps({"type": "summary", "summary": "s"})]) + "\n")  # mostly messages
    res = load_paths([tmp_path / "in"])
    assert _held(res.blocks.column("raw_line")) <= f.stat().st_size + 16 * res.blocks.num_rows
