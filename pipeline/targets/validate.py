"""Validators: the invariants a provider checks before it accepts a request (docs/layers.md).

One validator per target: `validate_anthropic`, `validate_openai_chat`, `validate_openai_responses`,
`validate_gemini`. Each takes an assembled request (the target's wire shape) and returns a list of
Violations naming thread, call, message and block, plus the rule (a short name) and a detail that
says what was found; an empty list means the provider would accept the request's structure.
`violation_decisions` turns violations into `violation` ledger rows (lenient mode).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

from ctxreplay.pipeline.core.constants import ANTHROPIC_TOOL_ID_PATTERN, TOOL_NAME_PATTERN
from ctxreplay.pipeline.targets import ANTHROPIC_RESULT_PART_TYPES, NATIVE_BLOCK_TYPES, Violation

TOOL_NAME = re.compile(TOOL_NAME_PATTERN)
ANTHROPIC_TOOL_ID = re.compile(ANTHROPIC_TOOL_ID_PATTERN)
GEMINI_FUNCTION_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_.:-]{0,63}$")
STRICT_ID = re.compile(r"^[A-Za-z0-9]{1,40}$")

# Anthropic image limits (the images layer enforces them: docs/layers.md)
ANTHROPIC_IMAGE_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")
ANTHROPIC_MAX_IMAGE_B64 = 5_242_880
ANTHROPIC_MAX_IMAGES = 100

# The block / item / part types each API takes (`unsupported_block_type` for any other): the
# portable shapes every target writes plus the provider's own (ctxreplay.pipeline.targets.NATIVE_BLOCK_TYPES).
ANTHROPIC_BLOCK_TYPES = frozenset({"text", "image", "thinking", "redacted_thinking", "tool_use", "tool_result"}) \
    | NATIVE_BLOCK_TYPES["anthropic"]
OPENAI_CHAT_PART_TYPES = {
    "user": frozenset({"text", "image_url", "input_audio", "file"}),
    "assistant": frozenset({"text", "refusal"}),
    "system": frozenset({"text"}), "developer": frozenset({"text"}), "tool": frozenset({"text"}),
}
RESPONSES_PART_TYPES = frozenset({"input_text", "input_image", "input_file", "input_audio", "output_text", "refusal"})
RESPONSES_ITEM_TYPES = frozenset({
    "message", "function_call", "function_call_output", "reasoning", "item_reference", "custom_tool_call",
    "custom_tool_call_output", "local_shell_call", "local_shell_call_output", "computer_call_output",
    "mcp_approval_response",
}) | (NATIVE_BLOCK_TYPES["openai_responses"] - RESPONSES_PART_TYPES)
GEMINI_PART_DATA = frozenset({"text", "inlineData", "fileData", "functionCall", "functionResponse", "executableCode",
                              "codeExecutionResult"})
GEMINI_PART_META = frozenset({"thought", "thoughtSignature", "videoMetadata"})

Bad = Callable[[int | None, int | None, str, str], None]


def _collector(thread_key: str, call: int) -> tuple[list[Violation], Bad]:
    out: list[Violation] = []

    def bad(m: int | None, b: int | None, rule: str, detail: str) -> None:
        out.append(Violation(thread_key, call, m, b, rule, detail))

    return out, bad


# ----------------------------------------------------------------------------- anthropic


def _anthropic_image(i: int, j: int, img: dict[str, Any], bad: Bad) -> None:
    src = img.get("source") or {}
    if src.get("type") != "base64":
        return
    mt = src.get("media_type")
    if mt not in ANTHROPIC_IMAGE_TYPES:
        bad(i, j, "image_media_type", f"image media type {mt!r} is not one of {', '.join(ANTHROPIC_IMAGE_TYPES)}")
    data = src.get("data") or ""
    if not data:
        bad(i, j, "image_empty", "image without data")
    elif len(data) > ANTHROPIC_MAX_IMAGE_B64:
        bad(i, j, "image_too_large", f"image base64 is {len(data):,} bytes, over {ANTHROPIC_MAX_IMAGE_B64:,}")


def validate_anthropic(request: dict[str, Any], *, thread_key: str, call: int,
                       allow_prefill: bool = False, awaits_user: bool = False) -> list[Violation]:
    """Anthropic Messages: alternating roles starting with user, every tool_use answered in the next
    message and every tool_result answering the previous one (results first), unique ids that match
    `^[a-zA-Z0-9_-]+$`, valid tool names and object inputs, no blank text, signed thinking, image
    limits, and no trailing assistant message unless prefill is allowed or the request awaits the
    user (`awaits_user`: a pending request that ends with the assistant's answer, what a resumed
    session carries; the user's next message follows it before it is sent)."""
    out, bad = _collector(thread_key, call)
    msgs = request.get("messages") or []
    if not msgs:
        bad(None, None, "messages_empty", "a request needs at least one message")
        return out
    if msgs[0].get("role") != "user":
        bad(0, None, "first_not_user", f"the first message has role {msgs[0].get('role')!r}, not 'user'")
    if not allow_prefill and not awaits_user and msgs[-1].get("role") == "assistant":
        bad(len(msgs) - 1, None, "trailing_assistant",
            "the request ends with an assistant message (a prefill), which the target does not allow")
    seen_ids: set[str] = set()
    images = 0
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
        result_ids: Counter[str] = Counter()
        for j, b in enumerate(content):
            t = b.get("type") if isinstance(b, dict) else None
            if t not in ANTHROPIC_BLOCK_TYPES:
                bad(i, j, "unsupported_block_type", f"content block type {t!r} is not one the Messages API takes")
                continue
            if t == "text" and not (b.get("text") or "").strip():
                bad(i, j, "empty_text", "text content blocks must contain non-whitespace text")
            if t in ("thinking", "redacted_thinking"):
                if role != "assistant":
                    bad(i, j, "thinking_in_user", "thinking outside an assistant message")
                if t == "thinking" and not (b.get("signature") or "").strip():
                    bad(i, j, "thinking_without_signature", "a thinking block needs its signature")
            if t == "image":
                images += 1
                _anthropic_image(i, j, b, bad)
            if t == "tool_use":
                if role != "assistant":
                    bad(i, j, "tool_use_in_user", "tool_use outside an assistant message")
                tid = b.get("id")
                if not tid:
                    bad(i, j, "tool_use_without_id", "tool_use has no id")
                elif not ANTHROPIC_TOOL_ID.match(str(tid)):
                    bad(i, j, "bad_tool_use_id", f"tool_use id {tid!r} does not match ^[a-zA-Z0-9_-]+$")
                if tid and tid in seen_ids:
                    bad(i, j, "duplicate_tool_use_id", f"tool_use id {tid} used twice in one request")
                seen_ids.add(tid or "")
                if not TOOL_NAME.match(str(b.get("name") or "")):
                    bad(i, j, "bad_tool_name", f"tool name {b.get('name')!r} does not match ^[a-zA-Z0-9_-]{{1,64}}$")
                if not isinstance(b.get("input"), dict):
                    bad(i, j, "tool_input_not_object", "tool_use input must be an object")
            if t == "tool_result":
                if role != "user":
                    bad(i, j, "tool_result_in_assistant", "tool_result outside a user message")
                rid = b.get("tool_use_id")
                result_ids[str(rid)] += 1
                if result_ids[str(rid)] == 2:
                    bad(i, j, "duplicate_tool_result", f"two tool_result blocks for {rid} in one message")
                for part in b.get("content") if isinstance(b.get("content"), list) else []:
                    pt = part.get("type") if isinstance(part, dict) else None
                    if pt not in ANTHROPIC_RESULT_PART_TYPES:
                        bad(i, j, "unsupported_block_type", f"tool_result content part type {pt!r} is not one the "
                            f"Messages API takes ({', '.join(sorted(ANTHROPIC_RESULT_PART_TYPES))})")
                    if pt == "image":
                        images += 1
                        _anthropic_image(i, j, part, bad)
        if role == "assistant":
            calls = [b.get("id") for b in content if b.get("type") == "tool_use"]
            if calls:
                nxt = msgs[i + 1] if i + 1 < len(msgs) else None
                answered = {b.get("tool_use_id") for b in (nxt or {}).get("content") or []
                            if isinstance(b, dict) and b.get("type") == "tool_result"}
                for cid in calls:
                    if cid not in answered:
                        bad(i, None, "tool_use_unanswered", f"tool_use {cid} has no tool_result in the next message")
        if role == "user":
            results = [(j, b.get("tool_use_id")) for j, b in enumerate(content) if b.get("type") == "tool_result"]
            if results:
                prev = msgs[i - 1] if i else None
                ids = {b.get("id") for b in (prev or {}).get("content") or []
                       if isinstance(b, dict) and b.get("type") == "tool_use"}
                for j, rid in results:
                    if rid not in ids:
                        bad(i, j, "tool_result_without_tool_use",
                            f"tool_result for {rid} has no tool_use in the previous message")
                first_other = next((j for j, b in enumerate(content) if b.get("type") != "tool_result"), None)
                if first_other is not None and any(j > first_other for j, _ in results):
                    bad(i, first_other, "tool_result_not_first", "tool_result blocks must come first in a user message")
    if images > ANTHROPIC_MAX_IMAGES:
        bad(None, None, "too_many_images", f"{images} images in one request, over {ANTHROPIC_MAX_IMAGES}")
    return out


# ----------------------------------------------------------------------------- openai chat


def validate_openai_chat(request: dict[str, Any], *, thread_key: str, call: int) -> list[Violation]:
    """OpenAI Chat Completions: every assistant `tool_calls` entry answered by its own `tool` message
    right after the assistant message (before any other message), no `tool` message without a
    preceding call, valid ids, names and string arguments, no empty user/system content."""
    out, bad = _collector(thread_key, call)
    msgs = request.get("messages") or []
    if not msgs:
        bad(None, None, "messages_empty", "a request needs at least one message")
        return out
    open_calls: list[str] = []
    open_from: int | None = None
    for i, m in enumerate(msgs):
        role = m.get("role")
        if isinstance(m.get("content"), list) and role in OPENAI_CHAT_PART_TYPES:
            for j, part in enumerate(m["content"]):
                pt = part.get("type") if isinstance(part, dict) else None
                if pt not in OPENAI_CHAT_PART_TYPES[role]:
                    bad(i, j, "unsupported_block_type", f"content part type {pt!r} in a {role} message (takes "
                        f"{', '.join(sorted(OPENAI_CHAT_PART_TYPES[role]))})")
        if role == "tool":
            cid = m.get("tool_call_id")
            if cid in open_calls:
                open_calls.remove(cid)
            else:
                bad(i, None, "tool_without_call", f"tool message for {cid} does not follow an assistant tool call")
            if not isinstance(m.get("content"), (str, list)):
                bad(i, None, "tool_content_missing", "tool message without content")
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
                fn = tc.get("function") or {}
                if not TOOL_NAME.match(str(fn.get("name") or "")):
                    bad(i, j, "bad_tool_name", f"function name {fn.get('name')!r} is not valid")
                if not isinstance(fn.get("arguments"), str):
                    bad(i, j, "arguments_not_string", "function arguments must be a JSON string")
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
    if open_calls:
        bad(open_from, None, "tool_call_unanswered",
            f"the request ends with unanswered tool call(s) {', '.join(map(str, open_calls))}")
    return out


# ----------------------------------------------------------------------------- openai responses


def validate_openai_responses(request: dict[str, Any], *, thread_key: str, call: int) -> list[Violation]:
    """OpenAI Responses: every function_call has exactly one function_call_output after it and every
    output has an earlier call ("No tool output found for function call"); call ids unique; a
    reasoning item is followed by another item of the same response (not a user message or an
    output); messages have a known role and content."""
    out, bad = _collector(thread_key, call)
    items = request.get("input") or []
    if not items:
        bad(None, None, "input_empty", "a request needs at least one input item")
        return out
    calls: dict[str, int] = {}
    outputs: Counter[str] = Counter()
    for i, it in enumerate(items):
        t = it.get("type")
        if t == "message":
            role = it.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                bad(i, None, "bad_role", f"role {role!r}")
            c = it.get("content")
            if not c:
                bad(i, None, "empty_content", f"{role} message with empty content")
            elif isinstance(c, list):
                for j, part in enumerate(c):
                    want = ("output_text", "refusal") if role == "assistant" else ("input_text", "input_image", "input_file")
                    pt = part.get("type") if isinstance(part, dict) else None
                    if pt not in RESPONSES_PART_TYPES:
                        bad(i, j, "unsupported_block_type", f"content part type {pt!r} is not one the Responses API takes")
                    elif pt not in want:
                        bad(i, j, "bad_content_type", f"{pt!r} in a {role} message")
        elif t == "function_call":
            cid = it.get("call_id")
            if not cid:
                bad(i, None, "function_call_without_id", "function_call has no call_id")
            elif cid in calls:
                bad(i, None, "duplicate_call_id", f"call_id {cid} used by two function calls")
            else:
                calls[cid] = i
            if not TOOL_NAME.match(str(it.get("name") or "")):
                bad(i, None, "bad_tool_name", f"function name {it.get('name')!r} is not valid")
            if not isinstance(it.get("arguments"), str):
                bad(i, None, "arguments_not_string", "function_call arguments must be a JSON string")
        elif t == "function_call_output":
            cid = it.get("call_id")
            if cid not in calls:
                bad(i, None, "output_without_call", f"function_call_output for {cid} has no earlier function_call")
            outputs[str(cid)] += 1
            if outputs[str(cid)] == 2:
                bad(i, None, "duplicate_output", f"two function_call_output items for {cid}")
            if not isinstance(it.get("output"), (str, list)):
                bad(i, None, "output_missing", "function_call_output without output")
        elif t == "reasoning":
            nxt = items[i + 1] if i + 1 < len(items) else None
            if nxt is None or nxt.get("type") == "function_call_output" or \
                    (nxt.get("type") == "message" and nxt.get("role") != "assistant"):
                bad(i, None, "reasoning_not_followed",
                    "a reasoning item must be followed by another item of the same response")
        elif t not in RESPONSES_ITEM_TYPES:
            bad(i, None, "unsupported_block_type", f"input item type {t!r} is not one the Responses API takes")
    for cid, i in calls.items():
        if not outputs.get(cid):
            bad(i, None, "function_call_unanswered", f"No tool output found for function call {cid}")
    return out


# ----------------------------------------------------------------------------- gemini


def validate_gemini(request: dict[str, Any], *, thread_key: str, call: int) -> list[Violation]:
    """Gemini generateContent: the first content is a user turn, roles alternate user/model, parts
    are not empty; a function-call turn follows a user or function-response turn and is answered by
    the next turn with as many function responses (same names, same ids); a function-response turn
    follows a function-call turn; call ids are strict (`[A-Za-z0-9]`, at most 40)."""
    out, bad = _collector(thread_key, call)
    contents = request.get("contents") or []
    if not contents:
        bad(None, None, "contents_empty", "a request needs at least one content")
        return out
    if contents[0].get("role") != "user":
        bad(0, None, "first_not_user", f"the first content has role {contents[0].get('role')!r}, not 'user'")

    def calls_of(c: dict[str, Any]) -> list[dict[str, Any]]:
        return [p["functionCall"] for p in c.get("parts") or [] if isinstance(p, dict) and "functionCall" in p]

    def responses_of(c: dict[str, Any]) -> list[dict[str, Any]]:
        return [p["functionResponse"] for p in c.get("parts") or [] if isinstance(p, dict) and "functionResponse" in p]

    for i, c in enumerate(contents):
        role = c.get("role")
        parts = c.get("parts")
        if role not in ("user", "model"):
            bad(i, None, "bad_role", f"role {role!r}")
        if i and contents[i - 1].get("role") == role:
            bad(i, None, "roles_not_alternating", f"two {role} turns in a row")
        if not parts:
            bad(i, None, "empty_parts", "a content needs at least one part")
            continue
        for j, p in enumerate(parts):
            keys = set(p) if isinstance(p, dict) else set()
            data = keys & GEMINI_PART_DATA
            if len(data) != 1 or keys - GEMINI_PART_DATA - GEMINI_PART_META:
                bad(i, j, "unsupported_block_type", f"a part needs exactly one of {', '.join(sorted(GEMINI_PART_DATA))}; "
                    f"got keys {', '.join(sorted(map(str, keys))) or 'none'}")
                continue
            if "text" in p and not p.get("text"):
                bad(i, j, "empty_text", "empty text part")
            for key in ("functionCall", "functionResponse"):
                if key in p:
                    f = p[key] or {}
                    if not GEMINI_FUNCTION_NAME.match(str(f.get("name") or "")):
                        bad(i, j, "bad_function_name", f"{key} name {f.get('name')!r} is not valid")
                    if f.get("id") is not None and not STRICT_ID.match(str(f.get("id"))):
                        bad(i, j, "bad_call_id", f"{key} id {f.get('id')!r} is not strict ([A-Za-z0-9], at most 40)")
                    if key == "functionCall" and role != "model":
                        bad(i, j, "call_in_user_turn", "functionCall outside a model turn")
                    if key == "functionResponse" and role != "user":
                        bad(i, j, "response_in_model_turn", "functionResponse outside a user turn")
        fcs = calls_of(c)
        if fcs:
            if i == 0 or contents[i - 1].get("role") != "user":
                bad(i, None, "call_turn_position", "a function-call turn must follow a user or function-response turn")
            nxt = contents[i + 1] if i + 1 < len(contents) else None
            frs = responses_of(nxt) if nxt is not None else []
            if nxt is None:
                bad(i, None, "function_call_unanswered", f"the request ends with {len(fcs)} unanswered function call(s)")
            elif len(frs) != len(fcs):
                bad(i + 1, None, "response_count_mismatch",
                    f"{len(fcs)} function call(s) answered by {len(frs)} function response(s)")
            else:
                if sorted(str(f.get("name")) for f in fcs) != sorted(str(f.get("name")) for f in frs):
                    bad(i + 1, None, "response_name_mismatch", "function response names differ from the call names")
                if any(f.get("id") is not None for f in fcs) and \
                        sorted(str(f.get("id")) for f in fcs) != sorted(str(f.get("id")) for f in frs):
                    bad(i + 1, None, "response_id_mismatch", "function response ids differ from the call ids")
        if responses_of(c) and (i == 0 or not calls_of(contents[i - 1])):
            bad(i, None, "response_without_call", "a function-response turn must follow a function-call turn")
    return out


# ----------------------------------------------------------------------------- ledger rows


def violation_decisions(violations: Iterable[Violation], keys: dict[str, tuple[str, str]]) -> list[dict[str, Any]]:
    """`violation` decision rows (STAGE_DECISION columns) for lenient mode.

    `keys` maps a thread key to its (session_id, thread_id). A violation names a wire message, not
    a block of the blocks table, so the row's `entry_id` is `wire:<message>` and `block_pos` the
    block within it (-1 when the whole message or request is meant); `reason` is the rule and
    `replacement` the detail.
    """
    rows = []
    for v in violations:
        sid, tid = keys.get(v.thread_key, (v.thread_key, "main"))
        rows.append({
            "session_id": sid, "thread_id": tid,
            "entry_id": "wire:" + ("request" if v.message is None else str(v.message)),
            "block_pos": -1 if v.block is None else v.block, "part_pos": 0, "tool_use_id": None,
            "from_call": v.call, "action": "violation", "reason": v.rule,
            "before_sha256": None, "after_sha256": None, "before_len": None, "after_len": None,
            "replacement": v.detail, "cache_epoch": 0,
        })
    return rows
