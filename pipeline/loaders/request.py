"""One model request saved as a JSON document: Anthropic Messages or OpenAI chat completions.

`{"model", "system"?, "messages": [...]}` (Anthropic) or `{"model", "messages": [{"role": "system" |
"developer" | "user" | "assistant" | "tool", ...}]}` (OpenAI chat), one whole JSON document per
file; pretty-printed is fine. The request is ONE thread: its assistant messages are the calls
that produced them, and what follows the last assistant message is the pending call.

Which of the two: OpenAI chat when a message has role system / developer / tool / function or
carries `tool_calls` / `tool_call_id` / `function_call`, or a content part is OpenAI-only
(`image_url`, `input_audio`, `file`); otherwise Anthropic when there is a top-level `system` or an
Anthropic-only block (tool_use, tool_result, thinking, redacted_thinking, document, an image with
a `source`); otherwise (plain text turns read the same in both) the model name decides: gpt-*,
o1/o3/o4-*, chatgpt-* are OpenAI, anything else Anthropic.

Accounting: when the document parses, every non-blank physical line is a message line; when it
does not (or is not such a request), every line is quarantined with the reason. Each message's
`source_line` is the line where it starts and its `raw_line` the exact text of it in the file.
"""

from __future__ import annotations

import base64
import bisect
import json
import re
from pathlib import Path
from typing import Any

import orjson

from ctxreplay.pipeline.core.constants import DATA_URL_PATTERN
from ctxreplay.pipeline.loaders.base import (
    MAX_DEPTH,
    Block,
    FileLoad,
    Message,
    QuarantineRow,
    Thread,
    arguments_json,
    content_items,
    displayable,
    file_load,
    json_text,
    line_digest,
    nonblank_lines,
    one_of,
    parse_document,
    path_str,
    read_file,
    session_id_from_name,
)
from ctxreplay.pipeline.loaders.claude_code import anthropic_content_blocks

FORMAT = "anthropic_request"
FORMAT_OPENAI = "openai_chat_request"

_OPENAI_ROLES = {"system", "developer", "tool", "function"}
_OPENAI_KEYS = {"tool_calls", "tool_call_id", "function_call"}
_OPENAI_PARTS = {"image_url", "input_audio", "file"}
_ANTHROPIC_BLOCKS = {"tool_use", "tool_result", "thinking", "redacted_thinking", "document",
                     "server_tool_use", "web_search_tool_result", "search_result", "container_upload"}
_OPENAI_MODEL = re.compile(r"^(gpt-|o[134](-|$)|chatgpt-|ft:gpt)", re.IGNORECASE)
_DATA_URL = re.compile(DATA_URL_PATTERN)
_decoder = json.JSONDecoder()


def classify(doc: Any) -> str | None:
    """The request format of a parsed document, or None when it is not a request."""
    if not isinstance(doc, dict) or not isinstance(doc.get("messages"), list):
        return None
    if doc.get("type") is not None and not isinstance(doc.get("model"), str):
        return None  # a transcript line (they carry a `type`), not a request
    msgs = [m for m in doc["messages"] if isinstance(m, dict)]
    parts = [b for m in msgs if isinstance(m.get("content"), list)
             for b in m["content"] if isinstance(b, dict)]
    if any(one_of(m.get("role"), _OPENAI_ROLES) or _OPENAI_KEYS & m.keys() for m in msgs) or any(
            one_of(b.get("type"), _OPENAI_PARTS) for b in parts):
        return FORMAT_OPENAI
    if "system" in doc or any(one_of(b.get("type"), _ANTHROPIC_BLOCKS)
                              or (b.get("type") == "image" and "source" in b) for b in parts):
        return FORMAT
    model = doc.get("model")
    if isinstance(model, str) and _OPENAI_MODEL.match(model):
        return FORMAT_OPENAI
    return FORMAT


def sniff(first_objects: list[Any], path: Path) -> str | None:
    if len(first_objects) != 1:
        return None
    return classify(first_objects[0])


# ---------------------------------------------------------------- spans in the source text


def _skip_ws(text: str, i: int) -> int:
    n = len(text)
    while i < n and text[i] in " \t\r\n":
        i += 1
    return i


def _object_spans(text: str, start: int) -> dict[str, tuple[int, int]]:
    """Spans of the values of a JSON object's keys (the object starts at `start`)."""
    spans: dict[str, tuple[int, int]] = {}
    i = _skip_ws(text, start)
    if i >= len(text) or text[i] != "{":
        raise ValueError("not an object")
    i = _skip_ws(text, i + 1)
    if text[i] == "}":
        return spans
    while True:
        key, i = _decoder.raw_decode(text, i)
        i = _skip_ws(text, i)
        if text[i] != ":":
            raise ValueError("expected ':'")
        i = _skip_ws(text, i + 1)
        _, end = _decoder.raw_decode(text, i)
        spans[key] = (i, end)
        i = _skip_ws(text, end)
        if text[i] == "}":
            return spans
        if text[i] != ",":
            raise ValueError("expected ','")
        i = _skip_ws(text, i + 1)


def _array_spans(text: str, start: int) -> list[tuple[int, int]]:
    spans: list[tuple[int, int]] = []
    i = _skip_ws(text, start)
    if text[i] != "[":
        raise ValueError("not an array")
    i = _skip_ws(text, i + 1)
    if text[i] == "]":
        return spans
    while True:
        _, end = _decoder.raw_decode(text, i)
        spans.append((i, end))
        i = _skip_ws(text, end)
        if text[i] == "]":
            return spans
        if text[i] != ",":
            raise ValueError("expected ','")
        i = _skip_ws(text, i + 1)


# ---------------------------------------------------------------- content mapping


def _rest(b: dict[str, Any], used: tuple[str, ...]) -> dict[str, Any] | None:
    rest = {k: v for k, v in b.items() if k != "type" and k not in used}
    return rest or None


def _image_url_block(url: Any, **kw: Any) -> Block:
    if isinstance(url, dict):
        extra = {k: v for k, v in url.items() if k != "url"} or None
        url = url.get("url")
    else:
        extra = None
    m = _DATA_URL.match(url) if isinstance(url, str) else None
    if m and m.group(2):
        return Block("image", image_media_type=m.group(1), image_data=m.group(3), extra=extra, **kw)
    return Block("image", extra={**(extra or {}), "url": url}, **kw)


def _openai_parts(content: Any) -> list[Block]:
    out: list[Block] = []
    for p in content_items(content):
        if isinstance(p, Block):
            out.append(p)
            continue
        t = p.get("type")
        if t == "text":
            out.append(Block("text", text=p.get("text"), extra=_rest(p, ("text",))))
        elif t == "image_url":
            out.append(_image_url_block(p.get("image_url")))
        elif t == "refusal":
            out.append(Block("refusal", text=p.get("refusal"), extra=p))
        else:
            out.append(Block(str(t), text=p.get("text") if isinstance(p.get("text"), str) else None, extra=p))
    return out


def _openai_tool_parts(content: Any, **common: Any) -> list[Block]:
    if isinstance(content, str):
        return [Block("tool_result", text=content, part_type="string", **common)]
    if not isinstance(content, list) or not content:
        return [Block("tool_result", part_type="empty", **common)]
    parts: list[Block] = []
    for i, p in enumerate(content):
        if isinstance(p, dict) and p.get("type") == "text":
            parts.append(Block("tool_result", text=p.get("text"), part_type="text", part_pos=i, **common))
        elif isinstance(p, dict) and p.get("type") == "image_url":
            img = _image_url_block(p.get("image_url"))
            parts.append(Block("tool_result", part_type="image", part_pos=i,
                               image_media_type=img.image_media_type, image_data=img.image_data,
                               extra=img.extra, **common))
        else:
            parts.append(Block("tool_result", part_type="other", part_pos=i,
                               text=p if isinstance(p, str) else json_text(p), extra={"part": p}, **common))
    return parts


def _tool_call_block(tc: Any) -> Block:
    if not isinstance(tc, dict):
        return Block("tool_use", tool_input=json_text(tc), extra={"tool_call": tc})
    fn = tc.get("function") if isinstance(tc.get("function"), dict) else {}
    args = fn.get("arguments")
    extra = {k: v for k, v in tc.items() if k not in ("id", "function", "type")}
    if tc.get("type") not in (None, "function"):
        extra["type"] = tc.get("type")
    tool_input, ok = arguments_json(args)
    if not ok:
        extra["arguments_not_json"] = True
    return Block("tool_use", tool_use_id=tc.get("id"), tool_name=fn.get("name"), tool_input=tool_input,
                 extra=extra or None)


def _openai_message(m: dict[str, Any], call_names: dict[str, str]) -> tuple[str, list[Block]] | None:
    role = m.get("role")
    if role in ("system", "developer"):
        blocks = _openai_parts(m.get("content"))
        if role == "developer":
            for b in blocks:
                b.extra = {**(b.extra or {}), "role": "developer"}
        return "system", blocks
    if role == "user":
        return "user", _openai_parts(m.get("content"))
    if role == "assistant":
        blocks: list[Block] = []
        for key in ("reasoning_content", "reasoning"):
            if isinstance(m.get(key), str) and m[key]:
                blocks.append(Block("thinking", text=m[key], extra={"field": key}))
        blocks.extend(_openai_parts(m.get("content")))
        if isinstance(m.get("refusal"), str) and m["refusal"]:
            blocks.append(Block("refusal", text=m["refusal"]))
        tcs = m.get("tool_calls")
        for tc in [] if tcs is None else tcs if isinstance(tcs, list) else [tcs]:
            b = _tool_call_block(tc)
            if isinstance(b.tool_use_id, str) and b.tool_use_id and isinstance(b.tool_name, str) and b.tool_name:
                call_names[b.tool_use_id] = b.tool_name
            blocks.append(b)
        if isinstance(m.get("function_call"), dict):
            b = _tool_call_block({"function": m["function_call"]})
            b.extra = {**(b.extra or {}), "legacy": "function_call"}
            blocks.append(b)
        return "assistant", blocks
    if role == "tool":
        tid = m.get("tool_call_id") if isinstance(m.get("tool_call_id"), str) else None
        name = m.get("name") if isinstance(m.get("name"), str) else call_names.get(tid or "")
        return "tool", _openai_tool_parts(m.get("content"), tool_use_id=tid, tool_name=name)
    if role == "function":
        name = m.get("name") if isinstance(m.get("name"), str) else None
        return "tool", _openai_tool_parts(m.get("content"), tool_use_id=None, tool_name=name)
    return None


def _anthropic_message(m: dict[str, Any], call_names: dict[str, str]) -> tuple[str, list[Block]] | None:
    role = m.get("role")
    if role not in ("user", "assistant"):
        return None
    blocks = anthropic_content_blocks(m.get("content"))
    for b in blocks:
        tid = b.tool_use_id if isinstance(b.tool_use_id, str) else ""
        if b.block_type == "tool_use" and tid and isinstance(b.tool_name, str) and b.tool_name:
            call_names[tid] = b.tool_name
        elif b.block_type == "tool_result" and b.tool_name is None and b.part_type != "tool_reference":
            b.tool_name = call_names.get(tid)
    if role == "user" and blocks and all(b.block_type == "tool_result" for b in blocks):
        return "tool", blocks
    return role, blocks


# ---------------------------------------------------------------- load


def counted_load(path: Path, fmt: str, data: bytes) -> FileLoad:
    """A whole-document file's accounting record: its non-blank lines counted (and digested)."""
    load = file_load(path, fmt, data, 0)
    for i, raw in nonblank_lines(data):
        load.lines += 1
        load.digests[i] = line_digest(raw)
    return load


def load(path: Path, data: bytes | None = None) -> tuple[list[Thread], FileLoad]:
    """Load one request file; `data`: its bytes when the caller has read them already."""
    path = Path(path)
    if data is None:
        data = read_file(path)
    load = counted_load(path, FORMAT, data)
    spath = load.path
    doc, text, bad_bytes = parse_document(data)

    def refuse(reason: str, code: str) -> tuple[list[Thread], FileLoad]:
        for i, raw in nonblank_lines(data):
            b64 = base64.b64encode(raw).decode("ascii") if bad_bytes else None
            load.quarantine.append(QuarantineRow(spath, i, displayable(raw), reason, code, b64))
        load.check()
        return [], load

    body_start = 1 if text.startswith("\ufeff") else 0
    if doc is None:
        try:
            orjson.loads(text[body_start:])
            reason, code = f"not one JSON document: nested deeper than {MAX_DEPTH} levels", "too_deep"
        except orjson.JSONDecodeError as exc:
            reason, code = f"not one JSON document: {exc}", "invalid_json"
            if "depth" in str(exc):
                code = "too_deep"
        if bad_bytes:
            reason += " (the file is not valid UTF-8; the exact bytes are kept in raw_base64)"
            code = "invalid_utf8"
        return refuse(reason, code)
    fmt = classify(doc)
    if fmt is None:
        got = type(doc).__name__ if not isinstance(doc, dict) else "an object with keys " + ", ".join(
            sorted(map(str, doc))[:8])
        return refuse("expected one request object with a 'messages' list "
                      f"(Anthropic Messages or OpenAI chat); got {got}", "not_a_request")
    if bad_bytes:
        load.stats["invalid_utf8_replaced"] += bad_bytes
        load.recovered.append({"file": spath, "line": 1, "note": f"{bad_bytes} byte sequence(s) that are not "
                               "UTF-8 inside JSON strings replaced by U+FFFD"})
    load.format = fmt
    load.message_lines = load.lines
    load.check()

    line_starts = [0]
    for i, ch in enumerate(text):
        if ch == "\n":
            line_starts.append(i + 1)

    def line_of(offset: int) -> int:
        return bisect.bisect_right(line_starts, offset)

    try:
        top = _object_spans(text, body_start)
        msg_spans: list[tuple[int, int]] | None = _array_spans(text, top["messages"][0])
        if len(msg_spans) != len(doc["messages"]):  # type: ignore[arg-type]
            msg_spans = None
    except (ValueError, KeyError, IndexError, json.JSONDecodeError):
        top, msg_spans = {}, None

    def locate(span: tuple[int, int] | None, value: Any) -> tuple[int, str]:
        if span is None:
            return 1, orjson.dumps(value).decode()
        return line_of(span[0]), text[span[0]:span[1]]

    items: list[tuple[int, str, str, list[Block], Any]] = []  # (line, raw, role, blocks, original)
    call_names: dict[str, str] = {}
    if fmt == FORMAT and doc.get("system") is not None:
        line, raw = locate(top.get("system"), doc["system"])
        items.append((line, raw, "system", anthropic_content_blocks(doc["system"]), doc["system"]))
    for k, m in enumerate(doc["messages"]):
        line, raw = locate(msg_spans[k] if msg_spans else None, m)
        mapped = None
        if isinstance(m, dict):
            mapped = (_anthropic_message if fmt == FORMAT else _openai_message)(m, call_names)
        if mapped is None:
            role = m.get("role") if isinstance(m, dict) else None
            load.recovered.append({"file": spath, "line": line,
                                   "note": f"messages[{k}] not understood (role {role!r}; expected "
                                           + ("user or assistant" if fmt == FORMAT else
                                              "system, developer, user, assistant or tool") + "); left out"})
            continue
        items.append((line, raw, mapped[0], mapped[1], m))

    per_line: dict[int, int] = {}
    for line, *_ in items:
        per_line[line] = per_line.get(line, 0) + 1
    seen: dict[int, int] = {}
    model = doc.get("model") if isinstance(doc.get("model"), str) else None
    provider, api = ("anthropic", "anthropic-messages") if fmt == FORMAT else ("openai", "openai-completions")
    msgs: list[Message] = []
    prev: str | None = None
    for line, raw, role, blocks, _orig in items:
        k = seen.get(line, 0)
        seen[line] = k + 1
        eid = f"L{line}" if per_line[line] == 1 else f"L{line}.{k}"
        assistant = role == "assistant"
        msgs.append(Message(entry_id=eid, role=role, blocks=blocks, source_file=spath, source_line=line,
                            raw_line=raw, parent_id=prev, model=model if assistant else None,
                            provider=provider if assistant else None, api=api if assistant else None))
        prev = eid
    session_id = session_id_from_name(path) or path_str(path.name).split(".json")[0] or path_str(path.stem)
    if not msgs:
        return [], load
    return [Thread(session_id, "main", fmt, spath, msgs)], load
