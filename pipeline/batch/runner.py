"""The runner: load → stages → replay → outputs and ledger. It owns all I/O; stages stay pure.

Outputs (see README): calls.parquet, messages.parquet + call_messages.parquet (the request store:
every call's request, once per distinct message, for `ctxreplay request`), blocks.parquet (the
final block versions), quarantine.parquet, decisions.parquet, summary.json,
requests/<thread_key>.json (pending call) and, with all_calls, requests/<thread_key>.jsonl;
spill/<sha256> when a stage spilled. A run holds the locks of OUT and of the ledger, writes every
output into a fresh staging directory OUT/.runs/<run_id>/, commits the ledger (the run's new
decisions, the run row and the token counts in one transaction), and only then publishes the
staged run by one atomic swap of the OUT/current link (pipeline/core/outdir.py). A crash before the
commit leaves ledger and OUT as they were; between commit and publish, the ledger holds the run and
OUT the previous one, and a re-run reuses the committed decisions and publishes the same outputs.
"""

from __future__ import annotations

import datetime as _dt
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from ctxreplay.errors import CheckFailed, NothingToDo, OutputError
from ctxreplay.pipeline.batch import manifest
from ctxreplay.pipeline.batch.batches import DEFAULT_BATCH_BYTES, plan
from ctxreplay.pipeline.batch.batchout import COMPRESSION, FILES, RUN_ID_KEY, Totals, Writers, sorted_tables
from ctxreplay.pipeline.batch.batchrun import BatchCounter, BatchResult, Env, output_error
from ctxreplay.pipeline.batch.workers import batch_results, default_jobs
from ctxreplay.pipeline.core import crashpoints
from ctxreplay.pipeline.core.constants import POLARS_ENGINE
from ctxreplay.pipeline.core.outdir import OutputDir, RunLock, ledger_lock_path, new_run_id
from ctxreplay.pipeline.core.progress import Progress
from ctxreplay.pipeline.core.tokens import CHARS4_COUNTER, TIKTOKEN_COUNTER, TokenCounter
from ctxreplay.pipeline.core.words import plural
from ctxreplay.pipeline.loaders import LoadResult
from ctxreplay.pipeline.loaders.gemini_cli import native_target
from ctxreplay.pipeline.loaders.inputs import path_str
from ctxreplay.pipeline.staging.ledger import Ledger
from ctxreplay.pipeline.staging.ledger import check_file as check_ledger_file
from ctxreplay.pipeline.staging.spec import DEFAULT_TARGET, PipelineSpec
from ctxreplay.pipeline.staging.stagerun import StageFailure, position_names
from ctxreplay.pipeline.targets import Violation, get_target
from ctxreplay.schemas.calls import CALLS
from ctxreplay.schemas.check import SchemaMismatch, to_arrow
from ctxreplay.schemas.decisions import DECISION_KEY, STAGE_DECISION
from ctxreplay.version import __version__


@dataclass
class RunOptions:
    out_dir: Path = Path("ctxreplay-out")
    ledger_path: Path | None = None
    # None: the spec's `[pipeline] target`, else gemini when the inputs are all Gemini CLI sessions,
    # openai-responses when they are all Codex rollouts, else
    # anthropic; a different one than the spec's is refused
    target: str | None = None
    all_calls: bool = False
    validate: bool = True
    token_counter: str = TIKTOKEN_COUNTER
    progress: Progress | None = None
    # input bytes per batch of session groups (pipeline/batch/batches.py): memory grows with it, not the corpus
    batch_bytes: int = DEFAULT_BATCH_BYTES
    # reuse the outputs of the groups whose files did not change since the previous run (OUT/manifest.json)
    reuse: bool = True
    # a live display (pipeline/core/progress.py RunProgress): start / advance per batch / close
    display: Any = None
    # worker processes for the batches (pipeline/batch/workers.py); None: one per core
    jobs: int | None = 1
    # "local" (this machine: in process or --jobs workers) or "ray" (pipeline/batch/rayengine.py)
    engine: str = "local"
    # with engine "ray": the cluster to join (ray.init(address=)); None starts a local Ray
    address: str | None = None
    # count the polars collects of every pipeline pass and time its stage positions: summary["profile"]
    profile: bool = False


@dataclass
class RunResult:
    summary: dict[str, Any]
    # the calls (`calls`) and decisions as the run made them, or as Arrow tables read back from the
    # previous run when it reused every output: polars makes the frames when they are first asked
    # for (a run that reused everything imports no polars: ctxreplay/deferred.py)
    _calls: pl.DataFrame | pa.Table
    out_dir: Path  # blocks.parquet is read from there on demand (`blocks`)
    violations: list[Violation] = field(default_factory=list)
    _decisions: pl.DataFrame | pa.Table | None = None
    # plug-in stages quarantined for some sessions (their effect skipped there)
    stage_failures: list[StageFailure] = field(default_factory=list)

    @property
    def calls(self) -> pl.DataFrame:
        """One row per call (calls.parquet)."""
        if isinstance(self._calls, pa.Table):
            self._calls = pl.DataFrame(self._calls)
        return self._calls

    @property
    def decisions(self) -> pl.DataFrame | None:
        """Every decision this run applied (reused ones too), with `stage` and `is_provisional`
        (decisions for a pending call, applied but not frozen in the ledger); also decisions.parquet."""
        if isinstance(self._decisions, pa.Table):
            self._decisions = pl.DataFrame(self._decisions)
        return self._decisions

    @property
    def blocks(self) -> pl.DataFrame:
        """The final block versions of the run (blocks.parquet of OUT)."""
        return pl.read_parquet(self.out_dir / "blocks.parquet")

    @property
    def found_problems(self) -> bool:
        s = self.summary
        return bool(s["quarantined_lines"] or s["violations"] or s["conflicts"] or s.get("stage_failures"))


def _now() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


def run(paths: list[Path], spec: PipelineSpec, opts: RunOptions) -> RunResult:
    """Load, run the stages, replay; write the outputs into a staging directory, commit the ledger,
    then publish the outputs in OUT all at once (see the module docstring for the order)."""
    crashpoints.begin()
    if opts.engine == "ray":  # before anything is written: the extra may be missing, the cluster away
        from ctxreplay.pipeline.batch.rayengine import preflight

        preflight(opts.address)
    # fail early on an unknown target; without one, inputs all of one agent with its own shape replay in it
    # (Gemini CLI sessions as gemini, Codex rollouts as openai-responses)
    target = get_target(opts.target or spec.target or native_target(paths) or DEFAULT_TARGET)
    spec = spec.for_target(target.name)
    ledger_path = opts.ledger_path or (opts.out_dir / "ledger.duckdb")
    out = OutputDir(opts.out_dir)
    own = _own_in_out(opts.out_dir, ledger_path)
    out.check(own)
    if ledger_path.exists() and not ledger_path.is_file():
        raise OutputError(f"--ledger {ledger_path} is a directory, not a file: pass a file path")
    out.check_ledger(ledger_path)
    check_ledger_file(ledger_path)  # a file that is not a ledger is refused before OUT is made
    crashpoints.phase("lock")
    out.create(own)
    run_id = new_run_id()
    published = False
    try:
        try:
            ledger_path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise OutputError(f"cannot create the ledger's directory {ledger_path.parent}: {exc.strerror}") from exc
        with out.lock(), RunLock(ledger_lock_path(ledger_path), f"the ledger {ledger_path}"):
            out.adopt(own)
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


def _own_in_out(out_dir: Path, ledger_path: Path) -> set[str]:
    """The names in OUT that are this run's ledger and its lock and WAL, when the ledger is in OUT
    itself (the default): OUT may hold them and still be taken for a new output directory."""
    if os.path.realpath(ledger_path.parent) != os.path.realpath(out_dir):
        return set()
    name = ledger_path.name
    return {name, f"{name}.wal", ledger_lock_path(ledger_path).name}


def _run_staged(paths: list[Path], spec: PipelineSpec, opts: RunOptions, target_name: str, ledger_path: Path,
                staging: Path, run_id: str, stale: list[str]) -> RunResult:
    """The run proper, with OUT and the ledger locked: every output goes to `staging`, batch by
    batch (pipeline/batch/batchrun.py), reusing the unchanged groups of the previous run
    (pipeline/batch/manifest.py); the cache simulation and calls.parquet once at the end."""
    started = _now()
    t_start = time.perf_counter()
    batches, skipped = plan(paths, opts.batch_bytes)
    conf = manifest.config(spec.sha256, target_name, opts.token_counter, opts.all_calls, opts.validate, ledger_path)
    plan_ = _Plan.make(batches, *(manifest.prior(opts.out_dir, conf) if opts.reuse else (None, "--full")))
    ledger: Any = _LazyLedger(ledger_path)  # opened when first needed: a run with nothing to do leaves no ledger
    if check_ledger_file(ledger_path) == "duckdb":
        ledger.open()  # it exists: refused now, before any work, when it is not a ctxreplay ledger
    writers = Writers(staging, run_id, opts.out_dir)
    closed = False
    results: Any = None  # the batches' results (a generator: closed at the end, its workers or Ray with it)
    try:
        counter = BatchCounter(opts.token_counter, cache=ledger)
        env = Env(spec, target_name, staging, opts.out_dir, opts.all_calls, opts.validate,
                  lambda sessions: ledger.earlier_all(spec.sha256, sessions), counter, opts.progress, opts.profile)
        totals = Totals(skipped=list(skipped))
        shown = opts.display
        if shown is not None:
            shown.start(sum(len(b.files) for b in batches), len(plan_.files), sum(b.bytes for b in batches))
        if plan_.all_reused:
            calls_df, cache_sim, applied = _reuse_everything(plan_, totals, staging, run_id)
        else:
            jobs = [(b.index, [g for g in b.groups if g.key not in plan_.reused]) for b in batches]
            todo = [j for j in jobs if j[1]]
            if opts.engine == "ray":
                from ctxreplay.pipeline.batch.rayengine import ray_batch_results

                results = ray_batch_results(todo, env, opts.jobs, ledger, address=opts.address)
            else:
                results = batch_results(todo, env, opts.jobs or default_jobs(), ledger)
            for batch, (_, fresh) in zip(batches, jobs, strict=True):
                before = totals.n_calls
                parts = _batch_parts(batch, fresh, next(results) if fresh else None, plan_, staging)
                _take_batch(parts, ledger, writers, totals, env)
                if shown is not None:
                    shown.advance(len(batch.files), len(batch.groups), batch.bytes, totals.n_calls - before)
            results.close()  # the workers (or Ray) go before the cache simulation
            _check_something_to_do(paths, totals.load_result())
            calls_df = totals.frame(totals.calls).sort("session_id", "thread_id", "call")
            applied = totals.frame(totals.applied)
            (opts.progress or (lambda s: None))("simulating the prompt cache")
            calls_df, cache_sim = _simulate(totals, calls_df, applied)
            writers.close()
            _write_parquet(staging / "calls.parquet", to_arrow(calls_df, CALLS, where="on write (calls)"),
                           run_id=run_id, out_dir=opts.out_dir)
            crashpoints.point("write")
        loaded = totals.load_result()
        row_groups = plan_.prior.row_groups if plan_.all_reused and plan_.prior else writers.row_groups
        manifest.write_manifest(staging, conf, plan_.records(totals.groups), len(totals.failures), row_groups)
        summary = _summary(RunFacts(loaded, spec, target_name, calls_df, totals, opts.out_dir, ledger_path,
                                    dict(totals.seconds), counter))
        summary.update(run_id=run_id, stale_outputs_removed=stale, cache_sim=cache_sim, groups=plan_.counts(),
                       request_store=totals.request_store or writers.request_store(totals))
        if opts.profile:
            summary["profile"] = profile_summary(totals.profile)
        crashpoints.phase("ledger")
        _queue_decisions(totals, ledger, spec)
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
        return RunResult(summary, calls_df, opts.out_dir, totals.violations, applied, list(totals.failures))
    finally:
        if results is not None:
            results.close()
        if opts.display is not None:
            opts.display.close()
        writers.abort()
        if not closed:
            ledger.close()


class _LazyLedger:
    """A Ledger opened at its first use."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._ledger: Ledger | None = None

    def open(self) -> Ledger:
        if self._ledger is None:
            self._ledger = Ledger(self.path)
        return self._ledger

    def __getattr__(self, name: str) -> Any:
        return getattr(self.open(), name)

    def close(self) -> None:
        if self._ledger is not None:
            self._ledger.close()


@dataclass
class _Plan:
    """Which groups of which batches run again and which are reused from the previous run."""

    batches: list[Any]
    prior: manifest.Prior | None
    why: str
    files: dict[str, list[dict[str, Any]]]  # group key -> its files' fingerprints
    reused: dict[str, dict[str, Any]]  # group key -> its record in the previous manifest
    paths: dict[str, Path]  # path_str of each input file -> its path

    @classmethod
    def make(cls, batches: list[Any], prior: manifest.Prior | None, why: str) -> _Plan:
        now = manifest.now_ns()  # before any stat (manifest.settled)
        files = {g.key: manifest.group_files(g, now) for b in batches for g in b.groups}
        paths = {path_str(f): f for b in batches for g in b.groups for f in g.files}
        reused = {}
        if prior is not None:
            manifest.hash_candidates(prior, files, paths)
            for key, fs in files.items():
                rec = prior.reusable(key, fs, paths)
                if rec is not None:
                    reused[key] = rec
        return cls(batches, prior, why, files, reused, paths)

    @property
    def all_reused(self) -> bool:
        return bool(self.files) and len(self.reused) == len(self.files)

    def counts(self) -> dict[str, Any]:
        old = self.prior.groups if self.prior else {}
        rerun = sum(1 for k in self.files if k not in self.reused and k in old)
        out: dict[str, Any] = {"total": len(self.files), "batches": len(self.batches), "reused": len(self.reused),
                               "rerun": rerun, "new": len(self.files) - len(self.reused) - rerun}
        if self.why:
            out["not_reused_because"] = self.why
        return out

    def records(self, fresh: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The manifest's group records: the reused ones as they were, the others from this run;
        each with the batch that holds its rows (when every group is reused, the previous one's)."""
        by_key = {**self.reused, **{r["key"]: r for r in fresh}}
        batch_of = {} if self.all_reused else {g.key: b.index for b in self.batches for g in b.groups}
        # a group that ran: its files' content hashes are those of the bytes its load read
        return [{**by_key[k], "key": k, "batch": batch_of.get(k, by_key[k].get("batch")),
                 "files": self.files[k] if k in self.reused
                 else manifest.with_content(self.files[k], by_key[k].get("loads", []), self.paths)}
                for k in sorted(self.files) if k in by_key]


def _batch_parts(batch: Any, fresh: list[Any], result: BatchResult | None, plan_: _Plan,
                 staging: Path) -> list[BatchResult]:
    """The batch's groups that ran again (`result` of run_batch over `fresh`) and those reused."""
    from ctxreplay.pipeline.batch.reuse import kept_row_groups, link_spills, reuse_batch

    parts = []
    if result is not None:
        for g, rec in zip(fresh, result.groups, strict=True):
            rec["key"] = g.key
        parts.append(result)
    old = [plan_.reused[g.key] for g in batch.groups if g.key in plan_.reused]
    if old:
        assert plan_.prior is not None
        kept = None if result is not None else \
            kept_row_groups(batch.index, {g.key for g in batch.groups}, plan_.reused, plan_.prior)
        parts.append(reuse_batch(batch.index, old, plan_.prior, staging, kept))
        link_spills(plan_.prior.run_dir, staging)
    return parts


def _reuse_everything(plan_: _Plan, totals: Totals, staging: Path, run_id: str,
                      ) -> tuple[pa.Table, dict[str, Any], pa.Table]:
    """Nothing changed: the previous run's outputs copied, its accounting summed again. The calls
    and decisions come back as Arrow tables: such a run computes no frame (ctxreplay/deferred.py)."""
    from ctxreplay.pipeline.batch.batchout import merge_stats
    from ctxreplay.pipeline.batch.reuse import reuse_all
    from ctxreplay.pipeline.core.outdir import read_summary

    assert plan_.prior is not None
    run = plan_.prior.run_dir
    records = [plan_.reused[k] for k in sorted(plan_.reused)]
    loaded, calls = reuse_all(records, plan_.prior, staging, run_id)
    totals.loads, totals.stats = loaded.loads, Counter(loaded.stats)
    totals.skipped.extend(loaded.skipped)
    totals.loaded_threads = loaded.threads
    for r in records:
        for name, st in r["stage_stats"].items():
            totals.stage_stats[name] = merge_stats(totals.stage_stats.get(name), st)
        totals.threads += r["threads"]
        totals.violations.extend(Violation(**v) for v in r["violations"])
    before = read_summary(run)
    totals.request_store = before.get("request_store")
    # ParquetFile, not pq.read_table: that loads pyarrow.dataset and pandas
    return calls, before.get("cache_sim", {}), pq.ParquetFile(staging / "decisions.parquet").read()


def profile_summary(p: dict[str, Any] | None) -> dict[str, Any]:
    """summary["profile"] (`run --profile`): the pipeline passes run (one per batch; none when every
    group was reused); per stage position, in the pipeline's order, its seconds, polars collects and
    the passes where its quick check held; the checks asked together; the totals of the stages and
    each phase's seconds and collects."""
    if p is None:
        return {"passes": 0, "stages": [], "checks": {}, "phases": {}, "totals": {"seconds": 0.0, "collects": 0}}
    stages = [{"position": k, "seconds": round(v["seconds"], 4), "collects": v["collects"], "quiet": v["quiet"]}
              for k, v in p["stages"].items()]
    checks = {k: round(v, 4) if isinstance(v, float) else v for k, v in p["checks"].items()}
    total_s = sum(v["seconds"] for v in p["stages"].values()) + p["checks"]["seconds"]
    total_n = sum(v["collects"] for v in p["stages"].values()) + p["checks"]["collects"]
    return {"passes": p["passes"], "stages": stages, "checks": checks,
            "phases": {k: {"seconds": round(v["seconds"], 4), "collects": v["collects"]} for k, v in p["phases"].items()},
            "totals": {"seconds": round(total_s, 4), "collects": total_n}}


# a batch's outputs that the cache simulation's store reads (Totals.add_store), and the others
STORE_TABLES = ("messages", "call_messages")
OTHER_TABLES = tuple(n for n in FILES if n not in STORE_TABLES)


def _take_batch(parts: list[BatchResult], ledger: Ledger, writers: Writers, totals: Totals, env: Env) -> None:
    """A batch's new decisions and violations queued in the ledger (committed with the run), its
    spills and tables written (its reused groups' rows with the others, in one order), its counts
    added to the totals."""
    outs = [p.out for p in parts if p.out is not None]
    for p in parts:
        if p.out is not None and not p.reused:
            totals.new_decisions.extend(p.out.new_decisions)
            _write_spills(p.out.spills, env.staging / "spill")
            if p.out.violations:
                totals.new_decisions.append(_violation_rows(p.out.violations, p.out.calls, env.spec, env.target,
                                                            ledger))
        totals.add(p)
    if outs:
        sources, presorted = [o.tables for o in outs], len(parts) == 1 and parts[0].presorted
        # the request store's tables are sorted now (the simulation's store reads them below); the
        # others, the batch's blocks above all, on the writer thread, where they are written
        store = sorted_tables(sources, presorted, STORE_TABLES)
        kept = parts[0].kept if len(parts) == 1 else None
        writers.write_batch(lambda: {**sorted_tables(sources, presorted, OTHER_TABLES), **store}, parts[0].index, kept)
        facts = pl.concat([o.facts for o in outs], how="vertical_relaxed").sort("session_id", "thread_id", "call")
        if kept is not None and (kept["call_facts"][1] is not None or not facts.height):
            writers.keep("call_facts", *kept["call_facts"], parts[0].index)
        else:
            writers.append("call_facts", facts.to_arrow(), parts[0].index)
        totals.add_store(store, pl.concat([o.applied for o in outs], how="vertical_relaxed"),
                         pl.concat([o.calls.select("thread_key", "call", "is_pending") for o in outs]))


def _simulate(totals: Totals, calls: pl.DataFrame, applied: pl.DataFrame) -> tuple[pl.DataFrame, dict[str, Any]]:
    """The prompt-cache simulation over every call of the run (cachesim.after_replay, from the
    per-call facts and the request store the batches kept)."""
    from ctxreplay.errors import CtxReplayError
    from ctxreplay.pipeline.cost import calibrate
    from ctxreplay.pipeline.cost.cachesim import Prepared, sim_outcome, simulate
    from ctxreplay.pipeline.cost.prices import PriceBook

    t0 = time.perf_counter()
    warnings: list[str] = []
    try:
        prices: Any = PriceBook.load()
    except CtxReplayError as exc:
        prices = None
        warnings.append(f"no prices: {exc}")
    facts = totals.frame(totals.facts)
    prep = Prepared(calibrate.fit(calls, facts.drop("answer_timestamp", "answer_api", "answer_provider", strict=False)),
                    facts)
    res = simulate(calls, totals.sim_store, prep, decisions=applied, prices=prices, aliases=totals.aliases)
    return sim_outcome(res, prices, warnings, t0)


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
        raise output_error(spill_dir.parent, exc) from exc


def _queue_decisions(totals: Totals, ledger: Ledger, spec: PipelineSpec) -> None:
    """Queue the run's new decisions in the ledger, stage by stage in pipeline order (then the
    violations), each stage's rows of every batch together in key order: the ledger's rows and
    their seq numbers are then those of a run in one batch, whatever the batch size."""
    by_stage: dict[tuple[str, int, str], list[pl.DataFrame]] = {}
    for rows, stage, version, digest in totals.new_decisions:
        by_stage.setdefault((stage, version, digest), []).append(rows)
    totals.new_decisions = []
    for (stage, version, digest), parts in by_stage.items():
        rows = pl.concat([p for p in parts if p.height], how="diagonal_relaxed") if any(p.height for p in parts) \
            else parts[0]
        if len(parts) > 1 and rows.height:
            rows = rows.sort(DECISION_KEY, nulls_last=False, maintain_order=True)
        ledger.stage(rows, spec_sha256=spec.sha256, stage=stage, stage_version=version, config_digest=digest)


def _violation_rows(violations: list[Violation], calls: pl.DataFrame, spec: PipelineSpec, target: str,
                    ledger: Ledger) -> tuple[pl.DataFrame, str, int, str]:
    """`violation` ledger rows (stage `validate:<target>`), only those no earlier run recorded."""
    from ctxreplay.pipeline.targets.validate import violation_decisions

    keys = {r["thread_key"]: (r["session_id"], r["thread_id"])
            for r in calls.select("thread_key", "session_id", "thread_id").unique().iter_rows(named=True)}
    rows = pl.from_arrow(pa.Table.from_pylist(violation_decisions(violations, keys), schema=STAGE_DECISION))
    stage = f"validate:{target}"
    earlier = ledger.earlier(spec.sha256, stage, sorted(set(rows.get_column("session_id").to_list()))).collect(engine=POLARS_ENGINE)
    new = rows.unique(DECISION_KEY, keep="first", maintain_order=True).join(
        earlier.select(DECISION_KEY), on=DECISION_KEY, how="anti", nulls_equal=True).sort(DECISION_KEY)
    return new, stage, 1, spec.sha256



def _write_parquet(path: Path, table: pa.Table, *, run_id: str, out_dir: Path, **options: Any) -> None:
    """Write into the staging directory (no temp file needed: nothing reads it before it is
    published); the run id goes into the file's metadata, so a reader can tell runs apart."""
    meta = {**(table.schema.metadata or {}), RUN_ID_KEY: run_id.encode()}
    try:
        pq.write_table(table.replace_schema_metadata(meta), path, **{**COMPRESSION, **options})
    except OSError as exc:
        raise output_error(out_dir, exc) from exc


def _write_json(path: Path, obj: Any, *, out_dir: Path) -> None:
    try:
        path.write_bytes(orjson.dumps(obj, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS) + b"\n")
    except OSError as exc:
        raise output_error(out_dir, exc) from exc


@dataclass(frozen=True)
class RunFacts:
    """What the summary is made of."""

    loaded: LoadResult
    spec: PipelineSpec
    target: str
    calls: pl.DataFrame | pa.Table  # (a table when the run reused every output)
    totals: Totals
    out_dir: Path
    ledger_path: Path
    timings: dict[str, float]
    counter: TokenCounter


def _stage_names(spec: PipelineSpec) -> list[str]:
    """The stages' names in pipeline order, as run_stages names them (`pairing#2` for a second use)."""
    return position_names(spec.stages)


def _summary(f: RunFacts) -> dict[str, Any]:
    """summary.json (README: "Outputs")."""
    calls, t = f.calls, f.totals
    order = {n: i for i, n in enumerate(_stage_names(f.spec))}
    t.stage_stats = dict(sorted(t.stage_stats.items(), key=lambda kv: order.get(kv[0], len(order))))
    n_calls, pending, sessions = _call_counts(calls)
    return {
        "pipeline": f.spec.name,
        "pipeline_sha256": f.spec.sha256,
        "target": f.target,
        **_input_counts(f.loaded),
        "sessions": sessions,
        "threads": t.threads,
        "calls": n_calls,
        "recorded_calls": n_calls - pending,
        "pending_calls": pending,
        "decisions": {k: v["decisions"] for k, v in t.stage_stats.items()},
        "decisions_by_stage": t.stage_stats,
        "conflicts": sum(v["conflicts"] for v in t.stage_stats.values()),
        "stage_failures": [x.as_dict() for x in t.failures],
        "violations": len(t.violations),
        "violations_by_rule": dict(sorted(Counter(v.rule for v in t.violations).items())),
        "loader_stats": dict(sorted(f.loaded.stats.items())),
        "tokens": {"counter": f.counter.name, "texts_counted": f.counter.counted, "cache_hits": f.counter.cache_hits},
        "timings_seconds": {k: round(v, 3) for k, v in f.timings.items()},
        "out_dir": str(f.out_dir),
        "ledger": str(f.ledger_path),
        "versions": _versions(f.spec),
    }


def _call_counts(calls: pl.DataFrame | pa.Table) -> tuple[int, int, int]:
    """(calls, pending calls, sessions) of the run's calls: a frame, or the Arrow table of a run
    that reused every output (read without polars: ctxreplay/deferred.py)."""
    if isinstance(calls, pa.Table):
        pending = sum(1 for v in calls.column("is_pending").to_pylist() if v)
        return calls.num_rows, pending, len(set(calls.column("session_id").to_pylist()))
    if not calls.height:
        return 0, 0, 0
    return calls.height, calls.filter(pl.col("is_pending")).height, calls.get_column("session_id").n_unique()


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
    from importlib.metadata import version

    import duckdb

    # tiktoken's and polars' versions from their installed metadata: a run that counts no token
    # (a warm one) does not import tiktoken (~12 ms), and one that reused every output not polars
    # (ctxreplay/deferred.py). polars pins its runtime's version to its own.
    return {"ctxreplay": __version__, "polars": version("polars"), "pyarrow": pa.__version__,
            "duckdb": duckdb.__version__, "tiktoken": version("tiktoken"), "python": sys.version.split()[0],
            "stages": {s.stage.name: s.stage.version for s in spec.stages}}


__all__ = [
    "CHARS4_COUNTER",
    "RunOptions",
    "RunResult",
    "SchemaMismatch",
    "run",
]
