"""Gemini generateContent: {"contents": [...], "model": ..., "systemInstruction": {"parts": [...]}}.

Provider shaping (layer-semantics §10): assistant → role `model`, user and tool results → role
`user`; adjacent turns of one role are merged (in a user turn the function responses come first);
the first turn must be a user turn, so a leading model turn gets a user turn `(session bootstrap)`
before it; text → `{"text"}`, images → `{"inlineData"}`, a tool call → `{"functionCall": {id, name,
args}}` (args an object; a freeform tool's raw input becomes `{"input": ...}`), a tool result →
`{"functionResponse": {id, name, response: {"output"|"error": text}}}` (the name from the result,
else from its call, else `unknown`). Thinking is not replayed (Gemini's thought signatures are not
kept in the blocks). Ids are made strict by the pairing layer (`tool_id_mode = auto`). A message
with no wire content is left out; a request with nothing recorded before it is the bootstrap turn
alone. A block of a type Gemini has no form for (another provider's item, which the sanitize layer
converts or drops) is passed as recorded, for the validator to report. The model name is kept in
the body, like the other targets, though Gemini takes it from the URL.
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
from ctxreplay.pipeline.targets.wire import (
    Content,
    memo_content,
    merge_run,
    raw_item,
    result_text,
    shape_runs,
    tool_input_object,
)


def _call_name(msgs: list[LogicalMessage], i: int, call_id: str | None) -> str | None:
    """The name of the call `call_id` answered at message i: search back to the nearest assistant
    message holding it (pairing puts it right before the result)."""
    for k in range(i - 1, -1, -1):
        m = msgs[k]
        if m.role != "assistant":
            continue
        for r in m.rows:
            if r["block_type"] == "tool_use" and r.get("tool_use_id") == call_id:
                return r.get("tool_name")
        if any(r["block_type"] == "tool_use" for r in m.rows):
            return None
    return None


def _parts(msgs: list[LogicalMessage], i: int,
           sent: list[dict[str, Any]] | None = None) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(function responses, other parts) of message i; the rows they send are added to `sent`."""
    m = msgs[i]
    responses: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for g in group_blocks(m.rows):
        r = g[0]
        t = r["block_type"]
        before = len(responses) + len(parts)
        if t == "text":
            parts.append({"text": r.get("text") or ""})
        elif t == "image":
            parts.append({"inlineData": {"mimeType": r.get("image_media_type"), "data": r.get("image_data") or ""}})
        elif t == "tool_use" and m.role == "assistant":
            fc: dict[str, Any] = {"name": r.get("tool_name"), "args": tool_input_object(r)}
            if r.get("tool_use_id"):
                fc["id"] = r.get("tool_use_id")
            parts.append({"functionCall": fc})
        elif t == "tool_result":
            name = next((p.get("tool_name") for p in g if p.get("part_type") != "tool_reference"), None)
            name = (name or "").strip() or _call_name(msgs, i, r.get("tool_use_id")) or "unknown"
            key = "error" if r.get("is_error") else "output"
            fr: dict[str, Any] = {"name": name, "response": {key: result_text(g)}}
            if r.get("tool_use_id"):
                fr["id"] = r.get("tool_use_id")
            responses.append({"functionResponse": fr})
        elif t not in PORTABLE_BLOCK_TYPES:
            # no Gemini form (another provider's item): as recorded, for the validator to report
            parts.append(raw_item(r))
        if sent is not None and len(responses) + len(parts) > before:
            sent.extend(g)
    return responses, parts


def _message(msgs: list[LogicalMessage], j: int) -> tuple[str, list[Any], list[Any], list[Any]] | None:
    """Message j for merge_run: its role on the wire, its function responses (first in the turn)
    and its other parts."""
    rows: list[dict[str, Any]] = []
    fr, ps = _parts(msgs, j, rows)
    if not (fr or ps):
        return None
    return ("model" if msgs[j].role == "assistant" else "user"), fr, ps, rows


def _run(msgs: list[LogicalMessage], i: int, content: Content = _message) -> tuple[int, list[Any]]:
    """One turn: a run of messages of one role."""
    j, role, responses, parts, sent = merge_run(msgs, i, content)
    return j, [] if role is None else [Wire({"role": role, "parts": responses + parts}, sent)]


def _lead_in(msgs: list[LogicalMessage], i: int, items: list[Any]) -> Wire | None:
    """The first turn must be a user turn: a leading model turn gets the bootstrap turn before it.
    The leading turn is the one of the run at message 0 (the replay shapes the first wire message
    from label 0); Anthropic's `_lead_in` looks for wire content before i instead, which agrees for
    every start the replay passes."""
    if i == 0 and items[0]["role"] != "user":
        return Wire({"role": "user", "parts": [{"text": BOOTSTRAP}]})
    return None


class Gemini:
    name = "gemini"
    list_key = "contents"

    def splits_system(self) -> bool:
        return True

    def shape(self, msgs: list[LogicalMessage], start: int) -> list[tuple[int, dict[str, Any]]]:
        content = memo_content(_message)  # (one shape call: the messages do not change under it)
        return shape_runs(msgs, start, lambda m, i: _run(m, i, content), _lead_in)

    def empty_messages(self) -> list[dict[str, Any]]:
        """The stand-in for a request with no recorded message (a history that starts with the model's
        turn has nothing before its first call): the `(session bootstrap)` user turn."""
        return [{"role": "user", "parts": [{"text": BOOTSTRAP}]}]

    def envelope(self, model: str | None, system: list[LogicalMessage]) -> dict[str, Any]:
        env: dict[str, Any] = {"model": model}
        texts = [{"text": r.get("text") or ""} for m in system for r in m.rows
                 if r["block_type"] == "text" and (r.get("text") or "").strip()]
        if texts:
            env["systemInstruction"] = {"parts": texts}
        return env

    allow_prefill = True

    def context_key(self, msg: LogicalMessage) -> tuple[tuple[Any, Any], ...] | None:
        """A tool result without a name takes the name of the call it answers from an earlier
        model turn (`_call_name`): what later messages read of an assistant message."""
        if msg.role != "assistant":
            return None
        return tuple((r.get("tool_use_id"), r.get("tool_name")) for r in msg.rows if r["block_type"] == "tool_use") or None

    def validate(self, request: dict[str, Any], *, thread_key: str, call: int,
                 awaits_user: bool = False) -> list[Violation]:
        from ctxreplay.pipeline.targets.validate import validate_gemini

        return validate_gemini(request, thread_key=thread_key, call=call)


register(Gemini())
