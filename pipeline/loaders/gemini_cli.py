"""Gemini CLI chat recordings (`~/.gemini/tmp/<project>/chats/`), both formats (docs/gemini-cli.md).

- `session-<time>-<short id>.json` (the older format): ONE JSON document, pretty-printed,
  `{sessionId, projectHash, startTime, lastUpdated, messages: [...]}`, rewritten whole on every
  turn: read as it stands. A document cut short (a crash mid-rewrite) keeps its complete messages;
  the lines of the broken tail are quarantined.
- `*.jsonl` (the newer format): a record stream. A header `{sessionId, projectHash, startTime,
  lastUpdated, kind}`, then one record per message version: a record whose `id` is known replaces
  that message where it stands (an answer is written again when its tool calls arrive);
  `{"$set": {...}}` updates the metadata, and `$set.messages` replaces the whole list (the CLI
  rolled its history back); `{"$rewindTo": id}` drops that message and everything after it (the
  list is emptied when the id is unknown). Records apply in file order, as the CLI reads them.
  Messages a rewind or a replacement dropped are kept when they hold answers: thread
  `branch-<first dropped id>`, whose shared history is inherited (each answer is reported once).

Messages (`type`): `user` (content: a string or a list of parts; what was sent, `displayContent`
is what was shown); `gemini`: one answer = ONE call, with `thoughts` (summaries → thinking blocks,
no signature), `content` (text, or in newer files the whole list of parts, function calls and
thought parts included), `toolCalls` (→ tool_use blocks; each `result` — the functionResponse
parts the CLI sent back — → the tool_result blocks of a `tool` message after the answer),
`tokens` {input, output, cached, thoughts, tool, total} and `model`; `info` / `error` /
`warning`: the CLI's own notices, never sent to the model, kept as non-model rows (role
assistant, display-only, not calls, one `empty` block whose extra holds the type and text, so
no target sends them).

A tool call recorded after a notice (the user cancelled it: "Request cancelled.") is written by
the CLI as a new `gemini` message with no text, thoughts or tokens; it belongs to the answer
before the notice and is merged into it (its results follow that answer).

Usage: `input` is the prompt with the cached tokens in it and `tool` is more prompt; `thoughts`
are billed as output. usage input = input - cached + tool, cache_read = cached, output = output +
thoughts; Gemini's implicit caching writes nothing.

Accounting: every non-blank physical line is a message line (it gives rows), another line by
kind (`session_header`, `session_metadata`, `metadata_update`, `rewind`, `superseded_version`,
`dropped_from_history`, `message:<unknown type>`) or quarantined with a reason code.
"""

from __future__ import annotations

import bisect
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ctxreplay.pipeline.loaders.base import (
    Block,
    FileLoad,
    Message,
    QuarantineRow,
    Thread,
    bad,
    depth_exceeds,
    file_load,
    iter_json_lines,
    json_text,
    line_digest,
    nonblank_lines,
    num,
    parse_ts,
    path_str,
    read_file,
    scrub,
    session_id_from_name,
)
from ctxreplay.pipeline.loaders.inputs import first_bytes

FORMAT = "gemini_cli"            # the JSONL record stream (and the source_format of every row)
FORMAT_JSON = "gemini_cli_json"  # the older whole-document session-*.json
PROVIDER = "google"
API = "google-gemini-cli"
NOTICE_PROVIDER = "gemini-cli"   # the provider of a notice row: the CLI itself, not a model
MESSAGE_TYPES = frozenset({"user", "gemini", "info", "error", "warning"})
NOTICE_TYPES = frozenset({"info", "error", "warning"})


# ---------------------------------------------------------------- detection


def is_header(o: Any) -> bool:
    """A session header (or the older document): string `sessionId` and `projectHash`, no `type`."""
    return (isinstance(o, dict) and isinstance(o.get("sessionId"), str) and isinstance(o.get("projectHash"), str)
            and "type" not in o and "id" not in o)


def _is_message_record(o: Any) -> bool:
    return (isinstance(o, dict) and isinstance(o.get("id"), str) and isinstance(o.get("type"), str)
            and o["type"] in MESSAGE_TYPES and "content" in o and "message" not in o and "uuid" not in o)


def sniff(first_objects: list[Any], path: Path) -> str | None:
    """A JSONL record stream: its header decides; when the first line is damaged, Gemini-shaped
    message records or `$set` / `$rewindTo` records do."""
    objs = [o for o in first_objects if isinstance(o, dict)]
    if not objs:
        return None
    if is_header(objs[0]) and not isinstance(objs[0].get("messages"), list):
        return FORMAT
    shaped = [o for o in objs if _is_message_record(o) or isinstance(o.get("$set"), dict)
              or isinstance(o.get("$rewindTo"), str)]
    if shaped and len(shaped) == len(objs) and any(_is_message_record(o) for o in shaped):
        return FORMAT
    return None


def sniff_document(doc: Any, data: bytes = b"") -> bool:
    """An older `session-*.json` document: a header with a `messages` list; a document that does
    not parse (cut short) when its first bytes hold the header's keys."""
    if doc is not None:
        return is_header(doc) and isinstance(doc.get("messages"), list)
    head = data[:2048].lstrip(b"\xef\xbb\xbf \t\r\n")
    return head.startswith(b"{") and b'"sessionId"' in head and b'"projectHash"' in head


# ---------------------------------------------------------------- records → messages


@dataclass(eq=False)
class _Rec:
    """One version of one message: the record, where it is, and which object slot it came from."""

    obj: dict[str, Any]
    line: int
    raw: str
    slot: tuple[int, int, int]  # (line, object on the line, index in a $set.messages list or -1)
    index: int = 0  # position in the document (older format): entry id of a message without one

    @property
    def id(self) -> str:
        i = self.obj.get("id")
        return i if isinstance(i, str) and i else f"m{self.index}"

    @property
    def type(self) -> Any:
        return self.obj.get("type")


def _is_answer(r: _Rec) -> bool:
    return r.type == "gemini" and isinstance(r.obj.get("tokens"), dict)


def _thought_text(t: Any) -> str:
    if not isinstance(t, dict):
        return t if isinstance(t, str) else json_text(t)
    subject, desc = t.get("subject"), t.get("description")
    desc = desc if isinstance(desc, str) else "" if desc is None else json_text(desc)
    if isinstance(subject, str) and subject:
        return f"**{subject}** {desc}"
    return desc


def _parts(content: Any) -> list[Any]:
    if content is None:
        return []
    if isinstance(content, list):
        return content
    return [content]


def _inline_block(d: Any, **kw: Any) -> Block:
    if isinstance(d, dict) and isinstance(d.get("mimeType"), str) and d["mimeType"].startswith("image/"):
        rest = {k: v for k, v in d.items() if k not in ("mimeType", "data")} or None
        return Block("image", image_media_type=d["mimeType"], image_data=d.get("data") if isinstance(
            d.get("data"), str) else None, extra=rest, **kw)
    return Block("inline_data", extra={"inlineData": d}, **kw)


def _response_text(resp: Any) -> tuple[str, str, bool | None, dict[str, Any] | None]:
    """A functionResponse's `response` → (text, part type, is_error, extra)."""
    if isinstance(resp, dict):
        keys = set(resp)
        if keys == {"output"} and isinstance(resp["output"], str):
            return resp["output"], "string", False, None
        if keys == {"error"} and isinstance(resp["error"], str):
            return resp["error"], "string", True, None
        if "error" in resp and "output" not in resp:
            return json_text(resp["error"]), "other", True, {"response": resp}
        return json_text(resp), "other", None, {"response": resp}
    if isinstance(resp, str):
        return resp, "string", None, None
    return json_text(resp), "other", None, {"response": resp}


def _result_blocks(result: Any, call_id: str | None, name: str | None) -> list[Block]:
    """A tool call's recorded `result` (the parts the CLI sent back) → the parts of one tool_result."""
    common = {"tool_use_id": call_id, "tool_name": name}
    if isinstance(result, str):
        return [Block("tool_result", text=result, part_type="string", **common)]
    out: list[Block] = []
    for i, p in enumerate(_parts(result)):
        if isinstance(p, dict) and isinstance(p.get("functionResponse"), dict):
            fr = p["functionResponse"]
            text, pt, err, extra = _response_text(fr.get("response"))
            ids = {"tool_use_id": fr.get("id") if isinstance(fr.get("id"), str) and fr["id"] else call_id,
                   "tool_name": fr.get("name") if isinstance(fr.get("name"), str) and fr["name"] else name}
            rest = {k: v for k, v in fr.items() if k not in ("id", "name", "response")}
            if rest:
                extra = {**(extra or {}), **rest}
            out.append(Block("tool_result", text=text, part_type=pt, is_error=err, part_pos=i, extra=extra, **ids))
        elif isinstance(p, dict) and isinstance(p.get("text"), str):
            out.append(Block("tool_result", text=p["text"], part_type="text", part_pos=i, **common))
        elif isinstance(p, dict) and "inlineData" in p:
            img = _inline_block(p["inlineData"])
            out.append(Block("tool_result", part_type="image" if img.block_type == "image" else "other",
                             part_pos=i, image_media_type=img.image_media_type, image_data=img.image_data,
                             text=None if img.block_type == "image" else json_text(p), extra=img.extra, **common))
        else:
            out.append(Block("tool_result", text=p if isinstance(p, str) else json_text(p), part_type="other",
                             part_pos=i, extra={"part": p}, **common))
    if not out:
        return [Block("tool_result", part_type="empty", **common)]
    # the first part starts the block: part positions count from 0
    for k, b in enumerate(out):
        b.part_pos = k
    return out


def _content_blocks(content: Any, *, model_side: bool) -> list[Block]:
    """A message's content (a string, a part or a list of parts) → blocks, in order. Empty text is
    no block (the CLI writes "" for an answer that is only tool calls)."""
    out: list[Block] = []
    for p in _parts(content):
        if isinstance(p, str):
            if p:
                out.append(Block("text", text=p))
            continue
        if not isinstance(p, dict):
            out.append(Block("text", text=json_text(p)))
            continue
        rest = {k: v for k, v in p.items() if k not in ("text", "thought", "thoughtSignature")} or None
        if isinstance(p.get("text"), str):
            if p.get("thought") is True:
                out.append(Block("thinking", text=p["text"], signature=p.get("thoughtSignature")
                                 if isinstance(p.get("thoughtSignature"), str) else None, extra=rest))
            elif p["text"] or rest:
                sig = {"thoughtSignature": p["thoughtSignature"]} if "thoughtSignature" in p else {}
                out.append(Block("text", text=p["text"], extra={**(rest or {}), **sig} or None))
        elif isinstance(p.get("functionCall"), dict) and model_side:
            fc = p["functionCall"]
            extra = {k: v for k, v in p.items() if k != "functionCall"} or None
            out.append(Block("tool_use", tool_use_id=fc.get("id") if isinstance(fc.get("id"), str) else None,
                             tool_name=fc.get("name") if isinstance(fc.get("name"), str) else None,
                             tool_input=json_text(fc.get("args") if fc.get("args") is not None else {}), extra=extra))
        elif isinstance(p.get("functionResponse"), dict):
            fr = p["functionResponse"]
            out.extend(_result_blocks([p], fr.get("id") if isinstance(fr.get("id"), str) else None,
                                      fr.get("name") if isinstance(fr.get("name"), str) else None))
        elif "inlineData" in p:
            out.append(_inline_block(p["inlineData"]))
        elif "fileData" in p:
            out.append(Block("file_data", extra=p))
        else:
            key = next(iter(p), "part")
            out.append(Block(str(key), text=p[key] if isinstance(p.get(key), str) else None, extra=p))
    return out


def _usage(tokens: Any) -> dict[str, int | None] | None:
    if not isinstance(tokens, dict):
        return None
    inp, cached, out = num(tokens.get("input")), num(tokens.get("cached")) or 0, num(tokens.get("output"))
    thoughts, tool = num(tokens.get("thoughts")) or 0, num(tokens.get("tool")) or 0
    return {"input": None if inp is None else max(inp - cached, 0) + tool, "cache_read": cached,
            "output": None if out is None else out + thoughts}


def _tool_call_block(tc: Any) -> Block:
    if not isinstance(tc, dict):
        return Block("tool_use", tool_input=json_text(tc), extra={"tool_call": tc})
    extra = {k: tc[k] for k in ("status", "timestamp", "displayName", "agentId") if k in tc} or None
    args = tc.get("args")
    return Block("tool_use", tool_use_id=tc.get("id") if isinstance(tc.get("id"), str) else None,
                 tool_name=tc.get("name") if isinstance(tc.get("name"), str) else None,
                 tool_input=json_text(args if args is not None else {}), extra=extra)


def _is_continuation(r: _Rec) -> bool:
    """A tool-call-only `gemini` message the CLI wrote after a notice: no text, thoughts or tokens."""
    o = r.obj
    content = o.get("content")
    empty = content in (None, "", []) or (isinstance(content, list) and all(
        isinstance(p, dict) and p.get("text") == "" and len(p) == 1 for p in content))
    return (r.type == "gemini" and empty and not o.get("thoughts") and not isinstance(o.get("tokens"), dict)
            and isinstance(o.get("toolCalls"), list) and bool(o["toolCalls"]))


@dataclass
class _Build:
    """Messages of one list of records, and which records gave rows."""

    msgs: list[Message] = field(default_factory=list)
    used: set[int] = field(default_factory=set)  # id() of the records that gave rows
    merged: int = 0
    notices: int = 0
    answers: int = 0


def _build(recs: list[_Rec], spath: str, *, responded: set[str] | None = None,
           inherited: frozenset[int] = frozenset()) -> _Build:
    """The messages a list of records gives, in order (see the module docstring).

    `inherited`: id() of the records whose answers another thread reports."""
    b = _Build()
    # tool results the records carry as user messages (a history written back by the CLI): a
    # call's recorded result is not sent twice
    if responded is None:
        responded = set()
        for r in recs:
            if r.type == "user":
                for p in _parts(r.obj.get("content")):
                    if isinstance(p, dict) and isinstance(p.get("functionResponse"), dict):
                        fid = p["functionResponse"].get("id")
                        if isinstance(fid, str):
                            responded.add(fid)
    last_answer: int | None = None  # index of the answer later tool-call-only messages belong to
    taken: Counter[str] = Counter()  # entry ids given so far (the older format may repeat an id)
    for r in recs:
        o = r.obj
        t = r.type
        ts = parse_ts(o.get("timestamp"))
        taken[r.id] += 1
        eid = r.id if taken[r.id] == 1 else f"{r.id}#{taken[r.id]}"
        base = {"entry_id": eid, "source_file": spath, "source_line": r.line, "raw_line": r.raw, "timestamp": ts}
        if t in NOTICE_TYPES:
            text = o.get("content")
            b.msgs.append(Message(role="assistant", blocks=[Block("empty", extra={
                "gemini_type": t, "content": text})], provider=NOTICE_PROVIDER, is_call=False,
                is_display_only=True, **base))
            b.used.add(id(r))
            b.notices += 1
            continue
        if t == "user":
            blocks = _content_blocks(o.get("content"), model_side=False)
            if "displayContent" in o and o["displayContent"] != o.get("content") and blocks:
                blocks[0].extra = {**(blocks[0].extra or {}), "displayContent": o["displayContent"]}
            role = "tool" if blocks and all(x.block_type == "tool_result" for x in blocks) else "user"
            b.msgs.append(Message(role=role, blocks=blocks, **base))
            b.used.add(id(r))
            if role == "user":
                last_answer = None
            continue
        if t != "gemini":
            continue  # a type the CLI does not send (accounted by the caller)
        calls = o.get("toolCalls") if isinstance(o.get("toolCalls"), list) else []
        if _is_continuation(r) and last_answer is not None:
            ans = b.msgs[last_answer]
            new = [_tool_call_block(tc) for tc in calls]
            _extend(ans, new, r, spath)
            res = _results(calls, responded)
            if res:
                nxt = b.msgs[last_answer + 1] if last_answer + 1 < len(b.msgs) else None
                if nxt is not None and nxt.role == "tool" and nxt.entry_id == f"{ans.entry_id}#results":
                    _extend(nxt, res, r, spath)
                else:
                    b.msgs.insert(last_answer + 1, Message(
                        role="tool", blocks=res, msg_key=f"{ans.entry_id}#results", **{
                            **base, "entry_id": f"{ans.entry_id}#results"}))
            b.used.add(id(r))
            b.merged += 1
            continue
        content = o.get("content")
        parts = _parts(content)
        modern = any(isinstance(p, dict) and (isinstance(p.get("functionCall"), dict) or p.get("thought") is True)
                     for p in parts)
        blocks: list[Block] = []
        if modern:
            blocks = _content_blocks(content, model_side=True)
        else:
            thoughts = o.get("thoughts") if isinstance(o.get("thoughts"), list) else []
            for th in thoughts:
                extra = {k: v for k, v in th.items() if k != "description"} if isinstance(th, dict) else None
                blocks.append(Block("thinking", text=_thought_text(th), extra=extra or None))
            blocks.extend(_content_blocks(content, model_side=True))
            blocks.extend(_tool_call_block(tc) for tc in calls)
        model = o.get("model") if isinstance(o.get("model"), str) and o.get("model") else None
        b.msgs.append(Message(role="assistant", blocks=blocks, model=model, provider=PROVIDER, api=API,
                              message_id=eid, usage=_usage(o.get("tokens")),
                              inherited=id(r) in inherited, **base))
        b.used.add(id(r))
        if id(r) not in inherited:
            b.answers += 1
        last_answer = len(b.msgs) - 1
        res = _results(calls, responded)
        if res:
            b.msgs.append(Message(role="tool", blocks=res, msg_key=f"{eid}#results",
                                  **{**base, "entry_id": f"{eid}#results"}))
    return b


def _results(calls: list[Any], responded: set[str]) -> list[Block]:
    out: list[Block] = []
    for tc in calls:
        if not isinstance(tc, dict) or tc.get("result") is None:
            continue  # never answered: the CLI sends no response for it
        cid = tc.get("id") if isinstance(tc.get("id"), str) else None
        if cid is not None and cid in responded:
            continue
        out.extend(_result_blocks(tc["result"], cid, tc.get("name") if isinstance(tc.get("name"), str) else None))
    return out


def _extend(m: Message, blocks: list[Block], r: _Rec, spath: str) -> None:
    """Blocks of another record appended to a message (each row keeps the line it came from)."""
    if m.block_lines is None:
        m.block_lines = [(m.entry_id, m.source_line, m.raw_line, m.source_file)] * len(m.blocks)
    m.blocks.extend(blocks)
    m.block_lines.extend([(r.id, r.line, r.raw, spath)] * len(blocks))


# ---------------------------------------------------------------- the two formats


@dataclass
class _Replay:
    """The records of a file applied in order: the live list and what was dropped from it."""

    live: dict[str, _Rec] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    drops: list[tuple[list[_Rec], set[str], str]] = field(default_factory=list)  # (list before, dropped ids, how)
    superseded: set[int] = field(default_factory=set)  # id() of versions replaced by a later one
    records: list[_Rec] = field(default_factory=list)  # every message version read, in file order

    def upsert(self, r: _Rec) -> None:
        old = self.live.get(r.id)
        if old is not None:
            self.superseded.add(id(old))
        self.live[r.id] = r
        self.records.append(r)

    def drop(self, ids: list[str], how: str) -> None:
        if not ids:
            return
        self.drops.append((list(self.live.values()), set(ids), how))
        for i in ids:
            del self.live[i]


def _load_records(path: Path, data: bytes | None) -> tuple[list[Thread], FileLoad]:
    load = FileLoad(path_str(path), FORMAT)
    spath = load.path
    rp = _Replay()
    line_kinds: dict[int, tuple[str, list[Any]]] = {}  # line → (raw, kinds: str or _Rec)
    for line_no, raw, objs in iter_json_lines(path, load, data):
        kinds: list[Any] = []
        for k, o in enumerate(objs):
            if not isinstance(o, dict):
                kinds.append(bad("not_an_object", f"expected a JSON object, got {type(o).__name__}"))
            elif isinstance(o.get("$rewindTo"), str):
                kinds.append("rewind")
                ids = list(rp.live)
                if o["$rewindTo"] in rp.live:
                    ids = ids[ids.index(o["$rewindTo"]):]
                else:
                    load.recovered.append({"file": spath, "line": line_no, "note": (
                        f"$rewindTo {o['$rewindTo'][:80]!r}: no such message; the CLI empties the list, and so "
                        "do we")})
                rp.drop(ids, "rewind")
                load.stats["gemini_rewinds"] += 1
            elif isinstance(o.get("$set"), dict):
                kinds.append("metadata_update")
                upd = o["$set"]
                rp.meta.update({k: v for k, v in upd.items() if k != "messages"})
                if isinstance(upd.get("messages"), list):
                    load.stats["gemini_history_replacements"] += 1
                    new: list[_Rec] = []
                    for j, m in enumerate(upd["messages"]):
                        if isinstance(m, dict) and isinstance(m.get("id"), str):
                            new.append(_Rec(m, line_no, raw, (line_no, k, j)))
                    if len(new) < len(upd["messages"]):
                        load.recovered.append({"file": spath, "line": line_no, "note": (
                            f"$set.messages: {len(upd['messages']) - len(new)} of {len(upd['messages'])} entries "
                            "are not messages with an 'id'; left out, as the CLI leaves them out")})
                    keep = {r.id for r in new}
                    rp.drop([i for i in rp.live if i not in keep], "replaced")
                    for r in new:
                        rp.upsert(r)
                        kinds.append(r)
            elif isinstance(o.get("id"), str):
                t = o.get("type")
                if not isinstance(t, str) or not t:
                    kinds.append(bad("no_type", "message record without a 'type' (expected user, gemini, info, "
                                     "error or warning)"))
                    continue
                r = _Rec(o, line_no, raw, (line_no, k, -1))
                rp.upsert(r)
                kinds.append(r)
            elif is_header(o):
                kinds.append("session_header")
                rp.meta.update({k2: v for k2, v in o.items() if k2 != "messages"})
                if isinstance(o.get("messages"), list):
                    for j, m in enumerate(o["messages"]):
                        if isinstance(m, dict) and isinstance(m.get("id"), str):
                            r = _Rec(m, line_no, raw, (line_no, k, j))
                            rp.upsert(r)
                            kinds.append(r)
            else:
                kinds.append(bad("unknown_record", "a JSON object that is no Gemini CLI record (header, message "
                                 "with an 'id', $set or $rewindTo); keys " + ", ".join(sorted(map(str, o))[:8])))
        line_kinds[line_no] = (raw, kinds)
    return _finish(path, load, rp, line_kinds)


def _finish(path: Path, load: FileLoad, rp: _Replay,
            line_kinds: dict[int, tuple[str, list[Any]]]) -> tuple[list[Thread], FileLoad]:
    spath = load.path
    sid_own = rp.meta.get("sessionId") if isinstance(rp.meta.get("sessionId"), str) and rp.meta.get(
        "sessionId") else None
    sid_own = sid_own or session_id_from_name(path) or path_str(path.name).split(".json")[0] or path_str(path.stem)
    session_id, thread_id = sid_own, "main"
    if rp.meta.get("kind") == "subagent":
        thread_id = f"agent-{sid_own}"
        if path.parent.parent.name == "chats":  # chats/<parent session id>/<session id>.jsonl
            session_id = path_str(path.parent.name)
    used: set[int] = set()
    threads: list[Thread] = []
    main = _build(list(rp.live.values()), spath)
    used |= main.used
    stats = Counter(gemini_answers=main.answers, gemini_notices=main.notices, gemini_tool_call_continuations=main.merged)
    if main.msgs:
        threads.append(Thread(session_id, thread_id, FORMAT, spath, main.msgs))
    for before, dropped, how in rp.drops:
        dropped_recs = [r for r in before if r.id in dropped]
        if not any(_is_answer(r) for r in dropped_recs):
            continue  # nothing answered there: only what the CLI itself took back (a failed prompt)
        kept = frozenset(id(r) for r in before if r.id not in dropped)
        br = _build(before, spath, inherited=kept)
        used |= br.used
        stats.update(gemini_answers=br.answers, gemini_tool_call_continuations=br.merged)
        stats[f"gemini_{how}_branches"] += 1
        threads.append(Thread(session_id, f"{thread_id}/branch-{dropped_recs[0].id}"
                              if thread_id != "main" else f"branch-{dropped_recs[0].id}", FORMAT, spath, br.msgs))
    superseded = 0
    for line_no, (raw, kinds) in sorted(line_kinds.items()):
        out: list[str] = []
        for kd in kinds:
            if not isinstance(kd, _Rec):
                out.append(kd)
            elif id(kd) in used:
                out.append("message")
            elif id(kd) in rp.superseded:
                out.append("superseded_version")
                superseded += 1
            elif kd.type not in MESSAGE_TYPES:
                out.append(f"message:{str(kd.type)[:60]}")
            else:
                out.append("dropped_from_history")
        load.account(line_no, raw, out)
    stats["gemini_superseded_versions"] = superseded
    load.stats.update(+stats)
    load.check()
    return threads, load


def _line_starts(text: str) -> list[int]:
    starts = [0]
    i = text.find("\n")
    while i >= 0:
        starts.append(i + 1)
        i = text.find("\n", i + 1)
    return starts


_decoder = json.JSONDecoder()


def _ws(text: str, i: int) -> int:
    n = len(text)
    while i < n and text[i] in " \t\r\n":
        i += 1
    return i


@dataclass
class _Doc:
    top: dict[str, Any] = field(default_factory=dict)
    elements: list[tuple[Any, int, int]] = field(default_factory=list)  # (value, start, end) of messages[]
    error: tuple[int, str, str] | None = None  # (offset, code, reason) where reading stopped


def _read_document(text: str, start: int) -> _Doc:
    """The document's top-level keys and the spans of its messages, read value by value, so that a
    document cut short keeps every message before the cut."""
    d = _Doc()
    n = len(text)

    def fail(i: int, what: str, exc: Exception | None = None) -> _Doc:
        # cut short: the text ends where more was expected (a copy taken mid-rewrite, a crash)
        at = exc.pos if isinstance(exc, json.JSONDecodeError) else i
        cut = _ws(text, at) >= n or (isinstance(exc, json.JSONDecodeError) and exc.msg.startswith("Unterminated"))
        d.error = (i, "truncated_json" if cut else "invalid_json",
                   ("the document stops" if cut else "invalid JSON") + f" {what}")
        return d

    i = _ws(text, start)
    if i >= n or text[i] != "{":
        return fail(i, "where its opening '{' was expected")
    i = _ws(text, i + 1)
    if i < n and text[i] == "}":
        i += 1
    else:
        while True:
            try:
                key, i = _decoder.raw_decode(text, i)
            except (ValueError, RecursionError) as exc:
                return fail(i, "where a key was expected", exc)
            i = _ws(text, i)
            if i >= n or text[i] != ":" or not isinstance(key, str):
                return fail(i, "after a key")
            i = _ws(text, i + 1)
            if key == "messages" and i < n and text[i] == "[":
                i = _ws(text, i + 1)
                d.top["messages"] = []
                if i < n and text[i] == "]":
                    i += 1
                else:
                    while True:
                        s = i
                        try:
                            v, i = _decoder.raw_decode(text, i)
                        except (ValueError, RecursionError) as exc:
                            return fail(s, f"inside message {len(d.elements)}", exc)
                        d.elements.append((v, s, i))
                        i = _ws(text, i)
                        if i < n and text[i] == "]":
                            i += 1
                            break
                        if i >= n or text[i] != ",":
                            return fail(i, f"after message {len(d.elements) - 1}")
                        i = _ws(text, i + 1)
            else:
                try:
                    d.top[key], i = _decoder.raw_decode(text, i)
                except (ValueError, RecursionError) as exc:
                    return fail(i, f"in the value of {key!r}", exc)
            i = _ws(text, i)
            if i < n and text[i] == "}":
                i += 1
                break
            if i >= n or text[i] != ",":
                return fail(i, "between two keys")
            i = _ws(text, i + 1)
    i = _ws(text, i)
    if i < n:
        d.error = (i, "invalid_json", "text after the end of the JSON document")
    return d


def _load_document(path: Path, data: bytes) -> tuple[list[Thread], FileLoad]:
    load = file_load(path, FORMAT_JSON, data, 0)
    spath = load.path
    lines = list(nonblank_lines(data))
    raws: dict[int, str] = {}
    for i, raw_b in lines:
        load.lines += 1
        load.digests[i] = line_digest(raw_b)
        raws[i] = raw_b.decode("utf-8", "backslashreplace").rstrip("\r")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        text = data.decode("utf-8", "replace")
        n_bad = text.count("\ufffd") - data.count(b"\xef\xbf\xbd")
        load.stats["invalid_utf8_replaced"] += n_bad
        load.recovered.append({"file": spath, "line": 1, "note": f"{n_bad} byte sequence(s) that are not UTF-8 "
                               "replaced by U+FFFD"})
    starts = _line_starts(text)

    def line_of(off: int) -> int:
        return bisect.bisect_right(starts, off)

    doc = _read_document(text, 1 if text.startswith("\ufeff") else 0)
    rp = _Replay()
    for k, v in doc.top.items():
        if k != "messages":
            rp.meta[k] = scrub(v)[0]
    kinds: dict[int, list[Any]] = {i: [] for i, _ in lines}
    for idx, (v, s, e) in enumerate(doc.elements):
        a, z = line_of(s), line_of(max(e - 1, s))
        span = [ln for ln in range(a, z + 1) if ln in kinds]
        if not isinstance(v, dict):
            kd: Any = bad("not_an_object", f"messages[{idx}] is not a JSON object")
        elif depth_exceeds(v):
            kd = bad("too_deep", f"messages[{idx}] is nested deeper than the loader reads")
        elif not isinstance(v.get("type"), str) or not v.get("type"):
            kd = bad("no_type", f"messages[{idx}] has no 'type' (expected user, gemini, info, error or warning)")
        else:
            v, replaced = scrub(v)
            if replaced:
                load.stats["lone_surrogates_replaced"] += replaced
            kd = _Rec(v, a, text[s:e], (a, idx, -1), index=idx)
            rp.records.append(kd)
            rp.live[f"\0{idx}"] = kd  # the older format keeps the list as written, ids or not
        for ln in span:
            kinds[ln].append(kd)
    if doc.error is not None:
        off, code, reason = doc.error
        first = line_of(off)
        for ln, ks in kinds.items():
            if ln >= first:
                ks.append(bad(code, reason))
        load.stats["gemini_document_cut"] += 1
    line_kinds = {ln: (raws[ln], ks or ["session_metadata"]) for ln, ks in kinds.items()}
    if not doc.elements and "messages" not in doc.top and doc.error is not None:
        # nothing of the document could be read: every line is quarantined with the reason
        off, code, reason = doc.error
        for ln in kinds:
            load.quarantine.append(QuarantineRow(spath, ln, raws[ln], reason, code))
        load.check()
        return [], load
    return _finish(path, load, rp, line_kinds)


def load(path: Path, data: bytes | None = None) -> tuple[list[Thread], FileLoad]:
    """Load one Gemini CLI session file: a `.json` name is the older format (one JSON document, read
    whole: the caller checks it is within the line limit), any other the records (read line by line,
    a line over the limit quarantined unread: `base.iter_json_lines`)."""
    path = Path(path)
    if path.name.endswith(".json"):
        return _load_document(path, read_file(path) if data is None else data)
    return _load_records(path, data)


# ---------------------------------------------------------------- copies of a session


def merge_copies(per_file: list[tuple[FileLoad, list[Thread]]]) -> list[Thread]:
    """Threads of Gemini CLI files, each session read once.

    When the CLI resumes an older `.json` session it writes `<name>.jsonl` beside it with every
    message again, so one session can sit in two files. Files whose threads share a session and
    thread id are compared by message id: the file with the most messages is replayed (the `.jsonl`
    on a tie); another whose messages it all holds is a copy (its lines count as `duplicate_entry`,
    its threads are dropped); one with messages of its own is kept apart as session
    `<id>~<hash>` (of its file name and first message id of its own, never of its directory: the
    same files elsewhere give the same ids) and reported."""
    import hashlib

    groups: dict[tuple[str, str], list[tuple[FileLoad, list[Thread]]]] = {}
    for ld, ths in per_file:
        if ths:
            groups.setdefault((ths[0].session_id, ths[0].thread_id), []).append((ld, ths))

    def ids(ths: list[Thread]) -> set[str]:
        return {m.entry_id for t in ths for m in t.messages}

    for (sid, _tid), members in groups.items():
        if len(members) < 2:
            continue
        members.sort(key=lambda m: (-len(ids(m[1])), m[0].format != FORMAT, m[0].path))
        primary = members[0]
        seen = ids(primary[1])
        for ld, ths in members[1:]:
            own = ids(ths) - seen
            if own:
                mark = f"{Path(ld.path).name}\0{min(own)}"  # not the path: issue 23, item 11
                new_sid = f"{sid}~{hashlib.sha256(mark.encode('utf-8', 'surrogatepass')).hexdigest()[:8]}"
                for t in ths:
                    t.session_id = new_sid
                ld.stats["session_copies_kept_apart"] += 1
                ld.recovered.append({"file": ld.path, "line": 1, "note": (
                    f"session {sid!r} is also in {primary[0].path} but this file holds {len(own)} message(s) it "
                    f"does not; replayed apart as session {new_sid!r}")})
                seen |= own
                continue
            n = ld.lines - ld.quarantined_lines
            ld.message_lines = 0
            ld.other_lines = Counter({"duplicate_entry": n}) if n else Counter()
            ld.stats["duplicate_session_files"] += 1
            ld.stats["duplicate_entries"] += n
            ld.recovered.append({"file": ld.path, "line": 1, "note": (
                f"a copy of session {sid!r} (read from {primary[0].path}): every message of it is there; its "
                f"{n} line(s) counted as duplicate_entry, not replayed twice")})
            ld.check()
            ths.clear()
    return [t for _, ths in per_file for t in ths]


# ---------------------------------------------------------------- the default target of a run


def is_session_file(path: Path) -> bool | None:
    """True for a Gemini CLI session file, False for a JSONL transcript of another format, None for
    anything else (a `.json` that is no Gemini session, an empty, unreadable or special file):
    judged from the file's first bytes only."""
    head = first_bytes(path)
    if head is None:
        return None
    if path.name.endswith(".json"):
        return True if sniff_document(None, head) else None
    for raw in head.split(b"\n"):
        if not raw.strip():
            continue
        try:
            o = json.loads(raw.decode("utf-8", "replace"))
        except ValueError:
            return None  # a first line cut by the 64 KiB window, or damaged: no verdict
        return sniff([o], path) is not None
    return None


def native_target(paths: list[Path]) -> str | None:
    """The one wire shape the transcripts under `paths` (files, or folders searched for `*.json`
    and `*.jsonl`) were sent in, when they are all of one agent that has its own: `gemini` for
    Gemini CLI sessions, `openai-responses` for Codex CLI rollouts (Codex sends the Responses API
    its base instructions as `instructions` and its developer messages as input items, which only
    that shape keeps where they were). A run without --target and without a spec target then
    replays them in that shape. Else None: a run has one target for all its files, so mixed inputs
    keep the default. Reads the first bytes of each file, and stops at the first transcript of
    another format."""
    import os

    from ctxreplay.pipeline.loaders.codex import is_rollout_file

    found: set[str] = set()
    for p in map(Path, paths):
        if p.is_dir():
            files = (Path(d) / n for d, _, names in os.walk(p) for n in sorted(names)
                     if n.endswith((".json", ".jsonl")))
        else:
            files = iter([p])
        for f in files:
            if is_rollout_file(f):
                found.add("openai-responses")
            else:
                v = is_session_file(f)
                if v is False:
                    return None
                if v:
                    found.add("gemini")
            if len(found) > 1:
                return None
    return found.pop() if found else None
