"""Where the memory of `ctxreplay run` goes (issue 10's memory goal): one run in this process, its
resident memory sampled every 20 ms and kept as a peak per batch and phase (load, stages, replay,
write: pipeline/core/crashpoints.py names them), with the memory left after each batch and the cache
simulation's store at the end.

    python bench/bench_memory.py TREE [--batch-bytes N] [--preset default] [--out DIR]

It tells the batch's own peak (which `--batch-bytes` bounds) from what the run keeps to its end
(which grows with the corpus). Figures move with the machine's load only in time, not in memory.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def rss_mib() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * 4096 / 2**20


def main() -> None:
    from ctxreplay.pipeline.batch import runner
    from ctxreplay.pipeline.batch.batches import DEFAULT_BATCH_BYTES
    from ctxreplay.pipeline.core import crashpoints
    from ctxreplay.pipeline.staging.spec import load_spec

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tree", type=Path)
    ap.add_argument("--batch-bytes", type=int, default=DEFAULT_BATCH_BYTES)
    ap.add_argument("--preset", default="default")
    ap.add_argument("--out", type=Path, help="OUT to write (default: a temp dir, removed)")
    a = ap.parse_args()
    out = a.out or Path(tempfile.mkdtemp(prefix="bench-memory-")) / "out"
    batch = [0]
    peaks: dict[tuple[int, str], float] = {}
    after: list[float] = []
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            key = (batch[0], crashpoints._phase or "start")
            r = rss_mib()
            if r > peaks.get(key, 0.0):
                peaks[key] = r
            time.sleep(0.02)

    take = runner._take_batch

    def counted(*args, **kw):  # type: ignore[no-untyped-def]
        take(*args, **kw)
        after.append(rss_mib())
        batch[0] += 1

    runner._take_batch = counted  # type: ignore[assignment]
    store: list[object] = []
    simulate = runner._simulate

    def kept(totals, *args, **kw):  # type: ignore[no-untyped-def]
        store.append(totals.sim_store)
        return simulate(totals, *args, **kw)

    runner._simulate = kept  # type: ignore[assignment]
    threading.Thread(target=sample, daemon=True).start()
    t0 = time.perf_counter()
    try:
        res = runner.run([a.tree], load_spec(preset=a.preset),
                         runner.RunOptions(out_dir=out, jobs=1, batch_bytes=a.batch_bytes))
    finally:
        done.set()
        if a.out is None:
            shutil.rmtree(out.parent, ignore_errors=True)
    s = res.summary
    print(f"{a.tree}: {s['bytes'] / 1e6:.1f} MB, {s['groups']['batches']} batches of at most "
          f"{a.batch_bytes / 2**20:.0f} MiB, {s['calls']:,} calls, {time.perf_counter() - t0:.1f} s")
    by_phase: dict[str, float] = {}
    for (_, ph), v in peaks.items():
        by_phase[ph] = max(by_phase.get(ph, 0.0), v)
    print("peak RSS by phase (MiB): " + ", ".join(f"{k} {v:.0f}" for k, v in by_phase.items()))
    if after:
        print(f"RSS after each batch (MiB): first {after[0]:.0f}, last {after[-1]:.0f}, "
              f"max {max(after):.0f}")
    st = store[0] if store else None
    if st is not None:
        held = sum(len(d) for d in st.data if d)  # type: ignore[attr-defined]
        print(f"cache simulation's store: {len(st.sha):,} messages, {held / 2**20:.1f} MiB of message bytes held")  # type: ignore[attr-defined]
    print(f"peak RSS: {max(peaks.values()):.0f} MiB")


if __name__ == "__main__":
    main()
