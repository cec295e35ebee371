"""Recorded cache breaks: each cause, its order, tokens; classes and per-session figures."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import polars as pl
import pytest

from ctxreplay.pipeline.cost import breaks

T0 = datetime(2026, 2, 10, 12, 0, tzinfo=UTC)
OPUS, HAIKU = "claude-opus-4-6", "claude-haiku-4-5-20251001"


def frame(rows: list[dict[str, Any]]) -> pl.DataFrame:
    """One thread; each row: t (s), read, write (5m unless w1), model, seg, strip, turn (a new user
    turn; default: strip), pre, and the server's diagnosis: reason, missed."""
    out = []
    for k, r in enumerate(rows):
        w1 = r.get("w1", False)
        out.append({"session_id": "s", "thread_id": "main", "thread_key": "s", "call": k, "is_pending": False,
                    "timestamp": T0 + timedelta(seconds=r["t"]), "model": r.get("model", OPUS),
                    "recorded_input_tokens": 1, "recorded_output_tokens": 10, "recorded_cache_read_tokens": r["read"],
                    "recorded_cache_write_tokens": r["write"],
                    "recorded_cache_write_5m_tokens": 0 if w1 else r["write"],
                    "recorded_cache_write_1h_tokens": r["write"] if w1 else 0,
                    "segment": r.get("seg", 0), "recorded_strip": r.get("strip", False),
                    "recorded_turn": r.get("turn", r.get("strip", False)),
                    "recorded_miss_reason": r.get("reason"), "recorded_missed_tokens": r.get("missed"),
                    "preamble_tokens": r.get("pre", 20000)})
    return pl.DataFrame(out, schema_overrides={"call": pl.Int32, "segment": pl.Int32, "recorded_miss_reason": pl.String,
                                               "recorded_missed_tokens": pl.Int64})


def causes(rows: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    out = breaks.recorded_breaks(frame(rows)).sort("call")
    return list(zip(out["recorded_break_cause"].to_list(), out["recorded_break_tokens"].to_list(),
                    out["recorded_break_detail"].to_list(), strict=True))


def test_incremental_reads_are_not_breaks_and_more_is_not_a_break() -> None:
    got = causes([{"t": 0, "read": 17000, "write": 9000}, {"t": 10, "read": 26000, "write": 500},
                  {"t": 20, "read": 26600, "write": 300}])          # 100 more than cached: a concurrent write
    assert [c for c, _, _ in got] == [None, None, None]


def test_each_cause_in_order() -> None:
    got = causes([
        {"t": 0, "read": 17000, "write": 9000},
        {"t": 10, "read": 0, "write": 26500, "model": HAIKU},                       # model switch
        {"t": 20, "read": 26500, "write": 500, "model": HAIKU},
        {"t": 321, "read": 0, "write": 27500, "model": HAIKU},                      # idle 301 s > 5m
        {"t": 330, "read": 21000, "write": 9000, "model": HAIKU, "seg": 1},          # compaction
        {"t": 340, "read": 21000, "write": 9500, "model": HAIKU, "seg": 1, "strip": True},   # thinking strip
        {"t": 350, "read": 19000, "write": 12000, "model": HAIKU, "seg": 1},         # fell into the preamble
        {"t": 360, "read": 25000, "write": 7000, "model": HAIKU, "seg": 1},          # inside the messages
    ])
    assert [c for c, _, _ in got] == [None, "model_switch", None, "ttl_expiry", "compaction", "thinking_strip",
                                      "preamble", "unexplained"]
    assert [n for _, n, _ in got][1:] == [26000, None, 27000, 6500, 9000, 11500, 6000]
    assert got[1][2] == f"{OPUS} -> {HAIKU}; also preamble"
    assert got[3][2] == "idle 301 s > TTL 5m; also preamble"
    assert got[7][2] is None


def test_ttl_follows_the_recorded_split_both_sides() -> None:
    base = [{"t": 0, "read": 17000, "write": 9000, "w1": True}]
    assert causes([*base, {"t": 3599, "read": 26000, "write": 10}])[1][0] is None
    assert causes([*base, {"t": 3601, "read": 0, "write": 26010}])[1][0] == "ttl_expiry"
    base5 = [{"t": 0, "read": 17000, "write": 9000}]
    assert causes([*base5, {"t": 299, "read": 0, "write": 26010}])[1][0] == "preamble"
    assert causes([*base5, {"t": 301, "read": 0, "write": 26010}])[1][0] == "ttl_expiry"


def test_classes_agreement_and_sessions() -> None:
    c = breaks.recorded_breaks(frame([{"t": 0, "read": 17000, "write": 9000}, {"t": 10, "read": 26000, "write": 500},
                                      {"t": 400, "read": 0, "write": 26600}]))
    c = c.with_columns(sim_cache_read_tokens=pl.Series([0, 26000, 26500]), sim_cache_write_5m_tokens=pl.Series([26000, 500, 600]),
                       sim_cache_write_1h_tokens=pl.lit(0), sim_input_tokens=pl.lit(1),
                       recorded_cost_usd=pl.lit(1.0), sim_cost_usd=pl.lit(0.5), sim_break_cause=pl.lit(None, pl.String),
                       sim_break_detail=pl.lit(None, pl.String), sim_break_tokens=pl.lit(None, pl.Int64),
                       recorded_break_cost_usd=pl.Series([None, None, 0.25]), sim_break_cost_usd=pl.lit(None, pl.Float64))
    cl = breaks.classify(c).sort("call")
    assert cl["rec_class"].to_list() == ["warm", "hit", "break"]
    assert cl["sim_class"].to_list() == ["cold", "hit", "hit"]
    assert cl["agree"].to_list() == [False, True, False]
    s = breaks.sessions(c).row(0, named=True)
    assert s["calls"] == 3 and s["agree"] == 1 and s["rec_breaks"] == 1 and s["sim_breaks"] == 0
    assert s["rec_break_share"] == 0.25 / 3
    assert s["read_diff"] == 52500 / 43000 - 1.0
    by = breaks.by_cause(c)
    assert by["recorded"]["ttl_expiry"]["breaks"] == 1 and by["recorded"]["unexplained_share"] == 0.0


def test_automatic_caching_misses_are_best_effort_and_count_the_uncached_input() -> None:
    rows = [{"t": 0, "read": 0, "write": 0, "model": "gpt-5.1-codex-max"},
            {"t": 10, "read": 4096, "write": 0, "model": "gpt-5.1-codex-max"},
            {"t": 20, "read": 1024, "write": 0, "model": "gpt-5.1-codex-max"}]
    f = frame(rows).with_columns(recorded_input_tokens=pl.Series([5000, 1000, 3500]))
    out = breaks.recorded_breaks(f).sort("call")
    assert out["recorded_break_cause"].to_list() == [None, None, "best_effort"]
    assert out["recorded_break_tokens"][2] == 4096 - 1024      # the lost prefix, cached again as input


def test_a_tool_loop_step_that_reads_only_the_previous_read_is_an_eviction() -> None:
    """The previous request's own write was not kept: the next step of the tool loop (which only
    appends to it) reads exactly what it read (Anthropic says previous_message_not_found). A new
    user turn reading the same is a change of the messages: the agent sent the tail changed."""
    base = [{"t": 0, "read": 17000, "write": 9000}, {"t": 5, "read": 26000, "write": 800}]
    assert causes([*base, {"t": 10, "read": 26000, "write": 1500}])[2][:2] == ("eviction", 800)
    assert causes([*base, {"t": 10, "read": 26000, "write": 1500, "turn": True}])[2][0] == "messages_change"
    # a thinking strip that falls back to the same place stays a thinking strip
    assert causes([*base, {"t": 10, "read": 26000, "write": 1500, "strip": True}])[2][0] == "thinking_strip"
    # other providers: automatic caching is best effort
    oa = [{**r, "model": "gpt-5.4"} for r in [*base, {"t": 10, "read": 26000, "write": 1500}]]
    assert causes(oa)[2][0] == "best_effort"


def test_a_new_turn_that_reads_less_inside_the_messages_is_a_messages_change() -> None:
    """A new user turn only appends the last answer and the user's message: reading less than the
    previous request cached, past the preamble, where no thinking strip holds, means an earlier
    message was sent changed (02fb0004, 49dcea81: a PostToolUse hook's context dropped at the next
    turn; the server says messages_changed). Not in a step of the tool loop, not at or before the
    preamble's end, not where a strip holds, not on a provider with automatic caching."""
    base = [{"t": 0, "read": 17000, "write": 9000}, {"t": 5, "read": 26000, "write": 800}]
    turn = {"t": 10, "read": 24000, "write": 3500, "turn": True}
    got = causes([*base, turn])[2]
    assert got[:2] == ("messages_change", 2800)
    assert got[2] == "a new turn read 24000 of the 26800 cached: an earlier message was sent changed"
    assert causes([*base, {**turn, "turn": False}])[2][0] == "unexplained"
    assert causes([*base, {**turn, "read": 20000}])[2][0] == "preamble"          # pre 20000
    assert causes([*base, {**turn, "read": 20001}])[2][0] == "messages_change"
    assert causes([*base, {**turn, "strip": True}])[2][0] == "thinking_strip"
    oa = [{**r, "model": "gpt-5.4"} for r in [*base, turn]]
    assert causes(oa)[2][0] == "best_effort"


def test_the_preamble_is_at_most_its_segments_first_request() -> None:
    """The fit's preamble estimate can exceed the first request it is part of: a read past that
    request's whole prompt is inside the messages (49dcea81 call 4: preamble 50,386, first request
    44,781, read 47,999), while one at or below it stays a preamble change."""
    base = [{"t": 0, "read": 0, "write": 30000, "pre": 40000}, {"t": 5, "read": 30000, "write": 800, "pre": 40000}]
    assert causes([*base, {"t": 10, "read": 30002, "write": 900, "pre": 40000, "turn": True}])[2][0] == "messages_change"
    assert causes([*base, {"t": 10, "read": 30001, "write": 900, "pre": 40000, "turn": True}])[2][0] == "preamble"
    got = causes([*base, {"t": 10, "read": 30000, "write": 900, "pre": 40000}])[2]
    assert got[0] == "preamble" and got[2].startswith("read 30000 <= preamble 30001")


SERVER = [  # (the server's reason, what the usage alone shows at the break, cause, inferred cause, detail begins)
    ("system_changed", {"strip": True}, "preamble", "thinking_strip", "system prompt changed; server: system_changed"),
    ("tools_changed", {"read": 18000}, "preamble", "preamble", "tools changed; read 18000 <= preamble 20000"),
    ("model_changed", {"model": HAIKU}, "model_switch", "model_switch", f"{OPUS} -> {HAIKU}; server"),
    ("model_changed", {}, "model_switch", "unexplained", f"{OPUS} -> {OPUS}; server: model_changed"),
    ("previous_message_not_found", {"t": 3610}, "ttl_expiry", "ttl_expiry", "idle 3610 s > TTL 1h; server: previous_message_not_found"),
    ("previous_message_not_found", {}, "eviction", "unexplained",
     "the previous request's cache entry is gone; server: previous_message_not_found; inferred unexplained"),
    ("messages_changed", {"strip": True}, "thinking_strip", "thinking_strip", "server: messages_changed, 30000 tokens"),
    ("messages_changed", {"seg": 1}, "compaction", "compaction", "server: messages_changed"),
    ("messages_changed", {"read": 19000}, "messages_change", "preamble",
     "server: messages_changed, 30000 tokens missed; inferred preamble"),
    ("unavailable", {}, "provider_miss", "unexplained", "server: unavailable; inferred unexplained"),
    ("unavailable", {"seg": 1}, "compaction", "compaction", "server: unavailable"),
    ("a_type_from_2027", {"strip": True}, "thinking_strip", "thinking_strip", "server: a_type_from_2027"),
    (None, {"strip": True}, "thinking_strip", "thinking_strip", None),
]


@pytest.mark.parametrize(("reason", "shows", "cause", "inferred", "detail"), SERVER)
def test_the_servers_diagnosis_names_the_cause(reason: str | None, shows: dict[str, Any], cause: str, inferred: str,
                                               detail: str | None) -> None:
    """Where the answer records the server's cache diagnosis, it names the recorded break's cause;
    recorded_break_inferred_cause keeps our own inference from the transcript and usage alone."""
    missed = 30000 if (reason or "").endswith("_changed") else None   # the changed kinds carry it
    brk = {"t": 10, "read": 21000, "write": 9000, "reason": reason, "missed": missed, "w1": True, **shows}
    brk["t"] = shows.get("t", 10)
    out = breaks.recorded_breaks(frame([{"t": 0, "read": 17000, "write": 9000, "w1": True}, brk])).sort("call")
    r = out.row(1, named=True)
    assert (r["recorded_break_cause"], r["recorded_break_inferred_cause"]) == (cause, inferred)
    assert (r["recorded_break_detail"] or "").startswith(detail or "") if detail else r["recorded_break_detail"] is None
    assert breaks.recorded_breaks(frame([{"t": 0, "read": 17000, "write": 9000, "w1": True}, brk]), use_server=False) \
        .sort("call")["recorded_break_cause"][1] == inferred


def test_a_diagnosis_without_a_shortfall_is_no_break() -> None:
    """The diagnosis compares request structures, not the cache: a call that read the whole
    previous prefix is no break whatever the server says."""
    out = causes([{"t": 0, "read": 17000, "write": 9000}, {"t": 5, "read": 26000, "write": 500, "reason": "unavailable"}])
    assert out[1][0] is None


def test_calls_without_usage_are_counted_apart_not_compared() -> None:
    """A call whose answer recorded no usage (missing, or all zero: a model or proxy that reports
    none) has nothing to compare the simulation with: classify leaves it out, sessions counts it as
    no_usage (a session of such calls only is listed with calls 0), and no model becomes unpriced."""
    rows = [{"t": 0, "read": 17000, "write": 9000}, {"t": 10, "read": 26000, "write": 500},
            {"t": 20, "read": 0, "write": 0}]
    c = breaks.recorded_breaks(frame(rows))
    c = c.with_columns(recorded_input_tokens=pl.Series([1, 1, 0]), recorded_output_tokens=pl.Series([10, 10, 0]))
    other = c.filter(pl.col("call") == 2).with_columns(session_id=pl.lit("t"), thread_key=pl.lit("t"),
                                                       recorded_cache_read_tokens=pl.lit(None, pl.Int64),
                                                       recorded_input_tokens=pl.lit(None, pl.Int64),
                                                       recorded_output_tokens=pl.lit(None, pl.Int64))
    c = pl.concat([c, other]).with_columns(
        sim_cache_read_tokens=pl.lit(20000, pl.Int64), sim_cache_write_5m_tokens=pl.lit(600, pl.Int64),
        sim_cache_write_1h_tokens=pl.lit(0, pl.Int64), sim_input_tokens=pl.lit(1, pl.Int64),
        recorded_cost_usd=pl.when(breaks.has_usage()).then(pl.lit(1.0)), sim_cost_usd=pl.lit(1.0),
        sim_break_cause=pl.lit(None, pl.String), sim_break_detail=pl.lit(None, pl.String),
        sim_break_tokens=pl.lit(None, pl.Int64), recorded_break_cost_usd=pl.lit(None, pl.Float64),
        sim_break_cost_usd=pl.lit(None, pl.Float64))
    assert breaks.classify(c)["call"].sort().to_list() == [0, 1]
    s = {r["session_id"]: r for r in breaks.sessions(c).to_dicts()}
    assert (s["s"]["calls"], s["s"]["no_usage"], s["s"]["unpriced"], s["s"]["rec_read"]) == (2, 1, 0, 43000)
    assert (s["t"]["calls"], s["t"]["no_usage"], s["t"]["rec_breaks"], s["t"]["agreement"]) == (0, 1, 0, None)
    doc = breaks.sim_view(c, {})
    assert (doc["totals"]["calls"], doc["totals"]["no_usage"]) == (2, 2)


@pytest.mark.parametrize(("model", "floor"), [("gpt-5.4", 1024), ("gemini-2.5-pro", 2048), ("qwen3.5-plus", 1024)])
def test_automatic_caching_a_prompt_at_its_minimum_that_read_nothing_missed(model: str, floor: int) -> None:
    """Writes are free (not reported) with automatic caching: a call that read nothing is a miss
    when its prompt reached the model's minimum, and no break below it (it could not be cached)."""
    def run(prompt: int) -> list[Any]:
        f = frame([{"t": 0, "read": 0, "write": 0, "model": model}, {"t": 10, "read": 3000, "write": 0, "model": model},
                   {"t": 20, "read": 0, "write": 0, "model": model}])
        f = f.with_columns(recorded_input_tokens=pl.Series([4000, 500, prompt]))
        return breaks.recorded_breaks(f).sort("call")["recorded_break_cause"].to_list()

    assert run(floor) == [None, None, "best_effort"]
    assert run(floor - 1) == [None, None, None]


def test_anthropic_a_call_that_neither_read_nor_wrote_is_still_no_break() -> None:
    f = frame([{"t": 0, "read": 17000, "write": 9000}, {"t": 10, "read": 0, "write": 0}])
    f = f.with_columns(recorded_input_tokens=pl.Series([1, 30000]))
    assert breaks.recorded_breaks(f).sort("call")["recorded_break_cause"].to_list() == [None, None]


@pytest.mark.parametrize(("keeps", "cause"), [(None, "thinking_strip"), (True, "thinking_strip"), (False, "preamble")])
def test_a_thread_that_keeps_its_thinking_has_no_thinking_strip(keeps: bool | None, cause: str) -> None:
    """A new turn after thinking is a strip only where the thread strips (the calibration's
    `strips_thinking`; unknown: it may); otherwise the next cause that holds names the break."""
    f = frame([{"t": 0, "read": 17000, "write": 9000}, {"t": 10, "read": 7000, "write": 20000, "strip": True}])
    if keeps is not None:
        f = f.with_columns(strips_thinking=pl.lit(keeps))
    assert breaks.recorded_breaks(f).sort("call")["recorded_break_cause"].to_list() == [None, cause]
