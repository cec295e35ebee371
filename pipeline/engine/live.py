"""The engine's live path: a call appended without a pipeline pass (docs/engine.md, "What a call costs").

A pipeline pass (every stage over the whole session with the ledger's view) costs ~10 to 20 % of
replaying the session whole (bench/bench_engine.py: the stages' quick checks, and the plans of the
stages that decide), and more when the spool must be loaded again. The usual live step is smaller
than that: the answer to the last request, and the tool results or user message
that follow it, appended at the end of the main thread of a Claude Code session; and in most calls
no stage decides anything about them. This module recognises such a step and gives the engine the
rows the batch loader would have added, so that the request is shaped from the kept replay state
plus those rows, with no pass:

- `TailScan` reads each spool line once, the way `claude_code.load_sessions` reads it (`read_line`,
  `entry_problem`, `make_node`), keeps the loader's maps of the entries, and builds the main thread
  with the loader's own `build_thread`: a step is live when that thread is the last step's with
  the new message entries appended;
- `new_rows` turns the appended message entries into block rows with the loader's own code
  (`Entries`, `thread_messages`, `Entries.blocks`), at the positions and call numbers the whole file
  gives them (a full pass that a stage's rule asks for appends them to the rows it keeps: no load);
- each stage says itself whether it decides anything at the new calls: its live rule
  (`@stage(live=LiveRule(start, step))`, ctxreplay.pipeline.stageapi.live) starts from what the
  last full pass left (`start_rules`) and answers each step from what it carried (`step_rules`).
  This module names no stage: a pipeline position without a rule means a full pass.

Every rule is conservative: it answers "quiet" only for rows on which its stage provably makes no
decision, so a wrong "quiet" cannot come from a case the rule did not think of, only a full pass that
was not needed. tests/test_engine_live.py puts each built-in rule on both sides of its thresholds and
compares the requests with `ctxreplay run`; tests/test_live_rules.py checks every rule against full
passes.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import polars as pl

from ctxreplay.pipeline.core.tokens import TokenCounter, row_tokens
from ctxreplay.pipeline.loaders.base import ORDER_STRIDE, FileLoad, path_str, read_line
from ctxreplay.pipeline.loaders.claude_code import (
    FORMAT,
    MESSAGE_TYPES,
    Entries,
    Node,
    ThreadBuild,
    ThreadPlan,
    build_thread,
    entry_problem,
    extend_thread,
    make_node,
    thread_messages,
)
from ctxreplay.pipeline.stageapi.live import Live, LiveRows, LiveThread
from ctxreplay.pipeline.stageapi.registry import RegisteredStage, StageContext

MAIN = "main"
FIRST_OBJECTS = 5  # the loaders sniff a file's format and session id from its first objects


# ---------------------------------------------------------------------------------------------
# reading the spool


@dataclass
class _Built:
    """The last main thread: the loader's bookkeeping of its build, its row groups, its order."""

    build: ThreadBuild
    groups: set[str]
    order: list[str]
    last: str | None  # the key of its last row group


@dataclass
class TailScan:
    """The entries of one spool file read so far, kept as `claude_code.load_sessions` keeps them
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
    built: _Built | None = None  # how the last main thread was built (extended while it can be)

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
        added: list[Node] = []
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
            added.append(node)
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
        old = self.thread
        self.thread = self._extended(added)  # (before the new ids join tool_ids: it asks which are new)
        self.msg_keys |= keys
        self.tool_ids |= ids
        if why is None and (not old or self.thread[:len(old)] != old
                            or self.thread[len(old):] != _row_order([n for n in new])):
            why = "an entry that does not continue the main thread (a rewind, a branch)"
        return new, why

    def main_thread(self) -> list[str]:
        """The message entries of the main thread as the loader builds it (its last message
        entry's ancestry, parallel tool calls and their results recovered), in the order of their
        rows (the entries of a message split over several lines together, at its first)."""
        self.built = None
        if self.tip is None:
            return []
        keep: list[ThreadBuild] = []
        entries, boundaries = build_thread(self.nodes[self.tip], self.nodes, self.by_key,  # type: ignore[arg-type]
                                            self.result_by_tool_id, self.prev_in_file, Counter(),  # type: ignore[arg-type]
                                            keep)
        msgs = [n for n in entries if n.is_message and n.uuid not in boundaries]
        self.built = _Built(keep[0], {_group_key(n) for n in msgs}, _row_order(msgs),
                            _group_key(_last_group(msgs)) if msgs else None)
        return self.built.order

    def _extended(self, added: list[Node]) -> list[str]:
        """`main_thread()` after the nodes `added`: the last thread with the entries the loader's
        build appends (`claude_code.extend_thread`), or built again where that cannot be said."""
        b = self.built
        if b is None or self.tip is None:
            return self.main_thread()
        if not added and self.tip == b.build.tip:
            return b.order
        got = extend_thread(b.build, self.nodes[self.tip], {n.uuid for n in added}, self.nodes,  # type: ignore[arg-type]
                            self.by_key, self.result_by_tool_id, self.tool_ids)  # type: ignore[arg-type]
        if got is None:
            return self.main_thread()
        entries, build = got
        msgs = [n for n in entries if n.is_message]
        if not msgs:
            self.built = _Built(build, b.groups, b.order, b.last)
            return b.order
        groups = {_group_key(n) for n in msgs}
        shared = groups & b.groups
        # a message of the last thread that gets more lines: only its last, continued by the first new line
        if shared and (shared != {b.last} or _group_key(msgs[0]) != b.last):
            return self.main_thread()
        order = _row_order(msgs)
        self.built = _Built(build, b.groups | groups, b.order + order, _group_key(_last_group(msgs)))
        return self.built.order

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
# what the last pass left


@dataclass(frozen=True)
class Position:
    """One position of the pipeline as the live path sees it: its name in the run (`<stage>#2`
    for a second use), its stage, params and context (the peers it reads)."""

    name: str
    stage: RegisteredStage
    params: Any
    ctx: StageContext


@dataclass
class ThreadFacts:
    """The main thread as the last pass (and the live steps since) left it: the row numbering, the
    decisions of the pending call, and what each position's live rule carries."""

    session_id: str
    source_file: str
    messages: int  # messages of the thread (the next one's entry_order)
    calls: int  # the pending call's index
    pending_decisions: int  # decisions at the pending call (provisional until the next call)
    keyed: bool  # the thread's calls have keys (its decisions are written with the call's key)
    schema: dict[str, pl.DataType]  # the final blocks' columns
    carried: dict[str, Any]  # position name -> what its live rule carries (positions with a rule)
    answers: dict[str, str | None] = field(default_factory=dict)  # the last step's answers, by position

    def grow(self, new: LiveRows, carried: dict[str, Any]) -> None:
        """The facts after a live step appended `new` (no stage decided anything about it)."""
        self.messages += len(new.messages)
        self.calls = new.calls
        self.pending_decisions = 0
        self.carried = carried


def _rule_failed(pos: Position, what: str, exc: Exception) -> str:
    first = (str(exc).strip().splitlines() or [""])[0][:200]
    return f"the live rule of stage {pos.name} raised in {what} ({type(exc).__name__}: {first})"


def start_rules(positions: tuple[Position, ...], base: LiveThread, outs: dict[str, pl.DataFrame],
                mine: pl.Expr) -> dict[str, Any]:
    """What each position's rule carries after a full pass: its `start` over the thread as the
    pass left it at that position (`outs`: each position's output blocks). A plug-in's rule that
    raises carries a full pass (the step says why); a built-in's is a bug and raises."""
    carried: dict[str, Any] = {}
    for pos in positions:
        rule = pos.stage.live
        if rule is None:
            continue
        out = outs[pos.name]  # the same frame for positions that left their input as it was
        thread = base.with_blocks(base.measured("thread", lambda out=out: only(out, mine), out), pos.name)
        try:
            carried[pos.name] = rule.start(thread, pos.params, pos.ctx)
        except Exception as exc:
            if pos.stage.is_builtin:
                raise
            carried[pos.name] = Live.full_pass(_rule_failed(pos, "start", exc))
    return carried


def step_rules(positions: tuple[Position, ...], facts: ThreadFacts, new: LiveRows) -> tuple[str | None, dict[str, Any]]:
    """Every position's answer for the appended rows: (None, what each carries next) when no stage
    decides anything at the new calls, else (the first position's reason, {}). Every position is
    asked (`facts.answers` keeps each one's answer: None for quiet, else its reason)."""
    carried: dict[str, Any] = {}
    answers: dict[str, str | None] = {}
    for pos in positions:
        rule = pos.stage.live
        if rule is None:
            answers[pos.name] = "has no live rule (a stage that needs the whole session at every step)"
            continue
        prev = facts.carried.get(pos.name)
        if isinstance(prev, Live):  # its start could not say (a plug-in's rule that raised)
            answers[pos.name] = prev.reason
            continue
        try:
            ans = rule.step(prev, new, pos.params, pos.ctx)
        except Exception as exc:
            if pos.stage.is_builtin:
                raise
            ans = Live.full_pass(_rule_failed(pos, "step", exc))
        if not isinstance(ans, Live):
            ans = Live.full_pass(f"its live rule answered {type(ans).__name__}, not Live.quiet(...) or "
                                 f"Live.full_pass(...)")
        answers[pos.name] = ans.reason
        carried[pos.name] = ans.carry
    facts.answers = answers
    why = next(((n, r) for n, r in answers.items() if r is not None), None)
    if why is not None:
        n, r = why
        return (f"stage {n} {r}" if r.startswith("has no live rule") else f"{n}: {r}"), {}
    return None, carried


def thread_facts(loaded: pl.DataFrame, final: pl.DataFrame, applied: pl.DataFrame, session_id: str, calls: int,
                 keyed: bool, positions: tuple[Position, ...], outs: dict[str, pl.DataFrame],
                 count_tokens: Any) -> ThreadFacts | None:
    """The facts of the session's main thread after a full pass (None: it has none)."""
    mine = (pl.col("session_id") == session_id) & (pl.col("thread_id") == MAIN)
    rows = only(loaded, mine)
    if not rows.height:
        return None
    files = rows.get_column("source_file").unique().to_list()
    dec = only(applied, mine)
    base = LiveThread(session_id, MAIN, calls, "", tuple(p.name for p in positions), rows, rows, dec, count_tokens)
    return ThreadFacts(
        session_id=session_id, source_file=files[0] if len(files) == 1 else "",
        messages=int(rows.get_column("entry_order").max()) + 1,  # type: ignore[arg-type,operator]
        calls=calls, pending_decisions=dec.filter(pl.col("from_call") >= calls).height if dec.height else 0,
        keyed=keyed, schema=dict(final.schema), carried=start_rules(positions, base, outs, mine))


def _group_key(n: Node) -> str:
    """The key `_row_order` groups an entry by."""
    return n.msg_key if n.type == "assistant" and n.msg_key else n.uuid


def _last_group(entries: list[Node]) -> Node:
    """The first entry of the group `_row_order` puts last."""
    first: dict[str, Node] = {}
    for n in entries:
        first.setdefault(_group_key(n), n)
    return list(first.values())[-1]


def _row_order(entries: list[Node]) -> list[str]:
    """Message entries in the order of their rows: `claude_code.thread_messages` puts every assistant
    entry of one message (its key) at the message's first."""
    groups: dict[str, list[str]] = {}
    for n in entries:
        groups.setdefault(_group_key(n), []).append(n.uuid)
    return [u for g in groups.values() for u in g]


def thread_entries(loaded: pl.DataFrame, session_id: str) -> list[str]:
    """The entry ids of the main thread's messages in the loaded blocks, in order (a message split
    over several lines gives each line's entry)."""
    rows = loaded.select("session_id", "thread_id", "entry_order", "block_pos", "part_pos", "entry_id") \
        .filter((pl.col("session_id") == session_id) & (pl.col("thread_id") == MAIN))
    return rows.sort("entry_order", "block_pos", "part_pos").get_column("entry_id").unique(maintain_order=True).to_list()


def only(frame: pl.DataFrame, rows: pl.Expr) -> pl.DataFrame:
    """frame.filter(rows), or the frame itself when every row is one of them (a session of one
    thread: filtering copied each of its columns, several times a pass)."""
    return frame if frame.select(rows.fill_null(False).all()).item() else frame.filter(rows)


# ---------------------------------------------------------------------------------------------
# the appended rows


def new_rows(nodes: list[Node], facts: ThreadFacts, counter: TokenCounter) -> LiveRows | str:
    """The block rows the loader gives the appended message entries at the end of the main thread
    (or why it cannot be said without a full load)."""
    entries = Entries()
    for n in nodes:
        entries.add(n, n.obj, path_str(Path(facts.source_file)), n.raw.encode("utf-8"))  # type: ignore[arg-type]
    msgs, compactions = thread_messages(nodes, set())
    if compactions or not msgs:
        return "no message to append"
    if any(m.is_call is False for m in msgs):
        return "a notice Claude Code wrote itself (model <synthetic>) among the new entries: it is no call"
    for m in msgs:
        if m.role == "assistant":
            m.inherited, m.is_call = False, True
    if msgs[0].role != "assistant":
        return "the new entries add to the call already assembled (they do not start with an answer)"
    notes: list[dict[str, Any]] = []
    table = entries.blocks([ThreadPlan(facts.session_id, MAIN, FORMAT, facts.source_file, msgs)], notes)
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
    return LiveRows(frame, rows, tokens, grouped, int(frame.get_column("first_call").max()))  # type: ignore[arg-type]
