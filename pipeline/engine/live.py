"""The engine's live path: a call appended without a pipeline pass (docs/engine.md, "What a call costs").

A pipeline pass (load the session's spool, run every stage with the ledger's view) costs about as
much as replaying the session whole, and a third of it is fixed (the stages' polars plans). The usual
live step is smaller than that: the answer to the last request, and the tool results or user message
that follow it, appended at the end of the main thread of a Claude Code session; and in most calls
no layer decides anything about them. This module recognises such a step and gives the engine the
rows the batch loader would have added, so that the request is shaped from the kept replay state
plus those rows, with no pass:

- `TailScan` reads each spool line once, the way `claude_code.load_session` reads it (`read_line`,
  `entry_problem`, `make_node`), keeps the loader's maps of the entries, and builds the main thread
  with the loader's own `build_thread`: a step is live when that thread is the last step's with
  the new message entries appended;
- `new_rows` turns the appended message entries into block rows with the loader's own code
  (`thread_messages`, `threads_to_blocks`), at the positions and call numbers the whole file gives them;
- one check per built-in stage (`QUIET`) says, in plain Python over those rows and a few figures the
  last pass measured (`ThreadFacts`), that the stage decides nothing at any of the new calls. A check
  answers with the reason when it cannot say so, and the engine runs a full pass.

Every check is conservative: it accepts only rows on which its stage provably makes no decision
(the conditions below follow each stage's own expressions), so a wrong "quiet" cannot come from a
case the check did not think of, only a full pass that was not needed. A stage without a check (a
plug-in, auto_compact) always means a full pass. tests/test_engine_live.py puts each condition on
both sides of its threshold and compares the requests with `ctxreplay run`.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import polars as pl

from ctxreplay.pipeline.core.constants import CLEARED_TEXT, MAGIC_STRING_PATTERN, MESSAGE_OVERHEAD_TOKENS
from ctxreplay.pipeline.core.tokens import TokenCounter, is_image_expr, row_tokens
from ctxreplay.pipeline.loaders.base import (
    ORDER_STRIDE,
    FileLoad,
    Thread,
    path_str,
    read_line,
    threads_to_blocks,
)
from ctxreplay.pipeline.loaders.claude_code import (
    FORMAT,
    MESSAGE_TYPES,
    Node,
    build_thread,
    entry_problem,
    make_node,
    thread_messages,
)
from ctxreplay.pipeline.stageapi.registry import StageContext
from ctxreplay.pipeline.targets import target_family

MAIN = "main"
FIRST_OBJECTS = 5  # the loaders sniff a file's format and session id from its first objects
_NONBLANK = re.compile(r"\S")  # Python's whitespace holds polars' (Rust's): \S here is non-blank there
_MAGIC = re.compile(MAGIC_STRING_PATTERN)
_MAGIC_HEAD = "ANTHROPIC_MAGIC_STRING_TRIGGER"
_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # TOOL_NAME_PATTERN, matched whole (no trailing newline)


def _nonblank(v: Any) -> bool:
    return isinstance(v, str) and _NONBLANK.search(v) is not None


# ---------------------------------------------------------------------------------------------
# reading the spool


@dataclass
class TailScan:
    """The entries of one spool file read so far, kept as `claude_code.load_session` keeps them
    (nodes by uuid, assistant entries by message key, results by the tool call they answer, the
    previous entry in the file), so that the main thread can be built with the loader's own
    `build_thread`. `thread` holds the message entries of the main thread at the last step.
    `regular` turns false for good at the first line the live path cannot follow (a line the
    loader quarantines or repairs, a message without uuid, a uuid read twice)."""

    path: Path
    scanned: int = 0
    regular: bool = True
    nodes: dict[str, Node] = field(default_factory=dict)
    by_key: dict[str, list[Node]] = field(default_factory=dict)
    result_by_tool_id: dict[str, list[Node]] = field(default_factory=dict)
    prev_in_file: dict[str, str] = field(default_factory=dict)
    last_uuid: str | None = None
    tip: str | None = None  # the last message entry that is not a sidechain: where the main thread ends
    thread: list[str] = field(default_factory=list)  # uuids of the main thread's message entries
    msg_keys: set[str] = field(default_factory=set)
    tool_ids: set[str] = field(default_factory=set)  # tool_use and tool_result ids

    def scan(self, lines: list[bytes]) -> tuple[list[Node], str | None]:
        """Read lines[scanned:] (the state follows them whatever they are). Returns the message
        nodes among them and None when the main thread is the one of the last step with them
        appended, or the reason why not."""
        why: str | None = None
        if not self.regular:
            why = "an earlier line of this file was not a plain transcript entry"
        elif self.scanned < FIRST_OBJECTS:
            why = f"the file had fewer than {FIRST_OBJECTS} entries (its format is sniffed from its first ones)"
        new: list[Node] = []
        keys: set[str] = set()
        ids: set[str] = set()
        while self.scanned < len(lines):
            i = self.scanned
            self.scanned += 1
            node = self._read(lines[i], i + 1)
            if isinstance(node, str):
                why = why or node
                continue
            if node is None:
                continue  # an entry without uuid (not a message): the loader only counts it
            self._add(node)
            if node.type == "system" and node.subtype == "compact_boundary":
                why = why or "a compaction boundary"
            if node.is_message:
                if node.sidechain:
                    why = why or "a sidechain message"
                if node.msg_key in self.msg_keys and node.msg_key not in keys:
                    why = why or "an answer continues a message read before"
                if node.obj.get("isCompactSummary"):
                    why = why or "a compaction summary"
                for t in (*node.tool_use_ids, *node.tool_result_ids):
                    if t in self.tool_ids and t not in ids:
                        why = why or "a tool id of an earlier entry"
                new.append(node)
            if node.msg_key:
                keys.add(node.msg_key)
            ids.update(node.tool_use_ids, node.tool_result_ids)
        self.msg_keys |= keys
        self.tool_ids |= ids
        old = self.thread
        self.thread = self.main_thread()
        if why is None and (not old or self.thread[:len(old)] != old
                            or self.thread[len(old):] != _row_order([n for n in new])):
            why = "an entry that does not continue the main thread (a rewind, a branch)"
        return new, why

    def main_thread(self) -> list[str]:
        """The message entries of the main thread as the loader builds it (its last message
        entry's ancestry, parallel tool calls and their results recovered), in the order of their
        rows (the entries of a message split over several lines together, at its first)."""
        if self.tip is None:
            return []
        entries, boundaries = build_thread(self.nodes[self.tip], self.nodes, self.by_key,  # type: ignore[arg-type]
                                            self.result_by_tool_id, self.prev_in_file, Counter())  # type: ignore[arg-type]
        return _row_order([n for n in entries if n.is_message and n.uuid not in boundaries])

    def _add(self, node: Node) -> None:
        self.nodes[node.uuid] = node
        if node.type == "assistant" and node.msg_key:
            self.by_key.setdefault(node.msg_key, []).append(node)
        for tid in node.tool_result_ids:
            self.result_by_tool_id.setdefault(tid, []).append(node)
        if self.last_uuid is not None:
            self.prev_in_file[node.uuid] = self.last_uuid
        self.last_uuid = node.uuid
        if node.is_message and not node.sidechain:
            self.tip = node.uuid

    def _read(self, raw: bytes, line: int) -> Node | str | None:
        """One line as the loader reads it: its node, None (an entry without uuid that is not a
        message), or why the live path cannot take it (the file stops being regular)."""
        load = FileLoad(path_str(self.path), FORMAT)
        got = read_line(load, line, raw) if raw.strip() else None
        o = got[1][0] if got is not None and len(got[1]) == 1 else None
        if (not isinstance(o, dict) or load.quarantine or load.recovered or any(load.stats.values())
                or entry_problem(o) is not None):
            self.regular = False
            return f"line {line} is not a plain transcript entry"
        uid = o.get("uuid")
        if not isinstance(uid, str) or not uid:
            if o["type"] in MESSAGE_TYPES:
                self.regular = False
                return f"line {line}: a message without uuid"
            return None
        if uid in self.nodes:
            self.regular = False
            return f"line {line}: uuid {uid} read before"
        return make_node(o, uid, 0, line, got[0])  # type: ignore[index]


# ---------------------------------------------------------------------------------------------
# what the last pass measured


@dataclass
class ThreadFacts:
    """The main thread as the last pass (and the live steps since) left it: what the stage checks
    and the row numbering need."""

    session_id: str
    source_file: str
    messages: int  # messages of the thread (the next one's entry_order)
    calls: int  # the pending call's index
    tool_ids: set[str]  # tool-call ids as loaded and as the stages left them
    images: int  # rows holding an image
    has_thinking: bool
    unsettled_tail: bool  # an assistant message without content after the last message with content
    decided: dict[str, int]  # decisions applied in the thread, by stage position
    pending_decisions: int  # decisions at the pending call (provisional until the next call)
    keyed: bool  # the thread's calls have keys (its decisions are written with the call's key)
    measures: dict[str, Measure]  # what each token-triggered position sees at the pending call
    schema: dict[str, pl.DataType]  # the final blocks' columns

    def grow(self, new: NewRows, min_chars: int) -> None:
        """The facts after a live step appended `new` (no stage decided anything about it)."""
        self.messages += len(new.messages)
        self.calls = new.calls
        self.tool_ids.update(r["tool_use_id"] for r in new.rows if r["tool_use_id"] is not None)
        self.has_thinking = self.has_thinking or any(r["block_type"] == "thinking" for r in new.rows)
        self.unsettled_tail = unsettled_tail(new.frame)
        self.pending_decisions = 0
        for name, m in self.measures.items():
            self.measures[name] = m.grown(new, min_chars)


MEASURED = ("snip", "tombstone")  # stages whose trigger is the request's token count


@dataclass
class Measure:
    """What a token-triggered stage sees at the pending call, measured on the blocks it leaves
    (snip: as long as it has not fired, its input; tombstone: its input with its clearings applied;
    snip's dry run of tombstone: that run's output over snip's input): the request's tokens, and the
    tool results tombstone could still clear, counted before and after the latest real user message
    (tombstone never clears the current tool loop, so those after it become clearable only when a
    user message comes). "Could still clear": not cleared, and not before the last result tombstone
    cleared (its frontier only moves forward; results it cleared from their first appearance on
    are the transcript's own and do not move it). The counts and tokens are upper bounds: every
    such result long enough (min_result_chars) or holding an image, whatever its tool, pin or age,
    with all its rows' tokens (tombstone frees at most that per result)."""

    tokens: int
    u_order: int | None  # order_key of the latest real user message (None: none yet)
    before: tuple[int, int]  # (results, tokens) before it
    after: tuple[int, int]  # (results, tokens) after it

    def grown(self, new: NewRows, min_chars: int) -> Measure:
        """The same after the appended rows."""
        users = [m[0]["order_key"] for m in new.messages if _real_user(m)]
        cands = _candidates(new, min_chars)
        tokens = self.tokens + new.request_tokens
        if not users:  # the current tool loop goes on: every new result is in it
            return Measure(tokens, self.u_order, self.before, _count(self.after, cands))
        u = users[-1]  # a new tool loop: what came before its user message is outside it
        before = _count((self.before[0] + self.after[0], self.before[1] + self.after[1]),
                        [c for c in cands if c[0] < u])
        return Measure(tokens, u, before, _count((0, 0), [c for c in cands if c[0] > u]))


def _count(acc: tuple[int, int], cands: list[tuple[int, int, int]]) -> tuple[int, int]:
    """(results, tokens) plus the candidates (order_key, tokens, size)."""
    return acc[0] + len(cands), acc[1] + sum(c[1] for c in cands)


def _real_user(msg: list[dict[str, Any]]) -> bool:
    return msg[0]["role"] == "user" and not any(r["block_type"] == "tool_result" for r in msg)


def _candidates(new: NewRows, min_chars: int) -> list[tuple[int, int, int]]:
    """(order_key, tokens, size) of each new tool result tombstone might clear."""
    out: dict[tuple[str, int], list[int]] = {}
    for r, tok in zip(new.rows, new.tokens, strict=True):
        if r["block_type"] != "tool_result":
            continue
        c = out.setdefault((r["entry_id"], r["block_pos"]), [r["order_key"], 0, 0])
        c[1] += tok
        c[2] += len(r["text"]) if isinstance(r["text"], str) else 0
    return [(o, t, n) for o, t, n in out.values() if n >= min_chars]


def measure(blocks: pl.DataFrame, session_id: str, call: int, counter: TokenCounter, min_chars: int) -> Measure:
    """The Measure of the main thread's call `call` in `blocks`. Tokens as
    ctxreplay.pipeline.stageapi.calls.request_tokens counts them (the rows visible at the call plus an overhead per
    message visible there); the latest real user message as ctxreplay.pipeline.stageapi.calls.messages finds it; what
    tombstone cleared as its own walk reads it (part 0 of a result replaced by the placeholder)."""
    t = blocks.filter((pl.col("session_id") == session_id) & (pl.col("thread_id") == MAIN))
    t = t.with_columns(_tok=row_tokens(t, counter))
    vis = t.filter((pl.col("first_call") <= call) & (pl.col("last_call").is_null() | (pl.col("last_call") > call)))
    rows = int(vis.get_column("_tok").sum() or 0)
    msgs = t.group_by("msg_key").agg(
        order=pl.col("order_key").min(), first=pl.col("first_call").min(),
        last=pl.when(pl.col("last_call").is_null().any()).then(None).otherwise(pl.col("last_call").max()),
        real=(pl.col("role").first() == "user") & ~(pl.col("block_type") == "tool_result").any()
        & (pl.col("origin").first() != "snip"))
    n = msgs.filter((pl.col("first") <= call) & (pl.col("last").is_null() | (pl.col("last") > call))).height
    u = msgs.filter(pl.col("real") & (pl.col("first") <= call)).get_column("order").max()
    res = t.filter(pl.col("block_type") == "tool_result")
    cleared = (pl.col("part_pos") == 0) & (pl.col("text") == CLEARED_TEXT)
    res = res.group_by("entry_id", "block_pos").agg(
        order=pl.col("order_key").min(), a=pl.col("first_call").min(), tok=pl.col("_tok").sum(),
        size=pl.col("text").str.len_chars().fill_null(0).sum(), img=is_image_expr().fill_null(False).any(),
        done_call=pl.col("first_call").filter(cleared).min(),
        done_epoch=pl.col("cache_epoch").filter(cleared).sort_by(pl.col("first_call").filter(cleared)).first(),
    ).with_columns(done=pl.col("done_call").is_not_null())
    own = res.filter(pl.col("done") & ~((pl.col("done_call") == pl.col("a")) & (pl.col("done_epoch") == 0)))
    frontier = own.get_column("order").max()
    res = res.filter(~pl.col("done") & ((pl.col("size") >= min_chars) | pl.col("img")))
    if frontier is not None:
        res = res.filter(pl.col("order") >= frontier)
    u_order = None if u is None else int(u)  # type: ignore[arg-type]
    first = res.filter(pl.col("order") < u_order) if u_order is not None else res.clear()
    second = res.filter(pl.col("order") >= u_order) if u_order is not None else res
    return Measure(rows + MESSAGE_OVERHEAD_TOKENS * n, u_order,
                   (first.height, int(first.get_column("tok").sum() or 0)),
                   (second.height, int(second.get_column("tok").sum() or 0)))


def thread_facts(loaded: pl.DataFrame, final: pl.DataFrame, applied: pl.DataFrame, session_id: str, calls: int,
                 measures: dict[str, Measure], keyed: bool) -> ThreadFacts | None:
    """The facts of the session's main thread after a full pass (None: it has none)."""
    mine = (pl.col("session_id") == session_id) & (pl.col("thread_id") == MAIN)
    rows = loaded.filter(mine)
    if not rows.height:
        return None
    files = rows.get_column("source_file").unique().to_list()
    out = final.filter(mine)
    ids = set(rows.get_column("tool_use_id").drop_nulls().to_list()) | \
        set(out.get_column("tool_use_id").drop_nulls().to_list())
    image = (pl.col("block_type") == "image") | (pl.col("part_type") == "image") | pl.col("image_data").is_not_null()
    dec = applied.filter(mine)
    decided = dict(dec.group_by("stage").len().iter_rows()) if dec.height else {}
    return ThreadFacts(
        session_id=session_id, source_file=files[0] if len(files) == 1 else "",
        messages=int(rows.get_column("entry_order").max()) + 1,  # type: ignore[arg-type,operator]
        calls=calls, tool_ids=ids, images=rows.filter(image.fill_null(False)).height,
        has_thinking=bool(rows.get_column("block_type").is_in(["thinking", "redacted_thinking"]).any()),
        unsettled_tail=unsettled_tail(rows), decided=decided,
        pending_decisions=dec.filter(pl.col("from_call") >= calls).height if dec.height else 0, keyed=keyed,
        measures=dict(measures), schema=dict(final.schema))


def _row_order(entries: list[Node]) -> list[str]:
    """Message entries in the order of their rows: `claude_code.thread_messages` puts every assistant
    entry of one message (its key) at the message's first."""
    groups: dict[str, list[str]] = {}
    for n in entries:
        key = n.msg_key if n.type == "assistant" and n.msg_key else n.uuid
        groups.setdefault(key, []).append(n.uuid)
    return [u for g in groups.values() for u in g]


def thread_entries(loaded: pl.DataFrame, session_id: str) -> list[str]:
    """The entry ids of the main thread's messages in the loaded blocks, in order (a message split
    over several lines gives each line's entry)."""
    rows = loaded.filter((pl.col("session_id") == session_id) & (pl.col("thread_id") == MAIN))
    return rows.sort("entry_order", "block_pos", "part_pos").get_column("entry_id").unique(maintain_order=True).to_list()


def unsettled_tail(rows: pl.DataFrame) -> bool:
    """Sanitize decides a failed (empty) assistant turn from the first call that sees a later
    message with content: true when such a message could still come for one (an assistant message
    after the last message with content; content as sanitize counts it, blank texts and
    placeholders not)."""
    content = ~pl.col("block_type").str.to_lowercase().is_in(["null", "none", "", "empty"]) & ~(
        (pl.col("block_type") == "text") & (pl.col("text").is_null() | (pl.col("text").str.strip_chars() == "")))
    msgs = rows.group_by("entry_order").agg(content=content.fill_null(False).any(),
                                            assistant=(pl.col("role") == "assistant").any())
    last = msgs.filter("content").get_column("entry_order").max()
    after = msgs if last is None else msgs.filter(pl.col("entry_order") > last)
    return bool(after.get_column("assistant").any())


# ---------------------------------------------------------------------------------------------
# the appended rows


@dataclass
class NewRows:
    """The rows of the appended messages, in thread order, with what the checks read."""

    frame: pl.DataFrame
    rows: list[dict[str, Any]]
    tokens: list[int]  # per row
    messages: list[list[dict[str, Any]]]  # rows grouped by message, in order
    calls: int  # the pending call after them

    @property
    def request_tokens(self) -> int:
        """What they add to a request that holds them all (rows + an overhead per message)."""
        return sum(self.tokens) + MESSAGE_OVERHEAD_TOKENS * len(self.messages)


def new_rows(nodes: list[Node], facts: ThreadFacts, counter: TokenCounter) -> NewRows | str:
    """The block rows the loader gives the appended message entries at the end of the main thread
    (or why it cannot be said without a full load)."""
    msgs, compactions = thread_messages(nodes, set(), [Path(facts.source_file)])
    if compactions or not msgs:
        return "no message to append"
    for m in msgs:
        if m.role == "assistant":
            m.inherited, m.is_call = False, True
    if msgs[0].role != "assistant":
        return "the new entries add to the call already assembled (they do not start with an answer)"
    notes: list[dict[str, Any]] = []
    table = threads_to_blocks([Thread(facts.session_id, MAIN, FORMAT, facts.source_file, msgs)], notes)
    if notes:
        return "a field of a new entry did not fit its column"
    frame = pl.from_arrow(table)
    assert isinstance(frame, pl.DataFrame)
    names = set(table.column_names)
    frame = frame.with_columns(
        entry_order=pl.col("entry_order") + facts.messages,
        order_key=pl.col("order_key") + facts.messages * ORDER_STRIDE,
        first_call=(pl.col("first_call") + facts.calls).cast(pl.Int32),
    ).cast({c: d for c, d in facts.schema.items() if c in names})  # type: ignore[arg-type]
    rows = frame.to_dicts()
    tokens = row_tokens(frame, counter).to_list()
    grouped: list[list[dict[str, Any]]] = []
    for r in rows:
        if grouped and grouped[-1][0]["msg_key"] == r["msg_key"]:
            grouped[-1].append(r)
        else:
            grouped.append([r])
    return NewRows(frame, rows, tokens, grouped, int(frame.get_column("first_call").max()))  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# one check per built-in stage: None when the stage decides nothing at the new calls, else why

Check = Callable[[Any, StageContext, ThreadFacts, NewRows, "Spec"], str | None]


@dataclass(frozen=True)
class Spec:
    """What a check reads of the rest of the pipeline: each position's name, stage and params."""

    positions: tuple[tuple[str, str, Any], ...]  # (position name, stage name, params)

    def params_of(self, stage: str) -> Any:
        return next((p for _, s, p in self.positions if s == stage), None)



def _sanitize(p: Any, ctx: StageContext, facts: ThreadFacts, new: NewRows, spec: Spec) -> str | None:
    family = target_family(ctx.target or "anthropic")
    scrub = p.scrub_magic == "always" or (p.scrub_magic == "anthropic" and family == "anthropic")
    if facts.unsettled_tail:
        return "the thread ends with an assistant turn without content (sanitize decides it at the next message)"
    keeps_thinking = p.thinking_policy == "keep_signed" and family == "anthropic"
    if p.thinking_policy in ("drop_all_but_latest", "drop_all_but_current_tool_turn") and facts.has_thinking:
        return f"thinking in the thread under thinking_policy {p.thinking_policy}"
    filters = set(p.drop_rows_where)
    allowed = {t.strip().lower() for t in p.allowed_tools} if p.allowed_tools is not None else None
    for r in new.rows:
        bt, role, text = r["block_type"], r["role"], r["text"]
        if (r["is_display_only"] and ("display_only" in filters or ("assistant_display_only" in filters
                                                                    and role == "assistant"))) \
                or (r["is_meta"] and "meta" in filters) or (r["is_sidechain"] and "sidechain" in filters):
            return "a row the row filter drops"
        if bt == "text":
            if not _nonblank(text):
                return "a blank text block"
            if scrub and role == "user" and _MAGIC_HEAD in text:
                return "a magic string"
        elif bt == "thinking":
            if not (keeps_thinking and _nonblank(r["signature"])):
                return "a thinking block the thinking policy drops"
        elif bt == "tool_use":
            name = r["tool_name"]
            if not (_nonblank(r["tool_use_id"]) and _nonblank(r["tool_input"]) and r["tool_input"].strip() != "null"
                    and isinstance(name, str) and _TOOL_NAME.fullmatch(name)
                    and (allowed is None or name.lower() in allowed)):
                return "a tool call sanitize drops or renames"
        elif bt == "tool_result":
            if r["extra_json"] is not None or r["part_type"] not in ("string", "text"):
                return "a tool result with fields or parts sanitize changes"
            if scrub and isinstance(text, str) and _MAGIC_HEAD in text:
                return "a magic string"
        else:
            return f"a block of type {bt}"
    return None


def _inter_session(p: Any, ctx: StageContext, facts: ThreadFacts, new: NewRows, spec: Spec) -> str | None:
    if any(r["provenance_kind"] == "inter_session" for r in new.rows):
        return "a message from another session"
    return None


def _images(p: Any, ctx: StageContext, facts: ThreadFacts, new: NewRows, spec: Spec) -> str | None:
    if any(r["block_type"] == "image" or r["part_type"] == "image" or r["image_data"] is not None for r in new.rows):
        return "an image"
    if facts.images > p.max_images_per_request:
        return "more images in the thread than max_images_per_request"
    return None


def _pairing(p: Any, ctx: StageContext, facts: ThreadFacts, new: NewRows, spec: Spec) -> str | None:
    from ctxreplay.stages.pairing import FAILED_STOP_REASONS, map_tool_id, resolve_id_mode

    target = ctx.target or "anthropic"
    mode = resolve_id_mode(p.tool_id_mode, target)
    expecting: list[str] = []
    seen: set[str] = set()
    for msg in new.messages:
        role = msg[0]["role"]
        calls = [r for r in msg if r["block_type"] == "tool_use"]
        results = [r for r in msg if r["block_type"] == "tool_result"]
        if role == "assistant":
            if expecting:
                return "a tool call not answered before the next answer"
            stop = msg[0]["stop_reason"]
            if calls and isinstance(stop, str) and stop.lower() in FAILED_STOP_REASONS:
                return "a failed turn with tool calls"
            for r in calls:
                tid = r["tool_use_id"]
                if not _nonblank(tid) or tid in facts.tool_ids or tid in seen or map_tool_id(tid, 0, mode, target) != tid:
                    return "a tool-call id pairing rewrites"
                seen.add(tid)
                expecting.append(tid)
            if results:
                return "a tool result in an assistant message"
        elif role == "tool":
            blocks: dict[int, list[dict[str, Any]]] = {}
            for r in results:
                blocks.setdefault(r["block_pos"], []).append(r)
            for parts in blocks.values():
                tid = parts[0]["tool_use_id"]
                if not expecting or any(r["tool_use_id"] != tid for r in parts) or tid != expecting[0]:
                    return "a tool result out of its call's order"
                expecting.pop(0)
                for r in parts:
                    name = r["tool_name"]
                    if name is not None and not (_nonblank(name) and name.strip() == name):
                        return "a tool result name pairing rewrites"
        else:
            if expecting:
                return "a message between a tool call and its result"
            if calls or results:
                return "a tool block in a user message"
    if expecting:
        return "a tool call whose result has not arrived (pairing stands one in)"
    return None


def _result_budget(p: Any, ctx: StageContext, facts: ThreadFacts, new: NewRows, spec: Spec) -> str | None:
    cap = max(1, min(p.max_result_chars, int(p.max_window_share * ctx.window_tokens * 4)))
    groups: dict[Any, int] = {}
    sizes: dict[tuple[str, int], int] = {}
    frame = None
    for r in new.rows:
        if r["role"] == "assistant":
            frame = r["msg_key"]
        if r["block_type"] != "tool_result" or r["text"] is None or (r["part_type"] or "text") == "image":
            continue
        key = (r["msg_key"], r["block_pos"])
        sizes[key] = sizes.get(key, 0) + len(r["text"])
        if sizes[key] > cap:
            return "a tool result over max_result_chars"
        groups[(frame, r["first_call"])] = groups.get((frame, r["first_call"]), 0) + len(r["text"])
    if p.aggregate_max_chars > 0 and any(v > p.aggregate_max_chars for v in groups.values()):
        return "the results of one turn over aggregate_max_chars"
    return None


def _idle(params: Any, new: NewRows) -> str | None:
    """tombstone's idle trigger at the new calls: the last message of a call's new rows against the
    answer that starts the call (ms; quiet only below the threshold, whatever the rounding)."""
    if params is None or params.trigger_idle_seconds <= 0:
        return None
    limit_ms = max(params.trigger_idle_seconds, 1) * 1000
    by_call: dict[int, list[dict[str, Any]]] = {}
    for msg in new.messages:
        by_call.setdefault(msg[0]["first_call"], []).append(msg[0])
    for heads in by_call.values():
        asst = [m for m in heads if m["role"] == "assistant"]
        t_req, t_asst = heads[-1]["timestamp"], asst[-1]["timestamp"] if asst else None
        if t_req is None or t_asst is None:
            return "a message without timestamp (tombstone's idle trigger)"
        if (t_req - t_asst).total_seconds() * 1000 >= limit_ms:
            return "a request an idle period after the last answer (tombstone's idle trigger)"
    return None


def _tombstone_fires(p: Any, m: Measure | None, new: NewRows) -> str | None:
    """Whether tombstone may fire at a new call, from the Measure at the pending call: never while
    no result is clearable; else on the idle trigger, or on the token trigger when the results it
    could clear free clear_at_least_tokens."""
    if m is None:
        return "no measure of tombstone's input"
    after = m.grown(new, p.min_result_chars)
    if after.before[0] == 0:
        return None  # no result outside the current tool loop: nothing to clear, no trigger fires
    idle = _idle(p, new)
    if idle:
        return idle
    if p.trigger_tokens > 0 and after.tokens > p.trigger_tokens and (
            p.clear_tool_inputs or after.before[1] >= p.clear_at_least_tokens):
        return "the request passes tombstone's trigger_tokens with enough to clear"
    return None


def _snip(p: Any, ctx: StageContext, facts: ThreadFacts, new: NewRows, spec: Spec, name: str = "snip") -> str | None:
    if not p.enabled:
        return None
    # while snip has not fired, its measure is the request after its dry run of tombstone (measured
    # on that run's output at the last full pass), grown by the new rows as long as the dry run
    # does not fire at the new calls
    if facts.decided.get(name):
        return "snip decided in this thread already"
    m = facts.measures.get(name)
    if m is None:
        return "no measure of snip's input"
    if m.tokens + new.request_tokens > p.high_watermark * max(0, ctx.window_tokens - p.reserve_output_tokens):
        return "the request passes snip's high watermark"
    tomb = spec.params_of("tombstone")
    why = _tombstone_fires(tomb, m, new) if tomb is not None else None
    return f"snip's dry run of tombstone: {why}" if why else None


def _tombstone(p: Any, ctx: StageContext, facts: ThreadFacts, new: NewRows, spec: Spec,
               name: str = "tombstone") -> str | None:
    return _tombstone_fires(p, facts.measures.get(name), new)


QUIET: dict[str, Check] = {
    "sanitize": _sanitize,
    "inter_session": _inter_session,
    "images": _images,
    "pairing": _pairing,
    "result_budget": _result_budget,
    "snip": _snip,
    "tombstone": _tombstone,
}


def quiet(spec: Spec, ctx: StageContext, facts: ThreadFacts, new: NewRows, builtin: dict[str, bool]) -> str | None:
    """None when no stage of the pipeline decides anything at the new calls; else the first reason."""
    for name, stage, params in spec.positions:
        check = QUIET.get(stage) if builtin.get(name) else None
        if check is None:
            return f"stage {name} has no live check (a plug-in or a stage that always needs the whole session)"
        why = check(params, ctx, facts, new, spec, name) if stage in MEASURED else \
            check(params, ctx, facts, new, spec)
        if why:
            return f"{name}: {why}"
    return None
