"""Validators (layer-semantics §10): each invariant of each target, on small hand-written requests;
violations name thread, call, message and block; lenient mode's `violation` ledger rows."""

from __future__ import annotations

from typing import Any

import pytest

from ctxreplay.pipeline.targets import get_target
from ctxreplay.pipeline.targets.validate import (
    validate_anthropic,
    validate_gemini,
    validate_openai_chat,
    validate_openai_responses,
    violation_decisions,
)
from ctxreplay.schemas.decisions import STAGE_DECISION


def rules(violations: list) -> list[str]:
    return sorted(v.rule for v in violations)


def a_user(*content: Any) -> dict[str, Any]:
    return {"role": "user", "content": list(content) or [{"type": "text", "text": "hi"}]}


def a_asst(*content: Any) -> dict[str, Any]:
    return {"role": "assistant", "content": list(content) or [{"type": "text", "text": "ok"}]}


def use(i: str, name: str = "Read", inp: Any = None) -> dict[str, Any]:
    return {"type": "tool_use", "id": i, "name": name, "input": {} if inp is None else inp}


def res(i: str) -> dict[str, Any]:
    return {"type": "tool_result", "tool_use_id": i, "content": "x"}


def anth(*msgs: dict[str, Any], **kw: Any) -> list[str]:
    return rules(validate_anthropic({"messages": list(msgs)}, thread_key="t", call=3, **kw))


# ----------------------------------------------------------------------------- anthropic


def test_anthropic_accepts_a_paired_request() -> None:
    assert anth(a_user(), a_asst(use("toolu_1"), use("toolu_2")), a_user(res("toolu_1"), res("toolu_2"),
                                                                         {"type": "text", "text": "and"})) == []


@pytest.mark.parametrize("msgs,expected", [
    ([], ["messages_empty"]),
    ([a_asst(), a_user()], ["first_not_user"]),
    ([a_user(), a_user()], ["roles_not_alternating"]),
    ([a_user(), a_asst()], ["trailing_assistant"]),
    ([a_user({"type": "text", "text": "  "})], ["empty_text"]),
    ([a_user(), {"role": "assistant", "content": []}, a_user()], ["empty_content"]),
    ([a_user(), a_asst(use("t1")), a_user()], ["tool_use_unanswered"]),
    ([a_user(res("t9"))], ["tool_result_without_tool_use"]),
    ([a_user(), a_asst(use("functions.read:0")), a_user(res("functions.read:0"))], ["bad_tool_use_id"]),
    ([a_user(), a_asst(use("t1"), use("t1")), a_user(res("t1"))], ["duplicate_tool_use_id"]),
    ([a_user(), a_asst(use("t1", name="bad name")), a_user(res("t1"))], ["bad_tool_name"]),
    ([a_user(), a_asst(use("t1", inp="raw")), a_user(res("t1"))], ["tool_input_not_object"]),
    ([a_user(), a_asst(use("t1")), a_user({"type": "text", "text": "x"}, res("t1"))], ["tool_result_not_first"]),
    ([a_user(), a_asst(use("t1")), a_user(res("t1"), res("t1"))], ["duplicate_tool_result"]),
    ([a_user(), a_asst({"type": "thinking", "thinking": "hm", "signature": ""}, {"type": "text", "text": "x"}),
      a_user()], ["thinking_without_signature"]),
    ([a_user({"type": "image", "source": {"type": "base64", "media_type": "image/bmp", "data": "AA=="}})],
     ["image_media_type"]),
    ([a_user({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "A" * 5_300_000}})],
     ["image_too_large"]),
])
def test_anthropic_rules(msgs: list, expected: list[str]) -> None:
    assert anth(*msgs) == expected


def test_anthropic_prefill_allowed_when_asked() -> None:
    assert anth(a_user(), a_asst(), allow_prefill=True) == []


def test_anthropic_image_count() -> None:
    img = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
    assert anth(a_user(*[img] * 101)) == ["too_many_images"]


def test_violation_names_thread_call_message_and_block() -> None:
    (v,) = validate_anthropic({"messages": [a_user(res("t9"))]}, thread_key="sess--agent", call=7)
    assert (v.thread_key, v.call, v.message, v.block) == ("sess--agent", 7, 0, 0)
    assert str(v).startswith("thread sess--agent, call 7, message 0, block 0: tool_result_without_tool_use: ")


# ----------------------------------------------------------------------------- openai chat


def tc(i: str, name: str = "read", args: Any = "{}") -> dict[str, Any]:
    return {"id": i, "type": "function", "function": {"name": name, "arguments": args}}


def chat(*msgs: dict[str, Any]) -> list[str]:
    return rules(validate_openai_chat({"messages": list(msgs)}, thread_key="t", call=0))


U = {"role": "user", "content": "hi"}


def test_openai_chat_accepts_a_paired_request() -> None:
    assert chat({"role": "system", "content": "s"}, U, {"role": "assistant", "content": None, "tool_calls": [tc("a"), tc("b")]},
                {"role": "tool", "tool_call_id": "b", "content": "x"}, {"role": "tool", "tool_call_id": "a", "content": "y"},
                U) == []


@pytest.mark.parametrize("msgs,expected", [
    ([], ["messages_empty"]),
    ([U, {"role": "assistant", "content": None, "tool_calls": [tc("a")]}, U], ["tool_call_unanswered"]),
    ([U, {"role": "assistant", "content": None, "tool_calls": [tc("a")]}], ["tool_call_unanswered"]),
    ([U, {"role": "tool", "tool_call_id": "a", "content": "x"}], ["tool_without_call"]),
    ([U, {"role": "assistant", "content": None, "tool_calls": [tc("a")]}, U,
      {"role": "tool", "tool_call_id": "a", "content": "x"}], ["tool_call_unanswered", "tool_without_call"]),
    ([U, {"role": "assistant", "content": None, "tool_calls": [tc("a", args={})]},
      {"role": "tool", "tool_call_id": "a", "content": "x"}], ["arguments_not_string"]),
    ([U, {"role": "assistant", "content": None, "tool_calls": [tc("a"), tc("a")]},
      {"role": "tool", "tool_call_id": "a", "content": "x"}, {"role": "tool", "tool_call_id": "a", "content": "x"}],
     ["duplicate_tool_call_id"]),
    ([{"role": "user", "content": []}], ["empty_content"]),
    ([U, {"role": "assistant", "content": None}], ["empty_assistant"]),
])
def test_openai_chat_rules(msgs: list, expected: list[str]) -> None:
    assert chat(*msgs) == expected


# ----------------------------------------------------------------------------- openai responses


def fc(i: str, name: str = "read") -> dict[str, Any]:
    return {"type": "function_call", "call_id": i, "name": name, "arguments": "{}"}


def fo(i: str) -> dict[str, Any]:
    return {"type": "function_call_output", "call_id": i, "output": "x"}


M = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}


def resp(*items: dict[str, Any]) -> list[str]:
    return rules(validate_openai_responses({"input": list(items)}, thread_key="t", call=0))


def test_openai_responses_accepts_a_paired_request() -> None:
    assert resp(M, {"type": "reasoning", "summary": []}, fc("a"), fc("b"), fo("b"), fo("a"), M) == []


@pytest.mark.parametrize("items,expected", [
    ([], ["input_empty"]),
    ([M, fc("a")], ["function_call_unanswered"]),
    ([M, fo("a")], ["output_without_call"]),
    ([M, fo("a"), fc("a")], ["output_without_call"]),
    ([M, fc("a"), fo("a"), fo("a")], ["duplicate_output"]),
    ([M, fc("a"), fc("a"), fo("a")], ["duplicate_call_id"]),
    ([M, {"type": "reasoning", "summary": []}, M], ["reasoning_not_followed"]),
    ([M, {"type": "reasoning", "summary": []}], ["reasoning_not_followed"]),
    ([{"type": "message", "role": "user", "content": [{"type": "output_text", "text": "x"}]}], ["bad_content_type"]),
    ([M, {"type": "custom_thing"}], ["unsupported_block_type"]),
])
def test_openai_responses_rules(items: list, expected: list[str]) -> None:
    assert resp(*items) == expected


# ----------------------------------------------------------------------------- gemini


def g(role: str, *parts: dict[str, Any]) -> dict[str, Any]:
    return {"role": role, "parts": list(parts) or [{"text": "x"}]}


def gcall(name: str = "read", i: str | None = "c1") -> dict[str, Any]:
    f: dict[str, Any] = {"name": name, "args": {}}
    if i:
        f["id"] = i
    return {"functionCall": f}


def gresp(name: str = "read", i: str | None = "c1") -> dict[str, Any]:
    f: dict[str, Any] = {"name": name, "response": {"output": "x"}}
    if i:
        f["id"] = i
    return {"functionResponse": f}


def gem(*contents: dict[str, Any]) -> list[str]:
    return rules(validate_gemini({"contents": list(contents)}, thread_key="t", call=0))


def test_gemini_accepts_a_paired_request() -> None:
    assert gem(g("user"), g("model", {"text": "let me"}, gcall("a", "c1"), gcall("b", "c2")),
               g("user", gresp("b", "c2"), gresp("a", "c1"), {"text": "and"}), g("model")) == []


@pytest.mark.parametrize("contents,expected", [
    ([], ["contents_empty"]),
    ([g("model"), g("user")], ["first_not_user"]),
    ([g("user"), g("user")], ["roles_not_alternating"]),
    ([g("user"), {"role": "model", "parts": []}], ["empty_parts"]),
    ([g("user", {"text": ""})], ["empty_text"]),
    ([g("user"), g("model", gcall())], ["function_call_unanswered"]),
    ([g("user"), g("model", gcall(), gcall("b", "c2")), g("user", gresp())], ["response_count_mismatch"]),
    ([g("user"), g("model", gcall()), g("user", gresp("other"))], ["response_name_mismatch"]),
    ([g("user"), g("model", gcall()), g("user", gresp(i="c9"))], ["response_id_mismatch"]),
    ([g("user", gresp())], ["response_without_call"]),
    ([g("user"), g("model", gcall(i="call_1")), g("user", gresp(i="call_1"))], ["bad_call_id", "bad_call_id"]),
    ([g("user"), g("model", gcall(name="9bad")), g("user", gresp(name="9bad"))],
     ["bad_function_name", "bad_function_name"]),
])
def test_gemini_rules(contents: list, expected: list[str]) -> None:
    assert gem(*contents) == expected


# ----------------------------------------------------------------------------- plumbing


@pytest.mark.parametrize("target", ["anthropic", "openai-chat", "openai-responses", "gemini"])
def test_targets_validate_with_their_validator(target: str) -> None:
    t = get_target(target)
    assert t.validate({t.list_key: []}, thread_key="t", call=0)[0].rule.endswith("_empty")


def test_violation_decisions_fit_the_decision_schema() -> None:
    vs = validate_anthropic({"messages": [a_user(res("t9"))]}, thread_key="k", call=2) + \
        validate_anthropic({"messages": []}, thread_key="k", call=3)
    rows = violation_decisions(vs, {"k": ("s1", "main")})
    assert [(r["entry_id"], r["block_pos"], r["from_call"], r["action"], r["reason"]) for r in rows] == [
        ("wire:0", 0, 2, "violation", "tool_result_without_tool_use"), ("wire:request", -1, 3, "violation", "messages_empty")]
    assert set(rows[0]) == set(STAGE_DECISION.names)
