"""Labels for wire messages, shared by the targets (not a target itself: the name starts with `_`).

The replay keeps, with every wire message, the index of the first logical message it holds, and
re-shapes a changed tail from the wire message whose label is the latest one <= the logical index
before the change (`bisect_right(labels, a) - 1`). A target that turns ONE logical message into
SEVERAL wire messages (OpenAI chat: one `tool` message per result; OpenAI Responses: one item per
block; Gemini: the bootstrap turn before a leading model turn) must not give them all the same
label, or the replay would keep the first ones and re-emit them again. Such a target labels the
k-th extra wire message of logical message i with `i + k / 2**20` and, asked to shape from such a
fractional start, resumes with the k-th wire message of message i. Whole-number labels keep their
plain meaning; the replay only compares labels and hands them back to `shape`.
"""

from __future__ import annotations

import math
from typing import Any

import orjson

from ctxreplay.pipeline.core.constants import DATA_URL_BASE64

SUB = float(1 << 20)


def label(index: int, sub: int) -> float:
    """The label of the `sub`-th wire message (0-based) made from logical message `index`."""
    return index if sub == 0 else index + sub / SUB


def split(start: float) -> tuple[int, int]:
    """(logical index, wire messages of it to skip) for a label handed back by the replay."""
    i = math.floor(start)
    return i, round((start - i) * SUB)


def result_text(parts: list[dict[str, Any]]) -> str:
    """A tool result's parts as one text, for wire shapes whose results are plain strings."""
    out = []
    for p in parts:
        if p.get("part_type") == "image":
            out.append("[image]")
        elif p.get("part_type") == "tool_reference":
            out.append(f"[tool reference: {p.get('tool_name')}]")
        elif p.get("text") is not None:
            out.append(p["text"])
    return "\n".join(out)


def image_data_url(r: dict[str, Any]) -> str:
    """An image row as the base64 `data:` URL the OpenAI shapes send."""
    return DATA_URL_BASE64.format(media_type=r.get("image_media_type"), data=r.get("image_data") or "")


def tool_input_object(r: dict[str, Any]) -> Any:
    """A row's tool input as the object providers take; a freeform tool's raw input is wrapped as
    `{"input": <value>}`."""
    t = r.get("tool_input")
    if t is None:
        return {}
    try:
        v = orjson.loads(t)
    except orjson.JSONDecodeError:
        v = t
    return v if isinstance(v, dict) else {"input": v}


def raw_item(r: dict[str, Any]) -> dict[str, Any]:
    """A block the target has no wire form for, as it was recorded (its raw object, kept in
    extra_json, when that names its type; else its block type and text), so the request shows it
    and the target's validator reports it (`unsupported_block_type`)."""
    e = r.get("extra_json")
    if e:
        try:
            v = orjson.loads(e)
        except orjson.JSONDecodeError:
            v = None
        if isinstance(v, dict) and v.get("type"):
            return v
    out: dict[str, Any] = {"type": r.get("block_type")}
    if r.get("text") is not None:
        out["text"] = r.get("text")
    return out
