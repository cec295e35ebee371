"""What running a plug-in stage in a worker process costs, against running it in-process.

Runs the example plug-in `redact_secrets` (examples/redact-secrets) on the blocks of a corpus after
sanitize, in-process and in a worker (Arrow IPC in and out through a temporary directory, a process
forked from the forkserver), best of N each; the first worker call also starts the forkserver.
Prints the blocks' size and the seconds of each, and the overhead per call.

    python bench/bench_plugin_worker.py [--corpus ../shared/corpus] [--repeat 5] [--copies 1]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples" / "redact-secrets" / "src"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", type=Path, default=ROOT.parent / "shared" / "corpus")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--copies", type=int, default=1, help="the blocks this many times (as other sessions)")
    args = ap.parse_args()

    import polars as pl
    import redact_secrets  # noqa: F401  (registers the stage)

    from ctxreplay.pipeline.core.blockops import decision_schema
    from ctxreplay.pipeline.loaders import load_paths
    from ctxreplay.pipeline.stageapi.registry import StageContext, get_stage
    from ctxreplay.pipeline.staging.invoke import invoke_inline
    from ctxreplay.pipeline.staging.isolation import invoke_in_worker
    from ctxreplay.testkit import run_stage

    blocks = pl.from_arrow(load_paths([args.corpus]).blocks)
    blocks = run_stage("sanitize", blocks.lazy()).blocks.collect()  # type: ignore[union-attr]
    if args.copies > 1:
        blocks = pl.concat([blocks.with_columns(session_id=pl.col("session_id") + f"-{i}") for i in range(args.copies)])
    st = get_stage("redact_secrets")
    params, view, ctx = st.params(), pl.DataFrame(schema=decision_schema()), StageContext()
    print(f"blocks: {blocks.height:,} rows, {blocks.estimated_size() / 2**20:.1f} MiB")

    def best(fn: object) -> float:
        times = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            fn()  # type: ignore[operator]
            times.append(time.perf_counter() - t0)
        return min(times)

    inline = best(lambda: invoke_inline(st, blocks, params, view, ctx, "redact_secrets", 1))
    t0 = time.perf_counter()
    invoke_in_worker(st, blocks, params, view, ctx, "redact_secrets", 1, budget=600, stated=600)
    first = time.perf_counter() - t0
    worker = best(lambda: invoke_in_worker(st, blocks, params, view, ctx, "redact_secrets", 1, budget=600, stated=600))
    print(f"in-process: {inline:.3f} s   worker: {worker:.3f} s (first call, forkserver start: {first:.3f} s)")
    print(f"overhead per call: {worker - inline:.3f} s")


if __name__ == "__main__":
    main()
