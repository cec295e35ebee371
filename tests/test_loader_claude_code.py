"""Claude Code loader: messages, splits, usage, chains, branches, compaction, subagents, accounting."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest

from ctxreplay.pipeline.loaders import load_paths

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "data" / "samples" / "claude-projects"
SID = "5f0c1d2e-3a4b-4c5d-8e9f-0a1b2c3d4e5f"


def _blocks(paths) -> tuple[pl.DataFrame, object]:
    r = load_paths(paths)
    return pl.from_arrow(r.blocks), r  # type: ignore[return-value]


def _calls(df: pl.DataFrame) -> pl.DataFrame:
    return (df.filter(pl.col("is_call")).group_by("thread_id", "msg_key")
            .agg(call=pl.col("first_call").min() - 1, out=pl.col("usage_output").first())
            .sort("thread_id", "call"))


def test_sample_session_threads_and_calls() -> None:
    df, r = _blocks([SAMPLE])
    calls = _calls(df)
    assert calls.filter(pl.col("thread_id") == "main")["msg_key"].to_list() == [
        f"msg_demo_0{i}|req_demo_0{i}" for i in range(1, 7)]
    assert calls.filter(pl.col("thread_id") == "agent-a1b2c3d").height == 2
    assert set(df["session_id"].unique()) == {SID}
    # every line accounted: 23 + 4 lines, 5 non-message kinds in the main file
    main = next(ld for ld in r.loads if ld.path.endswith(f"{SID}.jsonl"))
    assert (main.lines, main.message_lines, sum(main.other_lines.values())) == (23, 18, 5)
    assert dict(main.other_lines) == {"file-history-snapshot": 1, "progress:bash_progress": 1,
                                      "system:turn_duration": 1, "system:compact_boundary": 1, "last-prompt": 1}


def test_split_message_is_one_message_with_the_largest_usage() -> None:
    df, _ = _blocks([SAMPLE])
    first = df.filter(pl.col("msg_key") == "msg_demo_01|req_demo_01").sort("block_pos")
    assert first["block_type"].to_list() == ["thinking", "text", "tool_use"]
    assert first["block_pos"].to_list() == [0, 1, 2]
    assert first["usage_output"].unique().to_list() == [61]  # the final copy, not the placeholder 1
    assert first["source_line"].to_list() == [3, 4, 5]  # each block keeps its own line


def test_parallel_tool_calls_off_chain_are_recovered() -> None:
    df, _ = _blocks([SAMPLE])
    main = df.filter(pl.col("thread_id") == "main")
    assert main.filter(pl.col("msg_key") == "msg_demo_02|req_demo_02")["tool_use_id"].to_list() == [
        "toolu_demo_B1", "toolu_demo_B2"]
    results = main.filter(pl.col("block_type") == "tool_result")["tool_use_id"].to_list()
    assert results.count("toolu_demo_B2") == 1


def test_compaction_hides_history_from_later_calls() -> None:
    df, _ = _blocks([SAMPLE])
    main = df.filter(pl.col("thread_id") == "main")
    summary = main.filter(pl.col("is_compact_summary"))
    assert summary["first_call"].to_list() == [4]
    before = main.filter(pl.col("order_key") < summary["order_key"][0])
    assert before["last_call"].unique().to_list() == [4]
    # the last answer before the boundary is a call no later request contains
    last = main.filter(pl.col("msg_key") == "msg_demo_04|req_demo_04")
    assert last["first_call"].to_list() == [4] and last["last_call"].to_list() == [4]


def _write(path: Path, entries: list) -> Path:
    path.write_text("".join((e if isinstance(e, str) else json.dumps(e)) + "\n" for e in entries))
    return path


def _u(uuid, parent, typ, content, **kw):
    msg = {"role": typ, "content": content}
    if typ == "assistant":
        msg.update(id=kw.pop("mid"), model="claude-x", usage={"input_tokens": 1, "output_tokens": 2})
    return {"type": typ, "uuid": uuid, "parentUuid": parent, "sessionId": "s1", "timestamp": "2026-01-01T00:00:00Z",
            "message": msg, "requestId": kw.pop("rid", None), **kw}


def test_rewind_branch_is_a_thread_of_its_own(tmp_path: Path) -> None:
    f = _write(tmp_path / "s1.jsonl", [
        _u("u1", None, "user", "hello"),
        _u("a1", "u1", "assistant", [{"type": "text", "text": "hi"}], mid="m1", rid="r1"),
        _u("u2", "a1", "user", "do X"),
        _u("a2", "u2", "assistant", [{"type": "text", "text": "X done"}], mid="m2", rid="r2"),
        _u("u3", "a1", "user", "no, do Y"),  # rewind: a new child of a1
        _u("a3", "u3", "assistant", [{"type": "text", "text": "Y done"}], mid="m3", rid="r3"),
    ])
    df, _ = _blocks([f])
    calls = _calls(df)
    assert calls.filter(pl.col("thread_id") == "main")["msg_key"].to_list() == ["m1|r1", "m3|r3"]
    branch = calls.filter(pl.col("thread_id") != "main")
    assert branch["thread_id"].to_list() == ["branch-u2"] and branch["msg_key"].to_list() == ["m2|r2"]
    # the branch call sees its own ancestry: u1, a1 (main reports that request), u2; calls are
    # numbered along the path (a1 is its call 0, a2 its call 1), as they were before the rewind
    b = df.filter(pl.col("thread_id") == "branch-u2").sort("order_key")
    assert b["entry_id"].to_list() == ["u1", "a1", "u2", "a2"]
    assert b.filter(pl.col("entry_id") == "a1")["is_call"].to_list() == [False]
    assert b.filter(pl.col("entry_id") == "a2")["first_call"].to_list() == [2]


def test_bad_lines_are_quarantined_and_glued_lines_recovered(tmp_path: Path) -> None:
    good = json.dumps(_u("u1", None, "user", "hello"))
    f = _write(tmp_path / "s1.jsonl", [
        good[:-1] + "}" + json.dumps({"type": "summary", "summary": "t", "leafUuid": "x"}),  # two objects glued
        "{not json",
        json.dumps({"type": "assistant", "uuid": "a9", "sessionId": "s1"}),  # no message object
        json.dumps([1, 2]),
        _u("a1", "u1", "assistant", [{"type": "text", "text": "hi"}], mid="m1", rid="r1"),
        "",
    ])
    _, r = _blocks([f])
    ld = r.loads[0]
    assert (ld.lines, ld.message_lines, sum(ld.other_lines.values()), ld.quarantined_lines) == (5, 2, 0, 3)
    reasons = {q.line: q.reason for q in ld.quarantine}
    assert reasons[2].startswith("invalid JSON at column 2")
    assert reasons[3] == "'assistant' entry has no 'message' object"
    assert reasons[4] == "not an object"
    assert ld.recovered == [{"file": str(f), "line": 1, "objects": 2}]


def test_missing_logical_parent_links_by_file_order(tmp_path: Path) -> None:
    f = _write(tmp_path / "s1.jsonl", [
        _u("u1", None, "user", "hello"),
        _u("a1", "u1", "assistant", [{"type": "text", "text": "hi"}], mid="m1", rid="r1"),
        {"type": "system", "subtype": "compact_boundary", "uuid": "b1", "parentUuid": None,
         "logicalParentUuid": "gone", "sessionId": "s1"},
        _u("u2", "b1", "user", "summary ...", isCompactSummary=True),
        _u("a2", "u2", "assistant", [{"type": "text", "text": "ok"}], mid="m2", rid="r2"),
    ])
    df, r = _blocks([f])
    assert _calls(df)["thread_id"].unique().to_list() == ["main"]
    assert r.stats["compact_boundary_parent_from_file_order"] == 1


def test_inline_sidechain_becomes_its_own_thread(tmp_path: Path) -> None:
    f = _write(tmp_path / "s1.jsonl", [
        _u("u1", None, "user", "hello"),
        _u("s1", None, "user", "sub task", isSidechain=True),
        _u("s2", "s1", "assistant", [{"type": "text", "text": "sub done"}], mid="ms", rid="rs", isSidechain=True),
        _u("a1", "u1", "assistant", [{"type": "text", "text": "hi"}], mid="m1", rid="r1"),
    ])
    df, _ = _blocks([f])
    calls = _calls(df)
    assert sorted(calls["thread_id"].to_list()) == ["main", "sidechain-s1"]


@pytest.mark.corpus
def test_claude_projects_every_request_replayed_once(corpus: Path) -> None:
    """Per session file: non-pending calls == distinct (message.id, requestId) of its assistant entries."""
    root = corpus / "claude-projects"
    df, r = _blocks([root])
    calls = df.filter(pl.col("is_call")).select("session_id", "thread_id", "msg_key").unique()
    assert calls.group_by("msg_key").len().filter(pl.col("len") > 1).height == 0
    for f in sorted(root.rglob("*.jsonl")):
        entries = [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
        sidechain_file = f.parent.name == "subagents"
        keys = {f"{e['message'].get('id')}|{e.get('requestId')}" for e in entries
                if e.get("type") == "assistant" and (sidechain_file or not e.get("isSidechain"))}
        got = calls.filter(pl.col("msg_key").is_in(list(keys)))
        assert got.height == len(keys), f.name
        if sidechain_file:
            assert got["thread_id"].unique().to_list() == [f"agent-{f.stem.removeprefix('agent-')}"]
    for ld in r.loads:
        assert ld.message_lines + sum(ld.other_lines.values()) + ld.quarantined_lines == ld.lines
        assert ld.quarantined_lines == 0


DIAGNOSES = [  # (message.diagnostics as recorded, the reason and missed tokens read)
    ({"cache_miss_reason": {"type": "model_changed", "cache_missed_input_tokens": 25488}}, "model_changed", 25488),
    ({"cache_miss_reason": {"type": "system_changed", "cache_missed_input_tokens": 119127}}, "system_changed", 119127),
    ({"cache_miss_reason": {"type": "tools_changed", "cache_missed_input_tokens": 339884}}, "tools_changed", 339884),
    ({"cache_miss_reason": {"type": "messages_changed", "cache_missed_input_tokens": 26656}}, "messages_changed",
     26656),
    ({"cache_miss_reason": {"type": "previous_message_not_found"}}, "previous_message_not_found", None),
    ({"cache_miss_reason": {"type": "unavailable"}}, "unavailable", None),
    ({"cache_miss_reason": {"type": "thinking_changed", "cache_missed_input_tokens": 7}}, "thinking_changed", 7),
    ({"cache_miss_reason": None}, None, None),  # the comparison was still running: no diagnosis
    (None, None, None),  # nothing diverged
    ("absent", None, None),
    ({"cache_miss_reason": {"type": 5, "cache_missed_input_tokens": "many"}}, None, None),  # not what it should be
]


def test_the_servers_cache_diagnosis_is_read_with_the_usage(tmp_path: Path) -> None:
    """Claude Code 2.1.140+ records the API's cache diagnosis on the answer (`message.diagnostics`):
    every type is kept as written (a later one too), with its missed tokens; null, absent or a
    null reason is no diagnosis. A split answer (one line per block) carries it on every line."""
    entries, parent = [], None
    for i, (diag, _, _) in enumerate(DIAGNOSES):
        entries.append(_u(f"u{i}", parent, "user", f"question {i}"))
        for j, part in enumerate(("first", "second")):  # two lines of one answer
            a = _u(f"a{i}-{j}", f"u{i}" if j == 0 else f"a{i}-0", "assistant",
                   [{"type": "text", "text": f"{part} {i}"}], mid=f"m{i}", rid=f"r{i}")
            if diag != "absent":
                a["message"]["diagnostics"] = diag
            entries.append(a)
        parent = f"a{i}-1"
    f = _write(tmp_path / "s1.jsonl", entries)
    r = load_paths([f])
    df = pl.from_arrow(r.blocks)
    got = (df.filter(pl.col("is_call")).group_by("msg_key")
           .agg(pl.col("cache_miss_reason").unique().alias("reason"), pl.col("cache_missed_tokens").unique().alias("n"),
                call=pl.col("first_call").min() - 1).sort("call"))
    assert got["reason"].to_list() == [[want] for _, want, _ in DIAGNOSES]
    assert got["n"].to_list() == [[n] for _, _, n in DIAGNOSES]
    assert not df.filter(pl.col("role") != "assistant")["cache_miss_reason"].drop_nulls().len()
