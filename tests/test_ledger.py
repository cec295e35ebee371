"""The ledger: one transaction per run, namespaced by spec, reused on re-run."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest

from ctxreplay.pipeline.batch.runner import RunOptions, run
from ctxreplay.pipeline.core.tokens import CHARS4_COUNTER
from ctxreplay.pipeline.staging.ledger import Ledger
from ctxreplay.pipeline.staging.spec import load_spec

ROOT = Path(__file__).resolve().parent.parent
CC_SAMPLE = ROOT / "data" / "samples" / "claude-projects"


def test_a_failed_commit_leaves_the_ledger_as_before(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "l.duckdb"
    led = Ledger(path)
    led.store_tokens("c", {"a" * 64: 3})
    run_row = {"spec_sha256": "s", "input_files": [{"path": "x", "sha256": "y"}], "counts": {"calls": 1}}

    class Boom(Exception):
        pass

    original = led.con.execute

    def failing(q, *a, **k):
        if q.startswith("INSERT INTO runs"):
            raise Boom("crash in the middle of the run's commit")
        return original(q, *a, **k)

    monkeypatch.setattr(led, "con", type("C", (), {"execute": staticmethod(failing), "register": led.con.register,
                                                    "unregister": led.con.unregister})())
    with pytest.raises(Boom):
        led.commit_run(run_row, {})
    monkeypatch.undo()
    assert led.con.execute("SELECT count(*) FROM token_cache").fetchall()[0][0] == 0
    assert led.con.execute("SELECT count(*) FROM runs").fetchall()[0][0] == 0
    led.close()


def test_runs_are_recorded_with_input_hashes(tmp_path: Path) -> None:
    opts = RunOptions(out_dir=tmp_path / "o", token_counter=CHARS4_COUNTER)
    spec = load_spec(preset="identity")
    run([CC_SAMPLE], spec, opts)
    run([CC_SAMPLE], spec, opts)
    led = Ledger(tmp_path / "o" / "ledger.duckdb", read_only=True)
    runs = led.runs()
    assert runs.height == 2
    assert runs["spec_sha256"].unique().to_list() == [spec.sha256]
    import json

    files = json.loads(runs["input_files"][0])
    assert len(files) == 2 and all(len(f["sha256"]) == 64 for f in files)
    led.close()


def test_a_locked_or_bad_ledger_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "not-a-ledger.duckdb"
    bad.write_text("this is not a database")
    from ctxreplay.errors import LedgerError

    with pytest.raises(LedgerError, match="is not a DuckDB database, not a ctxreplay ledger"):
        Ledger(bad)
    assert bad.read_text() == "this is not a database"


def test_decisions_table_matches_the_schema(tmp_path: Path) -> None:
    led = Ledger(tmp_path / "l.duckdb")
    df = led.decisions()
    from ctxreplay.schemas.decisions import DECISIONS

    assert df.columns == DECISIONS.names
    assert isinstance(df, pl.DataFrame)
    led.close()


def test_seq_is_unique_and_contiguous_per_namespace(tmp_path: Path) -> None:
    samples = ROOT / "data" / "samples"
    opts = RunOptions(out_dir=tmp_path / "o", token_counter=CHARS4_COUNTER)
    for preset in ("default", "identity", "default"):
        run([samples], load_spec(preset=preset), opts)
    led = Ledger(tmp_path / "o" / "ledger.duckdb", read_only=True)
    d = led.decisions()
    led.close()
    assert d.height > 0 and d["stage"].n_unique() > 1
    for _, part in d.group_by("spec_sha256"):
        assert sorted(part["seq"].to_list()) == list(range(part.height))


def test_queued_token_counts_are_each_counted_once_and_written_by_the_commit(tmp_path: Path) -> None:
    """What the live engine's flush (`_tokens_due`) reads: the distinct counts queued, per counter;
    a count queued twice is one row; the commit writes them and the queue is empty after it."""
    a, b = "ab" * 32, "cd" * 32
    led = Ledger(tmp_path / "l.duckdb")
    led.store_tokens("c", {a: 3})
    led.store_tokens("c", {a: 3, b: 5})
    led.store_tokens("d", {a: 4})
    led.store_tokens("d", {})
    assert led.pending_tokens == 3
    led.commit_run(None, {}, "s")
    assert led.pending_tokens == 0
    assert led.con.execute("SELECT counter, sha256, tokens FROM token_cache ORDER BY ALL").fetchall() == [
        ("c", a, 3), ("c", b, 5), ("d", a, 4)]
    assert led.cached_tokens("d", [a, b]) == {a: 4}
    led.store_tokens("d", {a: 99, b: 7})  # `a` is cached already: the cache keeps its count
    led.commit_run(None, {}, "s")
    assert led.cached_tokens("d", [a, b]) == {a: 4, b: 7}
    assert led.con.execute("SELECT tokens FROM token_cache WHERE counter = 'd' ORDER BY sha256").fetchall() == [
        (4,), (7,)]
    led.close()


def test_cached_tokens_tells_apart_shas_that_end_in_zero_bytes(tmp_path: Path) -> None:
    """The counts are looked up as 32-byte digests: one ending in zero bytes is found, and neither a
    sha that differs from it only there nor one that is its prefix padded otherwise is."""
    zeros, near, other = "ab" * 30 + "0000", "ab" * 30 + "00ab", "ab" * 30 + "ab00"
    path = tmp_path / "l.duckdb"
    led = Ledger(path)
    led.store_tokens("c", {zeros: 1, other: 2})
    led.commit_run(None, {}, "s")
    assert led.cached_tokens("c", [near, zeros, other]) == {zeros: 1, other: 2}
    led.close()
    fresh = Ledger(path, read_only=True)
    assert fresh.cached_tokens("c", [near, other, zeros]) == {other: 2, zeros: 1}
    assert fresh.cached_tokens("c", [near]) == {}
    fresh.close()


def test_cached_tokens_finds_what_was_committed_after_it_was_first_asked(tmp_path: Path) -> None:
    """The counter's cached counts are read at its first lookup: counts committed after it are found
    by the same ledger and by a fresh one; a sha that shares its first 64 bits with a cached one is
    another text and is not found; other counters see none."""
    path = tmp_path / "l.duckdb"
    a, b = "ab" * 32, "cd" * 32
    twin = a[:16] + "0" * 48  # the same first 64 bits as `a`, another sha
    led = Ledger(path)
    assert led.cached_tokens("c", [a, b]) == {}  # nothing cached yet (the counts are read here)
    led.store_tokens("c", {a: 3})
    assert led.cached_tokens("c", [a]) == {}  # queued, not committed
    led.commit_run(None, {}, "s")
    assert led.cached_tokens("c", [a, b, twin]) == {a: 3}
    assert led.cached_tokens("other", [a]) == {}
    led.store_tokens("c", {b: 5})
    led.commit_run(None, {}, "s")
    assert led.cached_tokens("c", [b, a]) == {a: 3, b: 5}
    led.close()
    fresh = Ledger(path, read_only=True)
    assert fresh.cached_tokens("c", [twin, b]) == {b: 5}
    fresh.close()
