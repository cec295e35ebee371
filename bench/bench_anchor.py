"""What the anchor of `ctxreplay report --sim OUT`'s estimates costs (pipeline/reporting/anchor.py).

For each input tree: `ctxreplay run --preset default` (the run a user views), then `report --sim
OUT --json` three ways — `--raw` (no anchor), with `--anchor ID` (an identity run of the same
inputs, made beforehand) and with no option (the report runs identity itself) — and the identity
run's own replay and simulation seconds (`summary.json` timings: what keeping the anchor inside
every run of another pipeline would add to it at the least, before writing a second request store).
Best of `--repeat` runs each (the machine is shared: quote the load average with the figures).

    python bench/bench_anchor.py [--tree DIR ...] [--repeat 2]

Default trees: ../shared/corpus and a 3-copy tree of its Claude Code sessions (bench/gen_tree.py).
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


def _ctx(*args: object) -> float:
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "ctxreplay", *map(str, args)], check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    return time.perf_counter() - t


def _fresh(d: Path) -> Path:
    shutil.rmtree(d, ignore_errors=True)
    return d


def bench(tree: Path, work: Path, repeat: int) -> dict[str, float]:
    best: dict[str, float] = {}

    def keep(k: str, v: float) -> None:
        best[k] = min(best.get(k, v), v)

    for _ in range(repeat):
        out, ident = work / "default", work / "identity"
        keep("run default", _ctx("run", tree, "--preset", "default", "--out", _fresh(out), "-q"))
        keep("run identity", _ctx("run", tree, "--preset", "identity", "--out", _fresh(ident), "-q"))
        s = json.loads((ident / "summary.json").read_text())
        keep("identity replay + simulation (in a run)", s["timings_seconds"]["replay"] + s["cache_sim"]["seconds"])
        keep("report --sim --raw", _ctx("report", "--sim", out, "--raw", "--json"))
        keep("report --sim --anchor ID", _ctx("report", "--sim", out, "--anchor", ident, "--json"))
        keep("report --sim (identity run made)", _ctx("report", "--sim", out, "--json"))
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", type=Path, action="append", help="input tree (repeatable)")
    ap.add_argument("--repeat", type=int, default=2)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-anchor-") as tmp:
        trees = a.tree
        if not trees:
            from bench.gen_tree import generate

            corpus = ROOT.parent / "shared" / "corpus"
            generate(Path(tmp) / "tree", copies=3, src=corpus / "claude-projects")
            trees = [corpus, Path(tmp) / "tree" / "projects"]
        print(f"load average {os.getloadavg()[0]:.2f}; best of {a.repeat}")
        for tree in trees:
            work = Path(tmp) / "work"
            work.mkdir(exist_ok=True)
            best = bench(tree, work, a.repeat)
            run = best["run default"]
            print(f"{tree}:")
            for k, v in best.items():
                print(f"  {k:<42} {v:7.2f} s  ({v / run:.0%} of the run)")
        print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
