"""Batches across processes (`ctxreplay run --jobs N`, issue 10 point 5).

The parent owns the ledger and the output writers. Before the workers start (spawned, not forked:
polars' and DuckDB's threads do not survive a fork), it reads what they need from the ledger and
hands it to each worker once: the spec, every earlier decision of this pipeline's namespace and
the token cache of this counter. Each worker
runs `run_batch` on the batches it is given (writing only its threads' requests/), and returns the
BatchResult with the token counts it made; the parent takes the results in batch order (at most
`jobs + 1` batches in flight, so memory stays bounded), so the ledger's sequence numbers and every
output are those of `--jobs 1`.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import polars as pl

from ctxreplay.pipeline.batch import workerboot
from ctxreplay.pipeline.batch.batches import Group
from ctxreplay.pipeline.batch.batchrun import BatchCounter, BatchResult, Env, run_batch
from ctxreplay.pipeline.loaders.inputs import MAX_LINE_BYTES

if TYPE_CHECKING:
    from concurrent.futures import ProcessPoolExecutor

Job = tuple[int, list[Group]]

_ENV: Env | None = None  # a worker's Env (see init)


def default_jobs() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


class SnapshotCache:
    """The ledger's token cache as the workers see it: a read-only snapshot, plus what they count."""

    def __init__(self, counts: dict[str, int]) -> None:
        self.counts = counts
        self.new: dict[str, int] = {}

    def cached_tokens(self, counter: str, shas: list[str]) -> dict[str, int]:
        return {s: self.counts[s] for s in shas if s in self.counts}

    def store_tokens(self, counter: str, counts: dict[str, int]) -> None:
        self.new.update(counts)


@contextlib.contextmanager
def _sigint_blocked() -> Iterator[None]:
    """Ctrl-C held back while workers are spawned (issue 23, item 8), in two ways.

    - The signal is blocked in this thread: a spawned process inherits the mask, so a Ctrl-C during
      its start-up (importing, unpickling its state) stays pending there until `workerboot.boot`
      ignores it, instead of a KeyboardInterrupt traceback.
    - Python's handler only notes it: blocking it here does not keep the kernel from handing the
      signal to another of this process's threads (polars', the pool's), and Python then raises
      KeyboardInterrupt in this thread all the same, inside `submit`, which holds the pool's lock
      and may be writing a worker's start-up data: the pool's shutdown then waited for that lock
      for good (1 Ctrl-C in 20 hung a run, bench_signals on a 50 MB tree) and the worker read a
      cut pipe (`EOFError: Ran out of input`, its traceback).

    The Ctrl-C is delivered when both are restored: deferred, not lost."""
    if not hasattr(signal, "pthread_sigmask") or threading.current_thread() is not threading.main_thread():
        yield
        return
    noted: list[int] = []
    handler = signal.getsignal(signal.SIGINT)
    deferring = callable(handler)
    if deferring:
        signal.signal(signal.SIGINT, lambda signum, frame: noted.append(signum))
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
        if deferring:
            signal.signal(signal.SIGINT, handler)
            if noted:
                handler(signal.SIGINT, None)  # type: ignore[operator]


def init(state: tuple[Any, ...]) -> None:
    """A worker's Env, from the state the parent handed it (called by workerboot.boot, once the
    worker ignores Ctrl-C and dies with its parent)."""
    global _ENV
    spec, target, staging, out_dir, all_calls, validate, earlier, counter_name, tokens, max_line, profile = state
    MAX_LINE_BYTES.set(max_line)  # the command's --max-line-bytes (a context variable does not cross processes)

    def earlier_of(s: list[str]) -> pl.DataFrame:
        return earlier.filter(pl.col("session_id").is_in(s))

    _ENV = Env(spec, target, staging, out_dir, all_calls, validate, earlier_of,
               BatchCounter(counter_name, SnapshotCache(tokens)), None, profile)


def _work(job: Job) -> tuple[BatchResult, dict[str, int], int, int]:
    env = _ENV
    assert env is not None and isinstance(env.counter, BatchCounter)
    counter = env.counter
    before = (counter.counted, counter.cache_hits)
    result = run_batch(job[0], job[1], env)
    cache = counter.cache
    new, cache.new = cache.new, {}
    return result, new, counter.counted - before[0], counter.cache_hits - before[1]


def worker_state(env: Env, ledger: Any) -> tuple[Any, ...] | None:
    """What the workers need, read from the ledger once, here; None when the pipeline cannot go
    to another process (a stage that does not pickle: it runs here then)."""
    try:
        pickle.dumps(env.spec)
    except Exception:  # noqa: BLE001 - any pickling failure means: run in this process
        return None
    sha = env.spec.sha256
    sessions = [r[0] for r in ledger.con.execute(
        "SELECT DISTINCT session_id FROM decisions WHERE spec_sha256 = ?", [sha]).fetchall()]
    earlier = ledger.earlier_all(sha, sessions)
    tokens = dict(ledger.con.execute("SELECT sha256, tokens FROM token_cache WHERE counter = ?",
                                     [env.counter.name]).fetchall())
    return (env.spec, env.target, env.staging, env.out_dir, env.all_calls, env.validate, earlier,
            env.counter.name, tokens, MAX_LINE_BYTES.get(), env.profile)


def batch_results(jobs: list[Job], env: Env, n_jobs: int, ledger: Any) -> Iterator[BatchResult]:
    """run_batch over the jobs, results in job order: here, or in `n_jobs` worker processes."""
    state = worker_state(env, ledger) if n_jobs > 1 and len(jobs) > 1 else None
    if state is None:
        for index, groups in jobs:
            yield run_batch(index, groups, env)
        return
    # imported here: a run in this process (--jobs 1, a warm re-run) never needs them (~20 ms)
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    ctx = multiprocessing.get_context("spawn")
    # the state goes pickled: unpickling it imports the heavy modules, which the worker does only
    # after workerboot has bound it to this process (a parent killed meanwhile takes it along). It
    # goes through a file of the run's staging directory, not through the spawn's pipe: the token
    # cache makes it megabytes, more than a pipe holds, and a parent killed while it was still
    # writing them left the worker a truncated pickle and a traceback (bench_signals, 50 MB tree)
    state_file = workerboot.write_state(env.staging, pickle.dumps(state))
    ex = ProcessPoolExecutor(min(n_jobs, len(jobs)), mp_context=ctx, initializer=workerboot.boot,
                             initargs=(f"{__name__}:init", state_file, os.getpid()))
    finished = False
    try:
        pending: list[Future[Any]] = []
        todo = iter(jobs)
        for job in todo:
            with _sigint_blocked():  # submit spawns a worker while there are fewer than n_jobs
                pending.append(ex.submit(_work, job))
            if len(pending) > n_jobs:
                break
        while pending:
            result, new, counted, hits = pending.pop(0).result()
            nxt = next(todo, None)
            if nxt is not None:
                with _sigint_blocked():
                    pending.append(ex.submit(_work, nxt))
            take_counts(env, ledger, new, counted, hits)
            yield result
        finished = True
    finally:
        try:
            if finished:
                ex.shutdown(wait=True)
            else:
                _stop(ex)
        finally:
            with contextlib.suppress(OSError):
                os.unlink(state_file)


def _stop(ex: ProcessPoolExecutor) -> None:
    """The pool ended before its batches did (Ctrl-C, SIGTERM, an error, the run's generator closed):
    its workers killed (their batches are of no use now, and nothing of theirs is shared) rather
    than waited for, then the pool shut down, which frees its queues and their semaphores (no
    `leaked semaphore` warning)."""
    procs = list((getattr(ex, "_processes", None) or {}).values())
    manager = getattr(ex, "_executor_manager_thread", None)  # (shutdown forgets it)
    ex.shutdown(wait=False, cancel_futures=True)
    for p in procs:
        with contextlib.suppress(Exception):
            p.kill()
    for p in procs:
        with contextlib.suppress(Exception):
            p.join(5)
    # the jobs still queued for the killed workers may fill the call queue's pipe, whose read end
    # this process holds too: its feeder thread would then block for good, and with it the pool's
    # shutdown and the interpreter's exit (one Ctrl-C in 20 hung a run 60 s). Nothing reads them now.
    with contextlib.suppress(Exception):
        ex._call_queue.cancel_join_thread()  # type: ignore[attr-defined]
    done = threading.Thread(target=_shutdown_quietly, args=(ex,), name="ctxreplay-pool-shutdown", daemon=True)
    done.start()
    done.join(STOP_WAIT_S)
    # a worker killed while writing its result leaves the message cut in the result pipe (this
    # process holds its write end too): the pool's thread waits for the rest for good, and Python's
    # exit would join it (1 Ctrl-C in 10-20 hung a run, bench_signals on a 50 MB tree). The command
    # line then ends the process once the command is done (workerboot.STUCK)
    if manager is not None and manager.is_alive():
        workerboot.STUCK.append(manager)


STOP_WAIT_S = 3.0  # the pool's own shutdown after its workers were killed: well under a second


def _shutdown_quietly(ex: ProcessPoolExecutor) -> None:
    with contextlib.suppress(Exception):
        ex.shutdown(wait=True)


def take_counts(env: Env, ledger: Any, new: dict[str, int], counted: int, hits: int) -> None:
    """A worker's token counting, taken by the parent: its new counts into the ledger's cache, its
    counted texts and cache hits into the run's counter."""
    if new:
        ledger.store_tokens(env.counter.name, new)
    env.counter.counted += counted
    env.counter.cache_hits += hits


__all__ = ["SnapshotCache", "batch_results", "default_jobs", "take_counts"]
