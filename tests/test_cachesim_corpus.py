"""The cache simulator against the recorded usage of the real Claude Code tree (identity pipeline).

Thresholds are what the simulator reaches (README, "Prompt-cache simulation"): every recorded call
is classed as the recorded usage says; the misses nothing in the transcript explains (an MCP
reconnection changing the system prompt, a new turn falling back to the system prompt) are replayed.
"""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest

from ctxreplay.pipeline.batch.runner import RunOptions, run
from ctxreplay.pipeline.cost import breaks
from ctxreplay.pipeline.staging.spec import load_spec

pytestmark = pytest.mark.corpus

S258, SD6E = "258c7280-ae70-4798-800f-63464d01a85d", "d6e0bada-1959-4eec-a9d2-0bfade768d8f"


@pytest.fixture(scope="module")
def calls(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> pl.DataFrame:
    out = tmp_path_factory.mktemp("cachesim-corpus") / "o"
    res = run([corpus / "claude-projects"], load_spec(preset="identity"), RunOptions(out_dir=out))
    assert res.summary["cache_sim"]["warnings"] == []
    return pl.read_parquet(out / "calls.parquet")


def test_the_simulated_usage_adds_up_to_the_calibrated_prompt(calls: pl.DataFrame) -> None:
    c = calls.filter(~pl.col("is_pending"))
    assert c.height == 881 and c["sim_cache_read_tokens"].null_count() == 0
    total = pl.col("sim_cache_read_tokens") + pl.col("sim_cache_write_5m_tokens") + pl.col("sim_cache_write_1h_tokens") \
        + pl.col("sim_input_tokens")
    assert c.filter(total != pl.col("calibrated_prompt_tokens")).height == 0
    assert calls.filter(pl.col("is_pending"))["sim_cache_read_tokens"].null_count() == 19
    # the recorded usage, priced with the same book, is what `ctxreplay report` gives (and ccusage)
    assert round(c["recorded_cost_usd"].sum(), 4) == 51.5794
    assert c["recorded_cost_usd"].null_count() == 0 and c["sim_cost_usd"].null_count() == 0


def test_per_call_agreement_and_what_explains_the_rest(calls: pl.DataFrame) -> None:
    cl = breaks.classify(calls)
    assert cl.height == 881
    off = sorted((r["session_id"], r["thread_id"], r["call"], r["rec_class"], r["sim_class"])
                 for r in cl.filter(~pl.col("agree")).iter_rows(named=True))
    # the recorded preamble changes (S258 call 31: tool result + interruption + notification fell to
    # the system prompt; SD6E call 2: `/mcp` changed it, only the usage shows it) are replayed; Opus
    # 4.6 keeps its thinking across new turns, so S258 call 151 (a new turn after thinking that hit)
    # is no simulated strip (it was, before the documented per-model default: `keeps_thinking`)
    assert off == []


def test_per_session_recorded_vs_simulated(calls: pl.DataFrame) -> None:
    s = {r["session_id"]: r for r in breaks.sessions(calls).to_dicts()}
    assert len(s) == 8
    for sid, r in s.items():
        assert abs(r["read_diff"]) <= 0.01, (sid, r["read_diff"])
        assert abs(r["write_diff"]) <= 0.03, (sid, r["write_diff"])
        assert abs(r["cost_diff"]) <= 0.02, (sid, r["cost_diff"])
    # the two sessions with a preamble change nothing in the transcript explains: replayed, and
    # without the replay the simulation misses their writes (-20 to -25 %, -40 to -50 %)
    assert abs(s[S258]["write_diff"]) <= 0.01 and abs(s[SD6E]["write_diff"]) <= 0.01
    c = calls.filter(~pl.col("is_pending"))
    read = c["sim_cache_read_tokens"].sum() / c["recorded_cache_read_tokens"].sum() - 1
    cost = c["sim_cost_usd"].sum() / c["recorded_cost_usd"].sum() - 1
    assert abs(read) <= 0.002 and abs(cost) <= 0.025


def test_every_recorded_break_is_attributed(calls: pl.DataFrame) -> None:
    by = breaks.by_cause(calls)
    rec = {k: v["breaks"] for k, v in by["recorded"].items() if isinstance(v, dict)}
    # the three new turns after thinking that fell back to the system prompt's end (S258 call 149,
    # 4d5611e5 call 137, fa812bfe call 43) are no thinking strip on Opus 4.6, which keeps its
    # thinking: the read stops inside the preamble, as after a change of the system prompt
    assert rec == {"compaction": 4, "model_switch": 2, "preamble": 5, "ttl_expiry": 2}
    assert by["recorded"]["unexplained_share"] == 0.0
    sim = {k: v["breaks"] for k, v in by["sim"].items() if isinstance(v, dict)}
    assert sim == rec
    rows = breaks.break_rows(calls)
    replayed = rows.filter((pl.col("source") == "sim") & (pl.col("cause") == "preamble"))
    assert replayed.height == 5 and replayed["detail"].str.starts_with("replayed: ").all()
    ttl = rows.filter((pl.col("source") == "recorded") & (pl.col("cause") == "ttl_expiry"))
    assert sorted(ttl["detail"].str.extract(r"idle (\d+) s").cast(pl.Int64).to_list()) == [1150, 15076]
    # the breaks cost something, and never less than nothing
    assert rows.filter(pl.col("cost_usd") < 0).height == 0
    share = breaks.sessions(calls).select(pl.col("rec_break_cost").sum() / pl.col("rec_cost").sum()).item()
    assert 0.05 < share < 0.15
