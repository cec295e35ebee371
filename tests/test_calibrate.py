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


def strip_thread(model: str, last_read: int | None, strip_from: int = 1) -> pl.DataFrame:
    """The calibration's threads for one thread: a tool loop (calls 0-2; the answer of call
    `strip_from` is the turn's first with thinking, so a strip changes the prefix from the end of
    request `strip_from` on, 23,000 tokens), then a new user turn after it (call 3) that reads
    `last_read` (None: call 3 is a step of the tool loop, no strip candidate)."""
    reads = [0, 20000, 23000, 24000 if last_read is None else last_read]
    prompts = [20001, 23001, 24001, 25001]
    calls = pl.DataFrame({
        "session_id": SID, "thread_id": "main", "thread_key": SID, "call": [0, 1, 2, 3], "is_pending": False,
        "model": model, "recorded_input_tokens": 1, "recorded_cache_read_tokens": reads,
        "recorded_cache_write_tokens": [p - r - 1 for p, r in zip(prompts, reads, strict=True)],
        "recorded_cache_write_1h_tokens": 0}).with_columns(recorded_cache_write_5m_tokens=pl.col(
            "recorded_cache_write_tokens"))
    candidate = last_read is not None
    rec = pl.DataFrame({"session_id": SID, "thread_id": "main", "call": [0, 1, 2, 3], "rec_tokens": [100, 2600, 3400, 4100],
                        "segment": 0, "recorded_strip": [False, False, False, candidate],
                        "strip_from_call": [None, None, None, strip_from if candidate else None]},
                       schema_overrides={"call": pl.Int32, "segment": pl.Int32, "strip_from_call": pl.Int32})
    return calibrate.fit(calls, rec).threads


@pytest.mark.parametrize(("last_read", "old_model", "strips"), [
    (None, False, False), (None, True, True),              # no new turn after thinking: the model's default
    (24000, False, False), (24000, True, False),           # the new turn kept the whole prefix
    (23500, False, False), (23500, True, False),           # it read past the thinking: kept it, lost a later part
    (23000, False, True), (23000, True, True),             # it fell back to where the stripped thinking starts
    (15000, False, False), (15000, True, True),            # inside the preamble: as well a system prompt change
])
def test_whether_a_thread_strips_its_thinking(last_read: int | None, old_model: bool, strips: bool) -> None:
    """Opus 4.5+ and Sonnet 4.6+ keep earlier turns' thinking by default (here Sonnet 4.6), older
    models strip it (`old_model`: Sonnet 4.5): a thread without a new turn
    after thinking takes its model's default; with one, the recorded reads decide, a miss that read
    past the first thinking message of the turn before proving the thinking kept, and for a model
    that keeps it by default only a miss inside the messages counts against it."""
    model = "claude-sonnet-4-5-20250929" if old_model else "claude-sonnet-4-6"
    t = strip_thread(model, last_read).row(0, named=True)
    assert t["strips_thinking"] is strips
    assert t["strip_candidates"] == (last_read is not None)


def test_a_compaction_agent_strips_as_its_main_thread() -> None:
    """A compaction agent sends its main thread's messages: where its own calls show no new turn after
    thinking it strips (or keeps) the thinking as the main thread's recorded turns say, not by its
    model's default (fa812bfe's compaction agent read its main thread's prefix, stripped as that
    thread strips)."""
    main = incremental([100, 900, 2500, 4000, 7000, 9000], [20000], 1.3, [0] * 6)
    calls, rec = frames([{"session": SID, "thread": "main", "calls": main},
                         {"session": SID, "thread": "agent-acompact-1", "calls": [(9500, 30000, 500, 3, 0, "claude-opus-4-6")]},
                         {"session": SID, "thread": "agent-abc", "calls": [(300, 0, 20000, 3, 0, "claude-opus-4-6")]}])
    rec = rec.with_columns(recorded_strip=(pl.col("thread_id") == "main") & (pl.col("call") == 5),
                           strip_from_call=pl.when((pl.col("thread_id") == "main") & (pl.col("call") == 5))
                           .then(pl.lit(3, pl.Int32)))
    # main's new turn at call 5 fell back to the end of request 3, where its thinking starts
    at5 = (pl.col("thread_id") == "main") & (pl.col("call") == 5)
    end3 = main[3][1] + main[3][2]
    calls = calls.with_columns(recorded_cache_read_tokens=pl.when(at5).then(end3).otherwise(pl.col(
        "recorded_cache_read_tokens")), recorded_cache_write_tokens=pl.when(at5).then(
        pl.col("recorded_cache_read_tokens") + pl.col("recorded_cache_write_tokens") - end3).otherwise(pl.col(
            "recorded_cache_write_tokens")))
    th = {r["thread_id"]: r for r in calibrate.fit(calls, rec).threads.to_dicts()}
    assert th["main"]["strips_thinking"] is True
    assert th["agent-acompact-1"]["strips_thinking"] is True       # its owner's
    assert th["agent-abc"]["strips_thinking"] is False             # a subagent: its own (Opus 4.6 keeps)


def test_owners() -> None:
    """Whose system prompt a thread sends: a subagent (a subagent file's thread, or an inline
    sidechain of Claude Code 1.0.x, a Task subagent with a root of its own) its own; a compaction
    agent or a branch its session's main thread's."""
    t = pl.DataFrame({"session_id": SID, "thread_id": ["main", "agent-abc", "agent-acompact-1", "branch-12ab",
                                                          "sidechain-6340ddef"]})
    t = t.with_columns(thread_key=pl.when(pl.col("thread_id") == "main").then(pl.col("session_id"))
                       .otherwise(pl.col("session_id") + "--" + pl.col("thread_id")))
    got = dict(zip(t["thread_id"], t.select(calibrate.owner_expr()).to_series(), strict=True))
    assert got == {"main": SID, "agent-abc": f"{SID}--agent-abc", "agent-acompact-1": SID, "branch-12ab": SID,
                   "sidechain-6340ddef": f"{SID}--sidechain-6340ddef"}
