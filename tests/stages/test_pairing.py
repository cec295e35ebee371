"""L4 pairing (layer-semantics §6, §13): frames, per-occurrence matching, moves, synthetic results,
duplicates, orphans, failed frames, tool-call id modes, result names; causality and idempotence
(unit tests, then hypothesis properties)."""

from __future__ import annotations

import os
from typing import Any

import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ctxreplay.errors import SpecError
from ctxreplay.pipeline.stageapi.registry import StageContext, get_stage
from ctxreplay.pipeline.staging.spec import resolve_params
from ctxreplay.stages.pairing import MISSING_TEXT, MISSING_TEXT_OPENAI, map_tool_id
from ctxreplay.testkit import make_blocks, run_stage, visible

try:
    from tests.strategies import examples
except ModuleNotFoundError:  # the repo root is not on sys.path under --import-mode=importlib
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tests.strategies import examples


def pairing_examples(n: int) -> int:
    """PAIRING_EXAMPLES when set, else `n` scaled with the Hypothesis profile."""
    return int(os.environ["PAIRING_EXAMPLES"]) if "PAIRING_EXAMPLES" in os.environ else examples(n)

ANTHROPIC = StageContext(target="anthropic")
OPENAI = StageContext(target="openai-chat")
GEMINI = StageContext(target="gemini")


def call(*ids: str, name: str = "Read", stop: str | None = None, text: str | None = None) -> dict[str, Any]:
    blocks: list[dict[str, Any]] = [{"type": "text", "text": text}] if text else []
    blocks += [{"type": "tool_use", "tool_use_id": i, "tool_name": name, "tool_input": {"i": i}} for i in ids]
    m: dict[str, Any] = {"role": "assistant", "blocks": blocks}
    if stop:
        m["stop_reason"] = stop
    return m


def result(tid: str | None, text: str = "ok", name: str | None = None, **kw: Any) -> dict[str, Any]:
    return {"role": "tool", "blocks": [{"type": "tool_result", "tool_use_id": tid, "tool_name": name, "text": text,
                                        "part_type": "string", **kw}]}


def user(text: str = "go") -> dict[str, Any]:
    return {"role": "user", "text": text}


def run(messages: list[dict[str, Any]], params: dict[str, Any] | None = None, ctx: StageContext = ANTHROPIC,
        **kw: Any) -> tuple[pl.DataFrame, pl.DataFrame]:
    res = run_stage("pairing", make_blocks(messages, **kw), params or {}, ctx=ctx)
    return res.blocks.collect(), res.decisions.collect()


def seq(blocks: pl.DataFrame, k: int) -> list[tuple]:
    """What call k sees, one tuple per block: (role, block_type, tool_use_id, text)."""
    v = visible(blocks, k).filter(pl.col("part_pos") == 0)
    return [(r["role"], r["block_type"], r["tool_use_id"], r["text"]) for r in v.iter_rows(named=True)]


def reasons(decisions: pl.DataFrame) -> list[tuple[str, str]]:
    return sorted(zip(decisions["action"].to_list(), decisions["reason"].to_list()))


# ----------------------------------------------------------------------------- frames and order


def test_paired_frames_are_left_alone() -> None:
    msgs = [user(), call("a", "b"), result("a"), result("b"), {"role": "assistant", "text": "done"}]
    blocks, decisions = run(msgs)
    assert decisions.height == 0
    assert blocks.equals(make_blocks(msgs).collect().select(blocks.columns)) or blocks.height == 6


def test_results_out_of_order_with_a_user_row_between_move_after_the_call_in_call_order() -> None:
    # §13: parallel calls, results out of order with a user row between
    msgs = [user(), call("a", "b"), result("b", "B"), user("between"), result("a", "A"), {"role": "assistant", "text": "x"}]
    blocks, decisions = run(msgs)
    assert seq(blocks, 1) == [
        ("user", "text", None, "go"), ("assistant", "tool_use", "a", None), ("assistant", "tool_use", "b", None),
        ("tool", "tool_result", "a", "A"), ("tool", "tool_result", "b", "B"), ("user", "text", None, "between")]
    assert reasons(decisions) == [("move", "displaced"), ("move", "displaced")]


def test_parallel_results_in_completion_order_are_put_in_call_order() -> None:
    blocks, decisions = run([user(), call("a", "b", "c"), result("c"), result("a"), result("b")])
    assert [t[2] for t in seq(blocks, 1) if t[1] == "tool_result"] == ["a", "b", "c"]
    assert {r for _, r in reasons(decisions)} == {"displaced"}


# ----------------------------------------------------------------------------- missing results


def test_missing_result_gets_a_synthetic_error_result_from_the_next_call() -> None:
    # §13 dangling tool_use after a crash, then resume: the user row follows the synthetic result
    blocks, decisions = run([user(), call("a"), user("resumed"), {"role": "assistant", "text": "hi"}])
    assert seq(blocks, 0) == [("user", "text", None, "go")]
    assert seq(blocks, 1) == [("user", "text", None, "go"), ("assistant", "tool_use", "a", None),
                              ("tool", "tool_result", "a", MISSING_TEXT), ("user", "text", None, "resumed")]
    syn = blocks.filter(pl.col("origin") == "pairing").row(0, named=True)
    assert (syn["is_error"], syn["tool_name"], syn["role"], syn["first_call"], syn["last_call"]) == (
        True, "Read", "tool", 1, None)
    assert reasons(decisions) == [("insert", "missing")]


def test_missing_result_text_per_target_and_override() -> None:
    blocks, _ = run([user(), call("a")], ctx=OPENAI)
    assert blocks.filter(pl.col("origin") == "pairing")["text"].to_list() == [MISSING_TEXT_OPENAI]
    blocks, _ = run([user(), call("a")], {"missing_result_text": "lost"}, ctx=OPENAI)
    assert blocks.filter(pl.col("origin") == "pairing")["text"].to_list() == ["lost"]


def test_synthetic_ids_and_timestamps_are_deterministic() -> None:
    a, _ = run([user(), call("a")])
    b, _ = run([user(), call("a")])
    sa, sb = a.filter(pl.col("origin") == "pairing"), b.filter(pl.col("origin") == "pairing")
    assert sa["entry_id"].to_list() == sb["entry_id"].to_list()
    ts = a.filter(pl.col("block_type") == "tool_use")["timestamp"].to_list()
    assert sa["timestamp"].to_list() == ts  # copies its call's timestamp


def test_a_late_real_result_replaces_the_synthetic_one_from_its_call_on() -> None:
    msgs = [user(), call("a"), user("wait"), {"role": "assistant", "text": "still waiting"}, result("a", "late")]
    blocks, decisions = run(msgs)
    assert ("tool", "tool_result", "a", MISSING_TEXT) in seq(blocks, 1)
    pending = seq(blocks, 2)
    assert pending[2] == ("tool", "tool_result", "a", "late")  # moved right after its call
    assert all(t[3] != MISSING_TEXT for t in pending)
    syn = blocks.filter(pl.col("origin") == "pairing")
    assert syn["last_call"].to_list() == [2]
    assert ("insert", "missing") in reasons(decisions)


def test_prefix_replay_equals_the_same_calls_of_the_full_replay() -> None:
    msgs = [user(), call("a", "b"), result("b"), user("x"), {"role": "assistant", "text": "t"}, result("a"),
            call("c"), result("c")]
    full, _ = run(msgs)
    for j in range(1, len(msgs) + 1):
        part, _ = run(msgs[:j])
        n = sum(1 for m in msgs[:j] if m["role"] == "assistant")
        for k in range(n):
            assert seq(part, k) == seq(full, k), (j, k)


# ----------------------------------------------------------------------------- duplicates, orphans


def test_duplicate_results_first_real_one_wins() -> None:
    blocks, decisions = run([user(), call("a"), result("a", "first"), result("a", "second")])
    assert [t[3] for t in seq(blocks, 1) if t[1] == "tool_result"] == ["first"]
    assert reasons(decisions) == [("drop", "duplicate")]


def test_orphan_result_is_dropped() -> None:
    blocks, decisions = run([user(), call("a"), result("a"), result("zzz", "Tool grep not found", name="grep")])
    assert [t[2] for t in seq(blocks, 1) if t[1] == "tool_result"] == ["a"]
    assert reasons(decisions) == [("drop", "orphan")]


def test_orphan_with_an_unknown_id_is_reattached_to_the_only_unresolved_call_with_its_name() -> None:
    blocks, decisions = run([user(), call("a", name="edit"), result("other", "done", name="edit")])
    assert seq(blocks, 1)[2] == ("tool", "tool_result", "a", "done")
    assert reasons(decisions) == [("replace", "reattached")]


def test_synthetic_repair_named_unknown_is_an_orphan_not_an_owner() -> None:
    # OpenClaw's `call_auto_1` repair result (toolName "unknown") next to the real result
    msgs = [user(), call("function.edit:4", name="edit"), result("call_auto_1", "Tool  not found", name="unknown",
                                                                    is_error=True),
            result("function.edit:4", "Successfully replaced", name="edit")]
    blocks, decisions = run(msgs, ctx=OPENAI)
    assert [t[3] for t in seq(blocks, 1) if t[1] == "tool_result"] == ["Successfully replaced"]
    assert ("drop", "orphan") in reasons(decisions)


def test_result_without_id_next_to_a_single_call_is_attached_as_an_error() -> None:
    # §13
    blocks, decisions = run([user(), call("a", name="Bash"), result(None, "output", name="Bash")])
    r = blocks.filter(pl.col("block_type") == "tool_result").row(0, named=True)
    assert (r["tool_use_id"], r["is_error"]) == ("a", True)
    assert reasons(decisions) == [("replace", "reattached")]


def test_result_without_id_next_to_two_calls_is_dropped() -> None:
    _, decisions = run([user(), call("a", "b"), result(None, "output"), result("a"), result("b")])
    assert ("drop", "orphan") in reasons(decisions)


def test_result_whose_call_was_compacted_away_is_dropped_from_then_on() -> None:
    # calls starting after position 3 see rows from position 3 on: the call at 1 is gone, its
    # result at 3 would be an orphan from call 2 on
    msgs = [user(), call("a"), user("x"), result("a", "late one"), {"role": "assistant", "text": "y"},
            user("z"), {"role": "assistant", "text": "w"}]
    blocks, decisions = run(msgs, compactions=[(4, 3)])
    for k in range(4):
        ids = [t for t in seq(blocks, k) if t[1] == "tool_result"]
        calls = [t for t in seq(blocks, k) if t[1] == "tool_use"]
        assert len(ids) == len(calls), (k, seq(blocks, k))
    assert ("drop", "orphan") in reasons(decisions)


# ----------------------------------------------------------------------------- failed frames


def test_aborted_assistant_with_a_partial_call_is_dropped_without_a_synthetic_result() -> None:
    # §13
    msgs = [user(), call("a", stop="aborted", text="let me"), user("again"), {"role": "assistant", "text": "ok"}]
    blocks, decisions = run(msgs)
    assert seq(blocks, 1) == [("user", "text", None, "go"), ("user", "text", None, "again")]
    assert blocks.filter(pl.col("origin") == "pairing").height == 0
    assert reasons(decisions) == [("drop", "failed_frame"), ("drop", "failed_frame")]


def test_failed_frame_results_go_with_it() -> None:
    msgs = [user(), call("a", stop="error"), result("a", "aborted"), user("again")]
    blocks, decisions = run(msgs)
    assert seq(blocks, 1) == [("user", "text", None, "go"), ("user", "text", None, "again")]
    assert reasons(decisions) == [("drop", "failed_frame"), ("drop", "failed_frame")]


def test_failed_frame_policies() -> None:
    msgs = [user(), call("a", stop="aborted"), user("again")]
    blocks, _ = run(msgs, {"failed_frame_policy": "keep_with_synthetic"})
    assert ("tool", "tool_result", "a", MISSING_TEXT) in seq(blocks, 1)
    blocks, decisions = run(msgs, {"failed_frame_policy": "preserve"})
    assert decisions.height == 0 and blocks.filter(pl.col("origin") == "pairing").height == 0


# ----------------------------------------------------------------------------- ids and names


def test_same_tool_id_in_two_turns_makes_two_pairs() -> None:
    # §13, Kimi-style counters: functions.read:0 in two turns
    msgs = [user(), call("functions.read:0"), result("functions.read:0", "one"), user("again"),
            call("functions.read:0"), result("functions.read:0", "two"), {"role": "assistant", "text": "x"}]
    blocks, decisions = run(msgs, ctx=OPENAI)
    s = seq(blocks, 2)
    pairs = [(t[2], t[3]) for t in s if t[1] in ("tool_use", "tool_result")]
    assert pairs[0][0] == pairs[1][0] == "functions.read:0" and pairs[1][1] == "one"
    assert pairs[2][0] == pairs[3][0] != "functions.read:0" and pairs[3][1] == "two"
    assert {r for _, r in reasons(decisions)} == {"tool_id"}
    assert not any(r == "duplicate" for _, r in reasons(decisions))


def test_anthropic_preserve_makes_ids_valid_and_keeps_native_ones() -> None:
    blocks, _ = run([user(), call("toolu_01Ab", "functions.read:1"), result("toolu_01Ab"), result("functions.read:1")])
    ids = blocks.filter(pl.col("block_type") == "tool_use")["tool_use_id"].to_list()
    assert sorted(ids) == ["functions_read_1", "toolu_01Ab"]
    res = blocks.filter(pl.col("block_type") == "tool_result")["tool_use_id"].to_list()
    assert sorted(res) == sorted(ids)


@pytest.mark.parametrize("mode,check", [
    ("strict", lambda i: i.isalnum() and len(i) <= 40),
    ("strict9", lambda i: i.isalnum() and len(i) == 9),
])
def test_strict_id_modes_rewrite_calls_and_results_together(mode: str, check: Any) -> None:
    msgs = [user(), call("call_a|fc_1", "call-a.fc.1", "x"), result("call_a|fc_1"), result("call-a.fc.1"), result("x")]
    blocks, _ = run(msgs, {"tool_id_mode": mode}, ctx=OPENAI)
    calls = blocks.filter(pl.col("block_type") == "tool_use").sort("block_pos")["tool_use_id"].to_list()
    assert all(check(i) for i in calls) and len(set(calls)) == 3  # the collision got a suffix
    assert [t[2] for t in seq(blocks, 1) if t[1] == "tool_result"] == calls


def test_gemini_target_defaults_to_strict_ids_and_native_toolu_stays_for_anthropic_in_strict() -> None:
    blocks, _ = run([user(), call("call_abc-1"), result("call_abc-1")], ctx=GEMINI)
    assert set(blocks.filter(pl.col("tool_use_id").is_not_null())["tool_use_id"]) == {"callabc1"}
    assert map_tool_id("toolu_01X", 0, "strict", "anthropic") == "toolu_01X"
    assert map_tool_id("toolu_01X", 0, "strict", "gemini") == "toolu01X"


def test_id_mapping_is_idempotent() -> None:
    for mode in ("preserve", "strict", "strict9"):
        for target in ("anthropic", "openai-chat"):
            for tid in ("functions.read:0", "call_abc|fc_9", "toolu_01", "a", "....", "x" * 80):
                for occ in (0, 1, 3):
                    once = map_tool_id(tid, occ, mode, target)
                    assert map_tool_id(once, 0, mode, target) == once, (mode, target, tid, occ)


def test_result_name_is_trimmed_and_filled() -> None:
    blocks, decisions = run([user(), call("a", "b", name="Grep"), result("a", name="  Grep "), result("b", name=" ")])
    names = blocks.filter(pl.col("block_type") == "tool_result").sort("tool_use_id")["tool_name"].to_list()
    assert names == ["Grep", "Grep"]
    assert reasons(decisions) == [("replace", "result_name"), ("replace", "result_name")]


def test_params_are_validated() -> None:
    st_ = get_stage("pairing")
    with pytest.raises(SpecError, match="failed_frame_policy must be one of"):
        resolve_params(st_, {"failed_frame_policy": "keep"}, where="t")
    with pytest.raises(SpecError, match="tool_id_mode must be one of"):
        resolve_params(st_, {"tool_id_mode": "strict10"}, where="t")


# ----------------------------------------------------------------------------- properties

IDS = ["a", "b", "c", "functions.read:0", "call_1"]


@st.composite
def transcripts(draw: st.DrawFn) -> list[dict[str, Any]]:
    """Turns of calls and results with every defect pairing repairs: missing, late, duplicated,
    reordered, orphan and id-less results, reused ids, user rows inside frames, failed frames."""
    msgs: list[dict[str, Any]] = [user("start")]
    late: list[dict[str, Any]] = []
    for _ in range(draw(st.integers(1, 5))):
        ids = draw(st.lists(st.sampled_from(IDS), min_size=1, max_size=3, unique=True))
        stop = draw(st.sampled_from([None, None, None, "aborted", "error"]))
        msgs.append(call(*ids, name=draw(st.sampled_from(["Read", "Bash"])), stop=stop))
        results = [result(i, f"r-{i}-{len(msgs)}") for i in ids]
        results = draw(st.permutations(results))
        kept: list[dict[str, Any]] = []
        for r in results:
            fate = draw(st.sampled_from(["ok", "ok", "ok", "missing", "late", "dup"]))
            if fate == "ok":
                kept.append(r)
            elif fate == "late":
                late.append(r)
            elif fate == "dup":
                kept += [r, r]
        if draw(st.booleans()):
            kept.insert(draw(st.integers(0, len(kept))), user("between"))
        if draw(st.integers(0, 5)) == 0:
            kept.append(result("orphan-" + str(len(msgs)), "Tool grep not found", name="grep"))
        if draw(st.integers(0, 6)) == 0:
            kept.append(result(None, "no id"))
        msgs += kept
        if late and draw(st.booleans()):
            msgs.append(late.pop(0))
        if draw(st.booleans()):
            msgs.append(user("next"))
    return msgs


def check_paired(blocks: pl.DataFrame, n_calls: int) -> None:
    """At every call: each tool call is followed by exactly one result per call, in call order,
    before any other row; no result without its call."""
    for k in range(n_calls + 1):
        v = visible(blocks, k).filter(pl.col("part_pos") == 0)
        rows = v.to_dicts()
        i = 0
        while i < len(rows):
            r = rows[i]
            if r["block_type"] == "tool_result":
                raise AssertionError(f"call {k}: result {r['tool_use_id']} without its call right before it")
            if r["role"] == "assistant":
                j = i
                calls = []
                while j < len(rows) and rows[j]["entry_id"] == r["entry_id"]:
                    if rows[j]["block_type"] == "tool_use":
                        calls.append(rows[j]["tool_use_id"])
                    j += 1
                got = []
                while j < len(rows) and rows[j]["block_type"] == "tool_result" and len(got) < len(calls):
                    got.append(rows[j]["tool_use_id"])
                    j += 1
                assert got == calls, f"call {k}: calls {calls} answered by {got}"
                i = j
                continue
            i += 1


@settings(max_examples=pairing_examples(40))
@given(transcripts())
def test_property_every_call_answered_once_right_after_it(msgs: list[dict[str, Any]]) -> None:
    res = run_stage("pairing", make_blocks(msgs), {}, ctx=OPENAI)
    blocks = res.blocks.collect()
    n = sum(1 for m in msgs if m["role"] == "assistant")
    check_paired(blocks, n)
    ids = blocks.filter(pl.col("block_type") == "tool_use")["tool_use_id"].to_list()
    assert len(ids) == len(set(ids)), "call ids are unique after pairing"


@settings(max_examples=pairing_examples(25))
@given(transcripts(), st.sampled_from(["anthropic", "openai-chat", "gemini", "mistral"]))
def test_property_idempotent(msgs: list[dict[str, Any]], target: str) -> None:
    ctx = StageContext(target=target)
    first = run_stage("pairing", make_blocks(msgs), {}, ctx=ctx)
    again = run_stage("pairing", first.blocks, {}, ctx=ctx)
    assert again.decisions.collect().height == 0
    cols = ["entry_id", "block_pos", "part_pos", "first_call"]
    assert again.blocks.collect().sort(cols).equals(first.blocks.collect().sort(cols))


@settings(max_examples=pairing_examples(20))
@given(transcripts(), st.data())
def test_property_causal_prefix(msgs: list[dict[str, Any]], data: st.DataObject) -> None:
    j = data.draw(st.integers(2, len(msgs)))  # msgs[1] is a call: every prefix has one to compare
    full, _ = run(msgs, ctx=OPENAI)
    part, _ = run(msgs[:j], ctx=OPENAI)
    n = sum(1 for m in msgs[:j] if m["role"] == "assistant")
    assert n >= 1
    for k in range(n):
        assert seq(part, k) == seq(full, k), k


@settings(max_examples=pairing_examples(25))
@given(transcripts())
def test_property_one_decision_per_changed_block(msgs: list[dict[str, Any]]) -> None:
    res = run_stage("pairing", make_blocks(msgs), {}, ctx=ANTHROPIC)
    d = res.decisions.collect()
    assert d.group_by("entry_id", "block_pos", "part_pos", "from_call").len()["len"].max() in (None, 1)
    before = make_blocks(msgs).collect()
    changed = d.filter(pl.col("action").is_in(["replace", "move"]))
    shas = dict(zip(before["entry_id"] + "#" + before["block_pos"].cast(str) + "#" + before["part_pos"].cast(str),
                    before["content_sha256"]))
    for r in changed.iter_rows(named=True):
        assert shas[f"{r['entry_id']}#{r['block_pos']}#{r['part_pos']}"] == r["before_sha256"]


def test_an_open_synthetic_result_is_closed_when_its_real_result_is_visible() -> None:
    # what the second pairing pass does when the synthetic row it finds outlives the real result
    msgs = [user(), call("a"), user("waiting"), {"role": "assistant", "text": "still"}, result("a", "late")]
    first = run_stage("pairing", make_blocks(msgs), {}, ctx=ANTHROPIC).blocks
    reopened = first.with_columns(
        last_call=pl.when(pl.col("origin") == "pairing").then(pl.lit(None, pl.Int32)).otherwise(pl.col("last_call")))
    again = run_stage("pairing", reopened, {}, ctx=ANTHROPIC)
    d = again.decisions.collect()
    assert reasons(d) == [("drop", "superseded")] and d["from_call"].to_list() == [2]
    cols = ["entry_id", "block_pos", "part_pos", "first_call"]
    assert again.blocks.collect().sort(cols).equals(first.collect().sort(cols))


# ----------------------------------------------------------------------------- a result only answers its own call
# (issue 8, defect 2: sanitize drops one of several calls of a message; its result must not be
# re-labelled to another call of the message that has a result of its own)


def run_chain(messages: list[dict[str, Any]], ctx: StageContext = ANTHROPIC) -> tuple[pl.DataFrame, pl.DataFrame]:
    """sanitize, then pairing (the default order): what pairing sees has the invalid calls dropped."""
    s = run_stage("sanitize", make_blocks(messages), {}, ctx=ctx)
    res = run_stage("pairing", s.blocks, {}, ctx=ctx)
    return res.blocks.collect(), res.decisions.collect()


def test_result_of_a_call_sanitize_dropped_is_an_orphan_not_another_calls_result() -> None:
    no_input = {"type": "tool_use", "tool_use_id": "A", "tool_name": "Read"}
    ok = {"type": "tool_use", "tool_use_id": "B", "tool_name": "Read", "tool_input": {"p": 1}}
    msgs = [user(), {"role": "assistant", "blocks": [no_input, ok]}, result("A", "error for A", name="Read"),
            result("B", "content of B", name="Read"), {"role": "assistant", "text": "done"}]
    blocks, decisions = run_chain(msgs)
    assert [t for t in seq(blocks, 1) if t[1] in ("tool_use", "tool_result")] == [
        ("assistant", "tool_use", "B", None), ("tool", "tool_result", "B", "content of B")]
    assert decisions.height == 0  # sanitize dropped A's result with A (reason call_dropped)
    dropped = run_stage("sanitize", make_blocks(msgs), {}, ctx=ANTHROPIC).decisions.collect()
    assert sorted(zip(dropped["entry_id"], dropped["reason"])) == [("e0001", "invalid_tool_call"),
                                                                   ("e0002", "call_dropped")]
    # pairing alone, given A's result without A (as it was before sanitize dropped results too):
    # an orphan, dropped; B keeps its own result
    blocks, decisions = run([user(), call("B", name="Read"), result("A", "error for A", name="Read"),
                             result("B", "content of B", name="Read"), {"role": "assistant", "text": "done"}])
    assert [t[3] for t in seq(blocks, 1) if t[1] == "tool_result"] == ["content of B"]
    assert reasons(decisions) == [("drop", "orphan")]
    assert decisions["entry_id"].to_list() == ["e0002"]  # A's result, never B's


def test_a_reattached_result_stands_in_only_until_the_calls_own_result_arrives() -> None:
    for orphan_id in ("other", None):
        msgs = [user(), call("B", name="Read"), result(orphan_id, "stand-in", name="Read"),
                {"role": "assistant", "text": "waiting"}, result("B", "real B", name="Read"),
                {"role": "assistant", "text": "done"}]
        blocks, decisions = run(msgs)
        assert [t[3] for t in seq(blocks, 1) if t[1] == "tool_result"] == ["stand-in"]
        for k in (2, 3):
            assert [t[3] for t in seq(blocks, k) if t[1] == "tool_result"] == ["real B"], k
        assert ("drop", "superseded") in reasons(decisions) and ("drop", "duplicate") not in reasons(decisions)
        again = run_stage("pairing", blocks.lazy(), {}, ctx=ANTHROPIC)
        assert again.decisions.collect().height == 0


def test_an_orphan_seen_with_the_calls_own_result_is_dropped() -> None:
    # the orphan comes first, but the call's own result is visible at the same call
    blocks, decisions = run([user(), call("B", name="Read"), result("zzz", "not B's", name="Read"),
                             result("B", "B's", name="Read")])
    assert [t[3] for t in seq(blocks, 1) if t[1] == "tool_result"] == ["B's"]
    assert reasons(decisions) == [("drop", "orphan")]


@st.composite
def tempting_transcripts(draw: st.DrawFn) -> list[dict[str, Any]]:
    """Frames whose calls all share one name, with calls that sanitize drops (no input), orphans
    and id-less results of that name, results that come late (after another assistant message),
    duplicates and reused ids: every chance to answer a call with another call's result."""
    msgs: list[dict[str, Any]] = [user("start")]
    late: list[dict[str, Any]] = []
    n = 0
    for _ in range(draw(st.integers(1, 4))):
        ids = draw(st.lists(st.sampled_from(["a", "b", "c", "d"]), min_size=1, max_size=3, unique=True))
        blocks = []
        for i in ids:
            b: dict[str, Any] = {"type": "tool_use", "tool_use_id": i, "tool_name": "Read"}
            if draw(st.integers(0, 3)):
                b["tool_input"] = {"i": i}
            blocks.append(b)
        msgs.append({"role": "assistant", "blocks": blocks})
        kept: list[dict[str, Any]] = []
        for i in draw(st.permutations(ids)):
            n += 1
            r = result(i, f"result {n} for {i}", name="Read")
            fate = draw(st.sampled_from(["ok", "ok", "late", "missing", "dup"]))
            if fate == "ok":
                kept.append(r)
            elif fate == "late":
                late.append(r)
            elif fate == "dup":
                kept += [r, result(i, f"duplicate {n} for {i}", name="Read")]
        for _ in range(draw(st.integers(0, 2))):
            n += 1
            kept.insert(draw(st.integers(0, len(kept))),
                        result(draw(st.sampled_from([None, "zzz", "call_9"])), f"orphan {n}", name="Read"))
        msgs += kept
        if late and draw(st.booleans()):
            msgs.append({"role": "assistant", "text": "meanwhile"})
            msgs.append(late.pop(0))
        if draw(st.booleans()):
            msgs.append(user("next"))
    return msgs


def shown_results(blocks: pl.DataFrame, k: int) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(call row, result row shown right after it) for every tool call visible at call k."""
    rows = visible(blocks, k).join(blocks.select("entry_id", "block_pos", "part_pos", "first_call", "origin"),
                                   on=["entry_id", "block_pos", "part_pos", "first_call"], how="left",
                                   suffix="_b").filter(pl.col("part_pos") == 0).to_dicts()
    out = []
    i = 0
    while i < len(rows):
        if rows[i]["role"] != "assistant":
            i += 1
            continue
        j = i
        calls = []
        while j < len(rows) and rows[j]["entry_id"] == rows[i]["entry_id"]:
            if rows[j]["block_type"] == "tool_use":
                calls.append(rows[j])
            j += 1
        out += list(zip(calls, rows[j:j + len(calls)], strict=True))
        i = j + len(calls)
    return out


def check_own_results(before: pl.DataFrame, after: pl.DataFrame) -> None:
    """At every call, the result shown after each kept call is the first result recorded with that
    call's own id (per occurrence) when one is visible at that call; otherwise a synthetic one or a
    re-attached orphan, never the result of another call."""
    shift = 1 << 20
    b = before.filter(pl.col("part_pos") == 0).with_columns(_pos=pl.col("order_key") * shift + pl.col("block_pos"))
    calls = b.filter(pl.col("block_type") == "tool_use").sort("_pos").to_dicts()
    results = b.filter(pl.col("block_type") == "tool_result").sort("_pos").to_dicts()
    call_id = {(c["entry_id"], c["block_pos"]): c["tool_use_id"] for c in calls}
    own: dict[tuple[str, int], list[dict[str, Any]]] = {}
    owned: set[str] = set()
    for r in results:
        owner = [c for c in calls if c["tool_use_id"] == r["tool_use_id"] and c["_pos"] < r["_pos"]]
        if r["tool_use_id"] is not None and owner:
            own.setdefault((owner[-1]["entry_id"], owner[-1]["block_pos"]), []).append(r)
            owned.add(r["entry_id"])
    n = int(after["first_call"].max())
    for k in range(n + 1):
        for c, shown in shown_results(after, k):
            assert shown["block_type"] == "tool_result", (k, c, shown)
            key = (c["entry_id"], c["block_pos"])
            mine = [r for r in own.get(key, []) if r["first_call"] <= k and (r["last_call"] is None or r["last_call"] > k)]
            if mine:
                assert (shown["entry_id"], shown["text"]) == (mine[0]["entry_id"], mine[0]["text"]), \
                    f"call {k}: {call_id[key]} shows {shown['text']!r}, recorded {mine[0]['text']!r}"
            else:
                assert shown["origin"] == "pairing" or shown["entry_id"] not in owned, \
                    f"call {k}: {call_id[key]} shows another call's result {shown['text']!r}"


@settings(max_examples=pairing_examples(60))
@given(tempting_transcripts(), st.sampled_from(["anthropic", "openai-chat", "gemini"]))
def test_property_every_kept_call_shows_its_own_recorded_result(msgs: list[dict[str, Any]], target: str) -> None:
    ctx = StageContext(target=target)
    before = run_stage("sanitize", make_blocks(msgs), {}, ctx=ctx).blocks.collect()
    after = run_stage("pairing", before.lazy(), {}, ctx=ctx).blocks.collect()
    check_own_results(before, after)
    n = int(after["first_call"].max())
    check_paired(after, n)
