"""The live engine: what one more call costs on a long session, beside replaying it whole.

Generates a Claude Code session of N calls (tool call / result turns, bench_replay.generate),
replays it whole with the batch runner (best of --repeat), then feeds the engine the first N-1
calls, assembles once (the warm-up: the whole session goes through load + stages once), and times
--steps times "ingest the entries of one more call, assemble its request" at call N, N+1, ...
Prints the per-call latency of `assemble` in ms (median), where it goes (load / stages / commit /
shaping the request), and its share of the whole replay (the issue's target: at most 5 %).

    python bench/bench_engine.py [--calls 2000] [--preset default] [--steps 5] [--repeat 2] [--tiktoken]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_replay import SID, generate

from pipeline.engine import Engine, iter_lines
from pipeline.runner import RunOptions, run
from pipeline.spec import load_spec
from pipeline.tokens import CHARS4_COUNTER, TIKTOKEN_COUNTER


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--preset", default="default")
    ap.add_argument("--steps", type=int, default=5, help="calls appended and timed one by one")
    ap.add_argument("--repeat", type=int, default=2, help="whole replays timed (best of)")
    ap.add_argument("--tiktoken", action="store_true", help="count tokens with tiktoken (default: chars/4)")
    a = ap.parse_args()
    counter = TIKTOKEN_COUNTER if a.tiktoken else CHARS4_COUNTER
    spec = load_spec(preset=a.preset)
    with tempfile.TemporaryDirectory(prefix="bench-engine-") as d:
        work = Path(d)
        src = work / f"{SID}.jsonl"
        generate(src, a.calls + a.steps)
        lines = list(iter_lines(src))
        # line 0 is the prompt; call k's answer is line 1 + 2k, its tool result 2 + 2k
        upto = 1 + 2 * (a.calls - 1)  # everything before the answer to call calls-1
        whole = work / "whole" / f"{SID}.jsonl"
        whole.parent.mkdir()
        whole.write_bytes(b"".join(ln + b"\n" for ln in lines[:upto]))
        best = float("inf")
        for i in range(a.repeat):
            t = time.perf_counter()
            run([whole], spec, RunOptions(out_dir=work / f"out{i}", token_counter=counter))
            best = min(best, time.perf_counter() - t)
        print(f"whole replay of a {a.calls}-call session (ctxreplay run, {a.preset}): {best:.2f} s (best of {a.repeat})")

        with Engine.open(spec, work / "engine.duckdb", token_counter=counter) as eng:
            t = time.perf_counter()
            eng.ingest(SID, lines[:upto])
            first = eng.assemble(SID)
            print(f"engine, first assemble (whole session at once, call {first.call}): "
                  f"{time.perf_counter() - t:.2f} s")
            lat, parts = [], []
            pos = upto
            for _ in range(a.steps):
                t = time.perf_counter()
                eng.ingest(SID, lines[pos:pos + 2])  # the answer to the last call and its tool result
                res = eng.assemble(SID)
                lat.append(time.perf_counter() - t)
                parts.append(eng.timings(SID))
                pos += 2
            med = statistics.median(lat)
            print(f"engine, one call appended then assembled, calls {first.call + 1}..{res.call}: "
                  f"median {med * 1000:.0f} ms (min {min(lat) * 1000:.0f}, max {max(lat) * 1000:.0f})")
            keys = parts[0].keys()
            split = ", ".join(f"{k} {statistics.median(p[k] for p in parts) * 1000:.0f} ms" for k in keys)
            rest = med - sum(statistics.median(p[k] for p in parts) for k in keys)
            print(f"  of which (medians): {split}, the rest {rest * 1000:.0f} ms")
            print("  (load: the loaders read the session's spool again; stages: every stage over the whole "
                  "session, frozen decisions re-applied; shape: the pending request from the kept replay state)")
            share = 100 * med / best
            print(f"one appended call costs {share:.1f} % of the whole replay (target: <= 5 %): "
                  f"{'met' if share <= 5 else 'NOT met'}")


if __name__ == "__main__":
    main()
