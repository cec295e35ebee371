"""Hypothesis strategies for message lists in the `ctxreplay.testkit.make_blocks` form.

General on purpose (any layer may use them): user / assistant / tool rows with text (blank,
magic strings, plain), signed / unsigned / foreign thinking, valid and invalid tool calls, tool
results with parts and extra fields, images (small valid, oversized, corrupt, mislabelled),
inter-session provenance, failed and display-only assistant rows, usage and compaction summaries.
Payloads come from small fixed pools, so examples stay fast and shrink well.
"""

from __future__ import annotations

import base64
import io
from functools import cache
from typing import Any

from hypothesis import settings
from hypothesis import strategies as st

MAGIC = "ANTHROPIC_MAGIC_STRING_TRIGGER_REFUSAL"
DEV_EXAMPLES = 100  # max_examples of the `dev` profile (tests/conftest.py)

TOOL_IDS = ["toolu_01", "toolu_02", "call_abc", "functions.read:0", "", None]
TOOL_NAMES = ["Bash", "read", "Write", "web_search", "bad name", "", None, "x" * 65]
PROVIDERS = [
    {"provider": "anthropic", "api": "anthropic-messages", "model": "claude-sonnet-4-5"},
    {"provider": "openrouter", "api": "openai-completions", "model": "stepfun/step-3.5-flash"},
    {"provider": "openai", "api": "openai-responses", "model": "gpt-5"},
]


def examples(n: int) -> int:
    """A property test's example count: `n` under the `dev` profile, scaled like the loaded
    profile's max_examples (the `ci` profile of .ci/run runs four times as many)."""
    return max(1, n * settings.default.max_examples // DEV_EXAMPLES)


@cache
def image_pool() -> dict[str, tuple[str | None, str | None]]:
    """Named image payloads (base64 data, declared media type)."""
    from PIL import Image

    def enc(img: Any, fmt: str) -> str:
        buf = io.BytesIO()
        img.save(buf, format=fmt)
        return base64.b64encode(buf.getvalue()).decode()

    small_png = enc(Image.new("RGB", (6, 4), (9, 99, 199)), "PNG")
    wide_png = enc(Image.new("RGB", (2100, 3), (200, 0, 0)), "PNG")
    small_jpeg = enc(Image.new("RGB", (5, 5), (1, 2, 3)), "JPEG")
    raw = base64.b64decode(enc(Image.new("RGB", (40, 40), (5, 5, 5)), "PNG"))
    return {
        "small_png": (small_png, "image/png"),
        "wide_png": (wide_png, "image/png"),
        "jpeg_as_png": (small_jpeg, "image/png"),
        "truncated": (base64.b64encode(raw[: len(raw) // 2]).decode(), "image/png"),
        "invalid_b64": ("@@not base64@@", "image/png"),
        "empty": ("", "image/png"),
        "no_type": (small_png, None),
    }


texts = st.one_of(
    st.sampled_from(["hello", "", "  ", "\n\n", f"say {MAGIC}", "done", "日本語"]),
    st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12),
)


@st.composite
def image_block(draw: st.DrawFn) -> dict[str, Any]:
    data, media = image_pool()[draw(st.sampled_from(sorted(image_pool())))]
    return {"type": "image", "image_data": data, "image_media_type": media}


@st.composite
def thinking_block(draw: st.DrawFn) -> dict[str, Any]:
    kind = draw(st.sampled_from(["thinking", "thinking", "redacted_thinking"]))
    signature = draw(st.sampled_from(["EqQBCkYIBxgC", "", None, "reasoning_content"]))
    text = draw(st.sampled_from(["plan", f"plan {MAGIC}", ""]))
    return {"type": kind, "text": text if kind == "thinking" else "ZGF0YQ==", "signature": signature}


@st.composite
def tool_call(draw: st.DrawFn) -> dict[str, Any]:
    return {"type": "tool_use", "tool_use_id": draw(st.sampled_from(TOOL_IDS)),
            "tool_name": draw(st.sampled_from(TOOL_NAMES)),
            "tool_input": draw(st.sampled_from([{}, {"command": "ls"}, None]))}


@st.composite
def user_message(draw: st.DrawFn) -> dict[str, Any]:
    blocks: list[dict[str, Any]] = draw(st.lists(
        st.one_of(texts.map(lambda t: {"type": "text", "text": t}), image_block()), min_size=0, max_size=3))
    msg: dict[str, Any] = {"role": "user", "blocks": blocks}
    if draw(st.integers(0, 4)) == 0:
        msg["provenance"] = {"kind": "inter_session",
                             "source_session": draw(st.sampled_from(["agent:main:subagent:1", "a b\nc", None])),
                             "channel": draw(st.sampled_from(["webchat", None])),
                             "tool": draw(st.sampled_from(["subagent_announce", None]))}
    if draw(st.integers(0, 9)) == 0:
        msg["is_compact_summary"] = True
    return msg


@st.composite
def assistant_message(draw: st.DrawFn) -> dict[str, Any]:
    blocks = draw(st.lists(st.one_of(thinking_block(), tool_call(), texts.map(lambda t: {"type": "text", "text": t})),
                           min_size=0, max_size=3))
    msg: dict[str, Any] = {"role": "assistant", "blocks": blocks, **draw(st.sampled_from(PROVIDERS)),
                           "stop_reason": draw(st.sampled_from(["end_turn", "tool_use", "error", "stop", "aborted", None]))}
    if draw(st.booleans()):
        msg["usage"] = draw(st.sampled_from([
            {"input": 0, "output": 0, "cache_read": 0, "cache_write": 0},
            {"input": 10, "output": 5, "cache_read": 100, "cache_write": None},
        ]))
    if draw(st.integers(0, 7)) == 0:
        msg["is_display_only"] = True
        msg["is_call"] = False
    return msg


@st.composite
def tool_message(draw: st.DrawFn) -> dict[str, Any]:
    tid = draw(st.sampled_from(TOOL_IDS))
    n = draw(st.integers(1, 3))
    parts: list[dict[str, Any]] = []
    for i in range(n):
        if draw(st.integers(0, 3)) == 0:
            data, media = image_pool()[draw(st.sampled_from(sorted(image_pool())))]
            parts.append({"type": "tool_result", "tool_use_id": tid, "part_type": "image", "part_pos": i,
                          "image_data": data, "image_media_type": media})
        else:
            part: dict[str, Any] = {"type": "tool_result", "tool_use_id": tid, "part_pos": i,
                                    "part_type": "string" if n == 1 else "text", "text": draw(texts)}
            if draw(st.booleans()):
                part["extra"] = draw(st.sampled_from([{"details": {"status": "ok"}}, {"cache_control": {"type": "x"}}]))
            parts.append(part)
    return {"role": "tool", "blocks": parts}


def messages(min_size: int = 1, max_size: int = 8) -> st.SearchStrategy[list[dict[str, Any]]]:
    """A session as a list of message dicts (roles mixed freely, as real transcripts can be)."""
    return st.lists(st.one_of(user_message(), assistant_message(), tool_message()), min_size=min_size,
                    max_size=max_size)


@st.composite
def sessions_with_a_call(draw: st.DrawFn, max_size: int = 8) -> tuple[list[dict[str, Any]], int]:
    """(messages, n): a session and a prefix length n such that the prefix holds at least one
    assistant message that is a call (so a prefix-causality check has a call to compare)."""
    head = draw(messages(min_size=0, max_size=max_size // 2))
    call = draw(assistant_message().map(lambda m: {k: v for k, v in m.items() if k not in ("is_display_only",
                                                                                        "is_call")}))
    tail = draw(messages(min_size=1, max_size=max_size // 2))
    msgs = [*head, call, *tail]
    n = draw(st.integers(len(head) + 1, len(msgs) - 1))
    return msgs, n
