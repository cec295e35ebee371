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


BLOCKS_SESSION = "11111111-2222-4333-8444-555555555555"


def many_blocks_lines(n: int, turns: int = 1) -> list[str]:
    """A Claude Code session whose user message is a list of `n` tiny text blocks (`{"type": "text",
    "text": "x"}`), answered with usage; `turns` > 1 repeats the pair (issue 23, item 5: memory and
    time must be linear in the blocks of one message)."""
    g = SessionLines(BLOCKS_SESSION)
    for k in range(turns):
        g.entry("user", {"role": "user", "content": [{"type": "text", "text": "x"} for _ in range(n)]}, 2 * k)
        g.entry("assistant", {"id": f"msg_{k}", "type": "message", "role": "assistant",
                              "model": "claude-sonnet-4-5-20250929", "content": [{"type": "text", "text": "ok"}],
                              "stop_reason": "end_turn",
                              "usage": {"input_tokens": n, "output_tokens": 1, "cache_creation_input_tokens": 0,
                                        "cache_read_input_tokens": 0}}, 2 * k + 1, requestId=f"req_{k}")
    return g.lines
