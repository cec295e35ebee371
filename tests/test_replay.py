"""Replay: the incremental assembly equals a naive per-call assembly, and is causal."""

from __future__ import annotations

import hashlib
from pathlib import Path

import polars as pl
from hypothesis import given
from hypothesis import strategies as st

from pipeline.blockops import canonical_json, drop_where, replace_where
from pipeline.replay import ROW_COLUMNS, CallInfo, replay_thread, thread_key
from pipeline.targets import LogicalMessage, get_target
from pipeline.testkit import make_blocks


def _rows(blocks: pl.DataFrame) -> list[dict]:
    return blocks.sort(["order_key", "block_pos", "part_pos", "first_call", "entry_id"]).select(ROW_COLUMNS).to_dicts()


def _naive(rows: list[dict], k: int, target_name: str, model: str | None) -> dict:
    target = get_target(target_name)
    vis = [r for r in rows if r["first_call"] <= k and (r["last_call"] is None or r["last_call"] > k)]
    sysm = [r for r in vis if r["role"] == "system"] if target.splits_system() else []
    vis = [r for r in vis if not (target.splits_system() and r["role"] == "system")]
    logical: list[LogicalMessage] = []
    for r in vis:
        if logical and logical[-1].msg_key == r["msg_key"]:
            logical[-1].rows.append(r)
        else:
            logical.append(LogicalMessage(r["role"], [r], r["msg_key"]))
    system = [LogicalMessage("system", [r], r["msg_key"]) for r in sysm]
    msgs = [m for _, m in target.shape(logical, 0)]
    if not msgs and hasattr(target, "empty_messages"):
        msgs = target.empty_messages()
    return {target.list_key: msgs, **target.envelope(model, system)}


def _check_against_naive(blocks: pl.DataFrame, target: str) -> None:
    rows = _rows(blocks)
    n = blocks.filter(pl.col("is_call"))["msg_key"].n_unique()
    calls = [CallInfo(k, model="m") for k in range(n)]
    results = list(replay_thread(rows, [1] * len(rows), calls, get_target(target), materialize=lambda k, p: True))
    assert [r.call for r in results] == list(range(n + 1))
    prev = None
    for r in results:
        naive = _naive(rows, r.call, target, "m")
        assert r.request == naive
        assert r.request_sha256 == hashlib.sha256(canonical_json(naive)).hexdigest()
        if prev is not None:
            old, new = prev[get_target(target).list_key], naive[get_target(target).list_key]
            first_diff = next((i for i, (a, b) in enumerate(zip(old, new)) if a != b),
                              None if len(new) >= len(old) else len(new))
            if r.prefix_break_message is not None:
                assert first_diff is not None and r.prefix_break_message <= first_diff or first_diff is None
        prev = naive


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
    b = make_blocks(CONVERSATION).collect()
    for target in ("anthropic", "openai-chat"):
        _check_against_naive(b, target)


@given(st.data())
def test_incremental_equals_naive_under_versioned_changes(data: st.DataObject) -> None:
    b = make_blocks(CONVERSATION, compactions=data.draw(st.sampled_from([[], [(5, 3)], [(7, 6)]])))
    for _ in range(data.draw(st.integers(0, 3))):
        entry = data.draw(st.sampled_from([f"e{i:04d}" for i in range(len(CONVERSATION))]))
        k = data.draw(st.integers(0, 4))
        if data.draw(st.booleans()):
            b, _ = replace_where(b, pl.col("entry_id") == entry, {"text": pl.lit(f"changed@{k}")},
                                 action="replace", reason="test", from_call=pl.lit(k))
        else:
            b, _ = drop_where(b, pl.col("entry_id") == entry, reason="test", from_call=pl.lit(k))
    df = b.collect()
    df = df.filter(pl.col("last_call").is_null() | (pl.col("last_call") > pl.col("first_call")))
    _check_against_naive(df, data.draw(st.sampled_from(["anthropic", "openai-chat"])))


def test_thread_key_is_file_name_safe() -> None:
    assert thread_key("abc", "main") == "abc"
    assert thread_key("a b/c", "agent-x:1") == "a_b_c--agent-x_1"


def test_prompt_tokens_track_visible_rows() -> None:
    b = make_blocks(CONVERSATION).collect()
    rows = _rows(b)
    res = list(replay_thread(rows, [10] * len(rows), [CallInfo(0), CallInfo(1), CallInfo(2)], get_target("anthropic")))
    # call 0 sees system + "hi": 2 rows; system is in the envelope, one wire message
    assert res[0].prompt_tokens == 20 + 3 * 1 + 3
    assert [r.n_messages for r in res] == [1, 3, 5, 7]
    assert res[-1].is_pending and res[-1].request is not None


