"""Never touch what is not ours (issue 23, items 1-3, 13, 14): `run --out` refuses a directory it
did not write and, in its own, removes or replaces only what its record lists; a ledger where a
run writes is refused; a --ledger that is not a ctxreplay ledger is refused before DuckDB writes
a byte (and DuckDB never fetches an extension); a damaged ledger is a clear error;
call_messages.parquet names its run; one writer per --golden."""

from __future__ import annotations

import json
import os
import socket
import sqlite3
import sys
import time
from pathlib import Path
from typing import Any

import duckdb
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from bench.make_hostile_inputs import FOREIGN_OUT_FILES, foreign_out_dir, not_ledgers
from ctxreplay.errors import LedgerError, OutputError
from ctxreplay.pipeline.batch.runner import RunOptions, run
from ctxreplay.pipeline.commands.cli import main
from ctxreplay.pipeline.core.outdir import OUTPUT_NAMES, OWNED, RunLock
from ctxreplay.pipeline.core.tokens import CHARS4_COUNTER
from ctxreplay.pipeline.staging.ledger import FORMAT, Ledger
from ctxreplay.pipeline.staging.spec import load_spec
from tests.crashkit import RUN_ID_KEY, SAMPLES, cli, leftovers, out_state, popen

CC = SAMPLES / "claude-projects"
ARGS = [str(CC), "--preset", "identity", "--fast-tokens", "-q"]


def _cli(*args: Any) -> Any:
    return CliRunner().invoke(main, [str(a) for a in args])


def _run(out: Path, preset: str = "identity", **kw: Any) -> Any:
    return run([CC], load_spec(preset=preset), RunOptions(out_dir=out, token_counter=CHARS4_COUNTER, **kw))


def _paragraph(r: Any) -> str:
    """The one paragraph a refused command printed: exit 2, one line, no traceback, no bug."""
    err = r.stderr
    code = r.exit_code if hasattr(r, "exit_code") else r.returncode
    assert code == 2, err
    assert "Traceback" not in err and "internal error" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ctxreplay: "), err
    return lines[0]


def _tree(d: Path) -> dict[str, bytes | str]:
    """Every entry under d: a file's bytes, a link's target, a directory's marker."""
    found: dict[str, bytes | str] = {}
    for root, dirs, files in os.walk(d):
        for n in dirs + files:
            p = Path(root) / n
            rel = str(p.relative_to(d))
            found[rel] = f"-> {os.readlink(p)}" if p.is_symlink() else ("<dir>" if p.is_dir() else p.read_bytes())
    return found


# ------------------------------------------------------------------- 1: --out never deletes what is not ours


def test_a_directory_that_is_not_an_output_is_refused_and_left_as_it_was(tmp_path: Path) -> None:
    out = tmp_path / "o"
    foreign_out_dir(out)
    before = _tree(out)
    r = _cli("run", *ARGS, "--out", out)
    line = _paragraph(r)
    assert f"--out {out} is not a ctxreplay output directory" in line
    for name in (".runs", ".summary.json.bak", "requests", "summary.json"):
        assert name in line  # what was found
    assert "Pass a new or empty directory as --out, or remove" in line  # the fix
    assert _tree(out) == before  # not a byte changed, not even a lock file
    for rel, data in FOREIGN_OUT_FILES.items():
        assert (out / rel).read_bytes() == data


def test_diff_out_into_a_foreign_directory_is_refused(tmp_path: Path) -> None:
    golden = tmp_path / "g"
    assert _cli("snapshot", SAMPLES / "codex-sample.jsonl", "--preset", "identity", "--golden", golden,
                "--fast-tokens", "-q").exit_code == 0
    out = tmp_path / "o"
    foreign_out_dir(out)
    before = _tree(out)
    r = _cli("diff", SAMPLES / "codex-sample.jsonl", "--preset", "identity", "--golden", golden, "--out", out, "-q")
    assert "is not a ctxreplay output directory" in _paragraph(r)
    assert _tree(out) == before


def test_an_empty_directory_is_used_and_becomes_ours(tmp_path: Path) -> None:
    out = tmp_path / "o"
    out.mkdir()
    res = _run(out)
    shown = out_state(out)
    assert shown.run_id == res.summary["run_id"]
    record = json.loads((out / OWNED).read_text())
    assert record["format"] == "ctxreplay-out" and record["runs"] == [shown.run_id]
    assert set(record["links"]) == {p.name for p in (out / ".runs" / shown.run_id).iterdir()}


def test_a_new_out_that_holds_only_a_record_temp_file_is_taken_and_cleaned(tmp_path: Path) -> None:
    """A Ctrl-C while the first run of a new OUT wrote its record left `.ctxreplay-out.json.tmp-*`
    and nothing else (bench_signals, 1 SIGINT in 20): the next run refused OUT as not ours. Such a
    file is ours by its name; one that only looks like it is still foreign."""
    out = tmp_path / "o"
    out.mkdir()
    (out / f"{OWNED}.tmp-475d404c").write_bytes(b'{"format": "ctxre')
    res = _run(out)
    assert out_state(out).run_id == res.summary["run_id"]
    assert not [p for p in out.iterdir() if p.name.startswith(f"{OWNED}.tmp-")]
    other = tmp_path / "p"
    other.mkdir()
    (other / f"{OWNED}.tmp-mine").write_bytes(b"not ctxreplay's")
    r = _cli("run", *ARGS, "--out", str(other))
    assert "is not a ctxreplay output directory" in _paragraph(r)
    assert sorted(p.name for p in other.iterdir()) == [f"{OWNED}.tmp-mine"]


def test_a_record_write_stopped_by_ctrl_c_leaves_no_temp_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ctxreplay.pipeline.core import outdir

    out = tmp_path / "o"
    out.mkdir()
    od = outdir.OutputDir(out)

    def interrupted(*a: object, **k: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(outdir.os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        od.adopt()
    assert list(out.iterdir()) == []


def test_out_empty_string_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    r = _cli("run", *ARGS, "--out", "")
    assert "--out is empty or '.'" in _paragraph(r)
    assert list(cwd.iterdir()) == []


def test_foreign_files_inside_our_output_are_left_alone(tmp_path: Path) -> None:
    out = tmp_path / "o"
    first = _run(out)
    (out / "notes.txt").write_text("mine")
    (out / ".runs" / "keep").mkdir()
    (out / ".runs" / "keep" / "data.txt").write_text("keep me too")
    (out / ".summary.json.bak").write_text("a backup")
    (out / ".blocks.parquet.k3j4h5g6").write_text("looks like an old temp file, is not ours")
    os.symlink("current/summary.json", out / ".current.mine")
    second = _run(out, preset="default")
    shown = out_state(out)
    assert shown.run_id == second.summary["run_id"] != first.summary["run_id"]
    assert (out / "notes.txt").read_text() == "mine"
    assert (out / ".runs" / "keep" / "data.txt").read_text() == "keep me too"
    assert (out / ".summary.json.bak").read_text() == "a backup"
    assert (out / ".blocks.parquet.k3j4h5g6").exists() and os.readlink(out / ".current.mine") == "current/summary.json"
    assert sorted(p.name for p in (out / ".runs").iterdir()) == sorted(["keep", shown.run_id])


@pytest.mark.parametrize("make", ["file", "dir", "link"])
def test_a_foreign_file_where_a_run_writes_is_refused_not_replaced(tmp_path: Path, make: str) -> None:
    out = tmp_path / "o"
    first = _run(out)
    target = out / "summary.json"
    target.unlink()
    if make == "file":
        target.write_text("my own summary")
    elif make == "dir":
        target.mkdir()
        (target / "x").write_text("mine")
    else:
        os.symlink("/etc/hostname", target)
    before = _tree(out)
    with pytest.raises(OutputError, match=r"summary\.json is not ctxreplay's .* does not replace files it did not "
                                          r"write\. Move it out of"):
        _run(out, preset="default")
    assert _tree(out) == before
    assert os.readlink(out / "current") == f".runs/{first.summary['run_id']}"


def test_an_output_written_before_the_record_is_taken_over_keeping_foreign_files(tmp_path: Path) -> None:
    """An OUT of a ctxreplay without .ctxreplay-out.json (its `current` says a run made it): used,
    its stale staging removed, a foreign directory in .runs kept."""
    out = tmp_path / "o"
    _run(out)
    (out / OWNED).unlink()
    stale = out / ".runs" / "20260101T000000000000Z-0000001-dead00"
    stale.mkdir()
    (stale / "blocks.parquet").write_bytes(b"x" * 100)
    os.symlink(f".runs/{stale.name}", out / f".current.{stale.name}")
    (out / ".runs" / "keep").mkdir()
    (out / ".runs" / "keep" / "data.txt").write_text("keep me")
    res = _run(out, preset="default")
    assert sorted(res.summary["stale_outputs_removed"]) == [f".current.{stale.name}", f".runs/{stale.name}"]
    assert (out / ".runs" / "keep" / "data.txt").read_text() == "keep me"
    assert leftovers(out, res.summary["run_id"]) == [".runs/keep"]
    assert json.loads((out / OWNED).read_text())["runs"] == [res.summary["run_id"]]


def test_every_name_a_run_publishes_is_a_known_output_name() -> None:
    from ctxreplay.pipeline.batch.batchout import FILES
    from ctxreplay.pipeline.batch.manifest import FACTS_FILE, MANIFEST_FILE

    made = {*FILES.values(), "calls.parquet", "summary.json", "requests", "spill", MANIFEST_FILE, FACTS_FILE}
    assert made == set(OUTPUT_NAMES)


# ------------------------------------------------------------------- 2: a ledger where a run writes


@pytest.mark.parametrize("where", ["current/my.duckdb", ".runs/l.duckdb", "calls.parquet", "requests/l.duckdb"])
def test_a_ledger_inside_what_a_run_replaces_is_refused(tmp_path: Path, where: str) -> None:
    out = tmp_path / "o"
    _run(out)
    before = _tree(out)
    r = _cli("run", *ARGS, "--out", out, "--ledger", out / where)
    line = _paragraph(r)
    assert f"--ledger {out / where} is inside" in line and "the ledger would be deleted by a run" in line
    assert _tree(out) == before


def test_a_ledger_in_a_fresh_outs_staging_area_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "o"
    r = _cli("run", *ARGS, "--out", out, "--ledger", out / ".runs" / "l.duckdb")
    assert "is inside .runs of the output directory" in _paragraph(r)
    assert not out.exists()


def test_the_default_ledger_and_one_beside_the_outputs_are_kept(tmp_path: Path) -> None:
    out = tmp_path / "o"
    _run(out)
    _run(out, preset="default")
    assert Ledger(out / "ledger.duckdb", read_only=True).runs().height == 2
    _run(out, ledger_path=out / "my.duckdb")
    _run(out, preset="default", ledger_path=out / "my.duckdb")
    led = Ledger(out / "my.duckdb", read_only=True)
    assert led.runs().height == 2
    led.close()


# ------------------------------------------------------------------- 3: a --ledger that is not a ledger


@pytest.fixture(scope="module")
def bad_ledgers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("ledgers")
    _run(d / "o")
    return not_ledgers(d / "bad", ledger=d / "o" / "ledger.duckdb")


@pytest.mark.parametrize(("kind", "said"), [
    ("parquet", "is a Parquet file, not a ctxreplay ledger"),
    ("sqlite", "is a SQLite database, not a ctxreplay ledger"),
    ("json", "is a JSON file, not a ctxreplay ledger"),
    ("random", "is not a DuckDB database, not a ctxreplay ledger"),
    ("duckdb", "is a DuckDB database but not a ctxreplay ledger: it holds tables decisions, runs"),
])
def test_a_file_that_is_not_a_ledger_is_refused_and_left_as_it_was(bad_ledgers: dict[str, Path], tmp_path: Path,
                                                                    kind: str, said: str) -> None:
    path = bad_ledgers[kind]
    data = path.read_bytes()
    r = _cli("run", *ARGS, "--out", tmp_path / "o", "--ledger", path)
    line = _paragraph(r)
    assert f"{path} {said}" in line and "Pass --ledger a new file" in line
    assert path.read_bytes() == data
    assert not (tmp_path / "o").exists()
    assert not Path(f"{path}.wal").exists()


def test_a_foreign_duckdb_file_does_not_gain_our_tables(bad_ledgers: dict[str, Path]) -> None:
    path = bad_ledgers["duckdb"]
    with pytest.raises(LedgerError, match="not a ctxreplay ledger"):
        Ledger(path)
    con = duckdb.connect(str(path), read_only=True)
    try:
        tables = sorted(r[0] for r in con.execute("SELECT table_name FROM duckdb_tables()").fetchall())
    finally:
        con.close()
    assert tables == ["decisions", "runs"]


def test_a_sqlite_ledger_never_makes_duckdb_fetch_an_extension(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    sq = tmp_path / "x.sqlite"
    con = sqlite3.connect(sq)
    con.execute("CREATE TABLE runs (id INTEGER)")
    con.commit()
    con.close()
    env = {"HOME": str(home), "XDG_CACHE_HOME": str(home / ".cache")}
    r = cli(["run", *ARGS, "--out", tmp_path / "o", "--ledger", sq], env=env)
    assert r.returncode == 2 and "is a SQLite database, not a ctxreplay ledger" in r.stderr, r.stderr
    assert not (home / ".duckdb").exists()
    # a new file named .sqlite is a new ledger (a DuckDB file), still without any extension
    r = cli(["run", *ARGS, "--out", tmp_path / "o", "--ledger", tmp_path / "new.sqlite"], env=env)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "new.sqlite").read_bytes()[8:12] == b"DUCK"
    assert not (home / ".duckdb").exists()


def test_ledgers_open_without_extension_autoloading(tmp_path: Path) -> None:
    led = Ledger(tmp_path / "l.duckdb")
    try:
        got = led.con.execute("SELECT current_setting('autoload_known_extensions'), "
                              "current_setting('autoinstall_known_extensions')").fetchall()
    finally:
        led.close()
    assert got == [(False, False)]


def test_an_empty_file_and_an_empty_duckdb_database_become_ledgers(tmp_path: Path) -> None:
    empty = tmp_path / "empty.duckdb"
    empty.touch()
    _run(tmp_path / "o1", ledger_path=empty)
    bare = tmp_path / "bare.duckdb"
    duckdb.connect(str(bare)).close()  # a database without a table: what a crash before our first commit leaves
    _run(tmp_path / "o2", ledger_path=bare)
    for p in (empty, bare):
        led = Ledger(p, read_only=True)
        assert led.runs().height == 1
        assert dict(led.con.execute("SELECT key, value FROM meta").fetchall())["format"] == FORMAT
        led.close()


def test_a_ledger_written_before_the_marker_is_accepted_and_marked(tmp_path: Path) -> None:
    path = tmp_path / "old.duckdb"
    led = Ledger(path)
    led.con.execute("DELETE FROM meta WHERE key = 'format'")  # as today's code writes it
    led.close()
    _run(tmp_path / "o", ledger_path=path)
    led = Ledger(path, read_only=True)
    assert dict(led.con.execute("SELECT key, value FROM meta").fetchall())["format"] == FORMAT
    led.close()


# ------------------------------------------------------------------- 13: ledger problems are not bugs


def test_ledger_on_a_truncated_ledger_is_one_paragraph(tmp_path: Path) -> None:
    out = tmp_path / "o"
    _run(out, preset="default")
    path = out / "ledger.duckdb"
    os.truncate(path, path.stat().st_size // 2)
    line = _paragraph(_cli("ledger", out))
    assert f"{path}: the ledger cannot be read" in line and "the file is damaged" in line
    assert "Restore it from a copy, or pass --ledger a new file" in line
    line = _paragraph(_cli("run", *ARGS, "--out", out))
    assert str(path) in line


def test_ledger_with_a_huge_limit_lists_everything(tmp_path: Path) -> None:
    out = tmp_path / "o"
    _run(out, preset="default")
    for extra in ([], ["--quarantine"]):
        r = _cli("ledger", out, *extra, "--limit", "99999999999999999999", "--json")
        assert r.exit_code == 0, r.stderr
        doc = json.loads(r.stdout)
        assert doc["count"] == len(doc["rows"])


def test_ledger_on_a_foreign_file_is_one_paragraph(bad_ledgers: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "o"
    _run(out)
    for kind in ("duckdb", "parquet"):
        line = _paragraph(_cli("ledger", out, "--ledger", bad_ledgers[kind]))
        assert str(bad_ledgers[kind]) in line and "not a ctxreplay ledger" in line


# ------------------------------------------------------------------- 14: run ids, one writer per --golden


def test_every_output_names_its_run_also_when_reused(tmp_path: Path) -> None:
    out = tmp_path / "o"
    for _ in range(2):  # the second run reuses every file of the first (relabelled)
        res = _run(out)
        for name in ("calls", "blocks", "decisions", "quarantine", "messages", "call_messages", "call_facts"):
            meta = pq.read_schema(out / f"{name}.parquet").metadata or {}
            assert meta.get(RUN_ID_KEY, b"").decode() == res.summary["run_id"], name
    assert res.summary["groups"]["reused"] == res.summary["groups"]["total"]


@pytest.mark.skipif(sys.platform != "linux", reason="flock: Linux only")
def test_two_snapshots_on_one_golden_directory_exclude_each_other(tmp_path: Path) -> None:
    golden = tmp_path / "g"
    hold = tmp_path / "hold"
    args = ["snapshot", CC, "--preset", "identity", "--golden", golden, "--fast-tokens", "-q"]
    first = popen(args, env={"CTXREPLAY_HOLD_AT": "write:1", "CTXREPLAY_HOLD_FILE": str(hold)})
    try:
        deadline = time.monotonic() + 90
        while not Path(f"{hold}.reached").exists():
            assert first.poll() is None, first.communicate()
            assert time.monotonic() < deadline
            time.sleep(0.05)
        t0 = time.monotonic()
        second = cli(args)
        assert time.monotonic() - t0 < 60
    finally:
        Path(f"{hold}.go").touch()
        _, err = first.communicate(timeout=120)
    assert first.returncode == 0, err
    assert second.returncode == 2
    line = _paragraph(second)
    assert line.startswith(f"ctxreplay: the golden directory {golden} is in use by another ctxreplay run: pid "
                           f"{first.pid} on {socket.gethostname()}"), line
    assert "pass another --golden" in line
    assert (golden / "manifest.json").is_file()
    assert not (tmp_path / ".g.lock").exists()  # the lock file goes with the lock


def test_a_removed_lock_file_is_locked_anew(tmp_path: Path) -> None:
    path = tmp_path / ".g.lock"
    with RunLock(path, "the golden directory g", remove=True):
        assert path.exists()
    assert not path.exists()
    with RunLock(path, "the golden directory g", remove=True):
        assert path.exists()
