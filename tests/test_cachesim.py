"""The cache simulator's rules, each on small synthetic call sequences (both sides of every threshold)."""

from __future__ import annotations

from array import array
from datetime import UTC, datetime, timedelta
from typing import Any

import polars as pl
import pytest

from ctxreplay.pipeline.cost import calibrate
from ctxreplay.pipeline.cost.cachesim import (
    CacheState,
    Policy,
    Prepared,
    SimError,
    SimStore,
    min_cacheable_tokens,
    simulate,
)

T0 = datetime(2026, 2, 10, 12, 0, tzinfo=UTC)
SONNET = "claude-sonnet-4-5-20250929"   # minimum cacheable prompt 1,024
OPUS = "claude-opus-4-6"                # 4,096
SID = "11111111-0000-4000-8000-000000000001"
SID2 = "22222222-0000-4000-8000-000000000002"

CALL_SCHEMA = {
    "session_id": pl.String, "thread_id": pl.String, "thread_key": pl.String, "call": pl.Int32,
    "is_pending": pl.Boolean, "timestamp": pl.Datetime("ms", "UTC"), "model": pl.String, "prompt_tokens": pl.Int64,
    "recorded_input_tokens": pl.Int64, "recorded_output_tokens": pl.Int64, "recorded_cache_read_tokens": pl.Int64,
    "recorded_cache_write_tokens": pl.Int64, "recorded_cache_write_5m_tokens": pl.Int64,
    "recorded_cache_write_1h_tokens": pl.Int64, "segment": pl.Int32, "strip": pl.Boolean,
    "answer": pl.Datetime("ms", "UTC"),
}


def tool_result(tid: str, text: str) -> dict[str, Any]:
    return {"content": text, "tool_use_id": tid, "type": "tool_result"}


def canon(content: list[dict[str, Any]], role: str = "user") -> bytes:
    import orjson

    return orjson.dumps({"content": content, "role": role}, option=orjson.OPT_SORT_KEYS)


class Scenario:
    """Threads as per-call message lists (the last list is the pending call), their call times and
    a fixed calibration (ratio 1, no preamble unless given): positions are our own token counts."""

    def __init__(self) -> None:
        self.msgs: dict[str, dict[str, Any]] = {}
        self.lists: dict[str, list[list[str]]] = {}
        self.rows: list[dict[str, Any]] = []
        self.cal: list[dict[str, Any]] = []

    def msg(self, name: str, tokens: int, blocks: int = 1, **kw: Any) -> str:
        self.msgs[name] = {"tokens": tokens, "blocks": blocks, **kw}
        return name

    def thread(self, session: str, thread_id: str, lists: list[list[str]], times: list[float], *,
               models: str | list[str] = SONNET, answers: list[float | None] | None = None,
               segments: list[int] | None = None, strips: list[bool] | None = None,
               usage: list[dict[str, int] | None] | None = None, **cal: Any) -> str:
        key = session if thread_id == "main" else f"{session}--{thread_id}"
        assert len(lists) == len(times) + 1, "one list per recorded call, plus the pending one"
        self.lists[key] = lists
        for k, names in enumerate(lists):
            pending = k == len(times)
            t = times[k] if not pending else times[-1]
            u = (usage[k] if usage and not pending else None) or {}
            model = models if isinstance(models, str) else models[min(k, len(models) - 1)]
            ans = answers[k] if answers and not pending else None
            self.rows.append({
                "session_id": session, "thread_id": thread_id, "thread_key": key, "call": k, "is_pending": pending,
                "timestamp": T0 + timedelta(seconds=t), "model": model,
                "prompt_tokens": 3 + sum(self.msgs[n]["tokens"] + 3 for n in names),
                "recorded_input_tokens": u.get("input"), "recorded_output_tokens": u.get("output", 10),
                "recorded_cache_read_tokens": u.get("read"), "recorded_cache_write_tokens": u.get("write"),
                "recorded_cache_write_5m_tokens": u.get("w5"), "recorded_cache_write_1h_tokens": u.get("w1"),
                "segment": segments[min(k, len(segments) - 1)] if segments else 0,
                "strip": strips[k] if strips and not pending else False,
                "answer": T0 + timedelta(seconds=ans) if ans is not None else None,
            })
        self.cal.append({"thread_key": key, "session_id": session, "thread_id": thread_id, **cal})
        return key

    def calls(self) -> pl.DataFrame:
        return pl.DataFrame(self.rows, schema=CALL_SCHEMA)

    def run(self, policy: Policy | None = None, *, decisions: pl.DataFrame | None = None, prices: Any = None,
            state: CacheState | None = None, aliases: dict[str, str] | None = None,
            absorbed: bool = False) -> pl.DataFrame:
        calls = self.calls()
        store = SimStore.from_lists(self.lists, self.msgs)
        if absorbed:  # as the runner keeps it: no bytes, the `extends` answers taken per batch
            whole, store = store, SimStore()
            store.absorb(whole, calls)
            assert all(d is None for d in store.data)
        prep = Prepared.for_calls(calls, calibrate.fixed(self.cal), segment="segment", recorded_strip="strip",
                                  answer_timestamp="answer")
        out = simulate(calls.drop("segment", "strip", "answer"), store, prep, decisions=decisions, prices=prices,
                       policy=policy, state=state, aliases=aliases).calls
        return out.sort("thread_key", "call")


def row(df: pl.DataFrame, call: int, key: str | None = None) -> dict[str, Any]:
    d = df.filter(pl.col("call") == call)
    if key is not None:
        d = d.filter(pl.col("thread_key") == key)
    assert d.height == 1
    return d.row(0, named=True)


def end(*tokens: int) -> int:
    """The position of the end of messages with these token counts (request + message overheads)."""
    return 3 + sum(t + 3 for t in tokens)


def two_calls(gap: float, **kw: Any) -> tuple[Scenario, str]:
    s = Scenario()
    s.msg("u0", 2000)
    s.msg("a0", 50)
    s.msg("u1", 300)
    s.msg("a1", 40)
    key = s.thread(SID, "main", [["u0"], ["u0", "a0", "u1"], ["u0", "a0", "u1", "a1"]], [0, gap], **kw)
    return s, key


# --------------------------------------------------------------------------------------------- TTL


@pytest.mark.parametrize(("gap", "ttl", "hit"), [(299, "5m", True), (301, "5m", False),
                                                 (3599, "1h", True), (3601, "1h", False)])
def test_ttl_boundary_both_sides(gap: float, ttl: str, hit: bool) -> None:
    s, _ = two_calls(gap)
    out = s.run(Policy(ttl=ttl))
    r = row(out, 1)
    if hit:
        assert r["sim_cache_read_tokens"] == end(2000)
        assert r["sim_break_cause"] is None
    else:
        assert r["sim_cache_read_tokens"] == 0
        assert r["sim_break_cause"] == "ttl_expiry"
        assert r["sim_break_tokens"] == end(2000)
    assert r["sim_cache_read_tokens"] + r["sim_cache_write_5m_tokens"] + r["sim_cache_write_1h_tokens"] \
        + r["sim_input_tokens"] == r["calibrated_prompt_tokens"] == end(2000, 50, 300)
    # the write goes to the TTL's column
    w = "sim_cache_write_1h_tokens" if ttl == "1h" else "sim_cache_write_5m_tokens"
    assert r[w] > 0 and r["sim_cache_write_1h_tokens" if ttl == "5m" else "sim_cache_write_5m_tokens"] == 0


def test_ttl_from_the_recorded_split_else_the_default() -> None:
    # call 0 recorded a 1-hour write: the entry lives an hour; with no split, the default 5 minutes
    s, _ = two_calls(1000, usage=[{"input": 3, "read": 0, "write": 2000, "w5": 0, "w1": 2000}, None])
    assert row(s.run(), 1)["sim_cache_read_tokens"] == end(2000)
    s, _ = two_calls(1000)
    assert row(s.run(), 1)["sim_break_cause"] == "ttl_expiry"
    s, _ = two_calls(1000)
    assert row(s.run(Policy(default_ttl="1h")), 1)["sim_break_cause"] is None


def test_a_hit_refreshes_the_entry() -> None:
    # u0's entry, written at 0 for 5 minutes, is read at 200 (refreshed to 500) and again at 450
    s = Scenario()
    for name, tok in (("u0", 2000), ("a0", 50), ("u1", 300), ("b0", 60), ("u2", 200), ("a2", 10)):
        s.msg(name, tok)
    s.thread(SID, "main", [["u0"], ["u0", "a0", "u1"], ["u0", "b0", "u2"], ["u0", "b0", "u2", "a2"]], [0, 200, 450])
    out = s.run()
    assert row(out, 1)["sim_cache_read_tokens"] == end(2000)
    assert row(out, 2)["sim_cache_read_tokens"] == end(2000)
    s2 = Scenario()
    s2.msgs = s.msgs
    s2.thread(SID, "main", [["u0"], ["u0", "b0", "u2"], ["u0", "b0", "u2", "a2"]], [0, 450])
    assert row(s2.run(), 1)["sim_cache_read_tokens"] == 0


# ------------------------------------------------------------------------------ minimum cacheable length


@pytest.mark.parametrize(("model", "tokens", "cached"), [
    (SONNET, 1017, False), (SONNET, 1018, True),          # prompt 1,023 / 1,024
    (OPUS, 4089, False), (OPUS, 4090, True),              # prompt 4,095 / 4,096
])
def test_minimum_cacheable_length_both_sides(model: str, tokens: int, cached: bool) -> None:
    s = Scenario()
    s.msg("u0", tokens)
    s.msg("a0", 5)
    s.msg("u1", 5)
    s.thread(SID, "main", [["u0"], ["u0", "a0", "u1"], ["u0", "a0", "u1"]], [0, 10], models=model)
    out = s.run()
    r0, r1 = row(out, 0), row(out, 1)
    assert r0["calibrated_prompt_tokens"] == end(tokens)
    if cached:
        assert r0["sim_cache_write_5m_tokens"] == end(tokens) and r0["sim_input_tokens"] == 0
        assert r1["sim_cache_read_tokens"] == end(tokens)
    else:
        assert r0["sim_cache_write_5m_tokens"] == 0 and r0["sim_input_tokens"] == end(tokens)
        assert r0["sim_cache_read_tokens"] == 0 == r1["sim_cache_read_tokens"]


def test_minimum_cacheable_length_per_model() -> None:
    assert min_cacheable_tokens("claude-opus-4-6", "anthropic") == 4096
    assert min_cacheable_tokens("claude-haiku-4-5-20251001", "anthropic") == 4096
    assert min_cacheable_tokens("claude-sonnet-4-6", "anthropic") == 2048
    assert min_cacheable_tokens("claude-sonnet-4-5-20250929", "anthropic") == 1024
    assert min_cacheable_tokens("claude-opus-5", "anthropic") == 512
    assert min_cacheable_tokens("gpt-4o", "openai") == 1024
    assert min_cacheable_tokens("gemini-2.5-flash", "gemini") == 2048
    assert min_cacheable_tokens("gemini-3.1-pro-preview", "gemini") == 4096


# ----------------------------------------------------------------------------------------- breakpoints


def test_at_most_four_breakpoints() -> None:
    Policy(breakpoints=("shared", "system", "last", "last"))
    with pytest.raises(SimError, match="at most 4"):
        Policy(breakpoints=("shared", "system", "last", "last", "last"))
    with pytest.raises(SimError, match="unknown breakpoint"):
        Policy(breakpoints=("tools",))


def test_breakpoints_where_the_agent_puts_them() -> None:
    # a 3,000-token system prompt (preamble 3,000, system breakpoint at its end)
    def run(bps: tuple[str, ...]) -> dict[str, Any]:
        s, _ = two_calls(10, preamble_tokens=3000, system_tokens=3000)
        return row(s.run(Policy(breakpoints=bps)), 1)

    assert run(("system", "last"))["sim_cache_read_tokens"] == 3000 + end(2000)
    assert run(("system",))["sim_cache_read_tokens"] == 3000          # only the system prompt is cached
    r = run(("system",))
    assert r["sim_input_tokens"] == end(2000, 50, 300)
    assert run(())["sim_cache_read_tokens"] == 0


# ----------------------------------------------------------------------------------------- lookback


@pytest.mark.parametrize(("blocks", "hit"), [(19, True), (20, False)])
def test_twenty_block_lookback_both_sides(blocks: int, hit: bool) -> None:
    # call 1 appends an answer of `blocks` blocks and a one-block tool result: the last breakpoint
    # sits blocks + 1 blocks after the prefix call 0 cached
    s = Scenario()
    s.msg("u0", 2000)
    s.msg("a0", 400, blocks=blocks)
    s.msg("u1", 300)
    s.msg("a1", 10)
    s.thread(SID, "main", [["u0"], ["u0", "a0", "u1"], ["u0", "a0", "u1", "a1"]], [0, 10],
             preamble_tokens=1500, system_tokens=1500)
    r = row(s.run(), 1)
    if hit:
        assert r["sim_cache_read_tokens"] == 1500 + end(2000) and r["sim_break_cause"] is None
    else:   # the system breakpoint still reads the system prompt
        assert r["sim_cache_read_tokens"] == 1500
        assert r["sim_break_cause"] == "lookback"
        assert "21 blocks" in r["sim_break_detail"]


@pytest.mark.parametrize("absorbed", [False, True])
def test_a_message_extended_by_blocks_keeps_its_old_end_as_a_boundary(absorbed: bool) -> None:
    # the last tool result of call 1 gets text appended in call 2 (an interruption): the prefix
    # cached at the end of the tool result is still a block boundary inside the new message;
    # the same in a store that kept no bytes (SimStore.absorb, the runner's)
    s = Scenario()
    tr = [tool_result("t1", "x" * 40)]
    s.msg("u0", 2000, data=canon([{"text": "do it", "type": "text"}]), real_user=True)
    s.msg("a0", 50)
    s.msg("u1", 300, data=canon(tr))
    s.msg("u1x", 320, blocks=2, data=canon([*tr, {"text": "stop", "type": "text"}]))
    s.msg("u1y", 320, blocks=2, data=canon([tool_result("t1", "y" * 40), {"text": "stop", "type": "text"}]))
    s.msg("a2", 5)
    s.thread(SID, "main", [["u0"], ["u0", "a0", "u1"], ["u0", "a0", "u1x"], ["u0", "a0", "u1x", "a2"]], [0, 10, 20])
    r = row(s.run(absorbed=absorbed), 2)
    assert r["sim_break_cause"] is None
    assert r["sim_cache_read_tokens"] == end(2000, 50, 300)
    # a rewritten (not extended) message: the prefix breaks before it
    s.lists[SID][2] = ["u0", "a0", "u1y"]
    s.lists[SID][3] = ["u0", "a0", "u1y", "a2"]
    r = row(s.run(absorbed=absorbed), 2)
    assert r["sim_break_cause"] == "unexplained"
    assert r["sim_cache_read_tokens"] == end(2000)


def test_a_store_takes_each_thread_once() -> None:
    s, _ = two_calls(10)
    part = SimStore.from_lists(s.lists, s.msgs)
    store = SimStore()
    store.absorb(part, s.calls())
    with pytest.raises(SimError, match="two batches"):
        store.absorb(SimStore.from_lists(s.lists, s.msgs), s.calls())


# ------------------------------------------------------------------------------------- concurrency


@pytest.mark.parametrize(("start", "reads"), [(5, False), (15, True)])
def test_a_write_is_readable_only_once_its_answer_starts(start: float, reads: bool) -> None:
    # two threads of one session send the same first request; A's answer starts at t = 10
    s = Scenario()
    s.msg("u0", 2000)
    s.msg("a0", 10)
    a = s.thread(SID, "main", [["u0"], ["u0", "a0"]], [0], answers=[10])
    b = s.thread(SID, "branch-1", [["u0"], ["u0", "a0"]], [start], answers=[start + 10])
    out = s.run()
    assert row(out, 0, a)["sim_cache_write_5m_tokens"] == end(2000)
    rb = row(out, 0, b)
    if reads:
        assert rb["sim_cache_read_tokens"] == end(2000) and rb["sim_cache_write_5m_tokens"] == 0
    else:   # concurrent requests both write
        assert rb["sim_cache_read_tokens"] == 0 and rb["sim_cache_write_5m_tokens"] == end(2000)


# ------------------------------------------------------------------------------------- model switch


def test_model_switch_reads_nothing_then_the_old_model_cache_again() -> None:
    s = Scenario()
    for name, tok in (("u0", 2000), ("a0", 50), ("u1", 300), ("a1", 40), ("u2", 100), ("a2", 5)):
        s.msg(name, tok)
    s.thread(SID, "main", [["u0"], ["u0", "a0", "u1"], ["u0", "a0", "u1", "a1", "u2"],
                           ["u0", "a0", "u1", "a1", "u2", "a2"]], [0, 10, 20],
             models=[OPUS, SONNET, OPUS], preamble_tokens=3000, system_tokens=3000)
    out = s.run()
    r1, r2 = row(out, 1), row(out, 2)
    assert r1["sim_cache_read_tokens"] == 0
    assert r1["sim_break_cause"] == "model_switch"
    assert r1["sim_break_detail"] == f"{OPUS} -> {SONNET}"
    assert r2["sim_break_cause"] == "model_switch"
    assert r2["sim_cache_read_tokens"] == 3000 + end(2000)   # what call 0 cached for Opus


# ------------------------------------------------------------------------- cross-session preamble


@pytest.mark.parametrize(("start", "shared_b", "read"), [(60, 1500, 1500), (400, 1500, 0), (60, 1600, 0)])
def test_sessions_share_the_common_preamble(start: float, shared_b: int, read: int) -> None:
    # two sessions of one account: a 1,500-token common preamble (tools + system), then their own
    s = Scenario()
    s.msg("x0", 2000)
    s.msg("y0", 2500)
    s.msg("z", 5)
    s.thread(SID, "main", [["x0"], ["x0", "z"]], [0], preamble_tokens=3000, shared_tokens=1500, system_tokens=2000)
    s.thread(SID2, "main", [["y0"], ["y0", "z"]], [start], preamble_tokens=3000, shared_tokens=shared_b,
             system_tokens=2000)
    out = s.run(Policy(warm_shared=False))
    assert row(out, 0, SID2)["sim_cache_read_tokens"] == read
    assert row(out, 0, SID)["sim_cache_read_tokens"] == 0
    # per session, nothing is shared
    assert row(s.run(Policy(warm_shared=False, scope="session")), 0, SID2)["sim_cache_read_tokens"] == 0


def test_shared_preamble_read_by_a_first_request_is_warm() -> None:
    # the recorded first request read its shared preamble: sessions outside the data keep it warm
    s = Scenario()
    s.msg("x0", 2000)
    s.msg("z", 5)
    s.thread(SID, "main", [["x0"], ["x0", "z"]], [0], preamble_tokens=3000, shared_tokens=1500, system_tokens=2000)
    assert row(s.run(), 0)["sim_cache_read_tokens"] == 1500
    assert row(s.run(Policy(warm_shared=False)), 0)["sim_cache_read_tokens"] == 0


# --------------------------------------------------------------------------------- thinking strip


@pytest.mark.parametrize(("real_user", "strips"), [(True, True), (False, False)])
def test_a_new_user_turn_strips_the_thinking_of_the_turn_before(real_user: bool, strips: bool) -> None:
    s = Scenario()
    s.msg("u0", 2000, real_user=True)
    s.msg("a0", 300, thinking=True)
    s.msg("u1", 200)                      # a tool result
    s.msg("a1", 40)
    s.msg("u2", 30, real_user=real_user)  # text only (a new turn), or a tool result with text
    s.msg("a2", 5)
    s.thread(SID, "main", [["u0"], ["u0", "a0", "u1"], ["u0", "a0", "u1", "a1", "u2"],
                           ["u0", "a0", "u1", "a1", "u2", "a2"]], [0, 10, 20],
             preamble_tokens=3000, system_tokens=3000)
    out = s.run()
    assert out.equals(s.run(absorbed=True))   # the flags survive a store without bytes
    r = row(out, 2)
    if strips:
        assert r["sim_break_cause"] == "thinking_strip"
        assert r["sim_cache_read_tokens"] == 3000 + end(2000)   # u0's entry, before the stripped a0
    else:
        assert r["sim_break_cause"] is None
        assert r["sim_cache_read_tokens"] == 3000 + end(2000, 300, 200)
    assert row(s.run(Policy(strip_thinking=False)), 2)["sim_break_cause"] is None


@pytest.mark.parametrize(("model", "keeps"), [
    ("claude-opus-4-5-20251101", True), ("claude-opus-4-1-20250805", False), ("claude-opus-4-20250514", False),
    ("claude-sonnet-4-6", True), ("claude-sonnet-4-5-20250929", False), ("claude-sonnet-4-20250514", False),
    ("claude-haiku-4-5-20251001", False), ("claude-haiku-5-5", True), ("claude-fable-5", True),
    ("claude-mythos-preview", True), ("claude-3-7-sonnet-20250219", False), ("anthropic/claude-opus-4-8", True),
    ("gpt-5.4", False)])
def test_which_models_keep_earlier_thinking(model: str, keeps: bool) -> None:
    """Anthropic's extended-thinking page: Opus 4.5+ and Sonnet 4.6+ keep every earlier thinking block
    by default, Sonnet 4.5 and earlier, Opus 4.1 and earlier and Haiku through 4.5 only the last
    turn's; from the 5 generation on thinking is preserved (bound to its prefix)."""
    from ctxreplay.pipeline.cost.providers import keeps_thinking

    assert keeps_thinking(model) is keeps


@pytest.mark.parametrize(("thread_id", "reads_main"), [("sidechain-6340ddef", False), ("branch-12ab34cd", True)])
def test_an_inline_sidechain_sends_a_system_prompt_of_its_own(thread_id: str, reads_main: bool) -> None:
    """Claude Code 1.0.x writes its Task subagents into the main file as sidechains, each with its own
    root and system prompt: their first request reads nothing of the main thread's (5c0375b4: the
    first sidechain wrote 12,802 and read 0, 20 s after the main thread cached its system prompt),
    while a branch of the main thread (a rewind) sends the main thread's."""
    s = Scenario()
    s.msg("m0", 500, real_user=True)
    s.msg("ma0", 40)
    s.msg("x0", 600, real_user=True)
    s.msg("xa0", 40)
    s.thread(SID, "main", [["m0"], ["m0", "ma0"]], [0], preamble_tokens=3000, system_tokens=3000)
    key = s.thread(SID, thread_id, [["x0"], ["x0", "xa0"]], [20], preamble_tokens=3000, system_tokens=3000)
    r = row(s.run(), 0, key)
    assert r["sim_cache_read_tokens"] == (3000 if reads_main else 0)


# ------------------------------------------------------------------------ compaction, layers, preamble


def test_compaction_and_layer_breaks_are_named() -> None:
    s = Scenario()
    for name, tok in (("u0", 2000), ("a0", 50), ("u1", 300), ("a1", 40), ("u1t", 20), ("sum", 500), ("a2", 5)):
        s.msg(name, tok)
    s.thread(SID, "main", [["u0"], ["u0", "a0", "u1"], ["u0", "a0", "u1t", "a1"], ["sum"], ["sum", "a2"]],
             [0, 10, 20, 30], segments=[0, 0, 0, 1], preamble_tokens=[3000, 3500], system_tokens=2000)
    dec = pl.DataFrame({"session_id": [SID], "thread_id": ["main"], "from_call": [2], "stage": ["tombstone"],
                        "action": ["tombstone"], "reason": ["stale_result"], "cache_epoch": [3]})
    out = s.run(decisions=dec)
    r2, r3 = row(out, 2), row(out, 3)
    assert r2["sim_break_cause"] == "layer"
    assert r2["sim_break_detail"] == "tombstone/tombstone:stale_result@3"
    assert r2["sim_cache_read_tokens"] == 3000 + end(2000)       # call 0's entry: u1 was rewritten
    assert r3["sim_break_cause"] == "compaction"
    assert r3["sim_cache_read_tokens"] == 2000                   # the system prompt
    assert r3["preamble_tokens"] == 3500


# ------------------------------------------------------------------------------- OpenAI, Gemini


@pytest.mark.parametrize(("model", "fee"), [("gpt-4o", False), ("gpt-5.6-sol", True)])
def test_openai_automatic_caching_in_128_token_steps(model: str, fee: bool) -> None:
    s = Scenario()
    s.msg("u0", 1294)        # a 1,300-token prefix
    s.msg("a0", 20)
    s.msg("u1", 20)
    s.msg("v0", 994)         # a 1,000-token request: below 1,024, never cached
    s.thread(SID, "main", [["u0"], ["u0", "a0", "u1"], ["u0", "a0", "u1"]], [0, 10], models=model)
    s.thread(SID2, "main", [["v0"], ["v0", "a0", "u1"], ["v0", "a0", "u1"]], [0, 10], models=model)
    out = s.run()
    r0, r1 = row(out, 0, SID), row(out, 1, SID)
    assert r1["sim_cache_read_tokens"] == 1280                       # 1,300 rounded down to 128s
    assert r0["sim_cache_write_5m_tokens"] == (end(1294) if fee else 0)
    assert r0["sim_input_tokens"] == (0 if fee else end(1294))
    assert row(out, 1, SID2)["sim_cache_read_tokens"] == 0


def test_gemini_implicit_hit_when_the_prefix_matches() -> None:
    s = Scenario()
    s.msg("u0", 2494)
    s.msg("a0", 20)
    s.msg("u1", 20)
    s.thread(SID, "main", [["u0"], ["u0", "a0", "u1"], ["u0", "a0", "u1"]], [0, 10], models="gemini-2.5-pro")
    out = s.run()
    assert row(out, 1)["sim_cache_read_tokens"] == end(2494)
    assert row(out, 0)["sim_cache_write_5m_tokens"] == 0 and row(out, 0)["sim_input_tokens"] == end(2494)
    s2 = Scenario()
    s2.msgs = s.msgs
    s2.thread(SID, "main", [["u0"], ["u0", "a0", "u1"], ["u0", "a0", "u1"]], [0, 400], models="gemini-2.5-pro")
    assert row(s2.run(), 1)["sim_cache_read_tokens"] == 0        # gone after gemini_ttl_s


def test_an_agent_that_never_caches_is_simulated_without_cache() -> None:
    s, _ = two_calls(10, uses_cache=False)
    r = row(s.run(), 1)
    assert r["sim_cache_read_tokens"] == 0 and r["sim_cache_write_5m_tokens"] == 0
    assert r["sim_input_tokens"] == end(2000, 50, 300)


# ------------------------------------------------------------------------------ purity, state, prices


def test_simulate_is_deterministic_and_leaves_pending_calls_alone() -> None:
    s, _ = two_calls(10)
    a, b = s.run(), s.run()
    assert a.equals(b)
    pend = a.filter(pl.col("is_pending"))
    assert pend.height == 1 and pend["sim_cache_read_tokens"].null_count() == 1


def test_a_shared_state_carries_the_cache_across_calls_of_simulate() -> None:
    s1 = Scenario()
    s1.msg("u0", 2000)
    s1.msg("z", 5)
    s1.thread(SID, "main", [["u0"], ["u0", "z"]], [0])
    s2 = Scenario()          # another session: its own system prompt, so nothing to read
    s2.msgs = s1.msgs
    s2.thread(SID2, "branch-1", [["u0"], ["u0", "z"]], [30])
    s3 = Scenario()          # a branch of the same session sends the same bytes
    s3.msgs = s1.msgs
    s3.thread(SID, "branch-1", [["u0"], ["u0", "z"]], [30])
    state = CacheState()
    s1.run(state=state)
    assert row(s3.run(state=state), 0)["sim_cache_read_tokens"] == end(2000)
    assert row(s3.run(), 0)["sim_cache_read_tokens"] == 0
    assert row(s2.run(state=CacheState()), 0)["sim_cache_read_tokens"] == 0


def test_costs_from_the_price_book_and_unpriced_models_are_null() -> None:
    from ctxreplay.pipeline.cost.prices import PriceBook

    book = PriceBook.load(cache_dir=None)
    s, _ = two_calls(10, usage=[{"input": 3, "read": 0, "write": 2003, "w5": 2003, "w1": 0, "output": 100},
                                {"input": 1, "read": 2003, "write": 355, "w5": 355, "w1": 0, "output": 100}])
    out = s.run(prices=book)
    r0 = row(out, 0)
    p = book.price(SONNET, T0, r0["sim_input_tokens"], 100, r0["sim_cache_write_5m_tokens"], 0, 0)
    assert p is not None and r0["sim_cost_usd"] == pytest.approx(p.total_usd)
    q = book.price(SONNET, T0, 3, 100, 2003, 0, 0)
    assert q is not None and r0["recorded_cost_usd"] == pytest.approx(q.total_usd)
    s2, _ = two_calls(10, models="no-such-model-xyz", usage=[{"input": 3, "read": 0, "write": 5, "w5": 5, "w1": 0}, None])
    out2 = s2.run(prices=book)
    assert out2.filter(~pl.col("is_pending"))["sim_cost_usd"].null_count() == 2
    assert row(out2, 0)["recorded_cost_usd"] is None


def test_break_cost_is_the_write_premium_over_a_read() -> None:
    from ctxreplay.pipeline.cost.prices import PriceBook

    book = PriceBook.load(cache_dir=None)
    s, _ = two_calls(400)      # 5-minute TTL expired: call 1 re-writes u0
    r = row(s.run(prices=book), 1)
    rates = book.rates(SONNET, T0)
    assert rates is not None
    want = end(2000) * (rates.base.cache_write_5m - rates.base.cache_read) / 1e6
    assert r["sim_break_cost_usd"] == pytest.approx(want)


def test_a_call_without_a_model_is_simulated_and_left_unpriced() -> None:
    from ctxreplay.pipeline.cost.prices import PriceBook

    s, _ = two_calls(10)
    for r in s.rows:
        r["model"] = None
    out = s.run(prices=PriceBook.load(cache_dir=None))
    r = row(out, 1)
    assert r["sim_cost_usd"] is None and r["calibrated_prompt_tokens"] == end(2000, 50, 300)


@pytest.mark.parametrize("edit", [True, False])
def test_a_cache_edit_keeps_the_prefix_and_drops_the_cleared_tokens(edit: bool) -> None:
    # call 2 clears the tool result u1 (u1c): by rewrite, the prefix breaks there; by cache edit
    # (an alias), the prefix stays cached and its cleared tokens leave it
    s = Scenario()
    for name, tok in (("u0", 2000), ("a0", 50), ("u1", 900), ("a1", 40), ("u2", 100), ("u1c", 10), ("a2", 5)):
        s.msg(name, tok)
    s.thread(SID, "main", [["u0"], ["u0", "a0", "u1"], ["u0", "a0", "u1c", "a1", "u2"],
                           ["u0", "a0", "u1c", "a1", "u2", "a2"]], [0, 10, 20])
    r = row(s.run(aliases={"u1c": "u1"} if edit else None), 2)
    if edit:
        assert r["sim_break_cause"] is None
        assert r["sim_cache_read_tokens"] == end(2000, 50, 10)
    else:
        assert r["sim_break_cause"] == "unexplained"
        assert r["sim_cache_read_tokens"] == end(2000)


def test_openai_steady_growth_is_no_break_and_an_expiry_is() -> None:
    s = Scenario()
    for name, tok in (("u0", 1500), ("a0", 90), ("u1", 200), ("a1", 60), ("u2", 120), ("a2", 5)):
        s.msg(name, tok)
    s.thread(SID, "main", [["u0"], ["u0", "a0", "u1"], ["u0", "a0", "u1", "a1", "u2"],
                           ["u0", "a0", "u1", "a1", "u2", "a2"]], [0, 10, 400], models="gpt-4.1")
    out = s.run()
    r1, r2 = row(out, 1), row(out, 2)
    assert r1["sim_cache_read_tokens"] == end(1500) // 128 * 128 and r1["sim_break_cause"] is None
    assert r2["sim_cache_read_tokens"] == 0 and r2["sim_break_cause"] == "ttl_expiry"


def _chain_store(n: int) -> SimStore:
    st = SimStore()
    for i in range(n):
        st.add_message(f"{i:064x}", tokens=10 + i % 7, n_blocks=1 + i % 3, thinking=i % 5 == 0, real_user=i % 9 == 0)
    return st


def _chain(st: SimStore, ids: list[int], steps: list[tuple[int, int]], vector_from: int,
           monkeypatch: pytest.MonkeyPatch) -> tuple[list[int], list[int], list[int]]:
    """The walk's nodes / cumulative tokens / blocks after extending it by `steps` (valid from, horizon)."""
    from ctxreplay.pipeline.cost import cachesim as cs

    monkeypatch.setattr(cs, "_VECTOR_FROM", vector_from)
    w = cs._Walk("k", cs._ThreadEvents())
    w.ids, w.base = array("q", ids), 1234567
    cols = cs._Columns(st, CacheState().gid_map(st))
    for v, horizon in steps:
        del w.nodes[v:], w.cum_tok[v:], w.cum_blk[v:]
        cs._extend_chain(w, v, len(ids), horizon, cols)
    return list(w.nodes), list(w.cum_tok), list(w.cum_blk)


@pytest.mark.parametrize("steps", [[(0, -1)], [(0, 40), (17, 40)], [(0, -1), (60, -1), (3, -1)],
                                   [(0, 200), (60, 200), (3, 200)], [(0, 150), (102, 150)], [(0, -1), (60, 90), (3, 7)]])
def test_chain_numpy_equals_python(steps: list[tuple[int, int]], monkeypatch: pytest.MonkeyPatch) -> None:
    """The message chain is the same whether an extension is computed in numpy (long ones) or in Python
    (short ones), and extending from index v gives what computing from 0 gives (same horizon)."""
    st = _chain_store(120)
    ids = [(i * 37) % 120 for i in range(150)]            # repeats: the same message at two places
    py = _chain(st, ids, steps, 10**9, monkeypatch)
    vec = _chain(st, ids, steps, 0, monkeypatch)
    assert vec == py
    if len({h for _, h in steps}) == 1:
        assert _chain(st, ids, [(0, steps[0][1])], 10**9, monkeypatch) == py      # from scratch
    nodes = py[0]
    assert len(set(nodes)) == len(nodes)                  # every prefix has its own node


def test_chain_threshold_both_sides(monkeypatch: pytest.MonkeyPatch) -> None:
    """An extension one message shorter than _VECTOR_FROM stays in Python, one of _VECTOR_FROM goes to
    numpy; both continue the chain that the other path started."""
    from ctxreplay.pipeline.cost import cachesim as cs

    st = _chain_store(200)
    ids = list(range(200))
    limit = cs._VECTOR_FROM
    ref = _chain(st, ids, [(0, -1)], 10**9, monkeypatch)
    for v in (len(ids) - limit + 1, len(ids) - limit):      # python, numpy
        got = _chain(st, ids, [(0, -1), (v, -1)], limit, monkeypatch)
        assert got == ref
    # thinking stripped before the horizon changes the nodes from the first stripped message on
    one = _chain(st, ids, [(0, 5)], 10**9, monkeypatch)[0]       # message 0 stripped
    two = _chain(st, ids, [(0, 6)], 10**9, monkeypatch)[0]       # messages 0 and 5
    assert one[0] != ref[0][0] and two[:5] == one[:5] and two[5] != one[5]


def test_layer_detail_takes_the_decisions_of_calls_after_lo_up_to_hi() -> None:
    """The break's detail names the decisions from calls lo+1 .. hi: not lo's, not hi+1's (the lookup
    bisects both ends of the sorted list)."""
    from ctxreplay.pipeline.cost.cachesim import _layer_detail

    decs = sorted([(3, "a/x:r@1"), (4, "b/x:r@2"), (6, "c/x:r@3"), (6, "d/x:r@3"), (7, "e/x:r@4")])
    assert _layer_detail(decs, 3, 6) == "b/x:r@2, c/x:r@3, d/x:r@3"
    assert _layer_detail(decs, 2, 3) == "a/x:r@1"
    assert _layer_detail(decs, 6, 7) == "e/x:r@4"
    assert _layer_detail(decs, 7, 9) is None and _layer_detail(None, 0, 9) is None
    many = [(k, f"s{k:02d}/x:r@{k}") for k in range(1, 10)]
    assert _layer_detail(many, 0, 9) == "s01/x:r@1, s02/x:r@2, s03/x:r@3 (+6 more)"


def test_chain_power_tables_grow_for_long_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    """A request longer than the first power tables (4,096 messages) grows them; the numpy chain still
    equals the Python one over the whole length."""
    from ctxreplay.pipeline.cost import cachesim as cs

    monkeypatch.setattr(cs, "_POWERS", [])
    st = _chain_store(300)
    ids = [(i * 7) % 300 for i in range(5000)]
    vec = _chain(st, ids, [(0, 2500)], 0, monkeypatch)
    assert len(cs._POWERS[0]) > 5000
    assert vec == _chain(st, ids, [(0, 2500)], 10**9, monkeypatch)


# ------------------------------------------------------------------- exogenous breaks, replayed


def _preamble_change(u0_tokens: int = 2000) -> Scenario:
    """Call 1 recorded a read that stops inside the preamble (0 here): the system prompt or the tools
    changed, which no message shows."""
    s = Scenario()
    s.msg("u0", u0_tokens)
    s.msg("a0", 50)
    s.msg("u1", 300)
    s.msg("a1", 40)
    s.thread(SID, "main", [["u0"], ["u0", "a0", "u1"], ["u0", "a0", "u1", "a1"]], [0, 10],
             usage=[{"input": 3, "read": 0, "write": end(2000) - 3},
                    {"input": 3, "read": 0, "write": end(2000, 50, 300) - 3}])
    return s


def test_a_recorded_preamble_change_breaks_the_simulation_at_that_call() -> None:
    out = _preamble_change().run()
    r = row(out, 1)
    assert r["recorded_break_cause"] == "preamble"
    assert r["sim_break_cause"] == "preamble" and r["sim_break_detail"].startswith("replayed: ")
    assert r["sim_cache_read_tokens"] == 0
    assert r["sim_cache_write_5m_tokens"] == r["calibrated_prompt_tokens"]
    # the rules alone do not see it: the whole previous request is read
    off = row(_preamble_change().run(Policy(replay_exogenous=False)), 1)
    assert off["sim_break_cause"] is None and off["sim_cache_read_tokens"] == end(2000)


@pytest.mark.parametrize("policy", [Policy(), Policy(ttl="1h"), Policy(breakpoints=("system", "last")),
                                    Policy(strip_thinking=False)])
def test_a_system_change_breaks_every_pipeline_at_the_same_call(policy: Policy) -> None:
    # another pipeline sends other messages (a layer shortened the first one): the break stays at call 1
    for s in (_preamble_change(), _preamble_change(u0_tokens=1500)):
        r = row(s.run(policy), 1)
        assert (r["sim_break_cause"], r["sim_cache_read_tokens"]) == ("preamble", 0)


def test_a_best_effort_miss_is_replayed_as_the_recorded_share_of_the_prompt() -> None:
    s = Scenario()
    for name, tok in (("u0", 3000), ("a0", 50), ("u1", 300), ("a1", 40), ("u2", 20), ("a2", 30), ("u3", 10)):
        s.msg(name, tok)
    p1, p2 = end(3000, 50, 300), end(3000, 50, 300, 40, 20)
    lists = [["u0"], ["u0", "a0", "u1"], ["u0", "a0", "u1", "a1", "u2"], ["u0", "a0", "u1", "a1", "u2", "a2", "u3"]]
    lists.append(lists[-1])
    s.thread(SID, "main", lists, [0, 10, 20, 30], models="gpt-4o",
             usage=[{"input": end(3000), "read": 0, "write": 0},
                    {"input": p1 - 2944, "read": 2944, "write": 0},            # the whole first request
                    {"input": p2 - p2 // 2, "read": p2 // 2, "write": 0},       # half: a miss
                    {"input": 3500, "read": 0, "write": 0}])                    # nothing: a miss
    out = s.run()
    r2 = row(out, 2)
    assert r2["recorded_break_cause"] == "best_effort" and r2["sim_break_cause"] == "best_effort"
    # half of the prompt, in OpenAI's 128-token steps
    assert r2["sim_cache_read_tokens"] == (r2["calibrated_prompt_tokens"] * (p2 // 2) // p2) // 128 * 128
    r3 = row(out, 3)
    assert r3["recorded_break_cause"] == "best_effort" and r3["sim_cache_read_tokens"] == 0
    off = s.run(Policy(replay_exogenous=False))
    assert row(off, 2)["sim_cache_read_tokens"] == p1 // 128 * 128
    assert row(off, 3)["sim_cache_read_tokens"] == p2 // 128 * 128


def test_after_an_idle_gap_a_preamble_the_recorded_read_covers_is_warm() -> None:
    """Other sessions of the account (outside the data) keep the shared preamble warm: after a gap
    past the TTL, the recorded read shows it, and the simulation reads it too."""
    def run(read: int) -> dict[str, Any]:
        s = Scenario()
        s.msg("u0", 2000)
        s.msg("a0", 50)
        s.msg("u1", 300)
        s.thread(SID, "main", [["u0"], ["u0", "a0", "u1"], ["u0", "a0", "u1"]], [0, 1000],
                 usage=[{"input": 3, "read": 5000, "write": end(2000)}, {"input": 3, "read": read, "write": 100}],
                 preamble=5000, shared_tokens=5000)
        return row(s.run(), 1)

    assert run(5000)["sim_cache_read_tokens"] == 5000
    assert run(4999)["sim_cache_read_tokens"] == 0


@pytest.mark.parametrize(("summarised", "broken"), [("u1", False), ("u1x", True)])
def test_a_compaction_agents_first_request_is_compared_with_its_main_threads_last(summarised: str,
                                                                                   broken: bool) -> None:
    """Claude Code's compaction agent (`agent-acompact-*`) sends the main thread's history plus its
    prompt after the main thread's last request: a history a layer changed there is a break."""
    s = Scenario()
    for name, tok in (("u0", 3000), ("a0", 50), ("u1", 300), ("u1x", 200), ("p", 40)):
        s.msg(name, tok)
    s.thread(SID, "main", [["u0"], ["u0", "a0", "u1"], ["u0", "a0", "u1"]], [0, 10])
    key = s.thread(SID, "agent-acompact-1", [["u0"], ["u0", "a0", "u1"], ["u0", "a0", summarised, "p"],
                                             ["u0", "a0", summarised, "p"]], [0, 10, 20])
    s.rows = [r for r in s.rows if not (r["thread_key"] == key and r["call"] < 2)]   # inherited calls
    r = row(s.run(), 2, key)
    assert (r["sim_break_cause"] is not None) == broken
    assert r["sim_cache_read_tokens"] == (end(3000) if broken else end(3000, 50, 300))



def test_a_call_answered_by_several_messages_takes_the_earliest_whatever_the_row_order() -> None:
    # answer_times: a call whose answer is in two messages (two msg_keys with the same first call)
    # takes the earlier one's time and API, the same in every run (it took whichever came first
    # out of a group_by: another message from run to run)
    from ctxreplay.pipeline.cost.cachesim import answer_times

    t0 = datetime(2026, 2, 4, 2, 40, tzinfo=UTC)
    rows = []
    for k in range(40):
        for j, (late, api) in enumerate([(True, "late-api"), (False, "early-api"), (True, "later-api")]):
            rows.append({"session_id": "s", "thread_id": "main", "msg_key": f"m{k:02d}-{j}", "is_call": True,
                         "first_call": k + 1, "api": api, "provider": "anthropic",
                         "timestamp": t0 + timedelta(minutes=k, seconds=(10 + j if late else 0))})
    df = pl.DataFrame(rows)
    for seed in range(5):
        got = answer_times(df.sample(fraction=1.0, shuffle=True, seed=seed))
        assert got["call"].to_list() == list(range(40))
        assert got["answer_api"].to_list() == ["early-api"] * 40
        assert got["answer_timestamp"].to_list() == [t0 + timedelta(minutes=k) for k in range(40)]
