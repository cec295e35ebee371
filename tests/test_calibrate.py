"""Calibration from recorded usage: ratio and preambles recovered, owners, structure evidence, facts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import polars as pl
import pytest

from ctxreplay.pipeline.cost import calibrate
from ctxreplay.pipeline.loaders import load_paths

SID = "11111111-0000-4000-8000-000000000001"
SID2 = "22222222-0000-4000-8000-000000000002"


def frames(threads: list[dict[str, Any]]) -> tuple[pl.DataFrame, pl.DataFrame]:
    """calls and recorded facts from per-thread lists of (x, read, write, input, segment, model)."""
    calls, rec = [], []
    for t in threads:
        key = t["session"] if t["thread"] == "main" else f"{t['session']}--{t['thread']}"
        for k, (x, read, write, inp, seg, model) in enumerate(t["calls"]):
            calls.append({"session_id": t["session"], "thread_id": t["thread"], "thread_key": key, "call": k,
                          "is_pending": False, "model": model, "recorded_input_tokens": inp,
                          "recorded_cache_read_tokens": read, "recorded_cache_write_tokens": write,
                          "recorded_cache_write_5m_tokens": write, "recorded_cache_write_1h_tokens": 0})
            rec.append({"session_id": t["session"], "thread_id": t["thread"], "call": k, "rec_tokens": x,
                        "segment": seg, "recorded_strip": False})
    return pl.DataFrame(calls), pl.DataFrame(rec, schema_overrides={"call": pl.Int32, "segment": pl.Int32})


def incremental(xs: list[int], pre: list[int], ratio: float, segs: list[int], first_read: int = 0,
                model: str = "claude-opus-4-6", breaks: dict[int, int] | None = None) -> list[tuple[Any, ...]]:
    """Claude Code-like usage: prompt = preamble + ratio × x, each request reading what the last cached."""
    out: list[tuple[Any, ...]] = []
    cached = None
    for k, (x, s) in enumerate(zip(xs, segs, strict=True)):
        prompt = round(pre[s] + ratio * x)
        read = first_read if cached is None else cached
        if breaks and k in breaks:
            read = breaks[k]
        inp = 1
        write = prompt - read - inp
        out.append((x, read, write, inp, s, model))
        cached = read + write
    return out


def test_fit_recovers_the_ratio_and_a_preamble_per_compaction_segment() -> None:
    xs = [100, 900, 2500, 4000, 7000, 9000, 500, 1500, 3000, 6000]
    segs = [0] * 6 + [1] * 4
    calls, rec = frames([{"session": SID, "thread": "main",
                          "calls": incremental(xs, [20000, 26000], 1.3, segs, first_read=15000, breaks={6: 19000})}])
    cal = calibrate.fit(calls, rec)
    t = cal.threads.row(0, named=True)
    assert t["ratio"] == pytest.approx(1.3, abs=1e-3) and t["ratio_source"] == "thread"
    pre = dict(cal.segments.select("segment", "preamble_tokens").iter_rows())
    assert pre[0] == pytest.approx(20000, abs=2) and pre[1] == pytest.approx(26000, abs=2)
    assert t["shared_tokens"] == 15000          # what the first request read from other sessions
    assert t["system_tokens"] == 19000          # where the compaction fell back to
    assert t["tail_tokens"] == 1
    assert t["uses_cache"]
    out = calibrate.apply(calls.with_columns(prompt_tokens=rec["rec_tokens"]), cal, rec)
    y = (pl.col("recorded_input_tokens") + pl.col("recorded_cache_read_tokens") + pl.col("recorded_cache_write_tokens"))
    assert out.select((pl.col("calibrated_prompt_tokens") - y).abs().max()).item() <= 2


def test_too_few_calls_take_the_family_ratio_and_a_compaction_agent_its_owner() -> None:
    main = incremental([100, 900, 2500, 4000, 7000, 9000], [20000], 1.5, [0] * 6)
    other = incremental([100, 800, 1600, 3000, 5000, 8000, 9000], [18000], 1.1, [0] * 7)
    few = incremental([200, 3000], [9000], 1.25, [0, 0])
    calls, rec = frames([
        {"session": SID, "thread": "main", "calls": main},
        {"session": SID2, "thread": "main", "calls": other},
        {"session": SID, "thread": "agent-abc", "calls": few},                    # a subagent: its own system
        {"session": SID, "thread": "agent-acompact-1", "calls": [(50000, 95000, 0, 3, 0, "claude-opus-4-6")]},
    ])
    cal = calibrate.fit(calls, rec)
    th = {r["thread_id"] + r["session_id"][:2]: r for r in cal.threads.to_dicts()}
    fam = cal.families.row(0, named=True)
    assert 1.1 < fam["ratio_family"] < 1.5
    assert fam["thread_ratio_min"] == pytest.approx(1.1, abs=1e-3) and fam["thread_ratio_max"] == pytest.approx(1.5, abs=1e-3)
    assert th["agent-abc11"]["ratio_source"] == "family"
    assert th["agent-abc11"]["ratio"] == pytest.approx(fam["ratio_family"])
    assert th["agent-acompact-111"]["ratio_source"] == "owner"
    assert th["agent-acompact-111"]["ratio"] == pytest.approx(1.5, abs=1e-3)
    assert th["agent-acompact-111"]["owner_key"] == SID and th["agent-abc11"]["owner_key"] == f"{SID}--agent-abc"
    mode_family = calibrate.fit(calls, rec, mode="family")
    assert set(mode_family.threads["ratio_source"].to_list()) == {"family"}


def test_an_agent_that_never_caches() -> None:
    calls, rec = frames([{"session": SID, "thread": "main",
                          "calls": [(1000, 0, 0, 5000, 0, "claude-opus-4-6"), (2000, 0, 0, 6300, 0, "claude-opus-4-6")]}])
    assert not calibrate.fit(calls, rec).threads["uses_cache"][0]


def test_model_families() -> None:
    f = calibrate.model_family
    assert f("claude-opus-4-6") == f("claude-haiku-4-5-20251001") == f("claude-3-5-sonnet") == "claude-v3"
    assert f("claude-opus-4-7") == "claude-v4.7"
    assert f("claude-opus-5") == f("claude-sonnet-5-5") == "claude-v5"
    assert f("gpt-5.1-codex-max") == f("o3") == "openai-o200k"
    assert f("gemini-2.5-pro") == "gemini"
    assert f("openrouter/stepfun/step-3.5-flash:free") == f(None) == "other"


def cc(o: dict[str, Any]) -> str:
    base = {"isSidechain": False, "userType": "external", "cwd": "/w", "sessionId": SID, "version": "2.1.39"}
    return json.dumps({**base, **o})


def test_recorded_facts_segment_and_thinking_strip(tmp_path: Path) -> None:
    def asst(uuid: str, parent: str, mid: str, ts: str, content: list[dict[str, Any]]) -> str:
        return cc({"type": "assistant", "uuid": uuid, "parentUuid": parent, "timestamp": ts, "requestId": "r" + mid,
                   "message": {"id": mid, "type": "message", "role": "assistant", "model": "claude-opus-4-6",
                               "content": content, "usage": {"input_tokens": 3, "output_tokens": 5,
                                                             "cache_read_input_tokens": 0,
                                                             "cache_creation_input_tokens": 100}}})

    def user(uuid: str, parent: str | None, ts: str, content: Any, **kw: Any) -> str:
        return cc({"type": "user", "uuid": uuid, "parentUuid": parent, "timestamp": ts,
                   "message": {"role": "user", "content": content}, **kw})

    lines = [
        user("u1", None, "2026-03-02T09:00:00.000Z", "Fix the parser"),
        asst("a1", "u1", "m1", "2026-03-02T09:00:05.000Z",
             [{"type": "thinking", "thinking": "run the test", "signature": "c2ln"},
              {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"command": "pytest"}}]),
        user("u2", "a1", "2026-03-02T09:00:06.000Z", [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "1 failed"}]),
        asst("a2", "u2", "m2", "2026-03-02T09:00:08.000Z", [{"type": "text", "text": "Fixed."}]),
        user("u3", "a2", "2026-03-02T09:01:00.000Z", "Now the docs"),                       # a new turn
        asst("a3", "u3", "m3", "2026-03-02T09:01:02.000Z", [{"type": "text", "text": "Done."}]),
        cc({"type": "system", "subtype": "compact_boundary", "uuid": "cb", "parentUuid": None,
            "logicalParentUuid": "a3", "timestamp": "2026-03-02T09:02:00.000Z", "content": "Conversation compacted"}),
        user("u4", "cb", "2026-03-02T09:02:01.000Z", "This session is being continued from a previous conversation.",
             isCompactSummary=True),
        asst("a4", "u4", "m4", "2026-03-02T09:02:03.000Z", [{"type": "text", "text": "Continuing."}]),
        user("u5", "a4", "2026-03-02T09:03:00.000Z", "And the changelog"),                  # no thinking before
        asst("a5", "u5", "m5", "2026-03-02T09:03:02.000Z", [{"type": "text", "text": "Ok."}]),
    ]
    d = tmp_path / "proj"
    d.mkdir()
    (d / f"{SID}.jsonl").write_text("\n".join(lines) + "\n")
    blocks = pl.from_arrow(load_paths([d]).blocks)
    assert isinstance(blocks, pl.DataFrame)
    f = calibrate.recorded_facts(blocks, None).filter(pl.col("thread_id") == "main").sort("call")
    assert f["call"].to_list() == [0, 1, 2, 3, 4, 5]
    assert f["segment"].to_list() == [0, 0, 0, 1, 1, 1]
    assert f["recorded_strip"].to_list() == [False, False, True, False, False, False]
    # a new user turn (not a step of the tool loop, which only appends the answer and its results);
    # the first call after the compaction (3) is a new segment, which the break causes take first
    assert f["recorded_turn"].to_list() == [True, False, True, False, True, False]
    assert f["rec_tokens"][0] == 3 + 3 + (len("Fix the parser") + 3) // 4     # request + message overhead + text
