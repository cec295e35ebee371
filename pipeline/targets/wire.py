"""What the targets share (not a target itself: the name starts with `_`): the loop of `shape`,
the labels of wire messages, and the wire forms of a few row kinds.

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
from collections.abc import Callable, Sequence
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


Run = Callable[[Sequence[Any], int], tuple[int, list[Any]]]
LeadIn = Callable[[Sequence[Any], int, list[Any]], Any]


def shape_runs(msgs: Sequence[Any], start: float, run: Run, lead_in: LeadIn | None = None) -> list[tuple[Any, Any]]:
    """The loop of every target's `shape(msgs, start)`: from the label `start`, cut the logical
    messages into runs and label the wire messages each run makes.

    `run(msgs, i)` -> `(j, items)`: the run of logical messages [i, j) (j > i) and its wire messages
    (none when it has no wire content). What a run is, is the target's: one message (OpenAI
    Responses), one message or a run of tool-result messages (OpenAI chat), adjacent messages of
    one wire role (Anthropic, Gemini: `merge_run`).
    `lead_in(msgs, i, items)` -> a wire message or None: asked for the first run that makes wire
    messages in this call, a message to put before them (the bootstrap user turn of the APIs that
    want a user turn first; each target says when its history needs one).

    The k-th wire message of a run that starts at i is labelled `label(i, k)`; those of the run
    `start` points into are skipped up to its sub-index. A run without wire messages gives its
    label to the next wire message (its messages belong to that one: re-shaping from that label
    shapes them again)."""
    out: list[tuple[Any, Any]] = []
    i, skip = split(start)
    i0, n = i, len(msgs)
    pending: int | None = None  # first of the messages just left out (no wire content)
    while i < n:
        j, items = run(msgs, i)
        if items and lead_in is not None and not out:
            first = lead_in(msgs, i, items)
            if first is not None:
                items = [first, *items]
        if not items and pending is None:
            pending = i
        for k, item in enumerate(items):
            if not (i == i0 and k < skip):
                out.append((pending if k == 0 and pending is not None else label(i, k), item))
        if items:
            pending = None
        i = j
    return out


Content = Callable[[Sequence[Any], int], "tuple[str, list[Any], list[Any], list[Any]] | None"]


def memo_content(content: Content) -> Content:
    """`content` remembered by message index, for ONE `shape` call (one list of messages): merge_run
    computes the message that ends a run (another wire role) and the next run starts with it, so
    without this every message's wire blocks would be made twice."""
    memo: dict[int, Any] = {}

    def get(msgs: Sequence[Any], j: int) -> Any:
        if j in memo:
            return memo[j]
        c = memo[j] = content(msgs, j)
        return c

    return get


def merge_run(msgs: Sequence[Any], i: int,
              content: Content) -> tuple[int, str | None, list[Any], list[Any], list[Any]]:
    """The run from logical message i of the targets that merge adjacent messages of one wire role
    (Anthropic, Gemini): `content(msgs, j)` -> `(wire role, lead, rest, rows)`, or None for a
    message without wire content, which belongs to the run it sits in (or starts the next one).
    Returns `(j, role, lead, rest, rows)`: the run is [i, j); its wire message holds every
    message's `lead` parts first (the tool results), then their `rest`, and sends `rows`; role None:
    nothing up to the end has wire content."""
    role: str | None = None
    lead: list[Any] = []
    rest: list[Any] = []
    sent: list[Any] = []
    j, n = i, len(msgs)
    while j < n:
        c = content(msgs, j)
        if c is not None:
            r, first, other, rows = c
            if role is None:
                role = r
            elif r != role:
                break
            lead.extend(first)
            rest.extend(other)
            sent.extend(rows)
        j += 1
    return j, role, lead, rest, sent


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
