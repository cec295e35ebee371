"""Peak memory of `ctxreplay run` (issue 10's memory goal; issue 23, items 5 and 6).

    python bench/bench_memory.py [--quick] [--keep DIR]
    python bench/bench_memory.py TREE [--batch-bytes N] [--preset default] [--out DIR]

Without TREE: the cases (`line_cases`: one line of 20 / 50 / 200 MB, a sparse 1 GB file of zeros
over the line limit; `--quick` leaves out the 200 MB line; `block_cases`: one message of 1,000 /
10,000 / 100,000 tiny text blocks), each input written to a temp dir and
run by a fresh `ctxreplay run --jobs 1` whose peak RSS is read with getrusage(RUSAGE_CHILDREN) in a
wrapper process of its own; a table of case, largest line read (MB), peak RSS (MB), the bound
(4x the largest line + BATCH_BUDGET_MB, + PER_BLOCK_KB per block of the block cases) and whether
the peak is within it. The block cases end with the growth from 10,000 to 100,000 blocks against the
growth from 1,000 to 10,000: about 10 when memory is linear in the blocks of one message, about 100
when quadratic (each block held its own copy of the message's line: 388 MB at 1,000 blocks, 24 GB
not enough at 100,000, before issue 23 item 5).

With TREE: one run in this process, its resident memory sampled every 20 ms and kept as a peak per
batch and phase (load, stages, replay, write: pipeline/core/crashpoints.py names them), with the
memory left after each batch and the cache simulation's store at the end. It tells the batch's own
peak (which `--batch-bytes` bounds) from what the run keeps to its end (which grows with the corpus).
Figures move with the machine's load only in time, not in memory.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MB = 1024 * 1024
# what one default batch (16 MiB of input) peaks at, Python, DuckDB and polars included: about 0.6 GB
# on the 190 MB tree (docs/benchmarks.md); a case's bound is 4x its largest line read + this
BATCH_BUDGET_MB = 640
# what one more block of one message costs a run at most (block cases): its rows in the loader,
# stages and replay, a few kB (5 kB measured from 30,000 to 100,000 blocks), never the line again
PER_BLOCK_KB = 8


@dataclass
class Case:
    """One input written by `make(dir)`, run with `args`; `line_mb`: its largest line, `read_mb`: the
    largest line the loader reads (a line over --max-line-bytes is not read)."""

    name: str
    line_mb: float
    make: Callable[[Path], None]
    read_mb: float | None = None
    args: list[str] = field(default_factory=list)
    blocks: int = 0  # blocks in the one message of a block case

    def bound_mb(self, budget_mb: float = BATCH_BUDGET_MB) -> float:
        return 4 * (self.line_mb if self.read_mb is None else self.read_mb) + budget_mb + \
            self.blocks * PER_BLOCK_KB / 1024


def tool_result_session(d: Path, mb: float, sid: str = "be000000-0000-4000-8000-000000000001") -> None:
    """A Claude Code session whose one tool result is `mb` MB of text (its line a little longer)."""
    from bench.make_hostile_inputs import cc_entry, dump

    u = f"{sid[:8]}"
    entries = [
        cc_entry(sid, f"{u}-u1", None, "user", "read the big file"),
        cc_entry(sid, f"{u}-a1", f"{u}-u1", "assistant", [{"type": "tool_use", "id": "toolu_1", "name": "Read",
                                                          "input": {"file_path": "/big.txt"}}]),
        cc_entry(sid, f"{u}-u2", f"{u}-a1", "user", [{"type": "tool_result", "tool_use_id": "toolu_1",
                                                     "content": "line of the big file\n" * int(mb * MB / 21)}]),
        cc_entry(sid, f"{u}-a2", f"{u}-u2", "assistant", [{"type": "text", "text": "that was big"}]),
    ]
    d.mkdir(parents=True, exist_ok=True)
    with open(d / f"{sid}.jsonl", "wb") as fh:
        fh.writelines(dump(e) + b"\n" for e in entries)


def zeros_file(d: Path, mb: float) -> None:
    """`truncate -s`: a sparse file of zeros named *.jsonl, one line without a line break."""
    d.mkdir(parents=True, exist_ok=True)
    with open(d / "zeros.jsonl", "wb") as fh:
        fh.truncate(int(mb * MB))


def line_cases(quick: bool = False) -> list[Case]:
    """Issue 23, item 6: one huge tool result of 20 / 50 / 200 MB, read (run with --max-line-bytes 256M:
    the default limit, 64 MiB, would quarantine the 200 MB line unread; `quick` leaves it out) and a
    sparse 1 GB file of zeros (over the line limit: quarantined, never read whole)."""
    cases = [Case(f"line {mb} MB", mb, lambda d, mb=mb: tool_result_session(d, mb), args=["--max-line-bytes", "256M"])
             for mb in (20, 50, 200) if not (quick and mb == 200)]
    cases.append(Case("zeros 1 GB, no line break", 1024, lambda d: zeros_file(d, 1024), read_mb=0))
    return cases


def blocks_session(d: Path, n: int) -> None:
    """A Claude Code session whose user message is `n` blocks `{"type": "text", "text": "x"}`."""
    from bench.sessiongen import BLOCKS_SESSION, many_blocks_lines

    d.mkdir(parents=True, exist_ok=True)
    (d / f"{BLOCKS_SESSION}.jsonl").write_text("\n".join(many_blocks_lines(n)) + "\n")


def block_cases() -> list[Case]:
    """Issue 23, item 5: one user message of 1,000 / 10,000 / 100,000 tiny text blocks (a line of
    31 bytes per block: 3 MB at 100,000)."""
    return [Case(f"{n:,} blocks in one message", n * 31 / MB, lambda d, n=n: blocks_session(d, n), blocks=n)
            for n in (1000, 10_000, 100_000)]


def peak_rss(args: list[str]) -> tuple[float, int, str]:
    """(peak RSS in MB, exit status, stderr's end) of `ctxreplay ARGS` in a fresh process, read with
    getrusage(RUSAGE_CHILDREN) in a wrapper whose only child it is."""
    wrapper = ("import json, resource, subprocess, sys\n"
               "r = subprocess.run([sys.executable, '-m', 'ctxreplay.pipeline.commands.cli', *sys.argv[1:]],"
               " stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)\n"
               "print(json.dumps([resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, r.returncode,"
               " r.stderr[-2000:]]))\n")
    out = subprocess.run([sys.executable, "-c", wrapper, *args], capture_output=True, text=True, cwd=ROOT,
                         check=True).stdout
    peak, rc, err = json.loads(out)
    return peak, rc, err


def run_cases(cases: list[Case], keep: Path | None = None) -> list[dict[str, object]]:
    rows = []
    for c in cases:
        tmp = Path(tempfile.mkdtemp(prefix="bench-memory-", dir=keep))
        try:
            c.make(tmp / "in")
            t0 = time.perf_counter()
            peak, rc, err = peak_rss(["run", str(tmp / "in"), "--out", str(tmp / "out"), "--jobs", "1", "-q",
                                      *c.args])
            secs = time.perf_counter() - t0
        finally:
            if keep is None:
                shutil.rmtree(tmp, ignore_errors=True)
        if rc != 0:
            print(f"{c.name}: exit {rc}: {err}", file=sys.stderr)
        bound = c.bound_mb()
        rows.append({"case": c.name, "line_mb": c.line_mb, "peak_mb": peak, "bound_mb": bound,
                     "ok": rc == 0 and peak <= bound, "seconds": secs})
        print(f"{c.name:<32} {c.line_mb:>9.0f} {peak:>12.0f} {bound:>9.0f}  {'yes' if rows[-1]['ok'] else 'NO'}"
              f"  ({secs:.0f} s)", flush=True)
    return rows


def rss_mib() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * 4096 / 2**20


def main() -> None:
    from ctxreplay.pipeline.batch.batches import DEFAULT_BATCH_BYTES

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tree", type=Path, nargs="?", help="a tree to run in this process, peak per phase (else: the cases)")
    ap.add_argument("--quick", action="store_true", help="cases: leave out the 200 MB line")
    ap.add_argument("--keep", type=Path, help="cases: write inputs and outputs under DIR, kept")
    ap.add_argument("--batch-bytes", type=int, default=DEFAULT_BATCH_BYTES)
    ap.add_argument("--preset", default="default")
    ap.add_argument("--out", type=Path, help="OUT to write (default: a temp dir, removed)")
    a = ap.parse_args()
    if a.tree is None:
        print(f"{'case':<32} {'line MB':>9} {'peak RSS MB':>12} {'bound MB':>9}  ok")
        rows = run_cases(line_cases(a.quick), a.keep)
        blocks = run_cases(block_cases(), a.keep)
        p = [float(r["peak_mb"]) for r in blocks]  # type: ignore[arg-type]
        print(f"blocks: growth 10k->100k / growth 1k->10k = {(p[2] - p[1]) / max(p[1] - p[0], 1.0):.1f} "
              f"(linear: about 10; quadratic: about 100)")
        sys.exit(0 if all(r["ok"] for r in rows + blocks) else 1)
    tree(a)


def tree(a: argparse.Namespace) -> None:
    from ctxreplay.pipeline.batch import runner
    from ctxreplay.pipeline.core import crashpoints
    from ctxreplay.pipeline.staging.spec import load_spec

    out = a.out or Path(tempfile.mkdtemp(prefix="bench-memory-")) / "out"
    batch = [0]
    peaks: dict[tuple[int, str], float] = {}
    after: list[float] = []
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            key = (batch[0], crashpoints._phase or "start")
            r = rss_mib()
            if r > peaks.get(key, 0.0):
                peaks[key] = r
            time.sleep(0.02)

    take = runner._take_batch

    def counted(*args, **kw):  # type: ignore[no-untyped-def]
        take(*args, **kw)
        after.append(rss_mib())
        batch[0] += 1

    runner._take_batch = counted  # type: ignore[assignment]
    store: list[object] = []
    simulate = runner._simulate

    def kept(totals, *args, **kw):  # type: ignore[no-untyped-def]
        store.append(totals.sim_store)
        return simulate(totals, *args, **kw)

    runner._simulate = kept  # type: ignore[assignment]
    threading.Thread(target=sample, daemon=True).start()
    t0 = time.perf_counter()
    try:
        res = runner.run([a.tree], load_spec(preset=a.preset),
                         runner.RunOptions(out_dir=out, jobs=1, batch_bytes=a.batch_bytes))
    finally:
        done.set()
        if a.out is None:
            shutil.rmtree(out.parent, ignore_errors=True)
    s = res.summary
    print(f"{a.tree}: {s['bytes'] / 1e6:.1f} MB, {s['groups']['batches']} batches of at most "
          f"{a.batch_bytes / 2**20:.0f} MiB, {s['calls']:,} calls, {time.perf_counter() - t0:.1f} s")
    by_phase: dict[str, float] = {}
    for (_, ph), v in peaks.items():
        by_phase[ph] = max(by_phase.get(ph, 0.0), v)
    print("peak RSS by phase (MiB): " + ", ".join(f"{k} {v:.0f}" for k, v in by_phase.items()))
    if after:
        print(f"RSS after each batch (MiB): first {after[0]:.0f}, last {after[-1]:.0f}, "
              f"max {max(after):.0f}")
    st = store[0] if store else None
    if st is not None:
        held = sum(len(d) for d in st.data if d)  # type: ignore[attr-defined]
        print(f"cache simulation's store: {len(st.sha):,} messages, {held / 2**20:.1f} MiB of message bytes held")  # type: ignore[attr-defined]
    print(f"peak RSS: {max(peaks.values()):.0f} MiB")


if __name__ == "__main__":
    main()
