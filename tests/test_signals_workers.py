"""Signals with worker processes (issue 23, item 8): `ctxreplay run --jobs 2` on a tree of several
batches, a signal sent while its workers start or run.

- Ctrl-C (SIGINT to the whole process group, as a terminal sends it): exit 130 with one paragraph,
  no worker KeyboardInterrupt traceback, no internal error (BrokenProcessPool, DuckDB's "Query
  interrupted", a polars panic), no process left;
- SIGTERM to the parent: exit 143 with one paragraph, no `leaked semaphore` warning, no process left;
- SIGKILL of the parent: its workers exit with it.

Each run is in a session of its own (its process group is the run's); every wait is bounded and
whatever is left of the group is killed at the end."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.crashkit import ctrl_c_as_in_a_terminal

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def _tree(tmp: Path) -> Path:
    tree = tmp / "tree"
    shutil.copytree(ROOT / "data" / "samples", tree / "samples")
    shutil.copytree(ROOT / "tests" / "fixtures" / "loaders", tree / "fixtures")
    return tree


def _group(pgid: int) -> list[int]:
    """The live (not zombie) processes of a process group."""
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
            out.append(int(d.name))
    return out


def _workers(pid: int) -> list[int]:
    """The children of `pid` that are multiprocessing workers (not its resource tracker)."""
    out = []
    for c in _group(pid):
        try:
            cmd = Path(f"/proc/{c}/cmdline").read_bytes()
            stat = Path(f"/proc/{c}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        if ppid == pid and b"spawn_main" in cmd and b"resource_tracker" not in cmd:
            out.append(c)
    return out


def _start(tree: Path, out: Path, hold: Path | None = None) -> subprocess.Popen[bytes]:
    """The run; with `hold`, the first stage of a process's first batch waits there for `hold`.go
    (pipeline/core/crashpoints.py), which the tests never create: a signal then finds a batch running."""
    exe = Path(sys.executable).with_name("ctxreplay")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "ctxreplay"]
    env = {**os.environ, "CTXREPLAY_HOLD_AT": "stage:1", "CTXREPLAY_HOLD_FILE": str(hold)} if hold else None
    with ctrl_c_as_in_a_terminal():
        return subprocess.Popen([*cmd, "run", str(tree), "--out", str(out), "--jobs", "2", "--batch-bytes", "1",
                             "--fast-tokens", "-q"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True, env=env)


def _wait_for_a_held_worker(p: subprocess.Popen[bytes], hold: Path, limit: float = 60.0) -> int:
    """The pid of the worker that holds in its batch (not the parent), once one does."""
    reached = Path(f"{hold}.reached")
    end = time.monotonic() + limit
    # (the file is made, then its pid written: an empty read is that moment, not a failure)
    while time.monotonic() < end and p.poll() is None and not (reached.exists() and reached.read_text()):
        time.sleep(0.02)
    assert reached.exists() and reached.read_text(), "no batch reached its first stage"
    pid = int(reached.read_text())
    assert pid in _workers(p.pid), (pid, p.pid)
    return pid


def _wait_for_workers(p: subprocess.Popen[bytes], limit: float = 60.0) -> bool:
    end = time.monotonic() + limit
    while time.monotonic() < end and p.poll() is None:
        if _workers(p.pid):
            return True
        time.sleep(0.02)
    return False


def _finish(p: subprocess.Popen[bytes], limit: float = 60.0) -> tuple[int | None, str, list[int]]:
    """Exit code, stderr and the processes of its group left 5 s after it exited; then none left."""
    try:
        rc: int | None = p.wait(timeout=limit)
        end = time.monotonic() + 5
        while _group(p.pid) and time.monotonic() < end:
            time.sleep(0.1)
        left = _group(p.pid)
    except subprocess.TimeoutExpired:
        rc, left = None, _group(p.pid)
    finally:
        if _group(p.pid):
            os.killpg(p.pid, signal.SIGKILL)
    os.set_blocking(p.stderr.fileno(), False)  # type: ignore[union-attr]
    err = (p.stderr.read() or b"").decode("utf-8", "replace")  # type: ignore[union-attr]
    p.stderr.close()  # type: ignore[union-attr]
    p.wait()
    return rc, err, left


def _one_paragraph(err: str) -> None:
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert "internal error" not in err and "leaked" not in err, err
    assert err.strip().count("\n\n") == 0 and err.startswith("ctxreplay: "), err


@pytest.mark.parametrize("after", [0.0, pytest.param(0.4, marks=pytest.mark.slow)])
def test_ctrl_c_with_workers_exits_130_in_one_paragraph(tmp_path: Path, after: float) -> None:
    """Ctrl-C as soon as the first worker is spawned (its start-up: imports, unpickling its state),
    and a little later."""
    tree = _tree(tmp_path)
    p = _start(tree, tmp_path / "o")
    try:
        assert _wait_for_workers(p), "no worker started"
        time.sleep(after)
        os.killpg(p.pid, signal.SIGINT)
    finally:
        rc, err, left = _finish(p)
    if rc == 0:  # the run was over before the signal: nothing to check
        pytest.skip("the run ended before Ctrl-C")
    assert rc == 130, err
    _one_paragraph(err)
    assert "interrupted" in err
    assert not left


@pytest.mark.parametrize(("to_group", "sig", "code", "word"), [
    (True, signal.SIGINT, 130, "interrupted"),  # Ctrl-C: the terminal signals the whole process group
    (False, signal.SIGTERM, 143, "terminated"),  # SIGTERM to the parent alone (no `leaked semaphore` warning)
], ids=["ctrl_c", "sigterm"])
def test_a_signal_while_a_worker_runs_a_batch_exits_in_one_paragraph(tmp_path: Path, to_group: bool, sig: int,
                                                                      code: int, word: str) -> None:
    """The signal while a worker is inside a batch (held at its first stage: on a fast machine the
    whole run was over before a signal sent 1-1.5 s after the workers started, and the test skipped)."""
    tree, hold = _tree(tmp_path), tmp_path / "hold"
    p = _start(tree, tmp_path / "o", hold)
    try:
        _wait_for_a_held_worker(p, hold)
        (os.killpg if to_group else os.kill)(p.pid, sig)
    finally:
        rc, err, left = _finish(p)
    assert rc == code, err
    _one_paragraph(err)
    assert word in err
    assert not left


@pytest.mark.parametrize("in_batch", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_workers_exit_when_the_parent_is_killed(tmp_path: Path, in_batch: bool) -> None:
    """SIGKILL of the parent as soon as a worker is spawned, and while a worker is inside a batch
    (held at its first stage: a kill 1 s after the workers started found the run over, exit 0, on
    an idle 2-core machine)."""
    tree, hold = _tree(tmp_path), tmp_path / "hold"
    p = _start(tree, tmp_path / "o", hold if in_batch else None)
    try:
        if in_batch:
            _wait_for_a_held_worker(p, hold)
        else:
            assert _wait_for_workers(p), "no worker started"
        workers = _workers(p.pid)
        os.kill(p.pid, signal.SIGKILL)
    finally:
        rc, _err, left = _finish(p, limit=10)
    assert rc == -signal.SIGKILL
    assert workers and not [w for w in workers if w in left], left
    assert not left, left


def test_the_workers_state_goes_through_a_file_and_the_spawn_pipe_stays_small(tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The state a worker is started with (the pipeline, earlier decisions, the token cache:
    megabytes on a large tree) travels in a file of the run's staging directory, so that what the
    spawn writes into the worker's pipe fits in it at once: a parent killed while it was still
    writing left the worker a truncated pickle and a traceback (bench_signals, 50 MB tree, 1 trial
    in 20). The file is gone once the pool is, and never published."""
    import concurrent.futures
    import pickle

    from ctxreplay.pipeline.batch import workerboot
    from ctxreplay.pipeline.batch.runner import RunOptions, run
    from ctxreplay.pipeline.core.tokens import CHARS4_COUNTER
    from ctxreplay.pipeline.staging.spec import load_spec

    seen: list[tuple[object, ...]] = []
    pool = concurrent.futures.ProcessPoolExecutor  # (workers.py imports it when it starts a pool)

    def recording(*args: object, **kw: object) -> object:
        seen.append(tuple(kw["initargs"]))  # type: ignore[arg-type]
        return pool(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor", recording)
    written: list[str] = []
    write = workerboot.write_state
    monkeypatch.setattr(workerboot, "write_state", lambda d, b: written.append(write(d, b)) or written[-1])
    out = tmp_path / "out"
    s = run([ROOT / "data" / "samples", ROOT / "tests" / "fixtures" / "loaders"], load_spec(preset="default"),
            RunOptions(out_dir=out, token_counter=CHARS4_COUNTER, jobs=2, batch_bytes=20_000)).summary
    assert s["groups"]["batches"] > 3 and len(seen) == 1 and len(written) == 1
    _init, state, parent = seen[0]
    assert state == written[0] and isinstance(state, str) and parent == os.getpid()
    assert len(pickle.dumps(seen[0])) < 4096  # the pipe takes it whole (a pipe holds 64 KiB)
    assert not Path(written[0]).exists()
    assert not [p for p in out.rglob("*") if p.name == workerboot.STATE_FILE]


def test_boot_reads_the_state_from_bytes_or_from_its_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import pickle
    import types

    from ctxreplay.pipeline.batch import workerboot

    got: list[object] = []
    mod = types.ModuleType("ctxreplay_test_boot_target")
    mod.init = got.append  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    monkeypatch.setattr(workerboot.signal, "signal", lambda *a: None)  # keep this process's Ctrl-C
    path = workerboot.write_state(tmp_path, pickle.dumps({"a": 1}))
    workerboot.boot(f"{mod.__name__}:init", path)
    workerboot.boot(f"{mod.__name__}:init", pickle.dumps([2]))
    assert got == [{"a": 1}, [2]]


@pytest.mark.skipif(not hasattr(signal, "pthread_kill"), reason="pthread_kill")
def test_a_ctrl_c_another_thread_takes_while_workers_spawn_is_raised_after_the_spawn() -> None:
    """The kernel may hand a Ctrl-C to any thread that does not block it (polars', the pool's);
    Python then raised KeyboardInterrupt in the main thread inside the pool's `submit`, holding its
    lock (the shutdown that followed waited for it for good: a run hung) or cutting a worker's
    start-up data (its `EOFError` traceback). It is raised once the spawn is over."""
    import threading

    from ctxreplay.pipeline.batch.workers import _sigint_blocked

    go = threading.Event()
    other = threading.Thread(target=go.wait, daemon=True)
    other.start()  # started before the block: SIGINT is not blocked there
    reached = []
    with ctrl_c_as_in_a_terminal():  # (a suite started from a shell's background job inherits SIGINT ignored)
        with pytest.raises(KeyboardInterrupt), _sigint_blocked():
            assert other.ident is not None
            signal.pthread_kill(other.ident, signal.SIGINT)
            for _ in range(50):
                time.sleep(0.002)  # Python would run its handler here
            reached.append(True)
        go.set()
        assert reached == [True]
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_pool_whose_worker_died_mid_result_is_noted_stuck_and_the_command_line_exits(tmp_path: Path) -> None:
    """A worker killed while writing its result leaves the message cut in the result pipe, whose
    write end the parent holds too: the pool's thread waits for the rest for good and Python's exit
    joined it (a Ctrl-C in 10-20 hung the run, bench_signals on a 50 MB tree). `_stop` notes such a
    thread (workerboot.STUCK) within its bounded wait, and the entry point then ends the process
    with the command's status once the command is done."""
    script = (
        "import multiprocessing, os, sys, time\n"
        "from concurrent.futures import ProcessPoolExecutor\n"
        "from ctxreplay.pipeline.batch import workerboot, workers\n"
        "from tests import poolkit\n"
        "if __name__ == '__main__':\n"
        "    ex = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context('spawn'))\n"
        "    ex.submit(poolkit.die_mid_result)\n"
        "    time.sleep(3)\n"
        "    t0 = time.monotonic()\n"
        "    workers._stop(ex)\n"
        "    print(len(workerboot.STUCK), all(t.is_alive() for t in workerboot.STUCK), round(time.monotonic() - t0), flush=True)\n"
        "    os._exit(0)\n")
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    stuck, alive, took = r.stdout.split()
    assert (stuck, alive) == ("1", "True") and int(took) <= 10, r.stderr
    # the entry point: a command that leaves such a thread ends with its status, not in Python's join
    main = (
        "import sys, threading\n"
        "from ctxreplay import entry\n"
        "from ctxreplay.pipeline.batch import workerboot\n"
        "import ctxreplay.pipeline.commands.cli as cli\n"
        "def command():\n"
        "    t = threading.Thread(target=threading.Event().wait)\n"
        "    t.start()\n"
        "    workerboot.STUCK.append(t)\n"
        "    print('interrupted', file=sys.stderr)\n"
        "    raise SystemExit(130)\n"
        "cli.main = command\n"
        "entry.main()\n")
    r = subprocess.run([sys.executable, "-c", main], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert (r.returncode, r.stderr.strip()) == (130, "interrupted")
