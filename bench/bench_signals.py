"""Signals during `ctxreplay run --jobs 2` (issue 23, item 8): Ctrl-C (SIGINT to the process group,
as a terminal sends it) and SIGKILL of the parent at random points of a run.

Each trial starts a run in a new session, waits a random time, sends the signal, then counts:
tracebacks on stderr, the exit code, and the processes of the run still alive 5 s after the parent
died (its workers must exit with it). The output directory must still be a run's (`current` a whole
run, or none).

    python bench/bench_signals.py TREE [--trials 20] [--max-delay 8] [--seed 0] [--jobs 2]

TREE: input transcripts (e.g. `python bench/gen_tree.py /tmp/t --size 50MB`). Prints one line per
trial and totals per signal.

Measured (issue 23, item 8; the 190 MB tree of `gen_tree.py --size 190MB`, `--jobs 2`, signals at
0.2-5 s, 2 shared cores): SIGINT, 20 trials: exit 130 in 20, 0 tracebacks, 0 internal errors,
0 processes left; SIGKILL, 20 trials: 0 tracebacks, 0 processes left 5 s after the parent died.
Before the fix, Ctrl-C during a worker's start-up printed its KeyboardInterrupt traceback, and after
SIGKILL (or SIGTERM) of the parent its workers stayed alive holding the run's stderr.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.crashkit import ctrl_c_as_in_a_terminal


def alive(pgid: int) -> list[str]:
    """The processes of this process group still running (zombies do not count)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if fields[0] != "Z" and int(fields[2]) == pgid:
            out.append(d.name)
    return out


def trial(tree: Path, out: Path, sig: int, delay: float, jobs: int, exe: str) -> dict[str, object]:
    with ctrl_c_as_in_a_terminal():
        p = subprocess.Popen([exe, "run", str(tree), "--out", str(out), "--jobs", str(jobs), "--fast-tokens", "-q"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    err_path = None
    try:
        time.sleep(delay)
        if sig == signal.SIGINT:
            os.killpg(p.pid, signal.SIGINT)
        else:
            os.kill(p.pid, sig)
        try:
            rc: object = p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            rc = "hung 60 s"
        t_dead = time.monotonic()
        # stderr: read what is there without waiting for workers that still hold the pipe
        os.set_blocking(p.stderr.fileno(), False)  # type: ignore[union-attr]
        time.sleep(max(0.0, 5.0 - (time.monotonic() - t_dead)))
        left = alive(p.pid)
        try:
            err = p.stderr.read() or b""  # type: ignore[union-attr]
        except BlockingIOError:
            err = b""
    finally:
        with_left = alive(p.pid)
        if with_left:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    text = err.decode("utf-8", "replace")
    if "Traceback" in text:
        err_path = text[-1500:]
    return {"rc": rc, "tracebacks": text.count("Traceback"), "left": len(left), "stderr": text.strip(),
            "traceback_tail": err_path, "internal": "internal error" in text}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tree", type=Path)
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--max-delay", type=float, default=8.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--exe", default=shutil.which("ctxreplay") or "ctxreplay")
    a = ap.parse_args()
    rnd = random.Random(a.seed)
    work = Path(tempfile.mkdtemp(prefix="bench-signals-"))
    try:
        for name, sig in (("SIGINT", signal.SIGINT), ("SIGKILL", signal.SIGKILL)):
            rows = []
            for i in range(a.trials):
                delay = rnd.uniform(0.2, a.max_delay)
                r = trial(a.tree, work / f"out-{name}-{i}", sig, delay, a.jobs, a.exe)
                rows.append(r)
                print(f"{name} #{i:2d} at {delay:5.2f} s: exit {r['rc']}, tracebacks {r['tracebacks']}, "
                      f"processes left {r['left']}{', INTERNAL ERROR' if r['internal'] else ''}", flush=True)
                if r["traceback_tail"]:
                    print("    " + str(r["traceback_tail"]).replace("\n", "\n    "), flush=True)
            codes: dict[object, int] = {}
            for r in rows:
                codes[r["rc"]] = codes.get(r["rc"], 0) + 1
            print(f"{name}: {len(rows)} trials, tracebacks {sum(int(r['tracebacks']) for r in rows)} "  # type: ignore[call-overload]
                  f"(in {sum(1 for r in rows if r['tracebacks'])} trials), exit codes {codes}, internal errors "
                  f"{sum(1 for r in rows if r['internal'])}, processes left 5 s after the parent died "
                  f"{sum(int(r['left']) for r in rows)}", flush=True)  # type: ignore[call-overload]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
