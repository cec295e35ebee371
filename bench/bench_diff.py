"""Time `ctxreplay diff` against a plain `ctxreplay run` on the corpus (goal: diff under 2x run).

    python bench/bench_diff.py [--repeat 3] [--preset default] [--corpus ../shared/corpus]

Each command runs as its own process (what a CI job pays, imports included) into fresh output
directories: `run` with a fresh --out (so a fresh ledger, as `diff` has), `snapshot`, `diff`
against goldens of the same pipeline (identical, exit 0) and `diff` with tombstone `keep_recent`
changed from 5 to 2 (exit 1, the full report). Prints wall and CPU (user + sys) seconds, best of
--repeat, the ratios to `run`, and the golden directory's size.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CTXREPLAY = [sys.executable, "-m", "ctxreplay.pipeline.commands.cli"]


def timed(args: list[str], ok: tuple[int, ...] = (0,)) -> tuple[float, float]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    r = subprocess.run(CTXREPLAY + args, cwd=ROOT, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode not in ok:
        raise SystemExit(f"{' '.join(args)} exited {r.returncode}: {r.stderr}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--preset", default="default")
    ap.add_argument("--corpus", type=Path, default=ROOT.parent / "shared" / "corpus")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-diff-"))
    try:
        spec = tmp / "spec.toml"
        changed = tmp / "changed.toml"
        text = (ROOT / "data" / "pipelines" / f"{a.preset}.toml").read_text()
        spec.write_text(text)
        changed.write_text(text.replace('use = "tombstone"', 'use = "tombstone"\nkeep_recent = 2'))
        golden = tmp / "golden"
        corpus = str(a.corpus)
        cases = {
            "run": lambda i: timed(["run", corpus, "--pipeline", str(spec), "--out", str(tmp / f"run{i}"), "-q"]),
            "snapshot": lambda i: timed(["snapshot", corpus, "--pipeline", str(spec), "--golden", str(golden), "-q"]),
            "diff (identical)": lambda i: timed(["diff", corpus, "--pipeline", str(spec), "--golden", str(golden),
                                                 "-q"]),
            "diff (keep_recent 5 -> 2)": lambda i: timed(["diff", corpus, "--pipeline", str(changed), "--golden",
                                                          str(golden), "-q", "--format", "markdown"], ok=(1,)),
        }
        best: dict[str, tuple[float, float]] = {}
        for i in range(a.repeat):
            for name, fn in cases.items():
                wall, cpu = fn(i)
                w0, c0 = best.get(name, (float("inf"), float("inf")))
                best[name] = (min(w0, wall), min(c0, cpu))
                shutil.rmtree(tmp / f"run{i}", ignore_errors=True)
        load = os.getloadavg()[0]
        print(f"corpus {a.corpus} ({sum(f.stat().st_size for f in a.corpus.rglob('*') if f.is_file()) / 1e6:.1f} MB), "
              f"preset {a.preset}, best of {a.repeat}; {os.cpu_count()} CPU(s), load average {load:.2f}")
        base_w, base_c = best["run"]
        for name, (w, c) in best.items():
            print(f"  {name:<27} wall {w:6.2f} s ({w / base_w:4.2f}x run)   cpu {c:6.2f} s ({c / base_c:4.2f}x run)")
        size = sum(p.stat().st_size for p in golden.rglob("*") if p.is_file())
        files = sum(1 for p in golden.rglob("*") if p.is_file())
        print(f"  goldens: {size / 1e6:.2f} MB in {files} files")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
