"""A stage's quick "nothing to do" check (ctxreplay.pipeline.stageapi.quiet), against its plan.

For each stage with a check, on both sides of every threshold it reads: where the check says quiet,
the stage's plan (the check bypassed) decides nothing and returns exactly the blocks the quick path
returns (same rows, same order); one step over, the check says not quiet, and where the plan then
decides something the stage (check on) decides the same.
"""

from __future__ import annotations

import importlib
from typing import Any

import polars as pl
import pytest

from ctxreplay.pipeline.core.constants import CHARS4_COUNTER, MESSAGE_OVERHEAD_TOKENS
from ctxreplay.pipeline.core.tokens import TIKTOKEN_COUNTER, TokenCounter, row_tokens_expr
from ctxreplay.pipeline.stageapi.quiet import ask, request_tokens_max, row_tokens_bound
from ctxreplay.pipeline.stageapi.registry import StageContext, get_stage
from ctxreplay.pipeline.staging.spec import resolve_params
from ctxreplay.testkit import make_blocks, make_context, run_stage

HOUR = 3_600


def loops(n: int, *, size: int = 300, gap: float = 10, idle_before: int | None = None) -> list[dict[str, Any]]:
    """A user row, then n tool loops (call, result of `size` characters), `gap` seconds apart."""
    msgs: list[dict[str, Any]] = [{"role": "user", "text": "start", "timestamp": 0}]
    t = 10.0
    for i in range(n):
        if i == idle_before:
            t += HOUR + 5
        if i:
            msgs.append({"role": "user", "text": f"next {i}", "timestamp": t})
        msgs.append({"role": "assistant", "timestamp": t, "blocks": [
            {"type": "tool_use", "tool_use_id": f"toolu_{i}", "tool_name": "Read", "tool_input": {"p": i}}]})
        msgs.append({"role": "user", "timestamp": t + 1, "blocks": [
            {"type": "tool_result", "tool_use_id": f"toolu_{i}", "tool_name": "Read", "text": "x" * size}]})
        t += gap
    msgs.append({"role": "assistant", "text": "done", "timestamp": t})
    return msgs


def module(name: str) -> Any:
    return importlib.import_module(get_stage(name).module)


def check(name: str, blocks: pl.LazyFrame, params: dict[str, Any], ctx: StageContext) -> bool:
    st = get_stage(name)
    assert st.quiet is not None and st.quiet.check is module(name).quiet_check
    p = resolve_params(st, dict(params), where="test")
    return ask(blocks, [st.quiet.check(blocks, p, ctx)])[0]


def outputs(name: str, blocks: pl.LazyFrame, params: dict[str, Any], ctx: StageContext, checks: bool = True,
            ) -> tuple[pl.DataFrame, pl.DataFrame]:
    res = run_stage(name, blocks, params, ctx=ctx, checks=checks)
    return res.blocks.collect(), res.decisions.collect()


def agrees(name: str, blocks: pl.LazyFrame, params: dict[str, Any], ctx: StageContext) -> bool:
    """The check's answer, after asserting what it promises: quiet -> the plan decides nothing and
    leaves the blocks as the quick path does; either way the stage decides what its plan decides."""
    is_quiet = check(name, blocks, params, ctx)
    fast_blocks, fast_dec = outputs(name, blocks, params, ctx)
    plan_blocks, plan_dec = outputs(name, blocks, params, ctx, checks=False)
    assert fast_blocks.equals(plan_blocks)
    assert fast_dec.equals(plan_dec)
    if is_quiet:
        assert plan_dec.height == 0
    return is_quiet


CTX = StageContext(window_tokens=200_000)


def bound(blocks: pl.LazyFrame, ctx: StageContext = CTX) -> int:
    return int(request_tokens_max(blocks, ctx).select(pl.col("tokens").max()).collect().item())


# ---------------------------------------------------------------------------------------------
# tombstone: token trigger, idle trigger, eligible size


TOMB = {"keep_recent": 1, "clear_at_least_tokens": 1, "min_result_chars": 100}


def test_tombstone_token_trigger_both_sides() -> None:
    blocks = make_blocks(loops(8, size=2_000))
    b = bound(blocks)
    assert agrees("tombstone", blocks, {**TOMB, "trigger_idle_seconds": 0, "trigger_tokens": b}, CTX)
    assert not agrees("tombstone", blocks, {**TOMB, "trigger_idle_seconds": 0, "trigger_tokens": b - 1}, CTX)
    # far enough under the bound, the plan clears: the stage still does
    _, dec = outputs("tombstone", blocks, {**TOMB, "trigger_idle_seconds": 0, "trigger_tokens": b // 3}, CTX)
    assert dec.filter(pl.col("action") == "tombstone").height > 0


def test_tombstone_idle_trigger_both_sides() -> None:
    params = {**TOMB, "trigger_tokens": 0}
    calm = make_blocks(loops(6, gap=HOUR / 8))  # 6 loops span under an hour
    assert agrees("tombstone", calm, params, CTX)
    idle = make_blocks(loops(6, idle_before=4))
    assert not agrees("tombstone", idle, params, CTX)
    _, dec = outputs("tombstone", idle, params, CTX)
    assert set(dec.filter(pl.col("action") == "tombstone")["reason"]) == {"idle"}
    # the span itself: one second under the idle trigger is quiet, at it is not
    ts = calm.select(pl.col("timestamp").max() - pl.col("timestamp").min()).collect().item()
    span = int(ts.total_seconds())
    assert agrees("tombstone", calm, {**params, "trigger_idle_seconds": int(span) + 1}, CTX)
    assert not agrees("tombstone", calm, {**params, "trigger_idle_seconds": int(span)}, CTX)


def test_tombstone_results_too_short_to_clear_are_quiet_whatever_the_triggers() -> None:
    idle = make_blocks(loops(6, size=50, idle_before=4))  # 6 results of 50 characters, each before a user row
    params = {**TOMB, "trigger_tokens": 1}
    assert agrees("tombstone", idle, {**params, "min_result_chars": 51}, CTX)
    assert not agrees("tombstone", idle, {**params, "min_result_chars": 50}, CTX)
    _, dec = outputs("tombstone", idle, {**params, "min_result_chars": 50}, CTX)
    assert dec.filter(pl.col("action") == "tombstone").height > 0


def one_loop(n: int, size: int = 2_000, user_after: int | None = None) -> list[dict[str, Any]]:
    """One user row, then n tool loops in one tool loop (no user row between them), an idle gap
    before the last; with `user_after`, a user row after that many loops."""
    msgs: list[dict[str, Any]] = [{"role": "user", "text": "start", "timestamp": 0}]
    t = 10.0
    for i in range(n):
        if i == n - 1:
            t += HOUR + 5
        if i == user_after:
            msgs.append({"role": "user", "text": "and now", "timestamp": t})
        msgs.append({"role": "assistant", "timestamp": t, "blocks": [
            {"type": "tool_use", "tool_use_id": f"toolu_{i}", "tool_name": "Read", "tool_input": {"p": i}}]})
        msgs.append({"role": "user", "timestamp": t + 1, "blocks": [
            {"type": "tool_result", "tool_use_id": f"toolu_{i}", "tool_name": "Read", "text": "x" * size}]})
        t += 10
    msgs.append({"role": "assistant", "text": "done", "timestamp": t})
    return msgs


def test_tombstone_results_all_in_the_current_tool_loop_are_quiet_whatever_the_triggers() -> None:
    params = {**TOMB, "trigger_tokens": 1}
    assert agrees("tombstone", make_blocks(one_loop(8)), params, CTX)  # over both triggers, nothing eligible
    # a user row after the first results: they leave the tool loop, and the plan clears them
    later = make_blocks(one_loop(8, user_after=3))
    assert not agrees("tombstone", later, params, CTX)
    _, dec = outputs("tombstone", later, params, CTX)
    assert dec.filter(pl.col("action") == "tombstone").height > 0
    # the same user row before every result: the tool loop holds them all again
    assert agrees("tombstone", make_blocks(one_loop(8, user_after=0)), params, CTX)
    # a long result before the user row, the rest too short: one result is enough to be eligible
    msgs = one_loop(8, size=50, user_after=3)
    msgs[2]["blocks"][0]["text"] = "x" * 100
    assert not agrees("tombstone", make_blocks(msgs), params, CTX)
    msgs[2]["blocks"][0]["text"] = "x" * 99
    assert agrees("tombstone", make_blocks(msgs), params, CTX)


def all_rows_bound(blocks: pl.LazyFrame, ctx: StageContext = CTX) -> int:
    """Every row of the thread and every message's overhead, whether or not a request still holds it."""
    overhead = MESSAGE_OVERHEAD_TOKENS * pl.col("msg_key").n_unique()
    return int(blocks.select(row_tokens_bound(ctx).sum() + overhead).collect().item())


COMPACTED = [(13, 12)]  # at message 13 a compaction: the requests from then on start at message 12


def test_tombstone_token_trigger_both_sides_after_a_compaction() -> None:
    # the rows a compaction took away count no more: the largest request is about half of all rows,
    # and the trigger's boundary is that request's bound, not the sum of every row
    blocks = make_blocks(loops(8, size=2_000), compactions=COMPACTED)
    b = bound(blocks)
    assert b < all_rows_bound(blocks) // 2 + 100
    params = {**TOMB, "trigger_idle_seconds": 0}
    assert agrees("tombstone", blocks, {**params, "trigger_tokens": b}, CTX)
    assert not agrees("tombstone", blocks, {**params, "trigger_tokens": b - 1}, CTX)
    _, dec = outputs("tombstone", blocks, {**params, "trigger_tokens": b // 3}, CTX)
    assert dec.filter(pl.col("action") == "tombstone").height > 0


@pytest.mark.parametrize("peers", [{}, {"tombstone": {"trigger_idle_seconds": 0}}])
def test_snip_high_watermark_both_sides_after_a_compaction(peers: dict[str, Any]) -> None:
    blocks = make_blocks(chat(10), compactions=COMPACTED)
    b = bound(blocks)
    assert b < all_rows_bound(blocks) * 2 // 3
    params = {"reserve_output_tokens": 0, "high_watermark": 1.0, "low_watermark": 0.5}
    assert agrees("snip", blocks, params, make_context(window_tokens=b, peers=peers))
    assert not agrees("snip", blocks, params, make_context(window_tokens=b - 1, peers=peers))
    _, dec = outputs("snip", blocks, params, make_context(window_tokens=b // 2, peers=peers))
    assert dec.filter(pl.col("action") == "snip").height > 0


def test_tombstone_with_clearings_already_in_the_input_is_never_quiet() -> None:
    blocks = make_blocks(loops(8, size=2_000))
    params = {**TOMB, "trigger_idle_seconds": 0, "trigger_tokens": bound(blocks) // 3}
    out, _ = outputs("tombstone", blocks, params, CTX)
    assert not agrees("tombstone", out.lazy(), {**params, "trigger_tokens": 10 ** 9}, CTX)


# ---------------------------------------------------------------------------------------------
# snip: the high watermark, with and without the pipeline's tombstone


def chat(turns: int, size: int = 400) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [{"role": "system", "text": "You are terse."}]
    for t in range(turns):
        msgs.append({"role": "user", "text": f"question {t} " + "q" * size})
        msgs.append({"role": "assistant", "text": f"answer {t} " + "a" * size})
    return msgs


@pytest.mark.parametrize("peers", [{}, {"tombstone": {"trigger_idle_seconds": 0}}])
def test_snip_high_watermark_both_sides(peers: dict[str, Any]) -> None:
    blocks = make_blocks(chat(10))
    b = bound(blocks)
    at = make_context(window_tokens=b, peers=peers)  # high watermark 1.0 x budget = the bound
    under = make_context(window_tokens=b - 1, peers=peers)
    params = {"reserve_output_tokens": 0, "high_watermark": 1.0, "low_watermark": 0.5}
    assert agrees("snip", blocks, params, at)
    assert not agrees("snip", blocks, params, under)
    small = make_context(window_tokens=b // 2, peers=peers)
    _, dec = outputs("snip", blocks, params, small)
    assert dec.filter(pl.col("action") == "snip").height > 0


def test_snip_is_quiet_where_its_tombstone_dry_run_can_only_shorten_requests() -> None:
    blocks = make_blocks(loops(8, size=2_000))
    b = bound(blocks)
    params = {"reserve_output_tokens": 0, "high_watermark": 1.0}
    tomb = {"trigger_idle_seconds": 0, "keep_recent": 1, "clear_at_least_tokens": 1, "min_result_chars": 100}
    # tombstone quiet (its trigger over the bound), or not (its dry run clears): snip is quiet either way,
    # since clearing a 2,000-character result only shortens the request
    for trigger in (b, b // 3):
        ctx = make_context(window_tokens=b, peers={"tombstone": {**tomb, "trigger_tokens": trigger}})
        assert agrees("snip", blocks, params, ctx)
        assert agrees("tombstone", blocks, {**tomb, "trigger_tokens": trigger}, ctx) == (trigger == b)
    # one token over the watermark: not quiet, whatever the dry run
    assert not agrees("snip", blocks, params,
                      make_context(window_tokens=b - 1, peers={"tombstone": {**tomb, "trigger_tokens": b // 3}}))


@pytest.mark.parametrize("longer", ["short_result", "clear_tool_inputs", "clear_thinking_keep"])
def test_snip_is_not_quiet_where_its_tombstone_dry_run_may_lengthen_a_request(longer: str) -> None:
    # a result it may clear whose tokens are under the placeholder's, or params whose replacements
    # (a tool input's "{}", a thinking note) may be the longer: then only a quiet tombstone makes snip quiet
    size = 12 if longer == "short_result" else 2_000
    blocks = make_blocks(loops(8, size=size))
    b = bound(blocks)
    params = {"reserve_output_tokens": 0, "high_watermark": 1.0}
    tomb: dict[str, Any] = {"trigger_idle_seconds": 0, "keep_recent": 1, "clear_at_least_tokens": 1,
                            "min_result_chars": 10}
    if longer == "clear_tool_inputs":
        tomb["clear_tool_inputs"] = True
    if longer == "clear_thinking_keep":
        tomb["clear_thinking_keep"] = 1
    assert agrees("snip", blocks, params, make_context(window_tokens=b, peers={"tombstone": {**tomb, "trigger_tokens": b}}))
    assert not agrees("snip", blocks, params,
                      make_context(window_tokens=b, peers={"tombstone": {**tomb, "trigger_tokens": b // 3}}))
    if longer == "short_result":  # results of 12 characters (3 tokens) become the placeholder (9): longer
        idle = {**tomb, "trigger_tokens": 0, "trigger_idle_seconds": 1}  # (the idle trigger clears them)
        _, dec = outputs("tombstone", blocks, idle, make_context(window_tokens=b))
        assert dec.filter(pl.col("action") == "tombstone").height > 0
        # the same results under min_result_chars: never cleared, and snip quiet again
        assert agrees("snip", blocks, params, make_context(window_tokens=b, peers={
            "tombstone": {**tomb, "min_result_chars": 13, "trigger_tokens": b // 3}}))


def test_snip_with_a_marker_in_the_input_is_never_quiet() -> None:
    blocks = make_blocks(chat(10))
    small = make_context(window_tokens=bound(blocks) // 2, peers={})
    params = {"reserve_output_tokens": 0}
    out, _ = outputs("snip", blocks, params, small)
    assert not agrees("snip", out.lazy(), params, make_context(window_tokens=10 ** 9, peers={}))


# ---------------------------------------------------------------------------------------------
# result_budget, images, inter_session


def fanout(k: int, size: int) -> list[dict[str, Any]]:
    """One assistant turn of k calls, answered together by k results of `size` characters."""
    calls = [{"type": "tool_use", "tool_use_id": f"toolu_{i}", "tool_name": "Read", "tool_input": {"p": i}}
             for i in range(k)]
    results = [{"type": "tool_result", "tool_use_id": f"toolu_{i}", "tool_name": "Read", "text": "x" * size}
               for i in range(k)]
    return [{"role": "user", "text": "go"}, {"role": "assistant", "blocks": calls}, {"role": "user", "blocks": results},
            {"role": "assistant", "text": "done"}]


@pytest.mark.parametrize("aggregate", [0, 1_000])
def test_result_budget_cap_both_sides(aggregate: int) -> None:
    blocks = make_blocks(fanout(4, 250))  # 4 results of 250 characters, one turn: 1,000 together
    if not aggregate:
        assert agrees("result_budget", blocks, {"aggregate_max_chars": 0, "max_result_chars": 250}, CTX)
        assert not agrees("result_budget", blocks, {"aggregate_max_chars": 0, "max_result_chars": 249}, CTX)
        _, dec = outputs("result_budget", blocks, {"aggregate_max_chars": 0, "max_result_chars": 200}, CTX)
        assert set(dec["reason"]) == {"max_result_chars"}
    else:
        assert agrees("result_budget", blocks, {"aggregate_max_chars": aggregate, "max_result_chars": 5_000}, CTX)
        assert not agrees("result_budget", blocks, {"aggregate_max_chars": aggregate - 1, "max_result_chars": 5_000}, CTX)
        _, dec = outputs("result_budget", blocks, {"aggregate_max_chars": 600, "max_result_chars": 5_000}, CTX)
        assert set(dec["reason"]) == {"aggregate"}


def test_result_budget_counts_each_result_and_each_call_alone() -> None:
    # two threads, two calls each, one 400-character result per call: 1,600 characters in all
    two = pl.concat([make_blocks(loops(2, size=400)), make_blocks(loops(2, size=400), thread_id="other")])
    assert agrees("result_budget", two, {"max_result_chars": 400, "aggregate_max_chars": 400}, CTX)
    assert not agrees("result_budget", two, {"max_result_chars": 399, "aggregate_max_chars": 0}, CTX)
    assert not agrees("result_budget", two, {"max_result_chars": 5_000, "aggregate_max_chars": 399}, CTX)


def test_images_quiet_without_an_image_only() -> None:
    plain = [{"role": "user", "text": "hi"}, {"role": "assistant", "text": "ok"}]
    assert agrees("images", make_blocks(plain), {}, CTX)
    bad = [*plain, {"role": "user", "blocks": [{"type": "image", "image_media_type": "image/png", "image_data": "%%%"}]}]
    assert not agrees("images", make_blocks(bad), {}, CTX)
    _, dec = outputs("images", make_blocks(bad), {}, CTX)
    assert dec["action"].to_list() == ["replace"]


def test_inter_session_quiet_without_a_routed_user_row_only() -> None:
    prov = {"kind": "inter_session", "source_session": "a", "channel": "c", "tool": "t"}
    plain = [{"role": "user", "text": "hi", "provenance": {**prov, "kind": "external_user"}},
             {"role": "assistant", "text": "ok"}]
    assert agrees("inter_session", make_blocks(plain), {}, CTX)
    routed = [*plain, {"role": "user", "text": "child", "provenance": prov}]
    assert not agrees("inter_session", make_blocks(routed), {}, CTX)
    _, dec = outputs("inter_session", make_blocks(routed), {}, CTX)
    assert dec.height == 1


# ---------------------------------------------------------------------------------------------
# the token bound


@pytest.mark.parametrize("counter", [None, CHARS4_COUNTER, TIKTOKEN_COUNTER])
def test_row_tokens_bound_is_at_least_the_estimate(counter: str | None) -> None:
    texts = ["", "a", "héllo wörld " * 30, "日本語のテキスト" * 10, "{\"x\": [1, 2, 3]}", "🙂" * 7]
    msgs = [{"role": "user", "text": t} for t in texts if t] + [
        {"role": "assistant", "blocks": [{"type": "tool_use", "tool_use_id": "toolu_1", "tool_name": "Read",
                                          "tool_input": {"path": "/ü" * 40}}]},
        {"role": "user", "blocks": [{"type": "image", "image_media_type": "image/png", "image_data": "x"}]}]
    blocks = make_blocks(msgs)
    count = TokenCounter(counter).series_counter() if counter else None
    ctx = StageContext(count_tokens=count, token_counter_version=counter or CHARS4_COUNTER)
    got = blocks.select(exact=row_tokens_expr(count), bound=row_tokens_bound(ctx)).collect()
    assert (got["bound"] >= got["exact"]).all()
    # exact: chars/4 without the counter, tiktoken's own counts (looked up: each text is counted
    # once per run), so a long session under tiktoken is not judged by its bytes
    assert got["bound"].equals(got["exact"], check_names=False)


# ---------------------------------------------------------------------------------------------
# pairing: every defect it repairs, one at a time, against a clean transcript


def frame(ids: list[str], *, name: str = "Read") -> list[dict[str, Any]]:
    calls = [{"type": "tool_use", "tool_use_id": i, "tool_name": name, "tool_input": {"i": i}} for i in ids]
    return [{"role": "assistant", "blocks": calls},
            {"role": "user", "blocks": [{"type": "tool_result", "tool_use_id": i, "tool_name": name, "text": f"r {i}"}
                                        for i in ids]}]


def clean() -> list[dict[str, Any]]:
    return [{"role": "user", "text": "go"}, *frame(["toolu_01", "toolu_02"]), {"role": "user", "text": "more"},
            *frame(["toolu_03"]), {"role": "assistant", "text": "done"}]


def defects() -> dict[str, list[dict[str, Any]]]:
    c = clean()
    missing = [*c[:-1], *frame(["toolu_04"])[:1]]  # the last call not answered yet
    swapped = [*c[:1], c[1], {**c[2], "blocks": c[2]["blocks"][::-1]}, *c[3:]]
    between = [*c[:2], {"role": "user", "text": "interjection"}, *c[2:]]
    reused = [*c[:-1], *frame(["toolu_01"]), c[-1]]
    orphan = [*c[:-1], {"role": "user", "blocks": [{"type": "tool_result", "tool_use_id": "toolu_99", "text": "?"}]},
              c[-1]]
    untrimmed = [*c[:1], c[1], {**c[2], "blocks": [{**b, "tool_name": " Read "} for b in c[2]["blocks"]]}, *c[3:]]
    failed = [*c[:1], {**c[1], "stop_reason": "error"}, *c[2:]]
    return {"missing": missing, "swapped": swapped, "between": between, "reused": reused, "orphan": orphan,
            "untrimmed": untrimmed, "failed": failed}


@pytest.mark.parametrize("target", ["anthropic", "openai-chat", "gemini"])
def test_pairing_quiet_on_a_clean_transcript_for_ids_it_keeps(target: str) -> None:
    ctx = StageContext(target=target)
    # gemini's strict ids drop the underscore: the same transcript is not quiet there
    assert agrees("pairing", make_blocks(clean()), {}, ctx) == (target != "gemini")


@pytest.mark.parametrize("defect", sorted(defects()))
def test_pairing_not_quiet_on_any_defect_it_repairs(defect: str) -> None:
    blocks = make_blocks(defects()[defect])
    assert not agrees("pairing", blocks, {}, CTX)
    _, dec = outputs("pairing", blocks, {}, CTX)
    assert dec.height > 0
    # repaired once, a second pass decides nothing, quick path or not
    out, _ = outputs("pairing", blocks, {}, CTX)
    agrees("pairing", out.lazy(), {}, CTX)


def test_pairing_quiet_where_a_compaction_takes_calls_away_with_their_results() -> None:
    # from the last call on, the first frame (its calls and their results) is gone: every pair still
    # leaves the requests together, and the transcript has nothing to repair
    blocks = make_blocks(clean(), compactions=[(4, 3)])
    assert blocks.select(pl.col("last_call").is_not_null().sum()).collect().item() > 0
    assert agrees("pairing", blocks, {}, CTX)


@pytest.mark.parametrize("keep_from", [2, 1])
def test_pairing_not_quiet_where_a_compaction_splits_a_pair(keep_from: int) -> None:
    # the calls of the first frame leave and their results stay (keep_from = 2), or the
    # compaction cuts before the frame (1: nothing leaves but the first user row): one side and
    # the other side of the boundary the check reads
    blocks = make_blocks(clean(), compactions=[(4, keep_from)])
    quiet = agrees("pairing", blocks, {}, CTX)
    _, dec = outputs("pairing", blocks, {}, CTX, checks=False)
    assert quiet == (keep_from == 1)
    assert (dec.height > 0) == (keep_from == 2)
    if keep_from == 2:
        assert set(dec.get_column("reason").to_list()) == {"orphan"}


def test_pairing_property_check_agrees_with_the_plan() -> None:
    from hypothesis import given, settings
    from hypothesis import strategies as st

    try:
        from tests.stages.test_pairing import transcripts
    except ModuleNotFoundError:  # the repo root is not on sys.path under --import-mode=importlib
        import sys
        from pathlib import Path

        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from tests.stages.test_pairing import transcripts

    @settings(max_examples=40, deadline=None)
    @given(transcripts(), st.sampled_from(["anthropic", "openai-chat", "gemini"]), st.data())
    def prop(msgs: list[dict[str, Any]], target: str, data: st.DataObject) -> None:
        ctx = StageContext(target=target)
        # a compaction at a drawn place (none, one side of a pair, or both) now and then
        comp = [] if data.draw(st.booleans()) else [(data.draw(st.integers(1, len(msgs))),
                                                     data.draw(st.integers(1, len(msgs))))]
        blocks = make_blocks(msgs, compactions=[(at, min(keep, at)) for at, keep in comp])
        agrees("pairing", blocks, {}, ctx)
        out, _ = outputs("pairing", blocks, {}, ctx)
        agrees("pairing", out.lazy(), {}, ctx)

    prop()


# ---------------------------------------------------------------------------------------------
# sanitize: every sub-step, one defect at a time, against a clean transcript (usage columns are
# filled either way)

ANTHROPIC_META = {"provider": "anthropic", "api": "anthropic-messages"}


def sanitize_clean() -> list[dict[str, Any]]:
    return [
        {"role": "user", "text": "hi"},
        {"role": "assistant", **ANTHROPIC_META, "usage": {"input": 10, "output": 5}, "blocks": [
            {"type": "thinking", "text": "t", "signature": "sig"},
            {"type": "tool_use", "tool_use_id": "toolu_1", "tool_name": "Bash", "tool_input": {"c": "ls"}}]},
        {"role": "tool", "blocks": [{"type": "tool_result", "tool_use_id": "toolu_1", "part_type": "string",
                                     "text": "x", "extra": {"cache_control": {"type": "ephemeral"}}}]},
        {"role": "assistant", **ANTHROPIC_META, "text": "done", "stop_reason": "end_turn", "usage": {"input": 20}},
    ]


def sanitize_defects() -> dict[str, list[dict[str, Any]]]:
    c = sanitize_clean()
    call, result = c[1]["blocks"][1], c[2]["blocks"][0]

    def with_call(**kw: Any) -> list[dict[str, Any]]:
        return [c[0], {**c[1], "blocks": [c[1]["blocks"][0], {**call, **kw}]}, *c[2:]]

    return {
        "null_block": [*c[:3], {**c[3], "text": None}],
        "blank_text": [{"role": "user", "text": "  \n"}, *c[1:]],
        "display_only": [*c, {"role": "assistant", **ANTHROPIC_META, "text": "ui", "is_display_only": True}],
        "failed_turn": [*c[:3], {"role": "assistant", **ANTHROPIC_META, "stop_reason": "error",
                                 "blocks": [{"type": "empty"}]}, {"role": "user", "text": "again"}],
        "foreign_item": [*c, {"role": "assistant", "blocks": [{"type": "web_search_call", "text": "q"}]}],
        "unsigned_thinking": [c[0], {**c[1], "blocks": [{"type": "thinking", "text": "t"}, call]}, *c[2:]],
        "foreign_thinking": [c[0], {**c[1], "provider": "openai", "api": "openai-responses"}, *c[2:]],
        "bad_name": with_call(tool_name="bad name!"),
        "untrimmed_name": with_call(tool_name=" Bash "),
        "no_input": with_call(tool_input=None),
        "details": [*c[:2], {"role": "tool", "blocks": [{**result, "extra": {"details": {"a": 1}}}]}, c[3]],
        "escaped_key": [*c[:2], {"role": "tool", "blocks": [{**result, "extra": {"\\u0064etails": 1}}]}, c[3]],
        "magic": [{"role": "user", "text": "ANTHROPIC_MAGIC_STRING_TRIGGER_REFUSAL"}, *c[1:]],
    }


def test_sanitize_quiet_on_a_clean_transcript_and_fills_usage() -> None:
    blocks = make_blocks(sanitize_clean())
    assert agrees("sanitize", blocks, {}, CTX)
    out, _ = outputs("sanitize", blocks, {}, CTX)
    assert out["u_total"].max() == 20
    # another policy, another answer: drop_all drops even signed thinking
    assert not agrees("sanitize", blocks, {"thinking_policy": "drop_all"}, CTX)
    assert not agrees("sanitize", blocks, {"allowed_tools": ["Read"]}, CTX)
    assert agrees("sanitize", blocks, {"allowed_tools": ["bash"]}, CTX)


@pytest.mark.parametrize("defect", sorted(sanitize_defects()))
def test_sanitize_not_quiet_on_any_defect_it_repairs(defect: str) -> None:
    blocks = make_blocks(sanitize_defects()[defect])
    assert not agrees("sanitize", blocks, {}, CTX)
    if defect != "escaped_key":  # (a key that only looks escaped in the text: the check is conservative)
        _, dec = outputs("sanitize", blocks, {}, CTX)
        assert dec.height > 0


@pytest.mark.parametrize("mode", ["preserve", "strict", "strict9"])
@pytest.mark.parametrize("target", ["anthropic", "openai-chat", "gemini"])
def test_pairing_same_id_expression_never_claims_an_id_that_changes(mode: str, target: str) -> None:
    import importlib

    pairing = importlib.import_module("ctxreplay.stages.pairing")
    ids = ["toolu_01ABCdef", "toolu_01", "call_abc123", "abc123XYZ", "abcdefghi", "abcdefgh", "a" * 40, "a" * 41,
           "id with space", "id.dot", "ünïcode", "toolu_bad!", "x\n", "\x1c", " ", "", None, "-_-", "123456789"]
    got = pl.DataFrame({"_cid": ids}, schema={"_cid": pl.String}).select(
        pairing.same_id_expr(mode, target)).to_series().to_list()
    for tid, same in zip(ids, got, strict=True):
        keeps = tid is not None and bool(tid.strip()) and pairing.map_tool_id(tid, 0, mode, target) == tid
        assert not same or keeps, (tid, mode, target)  # never "kept" where the id changes
        if tid is not None and tid.isascii() and tid.isprintable() and tid.strip() == tid and tid:
            assert bool(same) == keeps, (tid, mode, target)  # and exact on plain ids


def test_quiet_blocks_declared_sorted_are_in_block_order() -> None:
    """A stage whose quiet blocks say they are in block order (`Quiet(sorted=True)`: the runner hands
    them on unsorted to the quiet positions after it) returns them in that order, from rows given
    in any order."""
    from ctxreplay.pipeline.core.blockops import sort_blocks
    from ctxreplay.pipeline.stageapi.registry import load_stages

    declared = [st for st in load_stages().values() if st.quiet is not None and st.quiet.sorted]
    assert [st.name for st in declared] == ["sanitize"]
    for st in declared:
        assert st.quiet is not None and st.quiet.blocks is not None
        blocks = make_blocks(sanitize_clean()).collect()
        shuffled = blocks.sample(fraction=1.0, shuffle=True, seed=7).lazy()
        p = resolve_params(st, {}, where="test")
        out = st.quiet.blocks(shuffled, p, CTX).collect()
        assert out.equals(sort_blocks(out.lazy()).collect())
        assert out.height == blocks.height
