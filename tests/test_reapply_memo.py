"""The live engine's memo of re-applied decisions (pipeline/staging/stagerun.py ReapplyMemo): where
it is used, it gives what re-applying afresh gives."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import polars as pl
import pytest

from ctxreplay.pipeline.core.blockops import sort_blocks
from ctxreplay.pipeline.core.tokens import CHARS4_COUNTER
from ctxreplay.pipeline.engine.engine import Engine
from ctxreplay.pipeline.staging.stagerun import Reapplied, ReapplyMemo, reapply
from tests.test_engine_live import SID, batch, build, spec


def _same(a: Reapplied, b: Reapplied) -> None:
    for f in ("blocks", "decisions", "conflicts", "view"):
        x, y = getattr(a, f), getattr(b, f)
        if f == "blocks":
            x, y = sort_blocks(x.lazy()).collect(), sort_blocks(y.lazy()).collect()
        assert x.equals(y), f


def _feed_full_passes(entries: list[dict[str, Any]], sp: Any, ledger: Path) -> list[tuple[int, str]]:
    """Every call a full pass (no live rule asked): the requests, call by call."""
    out = []
    with Engine.open(sp, ledger, token_counter=CHARS4_COUNTER) as eng:
        eng.ask_rules = False
        for i, e in enumerate(entries):
            if e["type"] == "assistant" and i:
                r = eng.assemble(SID, model=e["message"]["model"])
                out.append((r.call, r.request_sha256))
            eng.ingest(SID, [e])
    return out


def test_full_passes_reuse_the_last_reapplication_and_get_what_reapplying_gives(tmp_path: Path,
                                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    # tombstone's idle trigger clears at each new user turn: its ledger view grows at some calls and
    # stays the same at the others, where the memo is used
    s = build(16, size=2000, turn_every=4)
    sp = spec("tombstone.trigger_tokens = 0\ntombstone.keep_recent = 0\ntombstone.trigger_idle_seconds = 20")
    used: list[str] = []
    real = ReapplyMemo.reapply

    def checked(self: ReapplyMemo, name: str, stage: Any, blocks: pl.DataFrame, earlier: pl.DataFrame) -> Reapplied:
        kept = self._kept.get(name)
        got = real(self, name, stage, blocks, earlier)
        _same(got, reapply(stage, blocks, earlier))
        if kept is not None and got.decisions is kept.result.decisions:
            used.append(name)
        return got

    monkeypatch.setattr(ReapplyMemo, "reapply", checked)
    got = _feed_full_passes(s.entries, sp, tmp_path / "e.duckdb")
    want = batch(s.entries, sp, tmp_path)
    assert got == [(c, want[c]) for c, _ in got]
    assert "tombstone" in used and len(used) >= 5, used


def test_a_new_row_a_frozen_decision_targets_is_reapplied_afresh(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # the last pass lacked a row that a frozen decision targets (a missing target then): the memo
    # must not hand back that pass's result with the row merely added
    s = build(16, size=2000, turn_every=4)
    sp = spec("tombstone.trigger_tokens = 0\ntombstone.keep_recent = 0\ntombstone.trigger_idle_seconds = 20")
    seen: list[tuple[str, Any, pl.DataFrame, pl.DataFrame]] = []
    real = ReapplyMemo.reapply

    def spy(self: ReapplyMemo, name: str, stage: Any, blocks: pl.DataFrame, earlier: pl.DataFrame) -> Reapplied:
        seen.append((name, stage, blocks, earlier))
        return real(self, name, stage, blocks, earlier)

    monkeypatch.setattr(ReapplyMemo, "reapply", spy)
    _feed_full_passes(s.entries, sp, tmp_path / "e.duckdb")
    name, stage, blocks, earlier = next(x for x in reversed(seen) if x[0] == "tombstone")
    monkeypatch.setattr(ReapplyMemo, "reapply", real)
    target = earlier.filter(pl.col("action") == "tombstone").row(0, named=True)
    hit = (pl.col("entry_id") == target["entry_id"]) & (pl.col("block_pos") == target["block_pos"])
    assert blocks.filter(hit).height
    memo = ReapplyMemo()
    before = memo.reapply(name, stage, blocks.filter(~hit), earlier)
    assert before.conflicts.filter(pl.col("reason") == "missing_target").height
    _same(memo.reapply(name, stage, blocks, earlier), reapply(stage, blocks, earlier))
    # and with the same rows again, the memo's answer is the fresh one too
    _same(memo.reapply(name, stage, blocks, earlier), reapply(stage, blocks, earlier))
