"""Request JSON loader: Anthropic Messages and OpenAI chat requests saved as one JSON document."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import polars as pl
import pytest

from ctxreplay.pipeline.loaders import request
from ctxreplay.pipeline.loaders.base import call_ranges, threads_to_blocks
from ctxreplay.testkit import visible

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "data" / "samples"
PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg=="


def write(tmp_path: Path, doc: Any, name: str = "req.json", indent: int | None = 2) -> Path:
    p = tmp_path / name
    p.write_text(doc if isinstance(doc, str) else json.dumps(doc, indent=indent))
    return p


def frame(threads: list[request.Thread]) -> pl.DataFrame:
    return pl.from_arrow(threads_to_blocks(threads)).sort("entry_order", "block_pos", "part_pos")  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "doc, expected",
    [
        (
            {"model": "claude-x", "system": "s", "messages": [{"role": "user", "content": "hi"}]},
            "anthropic_request",
        ),
        (
            {
                "model": "m",
                "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t"}]}],
            },
            "anthropic_request",
        ),
        (
            {
                "model": "m",
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "image",
                                "source": {"type": "base64", "media_type": "image/png", "data": PNG},
                            }
                        ],
                    }
                ],
            },
            "anthropic_request",
        ),
        (
            {
                "model": "m",
                "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}],
            },
            "openai_chat_request",
        ),
        (
            {"model": "m", "messages": [{"role": "assistant", "content": None, "tool_calls": []}]},
            "openai_chat_request",
        ),
        (
            {
                "model": "m",
                "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            },
            "openai_chat_request",
        ),
        ({"model": "gpt-4.1", "messages": [{"role": "user", "content": "hi"}]}, "openai_chat_request"),
        ({"model": "o3-mini", "messages": [{"role": "user", "content": "hi"}]}, "openai_chat_request"),
        (
            {"model": "claude-sonnet-4-5", "messages": [{"role": "user", "content": "hi"}]},
            "anthropic_request",
        ),
        ({"model": "llama", "messages": [{"role": "user", "content": "hi"}]}, "anthropic_request"),
        ({"messages": "nope"}, None),
        ({"type": "user", "messages": []}, None),
        ([{"role": "user"}], None),
    ],
)
def test_classify(doc: Any, expected: str | None) -> None:
    assert request.classify(doc) == expected
    assert request.sniff([doc], Path("r.json")) == expected


def test_sniff_needs_a_single_document() -> None:
    doc = {"model": "m", "messages": []}
    assert request.sniff([doc, doc], Path("r.jsonl")) is None


def test_anthropic_sample() -> None:
    path = SAMPLES / "anthropic-request.json"
    threads, load = request.load(path)
    assert (load.format, load.lines, load.message_lines, load.quarantined_lines) == (
        "anthropic_request",
        95,
        95,
        0,
    )
    t = threads[0]
    assert (t.thread_id, t.session_id, t.source_format) == ("main", "anthropic-request", "anthropic_request")
    assert [m.role for m in t.messages] == ["system", "user", "assistant", "tool", "assistant", "user"]
    df = frame(threads)
    system = df.filter(pl.col("role") == "system").row(0, named=True)
    assert json.loads(system["extra_json"]) == {"cache_control": {"type": "ephemeral"}}
    tool = df.filter(pl.col("role") == "tool").row(0, named=True)
    assert (tool["tool_use_id"], tool["tool_name"], tool["part_type"], tool["text"]) == (
        "toolu_01Rye",
        "get_stock",
        "text",
        "12.5 kg",
    )
    img = df.filter(pl.col("block_type") == "image").row(0, named=True)
    assert img["image_media_type"] == "image/png" and img["image_bytes"] > 0
    # source line and the exact text of each message in the file
    text = path.read_text().split("\n")
    for m in t.messages:
        assert m.raw_line.split("\n")[0].strip() in text[m.source_line - 1]
        json.loads(m.raw_line)
    assert sum(call_ranges(t)[0]) == 2
    assert {r["model"] for r in df.filter(pl.col("role") == "assistant").to_dicts()} == {"claude-sonnet-4-5"}


def test_openai_sample() -> None:
    threads, load = request.load(SAMPLES / "openai-chat-request.json")
    assert (load.format, load.lines, load.message_lines) == ("openai_chat_request", 46, 46)
    df = frame(threads)
    assert df.select("role", "block_type", "text", "tool_use_id", "tool_name", "tool_input").rows() == [
        ("system", "text", "You help plan train trips. Use the tools for timetables.", None, None, None),
        ("user", "text", "When is the first train from Ghent to Bruges tomorrow?", None, None, None),
        (
            "assistant",
            "tool_use",
            None,
            "call_Tt01",
            "timetable",
            '{"day":"tomorrow","from":"Ghent","to":"Bruges"}',
        ),
        ("tool", "tool_result", "05:42, 06:12, 06:42", "call_Tt01", "timetable", None),
        ("assistant", "text", "The first train leaves Ghent at 05:42.", None, None, None),
        ("user", "text", "And the last one back?", None, None, None),
    ]
    blocks = pl.from_arrow(threads_to_blocks(threads))
    pending = visible(blocks, 2)  # two assistant messages = calls 0 and 1; call 2 is pending
    assert pending.height == 6


def test_openai_mapping_details(tmp_path: Path) -> None:
    doc = {
        "model": "deepseek-chat",
        "messages": [
            {"role": "developer", "content": [{"type": "text", "text": "rules"}]},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "see"},
                    {
                        "type": "image_url",
                        "image_url": {"url": f"data:image/png;base64,{PNG}", "detail": "low"},
                    },
                ],
            },
            {
                "role": "assistant",
                "content": "thinking done",
                "reasoning_content": "hmm",
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{oops"}}
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "r"}]},
            {"role": "critic", "content": "?"},
        ],
    }
    threads, load = request.load(write(tmp_path, doc))
    df = frame(threads)
    assert df.select("role", "block_type", "part_type", "text").rows() == [
        ("system", "text", None, "rules"),
        ("user", "text", None, "see"),
        ("user", "image", None, None),
        ("assistant", "thinking", None, "hmm"),
        ("assistant", "text", None, "thinking done"),
        ("assistant", "tool_use", None, None),
        ("tool", "tool_result", "text", "r"),
    ]
    assert json.loads(df.row(0, named=True)["extra_json"]) == {"role": "developer"}
    img = df.row(2, named=True)
    assert (img["image_media_type"], img["image_data"], json.loads(img["extra_json"])) == (
        "image/png",
        PNG,
        {"detail": "low"},
    )
    use = df.row(5, named=True)
    assert use["tool_input"] == '"{oops"' and json.loads(use["extra_json"]) == {"arguments_not_json": True}
    assert df.row(6, named=True)["tool_name"] == "f"
    assert (
        load.message_lines == load.lines
        and "messages[4] not understood (role 'critic'" in load.recovered[0]["note"]
    )


def test_anthropic_mapping_details(tmp_path: Path) -> None:
    doc = {
        "model": "claude-x",
        "system": "plain system",
        "messages": [
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "content": [
                    {"type": "redacted_thinking", "data": "xyz"},
                    {"type": "tool_use", "id": "t1", "name": "get", "input": {"b": 1, "a": 2}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "is_error": True, "content": "boom"},
                    {"type": "text", "text": "and also this"},
                ],
            },
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t2", "name": "get", "input": {}}]},
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "t2",
                        "content": [
                            {"type": "text", "text": "pic"},
                            {
                                "type": "image",
                                "source": {"type": "base64", "media_type": "image/png", "data": PNG},
                            },
                        ],
                    },
                    {"type": "tool_result", "tool_use_id": "t3", "content": []},
                ],
            },
        ],
    }
    threads, _ = request.load(write(tmp_path, doc))
    df = frame(threads)
    assert df.select("role", "block_pos", "part_pos", "block_type", "part_type", "text").rows() == [
        ("system", 0, 0, "text", None, "plain system"),
        ("user", 0, 0, "text", None, "hi"),
        ("assistant", 0, 0, "redacted_thinking", None, "xyz"),
        ("assistant", 1, 0, "tool_use", None, None),
        ("user", 0, 0, "tool_result", "string", "boom"),  # mixed with text: stays a user message
        ("user", 1, 0, "text", None, "and also this"),
        ("assistant", 0, 0, "tool_use", None, None),
        ("tool", 0, 0, "tool_result", "text", "pic"),
        ("tool", 0, 1, "tool_result", "image", None),
        ("tool", 1, 0, "tool_result", "empty", None),
    ]
    assert df.filter((pl.col("tool_use_id") == "t1") & (pl.col("block_type") == "tool_use"))[
        "tool_input"
    ].to_list() == ['{"a":2,"b":1}']
    assert df.filter(pl.col("part_type") == "string")["is_error"].to_list() == [True]


def test_compact_single_line_document_gets_unique_ids(tmp_path: Path) -> None:
    doc = {
        "model": "claude-x",
        "messages": [
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"},
        ],
    }
    threads, load = request.load(write(tmp_path, doc, indent=None))
    assert [(m.entry_id, m.source_line, m.raw_line) for m in threads[0].messages] == [
        ("L1.0", 1, '{"role": "user", "content": "a"}'),
        ("L1.1", 1, '{"role": "assistant", "content": "b"}'),
        ("L1.2", 1, '{"role": "user", "content": "c"}'),
    ]
    assert [m.parent_id for m in threads[0].messages] == [None, "L1.0", "L1.1"]
    assert (load.lines, load.message_lines) == (1, 1)


def test_invalid_json_quarantines_every_line(tmp_path: Path) -> None:
    p = write(tmp_path, '{\n  "model": "m",\n\n  "messages": [\n')
    threads, load = request.load(p)
    assert threads == []
    assert [q.line for q in load.quarantine] == [1, 2, 4]
    assert all(q.reason.startswith("not one JSON document:") for q in load.quarantine)
    assert (load.lines, load.message_lines, load.quarantined_lines) == (3, 0, 3)


def test_json_that_is_not_a_request_is_quarantined(tmp_path: Path) -> None:
    threads, load = request.load(write(tmp_path, {"model": "m", "prompt": "hi"}))
    assert threads == [] and load.quarantined_lines == load.lines == 4
    assert load.quarantine[0].reason == (
        "expected one request object with a 'messages' list (Anthropic Messages or "
        "OpenAI chat); got an object with keys model, prompt"
    )


def test_session_id_from_file_name(tmp_path: Path) -> None:
    sid = "11111111-2222-4333-8444-555555555555"
    doc = {"model": "claude-x", "messages": [{"role": "user", "content": "a"}]}
    threads, _ = request.load(write(tmp_path, doc, name=f"req-{sid}.json"))
    assert threads[0].session_id == sid
