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
    CtxReplayError,
    InputError,
    NothingToDo,
    OutputError,
    StageFailed,
    internal_error,
    write_traceback,
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

    @property
    def found_problems(self) -> bool:
        return bool(self.summary["quarantined_lines"] or self.summary["violations"] or self.summary["conflicts"])


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


def run_stages(blocks: pl.DataFrame, spec: PipelineSpec, ledger: Ledger | None, ctx: StageContext,
               progress: Progress | None = None, pending: pl.DataFrame | None = None,
               spill_dir: Path | None = None) -> tuple[pl.DataFrame, dict[str, Any]]:
    """Run every stage in order; returns the final blocks and per-stage counts. New decisions are
    queued in the ledger (written with the run's commit).

    `pending` (session_id, thread_id, pending_call) marks each thread's pending call: decisions
    that apply only from it on are provisional (the transcript may still grow before that request
    is sent), so they are applied in this run but not frozen in the ledger.
    """
    sessions = sorted(blocks.get_column("session_id").unique().to_list())
    applied: list[pl.DataFrame] = []
    stats: dict[str, Any] = {}
    seen: Counter[str] = Counter()
    for i, rs in enumerate(spec.stages, start=1):
        st = rs.stage
        seen[st.name] += 1
        # a stage used twice (pairing runs before and after snip) keeps its decisions apart
        name = st.name if seen[st.name] == 1 else f"{st.name}#{seen[st.name]}"
        where = f"after stage '{name}' (#{i})"
        if progress:
            progress(f"stage {i}/{len(spec.stages)}: {name}")
        earlier = ledger.earlier(spec.sha256, name, sessions) if ledger else \
            pl.LazyFrame(schema=pl.from_arrow(STAGE_DECISION.empty_table()).schema)
        t0 = time.perf_counter()
        blocks_before = blocks
        crashpoints.point("stage")
        try:
            res = st.fn(blocks.lazy(), rs.params, earlier, ctx)
            if not (isinstance(getattr(res, "blocks", None), pl.LazyFrame | pl.DataFrame)
                    and isinstance(getattr(res, "decisions", None), pl.LazyFrame | pl.DataFrame)):
                raise StageFailed(f"stage '{name}' (#{i}, from {st.module}) returned {type(res).__name__}, not a "
                                  f"StageResult(blocks, decisions) of polars frames; fix the stage")
            check_frame(res.blocks, BLOCKS, where=where)
            check_frame(res.decisions, STAGE_DECISION, where=f"decisions of stage '{st.name}' (#{i})")
            blocks = res.blocks.lazy().collect()
            decisions = res.decisions.lazy().collect()
        except CtxReplayError:
            raise
        except Exception as exc:
            raise _stage_failed(name, i, st.module, exc) from exc
        dupes = decisions.group_by(DECISION_KEY).len().filter(pl.col("len") > 1)
        if dupes.height:
            raise CheckFailed(f"stage '{st.name}' made {dupes.height} duplicate decisions for the same block and "
                              f"call (first: {dupes.row(0, named=True)}); this is a bug in the stage")
        earlier_df = earlier.collect()
        if spill_dir is not None:
            _write_spills(st.module, blocks_before, decisions, spill_dir)
        if pending is not None:
            marked = decisions.join(pending, on=["session_id", "thread_id"], how="left").with_columns(
                is_provisional=pl.col("pending_call").is_not_null() & (pl.col("from_call") >= pl.col("pending_call"))
            ).drop("pending_call")
        else:
            marked = decisions.with_columns(is_provisional=pl.lit(False))
        frozen = marked.filter(~pl.col("is_provisional")).drop("is_provisional")
        provisional = decisions.height - frozen.height
        applied.append(marked.with_columns(stage=pl.lit(name), stage_version=pl.lit(st.version, pl.Int32)))
        new = frozen.join(earlier_df.select(DECISION_KEY), on=DECISION_KEY, how="anti", nulls_equal=True)
        # the same decision key with another outcome than the ledger holds is a conflict
        clash = frozen.join(earlier_df.select(*DECISION_KEY, pl.col("after_sha256").alias("_was")),
                               on=DECISION_KEY, how="inner", nulls_equal=True).filter(
            pl.col("after_sha256").ne_missing(pl.col("_was")))
        conflicts = clash.drop("_was").with_columns(action=pl.lit("conflict"),
                                                    reason=pl.lit("ledger_mismatch"))
        new = pl.concat([new, conflicts.select(new.columns)]).sort(DECISION_KEY)
        if ledger is not None:
            ledger.stage(new, spec_sha256=spec.sha256, stage=name, stage_version=st.version,
                         config_digest=rs.config_digest)
        by_reason = Counter(f"{a}:{r}" for a, r in decisions.select("action", "reason").iter_rows())
        stats[name] = {
            "decisions": decisions.height,
            "new_decisions": new.height,
            "reused_decisions": frozen.height - (new.height - conflicts.height),
            "provisional_decisions": provisional,
            "conflicts": conflicts.height,
            "by_reason": dict(sorted(by_reason.items())),
            "seconds": round(time.perf_counter() - t0, 3),
        }
        crashpoints.point("stage")
    stats["_applied"] = pl.concat(applied) if applied else pl.DataFrame(
        schema={**pl.from_arrow(STAGE_DECISION.empty_table()).schema, "stage": pl.String,
                "stage_version": pl.Int32, "is_provisional": pl.Boolean})
    return blocks, stats


def _stage_failed(name: str, i: int, module: str, exc: Exception) -> StageFailed:
    path = write_traceback(exc)
    first = (str(exc).strip().splitlines() or [""])[0][:300]
    kept = f"the traceback was written to {path}" if path else "no traceback file could be written"
    builtin = module.startswith("stages.")
    whose = "this is a bug in ctxreplay; please report it" if builtin else \
        f"it is not a built-in stage: report it to the authors of {module.split('.')[0]}, or leave it out of the spec"
    return StageFailed(f"stage '{name}' (#{i}, from {module}) failed with {type(exc).__name__}: {first}. "
                       f"Nothing was written; {whose} ({kept})")


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
    t_load = time.perf_counter()
    blocks = pl.from_arrow(loaded.blocks)
    assert isinstance(blocks, pl.DataFrame)
    check_frame(blocks, BLOCKS, where="on load")
    skeleton = call_skeleton(blocks)
    counts = call_counts(blocks)
    # rows no call ever sees (compacted away before any call) leave the table now
    blocks = blocks.filter(pl.col("last_call").is_null() | (pl.col("last_call") > pl.col("first_call")))
    ledger = Ledger(ledger_path)
    closed = False
    try:
        counter = TokenCounter(opts.token_counter, cache=ledger)
        # snip dry-runs tombstone with the spec's own tombstone params (none: no dry run)
        tomb = next((s.params for s in spec.stages if s.stage.name == "tombstone"), None)
        ctx = StageContext(target=target_name, window_tokens=spec.window_tokens,
                           count_tokens=counter.series_counter(), token_counter_version=counter.name,
                           extra={"tombstone": tomb})
        pending = pl.DataFrame([{"session_id": s, "thread_id": t, "pending_call": n} for (s, t), n in counts.items()],
                               schema={"session_id": pl.String, "thread_id": pl.String, "pending_call": pl.Int32})
        crashpoints.phase("stages")
        blocks, stage_stats = run_stages(blocks, spec, ledger, ctx, say, pending=pending,
                                         spill_dir=staging / "spill")
        applied = stage_stats.pop("_applied")
        t_stages = time.perf_counter()
        final = to_arrow(blocks, BLOCKS, where="on write (blocks)")
        say("replaying calls")
        crashpoints.phase("replay")
        try:
            with _gc_paused():
                calls_df, violations, replay_stats = replay_all(
                    pl.from_arrow(final), skeleton, target_name, counter,  # type: ignore[arg-type]
                    all_calls=opts.all_calls, validate=opts.validate, out_dir=staging, progress=say, counts=counts)
        except OSError as exc:
            raise _output_error(opts.out_dir, exc) from exc
        except AssertionError as exc:  # an internal check of the replay failed: a bug, kept in a file
            raise internal_error(exc, "while replaying") from exc
        t_replay = time.perf_counter()
        calls_t = to_arrow(calls_df, CALLS, where="on write (calls)")
        quarantine = pa.Table.from_pylist(
            [{"file": q.file, "line": q.line, "raw": q.raw, "reason": q.reason, "code": q.code,
              "raw_base64": q.raw_base64} for q in loaded.quarantine],
            schema=QUARANTINE)
        crashpoints.phase("write")
        messages_t, call_messages_t = replay_stats.pop("store_tables")
        for name, table in (("calls.parquet", calls_t), ("blocks.parquet", final),
                            ("quarantine.parquet", quarantine), ("decisions.parquet", applied.to_arrow()),
                            (MESSAGES_FILE, messages_t)):
            _write_parquet(staging / name, table, run_id=run_id, out_dir=opts.out_dir)
            crashpoints.point("write")
        # without the Arrow schema in the file, its dictionary-encoded columns read back as strings
        _write_parquet(staging / CALL_MESSAGES_FILE, call_messages_t, run_id=run_id, out_dir=opts.out_dir,
                       store_schema=False)
        crashpoints.point("write")
        if violations:
            _stage_violations(violations, calls_df, spec, target_name, ledger)
        conflicts = sum(s["conflicts"] for s in stage_stats.values())
        summary = _summary(loaded, spec, opts, target_name, calls_df, stage_stats, violations, conflicts,
                           ledger_path, timings={"load": t_load - t_start, "stages": t_stages - t_load,
                                                 "replay": t_replay - t_stages},
                           counter=counter)
        summary["threads"] = replay_stats["threads"]
        summary["request_store"] = replay_stats["request_store"]
        summary["run_id"] = run_id
        summary["stale_outputs_removed"] = stale
        finished = _now()
        crashpoints.phase("ledger")
        ledger.commit_run({
            "spec_sha256": spec.sha256, "spec_name": spec.name, "started_at": started, "finished_at": finished,
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
        return RunResult(summary, calls_df, pl.from_arrow(final), violations, applied)  # type: ignore[arg-type]
    finally:
        if not closed:
            ledger.close()


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


def _write_spills(module: str, blocks_before: pl.DataFrame, decisions: pl.DataFrame, spill_dir: Path) -> None:
    """Write what a stage spilled to the content-addressed store OUT/spill/<sha256>: a stage that
    spills exposes `spilled_texts(blocks_before, decisions)` in its module (stages do no I/O)."""
    spilled = getattr(sys.modules.get(module), "spilled_texts", None)
    if spilled is None or not decisions.filter(pl.col("action") == "spill").height:
        return
    try:
        spill_dir.mkdir(parents=True, exist_ok=True)
        for r in spilled(blocks_before.lazy(), decisions.lazy()).collect().iter_rows(named=True):
            path = spill_dir / r["sha256"]
            if not path.exists():
                path.write_text(r["text"], encoding="utf-8", errors="surrogatepass")
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


def _summary(loaded: LoadResult, spec: PipelineSpec, opts: RunOptions, target: str, calls: pl.DataFrame,
             stage_stats: dict[str, Any], violations: list[Violation], conflicts: int, ledger_path: Path,
             timings: dict[str, float], counter: TokenCounter) -> dict[str, Any]:
    import duckdb
    import tiktoken

    other_kinds: Counter[str] = Counter()
    for ld in loaded.loads:
        other_kinds.update(ld.other_lines)
    lines = sum(ld.lines for ld in loaded.loads)
    message_lines = sum(ld.message_lines for ld in loaded.loads)
    other_lines = sum(other_kinds.values())
    quarantined = sum(ld.quarantined_lines for ld in loaded.loads)
    if message_lines + other_lines + quarantined != lines:
        raise CheckFailed(f"line accounting failed: {message_lines} + {other_lines} + {quarantined} != {lines}")
    q_reasons = Counter(q.reason for q in loaded.quarantine)
    q_codes = Counter(q.code for q in loaded.quarantine)
    formats = Counter(ld.format for ld in loaded.loads)
    total_bytes = sum(ld.bytes for ld in loaded.loads)
    pending = calls.filter(pl.col("is_pending")).height if calls.height else 0
    return {
        "pipeline": spec.name,
        "pipeline_sha256": spec.sha256,
        "target": target,
        "files": len(loaded.loads),
        "files_by_format": dict(sorted(formats.items())),
        "bytes": total_bytes,
        "lines": lines,
        "message_lines": message_lines,
        "other_lines": other_lines,
        "other_lines_by_kind": dict(sorted(other_kinds.items())),
        "quarantined_lines": quarantined,
        "quarantine_reasons": dict(sorted(q_reasons.items())),
        "quarantine_codes": dict(sorted(q_codes.items())),
        "recovered_lines": [r for ld in loaded.loads for r in ld.recovered],
        "skipped_files": loaded.skipped,
        "sessions": calls.get_column("session_id").n_unique() if calls.height else 0,
        "threads": loaded.threads,
        "calls": calls.height,
        "recorded_calls": calls.height - pending,
        "pending_calls": pending,
        "decisions": {k: v["decisions"] for k, v in stage_stats.items()},
        "decisions_by_stage": stage_stats,
        "conflicts": conflicts,
        "violations": len(violations),
        "violations_by_rule": dict(sorted(Counter(v.rule for v in violations).items())),
        "loader_stats": dict(sorted(loaded.stats.items())),
        "tokens": {"counter": counter.name, "texts_counted": counter.counted, "cache_hits": counter.cache_hits},
        "timings_seconds": {k: round(v, 3) for k, v in timings.items()},
        "out_dir": str(opts.out_dir),
        "ledger": str(ledger_path),
        "versions": {"ctxreplay": pipeline.__version__, "polars": pl.__version__, "pyarrow": pa.__version__,
                     "duckdb": duckdb.__version__, "tiktoken": tiktoken.__version__,
                     "python": sys.version.split()[0],
                     "stages": {s.stage.name: s.stage.version for s in spec.stages}},
    }


__all__ = [
    "CHARS4_COUNTER",
    "RunOptions",
    "RunResult",
    "SchemaMismatch",
    "replay_all",
    "run",
    "run_stages",
]
