"""Helpers of the crash-safety and concurrency tests: a generated session, subprocess runs, and
snapshots of a ledger and of an output directory that can be compared."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "data" / "samples"
GEN_SID = "c7a5e000-0000-4000-8000-00000000c0de"
RUN_ID_KEY = b"ctxreplay_run_id"


def generate_session(path: Path, calls: int = 240, *, huge_every: int = 80) -> None:
    """A Claude Code session of `calls` tool turns, with an idle hour every 50 calls (so the
    claude-code preset's tombstone fires) and a 60,000-character result every `huge_every` calls
    (so its result_budget spills)."""
    lines: list[str] = []
    parent: str | None = None
    n = 0
    clock = 0

    def entry(typ: str, message: dict[str, Any], **kw: Any) -> None:
        nonlocal parent, n, clock
        n += 1
        clock += 7
        uid = f"00000000-0000-4000-8000-{n:012d}"
        stamp = f"2026-01-0{1 + clock // 86400}T{(clock // 3600) % 24:02d}:{(clock // 60) % 60:02d}:{clock % 60:02d}.000Z"
        lines.append(json.dumps({"type": typ, "uuid": uid, "parentUuid": parent, "sessionId": GEN_SID,
                                 "timestamp": stamp, "isSidechain": False, "cwd": "/home/dev/gen",
                                 "message": message, **kw}))
        parent = uid

    entry("user", {"role": "user", "content": "Walk through the logs and summarise each step."})
    for k in range(calls):
        if k and k % 50 == 0:
            clock += 3700  # an idle hour: the 1-hour cache has gone cold
        tid = f"toolu_gen_{k:06d}"
        last = k == calls - 1
        block = ({"type": "text", "text": "Every step is summarised."} if last else
                 {"type": "tool_use", "id": tid, "name": "Bash", "input": {"command": f"cat step-{k}.log"}})
        usage = {"input_tokens": 5, "output_tokens": 30, "cache_read_input_tokens": 900 + 50 * k,
                 "cache_creation_input_tokens": 50}
        entry("assistant", {"id": f"msg_gen_{k:06d}", "type": "message", "role": "assistant",
                            "model": "claude-sonnet-4-5", "content": [block], "usage": usage},
              requestId=f"req_gen_{k:06d}")
        if not last:
            body = (f"step {k}\n" + "x" * 60_000) if k % huge_every == huge_every - 1 else \
                f"step {k} output\n" + "a log line with some detail in it\n" * (20 + k % 13)
            entry("user", {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tid,
                                                          "content": body}]})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def cli(args: list[str | Path], env: dict[str, str] | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    """`ctxreplay ARGS` in a fresh Python process (so that it can be killed)."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "ctxreplay.pipeline.commands.cli", *[str(a) for a in args]], cwd=ROOT,
                          env=full_env, capture_output=True, text=True, timeout=timeout, check=False)


def popen(args: list[str | Path], env: dict[str, str] | None = None) -> subprocess.Popen:
    full_env = {**os.environ, **(env or {})}
    return subprocess.Popen([sys.executable, "-m", "ctxreplay.pipeline.commands.cli", *[str(a) for a in args]], cwd=ROOT,
                            env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@dataclass(frozen=True)
class LedgerState:
    decisions: list[tuple]
    runs: list[tuple]
    tokens: int

    def same_as(self, other: LedgerState) -> bool:
        return (self.decisions, self.runs, self.tokens) == (other.decisions, other.runs, other.tokens)


def ledger_state(path: Path) -> LedgerState:
    """The ledger's decisions (every column), its runs (seq, spec, counts) and its token cache size,
    opened the way a run opens it (read-write: a WAL left by a crash is replayed)."""
    from ctxreplay.pipeline.staging.ledger import Ledger

    led = Ledger(path)
    try:
        d = led.decisions().sort("spec_sha256", "seq")
        runs = led.con.execute("SELECT run_seq, spec_sha256, counts FROM runs ORDER BY run_seq").fetchall()
        tokens = led.con.execute("SELECT count(*) FROM token_cache").fetchall()[0][0]
    finally:
        led.close()
    return LedgerState([tuple(r) for r in d.rows()], [tuple(r) for r in runs], int(tokens))


@dataclass(frozen=True)
class OutState:
    run_id: str
    calls: list[tuple]
    decisions: list[tuple]


def out_state(out: Path) -> OutState:
    """What OUT shows through its documented paths, after checking that every one of them comes
    from the same run: summary.json and the metadata of every parquet file name one run id, and
    every link resolves into that run's directory."""
    summary = json.loads((out / "summary.json").read_text())
    run_id = summary["run_id"]
    for name in ("calls.parquet", "blocks.parquet", "decisions.parquet", "quarantine.parquet"):
        meta = pq.read_schema(out / name).metadata or {}
        got = meta.get(RUN_ID_KEY, b"").decode()
        assert got == run_id, f"{name} is from run {got!r}, summary.json from {run_id!r}"
    for p in out.iterdir():
        # a link to an output the shown run does not have dangles: it shows "none", as that run
        if p.is_symlink() and p.name != "current" and os.readlink(p).startswith("current/") and p.exists():
            assert Path(os.path.realpath(p)).parent.name == run_id, f"{p.name} is not from run {run_id}"
    run_dir = Path(os.path.realpath(out / "current"))
    assert run_dir.name == run_id, f"current is run {run_dir.name}, summary.json says {run_id}"
    for p in run_dir.iterdir():
        assert (out / p.name).is_symlink() and os.readlink(out / p.name) == f"current/{p.name}", \
            f"the run's {p.name} has no link in OUT"
    calls = pl.read_parquet(out / "calls.parquet").sort("session_id", "thread_id", "call")
    decisions = pl.read_parquet(out / "decisions.parquet")
    key = [c for c in ("stage", "session_id", "thread_id", "entry_id", "block_pos", "part_pos", "from_call", "action")
           if c in decisions.columns]
    decisions = decisions.sort(key, nulls_last=True)
    return OutState(run_id, [tuple(r) for r in calls.select("session_id", "thread_id", "call", "request_sha256",
                                                             "prompt_tokens").rows()],
                    [tuple(r) for r in decisions.rows()])


def leftovers(out: Path, keep_run: str) -> list[str]:
    """Staging directories and temp files that are not the published run."""
    found = [f".runs/{d.name}" for d in (out / ".runs").iterdir() if d.name != keep_run] \
        if (out / ".runs").is_dir() else []
    found += [p.name for p in out.iterdir() if p.name.startswith((".current.", ".link-", ".calls.parquet.",
                                                                  ".blocks.parquet."))]
    return found


@contextlib.contextmanager
def ctrl_c_as_in_a_terminal() -> Iterator[None]:
    """A run started with SIGINT's default action: one started from a background job of a shell
    inherits SIGINT ignored (exec keeps an ignored signal ignored) and would never see the Ctrl-C;
    a handler here is reset to the default in the child."""
    if signal.getsignal(signal.SIGINT) != signal.SIG_IGN or threading.current_thread() is not threading.main_thread():
        yield
        return
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
