"""Gemini CLI loader (issue 25): both formats (the older session-*.json document, the newer JSONL
record stream), detection, accounting of every line and message, thoughts, tool calls paired with
their results, notices kept as non-model rows, `$set` / `$rewindTo` records, files rewritten while
the CLI runs, copies of one session, subagents; and the real sessions of ../shared/corpus-extra."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import polars as pl
import pytest

from ctxreplay.pipeline.loaders import gemini_cli, load_paths
from ctxreplay.pipeline.loaders.base import call_ranges, threads_to_blocks
from tests.geminikit import SID, GeminiSession, standard, tokens, tool_call, write_json, write_jsonl


def _blocks(threads: list[Any]) -> pl.DataFrame:
    return pl.from_arrow(threads_to_blocks(threads))  # type: ignore[return-value]


def _accounted(ld: Any) -> None:
    assert ld.message_lines + sum(ld.other_lines.values()) + ld.quarantined_lines == ld.lines


# ---------------------------------------------------------------- both formats, one session


@pytest.mark.parametrize("fmt", ["json", "jsonl"])
def test_both_formats_give_the_same_messages(tmp_path: Path, fmt: str) -> None:
    s = standard()
    if fmt == "json":
        path = write_json(tmp_path / "chats" / "session-2026-03-01T09-00-5e551000.json", s.document())
    else:
        path = write_jsonl(tmp_path / "chats" / "session-2026-03-01T09-00-5e551000.jsonl", s.records())
    threads, ld = gemini_cli.load(path)
    _accounted(ld)
    assert ld.format == (gemini_cli.FORMAT_JSON if fmt == "json" else gemini_cli.FORMAT)
    assert not ld.quarantine
    [t] = threads
    assert (t.session_id, t.thread_id, t.source_format) == (SID, "main", "gemini_cli")
    roles = [m.role for m in t.messages]
    # user, two notices, user, answer + its results, answer + result, answer, user, answer (the
    # cancelled call merged into it) + its result, the notice, user, answer
    assert roles == ["user", "assistant", "assistant", "user", "assistant", "tool", "assistant", "tool", "assistant",
                     "user", "assistant", "tool", "assistant", "user", "assistant"]
    is_call, _, _ = call_ranges(t)
    assert sum(is_call) == 5 == ld.stats["gemini_answers"]  # every recorded answer is one call
    assert ld.stats["gemini_notices"] == 3 and ld.stats["gemini_tool_call_continuations"] == 1
    b = _blocks(threads)
    # notices: assistant rows nobody sends (display-only, not calls, one empty block with the text aside)
    notes = b.filter(pl.col("provider") == "gemini-cli")
    assert notes.height == 3 and notes["block_type"].unique().to_list() == ["empty"]
    assert notes["is_display_only"].all() and not notes["is_call"].any()
    assert [json.loads(x)["gemini_type"] for x in notes["extra_json"]] == ["error", "info", "info"]
    # thoughts → thinking (subject in bold, as the CLI renders them), no signature
    th = b.filter(pl.col("block_type") == "thinking")
    assert th["text"].to_list()[0] == "**Planning** I will list the folder." and th["signature"].is_null().all()
    # every call has its result, by id, in the message right after its answer
    uses = b.filter(pl.col("block_type") == "tool_use")
    res = b.filter(pl.col("block_type") == "tool_result")
    assert sorted(uses["tool_use_id"]) == sorted(res["tool_use_id"]) and uses.height == 4
    err = res.filter(pl.col("is_error"))
    assert sorted(err["tool_use_id"]) == ["read_file_1_1", "run_shell_command_3_0"]
    assert res.filter(pl.col("tool_use_id") == "read_file_2_0")["text"].to_list() == ["buy milk"]
    # the cancelled call belongs to the answer before the notice: its results follow that answer
    merged = b.filter(pl.col("msg_key") == s.messages[8]["id"])
    assert merged["block_type"].to_list() == ["thinking", "text", "tool_use"]
    assert merged["entry_id"].to_list()[-1] == s.messages[10]["id"]  # the row keeps the record it came from
    order = b.filter(pl.col("block_pos") == 0).sort("entry_order")["msg_key"].to_list()
    assert order.index(f"{s.messages[8]['id']}#results") == order.index(s.messages[8]["id"]) + 1
    # usage: uncached input (input - cached + tool), cache reads, output + thoughts; no write
    a = b.filter(pl.col("message_id") == s.messages[5]["id"]).row(0, named=True)
    assert (a["usage_input"], a["usage_cache_read"], a["usage_output"], a["usage_cache_write"]) == (600, 4800, 55, None)
    assert b.filter(pl.col("is_call") & (pl.col("block_pos") == 0))["model"].to_list()[-1] == "gemini-2.5-flash"


def test_jsonl_records_apply_in_order(tmp_path: Path) -> None:
    """An answer written again with its tool calls replaces its first version where it stands; the
    first version's line is a superseded version, the `$set` lines metadata updates."""
    s = standard()
    recs = s.records()
    path = write_jsonl(tmp_path / "s.jsonl", recs)
    threads, ld = gemini_cli.load(path)
    _accounted(ld)
    assert ld.other_lines["superseded_version"] == 2  # the two answers with text and tool calls
    assert ld.other_lines["session_header"] == 1
    assert ld.other_lines["metadata_update"] == sum(1 for r in recs if "$set" in r)
    assert ld.message_lines == len(s.messages)
    rows = _blocks(threads)
    first = rows.filter(pl.col("msg_key") == s.messages[4]["id"])
    assert first["block_type"].to_list() == ["thinking", "text", "tool_use", "tool_use"]
    assert first["source_line"].unique().to_list() == [next(i + 1 for i, r in enumerate(recs)
                                                            if r.get("id") == s.messages[4]["id"] and "toolCalls" in r)]


def test_rewind_keeps_the_dropped_answers_as_a_branch(tmp_path: Path) -> None:
    """`$rewindTo` drops a message and everything after it; the answers it dropped were real calls:
    thread `branch-<first dropped id>` reports them, with the shared history inherited."""
    s = GeminiSession()
    u1 = s.user("first question", 0)
    s.answer("first answer", 5, tokens(3000, 10))
    u2 = s.user("second question, badly put", 10)
    a2 = s.answer("second answer", 15, tokens(3100, 10, 2900))
    recs = s.records()
    recs.append({"$rewindTo": u2["id"]})
    s2 = GeminiSession()
    s2.n = s.n
    u3 = s2.user("second question, well put", 30)
    a3 = s2.answer("better answer", 35, tokens(3150, 12, 2950))
    recs += s2.records()[1:]
    path = write_jsonl(tmp_path / "r.jsonl", recs)
    threads, ld = gemini_cli.load(path)
    _accounted(ld)
    assert ld.other_lines["rewind"] == 1 and ld.stats["gemini_rewinds"] == 1
    main, branch = threads
    assert [m.entry_id for m in main.messages] == [u1["id"], s.messages[1]["id"], u3["id"], a3["id"]]
    assert branch.thread_id == f"branch-{u2['id']}"
    assert [m.entry_id for m in branch.messages] == [u1["id"], s.messages[1]["id"], u2["id"], a2["id"]]
    assert ld.stats["gemini_answers"] == 3  # each answer reported once: the branch inherits the first
    b = _blocks(threads)
    reported = b.filter(pl.col("is_call") & (pl.col("block_pos") == 0))
    assert sorted(reported["message_id"]) == sorted([s.messages[1]["id"], a2["id"], a3["id"]])


def test_a_history_written_back_drops_a_failed_prompt(tmp_path: Path) -> None:
    """Newer CLIs roll a failed request back and write the list again (`$set.messages`): the prompt
    it dropped answered nothing, so no branch; its line is accounted as dropped from the history."""
    s = GeminiSession()
    s.user("hello", 0)
    a = s.answer("hi", 3, tokens(2000, 3))
    failed = s.user("this one fails", 10)
    recs = s.records()
    recs.append({"$set": {"messages": s.messages[:2], "lastUpdated": "2026-03-01T09:00:11.000Z"}})
    path = write_jsonl(tmp_path / "h.jsonl", recs)
    threads, ld = gemini_cli.load(path)
    _accounted(ld)
    [t] = threads
    assert [m.entry_id for m in t.messages] == [s.messages[0]["id"], a["id"]]
    assert ld.other_lines["dropped_from_history"] == 1
    assert ld.other_lines["superseded_version"] == 2  # the first two records, written again by $set
    assert failed["id"] not in {m.entry_id for m in t.messages}
    assert ld.stats["gemini_history_replacements"] == 1


def test_broken_lines_are_quarantined_with_a_reason(tmp_path: Path) -> None:
    s = standard()
    recs: list[Any] = s.records()
    recs[3:3] = ['{"id": "x", "type": "gemini", "content": "cut sh', "[1, 2]", '{"hello": "world"}',
                 '{"id": "y", "content": "no type"}']
    path = write_jsonl(tmp_path / "b.jsonl", recs)
    threads, ld = gemini_cli.load(path)
    _accounted(ld)
    codes = sorted(q.code for q in ld.quarantine)
    assert codes == ["no_type", "not_an_object", "truncated_json", "unknown_record"]
    assert sum(1 for m in threads[0].messages if m.role == "assistant" and m.is_call is None) == 5


def test_a_document_cut_while_it_was_rewritten_keeps_its_complete_messages(tmp_path: Path) -> None:
    """The older format is rewritten whole on every turn; a copy taken mid-write (or a crash) stops
    inside a message: the messages before it load, the lines of the cut one are quarantined."""
    s = standard()
    text = s.document()
    cut = text.index('"Reading the notes now."')
    path = write_json(tmp_path / "session-cut.json", text[:cut])
    threads, ld = gemini_cli.load(path)
    _accounted(ld)
    assert {q.code for q in ld.quarantine} == {"truncated_json"}
    [t] = threads
    assert [m.entry_id for m in t.messages if m.role != "tool"] == [m["id"] for m in s.messages[:5]]
    assert ld.stats["gemini_document_cut"] == 1


def test_a_file_rewritten_between_two_loads_is_read_as_it_stands(tmp_path: Path) -> None:
    s = standard()
    path = tmp_path / "session-live.json"
    early = GeminiSession(messages=s.messages[:6])
    write_json(path, early.document())
    threads, _ = gemini_cli.load(path)
    assert sum(m.role == "assistant" and m.is_call is None for m in threads[0].messages) == 2
    write_json(path, s.document())  # the CLI rewrote it whole after more turns
    threads, ld = gemini_cli.load(path)
    _accounted(ld)
    assert ld.stats["gemini_answers"] == 5


def test_load_paths_detects_both_formats_and_reads_a_resumed_copy_once(tmp_path: Path) -> None:
    """When the CLI resumes an older session it writes `<name>.jsonl` beside the `.json` with every
    message again: one session, replayed once; the `.json` is a copy (its lines duplicate_entry).
    The `.json` is not taken for a request file although it holds a 'messages' list."""
    s = standard()
    chats = tmp_path / ".gemini" / "tmp" / "proj" / "chats"
    early = GeminiSession(messages=s.messages[:8])
    write_json(chats / "session-2026-03-01T09-00-5e551000.json", early.document())
    write_jsonl(chats / "session-2026-03-01T09-00-5e551000.jsonl", s.records(rewrite_answers=False))
    res = load_paths([tmp_path])
    assert res.threads == 1 and not res.skipped
    by = {Path(ld.path).suffix: ld for ld in res.loads}
    assert by[".json"].format == "gemini_cli_json" and by[".jsonl"].format == "gemini_cli"
    assert by[".json"].other_lines == Counter({"duplicate_entry": by[".json"].lines})
    assert res.stats["duplicate_session_files"] == 1
    b = pl.from_arrow(res.blocks)
    assert b.filter(pl.col("is_call") & (pl.col("block_pos") == 0)).height == 5


def test_a_copy_with_messages_of_its_own_is_kept_apart(tmp_path: Path) -> None:
    s = standard()
    other = GeminiSession(messages=[*s.messages[:3], {**s.messages[3], "id": "elsewhere"}])
    write_json(tmp_path / "a" / "session-x.json", other.document())
    write_jsonl(tmp_path / "b" / "session-x.jsonl", s.records())
    res = load_paths([tmp_path])
    assert res.threads == 2
    sids = sorted(pl.from_arrow(res.blocks)["session_id"].unique())
    assert sids[0] == SID and sids[1].startswith(f"{SID}~")


def test_a_subagent_belongs_to_its_parent_session(tmp_path: Path) -> None:
    parent = "5e551000-aaaa-4bbb-8ccc-0000000000ff"
    s = GeminiSession("5e551000-aaaa-4bbb-8ccc-0000000000aa", kind="subagent")
    s.user("look for TODOs", 0)
    s.answer("none", 2, tokens(1500, 2))
    path = write_jsonl(tmp_path / "chats" / parent / f"{s.sid}.jsonl", s.records())
    [t], _ = gemini_cli.load(path)
    assert (t.session_id, t.thread_id) == (parent, f"agent-{s.sid}")


def test_modern_content_parts_are_the_model_turn(tmp_path: Path) -> None:
    """Newer files may hold the model turn's parts in `content` (function calls and thought parts
    with their signatures); the CLI then takes them as they are, and so do we."""
    s = GeminiSession()
    s.user("go", 0)
    s.answer("", 2, tokens(2000, 10), calls=[tool_call("c1", "glob", {"pattern": "*"}, "a.py", t=2)])
    s.messages[-1]["content"] = [{"text": "thinking it over", "thought": True, "thoughtSignature": "c2ln"},
                                 {"functionCall": {"id": "c1", "name": "glob", "args": {"pattern": "*"}},
                                  "thoughtSignature": "c2ln"}]
    s.messages[-1]["thoughts"] = [{"subject": "ignored", "description": "the parts win"}]
    path = write_jsonl(tmp_path / "m.jsonl", s.records())
    threads, _ = gemini_cli.load(path)
    b = _blocks(threads)
    ans = b.filter(pl.col("role") == "assistant")
    assert ans["block_type"].to_list() == ["thinking", "tool_use"]
    assert ans["signature"].to_list()[0] == "c2ln"
    assert b.filter(pl.col("block_type") == "tool_result")["tool_use_id"].to_list() == ["c1"]


def test_sniffing(tmp_path: Path) -> None:
    s = standard()
    assert gemini_cli.sniff([s.header()], tmp_path / "x.jsonl") == "gemini_cli"
    assert gemini_cli.sniff([None, *s.records()[1:4]], tmp_path / "x.jsonl") == "gemini_cli"
    assert gemini_cli.sniff([{"type": "user", "message": {"role": "user"}, "uuid": "u"}], tmp_path / "x") is None
    assert gemini_cli.sniff_document(json.loads(s.document()))
    assert not gemini_cli.sniff_document({"model": "m", "messages": []})
    assert gemini_cli.sniff_document(None, s.document()[:100].encode())


# ---------------------------------------------------------------- the real sessions


def _raw_messages(path: Path) -> list[dict[str, Any]]:
    """The final message list of a real file, read the simplest way (no $set.messages or rewinds in
    these files: checked)."""
    if path.suffix == ".json":
        return json.loads(path.read_text())["messages"]
    msgs: dict[str, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            o = json.loads(line)
            assert "$rewindTo" not in o and "messages" not in o.get("$set", {})
            if "id" in o:
                msgs[o["id"]] = o
    return list(msgs.values())


@pytest.mark.corpus
def test_corpus_gemini_sessions_load_with_exact_accounting(corpus_extra: Path) -> None:
    files = sorted((corpus_extra / "gemini-cli").iterdir())
    assert len(files) == 4
    res = load_paths(files)
    assert not res.skipped and not res.quarantine
    b = pl.from_arrow(res.blocks)
    for f in files:
        [ld] = [x for x in res.loads if x.path == str(f)]
        _accounted(ld)
        raw = _raw_messages(f)
        n_lines = sum(1 for line in f.read_bytes().split(b"\n") if line.strip())
        assert ld.lines == n_lines
        rows = b.filter(pl.col("source_file") == str(f))
        # every message of the file gives rows (a tool-call-only message after a notice inside the
        # answer it belongs to): message accounting by id
        ids = {m["id"] for m in raw}
        assert {e.removesuffix("#results") for e in rows["entry_id"].unique()} == ids
        by_type = Counter(m["type"] for m in raw)
        assert ld.stats["gemini_notices"] == by_type["info"] + by_type["error"] + by_type.get("warning", 0)
        assert rows.filter(pl.col("role") == "user")["msg_key"].n_unique() == by_type["user"]
        # every recorded answer is one call, and only they
        answers = {m["id"] for m in raw if m["type"] == "gemini" and m.get("tokens")}
        calls = rows.filter(pl.col("is_call") & (pl.col("block_pos") == 0))
        assert sorted(calls["message_id"]) == sorted(answers)
        assert ld.stats["gemini_answers"] == len(answers)
        assert ld.stats.get("gemini_tool_call_continuations", 0) == sum(
            1 for m in raw if m["type"] == "gemini" and not m.get("tokens"))
        # every tool call is paired with its result
        calls_n = sum(len(m.get("toolCalls") or []) for m in raw)
        assert rows.filter(pl.col("block_type") == "tool_use").height == calls_n
        assert sorted(rows.filter(pl.col("block_type") == "tool_use")["tool_use_id"]) == \
            sorted(rows.filter(pl.col("block_type") == "tool_result")["tool_use_id"])
        if f.suffix == ".jsonl":  # records written again: each older version accounted
            n_versions = sum(1 for line in f.read_text().splitlines() if line.strip() and '"id"' in line[:12])
            assert ld.other_lines["superseded_version"] == n_versions - len(raw)


def test_a_record_whose_type_is_not_a_string_is_no_gemini_message(tmp_path: Path) -> None:
    # a JSON array as `type` (found by the loaders' fuzz test): format detection must not raise on it
    f = tmp_path / "s.jsonl"
    f.write_text('{"type":[1],"id":"b1","content":"x"}\n{"type":{"a":1},"id":"b2","content":"y"}\n')
    res = load_paths([f])
    assert res.blocks.num_rows == 0 and len(res.quarantine) == 2
