"""Properties of layers 5-6 (result_budget, snip, tombstone) on generated threads.

- idempotence: a second pass decides nothing and changes nothing;
- every changed block has exactly one decision, whose before_sha256 matches what it replaced;
- prefix causality: a prefix of the thread gives the same requests for its calls as the whole;
- resume: the prefix's decisions as the ledger, then the whole thread == the whole thread fresh;
- cache epochs: between consecutive calls a request's earlier content changes only where a
  decision of that call with a new cache_epoch explains it.

Corpus-wide versions of these (every thread of ../shared/corpus under every preset) need the
runner; they live at the end of this file and skip until `pipeline.runner` exists.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.blockops import empty_decisions
from pipeline.registry import StageContext, StageResult
from pipeline.testkit import make_blocks, run_stage

CONTENT = ["role", "block_type", "part_type", "text", "tool_use_id", "tool_name", "tool_input", "is_error",
           "image_data", "signature"]
KEY = ["entry_id", "block_pos", "part_pos"]


# ------------------------------------------------------------------ generated sessions


def gen_messages(seed: int, *, turns: int = 8, big: int = 3_000, idle_every: int = 4) -> list[dict[str, Any]]:
    """A thread of user turns, each with a few tool loops (some results large, some errors, some
    thinking), timestamps with an idle gap (> 1 h) now and then."""
    rng = random.Random(seed)
    msgs: list[dict[str, Any]] = [{"role": "system", "text": "You are a test agent.", "timestamp": 0}]
    t = 1
    n = 0
    for turn in range(turns):
        t += 4_000 if (turn and turn % idle_every == 0) else rng.randint(5, 120)
        msgs.append({"role": "user", "text": f"turn {turn}: " + "please do things " * rng.randint(1, 30),
                     "timestamp": t})
        for _ in range(rng.randint(0, 3)):
            t += rng.randint(1, 30)
            calls = []
            for _c in range(rng.randint(1, 2)):
                n += 1
                calls.append((f"toolu_{n:04d}", rng.choice(["Read", "Bash", "Grep", "mcp__x__fetch"])))
            blocks: list[dict[str, Any]] = []
            if rng.random() < 0.3:
                blocks.append({"type": "thinking", "text": "hmm " * rng.randint(5, 50), "signature": f"sig{n}"})
            blocks += [{"type": "tool_use", "tool_use_id": i, "tool_name": name, "tool_input": {"n": i}}
                       for i, name in calls]
            msgs.append({"role": "assistant", "blocks": blocks, "timestamp": t})
            t += rng.randint(1, 30)
            results = []
            for i, name in calls:
                size = rng.choice([20, 300, 1_500, big, big * 3])
                body = "\n".join(f"{i} line {k} " + "x" * 40 for k in range(size // 50 + 1))[:size]
                results.append({"type": "tool_result", "tool_use_id": i, "tool_name": name, "text": body,
                                "part_type": "string", "is_error": rng.random() < 0.1})
            msgs.append({"role": "user", "blocks": results, "timestamp": t})
        t += rng.randint(1, 30)
        msgs.append({"role": "assistant", "text": f"done with turn {turn} " + "ok " * rng.randint(1, 40),
                     "timestamp": t})
    return msgs


def assistant_cuts(msgs: list[dict[str, Any]]) -> list[int]:
    """Positions of assistant messages: a prefix cut right before one ends at a pending call that
    the whole thread also has."""
    return [i for i, m in enumerate(msgs) if m["role"] == "assistant" and i > 1]


# ------------------------------------------------------------------ checks


def per_call(blocks: pl.LazyFrame | pl.DataFrame) -> pl.DataFrame:
    """One row per (call, visible block version)."""
    df = blocks.collect() if isinstance(blocks, pl.LazyFrame) else blocks
    n = int(df["first_call"].max())
    return df.with_columns(
        call=pl.int_ranges("first_call", pl.coalesce("last_call", pl.lit(n + 1)).clip(upper_bound=n + 1),
                           dtype=pl.Int32)
    ).explode("call").filter(pl.col("call").is_not_null())


def requests(blocks: pl.LazyFrame | pl.DataFrame) -> dict[int, list[tuple]]:
    """Each call's request content, in order (version bounds left out)."""
    v = per_call(blocks).sort(["call", "order_key", "block_pos", "part_pos", "entry_id"])
    out: dict[int, list[tuple]] = {}
    for (k,), part in v.group_by(["call"], maintain_order=True):
        out[int(k)] = list(part.select(*KEY, *CONTENT).iter_rows())  # type: ignore[arg-type]
    return out


def check_decisions_match(before: pl.LazyFrame, res: StageResult) -> None:
    """Every changed block version has one decision whose before_sha256 is what it replaced."""
    b = before.collect()
    a = res.blocks.collect()
    d = res.decisions.collect()
    assert d.filter(pl.col("action") == "conflict").height == 0
    vkey = ["entry_id", "block_pos", "part_pos", "first_call"]
    # versions in the output that were not in the input: each has a decision from its first call
    new = a.join(b.select(*vkey, "content_sha256"), on=[*vkey, "content_sha256"], how="anti")
    new = new.filter(pl.col("origin") != "snip")
    dec_at = d.select(*KEY, first_call="from_call", dsha="after_sha256", dcount=pl.lit(1))
    j = new.join(dec_at, on=vkey, how="left")
    assert j["dsha"].null_count() == 0, j.filter(pl.col("dsha").is_null()).select(*vkey, "text")
    assert (j["dsha"] == j["content_sha256"]).all()
    # one decision per (block, from_call)
    assert d.group_by([*KEY, "from_call"]).len()["len"].max() in (None, 1)
    # before_sha256 of replace-like decisions: the version visible right before from_call had it
    rep = d.filter(pl.col("before_sha256").is_not_null())
    vis = b.join(rep.select(*KEY, "from_call", "before_sha256"), on=KEY).filter(
        (pl.col("first_call") <= pl.col("from_call"))
        & (pl.col("last_call").is_null() | (pl.col("last_call") > pl.col("from_call"))))
    ins = rep.filter(pl.col("action").is_in(["insert", "replace"]) & pl.col("entry_id").is_in(
        a.filter(pl.col("origin") == "snip")["entry_id"].unique().to_list()))
    assert vis.height + ins.height >= rep.height
    assert (vis["content_sha256"] == vis["before_sha256"]).all()


def check_epochs_explain_breaks(out: pl.LazyFrame | pl.DataFrame, decisions: pl.DataFrame) -> None:
    """Between calls k-1 and k, content that k-1 sent and k changes or drops (or a row inserted
    before the end of k-1's request) must carry a decision at k with a cache epoch above every
    epoch seen at k-1."""
    v = per_call(out).select("call", *KEY, "content_sha256", "order_key", "cache_epoch")
    n = int(v["call"].max())
    prev_stats = v.group_by("call").agg(_max_epoch=pl.col("cache_epoch").max(), _end=pl.col("order_key").max()) \
        .with_columns(call=pl.col("call") + 1)
    shifted = v.with_columns(call=pl.col("call") + 1).filter(pl.col("call") <= n)
    gone = shifted.join(v, on=["call", *KEY, "content_sha256"], how="anti")
    inserted = v.join(shifted, on=["call", *KEY], how="anti").join(prev_stats, on="call").filter(
        pl.col("order_key") < pl.col("_end")).drop("_max_epoch", "_end")
    breaks = pl.concat([gone.select("call", *KEY), inserted.select("call", *KEY)]).unique()
    checked = breaks.join(prev_stats, on="call", how="left").join(
        decisions.select(*KEY, call="from_call", _epoch="cache_epoch"), on=["call", *KEY], how="left")
    unexplained = checked.filter(pl.col("_epoch").is_null() | (pl.col("_epoch") <= pl.col("_max_epoch")))
    assert unexplained.height == 0, unexplained


Runner = Callable[[pl.LazyFrame, pl.LazyFrame], StageResult]


def stage_runner(name: str, params: dict[str, Any], ctx: StageContext) -> Runner:
    return lambda blocks, ledger: run_stage(name, blocks, params, ledger=ledger, ctx=ctx)


def chain_runner(specs: list[tuple[str, dict[str, Any]]], ctx: StageContext) -> Runner:
    """result_budget → snip → tombstone as the runner will chain them; the ledger per stage is
    the decisions of that stage (tagged here with a `_stage` column kept outside the frame)."""

    def run(blocks: pl.LazyFrame, ledger: pl.LazyFrame) -> StageResult:
        led = ledger.collect()
        decisions = []
        for name, params in specs:
            mine = led.filter(pl.col("_stage") == name).drop("_stage") if "_stage" in led.columns else \
                empty_decisions().collect()
            res = run_stage(name, blocks, params, ledger=mine.lazy(), ctx=ctx)
            blocks = res.blocks
            decisions.append(res.decisions.collect().with_columns(_stage=pl.lit(name)))
        return StageResult(blocks, pl.concat(decisions).lazy())

    return run


def check_all(run: Runner, msgs: list[dict[str, Any]], cut: int, *, chained: bool = False) -> None:
    full_in = make_blocks(msgs)
    empty = empty_decisions()
    if chained:
        empty = empty.with_columns(_stage=pl.lit(None, pl.String))
    full = run(full_in, empty)
    full_blocks = full.blocks.collect()
    full_dec = full.decisions.collect()
    # idempotence
    again = run(full_blocks.lazy(), empty)
    assert again.decisions.collect().height == 0
    assert requests(again.blocks) == requests(full_blocks)
    if not chained:
        check_decisions_match(full_in, full)
    check_epochs_explain_breaks(full_blocks, full_dec)
    # prefix causality
    pre = run(make_blocks(msgs[:cut]), empty)
    pre_req = requests(pre.blocks)
    full_req = requests(full_blocks)
    for k, req in pre_req.items():
        assert req == full_req[k], f"call {k} differs between the prefix and the whole thread"
    # resume: the prefix's decisions as the ledger, then the whole thread
    resumed = run(full_in, pre.decisions)
    assert requests(resumed.blocks) == full_req
    rd = resumed.decisions.collect()
    assert rd.filter(pl.col("action") == "conflict").height == 0
    cols = ["entry_id", "block_pos", "part_pos", "from_call", "action", "after_sha256", "cache_epoch"]
    assert sorted(rd.select(cols).iter_rows()) == sorted(full_dec.select(cols).iter_rows())


SMALL = StageContext(window_tokens=12_000)
CASES = {
    "result_budget": {"max_result_chars": 2_000, "aggregate_max_chars": 5_000},
    "result_budget_spill": {"max_result_chars": 2_000, "spill": True, "spill_preview_chars": 300},
    "snip": {"reserve_output_tokens": 2_000, "min_tail_turns": 2},
    "tombstone": {"trigger_tokens": 5_000, "clear_at_least_tokens": 1_000, "keep_recent": 2,
                  "min_result_chars": 100, "clear_tool_inputs": True, "clear_thinking_keep": 1},
}


def _runner(case: str) -> Runner:
    name = "result_budget" if case.startswith("result_budget") else case
    return stage_runner(name, CASES[case], SMALL)


@pytest.mark.parametrize("case", sorted(CASES))
@settings(max_examples=5, deadline=None)
@given(seed=st.integers(0, 10_000), cut_at=st.floats(0.2, 0.9))
def test_stage_properties(case: str, seed: int, cut_at: float) -> None:
    msgs = gen_messages(seed)
    cuts = assistant_cuts(msgs)
    check_all(_runner(case), msgs, cuts[int(cut_at * (len(cuts) - 1))])


@settings(max_examples=4, deadline=None)
@given(seed=st.integers(0, 10_000), cut_at=st.floats(0.2, 0.9))
def test_chain_properties(seed: int, cut_at: float) -> None:
    msgs = gen_messages(seed, turns=10)
    cuts = assistant_cuts(msgs)
    run = chain_runner([("result_budget", CASES["result_budget"]), ("snip", CASES["snip"]),
                        ("tombstone", CASES["tombstone"])], SMALL)
    check_all(run, msgs, cuts[int(cut_at * (len(cuts) - 1))], chained=True)


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10**6), cut_at=st.floats(0.05, 0.95), turns=st.integers(2, 20))
def test_stage_properties_many(case: str, seed: int, cut_at: float, turns: int) -> None:
    msgs = gen_messages(seed, turns=turns)
    cuts = assistant_cuts(msgs)
    if not cuts:
        return
    check_all(_runner(case), msgs, cuts[int(cut_at * (len(cuts) - 1))])


def test_every_cut_of_one_thread_resumes_identically() -> None:
    msgs = gen_messages(7, turns=10)
    run = chain_runner([("result_budget", CASES["result_budget"]), ("snip", CASES["snip"]),
                        ("tombstone", CASES["tombstone"])], SMALL)
    cuts = assistant_cuts(msgs)
    for cut in (cuts[1], cuts[len(cuts) // 2], cuts[-1]):
        check_all(run, msgs, cut, chained=True)
