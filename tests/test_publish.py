"""The output directory (issue 8, defect 4): a run is staged and published all at once; readers
go through `current`; what interrupted runs left behind is cleaned (only what the record of OUT
lists: issue 23, tests/test_foreign_outputs.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import polars as pl
import pytest
from click.testing import CliRunner

import ctxreplay.pipeline.batch.batchrun as batchrun_mod
import ctxreplay.pipeline.batch.runner as runner_mod
from ctxreplay.errors import CtxReplayError, OutputError
from ctxreplay.pipeline.batch.runner import RunOptions, run
from ctxreplay.pipeline.commands.cli import main
from ctxreplay.pipeline.core.outdir import OutputDir, resolve_run
from ctxreplay.pipeline.core.tokens import CHARS4_COUNTER
from ctxreplay.pipeline.staging.spec import load_spec
from tests.crashkit import SAMPLES, leftovers, out_state

CC = SAMPLES / "claude-projects"
SID = "5f0c1d2e-3a4b-4c5d-8e9f-0a1b2c3d4e5f"


def _run(out: Path, preset: str = "identity", paths: list[Path] | None = None, **kw: object) -> runner_mod.RunResult:
    return run(paths or [CC], load_spec(preset=preset), RunOptions(out_dir=out, token_counter=CHARS4_COUNTER, **kw))


def test_outputs_are_links_through_current_into_one_run(tmp_path: Path) -> None:
    out = tmp_path / "o"
    first = _run(out)
    assert os.readlink(out / "current") == f".runs/{first.summary['run_id']}"
    for name in ("calls.parquet", "blocks.parquet", "decisions.parquet", "quarantine.parquet", "summary.json",
                 "requests"):
        assert os.readlink(out / name) == f"current/{name}"
    assert (out / "ledger.duckdb").is_file() and not (out / "ledger.duckdb").is_symlink()
    second = _run(out, preset="default")
    shown = out_state(out)
    assert shown.run_id == second.summary["run_id"] != first.summary["run_id"]
    assert sorted(p.name for p in (out / ".runs").iterdir()) == [shown.run_id]  # the old run is gone
    assert json.loads((out / "summary.json").read_text())["pipeline"] == "default"


def test_an_interrupted_run_leaves_the_previous_run_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "o"
    _run(out)
    before = out_state(out)

    def interrupted(*a: object, **k: object) -> None:
        # the replay has written requests/ into the staging directory when Ctrl-C comes
        staging = k["out_dir"]
        assert isinstance(staging, Path) and staging.parent.name == ".runs"
        (staging / "requests").mkdir()
        (staging / "requests" / "x.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(batchrun_mod, "replay_all", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _run(out, preset="default")
    assert out_state(out) == before
    assert leftovers(out, before.run_id) == []  # the staging directory went with the interrupt
    assert not (out / "requests" / "x.json").exists()


def test_a_failed_write_keeps_the_previous_outputs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "o"
    _run(out)
    before = out_state(out)

    def disk_full(*a: object, **k: object) -> None:
        raise OSError(28, "No space left on device", str(a[1]))

    monkeypatch.setattr(runner_mod.pq, "write_table", disk_full)
    with pytest.raises(OutputError, match=r"cannot write the outputs in .*: No space left on device \(.*calls.parquet"
                                          r"\)\. The previous outputs are kept"):
        _run(out, preset="default")
    monkeypatch.undo()
    assert out_state(out) == before and leftovers(out, before.run_id) == []


def _writer_threads() -> list[str]:
    import threading

    return [t.name for t in threading.enumerate() if t.name.startswith("ctxreplay-writer")]


def test_a_failed_batch_write_on_the_writer_thread_keeps_the_previous_outputs(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch's outputs are written on a thread of their own (pipeline/batch/batchout.py, Writers):
    its error is the run's one paragraph all the same, the previous outputs stay, and no thread
    is left behind."""
    import pyarrow.parquet as pq

    out = tmp_path / "o"
    _run(out, batch_bytes=1, paths=[SAMPLES])
    before = out_state(out)
    real = pq.ParquetWriter.write_table
    seen: list[str] = []

    def disk_full(self: pq.ParquetWriter, table: object, *a: object, **k: object) -> None:
        import threading

        seen.append(threading.current_thread().name)
        if str(self.where).endswith("decisions.parquet"):
            raise OSError(28, "No space left on device", str(self.where))
        real(self, table, *a, **k)

    monkeypatch.setattr(pq.ParquetWriter, "write_table", disk_full)
    with pytest.raises(OutputError, match=r"cannot write the outputs in .*: No space left on device \(.*decisions"
                                          r"\.parquet\)\. The previous outputs are kept"):
        _run(out, preset="default", batch_bytes=1, paths=[SAMPLES])
    monkeypatch.undo()
    assert seen and all(n.startswith("ctxreplay-writer") for n in seen)
    assert out_state(out) == before and leftovers(out, before.run_id) == []
    assert _writer_threads() == []


def test_an_interrupt_while_a_batch_is_written_leaves_no_writer_behind(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C in the next batch while the writer thread still writes the previous one: the run
    waits for that write before it discards its staging directory; the previous run stays whole."""
    import threading
    import time

    import ctxreplay.pipeline.batch.batchout as batchout_mod

    out = tmp_path / "o"
    _run(out, batch_bytes=1, paths=[SAMPLES])
    before = out_state(out)
    slow_done = threading.Event()
    real_write, real_replay = batchout_mod.Writers._write_batch, batchrun_mod.replay_all
    calls = {"replay": 0}

    def slow_write(self: object, *a: object, **k: object) -> None:
        time.sleep(0.3)
        real_write(self, *a, **k)  # type: ignore[arg-type]
        slow_done.set()

    def replay(*a: object, **k: object) -> object:
        calls["replay"] += 1
        if calls["replay"] == 2:  # the first batch's write is under way on the writer thread
            assert not slow_done.is_set()
            raise KeyboardInterrupt
        return real_replay(*a, **k)

    monkeypatch.setattr(batchout_mod.Writers, "_write_batch", slow_write)
    monkeypatch.setattr(batchrun_mod, "replay_all", replay)
    with pytest.raises(KeyboardInterrupt):
        _run(out, preset="default", batch_bytes=1, paths=[SAMPLES])
    assert slow_done.is_set()  # waited for, not abandoned
    assert _writer_threads() == []
    assert out_state(out) == before and leftovers(out, before.run_id) == []


def test_the_crash_points_of_the_writes_are_hit_on_the_runners_thread(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The writes run on their own thread, but their crash points (one per output file of each
    batch, then calls.parquet's) are hit on the runner's thread, in the same order in every run
    (the crash tests draw their kill points from one run's trace)."""
    import threading

    from ctxreplay.pipeline.core import crashpoints

    hits: list[tuple[str, str]] = []
    real = crashpoints.point
    monkeypatch.setattr(crashpoints, "point", lambda name: (hits.append((name, threading.current_thread().name)),
                                                             real(name))[1])
    res = _run(tmp_path / "o", preset="default", batch_bytes=1, paths=[SAMPLES])
    writes = [t for n, t in hits if n == "write"]
    assert set(writes) == {threading.main_thread().name}
    batches = res.summary["groups"]["batches"]
    assert batches > 1
    assert len(writes) == 5 * batches + 2  # five outputs per batch; calls.parquet; summary.json


def test_stale_staging_and_temp_links_are_removed_by_the_next_run(tmp_path: Path) -> None:
    out = tmp_path / "o"
    _run(out)
    killed = "20260101T000000000000Z-0000001-dead00"
    od = OutputDir(out)
    with od.lock():  # a killed run's staging: listed in the record, then made
        od.adopt()
        od.clean_stale()
        (od.stage(killed) / "blocks.parquet").write_bytes(b"x" * 1000)
    os.symlink(f".runs/{killed}", out / f".current.{killed}")
    os.symlink("current/blocks.parquet", out / f".link-blocks.parquet.{killed}")
    (out / ".blocks.parquet.k3j4h5g6").write_bytes(b"x" * 100)  # not in the record: not ours, kept
    res = _run(out)
    assert sorted(res.summary["stale_outputs_removed"]) == [
        f".current.{killed}", f".link-blocks.parquet.{killed}", f".runs/{killed}"]
    assert leftovers(out, res.summary["run_id"]) == [".blocks.parquet.k3j4h5g6"]
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == [
        ".blocks.parquet.k3j4h5g6", ".ctxreplay-out.json", ".ledger.duckdb.lock", ".lock", ".runs"]


def test_an_output_directory_of_the_layout_before_staging_is_read_but_not_written(tmp_path: Path) -> None:
    """Outputs written into OUT itself (before runs were staged) cannot be told from files of
    someone else's (issue 23): readers still read them; a run refuses OUT and changes nothing."""
    out = tmp_path / "o"
    _run(tmp_path / "old")
    out.mkdir()
    for name in ("calls.parquet", "blocks.parquet", "decisions.parquet", "quarantine.parquet", "summary.json"):
        (out / name).write_bytes((tmp_path / "old" / name).read_bytes())
    (out / "requests").mkdir()
    (out / "requests" / "stale.json").write_text("{}")
    (out / "notes.txt").write_text("mine")
    assert resolve_run(out) == out
    r = CliRunner().invoke(main, ["request", str(out), SID, "--call", "1"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    with pytest.raises(OutputError, match="is not a ctxreplay output directory"):
        _run(out)
    assert (out / "requests" / "stale.json").exists() and (out / "notes.txt").read_text() == "mine"
    assert not (out / "current").exists() and not (out / ".lock").exists()


def test_readers_see_one_run(tmp_path: Path) -> None:
    out = tmp_path / "o"
    with pytest.raises(CtxReplayError, match="no ctxreplay run here"):
        resolve_run(out)
    _run(out)
    run_dir = resolve_run(out)
    assert run_dir.parent.name == ".runs" and (run_dir / "blocks.parquet").is_file()
    q = CliRunner().invoke(main, ["ledger", str(out), "--quarantine", "--json"], catch_exceptions=False)
    assert q.exit_code == 0 and json.loads(q.stdout) == {"count": 0, "rows": []}
    calls = pl.read_parquet(out / "calls.parquet")
    assert calls.height == 10


def test_a_ledger_from_before_run_ids_gets_the_column(tmp_path: Path) -> None:
    import duckdb

    from ctxreplay.pipeline.staging.ledger import Ledger

    path = tmp_path / "old.duckdb"
    con = duckdb.connect(str(path))
    con.execute("CREATE TABLE meta (key VARCHAR PRIMARY KEY, value VARCHAR); INSERT INTO meta VALUES "
                "('schema_version', '1'); CREATE TABLE runs (run_seq BIGINT NOT NULL, spec_sha256 VARCHAR NOT NULL, "
                "spec_name VARCHAR, started_at VARCHAR, finished_at VARCHAR, input_files VARCHAR, versions VARCHAR, "
                "counts VARCHAR); INSERT INTO runs VALUES (0, 'x', 'old', NULL, NULL, '[]', '{}', '{}')")
    con.close()
    res = _run(tmp_path / "o", ledger_path=path)
    led = Ledger(path, read_only=True)
    runs = led.runs()
    led.close()
    assert runs.select("run_seq", "run_id").rows() == [(0, None), (1, res.summary["run_id"])]
