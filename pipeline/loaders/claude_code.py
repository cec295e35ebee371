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
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

from ctxreplay.pipeline.loaders.base import (
    Block,
    Compaction,
    FileLoad,
    Message,
    Thread,
    bad,
    content_items,
    iter_json_lines,
    json_text,
    num,
    one_of,
    parse_ts,
    path_str,
    read_lines,
    session_id_from_name,
    unreadable,
)

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


@dataclass
class Node:
    uuid: str
    parent: str | None
    logical_parent: str | None
    type: str
    subtype: str | None
    file_idx: int
    line: int
    raw: str
    obj: dict[str, Any]
    is_message: bool
    msg_key: str | None = None  # assistant: message.id|requestId
    sidechain: bool = False
    source_tool_assistant: str | None = None
    tool_result_ids: tuple[str, ...] = ()
    tool_use_ids: tuple[str, ...] = ()


@dataclass
class SessionFiles:
    session_id: str
    files: list[Path] = field(default_factory=list)


def _kind(o: dict[str, Any]) -> str:
    """The kind an other line is counted under (sub-kinds only when they are short texts)."""
    t = str(o.get("type"))

    def sub(v: Any) -> bool:
        return isinstance(v, str) and 0 < len(v) <= 100

    if t == "system" and sub(o.get("subtype")):
        return f"system:{o['subtype']}"
    if t == "progress" and isinstance(o.get("data"), dict) and sub(o["data"].get("type")):
        return f"progress:{o['data']['type']}"
    if t == "attachment" and isinstance(o.get("attachment"), dict) and sub(o["attachment"].get("type")):
        return f"attachment:{o['attachment']['type']}"
    return t[:100]


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
    msg = o.get("message") if t in MESSAGE_TYPES else None
    tr_ids, tu_ids = entry_tool_ids(o)
    return Node(
        uuid=uid,
        parent=o.get("parentUuid") if isinstance(o.get("parentUuid"), str) else None,
        logical_parent=o.get("logicalParentUuid") if isinstance(o.get("logicalParentUuid"), str) else None,
        type=t,
        subtype=o.get("subtype") if isinstance(o.get("subtype"), str) else None,
        file_idx=file_idx,
        line=line,
        raw=raw,
        obj=o,
        is_message=t in MESSAGE_TYPES,
        msg_key=(f"{msg.get('id')}|{o.get('requestId')}{conflict}" if t == "assistant" and msg and msg.get("id")
                 else (uid if t == "assistant" else None)),
        sidechain=bool(o.get("isSidechain")),
        source_tool_assistant=o.get("sourceToolAssistantUUID"),
        tool_result_ids=tr_ids,
        tool_use_ids=tu_ids,
    )


def _usage(u: Any, diagnostics: Any = None) -> dict[str, Any] | None:
    """The answer's usage, and with it the server's cache diagnosis (`message.diagnostics`, Claude
    Code 2.1.140+: `{"cache_miss_reason": {"type": ..., "cache_missed_input_tokens": N}}`, null or
    absent when nothing diverged): `miss_reason` is the type as written (a later type too),
    `missed_tokens` the count; both None without a diagnosis."""
    if not isinstance(u, dict):
        return None
    cc = u.get("cache_creation") if isinstance(u.get("cache_creation"), dict) else {}
    d = diagnostics.get("cache_miss_reason") if isinstance(diagnostics, dict) else None
    d = d if isinstance(d, dict) else {}
    return {
        "input": num(u.get("input_tokens")),
        "output": num(u.get("output_tokens")),
        "cache_read": num(u.get("cache_read_input_tokens")),
        "cache_write": num(u.get("cache_creation_input_tokens")),
        "cache_write_5m": num(cc.get("ephemeral_5m_input_tokens")),
        "cache_write_1h": num(cc.get("ephemeral_1h_input_tokens")),
        "miss_reason": d.get("type") if isinstance(d.get("type"), str) else None,
        "missed_tokens": num(d.get("cache_missed_input_tokens")),
    }


def _usage_total(u: dict[str, int | None] | None) -> int:
    if not u:
        return -1
    return sum(v or 0 for k, v in u.items() if k in ("input", "output", "cache_read", "cache_write"))


def _image_block(b: dict[str, Any], **kw: Any) -> Block:
    src = b.get("source") if isinstance(b.get("source"), dict) else {}
    extra = None
    if src.get("type") not in (None, "base64"):
        extra = {"source": src}
    return Block("image", image_media_type=src.get("media_type"), image_data=src.get("data"), extra=extra, **kw)


def anthropic_content_blocks(content: Any) -> list[Block]:
    """Anthropic Messages content (string or blocks) → blocks; tool_result content flattened into parts."""
    out: list[Block] = []
    for b in content_items(content):
        if isinstance(b, Block):
            out.append(b)
            continue
        t = b.get("type")
        rest = {k: v for k, v in b.items() if k not in ("type", "text", "thinking", "signature", "id", "name",
                                                      "input", "tool_use_id", "content", "is_error", "source",
                                                      "data")}
        if t == "text":
            out.append(Block("text", text=b.get("text"), extra=rest or None))
        elif t == "thinking":
            out.append(Block("thinking", text=b.get("thinking"), signature=b.get("signature"), extra=rest or None))
        elif t == "redacted_thinking":
            out.append(Block("redacted_thinking", text=b.get("data"), extra=rest or None))
        elif t in ("tool_use", "server_tool_use"):
            inp = b.get("input")
            out.append(Block(t, tool_use_id=b.get("id"), tool_name=b.get("name"),
                             tool_input=json_text(inp) if "input" in b else None, extra=rest or None))
        elif t == "tool_result":
            out.extend(_tool_result_parts(b))
        elif t == "image":
            out.append(_image_block(b))
        else:
            out.append(Block(str(t), text=b.get("text") if isinstance(b.get("text"), str) else None, extra=b))
    return out


def _tool_result_parts(b: dict[str, Any]) -> list[Block]:
    common = {"tool_use_id": b.get("tool_use_id"), "is_error": b.get("is_error")}
    c = b.get("content")
    if isinstance(c, str):
        return [Block("tool_result", text=c, part_type="string", **common)]
    if not isinstance(c, list) or not c:
        return [Block("tool_result", part_type="empty", **common)]
    parts = []
    for i, p in enumerate(c):
        if isinstance(p, dict) and p.get("type") == "text":
            parts.append(Block("tool_result", text=p.get("text"), part_type="text", part_pos=i, **common))
        elif isinstance(p, dict) and p.get("type") == "image":
            src = p.get("source") if isinstance(p.get("source"), dict) else {}
            parts.append(Block("tool_result", part_type="image", part_pos=i, image_media_type=src.get("media_type"),
                               image_data=src.get("data"), **common))
        elif isinstance(p, dict) and p.get("type") == "tool_reference":
            parts.append(Block("tool_result", part_type="tool_reference", part_pos=i, tool_name=p.get("tool_name"),
                               **common))
        else:
            parts.append(Block("tool_result", part_type="other", part_pos=i, text=json_text(p), extra={"part": p},
                               **common))
    return parts


def is_local_notice(node_type: str, model: Any) -> bool:
    """An answer Claude Code wrote itself (model `<synthetic>`): no provider answered it, so it is no
    call (`Message.is_call` False, never inherited)."""
    return node_type == "assistant" and model == LOCAL_MODEL


def _notice_blocks(o: dict[str, Any], m: dict[str, Any]) -> list[Block] | None:
    """The blocks of a local notice Claude Code leaves out of what it sends (`isApiErrorMessage`
    true: a failed request's notice), or None for any other message. The notice becomes one `empty`
    block, which no target sends, with the recorded content (and the `error` kind) in its extra."""
    if not (is_local_notice(o.get("type"), m.get("model")) and o.get("isApiErrorMessage") is True):
        return None
    extra: dict[str, Any] = {"content": m.get("content")}
    if isinstance(o.get("error"), str):
        extra["error"] = o["error"]
    return [Block("empty", extra=extra)]


def _message(node: Node, path: str) -> Message:
    o = node.obj
    m = o["message"]
    role = m.get("role") or o.get("type")
    muted = _notice_blocks(o, m)
    blocks = anthropic_content_blocks(m.get("content")) if muted is None else muted
    if role == "user" and blocks and all(b.block_type == "tool_result" for b in blocks):
        role = "tool"
    return Message(
        entry_id=node.uuid,
        role=role,
        blocks=blocks,
        source_file=path,
        source_line=node.line,
        raw_line=node.raw,
        parent_id=node.parent,
        msg_key=node.msg_key,
        message_id=m.get("id") if node.type == "assistant" else None,
        request_id=o.get("requestId"),
        timestamp=parse_ts(o.get("timestamp")),
        model=m.get("model"),
        provider="anthropic" if node.type == "assistant" else None,
        api="anthropic-messages" if node.type == "assistant" else None,
        stop_reason=m.get("stop_reason"),
        usage=_usage(m.get("usage"), m.get("diagnostics")) if node.type == "assistant" else None,
        is_sidechain=bool(o.get("isSidechain")),
        is_meta=bool(o.get("isMeta")),
        is_compact_summary=bool(o.get("isCompactSummary")),
        is_display_only=bool(o.get("isVisibleInTranscriptOnly")) or muted is not None,
        is_call=False if is_local_notice(node.type, m.get("model")) else None,
    )


def entry_tool_ids(o: dict[str, Any]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """An entry's tool-result ids and tool-call ids (non-empty strings), in content order."""
    msg = o.get("message") if isinstance(o.get("message"), dict) else {}
    content = msg.get("content") if isinstance(msg, dict) else None
    if not isinstance(content, list):
        return (), ()
    tr_ids = tuple(b["tool_use_id"] for b in content
                   if isinstance(b, dict) and b.get("type") == "tool_result"
                   and isinstance(b.get("tool_use_id"), str) and b["tool_use_id"])
    tu_ids = tuple(b["id"] for b in content
                   if isinstance(b, dict) and b.get("type") == "tool_use" and isinstance(b.get("id"), str) and b["id"])
    return tr_ids, tu_ids


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


def _agent_thread_id(p: Path, nodes: list[Node]) -> str:
    for n in nodes:
        aid = n.obj.get("agentId")
        if isinstance(aid, str) and aid:
            return f"agent-{aid}"
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


def load_session(group: SessionFiles, skipped: list[dict[str, str]] | None = None, *,
                 open_sidechains: bool = False) -> tuple[list[Thread], list[FileLoad], dict[str, int]]:
    """Load every file of one session; returns threads, per-file accounting and stats.

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
    """
    session_id = group.session_id
    files = _main_first(group.files, session_id)
    loads: list[FileLoad] = []
    nodes: dict[str, Node] = {}
    per_file: list[list[Node]] = []
    stats: Counter[str] = Counter()
    earlier_lines: set[bytes] = set()  # digests of the lines of the files read so far
    for fi, path in enumerate(files):
        load = FileLoad(path_str(path), FORMAT)
        file_nodes: list[Node] = []
        per_file.append(file_nodes)
        try:
            data = read_lines(path)  # a line over the limit is quarantined, never read
        except OSError as exc:
            if skipped is not None:
                skipped.append(unreadable(path, exc))
            continue
        loads.append(load)
        for line_no, raw, objs in iter_json_lines(path, load, data):
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
                    elif load.digests[line_no] in earlier_lines:
                        stats["duplicate_entries"] += 1
                        kinds.append("duplicate_entry")
                        continue
                    else:
                        kinds.append(_kind(o))
                        continue
                conflict = ""
                if uid in nodes:
                    first = nodes[uid]
                    if first.obj == o:
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
                node = make_node(o, uid, fi, line_no, raw, conflict)
                nodes[uid] = node
                file_nodes.append(node)
                kinds.append("message" if node.is_message else _kind(o))
            load.account(line_no, raw, kinds)
        earlier_lines.update(load.digests.values())
        load.check()

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

    threads: list[Thread] = []
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
            msgs, compactions = thread_messages(entries, compaction_at, files)
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
            base = "main" if main_file else _agent_thread_id(path, per_file[fi])
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
            threads.append(Thread(session_id, tid, FORMAT, path_str(path), msgs, compactions))
    stats["off_thread_message_entries"] += sum(
        1 for fn in per_file for n in fn if n.is_message and n.uuid not in covered)
    return threads, loads, dict(stats)


def opens_sidechain(roles: list[str]) -> bool:
    """An inline sidechain's path whose first request awaits its answer: messages, none of them
    the assistant's (`load_session`'s `open_sidechains`)."""
    return bool(roles) and "assistant" not in roles


def build_thread(tip: Node, nodes: dict[str, Node], by_key: dict[str, list[Node]],
                  result_by_tool_id: dict[str, list[Node]], prev_in_file: dict[str, str],
                  stats: Counter[str]) -> tuple[list[Node], set[str]]:
    chain: list[Node] = []
    seen: set[str] = set()
    boundaries: set[str] = set()
    cur: Node | None = tip
    while cur is not None and cur.uuid not in seen:
        seen.add(cur.uuid)
        chain.append(cur)
        nxt = cur.parent
        if nxt is None and cur.type == "system" and cur.subtype == "compact_boundary":
            boundaries.add(cur.uuid)
            nxt = cur.logical_parent
            if (nxt is None or nxt not in nodes) and cur.uuid in prev_in_file:
                # logicalParentUuid missing or pointing nowhere: the conversation before the boundary
                # is what the file holds right before it
                stats["compact_boundary_parent_from_file_order"] += 1
                nxt = prev_in_file[cur.uuid]
        if nxt is not None and nxt not in nodes:
            stats["parent_not_found"] += 1
            nxt = None
        cur = nodes.get(nxt) if nxt else None
    chain.reverse()
    on_chain = {n.uuid for n in chain}
    recovered: list[Node] = []
    tool_ids: set[str] = set()
    answered: set[str] = set()
    for n in chain:
        answered.update(n.tool_result_ids)
    for n in chain:
        if n.type == "assistant" and n.msg_key:
            for sib in by_key.get(n.msg_key, []):
                if sib.uuid not in on_chain and sib.uuid not in seen:
                    seen.add(sib.uuid)
                    recovered.append(sib)
            for sib in by_key.get(n.msg_key, []):
                tool_ids.update(sib.tool_use_ids)
    for tid in sorted(tool_ids):
        if tid in answered:
            continue
        for r in result_by_tool_id.get(tid, []):
            if r.uuid not in seen:
                seen.add(r.uuid)
                recovered.append(r)
                answered.add(tid)
                stats["recovered_parallel_results"] += 1
                break
    # order: files in the order the chain reaches them, then file line
    file_rank: dict[int, int] = {}
    for n in chain:
        file_rank.setdefault(n.file_idx, len(file_rank))
    entries = chain + recovered
    entries.sort(key=lambda n: (file_rank.get(n.file_idx, len(file_rank)), n.line, n.uuid))
    return entries, boundaries


def thread_messages(entries: list[Node], boundaries: set[str], files: list[Path]) -> tuple[list[Message], list[Compaction]]:
    msgs: list[Message] = []
    group_index: dict[str, int] = {}
    compactions: list[Compaction] = []
    for n in entries:
        if n.uuid in boundaries:
            b = len(msgs)
            if b > 0:
                compactions.append(Compaction(at=b - 1, keep_from=b))
            continue
        if not n.is_message:
            continue
        path = path_str(files[n.file_idx])
        m = _message(n, path)
        lines = [(n.uuid, n.line, n.raw, path)] * len(m.blocks)
        if n.type == "assistant" and n.msg_key in group_index:
            g = msgs[group_index[n.msg_key]]
            g.blocks.extend(m.blocks)
            assert g.block_lines is not None
            g.block_lines.extend(lines)
            if _usage_total(m.usage) >= _usage_total(g.usage):
                g.usage = m.usage
            if m.stop_reason:
                g.stop_reason = m.stop_reason
            continue
        m.block_lines = lines
        if n.type == "assistant" and n.msg_key:
            group_index[n.msg_key] = len(msgs)
        msgs.append(m)
    return msgs, compactions
