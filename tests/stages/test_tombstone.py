"""L6 tombstone (docs/layers.md): triggers, eligibility, replacement, frontier, ledger."""

from __future__ import annotations

from typing import Any

import polars as pl
import pytest

from ctxreplay.errors import SpecError
from ctxreplay.pipeline.stageapi.registry import StageContext, get_stage
from ctxreplay.pipeline.staging.spec import resolve_params
from ctxreplay.stages.tombstone import CLEARED, REASONING_OMITTED, glob_regex
from ctxreplay.testkit import make_blocks, run_stage, visible

HOUR = 3_600


def loop(i: int, *, size: int = 2_000, tool: str = "Read", t: float = 0, gap: float = 1,
         thinking: bool = False, error: bool = False, image: bool = False) -> list[dict[str, Any]]:
    """One tool loop: an assistant call, then its result `gap` seconds later."""
    blocks: list[dict[str, Any]] = []
    if thinking:
        blocks.append({"type": "thinking", "text": "let me think " * 20, "signature": f"sig{i}"})
    blocks.append({"type": "tool_use", "tool_use_id": f"toolu_{i}", "tool_name": tool, "tool_input": {"path": f"/f{i}"}})
    parts: list[dict[str, Any]] = [{"type": "tool_result", "tool_use_id": f"toolu_{i}", "tool_name": tool,
                                    "text": f"{i}:" + "x" * size, "part_type": "text", "part_pos": 0,
                                    "is_error": error}]
    if image:
        parts.append({"type": "tool_result", "tool_use_id": f"toolu_{i}", "tool_name": tool, "part_type": "image",
                      "part_pos": 1, "image_media_type": "image/png", "image_data": "iVBORw0KGgo="})
    return [{"role": "assistant", "blocks": blocks, "timestamp": t},
            {"role": "user", "blocks": parts, "timestamp": t + gap}]


def session(n_loops: int, *, idle_before: int | None = None, user_every: int = 1, **kw: Any) -> list[dict[str, Any]]:
    """A user row, then loops; a real user row before every `user_every`-th loop (so older loops
    leave the current tool loop); an idle hour before loop `idle_before`."""
    msgs: list[dict[str, Any]] = [{"role": "user", "text": "start", "timestamp": 0}]
    t = 10.0
    for i in range(n_loops):
        if i == idle_before:
            t += HOUR + 5
        if i and i % user_every == 0:
            msgs.append({"role": "user", "text": f"next {i}", "timestamp": t})
            t += 1
        msgs += loop(i, t=t, **kw)
        t += 10
    msgs.append({"role": "assistant", "text": "done", "timestamp": t})
    return msgs


def run(messages: list[dict[str, Any]], params: dict[str, Any] | None = None, *, ledger: pl.LazyFrame | None = None,
        ctx: StageContext | None = None) -> tuple[pl.DataFrame, pl.DataFrame]:
    res = run_stage("tombstone", make_blocks(messages), params or {}, ledger=ledger, ctx=ctx)
    blocks = res.blocks.collect().sort("entry_id", "block_pos", "part_pos", "first_call")
    return blocks, res.decisions.collect().sort("entry_id", "block_pos", "part_pos", "from_call", "action")


def cleared(decisions: pl.DataFrame) -> list[str]:
    d = decisions.filter(pl.col("action") == "tombstone")
    return sorted(d["tool_use_id"].drop_nulls().unique().to_list())


TOKEN = {"trigger_idle_seconds": 0, "trigger_tokens": 2_000, "clear_at_least_tokens": 500, "keep_recent": 2,
         "min_result_chars": 100}
IDLE = {"trigger_tokens": 0, "keep_recent": 2, "min_result_chars": 100}


def test_idle_trigger_clears_all_eligible_but_the_newest() -> None:
    _blocks, dec = run(session(6, idle_before=5, size=300), IDLE)
    assert cleared(dec) == ["toolu_0", "toolu_1", "toolu_2"]  # 3 and 4 are the 2 newest eligible; 5 is current
    assert set(dec["reason"]) == {"idle"}
    assert set(dec["from_call"]) == {5}  # the request after the idle hour


def test_idle_trigger_uses_transcript_timestamps_only_and_reruns_identically() -> None:
    msgs = session(6, idle_before=5, size=300)
    first = run(msgs, IDLE)
    later = run([{**m, "timestamp": m["timestamp"] + 86_400} for m in msgs], IDLE)  # "a day later"
    assert first[1].equals(later[1])
    assert first[0].select("text", "first_call", "last_call").equals(later[0].select("text", "first_call", "last_call"))


def test_no_idle_gap_no_token_pressure_nothing_cleared() -> None:
    _, dec = run(session(6, size=300), {"keep_recent": 2, "min_result_chars": 100})
    assert dec.height == 0


def test_token_trigger_clears_oldest_first_only_as_much_as_needed() -> None:
    _, dec = run(session(8, size=2_000), TOKEN)
    # each result is ~500 tokens; the request passes 2,000 tokens at call 4: clear the oldest
    # results until at least max(500, excess) is freed
    first = dec.filter(pl.col("from_call") == dec["from_call"].min())
    assert cleared(first) == ["toolu_0", "toolu_1"]
    assert dec["cache_epoch"].min() == int(first["from_call"][0]) + 1  # the firing's call + 1


def test_token_trigger_does_nothing_when_the_batch_frees_too_little() -> None:
    _, dec = run(session(8, size=2_000), {**TOKEN, "clear_at_least_tokens": 100_000})
    assert dec.height == 0


def test_each_firing_takes_a_new_cache_epoch_and_the_frontier_only_moves_forward() -> None:
    blocks, dec = run(session(12, size=2_000), TOKEN)
    firings = dec.group_by("from_call").agg(pl.col("cache_epoch").unique(), pl.col("tool_use_id").max()).sort("from_call")
    assert firings.height >= 2
    epochs = [e for (e,) in firings["cache_epoch"].to_list()]
    assert epochs == sorted(set(epochs))  # one epoch per firing, growing
    assert all(e > k for e, k in zip(epochs, firings["from_call"].to_list()))  # above every earlier call's
    assert firings["tool_use_id"].to_list() == sorted(firings["tool_use_id"].to_list())
    # once cleared, a result stays cleared in every later request
    last = int(blocks["first_call"].max())
    cleared_last = visible(blocks, last).filter(pl.col("text") == CLEARED)["tool_use_id"].to_list()
    assert sorted(cleared_last) == cleared(dec)


def test_never_clears_inside_the_current_tool_loop_13() -> None:
    # one user row, then only tool loops: everything is the current tool loop
    _, dec = run(session(8, size=2_000, user_every=100), TOKEN)
    assert dec.height == 0
    _, dec = run(session(8, size=300, user_every=100, idle_before=6), IDLE)
    assert dec.height == 0


def test_results_shorter_than_min_result_chars_are_kept() -> None:
    _, dec = run(session(6, idle_before=5, size=50), IDLE)
    assert dec.height == 0


def test_tool_allow_and_deny_globs_case_insensitive_deny_wins() -> None:
    msgs = [{"role": "user", "text": "go", "timestamp": 0}]
    t = 1
    for i, tool in enumerate(["Read", "mcp__github__search", "Bash", "READ", "Grep", "Grep"]):
        msgs.append({"role": "user", "text": f"u{i}", "timestamp": t})
        msgs += loop(i, tool=tool, size=300, t=t + 1)
        t += 10
    msgs.insert(-2, {"role": "user", "text": "later", "timestamp": t + HOUR})
    msgs[-2]["timestamp"] = msgs[-1]["timestamp"] = t + HOUR + 1
    params = {**IDLE, "keep_recent": 0, "tools": {"allow": ["read", "mcp__*"], "deny": ["*github*"]}}
    _, dec = run(msgs, params)
    assert cleared(dec) == ["toolu_0", "toolu_3"]
    assert glob_regex(("a*b",)) == "(?is)^(?:a.*b)$"


def test_clear_keeps_ids_names_positions_and_error_flag_and_drops_images() -> None:
    msgs = session(4, idle_before=3, size=300, error=True, image=True)
    blocks, dec = run(msgs, {**IDLE, "keep_recent": 0})
    is_result = (pl.col("tool_use_id") == "toolu_0") & (pl.col("block_type") == "tool_result")
    after = visible(blocks, 3).filter(is_result)
    assert after.select("part_pos", "text", "tool_name", "is_error", "block_type", "part_type").rows() == [
        (0, CLEARED, "Read", True, "tool_result", "text")]
    before = visible(blocks, 2).filter(is_result)
    assert before.height == 2  # calls before the firing still see text and image
    d = dec.filter(pl.col("tool_use_id") == "toolu_0").sort("part_pos")
    assert d.select("part_pos", "action").rows() == [(0, "tombstone"), (1, "tombstone")]
    assert d["replacement"][1] is None and d["after_sha256"][1] is None


def test_clear_tool_inputs_replaces_the_matching_call_input() -> None:
    blocks, dec = run(session(6, idle_before=5, size=300), {**IDLE, "clear_tool_inputs": True})
    inputs = dec.filter(pl.col("action") == "clear_input")
    assert sorted(inputs["tool_use_id"].to_list()) == ["toolu_0", "toolu_1", "toolu_2"]
    call = visible(blocks, 5).filter(pl.col("tool_use_id") == "toolu_0", pl.col("block_type") == "tool_use")
    assert call.select("tool_input", "tool_name").rows() == [("{}", "Read")]


def test_clear_thinking_keeps_the_recent_turns_and_the_current_loop() -> None:
    msgs = session(6, idle_before=5, size=300, thinking=True)
    _blocks, dec = run(msgs, {**IDLE, "clear_thinking_keep": 2})
    th = dec.filter(pl.col("reason") == "clear_thinking")
    # at call 5 the current turn is 6 (next 5); turns <= 4 lose thinking: loops 0..3
    assert th["action"].unique().to_list() == ["drop"]
    assert sorted(th["entry_id"].to_list()) == ["e0001", "e0004", "e0007", "e0010"]
    assert run(msgs, IDLE)[1].filter(pl.col("reason") == "clear_thinking").height == 0


def test_thinking_only_message_keeps_an_omitted_marker() -> None:
    msgs = session(4, idle_before=3, size=300)
    msgs.insert(2, {"role": "assistant", "blocks": [{"type": "thinking", "text": "hm " * 50, "signature": "s"}],
                    "timestamp": 10, "is_call": False})
    blocks, _dec = run(msgs, {**IDLE, "clear_thinking_keep": 0})
    row = visible(blocks, int(blocks["first_call"].max())).filter(pl.col("entry_id") == "e0002")
    assert row.select("block_type", "text").rows() == [("text", REASONING_OMITTED)]


def test_second_pass_decides_nothing() -> None:
    msgs = session(10, idle_before=6, size=2_000, thinking=True)
    params = {**TOKEN, "trigger_idle_seconds": HOUR, "clear_tool_inputs": True, "clear_thinking_keep": 1}
    res = run_stage("tombstone", make_blocks(msgs), params)
    again = run_stage("tombstone", res.blocks, params)
    assert again.decisions.collect().height == 0


def test_ledger_decisions_are_reapplied_byte_identically() -> None:
    msgs = session(8, size=2_000)
    blocks, dec = run(msgs, TOKEN)
    # with a much higher trigger nothing would fire, but the ledger's decisions are frozen
    blocks2, dec2 = run(msgs, {**TOKEN, "trigger_tokens": 10**9}, ledger=dec.lazy())
    assert blocks2.sort("entry_id", "part_pos", "first_call").select("text", "first_call", "last_call").equals(
        blocks.sort("entry_id", "part_pos", "first_call").select("text", "first_call", "last_call"))
    assert sorted(dec2.select("entry_id", "from_call", "after_sha256").rows()) == \
        sorted(dec.select("entry_id", "from_call", "after_sha256").rows())


def test_ledger_hash_mismatch_writes_a_conflict_and_decides_afresh() -> None:
    msgs = session(8, size=2_000)
    _, dec = run(msgs, TOKEN)
    changed = [dict(m) for m in msgs]
    changed[2] = {**changed[2], "blocks": [{**changed[2]["blocks"][0], "text": "0:" + "y" * 2_000}]}
    _blocks, dec2 = run(changed, TOKEN, ledger=dec.lazy())
    conflicts = dec2.filter(pl.col("action") == "conflict")
    assert conflicts.select("entry_id", "reason").rows() == [("e0002", "hash_mismatch")]
    # decided afresh: the changed result is still cleared, by a new decision
    assert dec2.filter((pl.col("action") == "tombstone") & (pl.col("entry_id") == "e0002")).height == 1


def test_resume_with_ledger_equals_a_fresh_run() -> None:
    msgs = session(12, idle_before=9, size=2_000)
    params = {**TOKEN, "trigger_idle_seconds": HOUR}
    cut = next(i for i in range(15, len(msgs)) if msgs[i]["role"] == "assistant")  # a pending call both have
    _, first = run(msgs[:cut], params)
    blocks, resumed = run(msgs, params, ledger=first.lazy())
    fresh_blocks, fresh = run(msgs, params)
    cols = ["entry_id", "part_pos", "first_call", "last_call", "text", "cache_epoch"]
    assert blocks.sort(cols[:3]).select(cols).equals(fresh_blocks.sort(cols[:3]).select(cols))
    assert sorted(resumed.select("entry_id", "from_call", "cache_epoch").rows()) == \
        sorted(fresh.select("entry_id", "from_call", "cache_epoch").rows())


def test_params_are_validated() -> None:
    st = get_stage("tombstone")
    with pytest.raises(SpecError, match="tools has unknown key"):
        resolve_params(st, {"tools": {"alow": ["*"]}}, where="t")
    with pytest.raises(SpecError, match="clear_thinking_keep"):
        resolve_params(st, {"clear_thinking_keep": "some"}, where="t")
    p = resolve_params(st, {"tools": {"deny": ["Bash"]}, "clear_thinking_keep": 3}, where="t")
    assert p.allow == ("*",) and p.deny == ("Bash",)


def test_tool_globs_use_the_call_name_when_the_result_has_none() -> None:
    # Claude Code results carry only tool_use_id; the name is on the call
    msgs = session(6, idle_before=5, size=300)
    for m in msgs:
        for b in m.get("blocks", []):
            if b["type"] == "tool_result":
                b.pop("tool_name")
    _, dec = run(msgs, {**IDLE, "tools": {"allow": ["read"]}})
    assert cleared(dec) == ["toolu_0", "toolu_1", "toolu_2"]
    _, dec = run(msgs, {**IDLE, "tools": {"deny": ["Read"]}})
    assert dec.height == 0
