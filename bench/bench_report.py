"""`ctxreplay report --by session --json` against ccusage 20.0.24 on generated trees, in one run.

Generates trees of the given sizes from ../shared/corpus/claude-projects with fresh ids
(bench/gen_tree.py), then times, alternating, `ctxreplay report TREE --by session --json` and
`HOME=<tmp> CLAUDE_CONFIG_DIR=TREE ccusage session --json --offline` (best and median of
--repeat runs each), checks that both give the same per-session tokens and cost, prints the
ratio ccusage / ctxreplay, and deletes the trees. ctxreplay's price cache is warmed first (one
run, not timed), and one cold run (empty price cache: genai-prices imported) is timed apart.

    npm install -g ccusage@20.0.24          # 20.0.26 has no linux-x64 binary
    python bench/bench_report.py [--sizes 190MB,800MB] [--repeat 5] [--keep DIR]
    python bench/bench_report.py --alternatives --sizes 190MB    # also time other ways to scan

Goal (issue 11): at least as fast as ccusage at 190 MB, at least 1.5× faster at 800 MB.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _ctxreplay() -> list[str]:
    exe = Path(sys.executable).parent / "ctxreplay"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "ctxreplay.pipeline.commands.cli"]


CPU: dict[str, list[float]] = {}


def _run(cmd: list[str], env: dict[str, str], tag: str = "") -> tuple[float, bytes]:
    """Wall seconds and stdout; the CPU seconds (user + system, all processes) go to CPU[tag]."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    p = subprocess.run(cmd, env=env, capture_output=True, check=False)
    dt = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if p.returncode != 0:
        raise SystemExit(f"bench_report: {' '.join(cmd)} exited {p.returncode}: {p.stderr.decode()[-500:]}")
    if tag:
        CPU.setdefault(tag, []).append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    return dt, p.stdout


def _same(ours: dict, theirs: dict) -> str:
    rows = {r["key"]: r for r in ours["rows"]}
    bad = 0
    for s in theirs["session"]:
        r = rows.get(s["period"])
        if r is None or (r["input_tokens"], r["output_tokens"], r["cache_write_5m_tokens"] + r["cache_write_1h_tokens"],
                         r["cache_read_tokens"]) != (s["inputTokens"], s["outputTokens"], s["cacheCreationTokens"],
                                                     s["cacheReadTokens"]) or abs(r["cost_usd"] - s["totalCost"]) > 5e-3:
            bad += 1
    n = len(theirs["session"])
    if bad or len(rows) != n:
        return f"DIFFERENT: {bad} of {n} sessions differ, {len(rows)} rows vs {n}"
    return (f"same {n} sessions, total {ours['totals']['cost_usd']:.4f} vs {theirs['totals']['totalCost']:.4f} USD")


def bench_tree(tree: Path, repeat: int, ccusage: str, cache_dir: Path) -> dict:
    home = Path(tempfile.mkdtemp(prefix="bench-home-"))
    env_cc = {**os.environ, "HOME": str(home), "CLAUDE_CONFIG_DIR": str(tree)}
    # as installed: bytecode cached (this environment sets PYTHONDONTWRITEBYTECODE, which would make every
    # run recompile ctxreplay's own modules, ~50 ms that an installed copy never pays)
    env_us = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env_us["CTXREPLAY_CACHE_DIR"] = str(cache_dir)
    ours_cmd = [*_ctxreplay(), "report", str(tree / "projects"), "--by", "session", "--json"]
    cc_cmd = [ccusage, "session", "--json", "--offline"]
    cold_dir = Path(tempfile.mkdtemp(prefix="bench-cold-"))
    cold, _ = _run(ours_cmd, {**env_us, "CTXREPLAY_CACHE_DIR": str(cold_dir)})
    shutil.rmtree(cold_dir, ignore_errors=True)
    _run(ours_cmd, env_us)                      # warm the page cache and the price cache
    _run(cc_cmd, env_cc)
    ours_t, cc_t = [], []
    ours_out = cc_out = b""
    CPU.clear()
    for _ in range(repeat):
        dt, ours_out = _run(ours_cmd, env_us, "ours")
        ours_t.append(dt)
        dt, cc_out = _run(cc_cmd, env_cc, "ccusage")
        cc_t.append(dt)
    shutil.rmtree(home, ignore_errors=True)
    return {"ours": ours_t, "ccusage": cc_t, "cold": cold, "cpu": {k: statistics.median(v) for k, v in CPU.items()},
            "check": _same(json.loads(ours_out), json.loads(cc_out))}


def alternatives(tree: Path) -> None:
    """Other ways to read the same usage, timed in this process (exact totals printed for comparison)."""
    import orjson

    projects = tree / "projects"
    files = sorted(str(p) for p in projects.rglob("*.jsonl"))

    def py_scan(needle: bytes) -> tuple[int, int]:
        n = out = 0
        for f in files:
            data = Path(f).read_bytes()
            pos = data.find(needle)
            while pos != -1:
                s = data.rfind(b"\n", 0, pos) + 1
                e = data.find(b"\n", pos)
                e = len(data) if e == -1 else e
                o = orjson.loads(data[s:e])
                if o.get("type") == "assistant":
                    n += 1
                    out += o["message"]["usage"]["output_tokens"]
                pos = data.find(needle, e)
        return n, out

    def cpu() -> float:
        me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime

    rows = []
    for needle in (b'"usage"', b'"usage":{', b'"output_tokens"'):
        t, c = time.perf_counter(), cpu()
        res = py_scan(needle)
        rows.append((f"python bytes.find({needle.decode()}) + orjson, 1 process", time.perf_counter() - t,
                     cpu() - c, res))
    from ctxreplay.pipeline.reporting.report import scan_files

    for w in (1, 2):
        t, c = time.perf_counter(), cpu()
        scans = scan_files(files, workers=w)
        dt, dc = time.perf_counter() - t, cpu() - c
        recs = [r for s in scans for r in s.records]
        rows.append((f"ctxreplay.pipeline.reporting.report.scan_files, {w} process(es) (per-file dedupe)", dt, dc,
                     (len(recs), sum(r[9] for r in recs))))
    t = time.perf_counter()
    import duckdb
    t_imp = time.perf_counter() - t
    con = duckdb.connect()
    glob = f"{projects}/**/*.jsonl"
    queries = {
        "duckdb read_ndjson_objects + LIKE prefilter + json_extract": f"""
            select count(*), sum(cast(json_extract(json, '$.message.usage.output_tokens') as bigint))
            from read_ndjson_objects('{glob}') where json like '%"usage":{{%'
              and json_extract_string(json, '$.type') = 'assistant'""",
        "duckdb read_json, explicit columns": f"""
            select count(*), sum(message.usage.output_tokens) from read_json('{glob}',
              format = 'newline_delimited', ignore_errors = true,
              columns = {{type: 'VARCHAR', requestId: 'VARCHAR', timestamp: 'VARCHAR', isSidechain: 'BOOLEAN',
                message: 'STRUCT(id VARCHAR, model VARCHAR, usage STRUCT(input_tokens BIGINT, output_tokens BIGINT,
                cache_creation_input_tokens BIGINT, cache_read_input_tokens BIGINT))'}})
            where type = 'assistant' and message.usage is not null""",
    }
    for name, q in queries.items():
        t, c = time.perf_counter(), cpu()
        res = con.execute(q).fetchall()[0]
        rows.append((name + f" (+{t_imp:.2f} s import)", time.perf_counter() - t, cpu() - c, tuple(res)))
    print(f"\nalternatives on {tree} ({sum(os.path.getsize(f) for f in files) / 1e6:.0f} MB): wall, CPU, "
          f"(usage lines or requests, output tokens)")
    for name, dt, dc, res in rows:
        print(f"  {dt:6.3f} s  {dc:6.3f} s CPU  {name}: {res}")


def main(argv: list[str] | None = None) -> int:
    from bench.gen_tree import DEFAULT_SRC, generate, parse_size

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="190MB,800MB", help="comma-separated tree sizes (default 190MB,800MB)")
    ap.add_argument("--repeat", type=int, default=5, help="timed runs of each tool per size (default 5)")
    ap.add_argument("--src", type=Path, default=DEFAULT_SRC, help="tree to copy")
    ap.add_argument("--ccusage", default=shutil.which("ccusage") or "ccusage", help="ccusage executable")
    ap.add_argument("--keep", type=Path, help="write the trees here and keep them, or reuse them when there "
                    "(default: a temp dir, deleted)")
    ap.add_argument("--alternatives", action="store_true", help="also time other ways to read the usage")
    a = ap.parse_args(argv)
    if not shutil.which(a.ccusage):
        print("bench_report: ccusage not found; npm install -g ccusage@20.0.24", file=sys.stderr)
        return 2
    version = subprocess.run([a.ccusage, "--version"], capture_output=True, text=True, check=False).stdout.strip()
    base = a.keep or Path(tempfile.mkdtemp(prefix="bench-report-"))
    cache_dir = Path(tempfile.mkdtemp(prefix="bench-price-cache-"))
    print(f"ccusage {version}; ctxreplay {' '.join(_ctxreplay())}; {os.cpu_count()} CPU(s); "
          f"load average {os.getloadavg()[0]:.2f}")
    try:
        for size_text in a.sizes.split(","):
            size = parse_size(size_text)
            tree = base / f"tree-{size_text.strip()}"
            t = time.perf_counter()
            if a.keep and tree.is_dir() and any(tree.iterdir()):
                mb = sum(f.stat().st_size for f in tree.rglob("*") if f.is_file()) / 1e6
                print(f"\n{size_text.strip()}: reusing {tree} ({mb:.1f} MB)")
            else:
                st = generate(tree, size=size, src=a.src)
                print(f"\n{size_text.strip()}: generated {st.bytes / 1e6:.1f} MB, {st.sessions} sessions, "
                      f"{st.files} files in {time.perf_counter() - t:.1f} s")
            r = bench_tree(tree, a.repeat, a.ccusage, cache_dir)
            o_best, c_best = min(r["ours"]), min(r["ccusage"])
            o_med, c_med = statistics.median(r["ours"]), statistics.median(r["ccusage"])
            print(f"  ctxreplay report: best {o_best:.3f} s, median {o_med:.3f} s (cold price cache: {r['cold']:.3f} s)")
            print(f"  ccusage session : best {c_best:.3f} s, median {c_med:.3f} s")
            print(f"  ratio ccusage / ctxreplay: best {c_best / o_best:.2f}×, median {c_med / o_med:.2f}×")
            cpu = r["cpu"]
            print(f"  CPU seconds (user + sys, median): ctxreplay {cpu['ours']:.3f}, ccusage {cpu['ccusage']:.3f}, "
                  f"ratio {cpu['ccusage'] / cpu['ours']:.2f}× (what a loaded machine leaves of the wall-clock ratio)")
            print(f"  check: {r['check']}")
            if a.alternatives:
                alternatives(tree)
            if not a.keep:
                shutil.rmtree(tree, ignore_errors=True)
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
        if not a.keep:
            shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
