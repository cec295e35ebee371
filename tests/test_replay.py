"""Replay: the incremental assembly equals a naive per-call assembly, and is causal."""

from __future__ import annotations

import polars as pl
import pytest

from ctxreplay.pipeline.assembly.replay import CallInfo, replay_thread, thread_key
from ctxreplay.pipeline.targets import get_target
from ctxreplay.testkit import check_replay_against_naive, make_blocks, replay_all_calls, replay_rows

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


def _tool_loop(turns: int) -> list[dict]:
    conv: list[dict] = [{"role": "user", "text": "go"}]
    for k in range(turns):
        conv.append({"role": "assistant", "blocks": [{"type": "tool_use", "tool_use_id": f"t{k}", "tool_name": "Read",
                                                      "tool_input": {"k": k}}]})
        conv.append({"role": "tool", "blocks": [{"type": "tool_result", "tool_use_id": f"t{k}", "text": f"r{k}",
                                                 "part_type": "string"}]})
        if k % 5 == 4:
            conv.append({"role": "user", "text": f"next {k}"})  # merges with the result before it on the wire
    conv.append({"role": "assistant", "text": "done"})
    return conv


def test_an_appended_call_reshapes_at_most_one_message_it_had(monkeypatch: pytest.MonkeyPatch) -> None:
    # each call appends the answer and its tool result: the replay re-shapes from the wire message
    # the first new one may merge with, not from the message before that one (it did: 2 to 3 old
    # messages shaped again at every call)
    from ctxreplay.pipeline.targets.anthropic import Anthropic

    shaped = []
    shape = Anthropic.shape
    monkeypatch.setattr(Anthropic, "shape", lambda self, msgs, start: shaped.append(out := shape(self, msgs, start))
                        or out)
    b = make_blocks(_tool_loop(40)).collect()
    res = replay_all_calls(b, "anthropic")
    total, n_calls = sum(len(o) for o in shaped), len(res) - 1
    assert total <= res[-1].n_messages + n_calls, (total, res[-1].n_messages, n_calls)
    check_replay_against_naive(b, "anthropic")


@pytest.mark.parametrize("target", ["anthropic", "openai-chat", "openai-responses", "gemini"])
def test_rows_that_join_an_earlier_message_at_a_later_call(target: str) -> None:
    # a message's last blocks become visible a call after its first ones: the message the replay
    # regroups with the new rows is not the one it was, and its wire message is shaped again; and,
    # in a tool loop, results that become visible a call after the answer that asked for them
    b = make_blocks(CONVERSATION).collect()
    late = (pl.col("entry_id") == "e0002") & (pl.col("tool_use_id") == "t2")
    b = b.with_columns(first_call=pl.when(late).then(pl.col("first_call") + 1).otherwise(pl.col("first_call")))
    b2 = make_blocks(_tool_loop(6)).collect()
    late2 = pl.col("role") == "tool"
    b2 = b2.with_columns(first_call=pl.when(late2).then(pl.col("first_call") + 1).otherwise(pl.col("first_call")))
    for blocks in (b, b2):
        check_replay_against_naive(blocks, target)
