"""The fixed cost of a pipeline pass: every stage of a preset over a short session, timed.

Generates a Claude Code session of --calls calls (bench_replay.generate: tool call / result turns),
loads it once, then runs the stages (pipeline/staging/stagerun.run_stages, as the batch runner and the
engine's full pass do) --repeat times and prints, per pass: wall ms (min and median), CPU ms (polars'
threads added up; less disturbed by other processes on a shared machine), the number of polars
plans collected (every collect, eager operations included), and each stage's seconds. With
--compare, the same again with the stages' quick "nothing to do" checks off
(ctxreplay.pipeline.stageapi.quiet): every stage runs its whole plan, as before the checks.

    python bench/bench_pass.py [--calls 10] [--preset default] [--repeat 15] [--compare]
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import polars as pl
import polars.lazyframe.engine as polars_engine
from bench_replay import generate

from ctxreplay.pipeline.assembly.replay import call_counts
from ctxreplay.pipeline.core.tokens import CHARS4_COUNTER, TIKTOKEN_COUNTER, TokenCounter
from ctxreplay.pipeline.loaders.load import load_paths
from ctxreplay.pipeline.stageapi.registry import StageContext
from ctxreplay.pipeline.staging.spec import load_spec
from ctxreplay.pipeline.staging.stagerun import CallMap, LedgerView, run_stages

COLLECTS = Counter[str]()


def _count_collects() -> None:
    """Count every plan polars runs (its engines' `collect`: lazy collects and eager operations)."""
    for cls in [v for v in vars(polars_engine).values() if isinstance(v, type) and "collect" in vars(v)]:
        orig = cls.collect

        def counted(self: Any, *a: Any, _orig: Any = orig, **k: Any) -> Any:
            COLLECTS["all"] += 1
            return _orig(self, *a, **k)

        cls.collect = counted  # type: ignore[method-assign]


@contextmanager
def checks_off(spec: Any) -> Iterator[None]:
    """The stages' quick checks off: each runs its whole plan."""
    mods = {importlib.import_module(rs.stage.module) for rs in spec.stages}
    saved = {m: m.quiet for m in mods if hasattr(m, "quiet")}
    for m in saved:
        m.quiet = lambda *a: False
    try:
        yield
    finally:
        for m, q in saved.items():
            m.quiet = q


def time_passes(blocks: pl.DataFrame, spec: Any, view: LedgerView, ctx: StageContext, repeat: int) -> dict[str, Any]:
    run_stages(blocks, spec, view, ctx)  # warm-up: imports, regex caches, the token memo
    walls, cpus, collects, stages = [], [], [], Counter[str]()
    for _ in range(repeat):
        COLLECTS.clear()
        w, c = time.perf_counter(), time.process_time()
        res = run_stages(blocks, spec, view, ctx)
        walls.append(time.perf_counter() - w)
        cpus.append(time.process_time() - c)
        collects.append(COLLECTS["all"])
        for o in res.outcomes:
            stages[o.name] += o.stats.seconds / repeat
    return {"wall_min": min(walls) * 1e3, "wall_med": statistics.median(walls) * 1e3,
            "cpu_med": statistics.median(cpus) * 1e3, "collects": statistics.median(collects),
            "decisions": sum(o.stats.decisions for o in res.outcomes), "stages": stages}


def show(label: str, r: dict[str, Any]) -> None:
    print(f"{label:>12}: wall {r['wall_min']:6.1f} ms min, {r['wall_med']:6.1f} ms median; cpu {r['cpu_med']:6.1f} ms "
          f"median; {r['collects']:.0f} polars collects per pass; {r['decisions']} decisions")
    print(" " * 14 + "stages (ms): " + ", ".join(f"{k} {v * 1e3:.0f}" for k, v in r["stages"].items()))


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
    _count_collects()
    print(f"preset {a.preset}, {a.calls}-call session ({blocks.height} rows), {len(spec.stages)} stage positions, "
          f"{a.repeat} passes")
    show("checks on", time_passes(blocks, spec, LedgerView(calls), ctx, a.repeat))
    if a.compare:
        with checks_off(spec):
            show("checks off", time_passes(blocks, spec, LedgerView(calls), ctx, a.repeat))


if __name__ == "__main__":
    main()
