"""Replay cost: a generated 4,000-call thread vs a 2,000-call one, MB/s over the corpus, and the
request store.

Prints the time of each size (best of N), their ratio (target ≤ 2.2: linear cost), and the
throughput of a cold run (token cache empty) and a warm one (same ledger: texts already counted)
over ../shared/corpus when it is present; then, for the corpus, the size of the request store
(messages.parquet + call_messages.parquet) beside the `--all-calls` JSONL export of the same
requests, and the time to rebuild every call's request from the store (each checked against its
request_sha256).

    python bench/bench_replay.py [--preset identity] [--repeat 3]
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

from bench.sessiongen import SessionLines
from ctxreplay.pipeline.assembly.store import iter_request_json
from ctxreplay.pipeline.batch.runner import RunOptions, run
from ctxreplay.pipeline.core.tokens import CHARS4_COUNTER, TIKTOKEN_COUNTER
from ctxreplay.pipeline.staging.spec import load_spec

SID = "9b1f0000-0000-4000-8000-00000000beef"


def generate(path: Path, calls: int, turns: int = 0) -> None:
    """A Claude Code session with `calls` requests: prompt, then tool call / result turns. With
    `turns`, every `turns`-th answer is a text and the user writes again (a new tool loop starts):
    the results before it can then be cleared. Two lines per call either way (answer, then result
    or user message)."""
    gen = SessionLines(SID)
    lines, entry = gen.lines, gen.entry

    entry("user", {"role": "user", "content": "Please refactor the module step by step."}, 0)
    for k in range(calls):
        usage = {"input_tokens": 3, "output_tokens": 40, "cache_read_input_tokens": 1000 + 60 * k,
                 "cache_creation_input_tokens": 60}
        tid = f"toolu_bench_{k:06d}"
        last = k == calls - 1
        turn = bool(turns) and k % turns == turns - 1 and not last
        block = ({"type": "text", "text": "All steps are done."} if last else
                 {"type": "text", "text": f"Step {k} is done."} if turn else
                 {"type": "tool_use", "id": tid, "name": "Bash", "input": {"command": f"run step {k}"}})
        entry("assistant", {"id": f"msg_bench_{k:06d}", "role": "assistant", "model": "claude-sonnet-4-5",
                            "content": [block], "usage": usage}, 2 * k + 1, requestId=f"req_bench_{k:06d}")
        if turn:
            entry("user", {"role": "user", "content": f"Good. Go on with step {k + 1}."}, 2 * k + 2)
        elif not last:
            out = f"step {k} output\n" + ("log line with some detail\n" * (5 + k % 7))
            entry("user", {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tid, "content": out}]},
                  2 * k + 2)
    path.write_text("\n".join(lines) + "\n")


def time_run(paths: list[Path], preset: str, out: Path, ledger: Path | None, counter: str,
             all_calls: bool = False) -> tuple[float, dict]:
    if out.exists():
        shutil.rmtree(out)
    t = time.perf_counter()
    res = run(paths, load_spec(preset=preset), RunOptions(out_dir=out, ledger_path=ledger, token_counter=counter,
                                                          all_calls=all_calls))
    return time.perf_counter() - t, res.summary


def store_figures(out: Path) -> None:
    """The request store of a run made with all_calls: its size beside the JSONL, and a rebuild."""
    import hashlib

    import polars as pl

    jsonl = sum(p.stat().st_size for p in (out / "requests").glob("*.jsonl"))
    store = sum((out / f).stat().st_size for f in ("messages.parquet", "call_messages.parquet"))
    want = {(k, c): h for k, c, h in pl.read_parquet(out / "calls.parquet")
            .select("thread_key", "call", "request_sha256").iter_rows()}
    t = time.perf_counter()
    n = size = bad = 0
    for key, call, data in iter_request_json(out):
        n += 1
        size += len(data)
        bad += hashlib.sha256(data).hexdigest() != want[(key, call)]
    dt = time.perf_counter() - t
    print(f"request store: messages.parquet + call_messages.parquet = {store / 1e6:.2f} MB for {n} requests "
          f"({size / 1e6:.0f} MB of JSON); --all-calls JSONL = {jsonl / 1e6:.0f} MB ({jsonl / store:.0f}x)")
    print(f"rebuilt all {n} requests from the store in {dt:.2f} s (sha256 checked: {bad} mismatches)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="default")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="ctxreplay-bench-"))
    try:
        times = {}
        for calls in (2000, 4000):
            d = tmp / f"gen{calls}"
            d.mkdir()
            generate(d / f"{SID}.jsonl", calls)
            best = min(time_run([d], args.preset, tmp / f"o{calls}", None, CHARS4_COUNTER)[0]
                       for _ in range(args.repeat))
            times[calls] = best
            print(f"{calls:>5} calls  {best:7.3f} s  ({calls / best:,.0f} calls/s)  preset {args.preset}")
        print(f"ratio 4000/2000 = {times[4000] / times[2000]:.2f}  (target <= 2.2)")
        corpus = ROOT.parent / "shared" / "corpus"
        if corpus.is_dir():
            ledger = tmp / "corpus-ledger.duckdb"
            cold, s = time_run([corpus], args.preset, tmp / "oc", ledger, TIKTOKEN_COUNTER)
            warm, s2 = time_run([corpus], args.preset, tmp / "ow", ledger, TIKTOKEN_COUNTER)
            mb = s["bytes"] / 1e6
            print(f"corpus {mb:.1f} MB, {s['calls']} calls: cold {cold:.2f} s = {mb / cold:.1f} MB/s "
                  f"({s['tokens']['texts_counted']} texts tokenized); warm {warm:.2f} s = {mb / warm:.1f} MB/s "
                  f"({s2['tokens']['texts_counted']} tokenized, {s2['tokens']['cache_hits']} from the cache)")
            time_run([corpus], args.preset, tmp / "oa", ledger, TIKTOKEN_COUNTER, all_calls=True)
            store_figures(tmp / "oa")
        else:
            print(f"corpus not found at {corpus}: MB/s figures skipped")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
