"""Replay cost when every call breaks the prefix deep in the history.

Generates a Claude Code session of N calls (user turns of 4 tool call / result loops, results of
about `--result-chars` characters) and replays it under `identity` and under `context-editing`.
Past its 100,000-token trigger, context-editing's tombstone clears just enough of the oldest tool
results at every call to stay under the trigger, so each call's request changes a message about
1,450 messages before its end: the replay must not re-shape the unchanged messages after it.

Prints, for the 2,400-call session, where the prefix breaks fall, the time of the replay phase and
of the whole run under both presets (best of N) and their ratio (goal <= 1.5), the phases of the
fastest whole run (load, stages, replay, cache simulation), and the linearity
figures: the replay time of 2n calls over n calls for n = 500, 1000, 2000, with the share of each
session's calls whose prefix context-editing breaks. Context-editing only fires past 100,000 tokens
(about 1,050 calls here), so its 2000/1000 figure compares a session where it never fires with one
where it fires at most calls: that is the policy switching on, not the replay growing faster than
its input. So the figures are also given past the trigger: with W the calls before context-editing
first breaks the prefix (from the 2,400-call session), sessions of W, W + n and W + 2n calls, and the
replay time the 2n calls past W add over what the n calls add, (t(W+2n) - t(W)) / (t(W+n) - t(W)):
the same work per call at both sizes (a break at nearly every call). The goal is <= 2.2.

The replay's floor under context-editing is the sha256 of every request: each call hashes the
cached bytes after its break again (about 630 MB over the 2,400 calls here); a worker thread does
it while the replay's Python goes on, so it shows in the ratio only as far as the cores are busy.

    python bench/bench_prefix_break.py [--calls 2400] [--repeat 3] [--profile OUT.prof]
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

import polars as pl

from bench.sessiongen import SessionLines
from ctxreplay.pipeline.batch.runner import RunOptions, run
from ctxreplay.pipeline.core.tokens import CHARS4_COUNTER
from ctxreplay.pipeline.staging.spec import load_spec

SID = "9b1f0000-0000-4000-8000-0000000b4eac"


def generate(path: Path, calls: int, result_chars: int = 360) -> None:
    """A Claude Code session with `calls` requests: user turns of 4 Bash tool call / result loops
    whose results hold about `result_chars` characters; the last answer is text."""
    gen = SessionLines(SID)
    lines, entry = gen.lines, gen.entry

    entry("user", {"role": "user", "content": "Please go through the build log step by step."}, 0)
    line = "log line with some detail about the step\n"
    for k in range(calls):
        if k and k % 4 == 0:  # a new user turn every 4 calls (tombstone never clears the current tool loop)
            entry("user", {"role": "user", "content": f"Now step {k}."}, 2 * k)
        usage = {"input_tokens": 3, "output_tokens": 40, "cache_read_input_tokens": 1000 + 60 * k,
                 "cache_creation_input_tokens": 60}
        tid = f"toolu_pb_{k:06d}"
        last = k == calls - 1
        block = ({"type": "text", "text": "All steps are done."} if last else
                 {"type": "tool_use", "id": tid, "name": "Bash", "input": {"command": f"run step {k}"}})
        entry("assistant", {"id": f"msg_pb_{k:06d}", "role": "assistant", "model": "claude-sonnet-4-5",
                            "content": [block], "usage": usage}, 2 * k + 1, requestId=f"req_pb_{k:06d}")
        if not last:
            out = f"step {k} output\n" + line * (result_chars // len(line))
            entry("user", {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tid, "content": out}]},
                  2 * k + 2)
    path.write_text("\n".join(lines) + "\n")


def timed_run(src: Path, preset: str, out: Path) -> tuple[float, float, pl.DataFrame, dict[str, float]]:
    """(whole run, replay phase) wall seconds, the calls, and the run's phases (load, stages, replay,
    cache simulation)."""
    if out.exists():
        shutil.rmtree(out)
    t = time.perf_counter()
    res = run([src], load_spec(preset=preset), RunOptions(out_dir=out, token_counter=CHARS4_COUNTER, validate=False))
    whole = time.perf_counter() - t
    phases = {k: float(res.summary["timings_seconds"].get(k, 0.0)) for k in ("load", "stages", "replay")}
    phases["cache sim"] = float(res.summary.get("cache_sim", {}).get("seconds", 0.0))
    return whole, phases["replay"], res.calls, phases


def best(src: Path, preset: str, out: Path, repeat: int) -> tuple[float, float, pl.DataFrame, dict[str, float]]:
    """Best of `repeat` runs: whole and replay seconds (each its own minimum), the calls, and the
    phases of the fastest whole run."""
    runs = [timed_run(src, preset, out) for _ in range(repeat)]
    fastest = min(runs, key=lambda r: r[0])
    return fastest[0], min(r[1] for r in runs), runs[0][2], fastest[3]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2400)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--result-chars", type=int, default=360)
    ap.add_argument("--no-linearity", action="store_true", help="skip the 500..4000-call sessions")
    ap.add_argument("--profile", type=Path, help="write a cProfile of one context-editing run here")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="ctxreplay-bench-pb-"))
    try:
        src = tmp / f"gen{args.calls}"
        src.mkdir()
        generate(src / f"{SID}.jsonl", args.calls, args.result_chars)
        if args.profile:
            import cProfile

            cProfile.runctx("timed_run(src, 'context-editing', tmp / 'prof')", globals(),
                            {"src": src, "tmp": tmp}, str(args.profile))
            print(f"profile written to {args.profile}")
        w_id, r_id, _, ph_id = best(src, "identity", tmp / "oi", args.repeat)
        w_ce, r_ce, calls, ph_ce = best(src, "context-editing", tmp / "oc", args.repeat)
        brk = calls.filter(pl.col("prefix_break_message").is_not_null())
        back = brk["n_messages"] - brk["prefix_break_message"]
        print(f"{args.calls} calls, {calls['n_messages'].max()} messages in the last request; under context-editing "
              f"{brk.height} calls break the prefix, a median {back.median() or 0:.0f} messages "
              f"(max {back.max() or 0}) before the request's end")
        print("                         identity  context-editing  ratio (goal <= 1.5)")
        print(f"replay (best of {args.repeat})     {r_id:7.3f} s  {r_ce:11.3f} s  {r_ce / r_id:6.2f}")
        print(f"whole run (best of {args.repeat})  {w_id:7.3f} s  {w_ce:11.3f} s  {w_ce / w_id:6.2f}")
        print("  phases of the fastest whole run: " + ", ".join(
            f"{k} {ph_id[k]:.3f} / {ph_ce[k]:.3f} s" for k in ph_id) + " (identity / context-editing)")
        if args.no_linearity:
            return
        times: dict[str, dict[int, float]] = {"identity": {}, "context-editing": {}}
        broken: dict[int, float] = {}  # n -> share of the calls whose prefix context-editing breaks
        for n in (500, 1000, 2000, 4000):
            d = tmp / f"lin{n}"
            d.mkdir()
            generate(d / f"{SID}.jsonl", n, args.result_chars)
            for preset, by_n in times.items():
                _, by_n[n], got, _ = best(d, preset, tmp / f"ol{n}", args.repeat)
                if preset == "context-editing":
                    broken[n] = got["prefix_break_message"].is_not_null().mean() or 0.0
            print(f"  {n:>5} calls: replay identity {times['identity'][n]:7.3f} s, "
                  f"context-editing {times['context-editing'][n]:7.3f} s (it breaks the prefix at {broken[n]:.0%} "
                  f"of the calls)")
        for n in (500, 1000, 2000):
            print(f"linearity {2 * n}/{n} calls: identity {times['identity'][2 * n] / times['identity'][n]:.2f}, "
                  f"context-editing {times['context-editing'][2 * n] / times['context-editing'][n]:.2f}  (it breaks "
                  f"the prefix at {broken[n]:.0%} / {broken[2 * n]:.0%} of the calls)")
        first = int(calls.with_row_index("k").filter(pl.col("prefix_break_message").is_not_null())["k"].min())
        past: dict[int, float] = {}
        for m in (0, 500, 1000, 2000, 4000):
            d = tmp / f"past{m}"
            d.mkdir()
            generate(d / f"{SID}.jsonl", first + m, args.result_chars)
            _, past[m], got, _ = best(d, "context-editing", tmp / f"op{m}", args.repeat)
            share = got.slice(first)["prefix_break_message"].is_not_null().mean() if m else 0.0
            print(f"  W + {m:>4} calls (W = {first}): replay context-editing {past[m]:7.3f} s"
                  + (f" (it breaks the prefix at {share:.0%} of the calls past W)" if m else ""))
        for n in (500, 1000, 2000):
            r = (past[2 * n] - past[0]) / (past[n] - past[0])
            print(f"linearity past the trigger, {2 * n}/{n} calls past W: context-editing {r:.2f} "
                  f"({'met' if r <= 2.2 else 'NOT met'}; goal <= 2.2)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
