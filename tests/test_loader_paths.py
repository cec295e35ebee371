"""The Claude Code loader gives one result whichever way it takes (issue 22, item 3: one loader).

A line is read the plain way (`base.plain_object`: orjson on its bytes, once) or the careful way
(`base.read_line`: repairs, notes, quarantine); the blocks table is gathered from the entries'
columns, or made as values (`base.blocks_table`, which makes a value of the wrong type fit its
column, with a note). Sending every line the careful way, and every table the values' way, must
change nothing: not a row, not a count, not a note; on the samples, the fixtures, the hostile set,
hard lines, mutated files and (corpus runs) the corpus. What the loader gives is checked against
digests frozen before it became one (test_loader_digests.py).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import polars as pl
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.make_hostile_inputs import Line, cc_entry, corpus_seeds, write_hostile_inputs
from ctxreplay.pipeline.loaders import LoadResult, base, claude_code, load_paths
from tests.loaderkit import (
    CC_SEEDS,
    EDGE_LINES,
    SID,
    answer,
    base_lines,
    mutated_files,
    session_file,
    user,
    write_files,
)
from tests.strategies import examples

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "data" / "samples"
FIXTURES = ROOT / "tests" / "fixtures" / "loaders"
ACCOUNTING = ("path", "format", "sha256", "bytes", "lines", "message_lines", "other_lines", "quarantine",
              "recovered", "stats")


def assert_same_load(ref: LoadResult, new: LoadResult, where: str = "") -> None:
    """Two loads are the same, table for table and line for line."""
    a, b = ref.blocks, new.blocks
    assert a.schema.equals(b.schema, check_metadata=True), where
    assert a.num_rows == b.num_rows, (where, a.num_rows, b.num_rows)
    for f in a.schema:
        x, y = a.column(f.name).combine_chunks(), b.column(f.name).combine_chunks()
        if not x.equals(y):
            xl, yl = x.to_pylist(), y.to_pylist()
            i = next(i for i in range(len(xl)) if xl[i] != yl[i])
            raise AssertionError(f"{where}: column {f.name} differs first at row {i}: {xl[i]!r} != {yl[i]!r}")
    assert [ld.path for ld in ref.loads] == [ld.path for ld in new.loads], where
    for la, lb in zip(ref.loads, new.loads, strict=True):
        for k in ACCOUNTING:
            va, vb = getattr(la, k), getattr(lb, k)
            if k in ("other_lines", "stats"):
                va, vb = dict(va), dict(vb)
            assert va == vb, (where, la.path, k, va, vb)
    assert ref.skipped == new.skipped, where
    assert ref.stats == new.stats, where
    assert ref.threads == new.threads, where


@contextmanager
def every_line_careful(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every line read the careful way (`read_line`), none the plain way."""
    with monkeypatch.context() as m:
        m.setattr(claude_code, "plain_object", lambda *a: base.NOT_PLAIN)
        yield


@contextmanager
def tables_by_value(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every Claude Code table made as values (`base.blocks_table`), as when a value does not fit."""
    def refuse(self: Any) -> Any:
        raise TypeError("made as values (test)")

    with monkeypatch.context() as m:
        m.setattr(claude_code.Entries, "_columns", refuse)
        yield


def all_ways(paths: list[Path], monkeypatch: pytest.MonkeyPatch, where: str = "", **kw: Any) -> LoadResult:
    """Load the plain way with the table gathered (even a small one), then every line the careful
    way, then every table as values: the same."""
    with monkeypatch.context() as m:
        m.setattr(claude_code, "SMALL_TABLE_ROWS", 0)
        got = load_paths(paths, **kw)
        with every_line_careful(monkeypatch):
            assert_same_load(got, load_paths(paths, **kw), f"{where}: every line careful")
    with tables_by_value(monkeypatch):
        assert_same_load(got, load_paths(paths, **kw), f"{where}: tables as values")
    return got


def test_the_ways_are_taken(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The two switches above do switch: with them the careful way and the values' way run (so the
    identities in this file are not one way compared with itself)."""
    careful: list[int] = []
    real_read = claude_code.read_line
    monkeypatch.setattr(claude_code, "read_line", lambda *a, **k: careful.append(1) or real_read(*a, **k))
    load_paths([SAMPLES])
    assert careful == []  # the samples' lines are all plain
    with every_line_careful(monkeypatch):
        load_paths([SAMPLES])
    assert careful
    by_value: list[int] = []
    real = claude_code.Entries._blocks_by_value
    monkeypatch.setattr(claude_code.Entries, "_blocks_by_value", lambda *a: by_value.append(1) or real(*a))
    fmt = load_paths([SAMPLES]).blocks.column("source_format").to_pylist()
    rows = fmt.count(claude_code.FORMAT)  # the Claude Code part of the table
    assert rows < claude_code.SMALL_TABLE_ROWS and by_value == [1]  # a small table is made as values
    monkeypatch.setattr(claude_code, "SMALL_TABLE_ROWS", rows)
    load_paths([SAMPLES])
    assert by_value == [1]  # gathered from the columns at the threshold
    with tables_by_value(monkeypatch):
        load_paths([SAMPLES])
    assert by_value == [1, 1]


# ---------------------------------------------------------------- shipped inputs, hard lines


def test_samples_and_fixtures(monkeypatch: pytest.MonkeyPatch) -> None:
    all_ways([SAMPLES], monkeypatch, "samples")
    for d in sorted(p for p in FIXTURES.iterdir() if p.is_dir()):
        all_ways([d], monkeypatch, d.name)
    all_ways([FIXTURES], monkeypatch, "all fixtures together")


def test_hostile_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_hostile_inputs(tmp_path / "h", huge_mb=0)
    all_ways([tmp_path / "h"], monkeypatch, "hostile directory")


@pytest.mark.parametrize("case", sorted(EDGE_LINES))
def test_edge_lines(case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p = session_file(tmp_path, [*base_lines(), *EDGE_LINES[case], user("z1", "a1", "after")])
    all_ways([p], monkeypatch, case)


def test_lines_only_the_careful_way_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A duplicate key (the last value wins, in both ways), a float where a count is read, NaN, a lone
    surrogate escape, bytes that are not UTF-8 and a byte order mark: the plain way takes what
    orjson reads as it is and leaves the rest to the careful way, line by line."""
    p = session_file(tmp_path, [
        *base_lines(),
        b'{"type":"user","uuid":"d1","uuid":"d2","parentUuid":"a1","message":{"role":"user","content":"a"}}',
        json.dumps(answer("f1", "d2", [{"type": "text", "text": "b"}])).replace('"output_tokens": 7',
                                                                             '"output_tokens": 7.5'),
        b'{"type":"user","uuid":"n1","parentUuid":"f1","message":{"role":"user","content":"a"},"n":NaN}',
        b'{"type":"user","uuid":"s1","parentUuid":"f1","message":{"role":"user","content":"a\\ud800"}}',
        b'{"type":"user","uuid":"b1","parentUuid":"s1","message":{"role":"user","content":"caf\xff"}}',
        json.dumps(user("z1", "b1", "after"))])
    p.write_bytes(b"\xef\xbb\xbf" + p.read_bytes())
    careful: list[int] = []
    real = claude_code.read_line
    monkeypatch.setattr(claude_code, "read_line", lambda load, i, *a, **k: careful.append(i) or real(load, i, *a, **k))
    res = all_ways([p], monkeypatch, "careful lines")
    assert careful[:4] == [1, 5, 6, 7]  # the BOM, NaN, the surrogate, the bytes; not the duplicate key or the float
    ld = res.loads[0]
    assert ld.quarantined_lines == 1  # the NaN line
    assert ld.stats == {"byte_order_marks": 1, "lone_surrogates_replaced": 1, "invalid_utf8_replaced": 1}
    df = pl.from_arrow(res.blocks)
    assert "d2" in df["entry_id"].to_list() and "d1" not in df["entry_id"].to_list()


def test_a_value_that_does_not_fit_is_made_to_fit_with_a_note(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    p = session_file(tmp_path, [*base_lines(), json.dumps(user("c1", "a1", [{"type": "text", "text": 5}]))])
    res = all_ways([p], monkeypatch, "coerced text")
    assert res.stats.get("fields_coerced") == 1
    assert [r["note"] for r in res.loads[0].recovered] == [
        "field text: a int where text was expected; kept as its JSON text"]
    assert "5" in res.blocks.column("text").to_pylist()


def test_the_cache_diagnosis(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p = session_file(tmp_path, [*base_lines(), *EDGE_LINES["cache diagnoses"][:4]])
    got = all_ways([p], monkeypatch, "cache diagnoses").blocks.to_pydict()
    assert [r for r in got["cache_miss_reason"] if r] == ["system_changed", "unavailable", "a_later_type"]
    assert [n for n in got["cache_missed_tokens"] if n is not None] == [119127, 3]


def test_a_bom_and_an_agent_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p = session_file(tmp_path, base_lines())
    p.write_bytes(b"\xef\xbb\xbf" + p.read_bytes())
    sub = tmp_path / "proj" / SID / "subagents"
    sub.mkdir(parents=True)
    (sub / "agent-abc123.jsonl").write_text(
        json.dumps(user("s1", None, "task", isSidechain=True, agentId="abc123")) + "\n"
        + json.dumps(answer("s2", "s1", [{"type": "text", "text": "done"}], isSidechain=True)) + "\n")
    res = all_ways([tmp_path], monkeypatch, "bom + agent")
    assert sorted(set(res.blocks.column("thread_id").to_pylist())) == ["agent-abc123", "main"]
    assert res.stats.get("byte_order_marks") == 1


def test_files_keep_their_own_lines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file without a final newline, a blank one and one with CRLF line ends keep their own lines,
    numbers and raw text (a row's raw line is its line, without its \\r)."""
    p = session_file(tmp_path, base_lines())
    p.write_bytes(p.read_bytes().rstrip(b"\n"))
    sub = tmp_path / "proj" / SID / "subagents"
    sub.mkdir(parents=True)
    (sub / "agent-a1.jsonl").write_bytes(b"\n  \n")
    (sub / "agent-b2.jsonl").write_bytes(
        json.dumps(user("s1", None, "task", isSidechain=True, agentId="b2")).encode() + b"\r\n"
        + json.dumps(answer("s2", "s1", [{"type": "text", "text": "done"}], isSidechain=True)).encode() + b"\r\n")
    (sub / "agent-c3.jsonl").write_bytes(json.dumps(user("t1", None, "other", isSidechain=True, agentId="c3")).encode())
    res = all_ways([tmp_path], monkeypatch, "own lines")
    df = pl.from_arrow(res.blocks)
    for f, line, raw in df.select("source_file", "source_line", "raw_line").rows():
        assert raw == Path(f).read_bytes().split(b"\n")[line - 1].rstrip(b"\r").decode()
    assert sorted(set(df["entry_id"].to_list())) == ["a1", "s1", "s2", "t1", "u1"]


def test_repeated_entries_are_compared_with_their_first_copy(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """An entry read again is compared with the first copy's object, parsed again from its line (a
    plain line's object is not kept), in this file or an earlier one of the session."""
    lines = [*base_lines(), json.dumps(user("x1", "a1", "same")), json.dumps(user("x1", "a1", "same")),
             json.dumps(user("x1", "a1", "other"))]
    p = session_file(tmp_path, lines)
    backup = tmp_path / "backup" / p.name
    backup.parent.mkdir()
    backup.write_bytes(p.read_bytes())
    res = all_ways([tmp_path], monkeypatch, "repeated")
    assert res.stats["duplicate_entries"] == 1 + len(lines)
    assert res.stats["conflicting_duplicate_entries"] == 1


def test_threads_load_at_once() -> None:
    # loads running at the same time in threads give the same table
    from concurrent.futures import ThreadPoolExecutor

    want = load_paths([SAMPLES]).blocks
    with ThreadPoolExecutor(3) as ex:
        got = list(ex.map(lambda _: load_paths([SAMPLES]).blocks, range(6)))
    assert all(g.equals(want) for g in got)


# ---------------------------------------------------------------- hypothesis: mutated files


def _mutated(seeds: list[Any]) -> st.SearchStrategy[list[tuple[str, list[Line]]]]:
    return st.randoms(use_true_random=False).map(lambda rng: mutated_files(seeds, rng))


@settings(max_examples=examples(30), deadline=None, suppress_health_check=[
    HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture])
@given(_mutated(CC_SEEDS))
def test_mutated_fixture_files(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch,
                               files: list[tuple[str, list[Line]]]) -> None:
    d = tmp_path_factory.mktemp("mut")
    all_ways(write_files(d, files), monkeypatch, "mutated fixture")


@pytest.mark.corpus
def test_mutated_corpus_windows(corpus: Path, tmp_path_factory: pytest.TempPathFactory,
                                monkeypatch: pytest.MonkeyPatch) -> None:
    seeds = [s for s in corpus_seeds(corpus, random.Random(5), window=30) if s.fmt == "claude_code"]

    @settings(max_examples=examples(20), deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                               HealthCheck.data_too_large])
    @given(_mutated(seeds))
    def inner(files: list[tuple[str, list[Line]]]) -> None:
        d = tmp_path_factory.mktemp("mutc")
        all_ways(write_files(d, files), monkeypatch, "mutated corpus window")

    inner()


@pytest.mark.corpus
def test_corpus(corpus: Path, corpus_extra: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    all_ways([corpus], monkeypatch, "corpus")
    all_ways([corpus_extra], monkeypatch, "corpus-extra")


@pytest.mark.slow
@pytest.mark.corpus
def test_hostile_directory_with_corpus_seeds(corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_hostile_inputs(tmp_path / "h", huge_mb=0, corpus=corpus)
    all_ways([tmp_path / "h"], monkeypatch, "hostile directory with corpus seeds")


# ---------------------------------------------------------------- a run, in one batch and in many


def _run_outputs(inp: Path, out: Path, *extra: str) -> tuple[dict[str, Any], list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    from click.testing import CliRunner

    from ctxreplay.pipeline.commands.cli import main

    r = CliRunner().invoke(main, ["run", str(inp), "--out", str(out), "--json", "--fast-tokens", "-q", "--jobs", "1",
                                  *extra])
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout)
    calls = pl.read_parquet(out / "calls.parquet").select(
        "session_id", "thread_id", "call", "request_sha256", "prompt_tokens", "timestamp").sort(
        "session_id", "thread_id", "call").rows()
    q = pl.read_parquet(out / "quarantine.parquet").select("file", "line", "code").sort("file", "line").rows()
    return {k: s[k] for k in ("files", "lines", "message_lines", "other_lines", "quarantined_lines", "sessions",
                              "threads", "calls", "skipped_files", "loader_stats")}, calls, q


def test_a_run_of_the_hostile_set_is_the_same_in_one_batch_and_in_many(tmp_path: Path) -> None:
    """The hostile set (numbers beyond a double included: `"timestamp": 1e400` once stopped a batch)
    run as one batch and as batches of 20 kB: the same outputs."""
    write_hostile_inputs(tmp_path / "h", huge_mb=0)
    one = _run_outputs(tmp_path / "h", tmp_path / "one", "--batch-bytes", str(1 << 30))
    many = _run_outputs(tmp_path / "h", tmp_path / "many", "--batch-bytes", "20000")
    assert one == many
    assert any("number_beyond_double" in str(p) for p in (tmp_path / "h").rglob("*"))


def test_a_message_entry_line_written_by_hand(tmp_path: Path) -> None:
    """cc_entry (the tests' writer of entries) against the loader: one line, one row, its fields."""
    p = session_file(tmp_path, [cc_entry(SID, "u1", None, "user", "hi", timestamp="2026-04-01T10:00:00.000Z")])
    df = pl.from_arrow(load_paths([p]).blocks)
    assert df.select("entry_id", "role", "text", "source_line").rows() == [("u1", "user", "hi", 1)]
