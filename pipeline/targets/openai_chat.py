"""OpenAI Chat Completions: {"messages": [...], "model": ...}; system messages stay in the list.

Each tool result is its own `tool` message; assistant tool calls become `tool_calls` with the
arguments as a JSON string; thinking is not part of this wire shape and is left out. In a run of
tool-result messages the `tool` messages come first and the run's other blocks (text, images) follow
as one user message, so no `tool` message is cut off from its call (layer-semantics §10). A message
with no wire content (an empty or aborted assistant turn, an empty user row) is left out. A block
of another provider's type (which the sanitize layer converts or drops) is passed as recorded (an
assistant message then has a list of content parts), for the validator to report.
"""

from __future__ import annotations

from typing import Any

from ctxreplay.pipeline.core.constants import BOOTSTRAP_TEXT as BOOTSTRAP
from ctxreplay.pipeline.targets import (
    PORTABLE_BLOCK_TYPES,
    LogicalMessage,
    Violation,
    Wire,
    group_blocks,
    register,
)
from ctxreplay.pipeline.targets.wire import image_data_url, raw_item, result_text, shape_runs


def _user_part(r: dict[str, Any]) -> dict[str, Any] | None:
    t = r["block_type"]
    if t == "text":
        return {"type": "text", "text": r.get("text") or ""}
    if t == "image":
        return {"type": "image_url",
                "image_url": {"url": image_data_url(r)}}
    if t in ("empty", "thinking", "redacted_thinking"):
        return None
    if t in PORTABLE_BLOCK_TYPES:
        return {"type": "text", "text": r.get("text") or ""}
    return raw_item(r)  # another provider's item, as recorded, for the validator to report


def _has_results(m: LogicalMessage) -> bool:
    return any(r["block_type"] == "tool_result" for r in m.rows)


def _run(msgs: list[LogicalMessage], i: int) -> tuple[int, list[Any]]:
    """One message, or a run of tool-result messages."""
    m = msgs[i]
    items: list[dict[str, Any]] = []
    j = i + 1
    if m.role == "system":
        groups = group_blocks(m.rows)
        texts = [g for g in groups if g[0]["block_type"] == "text"]
        items.append(Wire({"role": "system", "content": "\n".join(g[0].get("text") or "" for g in texts)},
                          [g[0] for g in texts]))
    elif m.role == "assistant":
        groups = group_blocks(m.rows)
        texts = [g[0] for g in groups if g[0]["block_type"] == "text"]
        uses = [g[0] for g in groups if g[0]["block_type"] == "tool_use"]
        foreign_rows = [g[0] for g in groups if g[0]["block_type"] not in PORTABLE_BLOCK_TYPES]
        text = "".join(r.get("text") or "" for r in texts)
        calls = [{"id": r.get("tool_use_id"), "type": "function",
                  "function": {"name": r.get("tool_name"), "arguments": r.get("tool_input") or "{}"}}
                 for r in uses]
        # another provider's item (the sanitize layer converts or drops them) is passed as
        # recorded, beside the text (content becomes a list of parts), for the validator
        foreign = [raw_item(r) for r in foreign_rows]
        if text or calls or foreign:
            msg = Wire({"role": "assistant", "content": text if text or not calls else None},
                       texts + uses + foreign_rows)
            if foreign:
                msg["content"] = ([{"type": "text", "text": text}] if text else []) + foreign
            if calls:
                msg["tool_calls"] = calls
            items.append(msg)
    elif _has_results(m):
        # a run of tool-result messages: tool messages first, the rest after them
        others: list[dict[str, Any]] = []
        other_rows: list[dict[str, Any]] = []
        j, n = i, len(msgs)
        while j < n and msgs[j].role not in ("system", "assistant") and _has_results(msgs[j]):
            for g in group_blocks(msgs[j].rows):
                if g[0]["block_type"] == "tool_result":
                    items.append(Wire({"role": "tool", "tool_call_id": g[0].get("tool_use_id"),
                                       "content": result_text(g)}, g))
                else:
                    p = _user_part(g[0])
                    if p is not None:
                        others.append(p)
                        other_rows.append(g[0])
            j += 1
        if others:
            items.append(Wire({"role": "user", "content": others}, other_rows))
    else:
        sent = [(p, g[0]) for g in group_blocks(m.rows) if (p := _user_part(g[0])) is not None]
        if sent:
            items.append(Wire({"role": "user", "content": [p for p, _ in sent]}, [r for _, r in sent]))
    return j, items


class OpenAIChat:
    name = "openai-chat"
    list_key = "messages"

    def splits_system(self) -> bool:
        return False

    def shape(self, msgs: list[LogicalMessage], start: int) -> list[tuple[int, dict[str, Any]]]:
        # no lead-in: the API takes a history that starts with the assistant
        return shape_runs(msgs, start, _run)

    def empty_messages(self) -> list[dict[str, Any]]:
        """The stand-in for a request with no recorded message."""
        return [{"role": "user", "content": BOOTSTRAP}]

    def envelope(self, model: str | None, system: list[LogicalMessage]) -> dict[str, Any]:
        return {"model": model}

    allow_prefill = True

    def validate(self, request: dict[str, Any], *, thread_key: str, call: int,
                 awaits_user: bool = False) -> list[Violation]:
        from ctxreplay.pipeline.targets.validate import validate_openai_chat

        return validate_openai_chat(request, thread_key=thread_key, call=call)


register(OpenAIChat())
