"""OpenClaw v3 / legacy pi loader: mapping rules, tree and compaction handling, line accounting."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import polars as pl
import pytest

from ctxreplay.pipeline.loaders import openclaw
from ctxreplay.pipeline.loaders.base import call_ranges, threads_to_blocks
from ctxreplay.testkit import visible

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "data" / "samples"
SID = "5a0c3e7d-2b1f-4c6a-8e9d-0f1a2b3c4d5e"

# 1x1 transparent PNG
PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg=="


def header(version: int | None = 3) -> dict[str, Any]:
    h: dict[str, Any] = {"type": "session", "id": SID, "timestamp": "2026-01-01T10:00:00.000Z", "cwd": "/w"}
    if version is not None:
        h["version"] = version
    return h


def msg(
    eid: str | None, parent: str | None, message: dict[str, Any], ts: str = "2026-01-01T10:00:01.000Z"
) -> dict[str, Any]:
    e: dict[str, Any] = {"type": "message", "timestamp": ts, "message": message}
    if eid is not None:
        e["id"] = eid
        e["parentId"] = parent
    return e


def user(text: str, **kw: Any) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "text", "text": text}], **kw}


def assistant(*blocks: dict[str, Any], **kw: Any) -> dict[str, Any]:
    content = list(blocks) or [{"type": "text", "text": "ok"}]
    base = {
        "role": "assistant",
        "content": content,
        "api": "openai-completions",
        "provider": "openrouter",
        "model": "m1",
        "stopReason": "stop",
    }
    base.update(kw)
    return base


def write(
    tmp_path: Path, objs: list[Any], name: str = f"{SID}.jsonl", raw_lines: list[str] | None = None
) -> Path:
    p = tmp_path / name
    lines = [o if isinstance(o, str) else json.dumps(o) for o in objs]
    if raw_lines:
        lines.extend(raw_lines)
    p.write_text("\n".join(lines) + "\n")
    return p


def frame(threads: list[openclaw.Thread]) -> pl.DataFrame:
    return pl.from_arrow(threads_to_blocks(threads)).sort("thread_id", "entry_order", "block_pos", "part_pos")  # type: ignore[union-attr]


def calls(t: openclaw.Thread) -> list[str]:
    ic, _, _ = call_ranges(t)
    return [m.entry_id for m, c in zip(t.messages, ic, strict=True) if c]


# ---------------------------------------------------------------- sniff and names


def test_sniff_tells_v3_from_legacy_and_ignores_other_formats() -> None:
    p = Path("x.jsonl")
    assert openclaw.sniff([header(3)], p) == "openclaw"
    assert openclaw.sniff([header(None)], p) == "pi_legacy"
    assert openclaw.sniff([{"type": "session_meta", "payload": {}}], p) is None
    assert openclaw.sniff([{"type": "user", "message": {}, "uuid": "u"}], p) is None
    assert openclaw.sniff([], p) is None
    # an unreadable first line: the entries after it decide
    entry = {"type": "message", "id": "a1", "parentId": None, "message": {"role": "user", "content": []}}
    assert openclaw.sniff([None, entry], p) == "openclaw"
    assert openclaw.sniff([None, {"type": "message", "message": {"role": "user"}}], p) == "pi_legacy"
    assert openclaw.sniff([None, {"type": "user", "message": {"role": "user"}}], p) is None
    assert openclaw.sniff([{"type": "message", "message": {"role": "user"}}], p) is None


@pytest.mark.parametrize(
    "name, expected",
    [
        (f"{SID}.jsonl", SID),
        (f"owner__repo__{SID}.jsonl.deleted.2026-03-25T00-29-45.957Z", SID),
        (f"2026-01-01T10-00-00_{SID}.jsonl.reset.2026-01-02T00-00-00.000Z", SID),
    ],
)
def test_session_id_is_the_last_uuid_in_the_file_name(tmp_path: Path, name: str, expected: str) -> None:
    h = header() | {"id": "00000000-0000-0000-0000-000000000000"}
    threads, _ = openclaw.load(write(tmp_path, [h, msg("a1", None, user("hi"))], name=name))
    assert threads[0].session_id == expected


def test_session_id_falls_back_to_header_id_then_file_stem(tmp_path: Path) -> None:
    threads, _ = openclaw.load(write(tmp_path, [header(), msg("a1", None, user("hi"))], name="session.jsonl"))
    assert threads[0].session_id == SID
    threads, _ = openclaw.load(
        write(tmp_path, [{"type": "session", "version": 3}, msg("a1", None, user("hi"))], name="plain.jsonl")
    )
    assert threads[0].session_id == "plain"


# ---------------------------------------------------------------- message mapping


def test_assistant_blocks_usage_and_metadata(tmp_path: Path) -> None:
    a = assistant(
        {"type": "thinking", "thinking": "plan", "thinkingSignature": "sig1"},
        {"type": "text", "text": "Reading.", "textSignature": "msg_1"},
        {
            "type": "toolCall",
            "id": "call_1",
            "name": "read",
            "arguments": {"path": "a.md", "limit": 2},
            "partialJson": '{"path":"a.m',
        },
        {"type": "mystery", "payload": 1},
        usage={"input": 10, "output": 5, "cacheRead": 100, "cacheWrite": 7, "totalTokens": 122},
        stopReason="toolUse",
        timestamp=1767261605000,
    )
    threads, load = openclaw.load(
        write(tmp_path, [header(), msg("u1", None, user("go")), msg("a1", "u1", a)])
    )
    df = frame(threads).filter(pl.col("entry_id") == "a1")
    assert df["block_type"].to_list() == ["thinking", "text", "tool_use", "mystery"]
    th, tx, tu, unk = df.to_dicts()
    assert (th["text"], th["signature"]) == ("plan", "sig1")
    assert json.loads(tx["extra_json"]) == {"textSignature": "msg_1"}
    assert tu["tool_use_id"] == "call_1" and tu["tool_name"] == "read"
    assert tu["tool_input"] == '{"limit":2,"path":"a.md"}'  # canonical JSON text
    assert json.loads(tu["extra_json"]) == {"partialJson": '{"path":"a.m'}
    assert json.loads(unk["extra_json"]) == {"type": "mystery", "payload": 1}
    assert (th["usage_input"], th["usage_output"], th["usage_cache_read"], th["usage_cache_write"]) == (
        10,
        5,
        100,
        7,
    )
    assert (th["model"], th["provider"], th["api"], th["stop_reason"]) == (
        "m1",
        "openrouter",
        "openai-completions",
        "toolUse",
    )
    assert (
        th["timestamp"].isoformat() == "2026-01-01T10:00:05+00:00"
    )  # message epoch-ms wins over the entry time
    assert th["parent_id"] == "u1" and th["is_call"] is True
    assert load.message_lines == 2 and load.other_lines == {"session": 1}


def test_tool_result_parts_text_image_and_empty(tmp_path: Path) -> None:
    tr = {
        "role": "toolResult",
        "toolCallId": "call_1",
        "toolName": "read",
        "isError": False,
        "content": [
            {"type": "text", "text": "Read image file [image/png]"},
            {"type": "image", "data": PNG, "mimeType": "image/png"},
        ],
        "details": {"x": 1},
    }
    empty = {"role": "toolResult", "toolCallId": "call_2", "toolName": "exec", "isError": True, "content": []}
    a = assistant(
        {"type": "toolCall", "id": "call_1", "name": "read", "arguments": {}},
        {"type": "toolCall", "id": "call_2", "name": "exec", "arguments": {}},
    )
    objs = [
        header(),
        msg("u1", None, user("go")),
        msg("a1", "u1", a),
        msg("t1", "a1", tr),
        msg("t2", "t1", empty),
    ]
    threads, _ = openclaw.load(write(tmp_path, objs))
    df = frame(threads)
    t1 = df.filter(pl.col("entry_id") == "t1").to_dicts()
    assert [(r["role"], r["block_type"], r["block_pos"], r["part_pos"], r["part_type"]) for r in t1] == [
        ("tool", "tool_result", 0, 0, "text"),
        ("tool", "tool_result", 0, 1, "image"),
    ]
    assert all(
        r["tool_use_id"] == "call_1" and r["tool_name"] == "read" and r["is_error"] is False for r in t1
    )
    assert (
        t1[1]["image_media_type"] == "image/png" and t1[1]["image_data"] == PNG and t1[1]["image_bytes"] == 70
    )
    t2 = df.filter(pl.col("entry_id") == "t2").to_dicts()
    assert [(r["part_type"], r["text"], r["is_error"]) for r in t2] == [("empty", None, True)]


def test_user_image_and_string_content(tmp_path: Path) -> None:
    u1 = {
        "role": "user",
        "content": [
            {"type": "text", "text": "look"},
            {"type": "image", "data": PNG, "mimeType": "image/png"},
        ],
    }
    u2 = {"role": "user", "content": "plain string"}
    threads, _ = openclaw.load(write(tmp_path, [header(), msg("u1", None, u1), msg("u2", "u1", u2)]))
    df = frame(threads)
    assert df.select("entry_id", "block_type", "text", "image_media_type").rows() == [
        ("u1", "text", "look", None),
        ("u1", "image", None, "image/png"),
        ("u2", "text", "plain string", None),
    ]


def test_inter_session_provenance_is_mapped(tmp_path: Path) -> None:
    prov = {
        "kind": "inter_session",
        "sourceSessionKey": "agent:main:subagent:abc",
        "sourceChannel": "webchat",
        "sourceTool": "subagent_announce",
    }
    threads, _ = openclaw.load(write(tmp_path, [header(), msg("u1", None, user("done", provenance=prov))]))
    r = frame(threads).row(0, named=True)
    assert (
        r["provenance_kind"],
        r["provenance_source_session"],
        r["provenance_channel"],
        r["provenance_tool"],
    ) == ("inter_session", "agent:main:subagent:abc", "webchat", "subagent_announce")


def test_delivery_mirror_is_not_a_call_and_display_only(tmp_path: Path) -> None:
    mirror = assistant(
        {"type": "text", "text": "copy"}, provider="openclaw", model="delivery-mirror", api="openai-responses"
    )
    objs = [
        header(),
        msg("u1", None, user("q")),
        msg("a1", "u1", assistant()),
        msg("m1", "a1", mirror),
        msg("u2", "m1", user("next")),
        msg("a2", "u2", assistant()),
    ]
    threads, _ = openclaw.load(write(tmp_path, objs))
    assert calls(threads[0]) == ["a1", "a2"]
    r = frame(threads).filter(pl.col("entry_id") == "m1").row(0, named=True)
    assert r["is_call"] is False and r["is_display_only"] is True and r["role"] == "assistant"


def test_bash_execution_rendered_like_pi(tmp_path: Path) -> None:
    ok = {
        "role": "bashExecution",
        "command": "ls",
        "output": "a\nb",
        "exitCode": 0,
        "cancelled": False,
        "truncated": False,
    }
    failed = {
        "role": "bashExecution",
        "command": "make",
        "output": "",
        "exitCode": 2,
        "cancelled": False,
        "truncated": True,
        "fullOutputPath": "/tmp/out.log",
    }
    cancelled = {
        "role": "bashExecution",
        "command": "sleep 9",
        "output": "x",
        "exitCode": None,
        "cancelled": True,
        "truncated": False,
    }
    hidden = {
        "role": "bashExecution",
        "command": "secret",
        "output": "y",
        "exitCode": 0,
        "cancelled": False,
        "truncated": False,
        "excludeFromContext": True,
    }
    objs = [header(None)] + [msg(None, None, m) for m in (ok, failed, cancelled, hidden)]
    threads, load = openclaw.load(write(tmp_path, objs))
    texts = frame(threads)["text"].to_list()
    assert texts == [
        "Ran `ls`\n```\na\nb\n```",
        ("Ran `make`\n(no output)\n\nCommand exited with code 2"
        "\n\n[Output truncated. Full output: /tmp/out.log]"),
        "Ran `sleep 9`\n```\nx\n```\n\n(command cancelled)",
    ]
    assert frame(threads)["role"].to_list() == ["user"] * 3
    assert load.message_lines == 3 and load.other_lines["message:bashExecution:excluded"] == 1


def test_custom_message_is_sent_as_user_even_when_hidden(tmp_path: Path) -> None:
    cm = {
        "type": "custom_message",
        "id": "c1",
        "parentId": "u1",
        "timestamp": "2026-01-01T10:00:02.000Z",
        "customType": "openclaw.sessions_yield",
        "content": "[Context: yielded]",
        "display": False,
        "details": {"source": "sessions_yield"},
    }
    bs = {
        "type": "branch_summary",
        "id": "b1",
        "parentId": "c1",
        "timestamp": "2026-01-01T10:00:03.000Z",
        "fromId": "zz",
        "summary": "tried X",
    }
    custom = {"type": "custom", "id": "k1", "parentId": "b1", "customType": "model-snapshot", "data": {}}
    objs = [header(), msg("u1", None, user("q")), cm, bs, custom, msg("a1", "k1", assistant())]
    threads, load = openclaw.load(write(tmp_path, objs))
    df = frame(threads)
    assert df.select("entry_id", "role", "text").rows() == [
        ("u1", "user", "q"),
        ("c1", "user", "[Context: yielded]"),
        ("b1", "user", openclaw.BRANCH_SUMMARY_PREFIX + "tried X" + openclaw.BRANCH_SUMMARY_SUFFIX),
        ("a1", "assistant", "ok"),
    ]
    assert df.filter(pl.col("entry_id") == "c1")["is_meta"].to_list() == [True]
    assert load.message_lines == 4 and load.other_lines == {"session": 1, "custom:model-snapshot": 1}


# ---------------------------------------------------------------- tree


def test_conversation_is_the_path_from_the_last_entry(tmp_path: Path) -> None:
    # u1 → a1 → {u2 → a2 (abandoned), u3 → a3 → label}
    label = {"type": "label", "id": "l1", "parentId": "a3", "targetId": "a3", "label": "good"}
    objs = [
        header(),
        msg("u1", None, user("q1")),
        msg("a1", "u1", assistant()),
        msg("u2", "a1", user("q2")),
        msg("a2", "u2", assistant()),
        msg("u3", "a1", user("q3")),
        msg("a3", "u3", assistant()),
        label,
    ]
    threads, load = openclaw.load(write(tmp_path, objs))
    assert [t.thread_id for t in threads] == ["main", "branch-a2"]
    main, branch = threads
    assert [m.entry_id for m in main.messages] == ["u1", "a1", "u3", "a3"]
    assert calls(main) == ["a1", "a3"]
    assert [m.entry_id for m in branch.messages] == ["u1", "a1", "u2", "a2"]
    assert calls(branch) == ["a2"]  # a1 is context there: it is replayed as a call in main
    assert load.message_lines == 6 and load.other_lines == {"session": 1, "label": 1}


def test_branch_without_own_call_makes_no_thread_but_is_accounted(tmp_path: Path) -> None:
    objs = [
        header(),
        msg("u1", None, user("q1")),
        msg("a1", "u1", assistant()),
        msg("u2", "a1", user("dropped")),
        msg("u3", "a1", user("q3")),
        msg("a3", "u3", assistant()),
    ]
    threads, load = openclaw.load(write(tmp_path, objs))
    assert [t.thread_id for t in threads] == ["main"]
    assert "u2" not in {m.entry_id for m in threads[0].messages}
    assert load.message_lines == 5
    load.check()


def test_missing_parent_is_a_root_and_noted(tmp_path: Path) -> None:
    objs = [header(), msg("u1", "gone0000", user("q")), msg("a1", "u1", assistant())]
    threads, load = openclaw.load(write(tmp_path, objs))
    assert [m.entry_id for m in threads[0].messages] == ["u1", "a1"]
    assert load.recovered == [
        {
            "file": str(tmp_path / f"{SID}.jsonl"),
            "line": 2,
            "note": "parentId 'gone0000' of entry u1 not found; treated as root",
        }
    ]


def test_legacy_is_linear_with_line_ids(tmp_path: Path) -> None:
    objs = [
        header(None),
        msg(None, None, user("q")),
        {"type": "thinking_level_change", "thinkingLevel": "low"},
        msg(None, None, assistant()),
    ]
    threads, load = openclaw.load(write(tmp_path, objs))
    assert load.format == "pi_legacy" and threads[0].source_format == "pi_legacy"
    assert [(m.entry_id, m.parent_id) for m in threads[0].messages] == [("L2", None), ("L4", "L3")]


def test_file_without_header_or_ids_is_read_as_linear(tmp_path: Path) -> None:
    objs = [msg(None, None, user("q")), msg(None, None, assistant()), msg(None, None, user("q2"))]
    threads, load = openclaw.load(write(tmp_path, objs))
    assert load.format == "pi_legacy"
    assert [m.entry_id for m in threads[0].messages] == ["L1", "L2", "L3"]


# ---------------------------------------------------------------- compaction


def _compaction_file(tmp_path: Path, first_kept: str) -> Path:
    comp = {
        "type": "compaction",
        "id": "c1",
        "parentId": "a2",
        "timestamp": "2026-01-01T10:05:00.000Z",
        "summary": "S",
        "firstKeptEntryId": first_kept,
        "tokensBefore": 999,
    }
    objs = [
        header(),
        msg("u1", None, user("q1")),
        msg("a1", "u1", assistant()),
        msg("u2", "a1", user("q2")),
        msg("a2", "u2", assistant()),
        comp,
        msg("u3", "c1", user("q3")),
        msg("a3", "u3", assistant()),
    ]
    return write(tmp_path, objs)


def test_compaction_hides_history_before_first_kept_from_later_calls(tmp_path: Path) -> None:
    threads, load = openclaw.load(_compaction_file(tmp_path, "u2"))
    t = threads[0]
    assert [m.entry_id for m in t.messages] == ["u1", "a1", "c1", "u2", "a2", "u3", "a3"]
    summary = t.messages[2]
    assert summary.is_compact_summary and summary.role == "user"
    assert (
        summary.blocks[0].text
        == openclaw.COMPACTION_SUMMARY_PREFIX + "S" + openclaw.COMPACTION_SUMMARY_SUFFIX
    )
    assert (summary.source_line, summary.raw_line.startswith('{"type": "compaction"')) == (6, True)
    blocks = pl.from_arrow(threads_to_blocks(threads))
    seen = {k: visible(blocks, k)["entry_id"].to_list() for k in range(4)}
    assert seen[0] == ["u1"]  # call 0 = a1
    assert seen[1] == ["u1", "a1", "u2"]  # call 1 = a2, before the compaction: no summary
    assert seen[2] == ["c1", "u2", "a2", "u3"]  # call 2 = a3: summary, kept, newer
    assert seen[3] == ["c1", "u2", "a2", "u3", "a3"]  # pending call
    assert load.other_lines["compaction"] == 1 and load.recovered == []


def test_compaction_with_unknown_first_kept_keeps_nothing_before_it(tmp_path: Path) -> None:
    threads, load = openclaw.load(_compaction_file(tmp_path, "nope"))
    blocks = pl.from_arrow(threads_to_blocks(threads))
    assert [m.entry_id for m in threads[0].messages] == ["u1", "a1", "u2", "a2", "c1", "u3", "a3"]
    assert visible(blocks, 2)["entry_id"].to_list() == ["c1", "u3"]
    assert visible(blocks, 1)["entry_id"].to_list() == ["u1", "a1", "u2"]
    assert "firstKeptEntryId 'nope'" in load.recovered[0]["note"]


def test_legacy_compaction_uses_entry_index(tmp_path: Path) -> None:
    objs = [
        header(None),
        msg(None, None, user("q1")),
        msg(None, None, assistant()),
        msg(None, None, user("q2")),
        msg(None, None, assistant()),
        {
            "type": "compaction",
            "timestamp": "2026-01-01T10:05:00.000Z",
            "summary": "S",
            "firstKeptEntryIndex": 3,
            "tokensBefore": 1,
        },
        msg(None, None, user("q3")),
        msg(None, None, assistant()),
    ]
    threads, _ = openclaw.load(write(tmp_path, objs))
    assert [m.entry_id for m in threads[0].messages] == ["L2", "L3", "L6", "L4", "L5", "L7", "L8"]
    blocks = pl.from_arrow(threads_to_blocks(threads))
    assert visible(blocks, 2)["entry_id"].to_list() == ["L6", "L4", "L5", "L7"]


# ---------------------------------------------------------------- accounting and quarantine


def test_bad_lines_are_quarantined_with_reasons(tmp_path: Path) -> None:
    objs = [
        header(),
        msg("u1", None, user("q")),
        [1, 2],
        {"id": "x"},
        {"type": "message", "id": "m9"},
        {"type": "message", "id": "m8", "message": {"content": []}},
    ]
    p = write(tmp_path, objs, raw_lines=["{not json"])
    _threads, load = openclaw.load(p)
    reasons = {q.line: q.reason for q in load.quarantine}
    assert reasons == {
        3: "expected a JSON object, got list",
        4: "entry has no 'type' field (expected session, message, compaction, ...)",
        5: "'message' entry has no 'message' object",
        6: "'message' entry: message has no 'role' (expected user, assistant, toolResult, ...)",
        7: reasons[7],
    }
    assert reasons[7].startswith("invalid JSON")
    assert (load.lines, load.message_lines, load.quarantined_lines) == (7, 1, 5)


def test_glued_line_counts_once_and_yields_both_entries(tmp_path: Path) -> None:
    glued = json.dumps(msg(None, None, assistant())) + json.dumps(msg(None, None, user("ok")))
    p = write(tmp_path, [header(None), msg(None, None, user("q")), glued, msg(None, None, assistant())])
    threads, load = openclaw.load(p)
    assert [m.entry_id for m in threads[0].messages] == ["L2", "L3.0", "L3.1", "L4"]
    assert (load.lines, load.message_lines) == (4, 3)
    assert load.recovered == [{"file": str(p), "line": 3, "objects": 2}]


def test_glued_line_with_one_bad_object_is_noted(tmp_path: Path) -> None:
    glued = json.dumps(msg("u2", "a1", user("ok"))) + "[3]"
    p = write(tmp_path, [header(), msg("u1", None, user("q")), msg("a1", "u1", assistant()), glued])
    _, load = openclaw.load(p)
    assert load.message_lines == 3 and not load.quarantine
    assert (
        load.recovered[-1]["note"]
        == "1 of 2 objects on this line not understood: expected a JSON object, got list"
    )


# ---------------------------------------------------------------- shipped samples


def test_openclaw_sample() -> None:
    threads, load = openclaw.load(SAMPLES / "openclaw-sample.jsonl")
    assert (load.format, load.lines, load.message_lines, load.quarantined_lines) == ("openclaw", 22, 17, 0)
    assert load.other_lines == {
        "session": 1,
        "model_change": 1,
        "thinking_level_change": 1,
        "custom:model-snapshot": 1,
        "compaction": 1,
    }
    assert load.recovered == [{"file": str(SAMPLES / "openclaw-sample.jsonl"), "line": 14, "objects": 2}]
    assert [(t.thread_id, len(calls(t))) for t in threads] == [("main", 7), ("branch-c0a1000a", 1)]
    df = frame(threads)
    main = df.filter(pl.col("thread_id") == "main")
    assert main.filter(pl.col("part_type") == "image").height == 1
    assert main.filter(pl.col("provenance_kind") == "inter_session").height == 1
    assert main.filter(pl.col("is_display_only"))["entry_id"].to_list() == ["c0a10008"]
    assert main.filter(pl.col("is_compact_summary"))["first_call"].to_list() == [5]
    # the glued line holds the tool result and the answer after it
    assert main.filter(pl.col("source_line") == 14)["entry_id"].unique(maintain_order=True).to_list() == [
        "c0a1000d",
        "c0a1000e",
    ]


def test_pi_legacy_sample() -> None:
    threads, load = openclaw.load(SAMPLES / "pi-legacy-sample.jsonl")
    assert (load.format, load.lines, load.message_lines, load.quarantined_lines) == ("pi_legacy", 14, 11, 0)
    t = threads[0]
    assert len(calls(t)) == 5
    blocks = pl.from_arrow(threads_to_blocks(threads))
    last = visible(blocks, 4)
    assert last["entry_id"].unique(maintain_order=True).to_list() == ["L12", "L8", "L9", "L10", "L11", "L13"]
    assert "Ran `ls notes`" in visible(blocks, 3)["text"].to_list()[5]


# ---------------------------------------------------------------- real files


CORPUS_FIGURES = {
    # file name prefix: (format, lines, message lines, other lines, quarantined, threads, calls in main)
    "badlogic__pi-mono__session.jsonl": ("pi_legacy", 463, 453, 10, 0, 1, 220),
    "okbest2024__openclaw-backup__00957d43": ("openclaw", 141, 135, 6, 0, 1, 62),
    "okbest2024__openclaw-backup__b1a9203a": ("openclaw", 82, 78, 4, 0, 1, 38),
    "okbest2024__openclaw-backup__bbd5bce8": ("openclaw", 14, 10, 4, 0, 1, 5),
    "okbest2024__openclaw-backup__bc8239c8": ("openclaw", 38, 32, 6, 0, 1, 16),
    "okbest2024__openclaw-backup__c1050d61": ("openclaw", 24, 20, 4, 0, 1, 9),
    "okbest2024__openclaw-backup__e3063350": ("openclaw", 102, 96, 6, 0, 1, 43),
}


def _corpus_file(corpus: Path, prefix: str) -> Path:
    found = [p for p in (corpus / "openclaw").iterdir() if p.name.startswith(prefix)]
    assert len(found) == 1, prefix
    return found[0]


@pytest.mark.corpus
@pytest.mark.parametrize("prefix", sorted(CORPUS_FIGURES))
def test_corpus_file_loads_with_exact_accounting(corpus: Path, prefix: str) -> None:
    fmt, lines, message, other, quarantined, n_threads, n_calls = CORPUS_FIGURES[prefix]
    path = _corpus_file(corpus, prefix)
    with path.open() as fh:
        first = json.loads(fh.readline())
    assert openclaw.sniff([first], path) == fmt
    threads, load = openclaw.load(path)
    assert (
        load.format,
        load.lines,
        load.message_lines,
        sum(load.other_lines.values()),
        load.quarantined_lines,
    ) == (fmt, lines, message, other, quarantined)
    assert load.lines == load.message_lines + sum(load.other_lines.values()) + load.quarantined_lines
    assert len(threads) == n_threads and len(calls(threads[0])) == n_calls
    assert threads[0].thread_id == "main"
    threads_to_blocks(threads)  # builds without error


@pytest.mark.corpus
def test_corpus_every_file_in_the_folder_loads(corpus: Path) -> None:
    files = sorted((corpus / "openclaw").iterdir())
    assert len(files) == len(CORPUS_FIGURES)
    for path in files:
        _, load = openclaw.load(path)
        load.check()


@pytest.mark.corpus
def test_corpus_pi_glued_line_440_yields_two_entries(corpus: Path) -> None:
    path = corpus / "openclaw" / "badlogic__pi-mono__session.jsonl"
    threads, load = openclaw.load(path)
    assert {"file": str(path), "line": 440, "objects": 2} in load.recovered
    on_440 = [m for m in threads[0].messages if m.source_line == 440]
    assert [(m.entry_id, m.role) for m in on_440] == [("L440.0", "assistant"), ("L440.1", "user")]
    assert threads[0].session_id == "5fd1e58c-9635-410e-a644-133a96057c90"  # header id: no uuid in the name


@pytest.mark.corpus
def test_corpus_pi_compaction_keeps_from_entry_index(corpus: Path) -> None:
    threads, _ = openclaw.load(corpus / "openclaw" / "badlogic__pi-mono__session.jsonl")
    t = threads[0]
    s = next(i for i, m in enumerate(t.messages) if m.is_compact_summary)
    assert (t.messages[s].entry_id, t.messages[s + 1].entry_id) == ("L463", "L356")
    assert t.compactions[0].keep_from == s
    blocks = pl.from_arrow(threads_to_blocks(threads))
    pending = visible(blocks, 220)["entry_id"].unique(maintain_order=True).to_list()
    assert pending[:2] == ["L463", "L356"]
    assert "L463" not in visible(blocks, 219)["entry_id"].to_list()
    bash = [m for m in t.messages if m.source_line == 270]
    assert bash[0].role == "user" and bash[0].blocks[0].text.startswith("Ran `npm run check`\n```\n")


@pytest.mark.corpus
def test_corpus_inter_session_message(corpus: Path) -> None:
    threads, _ = openclaw.load(_corpus_file(corpus, "okbest2024__openclaw-backup__bbd5bce8"))
    assert threads[0].session_id == "bbd5bce8-e1cc-4cd2-a160-758a0a14900e"  # the name, not the header id
    df = frame(threads).filter(pl.col("provenance_kind") == "inter_session")
    assert df.select("role", "provenance_tool", "provenance_channel").unique().rows() == [
        ("user", "subagent_announce", "webchat")
    ]
    assert df["provenance_source_session"][0].startswith("agent:main:subagent:")


@pytest.mark.corpus
def test_corpus_kimi_ids_and_synthetic_result(corpus: Path) -> None:
    threads, _ = openclaw.load(_corpus_file(corpus, "okbest2024__openclaw-backup__c1050d61"))
    df = frame(threads)
    uses = df.filter(pl.col("block_type") == "tool_use")["tool_use_id"].to_list()
    assert uses[0] == "functions.read:0" and "function.edit:4" in uses
    auto = df.filter(pl.col("tool_use_id") == "call_auto_1")
    assert auto.select("role", "tool_name", "is_error").rows() == [("tool", "unknown", True)]


@pytest.mark.corpus
def test_corpus_compaction_hides_messages_before_first_kept(corpus: Path) -> None:
    threads, load = openclaw.load(_corpus_file(corpus, "okbest2024__openclaw-backup__00957d43"))
    t = threads[0]
    s = next(i for i, m in enumerate(t.messages) if m.is_compact_summary)
    assert (
        t.messages[s].entry_id == "e22722b0" and t.messages[s + 1].entry_id == "3c66ef44"
    )  # firstKeptEntryId
    blocks = pl.from_arrow(threads_to_blocks(threads))
    last_before = "bcd52f66"  # the last call before the compaction
    k = blocks.filter(pl.col("entry_id") == last_before)["first_call"][0] - 1
    before, after = visible(blocks, k), visible(blocks, k + 1)
    assert "e22722b0" not in before["entry_id"].to_list() and "a70c5215" in before["entry_id"].to_list()
    dropped = {m.entry_id for m in t.messages[:s]}
    assert not dropped & set(after["entry_id"].to_list())
    assert after["entry_id"].to_list()[0] == "e22722b0"
    cut = blocks.filter(pl.col("entry_id").is_in(list(dropped)))
    assert cut["last_call"].unique().to_list() == [k + 1]
    # delivery-mirror siblings are off the conversation path; the one on it is not a call
    assert blocks.filter(pl.col("entry_id") == "59fa504a")["is_call"].to_list() == [False]
    assert not load.quarantine
