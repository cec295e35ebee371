"""OpenClaw v3 and legacy pi-coding-agent session logs (`<uuid>.jsonl`, also `.jsonl.deleted.<ts>`).

Both are written by pi's session manager; OpenClaw embeds it. What the model saw is rebuilt the
way pi's `buildSessionContext` / `convertToLlm` do it:

- v3 (`"version": 3` header): entries form a tree by `id` / `parentId`. The conversation is the
  path from the LAST entry of the file back to the root, through every entry type. Every other
  branch tip (scanned from the end of the file backwards) whose path holds a model call that no
  earlier thread holds becomes thread `branch-<tip id>`; the shared prefix is its context, and
  only its own assistant messages are calls there.
- legacy pi (header without `version`): one linear thread in file order.
- `message` entries: user / assistant / toolResult as they are; `bashExecution` becomes a user
  text message rendered like pi's `bashExecutionToText` (and is left out with
  `excludeFromContext`); `custom` (formerly `hookMessage`) becomes a user message.
- `custom_message` entries ARE sent to the model, whatever `display` says: pi's
  `buildSessionContext` appends them and `convertToLlm` turns them into user messages; `display`
  only controls TUI rendering. They count as message lines.
- `branch_summary` entries are sent as a user message with pi's branch summary envelope.
- `custom`, `model_change`, `thinking_level_change`, `label`, `session_info` are bookkeeping.
- `compaction`: from the first call after it, the model sees the summary (pi's
  COMPACTION_SUMMARY_PREFIX/SUFFIX envelope), then the kept entries from `firstKeptEntryId`
  (legacy: `firstKeptEntryIndex` into the file's entry list, 0 = header), then what follows.
- Assistant messages from `provider == "openclaw"` (`delivery-mirror`, `gateway-injected`) were
  never produced by a model: not calls, and marked display-only (OpenClaw itself filters them out
  of the model context in later releases).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
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
    session_id_from_name,
)

FORMAT = "openclaw"
FORMAT_LEGACY = "pi_legacy"

# pi-mono packages/coding-agent/src/core/messages.ts
COMPACTION_SUMMARY_PREFIX = (
    "The conversation history before this point was compacted into the following summary:\n\n<summary>\n"
)
COMPACTION_SUMMARY_SUFFIX = "\n</summary>"
BRANCH_SUMMARY_PREFIX = (
    "The following is a summary of a branch that this conversation came back from:\n\n<summary>\n"
)
BRANCH_SUMMARY_SUFFIX = "</summary>"

# Message roles pi's convertToLlm sends to the model; any other role is dropped by it.
SENT_ROLES = {"user", "assistant", "toolResult", "bashExecution", "custom", "hookMessage",
              "branchSummary", "compactionSummary"}

ENTRY_TYPES = {"message", "model_change", "thinking_level_change", "compaction", "custom", "custom_message",
               "branch_summary", "label", "session_info"}


def sniff(first_objects: list[Any], path: Path) -> str | None:
    """The session header decides; when the first line is unreadable or damaged, pi-shaped entries do."""
    objs = [o for o in first_objects if isinstance(o, dict) and "payload" not in o]  # payload: Codex
    if not objs:
        return None
    o = objs[0]
    if o.get("type") == "session":
        return FORMAT if o.get("version") is not None else FORMAT_LEGACY
    pi = [e for e in objs if one_of(e.get("type"), ENTRY_TYPES)
          and (e.get("type") != "message" or isinstance(e.get("message"), dict) and "role" in e["message"])]
    if not pi:
        return None
    if first_objects and isinstance(first_objects[0], dict):
        # a readable first line that is not a pi header (a damaged one?): pi only when every other
        # entry read is pi-shaped
        shaped = {id(e) for e in pi}
        rest = [e for e in objs if e is not first_objects[0]]
        if len(rest) < 2 or any(id(e) not in shaped for e in rest):
            return None
    return FORMAT if any("parentId" in e for e in pi) else FORMAT_LEGACY


# ---------------------------------------------------------------- content mapping


def _usage(u: Any) -> dict[str, int | None] | None:
    if not isinstance(u, dict):
        return None
    return {"input": num(u.get("input")), "output": num(u.get("output")),
            "cache_read": num(u.get("cacheRead")), "cache_write": num(u.get("cacheWrite"))}


def _rest(b: dict[str, Any], used: Iterable[str]) -> dict[str, Any] | None:
    skip = {"type", *used}
    rest = {k: v for k, v in b.items() if k not in skip}
    return rest or None


def content_blocks(content: Any) -> list[Block]:
    """pi message content (string, or text / thinking / toolCall / image blocks) → blocks."""
    out: list[Block] = []
    for b in content_items(content):
        if isinstance(b, Block):
            out.append(b)
            continue
        t = b.get("type")
        if t == "text":
            out.append(Block("text", text=b.get("text"), extra=_rest(b, ["text"])))
        elif t == "thinking" and b.get("redacted"):
            # pi keeps Anthropic redacted thinking as a thinking block whose signature is the data
            out.append(Block("redacted_thinking", text=b.get("thinkingSignature"),
                             extra=_rest(b, ["thinkingSignature"])))
        elif t == "thinking":
            out.append(Block("thinking", text=b.get("thinking"), signature=b.get("thinkingSignature"),
                             extra=_rest(b, ["thinking", "thinkingSignature"])))
        elif t == "toolCall":
            args = b.get("arguments")
            out.append(Block("tool_use", tool_use_id=b.get("id"), tool_name=b.get("name"),
                             tool_input=json_text(args) if "arguments" in b else None,
                             extra=_rest(b, ["id", "name", "arguments"])))
        elif t == "image":
            out.append(Block("image", image_media_type=b.get("mimeType"), image_data=b.get("data"),
                             extra=_rest(b, ["mimeType", "data"])))
        else:
            out.append(Block(str(t), text=b.get("text") if isinstance(b.get("text"), str) else None, extra=b))
    return out


def tool_result_parts(content: Any, *, tool_use_id: Any, tool_name: Any, is_error: Any) -> list[Block]:
    """A toolResult's content → one `tool_result` row per part (part_pos 0..n)."""
    common = {"tool_use_id": tool_use_id if isinstance(tool_use_id, str) else None,
              "tool_name": tool_name if isinstance(tool_name, str) else None,
              "is_error": is_error if isinstance(is_error, bool) else None}
    if isinstance(content, str):
        return [Block("tool_result", text=content, part_type="string", **common)]
    if isinstance(content, dict):
        content = [content]
    if not isinstance(content, list) or not content:
        return [Block("tool_result", part_type="empty", **common)]
    parts: list[Block] = []
    for i, p in enumerate(content):
        if isinstance(p, dict) and p.get("type") == "text":
            parts.append(Block("tool_result", text=p.get("text"), part_type="text", part_pos=i,
                               extra=_rest(p, ["text"]), **common))
        elif isinstance(p, dict) and p.get("type") == "image":
            parts.append(Block("tool_result", part_type="image", part_pos=i,
                               image_media_type=p.get("mimeType"), image_data=p.get("data"),
                               extra=_rest(p, ["mimeType", "data"]), **common))
        else:
            parts.append(Block("tool_result", part_type="other", part_pos=i,
                               text=p if isinstance(p, str) else json_text(p), extra={"part": p}, **common))
    return parts


def bash_execution_to_text(m: dict[str, Any]) -> str:
    """pi's `bashExecutionToText`: how a user's `!command` run is sent to the model."""
    text = f"Ran `{m.get('command', '')}`\n"
    output = m.get("output")
    if output:
        text += f"```\n{output}\n```"
    else:
        text += "(no output)"
    exit_code = m.get("exitCode")
    if m.get("cancelled"):
        text += "\n\n(command cancelled)"
    elif exit_code is not None and exit_code != 0:
        text += f"\n\nCommand exited with code {exit_code}"
    if m.get("truncated") and m.get("fullOutputPath"):
        text += f"\n\n[Output truncated. Full output: {m['fullOutputPath']}]"
    return text


def _provenance(p: Any) -> dict[str, str | None] | None:
    if not isinstance(p, dict):
        return None

    def s(v: Any) -> str | None:
        return v if isinstance(v, str) else (None if v is None else json_text(v))

    return {"kind": s(p.get("kind")), "source_session": s(p.get("sourceSessionKey")),
            "channel": s(p.get("sourceChannel")), "tool": s(p.get("sourceTool"))}


# ---------------------------------------------------------------- entries


@dataclass
class Entry:
    id: str
    parent: str | None
    type: str
    line: int
    raw: str
    obj: dict[str, Any]
    index: int  # position among all parsed objects of the file (0 = header)
    message: Message | None = None  # what this entry sends to the model (None: nothing)
    is_compaction: bool = False


def _entry_message(e: Entry, path: str) -> tuple[Message | None, str]:
    """(message this entry sends, line kind); kind starting with '!' = not understood (reason)."""
    o = e.obj
    ts_entry = o.get("timestamp")
    base = {"entry_id": e.id, "source_file": path, "source_line": e.line, "raw_line": e.raw,
            "parent_id": e.parent}
    if e.type == "message":
        m = o.get("message")
        if not isinstance(m, dict):
            return None, bad("no_message", "'message' entry has no 'message' object")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            return None, bad("no_role", "'message' entry: message has no 'role' (expected user, assistant, "
                             "toolResult, ...)")
        ts = parse_ts(m.get("timestamp")) or parse_ts(ts_entry)
        if role not in SENT_ROLES:
            return None, f"message:{role}"  # pi's convertToLlm drops unknown roles
        if role == "assistant":
            provider = m.get("provider") if isinstance(m.get("provider"), str) else None
            injected = provider == "openclaw"
            return Message(role="assistant", blocks=content_blocks(m.get("content")), timestamp=ts,
                           model=m.get("model"), provider=provider, api=m.get("api"),
                           stop_reason=m.get("stopReason"), usage=_usage(m.get("usage")),
                           message_id=m.get("responseId") if isinstance(m.get("responseId"), str) else None,
                           is_call=False if injected else None, is_display_only=injected, **base), "message"
        if role == "toolResult":
            blocks = tool_result_parts(m.get("content"), tool_use_id=m.get("toolCallId"),
                                       tool_name=m.get("toolName"), is_error=m.get("isError"))
            return Message(role="tool", blocks=blocks, timestamp=ts, **base), "message"
        if role == "bashExecution":
            if m.get("excludeFromContext"):
                return None, "message:bashExecution:excluded"
            return Message(role="user", blocks=[Block("text", text=bash_execution_to_text(m))], timestamp=ts,
                           **base), "message"
        if role == "branchSummary":
            text = BRANCH_SUMMARY_PREFIX + str(m.get("summary", "")) + BRANCH_SUMMARY_SUFFIX
            return Message(role="user", blocks=[Block("text", text=text)], timestamp=ts, **base), "message"
        if role == "compactionSummary":
            text = COMPACTION_SUMMARY_PREFIX + str(m.get("summary", "")) + COMPACTION_SUMMARY_SUFFIX
            return Message(role="user", blocks=[Block("text", text=text)], timestamp=ts,
                           is_compact_summary=True, **base), "message"
        # user, custom / hookMessage (extension-injected, sent as user)
        return Message(role="user", blocks=content_blocks(m.get("content")), timestamp=ts,
                       provenance=_provenance(m.get("provenance")), is_meta=role != "user", **base), "message"
    if e.type == "custom_message":
        # sent to the model as a user message whatever `display` says (display only affects the TUI)
        return Message(role="user", blocks=content_blocks(o.get("content")), timestamp=parse_ts(ts_entry),
                       is_meta=True, **base), "message"
    if e.type == "branch_summary":
        if not o.get("summary"):
            return None, "branch_summary"
        text = BRANCH_SUMMARY_PREFIX + str(o.get("summary")) + BRANCH_SUMMARY_SUFFIX
        return Message(role="user", blocks=[Block("text", text=text)], timestamp=parse_ts(ts_entry),
                       **base), "message"
    if e.type == "custom":
        return None, f"custom:{o.get('customType')}" if o.get("customType") else "custom"
    return None, e.type


def _summary_message(c: Entry, path: str) -> Message:
    text = COMPACTION_SUMMARY_PREFIX + str(c.obj.get("summary", "")) + COMPACTION_SUMMARY_SUFFIX
    return Message(entry_id=c.id, role="user", blocks=[Block("text", text=text)], source_file=path,
                   source_line=c.line, raw_line=c.raw, parent_id=c.parent,
                   timestamp=parse_ts(c.obj.get("timestamp")), is_compact_summary=True)


# ---------------------------------------------------------------- threads


def _thread(path_entries: list[Entry], file_entries: list[Entry], fmt: str, path: str,
            load: FileLoad) -> tuple[list[Message], list[Compaction]]:
    """Messages of one path (root first) with compaction summaries inserted, and the compactions."""
    msgs: list[Message] = []
    msgs_before: list[int] = []  # per path position: messages emitted before it
    comps: list[tuple[Entry, int, int]] = []  # (compaction entry, messages before it, path position)
    for pos, e in enumerate(path_entries):
        msgs_before.append(len(msgs))
        if e.message is not None:
            msgs.append(dataclasses.replace(e.message))
        elif e.is_compaction:
            comps.append((e, len(msgs), pos))
    if not comps:
        return msgs, []
    path_pos = {e.id: i for i, e in enumerate(path_entries)}
    by_index = {e.index: e for e in file_entries}
    inserts: list[tuple[int, int, Message]] = []  # (insert before message index, compaction order, summary)
    for order, (c, before, cpos) in enumerate(comps):
        first_kept: Entry | None = None
        if fmt == FORMAT_LEGACY:
            idx = c.obj.get("firstKeptEntryIndex")
            first_kept = by_index.get(idx) if isinstance(idx, int) and not isinstance(idx, bool) else None
            want = f"firstKeptEntryIndex {idx!r}"
        else:
            fk = c.obj.get("firstKeptEntryId")
            first_kept = next((e for e in file_entries if e.id == fk), None) if isinstance(fk, str) else None
            want = f"firstKeptEntryId {fk!r}"
        kp = path_pos.get(first_kept.id) if first_kept is not None else None
        if kp is None or kp >= cpos:
            load.recovered.append({"file": path, "line": c.line,
                                   "note": f"compaction {c.id}: {want} is not an earlier entry of this "
                                           "conversation; nothing before the compaction is kept"})
            target = before
        else:
            target = msgs_before[kp]
        inserts.append((target, order, _summary_message(c, path)))
    # merge: summaries go right before the first kept message
    final: list[Message] = []
    new_index: list[int] = []  # original message index → index in `final`
    summary_at: dict[int, int] = {}  # compaction order → index of its summary in `final`
    pending = sorted(inserts, key=lambda t: (t[0], t[1]))
    j = 0
    for i, m in enumerate(msgs + [None]):  # type: ignore[operator]
        while j < len(pending) and pending[j][0] == i:
            summary_at[pending[j][1]] = len(final)
            final.append(pending[j][2])
            j += 1
        if m is not None:
            new_index.append(len(final))
            final.append(m)
    compactions: list[Compaction] = []
    for order, (c, before, _cpos) in enumerate(comps):
        # calls that start after the last message before the compaction see the summary, not the past
        at = new_index[before - 1] if before > 0 else -1
        s = summary_at[order]
        final[s].visible_from = at
        compactions.append(Compaction(at=at, keep_from=s))
        later = [summary_at[o] for o in range(order) if summary_at[o] > s]
        if later:
            load.recovered.append({"file": path, "line": c.line,
                                   "note": f"compaction {c.id} keeps entries from before an earlier "
                                           "compaction; the earlier summary stays visible in this replay"})
    return final, compactions


def _ancestry(tip: Entry, by_id: dict[str, Entry], load: FileLoad, path: str, noted: set[str]) -> list[Entry]:
    chain: list[Entry] = []
    seen: set[str] = set()
    cur: Entry | None = tip
    while cur is not None and cur.id not in seen:
        seen.add(cur.id)
        chain.append(cur)
        nxt = cur.parent
        if nxt is not None and nxt not in by_id:
            if cur.id not in noted:
                noted.add(cur.id)
                note = f"parentId {nxt!r} of entry {cur.id} not found; treated as root"
                load.recovered.append({"file": path, "line": cur.line, "note": note})
            nxt = None
        cur = by_id.get(nxt) if nxt is not None else None
    chain.reverse()
    return chain


def load(path: Path) -> tuple[list[Thread], FileLoad]:
    path = Path(path)
    spath = path_str(path)
    load = FileLoad(spath, FORMAT)
    entries: list[Entry] = []
    header: dict[str, Any] | None = None
    index = 0
    pending_lines: list[tuple[int, str, list[str]]] = []
    for line_no, raw, objs in iter_json_lines(path, load):
        kinds: list[str] = []
        glued = len(objs) > 1
        for k, o in enumerate(objs):
            idx = index
            index += 1
            if not isinstance(o, dict):
                kinds.append(bad("not_an_object", f"expected a JSON object, got {type(o).__name__}"))
                continue
            t = o.get("type")
            if not isinstance(t, str) or not t:
                kinds.append(bad("no_type", "entry has no 'type' field (expected session, message, compaction, ...)"))
                continue
            if t == "session" and header is None and not entries:
                header = o
                kinds.append("session")
                continue
            eid = o.get("id") if isinstance(o.get("id"), str) and o.get("id") else None
            if eid is None or t == "session":
                eid = f"L{line_no}.{k}" if glued else f"L{line_no}"
            parent = o.get("parentId") if isinstance(o.get("parentId"), str) else None
            entries.append(Entry(eid, parent, t, line_no, raw, o, idx, is_compaction=t == "compaction"))
            kinds.append("")  # decided below, once the format is known
        pending_lines.append((line_no, raw, kinds))

    # legacy: an unversioned header; a file without a header is legacy when no entry has an id
    legacy = (header.get("version") is None if header is not None
              else not any(isinstance(e.obj.get("id"), str) for e in entries))
    fmt = FORMAT_LEGACY if legacy else FORMAT
    load.format = fmt
    if legacy:
        # strictly linear: ids by line, each entry's parent is the entry before it (as pi's v1→v2 migration)
        prev: str | None = None
        for e in entries:
            e.parent = prev
            prev = e.id
    # unique ids (the last one wins for parent lookups, as in pi's byId map)
    by_id: dict[str, Entry] = {}
    for e in entries:
        if e.id in by_id:
            old = by_id[e.id]
            old.id = f"{old.id}@L{old.line}"
            note = f"entry id {e.id!r} is used again on line {e.line}; renamed {old.id!r}"
            load.recovered.append({"file": spath, "line": old.line, "note": note})
        by_id[e.id] = e
    by_id = {e.id: e for e in entries}
    # resolve what each entry sends, then account lines
    per_line: dict[int, list[str]] = {}
    for e in entries:
        msg, kind = _entry_message(e, spath)
        e.message = msg
        per_line.setdefault(e.line, []).append(kind)
    for line_no, raw, kinds in pending_lines:
        # the kinds known while reading, then those of the entries on this line (order matters:
        # the first understood kind names an other line, the first reason a quarantined one)
        load.account(line_no, raw, [k for k in kinds if k] + per_line.get(line_no, []))
    load.check()

    session_id = session_id_from_name(path)
    if session_id is None and header is not None and isinstance(header.get("id"), str) and header["id"]:
        session_id = header["id"]
    if session_id is None:
        session_id = path_str(path.name).split(".jsonl")[0] or path_str(path.stem)

    threads: list[Thread] = []
    if not entries:
        return threads, load
    if legacy:
        msgs, comps = _thread(entries, entries, fmt, spath, load)
        threads.append(Thread(session_id, "main", fmt, spath, msgs, comps))
        return threads, load

    covered: set[str] = set()
    claimed: set[str] = set()
    noted: set[str] = set()
    first = True
    for tip in reversed(entries):
        if tip.id in covered:
            continue
        chain = _ancestry(tip, by_id, load, spath, noted)
        covered.update(e.id for e in chain)
        msgs, comps = _thread(chain, entries, fmt, spath, load)
        own = []
        for m in msgs:
            if m.role != "assistant" or m.is_call is False:
                continue
            if m.entry_id in claimed:
                m.inherited = True  # reported by an earlier thread; still a call of this path
            else:
                own.append(m.entry_id)
        if not own and not first:
            continue
        claimed.update(own)
        threads.append(Thread(session_id, "main" if first else f"branch-{tip.id}", fmt, spath, msgs, comps))
        first = False
    return threads, load
