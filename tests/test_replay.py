"""Replay: the incremental assembly equals a naive per-call assembly, and is causal."""

from __future__ import annotations

from ctxreplay.pipeline.assembly.replay import CallInfo, replay_thread, thread_key
from ctxreplay.pipeline.targets import get_target
from ctxreplay.testkit import check_replay_against_naive, make_blocks, replay_rows

CONVERSATION = [
    {"role": "system", "text": "be brief"},
    {"role": "user", "text": "hi"},
    {"role": "assistant", "blocks": [{"type": "thinking", "text": "hm", "signature": "s"},
                                     {"type": "tool_use", "tool_use_id": "t1", "tool_name": "Read", "tool_input": {"p": 1}},
                                     {"type": "tool_use", "tool_use_id": "t2", "tool_name": "Read", "tool_input": {"p": 2}}]},
    {"role": "tool", "blocks": [{"type": "tool_result", "tool_use_id": "t1", "text": "one", "part_type": "string"}]},
    {"role": "tool", "blocks": [{"type": "tool_result", "tool_use_id": "t2", "text": "a", "part_type": "text"},
                                {"type": "tool_result", "tool_use_id": "t2", "part_type": "tool_reference",
                                 "tool_name": "Grep", "part_pos": 1}]},
    {"role": "user", "text": "and?"},
    {"role": "assistant", "text": "done"},
    {"role": "user", "text": "more"},
    {"role": "assistant", "text": "ok"},
    {"role": "user", "text": "last"},
]


def test_incremental_equals_naive_on_a_plain_thread() -> None:
    # (the versioned-change property over all four targets lives in test_targets.py)
    b = make_blocks(CONVERSATION).collect()
    for target in ("anthropic", "openai-chat"):
        check_replay_against_naive(b, target)


def test_thread_key_is_file_name_safe() -> None:
    assert thread_key("abc", "main") == "abc"
    assert thread_key("a b/c", "agent-x:1").startswith("a_b_c--agent-x_1~")  # + hash: see test_hostile_inputs


def test_prompt_tokens_track_visible_rows() -> None:
    b = make_blocks(CONVERSATION).collect()
    rows = replay_rows(b)
    res = list(replay_thread(rows, [10] * len(rows), [CallInfo(0), CallInfo(1), CallInfo(2)], get_target("anthropic")))
    # call 0 sees system + "hi": 2 rows; system is in the envelope, one wire message
    assert res[0].prompt_tokens == 20 + 3 * 1 + 3
    assert [r.n_messages for r in res] == [1, 3, 5, 7]
    assert res[-1].is_pending and res[-1].request is not None


