"""The stage contract (issue 9): typed context, declared dependencies, one error root, the runner's
typed result, and the re-application of frozen decisions by the runner."""

from __future__ import annotations

import dataclasses

import polars as pl
import pytest

from ctxreplay.errors import CtxReplayError, SpecError, StageFailed
from ctxreplay.pipeline.stageapi.registry import StageContext, get_stage, load_stages
from ctxreplay.pipeline.staging.spec import parse_spec
from ctxreplay.pipeline.staging.stagerun import CallMap, LedgerView, StagesResult, run_stages
from ctxreplay.testkit import make_blocks


def test_the_context_declares_every_field_and_has_no_side_channel() -> None:
    names = {f.name for f in dataclasses.fields(StageContext)}
    assert names == {"target", "window_tokens", "count_tokens", "token_counter_version", "supports_images", "peers"}


def test_a_pipeline_without_a_required_stage_is_refused_before_any_data_is_read() -> None:
    with pytest.raises(SpecError) as e:
        parse_spec('[[stage]]\nuse = "tombstone"\n', source="spec.toml")
    assert str(e.value) == ("spec.toml [[stage]] #1 (tombstone): needs stage 'pairing' earlier in the pipeline, and "
                            "there is none before it. Add a [[stage]] with use = \"pairing\" before #1")
    with pytest.raises(SpecError, match=r"#1 \(pairing\): needs stage 'sanitize' earlier"):
        parse_spec('[[stage]]\nuse = "pairing"\n[[stage]]\nuse = "sanitize"\n', source="spec.toml")
    parse_spec('[[stage]]\nuse = "sanitize"\n[[stage]]\nuse = "pairing"\n[[stage]]\nuse = "tombstone"\n', source="ok")


def test_declared_needs_of_the_builtins() -> None:
    st = load_stages()
    assert st["snip"].reads == ("tombstone",) and st["snip"].requires == ("pairing",)
    assert st["images"].encoder_version and st["images"].encoder_version.startswith("Pillow ")
    assert st["result_budget"].spilled_texts is not None and st["snip"].rebuild is not None
    assert {n for n, s in st.items() if s.frozen} == {"result_budget", "snip", "tombstone"}


def test_peer_gives_the_pipeline_stage_or_defaults_when_run_alone() -> None:
    alone = StageContext()
    ref = alone.peer("tombstone")
    assert ref is not None and ref.params == get_stage("tombstone").params()
    assert StageContext(peers=()).peer("tombstone") is None


def test_stage_failed_carries_its_facts_and_is_a_ctxreplay_error() -> None:
    err = StageFailed("pairing#2", 7, ValueError("bad"), kind="raised")
    assert isinstance(err, CtxReplayError) and (err.stage, err.position, err.kind) == ("pairing#2", 7, "raised")
    assert str(err) == "stage 'pairing#2' (#7) failed: ValueError: bad"


def test_run_stages_returns_a_typed_result_with_one_outcome_per_position() -> None:
    spec = parse_spec('[[stage]]\nuse = "sanitize"\n[[stage]]\nuse = "pairing"\n[[stage]]\nuse = "pairing"\n',
                      source="t")
    blocks = make_blocks([{"role": "user", "text": "hi"}, {"role": "assistant", "blocks": [
        {"type": "tool_use", "tool_use_id": "t1", "tool_name": "Read", "tool_input": {}}]},
        {"role": "user", "text": "next"}, {"role": "assistant", "text": "ok"}]).collect()
    res = run_stages(blocks, spec, LedgerView(CallMap.from_blocks(blocks)), StageContext())
    assert isinstance(res, StagesResult) and [o.name for o in res.outcomes] == ["sanitize", "pairing", "pairing#2"]
    assert res.stats()["pairing"]["decisions"] == 1  # the synthetic result of the unanswered call
    assert res.failures == () and res.conflicts == 0
    assert set(res.applied["stage"]) == {"pairing"} and not res.applied["is_provisional"].any()
    # the second pairing decides nothing new (idempotent), and nothing is new to an empty ledger twice
    assert res.stats()["pairing#2"]["decisions"] == 0


def test_call_keys_are_the_messages_that_answer_each_call() -> None:
    blocks = make_blocks([{"role": "user", "text": "a"}, {"role": "assistant", "text": "b"},
                          {"role": "user", "text": "c"}, {"role": "assistant", "text": "d"},
                          {"role": "user", "text": "e"}]).collect()
    calls = CallMap.from_blocks(blocks)
    assert calls.keys.sort("call").select("call", "call_key").rows() == [(0, "e0001"), (1, "e0003")]
    assert calls.pending["pending_call"].to_list() == [2]
    # a decision recorded with a call key lands on this run's thread and call of that key
    raw = pl.DataFrame({"session_id": ["s1"], "thread_id": ["old-name"], "entry_id": ["e0000"], "block_pos": [0],
                        "part_pos": [0], "tool_use_id": [None], "from_call": [5], "action": ["drop"], "reason": ["x"],
                        "before_sha256": [None], "after_sha256": [None], "before_len": [None], "after_len": [None],
                        "replacement": [None], "cache_epoch": [0], "stage": ["snip"], "seq": [0],
                        "call_key": ["e0003"]})
    view = LedgerView.translate(raw.cast({"block_pos": pl.Int32, "part_pos": pl.Int32, "from_call": pl.Int32,
                                          "cache_epoch": pl.Int32, "tool_use_id": pl.String,
                                          "before_sha256": pl.String, "after_sha256": pl.String,
                                          "before_len": pl.Int64, "after_len": pl.Int64,
                                          "replacement": pl.String, "seq": pl.Int64}), calls)
    assert view.for_stage("snip").select("thread_id", "from_call").rows() == [("main", 1)]


def test_every_placeholder_string_is_documented_and_used_as_written() -> None:
    """docs/layers.md lists the exact strings (the modules that write them import them from
    ctxreplay.pipeline.core.constants, their one definition)."""
    import re
    from pathlib import Path

    from ctxreplay.pipeline.core import constants as c

    doc = (Path(__file__).resolve().parent.parent / "docs" / "layers.md").read_text()
    strings = [c.FAILED_TURN_TEXT, c.REASONING_OMITTED_TEXT, c.UNAVAILABLE_TOOL_TEXT, c.REDACTED_TEXT,
               c.INTER_SESSION_HEADER, c.INTER_SESSION_EXPLANATION, c.INTER_SESSION_NO_TEXT_BODY, c.IMAGE_OMITTED_TEXT,
               c.IMAGE_STALE_TEXT, c.NO_IMAGE_INPUT_TEXT, c.MISSING_RESULT_TEXT, c.MISSING_RESULT_TEXT_OPENAI,
               c.SNIP_MARKER_TEXT, c.CLEARED_TEXT, c.BOOTSTRAP_TEXT]
    for s in strings:
        assert re.sub(r"\{([a-z_]+)\}", r"<\1>", s) in doc, s
    assert re.fullmatch(c.SNIP_MARKER_RE, c.SNIP_MARKER_TEXT.format(n=3, t=120))
