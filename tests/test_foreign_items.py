"""Provider-native items and tool names across targets (issue 8, defects 3 and 8).

- A Codex rollout's hosted-tool items (`web_search_call`, `image_generation_call`), its encrypted
  reasoning and its refusals, and a Claude Code session's server-tool blocks (`server_tool_use`,
  `web_search_tool_result`), replayed to every target: the sanitize layer converts what the target
  cannot carry to text or drops it, with a `foreign_item` decision per block, and every request
  passes the target's validator. Without the sanitize layer (the identity preset) the items reach
  the request as recorded and the validator reports them (`unsupported_block_type`), except where
  the target is their own provider's.
- A tool name valid only once trimmed (`" Grep "`) is written trimmed, on the call and its result.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import polars as pl
import pytest

from ctxreplay.pipeline.batch.runner import RunOptions, RunResult, run
from ctxreplay.pipeline.core.tokens import CHARS4_COUNTER
from ctxreplay.pipeline.stageapi.registry import StageContext
from ctxreplay.pipeline.staging.spec import load_spec
from ctxreplay.pipeline.targets import get_target
from ctxreplay.pipeline.targets.validate import (
    validate_anthropic,
    validate_gemini,
    validate_openai_chat,
    validate_openai_responses,
)
from ctxreplay.testkit import make_blocks, run_stage

TARGETS = ["anthropic", "openai-chat", "openai-responses", "gemini"]
CODEX_ID = "019b0000-aaaa-7bbb-8ccc-0123456789ab"
CC_ID = "4f2d8c1a-9b3e-4c5d-8e6f-7a8b9c0d1e2f"


def _codex(tmp: Path) -> Path:
    def line(t: str, payload: dict[str, Any], sec: int) -> dict[str, Any]:
        return {"timestamp": f"2026-02-01T10:00:{sec:02d}.000Z", "type": t, "payload": payload}

    def item(sec: int, **p: Any) -> dict[str, Any]:
        return line("response_item", p, sec)

    def tokens(sec: int, total: int) -> dict[str, Any]:
        u = {"input_tokens": total, "cached_input_tokens": 0, "output_tokens": 10, "total_tokens": total + 10}
        return line("event_msg", {"type": "token_count", "info": {"total_token_usage": u, "last_token_usage": u}}, sec)

    objs = [
        line("session_meta", {"id": CODEX_ID, "instructions": "Be brief.", "model_provider": "openai"}, 0),
        line("turn_context", {"model": "gpt-5-codex"}, 0),
        item(1, type="message", role="user", content=[{"type": "input_text", "text": "What is new in Python 3.14?"}]),
        item(2, type="reasoning", summary=[{"type": "summary_text", "text": "**Searching**"}], content=None,
             encrypted_content="gAAAAABencryptedReasoning"),
        item(3, type="web_search_call", id="ws_1", status="completed",
             action={"type": "search", "query": "python 3.14 release notes"}),
        item(4, type="message", role="assistant", content=[{"type": "output_text", "text": "Free threading."}]),
        tokens(4, 100),
        item(5, type="message", role="user", content=[{"type": "input_text", "text": "Draw it, then run ls."}]),
        item(6, type="image_generation_call", id="ig_1", status="completed", result="iVBORw0KGgo="),
        item(7, type="local_shell_call", call_id="ls_1", status="completed",
             action={"type": "exec", "command": ["ls"]}),
        tokens(7, 200),
        item(8, type="local_shell_call_output", call_id="ls_1", output="a.txt"),
        item(9, type="message", role="assistant",
             content=[{"type": "refusal", "refusal": "I cannot draw that."}]),
        tokens(9, 300),
        item(10, type="message", role="user", content=[{"type": "input_text", "text": "ok"}]),
    ]
    p = tmp / "codex" / f"rollout-2026-02-01T10-00-00-{CODEX_ID}.jsonl"
    p.parent.mkdir(parents=True)
    p.write_text("".join(json.dumps(o) + "\n" for o in objs))
    return p


def _claude(tmp: Path, tool_name: str = "Grep") -> Path:
    n = [0]

    def entry(typ: str, parent: str | None, message: dict[str, Any], **kw: Any) -> dict[str, Any]:
        n[0] += 1
        return {"parentUuid": parent, "isSidechain": False, "type": typ, "uuid": f"u{n[0]}", "sessionId": CC_ID,
                "timestamp": f"2026-02-01T10:00:{n[0]:02d}.000Z", "message": message, **kw}

    def asst(parent: str, mid: str, content: list[dict[str, Any]]) -> dict[str, Any]:
        return entry("assistant", parent, {"id": mid, "type": "message", "role": "assistant", "model": "claude-x",
                                           "content": content, "stop_reason": "end_turn",
                                           "usage": {"input_tokens": 5, "output_tokens": 5}}, requestId=f"r{mid}")

    e = [entry("user", None, {"role": "user", "content": "Search the web, then grep."})]
    e.append(asst("u1", "m1", [
        {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {"query": "x"}},
        {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_1",
         "content": [{"type": "web_search_result", "url": "https://example.org", "title": "X",
                      "encrypted_content": "EqQB"}]},
        {"type": "text", "text": "Found it."},
        {"type": "tool_use", "id": "toolu_1", "name": tool_name, "input": {"pattern": "x"}}]))
    e.append(entry("user", "u2", {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "a.txt:1:x"}]}))
    e.append(asst("u3", "m2", [{"type": "text", "text": "Done."}]))
    e.append(entry("user", "u4", {"role": "user", "content": "thanks"}))
    p = tmp / "claude" / f"{CC_ID}.jsonl"
    p.parent.mkdir(parents=True)
    p.write_text("".join(json.dumps(o) + "\n" for o in e))
    return p


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("in")
    _codex(tmp)
    _claude(tmp)
    return tmp


@pytest.fixture(scope="module")
def runs(inputs: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], RunResult]:
    out = {}
    for preset in ("default", "identity"):
        for t in TARGETS:
            tmp = tmp_path_factory.mktemp(f"{preset}-{t}")
            out[(preset, t)] = run([inputs], load_spec(preset=preset),
                                   RunOptions(out_dir=tmp / "o", target=t, all_calls=True,
                                              token_counter=CHARS4_COUNTER))
    return out


def _requests(res: RunResult) -> str:
    out = Path(res.summary["out_dir"]) / "requests"
    return "\n".join(p.read_text() for p in sorted(out.glob("*.jsonl")))


@pytest.mark.parametrize("target", TARGETS)
def test_default_pipeline_shapes_or_drops_every_foreign_item(runs: dict[tuple[str, str], RunResult],
                                                             target: str) -> None:
    res = runs[("default", target)]
    assert res.violations == [], "; ".join(map(str, res.violations[:5]))
    d = res.decisions.filter(pl.col("stage") == "sanitize")
    foreign = Counter(f"{a}:{r}" for a, r in d.select("action", "reason").iter_rows() if r == "foreign_item")
    reqs = _requests(res)
    assert "EqQB" not in reqs or target == "anthropic"  # the web search result only goes back to Anthropic
    if target == "openai-responses":
        # Codex's own items go back as they were recorded; Claude Code's server tools are dropped
        assert '"type":"web_search_call"' in reqs.replace(" ", "")
        assert '"type":"image_generation_call"' in reqs.replace(" ", "")
        assert "\"refusal\":\"I cannot draw that.\"" in reqs.replace(": ", ":")
        assert foreign == {"drop:foreign_item": 2}
    elif target == "anthropic":
        # its own server tool blocks stay; Codex's hosted-tool items are dropped, the refusal is text
        assert '"type":"web_search_tool_result"' in reqs.replace(" ", "")
        assert "web_search_call" not in reqs and "image_generation_call" not in reqs
        assert foreign == {"drop:foreign_item": 2, "replace:foreign_item": 1}
    else:
        assert not any(x in reqs for x in ("web_search_call", "image_generation_call", "server_tool_use",
                                            "web_search_tool_result"))
        assert foreign == {"drop:foreign_item": 4, "replace:foreign_item": 1}
    assert "I cannot draw that." in reqs
    # encrypted reasoning never reaches another provider (foreign thinking: dropped)
    assert "gAAAAABencryptedReasoning" not in reqs


@pytest.mark.parametrize("target", TARGETS)
def test_without_sanitize_the_validator_reports_foreign_items(runs: dict[tuple[str, str], RunResult],
                                                              target: str) -> None:
    res = runs[("identity", target)]
    unsupported = [v for v in res.violations if v.rule == "unsupported_block_type"]
    details = " ".join(v.detail for v in unsupported)
    if target == "openai-responses":
        # Codex's items are native; Claude Code's server tool blocks are not
        assert "server_tool_use" in details and "web_search_call" not in details
    elif target == "anthropic":
        assert "web_search_call" in details and "image_generation_call" in details and "refusal" in details
        assert "server_tool_use" not in details
    else:
        assert unsupported, f"{target}: foreign items reached the request unreported"


def test_to_text_and_drop_policies() -> None:
    msgs = [{"role": "user", "text": "q"},
            {"role": "assistant", "blocks": [{"type": "refusal", "text": "no"},
                                             {"type": "web_search_call", "extra": {"type": "web_search_call"}}]}]
    res = run_stage("sanitize", make_blocks(msgs), {}, ctx=StageContext(target="anthropic"))
    b = res.blocks.collect().filter(pl.col("role") == "assistant")
    assert b.select("block_type", "text").rows() == [("text", "no")]
    assert sorted(res.decisions.collect().select("action", "reason").rows()) == [
        ("drop", "foreign_item"), ("replace", "foreign_item")]
    res = run_stage("sanitize", make_blocks(msgs), {"foreign_items": "drop"}, ctx=StageContext(target="anthropic"))
    assert res.blocks.collect().filter(pl.col("role") == "assistant").height == 0
    # a second pass decides nothing
    again = run_stage("sanitize", res.blocks, {"foreign_items": "drop"}, ctx=StageContext(target="anthropic"))
    assert again.decisions.collect().height == 0


def test_anthropic_tool_result_parts_of_a_foreign_type_become_text() -> None:
    msgs = [{"role": "user", "text": "q"},
            {"role": "assistant", "blocks": [{"type": "tool_use", "tool_use_id": "t", "tool_name": "Read",
                                              "tool_input": {}}]},
            {"role": "tool", "blocks": [
                {"type": "tool_result", "tool_use_id": "t", "part_type": "text", "text": "head"},
                {"type": "tool_result", "tool_use_id": "t", "part_type": "other", "part_pos": 1,
                 "text": '{"type":"input_file"}', "extra": {"part": {"type": "input_file"}}}]}]
    res = run_stage("sanitize", make_blocks(msgs), {}, ctx=StageContext(target="anthropic"))
    parts = res.blocks.collect().filter(pl.col("block_type") == "tool_result").sort("part_pos")
    assert parts.select("part_type", "extra_json").rows() == [("text", None), ("text", None)]
    assert res.decisions.collect()["reason"].to_list() == ["foreign_item"]


@pytest.mark.parametrize("validate,request_", [
    (validate_anthropic, {"messages": [{"role": "user", "content": [{"type": "web_search_call"}]}]}),
    (validate_anthropic, {"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "input_file"}]}]}]}),
    (validate_openai_chat, {"messages": [{"role": "user", "content": [{"type": "server_tool_use"}]}]}),
    (validate_openai_chat, {"messages": [{"role": "user", "content": "hi"},
                                         {"role": "assistant", "content": [{"type": "web_search_call"}]}]}),
    (validate_openai_responses, {"input": [{"type": "message", "role": "user", "content": [
        {"type": "input_text", "text": "q"}]}, {"type": "server_tool_use"}]}),
    (validate_openai_responses, {"input": [{"type": "message", "role": "user", "content": [
        {"type": "web_search_tool_result"}]}]}),
    (validate_gemini, {"contents": [{"role": "user", "parts": [{"type": "web_search_call"}]}]}),
])
def test_validators_check_block_types(validate: Any, request_: dict[str, Any]) -> None:
    rules = [v.rule for v in validate(request_, thread_key="t", call=0)]
    assert "unsupported_block_type" in rules
    good = {"anthropic": {"messages": [{"role": "user", "content": [{"type": "text", "text": "q"}]}]},
            "chat": {"messages": [{"role": "user", "content": [{"type": "text", "text": "q"}]}]},
            "responses": {"input": [{"type": "web_search_call", "id": "ws", "status": "completed"},
                                    {"type": "message", "role": "user",
                                     "content": [{"type": "input_text", "text": "q"}]}]},
            "gemini": {"contents": [{"role": "user", "parts": [{"text": "q", "thoughtSignature": "x"}]}]}}
    kind = {validate_anthropic: "anthropic", validate_openai_chat: "chat", validate_openai_responses: "responses",
            validate_gemini: "gemini"}[validate]
    assert "unsupported_block_type" not in [v.rule for v in validate(good[kind], thread_key="t", call=0)]


# ----------------------------------------------------------------------------- tool names (defect 3)


def test_a_name_valid_once_trimmed_is_written_trimmed_on_the_call_and_its_result() -> None:
    msgs = [{"role": "user", "text": "q"},
            {"role": "assistant", "blocks": [{"type": "tool_use", "tool_use_id": "t1", "tool_name": " Grep ",
                                              "tool_input": {"p": 1}}]},
            {"role": "tool", "blocks": [{"type": "tool_result", "tool_use_id": "t1", "tool_name": " Grep ",
                                         "text": "hit", "part_type": "string"}]},
            {"role": "assistant", "text": "ok"}]
    res = run_stage("sanitize", make_blocks(msgs), {}, ctx=StageContext(target="anthropic"))
    b = res.blocks.collect()
    assert b.filter(pl.col("tool_name").is_not_null())["tool_name"].to_list() == ["Grep", "Grep"]
    d = res.decisions.collect()
    assert sorted(zip(d["entry_id"], d["action"], d["reason"])) == [
        ("e0001", "replace", "tool_name"), ("e0002", "replace", "tool_name")]
    again = run_stage("sanitize", res.blocks, {}, ctx=StageContext(target="anthropic"))
    assert again.decisions.collect().height == 0


@pytest.mark.parametrize("target", TARGETS)
def test_trimmed_tool_name_reaches_the_request_and_passes_the_validator(tmp_path: Path, target: str) -> None:
    _claude(tmp_path, tool_name=" Grep ")
    res = run([tmp_path / "claude"], load_spec(preset="minimal"),
              RunOptions(out_dir=tmp_path / "o", target=target, all_calls=True, token_counter=CHARS4_COUNTER))
    reqs = _requests(res)
    assert '" Grep "' not in reqs and "Grep" in reqs
    assert [v for v in res.violations if v.rule in ("bad_tool_name", "bad_function_name")] == []
    assert res.violations == [], "; ".join(map(str, res.violations[:5]))
    # without sanitize, the validator sees the untrimmed name
    raw = run([tmp_path / "claude"], load_spec(preset="identity"),
              RunOptions(out_dir=tmp_path / "i", target=target, all_calls=True, token_counter=CHARS4_COUNTER))
    assert any(v.rule in ("bad_tool_name", "bad_function_name") for v in raw.violations)


def test_every_target_has_a_bootstrap_stand_in_for_an_empty_request() -> None:
    for t in TARGETS:
        assert "(session bootstrap)" in json.dumps(get_target(t).empty_messages()), t
