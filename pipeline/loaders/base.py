"""What every loader produces, and the shared machinery: line reading, accounting, blocks building.

A loader turns files into `Thread`s (ordered `Message`s) plus a `FileLoad` per file that accounts
for every non-blank physical line: message line, other line (by kind), or quarantined line.
`threads_to_blocks` turns threads into the blocks table, with the call structure
(`is_call`, `first_call`, `last_call`) computed from message order and recorded compactions.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa

from pipeline.blockops import canonical_json, content_sha256
from schemas.blocks import BLOCKS

ORDER_STRIDE = 1024  # order_key = position * ORDER_STRIDE leaves room for inserted rows


@dataclass
class QuarantineRow:
    file: str
    line: int
    raw: str
    reason: str


@dataclass
class FileLoad:
    """Accounting for one input file."""

    path: str
    format: str
    sha256: str = ""
    bytes: int = 0
    lines: int = 0  # non-blank physical lines
    message_lines: int = 0
    other_lines: Counter[str] = field(default_factory=Counter)  # by kind
    quarantine: list[QuarantineRow] = field(default_factory=list)
    recovered: list[dict[str, Any]] = field(default_factory=list)  # e.g. two objects on one line

    @property
    def quarantined_lines(self) -> int:
        return len({q.line for q in self.quarantine})

    def check(self) -> None:
        total = self.message_lines + sum(self.other_lines.values()) + self.quarantined_lines
        if total != self.lines:
            from pipeline.errors import CheckFailed

            msg = (f"{self.path}: line accounting failed: {self.message_lines} message + "
                   f"{sum(self.other_lines.values())} other + {self.quarantined_lines} quarantined "
                   f"!= {self.lines} lines; this is a bug in ctxreplay's {self.format} loader")
            raise CheckFailed(msg)

    def account(self, line_no: int, raw: str, kinds: list[str]) -> None:
        """Count one physical line from the kinds of the objects on it.

        A kind starting with '!' is an object not understood (the rest is the reason). A line with
        no understood object is quarantined; otherwise it is a message line when any object on it
        is a message, else an other line of its first kind; objects lost beside understood ones
        are noted in `recovered`.
        """
        bad = [k for k in kinds if k.startswith("!")]
        good = [k for k in kinds if not k.startswith("!")]
        if not good:
            self.quarantine.append(QuarantineRow(self.path, line_no, raw, bad[0][1:] if bad else "empty line"))
            return
        if "message" in good:
            self.message_lines += 1
        else:
            self.other_lines[good[0]] += 1
        if bad:
            self.recovered.append({"file": self.path, "line": line_no,
                                   "note": f"{len(bad)} of {len(kinds)} objects on this line not understood: "
                                           f"{bad[0][1:]}"})


@dataclass
class Block:
    """One content block (or one part of a tool_result's content)."""

    block_type: str  # text | thinking | redacted_thinking | tool_use | tool_result | image | document | ...
    text: str | None = None
    signature: str | None = None
    tool_use_id: str | None = None
    tool_name: str | None = None
    tool_input: str | None = None  # canonical JSON text
    is_error: bool | None = None
    part_type: str | None = None  # tool_result parts: string | text | image | tool_reference | empty
    part_pos: int = 0
    image_media_type: str | None = None
    image_data: str | None = None
    extra: dict[str, Any] | None = None  # other keys of the block, kept


@dataclass
class Message:
    """One logical message (all blocks of one model response, or one user/tool/system message)."""

    entry_id: str
    role: str  # system | user | assistant | tool
    blocks: list[Block]
    source_file: str
    source_line: int
    raw_line: str
    parent_id: str | None = None
    msg_key: str | None = None  # defaults to entry_id
    message_id: str | None = None
    request_id: str | None = None
    timestamp: datetime | None = None
    model: str | None = None
    provider: str | None = None
    api: str | None = None
    stop_reason: str | None = None
    usage: dict[str, int | None] | None = None  # input, output, cache_read, cache_write, cache_write_5m, cache_write_1h
    is_call: bool | None = None  # None: assistant messages are calls
    # a recorded request on this thread's path that an earlier thread reports (a branch's shared
    # history): a call of this thread for numbering and the stages' state, not reported here
    inherited: bool = False
    is_sidechain: bool = False
    is_meta: bool = False
    is_compact_summary: bool = False
    is_display_only: bool = False
    provenance: dict[str, str | None] | None = None  # kind, source_session, channel, tool
    visible_from: int | None = None  # position (in the thread) from which calls see it; default its own
    # per-block source lines when a message spans several physical lines (Claude Code split messages)
    block_lines: list[tuple[str, int, str, str]] | None = None  # (entry_id, line, raw, file) per block


@dataclass
class Compaction:
    """From the first call that starts after position `at`, messages before `keep_from` are gone."""

    at: int
    keep_from: int


@dataclass
class Thread:
    session_id: str
    thread_id: str
    source_format: str
    source_file: str
    messages: list[Message]
    compactions: list[Compaction] = field(default_factory=list)


# ---------------------------------------------------------------- line reading

_decoder = json.JSONDecoder()


def read_nonblank_lines(path: Path, data: bytes | None = None) -> tuple[bytes, list[tuple[int, str]]]:
    """A file's bytes (read unless given) and its non-blank physical lines.

    Lines are (1-based line number, text without its line break), decoded as UTF-8 with
    undecodable bytes kept as surrogates, so every line can be quarantined exactly as it is.
    """
    if data is None:
        data = path.read_bytes()
    text = data.decode("utf-8", errors="surrogateescape")
    lines = [(i, line) for i, raw in enumerate(text.split("\n"), start=1) if (line := raw.rstrip("\r")).strip()]
    return data, lines


def file_load(path: Path, fmt: str, data: bytes, lines: int) -> FileLoad:
    """A file's accounting record, with its size and sha256 taken from its bytes."""
    return FileLoad(str(path), fmt, sha256=hashlib.sha256(data).hexdigest(), bytes=len(data), lines=lines)


def iter_json_lines(path: Path, load: FileLoad) -> Iterator[tuple[int, str, list[Any]]]:
    """Yield (line number, raw line, parsed objects) for every non-blank physical line.

    A line that holds several JSON values back to back yields them all (recorded in
    `load.recovered`). A line that cannot be parsed at all is quarantined and not yielded; a line
    with a parsable head and garbage after it yields the head and quarantines nothing but records
    the loss in `load.recovered`.
    """
    data, lines = read_nonblank_lines(path)
    load.bytes = len(data)
    load.sha256 = hashlib.sha256(data).hexdigest()
    for i, line in lines:
        load.lines += 1
        try:
            yield i, line, [orjson.loads(line)]
            continue
        except orjson.JSONDecodeError:
            pass
        objs: list[Any] = []
        pos, n = 0, len(line)
        error: str | None = None
        while pos < n:
            while pos < n and line[pos] in " \t\r":
                pos += 1
            if pos >= n:
                break
            try:
                obj, end = _decoder.raw_decode(line, pos)
            except json.JSONDecodeError as exc:
                error = f"invalid JSON at column {exc.colno}: {exc.msg}"
                break
            objs.append(obj)
            pos = end
        if not objs:
            reason = error or "invalid JSON"
            if any("\udc80" <= ch <= "\udcff" for ch in line):
                reason += " (the line is not valid UTF-8)"
            load.quarantine.append(QuarantineRow(str(path), i, line, reason))
            continue
        note = {"file": str(path), "line": i, "objects": len(objs)}
        if error:
            note["lost_tail"] = error
        load.recovered.append(note)
        yield i, line, objs


# ---------------------------------------------------------------- helpers for loaders

_UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
_UUID_ANY_CASE = re.compile(_UUID, re.IGNORECASE)
_UUID_LOWER = re.compile(_UUID)


def session_id_from_name(path: Path, *, lowercase_only: bool = False) -> str | None:
    """The last uuid in a file name, lowercased (`<uuid>.jsonl`, `owner__repo__<uuid>.jsonl.deleted.<ts>`, ...).

    `lowercase_only`: only uuids written in lowercase count (Claude Code's file names).
    """
    found = (_UUID_LOWER if lowercase_only else _UUID_ANY_CASE).findall(path.name)
    return found[-1].lower() if found else None


def num(v: Any) -> int | None:
    """A JSON number as an int (floats truncated); None for anything else, booleans included."""
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def parse_ts(value: Any) -> datetime | None:
    """ISO-8601 string or epoch milliseconds → aware UTC datetime (None when absent/invalid)."""
    if value is None or value == "":
        return None
    try:
        if isinstance(value, (int, float)):
            return datetime.fromtimestamp(value / 1000.0, tz=timezone.utc)
        if isinstance(value, str):
            s = value.strip()
            if s.endswith("Z"):
                s = s[:-1] + "+00:00"
            dt = datetime.fromisoformat(s)
            return dt if dt.tzinfo else dt.replace(tzinfo=timezone.utc)
    except (ValueError, OverflowError, OSError):
        return None
    return None


def json_text(obj: Any) -> str:
    """Canonical JSON text of a value (sorted keys; strings kept exactly)."""
    return canonical_json(obj).decode()


def content_items(content: Any) -> list[dict[str, Any] | Block]:
    """A message's content as a list: block objects as they are, anything else already a text Block.

    Every format stores content as a string on some lines and a list of blocks on others (and,
    rarely, a bare object or scalar); loaders map the dicts and keep the rest as text.
    """
    if content is None:
        return []
    if isinstance(content, str):
        return [Block("text", text=content)]
    if isinstance(content, dict):
        return [content]
    if not isinstance(content, list):
        return [Block("text", text=json_text(content))]
    return [c if isinstance(c, dict) else Block("text", text=c if isinstance(c, str) else json_text(c))
            for c in content]


def b64_decoded_len(data: str | None) -> int | None:
    if not data:
        return 0 if data == "" else None
    n = len(data)
    pad = len(data) - len(data.rstrip("="))
    return max(0, (n * 3) // 4 - pad)


# ---------------------------------------------------------------- threads → blocks


def _row_base(t: Thread, m: Message, pos: int) -> dict[str, Any]:
    u = m.usage or {}
    p = m.provenance or {}
    return {
        "session_id": t.session_id,
        "thread_id": t.thread_id,
        "source_format": t.source_format,
        "source_file": m.source_file,
        "source_line": m.source_line,
        "raw_line": m.raw_line,
        "entry_order": pos,
        "order_key": pos * ORDER_STRIDE,
        "entry_id": m.entry_id,
        "parent_id": m.parent_id,
        "msg_key": m.msg_key or m.entry_id,
        "message_id": m.message_id,
        "request_id": m.request_id,
        "role": m.role,
        "timestamp": m.timestamp,
        "model": m.model,
        "provider": m.provider,
        "api": m.api,
        "stop_reason": m.stop_reason,
        "usage_input": u.get("input"),
        "usage_output": u.get("output"),
        "usage_cache_read": u.get("cache_read"),
        "usage_cache_write": u.get("cache_write"),
        "usage_cache_write_5m": u.get("cache_write_5m"),
        "usage_cache_write_1h": u.get("cache_write_1h"),
        "is_sidechain": m.is_sidechain,
        "is_meta": m.is_meta,
        "is_compact_summary": m.is_compact_summary,
        "is_display_only": m.is_display_only,
        "provenance_kind": p.get("kind"),
        "provenance_source_session": p.get("source_session"),
        "provenance_channel": p.get("channel"),
        "provenance_tool": p.get("tool"),
        "origin": "transcript",
        "cache_epoch": 0,
    }


def call_ranges(t: Thread) -> tuple[list[bool], list[int], list[int | None]]:
    """Per message: is it a call this thread reports, first call that sees it, first call that no
    longer does.

    Calls are numbered along the thread's whole path: an inherited message (a recorded request that
    another thread reports) starts a call like any other, so a branch numbers its calls as the path
    it shares did, and every layer decides the shared history exactly as it did there.
    """
    n = len(t.messages)
    is_call = [
        (m.is_call if m.is_call is not None else m.role == "assistant") and not m.inherited for m in t.messages
    ]
    starts = [i for i in range(n) if is_call[i] or t.messages[i].inherited]  # call k starts at starts[k]
    import bisect

    def calls_starting_at_or_before(p: int) -> int:
        return bisect.bisect_right(starts, p)

    first = []
    for i, m in enumerate(t.messages):
        p = m.visible_from if m.visible_from is not None else i
        first.append(calls_starting_at_or_before(p))
    last: list[int | None] = [None] * n
    for c in t.compactions:
        # calls that start after position `at` no longer see messages before keep_from
        cut = bisect.bisect_right(starts, c.at)
        for i in range(min(c.keep_from, n)):
            if last[i] is None or last[i] > cut:  # type: ignore[operator]
                last[i] = cut
    return is_call, first, last


def threads_to_blocks(threads: list[Thread]) -> pa.Table:
    """The blocks table of these threads (BLOCKS schema)."""
    rows: list[dict[str, Any]] = []
    for t in threads:
        is_call, first, last = call_ranges(t)
        for pos, m in enumerate(t.messages):
            base = _row_base(t, m, pos)
            base["is_call"] = is_call[pos]
            base["first_call"] = first[pos]
            base["last_call"] = last[pos]
            # a message compacted away before any call saw it keeps its rows with an empty range
            # (last_call == first_call): it is still a call of its own; the runner drops such rows
            # after it has read the call structure
            block_pos = -1
            blocks = m.blocks
            if not blocks:
                # a message with no content still exists (and may be a call): one "empty" row
                blocks = [Block("empty")]
            for bi, b in enumerate(blocks):
                # parts of one tool_result share block_pos; a part_pos of 0 starts a new block
                if b.part_pos == 0 or block_pos < 0:
                    block_pos += 1
                r = dict(base)
                if m.block_lines and bi < len(m.block_lines):
                    eid, line, raw, f = m.block_lines[bi]
                    r["entry_id"], r["source_line"], r["raw_line"], r["source_file"] = eid, line, raw, f
                r.update(
                    block_pos=block_pos,
                    part_pos=b.part_pos,
                    block_type=b.block_type,
                    part_type=b.part_type,
                    text=b.text,
                    signature=b.signature,
                    tool_use_id=b.tool_use_id,
                    tool_name=b.tool_name,
                    tool_input=b.tool_input,
                    is_error=b.is_error,
                    image_media_type=b.image_media_type,
                    image_data=b.image_data,
                    image_bytes=b64_decoded_len(b.image_data) if b.image_data is not None else None,
                    image_width=None,
                    image_height=None,
                    extra_json=json_text(b.extra) if b.extra else None,
                )
                r["content_sha256"] = content_sha256(r)
                rows.append(r)
    cols = {f.name: [r.get(f.name) for r in rows] for f in BLOCKS}
    return pa.Table.from_pydict(cols, schema=BLOCKS)
