"""L5a result_budget (docs/layers.md): caps, cuts, aggregate, spill, frozen decisions."""

from __future__ import annotations

import hashlib
import re
from typing import Any

import polars as pl
import pytest

from ctxreplay.errors import SpecError
from ctxreplay.pipeline.stageapi.registry import StageContext, get_stage
from ctxreplay.pipeline.staging.spec import resolve_params
from ctxreplay.stages.result_budget import MARKER_RE, spilled_texts
from ctxreplay.testkit import make_blocks, run_stage, visible


def results(*bodies: str, error: bool = False, later: list[str] | None = None) -> list[dict[str, Any]]:
    """A user row, an assistant calling one tool per body, the results; optionally a second turn."""
    msgs: list[dict[str, Any]] = [
        {"role": "user", "text": "go"},
        {"role": "assistant", "blocks": [{"type": "tool_use", "tool_use_id": f"t{i}", "tool_name": "Bash",
                                          "tool_input": {"i": i}} for i in range(len(bodies))]},
        {"role": "user", "blocks": [{"type": "tool_result", "tool_use_id": f"t{i}", "tool_name": "Bash", "text": b,
                                     "part_type": "string", "is_error": error} for i, b in enumerate(bodies)]},
        {"role": "assistant", "text": "ok"},
    ]
    for j, b in enumerate(later or []):
        msgs += [{"role": "assistant", "blocks": [{"type": "tool_use", "tool_use_id": f"l{j}", "tool_name": "Bash",
                                                   "tool_input": {}}]},
                 {"role": "user", "blocks": [{"type": "tool_result", "tool_use_id": f"l{j}", "text": b}]},
                 {"role": "assistant", "text": "ok"}]
    return msgs


def run(messages: list[dict[str, Any]], params: dict[str, Any] | None = None, *, ctx: StageContext | None = None,
        ledger: pl.LazyFrame | None = None) -> tuple[pl.DataFrame, pl.DataFrame]:
    res = run_stage("result_budget", make_blocks(messages), params or {}, ctx=ctx, ledger=ledger)
    return res.blocks.collect(), res.decisions.collect().sort("entry_id", "block_pos")


def result_texts(blocks: pl.DataFrame, call: int = 2) -> list[str]:
    return visible(blocks, call).filter(pl.col("block_type") == "tool_result")["text"].to_list()


def test_under_the_cap_nothing_changes() -> None:
    _, dec = run(results("a" * 1_000), {"max_result_chars": 1_000})
    assert dec.height == 0


def test_over_the_cap_keeps_head_and_tail_with_the_exact_marker() -> None:
    body = "".join(chr(ord("a") + i % 26) for i in range(1_000))  # no newlines
    blocks, dec = run(results(body), {"max_result_chars": 200})
    (text,) = result_texts(blocks)
    head, n, tail = re.fullmatch(r"(?s)(.*)\n…(\d+) chars truncated…\n(.*)", text).groups()  # type: ignore[union-attr]
    assert body.startswith(head) and body.endswith(tail)
    assert len(head) + int(n) + len(tail) == 1_000
    assert len(text) <= 200 and abs(len(head) - len(tail)) <= 1  # head_ratio 0.5
    assert dec.select("action", "reason", "from_call", "before_len").rows() == [("truncate", "max_result_chars", 1, 1_000)]


def test_cuts_snap_to_newlines_within_twenty_percent() -> None:
    body = "\n".join(f"row {i:04d} " + "z" * 30 for i in range(100))  # 40-char lines
    blocks, _ = run(results(body), {"max_result_chars": 600})
    (text,) = result_texts(blocks)
    head, tail = text.split("\n…")[0], text.split("truncated…\n")[1]
    assert body.startswith(head + "\n") and body.endswith("\n" + tail)  # whole lines on both sides
    assert head.count("\n") >= 5 and tail.startswith("row ")


def test_head_ratio_moves_the_split() -> None:
    body = "x" * 2_000
    blocks, _ = run(results(body), {"max_result_chars": 500, "head_ratio": 0.8})
    (text,) = result_texts(blocks)
    head, tail = text.split("\n…")[0], text.split("truncated…\n")[1]
    assert len(head) > 3 * len(tail)


def test_cut_never_splits_a_multibyte_character_or_surrogate_pair_13() -> None:
    body = "é😀中" * 500  # 2-, 4- (a UTF-16 surrogate pair) and 3-byte characters
    for cap in (101, 102, 103, 250, 333):
        blocks, _ = run(results(body), {"max_result_chars": cap})
        (text,) = result_texts(blocks)
        text.encode("utf-8")  # valid UTF-8, no lone surrogate
        head, tail = text.split("\n…")[0], text.split("truncated…\n")[1]
        assert body.startswith(head) and body.endswith(tail)
        assert "\ud83d" not in text and "\ude00" not in text


def test_cap_is_a_share_of_the_window() -> None:
    body = "y" * 5_000
    _, dec = run(results(body), {"max_result_chars": 50_000}, ctx=StageContext(window_tokens=2_000))
    assert dec.height == 1  # 0.3 × 2,000 × 4 = 2,400 characters
    _, dec = run(results(body), {"max_result_chars": 50_000}, ctx=StageContext(window_tokens=200_000))
    assert dec.height == 0


def test_aggregate_cap_cuts_the_largest_results_of_one_turn_to_one_level() -> None:
    blocks, dec = run(results("a" * 300, "b" * 3_000, "c" * 5_000), {"aggregate_max_chars": 4_000})
    texts = result_texts(blocks)
    assert texts[0] == "a" * 300  # small results stay
    assert sum(len(t) for t in texts) <= 4_000
    assert abs(len(texts[1]) - len(texts[2])) <= 2  # both cut to the same level
    assert set(dec["reason"]) == {"aggregate"} and dec.height == 2


def test_aggregate_counts_only_results_that_appear_together() -> None:
    _, dec = run(results("a" * 3_000, later=["b" * 3_000]), {"aggregate_max_chars": 4_000})
    assert dec.height == 0


def test_never_emits_an_empty_result() -> None:
    blocks, _ = run(results("q" * 900, "r" * 900), {"aggregate_max_chars": 10})
    for t in result_texts(blocks):
        assert re.fullmatch(r"\n…\d+ chars truncated…\n", t)


def test_spill_replaces_the_result_by_a_persisted_output_preview() -> None:
    body = "\n".join(f"line {i}" for i in range(2_000))
    blocks, dec = run(results(body), {"max_result_chars": 1_000, "spill": True, "spill_preview_chars": 100})
    (text,) = result_texts(blocks)
    sha = hashlib.sha256(body.encode()).hexdigest()
    first, *preview, last = text.split("\n")
    assert first == f'<persisted-output ref="spill://sha256/{sha}" chars="{len(body)}" sha256="{sha[:12]}">'
    assert last == "</persisted-output>"
    assert "\n".join(preview) == "\n".join(f"line {i}" for i in range(len(preview)))
    assert dec.select("action", "reason").rows() == [("spill", "max_result_chars")]


def test_the_runner_can_recover_spilled_text() -> None:
    body = "s" * 3_000
    msgs = results(body)
    res = run_stage("result_budget", make_blocks(msgs), {"max_result_chars": 1_000, "spill": True})
    store = spilled_texts(make_blocks(msgs), res.decisions).collect()
    assert store.select("text").rows() == [(body,)]
    assert store["ref"][0] == "spill://sha256/" + hashlib.sha256(body.encode()).hexdigest()


def test_errors_are_never_spilled() -> None:
    _, dec = run(results("e" * 3_000, error=True), {"max_result_chars": 1_000, "spill": True})
    assert dec["action"].to_list() == ["truncate"]


def test_decided_at_first_appearance_and_kept_for_every_later_call() -> None:
    blocks, dec = run(results("w" * 3_000, later=["v" * 10]), {"max_result_chars": 1_000})
    assert dec["from_call"].to_list() == [1]
    row = blocks.filter((pl.col("tool_use_id") == "t0") & (pl.col("block_type") == "tool_result"))
    assert row.select("first_call", "last_call").rows() == [(1, None)]  # one version: no prefix change later


def test_second_pass_decides_nothing() -> None:
    params = {"max_result_chars": 500, "aggregate_max_chars": 900}
    res = run_stage("result_budget", make_blocks(results("a" * 2_000, "b" * 700)), params)
    again = run_stage("result_budget", res.blocks, params)
    assert again.decisions.collect().height == 0


def test_ledger_decisions_are_reapplied_byte_identically() -> None:
    msgs = results("k" * 3_000)
    _, dec = run(msgs, {"max_result_chars": 1_000})
    # a later run with a larger cap would not truncate, but the recorded decision is frozen
    blocks, dec2 = run(msgs, {"max_result_chars": 100_000}, ledger=dec.lazy())
    assert dec2.select("after_sha256", "replacement").rows() == dec.select("after_sha256", "replacement").rows()
    assert re.search(MARKER_RE, result_texts(blocks)[0])


def test_ledger_hash_mismatch_is_a_conflict_and_decided_afresh() -> None:
    _, dec = run(results("k" * 3_000), {"max_result_chars": 1_000})
    blocks, dec2 = run(results("m" * 3_000), {"max_result_chars": 1_000}, ledger=dec.lazy())
    assert sorted(dec2["action"].to_list()) == ["conflict", "truncate"]
    assert result_texts(blocks)[0].startswith("m")


def test_params_are_validated() -> None:
    with pytest.raises(SpecError, match="head_ratio"):
        resolve_params(get_stage("result_budget"), {"head_ratio": 1.5}, where="t")
