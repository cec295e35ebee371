"""The fixed cost of a pipeline pass: every stage of a preset over a short session, timed.

Generates a Claude Code session of --calls calls (bench_replay.generate: tool call / result turns),
loads it once, then runs the stages (pipeline/staging/stagerun.run_stages, as the batch runner and the
engine's full pass do) --repeat times and prints, per pass: wall ms (min and median), CPU ms (polars'
threads added up; less disturbed by other processes on a shared machine), the number of polars
plans collected (every collect, eager operations included: pipeline/core/profile.py), and each
stage position's milliseconds and collects (medians; `quiet`: its quick check held, its plan did not
run), the checks asked together apart. With --compare, the same again with the stages' quick
"nothing to do" checks off (`run_stages(checks=False)`): every stage runs its whole plan.

    python bench/bench_pass.py [--calls 10] [--preset default] [--repeat 15] [--compare]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import polars as pl
from bench_replay import generate

from ctxreplay.pipeline.assembly.replay import call_counts
from ctxreplay.pipeline.core import profile
from ctxreplay.pipeline.core.tokens import CHARS4_COUNTER, TIKTOKEN_COUNTER, TokenCounter
from ctxreplay.pipeline.loaders.load import load_paths
from ctxreplay.pipeline.stageapi.registry import StageContext
from ctxreplay.pipeline.staging.spec import load_spec
from ctxreplay.pipeline.staging.stagerun import CallMap, LedgerView, run_stages


def time_passes(blocks: pl.DataFrame, spec: Any, view: LedgerView, ctx: StageContext, repeat: int,
                checks: bool = True) -> dict[str, Any]:
    run_stages(blocks, spec, view, ctx, checks=checks)  # warm-up: imports, regex caches, the token memo
    walls, cpus, collects = [], [], []
    stages: dict[str, list[tuple[float, int, bool]]] = {}
    asked: list[tuple[float, int]] = []
    with profile.counting():
        for _ in range(repeat):
            c0 = profile.collects()
            w, c = time.perf_counter(), time.process_time()
            res = run_stages(blocks, spec, view, ctx, checks=checks)
            walls.append(time.perf_counter() - w)
            cpus.append(time.process_time() - c)
            collects.append(profile.collects() - c0)
            for o in res.outcomes:
                stages.setdefault(o.name, []).append((o.stats.seconds, o.stats.collects or 0, o.stats.quiet))
            asked.append((res.checks["seconds"], res.checks.get("collects", 0)))
    return {"wall_min": min(walls) * 1e3, "wall_med": statistics.median(walls) * 1e3,
            "cpu_med": statistics.median(cpus) * 1e3, "collects": statistics.median(collects),
            "decisions": sum(o.stats.decisions for o in res.outcomes), "stages": stages, "asked": asked,
            "queries": res.checks["queries"]}


def show(label: str, r: dict[str, Any]) -> None:
    print(f"{label:>12}: wall {r['wall_min']:6.1f} ms min, {r['wall_med']:6.1f} ms median; cpu {r['cpu_med']:6.1f} ms "
          f"median; {r['collects']:.0f} polars collects per pass; {r['decisions']} decisions")
    parts = []
    for name, runs in r["stages"].items():
        ms = statistics.median(x[0] for x in runs) * 1e3
        n = statistics.median(x[1] for x in runs)
        parts.append(f"{name} {ms:.0f} ms/{n:.0f}" + (" quiet" if all(x[2] for x in runs) else ""))
    print(" " * 14 + "stages (ms/collects): " + ", ".join(parts))
    if r["queries"]:
        ms = statistics.median(x[0] for x in r["asked"]) * 1e3
        n = statistics.median(x[1] for x in r["asked"])
        print(" " * 14 + f"quick checks asked together: {r['queries']} queries, {ms:.0f} ms/{n:.0f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--preset", default="default")
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--tiktoken", action="store_true", help="count tokens with tiktoken (default: chars/4)")
    ap.add_argument("--compare", action="store_true", help="also time the passes with the stages' quick checks off")
    a = ap.parse_args()
    spec = load_spec(preset=a.preset)
    with tempfile.TemporaryDirectory(prefix="bench-pass-") as d:
        src = Path(d) / "session.jsonl"
        generate(src, a.calls)
        blocks = pl.from_arrow(load_paths([Path(d)]).blocks)
    assert isinstance(blocks, pl.DataFrame)
    calls = CallMap.from_blocks(blocks, call_counts(blocks))
    blocks = blocks.filter(pl.col("last_call").is_null() | (pl.col("last_call") > pl.col("first_call")))
    counter = TokenCounter(TIKTOKEN_COUNTER if a.tiktoken else CHARS4_COUNTER)
    ctx = StageContext(target="anthropic", window_tokens=spec.window_tokens, count_tokens=counter.series_counter(),
                       token_counter_version=counter.name, supports_images=True)
    print(f"preset {a.preset}, {a.calls}-call session ({blocks.height} rows), {len(spec.stages)} stage positions, "
          f"{a.repeat} passes")
    show("checks on", time_passes(blocks, spec, LedgerView(calls), ctx, a.repeat))
    if a.compare:
        show("checks off", time_passes(blocks, spec, LedgerView(calls), ctx, a.repeat, checks=False))


if __name__ == "__main__":
    main()
