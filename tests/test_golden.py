"""Golden cases: tests/golden/<stage>/<case>/ with input.jsonl (messages, one per line, in the
`pipeline.testkit.make_thread` form), params.toml (a comment says what the case shows),
expected_blocks.jsonl and expected_decisions.jsonl (sorted by key). `pytest --update-goldens`
rewrites the expected files; review the diff like code. Re-running the stage on its own output
must decide nothing (idempotence)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import orjson
import polars as pl
import pytest

from pipeline.registry import StageContext
from pipeline.testkit import VIEW, make_blocks, run_stage

GOLDEN = Path(__file__).parent / "golden"
CASES = sorted(p for p in GOLDEN.glob("*/*") if (p / "input.jsonl").is_file())

# the testkit's compact view plus the cache epoch of every version and decision (a layer that fires
# must take a new epoch; one that does not must leave epochs alone)
BLOCK_VIEW = [*VIEW, "cache_epoch"]
DECISION_VIEW = ["session_id", "thread_id", "entry_id", "block_pos", "part_pos", "tool_use_id", "from_call",
                 "action", "reason", "before_sha256", "after_sha256", "replacement", "cache_epoch"]


def view(blocks: pl.LazyFrame | pl.DataFrame) -> pl.DataFrame:
    df = blocks.collect() if isinstance(blocks, pl.LazyFrame) else blocks
    return df.select(BLOCK_VIEW).sort(["session_id", "thread_id", "order_key", "block_pos", "part_pos", "first_call"])


def _rows(df: pl.DataFrame) -> list[dict]:
    return [orjson.loads(orjson.dumps(r, default=str)) for r in df.to_dicts()]


def _read(p: Path) -> list[dict]:
    return [orjson.loads(x) for x in p.read_text(encoding="utf-8").splitlines() if x.strip()]


def _write(p: Path, rows: list[dict]) -> None:
    p.write_text("".join(orjson.dumps(r, option=orjson.OPT_SORT_KEYS).decode() + "\n" for r in rows),
                 encoding="utf-8")


def test_there_are_golden_cases() -> None:
    assert CASES, "no golden cases found under tests/golden"


@pytest.mark.parametrize("case", CASES, ids=[f"{c.parent.name}/{c.name}" for c in CASES])
def test_golden(case: Path, update_goldens: bool) -> None:
    stage = case.parent.name
    cfg = tomllib.loads((case / "params.toml").read_text()) if (case / "params.toml").exists() else {}
    ctx_cfg = cfg.pop("context", {})
    compactions = [tuple(x) for x in cfg.pop("compactions", [])]
    ctx = StageContext(**ctx_cfg)
    blocks = make_blocks(_read(case / "input.jsonl"), compactions=compactions)
    res = run_stage(stage, blocks, cfg, ctx=ctx)
    got_blocks = _rows(view(res.blocks))
    dec = res.decisions.collect().select(DECISION_VIEW).sort(DECISION_VIEW[:7])
    got_dec = _rows(dec)
    if update_goldens:
        _write(case / "expected_blocks.jsonl", got_blocks)
        _write(case / "expected_decisions.jsonl", got_dec)
    assert got_blocks == _read(case / "expected_blocks.jsonl")
    assert got_dec == _read(case / "expected_decisions.jsonl")
    again = run_stage(stage, res.blocks, cfg, ctx=ctx)
    assert again.decisions.collect().height == 0, "second pass must decide nothing"
    assert _rows(view(again.blocks)) == got_blocks
