"""Claude Code session logs (`~/.claude/projects/<project>/<session>.jsonl` and subagent files).

All files of one session (the main file, `<session>/subagents/agent-*.jsonl`, legacy project-level
`agent-*.jsonl`) are loaded together, because entries link across them by `parentUuid` (the
compaction agent's request continues the main conversation).

Threads: for each file, the first thread is the ancestry of its last message entry (the main
chain; `compact_boundary` entries are crossed through `logicalParentUuid`); every later message
entry not yet covered is a branch tip, and becomes a thread of its own when its ancestry holds a
model request (message.id, requestId) no earlier thread holds. Inherited requests (the history a
branch shares with an earlier thread) stay calls of the branch, numbered as on its path, so what
the layers decide for the shared history does not depend on which thread a later rewind makes the
main one; but only the thread that claimed a request reports it, so each recorded request is output
exactly once. Parallel tool calls put sibling
tool_use entries and their results off the parentUuid chain; they are recovered the way Claude
Code does on resume (entries sharing the message id of an on-chain assistant entry, and the
tool_result entries that answer them).

How a load runs (`load_sessions`; one loader, for a batch of many sessions as for the live
engine's single spool file, which reads its lines with the same functions):

1. **Lines.** Each file is read once (`read_lines`: a line over --max-line-bytes is quarantined,
   never held) and split into lines. Every non-blank line is parsed once, by `base.read_line`:
   orjson on the line's bytes, which keeps a duplicated key's last value as the agents' JavaScript
   does; only a line orjson refuses (bytes that are not UTF-8, a lone surrogate escape, several
   values glued together, NaN, a number beyond a double), nests deeper than MAX_DEPTH or starts with
   a byte order mark takes the slower way there, which quarantines, repairs and notes it. A line's
   text is decoded only when it is kept (a message's `raw_line`, a quarantine row).
2. **Entries.** Each object of a line is checked (`entry_problem`), becomes a `Node` (`make_node`:
   ids, parents, type, message key, tool ids) and, when it is a message, its columns are taken out
   of it at once (`Entries.add`: the message's fields, and its content as block parts,
   `content_parts`); the parsed object is then let go (a later copy of the same uuid is compared
   with the first by parsing its line again), so a load holds the lines' bytes and the columns,
   never every parsed line.
3. **Threads** are graph logic over the nodes (parent chains, compaction boundaries, parallel tool
   results off the chain, branches and the calls they inherit) and give plans (`ThreadPlan`,
   `MessagePlan`: which entries make which message), not rows.
4. **Blocks table.** `SessionsLoad.blocks` turns the plans into row indices into the entry and part
   columns and gathers every column once (`base.blocks_table` builds the table, coercing a value of
   the wrong type with a note, as for every format); a line's text is shared by the rows of its
   blocks (`raw_line`, a string_view column).
"""

from __future__ import annotations

import hashlib
import re
import struct
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import polars as pl
import pyarrow as pa

from ctxreplay.pipeline.loaders.base import (
    NOT_PLAIN,
    ORDER_STRIDE,
    Block,
    Compaction,
    FileLoad,
    b64_decoded_len,
    bad,
    blocks_table,
    call_ranges,
    json_text,
    line_text,
    nonblank,
    num,
    one_of,
    parse_ts,
    path_str,
    plain_object,
    read_line,
    read_lines,
    session_id_from_name,
    take_long_lines,
    unreadable,
)
from ctxreplay.schemas.blocks import BLOCKS, CONTENT_COLUMNS

FORMAT = "claude_code"

MESSAGE_TYPES = {"user", "assistant"}
LOCAL_MODEL = "<synthetic>"
"""The model Claude Code names on the answers it writes itself: a failed request's notice ("Prompt
is too long", a rate limit, an API error: `isApiErrorMessage` true, which Claude Code never sends
again), and the "No response requested." it puts after a resumed session's last user message (sent
with the next request, as any assistant turn). Neither is a call: no provider answered it."""
KNOWN_OTHER = {
    "summary", "system", "attachment", "progress", "file-history-snapshot", "queue-operation",
    "last-prompt", "permission-mode", "custom-title", "tag", "agent-name", "pr-link",
}
ENVELOPE_KEYS = {"parentUuid", "sessionId", "uuid", "timestamp"}
# block keys read into their own columns; any other key of a block is kept in extra_json
KNOWN_BLOCK_KEYS = frozenset(("type", "text", "thinking", "signature", "id", "name", "input", "tool_use_id",
                              "content", "is_error", "source", "data"))


def sniff(first_objects: list[Any], path: Path) -> str | None:
    for o in first_objects:
        if not isinstance(o, dict):
            continue
        t = o.get("type")
        if one_of(t, MESSAGE_TYPES) and isinstance(o.get("message"), dict) and ("uuid" in o or "sessionId" in o):
            return FORMAT
        if one_of(t, KNOWN_OTHER) and ("sessionId" in o or "leafUuid" in o or "snapshot" in o or "uuid" in o):
            return FORMAT
    return None


@dataclass(slots=True)
class Node:
    """One entry with a uuid (a message, or another entry the threads walk through)."""

    uuid: str
    parent: str | None
    logical_parent: str | None
    type: str
    subtype: str | None
    file_idx: int
    line: int
    raw: str  # the line's text (message entries; a batch load leaves it empty for the others)
    obj: dict[str, Any] | None  # the entry as parsed (a batch load lets go of it once it has its columns)
    is_message: bool
    msg_key: str | None = None  # assistant: message.id|requestId
    sidechain: bool = False
    tool_result_ids: tuple[str, ...] = ()
    tool_use_ids: tuple[str, ...] = ()
    # message entries, once in an `Entries` (`Entries.add`): their row there, the message's role,
    # usage total (-1: no usage) and whether it has a stop_reason that counts (a truthy one)
    row: int = -1
    role: Any = None
    utotal: int = -1
    stop: bool = False
    local: bool = False  # a local notice (`is_local_notice`): never a call


@dataclass
class SessionFiles:
    session_id: str
    files: list[Path] = field(default_factory=list)


def _kind(o: dict[str, Any]) -> str:
    """The kind an other line is counted under (sub-kinds only when they are short texts)."""
    t = str(o.get("type"))
    if t == "progress":
        sub = o.get("data")
    elif t == "system":
        sub = o
    elif t == "attachment":
        sub = o.get("attachment")
    else:
        return t[:100]
    if isinstance(sub, dict):
        v = sub.get("subtype" if sub is o else "type")
        if isinstance(v, str) and 0 < len(v) <= 100:
            return f"{t}:{v}"
    return t


def entry_problem(o: dict[str, Any]) -> str | None:
    """Why an entry object cannot be read (a quarantine kind from `bad`), or None."""
    t = o.get("type")
    if not isinstance(t, str) or not t:
        return bad("no_type", "entry has no 'type' field (expected user, assistant, system, progress, ...)")
    if t in MESSAGE_TYPES:
        msg = o.get("message")
        if not isinstance(msg, dict):
            return bad("no_message", f"'{t}' entry has no 'message' object")
        if t == "assistant" and not isinstance(msg.get("content"), (list, str)):
            return bad("bad_content", "'assistant' entry: message.content is not a list or string")
    return None


def make_node(o: dict[str, Any], uid: str, file_idx: int, line: int, raw: str, conflict: str = "") -> Node:
    """The node of one entry with a uuid (`entry_problem` found nothing wrong with it)."""
    t = o["type"]
    is_msg = t in MESSAGE_TYPES
    tr_ids, tu_ids = entry_tool_ids(o) if is_msg or "message" in o else ((), ())
    parent = o.get("parentUuid")
    lparent = o.get("logicalParentUuid")
    subtype = o.get("subtype")
    if t == "assistant":
        mid = o["message"].get("id")
        msg_key = f"{mid}|{o.get('requestId')}{conflict}" if mid else uid
    else:
        msg_key = None
    return Node(uid, parent if isinstance(parent, str) else None, lparent if isinstance(lparent, str) else None, t,
                subtype if isinstance(subtype, str) else None, file_idx, line, raw, o, is_msg, msg_key,
                bool(o.get("isSidechain")), tr_ids, tu_ids)


def entry_tool_ids(o: dict[str, Any]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """An entry's tool-result ids and tool-call ids (non-empty strings), in content order."""
    msg = o.get("message")
    content = msg.get("content") if isinstance(msg, dict) else None
    if not isinstance(content, list):
        return (), ()
    tr: list[str] = []
    tu: list[str] = []
    for b in content:
        if isinstance(b, dict):
            t = b.get("type")
            if t == "tool_result":
                v = b.get("tool_use_id")
                if isinstance(v, str) and v:
                    tr.append(v)
            elif t == "tool_use":
                v = b.get("id")
                if isinstance(v, str) and v:
                    tu.append(v)
    return tuple(tr), tuple(tu)


# ---------------------------------------------------------------- message content


_NO_USAGE = (None,) * 8


def _usage(u: Any, diagnostics: Any = None) -> tuple[Any, ...] | None:
    """The answer's usage (input, output, cache_read, cache_write, cache_write_5m, cache_write_1h
    tokens), and with it the server's cache diagnosis (`message.diagnostics`, Claude Code 2.1.140+:
    `{"cache_miss_reason": {"type": ..., "cache_missed_input_tokens": N}}`, null or absent when
    nothing diverged): the type as written (a later type too) and the count; both None without a
    diagnosis. None without a usage object."""
    if not isinstance(u, dict):
        return None
    cc = u.get("cache_creation")
    if not isinstance(cc, dict):
        cc = {}
    d = diagnostics.get("cache_miss_reason") if isinstance(diagnostics, dict) else None
    if not isinstance(d, dict):
        d = {}
    reason = d.get("type")
    return (num(u.get("input_tokens")), num(u.get("output_tokens")), num(u.get("cache_read_input_tokens")),
            num(u.get("cache_creation_input_tokens")), num(cc.get("ephemeral_5m_input_tokens")),
            num(cc.get("ephemeral_1h_input_tokens")), reason if isinstance(reason, str) else None,
            num(d.get("cache_missed_input_tokens")))


def _usage_total(u: tuple[Any, ...] | None) -> int:
    if u is None:
        return -1
    return (u[0] or 0) + (u[1] or 0) + (u[2] or 0) + (u[3] or 0)


# A block part as a tuple in `base.Block`'s field order: block_type, text, signature, tool_use_id,
# tool_name, tool_input, is_error, part_type, part_pos, image_media_type, image_data, extra.
Part = tuple[Any, ...]


def _text(text: Any) -> Part:
    return ("text", text, None, None, None, None, None, None, 0, None, None, None)


def content_parts(content: Any) -> list[Part]:
    """Anthropic Messages content (a string or a list of blocks; rarely a bare object or scalar) →
    block parts, tool_result content flattened into its parts. Keys of a block that have no column
    of their own are kept (`extra`), as is a whole block of a type without columns."""
    if content is None:
        return []
    if isinstance(content, str):
        return [_text(content)]
    if isinstance(content, dict):
        items: list[Any] = [content]
    elif isinstance(content, list):
        items = content
    else:
        return [_text(json_text(content))]
    out: list[Part] = []
    for b in items:
        if not isinstance(b, dict):
            out.append(_text(b if isinstance(b, str) else json_text(b)))
            continue
        t = b.get("type")
        rest = None if b.keys() <= KNOWN_BLOCK_KEYS else ({k: v for k, v in b.items() if k not in KNOWN_BLOCK_KEYS}
                                                          or None)
        if t == "text":
            out.append(("text", b.get("text"), None, None, None, None, None, None, 0, None, None, rest))
        elif t == "tool_use" or t == "server_tool_use":
            out.append((t, None, None, b.get("id"), b.get("name"), json_text(b.get("input")) if "input" in b else None,
                        None, None, 0, None, None, rest))
        elif t == "tool_result":
            _tool_result_parts(b, out)
        elif t == "thinking":
            out.append(("thinking", b.get("thinking"), b.get("signature"), None, None, None, None, None, 0, None, None,
                        rest))
        elif t == "redacted_thinking":
            out.append(("redacted_thinking", b.get("data"), None, None, None, None, None, None, 0, None, None, rest))
        elif t == "image":
            src = b.get("source")
            src = src if isinstance(src, dict) else {}
            extra = {"source": src} if src.get("type") not in (None, "base64") else None
            out.append(("image", None, None, None, None, None, None, None, 0, src.get("media_type"), src.get("data"),
                        extra))
        else:
            out.append((str(t), b.get("text") if isinstance(b.get("text"), str) else None, None, None, None, None, None,
                        None, 0, None, None, b))
    return out


def _tool_result_parts(b: dict[str, Any], out: list[Part]) -> None:
    tuid, err = b.get("tool_use_id"), b.get("is_error")
    c = b.get("content")
    if isinstance(c, str):
        out.append(("tool_result", c, None, tuid, None, None, err, "string", 0, None, None, None))
        return
    if not isinstance(c, list) or not c:
        out.append(("tool_result", None, None, tuid, None, None, err, "empty", 0, None, None, None))
        return
    for i, p in enumerate(c):
        t = p.get("type") if isinstance(p, dict) else None
        if t == "text":
            out.append(("tool_result", p.get("text"), None, tuid, None, None, err, "text", i, None, None, None))
        elif t == "image":
            src = p.get("source")
            src = src if isinstance(src, dict) else {}
            out.append(("tool_result", None, None, tuid, None, None, err, "image", i, src.get("media_type"),
                        src.get("data"), None))
        elif t == "tool_reference":
            out.append(("tool_result", None, None, tuid, p.get("tool_name"), None, err, "tool_reference", i, None, None,
                        None))
        else:
            out.append(("tool_result", json_text(p), None, tuid, None, None, err, "other", i, None, None, {"part": p}))


def is_local_notice(node_type: str, model: Any) -> bool:
    """An answer Claude Code wrote itself (model `<synthetic>`): no provider answered it, so it is no
    call (`MessagePlan.is_call` False, never inherited)."""
    return node_type == "assistant" and model == LOCAL_MODEL


def _notice_parts(o: dict[str, Any], m: dict[str, Any]) -> list[Part] | None:
    """The parts of a local notice Claude Code leaves out of what it sends (`isApiErrorMessage`
    true: a failed request's notice), or None for any other message. The notice becomes one `empty`
    block, which no target sends, with the recorded content (and the `error` kind) in its extra."""
    if not (is_local_notice(o.get("type"), m.get("model")) and o.get("isApiErrorMessage") is True):
        return None
    extra: dict[str, Any] = {"content": m.get("content")}
    if isinstance(o.get("error"), str):
        extra["error"] = o["error"]
    return [("empty", None, None, None, None, None, None, None, 0, None, None, extra)]


def anthropic_content_blocks(content: Any) -> list[Block]:
    """Anthropic Messages content (string or blocks) → blocks (`content_parts` as `base.Block`s)."""
    return [Block(*p) for p in content_parts(content)]


# ---------------------------------------------------------------- the entries' columns


_EMPTY_PART: Part = ("empty", None, None, None, None, None, None, None, 0, None, None, None)
# an entry's own columns (`Entries.add`), in BLOCKS' types
ENTRY_COLUMNS = ("entry_id", "source_file", "source_line", "raw_line", "parent_id", "msg_key", "message_id",
                 "request_id", "role", "timestamp", "model", "provider", "api", "stop_reason", "usage_input",
                 "usage_output", "usage_cache_read", "usage_cache_write", "usage_cache_write_5m",
                 "usage_cache_write_1h", "cache_miss_reason", "cache_missed_tokens", "is_sidechain", "is_meta",
                 "is_compact_summary", "is_display_only")
_USAGE = ENTRY_COLUMNS[14:22]  # the usage and the diagnosis: read from the copy a message reports
_PER_MESSAGE = ("parent_id", "msg_key", "message_id", "request_id", "role", "timestamp", "model", "provider", "api",
                "is_sidechain", "is_meta", "is_compact_summary", "is_display_only")  # from its first entry
_PER_ROW = ("entry_id", "source_file", "source_line", "raw_line")  # from the row's own entry
PART_COLUMNS = ("block_type", "text", "signature", "tool_use_id", "tool_name", "tool_input", "is_error", "part_type",
                "part_pos", "image_media_type", "image_data")  # a Part's fields, its `extra` aside
# a part's fields that content_sha256 covers (CONTENT_COLUMNS), in the order of their names: a dict
# made in this order is written by orjson as `blockops.canonical_json` writes it (sorted keys)
_CONTENT = tuple(sorted(((PART_COLUMNS.index(c), c) for c in CONTENT_COLUMNS), key=lambda x: x[1]))
_sha, _dumps = hashlib.sha256, orjson.dumps
# a table of fewer rows is made as values (`Entries.blocks`): the same table, without the gather's fixed
# cost, about 10 ms, which is most of a small load's (a live engine's spool file, a session of a few turns)
SMALL_TABLE_ROWS = 500
_VIEW_MAX = 2**31 - 1  # a string_view's offsets and lengths are 32-bit: texts beyond are copied


class Entries:
    """The message entries of a load, column by column: one row per entry (a tuple in
    ENTRY_COLUMNS' order; `raw_line` aside, kept as where its bytes are), added in reading order, and
    their content as block parts (the parts of row r are parts[start[r]:start[r + 1]])."""

    def __init__(self) -> None:
        self.rows: list[tuple[Any, ...]] = []
        self.parts: list[Part] = []
        self.start: list[int] = [0]
        # raw lines: entry r's text is buffers[raw_buf[r]][raw_off[r]:raw_off[r] + raw_len[r]] (UTF-8); the
        # buffers are the files' bytes, so the table's raw_line views point into them (no copy), and the
        # texts that are not a file's bytes as they are (a repaired line, the live engine's) are copied
        # into buffers of their own
        self.buffers: list[Any] = []
        self._buffer_of: dict[int, int] = {}
        self._own: bytearray | None = None
        self._own_at = -1
        self.raw_buf: list[int] = []
        self.raw_off: list[int] = []
        self.raw_len: list[int] = []

    def add(self, node: Node, o: dict[str, Any], path: str, raw: bytes, s: int | None = None,
            e: int | None = None) -> None:
        """Take a message entry's columns out of its object (the node gets its row, role, usage
        total and stop flag). Its line's text: raw[s:e] (UTF-8; raw is kept, not copied), or `raw`
        whole when s is None (copied)."""
        if s is None or e > _VIEW_MAX:  # type: ignore[operator]
            raw = raw if s is None else raw[s:e]
            own = self._own
            if own is None or len(own) + len(raw) > _VIEW_MAX:
                own = self._own = bytearray()
                self._own_at = len(self.buffers)
                self.buffers.append(own)
            self.raw_buf.append(self._own_at)
            self.raw_off.append(len(own))
            self.raw_len.append(len(raw))
            own += raw
        else:
            k = self._buffer_of.get(id(raw))
            if k is None:
                k = self._buffer_of[id(raw)] = len(self.buffers)
                self.buffers.append(raw)
            self.raw_buf.append(k)
            self.raw_off.append(s)
            self.raw_len.append(e - s)  # type: ignore[operator]
        m = o["message"]
        muted = _notice_parts(o, m)
        parts = content_parts(m.get("content")) if muted is None else muted
        role = m.get("role") or o.get("type")
        if role == "user" and parts and all(p[0] == "tool_result" for p in parts):
            role = "tool"
        asst = node.type == "assistant"
        usage = _usage(m.get("usage"), m.get("diagnostics")) if asst else None
        stop = m.get("stop_reason")
        node.row = len(self.rows)
        node.role, node.utotal, node.stop = role, _usage_total(usage), bool(stop)
        node.local = is_local_notice(node.type, m.get("model"))
        g = o.get
        self.rows.append((
            node.uuid, path, node.line, None, node.parent, node.msg_key or node.uuid, m.get("id") if asst else None,
            g("requestId"), role, g("timestamp"), m.get("model"), "anthropic" if asst else None,
            "anthropic-messages" if asst else None, stop, *(usage or _NO_USAGE), bool(g("isSidechain")),
            bool(g("isMeta")), bool(g("isCompactSummary")), bool(g("isVisibleInTranscriptOnly")) or muted is not None))
        self.parts.extend(parts)
        self.start.append(len(self.parts))

    def blocks(self, threads: list[ThreadPlan], notes: list[dict[str, Any]] | None = None) -> pa.Table:
        """The blocks table (BLOCKS schema) of these threads, in their order, with the ids they carry
        now: one row per block part of each message (an "empty" row for a message without any).

        The entries' and parts' columns are made Arrow arrays once and every column of the table is
        gathered from them by row indices; when a value does not fit its column (a number where a text
        is read, ...), the rows are made as Python values and `base.blocks_table` makes them fit, with
        a note per row (what every format's loader does). A table of fewer than SMALL_TABLE_ROWS rows
        is made as values too: the gather's fixed cost (polars, Arrow) is more than such a table's."""
        idx = _RowIndex(self, threads)
        if len(idx.part) < SMALL_TABLE_ROWS:
            return self._blocks_by_value(idx, notes)
        try:
            ent, prt = self._columns()
        except (pa.ArrowException, pl.exceptions.PolarsError, TypeError, ValueError, OverflowError):
            return self._blocks_by_value(idx, notes)
        n = len(idx.part)
        cols: dict[str, Any] = {}
        part_idx = np.where(idx.part >= 0, idx.part, len(self.parts))  # the last part: the "empty" one
        for names, at, src in ((_PER_ROW, idx.ent, ent), (_PER_MESSAGE, idx.first, ent), (_USAGE, idx.usage, ent),
                               (("stop_reason",), idx.stop, ent), (tuple(prt), part_idx, prt)):
            arrow_idx = polars_idx = None
            for name in names:
                col = src[name]
                if name == "raw_line":
                    cols[name] = self._raw_lines(at)
                elif isinstance(col, pl.Series):  # strings: polars' gather shares their bytes until to_arrow
                    if polars_idx is None:
                        polars_idx = pl.Series(at, dtype=pl.Int64)
                    cols[name] = _string(col.gather(polars_idx).to_arrow())
                else:
                    if arrow_idx is None:
                        arrow_idx = pa.array(at, pa.int64())
                    cols[name] = col.take(arrow_idx)
        t_idx = pa.array(idx.thread, pa.int64())
        cols["session_id"] = pa.array([t.session_id for t in threads], pa.string()).take(t_idx)
        cols["thread_id"] = pa.array([t.thread_id for t in threads], pa.string()).take(t_idx)
        cols["entry_order"] = pa.array(idx.pos, pa.int64())
        cols["order_key"] = pa.array(idx.pos * ORDER_STRIDE, pa.int64())
        cols["is_call"] = pa.array(idx.call, pa.bool_())
        cols["first_call"] = pa.array(idx.first_call, pa.int32())
        cols["last_call"] = idx.last_call
        cols["block_pos"] = pa.array(idx.block_pos, pa.int32())
        cols["source_format"] = _const(FORMAT, n, pa.string())
        cols["origin"] = _const("transcript", n, pa.string())
        cols["cache_epoch"] = _const(0, n, pa.int32())
        for f in BLOCKS:
            if f.name not in cols:
                cols[f.name] = pa.nulls(n, f.type)
        return pa.Table.from_arrays([cols[f.name] for f in BLOCKS], schema=BLOCKS)

    def _columns(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The entries' and the parts' columns (the parts' with one more part at the end, a message's
        "empty" row, and their image sizes and content hashes): text as polars Series, the others as
        Arrow arrays of BLOCKS' types; raises when a value does not fit its column."""
        n_ent = len(self.rows)
        ent_cols = list(zip(*self.rows, strict=True)) if self.rows else [()] * len(ENTRY_COLUMNS)
        ent = {name: _column(name, list(vals)) for name, vals in zip(ENTRY_COLUMNS, ent_cols, strict=True)
               if name not in ("raw_line", "timestamp")}
        ent["timestamp"] = _timestamps(list(ent_cols[ENTRY_COLUMNS.index("timestamp")]))
        ent["raw_line"] = self._raw_views(n_ent)
        parts = [*self.parts, _EMPTY_PART]
        part_cols = list(zip(*parts, strict=True))
        prt = {name: _column(name, list(vals)) for name, vals in zip(PART_COLUMNS, part_cols, strict=False)}
        prt["extra_json"] = _column("extra_json", [json_text(x) if x else None for x in part_cols[11]])
        prt["image_bytes"] = pa.array([b64_decoded_len(d) if d is not None else None for d in part_cols[10]],
                                      pa.int64())
        prt["content_sha256"] = _column("content_sha256", [_sha(_dumps({k: p[i] for i, k in _CONTENT if p[i] is not None}))
                                                           .hexdigest() for p in parts])
        return ent, prt

    def _raw_views(self, n: int) -> Any:
        """The entries' raw lines as a string_view array whose views point into `buffers` (checked
        to be UTF-8); the views are kept for `_raw_lines`."""
        bufs = [bytes(b) if isinstance(b, bytearray) else b for b in self.buffers]
        offs = self.raw_off
        # a file whose message lines are less than half its bytes: those lines are copied out, so the
        # table does not keep the rest of the file alive (views into it would)
        used = [0] * len(bufs)
        for b, ln in zip(self.raw_buf, self.raw_len, strict=True):
            used[b] += ln
        sparse = {b for b, u in enumerate(used) if 2 * u < len(bufs[b])}
        if sparse:
            offs = list(offs)
            copies: dict[int, bytearray] = {}
            for i, (b, o, ln) in enumerate(zip(self.raw_buf, self.raw_off, self.raw_len, strict=True)):
                if b in sparse:
                    c = copies.setdefault(b, bytearray())
                    offs[i] = len(c)
                    c += bufs[b][o:o + ln]
            for b, c in copies.items():
                bufs[b] = bytes(c)
        out = bytearray(16 * n)
        pack = struct.pack_into
        for i, (b, o, ln) in enumerate(zip(self.raw_buf, offs, self.raw_len, strict=True)):
            buf = bufs[b]
            if ln <= 12:  # a short text is inlined whole
                pack("<i12s", out, 16 * i, ln, buf[o:o + ln])
            else:  # its length, first 4 bytes, buffer and offset
                pack("<i4sii", out, 16 * i, ln, buf[o:o + 4], b, o)
        self._views = np.frombuffer(out, np.uint8).reshape(n, 16)
        self._view_buffers = [pa.py_buffer(b) for b in bufs]
        arr = pa.Array.from_buffers(pa.string_view(), n, [None, pa.py_buffer(out), *self._view_buffers])
        arr.validate(full=True)
        return arr

    def _raw_lines(self, at: np.ndarray) -> pa.Array:
        """The raw_line column of these rows (entry indices): the entries' views, repeated; the rows
        of one entry share its bytes (BLOCKS: raw_line)."""
        rows = self._views[at]
        return pa.Array.from_buffers(pa.string_view(), len(at), [None, pa.py_buffer(rows), *self._view_buffers])

    def _blocks_by_value(self, idx: _RowIndex, notes: list[dict[str, Any]] | None) -> pa.Table:
        """`blocks`, the rows made as Python values (`base.blocks_table`: a value that does not fit its
        column is made to fit, with a note)."""
        n = len(idx.part)
        thread = idx.thread.tolist()
        pos = idx.pos.tolist()
        cols: dict[str, Any] = {
            "session_id": [idx.threads[i].session_id for i in thread],
            "thread_id": [idx.threads[i].thread_id for i in thread], "source_format": [FORMAT] * n,
            "entry_order": pos, "order_key": [p * ORDER_STRIDE for p in pos], "is_call": idx.call.tolist(),
            "first_call": idx.first_call.tolist(), "last_call": idx.last_call.to_pylist(),
            "block_pos": idx.block_pos.tolist(),
        }
        ts = ENTRY_COLUMNS.index("timestamp")
        rows = [(*r[:ts], parse_ts(r[ts]), *r[ts + 1:]) for r in self.rows]
        k = {name: i for i, name in enumerate(ENTRY_COLUMNS)}
        for names, at in ((_PER_ROW, idx.ent.tolist()), (_PER_MESSAGE, idx.first.tolist()),
                          (_USAGE, idx.usage.tolist()), (("stop_reason",), idx.stop.tolist())):
            for name in names:
                j = k[name]
                cols[name] = [rows[i][j] for i in at]
        bufs = self.buffers
        texts = [bytes(bufs[b][o:o + ln]).decode("utf-8") for b, o, ln in zip(self.raw_buf, self.raw_off,
                                                                                self.raw_len, strict=True)]
        cols["raw_line"] = [texts[i] for i in idx.ent.tolist()]
        parts = [self.parts[i] if i >= 0 else _EMPTY_PART for i in idx.part.tolist()]
        values = list(zip(*parts, strict=True)) if parts else [()] * 12
        for name, vals in zip(PART_COLUMNS, values, strict=False):
            cols[name] = list(vals)
        cols["extra_json"] = [json_text(x) if x else None for x in values[11]]
        cols["image_bytes"] = [b64_decoded_len(d) if d is not None else None for d in cols["image_data"]]
        none = [None] * n
        for f in BLOCKS:
            if f.name not in cols and f.name != "content_sha256":
                cols[f.name] = none
        cols["origin"] = ["transcript"] * n
        cols["cache_epoch"] = [0] * n
        return blocks_table(cols, notes)


class _RowIndex:
    """The rows of the blocks table of some threads, as index arrays: per row, its entry (`ent`),
    part (`part`, -1 for a message's "empty" row), the entries its message takes its columns from
    (`first`, `usage`, `stop`), its thread, position, call columns and block_pos."""

    def __init__(self, entries: Entries, threads: list[ThreadPlan]) -> None:
        start = entries.start
        self.threads = threads
        # per message, and per segment (a member entry's parts, or a message's one "empty" row)
        m_thread: list[int] = []
        m_pos: list[int] = []
        m_first: list[int] = []
        m_usage: list[int] = []
        m_stop: list[int] = []
        m_call: list[bool] = []
        m_fc: list[int] = []
        m_lc: list[int | None] = []
        s_ent: list[int] = []
        s_start: list[int] = []
        s_count: list[int] = []
        s_msg: list[int] = []
        for ti, t in enumerate(threads):
            is_call, first, last = call_ranges(t)
            for pos, m in enumerate(t.messages):
                mi = len(m_thread)
                e0 = m.members[0].row
                m_thread.append(ti)
                m_pos.append(pos)
                m_first.append(e0)
                m_usage.append(m.usage_node.row)
                m_stop.append(m.stop_node.row)
                m_call.append(is_call[pos])
                m_fc.append(first[pos])
                m_lc.append(last[pos])
                got = False
                for e in m.members:
                    row = e.row
                    a, b = start[row], start[row + 1]
                    if b > a:
                        got = True
                        s_ent.append(row)
                        s_start.append(a)
                        s_count.append(b - a)
                        s_msg.append(mi)
                if not got:  # a message with no content still exists (and may be a call): one "empty" row
                    s_ent.append(e0)
                    s_start.append(-1)
                    s_count.append(1)
                    s_msg.append(mi)
        count = np.array(s_count, np.int64)
        n = int(count.sum())
        seg = np.repeat(np.arange(len(s_count), dtype=np.int64), count)
        seg_first_row = np.cumsum(count) - count
        within = np.arange(n, dtype=np.int64) - seg_first_row[seg]
        self.part = np.array(s_start, np.int64)[seg] + within
        self.ent = np.array(s_ent, np.int64)[seg]
        msg = np.array(s_msg, np.int64)[seg]
        self.first = np.array(m_first, np.int64)[msg]
        self.usage = np.array(m_usage, np.int64)[msg]
        self.stop = np.array(m_stop, np.int64)[msg]
        self.thread = np.array(m_thread, np.int64)[msg]
        self.pos = np.array(m_pos, np.int64)[msg]
        self.call = np.array(m_call, np.bool_)[msg]
        self.first_call = np.array(m_fc, np.int32)[msg]
        lc = np.array([-1 if x is None else x for x in m_lc], np.int32)[msg]
        self.last_call = pa.array(lc, pa.int32(), mask=lc < 0)
        # block_pos: parts of one tool_result share it; a part_pos of 0, or a message's first row, starts one
        part_pos = np.fromiter((p[8] for p in entries.parts), np.int64, len(entries.parts))
        pp = np.where(self.part >= 0, part_pos[np.maximum(self.part, 0)] if len(part_pos) else 0, 0)
        msg_start = np.ones(n, np.bool_)
        msg_start[1:] = msg[1:] != msg[:-1]
        starts = (pp == 0) | msg_start
        cs = np.cumsum(starts)
        self.block_pos = (cs - cs[np.flatnonzero(msg_start)][np.cumsum(msg_start) - 1]).astype(np.int32)


def _column(name: str, vals: list[Any]) -> Any:
    """One column of values read from the entries: a polars Series of strings for a text column
    (strict: a value that is not a str raises, as one Arrow cannot hold does), else an Arrow array
    of its BLOCKS type (raises when a value does not fit)."""
    if name == "raw_line":
        return pl.Series(vals, dtype=pl.Binary).cast(pl.String)
    typ = BLOCKS.field(name).type
    if typ == pa.string():
        return pl.Series(vals, dtype=pl.String)
    return pa.array(vals, typ)


# the timestamps Claude Code writes (`2026-04-01T10:00:00.123Z`), which polars parses as `parse_ts` does;
# any other value (another shape, a number, an hour 24, a leap second) is parsed by `parse_ts` itself
_TS_SHAPE = r"^[1-9][0-9]{3}-[0-9]{2}-[0-9]{2}T([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9]\.[0-9]{3}Z$"
_TS_FORMAT = "%Y-%m-%dT%H:%M:%S%.3fZ"


def _timestamps(vals: list[Any]) -> pa.Array:
    """The entries' `timestamp` values as BLOCKS' timestamps (`base.parse_ts`: null when absent or
    invalid, e.g. 2026-02-30)."""
    typ = BLOCKS.field("timestamp").type
    text = pl.Series([v if type(v) is str else None for v in vals], dtype=pl.String)
    shaped = text.str.contains(_TS_SHAPE).fill_null(False)
    got = pl.select(pl.when(shaped).then(text.str.strptime(pl.Datetime("ms", "UTC"), _TS_FORMAT, strict=False)))
    out = got.to_series().to_arrow().cast(typ)
    odd = [i for i, (v, ok) in enumerate(zip(vals, shaped.to_list(), strict=True)) if not ok and v is not None]
    if not odd:
        return out
    fixed = out.to_pylist()
    for i in odd:
        fixed[i] = parse_ts(vals[i])
    return pa.array(fixed, typ)


def _string(a: pa.Array) -> Any:
    """A large_string array (polars' export) as a string one (BLOCKS' type), in chunks when its text
    is too long for one string array's 32-bit offsets."""
    try:
        return a.cast(pa.string())
    except pa.ArrowInvalid:
        half = len(a) // 2
        if not half:
            raise
        return pa.chunked_array([*_chunks(_string(a.slice(0, half))), *_chunks(_string(a.slice(half)))])


def _chunks(a: Any) -> list[pa.Array]:
    return a.chunks if isinstance(a, pa.ChunkedArray) else [a]


def _const(v: Any, n: int, typ: pa.DataType) -> pa.Array:
    return pa.repeat(pa.scalar(v, typ), n) if n else pa.array([], typ)


# ---------------------------------------------------------------- plans


@dataclass
class MessagePlan:
    """One message of a thread: the entries whose blocks it holds, in order (several when one
    answer was written over several lines); what `base.call_ranges` reads of a `base.Message`."""

    members: list[Node]
    usage_node: Node  # the entry whose usage it reports (the largest copy, the last of equals)
    stop_node: Node  # the entry whose stop_reason it reports (the last that has one, else the first)
    role: Any
    msg_key: str | None
    source_line: int
    inherited: bool = False
    is_call: bool | None = None  # None: assistant messages are calls; False: a local notice (never one)
    visible_from: int | None = None


@dataclass
class ThreadPlan:
    """A thread as message plans; it has what `load_paths` reads of a `base.Thread`."""

    session_id: str
    thread_id: str
    source_format: str
    source_file: str
    messages: list[MessagePlan]
    compactions: list[Compaction] = field(default_factory=list)


@dataclass
class SessionsLoad:
    """What `load_sessions` returns: the threads (in group order), the accounting of every file,
    the loader stats of every group (in order, for the caller to add up), and the entries'
    columns the blocks table is made of (`blocks`)."""

    threads: list[ThreadPlan]
    loads: list[FileLoad]
    stats: list[dict[str, int]]
    entries: Entries
    timings: dict[str, float] | None = None

    def blocks(self, threads: list[ThreadPlan] | None = None, notes: list[dict[str, Any]] | None = None) -> Any:
        """The blocks table of these threads (default: all of them), in their order, with the thread
        ids they carry now; a value that had to be made to fit its column is noted in `notes`."""
        clock = _Clock(self.timings)
        out = self.entries.blocks(self.threads if threads is None else threads, notes)
        clock.lap("blocks table")
        return out


class _Clock:
    """Optional wall-clock and CPU seconds per phase (bench/bench_load.py); no-op without a dict."""

    def __init__(self, timings: dict[str, float] | None) -> None:
        self.timings = timings
        self.t, self.c = time.perf_counter(), time.process_time()

    def lap(self, name: str) -> None:
        if self.timings is not None:
            now, cpu = time.perf_counter(), time.process_time()
            self.timings[name] = self.timings.get(name, 0.0) + now - self.t
            self.timings[f"cpu: {name}"] = self.timings.get(f"cpu: {name}", 0.0) + cpu - self.c
            self.t, self.c = now, cpu


# ---------------------------------------------------------------- sessions


def group_sessions(paths: list[Path], first_objects: dict[Path, list[Any]]) -> list[SessionFiles]:
    """Group Claude Code files by the session they belong to (the `sessionId` inside them)."""
    groups: dict[str, SessionFiles] = {}
    for p in paths:
        sid = None
        for o in first_objects.get(p, []):
            if isinstance(o, dict) and isinstance(o.get("sessionId"), str):
                sid = o["sessionId"]
                break
        if sid is None:
            if p.parent.name == "subagents":
                sid = path_str(p.parent.parent.name)
            else:
                sid = session_id_from_name(p, lowercase_only=True) or path_str(p.stem)
        groups.setdefault(sid, SessionFiles(sid)).files.append(p)
    return [groups[k] for k in sorted(groups)]


def _is_main_file(p: Path, session_id: str) -> bool:
    return session_id in p.name and not (p.name.startswith("agent-") or "__subagents__" in p.name
                                         or p.parent.name == "subagents")


def _agent_thread_id(p: Path, agent_id: str | None) -> str:
    if agent_id:
        return f"agent-{agent_id}"
    m = re.search(r"agent-([A-Za-z0-9_-]+?)(?:\.jsonl)?$", p.name)
    return f"agent-{m.group(1)}" if m else path_str(p.stem)


def _main_first(files: list[Path], session_id: str) -> list[Path]:
    """Main session files first (the largest first: a backup copy of the session is usually an older,
    shorter prefix of it), then subagent files, each by path."""
    def size(p: Path) -> int:
        try:
            return p.stat().st_size
        except OSError:
            return 0

    return sorted(files, key=lambda p: (not _is_main_file(p, session_id),
                                        -size(p) if _is_main_file(p, session_id) else 0, str(p)))


def load_sessions(groups: list[SessionFiles], skipped: list[dict[str, str]] | None = None,
                  timings: dict[str, float] | None = None, *, open_sidechains: bool = False) -> SessionsLoad:
    """Load every file of these sessions, group by group: their threads, the accounting of every
    file, each group's stats, and the columns of their message entries (`SessionsLoad.blocks`).

    An entry read twice (the same uuid: a resumed session writes some again; a backup copy of
    the session holds them all) is read once: a later copy with the same content counts as a
    `duplicate_entry` other line, as does a line without a uuid that an earlier file of the
    session holds byte for byte. A later entry with the same uuid but other content is kept apart
    as `<uuid>~<hash>` (its own message; a branch of its own when it has a call) and noted in
    the file's `recovered`. A file that cannot be read is listed in `skipped`.

    `open_sidechains`: also keep, as a thread of no call, an inline sidechain of the main file
    whose first request awaits its answer (no assistant message on its path yet), named as it will
    be once answered (`opens_sidechain`). The live engine assembles that request; a batch run
    reports recorded calls, so it leaves such a path out (counted in `branches_without_calls`).

    `timings`: when given, seconds per phase are added to it (bench/bench_load.py).
    """
    entries = Entries()
    threads: list[ThreadPlan] = []
    loads: list[FileLoad] = []
    stats: list[dict[str, int]] = []
    clock = _Clock(timings)
    for g in groups:
        t, lds, st = _load_session(g, entries, skipped, open_sidechains, clock)
        threads.extend(t)
        loads.extend(lds)
        stats.append(st)
    return SessionsLoad(threads, loads, stats, entries, timings)


class _EarlierLines:
    """The lines of the files of a session read so far, as a set made only when asked (a line
    without uuid in a later file is compared with them)."""

    def __init__(self) -> None:
        self.pending: list[bytes] = []  # files' bytes
        self.seen: set[bytes] = set()

    def holds(self, raw: bytes) -> bool:
        for data in self.pending:
            self.seen.update(ln.rstrip(b"\r") for ln in data.split(b"\n"))
        self.pending = []
        return raw.rstrip(b"\r") in self.seen


def _load_session(group: SessionFiles, entries: Entries, skipped: list[dict[str, str]] | None,
                  open_sidechains: bool, clock: _Clock) -> tuple[list[ThreadPlan], list[FileLoad], dict[str, int]]:
    session_id = group.session_id
    files = _main_first(group.files, session_id)
    loads: list[FileLoad] = []
    nodes: dict[str, Node] = {}
    per_file: list[list[Node]] = []
    agents: list[str | None] = []
    file_data: list[bytes] = []  # each file's bytes, while the session is read
    file_starts: dict[int, list[int]] = {}  # where each line of a file starts (made when asked)
    stats: Counter[str] = Counter()
    earlier = _EarlierLines()
    loads_obj = orjson.loads

    def obj_of(n: Node) -> Any:
        """A node's object: kept when its line was repaired; else its line parsed again (orjson)."""
        if n.obj is not None:
            return n.obj
        data = file_data[n.file_idx]
        starts = file_starts.get(n.file_idx)
        if starts is None:
            starts = file_starts[n.file_idx] = [0, *(np.flatnonzero(np.frombuffer(data, np.uint8) == 0x0A) + 1).tolist()]
        start = starts[n.line - 1]
        end = data.find(b"\n", start)
        return loads_obj(memoryview(data)[start:end if end >= 0 else len(data)])

    for fi, path in enumerate(files):
        file_nodes: list[Node] = []
        per_file.append(file_nodes)
        agent: str | None = None
        try:
            src = read_lines(path)  # a line over the limit is quarantined, never read
        except OSError as exc:
            if skipped is not None:
                skipped.append(unreadable(path, exc))
            agents.append(None)
            file_data.append(b"")
            continue
        load = FileLoad(path_str(path), FORMAT)
        take_long_lines(load, src)
        loads.append(load)
        spath = load.path
        data = src.data
        del src
        file_data.append(data)
        view = memoryview(data)
        find = data.find
        other = load.other_lines
        counted = message_lines = 0
        n_data = len(data)
        s, line_no = 0, 0
        while s <= n_data:
            e = find(b"\n", s)
            if e < 0:
                e = n_data
            line_no += 1
            if e == s or (data[s] != 0x7B and not nonblank(data[s:e])):  # 0x7B: "{"
                s = e + 1
                continue
            counted += 1
            o = plain_object(data, view, s, e, line_no == 1)
            if o is not NOT_PLAIN:
                raw: str | None = None  # a plain line: its text is its bytes, decoded when kept
                objs: list[Any] = [o]
            else:
                got = read_line(load, line_no, data[s:e], text=False, plain=False)
                if got is None:
                    s = e + 1
                    continue
                raw, objs = got
            kinds: list[str] = []
            for k, o in enumerate(objs):
                if not isinstance(o, dict):
                    kinds.append(bad("not_an_object", "not an object"))
                    continue
                wrong = entry_problem(o)
                if wrong is not None:
                    kinds.append(wrong)
                    continue
                t = o["type"]
                uid = o.get("uuid")
                if not isinstance(uid, str) or not uid:
                    if t in MESSAGE_TYPES:
                        uid = f"L{fi}:{line_no}.{k}"
                    elif fi and earlier.holds(data[s:e]):
                        stats["duplicate_entries"] += 1
                        kinds.append("duplicate_entry")
                        continue
                    else:
                        kinds.append(_kind(o))
                        continue
                conflict = ""
                if uid in nodes:
                    first = nodes[uid]
                    if obj_of(first) == o:
                        # the same entry written twice (resumed sessions, backup copies): read once
                        stats["duplicate_entries"] += 1
                        kinds.append("duplicate_entry")
                        continue
                    conflict = "~" + hashlib.sha256(json_text(o).encode()).hexdigest()[:8]
                    if uid + conflict in nodes:
                        stats["duplicate_entries"] += 1
                        kinds.append("duplicate_entry")
                        continue
                    stats["conflicting_duplicate_entries"] += 1
                    load.recovered.append({"file": load.path, "line": line_no, "note": (
                        f"entry uuid {uid!r} was read before ({path_str(files[first.file_idx])} line {first.line}) "
                        f"with other content; kept apart as {uid + conflict!r}")})
                    uid += conflict
                node = make_node(o, uid, fi, line_no, "", conflict)
                nodes[uid] = node
                file_nodes.append(node)
                if agent is None:
                    aid = o.get("agentId")
                    if isinstance(aid, str) and aid:
                        agent = aid
                if node.is_message:
                    if raw is None:
                        end = e
                        while end > s and data[end - 1] == 0x0D:  # a line's text ends before its \r
                            end -= 1
                        entries.add(node, o, spath, data, s, end)
                    else:
                        entries.add(node, o, spath, raw.encode("utf-8"))
                    kinds.append("message")
                else:
                    kinds.append(_kind(o))
                if raw is None:
                    node.obj = None  # parsed again from its line if a later copy must be compared
            if len(kinds) == 1 and kinds[0][0] != "!":
                if kinds[0] == "message":
                    message_lines += 1
                else:
                    other[kinds[0]] += 1
            else:
                load.account(line_no, raw if raw is not None else line_text(data[s:e]), kinds)
            s = e + 1
        load.lines += counted
        load.message_lines += message_lines
        agents.append(agent)
        earlier.pending.append(data)
        load.check()
    clock.lap("lines and entries")
    out = _threads(files, session_id, per_file, agents, nodes, stats, open_sidechains)
    clock.lap("threads")
    return out, loads, dict(stats)


def _threads(files: list[Path], session_id: str, per_file: list[list[Node]], agents: list[str | None],
             nodes: dict[str, Node], stats: Counter[str], open_sidechains: bool) -> list[ThreadPlan]:
    # groups of assistant entries by request, and results by the tool_use they answer
    by_key: dict[str, list[Node]] = defaultdict(list)
    result_by_tool_id: dict[str, list[Node]] = defaultdict(list)
    for fn in per_file:
        for n in fn:
            if n.type == "assistant" and n.msg_key:
                by_key[n.msg_key].append(n)
            for tid in n.tool_result_ids:
                result_by_tool_id[tid].append(n)

    prev_in_file: dict[str, str] = {}
    for fn in per_file:
        for a, b in pairwise(fn):
            prev_in_file[b.uuid] = a.uuid

    threads: list[ThreadPlan] = []
    covered: set[str] = set()
    claimed: set[str] = set()
    for fi, path in enumerate(files):
        main_file = _is_main_file(path, session_id)
        first_thread = True
        # the main chain ends at the last non-sidechain message; inline sidechains (1.0.x) after
        tips = [n for n in reversed(per_file[fi]) if n.is_message]
        if main_file:
            tips = [n for n in tips if not n.sidechain] + [n for n in tips if n.sidechain]
        used: set[str] = set()
        for tip in tips:
            if tip.uuid in covered:
                continue
            entries, compaction_at = build_thread(tip, nodes, by_key, result_by_tool_id, prev_in_file, stats)
            first_own = next((n for n in entries if n.is_message and n.uuid not in covered), tip)
            covered.update(n.uuid for n in entries)
            msgs, compactions = thread_messages(entries, compaction_at)
            # local notices (is_call False from the start) are no call of any thread
            roles = [m.role for m in msgs if m.is_call is not False]
            answers = [m for m in msgs if m.role == "assistant" and m.is_call is not False]
            own = [m for m in answers if m.msg_key not in claimed]
            for m in answers:
                # a request another thread reports stays a call of this path (its numbering and
                # the layers' state follow the path), but only its owner reports it
                m.inherited = m.msg_key in claimed
                m.is_call = not m.inherited
            if not own and not first_thread and not (open_sidechains and main_file and tip.sidechain
                                                     and opens_sidechain(roles)):
                stats["branches_without_calls"] += 1
                continue
            claimed.update(m.msg_key for m in own if m.msg_key)
            # names stay stable as the file grows: a branch is named after its first own message,
            # an inline sidechain after its root
            base = "main" if main_file else _agent_thread_id(path, agents[fi])
            if first_thread:
                tid = base
            elif tip.sidechain and main_file:
                tid = f"sidechain-{entries[0].uuid[:8]}"
                if tid in used:
                    tid = f"{tid}-branch-{first_own.uuid[:8]}"
            else:
                tid = f"branch-{first_own.uuid[:8]}" if main_file else f"{base}-branch-{first_own.uuid[:8]}"
            used.add(tid)
            first_thread = False
            threads.append(ThreadPlan(session_id, tid, FORMAT, path_str(path), msgs, compactions))
    stats["off_thread_message_entries"] += sum(
        1 for fn in per_file for n in fn if n.is_message and n.uuid not in covered)
    return threads


def opens_sidechain(roles: list[Any]) -> bool:
    """An inline sidechain's path whose first request awaits its answer: messages, none of them
    the assistant's (`load_sessions`' `open_sidechains`)."""
    return bool(roles) and "assistant" not in roles


@dataclass
class ThreadBuild:
    """What `build_thread` decided for one thread, kept so that the thread can be extended when
    entries are appended (`extend_thread`, the live engine): the tip, the entries taken (`seen`:
    chain and recovered), the tool call ids of its answers, those answered (on the chain, or by a
    recovered result), the msg keys of its answers, and whether a later node cannot change the walk
    (`at_root`: it stopped at a node without parent that is not a compaction boundary, and crossed
    each boundary by a logical parent present, or by the file's order where it names none)."""

    tip: str
    seen: set[str]
    tool_ids: set[str]
    answered: set[str]
    keys: set[str]
    at_root: bool


def build_thread(tip: Node, nodes: dict[str, Node], by_key: dict[str, list[Node]],
                  result_by_tool_id: dict[str, list[Node]], prev_in_file: dict[str, str],
                  stats: Counter[str], keep: list[ThreadBuild] | None = None) -> tuple[list[Node], set[str]]:
    """A thread's entries, in order: the tip's ancestry (a compaction boundary crossed through its
    logical parent), then the entries its answers' other lines hold and the tool results that
    answer their calls (parallel tool calls sit off the chain); and its compaction boundaries.
    `keep`: the build's bookkeeping is appended to it (ThreadBuild)."""
    chain: list[Node] = []
    seen: set[str] = set()
    boundaries: set[str] = set()
    get = nodes.get
    cur: Node | None = tip
    at_root, fixed = False, True  # fixed: every boundary crossed by a reference that later lines cannot change
    while cur is not None:
        u = cur.uuid
        if u in seen:
            break
        seen.add(u)
        chain.append(cur)
        nxt = cur.parent
        if nxt is None:
            if cur.type != "system" or cur.subtype != "compact_boundary":
                at_root = True
                break
            boundaries.add(u)
            nxt = cur.logical_parent
            if nxt is not None and nxt not in nodes:
                fixed = False
            if (nxt is None or nxt not in nodes) and u in prev_in_file:
                # logicalParentUuid missing or pointing nowhere: the conversation before the boundary
                # is what the file holds right before it
                stats["compact_boundary_parent_from_file_order"] += 1
                nxt = prev_in_file[u]
            if nxt is None:
                break
        cur = get(nxt)
        if cur is None:
            stats["parent_not_found"] += 1
    chain.reverse()
    answered: set[str] = set()
    for n in chain:
        if n.tool_result_ids:
            answered.update(n.tool_result_ids)
    recovered, tool_ids, keys = _siblings(chain, by_key, seen)
    recovered += _recover_results(sorted(tool_ids), answered, seen, result_by_tool_id, stats)
    if keep is not None:
        keep.append(ThreadBuild(tip.uuid, seen, tool_ids, answered, keys, at_root and fixed))
    # order: files in the order the chain reaches them, then file line
    file_rank: dict[int, int] = {}
    for n in chain:
        if n.file_idx not in file_rank:
            file_rank[n.file_idx] = len(file_rank)
    entries = chain + recovered
    if len(file_rank) == 1 and all(n.file_idx == tip.file_idx for n in recovered):
        entries.sort(key=_line_order)
    else:
        rank, other = file_rank.get, len(file_rank)
        entries.sort(key=lambda n: (rank(n.file_idx, other), n.line, n.uuid))
    return entries, boundaries


def _siblings(chain: list[Node], by_key: dict[str, list[Node]], seen: set[str]) -> tuple[list[Node], set[str], set[str]]:
    """The other lines of the chain's answers (added to `seen`), the tool call ids they all hold,
    and the answers' msg keys."""
    recovered: list[Node] = []
    tool_ids: set[str] = set()
    keys: set[str] = set()
    for n in chain:
        if n.type == "assistant" and n.msg_key:
            keys.add(n.msg_key)
            sibs = by_key.get(n.msg_key, ())
            for sib in sibs:
                if sib.uuid not in seen:  # (the chain is in `seen`)
                    seen.add(sib.uuid)
                    recovered.append(sib)
            for sib in sibs:
                if sib.tool_use_ids:
                    tool_ids.update(sib.tool_use_ids)
    return recovered, tool_ids, keys


def _recover_results(tool_ids: list[str], answered: set[str], seen: set[str],
                     result_by_tool_id: dict[str, list[Node]], stats: Counter[str]) -> list[Node]:
    """For each call not answered on the chain (in this order), the first result entry not taken
    yet (parallel tool calls: their results sit off the chain); `answered` and `seen` updated."""
    recovered: list[Node] = []
    for tid in tool_ids:
        if tid in answered:
            continue
        for r in result_by_tool_id.get(tid, []):
            if r.uuid not in seen:
                seen.add(r.uuid)
                recovered.append(r)
                answered.add(tid)
                stats["recovered_parallel_results"] += 1
                break
    return recovered


def extend_thread(b: ThreadBuild, tip: Node, fresh: set[str], nodes: dict[str, Node],
                  by_key: dict[str, list[Node]], result_by_tool_id: dict[str, list[Node]],
                  old_ids: set[str]) -> tuple[list[Node], ThreadBuild] | None:
    """The entries `build_thread` adds to the thread of `b` (one file) once the nodes `fresh` were
    read after it, in order, and the new bookkeeping; None where it cannot be said without building
    the thread again. It can where the build provably gives the old thread with entries appended:
    the old walk cannot change (`at_root`); the new tip's ancestry reaches the old tip through fresh
    nodes, and old entries that are not messages and not in the thread; a fresh line of an old
    answer is on that path; a fresh result answers no call the old thread had answered; the fresh
    answers' call ids are new (`old_ids`: every tool id read before); fresh lines come after the old
    ones in the file."""
    if not b.at_root:
        return None
    path: list[Node] = []
    cur: Node | None = tip
    while cur is not None and cur.uuid != b.tip:
        if cur.parent is None:  # a root, a boundary: not the old thread's ancestry
            return None
        if cur.uuid not in fresh and (cur.is_message or cur.uuid in b.seen or cur.tool_use_ids
                                      or cur.tool_result_ids):
            return None  # a branch off the thread
        path.append(cur)
        cur = nodes.get(cur.parent)
    if cur is None:
        return None
    on_path = {n.uuid for n in path}
    for uid in fresh:
        n = nodes[uid]
        if n.type == "assistant" and n.msg_key in b.keys and uid not in on_path:
            return None  # another line of an old answer, off the thread's end
        if not b.answered.isdisjoint(n.tool_result_ids):
            return None
    path.reverse()
    seen = b.seen | on_path
    answered = b.answered | {t for n in path for t in n.tool_result_ids}
    recovered, _, keys = _siblings(path, by_key, seen)
    if any(n.uuid not in fresh for n in recovered):
        return None
    tool_ids = {t for n in [*path, *recovered] if n.type == "assistant" for t in n.tool_use_ids}
    if not tool_ids.isdisjoint(old_ids):
        return None
    # the calls the old thread left unanswered come in again: a fresh result may answer them now
    todo = sorted(tool_ids | (b.tool_ids - b.answered))
    recovered += _recover_results(todo, answered, seen, result_by_tool_id, Counter())
    entries = sorted([*path, *recovered], key=_line_order)
    return entries, ThreadBuild(tip.uuid, seen, b.tool_ids | tool_ids, answered, b.keys | keys, True)


def _line_order(n: Node) -> tuple[int, str]:
    return n.line, n.uuid


def thread_messages(entries: list[Node], boundaries: set[str]) -> tuple[list[MessagePlan], list[Compaction]]:
    """The messages of a thread's entries (stored in an `Entries`): the assistant entries of one
    request (split over several lines) make one message, with the usage of its largest copy and the
    last stop_reason given; a compaction boundary ends what the calls after it see."""
    msgs: list[MessagePlan] = []
    group_index: dict[str, int] = {}
    compactions: list[Compaction] = []
    for n in entries:
        if not n.is_message:
            if boundaries and n.uuid in boundaries:
                b = len(msgs)
                if b > 0:
                    compactions.append(Compaction(at=b - 1, keep_from=b))
            continue
        if n.type == "assistant" and n.msg_key:
            k = group_index.get(n.msg_key)
            if k is not None:
                g = msgs[k]
                g.members.append(n)
                if n.utotal >= g.usage_node.utotal:
                    g.usage_node = n
                if n.stop:
                    g.stop_node = n
                continue
            group_index[n.msg_key] = len(msgs)
        msgs.append(MessagePlan([n], n, n, n.role, n.msg_key, n.line, is_call=False if n.local else None))
    return msgs, compactions
