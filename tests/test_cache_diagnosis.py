"""The server's own cache diagnosis (Anthropic `diagnostics.cache_miss_reason`, recorded by Claude
Code 2.1.140+): read for every call into calls.parquet (`recorded_miss_reason`,
`recorded_missed_tokens`), taken as the recorded break's cause where present, and measured against
our own inference on the real sessions that carry it (../shared/corpus-extra)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import polars as pl
import pytest

from ctxreplay.pipeline.batch.runner import RunOptions, run
from ctxreplay.pipeline.cost import breaks
from ctxreplay.pipeline.staging.spec import load_spec
from tests.cckit import cc_entry

SID = "d1a90000-0000-4000-8000-000000000001"


def _entry(uuid: str, parent: str | None, role: str, content: Any, t: int, **msg: Any) -> dict[str, Any]:
    if role == "assistant":
        msg = {"model": "claude-opus-4-8", **msg}
    return cc_entry(SID, uuid, parent, role, content, t, **msg)


def test_run_writes_the_diagnosis_of_every_call(tmp_path: Path) -> None:
    usage = {"input_tokens": 3, "output_tokens": 10, "cache_read_input_tokens": 0,
             "cache_creation_input_tokens": 5000,
             "cache_creation": {"ephemeral_5m_input_tokens": 0, "ephemeral_1h_input_tokens": 5000}}
    diags: list[Any] = [None, {"cache_miss_reason": {"type": "tools_changed", "cache_missed_input_tokens": 4200}},
                        {"cache_miss_reason": {"type": "a_type_from_2027"}}, "absent"]
    lines, parent = [], None
    for i, d in enumerate(diags):
        lines.append(_entry(f"u{i}", parent, "user", f"question {i}", 10 * i))
        extra = {} if d == "absent" else {"diagnostics": d}
        lines.append(_entry(f"a{i}", f"u{i}", "assistant", [{"type": "text", "text": f"answer {i}"}], 10 * i + 5,
                            usage=usage, **extra))
        parent = f"a{i}"
    proj = tmp_path / "projects" / "p"
    proj.mkdir(parents=True)
    (proj / f"{SID}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    run([tmp_path / "projects"], load_spec(preset="identity"), RunOptions(out_dir=tmp_path / "out"))
    calls = pl.read_parquet(tmp_path / "out" / "calls.parquet").filter(~pl.col("is_pending")).sort("call")
    assert calls["recorded_miss_reason"].to_list() == [None, "tools_changed", "a_type_from_2027", None]
    assert calls["recorded_missed_tokens"].to_list() == [None, 4200, None, None]


def test_report_breaks_shows_the_servers_reason_beside_ours(tmp_path: Path) -> None:
    """A new turn after thinking (a thinking strip, by the transcript: Sonnet 4.5 strips earlier
    thinking) where the server says the system prompt changed: the break's cause is the preamble
    change, the server's reason and the missed tokens beside it, our inferred cause in the detail."""
    from click.testing import CliRunner

    from ctxreplay.pipeline.commands.cli import main

    def usage(read: int, write: int) -> dict[str, Any]:
        return {"input_tokens": 3, "output_tokens": 10, "cache_read_input_tokens": read,
                "cache_creation_input_tokens": write,
                "cache_creation": {"ephemeral_5m_input_tokens": 0, "ephemeral_1h_input_tokens": write}}

    think = {"type": "thinking", "thinking": "plan", "signature": "c2ln"}
    old = "claude-sonnet-4-5-20250929"
    lines = [_entry("u0", None, "user", "first question", 0),
             _entry("a0", "u0", "assistant", [think, {"type": "text", "text": "one"}], 5, usage=usage(17000, 9000),
                    model=old),
             _entry("u1", "a0", "user", "second question", 60),
             _entry("a1", "u1", "assistant", [{"type": "text", "text": "two"}], 65, usage=usage(17000, 9500), model=old,
                    diagnostics={"cache_miss_reason": {"type": "system_changed", "cache_missed_input_tokens": 9000}})]
    proj = tmp_path / "projects" / "p"
    proj.mkdir(parents=True)
    (proj / f"{SID}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "out"
    assert CliRunner().invoke(main, ["run", str(tmp_path / "projects"), "--preset", "identity", "--out", str(out),
                                     "-q"]).exit_code == 0
    r = CliRunner().invoke(main, ["report", "--breaks", str(out), "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    rec = [b for b in doc["breaks"] if b["source"] == "recorded"]
    assert [(b["call"], b["cause"], b["server_reason"], b["server_missed_tokens"], b["inferred_cause"]) for b in rec] == [
        (1, "preamble", "system_changed", 9000, "thinking_strip")]
    assert rec[0]["detail"].startswith("system prompt changed; server: system_changed, 9000 tokens missed; "
                                       "inferred thinking_strip")
    assert doc["diagnosis"]["breaks"] == 1 and doc["diagnosis"]["agree"] == 0
    t = CliRunner(env={"COLUMNS": "250"}).invoke(main, ["report", "--breaks", str(out)])
    assert t.exit_code == 0, t.output
    assert "system_changed (9,000 missed)" in t.output
    assert "server diagnosis on 1 recorded break(s), the cause taken from it; our inference alone puts 0 in the " \
           "same family" in t.output


@pytest.fixture(scope="module")
def extra_calls(corpus_extra: Path, tmp_path_factory: pytest.TempPathFactory) -> pl.DataFrame:
    out = tmp_path_factory.mktemp("diagnosis") / "o"
    run([corpus_extra / "claude-projects"], load_spec(preset="identity"), RunOptions(out_dir=out))
    return pl.read_parquet(out / "calls.parquet")


@pytest.mark.corpus
def test_every_diagnosis_of_the_second_corpus_reaches_calls(extra_calls: pl.DataFrame) -> None:
    """corpus-extra's Claude Code tree records 67 diagnoses (one per API message, on every line of it)."""
    calls = extra_calls
    got = dict(calls.group_by("recorded_miss_reason").len().drop_nulls().iter_rows())
    assert got == {"messages_changed": 20, "previous_message_not_found": 22, "unavailable": 14, "tools_changed": 6,
                   "system_changed": 3, "model_changed": 2}
    d = calls.filter(pl.col("recorded_miss_reason").is_not_null())
    # the changed kinds carry the tokens they missed; previous_message_not_found and unavailable do not
    assert d.filter(pl.col("recorded_missed_tokens").is_null())["recorded_miss_reason"].unique().sort().to_list() == [
        "previous_message_not_found", "unavailable"]
    assert d.filter((pl.col("recorded_miss_reason") == "system_changed")
                    & (pl.col("recorded_missed_tokens") == 119127)).height == 1


@pytest.mark.corpus
def test_every_diagnosed_break_is_attributed_to_the_servers_family(extra_calls: pl.DataFrame) -> None:
    d = extra_calls.filter(pl.col("recorded_break_cause").is_not_null()
                           & pl.col("recorded_miss_reason").is_in(list(breaks.SERVER_FAMILY)))
    assert d.height == 53
    fam = d.with_columns(f=pl.col("recorded_break_cause").replace_strict(breaks.CAUSE_FAMILY, default=None),
                         s=pl.col("recorded_miss_reason").replace_strict(breaks.SERVER_FAMILY))
    assert fam.filter(pl.col("f") != pl.col("s")).height == 0
    # `unavailable` (the server could not compare): 10 calls read the whole prefix (no break), the
    # others keep the cause we infer
    u = extra_calls.filter(pl.col("recorded_miss_reason") == "unavailable")
    assert u["recorded_break_cause"].value_counts().sort("recorded_break_cause").rows() == [
        (None, 10), ("compaction", 3), ("eviction", 1)]


@pytest.mark.corpus
def test_our_inference_against_the_servers_diagnosis(extra_calls: pl.DataFrame) -> None:
    """Our own inference (transcript and usage alone) puts 49 of the 53 breaks the server diagnoses
    in the server's family (39 before eviction was inferred: the 8 steps of a tool loop that read
    only what the previous request read, each after a request the server could not diagnose; 47
    before a thread the calibration found keeping its thinking stopped being given thinking strips:
    6edeb8ec call 7, a system change; 48 before models that keep their thinking by default stopped
    being given strips and a new turn that reads less inside the messages became a messages change:
    02fb0004 call 80 and baeb5d66 call 41 now agree, 02fb0004 call 53 no longer agrees by a strip it
    never was). The 4 left are not decidable from the files: a system change at a compaction (1)
    falls back where a messages change does; the messages changed at a new turn beyond the 20-block
    lookback (1) or after a failed request (`<synthetic>` 401, 1) and the read fell to the shared
    prefix, as after a change of the system prompt; the previous message not found after a
    `<synthetic>` rate-limit notice, whose id the server cannot know (1)."""
    a = breaks.diagnosis_agreement(extra_calls)
    assert (a["breaks"], a["agree"]) == (53, 49)
    assert a["families"] == {"gone": {"breaks": 22, "agree": 21}, "messages": {"breaks": 20, "agree": 18},
                             "model": {"breaks": 2, "agree": 2}, "preamble": {"breaks": 9, "agree": 8}}
    off = sorted((r["thread_key"][:8], r["call"], r["recorded_miss_reason"], r["recorded_break_inferred_cause"])
                 for r in a["disagree"])
    assert off == [("02fb0004", 53, "messages_changed", "preamble"),
                   ("67fded5a", 49, "messages_changed", "preamble"),
                   ("aaa0233d", 209, "previous_message_not_found", "messages_change"),
                   ("aaa0233d", 250, "system_changed", "compaction")]
    # the messages changes at new turns (a PostToolUse hook's context dropped, 02fb0004 and 49dcea81)
    mc = extra_calls.filter(pl.col("recorded_break_inferred_cause") == "messages_change")
    assert mc["recorded_miss_reason"].value_counts().sort("recorded_miss_reason").rows() == [
        ("messages_changed", 16), ("previous_message_not_found", 1)]
    ev = extra_calls.filter(pl.col("recorded_break_inferred_cause") == "eviction")
    assert ev["recorded_miss_reason"].value_counts().sort("recorded_miss_reason").rows() == [
        ("previous_message_not_found", 8), ("unavailable", 1)]
