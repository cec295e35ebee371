"""Helpers for the inspection tests (why, threads, ledger, CLI conventions): a CLI runner, a small
Claude Code session written here (our own words) that makes sanitize, images, pairing and
tombstone fire, and the effective decisions at a call computed from a run's files alone."""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

import orjson
import polars as pl
from click.testing import CliRunner, Result

from ctxreplay.pipeline.commands.cli import main

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "data" / "samples"
KEY = ["entry_id", "block_pos", "part_pos"]
SYN_SID = "a0b1c2d3-0000-4000-8000-00000000c0de"


def cli(*args: object) -> Result:
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def one_error_line(r: Result) -> str:
    """The one paragraph a refused command printed on stderr (one line, no traceback)."""
    assert "Traceback" not in r.output and "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ctxreplay: "), r.stderr
    return lines[0]


def _png(width: int, height: int) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (width, height), (200, 40, 40)).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def write_session(dst: Path, *, sid: str = SYN_SID, pending_user: bool = True) -> Path:
    """A Claude Code session: a 2,400 px image (images resizes it), a blank text block (sanitize
    drops it), two tool calls answered in the wrong order with a user note between (pairing moves
    the results), old long results and an idle gap of two hours (tombstone clears them), and,
    with `pending_user`, a last user message with a blank block (a provisional sanitize decision
    for the pending call)."""
    lines: list[dict[str, Any]] = []
    parent: str | None = None
    n = 0

    def add(kind: str, content: Any, ts: str, **extra: Any) -> None:
        nonlocal parent, n
        n += 1
        uid = f"00000000-0000-4000-8000-{n:012d}"
        msg: dict[str, Any] = {"role": kind, "content": content}
        if kind == "assistant":
            msg = {"id": f"msg_syn_{n:02d}", "type": "message", "role": "assistant", "model": "claude-sonnet-4-5",
                   "content": content, "stop_reason": extra.pop("stop_reason", "tool_use"),
                   "usage": {"input_tokens": 10, "output_tokens": 5, "cache_read_input_tokens": 0,
                             "cache_creation_input_tokens": 0}}
        line = {"parentUuid": parent, "isSidechain": False, "type": kind, "uuid": uid, "sessionId": sid,
                "timestamp": ts, "message": msg, **extra}
        if kind == "assistant":
            line["requestId"] = f"req_syn_{n:02d}"
        lines.append(line)
        parent = uid

    long_a = "\n".join(f"line {i} of the first listing" for i in range(60))
    long_b = "\n".join(f"row {i}: " + "x" * 40 for i in range(60))
    add("user", [{"type": "text", "text": "Please look at this picture and the two files."},
                 {"type": "text", "text": "   "},
                 {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": _png(2400, 60)}}],
        "2026-05-01T10:00:00.000Z")
    add("assistant", [{"type": "tool_use", "id": "toolu_syn_A", "name": "Read", "input": {"file_path": "/a.txt"}},
                      {"type": "tool_use", "id": "toolu_syn_B", "name": "Read", "input": {"file_path": "/b.txt"}}],
        "2026-05-01T10:00:05.000Z")
    add("user", [{"type": "tool_result", "tool_use_id": "toolu_syn_B", "content": long_b}], "2026-05-01T10:00:06.000Z")
    add("user", [{"type": "text", "text": "(a note typed while the tools ran)"}], "2026-05-01T10:00:07.000Z")
    add("user", [{"type": "tool_result", "tool_use_id": "toolu_syn_A", "content": long_a}], "2026-05-01T10:00:08.000Z")
    add("assistant", [{"type": "text", "text": "Both files are listings."}], "2026-05-01T10:00:10.000Z",
        stop_reason="end_turn")
    for i in range(7):
        hour = 10 if i < 6 else 12  # two idle hours before the last read: tombstone's idle trigger
        add("user", [{"type": "text", "text": f"Now read file {i}."}], f"2026-05-01T{hour}:1{i}:00.000Z")
        add("assistant", [{"type": "tool_use", "id": f"toolu_syn_C{i}", "name": "Read",
                           "input": {"file_path": f"/c{i}.txt"}}], f"2026-05-01T{hour}:1{i}:05.000Z")
        add("user", [{"type": "tool_result", "tool_use_id": f"toolu_syn_C{i}", "content": long_a + f"\nend {i}"}],
            f"2026-05-01T{hour}:1{i}:06.000Z")
        add("assistant", [{"type": "text", "text": f"File {i} read."}], f"2026-05-01T{hour}:1{i}:10.000Z",
            stop_reason="end_turn")
    if pending_user:
        add("user", [{"type": "text", "text": "One more thing:"}, {"type": "text", "text": " \n "}],
            "2026-05-01T12:20:00.000Z")
    path = dst / "-home-dev-syn" / f"{sid}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\n".join(orjson.dumps(x) for x in lines) + b"\n")
    return path


def visible(df: pl.DataFrame, k: int) -> pl.DataFrame:
    return df.filter((pl.col("first_call") <= k) & (pl.col("last_call").is_null() | (pl.col("last_call") > k)))


def effective(decisions: pl.DataFrame, final: pl.DataFrame, recorded: pl.DataFrame, sid: str, tid: str,
              k: int) -> list[tuple[Any, ...]]:
    """Decisions effective at call k, from the run's files alone: from_call <= k, on a block the
    run's view (blocks.parquet) or the recorded view (an identity run's blocks.parquet) holds at k."""
    mine = (pl.col("session_id") == sid) & (pl.col("thread_id") == tid)
    keys = pl.concat([visible(final.filter(mine), k).select(KEY), visible(recorded.filter(mine), k).select(KEY)])
    d = decisions.filter(mine & (pl.col("from_call") <= k)).join(keys.unique(), on=KEY, how="semi")
    return sorted(d.select(*KEY, "stage", "action", "reason", "from_call").rows())


def shown(doc: dict[str, Any]) -> list[tuple[Any, ...]]:
    """The decisions a `why --json` document shows, one per annotation (not de-duplicated)."""
    return sorted((b["entry_id"], b["block_pos"], b["part_pos"], d["stage"], d["action"], d["reason"], d["from_call"])
                  for m in doc["messages"] for b in m["blocks"] for d in b["decisions"])
