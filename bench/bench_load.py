"""Load speed: the Claude Code loader on a generated tree, against orjson's parse of every line.

On a tree made by `gen_tree.py` (default 190 MB), the loader loads the whole tree (`load_paths`) in
a fresh process per run, so peak RSS is its own, with Python's cyclic GC paused as `ctxreplay run`
pauses it while it loads. Prints the best wall and CPU seconds of N runs, MB/s and peak RSS (and
its growth over the process after imports). `--before DIR` also times the loaders of another
checkout (e.g. `git archive <commit> | tar -x -C DIR`) in the same turns: each engine its
`load_paths` offers (`engine=`: "reference" and "columnar" before issue 22 made the loader one), or
its one loader; it prints this checkout's speed-up over each, and whether they all gave the same
blocks table (every column, every row: `Table.equals`). `--phases` adds the loader's seconds per
phase. `--readers` times the floor: orjson parsing every line of the tree, nothing else. `--run`
times a cold `ctxreplay run --jobs 1` of the tree (fresh process, fresh output directory, with
its peak RSS) and prints its ratio to that parse (issue 22: at most 6x).

    python bench/bench_load.py [--size 190MB] [--keep DIR] [--repeat 3] [--phases] [--readers] [--run]
    python bench/bench_load.py --tree DIR                             # an existing tree
    python bench/bench_load.py --tree DIR --before /tmp/old-checkout  # before / after a change
    python bench/bench_load.py --tree SMALL_DIR --calls 20            # per-call cost of repeated small loads
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def child(engine: str, tree: Path, table_out: Path | None, calls: int = 1) -> None:
    """One timed load in this process (`calls` > 1: that many, the best kept); prints one JSON object.
    `engine`: "loader" (the checkout's default) or an `engine=` value of an older checkout."""
    import pyarrow as pa

    from ctxreplay.pipeline.loaders import load_paths

    kw: dict[str, Any] = {}
    if engine != "loader":
        kw["engine"] = engine
    if "timings" in inspect.signature(load_paths).parameters:
        kw["timings"] = {}
    base = _rss_mb()
    wall = cpu = float("inf")
    timings: dict[str, float] = {}
    for _ in range(calls):
        if "timings" in kw:
            kw["timings"] = {}
        gc.disable()  # as `ctxreplay run` loads (runner._gc_paused)
        t0, c0 = time.perf_counter(), time.process_time()
        res = load_paths([tree], **kw)
        w, c = time.perf_counter() - t0, time.process_time() - c0
        gc.enable()
        if w < wall:
            timings = kw.get("timings") or {}
        wall, cpu = min(wall, w), min(cpu, c)
    peak = _rss_mb()
    if table_out is not None:
        with pa.OSFile(str(table_out), "wb") as fh, pa.ipc.new_file(fh, res.blocks.schema) as w:
            w.write_table(res.blocks)
    print(json.dumps({"wall": wall, "cpu": cpu, "peak_rss_mb": peak, "base_rss_mb": base,
                      "rows": res.blocks.num_rows, "timings": timings}))


def _run_child(engine: str, tree: Path, table_out: Path | None, root: Path = ROOT, calls: int = 1) -> dict[str, Any]:
    """One load in a fresh process, with the code of `root` (this checkout, or `--before`'s)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", engine, "--tree", str(tree.resolve()),
           "--code", str(root)]
    if calls > 1:
        cmd += ["--calls", str(calls)]
    if table_out is not None:
        cmd += ["--table-out", str(table_out)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _engines_of(root: Path) -> list[str]:
    """The engines another checkout's `load_paths` offers (its `ENGINES`), or its one loader."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from ctxreplay.pipeline.loaders import load as m; "
            "print(' '.join(getattr(m, 'ENGINES', ())))")
    out = subprocess.run([sys.executable, "-c", code, str(root)], check=True, capture_output=True, text=True)
    return out.stdout.split() or ["loader"]


def _same_tables(a: Path, b: Path) -> bool:
    import pyarrow as pa

    ta = pa.ipc.open_file(pa.memory_map(str(a))).read_all()
    tb = pa.ipc.open_file(pa.memory_map(str(b))).read_all()
    return ta.schema.equals(tb.schema, check_metadata=True) and ta.equals(tb)


# ---------------------------------------------------------------- the floor: orjson over every line


def orjson_parse(tree: Path) -> dict[str, float]:
    """Seconds to read every transcript of the tree and parse each of its lines with orjson (the
    lines it refuses are passed over), in this process: the least any loader of these files does."""
    import orjson

    files = sorted(p for p in tree.rglob("*") if p.is_file() and ".jsonl" in p.name)
    gc.disable()
    t0, c0 = time.perf_counter(), time.process_time()
    n = 0
    for p in files:
        for line in p.read_bytes().split(b"\n"):
            if line.strip():
                try:
                    orjson.loads(line)
                except orjson.JSONDecodeError:
                    pass
                n += 1
    out = {"wall": time.perf_counter() - t0, "cpu": time.process_time() - c0, "lines": n}
    gc.enable()
    return out


def _orjson_child(tree: Path) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child-orjson", "--tree", str(tree.resolve())]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def whole_run(tree: Path) -> dict[str, float]:
    """A cold `ctxreplay run --jobs 1` of the tree: a fresh process and output directory; wall and
    CPU seconds (the command and its children) and the peak RSS of the largest of them."""
    with tempfile.TemporaryDirectory(prefix="bench-load-run-") as tmp:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        cmd = [sys.executable, "-c", "from ctxreplay.entry import main; main()", "run", str(tree), "--out",
               str(Path(tmp) / "out"), "--jobs", "1", "-q"]
        subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        wall = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall": wall, "cpu": cpu, "peak_rss_mb": after.ru_maxrss / 1024}


# ---------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="190MB", help="tree size to generate (default 190MB)")
    ap.add_argument("--tree", type=Path, help="an existing tree to load instead of generating one")
    ap.add_argument("--keep", type=Path, help="generate the tree here (reused when present)")
    ap.add_argument("--repeat", type=int, default=3, help="runs per loader (best is printed)")
    ap.add_argument("--phases", action="store_true", help="the loader's seconds per phase")
    ap.add_argument("--readers", action="store_true", help="also time orjson parsing every line of the tree")
    ap.add_argument("--run", action="store_true", help="also time a cold `ctxreplay run --jobs 1` of the tree")
    ap.add_argument("--before", type=Path, help="another checkout whose loaders are timed too (before)")
    ap.add_argument("--calls", type=int, default=1,
                    help="loads per process, best kept: with a small --tree, the per-call (fixed) cost of a "
                         "process that loads again and again")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--child-orjson", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--code", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--table-out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child_orjson:
        print(json.dumps(orjson_parse(args.tree)))
        return 0
    if args.child:
        if args.code is not None:  # the loader of this checkout (or of --before's)
            sys.path.insert(0, str(args.code))
        child(args.child, args.tree, args.table_out, args.calls)
        return 0

    from bench.gen_tree import DEFAULT_SRC, generate, parse_size

    tree = args.tree
    if tree is None:
        base = args.keep or Path(tempfile.mkdtemp(prefix="bench-load-"))
        tree = base / f"tree-{args.size}"
        if not tree.is_dir():
            if not DEFAULT_SRC.is_dir():
                print(f"no source tree at {DEFAULT_SRC}", file=sys.stderr)
                return 2
            t0 = time.perf_counter()
            st = generate(tree, size=parse_size(args.size), src=DEFAULT_SRC)
            print(f"generated {tree}: {st.bytes / 1e6:.1f} MB, {st.sessions} sessions in "
                  f"{time.perf_counter() - t0:.1f} s")
    files = [p for p in tree.rglob("*") if p.is_file()]
    mb = sum(p.stat().st_size for p in files) / 1e6
    per = f"; best of {args.calls} loads per process" if args.calls > 1 else ""
    print(f"tree {tree}: {mb:.1f} MB in {len(files)} files{per}; {os.cpu_count()} CPU(s), load average "
          f"{os.getloadavg()[0]:.2f} (runs are disturbed by other work on the machine)")
    # (label, engine, checkout)
    runs_of: list[tuple[str, str, Path]] = [("loader", "loader", ROOT)]
    if args.before:
        for e in _engines_of(args.before.resolve()):
            runs_of.append((f"before {e}" if e != "loader" else "before", e, args.before.resolve()))
    results: dict[str, dict[str, Any]] = {}
    all_runs: dict[str, list[dict[str, Any]]] = {label: [] for label, _, _ in runs_of}
    with tempfile.TemporaryDirectory(prefix="bench-load-tables-") as tmp:
        for k in range(max(args.repeat, 1)):  # loaders take turns: a change in the load hits each
            for label, engine, root in runs_of:
                out = Path(tmp) / f"{label.replace(' ', '-')}.arrow" if k == 0 else None
                all_runs[label].append(_run_child(engine, tree, out, root, args.calls))
        for label, _, _ in runs_of:
            runs = all_runs[label]
            best = min(runs, key=lambda r: r["wall"])
            results[label] = {"wall": best["wall"], "cpu": min(r["cpu"] for r in runs),
                              "peak": max(r["peak_rss_mb"] for r in runs), "base": runs[0]["base_rss_mb"],
                              "rows": best["rows"], "runs": runs}
            r = results[label]
            walls = ", ".join(f"{x['wall']:.2f}" for x in runs)
            print(f"  {label:17s} wall {r['wall']:6.2f} s ({mb / r['wall']:6.1f} MB/s)  cpu {r['cpu']:6.2f} s "
                  f"({mb / r['cpu']:6.1f} MB/s)  peak RSS {r['peak']:7.0f} MB (+{r['peak'] - r['base']:.0f} MB over "
                  f"imports)  {r['rows']:,} block rows  [walls: {walls}]")
        tables = [Path(tmp) / f"{label.replace(' ', '-')}.arrow" for label, _, _ in runs_of]
        same = all(_same_tables(tables[0], t) for t in tables[1:])
    new = results["loader"]
    for label, _, _ in runs_of[1:]:
        old = results[label]
        print(f"speed-up loader / {label}: wall {old['wall'] / new['wall']:.2f}x, cpu {old['cpu'] / new['cpu']:.2f}x; "
              f"peak RSS {new['peak'] / old['peak']:.2f}x")
    if len(runs_of) > 1:
        print(f"same blocks table (every column, every row, all {len(runs_of)}): {'yes' if same else 'NO'}")
    if args.phases:
        phases: dict[str, float] = {}
        for r in new["runs"]:
            for k, v in r["timings"].items():
                phases[k] = min(phases.get(k, float("inf")), v)
        print("loader phases (best of the runs; wall s, cpu s):")
        for k, v in phases.items():
            if not k.startswith("cpu: "):
                print(f"  {k:30s} {v:6.2f}  {phases.get('cpu: ' + k, 0.0):6.2f}")
    floor = None
    if args.readers or args.run:
        parses = [_orjson_child(tree) for _ in range(max(args.repeat, 1))]
        floor = {"wall": min(p["wall"] for p in parses), "cpu": min(p["cpu"] for p in parses)}
        print(f"orjson, every line parsed ({parses[0]['lines']:,} lines): wall {floor['wall']:6.2f} s  "
              f"cpu {floor['cpu']:6.2f} s; the loader takes {new['cpu'] / floor['cpu']:.1f}x its CPU")
    if args.run and floor is not None:
        runs = [whole_run(tree) for _ in range(max(args.repeat, 1))]
        best = min(runs, key=lambda r: r["cpu"])
        print(f"ctxreplay run --jobs 1 (cold): wall {min(r['wall'] for r in runs):6.2f} s  cpu {best['cpu']:6.2f} s  "
              f"peak RSS {max(r['peak_rss_mb'] for r in runs):.0f} MB; {best['cpu'] / floor['cpu']:.1f}x orjson's "
              f"CPU (goal <= 6x), wall {min(r['wall'] for r in runs) / floor['wall']:.1f}x")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
