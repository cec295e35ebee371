"""The runner: load → stages → replay → outputs and ledger. It owns all I/O; stages stay pure.

Outputs (see README): calls.parquet, messages.parquet + call_messages.parquet (the request store:
every call's request, once per distinct message, for `ctxreplay request`), blocks.parquet (the
final block versions), quarantine.parquet, decisions.parquet, summary.json,
requests/<thread_key>.json (pending call) and, with all_calls, requests/<thread_key>.jsonl;
spill/<sha256> when a stage spilled. A run holds the locks of OUT and of the ledger, writes every
output into a fresh staging directory OUT/.runs/<run_id>/, commits the ledger (the run's new
decisions, the run row and the token counts in one transaction), and only then publishes the
staged run by one atomic swap of the OUT/current link (pipeline/outdir.py). A crash before the
commit leaves ledger and OUT as they were; between commit and publish, the ledger holds the run and
OUT the previous one, and a re-run reuses the committed decisions and publishes the same outputs.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import gc
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

import pipeline
from pipeline import crashpoints
from pipeline.errors import (
    CheckFailed,
    InputError,
    NothingToDo,
    OutputError,
    internal_error,
)
from pipeline.ledger import Ledger
from pipeline.loaders import LoadResult, load_paths
from pipeline.outdir import OutputDir, RunLock, ledger_lock_path, new_run_id
from pipeline.registry import StageContext
from pipeline.replay import (
    ROW_COLUMNS,
    MessageStore,
    SpanLog,
    call_counts,
    call_skeleton,
    replay_thread,
    thread_calls,
    thread_key,
    thread_rows,
)
from pipeline.spec import DEFAULT_TARGET, PipelineSpec
from pipeline.stagerun import CallMap, LedgerView, StageFailure, StagesResult, run_stages
from pipeline.store import CALL_MESSAGES_FILE, MESSAGES_FILE, store_tables
from pipeline.targets import Violation, get_target
from pipeline.tokens import CHARS4_COUNTER, TIKTOKEN_COUNTER, TokenCounter, row_tokens
from pipeline.words import plural
from schemas.blocks import BLOCKS
from schemas.calls import CALLS
from schemas.check import SchemaMismatch, check_frame, polars_schema, to_arrow
from schemas.decisions import DECISION_KEY, STAGE_DECISION
from schemas.quarantine import QUARANTINE

Progress = Callable[[str], None]


@dataclass
class RunOptions:
    out_dir: Path = Path("ctxreplay-out")
    ledger_path: Path | None = None
    # None: the spec's `[pipeline] target`, else anthropic; a different one than the spec's is refused
    target: str | None = None
    all_calls: bool = False
    validate: bool = True
    token_counter: str = TIKTOKEN_COUNTER
    progress: Progress | None = None


@dataclass
class RunResult:
    summary: dict[str, Any]
    calls: pl.DataFrame
    blocks: pl.DataFrame
    violations: list[Violation] = field(default_factory=list)
    # every decision this run applied (reused ones too), with `stage` and `is_provisional`
    # (decisions for a pending call, applied but not frozen in the ledger); also decisions.parquet
    decisions: pl.DataFrame | None = None
    # plug-in stages quarantined for some sessions (their effect skipped there)
    stage_failures: list[StageFailure] = field(default_factory=list)

    @property
    def found_problems(self) -> bool:
        s = self.summary
        return bool(s["quarantined_lines"] or s["violations"] or s["conflicts"] or s.get("stage_failures"))


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Loading and replay build many long-lived small objects; Python's cyclic GC would rescan them
    over and over (a cost that grows faster than the input), and they hold no cycles worth it."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _now() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


def replay_all(blocks: pl.DataFrame, skeleton: pl.DataFrame, target_name: str, counter: TokenCounter, *,
               all_calls: bool, validate: bool, out_dir: Path | None,
               progress: Progress | None = None,
               counts: dict[tuple[str, str], int] | None = None) -> tuple[pl.DataFrame, list[Violation], dict[str, Any]]:
    """Replay every thread: the calls frame (CALLS), the violations of the validated requests (the
    pending ones; every call with all_calls) and stats, whose `store_tables` are the request store
    (messages.parquet, call_messages.parquet: every call's request, a branch's inherited calls too;
    see pipeline/store.py). `counts` (calls per thread, inherited ones included) lets a branch walk
    its shared history's calls without reporting them. Under out_dir it writes requests/ (the
    pending request of each thread; with all_calls every reported call's, as JSONL)."""
    target = get_target(target_name)
    calls_by_thread = thread_calls(skeleton, counts)
    blocks = blocks.with_columns(_tok=row_tokens(blocks, counter))
    req_dir = out_dir / "requests" if out_dir else None
    if req_dir:
        req_dir.mkdir(parents=True, exist_ok=True)
    store = MessageStore()
    spans = SpanLog()
    rows_out: list[dict[str, Any]] = []
    violations: list[Violation] = []
    threads = 0
    for (sid, tid), part in thread_rows(blocks):
        threads += 1
        key = thread_key(sid, tid)
        calls = calls_by_thread.get((sid, tid), [])
        rows = part.select(ROW_COLUMNS).to_dicts()
        toks = part.get_column("_tok").to_list()
        spans.begin_thread(sid, tid, key)
        reported = [c.reported for c in calls]
        with contextlib.ExitStack() as stack:
            jsonl = stack.enter_context(open(req_dir / f"{key}.jsonl", "wb")) if (req_dir and all_calls) else None
            for res in replay_thread(rows, toks, calls, target, store=store, spans=spans,
                                     materialize=lambda k, pending, rep=reported: pending or (all_calls and rep[k])):
                if not res.is_pending and not calls[res.call].reported:
                    continue  # an inherited call: its own thread reports it
                rows_out.append({
                    "session_id": sid, "thread_id": tid, "thread_key": key, "call": res.call,
                    "is_pending": res.is_pending, "awaits_user": res.awaits_user, "timestamp": res.timestamp,
                    "model": res.model, "request_sha256": res.request_sha256, "n_messages": res.n_messages,
                    "prompt_tokens": res.prompt_tokens, "prefix_break_message": res.prefix_break_message,
                })
                if res.request is not None:
                    if validate:
                        violations.extend(target.validate(res.request, thread_key=key, call=res.call,
                                                          awaits_user=res.awaits_user))
                    if jsonl is not None:
                        assert res.request_json is not None
                        jsonl.write(b'{"call":%d,"request":%s}\n' % (res.call, res.request_json))
                    if res.is_pending and req_dir:
                        (req_dir / f"{key}.json").write_bytes(
                            orjson.dumps(res.request, option=orjson.OPT_SORT_KEYS | orjson.OPT_INDENT_2) + b"\n")
        if progress and threads % 20 == 0:
            progress(f"replayed {threads} threads")
    # what the transcript recorded about each call (its answer), by one join on the call skeleton
    recorded = skeleton.select(
        "session_id", "thread_id", "call", "message_id", "request_id",
        recorded_input_tokens="usage_input", recorded_output_tokens="usage_output",
        recorded_cache_read_tokens="usage_cache_read", recorded_cache_write_tokens="usage_cache_write",
        recorded_cache_write_5m_tokens="usage_cache_write_5m", recorded_cache_write_1h_tokens="usage_cache_write_1h")
    replayed = pl.DataFrame(rows_out, schema={k: v for k, v in polars_schema(CALLS).items() if k not in recorded.columns
                                              or k in ("session_id", "thread_id", "call")})
    calls_df = replayed.join(recorded, on=["session_id", "thread_id", "call"], how="left").select(CALLS.names)
    n_messages = sum(k == "message" for k in store.kind)
    stats = {"threads": threads, "request_store": {
        "messages": n_messages, "envelopes": len(store) - n_messages, "call_message_rows": len(spans),
        "bytes": sum(map(len, store.data)), "token_conflicts": store.token_conflicts},
        "store_tables": store_tables(store, spans, target.name, target.list_key)}
    return calls_df, violations, stats


def run(paths: list[Path], spec: PipelineSpec, opts: RunOptions) -> RunResult:
    """Load, run the stages, replay; write the outputs into a staging directory, commit the ledger,
    then publish the outputs in OUT all at once (see the module docstring for the order)."""
    crashpoints.begin()
    target = get_target(opts.target or spec.target or DEFAULT_TARGET)  # fail early on an unknown target
    spec = spec.for_target(target.name)
    ledger_path = opts.ledger_path or (opts.out_dir / "ledger.duckdb")
    out = OutputDir(opts.out_dir)
    out.check()
    if ledger_path.exists() and not ledger_path.is_file():
        raise OutputError(f"--ledger {ledger_path} is a directory, not a file: pass a file path")
    crashpoints.phase("lock")
    out.create()
    run_id = new_run_id()
    published = False
    try:
        try:
            ledger_path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise OutputError(f"cannot create the ledger's directory {ledger_path.parent}: {exc.strerror}") from exc
        with out.lock(), RunLock(ledger_lock_path(ledger_path), f"the ledger {ledger_path}"):
            stale = out.clean_stale()
            staging = out.stage(run_id)
            try:
                result = _run_staged(paths, spec, opts, target.name, ledger_path, staging, run_id, stale)
                crashpoints.phase("publish")
                out.publish(run_id)
                published = True
            finally:
                if not published:
                    out.discard(run_id)
    finally:
        if not published:
            out.remove_if_unused((ledger_lock_path(ledger_path).name,))
    crashpoints.phase("done")
    return result


def _run_staged(paths: list[Path], spec: PipelineSpec, opts: RunOptions, target_name: str, ledger_path: Path,
                staging: Path, run_id: str, stale: list[str]) -> RunResult:
    """The run proper, with OUT and the ledger locked: every output goes to `staging`."""
    started = _now()
    t_start = time.perf_counter()
    say = opts.progress or (lambda s: None)
    loaded, blocks, skeleton, counts, calls = _load(paths, say)
    t_load = time.perf_counter()
    ledger = Ledger(ledger_path)
    closed = False
    try:
        counter = TokenCounter(opts.token_counter, cache=ledger)
        staged = _run_pipeline(blocks, spec, target_name, ledger, counter, calls, staging, say)
        t_stages = time.perf_counter()
        final = to_arrow(staged.blocks, BLOCKS, where="on write (blocks)")
        calls_df, violations, replay_stats = _replay(final, skeleton, target_name, counter, opts, staging, counts, say)
        t_replay = time.perf_counter()
        say("simulating the prompt cache")
        from pipeline.cachesim import after_replay

        calls_df, cache_sim = after_replay(loaded.blocks, final, calls_df, replay_stats["store_tables"], staged.applied,
                                           counter.series_counter())
        _write_tables(staging, loaded, calls_df, final, staged.applied, replay_stats.pop("store_tables"), run_id,
                      opts.out_dir)
        if violations:
            _stage_violations(violations, calls_df, spec, target_name, ledger)
        summary = _summary(RunFacts(loaded, spec, target_name, calls_df, staged, violations, opts.out_dir,
                                    ledger_path, {"load": t_load - t_start, "stages": t_stages - t_load,
                                                  "replay": t_replay - t_stages}, counter))
        summary.update(threads=replay_stats["threads"], request_store=replay_stats["request_store"], run_id=run_id,
                       stale_outputs_removed=stale, cache_sim=cache_sim)
        crashpoints.phase("ledger")
        ledger.commit_run({
            "spec_sha256": spec.sha256, "spec_name": spec.name, "started_at": started, "finished_at": _now(),
            "input_files": [{"path": ld.path, "sha256": ld.sha256} for ld in loaded.loads],
            "versions": summary["versions"], "run_id": run_id,
            "counts": {k: summary[k] for k in ("files", "lines", "calls", "quarantined_lines")},
        }, spec.resolved())
        ledger.close()
        closed = True
        crashpoints.point("ledger")
        crashpoints.phase("write")
        summary["seconds"] = round(time.perf_counter() - t_start, 3)
        _write_json(staging / "summary.json", summary, out_dir=opts.out_dir)
        crashpoints.point("write")
        return RunResult(summary, calls_df, pl.from_arrow(final), violations, staged.applied,  # type: ignore[arg-type]
                         list(staged.failures))
    finally:
        if not closed:
            ledger.close()


def _load(paths: list[Path], say: Progress) -> tuple[LoadResult, pl.DataFrame, pl.DataFrame,
                                                      dict[tuple[str, str], int], CallMap]:
    """Load and check the inputs; the blocks every call sees, the call skeleton, the calls per
    thread and their keys."""
    say(f"loading {plural(len(paths), 'path')}")
    crashpoints.phase("load")
    try:
        with _gc_paused():
            loaded: LoadResult = load_paths(paths)
    except OSError as exc:
        raise InputError(f"cannot read the input: {exc}. Check the path and its permissions") from exc
    for ld in loaded.loads:
        ld.check()
    _check_something_to_do(paths, loaded)
    blocks = pl.from_arrow(loaded.blocks)
    assert isinstance(blocks, pl.DataFrame)
    check_frame(blocks, BLOCKS, where="on load")
    skeleton = call_skeleton(blocks)
    counts = call_counts(blocks)
    calls = CallMap.from_blocks(blocks, counts)
    # rows no call ever sees (compacted away before any call) leave the table now
    blocks = blocks.filter(pl.col("last_call").is_null() | (pl.col("last_call") > pl.col("first_call")))
    return loaded, blocks, skeleton, counts, calls


def _run_pipeline(blocks: pl.DataFrame, spec: PipelineSpec, target_name: str, ledger: Ledger, counter: TokenCounter,
                  calls: CallMap, staging: Path, say: Progress) -> StagesResult:
    """Run the stages with the ledger's view of these sessions; queue their new decisions in the
    ledger and write what they spilled."""
    target = get_target(target_name)
    # every target shipped today takes images; one that does not says so with `supports_images = False`
    ctx = StageContext(target=target_name, window_tokens=spec.window_tokens,
                       count_tokens=counter.series_counter(), token_counter_version=counter.name,
                       supports_images=bool(getattr(target, "supports_images", True)))
    sessions = sorted(blocks.get_column("session_id").unique().to_list())
    view = LedgerView.translate(ledger.earlier_all(spec.sha256, sessions), calls)
    crashpoints.phase("stages")
    staged = run_stages(blocks, spec, view, ctx, say)
    for o in staged.outcomes:
        ledger.stage(o.new, spec_sha256=spec.sha256, stage=o.name, stage_version=o.stage.version,
                     config_digest=o.config_digest)
    _write_spills(staged.spills, staging / "spill")
    return staged


def _replay(final: pa.Table, skeleton: pl.DataFrame, target_name: str, counter: TokenCounter, opts: RunOptions,
            staging: Path, counts: dict[tuple[str, str], int], say: Progress,
            ) -> tuple[pl.DataFrame, list[Violation], dict[str, Any]]:
    say("replaying calls")
    crashpoints.phase("replay")
    try:
        with _gc_paused():
            return replay_all(pl.from_arrow(final), skeleton, target_name, counter,  # type: ignore[arg-type]
                              all_calls=opts.all_calls, validate=opts.validate, out_dir=staging, progress=say,
                              counts=counts)
    except OSError as exc:
        raise _output_error(opts.out_dir, exc) from exc
    except AssertionError as exc:  # an internal check of the replay failed: a bug, kept in a file
        raise internal_error(exc, "while replaying") from exc


def _write_tables(staging: Path, loaded: LoadResult, calls_df: pl.DataFrame, final: pa.Table,
                  applied: pl.DataFrame, store: tuple[pa.Table, pa.Table], run_id: str, out_dir: Path) -> None:
    """calls, blocks, quarantine, decisions and the request store (messages, call_messages)."""
    calls_t = to_arrow(calls_df, CALLS, where="on write (calls)")
    quarantine = pa.Table.from_pylist(
        [{"file": q.file, "line": q.line, "raw": q.raw, "reason": q.reason, "code": q.code,
          "raw_base64": q.raw_base64} for q in loaded.quarantine],
        schema=QUARANTINE)
    crashpoints.phase("write")
    messages_t, call_messages_t = store
    for name, table in (("calls.parquet", calls_t), ("blocks.parquet", final),
                        ("quarantine.parquet", quarantine), ("decisions.parquet", applied.to_arrow()),
                        (MESSAGES_FILE, messages_t)):
        _write_parquet(staging / name, table, run_id=run_id, out_dir=out_dir)
        crashpoints.point("write")
    # without the Arrow schema in the file, its dictionary-encoded columns read back as strings
    _write_parquet(staging / CALL_MESSAGES_FILE, call_messages_t, run_id=run_id, out_dir=out_dir, store_schema=False)
    crashpoints.point("write")


def _check_something_to_do(paths: list[Path], loaded: LoadResult) -> None:
    """A run over inputs without one transcript line cannot run (exit 2), --strict or not."""
    if sum(ld.lines for ld in loaded.loads) or loaded.quarantine:
        return
    where = ", ".join(str(p) for p in paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")
    empty = sum(1 for ld in loaded.loads if ld.lines == 0)
    parts = []
    if empty:
        parts.append(f"{plural(empty, 'empty file')}")
    skipped = loaded.skipped
    if skipped:
        first = "; ".join(f"{s['file']}: {s['reason']}" for s in skipped[:3])
        parts.append(f"{plural(len(skipped), 'file')} skipped ({first}{'; ...' if len(skipped) > 3 else ''})")
    found = ", ".join(parts) if parts else "no files there"
    raise NothingToDo(f"no transcripts found under {where}: {found}. Pass the files or directories that hold "
                      f"session transcripts (*.jsonl), e.g. ~/.claude/projects")


def _output_error(out_dir: Path, exc: OSError) -> OutputError:
    where = f" ({exc.filename})" if exc.filename else ""
    return OutputError(f"cannot write the outputs in {out_dir}: {exc.strerror or exc}{where}. The previous "
                       f"outputs are kept; free some space or pass an --out you can write to")


def _write_spills(spills: pl.DataFrame, spill_dir: Path) -> None:
    """Write what the stages spilled to the content-addressed store OUT/spill/<sha256> (stages do no
    I/O: they name the texts through their `spilled_texts` hook)."""
    if not spills.height:
        return
    try:
        spill_dir.mkdir(parents=True, exist_ok=True)
        for sha, text in zip(spills.get_column("sha256").to_list(), spills.get_column("text").to_list()):
            path = spill_dir / sha
            if not path.exists():
                path.write_text(text, encoding="utf-8", errors="surrogatepass")
    except OSError as exc:
        raise _output_error(spill_dir.parent, exc) from exc


def _stage_violations(violations: list[Violation], calls: pl.DataFrame, spec: PipelineSpec, target: str,
                      ledger: Ledger) -> None:
    """Queue `violation` ledger rows (stage `validate:<target>`), only those no earlier run recorded."""
    from pipeline.validate import violation_decisions

    keys = {r["thread_key"]: (r["session_id"], r["thread_id"])
            for r in calls.select("thread_key", "session_id", "thread_id").unique().iter_rows(named=True)}
    rows = pl.from_arrow(pa.Table.from_pylist(violation_decisions(violations, keys), schema=STAGE_DECISION))
    stage = f"validate:{target}"
    earlier = ledger.earlier(spec.sha256, stage, sorted(set(rows.get_column("session_id").to_list()))).collect()
    new = rows.unique(DECISION_KEY, keep="first", maintain_order=True).join(
        earlier.select(DECISION_KEY), on=DECISION_KEY, how="anti", nulls_equal=True).sort(DECISION_KEY)
    ledger.stage(new, spec_sha256=spec.sha256, stage=stage, stage_version=1, config_digest=spec.sha256)


RUN_ID_KEY = b"ctxreplay_run_id"


def _write_parquet(path: Path, table: pa.Table, *, run_id: str, out_dir: Path, **options: Any) -> None:
    """Write into the staging directory (no temp file needed: nothing reads it before it is
    published); the run id goes into the file's metadata, so a reader can tell runs apart."""
    meta = {**(table.schema.metadata or {}), RUN_ID_KEY: run_id.encode()}
    try:
        pq.write_table(table.replace_schema_metadata(meta), path, **options)
    except OSError as exc:
        raise _output_error(out_dir, exc) from exc


def _write_json(path: Path, obj: Any, *, out_dir: Path) -> None:
    try:
        path.write_bytes(orjson.dumps(obj, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS) + b"\n")
    except OSError as exc:
        raise _output_error(out_dir, exc) from exc


@dataclass(frozen=True)
class RunFacts:
    """What the summary is made of."""

    loaded: LoadResult
    spec: PipelineSpec
    target: str
    calls: pl.DataFrame
    stages: StagesResult
    violations: list[Violation]
    out_dir: Path
    ledger_path: Path
    timings: dict[str, float]
    counter: TokenCounter


def _summary(f: RunFacts) -> dict[str, Any]:
    """summary.json (README: "Outputs")."""
    calls, stage_stats = f.calls, f.stages.stats()
    pending = calls.filter(pl.col("is_pending")).height if calls.height else 0
    return {
        "pipeline": f.spec.name,
        "pipeline_sha256": f.spec.sha256,
        "target": f.target,
        **_input_counts(f.loaded),
        "sessions": calls.get_column("session_id").n_unique() if calls.height else 0,
        "threads": f.loaded.threads,
        "calls": calls.height,
        "recorded_calls": calls.height - pending,
        "pending_calls": pending,
        "decisions": {k: v["decisions"] for k, v in stage_stats.items()},
        "decisions_by_stage": stage_stats,
        "conflicts": f.stages.conflicts,
        "stage_failures": [x.as_dict() for x in f.stages.failures],
        "violations": len(f.violations),
        "violations_by_rule": dict(sorted(Counter(v.rule for v in f.violations).items())),
        "loader_stats": dict(sorted(f.loaded.stats.items())),
        "tokens": {"counter": f.counter.name, "texts_counted": f.counter.counted, "cache_hits": f.counter.cache_hits},
        "timings_seconds": {k: round(v, 3) for k, v in f.timings.items()},
        "out_dir": str(f.out_dir),
        "ledger": str(f.ledger_path),
        "versions": _versions(f.spec),
    }


def _input_counts(loaded: LoadResult) -> dict[str, Any]:
    """Files, bytes and lines read, every line accounted for (message + other + quarantined)."""
    other_kinds: Counter[str] = Counter()
    for ld in loaded.loads:
        other_kinds.update(ld.other_lines)
    lines = sum(ld.lines for ld in loaded.loads)
    message_lines = sum(ld.message_lines for ld in loaded.loads)
    other_lines = sum(other_kinds.values())
    quarantined = sum(ld.quarantined_lines for ld in loaded.loads)
    if message_lines + other_lines + quarantined != lines:
        raise CheckFailed(f"line accounting failed: {message_lines} + {other_lines} + {quarantined} != {lines}")
    return {
        "files": len(loaded.loads),
        "files_by_format": dict(sorted(Counter(ld.format for ld in loaded.loads).items())),
        "bytes": sum(ld.bytes for ld in loaded.loads),
        "lines": lines,
        "message_lines": message_lines,
        "other_lines": other_lines,
        "other_lines_by_kind": dict(sorted(other_kinds.items())),
        "quarantined_lines": quarantined,
        "quarantine_reasons": dict(sorted(Counter(q.reason for q in loaded.quarantine).items())),
        "quarantine_codes": dict(sorted(Counter(q.code for q in loaded.quarantine).items())),
        "recovered_lines": [r for ld in loaded.loads for r in ld.recovered],
        "skipped_files": loaded.skipped,
    }


def _versions(spec: PipelineSpec) -> dict[str, Any]:
    import duckdb
    import tiktoken

    return {"ctxreplay": pipeline.__version__, "polars": pl.__version__, "pyarrow": pa.__version__,
            "duckdb": duckdb.__version__, "tiktoken": tiktoken.__version__, "python": sys.version.split()[0],
            "stages": {s.stage.name: s.stage.version for s in spec.stages}}


__all__ = [
    "CHARS4_COUNTER",
    "RunOptions",
    "RunResult",
    "SchemaMismatch",
    "replay_all",
    "run",
]
