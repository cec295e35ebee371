"""Recorded usage of Gemini CLI sessions for `ctxreplay report` (light: orjson and the standard library).

Both formats (docs/gemini-cli.md): the older `session-*.json` document and the newer `*.jsonl`
record stream. Every answer (`type: gemini` with `tokens`) is one billed request, counted once:
its latest recorded version, by message id (the record stream writes an answer again when its tool
calls arrive; `$set.messages` writes the list again). An answer a rewind or a rolled-back history
dropped from the list was still billed, so it is counted.

Tokens: `input` (the prompt, cached tokens included) and `tool` (more prompt) → uncached input
`input - cached + tool`; `cached` → cache reads; `output + thoughts` → output (thinking is billed
as output); no cache writes (Gemini's implicit caching has no write fee).

The record's key is ("gemini", the file's sessionId, message id), so the two files of a session
the CLI resumed (the `.json` and the `.jsonl` it wrote beside it with every message again) count
each answer once. A subagent's file (`chats/<parent session id>/<id>.jsonl`, `kind: subagent`)
belongs to its parent's session. The project is the `~/.gemini/tmp/<project>` folder's name
(a slug or, in older CLIs, the project's hash), else the session's `projectHash`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

import orjson

from ctxreplay.pipeline.reporting.tokencount import token_count

SOURCE = "gemini-cli"
PROVIDER = "google"
_HEAD = re.compile(rb'^\s*\{\s*"(?:sessionId|projectHash)"')


def is_session_name(name: str) -> bool:
    """A Gemini CLI session file of the older format found in a folder (`session-*.json`)."""
    return name.endswith(".json") and "session-" in name


def is_header(o: Any) -> bool:
    return (isinstance(o, dict) and isinstance(o.get("sessionId"), str) and isinstance(o.get("projectHash"), str)
            and "type" not in o and "id" not in o)


def is_document(data: Any) -> bool:
    """The older format written over several lines: a document that starts with the session's keys
    and whose first line is no JSON value of its own (a one-line document reads as a header that
    holds the messages, as the CLI itself reads it)."""
    head = bytes(data[:4096]).lstrip(b"\xef\xbb\xbf")
    if not (_HEAD.match(head) and b'"projectHash"' in head):
        return False
    first = head.lstrip().split(b"\n", 1)[0]
    try:
        orjson.loads(first)
    except orjson.JSONDecodeError:
        return True
    return False




def _every_line(data: Any) -> Iterator[tuple[int, bytes]]:
    start = 0
    for line in bytes(data).split(b"\n"):
        yield start, line
        start += len(line) + 1


def _line_no(data: Any, pos: int) -> int:
    return bytes(data[:pos]).count(b"\n") + 1


def _ids(path: str, meta: dict[str, Any]) -> tuple[str, str, str]:
    """(own session id, session the records belong to, project) of a file."""
    parts = path.replace("\\", "/").split("/")
    own = meta.get("sessionId") if isinstance(meta.get("sessionId"), str) and meta.get("sessionId") else \
        parts[-1].split(".json")[0]
    session = own
    if meta.get("kind") == "subagent" and len(parts) >= 3 and parts[-3] == "chats":
        session = parts[-2]
    if len(parts) >= 3 and parts[-2] == "chats":
        project = parts[-3]
    elif len(parts) >= 4 and parts[-3] == "chats":
        project = parts[-4]
    else:
        ph = meta.get("projectHash")
        project = ph if isinstance(ph, str) else ""
    return own, session, project


def scan(path: str, data: Any, lines: Callable[[Any], Iterator[tuple[int, bytes]]] | None = None,
         ) -> tuple[list[tuple[Any, ...]], list[dict[str, Any]], int]:
    """(records, bad lines, usage lines) of one Gemini CLI file.

    `lines(data)`: its (offset, line) pairs (the report's, which leaves out lines over --max-line-bytes);
    default: every line. Records have the layout of `ctxreplay.pipeline.reporting.report` (KEY ... SOURCE)."""
    answers: dict[str, dict[str, Any]] = {}  # message id → its latest version that has tokens
    meta: dict[str, Any] = {}
    bad: list[dict[str, Any]] = []
    usage_lines = 0

    def take(m: Any) -> None:
        if isinstance(m, dict) and m.get("type") == "gemini" and isinstance(m.get("id"), str) \
                and isinstance(m.get("tokens"), dict):
            answers[m["id"]] = m

    if is_document(data):
        try:
            doc = orjson.loads(bytes(data).removeprefix(b"\xef\xbb\xbf"))
        except orjson.JSONDecodeError as exc:
            return [], [{"file": path, "line": 0, "reason": f"not one JSON document: {exc}"[:200], "raw": ""}], 0
        if isinstance(doc, dict):
            meta = doc
            for m in doc.get("messages") or [] if isinstance(doc.get("messages"), list) else []:
                take(m)
        usage_lines = len(answers)
    else:
        each = lines(data) if lines is not None else _every_line(data)
        for s, line in each:
            if not line.strip():
                continue
            try:
                o = orjson.loads(line)
            except orjson.JSONDecodeError as exc:
                bad.append({"file": path, "line": _line_no(data, s), "reason": f"not valid JSON: {exc}"[:200],
                            "raw": line[:200].decode("utf-8", "replace")})
                continue
            if not isinstance(o, dict):
                continue
            if is_header(o):
                meta.update(o)
                for m in o.get("messages") or [] if isinstance(o.get("messages"), list) else []:
                    take(m)
            elif isinstance(o.get("$set"), dict):
                meta.update({k: v for k, v in o["$set"].items() if k != "messages"})
                if isinstance(o["$set"].get("messages"), list):
                    for m in o["$set"]["messages"]:
                        take(m)
            elif "tokens" in o:
                usage_lines += 1
                take(o)
    own, session, project = _ids(path, meta)
    records = []
    for mid, m in answers.items():
        t = m["tokens"]
        cached = token_count(t.get("cached"))
        inp = max(token_count(t.get("input")) - cached, 0) + token_count(t.get("tool"))
        out = token_count(t.get("output")) + token_count(t.get("thoughts"))
        total = inp + out + cached
        if total == 0:
            continue
        model = m.get("model") if isinstance(m.get("model"), str) and m.get("model") else "unknown"
        ts = m.get("timestamp") if isinstance(m.get("timestamp"), str) else ""
        records.append((("gemini", own, mid), 2, total, session, project, ts, model, PROVIDER,
                        inp, out, 0, 0, cached, (), 0, None, SOURCE))
    return records, bad, usage_lines
