"""Load speed: the columnar Claude Code loader against the reference (row-by-row) one.

On a tree made by `gen_tree.py` (default 190 MB), each engine loads the whole tree
(`load_paths(..., engine=...)`) in a fresh process per run (the engines take turns), so peak RSS
is its own, with Python's cyclic GC paused as `ctxreplay run` pauses it while it loads. Prints per
engine the best wall and CPU seconds of N runs, MB/s, peak RSS (and its growth over the process
after imports), the speed-up of the columnar engine (goal: at least 5x) and whether both gave the
same blocks table (every column, every row: `Table.equals`). `--phases` adds the columnar engine's
seconds per phase (best of the runs). `--readers` times the first step alone, parsing every line
of the tree into the fields the loader reads, with the two native readers the issue names: DuckDB's
JSON functions (what cc_columnar uses) and polars over orjson-decoded batches. `--before DIR` also
times the columnar engine of another checkout (e.g. `git archive main | tar -x -C DIR`), in the same
turns, and prints this checkout's speed-up over it.

    python bench/bench_load.py [--size 190MB] [--keep DIR] [--repeat 3] [--phases] [--readers]
    python bench/bench_load.py --tree DIR          # an existing tree
    python bench/bench_load.py --tree DIR --before /tmp/main-copy   # before / after a change
    python bench/bench_load.py --tree SMALL_DIR --calls 20          # per-call cost of repeated small loads
"""

from __future__ import annotations

import argparse
import gc
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

ENGINES = ("reference", "columnar")


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def child(engine: str, tree: Path, table_out: Path | None, calls: int = 1) -> None:
    """One timed load in this process (`calls` > 1: that many, the best kept); prints one JSON object."""
    import pyarrow as pa

    from ctxreplay.pipeline.loaders import load_paths

    base = _rss_mb()
    wall = cpu = float("inf")
    for _ in range(calls):
        timings: dict[str, float] | None = {} if engine == "columnar" else None
        gc.disable()  # as `ctxreplay run` loads (runner._gc_paused)
        t0, c0 = time.perf_counter(), time.process_time()
        res = load_paths([tree], engine=engine, timings=timings)
        wall, cpu = min(wall, time.perf_counter() - t0), min(cpu, time.process_time() - c0)
        gc.enable()
    peak = _rss_mb()
    if table_out is not None:
        with pa.OSFile(str(table_out), "wb") as fh, pa.ipc.new_file(fh, res.blocks.schema) as w:
            w.write_table(res.blocks)
    print(json.dumps({"wall": wall, "cpu": cpu, "peak_rss_mb": peak, "base_rss_mb": base,
                      "rows": res.blocks.num_rows, "timings": timings or {}}))


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


def _same_tables(a: Path, b: Path) -> bool:
    import pyarrow as pa

    ta = pa.ipc.open_file(pa.memory_map(str(a))).read_all()
    tb = pa.ipc.open_file(pa.memory_map(str(b))).read_all()
    return ta.schema.equals(tb.schema, check_metadata=True) and ta.equals(tb)


# ---------------------------------------------------------------- readers (the parse step alone)


def _lines(tree: Path) -> Any:
    import pyarrow as pa
    import pyarrow.compute as pc

    files = sorted(p for p in tree.rglob("*.jsonl"))
    data = pa.array([p.read_bytes() for p in files], pa.large_binary())
    text = pc.split_pattern(data, b"\n").flatten().cast(pa.large_string())
    return text.filter(pc.starts_with(text, "{"))


def _duckdb_reader(text: Any) -> int:
    """The columnar loader's parse: DuckDB json_keys + json_transform over every line."""
    import duckdb
    import pyarrow as pa

    from ctxreplay.pipeline.loaders import cc_columnar as m

    con = duckdb.connect()
    try:
        con.register("v", pa.table({"lid": pa.array(range(len(text)), pa.int64()), "t": text}))
        con.execute(m._MACROS.split("CREATE OR REPLACE TEMP MACRO nodupk")[0])
        con.execute(m._SQL_PARSE)
        return con.execute("SELECT count(*) FROM p WHERE s IS NOT NULL").fetchall()[0][0]
    finally:
        con.close()


_TOP = ("type", "uuid", "parentUuid", "logicalParentUuid", "subtype", "isSidechain", "isMeta", "isCompactSummary",
        "isVisibleInTranscriptOnly", "requestId", "timestamp", "agentId")
_MSG = ("id", "role", "model", "stop_reason")
_USAGE = ("input_tokens", "output_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")


def _orjson_polars_reader(text: Any, batch: int = 8192) -> int:
    """Polars over orjson-decoded batches: each line decoded by orjson, the same fields as the SQL
    transform picked per batch into columns (content items kept as JSON text), one DataFrame per
    batch. The decode and the picking are Python per line: there is no way around it with orjson."""
    import orjson
    import polars as pl

    dumps, loads = orjson.dumps, orjson.loads
    n = 0
    for start in range(0, len(text), batch):
        cols: dict[str, list[Any]] = {k: [] for k in (*_TOP, *(f"m_{k}" for k in _MSG),
                                                      *(f"u_{k}" for k in _USAGE), "content")}
        for t in text.slice(start, batch).to_pylist():
            try:
                o = loads(t)
            except orjson.JSONDecodeError:
                continue
            if not isinstance(o, dict):
                continue
            for k in _TOP:
                v = o.get(k)
                cols[k].append(None if v is None else dumps(v).decode())
            msg = o.get("message")
            msg = msg if isinstance(msg, dict) else {}
            for k in _MSG:
                v = msg.get(k)
                cols[f"m_{k}"].append(None if v is None else dumps(v).decode())
            u = msg.get("usage")
            u = u if isinstance(u, dict) else {}
            for k in _USAGE:
                v = u.get(k)
                cols[f"u_{k}"].append(None if v is None else dumps(v).decode())
            c = msg.get("content")
            cols["content"].append([dumps(x).decode() for x in c] if isinstance(c, list) else None)
        df = pl.DataFrame(cols, schema={**{k: pl.String for k in cols if k != "content"},
                                        "content": pl.List(pl.String)})
        n += df.height
    return n


def readers(tree: Path, mb: float, repeat: int) -> None:
    text = _lines(tree)
    print(f"readers: the parse step alone over {len(text):,} lines ({mb:.1f} MB), best of {repeat}")
    for name, fn in (("DuckDB json_keys + json_transform", _duckdb_reader),
                     ("polars over orjson-decoded batches", _orjson_polars_reader)):
        best_w = best_c = float("inf")
        rows = 0
        for _ in range(repeat):
            t0, c0 = time.perf_counter(), time.process_time()
            rows = fn(text)
            best_w, best_c = min(best_w, time.perf_counter() - t0), min(best_c, time.process_time() - c0)
        print(f"  {name:36s} wall {best_w:6.2f} s  cpu {best_c:6.2f} s  {mb / best_w:7.1f} MB/s  ({rows:,} rows)")


# ---------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="190MB", help="tree size to generate (default 190MB)")
    ap.add_argument("--tree", type=Path, help="an existing tree to load instead of generating one")
    ap.add_argument("--keep", type=Path, help="generate the tree here (reused when present)")
    ap.add_argument("--repeat", type=int, default=3, help="runs per engine (best is printed)")
    ap.add_argument("--phases", action="store_true", help="the columnar engine's seconds per phase")
    ap.add_argument("--readers", action="store_true", help="also time the two native JSON readers alone")
    ap.add_argument("--before", type=Path, help="another checkout whose columnar engine is timed too (before)")
    ap.add_argument("--calls", type=int, default=1,
                    help="loads per process, best kept: with a small --tree, the per-call (fixed) cost of a "
                         "process that loads again and again")
    ap.add_argument("--child", choices=ENGINES, help=argparse.SUPPRESS)
    ap.add_argument("--code", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--table-out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
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
    results: dict[str, dict[str, Any]] = {}
    names = (*ENGINES, "before") if args.before else ENGINES
    all_runs: dict[str, list[dict[str, Any]]] = {e: [] for e in names}
    with tempfile.TemporaryDirectory(prefix="bench-load-tables-") as tmp:
        for k in range(max(args.repeat, 1)):  # engines take turns: a change in the load hits each
            for engine in names:
                out = Path(tmp) / f"{engine}.arrow" if k == 0 else None
                if engine == "before":
                    all_runs[engine].append(_run_child("columnar", tree, out, args.before.resolve(), args.calls))
                else:
                    all_runs[engine].append(_run_child(engine, tree, out, calls=args.calls))
        for engine in names:
            runs = all_runs[engine]
            best = min(runs, key=lambda r: r["wall"])
            results[engine] = {"wall": best["wall"], "cpu": min(r["cpu"] for r in runs),
                               "peak": max(r["peak_rss_mb"] for r in runs), "base": runs[0]["base_rss_mb"],
                               "rows": best["rows"], "runs": runs}
            r = results[engine]
            walls = ", ".join(f"{x['wall']:.2f}" for x in runs)
            print(f"  {engine:10s} wall {r['wall']:6.2f} s ({mb / r['wall']:6.1f} MB/s)  cpu {r['cpu']:6.2f} s "
                  f"({mb / r['cpu']:6.1f} MB/s)  peak RSS {r['peak']:7.0f} MB (+{r['peak'] - r['base']:.0f} MB over "
                  f"imports)  {r['rows']:,} block rows  [walls: {walls}]")
        same = _same_tables(Path(tmp) / "reference.arrow", Path(tmp) / "columnar.arrow")
        if args.before:
            same = same and _same_tables(Path(tmp) / "before.arrow", Path(tmp) / "columnar.arrow")
    ref, col = results["reference"], results["columnar"]
    print(f"speed-up columnar / reference: wall {ref['wall'] / col['wall']:.2f}x, cpu {ref['cpu'] / col['cpu']:.2f}x "
          f"(goal >= 5x); peak RSS {col['peak'] / ref['peak']:.2f}x")
    if args.before:
        bef = results["before"]
        print(f"speed-up columnar / before ({args.before}): wall {bef['wall'] / col['wall']:.2f}x, "
              f"cpu {bef['cpu'] / col['cpu']:.2f}x; before / reference: cpu {ref['cpu'] / bef['cpu']:.2f}x")
    print(f"same blocks table (every column, every row{', all three' if args.before else ''}): "
          f"{'yes' if same else 'NO'}")
    if args.phases:
        phases: dict[str, float] = {}
        for r in col["runs"]:
            for k, v in r["timings"].items():
                phases[k] = min(phases.get(k, float("inf")), v)
        print("columnar phases (best of the runs; wall s, cpu s):")
        for k, v in phases.items():
            if not k.startswith("cpu: "):
                print(f"  {k:46s} {v:6.2f}  {phases.get('cpu: ' + k, 0.0):6.2f}")
    if args.readers:
        readers(tree, mb, max(args.repeat, 1))
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
