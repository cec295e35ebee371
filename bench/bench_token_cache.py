"""The token cache where a stage counts a few texts at a time: snip firing at every few calls.

A generated session of short tool-loop turns (bench/bench_replay.py, `generate`) in a small window
(default 2,000 calls, 20,000 tokens: snip fires about once every four calls, and counts the text of
each marker it writes, one `count_many` call each). Runs it with the default preset twice on one
ledger: the first run counts every text and queues each count for the ledger; the second finds
its snips frozen in the ledger and looks each marker's count up in the token cache. Prints per
run its seconds, the stages' seconds, the texts counted and found in the cache, and snip's
decisions.

    python bench/bench_token_cache.py [--calls 2000] [--window 20000] [--repeat 2]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.bench_replay import generate
from ctxreplay.pipeline.batch.runner import RunOptions, run
from ctxreplay.pipeline.core.tokens import CHARS4_COUNTER, TIKTOKEN_COUNTER
from ctxreplay.pipeline.staging.spec import load_spec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--window", type=int, default=20000, help="window_tokens of the default preset")
    ap.add_argument("--repeat", type=int, default=2, help="the pair of runs made N times, each on a new ledger")
    ap.add_argument("--tiktoken", action="store_true", help="count with tiktoken (default: chars4)")
    a = ap.parse_args()
    counter = TIKTOKEN_COUNTER if a.tiktoken else CHARS4_COUNTER
    tmp = Path(tempfile.mkdtemp(prefix="bench-token-cache-"))
    try:
        src = tmp / "in"
        src.mkdir()
        generate(src / "s.jsonl", a.calls, turns=4)
        spec = load_spec(preset="default")
        spec.settings["window_tokens"] = a.window
        print(f"{a.calls:,} calls, window {a.window:,} tokens, counter {counter}")
        print("rep  run      seconds  stages s  texts counted  cache hits  snip decisions")
        for rep in range(a.repeat):
            ledger = tmp / f"ledger{rep}.duckdb"
            for k in ("first", "second"):
                t = time.perf_counter()
                res = run([src], spec, RunOptions(out_dir=tmp / f"out{rep}{k}", ledger_path=ledger,
                                                  token_counter=counter))
                s = res.summary
                print(f"{rep:3d}  {k:7s} {time.perf_counter() - t:8.2f}  {s['timings_seconds']['stages']:8.2f}  "
                      f"{s['tokens']['texts_counted']:13,}  {s['tokens']['cache_hits']:10,}  "
                      f"{s['decisions'].get('snip', 0):14,}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
