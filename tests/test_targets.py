"""Targets: the incremental replay equals a naive per-call shaping for every target, under
versioned changes; provider shaping rules of layer-semantics §10 (merging, bootstrap, empty and
trailing messages, wire labels); every target shapes a paired conversation its validator accepts."""

from __future__ import annotations

import polars as pl
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ctxreplay.pipeline.targets import get_target, target_names
from ctxreplay.pipeline.targets.wire import label, split
from ctxreplay.testkit import (
    check_replay_against_naive,
    drop_from,
    make_blocks,
    replace_from,
    replay_all_calls,
)

TARGETS = ["anthropic", "openai-chat", "openai-responses", "gemini"]


def _replay(blocks: pl.DataFrame, target: str) -> list:
    return replay_all_calls(blocks, target)


def _check_against_naive(blocks: pl.DataFrame, target: str) -> None:
    check_replay_against_naive(blocks, target)


CONVERSATION = [
    {"role": "system", "text": "be brief"},
    {"role": "user", "text": "hi"},
    {"role": "assistant", "blocks": [{"type": "thinking", "text": "hm", "signature": "s"},
                                     {"type": "text", "text": "reading"},
                                     {"type": "tool_use", "tool_use_id": "t1", "tool_name": "Read", "tool_input": {"p": 1}},
                                     {"type": "tool_use", "tool_use_id": "t2", "tool_name": "Read", "tool_input": {"p": 2}}]},
    {"role": "tool", "blocks": [{"type": "tool_result", "tool_use_id": "t1", "text": "one", "part_type": "string"}]},
    {"role": "tool", "blocks": [{"type": "tool_result", "tool_use_id": "t2", "text": "a", "part_type": "text"},
                                {"type": "text", "text": "note inside a result message"}]},
    {"role": "user", "text": "and?"},
    {"role": "assistant", "text": "done"},
    {"role": "user", "text": "more"},
    {"role": "assistant", "blocks": [{"type": "tool_use", "tool_use_id": "t3", "tool_name": "Ls", "tool_input": {}}]},
    {"role": "tool", "blocks": [{"type": "tool_result", "tool_use_id": "t3", "text": "x", "part_type": "string"}]},
    {"role": "assistant", "text": "ok"},
    {"role": "user", "text": "last"},
]

# a thread that starts with a model turn (Gemini needs the bootstrap turn) and has an empty turn
LEADING_ASSISTANT = [
    {"role": "assistant", "text": "hello, I am here"},
    {"role": "user", "text": "hi"},
    {"role": "assistant", "blocks": []},  # an aborted turn with no content
    {"role": "user", "text": "again"},
    {"role": "assistant", "blocks": [{"type": "tool_use", "tool_use_id": "c1", "tool_name": "Read", "tool_input": {}}]},
    {"role": "tool", "blocks": [{"type": "tool_result", "tool_use_id": "c1", "text": "r", "part_type": "string"}]},
    {"role": "assistant", "text": "fine"},
    {"role": "user", "text": "bye"},
]


def test_all_targets_are_registered() -> None:
    assert set(TARGETS) <= set(target_names())


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("conv", [CONVERSATION, LEADING_ASSISTANT], ids=["plain", "leading_assistant"])
def test_incremental_equals_naive(target: str, conv: list) -> None:
    _check_against_naive(make_blocks(conv).collect(), target)


@given(st.data())
def test_incremental_equals_naive_under_versioned_changes(data: st.DataObject) -> None:
    conv = data.draw(st.sampled_from([CONVERSATION, LEADING_ASSISTANT]))
    comp = data.draw(st.sampled_from([[], [(3, 2)], [(6, 5)]]))
    b = make_blocks(conv, compactions=comp)
    for _ in range(data.draw(st.integers(0, 3))):
        entry = data.draw(st.sampled_from([f"e{i:04d}" for i in range(len(conv))]))
        k = data.draw(st.integers(0, 4))
        if data.draw(st.booleans()):
            b = replace_from(b, pl.col("entry_id") == entry, {"text": pl.lit(f"changed@{k}")}, k)
        else:
            b = drop_from(b, pl.col("entry_id") == entry, k)
    df = b.collect()
    df = df.filter(pl.col("last_call").is_null() | (pl.col("last_call") > pl.col("first_call")))
    _check_against_naive(df, data.draw(st.sampled_from(TARGETS)))


@pytest.mark.parametrize("target", TARGETS)
def test_paired_conversation_passes_the_validator(target: str) -> None:
    for r in _replay(make_blocks(CONVERSATION).collect(), target):
        assert get_target(target).validate(r.request, thread_key="t", call=r.call) == [], f"call {r.call}"


def test_wire_labels_round_trip() -> None:
    assert label(7, 0) == 7
    assert split(label(7, 0)) == (7, 0)
    assert split(label(7, 3)) == (7, 3)
    assert split(label(1_000_000, 1023)) == (1_000_000, 1023)
    assert label(7, 1) < 8


def test_anthropic_merges_results_first_and_drops_empty_and_trailing_assistant() -> None:
    req = _replay(make_blocks(CONVERSATION).collect(), "anthropic")[1].request
    msgs = req["messages"]
    assert [m["role"] for m in msgs] == ["user", "assistant", "user"]
    assert [b["type"] for b in msgs[2]["content"]] == ["tool_result", "tool_result", "text", "text"]
    reqs = _replay(make_blocks(LEADING_ASSISTANT).collect(), "anthropic")
    # call 2 sees hello, hi, the empty turn, again: the empty turn is left out, hi and again merge
    assert reqs[2].request["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "(session bootstrap)"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "hello, I am here"}]},
        {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "again"}]},
    ]
    # a request never ends with an assistant message (allow_prefill is off)
    assert [r.request["messages"][-1]["role"] for r in reqs[1:]] == ["user"] * (len(reqs) - 1)


def test_anthropic_wraps_non_object_tool_input() -> None:
    conv = [{"role": "user", "text": "patch"},
            {"role": "assistant", "blocks": [{"type": "tool_use", "tool_use_id": "p1", "tool_name": "apply_patch",
                                              "tool_input": "*** Begin Patch"}]},
            {"role": "tool", "blocks": [{"type": "tool_result", "tool_use_id": "p1", "text": "ok", "part_type": "string"}]}]
    req = _replay(make_blocks(conv).collect(), "anthropic")[-1].request
    assert req["messages"][1]["content"][0]["input"] == {"input": "*** Begin Patch"}


def test_openai_chat_tool_messages_stay_next_to_their_call() -> None:
    req = _replay(make_blocks(CONVERSATION).collect(), "openai-chat")[1].request
    assert [m["role"] for m in req["messages"]] == ["system", "user", "assistant", "tool", "tool", "user", "user"]
    assert req["messages"][5]["content"] == [{"type": "text", "text": "note inside a result message"}]


def test_openai_responses_items() -> None:
    req = _replay(make_blocks(CONVERSATION).collect(), "openai-responses")[1].request
    assert req["instructions"] == "be brief"
    types = [(i["type"], i.get("role")) for i in req["input"]]
    assert types == [("message", "user"), ("message", "assistant"), ("function_call", None), ("function_call", None),
                     ("function_call_output", None), ("function_call_output", None), ("message", "user"),
                     ("message", "user")]


def test_gemini_bootstrap_merge_and_names() -> None:
    reqs = _replay(make_blocks(LEADING_ASSISTANT).collect(), "gemini")
    contents = reqs[-1].request["contents"]
    assert contents[0] == {"role": "user", "parts": [{"text": "(session bootstrap)"}]}
    assert [c["role"] for c in contents] == ["user", "model", "user", "model", "user", "model", "user"]
    # "hi" and "again" merge around the empty model turn
    assert contents[2]["parts"] == [{"text": "hi"}, {"text": "again"}]
    assert contents[4]["parts"][0]["functionResponse"]["name"] == "Read"  # from the call
    for r in reqs[1:]:
        assert get_target("gemini").validate(r.request, thread_key="t", call=r.call) == []


def test_gemini_bootstrap_after_compaction_is_not_doubled() -> None:
    # from call 2 on only the rows from position 4 on are visible: the thread then starts with a
    # model turn, and the replay re-shapes from the start
    b = make_blocks(LEADING_ASSISTANT, compactions=[(3, 4)]).collect()
    b = b.filter(pl.col("last_call").is_null() | (pl.col("last_call") > pl.col("first_call")))
    _check_against_naive(b, "gemini")
    for r in _replay(b, "gemini"):
        contents = r.request["contents"]
        assert sum(c["parts"] == [{"text": "(session bootstrap)"}] for c in contents) <= 1
