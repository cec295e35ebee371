"""The live engine's memo of re-applied decisions (pipeline/staging/stagerun.py ReapplyMemo): where
it is used, it gives what re-applying afresh gives."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import polars as pl
import pytest

from ctxreplay.pipeline.core.blockops import append_sorted, sort_blocks
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
        if got.ordered:  # said to be in block order: exactly sort_blocks' order
            assert got.blocks.equals(sort_blocks(got.blocks.lazy()).collect())
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


def _rows(*keys: tuple[str, int, int]) -> pl.DataFrame:
    """Block rows (thread, order_key, first_call) of one session, the other keys fixed."""
    return pl.DataFrame({"session_id": ["s"] * len(keys), "thread_id": [k[0] for k in keys],
                         "order_key": [k[1] for k in keys], "block_pos": [0] * len(keys), "part_pos": [0] * len(keys),
                         "first_call": [k[2] for k in keys], "entry_id": [f"e{k[1]}" for k in keys],
                         "text": [f"{k}" for k in keys]},
                        schema_overrides={"order_key": pl.Int64, "first_call": pl.Int32, "block_pos": pl.Int32,
                                          "part_pos": pl.Int32})


@pytest.mark.parametrize("rows", [
    [("main", 40, 3), ("main", 30, 2)],  # after the last row (given unsorted): appended
    [("main", 20, 2)],  # equal to the last row's order_key, a later version: after it
    [("main", 20, 1)],  # the last row itself again: not after it (equal), sorted in
    [("main", 15, 1)],  # between two kept rows: sorted in
    [("a-branch", 50, 1)],  # another thread that sorts before the kept one
    [("main", None, 3)],  # a null key: sorted in (polars puts it first)
])
def test_append_sorted_is_sort_blocks_of_both(rows: list[tuple[str, int, int]]) -> None:
    kept = sort_blocks(_rows(("main", 10, 1), ("main", 20, 1)).lazy()).collect()
    new = _rows(*rows)
    assert append_sorted(kept, new).equals(sort_blocks(pl.concat([kept, new]).lazy()).collect())


def test_append_sorted_without_rows_is_the_frame_itself() -> None:
    kept = _rows(("main", 10, 1))
    assert append_sorted(kept, kept.head(0)) is kept
    assert append_sorted(kept.head(0), kept).equals(kept)


def test_a_kept_reapplication_not_in_block_order_is_sorted_with_the_new_rows() -> None:
    # a ledger view without a frozen decision of the stage (a conflict row only): reapplying leaves
    # the blocks as given (here shuffled), so the memo's new rows cannot just follow them
    from ctxreplay.pipeline.core.blockops import decision_schema
    from ctxreplay.pipeline.stageapi.registry import get_stage
    from ctxreplay.testkit import make_blocks

    msgs = [{"role": "user" if i % 2 == 0 else "assistant", "text": f"m{i}"} for i in range(8)]
    blocks = make_blocks(msgs).collect().sample(fraction=1.0, shuffle=True, seed=3)
    earlier = pl.DataFrame([{"session_id": "s1", "thread_id": "main", "entry_id": "e0000", "block_pos": 0,
                             "part_pos": 0, "from_call": 1, "action": "conflict", "reason": "hash_mismatch",
                             "cache_epoch": 0}], schema=decision_schema())
    stage = get_stage("tombstone")
    memo = ReapplyMemo()
    first = memo.reapply("tombstone", stage, blocks.filter(pl.col("entry_id") != "e0007"), earlier)
    assert not first.ordered
    got = memo.reapply("tombstone", stage, blocks, earlier)
    assert got.decisions is first.decisions  # the memo was used
    assert got.ordered and got.blocks.equals(sort_blocks(blocks.lazy()).collect())
