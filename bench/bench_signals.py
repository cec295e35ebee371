"""Signals during `ctxreplay run --jobs 2` (issue 23, item 8): Ctrl-C (SIGINT to the process group,
as a terminal sends it) and SIGKILL of the parent at random points of a run.

Each trial starts a run in a new session, waits a random time, sends the signal, then counts:
tracebacks on stderr, the exit code, and the processes of the run still alive 5 s after the parent
died (its workers must exit with it). Then it checks that what the run left is consistent, as
docs/running.md promises ("DIR shows either the complete previous run or the complete new one, never
a mix, and the ledger is as it was before the run or after it"):

- OUT: `current` is absent (no run published: the first run of a fresh OUT was stopped) or names a
  whole run: summary.json, the parquet files' run id and every link agree (tests/crashkit.py
  out_state), every parquet file of the run reads, each file the run's manifest lists has the row
  groups the manifest gives it, and OUT/.ctxreplay-out.json lists the published run, every link in
  OUT and every staging directory under .runs/ (so that the next run may remove them). The run
  shown is the previous complete one or the new one;
- the ledger opens (a WAL a kill left is replayed) and holds the runs it held before, or those and
  this run (one row more, the run id `current` names when that run was published);
- a re-run with the same arguments exits 0, leaves no staging directory or temp file, and its
  calls.parquet has the request hashes of a clean run of the same tree (made once, first).

Odd trials start from a copy of that clean run (the "previous complete output"; the copy's ledger
path differs from the manifest's, so the run does all its work again), even ones from a fresh OUT.

    python bench/bench_signals.py TREE [--trials 20] [--max-delay S] [--seed 0] [--jobs 2] [--batch-bytes N]

TREE: input transcripts (e.g. `python bench/gen_tree.py /tmp/t --size 50MB`). --max-delay defaults
to 0.8 times the clean run's duration. Prints one line per trial, totals per signal, and counts per kind of
outcome.

Measured (issue 23, item 8; the 190 MB tree of `gen_tree.py --size 190MB`, `--jobs 2`, signals at
0.2-5 s, 2 shared cores): SIGINT, 20 trials: exit 130 in 20, 0 tracebacks, 0 internal errors,
0 processes left; SIGKILL, 20 trials: 0 tracebacks, 0 processes left 5 s after the parent died.
Before the fix, Ctrl-C during a worker's start-up printed its KeyboardInterrupt traceback, and after
SIGKILL (or SIGTERM) of the parent its workers stayed alive holding the run's stderr.

With the consistency checks (data/samples + tests/fixtures/loaders, 57 calls, `--batch-bytes 1
--trials 5 --seed 1`, 2 shared cores at a load of ~15, a clean run 8-24 s): SIGINT, 5 trials: exit
130 in 4, 0 in 1 (finished first), 0 tracebacks, 0 left; OUT none 3 / previous 1 / new 1, ledger
absent 1 / as before 3 / one run more 1; SIGKILL, 5 trials: 0 left; OUT none 3 / previous 2, ledger
absent 1 / as before 4; every re-run exit 0 with the clean run's request hashes: 0 inconsistent
states. The first such run found a SIGABRT with a traceback (a Ctrl-C inside DuckDB's lazy import,
since deferred: pipeline/commands/cli.py) and, once, exit -2: a Ctrl-C while Python was exiting
after the run had published (its handlers are the default by then; a shell shows 130).

Issue 23's acceptance, 2026-12-03 (`gen_tree.py --copies 1`: 16.5 MB, 900 calls; `--jobs 2 --trials 20
--seed 0`; a clean run 22.8 s at a load of 13-22 on the 2 shared cores, signals at 0.2-18.2 s):
SIGINT, 20 trials: exit 130 in 12, 0 in 5 (the run had finished), -2 in 3, 0 tracebacks, 0 internal
errors, 0 processes left; OUT none 5 / previous 7 / new 8, ledger absent 1 / as before 11 / one run
more 8. SIGKILL, 20 trials: exit -9 in 18, 0 in 2, 0 tracebacks, 0 processes left 5 s after the
parent died; OUT none 9 / previous 9 / new 2, ledger absent 6 / as before 11 / one run more 3. Every
re-run exit 0 with the clean run's request hashes: 0 inconsistent states. The three -2 were each a
Ctrl-C while Python tore down after a finished, published run; the entry point now ignores Ctrl-C once
the command has returned (ctxreplay/entry.py; tests/test_startup_sigint.py).

2026-12-04, the same 16.5 MB tree (`--seed 0`, clean run 8.0 s, signals at 0.2-6.4 s): SIGINT exit
130 in 13, 0 in 7; SIGKILL -9 in 6, 0 in 14; 0 tracebacks, 0 left, 0 inconsistent. Runs that short
mostly end before the signal, so the 50 MB tree of `gen_tree.py --size 50MB` (2,944 calls, a clean
run 3.8-7 s) was tried too, and found four defects, each in 1 or 2 trials of 20: a Ctrl-C hung the
run (py-spy: Python's exit joining the pool's thread, blocked reading a result a killed worker had
cut; and, once, KeyboardInterrupt raised inside the pool's submit, which holds its lock); a SIGKILL
left a worker's `UnpicklingError: pickle data was truncated` (its state came through the spawn's
pipe) and a Ctrl-C a worker's `EOFError`; a Ctrl-C while a new OUT's record was written left only
its temp file, and the next run refused OUT. Fixed in pipeline/batch/workers.py, workerboot.py,
ctxreplay/entry.py and pipeline/core/outdir.py (tests/test_signals_workers.py,
tests/test_foreign_outputs.py). After the fixes (`--seed 4`, clean run 4.7 s,
signals at 0.2-3.8 s, all mid-run): SIGINT, 20 trials: exit 130 in 20, 0 tracebacks, 0 internal
errors, 0 left; OUT none 10 / previous 10, ledger absent 1 / as before 19. SIGKILL, 20 trials: exit
-9 in 20, 0 tracebacks, 0 left 5 s after the parent died; OUT none 10 / previous 10, ledger as
before 20. Every re-run exit 0 with the clean run's request hashes: 0 inconsistent states.
"""

from __future__ import annotations

import argparse
import json
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

from tests.crashkit import ctrl_c_as_in_a_terminal, ledger_state, leftovers, out_state


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


def command(tree: Path, out: Path, a: argparse.Namespace) -> list[str]:
    cmd = [a.exe, "run", str(tree), "--out", str(out), "--jobs", str(a.jobs), "--fast-tokens", "-q"]
    return cmd + (["--batch-bytes", str(a.batch_bytes)] if a.batch_bytes else [])


def trial(cmd: list[str], sig: int, delay: float) -> dict[str, object]:
    with ctrl_c_as_in_a_terminal():
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
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


def ledger_runs(path: Path) -> list[tuple] | None:
    """The ledger's runs (seq, spec, counts, run id), opened as a run opens it; None when absent."""
    if not path.exists():
        return None
    ledger_state(path)  # opens it read-write (a WAL is replayed) and reads every table
    from ctxreplay.pipeline.core.duck import connect  # closed again: a read-only look at its run ids

    con = connect(str(path), read_only=True)
    try:
        return [tuple(r) for r in con.execute("SELECT run_seq, spec_sha256, counts, run_id FROM runs "
                                              "ORDER BY run_seq").fetchall()]
    finally:
        con.close()


def out_kind(out: Path, previous: str | None) -> str:
    """What OUT shows after a stopped run: 'none' (no run published), 'previous' or 'new' (a whole
    run); raises AssertionError on anything else."""
    import pyarrow.parquet as pq

    if not out.exists():
        return "none"  # stopped before it made OUT
    record = json.loads((out / ".ctxreplay-out.json").read_text()) if (out / ".ctxreplay-out.json").exists() else None
    assert record is None or record.get("format") == "ctxreplay-out", f"{out}/.ctxreplay-out.json is not ours"
    runs_dir = out / ".runs"
    staged = sorted(d.name for d in runs_dir.iterdir()) if runs_dir.is_dir() else []
    if staged:
        assert record is not None, "staging directories and no record of them"
        unlisted = sorted(set(staged) - set(record["runs"]))
        assert not unlisted, f"staging directories not in the record (the next run could not remove them): {unlisted}"
    if not os.path.lexists(out / "current"):
        shown = [p.name for p in out.iterdir() if p.is_symlink() and p.exists()]
        assert not shown, f"no current run, yet {shown} resolve"
        return "none"
    state = out_state(out)  # summary, parquet run ids and links agree; every file of the run has its link
    run_dir = Path(os.path.realpath(out / "current"))
    assert record is not None and state.run_id in record["runs"], "the published run is not in the record"
    links = [p.name for p in out.iterdir() if p.is_symlink() and p.name != "current"]
    assert not set(links) - set(record["links"]), f"links not in the record: {set(links) - set(record['links'])}"
    for f in run_dir.rglob("*.parquet"):
        pq.read_table(f)  # every parquet file reads whole
    manifest = json.loads((run_dir / "manifest.json").read_text())
    for name, batches in (manifest.get("row_groups") or {}).items():
        got = pq.ParquetFile(run_dir / name).metadata.num_row_groups
        assert got == len(batches), f"{name}: {got} row groups, the manifest lists {len(batches)}"
    return "previous" if state.run_id == previous else "new"


def check(out: Path, ledger_before: list[tuple] | None, previous: str | None, cmd: list[str],
          clean_calls: list[tuple]) -> dict[str, str]:
    """The kinds of what a stopped run left (see the module docstring), or 'INCONSISTENT: why'."""
    res: dict[str, str] = {}
    try:
        res["out"] = out_kind(out, previous)
    except Exception as exc:  # noqa: BLE001 - a bench: the failure is what it reports
        res["out"] = f"INCONSISTENT: {type(exc).__name__}: {exc}"
    try:
        after = ledger_runs(out / "ledger.duckdb")
        before = ledger_before or []
        if after is None:
            assert ledger_before is None, "the ledger is gone"
            res["ledger"] = "absent"
        elif after == before:
            res["ledger"] = "as before"
        else:
            assert after[:len(before)] == before and len(after) == len(before) + 1, \
                f"runs before {[r[0] for r in before]}, after {[r[0] for r in after]}"
            if res["out"] == "new":
                assert after[-1][3] == Path(os.path.realpath(out / "current")).name, "published run not in the ledger"
            res["ledger"] = "one run more"
    except Exception as exc:  # noqa: BLE001
        res["ledger"] = f"INCONSISTENT: {type(exc).__name__}: {exc}"
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
        assert r.returncode == 0, f"the re-run exited {r.returncode}: {r.stderr.strip()[-500:]}"
        state = out_state(out)
        left = leftovers(out, state.run_id)
        assert not left, f"left after the re-run: {left}"
        got = sorted((c[0], c[1], c[2], c[3]) for c in state.calls)
        assert got == clean_calls, f"request hashes differ from a clean run's ({len(got)} vs {len(clean_calls)} calls)"
        res["rerun"] = "same hashes"
    except Exception as exc:  # noqa: BLE001
        res["rerun"] = f"INCONSISTENT: {type(exc).__name__}: {exc}"
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tree", type=Path)
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--max-delay", type=float, help="latest signal, in seconds (default: a clean run's duration)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--batch-bytes", type=int, help="passed to the runs (small: several batches, more workers' work)")
    ap.add_argument("--exe", default=shutil.which("ctxreplay") or "ctxreplay")
    a = ap.parse_args()
    rnd = random.Random(a.seed)
    work = Path(tempfile.mkdtemp(prefix="bench-signals-"))
    inconsistent = 0
    try:
        clean = work / "clean"
        t0 = time.monotonic()
        r = subprocess.run(command(a.tree, clean, a), capture_output=True, text=True, check=False)
        took = time.monotonic() - t0
        if r.returncode != 0:
            print(f"the clean run failed (exit {r.returncode}): {r.stderr.strip()}", file=sys.stderr)
            return 2
        clean_state = out_state(clean)
        clean_calls = sorted((c[0], c[1], c[2], c[3]) for c in clean_state.calls)
        max_delay = a.max_delay or 0.8 * took  # a loaded machine runs slower or faster: most signals land mid-run
        print(f"clean run: {took:.1f} s, {len(clean_calls)} calls; signals at 0.2-{max_delay:.1f} s", flush=True)
        kinds: dict[str, dict[str, int]] = {}
        for name, sig in (("SIGINT", signal.SIGINT), ("SIGKILL", signal.SIGKILL)):
            rows = []
            for i in range(a.trials):
                delay = rnd.uniform(0.2, max_delay)
                out = work / f"out-{name}-{i}"
                previous = None
                if i % 2:
                    shutil.copytree(clean, out, symlinks=True)
                    previous = clean_state.run_id
                before = ledger_runs(out / "ledger.duckdb")
                cmd = command(a.tree, out, a)
                r = trial(cmd, sig, delay)
                c = check(out, before, previous, cmd, clean_calls)
                rows.append(r)
                for k, v in c.items():
                    label = v if not v.startswith("INCONSISTENT") else "INCONSISTENT"
                    kinds.setdefault(f"{name} {k}", {}).setdefault(label, 0)
                    kinds[f"{name} {k}"][label] += 1
                    inconsistent += label == "INCONSISTENT"
                print(f"{name} #{i:2d} at {delay:5.2f} s{' (from a previous run)' if previous else ''}: exit {r['rc']}, "
                      f"tracebacks {r['tracebacks']}, processes left {r['left']}"
                      f"{', INTERNAL ERROR' if r['internal'] else ''}; out {c['out']}, ledger {c['ledger']}, "
                      f"re-run {c['rerun']}", flush=True)
                if r["traceback_tail"]:
                    print("    " + str(r["traceback_tail"]).replace("\n", "\n    "), flush=True)
                shutil.rmtree(out, ignore_errors=True)
            codes: dict[object, int] = {}
            for r in rows:
                codes[r["rc"]] = codes.get(r["rc"], 0) + 1
            # -2 (killed by SIGINT, which a shell shows as 130): the Ctrl-C came while Python was exiting,
            # after the run had published (its signal handlers are back to the default there); 0: the
            # run had finished before the signal
            print(f"{name}: {len(rows)} trials, tracebacks {sum(int(r['tracebacks']) for r in rows)} "  # type: ignore[call-overload]
                  f"(in {sum(1 for r in rows if r['tracebacks'])} trials), exit codes {codes}, internal errors "
                  f"{sum(1 for r in rows if r['internal'])}, processes left 5 s after the parent died "
                  f"{sum(int(r['left']) for r in rows)}", flush=True)  # type: ignore[call-overload]
        for k, counts in kinds.items():
            print(f"{k}: " + ", ".join(f"{v} {n}" for v, n in sorted(counts.items())), flush=True)
        print(f"inconsistent states: {inconsistent}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if inconsistent else 0


if __name__ == "__main__":
    sys.exit(main())
