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
from ctxreplay.pipeline.staging.spec import load_spec

SID = "d1a90000-0000-4000-8000-000000000001"


def _entry(uuid: str, parent: str | None, role: str, content: Any, t: int, **msg: Any) -> dict[str, Any]:
    m: dict[str, Any] = {"role": role, "content": content}
    e: dict[str, Any] = {"type": role, "uuid": uuid, "parentUuid": parent, "sessionId": SID, "isSidechain": False,
                         "timestamp": f"2026-06-01T10:{t // 60:02d}:{t % 60:02d}.000Z", "message": m}
    if role == "assistant":
        e["requestId"] = f"req_{uuid}"
        m.update(id=f"msg_{uuid}", type="message", model="claude-opus-4-8", stop_reason="end_turn", **msg)
    return e


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


@pytest.mark.corpus
def test_every_diagnosis_of_the_second_corpus_reaches_calls(corpus_extra: Path, tmp_path: Path) -> None:
    """corpus-extra's Claude Code tree records 67 diagnoses (one per API message, on every line of it)."""
    run([corpus_extra / "claude-projects"], load_spec(preset="identity"), RunOptions(out_dir=tmp_path / "o"))
    calls = pl.read_parquet(tmp_path / "o" / "calls.parquet")
    got = dict(calls.group_by("recorded_miss_reason").len().drop_nulls().iter_rows())
    assert got == {"messages_changed": 20, "previous_message_not_found": 22, "unavailable": 14, "tools_changed": 6,
                   "system_changed": 3, "model_changed": 2}
    d = calls.filter(pl.col("recorded_miss_reason").is_not_null())
    # the changed kinds carry the tokens they missed; previous_message_not_found and unavailable do not
    assert d.filter(pl.col("recorded_missed_tokens").is_null())["recorded_miss_reason"].unique().sort().to_list() == [
        "previous_message_not_found", "unavailable"]
    assert d.filter((pl.col("recorded_miss_reason") == "system_changed")
                    & (pl.col("recorded_missed_tokens") == 119127)).height == 1
