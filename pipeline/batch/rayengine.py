"""`ctxreplay run --engine ray`: the batches of a run on Ray Data (issue 10, point 6).

The same shape as `--jobs` (pipeline/batch/workers.py): the driver (this process) owns the ledger and
every output writer; Ray workers run `run_batch` - the same loaders, stage functions and replay
as the local engine - and send back the same BatchResult, which the runner takes in batch order.

Why `map_batches` over the batch plan and not `map_groups`: the unit a worker runs is a *batch*
of whole session groups (pipeline/batch/batches.py), packed by bytes before any worker starts. Each
row of the Ray dataset is one batch (its index and its groups' files), and `map_batches` runs
with `batch_size=1`, so a worker gets exactly one batch at a time: a session group is never cut
(it is inside one row), and a batch loads in one call as in the local engine. `map_groups` would
group rows (files) by a session key with a shuffle first, and call the function once per group,
which pays the loader's fixed cost per group (the reason batches load in one call) and re-derives
grouping that the plan already did.

What travels: to each worker once (an object in Ray's store), what `--jobs` workers get - the
spec, the earlier decisions of this namespace, a snapshot of the token cache. Back, per batch:
the BatchResult, with each stage's new decisions as a Parquet segment (bytes); the driver reads
the segments in batch order and queues them in the ledger, which commits them, the run row and
the token counts in one transaction at the end of the run (issue 8's rule: the ledger holds the
pre-run or the post-run state). The ledger's sequence numbers and every output are therefore
those of the local engine.

Files: workers read the input files by their paths and write the requests/ of their threads into
the run's staging directory (OUT/.runs/<run_id>/), as `--jobs` workers do. On one machine that
just works. On a cluster (`--address`), the inputs and --out must be on a shared filesystem
mounted at the same path on every node; a worker that cannot see them stops the run with an error
that says so (nothing is shipped as bytes: request files can be far larger than the inputs).

A local Ray (no --address) starts with num_cpus = --jobs (default: the cores), listening on
127.0.0.1 only (see `_local_only`), without the dashboard and without usage reporting, and is
shut down when the run ends.
With --address the driver joins that cluster and only disconnects at the end. When Ray is
already initialised in this process (a caller's own `ray.init`), it is used as it is and left up.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import pickle
import signal
import socket
import traceback
import warnings
from collections.abc import Iterator
from typing import Any

import polars as pl

from ctxreplay.errors import CtxReplayError, InputError, OutputError, RayEngineError, internal_error
from ctxreplay.pipeline.batch.batchrun import BatchResult, Env
from ctxreplay.pipeline.batch.workers import take_counts

INSTALL_HINT = "pip install 'ctxreplay[ray]'"
# the object store of a local Ray, in MiB: the batches' results pass through it (what does not fit
# spills to Ray's temp directory); CTXREPLAY_RAY_OBJECT_STORE_MB sets another size
OBJECT_STORE_ENV = "CTXREPLAY_RAY_OBJECT_STORE_MB"
LOCAL_OBJECT_STORE_MB = 512
PROBE_SECONDS = 5.0

Job = tuple[int, list[Any]]


def _local_only() -> None:
    """Before Ray is imported, for a local Ray: its node address is the loopback one, so that every
    server it starts (GCS, raylet, workers, object manager) listens on 127.0.0.1 only. Ray 2.60
    turns `_node_ip_address="127.0.0.1"` into the machine's reachable address and listens on all
    interfaces; the loopback address is what it takes when clusters are off
    (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, read when `ray` is imported). No usage report either."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def check_available() -> None:
    """Fail early, with the fix, when the `ray` extra is not installed."""
    try:
        import ray
        import ray.data  # noqa: F401
    except ImportError as exc:
        raise RayEngineError(f"--engine ray needs Ray Data, which is not installed ({exc}). Install the extra "
                             f"with `{INSTALL_HINT}`, or leave --engine out to run on this machine "
                             f"(--jobs N for several processes)") from exc


def _host(address: str) -> str:
    rest = address.split("://", 1)[1] if "://" in address else address
    return rest.rpartition(":")[0].strip("[]") if ":" in rest else rest


def _loopback(address: str | None) -> bool:
    """No address (a local Ray), or one on this machine's loopback interface."""
    if not address:
        return True
    host = _host(address)
    return host == "localhost" or host == "::1" or host.startswith("127.")


def preflight(address: str | None) -> None:
    """Before a run writes anything: Ray installed, and the cluster of --address reachable."""
    if _loopback(address):
        # also for a cluster on 127.0.0.1: Ray would otherwise turn that address into the machine's
        # reachable one, where a loopback-only cluster does not answer (and ray.init waits forever)
        _local_only()
    check_available()
    if address:
        _probe(address)


def _probe(address: str) -> None:
    """A host:port address (or ray://host:port) must accept a TCP connection before ray.init,
    which otherwise waits a long time on an address nobody listens to."""
    rest = address.split("://", 1)[1] if "://" in address else address
    if address == "auto" or ":" not in rest:
        return
    host, port = _host(address), rest.rpartition(":")[2]
    try:
        port_n = int(port)
    except ValueError:
        raise RayEngineError(f"--address {address}: the port '{port}' is not a number. Pass the head node's "
                             f"address as HOST:PORT (e.g. 10.0.0.5:6379), or leave --address out for a "
                             f"local Ray") from None
    try:
        socket.create_connection((host, port_n), timeout=PROBE_SECONDS).close()
    except OSError as exc:
        raise RayEngineError(f"--address {address}: no Ray cluster answers there ({exc.strerror or exc}). Start "
                             f"one with `ray start --head` and pass the address it prints (HOST:PORT), or "
                             f"leave --address out to start a local Ray on this machine") from exc


def _object_store_bytes() -> int:
    raw = os.environ.get(OBJECT_STORE_ENV, "").strip()
    if not raw:
        return LOCAL_OBJECT_STORE_MB << 20
    if not raw.isdigit() or int(raw) < 80:
        raise RayEngineError(f"{OBJECT_STORE_ENV}={raw}: give the local Ray's object store size in MiB, a whole "
                             f"number of at least 80 (Ray's minimum), e.g. {OBJECT_STORE_ENV}=512")
    return int(raw) << 20


@contextlib.contextmanager
def ray_session(address: str | None, num_cpus: int) -> Iterator[None]:
    """Ray up for the run: joined (address), started locally (127.0.0.1 only, num_cpus, no
    dashboard), or the caller's own when already initialised; shut down / left as it was after."""
    if _loopback(address):
        _local_only()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no network at run time
    import ray

    if ray.is_initialized():
        yield
        return
    # stderr is ctxreplay's (progress, errors): Ray's notes stay in its session logs; failures still raise
    quiet: dict[str, Any] = {"log_to_driver": False, "logging_level": logging.ERROR}
    try:
        if address:
            _probe(address)
            ray.init(address=address, **quiet)
        else:
            # address="local": a Ray of our own, even where a cluster was started on this machine
            # (ray.init() would join that one, from /tmp/ray/ray_current_cluster or RAY_ADDRESS)
            ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, _node_ip_address="127.0.0.1",
                     object_store_memory=_object_store_bytes(), **quiet)
    except RayEngineError:
        raise
    except Exception as exc:  # ray.init raises ConnectionError, RuntimeError, ValueError...
        ray.shutdown()
        where = f"join the Ray cluster at {address}" if address else "start a local Ray"
        auth = (" If the cluster uses token authentication (`ray start` turns it on by default), set "
                "RAY_AUTH_MODE=token and give its token (RAY_AUTH_TOKEN, or the file ~/.ray/auth_token)."
                if address else "")
        raise RayEngineError(f"cannot {where}: {type(exc).__name__}: {str(exc).strip()[:400]}.{auth} Check that "
                             f"the cluster runs the same Ray and Python versions as here, or leave --engine ray "
                             f"out to run on this machine") from exc
    try:
        yield
    finally:
        ray.shutdown()


# ------------------------------------------------------------------ the worker side


def _encode(result: BatchResult) -> BatchResult:
    """Each stage's new decisions as a Parquet segment (bytes), the rest as it is."""
    if result.out is not None:
        segs = []
        for rows, stage, version, digest in result.out.new_decisions:
            buf = io.BytesIO()
            rows.write_parquet(buf)
            segs.append((buf.getvalue(), stage, version, digest))
        result.out.new_decisions = segs  # type: ignore[assignment]
    return result


def _decode(result: BatchResult) -> BatchResult:
    if result.out is not None:
        result.out.new_decisions = [(pl.read_parquet(io.BytesIO(seg)), stage, version, digest)
                                    for seg, stage, version, digest in result.out.new_decisions]
    return result


def _portable(exc: CtxReplayError) -> CtxReplayError:
    """The error itself when it survives pickling, else a CtxReplayError with its message."""
    try:
        back = pickle.loads(pickle.dumps(exc))
    except Exception:  # noqa: BLE001 - an error class that does not pickle: keep its words
        return CtxReplayError(str(exc))
    return back if isinstance(back, CtxReplayError) and str(back) == str(exc) else CtxReplayError(str(exc))


def _check_visible(groups: list[Any], env: Env) -> None:
    """On a cluster a worker may run where the inputs or OUT are not: say so, with the fix."""
    node = socket.gethostname()
    for g in groups:
        for f in g.files:
            if not os.path.lexists(f):
                raise InputError(f"{f}: not found by the Ray worker on node {node}. With --address the input "
                                 f"files must be on a shared path, mounted at the same place on every node of "
                                 f"the cluster")
    if not env.staging.is_dir():
        raise OutputError(f"{env.staging}: the run's output directory is not visible to the Ray worker on node "
                          f"{node}. With --address, --out must be on a shared path, mounted at the same place "
                          f"on every node of the cluster")


class _BatchWorker:
    """A Ray Data actor: the Env of a `--jobs` worker, then one batch per call."""

    def __init__(self, state: Any, cwd: str) -> None:
        import ray

        from ctxreplay.pipeline.batch import workers

        # the paths of the plan (inputs, OUT) are as the user gave them, maybe relative to the
        # driver's directory; outputs name them so (source_file), hence no rewriting to absolute
        with contextlib.suppress(OSError):  # not there: _check_visible names the missing path
            os.chdir(cwd)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the driver handles Ctrl-C, as a --jobs worker's parent
        workers.init(ray.get(state[0]))

    def __call__(self, batch: Any) -> Any:
        import pyarrow as pa

        from ctxreplay.pipeline.batch import workers

        out = []
        for index, job in zip(batch.column("index").to_pylist(), batch.column("job").to_pylist(), strict=True):
            groups = pickle.loads(job)
            try:
                env = workers._ENV
                assert env is not None
                _check_visible(groups, env)
                result, new, counted, hits = workers._work((index, groups))
                payload: tuple[Any, ...] = ("ok", _encode(result), new, counted, hits)
            except CtxReplayError as exc:
                payload = ("error", _portable(exc))
            except Exception as exc:  # noqa: BLE001 - a bug: its traceback goes to the driver
                payload = ("bug", f"{type(exc).__name__}: {exc}", "".join(traceback.format_exception(exc)))
            out.append(pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL))
        return pa.table({"index": pa.array(batch.column("index").to_pylist(), pa.int64()),
                         "result": pa.array(out, pa.large_binary())})


class WorkerBug(Exception):
    """An exception (not a CtxReplayError) raised in a Ray worker; its message holds the worker's traceback."""


# ------------------------------------------------------------------ the driver side


def ray_batch_results(jobs: list[Job], env: Env, n_jobs: int | None, ledger: Any, *,
                      address: str | None = None) -> Iterator[BatchResult]:
    """run_batch over the jobs on Ray Data, results in job order (as workers.batch_results)."""
    from ctxreplay.pipeline.batch.workers import default_jobs, worker_state

    check_available()
    state = worker_state(env, ledger)
    if state is None:
        raise RayEngineError("--engine ray: a stage of this pipeline cannot be sent to another process (it does "
                             "not pickle, e.g. a plug-in stage defined inside a function). Define the stage at "
                             "the top level of an importable module, or run without --engine ray")
    with ray_session(address, n_jobs or default_jobs()):
        yield from _stream(jobs, state, env, ledger, n_jobs)


def _stream(jobs: list[Job], state: Any, env: Env, ledger: Any, n_jobs: int | None) -> Iterator[BatchResult]:
    import ray
    import ray.data

    if not jobs:
        return
    workers = n_jobs or max(1, int(ray.cluster_resources().get("CPU", 1)))
    workers = max(1, min(workers, len(jobs)))
    with warnings.catch_warnings():  # Ray 2.60's DataContext warns about its own defaults
        warnings.simplefilter("ignore", DeprecationWarning)
        ctx = ray.data.DataContext.get_current()
    before = (ctx.execution_options.preserve_order, ctx.enable_progress_bars)
    ctx.execution_options.preserve_order = True  # results in batch order, as the local engine takes them
    ctx.enable_progress_bars = False  # stderr is ctxreplay's own (progress display, errors)
    logging.getLogger("ray.data").setLevel(logging.ERROR)
    try:
        yield from _map(jobs, state, env, ledger, workers)
    finally:  # the process's Ray Data context as it was (a caller's own Ray may go on using it)
        ctx.execution_options.preserve_order, ctx.enable_progress_bars = before


def _map(jobs: list[Job], state: Any, env: Env, ledger: Any, workers: int) -> Iterator[BatchResult]:
    import ray
    import ray.data
    from ray.exceptions import RayError

    rows = [{"index": index, "job": pickle.dumps(groups, protocol=pickle.HIGHEST_PROTOCOL)}
            for index, groups in jobs]
    state_ref = ray.put(state)
    with warnings.catch_warnings():
        # max_restarts=0: a worker that dies (killed, out of memory) fails the run with a RayError;
        # Ray Data's default restarts it and retries its batch without end. Ray 2.60 warns that
        # extra remote args are deprecated (named parameters to come, none for this one yet).
        warnings.simplefilter("ignore", DeprecationWarning)
        ds = ray.data.from_items(rows, override_num_blocks=len(rows)).map_batches(
            # the reference inside a list: each actor fetches it (a top-level one would be resolved by Ray)
            _BatchWorker, fn_constructor_args=([state_ref], os.getcwd()), batch_size=1, batch_format="pyarrow",
            compute=ray.data.ActorPoolStrategy(size=workers), num_cpus=1, max_restarts=0)
    expected = [index for index, _ in jobs]
    got = 0
    try:
        for batch in ds.iter_batches(batch_size=1, batch_format="pyarrow", prefetch_batches=1):
            for index, blob in zip(batch.column("index").to_pylist(), batch.column("result").to_pylist(),
                                   strict=True):
                if got >= len(expected) or index != expected[got]:
                    raise internal_error(AssertionError(f"Ray returned batch {index}, expected "
                                                        f"{expected[got] if got < len(expected) else 'none'}"),
                                         "in the Ray engine")
                got += 1
                yield _take(pickle.loads(blob), env, ledger)
    except RayError as exc:
        raise RayEngineError(f"the Ray run failed: {type(exc).__name__}: {str(exc).strip()[:600]}. The ledger "
                             f"and the previous outputs are kept; run again, or without --engine ray") from exc
    if got != len(expected):
        raise internal_error(AssertionError(f"Ray returned {got} of {len(expected)} batches"), "in the Ray engine")


def _take(payload: tuple[Any, ...], env: Env, ledger: Any) -> BatchResult:
    kind = payload[0]
    if kind == "error":
        raise payload[1]
    if kind == "bug":
        raise internal_error(WorkerBug(f"{payload[1]}\n--- in a Ray worker:\n{payload[2]}"), "in a Ray worker")
    _, result, new, counted, hits = payload
    take_counts(env, ledger, new, counted, hits)
    return _decode(result)


__all__ = ["INSTALL_HINT", "RayEngineError", "check_available", "preflight", "ray_batch_results", "ray_session"]
