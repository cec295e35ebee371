"""OpenAI Codex CLI rollout files (`~/.codex/sessions/YYYY/MM/DD/rollout-<ts>-<uuid>.jsonl`).

Every line is `{timestamp, type, payload}`. `response_item` payloads are the items that were sent
to and received from the Responses API, in order; everything else is bookkeeping:

- `message` role user → "user"; role developer (and system) → "system" with the recorded role in
  each block's extra (`{"role": "developer"}`): instructions from the harness, not the user, that
  Codex sends as developer-role input items where they occur (only the base instructions go to
  the request's `instructions`), so the Responses target keeps them there;
  role assistant → part of a model response.
- A model response is a maximal run of consecutive assistant-side items (reasoning, assistant
  message, function_call, custom_tool_call, local_shell_call, web_search_call): ONE assistant
  message with its blocks in order. A new `token_count` event (its total changed) also ends it.
- `reasoning` → thinking (text = summary texts joined by a blank line, signature =
  encrypted_content); `function_call` → tool_use (tool_input = canonical JSON of the parsed
  `arguments`; unparsable arguments are kept as a JSON string, noted in extra);
  `custom_tool_call` → tool_use whose tool_input is the JSON string of `input`;
  `function_call_output` / `custom_tool_call_output` → a "tool" message with the output.
- Usage: the first new `event_msg` `token_count` after a response: `last_token_usage`, where
  `input_tokens` includes cached (and, from GPT-5.6, written) tokens (usage input = input − cached
  − written, at least 0; cache_read = cached; cache_write = `cache_write_tokens`), or, where an
  older CLI wrote only `total_token_usage`, the difference from the previous total (what
  `ctxreplay report` and ccusage count). A new token_count with no response since the previous
  one is a request whose answer the rollout does not record (a compaction's summary request, an
  interrupted turn): a call of its own thread (`compaction-L<line>`: the history before the
  compaction, answered by its summary; `request-L<line>`: the history so far), the main thread's
  calls inherited, so every request the rollout counts is a call.
- `session_meta.payload.instructions` (older CLIs) or `base_instructions.text` (newer) → a
  "system" message first; `turn_context.model` → model of the following responses.
- `compacted` (not in the corpus): with `replacement_history`, those items replace everything
  before them for later calls; without it, the summary `message` does (an approximation: Codex
  also re-sends its initial context and recent user messages, which the file does not record).
- `event_msg` lines are UI echoes (`event_msg:<type>`); `ghost_snapshot` items are undo
  checkpoints (`response_item:ghost_snapshot`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import orjson

from ctxreplay.pipeline.core.constants import DATA_URL_PATTERN
from ctxreplay.pipeline.loaders.base import (
    Block,
    Compaction,
    FileLoad,
    Message,
    Thread,
    arguments_json,
    bad,
    content_items,
    iter_json_lines,
    json_text,
    num,
    one_of,
    parse_ts,
    path_str,
    session_id_from_name,
)
from ctxreplay.pipeline.loaders.inputs import first_bytes

FORMAT = "codex"
ROLLOUT_TYPES = {"session_meta", "response_item", "event_msg", "turn_context", "compacted"}
ASSISTANT_ITEMS = {"reasoning", "function_call", "custom_tool_call", "local_shell_call", "web_search_call",
                   "tool_search_call", "image_generation_call"}
OUTPUT_ITEMS = {"function_call_output", "custom_tool_call_output", "local_shell_call_output",
                "tool_search_output"}
_META_PREFIXES = ("<environment_context>", "<user_instructions>", "# AGENTS.md instructions",
                  "<turn_aborted>", "<user_shell_command>")
_DATA_URL = re.compile(DATA_URL_PATTERN)


def sniff(first_objects: list[Any], path: Path) -> str | None:
    for o in first_objects:
        if isinstance(o, dict) and one_of(o.get("type"), ROLLOUT_TYPES) and isinstance(o.get("payload"), dict):
            return FORMAT
    return None


# a rollout's first line as Codex CLI writes it (serde's field order): its timestamp, then its type
_ROLLOUT_HEAD = re.compile(rb'\s*\{\s*"timestamp"\s*:\s*"[^"]{0,64}"\s*,\s*"type"\s*:\s*"(?:' + b"|".join(
    t.encode() for t in sorted(ROLLOUT_TYPES)) + rb')"\s*,\s*"payload"\s*:\s*\{')


def is_rollout_file(path: Path) -> bool:
    """Whether a file is a Codex rollout, from its first bytes only: its first line's opening as
    Codex writes it (a long first line need not be read whole), else a first line of at most
    64 KiB that the sniffer takes. A FIFO, device or folder is none (never opened)."""
    head = first_bytes(path)
    if head is None:
        return False
    if _ROLLOUT_HEAD.match(head):
        return True
    first = head.lstrip().split(b"\n", 1)[0]
    if not first.startswith(b"{"):
        return False
    try:
        o = orjson.loads(first)
    except orjson.JSONDecodeError:
        return False
    return sniff([o], path) is not None


def _image_from_url(url: Any, **kw: Any) -> Block:
    """`image_url` as Codex sends it (usually a data: URL) → an image block."""
    m = _DATA_URL.match(url) if isinstance(url, str) else None
    if m and m.group(2):
        return Block("image", image_media_type=m.group(1), image_data=m.group(3), **kw)
    extra = {"image_url": url}
    return Block("image", extra=extra, **kw)


def _message_blocks(content: Any) -> list[Block]:
    out: list[Block] = []
    for c in content_items(content):
        if isinstance(c, Block):
            out.append(c)
            continue
        t = c.get("type")
        rest = {k: v for k, v in c.items() if k not in ("type", "text", "image_url")} or None
        if t in ("input_text", "output_text", "text"):
            out.append(Block("text", text=c.get("text"), extra=rest))
        elif t == "input_image":
            b = _image_from_url(c.get("image_url"))
            if rest:
                b.extra = {**(b.extra or {}), **rest}
            out.append(b)
        elif t == "refusal":
            out.append(Block("refusal", text=c.get("refusal"), extra=c))
        else:
            out.append(Block(str(t), text=c.get("text") if isinstance(c.get("text"), str) else None, extra=c))
    return out


def _output_parts(output: Any, *, tool_use_id: str | None, tool_name: str | None) -> list[Block]:
    common = {"tool_use_id": tool_use_id, "tool_name": tool_name}
    if isinstance(output, str):
        return [Block("tool_result", text=output, part_type="string", **common)]
    if isinstance(output, dict) and isinstance(output.get("content"), str):
        rest = {k: v for k, v in output.items() if k != "content"} or None
        return [Block("tool_result", text=output["content"], part_type="string", extra=rest,
                      is_error=(output.get("success") is False) if "success" in output else None,
                      **common)]
    if isinstance(output, list) and output:
        parts: list[Block] = []
        for i, p in enumerate(output):
            if isinstance(p, dict) and p.get("type") in ("input_text", "output_text", "text"):
                parts.append(Block("tool_result", text=p.get("text"), part_type="text", part_pos=i, **common))
            elif isinstance(p, dict) and p.get("type") == "input_image":
                img = _image_from_url(p.get("image_url"))
                parts.append(Block("tool_result", part_type="image", part_pos=i,
                                   image_media_type=img.image_media_type, image_data=img.image_data,
                                   extra=img.extra, **common))
            else:
                text = p if isinstance(p, str) else json_text(p)
                parts.append(Block("tool_result", part_type="other", part_pos=i, text=text, extra={"part": p},
                                   **common))
        return parts
    if output is None or output == [] or output == "":
        return [Block("tool_result", part_type="empty", **common)]
    return [Block("tool_result", text=json_text(output), part_type="other", extra={"part": output}, **common)]


def _text(v: Any) -> str:
    """A text field as text (null: empty; any other JSON value: its JSON text)."""
    return v if isinstance(v, str) else "" if v is None else json_text(v)


def _assistant_blocks(p: dict[str, Any]) -> list[Block]:
    t = p.get("type")
    if t == "message":
        return _message_blocks(p.get("content"))
    if t == "reasoning":
        summary = p.get("summary") if isinstance(p.get("summary"), list) else []
        texts = [_text(s.get("text", "")) if isinstance(s, dict) else str(s) for s in summary]
        extra: dict[str, Any] = {}
        if len(summary) != 1:
            extra["summary"] = summary
        if p.get("content") is not None:
            extra["content"] = p.get("content")
            if not texts and isinstance(p["content"], list):
                texts = [_text(c.get("text", "")) for c in p["content"] if isinstance(c, dict)]
        if p.get("id"):
            extra["id"] = p["id"]
        return [Block("thinking", text="\n\n".join(texts), signature=p.get("encrypted_content"),
                      extra=extra or None)]
    if t == "function_call":
        args = p.get("arguments")
        extra = {k: v for k, v in p.items() if k not in ("type", "name", "arguments", "call_id")}
        tool_input, ok = arguments_json(args)
        if not ok:
            extra["arguments_not_json"] = True
        return [Block("tool_use", tool_use_id=p.get("call_id"), tool_name=p.get("name"),
                      tool_input=tool_input, extra=extra or None)]
    if t == "custom_tool_call":
        extra = {k: v for k, v in p.items() if k not in ("type", "name", "input", "call_id")}
        extra["item_type"] = "custom_tool_call"
        return [Block("tool_use", tool_use_id=p.get("call_id"), tool_name=p.get("name"),
                      tool_input=json_text(p.get("input")), extra=extra)]
    if t == "local_shell_call":
        extra = {k: v for k, v in p.items() if k not in ("type", "action", "call_id")}
        extra["item_type"] = "local_shell_call"
        return [Block("tool_use", tool_use_id=p.get("call_id") or p.get("id"), tool_name="local_shell",
                      tool_input=json_text(p.get("action")), extra=extra)]
    return [Block(str(t), extra=p)]


@dataclass
class _Response:
    """Items of one model response being collected."""

    msg: Message
    lines: list[tuple[str, int, str, str]] = field(default_factory=list)


def load(path: Path) -> tuple[list[Thread], FileLoad]:
    path = Path(path)
    spath = path_str(path)
    load = FileLoad(spath, FORMAT)
    msgs: list[Message] = []
    compactions: list[Compaction] = []
    session_id = session_id_from_name(path)
    meta_seen = False
    model: str | None = None
    provider: str | None = None
    current: _Response | None = None
    last_total: Any = None
    awaiting_usage: Message | None = None  # the latest response, until a new token_count arrives
    call_names: dict[str, str] = {}
    # requests without a recorded answer: (messages before it, its answer, compactions before it)
    unanswered: list[tuple[int, Message, int]] = []
    compacted_at: tuple[int, str, int] | None = None  # since the last response: (keep_from, summary, compactions)

    def close() -> None:
        nonlocal current, awaiting_usage, compacted_at
        if current is not None:
            current.msg.block_lines = current.lines
            msgs.append(current.msg)
            awaiting_usage = current.msg
            compacted_at = None
            current = None

    for line_no, raw, objs in iter_json_lines(path, load):
        kinds: list[str] = []
        glued = len(objs) > 1
        for k, o in enumerate(objs):
            eid = f"L{line_no}.{k}" if glued else f"L{line_no}"
            if not isinstance(o, dict):
                kinds.append(bad("not_an_object", f"expected a JSON object, got {type(o).__name__}"))
                continue
            t = o.get("type")
            if not isinstance(t, str) or not t:
                kinds.append(bad("no_type", "line has no 'type' field "
                                 "(expected session_meta, response_item, event_msg, ...)"))
                continue
            p = o.get("payload")
            if not isinstance(p, dict):
                kinds.append(bad("no_payload", f"'{t[:100]}' line has no 'payload' object"))
                continue
            ts = parse_ts(o.get("timestamp"))
            if t == "session_meta":
                kinds.append("session_meta")
                if meta_seen:
                    continue
                meta_seen = True
                if session_id is None and isinstance(p.get("id"), str) and p["id"]:
                    session_id = p["id"]
                if isinstance(p.get("model_provider"), str):
                    provider = p["model_provider"]
                base = p.get("base_instructions")
                instr = p.get("instructions")
                text = None
                if isinstance(base, dict) and isinstance(base.get("text"), str) and base["text"]:
                    text = base["text"]
                elif isinstance(instr, str) and instr:
                    text = instr
                if text is not None:
                    close()
                    msgs.append(Message(entry_id=eid, role="system", blocks=[Block("text", text=text)],
                                        source_file=spath, source_line=line_no, raw_line=raw, timestamp=ts))
                continue
            if t == "turn_context":
                kinds.append("turn_context")
                if isinstance(p.get("model"), str):
                    model = p["model"]
                continue
            if t == "event_msg":
                et = p.get("type")
                kinds.append(f"event_msg:{et}" if et else "event_msg")
                if et == "token_count" and isinstance(p.get("info"), dict):
                    info = p["info"]
                    total = info.get("total_token_usage")
                    if total is not None and total == last_total:
                        continue  # the same figures again (Codex repeats them after tool output)
                    previous, last_total = last_total, total
                    close()
                    usage = _token_usage(info.get("last_token_usage"), total, previous)
                    if awaiting_usage is not None:
                        if usage is not None:
                            awaiting_usage.usage = usage
                    elif usage is not None and msgs and any(v for v in usage.values()):
                        # a request whose answer is not recorded: a compaction's own request reads
                        # the history before it and answers with its summary
                        text = compacted_at[1] if compacted_at else None
                        ans = Message(entry_id=eid, role="assistant",
                                      blocks=[Block("text", text=text)] if text else [], source_file=spath,
                                      source_line=line_no, raw_line=raw, timestamp=ts, model=model,
                                      provider=provider, api="openai-responses", usage=usage)
                        unanswered.append((compacted_at[0] if compacted_at else len(msgs), ans,
                                           compacted_at[2] if compacted_at else len(compactions)))
                        compacted_at = None
                    awaiting_usage = None
                continue
            if t == "compacted":
                kinds.append("compacted")
                close()
                at = len(msgs) - 1
                hist = p.get("replacement_history")
                keep_from = len(msgs)
                if isinstance(hist, list) and hist:
                    for i, item in enumerate(hist):
                        m = _item_message(item, f"{eid}.r{i}", spath, line_no, raw, ts, model, provider,
                                          call_names)
                        if m is not None:
                            m.visible_from = at
                            msgs.append(m)
                else:
                    msgs.append(Message(entry_id=eid, role="user",
                                        blocks=[Block("text", text=str(p.get("message", "")))],
                                        source_file=spath, source_line=line_no, raw_line=raw, timestamp=ts,
                                        is_compact_summary=True, visible_from=at))
                    load.recovered.append({"file": spath, "line": line_no,
                                           "note": "compacted entry without replacement_history: the history "
                                                   "before it is replaced by its summary (approximation)"})
                compacted_at = (keep_from, str(p.get("message") or ""), len(compactions))
                compactions.append(Compaction(at=at, keep_from=keep_from))
                continue
            if t != "response_item":
                kinds.append(t)
                continue
            it = p.get("type")
            if it == "message" and p.get("role") == "assistant" or one_of(it, ASSISTANT_ITEMS):
                if current is None:
                    current = _Response(Message(entry_id=eid, role="assistant", blocks=[], source_file=spath,
                                                source_line=line_no, raw_line=raw, timestamp=ts, model=model,
                                                provider=provider, api="openai-responses"))
                blocks = _assistant_blocks(p)
                for b in blocks:
                    if b.block_type == "tool_use" and isinstance(b.tool_use_id, str) and b.tool_use_id \
                            and isinstance(b.tool_name, str) and b.tool_name:
                        call_names[b.tool_use_id] = b.tool_name
                current.msg.blocks.extend(blocks)
                current.lines.extend([(eid, line_no, raw, spath)] * len(blocks))
                if p.get("id") and current.msg.message_id is None and it == "message":
                    current.msg.message_id = p["id"]
                kinds.append("message")
                continue
            m = _item_message(p, eid, spath, line_no, raw, ts, model, provider, call_names)
            if m is None:
                if it == "message":
                    kinds.append(bad("no_role", "response_item message has no usable 'role' "
                                         f"(got {repr(p.get('role'))[:100]})"))
                else:
                    kinds.append(f"response_item:{it}")
                continue
            close()
            msgs.append(m)
            kinds.append("message")
        load.account(line_no, raw, kinds)
    close()
    load.check()
    if session_id is None:
        session_id = path_str(path.name).split(".jsonl")[0] or path_str(path.stem)
    if not msgs:
        return [], load
    threads = [Thread(session_id, "main", FORMAT, spath, msgs, compactions)]
    for n, ans, nc in unanswered:
        # the main thread's requests on this path stay its calls (inherited: numbered, not reported)
        hist = [replace(m, inherited=True) if m.role == "assistant" and m.is_call is not False else m
                for m in msgs[:n]]
        kind = "compaction" if ans.blocks else "request"
        threads.append(Thread(session_id, f"{kind}-{ans.entry_id}", FORMAT, spath, [*hist, ans], compactions[:nc]))
    return threads, load


def _token_usage(last: Any, total: Any, previous: Any) -> dict[str, int | None] | None:
    """A token_count's usage of one request: `last_token_usage`, else the difference of the
    cumulative totals (older CLIs write only those); None when neither is an object. Input is
    what was neither read from nor written to the cache (Codex counts both in input_tokens)."""
    if not isinstance(last, dict):
        if not isinstance(total, dict):
            return None
        prev = previous if isinstance(previous, dict) else {}
        last = {k: max((num(total.get(k)) or 0) - (num(prev.get(k)) or 0), 0) for k in total}
    inp, cached, written = num(last.get("input_tokens")), num(last.get("cached_input_tokens")), \
        num(last.get("cache_write_tokens"))
    u = {"input": None if inp is None else max(inp - (cached or 0) - (written or 0), 0), "cache_read": cached,
         "output": num(last.get("output_tokens"))}
    if written is not None:   # priced as a 5-minute write, as `ctxreplay report` does
        u.update(cache_write=written, cache_write_5m=written)
    return u


def _item_message(p: Any, eid: str, spath: str, line_no: int, raw: str, ts: Any, model: str | None,
                  provider: str | None, call_names: dict[str, str]) -> Message | None:
    """A non-assistant response item (or any item of a replacement history) → one message."""
    if not isinstance(p, dict):
        return None
    it = p.get("type")
    base = {"entry_id": eid, "source_file": spath, "source_line": line_no, "raw_line": raw, "timestamp": ts}
    if it == "message":
        role = p.get("role")
        blocks = _message_blocks(p.get("content"))
        if role == "user":
            first = next((b.text for b in blocks if b.block_type == "text" and isinstance(b.text, str) and b.text), "")
            is_meta = first.lstrip().startswith(_META_PREFIXES)
            return Message(role="user", blocks=blocks, is_meta=is_meta, **base)
        if role in ("developer", "system"):
            # an input item of the request (Codex sends only its base instructions as
            # `instructions`): the recorded role keeps it in the Responses input where it was
            for b in blocks:
                b.extra = {**(b.extra or {}), "role": role}
            return Message(role="system", blocks=blocks, **base)
        if role == "assistant":
            return Message(role="assistant", blocks=blocks, model=model, provider=provider,
                           api="openai-responses", is_call=False, **base)
        return None
    if one_of(it, OUTPUT_ITEMS):
        cid = p.get("call_id") if isinstance(p.get("call_id"), str) else None
        return Message(role="tool", blocks=_output_parts(p.get("output"), tool_use_id=cid,
                                                          tool_name=call_names.get(cid or "")), **base)
    if one_of(it, ASSISTANT_ITEMS):
        # inside a replacement history: part of the past, not a call recorded here
        return Message(role="assistant", blocks=_assistant_blocks(p), model=model, provider=provider,
                       api="openai-responses", is_call=False, **base)
    return None
