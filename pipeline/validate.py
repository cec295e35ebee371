"""Validators: the invariants a provider checks before it accepts a request (layer-semantics §10).

Each returns a list of Violations naming thread, call, message and block; an empty list means the
provider would accept the request's structure.
"""

from __future__ import annotations

import re
from typing import Any

from pipeline.targets import Violation

TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


def validate_anthropic(request: dict[str, Any], *, thread_key: str, call: int) -> list[Violation]:
    out: list[Violation] = []

    def bad(m: int | None, b: int | None, rule: str, detail: str) -> None:
        out.append(Violation(thread_key, call, m, b, rule, detail))

    msgs = request.get("messages") or []
    if not msgs:
        bad(None, None, "messages_empty", "a request needs at least one message")
        return out
    if msgs[0].get("role") != "user":
        bad(0, None, "first_not_user", f"the first message has role {msgs[0].get('role')!r}, not 'user'")
    seen_ids: set[str] = set()
    for i, m in enumerate(msgs):
        role = m.get("role")
        content = m.get("content")
        if role not in ("user", "assistant"):
            bad(i, None, "bad_role", f"role {role!r}")
        if i and msgs[i - 1].get("role") == role:
            bad(i, None, "roles_not_alternating", f"two {role} messages in a row")
        if not isinstance(content, list) or (not content and not (role == "assistant" and i == len(msgs) - 1)):
            bad(i, None, "empty_content", "message content is empty")
            continue
        for j, b in enumerate(content):
            t = b.get("type")
            if t == "text" and not (b.get("text") or "").strip():
                bad(i, j, "empty_text", "text content blocks must contain non-whitespace text")
            if t == "tool_use":
                if role != "assistant":
                    bad(i, j, "tool_use_in_user", "tool_use outside an assistant message")
                tid = b.get("id")
                if not tid:
                    bad(i, j, "tool_use_without_id", "tool_use has no id")
                elif tid in seen_ids:
                    bad(i, j, "duplicate_tool_use_id", f"tool_use id {tid} used twice in one request")
                seen_ids.add(tid or "")
                if not TOOL_NAME.match(str(b.get("name") or "")):
                    bad(i, j, "bad_tool_name", f"tool name {b.get('name')!r} does not match ^[a-zA-Z0-9_-]{{1,64}}$")
                if not isinstance(b.get("input"), dict):
                    bad(i, j, "tool_input_not_object", "tool_use input must be an object")
            if t == "tool_result" and role != "user":
                bad(i, j, "tool_result_in_assistant", "tool_result outside a user message")
        if role == "assistant":
            calls = [b.get("id") for b in content if b.get("type") == "tool_use"]
            if calls:
                nxt = msgs[i + 1] if i + 1 < len(msgs) else None
                answered = {b.get("tool_use_id") for b in (nxt or {}).get("content") or [] if b.get("type") == "tool_result"}
                for cid in calls:
                    if cid not in answered:
                        bad(i, None, "tool_use_unanswered",
                            f"tool_use {cid} has no tool_result in the next message")
        if role == "user":
            results = [(j, b.get("tool_use_id")) for j, b in enumerate(content) if b.get("type") == "tool_result"]
            if results:
                prev = msgs[i - 1] if i else None
                ids = {b.get("id") for b in (prev or {}).get("content") or [] if b.get("type") == "tool_use"}
                for j, rid in results:
                    if rid not in ids:
                        bad(i, j, "tool_result_without_tool_use",
                            f"tool_result for {rid} has no tool_use in the previous message")
                first_other = next((j for j, b in enumerate(content) if b.get("type") != "tool_result"), None)
                if first_other is not None and any(j > first_other for j, _ in results):
                    bad(i, first_other, "tool_result_not_first", "tool_result blocks must come first in a user message")
    return out


def validate_openai_chat(request: dict[str, Any], *, thread_key: str, call: int) -> list[Violation]:
    out: list[Violation] = []

    def bad(m: int | None, b: int | None, rule: str, detail: str) -> None:
        out.append(Violation(thread_key, call, m, b, rule, detail))

    msgs = request.get("messages") or []
    if not msgs:
        bad(None, None, "messages_empty", "a request needs at least one message")
        return out
    open_calls: list[str] = []
    open_from: int | None = None
    for i, m in enumerate(msgs):
        role = m.get("role")
        if role == "tool":
            cid = m.get("tool_call_id")
            if cid in open_calls:
                open_calls.remove(cid)
            else:
                bad(i, None, "tool_without_call", f"tool message for {cid} does not follow an assistant tool call")
            continue
        if open_calls:
            bad(open_from, None, "tool_call_unanswered",
                f"tool call(s) {', '.join(map(str, open_calls))} have no tool message before message {i}")
            open_calls = []
        if role == "assistant":
            tcs = m.get("tool_calls") or []
            ids = [tc.get("id") for tc in tcs]
            for j, tc in enumerate(tcs):
                if not tc.get("id"):
                    bad(i, j, "tool_call_without_id", "tool call has no id")
                if not TOOL_NAME.match(str((tc.get("function") or {}).get("name") or "")):
                    bad(i, j, "bad_tool_name", f"function name {(tc.get('function') or {}).get('name')!r} is not valid")
            if len(set(ids)) != len(ids):
                bad(i, None, "duplicate_tool_call_id", "the same tool call id twice in one message")
            open_calls, open_from = [x for x in ids if x], i
            if m.get("content") is None and not tcs:
                bad(i, None, "empty_assistant", "assistant message without content or tool calls")
        elif role in ("user", "system", "developer"):
            c = m.get("content")
            if c is None or c == [] or c == "":
                bad(i, None, "empty_content", f"{role} message with empty content")
        else:
            bad(i, None, "bad_role", f"role {role!r}")
    if open_calls and open_from is not None and open_from != len(msgs) - 1:
        bad(open_from, None, "tool_call_unanswered", f"tool call(s) {', '.join(map(str, open_calls))} unanswered")
    elif open_calls:
        bad(open_from, None, "tool_call_unanswered",
            f"the request ends with unanswered tool call(s) {', '.join(map(str, open_calls))}")
    return out
