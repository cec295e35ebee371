"""Both sides of every trigger and threshold of the layers (issue 9, "tests that bite").

Each test puts a request, a gap, a size or a count exactly at a threshold and one step past it, and
checks that the layer acts on exactly one side: tombstone (token trigger, a second firing after
tokens were freed, idle trigger, `clear_at_least_tokens`, `keep_recent`, `min_result_chars`), snip
(high and low watermark), result_budget (the per-result cap from `max_result_chars` and from the
window share, the aggregate cap, truncating and spilling), images (side, payload and pixel caps, the
resize candidates, images per request, recent image turns).

Request sizes are measured with the estimate the layers share (`ctxreplay.pipeline.stageapi.calls.request_tokens`, the
fast ceil(chars / 4) counter), so the thresholds are set from the very numbers a layer compares.
Time comes from transcript timestamps only: nothing here waits or reads a clock.
"""

from __future__ import annotations

import base64
import io
from typing import Any

import polars as pl
import pytest
from PIL import Image

from ctxreplay.pipeline.stageapi.calls import request_tokens
from ctxreplay.pipeline.stageapi.registry import StageContext
from ctxreplay.stages.images import STALE, Images, fit_image
from ctxreplay.stages.snip import SNIP_TEMPLATE
from ctxreplay.stages.tombstone import CLEARED
from ctxreplay.testkit import make_blocks, run_stage, visible

CTX = StageContext()  # count_tokens None: the fast estimator


def last_request_tokens(blocks: pl.LazyFrame | pl.DataFrame) -> int:
    """Estimated tokens of the thread's last (pending) request, as the layers measure it."""
    return tokens_at_calls(blocks)[-1]


def tokens_at_calls(blocks: pl.LazyFrame | pl.DataFrame) -> list[int]:
    """Estimated request tokens of every call of the (one) thread, in call order."""
    lf = blocks.lazy() if isinstance(blocks, pl.DataFrame) else blocks
    return request_tokens(lf, CTX).sort("call").collect()["tokens"].to_list()


def decided(name: str, msgs: list[dict[str, Any]], params: dict[str, Any],
            ctx: StageContext = CTX) -> tuple[pl.DataFrame, pl.DataFrame]:
    res = run_stage(name, make_blocks(msgs), params, ctx=ctx)
    blocks, decisions = pl.collect_all([res.blocks, res.decisions])
    return blocks, decisions.sort("entry_id", "block_pos", "part_pos", "from_call", "action")


# ----------------------------------------------------------------------------- tombstone

IDLE_OFF = {"trigger_idle_seconds": 0}
TOKENS_OFF = {"trigger_tokens": 0}


def result_loop(i: int, t: int, text: str) -> list[dict[str, Any]]:
    """A real user turn with one tool loop: user row, call, result (one second apart)."""
    return [
        {"role": "user", "text": f"turn {i}", "timestamp": t},
        {"role": "assistant", "timestamp": t + 1,
         "blocks": [{"type": "tool_use", "tool_use_id": f"toolu_{i}", "tool_name": "Read", "tool_input": {"i": i}}]},
        {"role": "user", "timestamp": t + 2,
         "blocks": [{"type": "tool_result", "tool_use_id": f"toolu_{i}", "tool_name": "Read", "text": text,
                     "part_type": "string"}]},
    ]


def tomb_session(n: int = 4, *, size: int = 400, gap: int = 5, last_text: str = "x " * 2_000,
                 texts: list[str] | None = None) -> list[dict[str, Any]]:
    """n old tool loops in their own turns, an assistant answer, then (`gap` seconds later) a big
    final user row: the pending request jumps over every earlier one and has no current tool loop."""
    msgs: list[dict[str, Any]] = [{"role": "user", "text": "start", "timestamp": 0}]
    t = 10
    for i in range(n):
        msgs += result_loop(i, t, texts[i] if texts else f"r{i}:".ljust(size, "y"))
        t += 10
    msgs.append({"role": "assistant", "text": "done", "timestamp": t})
    msgs.append({"role": "user", "text": last_text, "timestamp": t + gap})
    return msgs


def tombstoned(decisions: pl.DataFrame, reason: str | None = None) -> list[str]:
    d = decisions.filter(pl.col("action") == "tombstone")
    if reason is not None:
        d = d.filter(pl.col("reason") == reason)
    return sorted(d["tool_use_id"].unique().to_list())


def test_tombstone_token_trigger_fires_only_above_trigger_tokens() -> None:
    msgs = tomb_session()
    per_call = tokens_at_calls(make_blocks(msgs))
    last = per_call[-1]
    assert per_call[-2] < last - 1  # only the pending request can reach the trigger
    base = {**IDLE_OFF, "clear_at_least_tokens": 0, "keep_recent": 0, "min_result_chars": 1}
    _, at = decided("tombstone", msgs, {**base, "trigger_tokens": last})
    assert at.height == 0, "a request exactly at trigger_tokens must not fire"
    _, over = decided("tombstone", msgs, {**base, "trigger_tokens": last - 1})
    assert tombstoned(over, "token") == ["toolu_0"]  # the oldest result frees enough
    assert set(over["from_call"]) == {len(per_call) - 1}


def test_tombstone_second_token_firing_counts_the_tokens_already_freed() -> None:
    # an idle hour before loop 2 clears loops 0-1 there; later the pending request, measured
    # after that clearing, sits exactly at the trigger (no second firing) or one token above it
    msgs: list[dict[str, Any]] = [{"role": "user", "text": "start", "timestamp": 0}]
    t = 10
    for i in range(5):
        if i == 2:
            t += 7_200
        msgs += result_loop(i, t, f"r{i}:".ljust(800, "y"))
        t += 10
    msgs += [{"role": "assistant", "text": "done", "timestamp": t},
             {"role": "user", "text": "z " * 3_000, "timestamp": t + 5}]
    base = {"trigger_idle_seconds": 3_600, "clear_at_least_tokens": 0, "keep_recent": 0, "min_result_chars": 1}
    idle_only, idle_dec = decided("tombstone", msgs, {**base, "trigger_tokens": 0})
    assert tombstoned(idle_dec, "idle") == ["toolu_0", "toolu_1"]
    after = tokens_at_calls(idle_only)
    before = tokens_at_calls(make_blocks(msgs))
    pending = len(after) - 1
    assert after[pending] < before[pending]  # the first firing freed tokens of the pending request
    assert max(before[:pending]) < after[pending] - 1 and max(after[:pending]) < after[pending] - 1
    _, at = decided("tombstone", msgs, {**base, "trigger_tokens": after[pending]})
    assert at.equals(idle_dec), "the request minus the freed tokens is exactly at the trigger: no second firing"
    _, over = decided("tombstone", msgs, {**base, "trigger_tokens": after[pending] - 1})
    second = over.filter(pl.col("reason") == "token")
    assert second.height > 0 and set(second["from_call"]) == {pending}
    assert tombstoned(over, "idle") == ["toolu_0", "toolu_1"]


def test_tombstone_idle_trigger_fires_at_exactly_trigger_idle_seconds() -> None:
    msgs = tomb_session(gap=600)
    base = {**TOKENS_OFF, "keep_recent": 0, "min_result_chars": 1}
    _, at = decided("tombstone", msgs, {**base, "trigger_idle_seconds": 600})
    assert tombstoned(at, "idle") == ["toolu_0", "toolu_1", "toolu_2", "toolu_3"]
    _, under = decided("tombstone", msgs, {**base, "trigger_idle_seconds": 601})
    assert under.height == 0, "a gap one second short of trigger_idle_seconds must not fire"


def test_tombstone_clear_at_least_tokens_both_sides() -> None:
    msgs = tomb_session(gap=7_200)
    last = last_request_tokens(make_blocks(msgs))
    # what clearing every eligible result frees at the pending call (the idle trigger clears them all)
    idle_only, _ = decided("tombstone", msgs, {**TOKENS_OFF, "keep_recent": 0, "min_result_chars": 1})
    frees = last - last_request_tokens(idle_only)
    base = {**IDLE_OFF, "trigger_tokens": last - 1, "keep_recent": 0, "min_result_chars": 1}
    _, enough = decided("tombstone", msgs, {**base, "clear_at_least_tokens": frees})
    assert tombstoned(enough, "token") == ["toolu_0", "toolu_1", "toolu_2", "toolu_3"]
    _, short = decided("tombstone", msgs, {**base, "clear_at_least_tokens": frees + 1})
    assert short.height == 0, "a batch one token short of clear_at_least_tokens must not fire"


def test_tombstone_keep_recent_both_sides() -> None:
    msgs = tomb_session(gap=7_200)
    base = {**TOKENS_OFF, "min_result_chars": 1}
    _, all_kept = decided("tombstone", msgs, {**base, "keep_recent": 4})
    assert all_kept.height == 0
    _, one = decided("tombstone", msgs, {**base, "keep_recent": 3})
    assert tombstoned(one) == ["toolu_0"]
    _, three = decided("tombstone", msgs, {**base, "keep_recent": 1})
    assert tombstoned(three) == ["toolu_0", "toolu_1", "toolu_2"]


def test_tombstone_min_result_chars_both_sides() -> None:
    msgs = tomb_session(gap=7_200, texts=["a" * 300, "b" * 299, "c" * 301, "d" * 300])
    base = {**TOKENS_OFF, "keep_recent": 0}
    _, at = decided("tombstone", msgs, {**base, "min_result_chars": 300})
    assert tombstoned(at) == ["toolu_0", "toolu_2", "toolu_3"]  # 300 chars is enough, 299 is not
    _, above = decided("tombstone", msgs, {**base, "min_result_chars": 301})
    assert tombstoned(above) == ["toolu_2"]
    blocks, _ = decided("tombstone", msgs, {**base, "min_result_chars": 301})
    pending = int(blocks["first_call"].max())
    cleared = visible(blocks, pending).filter(pl.col("text") == CLEARED)["tool_use_id"].to_list()
    assert cleared == ["toolu_2"]


# ----------------------------------------------------------------------------- snip

BUDGET = 1 << 14  # a power of two: every watermark below is an exact binary fraction of it


def snip_session(n_turns: int = 6) -> list[dict[str, Any]]:
    """A first turn, n middle turns of different sizes, then a final user row (the current turn)."""
    msgs: list[dict[str, Any]] = []
    for i in range(n_turns + 1):
        msgs.append({"role": "user", "text": f"question {i} " + "q" * (40 * (i + 1)), "timestamp": 10 * i})
        msgs.append({"role": "assistant", "text": f"answer {i} " + "a" * (60 * (i + 2)), "timestamp": 10 * i + 1})
    msgs.append({"role": "user", "text": "the last question", "timestamp": 10 * n_turns + 5})
    return msgs


def snip_params(high: int, low: int) -> dict[str, Any]:
    return {"reserve_output_tokens": 0, "high_watermark": high / BUDGET, "low_watermark": low / BUDGET,
            "min_tail_turns": 1, "keep_head_turns": 1}


SNIP_CTX = StageContext(window_tokens=BUDGET)


def snipped_messages(decisions: pl.DataFrame) -> list[str]:
    return sorted(decisions.filter(pl.col("action") == "snip")["entry_id"].unique().to_list())


def test_snip_high_watermark_both_sides() -> None:
    msgs = snip_session()
    per_call = tokens_at_calls(make_blocks(msgs))
    last = per_call[-1]
    assert last < BUDGET and per_call[-2] < last - 1
    _, at = decided("snip", msgs, snip_params(last, last // 2), SNIP_CTX)
    assert at.height == 0, "a request exactly at the high watermark must not be snipped"
    _, over = decided("snip", msgs, snip_params(last - 1, last // 2), SNIP_CTX)
    assert snipped_messages(over) and set(over["from_call"]) == {len(per_call) - 1}


def test_snip_low_watermark_both_sides() -> None:
    # turns 2, 3, ... go oldest first until the request plus a marker estimate is at or under the
    # low watermark; the estimate is the marker with 99 more messages and 99,999 more tokens than
    # the snip so far (its text can only be shorter)
    msgs = snip_session()
    last = last_request_tokens(make_blocks(msgs))
    marker = last_request_tokens(make_blocks([{"role": "user", "text": SNIP_TEMPLATE.format(n=99, t=99_999)}]))
    # turns 2 and 3 are messages 2..5 (turn 1, messages 0-1, is the protected head)
    without_2_3 = last_request_tokens(make_blocks(msgs[:2] + msgs[6:]))
    low = last - (last - without_2_3) + marker  # removing turns 2-3 lands exactly on the low watermark
    assert low < last - 1
    _, exact = decided("snip", msgs, snip_params(last - 1, low), SNIP_CTX)
    assert snipped_messages(exact) == ["e0002", "e0003", "e0004", "e0005"]
    _, one_less = decided("snip", msgs, snip_params(last - 1, low - 1), SNIP_CTX)
    assert snipped_messages(one_less) == ["e0002", "e0003", "e0004", "e0005", "e0006", "e0007"]


# ----------------------------------------------------------------------------- result_budget


def budget_session(sizes: list[int]) -> list[dict[str, Any]]:
    """One assistant row calling len(sizes) tools; their results (of these sizes) come together."""
    calls = [{"type": "tool_use", "tool_use_id": f"t{i}", "tool_name": "Read", "tool_input": {"i": i}}
             for i in range(len(sizes))]
    results = [{"type": "tool_result", "tool_use_id": f"t{i}", "tool_name": "Read", "part_type": "string",
                "text": (f"{i}" * n)[:n]} for i, n in enumerate(sizes)]
    return [{"role": "user", "text": "go"}, {"role": "assistant", "blocks": calls},
            {"role": "user", "blocks": results}, {"role": "assistant", "text": "ok"}]


def budget_reasons(decisions: pl.DataFrame) -> list[tuple[str, str, str]]:
    return sorted(decisions.select("tool_use_id", "action", "reason").iter_rows())


def test_result_budget_max_result_chars_both_sides() -> None:
    params = {"max_result_chars": 1_000, "aggregate_max_chars": 0}
    _, at = decided("result_budget", budget_session([1_000]), params)
    assert at.height == 0
    _, over = decided("result_budget", budget_session([1_001]), params)
    assert budget_reasons(over) == [("t0", "truncate", "max_result_chars")]


def test_result_budget_window_share_cap_both_sides() -> None:
    # cap = min(max_result_chars, max_window_share x window_tokens x 4) = 0.25 x 1,200 x 4 = 1,200
    params = {"max_result_chars": 10**6, "max_window_share": 0.25, "aggregate_max_chars": 0}
    ctx = StageContext(window_tokens=1_200)
    _, at = decided("result_budget", budget_session([1_200]), params, ctx)
    assert at.height == 0
    _, over = decided("result_budget", budget_session([1_201]), params, ctx)
    assert budget_reasons(over) == [("t0", "truncate", "max_result_chars")]


def test_result_budget_aggregate_cap_both_sides() -> None:
    params = {"max_result_chars": 5_000, "aggregate_max_chars": 6_000}
    _, at = decided("result_budget", budget_session([3_000, 2_000, 1_000]), params)
    assert at.height == 0, "a group exactly at aggregate_max_chars is left alone"
    _, over = decided("result_budget", budget_session([3_001, 2_000, 1_000]), params)
    assert ("t0", "truncate", "aggregate") in budget_reasons(over)


def test_result_budget_aggregate_spill_both_sides() -> None:
    # the group passes the cap: the largest result is spilled (it then counts as its preview plus
    # the wrapper allowance); the next one only if the group is still over the cap
    preview, wrapper = 100, 160
    spilled = preview + wrapper
    sizes = [4_000, 2_000, 1_500]
    params = {"max_result_chars": 10_000, "spill": True, "spill_preview_chars": preview}
    fits = spilled + sizes[1] + sizes[2]  # the group once the largest is spilled
    _, one = decided("result_budget", budget_session(sizes), {**params, "aggregate_max_chars": fits})
    assert budget_reasons(one) == [("t0", "spill", "aggregate")]
    _, two = decided("result_budget", budget_session(sizes), {**params, "aggregate_max_chars": fits - 1})
    assert budget_reasons(two) == [("t0", "spill", "aggregate"), ("t1", "spill", "aggregate")]
    _, none = decided("result_budget", budget_session(sizes), {**params, "aggregate_max_chars": sum(sizes)})
    assert none.height == 0


# ----------------------------------------------------------------------------- images


def png(w: int, h: int) -> str:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), (200, 30, 30)).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def test_images_max_side_px_both_sides() -> None:
    p = Images(max_side_px=64)
    assert fit_image(png(64, 3), "image/png", p).status == "keep"
    assert fit_image(png(3, 64), "image/png", p).status == "keep"
    over = fit_image(png(65, 3), "image/png", p)
    assert (over.status, over.width) == ("resize", 64)


def test_images_max_b64_bytes_both_sides() -> None:
    data = png(40, 30)
    assert fit_image(data, "image/png", Images(max_b64_bytes=len(data))).status == "keep"
    assert fit_image(data, "image/png", Images(max_b64_bytes=len(data) - 1)).status != "keep"


def test_images_max_input_b64_bytes_both_sides() -> None:
    data = png(40, 30)
    assert fit_image(data, "image/png", Images(max_input_b64_bytes=len(data))).status == "keep"
    over = fit_image(data, "image/png", Images(max_input_b64_bytes=len(data) - 1))
    assert over.status == "omit" and over.reason is not None and over.reason.startswith("exceeds input size limit")


def test_images_max_pixels_both_sides() -> None:
    data = png(40, 30)
    assert fit_image(data, "image/png", Images(max_pixels=1_200)).status == "keep"
    over = fit_image(data, "image/png", Images(max_pixels=1_199))
    assert (over.status, over.reason) == ("omit", "pixel count exceeds 1199")


def test_images_first_resize_candidate_that_fits_wins_both_sides() -> None:
    data = png(300, 200)
    first = fit_image(data, "image/png", Images(max_side_px=100))  # side 100, quality 85
    assert first.status == "resize" and first.data is not None
    n = len(first.data)
    exact = fit_image(data, "image/png", Images(max_side_px=100, max_b64_bytes=n))
    assert exact.data == first.data, "a candidate exactly at max_b64_bytes fits"
    smaller = fit_image(data, "image/png", Images(max_side_px=100, max_b64_bytes=n - 1))
    assert smaller.status == "resize" and smaller.data is not None and len(smaller.data) <= n - 1


def image_turns(n: int) -> list[dict[str, Any]]:
    """n user turns with one small image each, each answered."""
    msgs: list[dict[str, Any]] = []
    for i in range(n):
        msgs.append({"role": "user", "blocks": [{"type": "text", "text": f"look {i}"},
                                                {"type": "image", "image_media_type": "image/png",
                                                 "image_data": png(4 + i, 4)}]})
        msgs.append({"role": "assistant", "text": f"seen {i}"})
    return msgs


def stale_images(decisions: pl.DataFrame) -> list[str]:
    return sorted(decisions.filter(pl.col("reason") == "image_stale")["entry_id"].to_list())


def test_images_max_images_per_request_both_sides() -> None:
    # four turns with an image each, at most three per request: the call that sees three images
    # keeps them all; the call that sees the fourth replaces the oldest (outside the recent turns)
    blocks, over = decided("images", image_turns(4), {"max_images_per_request": 3, "keep_recent_image_turns": 0})
    assert stale_images(over) != [] and set(over.filter(pl.col("reason") == "image_stale")["from_call"]) == {3}
    images_at = [visible(blocks, k).filter(pl.col("block_type") == "image").height for k in range(4)]
    assert images_at == [1, 2, 3, 1]
    assert visible(blocks, 3).filter(pl.col("text") == STALE).height == 3
    _, at = decided("images", image_turns(3), {"max_images_per_request": 3, "keep_recent_image_turns": 0})
    assert stale_images(at) == []


def test_images_keep_recent_image_turns_both_sides() -> None:
    # three images, at most two per request: the current turn and the last completed
    # keep_recent_image_turns turns keep theirs while the count allows
    msgs = image_turns(3)
    _, one = decided("images", msgs, {"max_images_per_request": 2, "keep_recent_image_turns": 1})
    assert stale_images(one) == ["e0000"]
    _, none = decided("images", msgs, {"max_images_per_request": 2, "keep_recent_image_turns": 0})
    assert stale_images(none) == ["e0000", "e0002"]


@pytest.mark.parametrize("gap", [599, 600, 601])
def test_tombstone_idle_gap_is_read_from_timestamps_only(gap: int) -> None:
    # the same transcript shifted by a day decides the same: the gap is between row timestamps
    msgs = tomb_session(gap=gap)
    shifted = [{**m, "timestamp": m["timestamp"] + 86_400} for m in msgs]
    params = {**TOKENS_OFF, "trigger_idle_seconds": 600, "keep_recent": 0, "min_result_chars": 1}
    _, a = decided("tombstone", msgs, params)
    _, b = decided("tombstone", shifted, params)
    assert a.equals(b) and (a.height > 0) == (gap >= 600)
