"""OpenAI Chat Completions: {"messages": [...], "model": ...}; system messages stay in the list.

Each tool result is its own `tool` message; assistant tool calls become `tool_calls` with the
arguments as a JSON string; thinking is not part of this wire shape and is left out.
"""

from __future__ import annotations

from typing import Any

from pipeline.targets import LogicalMessage, Violation, group_blocks, register


def _text(parts: list[dict[str, Any]]) -> str:
    out = []
    for p in parts:
        if p.get("part_type") == "image":
            out.append("[image]")
        elif p.get("part_type") == "tool_reference":
            out.append(f"[tool reference: {p.get('tool_name')}]")
        elif p.get("text") is not None:
            out.append(p["text"])
    return "\n".join(out)


def _user_part(r: dict[str, Any]) -> dict[str, Any] | None:
    t = r["block_type"]
    if t == "text":
        return {"type": "text", "text": r.get("text") or ""}
    if t == "image":
        return {"type": "image_url",
                "image_url": {"url": f"data:{r.get('image_media_type')};base64,{r.get('image_data') or ''}"}}
    if t in ("empty", "thinking", "redacted_thinking"):
        return None
    return {"type": "text", "text": r.get("text") or ""}


class OpenAIChat:
    name = "openai-chat"
    list_key = "messages"

    def splits_system(self) -> bool:
        return False

    def shape(self, msgs: list[LogicalMessage], start: int) -> list[tuple[int, dict[str, Any]]]:
        out: list[tuple[int, dict[str, Any]]] = []
        for i in range(start, len(msgs)):
            m = msgs[i]
            groups = group_blocks(m.rows)
            if m.role == "system":
                out.append((i, {"role": "system", "content": "\n".join(
                    g[0].get("text") or "" for g in groups if g[0]["block_type"] == "text")}))
            elif m.role == "assistant":
                text = "".join(g[0].get("text") or "" for g in groups if g[0]["block_type"] == "text")
                calls = [{"id": g[0].get("tool_use_id"), "type": "function",
                          "function": {"name": g[0].get("tool_name"), "arguments": g[0].get("tool_input") or "{}"}}
                         for g in groups if g[0]["block_type"] == "tool_use"]
                msg: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
                if calls:
                    msg["tool_calls"] = calls
                out.append((i, msg))
            else:
                others: list[dict[str, Any]] = []
                for g in groups:
                    if g[0]["block_type"] == "tool_result":
                        if others:
                            out.append((i, {"role": "user", "content": others}))
                            others = []
                        out.append((i, {"role": "tool", "tool_call_id": g[0].get("tool_use_id"), "content": _text(g)}))
                    else:
                        p = _user_part(g[0])
                        if p is not None:
                            others.append(p)
                if others or not groups or all(g[0]["block_type"] == "empty" for g in groups):
                    out.append((i, {"role": "user", "content": others}))
        return out

    def envelope(self, model: str | None, system: list[LogicalMessage]) -> dict[str, Any]:
        return {"model": model}

    def validate(self, request: dict[str, Any], *, thread_key: str, call: int) -> list[Violation]:
        from pipeline.validate import validate_openai_chat

        return validate_openai_chat(request, thread_key=thread_key, call=call)


register(OpenAIChat())
