"""OpenAI Responses: {"input": [items], "instructions": ..., "model": ...}.

Each block becomes one input item (layer-semantics §10): user text and images → one `message`
item (`input_text` / `input_image`); assistant text → a `message` item with `output_text`; a tool
call → a `function_call` item (`call_id`, `name`, `arguments` as a JSON string); a tool result → a
`function_call_output` item (`output` as text, images as `[image]`). System messages go to
`instructions`, except those recorded as input items (a Codex developer message, extra `role`),
which stay `developer` (or `system`) message items where they were, as Codex CLI sends them. Reasoning is not replayed: a reasoning item's encrypted content belongs to the
response and model that produced it (it must be followed by an item of that same response, and is
dropped on a model switch), and the blocks keep neither its item id nor its response, so leaving it
out is the only shape the API is sure to accept. A refusal is an assistant `refusal` part; the API's
hosted-tool items (`web_search_call`, `image_generation_call`, ...) recorded by a Responses client go
back as they were recorded; a block of another provider's type (which the sanitize layer converts
or drops) is passed as recorded, for the validator to report. A message with no wire content is
left out; a request with nothing recorded before it is a `(session bootstrap)` user message.
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
    recorded_role,
    register,
)
from ctxreplay.pipeline.targets.wire import image_data_url, raw_item, result_text, shape_runs


def _input_part(r: dict[str, Any]) -> dict[str, Any] | None:
    t = r["block_type"]
    if t == "image":
        return {"type": "input_image",
                "image_url": image_data_url(r)}
    if t in ("empty", "thinking", "redacted_thinking", "tool_use", "tool_result"):
        return None
    if t == "text":
        return {"type": "input_text", "text": r.get("text") or ""}
    return raw_item(r)  # a file part as recorded; another provider's item for the validator to report


def message_items(m: LogicalMessage) -> list[dict[str, Any]]:
    """The input items of one logical message, in block order."""
    items: list[dict[str, Any]] = []
    groups = group_blocks(m.rows)
    if m.role == "assistant":
        text: list[dict[str, Any]] = []  # rows
        refusals: list[dict[str, Any]] = []  # rows

        def flush() -> None:
            if text or refusals:
                content = ([{"type": "output_text", "text": "".join(r.get("text") or "" for r in text)}] if text else []) \
                    + [{"type": "refusal", "refusal": r.get("text") or ""} for r in refusals]
                items.append(Wire({"type": "message", "role": "assistant", "content": content}, text + refusals))
                text.clear()
                refusals.clear()

        for g in groups:
            r = g[0]
            t = r["block_type"]
            if t == "text":
                text.append(r)
            elif t == "refusal":
                refusals.append(r)
            elif t == "tool_use":
                flush()
                items.append(Wire({"type": "function_call", "call_id": r.get("tool_use_id"), "name": r.get("tool_name"),
                                   "arguments": r.get("tool_input") or "{}"}, [r]))
            elif t not in PORTABLE_BLOCK_TYPES:
                # a hosted-tool item (web_search_call, ...) as the API returned it; another
                # provider's item as recorded, for the validator to report
                flush()
                items.append(Wire(raw_item(r), [r]))
        flush()
        return items
    parts: list[dict[str, Any]] = []
    part_rows: list[dict[str, Any]] = []
    for g in groups:
        if g[0]["block_type"] == "tool_result":
            items.append(Wire({"type": "function_call_output", "call_id": g[0].get("tool_use_id"),
                               "output": result_text(g)}, g))
        elif (p := _input_part(g[0])) is not None:
            parts.append(p)
            part_rows.append(g[0])
    if parts:
        role = (recorded_role(m.rows[0]) or "developer") if m.role == "system" else "user"
        items.append(Wire({"type": "message", "role": role, "content": parts}, part_rows))
    return items


def _run(msgs: list[LogicalMessage], i: int) -> tuple[int, list[Any]]:
    return i + 1, message_items(msgs[i])


class OpenAIResponses:
    name = "openai-responses"
    list_key = "input"

    def splits_system(self) -> bool:
        return True

    def keeps_in_list(self, row: dict[str, Any]) -> bool:
        """A system row recorded as a message of the input list (a Codex developer item, an OpenAI
        chat developer message) stays an input item where it was: Codex CLI sends its base
        instructions as `instructions` and every developer message (sandbox policy, collaboration
        mode, model switch notes) as a `developer` input item in the history."""
        return recorded_role(row) in ("developer", "system")

    def shape(self, msgs: list[LogicalMessage], start: int) -> list[tuple[int, dict[str, Any]]]:
        # each message on its own; no lead-in: the API takes a history that starts with the assistant
        return shape_runs(msgs, start, _run)

    def empty_messages(self) -> list[dict[str, Any]]:
        """The stand-in for a request with no recorded message (a history that starts with the
        assistant has nothing before its first call): the `(session bootstrap)` user message."""
        return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": BOOTSTRAP}]}]

    def envelope(self, model: str | None, system: list[LogicalMessage]) -> dict[str, Any]:
        env: dict[str, Any] = {"model": model}
        text = "\n\n".join(r.get("text") or "" for m in system for r in m.rows if r["block_type"] == "text")
        if text:
            env["instructions"] = text
        return env

    allow_prefill = True

    def validate(self, request: dict[str, Any], *, thread_key: str, call: int,
                 awaits_user: bool = False) -> list[Violation]:
        from ctxreplay.pipeline.targets.validate import validate_openai_responses

        return validate_openai_responses(request, thread_key=thread_key, call=call)


register(OpenAIResponses())
