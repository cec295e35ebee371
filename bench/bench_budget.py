"""Layers 5-6 at scale: a generated 2,000-call and 4,000-call session with idle gaps, per preset.

For each preset (and `stress-5-6`, a spec that makes snip fire too: a 60,000-token window) prints
the calls, the decisions by stage, the mean estimated prompt tokens per call, the time of the
run (load + stages + replay, best of N) and of the stages alone, and the 4,000/2,000 time ratio
(target ≤ 2.2: cost grows linearly with the session).

    python bench/bench_budget.py [--presets claude-code,openclaw,...] [--repeat 2] [--tiktoken]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ctxreplay.pipeline.batch.runner import RunOptions, run
from ctxreplay.pipeline.core.tokens import CHARS4_COUNTER, TIKTOKEN_COUNTER
from ctxreplay.pipeline.staging.spec import load_spec, parse_spec

SID = "5e551011-0000-4000-8000-0000000b0d6e"
PRESETS = ["minimal", "claude-code", "openclaw", "context-editing", "default", "stress-5-6"]
STRESS = """
[pipeline]
name = "stress-5-6"
window_tokens = 60000
[[stage]]
use = "sanitize"
[[stage]]
use = "pairing"
[[stage]]
use = "result_budget"
max_result_chars = 8000
[[stage]]
use = "snip"
reserve_output_tokens = 8000
min_tail_turns = 2
[[stage]]
use = "pairing"
[[stage]]
use = "tombstone"
trigger_tokens = 30000
clear_at_least_tokens = 5000
keep_recent = 5
"""


def generate(path: Path, calls: int, seed: int = 5) -> None:
    """A Claude Code session with `calls` model calls: user turns of 1-6 tool loops, results of
    varied size (a few over 50,000 characters), thinking now and then, and an idle gap of more than
    an hour before every 25th turn (the prompt cache has gone cold there)."""
    rng = random.Random(seed)
    lines: list[str] = []
    parent: str | None = None
    n = 0
    clock = 0

    def entry(typ: str, message: dict[str, Any], **kw: Any) -> None:
        nonlocal parent, n
        n += 1
        u = f"00000000-0000-4000-8000-{n:012d}"
        ts = f"2026-01-{1 + clock // 86_400:02d}T{(clock // 3600) % 24:02d}:{(clock // 60) % 60:02d}:{clock % 60:02d}.000Z"
        lines.append(json.dumps({"type": typ, "uuid": u, "parentUuid": parent, "sessionId": SID, "timestamp": ts,
                                 "isSidechain": False, "message": message, **kw}))
        parent = u

    k = turn = 0
    while k < calls:
        clock += 3_700 if turn and turn % 25 == 0 else rng.randint(20, 300)
        entry("user", {"role": "user", "content": f"Turn {turn}: continue with the next part of the refactor."})
        turn += 1
        for _ in range(rng.randint(1, 6)):
            if k >= calls - 1:
                break
            clock += rng.randint(2, 20)
            tid = f"toolu_bench_{k:06d}"
            content: list[dict[str, Any]] = []
            if rng.random() < 0.2:
                content.append({"type": "thinking", "thinking": "Let me check the callers first. " * 8,
                                "signature": f"sig{k}"})
            tool = rng.choice(["Read", "Bash", "Grep", "Edit"])
            content.append({"type": "tool_use", "id": tid, "name": tool, "input": {"arg": f"step {k}"}})
            entry("assistant", {"id": f"msg_bench_{k:06d}", "role": "assistant", "model": "claude-sonnet-4-5",
                                "content": content, "usage": {"input_tokens": 3, "output_tokens": 60}},
                  requestId=f"req_bench_{k:06d}")
            k += 1
            clock += rng.randint(1, 30)
            size = rng.choice([200, 800, 2_000, 4_000, 12_000]) if rng.random() > 0.01 else 70_000
            out = "\n".join(f"{tool} {k} line {i}: " + "detail " * 6 for i in range(size // 60 + 1))[:size]
            entry("user", {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tid, "content": out}]})
        clock += rng.randint(2, 20)
        entry("assistant", {"id": f"msg_bench_{k:06d}", "role": "assistant", "model": "claude-sonnet-4-5",
                            "content": [{"type": "text", "text": f"Done with turn {turn}."}],
                            "usage": {"input_tokens": 3, "output_tokens": 20}}, requestId=f"req_bench_{k:06d}")
        k += 1
    path.write_text("\n".join(lines) + "\n")


def one_run(path: Path, preset: str, work: Path, counter: str) -> tuple[float, dict[str, Any], float]:
    spec = parse_spec(STRESS, source="stress-5-6") if preset == "stress-5-6" else load_spec(preset=preset)
    out = work / "out"
    if out.exists():
        shutil.rmtree(out)
    t = time.perf_counter()
    res = run([path], spec, RunOptions(out_dir=out, ledger_path=work / f"{time.perf_counter_ns()}.duckdb",
                                       token_counter=counter, validate=False))
    seconds = time.perf_counter() - t
    mean = float(res.calls["prompt_tokens"].mean() or 0)
    return seconds, res.summary, mean


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default=",".join(PRESETS))
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--tiktoken", action="store_true", help="count with tiktoken (default: the chars/4 estimator)")
    args = ap.parse_args()
    counter = TIKTOKEN_COUNTER if args.tiktoken else CHARS4_COUNTER
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        files = {}
        for calls in (2_000, 4_000):
            d = work / f"s{calls}"
            d.mkdir()
            files[calls] = d / f"{SID}.jsonl"
            generate(files[calls], calls)
        print(f"counter {counter}; best of {args.repeat}")
        print(f"{'preset':<16} {'calls':>6} {'mean prompt tok':>15} {'run s':>7} {'stages s':>8}  decisions by stage")
        for preset in args.presets.split(","):
            times = {}
            for calls, path in files.items():
                best = None
                for _ in range(args.repeat):
                    seconds, summary, mean = one_run(path, preset, work, counter)
                    if best is None or seconds < best[0]:
                        best = (seconds, summary, mean)
                assert best is not None
                seconds, summary, mean = best
                times[calls] = seconds
                by_stage = {name: st["decisions"] for name, st in summary["decisions_by_stage"].items()}
                stages_s = summary["timings_seconds"]["stages"]
                print(f"{preset:<16} {summary['calls']:>6} {mean:>15,.0f} {seconds:>7.2f} {stages_s:>8.2f}  {by_stage}")
            print(f"{preset:<16} ratio 4000/2000 = {times[4_000] / times[2_000]:.2f}  (target <= 2.2)")


if __name__ == "__main__":
    main()
