"""`ctxreplay run` on the local engine against `--engine ray`, for 1, 2, ... workers (issue 10 point 6).

    python bench/bench_ray.py [--size 40MB] [--tree DIR] [--workers 1,2] [--preset default] [--batch-bytes N]

Generates (or reuses) a tree of fresh copies of the real `claude-projects` tree (bench/gen_tree.py),
then, for each worker count N, runs in a new OUT each, as its own process:
- local: `ctxreplay run TREE --jobs N` (N = 1 runs in process, N > 1 in N worker processes);
- ray: `ctxreplay run TREE --engine ray --jobs N` (a local Ray with N CPUs, started and shut down by
  the run);
and checks that both wrote the same request_sha256 for every call. It prints wall seconds, MB/s,
ray / local, each engine's speed-up over its own 1-worker run, and Ray's fixed cost (start-up and
shut-down) measured on a one-batch input. `--batch-bytes` (default: the tree's size / 16, so that 16
workers get a batch each) makes the batches. Where a 16-core machine exists, run it there with
`--workers 1,4,16`. On a shared machine the figures move with the load: say so when you quote them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_scale import given_or_generated_tree, tree_bytes  # the same tree handling


def timed_run(args: list[str]) -> tuple[float, dict]:
    """(wall seconds, summary) of one `ctxreplay run ... --json -q` in its own process."""
    exe = [sys.executable, "-m", "ctxreplay.pipeline.commands.cli"]
    t0 = time.perf_counter()
    r = subprocess.run([*exe, "run", *args, "--json", "-q"], capture_output=True, text=True, cwd=ROOT, check=False)
    wall = time.perf_counter() - t0
    if r.returncode not in (0, 1):
        raise SystemExit(f"ctxreplay run {' '.join(args)} failed ({r.returncode}): {r.stderr[-2000:]}")
    return wall, json.loads(r.stdout)


def hashes(out: Path) -> list[tuple]:
    import polars as pl

    calls = pl.read_parquet(out / "current" / "calls.parquet").sort("session_id", "thread_id", "call")
    return list(calls.select("session_id", "thread_id", "call", "request_sha256").iter_rows())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="40MB", help="size of the generated tree (default 40MB)")
    ap.add_argument("--tree", type=Path, help="an existing tree (default: generated under the work dir)")
    ap.add_argument("--workers", default="1,2", help="worker counts, comma-separated (default 1,2)")
    ap.add_argument("--preset", default="default")
    ap.add_argument("--batch-bytes", type=int, help="input bytes per batch (default: the tree's size / 16)")
    ap.add_argument("--keep", type=Path, help="work directory to keep (default: a temp dir, removed)")
    a = ap.parse_args()
    workers = [int(w) for w in a.workers.split(",") if w.strip()]
    work = a.keep or Path(tempfile.mkdtemp(prefix="bench-ray-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        tree = given_or_generated_tree(a.tree, work, a.size)
        size = tree_bytes(tree)
        mb = size / 1e6
        batch = a.batch_bytes or max(1, size // 16)
        common = [str(tree), "--preset", a.preset, "--batch-bytes", str(batch)]
        print(f"tree: {tree} ({mb:.1f} MB); preset {a.preset}; --batch-bytes {batch:,}; {os.cpu_count()} CPUs "
              f"here; figures under whatever load the machine has")
        # Ray's fixed cost: a run whose work is one small batch
        sample = ROOT / "data" / "samples" / "claude-projects"
        small_local, _ = timed_run([str(sample), "--out", str(work / "small-local"), "--jobs", "1"])
        small_ray, _ = timed_run([str(sample), "--out", str(work / "small-ray"), "--engine", "ray", "--jobs", "1"])
        print(f"fixed cost on {sample.relative_to(ROOT)} (one batch): local {small_local:.2f} s, ray "
              f"{small_ray:.2f} s (Ray start-up and shut-down: ~{small_ray - small_local:.1f} s)")
        base: dict[str, float] = {}
        ref = None
        print(f"{'workers':>7}  {'local s':>8}  {'MB/s':>6}  {'ray s':>8}  {'MB/s':>6}  {'ray/local':>9}  "
              f"{'local x1/xN':>11}  {'ray x1/xN':>9}")
        for n in workers:
            t_local, _ = timed_run([*common, "--out", str(work / f"local-{n}"), "--jobs", str(n)])
            t_ray, s_ray = timed_run([*common, "--out", str(work / f"ray-{n}"), "--engine", "ray", "--jobs", str(n)])
            h_local, h_ray = hashes(work / f"local-{n}"), hashes(work / f"ray-{n}")
            if h_local != h_ray or (ref is not None and h_local != ref):
                raise SystemExit(f"{n} workers: the engines wrote different request_sha256 values")
            ref = h_local
            base.setdefault("local", t_local)
            base.setdefault("ray", t_ray)
            print(f"{n:>7}  {t_local:8.2f}  {mb / t_local:6.2f}  {t_ray:8.2f}  {mb / t_ray:6.2f}  "
                  f"{t_ray / t_local:9.2f}  {base['local'] / t_local:11.2f}  {base['ray'] / t_ray:9.2f}")
            for d in (f"local-{n}", f"ray-{n}"):
                shutil.rmtree(work / d, ignore_errors=True)
        print(f"{s_ray['calls']:,} calls in {s_ray['groups']['total']} session groups, {s_ray['groups']['batches']} "
              f"batches; every run wrote the same request_sha256 for every call")
    finally:
        if a.keep is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
