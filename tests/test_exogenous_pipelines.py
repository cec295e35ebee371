"""A change no context policy causes or prevents breaks every pipeline at the call where it happened
(issue 20, acceptance): a Claude Code session whose answer at call 2 records a system prompt change
(its read stops before the messages; the server says `system_changed`), run through `compare` under
every shipped preset that applies to it. The simulator-level rule is tests/test_cachesim.py's."""

from __future__ import annotations

import json
from typing import Any

import polars as pl
import pytest

from ctxreplay.pipeline.reporting.compare import compare, parse_choice
from tests.cckit import cc_entry

SID = "e0a90000-0000-4000-8000-000000000001"
PRESETS = ["identity", "minimal", "default", "claude-code", "context-editing"]


def _usage(read: int, write: int) -> dict[str, Any]:
    return {"input_tokens": 3, "output_tokens": 30, "cache_read_input_tokens": read, "cache_creation_input_tokens": write,
            "cache_creation": {"ephemeral_5m_input_tokens": write, "ephemeral_1h_input_tokens": 0}}


@pytest.fixture(scope="module")
def calls(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pl.DataFrame]:
    tmp = tmp_path_factory.mktemp("exo")
    mp = pytest.MonkeyPatch()
    mp.setenv("CTXREPLAY_CACHE_DIR", str(tmp / "price-cache"))
    model = "claude-sonnet-4-5"
    reads = [(0, 22000), (22000, 600), (0, 23000), (23000, 500)]       # call 2: nothing read, all written again
    lines, parent = [], None
    for k, (read, write) in enumerate(reads):
        # a blank text beside the question: sanitize drops it, so the pipelines' requests differ
        lines.append(cc_entry(SID, f"u{k}", parent, "user", [{"type": "text", "text": f"question {k} " * 200},
                                                             {"type": "text", "text": "  "}], 20 * k))
        diag = {"diagnostics": {"cache_miss_reason": {"type": "system_changed", "cache_missed_input_tokens": 22600}}} \
            if k == 2 else {}
        lines.append(cc_entry(SID, f"a{k}", f"u{k}", "assistant", [{"type": "text", "text": f"answer {k}"}],
                              20 * k + 5, model=model, usage=_usage(read, write), **diag))
        parent = f"a{k}"
    proj = tmp / "projects" / "p"
    proj.mkdir(parents=True)
    (proj / f"{SID}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    try:
        res = compare([tmp / "projects"], [parse_choice(p) for p in PRESETS])
    finally:
        mp.undo()
    return {ch.label: c.filter(~pl.col("is_pending")).sort("call") for ch, c in zip(res.choices, res.calls, strict=True)}


@pytest.mark.parametrize("preset", PRESETS)
def test_a_recorded_system_change_breaks_every_pipeline_at_its_call(calls: dict[str, pl.DataFrame], preset: str) -> None:
    c = calls[preset]
    assert c["call"].to_list() == [0, 1, 2, 3]
    assert c["recorded_break_cause"].to_list() == [None, None, "preamble", None]
    assert c["sim_break_cause"].to_list() == [None, None, "preamble", None], c.select("call", "sim_break_detail")
    r = c.row(2, named=True)
    assert r["sim_break_detail"].startswith("replayed: ") and r["sim_cache_read_tokens"] == 0


def test_the_pipelines_send_other_requests(calls: dict[str, pl.DataFrame]) -> None:
    """The break is not the same requests simulated five times: the layers changed them."""
    shas = {p: tuple(c["request_sha256"].to_list()) for p, c in calls.items()}
    assert shas["default"] != shas["identity"]
