"""auto_compact (docs/layers.md): a simulated auto-compaction at a token threshold."""

from __future__ import annotations

from typing import Any

import polars as pl
import pytest

from ctxreplay.errors import SpecError
from ctxreplay.pipeline.stageapi.calls import request_tokens, text_tokens
from ctxreplay.pipeline.stageapi.registry import StageContext, get_stage
from ctxreplay.pipeline.staging.spec import resolve_params
from ctxreplay.stages.auto_compact import ORIGIN, parse_summary
from ctxreplay.testkit import make_blocks, make_context, run_stage, visible

CTX = make_context(window_tokens=200_000)


def chat(turns: int, size: int = 400) -> list[dict[str, Any]]:
    """A system row, then `turns` user/assistant turns of about size/4 tokens each message."""
    msgs: list[dict[str, Any]] = [{"role": "system", "text": "You are terse."}]
    for t in range(turns):
        msgs.append({"role": "user", "text": f"question {t} " + "q" * size})
        msgs.append({"role": "assistant", "text": f"answer {t} " + "a" * size})
    return msgs


def tokens_at(blocks: pl.DataFrame, ctx: StageContext = CTX) -> dict[int, int]:
    t = request_tokens(blocks.lazy(), ctx).collect()
    return dict(zip(t["call"].to_list(), t["tokens"].to_list(), strict=True))


def run(messages: list[dict[str, Any]], params: dict[str, Any], **kw: Any) -> tuple[pl.DataFrame, pl.DataFrame]:
    res = run_stage("auto_compact", make_blocks(messages, **kw), params, ctx=CTX)
    return res.blocks.collect(), res.decisions.collect().sort("from_call", "entry_id")


def test_fires_at_the_first_call_over_the_threshold_and_not_before() -> None:
    before = tokens_at(make_blocks(chat(10)).collect())
    k = 6
    # both sides of the threshold: equal to call k-1's request does not fire there, one less does
    for threshold, fired_at in ((before[k - 1], k), (before[k - 1] - 1, k - 1)):
        blocks, dec = run(chat(10), {"threshold_tokens": threshold, "summary_tokens": 50})
        assert int(dec["from_call"].min()) == fired_at, threshold
        assert tokens_at(blocks)[fired_at] < before[fired_at]
    blocks, dec = run(chat(10), {"threshold_tokens": max(before.values()), "summary_tokens": 50})
    assert dec.height == 0 and blocks.height == make_blocks(chat(10)).collect().height


def test_the_history_before_the_current_step_becomes_one_summary_of_the_size_asked() -> None:
    before = tokens_at(make_blocks(chat(10)).collect())
    blocks, dec = run(chat(10), {"threshold_tokens": before[4], "summary_tokens": 120})
    k = int(dec["from_call"].min())
    seen = visible(blocks, k)
    # the system prompt, the summary, the latest assistant message and the user message after it
    assert seen["role"].to_list() == ["system", "user", "assistant", "user"]
    summary = blocks.filter(pl.col("origin") == ORIGIN).sort("first_call")
    s = summary.row(0, named=True)
    assert s["first_call"] == k and s["text"].startswith("[Simulated auto-compaction:")
    assert text_tokens([s["text"]], CTX)[0] == 120
    dropped, size, request = parse_summary(s["text"])
    assert size == 120 and request == before[k] and dropped > 0
    # decisions: a `compact` drop per row removed, one `insert` for the summary, in one new epoch
    acts = dict(dec.group_by("action").len().iter_rows())
    assert acts["insert"] == summary.height and acts["compact"] == len(set(dec.filter(
        pl.col("action") == "compact")["entry_id"].to_list()))
    first = dec.filter(pl.col("from_call") == k)
    assert set(first["reason"].to_list()) == {"threshold", "simulated_summary"}
    assert first["cache_epoch"].n_unique() == 1 and first["cache_epoch"][0] == k + 1
    # later firings replace the summary: one summary at a time, each ends where the next starts
    if summary.height > 1:
        assert summary["last_call"].to_list()[:-1] == summary["first_call"].to_list()[1:]
    for call in range(k, max(before) + 1):
        assert visible(blocks, call).filter(pl.col("origin") == ORIGIN).height == 1


def test_requests_after_a_firing_stay_under_the_threshold_until_the_next() -> None:
    threshold = 700
    blocks, dec = run(chat(14), {"threshold_tokens": threshold, "summary_tokens": 100})
    after = tokens_at(blocks)
    fired = sorted(set(dec["from_call"].to_list()))
    assert len(fired) >= 2
    for call, tok in after.items():
        if call >= fired[0]:
            assert tok <= threshold, (call, tok)


def test_keep_recent_turns_keeps_whole_turns() -> None:
    before = tokens_at(make_blocks(chat(10)).collect())
    blocks, dec = run(chat(10), {"threshold_tokens": before[6], "summary_tokens": 50, "keep_recent_turns": 2})
    k = int(dec["from_call"].min())
    seen = visible(blocks, k)
    # the system prompt, the summary, then the two latest turns whole (user, assistant, user)
    assert seen["role"].to_list() == ["system", "user", "user", "assistant", "user"]
    assert seen["text"].to_list()[2].startswith(f"question {k - 1}") and seen["text"].to_list()[4].startswith(f"question {k}")


def test_a_recorded_compaction_agent_is_left_as_recorded() -> None:
    before = tokens_at(make_blocks(chat(10)).collect())
    params = {"threshold_tokens": before[4], "summary_tokens": 50}
    assert run(chat(10), params, thread_id="agent-a1b2c3")[1].height > 0      # a subagent compacts
    blocks, dec = run(chat(10), params, thread_id="agent-acompact-a1b2c3")   # the summarisation request: no
    assert dec.height == 0 and blocks.filter(pl.col("origin") == ORIGIN).height == 0


def test_a_second_run_decides_nothing() -> None:
    res = run_stage("auto_compact", make_blocks(chat(12)), {"threshold_tokens": 600, "summary_tokens": 80}, ctx=CTX)
    assert res.decisions.collect().height > 0
    again = run_stage("auto_compact", res.blocks, {"threshold_tokens": 600, "summary_tokens": 80}, ctx=CTX)
    assert again.decisions.collect().height == 0


@pytest.mark.parametrize(("params", "words"), [
    ({"threshold_tokens": 0}, "threshold_tokens must be positive"),
    ({"threshold_tokens": 100, "summary_tokens": 100}, "must be below threshold_tokens"),
    ({"keep_recent_turns": -1}, "must not be negative"),
])
def test_bad_params_are_refused(params: dict[str, Any], words: str) -> None:
    with pytest.raises(SpecError, match=words):
        resolve_params(get_stage("auto_compact"), params, where="test")
