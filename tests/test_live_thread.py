"""The live path's main thread (pipeline/engine/live.py TailScan): extended step by step where it
can be, it is always the thread the loader's `build_thread` gives over the lines read so far."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pytest

from ctxreplay.pipeline.engine.engine import iter_lines
from ctxreplay.pipeline.engine.live import TailScan, _row_order
from ctxreplay.pipeline.loaders.claude_code import build_thread
from tests.cckit import CCSession, _assistant
from tests.test_engine_live import SID, T0, build


def _built_whole(scan: TailScan) -> list[str]:
    """The loader's build over everything the scan read (its state left as it is)."""
    if scan.tip is None:
        return []
    entries, boundaries = build_thread(scan.nodes[scan.tip], scan.nodes, scan.by_key, scan.result_by_tool_id,
                                       scan.prev_in_file, Counter())
    return _row_order([n for n in entries if n.is_message and n.uuid not in boundaries])


def _follow(path: Path, lines: list[bytes], seed: int) -> tuple[int, int]:
    """Read `lines` a few at a time; after each read the scan's thread is the whole build's.
    Returns (reads, reads whose thread was extended without a whole build)."""
    scan, rng, extended, reads = TailScan(path), random.Random(seed), 0, 0
    whole = scan.main_thread
    calls = 0

    def counted() -> list[str]:
        nonlocal calls
        calls += 1
        return whole()

    scan.main_thread = counted  # type: ignore[method-assign]
    upto = 0
    while upto < len(lines):
        upto = min(len(lines), upto + rng.choice([1, 1, 2, 3]))
        before = calls
        scan.scan(lines[:upto])
        reads += 1
        extended += calls == before
        assert scan.thread == _built_whole(scan), (path.name, upto)
    return reads, extended


def _main_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.jsonl") if "subagents" not in p.parts and "__subagents__" not in p.name)


@pytest.mark.parametrize("which", ["corpus", "corpus_extra"])
def test_every_corpus_file_read_a_few_lines_at_a_time_gives_the_loaders_thread(which: str,
                                                                              request: pytest.FixtureRequest) -> None:
    root: Path = request.getfixturevalue(which)
    files = _main_files(root / "claude-projects") + ([] if which == "corpus_extra" else _main_files(root / "claude-code"))
    assert files
    reads = extended = 0
    for i, f in enumerate(files):
        r, e = _follow(f, list(iter_lines(f)), i)
        reads, extended = reads + r, extended + e
    assert extended > reads // 2, (extended, reads)  # most reads extend the thread


def test_a_generated_session_extends_its_thread_at_nearly_every_read(tmp_path: Path) -> None:
    s = build(40, turn_every=5)
    path = tmp_path / "s.jsonl"
    s.write(path)
    reads, extended = _follow(path, list(iter_lines(path)), 0)
    assert extended >= reads - 5, (extended, reads)


def _line_by_line(tmp_path: Path, s: CCSession) -> None:
    path = s.write(tmp_path / "s.jsonl")
    lines = list(iter_lines(path))
    scan = TailScan(path)
    for k in range(1, len(lines) + 1):
        scan.scan(lines[:k])
        assert scan.thread == _built_whole(scan), k


def _call(s: CCSession, k: int, tid: str, parent: str | None, line: int = 0) -> str:
    """An assistant line of message `msg_<k>` calling tool `tid`."""
    return s.entry("assistant", _assistant(k, [{"type": "tool_use", "id": tid, "name": "Bash", "input": {"n": line}}],
                                           "tool_use"), 1, parent, requestId=f"req_{k:06d}")


def _result(s: CCSession, tid: str, parent: str | None) -> str:
    return s.entry("user", {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tid, "content": "ok"}]},
                   1, parent)


def test_a_second_result_on_the_thread_for_a_call_a_recovered_result_answered(tmp_path: Path) -> None:
    # parallel calls A and B (one answer, two lines); A's result sits off the chain and is recovered;
    # then a second result for A comes on the chain: the build no longer recovers the first one
    s = CCSession(SID, T0)
    u = s.user("go")
    a1 = _call(s, 1, "toolu_A", u, 1)
    a2 = _call(s, 1, "toolu_B", a1, 2)
    _result(s, "toolu_A", a1)
    rb = _result(s, "toolu_B", a2)
    _result(s, "toolu_A", rb)
    s.user("and now?")
    _line_by_line(tmp_path, s)


def test_a_call_id_an_old_result_off_the_thread_holds(tmp_path: Path) -> None:
    # a dead branch holds a call T and its result; the main thread later calls T again: the build
    # recovers the old result, at its place in the file
    s = CCSession(SID, T0)
    u = s.user("go")
    b = _call(s, 1, "toolu_T", u)
    _result(s, "toolu_T", b)
    a = _call(s, 2, "toolu_A", u)
    ra = _result(s, "toolu_A", a)
    _call(s, 3, "toolu_T", ra)
    s.user("and now?")
    _line_by_line(tmp_path, s)
