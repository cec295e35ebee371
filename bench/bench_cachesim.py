"""Prompt-cache simulator throughput on a generated tree (default 190 MB, `gen_tree.py`).

Replays the tree once with the identity pipeline (`ctxreplay run`, which already simulates the
cache), then times the simulator's parts on that run's outputs: `prepare` (the calibration fit
and the per-call facts from the loaded blocks), building the `SimStore` from the request store,
and `simulate` (the walk over every call in time order, break attribution and pricing). Prints
calls/s for each.

    python bench/bench_cachesim.py [--size 190MB] [--keep DIR] [--repeat 3]

With `--accuracy [SHARED]` it measures instead how well the simulator reproduces the recorded
usage of every real session of SHARED/corpus and SHARED/corpus-extra (default ../shared), in-sample,
leave-one-session-out and across corpora, and the error bars' coverage (bench/cachesim_accuracy.py):

    python bench/bench_cachesim.py --accuracy
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.gen_tree import DEFAULT_SRC, generate, parse_size


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="190MB", help="tree size (default 190MB)")
    ap.add_argument("--src", type=Path, default=DEFAULT_SRC, help="tree to copy")
    ap.add_argument("--keep", type=Path, help="keep the tree and the run's outputs here (reused when present)")
    ap.add_argument("--repeat", type=int, default=3, help="timed simulate runs (best is printed)")
    ap.add_argument("--accuracy", nargs="?", type=Path, const=ROOT.parent / "shared", metavar="SHARED",
                    help="print the accuracy table on the real corpora under SHARED (default ../shared) instead")
    args = ap.parse_args(argv)
    if args.accuracy is not None:
        from bench.cachesim_accuracy import main as accuracy

        return accuracy(args.accuracy, args.keep)
    if not args.src.is_dir():
        print(f"no source tree at {args.src}", file=sys.stderr)
        return 2
    base = args.keep or Path(tempfile.mkdtemp(prefix="bench-cachesim-"))
    tree = base / f"tree-{args.size}"
    out = base / f"out-{args.size}"
    os.environ.setdefault("CTXREPLAY_CACHE_DIR", str(base / "price-cache"))

    import polars as pl

    from ctxreplay.pipeline.batch.runner import RunOptions, run
    from ctxreplay.pipeline.core.tokens import TIKTOKEN_COUNTER, TokenCounter
    from ctxreplay.pipeline.cost.cachesim import SimStore, prepare, simulate
    from ctxreplay.pipeline.cost.prices import PriceBook
    from ctxreplay.pipeline.loaders import load_paths
    from ctxreplay.pipeline.staging.spec import load_spec

    if not tree.is_dir():
        t0 = time.perf_counter()
        st = generate(tree, size=parse_size(args.size), src=args.src)
        print(f"generated {tree}: {st.bytes / 1e6:.1f} MB, {st.sessions} sessions in {time.perf_counter() - t0:.1f} s")
    if not (out / "calls.parquet").exists():
        t0 = time.perf_counter()
        res = run([tree], load_spec(preset="identity"), RunOptions(out_dir=out))
        s = res.summary
        print(f"ctxreplay run --preset identity: {s['calls']:,} calls in {time.perf_counter() - t0:.1f} s "
              f"(cache simulation inside the run: {s['cache_sim']['seconds']:.2f} s)")
    calls = pl.read_parquet(out / "calls.parquet")
    n = calls.filter(~pl.col("is_pending")).height

    t0 = time.perf_counter()
    blocks = pl.from_arrow(load_paths([tree]).blocks)
    t_load = time.perf_counter() - t0
    counter = TokenCounter(TIKTOKEN_COUNTER)
    counter.count_many(blocks.get_column("text").drop_nulls().unique().to_list())   # warm, as in a run
    final = pl.read_parquet(out / "blocks.parquet")
    t0 = time.perf_counter()
    prep = prepare(blocks, calls, counter.series_counter(), final)  # type: ignore[arg-type]
    t_prep = time.perf_counter() - t0
    t0 = time.perf_counter()
    store = SimStore.from_dir(out)
    t_store = time.perf_counter() - t0
    book = PriceBook.load()
    decisions = pl.read_parquet(out / "decisions.parquet")
    best = float("inf")
    for _ in range(max(args.repeat, 1)):
        t0 = time.perf_counter()
        res_sim = simulate(calls, store, prep, decisions=decisions, prices=book)
        best = min(best, time.perf_counter() - t0)
    tot = res_sim.summary["totals"]
    mb = sum(f.stat().st_size for f in tree.rglob("*.jsonl")) / 1e6
    print(f"tree {mb:.1f} MB: {n:,} recorded calls, {calls.get_column('thread_key').n_unique():,} threads "
          f"(loading the blocks again took {t_load:.1f} s)")
    print(f"  prepare (calibration + facts)  {t_prep:6.2f} s  {n / t_prep:9,.0f} calls/s")
    print(f"  SimStore from the run          {t_store:6.2f} s  {n / t_store:9,.0f} calls/s")
    print(f"  simulate (best of {args.repeat})          {best:6.2f} s  {n / best:9,.0f} calls/s")
    print(f"  all three                      {t_prep + t_store + best:6.2f} s  {n / (t_prep + t_store + best):9,.0f} calls/s")
    print(f"  agreement with the recorded usage {tot['agreement']:.2%}; recorded {tot['recorded_cost_usd']:.2f} USD, "
          f"simulated {tot['sim_cost_usd']:.2f} USD")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
