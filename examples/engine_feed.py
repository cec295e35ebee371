"""Feed Claude Code transcript files to the live engine line by line, as the agent wrote them, and
check every request against what `ctxreplay run` wrote for the same call (OUT/calls.parquet):

    ctxreplay run data/samples/claude-projects --out replay
    python examples/engine_feed.py replay data/samples/claude-projects/-home-dev-demo/5f0c1d2e-*.jsonl \\
        data/samples/claude-projects/-home-dev-demo/5f0c1d2e-*/subagents/agent-*.jsonl

Give it the files of one or more sessions (a main file `<session>.jsonl`, its sub-agents'
`<session>/subagents/agent-<id>.jsonl`), run with the same preset (`--preset`, default `default`).
The lines of a session's files are fed in the order of their timestamps, as they were written.
Before the first line of each new answer, it assembles the request that answer was given for,
on the thread `thread_for` picks, with the answer's model, and compares its sha256 with the one
`ctxreplay run` wrote for the call that answer answers (found by the answer's message id and
request id). At the end, each thread's pending request (`awaiting_user=True`) is compared with
the run's pending call. Exit status 1 when a request differs. docs/engine.md walks through it.
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import polars as pl

from ctxreplay import Engine
from ctxreplay.pipeline.engine.engine import AssembleResult, iter_lines


def engine_file(path: Path) -> str:
    """The name a Claude Code transcript file is given to `ingest(file=...)`: its name on disk,
    `<session>.jsonl`, or `<session>/subagents/agent-<id>.jsonl` for a sub-agent's file."""
    if path.parent.name == "subagents":
        return f"{path.parent.parent.name}/subagents/{path.name}"
    return path.name


def session_of(path: Path) -> str:
    """The session a Claude Code file belongs to: the `sessionId` of its entries (a sub-agent's
    file has its parent session's), as `ctxreplay run` reads it."""
    for _, _, entry in timed_lines([path]):
        if isinstance(entry.get("sessionId"), str):
            return str(entry["sessionId"])
    return engine_file(path).split("/")[0].removesuffix(".jsonl")


def starts_an_answer(entry: dict[str, Any], last_id: str | None) -> bool:
    """Claude Code writes one answer (one API response) as several lines, one per content block
    (thinking, text, each tool call), each with the same `message.id`: a new answer starts at an
    assistant line whose message id is not the one of the line before it in its file."""
    msg = entry.get("message")
    return entry.get("type") == "assistant" and isinstance(msg, dict) and msg.get("id") != last_id


class ThreadPicker:
    """The engine thread an answer is given on, from the entries of its file seen so far.

    - a sub-agent's own file (`subagents/agent-<id>.jsonl`, or `agent-<id>.jsonl` beside the
      session's) holds one thread: `agent-<id>`, the `agentId` of its entries;
    - in the main file, an inline sidechain (Claude Code 1.0: `isSidechain: true` lines, their
      first one without a parent) is `sidechain-` + the first 8 characters of the uuid of the
      first entry of its chain;
    - every other answer of the main file is on `main`: the path that ends at the last message
      written (a rewind makes the new path `main`; the one left becomes a `branch-...`)."""

    def __init__(self) -> None:
        self.root: dict[str, str] = {}  # entry uuid -> uuid of the first entry of its chain

    def see(self, entry: dict[str, Any]) -> None:
        uid, parent = entry.get("uuid"), entry.get("parentUuid")
        if isinstance(uid, str):
            self.root[uid] = self.root.get(parent, uid) if isinstance(parent, str) else uid

    def thread_for(self, entry: dict[str, Any], file: str) -> str:
        name = Path(file).name
        if "/subagents/" in file or name.startswith("agent-"):
            aid = entry.get("agentId")
            return f"agent-{aid}" if isinstance(aid, str) and aid else name.removesuffix(".jsonl")
        if entry.get("isSidechain"):
            parent = entry.get("parentUuid")
            return "sidechain-" + self.root.get(parent, parent or "")[:8]
        return "main"


@dataclass
class Checked:
    calls: int = 0  # requests compared (one per answer)
    identical: int = 0
    pending: int = 0  # pending requests compared
    pending_identical: int = 0
    unmatched: list[str] = field(default_factory=list)  # calls of the run no answer was fed for

    @property
    def ok(self) -> bool:
        return self.identical == self.calls and self.pending_identical == self.pending and not self.unmatched


def timed_lines(paths: list[Path]) -> Iterator[tuple[Path, bytes, dict[str, Any]]]:
    """The lines of several files, each with its entry ({} for a line that is not a JSON object:
    the engine quarantines it), merged in timestamp order (each file's own order kept; a line
    without a timestamp stays after the line before it)."""

    def one(path: Path, rank: int) -> Iterator[tuple[str, int, int, Path, bytes, dict[str, Any]]]:
        last = ""
        for n, raw in enumerate(iter_lines(path)):
            try:
                entry = json.loads(raw)
            except ValueError:
                entry = None
            entry = entry if isinstance(entry, dict) else {}
            ts = entry.get("timestamp")
            last = max(last, ts) if isinstance(ts, str) else last
            yield last, rank, n, path, raw, entry

    for _, _, _, path, raw, entry in heapq.merge(*(one(p, i) for i, p in enumerate(paths))):
        yield path, raw, entry


def feed(eng: Engine, sid: str, files: list[Path]) -> Iterator[tuple[dict[str, Any], AssembleResult]]:
    """Feed the files of session `sid` to `eng` line by line, as they were written; before each
    new answer, yield its first line and the request it was given for (its thread's pending call)."""
    pickers: dict[str, ThreadPicker] = {}  # per file
    last_id: dict[str, str | None] = {}  # per file: the message id of its last assistant line
    for path, raw, entry in timed_lines(files):
        file = engine_file(path)
        pick = pickers.setdefault(file, ThreadPicker())
        if starts_an_answer(entry, last_id.get(file)):
            thread = pick.thread_for(entry, file)
            yield entry, eng.assemble(sid, thread, model=entry["message"].get("model"))
        if entry.get("type") == "assistant":
            last_id[file] = (entry.get("message") or {}).get("id")
        pick.see(entry)
        eng.ingest(sid, [raw], file=file)


def check(out_dir: Path, paths: list[Path], preset: str = "default", show: bool = True) -> Checked:
    """Feed `paths` to an engine line by line and compare each request with `ctxreplay run`'s in
    `out_dir` (the module docstring)."""
    calls = pl.read_parquet(out_dir / "calls.parquet")
    got = Checked()
    sessions: dict[str, list[Path]] = {}
    for p in paths:
        sessions.setdefault(session_of(p), []).append(p)
    with tempfile.TemporaryDirectory(prefix="engine-feed-") as tmp, \
            Engine.open(preset, Path(tmp) / "ledger.duckdb") as eng:
        for sid, files in sessions.items():
            mine = calls.filter(pl.col("session_id") == sid)
            recorded = {(r["message_id"], r["request_id"]): r
                        for r in mine.filter(~pl.col("is_pending")).iter_rows(named=True)}
            seen: set[tuple[str, str]] = set()
            for entry, res in feed(eng, sid, files):
                key = (entry["message"].get("id"), entry.get("requestId"))
                want = recorded.get(key)
                same = want is not None and want["request_sha256"] == res.request_sha256
                got.calls += 1
                got.identical += same
                if want is not None:
                    seen.add(key)
                if show:
                    print(f"{sid[:8]} {res.thread_id} call {res.call}: sha256 {res.request_sha256[:12]} "
                          + ("= ctxreplay run" if same else
                             "NOT IN ctxreplay run" if want is None else
                             f"!= ctxreplay run's {want['thread_id']} call {want['call']}"))
            got.unmatched += [f"{sid[:8]} {r['thread_id']} call {r['call']}" for k, r in recorded.items()
                              if k not in seen]
            for r in mine.filter(pl.col("is_pending")).iter_rows(named=True):
                res = eng.assemble(sid, r["thread_id"], awaiting_user=True)
                got.pending += 1
                got.pending_identical += res.request_sha256 == r["request_sha256"]
    if show:
        print(f"{got.identical} of {got.calls} requests identical to ctxreplay run, "
              f"{got.pending_identical} of {got.pending} pending requests; "
              f"calls of ctxreplay run not fed: {len(got.unmatched)}")
    return got


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("out", type=Path, help="the --out of a `ctxreplay run` over these files")
    ap.add_argument("files", type=Path, nargs="+", help="Claude Code transcript files")
    ap.add_argument("--preset", default="default", help="the run's preset (default: default)")
    args = ap.parse_args(argv)
    return 0 if check(args.out, args.files, args.preset).ok else 1


if __name__ == "__main__":
    sys.exit(main())
