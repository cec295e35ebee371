"""Gemini CLI sessions written here (our own words and numbers), in both formats the CLI writes:
the older `session-*.json` document (rewritten whole on every turn) and the newer `*.jsonl`
record stream (a header, one record per message version, `$set` and `$rewindTo` records)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

SID = "5e551000-aaaa-4bbb-8ccc-000000000001"
PROJECT = "f" * 64
T0 = datetime(2026, 3, 1, 9, 0, tzinfo=UTC)


def ts(seconds: float) -> str:
    return (T0 + timedelta(seconds=seconds)).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def tokens(inp: int, out: int, cached: int = 0, thoughts: int = 0, tool: int = 0) -> dict[str, int]:
    return {"input": inp, "output": out, "cached": cached, "thoughts": thoughts, "tool": tool,
            "total": inp + out + thoughts + tool}


def tool_call(cid: str, name: str, args: dict[str, Any], output: str | None, *, status: str = "success",
              t: float = 0) -> dict[str, Any]:
    tc: dict[str, Any] = {"id": cid, "name": name, "args": args, "status": status, "timestamp": ts(t),
                          "displayName": name.title(), "description": "a tool", "renderOutputAsMarkdown": False}
    if output is not None:
        key = "output" if status == "success" else "error"
        tc["result"] = [{"functionResponse": {"id": cid, "name": name, "response": {key: output}}}]
        tc["resultDisplay"] = output[:20]
    return tc


@dataclass
class GeminiSession:
    """Messages in order; `document()` / `records()` write them in either format."""

    sid: str = SID
    messages: list[dict[str, Any]] = field(default_factory=list)
    n: int = 0
    kind: str | None = None

    def _id(self) -> str:
        self.n += 1
        return f"00000000-1111-4222-8333-{self.n:012d}"

    def user(self, text: str, t: float, **extra: Any) -> dict[str, Any]:
        m = {"id": self._id(), "timestamp": ts(t), "type": "user", "content": [{"text": text}], **extra}
        self.messages.append(m)
        return m

    def answer(self, text: str, t: float, tok: dict[str, int] | None, *, model: str = "gemini-2.5-pro",
               thoughts: list[tuple[str, str]] = (), calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        m: dict[str, Any] = {"id": self._id(), "timestamp": ts(t), "type": "gemini", "content": text,
                             "thoughts": [{"subject": s, "description": d, "timestamp": ts(t)} for s, d in thoughts],
                             "model": model}
        if tok is not None:
            m["tokens"] = tok
        if calls:
            m["toolCalls"] = calls
        self.messages.append(m)
        return m

    def notice(self, kind: str, text: str, t: float) -> dict[str, Any]:
        m = {"id": self._id(), "timestamp": ts(t), "type": kind, "content": text}
        self.messages.append(m)
        return m

    def header(self) -> dict[str, Any]:
        h = {"sessionId": self.sid, "projectHash": PROJECT, "startTime": ts(0),
             "lastUpdated": self.messages[-1]["timestamp"] if self.messages else ts(0)}
        if self.kind:
            h["kind"] = self.kind
        return h

    def document(self) -> str:
        """The older format: the whole conversation as one pretty-printed document."""
        return json.dumps({**self.header(), "messages": self.messages}, indent=2, ensure_ascii=False)

    def records(self, *, rewrite_answers: bool = True) -> list[dict[str, Any]]:
        """The newer format as the CLI appends it: each message, then a `$set` of lastUpdated; an
        answer with tool calls is first written without them, then again with them."""
        out: list[dict[str, Any]] = [self.header()]
        for m in self.messages:
            if rewrite_answers and m["type"] == "gemini" and m.get("toolCalls") and m.get("content"):
                out.append({k: v for k, v in m.items() if k != "toolCalls"})
                out.append({"$set": {"lastUpdated": m["timestamp"]}})
            out.append(m)
            out.append({"$set": {"lastUpdated": m["timestamp"]}})
        return out


def write_jsonl(path: Path, records: list[Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r, ensure_ascii=False)) + "\n"
                            for r in records), encoding="utf-8")
    return path


def write_json(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def standard(sid: str = SID) -> GeminiSession:
    """A session with everything the formats hold: a failed request (error + info notices) and its
    retry, thoughts, an answer with two tool calls (one failed), a tool call the user cancelled
    after a notice (the CLI writes it as a message of its own), a model switch, and a last answer."""
    s = GeminiSession(sid)
    s.user("list the files and read the notes", 0)
    s.notice("error", "[API Error: quota exhausted for this model]", 2)
    s.notice("info", "This request failed. Press F12 for diagnostics.", 2)
    s.user("list the files and read the notes", 20)
    s.answer("Listing first.", 24, tokens(5000, 20, 0, 60), thoughts=[("Planning", "I will list the folder.")],
             calls=[tool_call("list_directory_1_0", "list_directory", {"dir_path": "."}, "notes.txt\nmain.py", t=25),
                    tool_call("read_file_1_1", "read_file", {"file_path": "missing.txt"}, "File not found.",
                              status="error", t=25)])
    s.answer("Reading the notes now.", 30, tokens(5400, 15, 4800, 40),
             calls=[tool_call("read_file_2_0", "read_file", {"file_path": "notes.txt"}, "buy milk", t=31)])
    s.answer("The notes say: buy milk.", 35, tokens(5600, 12, 5300, 0))
    s.user("now delete them", 100)
    s.answer("I will delete notes.txt.", 104, tokens(5700, 18, 5500, 25), thoughts=[("Deleting", "rm it.")])
    s.notice("info", "Request cancelled.", 130)
    s.answer("", 131, None, calls=[tool_call("run_shell_command_3_0", "run_shell_command", {"command": "rm notes.txt"},
                                             "[Operation Cancelled] Reason: Operation cancelled",
                                             status="cancelled", t=131)])
    s.user("ok, keep them", 200)
    s.answer("Kept.", 203, tokens(6000, 5, 0, 0), model="gemini-2.5-flash")
    return s
