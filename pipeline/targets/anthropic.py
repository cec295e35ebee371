"""Anthropic Messages: {"messages": [...], "model": ..., "system": [text blocks]}.

Provider shaping (layer-semantics §10): adjacent messages that map to the same wire role are merged
(user content concatenated in order; in a user message tool_result blocks come first, other blocks
after); a message with no wire content (an empty or aborted assistant turn) is left out, so its
neighbours merge; a recorded call's request never ends with an assistant message unless
`allow_prefill` (models that reject prefill answer a request ending with an assistant turn with a
400): the replay leaves it out, except in the pending request of a thread that ended on the
assistant's answer, which keeps it (`awaits_user`: what a resumed session carries); a tool input that is not
a JSON object (a freeform tool's raw text) becomes `{"input": <value>}`; a history that starts with
an assistant turn gets a `(session bootstrap)` user turn before it (the API wants a user turn first).
"""

from __future__ import annotations

from typing import Any

import orjson

from ctxreplay.pipeline.core.constants import BOOTSTRAP_TEXT as BOOTSTRAP
from ctxreplay.pipeline.targets import LogicalMessage, Violation, Wire, group_blocks, register
from ctxreplay.pipeline.targets.wire import Content, memo_content, merge_run, shape_runs, tool_input_object

WIRE_ROLE = {"user": "user", "tool": "user", "assistant": "assistant"}




def _image(r: dict[str, Any]) -> dict[str, Any]:
    return {"type": "image", "source": {"type": "base64", "media_type": r.get("image_media_type"),
                                        "data": r.get("image_data")}}


def _extra(r: dict[str, Any]) -> dict[str, Any] | None:
    e = r.get("extra_json")
    if not e:
        return None
    try:
        v = orjson.loads(e)
    except orjson.JSONDecodeError:
        return None
    return v if isinstance(v, dict) else None


def wire_block(parts: list[dict[str, Any]]) -> dict[str, Any] | None:
    r = parts[0]
    t = r["block_type"]
    if t == "text":
        return {"type": "text", "text": r.get("text") or ""}
    if t == "thinking":
        return {"type": "thinking", "thinking": r.get("text") or "", "signature": r.get("signature") or ""}
    if t == "redacted_thinking":
        return {"type": "redacted_thinking", "data": r.get("text") or ""}
    if t in ("tool_use", "server_tool_use"):
        return {"type": t, "id": r.get("tool_use_id"), "name": r.get("tool_name"), "input": tool_input_object(r)}
    if t == "image":
        return _image(r)
    if t == "empty":
        return None
    if t == "tool_result":
        out: dict[str, Any] = {"type": "tool_result", "tool_use_id": r.get("tool_use_id")}
        if len(parts) == 1 and r.get("part_type") == "string":
            out["content"] = r.get("text") or ""
        elif len(parts) == 1 and r.get("part_type") in ("empty", None):
            out["content"] = r.get("text") if r.get("text") is not None else []
        else:
            content = []
            for p in parts:
                pt = p.get("part_type")
                if pt == "image":
                    content.append(_image(p))
                elif pt == "tool_reference":
                    content.append({"type": "tool_reference", "tool_name": p.get("tool_name")})
                elif pt == "other" and _extra(p) and "part" in (_extra(p) or {}):
                    content.append((_extra(p) or {})["part"])
                elif pt != "empty":
                    content.append({"type": "text", "text": p.get("text") or ""})
            out["content"] = content
        if r.get("is_error") is not None:
            out["is_error"] = bool(r["is_error"])
        return out
    extra = _extra(r)
    if extra is not None and extra.get("type"):
        return extra
    return {"type": t, "text": r.get("text") or ""}


def message_content(msgs: list[LogicalMessage]) -> list[dict[str, Any]]:
    return _content(msgs)[0]


def _content(msgs: list[LogicalMessage]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(wire blocks, the rows they send) of these messages."""
    blocks: list[dict[str, Any]] = []
    sent: list[dict[str, Any]] = []
    for m in msgs:
        for parts in group_blocks(m.rows):
            b = wire_block(parts)
            if b is not None:
                blocks.append(b)
                sent.extend(parts)
    return blocks, sent


def _message(msgs: list[LogicalMessage], j: int) -> tuple[str, list[Any], list[Any], list[Any]] | None:
    """Message j for merge_run: its wire role, and in a user message its tool results first, the
    other blocks after (stable)."""
    c, rows = _content([msgs[j]])
    if not c:
        return None
    role = WIRE_ROLE.get(msgs[j].role, "user")
    if role == "user":
        results = [b for b in c if b.get("type") == "tool_result"]
        return role, results, [b for b in c if b.get("type") != "tool_result"], rows
    return role, [], c, rows


def _run(msgs: list[LogicalMessage], i: int, content: Content = _message) -> tuple[int, list[Any]]:
    """One wire message: a run of messages of one wire role."""
    j, role, results, other, sent = merge_run(msgs, i, content)
    return j, [] if role is None else [Wire({"role": role, "content": results + other}, sent)]


def _lead_in(msgs: list[LogicalMessage], i: int, items: list[Any]) -> Wire | None:
    """The Messages API wants a user turn first: a history that starts with the assistant (a resumed
    or truncated session: no message before i has wire content) gets the bootstrap turn before it."""
    if items[0]["role"] == "assistant" and not any(message_content([msgs[x]]) for x in range(i)):
        return Wire({"role": "user", "content": [{"type": "text", "text": BOOTSTRAP}]})
    return None


class Anthropic:
    name = "anthropic"
    list_key = "messages"

    def splits_system(self) -> bool:
        return True

    allow_prefill = False  # a request may end with an assistant message (a prefill)

    def shape(self, msgs: list[LogicalMessage], start: int) -> list[tuple[int, dict[str, Any]]]:
        content = memo_content(_message)  # (one shape call: the messages do not change under it)
        return shape_runs(msgs, start, lambda m, i: _run(m, i, content), _lead_in)

    def empty_messages(self) -> list[dict[str, Any]]:
        """The stand-in for a request with no recorded message (the API needs one user turn)."""
        return [{"role": "user", "content": [{"type": "text", "text": BOOTSTRAP}]}]

    def envelope(self, model: str | None, system: list[LogicalMessage]) -> dict[str, Any]:
        sys_blocks = [b for b in message_content(system) if b.get("type") == "text"]
        return {"model": model, "system": sys_blocks}

    def validate(self, request: dict[str, Any], *, thread_key: str, call: int,
                 awaits_user: bool = False) -> list[Violation]:
        from ctxreplay.pipeline.targets.validate import validate_anthropic

        return validate_anthropic(request, thread_key=thread_key, call=call, allow_prefill=self.allow_prefill,
                                  awaits_user=awaits_user)


register(Anthropic())
