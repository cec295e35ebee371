"""Generated Claude Code sessions for tests: entries as the CLI writes them (one API message per
assistant entry), chained by parentUuid, with uuids from the entry's position and timestamps that
advance by a gap per entry.

Each method appends one entry (or a tool call and its result) after `parent`, by default the last
entry written, and returns the uuid of the entry it appended last, so a test can branch (a rewind
names an older parent) or just chain.
"""

from __future__ import annotations

import importlib
import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

_TIP: Any = object()  # "after the last entry written"


class CCSession:
    """The entries of one generated Claude Code session (dicts, in file order)."""

    def __init__(self, session_id: str, t0: datetime) -> None:
        self.session_id = session_id
        self.entries: list[dict[str, Any]] = []
        self.t = t0
        self.tip: str | None = None

    def entry(self, typ: str, message: dict[str, Any], gap: float, parent: str | None = _TIP, **kw: Any) -> str:
        n = len(self.entries) + 1
        self.t += timedelta(seconds=gap)
        uid = f"{n:08x}-0000-4000-8000-{n:012x}"
        self.entries.append({"parentUuid": self.tip if parent is _TIP else parent, "isSidechain": False,
                             "type": typ, "uuid": uid, "sessionId": self.session_id, "version": "2.1.40",
                             "timestamp": self.t.isoformat(), "message": message, **kw})
        self.tip = uid
        return uid

    def user(self, text: str, gap: float = 30, parent: str | None = _TIP) -> str:
        return self.entry("user", {"role": "user", "content": text}, gap, parent)

    def tool_call(self, k: int, name: str, size: int, gap: float = 5, parent: str | None = _TIP) -> str:
        """An assistant tool call (`toolu_<k>`, message `msg_<k>`) and its result of `size`
        characters, 2 s later; returns the result's uuid."""
        tid = f"toolu_{k:06d}"
        a = self.entry("assistant", _assistant(k, [{"type": "tool_use", "id": tid, "name": name, "input": {"k": k}}],
                                               "tool_use"), gap, parent, requestId=f"req_{k:06d}")
        body = "\n".join(f"{name} {k} line {i} " + "x" * 60 for i in range(size // 80 + 1))[:size]
        return self.entry("user", {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tid,
                                                                 "content": body}]}, 2, a)

    def answer(self, k: int, text: str, gap: float = 5, parent: str | None = _TIP) -> str:
        """An assistant text answer (message `msg_<k>`)."""
        return self.entry("assistant", _assistant(k, [{"type": "text", "text": text}], "end_turn"), gap, parent,
                          requestId=f"req_{k:06d}")

    def write(self, path: Path, upto: int | None = None) -> Path:
        """The first `upto` entries (all by default) as a JSONL file."""
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(x) + "\n" for x in self.entries[:upto]))
        return path


def _assistant(k: int, content: list[dict[str, Any]], stop: str) -> dict[str, Any]:
    return {"id": f"msg_{k:06d}", "type": "message", "role": "assistant", "model": "claude-x", "content": content,
            "stop_reason": stop, "usage": {"input_tokens": 10, "output_tokens": 5}}


@contextmanager
def shout_plugin() -> Iterator[None]:
    """The test plug-in stage `shout` (tests/plugins/misbehaving.py) registered for the block, and
    unregistered after it."""
    from ctxreplay.pipeline.stageapi.registry import STAGES

    sys.modules.pop("tests.plugins.misbehaving", None)
    importlib.import_module("tests.plugins.misbehaving")
    try:
        yield
    finally:
        STAGES.pop("shout", None)
        sys.modules.pop("tests.plugins.misbehaving", None)


def cc_entry(session_id: str, uuid: str, parent: str | None, role: str, content: Any, t: int,
             **msg: Any) -> dict[str, Any]:
    """One Claude Code transcript entry of session `session_id` at 10:00 + `t` seconds on 2026-06-01; an
    assistant entry gets `msg_<uuid>` / `req_<uuid>` ids, `end_turn`, and `msg`'s fields (model, usage, ...)."""
    m: dict[str, Any] = {"role": role, "content": content}
    e: dict[str, Any] = {"type": role, "uuid": uuid, "parentUuid": parent, "sessionId": session_id,
                         "isSidechain": False, "timestamp": f"2026-06-01T10:{t // 60:02d}:{t % 60:02d}.000Z",
                         "message": m}
    if role == "assistant":
        e["requestId"] = f"req_{uuid}"
        m.update(id=f"msg_{uuid}", type="message", stop_reason="end_turn", **msg)
    return e
