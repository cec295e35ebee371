"""Scale figures of `ctxreplay run` on a generated tree (issue 10), printed as ratios measured in one run.

    python bench/bench_scale.py [--size 190MB] [--tree DIR] [--preset default] [--jobs 2] [--skip-jobs] [--repeat N]

Generates (or reuses) an N× copy of the real `claude-projects` tree with fresh ids (bench/gen_tree.py),
then runs, each as its own `ctxreplay run` process under `/usr/bin/time` (wall seconds, peak RSS):
- cold: a new OUT and ledger;
- warm: the same command again, nothing changed (every session group reused; the tree is left
  to settle first, 3 s after its last write, so that the warm run trusts the files' stats as it
  does for transcripts not being written: pipeline/batch/manifest.py, `settled`);
- append: one call (a user line and an assistant line) appended to the largest session, run again;
- `--jobs 1` and `--jobs N`, cold, in new OUTs;
and the tokenizer-only bound: tiktoken over the distinct texts of the cold run's blocks, timed
alone. Figures: cold MB/s, tokenizer MB/s and their ratio, warm/cold, append/cold, jobs 1/jobs N,
peak RSS. On a shared machine the figures move with the load: say so when you quote them.
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


def _bytes(size: str) -> int:
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9}
    for u, m in units.items():
        if size.upper().endswith(u):
            return int(float(size[: -len(u)]) * m)
    return int(size)


def tree_bytes(tree: Path) -> int:
    return sum(p.stat().st_size for p in tree.rglob("*") if p.is_file())


def given_or_generated_tree(tree: Path | None, work: Path, size: str) -> Path:
    """`tree` when given, else a tree of `size` generated (once) under `work/tree`."""
    if tree is not None:
        return tree
    from bench.gen_tree import generate

    tree = work / "tree"
    if not tree.exists():
        generate(tree, size=_bytes(size))
    return tree


def _exe() -> list[str]:
    return [sys.executable, "-m", "ctxreplay.pipeline.commands.cli"] if not shutil.which("ctxreplay") else ["ctxreplay"]


def _env() -> dict[str, str]:
    """The environment of the timed runs: with bytecode written and read, as an installed tool runs
    (pip compiles a wheel's modules; PYTHONDONTWRITEBYTECODE=1, set on some machines, would make
    every run compile ~80 modules from source again: ~0.2 s, a fifth of a warm run)."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def compile_once() -> None:
    """The bytecode of the checkout's modules written before anything is timed (what pip does for a
    wheel; an editable install compiles each module at its first import)."""
    subprocess.run([sys.executable, "-m", "compileall", "-q", *(str(ROOT / d) for d in ("ctxreplay", "pipeline", "stages",
                                                                                     "schemas"))],
                   capture_output=True, check=False, env=_env())


def timed_run(args: list[str]) -> tuple[float, int, dict]:
    """(wall seconds, peak RSS bytes, summary) of one `ctxreplay run ... --json -q`."""
    exe = _exe()
    with tempfile.NamedTemporaryFile("r", suffix=".time") as tf:
        t0 = time.perf_counter()
        r = subprocess.run(["/usr/bin/time", "-f", "%M", "-o", tf.name, *exe, "run", *args, "--json", "-q"],
                           capture_output=True, text=True, cwd=ROOT, check=False, env=_env())
        wall = time.perf_counter() - t0
        if r.returncode not in (0, 1):
            raise SystemExit(f"ctxreplay run failed ({r.returncode}): {r.stderr[-2000:]}")
        rss_kb = int(tf.read().strip().splitlines()[-1])
    return wall, rss_kb * 1024, json.loads(r.stdout)


def append_one_call(tree: Path) -> Path:
    """Append a user line and an assistant line (a new call) to the largest main session file."""
    files = [p for p in tree.rglob("*.jsonl") if p.parent.name != "subagents"]
    target = max(files, key=lambda p: p.stat().st_size)
    last = None
    with open(target, "rb") as fh:
        for line in fh:
            try:
                o = json.loads(line)
            except ValueError:
                continue
            if isinstance(o, dict) and o.get("type") == "assistant" and o.get("uuid"):
                last = o
    assert last is not None, f"no assistant line in {target}"
    stamp = str(time.time_ns())
    user = {**last, "type": "user", "uuid": f"bench-u-{stamp}", "parentUuid": last["uuid"],
            "message": {"role": "user", "content": "one more question, appended by bench_scale"}}
    user.pop("requestId", None)
    msg = dict(last["message"])
    msg.update(id=f"msg_bench{stamp}", content=[{"type": "text", "text": "one more answer"}])
    answer = {**last, "uuid": f"bench-a-{stamp}", "parentUuid": user["uuid"], "message": msg}
    with open(target, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(user) + "\n" + json.dumps(answer) + "\n")
    return target


def tokenizer_bound(out: Path) -> tuple[float, int, float, int]:
    """tiktoken alone over the texts the run counts (each block's token text: text, or a tool
    call's name and input): (seconds, n) over the distinct ones (what the run tokenizes: it counts
    a text once) and over every block row."""
    import polars as pl

    from ctxreplay.pipeline.core.tokens import tiktoken_counts, token_text_expr

    rows = pl.read_parquet(out / "blocks.parquet").select(t=token_text_expr()).get_column("t").drop_nulls()
    distinct, every = rows.unique().to_list(), rows.to_list()
    t0 = time.perf_counter()
    tiktoken_counts(distinct)
    t1 = time.perf_counter()
    tiktoken_counts(every)
    return t1 - t0, len(distinct), time.perf_counter() - t1, len(every)


def settle(tree: Path) -> float:
    """Wait until every file of the tree has settled (pipeline/batch/manifest.py, `settled`), so
    that the cold run records each file's stat and the warm run takes the recorded hashes from it,
    as it does for transcripts not written in the last seconds (a tree written just now would be
    read and hashed again by the warm run). The seconds waited."""
    from ctxreplay.pipeline.batch.manifest import SETTLE_NS

    newest = max((p.stat().st_ctime_ns for p in tree.rglob("*") if p.is_file()), default=0)
    wait = (newest + SETTLE_NS - time.time_ns()) / 1e9
    if wait <= 0:
        return 0.0
    time.sleep(wait + 0.1)
    return wait + 0.1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="190MB")
    ap.add_argument("--tree", type=Path, help="an existing tree (default: generated under a temp dir)")
    ap.add_argument("--preset", default="default")
    ap.add_argument("--jobs", type=int, default=2, help="the N of `--jobs 1 / --jobs N` (cold, warm and append "
                    "run with --jobs 1)")
    ap.add_argument("--skip-jobs", action="store_true")
    ap.add_argument("--keep", type=Path, help="work directory to keep (default: a temp dir, removed)")
    ap.add_argument("--repeat", type=int, default=1, help="cold, warm and append runs timed N times each, the "
                    "fastest kept (each append try starts from a copy of the OUT and input before it)")
    a = ap.parse_args()
    work = a.keep or Path(tempfile.mkdtemp(prefix="bench-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        tree = given_or_generated_tree(a.tree, work, a.size)
        mb = tree_bytes(tree) / 1e6
        waited = settle(tree)
        common = ["--preset", a.preset]
        out = work / "out"
        shutil.rmtree(out, ignore_errors=True)
        compile_once()
        args = [str(tree), "--out", str(out), *common, "--jobs", "1"]
        tries = max(1, a.repeat)
        colds = []
        for _ in range(tries):
            shutil.rmtree(out, ignore_errors=True)
            colds.append(timed_run(args))
        cold, cold_rss, s = min(colds, key=lambda r: r[0])
        calls = s["calls"]
        tok_s, n_texts, all_s, n_all = tokenizer_bound(out / "current")
        warm, warm_rss, w = min((timed_run(args) for _ in range(tries)), key=lambda r: r[0])
        target = max((p for p in tree.rglob("*.jsonl") if p.parent.name != "subagents"), key=lambda p: p.stat().st_size)
        before = target.read_bytes()
        saved = work / "out-before-append"
        shutil.rmtree(saved, ignore_errors=True)
        if tries > 1:
            shutil.copytree(out, saved, symlinks=True)
        apps = []
        for k in range(tries):
            if k:  # the OUT and the input as they were before the first append
                shutil.rmtree(out)
                shutil.copytree(saved, out, symlinks=True)
                target.write_bytes(before)
            assert append_one_call(tree) == target
            apps.append(timed_run(args))
        app, app_rss, ap_s = min(apps, key=lambda r: r[0])
        load = os.getloadavg()[0]
        print(f"tree: {tree} ({mb:.1f} MB, {s['files']} files, {s['groups']['total']} session groups, {calls:,} calls, "
              f"{s['groups']['batches']} batches); preset {a.preset}; {os.cpu_count()} CPUs, figures under load "
              f"(load average {load:.2f} at the end)" + (f"; fastest of {tries} runs each" if tries > 1 else "")
              + (f"; waited {waited:.1f} s for the tree to settle" if waited else ""))
        print(f"cold:     {cold:7.2f} s  {mb / cold:6.2f} MB/s  peak RSS {cold_rss / 2**20:7.0f} MiB "
              f"(load {s['timings_seconds'].get('load', 0):.1f} s, stages {s['timings_seconds'].get('stages', 0):.1f} s, "
              f"replay {s['timings_seconds'].get('replay', 0):.1f} s, cache sim {s['cache_sim'].get('seconds', 0):.1f} s)")
        print(f"tokenizer only: {tok_s:7.2f} s over the {n_texts:,} distinct texts the run counts = "
              f"{mb / tok_s:6.2f} MB/s; cold / tokenizer = {(mb / cold) / (mb / tok_s):.2f}  "
              f"(every block row's text, {n_all:,}: {all_s:.2f} s = {mb / all_s:.2f} MB/s, ratio "
              f"{(mb / cold) / (mb / all_s):.2f})")
        print(f"warm:     {warm:7.2f} s  peak RSS {warm_rss / 2**20:7.0f} MiB  groups {w['groups']}  "
              f"cold / warm = {cold / warm:.1f}x")
        print(f"append:   {app:7.2f} s  peak RSS {app_rss / 2**20:7.0f} MiB  groups {ap_s['groups']}  "
              f"append / cold = {100 * app / cold:.1f} %  ({target.name})")
        if not a.skip_jobs:
            j1, j1_rss, _ = timed_run([str(tree), "--out", str(work / "j1"), *common, "--jobs", "1"])
            jn, jn_rss, _ = timed_run([str(tree), "--out", str(work / "jn"), *common, "--jobs", str(a.jobs)])
            print(f"--jobs 1: {j1:7.2f} s  peak RSS {j1_rss / 2**20:7.0f} MiB;  --jobs {a.jobs}: {jn:7.2f} s  "
                  f"peak RSS {jn_rss / 2**20:7.0f} MiB (parent; workers are separate processes);  "
                  f"jobs 1 / jobs {a.jobs} = {j1 / jn:.2f}x")
    finally:
        if a.keep is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
