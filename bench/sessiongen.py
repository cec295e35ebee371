"""Writing generated Claude Code sessions for the benchmarks: entries chained by parentUuid, with
fresh uuids and timestamps one second apart per step index."""

from __future__ import annotations

import json
from typing import Any


class SessionLines:
    """The JSONL lines of one generated session; `entry` appends one entry after the previous."""

    def __init__(self, session_id: str) -> None:
        self.session_id = session_id
        self.lines: list[str] = []
        self.parent: str | None = None
        self.n = 0

    @staticmethod
    def ts(i: int) -> str:
        return f"2026-01-{1 + i // 86_400:02d}T{(i // 3600) % 24:02d}:{(i // 60) % 60:02d}:{i % 60:02d}.000Z"

    def entry(self, typ: str, message: dict[str, Any], i: int, **kw: Any) -> None:
        self.n += 1
        u = f"00000000-0000-4000-8000-{self.n:012d}"
        self.lines.append(json.dumps({"type": typ, "uuid": u, "parentUuid": self.parent, "sessionId": self.session_id,
                                      "timestamp": self.ts(i), "isSidechain": False, "message": message, **kw}))
        self.parent = u
