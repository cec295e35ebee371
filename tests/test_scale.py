"""Issue 10: session groups in batches give the outputs of one batch; groups tie a session's files."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import orjson
import polars as pl
import pytest

from ctxreplay.pipeline.batch.batches import Group, pack, session_groups
from ctxreplay.pipeline.batch.runner import RunOptions, run
from ctxreplay.pipeline.core.tokens import CHARS4_COUNTER
from ctxreplay.pipeline.staging.spec import load_spec
from tests.crashkit import out_state

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "data" / "samples"
FIXTURES = ROOT / "tests" / "fixtures" / "loaders"

# summary keys that may differ between two runs of the same inputs
VOLATILE = {"run_id", "seconds", "timings_seconds", "out_dir", "ledger", "stale_outputs_removed", "cache_sim",
            "decisions_by_stage", "groups"}


def _run(paths: list[Path], out: Path, preset: str = "default", **kw: Any) -> dict[str, Any]:
    return run(paths, load_spec(preset=preset), RunOptions(out_dir=out, token_counter=CHARS4_COUNTER, **kw)).summary


def _outputs(out: Path) -> dict[str, pl.DataFrame]:
    """Every table of a run, in its row order (requests/ as one table of name -> bytes)."""
    names = ["calls", "blocks", "decisions", "quarantine", "messages", "call_messages"]
    got = {n: pl.read_parquet(out / f"{n}.parquet") for n in names}
    req = sorted((out / "requests").iterdir())
    got["requests"] = pl.DataFrame({"name": [p.name for p in req], "data": [p.read_bytes() for p in req]})
    return got


def _sorted(df: pl.DataFrame) -> pl.DataFrame:
    cols = [c for c, t in df.schema.items() if t.is_numeric() or t in (pl.String, pl.Boolean, pl.Binary)]
    return df.sort(cols, nulls_last=True)


def _summary_core(s: dict[str, Any], *also: str) -> dict[str, Any]:
    return {k: v for k, v in s.items() if k not in VOLATILE and k not in also}


def _stage_counts(s: dict[str, Any]) -> dict[str, Any]:
    return {k: {kk: vv for kk, vv in v.items() if kk != "seconds"} for k, v in s["decisions_by_stage"].items()}


def test_small_batches_give_the_outputs_of_one_batch(tmp_path: Path) -> None:
    """Every session group in a batch of its own: the same rows (batches keep their order, so only
    the row order across groups may differ), the same summary counts, the same cache simulation."""
    inputs = [SAMPLES, FIXTURES]
    one = _run(inputs, tmp_path / "one")
    many = _run(inputs, tmp_path / "many", batch_bytes=1)
    assert many["groups"]["batches"] > 5 and one["groups"]["batches"] == 1
    assert _summary_core(many) == _summary_core(one)
    assert _stage_counts(many) == _stage_counts(one)
    assert {k: v for k, v in many["cache_sim"].items() if k != "seconds"} == \
        {k: v for k, v in one["cache_sim"].items() if k != "seconds"}
    a, b = _outputs(tmp_path / "one"), _outputs(tmp_path / "many")
    for name in a:
        assert _sorted(a[name]).equals(_sorted(b[name])), name
    # each distinct message once, even when several batches hold it
    assert b["messages"].get_column("sha256").is_unique().all()
    # the ledger's rows, seq numbers included: a stage's rows of every batch are queued together
    rows = _ledger_rows(tmp_path / "one" / "ledger.duckdb")
    assert _ledger_rows(tmp_path / "many" / "ledger.duckdb") == rows and len(rows[0]) > 10


def test_a_run_twice_writes_the_same_rows_in_the_same_order(tmp_path: Path) -> None:
    for n in ("a", "b"):
        _run([SAMPLES, FIXTURES], tmp_path / n, batch_bytes=20_000)
    a, b = _outputs(tmp_path / "a"), _outputs(tmp_path / "b")
    for name in a:
        assert a[name].equals(b[name]), name


def _cc_line(sid: str, uuid: str, parent: str | None, role: str, text: str, **kw: Any) -> bytes:
    msg: dict[str, Any] = {"role": role, "content": [{"type": "text", "text": text}]}
    if role == "assistant":
        msg.update(id=f"msg_{uuid}", model="claude-sonnet-4-5", usage={"input_tokens": 10, "output_tokens": 2})
    return orjson.dumps({"type": role, "sessionId": sid, "uuid": uuid, "parentUuid": parent,
                         "timestamp": "2026-01-01T00:00:00Z", "message": msg, **kw}) + b"\n"


def test_a_sessions_files_form_one_group(tmp_path: Path) -> None:
    """Main file, subagent file and sidecar, and a backup copy of the session under another name,
    land in one group; another session is a group of its own."""
    sid = "11111111-2222-4333-8444-555555555555"
    proj = tmp_path / "proj"
    (proj / sid / "subagents").mkdir(parents=True)
    main = proj / f"{sid}.jsonl"
    main.write_bytes(_cc_line(sid, "u1", None, "user", "hi") + _cc_line(sid, "a1", "u1", "assistant", "yo"))
    sub = proj / sid / "subagents" / "agent-abc.jsonl"
    sub.write_bytes(_cc_line(sid, "s1", None, "user", "task", isSidechain=True, agentId="abc"))
    meta = proj / sid / "subagents" / "agent-abc.meta.json"
    meta.write_text('{"agentType": "general"}')
    backup = tmp_path / "backup" / "old-copy.jsonl"  # no uuid in the name: tied by the sessionId inside
    backup.parent.mkdir()
    shutil.copy(main, backup)
    other_sid = "99999999-2222-4333-8444-555555555555"
    other = proj / f"{other_sid}.jsonl"
    other.write_bytes(_cc_line(other_sid, "u1", None, "user", "hi"))
    groups = session_groups([main, sub, meta, backup, other])
    assert sorted(sorted(p.name for p in g.files) for g in groups) == sorted([
        [f"{other_sid}.jsonl"], sorted([f"{sid}.jsonl", "agent-abc.jsonl", "agent-abc.meta.json", "old-copy.jsonl"])])


def test_groups_pack_into_batches_by_bytes_in_order() -> None:
    gs = [Group([Path(f"/g{i}")], b) for i, b in enumerate([40, 30, 50, 200, 10])]
    assert [[g.key for g in b.groups] for b in pack(gs, 100)] == [["/g0", "/g1"], ["/g2"], ["/g3"], ["/g4"]]
    assert [[g.key for g in b.groups] for b in pack(gs, 70)] == [["/g0", "/g1"], ["/g2"], ["/g3"], ["/g4"]]
    assert [[g.key for g in b.groups] for b in pack(gs, 69)] == [["/g0"], ["/g1"], ["/g2"], ["/g3"], ["/g4"]]
    assert len(pack(gs, 10**9)) == 1


@pytest.mark.slow
def test_the_corpus_in_small_batches_equals_one_batch(corpus: Path, tmp_path: Path) -> None:
    one = _run([corpus], tmp_path / "one", preset="claude-code", batch_bytes=64 << 20)
    many = _run([corpus], tmp_path / "many", preset="claude-code", batch_bytes=2_000_000)
    assert many["groups"]["batches"] > 3 and one["groups"]["batches"] == 1
    decisions_many, _ = _ledger_rows(tmp_path / "many" / "ledger.duckdb")
    decisions_one, _ = _ledger_rows(tmp_path / "one" / "ledger.duckdb")
    assert decisions_many == decisions_one
    # The token cache is a memo of what a run counted, and a stage whose quick check holds for a
    # batch counts nothing: in one batch, tombstone's plan runs for the whole corpus (some thread
    # has results to clear) and counts each tool call's cleared form ("feishu_doc {}"); in small
    # batches, it does not run where no thread of the batch has any. What both counted agrees.
    cache_many, cache_one = _token_cache(tmp_path / "many"), _token_cache(tmp_path / "one")
    assert cache_many.items() <= cache_one.items() and len(cache_one) - len(cache_many) < 10
    assert _summary_core(many, "tokens") == _summary_core(one, "tokens")
    a, b = _outputs(tmp_path / "one"), _outputs(tmp_path / "many")
    for name in a:
        assert _sorted(a[name]).equals(_sorted(b[name])), name


# ------------------------------------------------------------------------------ incremental re-runs


def _tree(tmp: Path) -> Path:
    tree = tmp / "tree"
    shutil.copytree(SAMPLES, tree / "samples")
    shutil.copytree(FIXTURES, tree / "fixtures")
    return tree


def _run_before_the_last_lines(tmp_path: Path) -> tuple[Path, Path, bytes, Path]:
    """A tree of the samples and fixtures whose main Claude Code session lacks its last 4 lines, run
    in batches of one group into OUT: (tree, that file, its whole bytes, OUT)."""
    tree = _tree(tmp_path)
    main = next((tree / "samples" / "claude-projects").rglob("5f0c1d2e-*.jsonl"))
    full = main.read_bytes()
    main.write_bytes(b"".join(full.splitlines(keepends=True)[:-4]))
    out = tmp_path / "o"
    _run([tree], out, batch_bytes=1)
    return tree, main, full, out


def _same_outputs(a: Path, b: Path) -> None:
    x, y = _outputs(a), _outputs(b)
    for name in x:
        assert x[name].equals(y[name]), name


@pytest.mark.parametrize("batch_bytes", [1, 64 << 20])
def test_an_unchanged_rerun_reuses_every_group_and_writes_the_same_outputs(tmp_path: Path, batch_bytes: int) -> None:
    tree = _tree(tmp_path)
    out = tmp_path / "o"
    first = _run([tree], out, batch_bytes=batch_bytes)
    snap = tmp_path / "first"
    shutil.copytree(out / "current", snap)
    again = _run([tree], out, batch_bytes=batch_bytes)
    g = again["groups"]
    assert g["reused"] == g["total"] == first["groups"]["total"] > 5 and g["rerun"] == g["new"] == 0
    assert first["groups"]["new"] == first["groups"]["total"]
    assert _summary_core(again, "tokens") == _summary_core(first, "tokens")  # nothing counted again
    assert _stage_counts(again) == {k: {**v, "new_decisions": 0, "reused_decisions": v["decisions"]
                                        - v["provisional_decisions"] - v["conflicts"]}
                                    for k, v in _stage_counts(first).items()}
    _same_outputs(snap, out)
    out_state(out)  # every output file names the new run (relabelled, not the previous run's id)


@pytest.mark.parametrize("batch_bytes", [1, 64 << 20])
def test_a_grown_file_reruns_its_group_only_and_equals_a_fresh_run(tmp_path: Path, batch_bytes: int) -> None:
    tree = _tree(tmp_path)
    main = next((tree / "samples" / "claude-projects").rglob("5f0c1d2e-*.jsonl"))
    full = main.read_bytes()
    lines = full.splitlines(keepends=True)
    main.write_bytes(b"".join(lines[:-4]))  # the session before its last lines were written
    out = tmp_path / "o"
    _run([tree], out, batch_bytes=batch_bytes)
    main.write_bytes(full)  # the session grew
    grown = _run([tree], out, batch_bytes=batch_bytes)
    g = grown["groups"]
    assert (g["rerun"], g["new"], g["reused"]) == (1, 0, g["total"] - 1)
    fresh = _run([tree], tmp_path / "fresh", batch_bytes=batch_bytes)
    assert _summary_core(grown, "tokens") == _summary_core(fresh, "tokens")
    _same_outputs(tmp_path / "fresh", out)
    # a new file is a new group; a removed one is gone from the outputs
    (tree / "samples" / "codex-sample.jsonl").unlink()
    shutil.copy(tree / "samples" / "openclaw-sample.jsonl", tree / "samples" / "copy-9f1e.jsonl")
    after = _run([tree], out, batch_bytes=batch_bytes)
    assert after["groups"]["new"] + after["groups"]["rerun"] >= 1
    _run([tree], tmp_path / "fresh2", batch_bytes=batch_bytes)
    _same_outputs(tmp_path / "fresh2", out)


def test_a_run_whose_call_facts_lack_a_column_is_not_reused(tmp_path: Path) -> None:
    """The per-call facts gained `strip_from_call` (the calibration's thinking-strip evidence): the
    facts of a run made before (manifest version 3) cannot go beside a new batch's, so such a run is
    not reused; a grown file then runs everything again instead of failing on the facts' schema."""
    tree, main, full, out = _run_before_the_last_lines(tmp_path)
    run_dir = (out / "current").resolve()
    facts = run_dir / "call_facts.parquet"
    pl.read_parquet(facts).drop("strip_from_call").write_parquet(facts)      # as a version 3 run wrote them
    manifest = orjson.loads((run_dir / "manifest.json").read_bytes())
    manifest["config"]["version"] = 3
    (run_dir / "manifest.json").write_bytes(orjson.dumps(manifest))
    main.write_bytes(full)
    again = _run([tree], out, batch_bytes=1)
    assert again["groups"]["reused"] == 0 and "version" in again["groups"]["not_reused_because"]
    _run([tree], tmp_path / "fresh", batch_bytes=1)
    _same_outputs(tmp_path / "fresh", out)


def test_a_changed_pipeline_reruns_every_group(tmp_path: Path) -> None:
    tree = _tree(tmp_path)
    out = tmp_path / "o"
    _run([tree], out)
    other = _run([tree], out, preset="minimal")
    assert other["groups"]["reused"] == 0 and other["groups"]["new"] == other["groups"]["total"]
    assert "pipeline_sha256" in other["groups"]["not_reused_because"]
    _run([tree], tmp_path / "fresh", preset="minimal")
    _same_outputs(tmp_path / "fresh", out)
    full = _run([tree], out, preset="minimal", reuse=False)  # --full
    assert full["groups"]["reused"] == 0 and full["groups"]["not_reused_because"] == "--full"
    _same_outputs(tmp_path / "fresh", out)


# ------------------------------------------------------------------------------ progress


def test_the_progress_display_counts_files_groups_and_calls(tmp_path: Path) -> None:
    import io

    from rich.console import Console

    from ctxreplay.pipeline.core.progress import RunProgress

    buf = io.StringIO()
    shown = RunProgress(Console(file=buf, force_terminal=True, width=200))
    shown._p.live.auto_refresh = False  # no timer: what is shown is what each batch draws (a batch here is ms)
    s = _run([SAMPLES], tmp_path / "o", batch_bytes=1, display=shown)
    text = buf.getvalue()
    g = s["groups"]["total"]
    assert f"files {s['files']}/{s['files']}" in text and f"groups {g}/{g}" in text
    assert f"calls {s['calls']}" in text and "ETA" in text
    assert f"groups 1/{g}" in text  # it moved batch by batch


def test_no_progress_without_a_terminal_or_with_q(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from ctxreplay.pipeline.commands.cli import main

    for flags in ([], ["-q"]):
        r = CliRunner().invoke(main, ["run", str(SAMPLES), "--out", str(tmp_path / "o"), "--fast-tokens", *flags])
        assert r.exit_code == 0, r.output
        assert "ETA" not in r.stderr and "groups" not in r.stderr


# ------------------------------------------------------------------------------ --jobs


def _ledger_rows(path: Path) -> tuple[list[tuple], int]:
    import duckdb

    con = duckdb.connect(str(path), read_only=True)
    try:
        rows = con.execute("SELECT * EXCLUDE (spec_sha256) FROM decisions ORDER BY seq").fetchall()
        tokens = con.execute("SELECT count(*) FROM token_cache").fetchall()[0][0]
    finally:
        con.close()
    return rows, tokens


def _token_cache(out: Path) -> dict[tuple[str, str], int]:
    import duckdb

    con = duckdb.connect(str(out / "ledger.duckdb"), read_only=True)
    try:
        return {(c, sha): n for c, sha, n in con.execute("SELECT counter, sha256, tokens FROM token_cache").fetchall()}
    finally:
        con.close()


def test_jobs_1_and_2_write_the_same_outputs_and_ledger(tmp_path: Path) -> None:
    one = _run([SAMPLES, FIXTURES], tmp_path / "one", batch_bytes=20_000, jobs=1)
    two = _run([SAMPLES, FIXTURES], tmp_path / "two", batch_bytes=20_000, jobs=2)
    assert two["groups"]["batches"] > 3
    assert _summary_core(one, "tokens") == _summary_core(two, "tokens")
    assert _stage_counts(one) == _stage_counts(two)
    _same_outputs(tmp_path / "one", tmp_path / "two")
    assert _ledger_rows(tmp_path / "one" / "ledger.duckdb") == _ledger_rows(tmp_path / "two" / "ledger.duckdb")
    # a re-run with workers after a grown file: the same as with none
    for out in ("one", "two"):
        f = next((SAMPLES / "claude-projects").rglob("5f0c1d2e-*.jsonl"))
        tree = tmp_path / f"tree-{out}"
        shutil.copytree(SAMPLES, tree)
        (tree / f.relative_to(SAMPLES)).write_bytes(f.read_bytes() + f.read_bytes().splitlines(keepends=True)[-1])
    a = _run([tmp_path / "tree-one"], tmp_path / "one", jobs=1, batch_bytes=20_000)
    b = _run([tmp_path / "tree-two"], tmp_path / "two", jobs=2, batch_bytes=20_000)
    assert a["groups"]["new"] == b["groups"]["new"] > 0


def test_a_warm_re_run_does_not_import_pandas(tmp_path: Path) -> None:
    """A re-run with nothing changed is mostly start-up: pandas (pulled in by pyarrow's
    Schema.empty_table() and pq.read_table) was 0.3 s of its 1 s. Fails if either comes back."""
    import subprocess
    import sys

    out = tmp_path / "o"
    _run([SAMPLES], out)
    code = ("import sys\nfrom pathlib import Path\nfrom ctxreplay.pipeline.batch.runner import RunOptions, run\n"
            "from ctxreplay.pipeline.staging.spec import load_spec\n"
            f"s = run([Path({str(SAMPLES)!r})], load_spec(preset='default'), RunOptions(out_dir=Path({str(out)!r}), "
            "token_counter='chars4-v1')).summary\n"
            "print(s['groups']['reused'] == s['groups']['total'], 'pandas' in sys.modules, "
            "'pyarrow.dataset' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert r.stdout.split() == ["True", "False", "False"], r.stdout + r.stderr


def _two_groups(tree: Path) -> tuple[str, Path]:
    """A 300 kB session and a small one, in two groups: (the large one's id, its file)."""
    sid = "11111111-2222-4333-8444-555555555555"
    proj = tree / "proj"
    proj.mkdir(parents=True)
    lines, parent = [], None
    for i in range(60):
        u, a = f"u{i}", f"a{i}"
        lines.append(_cc_line(sid, u, parent, "user", f"question {i:03d} " + "x" * 2500))
        lines.append(_cc_line(sid, a, u, "assistant", f"answer {i:03d} " + "y" * 2500))
        parent = a
    main = proj / f"{sid}.jsonl"
    main.write_bytes(b"".join(lines))
    other_sid = "99999999-2222-4333-8444-555555555555"
    (proj / f"{other_sid}.jsonl").write_bytes(_cc_line(other_sid, "u1", None, "user", "hi")
                                              + _cc_line(other_sid, "a1", "u1", "assistant", "yo"))
    assert main.stat().st_size > 256 * 1024
    return sid, main


def _edit_in_place(main: Path) -> None:
    """6 bytes overwritten in the middle of the file: the same inode and size, the mtime restored."""
    import os

    st = main.stat()
    data = main.read_bytes()
    at = data.index(b"question 030 ") + len(b"question 030 ")
    with open(main, "r+b") as fh:  # in place: same inode, same size
        fh.seek(at)
        fh.write(b"EDITED")
    os.utime(main, ns=(st.st_atime_ns, st.st_mtime_ns))  # its mtime restored (or a coarse clock)
    assert main.stat().st_mtime_ns == st.st_mtime_ns and main.stat().st_ino == st.st_ino
    assert main.stat().st_size == st.st_size and main.read_bytes() != data


def _counting_hashes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the files a re-run reads to hash (manifest.content_sha256), as it reads them."""
    from ctxreplay.pipeline.batch import manifest

    hashed: list[str] = []
    real = manifest.content_sha256

    def counted(path: Path) -> str | None:
        hashed.append(Path(path).name)
        return real(path)

    monkeypatch.setattr(manifest, "content_sha256", counted)
    return hashed


def _manifest_files(out: Path) -> dict[str, dict[str, Any]]:
    doc = orjson.loads((out / "manifest.json").read_bytes())
    return {Path(f["path"]).name: f for g in doc["groups"] for f in g["files"]}


def test_a_settled_files_stat_stands_in_for_its_bytes_and_an_edit_in_place_still_shows(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file whose ctime is SETTLE_NS older than a run's clock gets its inode and ctime in the
    manifest (`sig`); a re-run that finds them, the size and the mtime unchanged takes the recorded
    hash and reads nothing. An edit in place that keeps the inode, the size and the mtime sets the
    ctime: that file is read again and its group re-runs (the other is still reused unread)."""
    import time

    from ctxreplay.pipeline.batch import manifest

    sid, main = _two_groups(tmp_path / "tree")
    clock = [time.time_ns() + manifest.SETTLE_NS]  # every file has settled by this clock
    monkeypatch.setattr(manifest, "now_ns", lambda: clock[0])
    out = tmp_path / "o"
    _run([tmp_path / "tree"], out)
    files = _manifest_files(out)
    assert len(files) == 2 and all(f.get("sig") for f in files.values())
    hashed = _counting_hashes(monkeypatch)
    again = _run([tmp_path / "tree"], out)
    assert again["groups"]["reused"] == 2 and hashed == []
    _edit_in_place(main)
    clock[0] = time.time_ns() + manifest.SETTLE_NS
    third = _run([tmp_path / "tree"], out)
    g = third["groups"]
    assert (g["rerun"], g["reused"], g["new"]) == (1, 1, 0)
    assert hashed == [main.name]
    assert any(b"EDITED" in p.read_bytes() for p in (out / "requests").iterdir() if sid in p.name)
    assert _manifest_files(out)[main.name]["sig"] != files[main.name]["sig"]


@pytest.mark.parametrize("late_ns", [0, 1])
def test_a_file_changed_within_the_settling_time_is_read_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               late_ns: int) -> None:
    """The threshold, both sides: a run whose clock is exactly SETTLE_NS past the file's ctime
    records its stat and the re-run reads nothing of it; 1 ns less (the file may change again and
    keep that ctime, on a coarse clock) records none, and the re-run hashes the file."""
    from ctxreplay.pipeline.batch import manifest

    _, main = _two_groups(tmp_path / "tree")
    at = main.stat().st_ctime_ns + manifest.SETTLE_NS - late_ns
    monkeypatch.setattr(manifest, "now_ns", lambda: at)
    out = tmp_path / "o"
    _run([tmp_path / "tree"], out)
    assert ("sig" in _manifest_files(out)[main.name]) == (late_ns == 0)
    hashed = _counting_hashes(monkeypatch)
    again = _run([tmp_path / "tree"], out)
    assert again["groups"]["reused"] == 2
    assert (main.name in hashed) == (late_ns == 1)


def test_a_stat_stands_for_the_bytes_only_when_the_loader_read_as_many() -> None:
    """with_content keeps a file's `sig` when its load read the size the stat saw, and drops it when
    the file grew (or shrank) between the stat and the read: the hash is of other bytes then."""
    from ctxreplay.pipeline.batch.manifest import with_content

    files = [{"path": "a", "size": 10, "mtime_ns": 5, "sig": "7:9"}]
    same = with_content(files, [{"path": "a", "bytes": 10, "sha256": "h"}], {})
    grown = with_content(files, [{"path": "a", "bytes": 12, "sha256": "h"}], {})
    assert same == [{"path": "a", "size": 10, "mtime_ns": 5, "sig": "7:9", "fp": "h"}]
    assert grown == [{"path": "a", "size": 12, "mtime_ns": 5, "fp": "h"}]


def test_an_edit_in_place_that_keeps_size_and_mtime_is_noticed(tmp_path: Path) -> None:
    """Issue 23, item 10: 6 bytes overwritten in the middle of a 300 kB transcript, its size kept and
    its mtime restored with os.utime: reuse is decided on content, so its group runs again
    and its requests change; the other group is still reused."""
    sid, main = _two_groups(tmp_path / "tree")
    out = tmp_path / "o"
    first = _run([tmp_path / "tree"], out)
    assert first["groups"]["new"] == 2
    before = {p.name: p.read_bytes() for p in (out / "requests").iterdir()}
    _edit_in_place(main)
    again = _run([tmp_path / "tree"], out)
    g = again["groups"]
    assert (g["rerun"], g["reused"], g["new"]) == (1, 1, 0)
    after = {p.name: p.read_bytes() for p in (out / "requests").iterdir()}
    changed = sorted(n for n in before if before[n] != after.get(n))
    assert changed and all(sid in n for n in changed)
    assert any(b"EDITED" in after[n] for n in changed)
    # the re-run's outputs are a fresh run's
    _run([tmp_path / "tree"], tmp_path / "fresh")
    _same_outputs(tmp_path / "fresh", out)
    # and a third run, nothing changed, reuses both groups again (the hashes the load took are kept)
    third = _run([tmp_path / "tree"], out)
    assert third["groups"]["reused"] == third["groups"]["total"] == 2

