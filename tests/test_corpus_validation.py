"""Acceptance on the real corpus (../shared/corpus): under a spec with every layer in the order of
layer-semantics §2 (pairing twice), every pending request and every call of every thread passes
the `anthropic` and the `openai-chat` validators; the pairing repairs that made it so include the
OpenClaw orphan results and the `call_auto_1` synthetic repair; the second pairing pass (after
snip) decides nothing."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import polars as pl
import pytest

from ctxreplay.pipeline.batch.runner import RunOptions, RunResult, run
from ctxreplay.pipeline.core.tokens import CHARS4_COUNTER
from ctxreplay.pipeline.staging.spec import load_spec

pytestmark = pytest.mark.corpus

ORPHANS = "e3063350-9fbd-46dd-99f7-0559c3d78207"  # two "Tool grep not found" results without a call
AUTO_REPAIR = "c1050d61-2f26-4939-b759-c49791308fc3"  # call_auto_1 repair result; last call unanswered


@pytest.fixture(scope="module")
def runs(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, RunResult]:
    spec = load_spec(preset="default")  # every layer, in the §2 order
    out = {}
    for target in ("anthropic", "openai-chat"):
        tmp = tmp_path_factory.mktemp(target)
        out[target] = run([corpus], spec, RunOptions(out_dir=tmp / "o", target=target, all_calls=True,
                                                     token_counter=CHARS4_COUNTER))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("target", ["anthropic", "openai-chat"])
def test_every_call_of_every_thread_passes_the_validator(runs: dict[str, RunResult], target: str) -> None:
    res = runs[target]
    assert res.summary["calls"] > 1000 and res.summary["pending_calls"] == res.summary["threads"]
    by_rule = Counter(v.rule for v in res.violations)
    assert not res.violations, f"{len(res.violations)} violations under {target}: {dict(by_rule)}; first: " + \
        "; ".join(map(str, res.violations[:3]))


def _pairing_decisions(res: RunResult) -> pl.DataFrame:
    """Every pairing decision the run applied (the ledger holds only those frozen: a decision for a
    thread's pending call, like the synthetic result for a session that ends on a call, is not)."""
    assert res.decisions is not None
    d = res.decisions
    return d.filter(pl.col("stage").str.starts_with("pairing"))


def test_pairing_repairs_the_openclaw_defects(runs: dict[str, RunResult]) -> None:
    d = _pairing_decisions(runs["anthropic"])
    orphans = d.filter((pl.col("action") == "drop") & (pl.col("reason") == "orphan"))
    assert orphans.filter(pl.col("session_id") == ORPHANS).height == 2
    auto = orphans.filter(pl.col("session_id") == AUTO_REPAIR)
    assert auto["tool_use_id"].to_list() == ["call_auto_1"]
    missing = d.filter((pl.col("action") == "insert") & (pl.col("reason") == "missing"))
    assert missing.filter(pl.col("session_id") == AUTO_REPAIR).height == 1  # the session ends on a call
    # Kimi ids (`functions.read:0`) are made valid for Anthropic, on calls and results together
    ids = d.filter((pl.col("session_id") == AUTO_REPAIR) & (pl.col("reason") == "tool_id"))
    assert ids.height > 0 and all(":" not in i and "." not in i for i in ids["tool_use_id"].to_list())


def test_second_pairing_pass_decides_nothing(runs: dict[str, RunResult]) -> None:
    stats = runs["anthropic"].summary["decisions_by_stage"]
    assert stats["pairing"]["decisions"] > 0
    assert stats["pairing#2"]["decisions"] == 0
