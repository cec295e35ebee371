"""Real-world tool-call failures that got agents stuck on a provider 400, as small transcripts
written from scratch (tests/fixtures/failures/<name>.jsonl, Claude Code or OpenClaw format). Each
replays, under a spec with the pairing stage (and the other layers, in the order of
layer-semantics §2), to a pending request and calls that pass the target's validator; each test
also checks the repair that made it so."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import polars as pl
import pytest

from ctxreplay.pipeline.batch.runner import RunOptions, RunResult, run
from ctxreplay.pipeline.core.tokens import CHARS4_COUNTER
from ctxreplay.pipeline.staging.spec import load_spec

FIXTURES = Path(__file__).parent / "fixtures" / "failures"
TARGETS = ["anthropic", "openai-chat", "openai-responses", "gemini"]

@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, RunResult]:
    """One run of every fixture per target (all calls materialised and validated)."""
    spec = load_spec(preset="default")  # every layer, in the §2 order
    out = {}
    for target in TARGETS:
        tmp = tmp_path_factory.mktemp(target)
        out[target] = run([FIXTURES], spec, RunOptions(out_dir=tmp / "o", target=target, all_calls=True,
                                                       token_counter=CHARS4_COUNTER))
    return out


def outcome(res: RunResult, name: str, stage: str = "pairing") -> tuple[list[Any], Counter[str], pl.DataFrame]:
    """(violations, decisions of `stage` by action:reason, calls) of the fixture `name`."""
    sessions = res.blocks.filter(pl.col("source_file").str.ends_with(f"/{name}.jsonl"))["session_id"].unique().to_list()
    assert len(sessions) == 1, f"{name}: {sessions}"
    calls = res.calls.filter(pl.col("session_id") == sessions[0])
    keys = set(calls["thread_key"].to_list())
    violations = [v for v in res.violations if v.thread_key in keys]
    from ctxreplay.pipeline.staging.ledger import Ledger

    led = Ledger(Path(res.summary["ledger"]), read_only=True)
    try:
        d = led.decisions()
    finally:
        led.close()
    d = d.filter((pl.col("session_id") == sessions[0]) & pl.col("stage").str.starts_with(stage))
    return violations, Counter(f"{a}:{r}" for a, r in d.select("action", "reason").iter_rows()), calls


def passes(runs: dict[str, RunResult], name: str, targets: list[str] = TARGETS,
           stage: str = "pairing") -> dict[str, Counter[str]]:
    """Assert every call of the fixture passes each target's validator; the repairs (decisions of
    `stage` by action:reason) per target, for the test to check on every target."""
    repaired: dict[str, Counter[str]] = {}
    for t in targets:
        violations, decisions, calls = outcome(runs[t], name, stage)
        assert calls.filter(pl.col("is_pending")).height == 1
        assert not violations, f"{name} under {t}: " + "; ".join(map(str, violations[:5]))
        repaired[t] = decisions
    return repaired


def test_every_fixture_is_loaded_without_quarantine(runs: dict[str, RunResult]) -> None:
    s = runs["anthropic"].summary
    assert s["files"] == len(list(FIXTURES.glob("*.jsonl"))) == 11
    assert s["quarantined_lines"] == 0


def test_dangling_tool_use_after_crash_then_resume(runs: dict[str, RunResult]) -> None:
    for d in passes(runs, "dangling_tool_use_after_crash_then_resume").values():
        assert d["insert:missing"] == 1


def test_aborted_assistant_with_partial_tool_call(runs: dict[str, RunResult]) -> None:
    # no synthetic result: the frame is dropped (text block and partial call)
    for d in passes(runs, "aborted_assistant_partial_tool_call").values():
        assert d["drop:failed_frame"] == 2 and d["insert:missing"] == 0


def test_synthetic_result_for_aborted_call_creates_orphan(runs: dict[str, RunResult]) -> None:
    # the aborted call and the synthetic result written for it go together
    for d in passes(runs, "synthetic_result_for_aborted_call_orphan").values():
        assert d["drop:failed_frame"] == 2


def test_tool_use_without_input(runs: dict[str, RunResult]) -> None:
    # sanitize drops the invalid call and its result together; nothing is left for pairing to
    # attach to another call
    for t, d in passes(runs, "tool_use_without_input", stage="sanitize").items():
        assert d["drop:invalid_tool_call"] == 1 and d["drop:call_dropped"] == 1, t
    for t, d in passes(runs, "tool_use_without_input").items():
        assert not d["drop:orphan"] and not d["replace:reattached"], t


def test_orphan_tool_result(runs: dict[str, RunResult]) -> None:
    for d in passes(runs, "orphan_tool_result").values():
        assert d["drop:orphan"] == 1


def test_results_out_of_order_with_user_message_between(runs: dict[str, RunResult]) -> None:
    for d in passes(runs, "results_out_of_order_user_between").values():
        assert d["move:displaced"] + d["replace:tool_id+displaced"] == 2


def test_same_tool_id_in_two_turns(runs: dict[str, RunResult]) -> None:
    for d in passes(runs, "same_tool_id_two_turns").values():
        assert d["drop:duplicate"] == 0 and d["replace:tool_id"] >= 2


def test_result_without_id_next_to_single_call(runs: dict[str, RunResult]) -> None:
    for d in passes(runs, "result_without_id_single_call").values():
        assert d["replace:reattached"] == 1


def test_history_starting_with_assistant_function_call(runs: dict[str, RunResult]) -> None:
    # a warm-up / resumed history that starts with the model's turn: every target puts the
    # `(session bootstrap)` user turn first, also in call 0's request (nothing recorded before it)
    passes(runs, "history_starts_with_assistant_call")
    for t in TARGETS:
        _, _, calls = outcome(runs[t], "history_starts_with_assistant_call")
        key = calls["thread_key"][0]
        out = Path(runs[t].summary["out_dir"]) / "requests"
        first = json.loads((out / f"{key}.jsonl").read_text().splitlines()[0])
        assert first["call"] == 0
        assert "(session bootstrap)" in json.dumps(first["request"]), t
        assert calls.filter(pl.col("call") == 0)["n_messages"].to_list() == [1], t
        # the Messages and Gemini APIs want a user turn first in every request; the OpenAI APIs
        # take a history that starts with the assistant as it is
        pending = (out / f"{key}.json").read_text()
        assert ('"(session bootstrap)"' in pending) == (t in ("anthropic", "gemini")), t


def test_openai_function_call_without_output(runs: dict[str, RunResult]) -> None:
    # "No tool output found for function call": OpenAI targets get the synthetic output `aborted`
    for d in passes(runs, "function_call_without_output").values():
        assert d["insert:missing"] == 1
    out = Path(runs["openai-responses"].summary["out_dir"]) / "requests"
    assert any('"output":"aborted"' in p.read_text().replace(" ", "") for p in out.glob("*.json"))


def test_output_without_call(runs: dict[str, RunResult]) -> None:
    for d in passes(runs, "output_without_call").values():
        assert d["drop:orphan"] == 1
