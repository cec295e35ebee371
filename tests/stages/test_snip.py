"""L5b snip (docs/layers.md): watermarks, whole turns, protected rows, one marker."""

from __future__ import annotations

import re
from typing import Any

import polars as pl
import pytest

from ctxreplay.errors import SpecError
from ctxreplay.pipeline.core.tokens import fast_token_estimate
from ctxreplay.pipeline.stageapi.calls import request_tokens
from ctxreplay.pipeline.stageapi.registry import StageContext, get_stage
from ctxreplay.pipeline.staging.spec import resolve_params
from ctxreplay.stages.snip import SNIP_RE
from ctxreplay.testkit import make_blocks, make_context, run_stage, visible

NO_DRY_RUN = make_context(window_tokens=2_000, peers={})  # no tombstone in the pipeline
PARAMS = {"reserve_output_tokens": 0}  # budget 2,000: high 1,600, low 1,200


def chat(turns: int, size: int = 400) -> list[dict[str, Any]]:
    """A system row, then `turns` user/assistant turns of about size/4 tokens each message."""
    msgs: list[dict[str, Any]] = [{"role": "system", "text": "You are terse."}]
    for t in range(turns):
        msgs.append({"role": "user", "text": f"question {t} " + "q" * size})
        msgs.append({"role": "assistant", "text": f"answer {t} " + "a" * size})
    return msgs


def run(messages: list[dict[str, Any]], params: dict[str, Any] | None = None, *, ctx: StageContext = NO_DRY_RUN,
        ledger: pl.LazyFrame | None = None, **kw: Any) -> tuple[pl.DataFrame, pl.DataFrame]:
    res = run_stage("snip", make_blocks(messages, **kw), {**PARAMS, **(params or {})}, ctx=ctx, ledger=ledger)
    return res.blocks.collect(), res.decisions.collect().sort("from_call", "entry_id")


def tokens_at(blocks: pl.DataFrame, ctx: StageContext = NO_DRY_RUN) -> dict[int, int]:
    t = request_tokens(blocks.lazy(), ctx).collect()
    return dict(zip(t["call"].to_list(), t["tokens"].to_list()))


def markers(blocks: pl.DataFrame) -> pl.DataFrame:
    return blocks.filter(pl.col("origin") == "snip").sort("first_call")


def test_snips_oldest_middle_turns_down_to_the_low_watermark() -> None:
    before = tokens_at(make_blocks(chat(10)).collect())
    blocks, dec = run(chat(10))
    first = int(dec["from_call"].min())
    assert before[first] > 1_600 >= before[first - 1]  # fires at the first call over the high watermark
    assert tokens_at(blocks)[first] <= 1_200  # and gets it under the low watermark
    snipped = dec.filter(pl.col("action") == "snip")["entry_id"].to_list()
    assert snipped == sorted(snipped) and snipped[0] == "e0003"  # the first turn after the protected head
    m = markers(blocks).row(0, named=True)
    assert re.fullmatch(SNIP_RE, m["text"])
    assert m["text"] == f"[Earlier conversation snipped: {len(snipped)} messages (~{m['text'].split('~')[1].split()[0]} tokens) removed to fit the context budget]"
    assert m["role"] == "user" and m["order_key"] == 3 * 1024 - 1 and m["first_call"] == first


def test_later_snips_extend_the_same_marker() -> None:
    blocks, dec = run(chat(16), {"min_tail_turns": 1, "high_watermark": 0.6, "low_watermark": 0.5})
    m = markers(blocks)
    assert m["entry_id"].n_unique() == 1 and m.height >= 2
    assert m["last_call"].to_list()[:-1] == m["first_call"].to_list()[1:]  # one version per firing
    counts = [int(re.fullmatch(SNIP_RE, t).group(1)) for t in m["text"]]  # type: ignore[union-attr]
    assert counts == sorted(counts) and len(set(counts)) == len(counts)
    acts = dec.filter(pl.col("entry_id") == m["entry_id"][0])["action"].to_list()
    assert acts == ["insert"] + ["replace"] * (len(acts) - 1)
    epochs = dec.group_by("from_call").agg(pl.col("cache_epoch").unique()).sort("from_call")["cache_epoch"].to_list()
    assert [e for (e,) in epochs] == [k + 1 for k in sorted(set(dec["from_call"]))]  # epoch = firing call + 1
    # frontier only moves forward: once gone, a message never comes back
    last = int(blocks["first_call"].max())
    gone = set(dec.filter(pl.col("action") == "snip")["entry_id"])
    assert not gone & set(visible(blocks, last)["entry_id"])


def test_first_user_turn_and_system_rows_are_never_snipped_13() -> None:
    _blocks, dec = run(chat(14), {"min_tail_turns": 1, "high_watermark": 0.5, "low_watermark": 0.3})
    gone = set(dec.filter(pl.col("action") == "snip")["entry_id"])
    assert dec.height and not gone & {"e0000", "e0001", "e0002"}
    with pytest.raises(SpecError, match="first user turn"):
        resolve_params(get_stage("snip"), {"keep_head_turns": 0}, where="t")


def test_min_tail_turns_are_kept() -> None:
    _, dec = run(chat(10), {"min_tail_turns": 6})
    kept_turn_rows = {f"e{i:04d}" for i in range(9, 21)}  # turns 4..9 at the last call
    assert not set(dec.filter(pl.col("action") == "snip")["entry_id"]) & kept_turn_rows


def test_current_tool_loop_is_never_snipped_13() -> None:
    # one user turn followed by a long tool loop: all of it is the current loop, protected
    msgs: list[dict[str, Any]] = [{"role": "user", "text": "go"}]
    for i in range(12):
        msgs.append({"role": "assistant", "blocks": [{"type": "tool_use", "tool_use_id": f"t{i}", "tool_name": "Read",
                                                      "tool_input": {}}]})
        msgs.append({"role": "user", "blocks": [{"type": "tool_result", "tool_use_id": f"t{i}", "text": "r" * 800}]})
    _, dec = run(msgs, {"min_tail_turns": 0})
    assert dec.height == 0  # over the budget, but only protected rows: nothing to snip


def test_latest_compaction_summary_and_after_are_protected() -> None:
    msgs = chat(16)
    at = 13  # a summary message right before turn 6; earlier messages are compacted away
    msgs.insert(at, {"role": "user", "text": "Summary of the conversation so far.", "is_compact_summary": True})
    blocks, dec = run(msgs, {"min_tail_turns": 1, "high_watermark": 0.3, "low_watermark": 0.2},
                      compactions=[(at, at)])
    cut = int(blocks.filter(pl.col("entry_id") == "e0001")["last_call"][0])  # the compaction's first call
    snips = dec.filter(pl.col("action") == "snip")
    assert snips.height > 0 and snips["from_call"].max() < cut  # nothing snipped once the summary is in
    # the marker goes with the rows it stood for
    assert markers(blocks)["last_call"].to_list()[-1] == cut


def test_judged_after_a_dry_run_of_tombstone() -> None:
    msgs: list[dict[str, Any]] = []
    for t in range(8):
        msgs.append({"role": "user", "text": f"do {t}", "timestamp": t * 100})
        msgs.append({"role": "assistant", "blocks": [{"type": "tool_use", "tool_use_id": f"t{t}", "tool_name": "Read",
                                                      "tool_input": {}}], "timestamp": t * 100 + 1})
        msgs.append({"role": "user", "blocks": [{"type": "tool_result", "tool_use_id": f"t{t}", "tool_name": "Read",
                                                 "text": "r" * 1_200}], "timestamp": t * 100 + 2})
        msgs.append({"role": "assistant", "text": "ok", "timestamp": t * 100 + 3})
    _, without = run(msgs)
    assert without.filter(pl.col("action") == "snip").height > 0
    tomb = {"trigger_tokens": 1_000, "clear_at_least_tokens": 200, "keep_recent": 1, "trigger_idle_seconds": 0}
    _, with_dry_run = run(msgs, ctx=make_context(window_tokens=2_000, peers={"tombstone": tomb}))
    assert with_dry_run.height == 0  # tombstoning alone gets the request under the high watermark


def test_second_pass_decides_nothing() -> None:
    params = {**PARAMS, "min_tail_turns": 1, "high_watermark": 0.6, "low_watermark": 0.5}
    res = run_stage("snip", make_blocks(chat(16)), params, ctx=NO_DRY_RUN)
    again = run_stage("snip", res.blocks, params, ctx=NO_DRY_RUN)
    assert again.decisions.collect().height == 0
    cols = ["entry_id", "first_call", "last_call", "text"]
    assert again.blocks.collect().sort(cols[:2]).select(cols).equals(res.blocks.collect().sort(cols[:2]).select(cols))


def test_resume_with_ledger_equals_a_fresh_run() -> None:
    params = {"min_tail_turns": 1, "high_watermark": 0.6, "low_watermark": 0.5}
    msgs = chat(16)
    _, first = run(msgs[:20], params)
    assert first.height > 0
    blocks, resumed = run(msgs, params, ledger=first.lazy())
    fresh_blocks, fresh = run(msgs, params)
    cols = ["entry_id", "first_call", "last_call", "text", "order_key", "cache_epoch"]
    assert blocks.sort(cols[:2]).select(cols).equals(fresh_blocks.sort(cols[:2]).select(cols))
    key = ["entry_id", "from_call", "action", "after_sha256", "cache_epoch"]
    assert sorted(resumed.select(key).rows()) == sorted(fresh.select(key).rows())


def test_ledger_snips_are_kept_even_when_the_budget_would_not_snip_now() -> None:
    msgs = chat(10)
    _, first = run(msgs)
    blocks, again = run(msgs, {"high_watermark": 1.0, "low_watermark": 1.0}, ledger=first.lazy())
    assert sorted(again.select("entry_id", "from_call", "action").rows()) == \
        sorted(first.select("entry_id", "from_call", "action").rows())
    assert markers(blocks).height == 1


def test_disabled_does_nothing() -> None:
    _, dec = run(chat(10), {"enabled": False})
    assert dec.height == 0


def test_fast_estimator_is_ceil_chars_over_four() -> None:
    df = pl.DataFrame({"n": [0, 1, 4, 5]})
    assert df.select(fast_token_estimate(pl.col("n")))["n"].to_list() == [0, 1, 1, 2]


def _dry_run_shrinks(parts: list[str], min_chars: int, **tomb: Any) -> bool | None:
    """Whether snip's bound holds for one tool result of these parts (tombstone dry-run with
    min_result_chars = min_chars, the fast estimate): None where tombstone's params could lengthen
    any request."""
    from ctxreplay.stages.snip import _dry_run_shrinks as shrinks

    msgs: list[dict[str, Any]] = [
        {"role": "user", "text": "go"},
        {"role": "assistant", "blocks": [{"type": "tool_use", "tool_use_id": "t0", "tool_name": "Read", "tool_input": {}}]},
        {"role": "user", "blocks": [{"type": "tool_result", "tool_use_id": "t0", "text": text, "part_type": "text",
                                     "part_pos": i} for i, text in enumerate(parts)]},
        {"role": "user", "blocks": [{"type": "tool_result", "tool_use_id": "t9", "text": "x" * 400}]},  # long, cleared short
    ]
    params = resolve_params(get_stage("tombstone"), {"min_result_chars": min_chars, **tomb}, where="test")
    plan = shrinks(make_blocks(msgs), params, StageContext())
    return None if plan is None else bool(plan.collect().item())


def test_the_dry_run_of_tombstone_shrinks_unless_a_result_it_may_clear_has_a_row_under_the_placeholder() -> None:
    """The placeholder ("[Old tool result content cleared]", 33 characters) is 9 tokens by the fast
    estimate: a row of 33-36 characters is 9 (not under it), 32 characters 8 (under it). A result
    may be cleared when all its parts' text is at least min_result_chars."""
    assert _dry_run_shrinks(["a" * 32], 32) is False  # may clear (32 >= 32), its row under the placeholder
    assert _dry_run_shrinks(["a" * 32], 33) is True  # too short to clear
    assert _dry_run_shrinks(["a" * 33], 33) is True  # clearable, but not under the placeholder
    # two parts: their text together makes it clearable, the short part is under the placeholder
    assert _dry_run_shrinks(["a" * 40, "b" * 8], 48) is False
    assert _dry_run_shrinks(["a" * 40, "b" * 8], 49) is True
    assert _dry_run_shrinks(["a" * 40, "b" * 36], 70) is True  # every row at least the placeholder
    assert _dry_run_shrinks(["a" * 32], 32, clear_tool_inputs=True) is None  # an input may become longer
