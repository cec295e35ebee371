"""Generated input for the `--html` pages: Claude Code sessions over about eight months, under a
dozen models, with cache hit rates between about 95 and 98 % (our own words, no real data).

Each session is `turns` turns (ask, Read, the file's text, answer). Its usage grows as Claude
Code's does: the first request reads a system prompt cached by earlier sessions and writes the
rest, each later one reads the previous prompt and writes the new tail.
"""

from __future__ import annotations

from datetime import date, timedelta
from pathlib import Path
from typing import Any

import orjson

# priced Claude models (genai-prices), more than plotly's ten default colours
MODELS = ("claude-opus-4-6", "claude-opus-4-5", "claude-opus-4-1", "claude-opus-4", "claude-sonnet-4-6",
          "claude-sonnet-4-5", "claude-sonnet-4", "claude-3-7-sonnet", "claude-3-5-sonnet", "claude-haiku-4-5",
          "claude-3-5-haiku", "claude-3-haiku")


def session_id(i: int) -> str:
    return f"5e55{i:04x}-0000-4000-8000-{i:012x}"


def write_session(dst: Path, i: int, day: date, model: str, *, turns: int = 3, cached: int = 20_000) -> Path:
    """Session `i` on `day` (from 09:00 UTC), `turns` turns under `model`; its first request reads
    `cached` tokens of system prompt."""
    sid = session_id(i)
    lines: list[dict[str, Any]] = []
    parent: str | None = None
    n = 0
    prompt = cached + 3000
    prev = cached

    def add(kind: str, content: Any, s: int, out: int = 0, stop: str = "tool_use") -> None:
        nonlocal parent, n, prompt, prev
        n += 1
        uid = f"{i:08x}-0000-4000-8000-{n:012d}"
        msg: dict[str, Any] = {"role": kind, "content": content}
        prompt += len(orjson.dumps(content)) // 3
        if kind == "assistant":
            write = prompt - prev
            msg = {"id": f"msg_{i:04d}_{n:03d}", "type": "message", "role": "assistant", "model": model,
                   "content": content, "stop_reason": stop,
                   "usage": {"input_tokens": 3, "output_tokens": out, "cache_read_input_tokens": prev,
                             "cache_creation_input_tokens": write,
                             "cache_creation": {"ephemeral_5m_input_tokens": write, "ephemeral_1h_input_tokens": 0}}}
            prev = prompt
        stamp = f"{day.isoformat()}T{9 + s // 3600:02d}:{s // 60 % 60:02d}:{s % 60:02d}.000Z"
        line = {"parentUuid": parent, "isSidechain": False, "type": kind, "uuid": uid, "sessionId": sid,
                "timestamp": stamp, "message": msg, "cwd": f"/home/dev/p{i % 5}", "version": "2.1.0"}
        if kind == "assistant":
            line["requestId"] = f"req_{i:04d}_{n:03d}"
        lines.append(line)
        parent = uid

    t = 0
    for k in range(turns):
        add("user", [{"type": "text", "text": f"Read chapter {k} and summarise it."}], t)
        add("assistant", [{"type": "tool_use", "id": f"toolu_{i:04d}_{k:03d}", "name": "Read",
                           "input": {"file_path": f"/doc/ch{k}.txt"}}], t + 2, out=30)
        body = "\n".join(f"chapter {k} line {j}: the quick brown fox jumps over the lazy dog {j * k}"
                         for j in range(30))
        add("user", [{"type": "tool_result", "tool_use_id": f"toolu_{i:04d}_{k:03d}", "content": body}], t + 3)
        add("assistant", [{"type": "text", "text": f"Chapter {k} explains step {k}."}], t + 6, out=20,
            stop="end_turn")
        t += 40
    path = dst / f"-home-dev-p{i % 5}" / f"{sid}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\n".join(orjson.dumps(x) for x in lines) + b"\n")
    return path


def write_months(dst: Path, *, start: date = date(2026, 1, 5), days: int = 240, sessions: int = 60,
                 models: tuple[str, ...] = MODELS) -> list[Path]:
    """`sessions` sessions spread over `days` days from `start` (about eight months by default),
    the models in turn; the cached system prompt (so the hit rate) differs from session to session."""
    out = []
    for i in range(sessions):
        day = start + timedelta(days=i * (days - 1) // max(sessions - 1, 1))
        out.append(write_session(dst, i, day, models[i % len(models)], turns=2 + i % 3,
                                 cached=12_000 + (i * 7919) % 40_000))
    return out
