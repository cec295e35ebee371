"""Plug-in stages run isolated, so that a run never dies of one.

A third-party stage runs in a worker process: the runner writes the blocks and the stage's ledger
view as Arrow IPC files into a temporary directory, a worker (forked from a `forkserver` that has
imported polars but never run a query, so the fork is safe) imports the stage's module, runs it,
and writes its blocks and decisions back as Arrow IPC. The runner waits at most the stage's time
budget (`time_budget_seconds` in its `[[stage]]` table, default DEFAULT_TIME_BUDGET_SECONDS) and
kills the worker past it: a signal cannot interrupt polars' native code, a process can be killed.

A stage that cannot be sent to a worker (defined inside a function, or with params that do not
pickle) runs in-process: a failure is still caught, but a stage past its budget is only noticed
when it returns. Built-in stages always run in-process (pipeline/staging/stagerun.py).

When the stage fails on the batch, it is run again session by session (one budget shared by these
retries), so a stage failing for one session does not stop the others; the sessions it fails for
keep the blocks they came with and are reported (`StageFailed` per session).
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import pickle
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl

from ctxreplay.errors import StageFailed, write_traceback
from ctxreplay.pipeline.core.constants import CHARS4_COUNTER, POLARS_ENGINE
from ctxreplay.pipeline.stageapi.registry import RegisteredStage, StageContext, StageRef, StageResult
from ctxreplay.pipeline.staging.invoke import check_result, invoke_inline
from ctxreplay.schemas.check import polars_schema
from ctxreplay.schemas.decisions import STAGE_DECISION

DEFAULT_TIME_BUDGET_SECONDS = 600.0
Invoke = Callable[..., tuple[pl.DataFrame, pl.DataFrame]]


@dataclass(frozen=True)
class _Job:
    """What a worker needs: where the stage is, its params and context, and the IPC files."""

    module: str
    qualname: str
    params: bytes
    target: str
    window_tokens: int
    token_counter: str | None
    supports_images: bool
    peers: tuple[tuple[str, bytes], ...] | None
    sys_path: tuple[str, ...]
    folder: str


def run_isolated(st: RegisteredStage, blocks: pl.DataFrame, params: Any, earlier: pl.DataFrame,
                 ctx: StageContext, name: str, position: int, *, budget: float | None, skip: set[str],
                 run: Callable[..., tuple[pl.DataFrame, pl.DataFrame]],
                 ) -> tuple[pl.DataFrame, pl.DataFrame, dict[str, StageFailed]]:
    """Run a plug-in on every session not in `skip`; returns (blocks, decisions, failures by
    session). `run(st, blocks, params, earlier, ctx, name, position, invoke=...)` re-applies the
    stage's frozen decisions and calls `invoke` for the stage itself."""
    budget = float(budget or DEFAULT_TIME_BUDGET_SECONDS)
    invoke = _invoker(st, params)
    session = pl.col("session_id")
    kept = blocks.filter(session.is_in(sorted(skip)))
    todo = blocks.filter(~session.is_in(sorted(skip)))
    sessions = sorted(todo.get_column("session_id").unique().to_list())
    if not sessions:
        return blocks, pl.DataFrame(schema=_decision_schema()), {}
    try:
        out, dec = run(st, todo, params, earlier, ctx, name, position, invoke=_with_budget(invoke, budget))
        return pl.concat([out, kept]), dec, {}
    except StageFailed as first:
        if len(sessions) == 1:
            return blocks, pl.DataFrame(schema=_decision_schema()), {sessions[0]: first}
    return _per_session(st, todo, kept, sessions, params, earlier, ctx, name, position, budget, invoke, run)


def _per_session(st: RegisteredStage, todo: pl.DataFrame, kept: pl.DataFrame, sessions: list[str], params: Any,
                 earlier: pl.DataFrame, ctx: StageContext, name: str, position: int, budget: float,
                 invoke: Invoke, run: Callable[..., tuple[pl.DataFrame, pl.DataFrame]],
                 ) -> tuple[pl.DataFrame, pl.DataFrame, dict[str, StageFailed]]:
    """The stage failed on the batch: run it per session, within one shared budget."""
    deadline = time.monotonic() + budget
    outs, decs, failed = [kept], [], {}
    for sid in sessions:
        part = todo.filter(pl.col("session_id") == sid)
        left = deadline - time.monotonic()
        if left <= 0:
            failed[sid] = StageFailed(name, position, "not retried", kind="timeout",
                                      message=f"stage '{name}' (#{position}) was not run for this session: its time "
                                              f"budget of {budget:g} s was spent on the others")
            outs.append(part)
            continue
        try:
            out, dec = run(st, part, params, earlier.filter(pl.col("session_id") == sid), ctx, name, position,
                           invoke=_with_budget(invoke, min(budget, left), budget))
            outs.append(out)
            decs.append(dec)
        except StageFailed as exc:
            failed[sid] = exc
            outs.append(part)
    dec = pl.concat(decs) if decs else pl.DataFrame(schema=_decision_schema())
    return pl.concat(outs), dec, failed


def _decision_schema() -> pl.Schema:
    return polars_schema(STAGE_DECISION)


def _with_budget(invoke: Invoke, budget: float, stated: float | None = None) -> Invoke:
    """`invoke` with at most `budget` seconds; messages name the stage's budget (`stated`)."""
    def call(*args: Any) -> tuple[pl.DataFrame, pl.DataFrame]:
        return invoke(*args, budget=budget, stated=stated if stated is not None else budget)

    return call


def _invoker(st: RegisteredStage, params: Any) -> Invoke:
    """The worker when the stage can be sent to one, else in-process with a clock."""
    return invoke_in_worker if sendable(st, params) else _invoke_inline_timed


def sendable(st: RegisteredStage, params: Any) -> bool:
    """A worker can find the stage by module and name, and its params pickle."""
    qualname = getattr(st.fn, "__qualname__", "")
    if "<locals>" in qualname or st.module in ("", "__main__"):
        return False
    try:
        obj: Any = importlib.import_module(st.module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
        pickle.dumps(params)
    except Exception:  # noqa: BLE001  (any failure means: run it in-process)
        return False
    return obj is st.fn


def _invoke_inline_timed(st: RegisteredStage, blocks: pl.DataFrame, params: Any, view: pl.DataFrame,
                         ctx: StageContext, name: str, position: int, *, budget: float, stated: float,
                         ) -> tuple[pl.DataFrame, pl.DataFrame]:

    t0 = time.perf_counter()
    out = invoke_inline(st, blocks, params, view, ctx, name, position)
    took = time.perf_counter() - t0
    if took > budget:
        raise StageFailed(name, position, "timeout", kind="timeout",
                          message=f"stage '{name}' (#{position}, from {st.module}) ran {took:.1f} s, past its time "
                                  f"budget of {stated:g} s (it runs in-process, so it could not be stopped earlier)")
    return out


# ---------------------------------------------------------------------------------------------
# the worker


_CONTEXT: Any = None


def _mp_context() -> Any:
    """A forkserver context (spawn where there is none), started once per process."""
    global _CONTEXT
    if _CONTEXT is None:
        try:
            _CONTEXT = mp.get_context("forkserver")
            _CONTEXT.set_forkserver_preload(["polars", "pyarrow", "ctxreplay.pipeline.staging.isolation", "ctxreplay.stages"])
        except ValueError:
            _CONTEXT = mp.get_context("spawn")
    return _CONTEXT


def invoke_in_worker(st: RegisteredStage, blocks: pl.DataFrame, params: Any, view: pl.DataFrame,
                     ctx: StageContext, name: str, position: int, *, budget: float, stated: float,
                     ) -> tuple[pl.DataFrame, pl.DataFrame]:
    """Run the stage in a worker process, killed past `budget` seconds."""

    with tempfile.TemporaryDirectory(prefix="ctxreplay-stage-") as folder:
        blocks.write_ipc(Path(folder) / "blocks.arrow")
        view.write_ipc(Path(folder) / "ledger.arrow")
        job = _job(st, params, ctx, folder)
        mpc = _mp_context()
        parent, child = mpc.Pipe(duplex=False)
        proc = mpc.Process(target=_worker_main, args=(child, job), daemon=True)
        proc.start()
        child.close()
        try:
            if not parent.poll(budget):
                raise StageFailed(name, position, "timeout", kind="timeout",
                                  message=f"stage '{name}' (#{position}, from {st.module}) ran past its time budget "
                                          f"of {stated:g} s and was stopped")
            try:
                msg = parent.recv()
            except EOFError:
                raise StageFailed(name, position, "worker died", kind="worker",
                                  message=f"stage '{name}' (#{position}, from {st.module}): its worker process "
                                          f"ended without an answer (exit code {proc.join(5) or proc.exitcode})"
                                  ) from None
        finally:
            if proc.is_alive():
                proc.kill()
            proc.join(10)
            parent.close()
        if msg[0] == "error":
            raise _child_error(st, name, position, msg)
        if msg[0] == "result":
            text = (f"stage '{name}' (#{position}, from {st.module}) returned {msg[1]}, not a "
                    f"StageResult(blocks, decisions) of polars frames; fix the stage")
            raise StageFailed(name, position, text, kind="result", message=text)
        # read into memory: the folder goes away when this block ends
        res = StageResult(pl.read_ipc((Path(folder) / "out_blocks.arrow").read_bytes()).lazy(),
                          pl.read_ipc((Path(folder) / "out_decisions.arrow").read_bytes()).lazy())
        return check_result(res, name, position, st.module)


def _job(st: RegisteredStage, params: Any, ctx: StageContext, folder: str) -> _Job:
    counter = ctx.token_counter_version if ctx.count_tokens is not None else None
    peers = None if ctx.peers is None else tuple((p.stage.name, pickle.dumps(p.params)) for p in ctx.peers)
    return _Job(st.module, st.fn.__qualname__, pickle.dumps(params), ctx.target, ctx.window_tokens, counter,
                ctx.supports_images, peers, tuple(sys.path), folder)


def _child_error(st: RegisteredStage, name: str, position: int, msg: tuple[Any, ...]) -> StageFailed:
    _, type_name, text, tb = msg
    path = _write_text_traceback(tb)
    kept = f"the traceback was written to {path}" if path else "no traceback file could be written"
    message = (f"stage '{name}' (#{position}, from {st.module}) failed with {type_name}: {text}. It is not a "
               f"built-in stage: report it to the authors of {st.owner}, or leave it out of the spec ({kept})")
    return StageFailed(name, position, f"{type_name}: {text}", kind="raised", message=message)


def _write_text_traceback(tb: str) -> Path | None:
    class _Remote(Exception):
        def __str__(self) -> str:
            return tb

    return write_traceback(_Remote())


class _LazyCounter:
    """The run's token counter, built in the worker on first use (tiktoken takes a while to load)."""

    def __init__(self, name: str) -> None:
        self.name, self.fn = name, None

    def __call__(self, texts: pl.Series) -> pl.Series:
        if self.fn is None:
            from ctxreplay.pipeline.core.tokens import TokenCounter

            self.fn = TokenCounter(self.name).series_counter()
        return self.fn(texts)


def _child_context(job: _Job) -> StageContext:
    peers = None
    if job.peers is not None:
        from ctxreplay.pipeline.stageapi.registry import get_stage

        peers = tuple(StageRef(get_stage(n), pickle.loads(p)) for n, p in job.peers)
    return StageContext(target=job.target, window_tokens=job.window_tokens,
                        count_tokens=_LazyCounter(job.token_counter) if job.token_counter else None,
                        token_counter_version=job.token_counter or CHARS4_COUNTER,
                        supports_images=job.supports_images, peers=peers)


def _worker_main(conn: Any, job: _Job) -> None:
    """In the worker: import the stage, run it on the IPC input, write its output as IPC."""
    try:
        sys.path[:] = list(job.sys_path)
        obj: Any = importlib.import_module(job.module)
        for part in job.qualname.split("."):
            obj = getattr(obj, part)
        folder = Path(job.folder)
        blocks = pl.read_ipc((folder / "blocks.arrow").read_bytes()).lazy()
        ledger = pl.read_ipc((folder / "ledger.arrow").read_bytes()).lazy()
        res = obj(blocks, pickle.loads(job.params), ledger, _child_context(job))
        frames = (pl.LazyFrame, pl.DataFrame)
        if not (isinstance(getattr(res, "blocks", None), frames) and isinstance(getattr(res, "decisions", None), frames)):
            conn.send(("result", type(res).__name__))
            return
        res.blocks.lazy().collect(engine=POLARS_ENGINE).write_ipc(folder / "out_blocks.arrow")
        res.decisions.lazy().collect(engine=POLARS_ENGINE).write_ipc(folder / "out_decisions.arrow")
        conn.send(("ok",))
    except BaseException as exc:  # noqa: BLE001  (everything goes back to the runner as a message)
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        conn.send(("error", type(exc).__name__, first, "".join(traceback.format_exception(exc))))
    finally:
        conn.close()
