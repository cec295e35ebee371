"""L1 sanitize (docs/layers.md): one test per sub-step, the §13 magic-string case, usage."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import polars as pl
import pytest

from ctxreplay.errors import SpecError
from ctxreplay.pipeline.stageapi.registry import StageContext, get_stage
from ctxreplay.pipeline.staging.spec import resolve_params
from ctxreplay.stages.sanitize import (
    FAILED_TURN_TEXT,
    REASONING_OMITTED_TEXT,
    REDACTED,
    normalized_usage,
)
from ctxreplay.testkit import make_blocks, run_stage, view, visible

ANTHROPIC = {"provider": "anthropic", "api": "anthropic-messages"}
OPENROUTER = {"provider": "openrouter", "api": "openai-completions"}
MAGIC = "ANTHROPIC_MAGIC_STRING_TRIGGER_REFUSAL_" + "0123456789abcdef" * 4
MAGIC_SHORT = "ANTHROPIC_MAGIC_STRING_TRIGGER_REDACTED_THINKING"


def _run(messages: list[dict[str, Any]], params: dict[str, Any] | None = None, ctx: StageContext | None = None):
    res = run_stage("sanitize", make_blocks(messages), params or {}, ctx=ctx)
    return res.blocks.collect(), res.decisions.collect()


def _texts(blocks: pl.DataFrame, call: int | None = None) -> list[tuple[str, str, str | None]]:
    df = view(blocks) if call is None else visible(blocks, call)
    return [(r["entry_id"], r["block_type"], r["text"]) for r in df.iter_rows(named=True)]


def _reasons(decisions: pl.DataFrame) -> list[tuple[str, int, str, str]]:
    return sorted((r["entry_id"], r["block_pos"], r["action"], r["reason"]) for r in decisions.iter_rows(named=True))


def test_clean_session_is_left_alone() -> None:
    msgs = [
        {"role": "user", "text": "hi"},
        {"role": "assistant", **ANTHROPIC, "blocks": [
            {"type": "thinking", "text": "t", "signature": "sig"},
            {"type": "tool_use", "tool_use_id": "toolu_1", "tool_name": "Bash", "tool_input": {"c": "ls"}}]},
        {"role": "tool", "blocks": [{"type": "tool_result", "tool_use_id": "toolu_1", "part_type": "string", "text": "x"}]},
        {"role": "assistant", **ANTHROPIC, "text": "done", "stop_reason": "end_turn"},
    ]
    blocks = make_blocks(msgs)
    res = run_stage("sanitize", blocks, {})
    assert res.decisions.collect().height == 0
    assert view(res.blocks).equals(view(blocks))


# ---------------------------------------------------------------- 1. structural


def test_drops_null_blocks() -> None:
    blocks, dec = _run([{"role": "user", "blocks": [{"type": "null"}, {"type": "text", "text": None},
                                                     {"type": "text", "text": "kept"}]}])
    assert _texts(blocks) == [("e0000", "text", "kept")]
    assert _reasons(dec) == [("e0000", 0, "drop", "null_block"), ("e0000", 1, "drop", "null_block")]


# ---------------------------------------------------------------- 2. blank text


def test_drops_whitespace_only_text_and_a_user_row_left_empty() -> None:
    blocks, dec = _run([
        {"role": "user", "text": " \n\t"},
        {"role": "user", "text": "real"},
        {"role": "assistant", **ANTHROPIC, "blocks": [{"type": "text", "text": "\n\n"},
                                                    {"type": "text", "text": "answer"}]},
    ])
    assert _texts(blocks) == [("e0001", "text", "real"), ("e0002", "text", "answer")]
    assert _reasons(dec) == [("e0000", 0, "drop", "blank_text"), ("e0002", 0, "drop", "blank_text")]


def test_blank_tool_result_text_is_not_touched() -> None:
    msgs = [{"role": "tool", "blocks": [{"type": "tool_result", "tool_use_id": "t", "part_type": "string", "text": " "}]}]
    _, dec = _run(msgs)
    assert dec.height == 0


# ---------------------------------------------------------------- 3. row filter


def test_drops_display_only_assistant_rows_by_default() -> None:
    msgs = [
        {"role": "user", "text": "q"},
        {"role": "assistant", "provider": "openclaw", "model": "delivery-mirror", "text": "copy",
         "is_display_only": True, "is_call": False},
        {"role": "user", "text": "shown", "is_display_only": True},
        {"role": "user", "text": "meta", "is_meta": True},
    ]
    blocks, dec = _run(msgs)
    assert [e for e, _, _ in _texts(blocks)] == ["e0000", "e0002", "e0003"]
    assert _reasons(dec) == [("e0001", 0, "drop", "row_filter")]
    blocks, dec = _run(msgs, {"drop_rows_where": ["display_only", "meta"]})
    assert [e for e, _, _ in _texts(blocks)] == ["e0000"]


def test_row_filter_names_are_checked() -> None:
    with pytest.raises(SpecError, match="drop_rows_where"):
        resolve_params(get_stage("sanitize"), {"drop_rows_where": ["assistants"]}, where="t")


# ---------------------------------------------------------------- 4. failed empty assistant turns


def _failed_session() -> list[dict[str, Any]]:
    return [
        {"role": "user", "text": "q"},                                            # 0
        {"role": "assistant", **OPENROUTER, "blocks": [], "stop_reason": "error"},  # 1: call 0, seen from call 1
        {"role": "assistant", **OPENROUTER, "text": "retry ok", "stop_reason": "stop"},  # 2: call 1, seen from 2
        {"role": "user", "text": "next"},                                          # 3
    ]


def test_failed_empty_turn_reads_the_sentinel_once_a_later_row_is_seen() -> None:
    blocks, dec = _run(_failed_session())
    # call 1 (the retry) sees the failed row as its last row: it is absent there
    assert _texts(blocks, 1) == [("e0000", "text", "q")]
    # from call 2 on a later row follows it: it reads the sentinel
    assert _texts(blocks, 2) == [("e0000", "text", "q"), ("e0001", "text", FAILED_TURN_TEXT),
                                 ("e0002", "text", "retry ok"), ("e0003", "text", "next")]
    assert _reasons(dec) == [("e0001", -1, "insert", "failed_turn"), ("e0001", 0, "drop", "failed_turn")]
    ins = dec.filter(pl.col("action") == "insert").row(0, named=True)
    assert ins["from_call"] == 2 and ins["before_sha256"] is None and ins["after_sha256"]


def test_trailing_failed_turn_is_dropped() -> None:
    blocks, dec = _run(_failed_session()[:2])
    assert _texts(blocks) == [("e0000", "text", "q")]
    assert _reasons(dec) == [("e0001", 0, "drop", "failed_turn")]


def test_stop_with_all_zero_usage_is_a_failed_turn_other_empty_rows_are_unchanged() -> None:
    zero = {"input": 0, "output": 0, "cache_read": 0, "cache_write": 0}
    msgs = [
        {"role": "user", "text": "q"},
        {"role": "assistant", **OPENROUTER, "blocks": [], "stop_reason": "stop", "usage": zero},
        {"role": "assistant", **OPENROUTER, "blocks": [], "stop_reason": "aborted"},
        {"role": "assistant", **OPENROUTER, "blocks": [], "stop_reason": "stop", "usage": {**zero, "output": 3}},
        {"role": "user", "text": "again"},
    ]
    blocks, dec = _run(msgs)
    assert _texts(blocks) == [("e0000", "text", "q"), ("e0001", "text", FAILED_TURN_TEXT),
                              ("e0002", "empty", None), ("e0003", "empty", None), ("e0004", "text", "again")]
    assert {r["entry_id"] for r in dec.iter_rows(named=True)} == {"e0001"}


# ---------------------------------------------------------------- 5. thinking


def _thinking_session() -> list[dict[str, Any]]:
    return [
        {"role": "user", "text": "q1"},                                            # 0
        {"role": "assistant", **ANTHROPIC, "blocks": [                              # 1 call 0 (seen from 1)
            {"type": "thinking", "text": "plan A", "signature": "sigA"},
            {"type": "tool_use", "tool_use_id": "toolu_1", "tool_name": "Bash", "tool_input": {}}]},
        {"role": "tool", "blocks": [{"type": "tool_result", "tool_use_id": "toolu_1", "text": "ok"}]},  # 2
        {"role": "assistant", **ANTHROPIC, "blocks": [                              # 3 call 1 (seen from 2)
            {"type": "thinking", "text": "plan B", "signature": "sigB"},
            {"type": "text", "text": "answer"}]},
        {"role": "user", "text": "q2"},                                            # 4
        {"role": "assistant", **ANTHROPIC, "text": "fine"},                        # 5 call 2 (seen from 3)
    ]


def test_keep_signed_keeps_signed_thinking_byte_identical_and_drops_unsigned() -> None:
    msgs = [
        {"role": "user", "text": "q"},
        {"role": "assistant", **ANTHROPIC, "blocks": [
            {"type": "thinking", "text": "signed " + MAGIC, "signature": "EqQBCkYIBxgC"},
            {"type": "thinking", "text": "no signature"},
            {"type": "thinking", "text": "blank signature", "signature": "  "},
            {"type": "redacted_thinking", "text": "ZGF0YQ=="},
            {"type": "text", "text": "a"}]},
    ]
    before = make_blocks(msgs).collect()
    blocks, dec = _run(msgs)
    kept = blocks.filter(pl.col("block_type").is_in(["thinking", "redacted_thinking"]))
    assert kept.select("text", "signature", "content_sha256").rows() == before.filter(
        (pl.col("entry_id") == "e0001") & pl.col("block_pos").is_in([0, 3])
    ).select("text", "signature", "content_sha256").rows()
    assert _reasons(dec) == [("e0001", 1, "drop", "thinking_unsigned"), ("e0001", 2, "drop", "thinking_unsigned")]


def test_drop_all_drops_native_thinking() -> None:
    blocks, dec = _run(_thinking_session(), {"thinking_policy": "drop_all"})
    assert blocks.filter(pl.col("block_type") == "thinking").height == 0
    assert {r["reason"] for r in dec.iter_rows(named=True)} == {"thinking_policy:drop_all"}


def test_drop_all_but_latest_drops_from_the_call_that_sees_a_newer_assistant_row() -> None:
    blocks, dec = _run(_thinking_session(), {"thinking_policy": "drop_all_but_latest"})
    think = lambda call: [t for _, bt, t in _texts(blocks, call) if bt == "thinking"]
    assert think(1) == ["plan A"]  # row 1 is the latest assistant row of call 1's request
    assert think(2) == ["plan B"]  # row 3 is seen from call 2: plan A is dropped from there
    assert think(3) == []          # row 5 is seen by the pending call 3: plan B is dropped there
    assert sorted((r["entry_id"], r["from_call"]) for r in dec.iter_rows(named=True)) == [("e0001", 2), ("e0003", 3)]


def test_drop_all_but_current_tool_turn_drops_from_the_next_real_user_row() -> None:
    blocks, dec = _run(_thinking_session(), {"thinking_policy": "drop_all_but_current_tool_turn"})
    think = lambda call: [t for _, bt, t in _texts(blocks, call) if bt == "thinking"]
    assert think(1) == ["plan A"]  # call 1 is inside q1's tool loop
    assert think(2) == []          # call 2's request ends with q2: a new turn, no thinking kept
    assert sorted((r["entry_id"], r["from_call"]) for r in dec.iter_rows(named=True)) == [("e0001", 2), ("e0003", 2)]


def test_foreign_thinking_is_dropped_or_kept_as_text() -> None:
    msgs = [
        {"role": "user", "text": "q"},
        {"role": "assistant", **OPENROUTER, "blocks": [
            {"type": "thinking", "text": "their reasoning", "signature": "reasoning_content"},
            {"type": "text", "text": "a"}]},
    ]
    blocks, dec = _run(msgs)
    assert _texts(blocks) == [("e0000", "text", "q"), ("e0001", "text", "a")]
    assert _reasons(dec) == [("e0001", 0, "drop", "foreign_thinking")]
    blocks, dec = _run(msgs, {"foreign_thinking": "to_text"})
    assert _texts(blocks) == [("e0000", "text", "q"), ("e0001", "text", "their reasoning"), ("e0001", "text", "a")]
    assert blocks.filter(pl.col("block_pos") == 0)["signature"].to_list() == [None, None]
    assert _reasons(dec) == [("e0001", 0, "replace", "foreign_thinking")]


def test_native_thinking_depends_on_the_target() -> None:
    msgs = [{"role": "user", "text": "q"},
            {"role": "assistant", **ANTHROPIC, "blocks": [{"type": "thinking", "text": "t", "signature": "s"},
                                                        {"type": "text", "text": "a"}]}]
    _, dec = _run(msgs, ctx=StageContext(target="openai_chat"))
    assert _reasons(dec) == [("e0001", 0, "drop", "foreign_thinking")]


def test_row_left_empty_by_the_thinking_policy_reads_reasoning_omitted() -> None:
    msgs = [
        {"role": "user", "text": "q"},
        {"role": "assistant", **OPENROUTER, "blocks": [{"type": "thinking", "text": "only", "signature": "x"}]},
        {"role": "user", "text": "next"},
    ]
    blocks, dec = _run(msgs)
    assert _texts(blocks) == [("e0000", "text", "q"), ("e0001", "text", REASONING_OMITTED_TEXT), ("e0002", "text", "next")]
    assert _reasons(dec) == [("e0001", -1, "insert", "reasoning_omitted"), ("e0001", 0, "drop", "foreign_thinking")]


def test_reasoning_omitted_starts_where_the_row_becomes_empty() -> None:
    msgs = _thinking_session()
    msgs[3] = {"role": "assistant", **ANTHROPIC, "blocks": [{"type": "thinking", "text": "plan B", "signature": "s"}]}
    blocks, _ = _run(msgs, {"thinking_policy": "drop_all_but_latest"})
    assert [t for e, _, t in _texts(blocks, 2) if e == "e0003"] == ["plan B"]
    assert [t for e, _, t in _texts(blocks, 3) if e == "e0003"] == [REASONING_OMITTED_TEXT]


# ---------------------------------------------------------------- 6. tool calls


def _calls(*calls: dict[str, Any], thinking: bool = False) -> list[dict[str, Any]]:
    blocks = ([{"type": "thinking", "text": "t", "signature": "sig"}] if thinking else []) + [
        {"type": "tool_use", **c} for c in calls]
    return [{"role": "user", "text": "q"}, {"role": "assistant", **ANTHROPIC, "blocks": blocks}]


GOOD = {"tool_use_id": "toolu_1", "tool_name": "Bash", "tool_input": {"c": "ls"}}


@pytest.mark.parametrize("bad", [
    {"tool_use_id": None}, {"tool_use_id": " "}, {"tool_input": None}, {"tool_name": "bad name"},
    {"tool_name": "x" * 65}, {"tool_name": ""}, {"tool_name": None},
])
def test_invalid_tool_calls_are_dropped(bad: dict[str, Any]) -> None:
    call = {**GOOD, "tool_use_id": "toolu_2", **bad}
    blocks, dec = _run(_calls(GOOD, call))
    assert blocks.filter(pl.col("block_type") == "tool_use")["tool_use_id"].to_list() == ["toolu_1"]
    assert _reasons(dec) == [("e0001", 1, "drop", "invalid_tool_call")]


def test_allowed_tools_is_case_insensitive_and_a_row_left_empty_disappears() -> None:
    blocks, _ = _run(_calls(GOOD, {**GOOD, "tool_use_id": "toolu_2", "tool_name": "Write"}), {"allowed_tools": ["bash"]})
    assert blocks.filter(pl.col("block_type") == "tool_use")["tool_name"].to_list() == ["Bash"]
    blocks, _ = _run(_calls({**GOOD, "tool_name": "Write"}), {"allowed_tools": ["bash"]})
    assert _texts(blocks) == [("e0000", "text", "q")]


def test_mark_replaces_an_unknown_tool_call_by_text() -> None:
    blocks, dec = _run(_calls(GOOD, {**GOOD, "tool_use_id": "toolu_2", "tool_name": " bad tool "}),
                       {"unknown_tool_policy": "mark"})
    assert _texts(blocks)[-1] == ("e0001", "text", "[tool call to unavailable tool omitted: bad tool]")
    row = blocks.filter(pl.col("block_pos") == 1).row(0, named=True)
    assert row["tool_use_id"] is None and row["tool_input"] is None
    assert _reasons(dec) == [("e0001", 1, "replace", "unknown_tool")]


def test_a_row_with_signed_thinking_is_dropped_whole_if_a_call_is_invalid() -> None:
    blocks, dec = _run(_calls(GOOD, {**GOOD, "tool_use_id": None}, thinking=True))
    assert _texts(blocks) == [("e0000", "text", "q")]
    assert {r["reason"] for r in dec.iter_rows(named=True)} == {"invalid_tool_call_in_signed_row"}
    blocks, dec = _run(_calls(GOOD, thinking=True))
    assert dec.height == 0


# ---------------------------------------------------------------- 7. non-model result fields


def test_strips_details_from_tool_results() -> None:
    msgs = [{"role": "tool", "blocks": [
        {"type": "tool_result", "tool_use_id": "t", "part_type": "text", "text": "r",
         "extra": {"details": {"status": "ok"}, "cache_control": {"type": "ephemeral"}}},
        {"type": "tool_result", "tool_use_id": "t", "part_type": "other", "part_pos": 1, "text": "{}",
         "extra": {"part": {"type": "x"}}}]}]
    # (openai-chat: a result part of an unknown type is its text there; for Anthropic it would be a
    # foreign part, see the foreign-item tests)
    blocks, dec = _run(msgs, ctx=StageContext(target="openai-chat"))
    assert blocks.sort("part_pos")["extra_json"].to_list() == ['{"cache_control":{"type":"ephemeral"}}',
                                                               '{"part":{"type":"x"}}']
    row = dec.row(0, named=True)
    assert (row["part_pos"], row["reason"]) == (0, "strip_result_fields")
    assert row["before_sha256"] == row["after_sha256"]  # the model-visible content is the same


# ---------------------------------------------------------------- 8. usage


def test_normalized_usage() -> None:
    msgs = [
        {"role": "user", "text": "q"},
        {"role": "assistant", "text": "a", "usage": {"input": 5, "output": None, "cache_read": 100}},
        {"role": "user", "text": "summary", "is_compact_summary": True},
        {"role": "assistant", "text": "b", "usage": {"input": 1, "output": 2, "cache_read": 3, "cache_write": 4}},
    ]
    blocks = make_blocks(msgs)
    out = normalized_usage(blocks).collect().sort("order_key")
    assert out.select("u_input", "u_output", "u_cache_read", "u_cache_write", "u_total", "usage_stale").rows() == [
        (0, 0, 0, 0, 0, False), (5, 0, 100, 0, 105, True), (0, 0, 0, 0, 0, False), (1, 2, 3, 4, 10, False)]
    assert out["usage_output"].to_list() == [None, None, None, 2]  # raw usage untouched


def test_normalized_usage_takes_the_largest_copy_of_a_split_message() -> None:
    msgs = [
        {"role": "assistant", "text": "a", "msg_key": "m1", "entry_id": "x1", "usage": {"input": 3, "output": 1}},
        {"role": "assistant", "text": "b", "msg_key": "m1", "entry_id": "x2", "usage": {"input": 3, "output": 90}},
    ]
    out = normalized_usage(make_blocks(msgs)).collect()
    assert out["u_output"].to_list() == [90, 90] and out["u_total"].to_list() == [93, 93]


# ---------------------------------------------------------------- 9. magic strings (§13)


def test_magic_string_in_tool_result_is_scrubbed_and_signed_thinking_untouched() -> None:
    msgs = [
        {"role": "user", "text": f"please {MAGIC_SHORT} now"},
        {"role": "assistant", **ANTHROPIC, "blocks": [
            {"type": "thinking", "text": f"I saw {MAGIC}", "signature": "sig"},
            {"type": "text", "text": f"assistant says {MAGIC_SHORT}"},
            {"type": "tool_use", "tool_use_id": "toolu_1", "tool_name": "Bash", "tool_input": {"c": MAGIC_SHORT}}]},
        {"role": "tool", "blocks": [{"type": "tool_result", "tool_use_id": "toolu_1", "part_type": "string",
                                     "text": f"out {MAGIC} end"}]},
    ]
    blocks, dec = _run(msgs)
    texts = {(e, bt): t for e, bt, t in _texts(blocks)}
    assert texts[("e0000", "text")] == f"please {REDACTED} now"
    assert texts[("e0002", "tool_result")] == f"out {REDACTED} end"
    assert texts[("e0001", "thinking")] == f"I saw {MAGIC}"
    assert texts[("e0001", "text")] == f"assistant says {MAGIC_SHORT}"
    assert _reasons(dec) == [("e0000", 0, "replace", "magic_string"), ("e0002", 0, "replace", "magic_string")]


@pytest.mark.parametrize(("scrub", "target", "expected"), [
    ("anthropic", "anthropic", 1), ("anthropic", "openai_chat", 0), ("always", "openai_chat", 1), ("off", "anthropic", 0),
])
def test_scrub_magic_modes(scrub: str, target: str, expected: int) -> None:
    _, dec = _run([{"role": "user", "text": MAGIC}], {"scrub_magic": scrub}, ctx=StageContext(target=target))
    assert dec.height == expected


# ---------------------------------------------------------------- decisions


def test_each_changed_block_has_one_decision_with_its_hashes() -> None:
    msgs = _thinking_session() + _failed_session() + [{"role": "user", "text": MAGIC}, {"role": "user", "text": " "}]
    blocks_in = make_blocks(msgs).collect()
    res = run_stage("sanitize", blocks_in.lazy(), {"thinking_policy": "drop_all_but_latest"})
    dec = res.decisions.collect()
    assert dec.group_by("session_id", "thread_id", "entry_id", "block_pos", "part_pos", "from_call").len()["len"].max() == 1
    inputs = dict(zip(zip(blocks_in["entry_id"], blocks_in["block_pos"]), blocks_in["content_sha256"]))
    for r in dec.filter(pl.col("action") != "insert").iter_rows(named=True):
        assert r["before_sha256"] == inputs[(r["entry_id"], r["block_pos"])]
    again = run_stage("sanitize", res.blocks.collect().lazy(), {"thinking_policy": "drop_all_but_latest"})
    assert again.decisions.collect().height == 0


# ---------------------------------------------------------------- the real corpus


@pytest.mark.corpus
def test_signed_thinking_is_never_altered_on_the_corpus(corpus: Path) -> None:
    from ctxreplay.pipeline.loaders import load_paths

    blocks = pl.from_arrow(load_paths([corpus]).blocks)
    res = run_stage("sanitize", blocks.lazy(), {})
    out, dec = pl.collect_all([res.blocks, res.decisions])
    native_signed = blocks.filter(
        pl.col("block_type").is_in(["thinking", "redacted_thinking"]) & (pl.col("api") == "anthropic-messages")
        & pl.col("signature").is_not_null() & (pl.col("signature").str.strip_chars() != "")
    )
    assert native_signed.height > 100
    key = ["session_id", "thread_id", "entry_id", "block_pos", "part_pos", "first_call"]
    after = native_signed.select(key).join(out, on=key, how="left")
    assert after.select("text", "signature", "content_sha256").equals(
        native_signed.select("text", "signature", "content_sha256"))
    touched = dec.join(native_signed.select(key[:-1]), on=key[:-1], how="semi")
    assert touched.height == 0
