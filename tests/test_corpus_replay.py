"""Replay on the real corpus: accounting, determinism, prefix causality, resume with a ledger."""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import polars as pl
import pytest

from ctxreplay.pipeline.batch.runner import RunOptions, run
from ctxreplay.pipeline.core.tokens import CHARS4_COUNTER
from ctxreplay.pipeline.staging.spec import load_spec

pytestmark = pytest.mark.corpus


def _run(paths, out: Path, preset: str = "identity", ledger: Path | None = None, all_calls: bool = False):
    opts = RunOptions(out_dir=out, ledger_path=ledger, token_counter=CHARS4_COUNTER, all_calls=all_calls)
    return run([Path(p) for p in paths], load_spec(preset=preset), opts)


def _hashes(calls: pl.DataFrame) -> dict[tuple[str, str, int], str]:
    return {(r["session_id"], r["thread_id"], r["call"]): r["request_sha256"]
            for r in calls.filter(~pl.col("is_pending")).iter_rows(named=True)}


def _by_request(calls: pl.DataFrame) -> dict[tuple, str]:
    """request_sha256 by the recorded request it replays (thread names can change when a later
    rewind turns the path that was current into an abandoned branch)."""
    return {(r["session_id"], r["message_id"], r["request_id"], r["thread_id"] if r["message_id"] is None else "",
             r["call"] if r["message_id"] is None else -1): r["request_sha256"]
            for r in calls.filter(~pl.col("is_pending")).iter_rows(named=True)}


def test_whole_corpus_line_accounting(corpus: Path, tmp_path: Path) -> None:
    res = _run([corpus], tmp_path / "o")
    s = res.summary
    assert s["message_lines"] + s["other_lines"] + s["quarantined_lines"] == s["lines"]
    assert s["quarantined_lines"] == 0
    # the glued line of the pi session is recovered, not lost
    assert any(r["file"].endswith("badlogic__pi-mono__session.jsonl") and r["line"] == 440
               for r in s["recovered_lines"])
    # README.md and the ccusage reports are not transcripts; nothing else is skipped
    assert sorted(Path(x["file"]).name for x in s["skipped_files"]) == [
        "README.md", "real.daily.json", "real.monthly.json", "real.session.json"]


def test_pending_request_holds_the_compaction_summary_first(corpus: Path, tmp_path: Path) -> None:
    root = corpus / "claude-projects" / "projects" / "-home-marco-projects-spotter-worktrees-spotter-4te"
    res = _run([root], tmp_path / "o")
    req = json.loads((tmp_path / "o" / "requests" / "ae4a77f8-aedd-4bc1-888f-c94edc91af04.json").read_text())
    first = req["messages"][0]["content"][0]["text"]
    assert first.startswith("This session is being continued from a previous conversation that ran out of context.")
    # nothing from before the boundary: the session's first prompt is gone from the pending request
    src = [json.loads(x) for x in (root / "ae4a77f8-aedd-4bc1-888f-c94edc91af04.jsonl").read_text().splitlines()]
    first_prompt = next(e for e in src if e.get("type") == "user" and isinstance(e["message"]["content"], str)
                        and not e.get("isMeta"))["message"]["content"]
    assert all(first_prompt not in json.dumps(m) for m in req["messages"][1:])
    # messages alternate, in order; the pending request ends with the final answer
    roles = [m["role"] for m in req["messages"]]
    assert all(a != b for a, b in itertools.pairwise(roles))
    main = res.calls.filter((pl.col("thread_id") == "main") & ~pl.col("is_pending"))
    assert main.height == 217


@pytest.mark.slow
def test_two_runs_give_identical_hashes(corpus: Path, tmp_path: Path) -> None:
    a = _run([corpus], tmp_path / "a").calls
    b = _run([corpus], tmp_path / "b").calls
    assert a.select("session_id", "thread_id", "call", "request_sha256").equals(
        b.select("session_id", "thread_id", "call", "request_sha256"))


def _files(corpus: Path) -> list[Path]:
    out = []
    for f in sorted(corpus.rglob("*")):
        name = f.name
        if f.is_file() and (name.endswith(".jsonl") or ".jsonl.deleted." in name or ".jsonl.reset." in name):
            out.append(f)
    return out


def _half(src: Path, dst_dir: Path) -> Path:
    dst_dir.mkdir(parents=True, exist_ok=True)
    lines = src.read_bytes().split(b"\n")
    n = len([x for x in lines if x.strip()])
    keep, seen = [], 0
    for x in lines:
        if x.strip():
            seen += 1
            if seen > n // 2:
                break
        keep.append(x)
    dst = dst_dir / src.name
    dst.write_bytes(b"\n".join(keep) + b"\n")
    return dst


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["identity", "default"])
def test_prefix_causality_and_resume_every_file(corpus: Path, tmp_path: Path, preset: str) -> None:
    """First half of each file: same hashes for its recorded calls as the full file; and a run on the
    half with a ledger followed by the full file with the same ledger equals a fresh full run."""
    for i, f in enumerate(_files(corpus)):
        full_dir = tmp_path / f"full{i}"
        full_dir.mkdir()
        shutil.copy(f, full_dir / f.name)
        half = _half(f, tmp_path / f"half{i}")
        full_calls = _run([full_dir], tmp_path / f"of{i}", preset).calls
        full, part = _by_request(full_calls), _by_request(_run([half], tmp_path / f"oh{i}", preset).calls)
        missing = {k: v for k, v in part.items() if full.get(k) != v}
        assert not missing, f"{f.name}: {len(missing)} of {len(part)} calls differ from the full replay"
        ledger = tmp_path / f"l{i}.duckdb"
        _run([half], tmp_path / f"r1_{i}", preset, ledger=ledger)
        resumed_run = _run([full_dir], tmp_path / f"r2_{i}", preset, ledger=ledger)
        assert resumed_run.summary["conflicts"] == 0, f.name
        resumed = _hashes(resumed_run.calls)
        assert resumed == _hashes(full_calls), f.name
