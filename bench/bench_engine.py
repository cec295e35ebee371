"""The live engine: what one more call costs on a long session, beside replaying it whole.

Generates a Claude Code session of N calls (tool call / result turns, bench_replay.generate),
replays it whole with the batch runner (best of --repeat), then feeds the engine the first N-1
calls, assembles once (the warm-up: the whole session goes through load + stages once), and times
--steps times "ingest the entries of one more call, assemble its request" at call N, N+1, ...
Prints the per-call latency of `assemble` in ms (median; CPU seconds too, less disturbed by other
processes on a shared machine, polars' threads added up), how many of the timed calls took the
live path (pipeline/engine/live.py: the appended rows, no pipeline pass) and why the others did not, where
the time goes (load / stages / commit / shaping the request), and its share of the whole replay
(the issue's target: at most 5 %). Then the same with every call a full pass: the stages' live
rules not asked (`Engine.ask_rules = False`), so every stage runs over the whole session as when a
stage decides something at the new call (its rows still come from the live path's reading of the
new lines; issue 22's target: at most 15 % of the whole replay), and again with the live path off
(`Engine.live_path = False`: the loaders read the session's spool again as well). Last, the live
path on a session of --floor calls (default 10): what a step costs whatever the session's length.

`--turns N`: every N-th answer of the generated session is a text followed by a user message, so
that tombstone has results to clear (outside the current tool loop) and fires, in the whole replay
and in the full passes (without it the session is one tool loop and no layer decides anything).

    python bench/bench_engine.py [--calls 2000] [--preset default] [--steps 5] [--repeat 2] [--floor 10]
                                 [--turns 0] [--tiktoken] [--no-full]
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

from ctxreplay.pipeline.batch.runner import RunOptions, run
from ctxreplay.pipeline.core.tokens import CHARS4_COUNTER, TIKTOKEN_COUNTER
from ctxreplay.pipeline.engine.engine import Engine, iter_lines
from ctxreplay.pipeline.staging.spec import PipelineSpec, load_spec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--preset", default="default")
    ap.add_argument("--steps", type=int, default=5, help="calls appended and timed one by one")
    ap.add_argument("--repeat", type=int, default=2, help="whole replays timed (best of)")
    ap.add_argument("--tiktoken", action="store_true", help="count tokens with tiktoken (default: chars/4)")
    ap.add_argument("--floor", type=int, default=10, help="calls of the small session timed the same way (0: none)")
    ap.add_argument("--no-full", action="store_true", help="skip the runs where every call is a full pass")
    ap.add_argument("--turns", type=int, default=0, help="a user message every N calls (0: one tool loop)")
    a = ap.parse_args()
    counter = TIKTOKEN_COUNTER if a.tiktoken else CHARS4_COUNTER
    spec = load_spec(preset=a.preset)
    with tempfile.TemporaryDirectory(prefix="bench-engine-") as d:
        work = Path(d)
        src = work / f"{SID}.jsonl"
        generate(src, a.calls + a.steps, a.turns)
        lines = list(iter_lines(src))
        # line 0 is the prompt; call k's answer is line 1 + 2k, its tool result 2 + 2k
        upto = 1 + 2 * (a.calls - 1)  # everything before the answer to call calls-1
        whole = work / "whole" / f"{SID}.jsonl"
        whole.parent.mkdir()
        whole.write_bytes(b"".join(ln + b"\n" for ln in lines[:upto]))
        best = best_cpu = float("inf")
        for i in range(a.repeat):
            t, c = time.perf_counter(), time.process_time()
            run([whole], spec, RunOptions(out_dir=work / f"out{i}", token_counter=counter))
            best = min(best, time.perf_counter() - t)
            best_cpu = min(best_cpu, time.process_time() - c)
        what = f"a user message every {a.turns} calls" if a.turns else "one tool loop"
        print(f"whole replay of a {a.calls}-call session ({what}; ctxreplay run, {a.preset}): {best:.2f} s, "
              f"CPU {best_cpu:.2f} s (best of {a.repeat})")

        med, med_cpu = appended(spec, counter, lines, a.calls, a.steps, work / "engine.duckdb")
        share = 100 * med / best
        print(f"one appended call costs {share:.1f} % of the whole replay (target: <= 5 %): "
              f"{'met' if share <= 5 else 'NOT met'}; in CPU seconds {100 * med_cpu / best_cpu:.1f} %")
        if not a.no_full:
            print("the same with every call a full pass (no live rule asked: every stage over the session):")
            full, full_cpu = appended(spec, counter, lines, a.calls, a.steps, work / "full.duckdb", rules=False)
            print(f"a full pass costs {100 * full / best:.1f} % of the whole replay (target: <= 15 %): "
                  f"{'met' if 100 * full / best <= 15 else 'NOT met'}; in CPU seconds {100 * full_cpu / best_cpu:.1f} %")
            print("the same with the live path off (every call a full pass, the session's spool loaded again):")
            full, full_cpu = appended(spec, counter, lines, a.calls, a.steps, work / "reload.duckdb", live=False)
            print(f"a full pass with a load costs {100 * full / best:.1f} % of the whole replay; in CPU seconds "
                  f"{100 * full_cpu / best_cpu:.1f} %")
        if a.floor:
            print(f"the same on a {a.floor}-call session:")
            small = work / "small.jsonl"
            generate(small, a.floor + a.steps)
            floor, floor_cpu = appended(spec, counter, list(iter_lines(small)), a.floor, a.steps, work / "small.duckdb")
            print(f"one appended call on a {a.floor}-call session: {floor * 1000:.0f} ms = "
                  f"{100 * floor / best:.1f} % of the whole {a.calls}-call replay; in CPU seconds "
                  f"{100 * floor_cpu / best_cpu:.1f} % (what a step costs whatever the session's length)")


def appended(spec: PipelineSpec, counter: str, lines: list[bytes], calls: int, steps: int, ledger: Path,
             live: bool = True, rules: bool = True) -> tuple[float, float]:
    """Feed the engine the first calls-1 calls, assemble, then time `steps` calls appended one by one;
    prints the figures and returns the median seconds of one appended call, wall-clock and CPU."""
    upto = 1 + 2 * (calls - 1)
    with Engine.open(spec, ledger, token_counter=counter) as eng:
        eng.live_path, eng.ask_rules = live, rules
        t = time.perf_counter()
        eng.ingest(SID, lines[:upto])
        first = eng.assemble(SID)
        print(f"engine, first assemble (whole session at once, call {first.call}): {time.perf_counter() - t:.2f} s")
        lat, cpu, parts, stages, reasons = [], [], [], [], []
        pos = upto
        for _ in range(steps):
            t, c = time.perf_counter(), time.process_time()
            eng.ingest(SID, lines[pos:pos + 2])  # the answer to the last call and its tool result
            res = eng.assemble(SID)
            lat.append(time.perf_counter() - t)
            cpu.append(time.process_time() - c)
            parts.append(eng.timings(SID))
            stages.append(eng.stage_timings(SID))
            reasons.append(res.full_pass_reason)
            pos += 2
    med = statistics.median(lat)
    print(f"engine, one call appended then assembled, calls {first.call + 1}..{res.call}: "
          f"median {med * 1000:.0f} ms (min {min(lat) * 1000:.0f}, max {max(lat) * 1000:.0f}), "
          f"CPU {statistics.median(cpu) * 1000:.0f} ms")
    keys = parts[0].keys()
    split = ", ".join(f"{k} {statistics.median(p[k] for p in parts) * 1000:.0f} ms" for k in keys)
    rest = statistics.median(t - sum(p.values()) for t, p in zip(lat, parts, strict=True))
    n_live = sum(r is None for r in reasons)
    why = sorted({r for r in reasons if r is not None})
    print(f"  {n_live} of {steps} took the live path" + (f"; full passes because: {'; '.join(why)}" if why else ""))
    if live and n_live:
        print("  (a live step: load = reading the new lines and making their rows, stages = the stages' checks, "
              "commit = adding the rows to the kept blocks)")
    print(f"  of which (medians): {split}, the rest {rest * 1000:.0f} ms")
    if n_live < steps:
        print("  stages of the last full pass: " + ", ".join(
            f"{k} {statistics.median(p[k] for p in stages) * 1000:.0f} ms" for k in stages[0]))
    return med, statistics.median(cpu)

if __name__ == "__main__":
    main()
