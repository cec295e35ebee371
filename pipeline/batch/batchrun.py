"""One batch of session groups: load → stages → replay, with no ledger writes and no output files
but the requests/ of its threads (issue 10, point 1).

`run_batch` is what the runner (in-process) or a worker process (`--jobs`) runs per batch. It reads
the ledger only through `Env.earlier` (the earlier decisions of some sessions) and the token cache
through its counter; it returns everything the parent writes, in batch order: the new decisions
per stage (for the ledger), the output tables (sorted by keys: the same rows in the same order
whatever the run), the per-call facts the prompt-cache simulation needs at the end of the run,
and the counts the summary sums.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import polars as pl
import pyarrow as pa

from ctxreplay.errors import InputError, OutputError, internal_error
from ctxreplay.pipeline.assembly.replay import call_counts, call_skeleton
from ctxreplay.pipeline.assembly.replayall import replay_all
from ctxreplay.pipeline.batch.batches import Group
from ctxreplay.pipeline.core import crashpoints, profile
from ctxreplay.pipeline.core.progress import Progress
from ctxreplay.pipeline.core.tokens import TokenCounter, text_sha
from ctxreplay.pipeline.core.words import plural
from ctxreplay.pipeline.loaders import LoadResult, load_paths
from ctxreplay.pipeline.loaders.base import path_str
from ctxreplay.pipeline.stageapi.registry import StageContext
from ctxreplay.pipeline.staging.spec import PipelineSpec
from ctxreplay.pipeline.staging.stagerun import CallMap, LedgerView, StageFailure, run_stages
from ctxreplay.pipeline.targets import Violation, get_target
from ctxreplay.schemas.blocks import BLOCKS
from ctxreplay.schemas.check import check_frame, empty_table, to_arrow
from ctxreplay.schemas.quarantine import QUARANTINE

BLOCK_ORDER = ["session_id", "thread_id", "order_key", "entry_id", "block_pos", "part_pos", "first_call"]
DECISION_ORDER = ["session_id", "thread_id", "entry_id", "block_pos", "part_pos", "from_call", "stage", "action"]


@dataclass
class Env:
    """What every batch of a run shares."""

    spec: PipelineSpec
    target: str
    staging: Path
    out_dir: Path
    all_calls: bool
    validate: bool
    # sessions -> their earlier decisions in this namespace (Ledger.earlier_all's frame)
    earlier: Callable[[list[str]], pl.DataFrame]
    counter: TokenCounter
    progress: Progress | None = None
    profile: bool = False  # count the polars collects of each phase and stage position (`run --profile`)


@dataclass
class BatchResult:
    index: int
    loaded: LoadResult  # accounting only: its blocks are dropped
    # None when the batch's files hold no line at all (nothing to stage, replay or write)
    out: BatchOutputs | None = None
    groups: list[dict[str, Any]] = field(default_factory=list)  # per group: what the manifest keeps
    reused: bool = False  # groups taken from the previous run (pipeline/batch/reuse.py)
    # reused rows read from one row group per output file: already in batchout.sorted_tables' order
    presorted: bool = False
    # every group of the batch reused, the batch made of the same groups as in the previous run:
    # output name -> (previous file, this batch's row group there or None), copied as bytes
    # (batchout.Writers.write_batch); its blocks are not read
    kept: dict[str, tuple[Any, int | None]] | None = None


@dataclass
class BatchOutputs:
    tables: dict[str, pa.Table]  # blocks, quarantine, decisions, messages, call_messages
    calls: pl.DataFrame
    # per call: calibrate.recorded_facts of the loaded blocks and cachesim.answer_times of the final ones
    facts: pl.DataFrame
    new_decisions: list[tuple[pl.DataFrame, str, int, str]]  # rows, stage, stage_version, config_digest
    spills: pl.DataFrame
    stage_stats: dict[str, dict[str, Any]]
    failures: list[StageFailure]
    violations: list[Violation]
    replay_stats: dict[str, Any]
    applied: pl.DataFrame
    seconds: dict[str, float] = field(default_factory=dict)
    profile: dict[str, Any] | None = None  # with Env.profile: the pass's figures (StagesResult.profile + phases)


class BatchCounter(TokenCounter):
    """A TokenCounter whose memory of texts lasts one batch (`forget`), with the counts kept by
    sha256 for the rest of the run: a text seen in an earlier batch is neither counted again nor
    looked up in the cache (as when everything was one batch), and memory holds no texts."""

    def __init__(self, name: str, cache: Any = None) -> None:
        super().__init__(name, cache)
        self.by_sha: dict[str, int] = {}

    def count_many(self, texts: Any) -> dict[str, int]:
        memo = self.by_text
        todo = {t for t in texts if t is not None and t not in memo}
        shas = {t: text_sha(t) for t in todo}
        rest = []
        for t, sha in shas.items():
            n = self.by_sha.get(sha)
            if n is None:
                rest.append(t)
            else:
                memo[t] = n
        out = super().count_many(rest)
        for t in rest:
            self.by_sha[shas[t]] = out[t]
        return out

    def forget(self) -> None:
        self.by_text = {}


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Loading and replay build many long-lived small objects; Python's cyclic GC would rescan them
    over and over (a cost that grows faster than the input), and they hold no cycles worth it."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def load_batch(groups: list[Group], say: Progress,
               ) -> tuple[LoadResult, list[LoadResult], list[list[str]], pl.DataFrame]:
    """Load a batch group by group (each group as a load of all the files would read it); the
    batch's accounting, each group's (its blocks not kept: the batch's hold them), each group's
    sessions, and the blocks of the batch (checked)."""
    say(f"loading {plural(sum(len(g.files) for g in groups), 'file')}")
    crashpoints.phase("load")
    try:
        with gc_paused():
            # one load for the batch: each load has a fixed cost, which
            # per group made the corpus load 5x slower
            # listed: a file gone or replaced since the run listed it is skipped, not an error
            loaded = load_paths([f for g in groups for f in g.files], listed=True)
    except OSError as exc:
        raise InputError(f"cannot read the input: {exc}. Check the path and its permissions") from exc
    for ld in loaded.loads:
        ld.check()
        ld.digests = {}  # used inside the load only
    blocks = pl.from_arrow(loaded.blocks)
    assert isinstance(blocks, pl.DataFrame)
    check_frame(blocks, BLOCKS, where="on load")
    # each group's sessions, from the sessions of each file (one query: filtering the batch's blocks
    # once per group copied them all, a group at a time, only to read their session ids)
    pairs = loaded.blocks.select(["source_file", "session_id"]).group_by(["source_file", "session_id"]).aggregate([])
    by_file: dict[str, set[str]] = {}
    for f, sid in zip(pairs.column("source_file").to_pylist(), pairs.column("session_id").to_pylist(), strict=True):
        by_file.setdefault(f, set()).add(sid)
    sessions = [sorted({sid for f in g.files for sid in by_file.get(path_str(f), ())}) for g in groups]
    parts = [dataclasses.replace(loaded, blocks=empty_table(BLOCKS))] if len(groups) == 1 else \
        [_group_part(loaded, g) for g in groups]
    return loaded, parts, sessions, blocks


def _group_part(loaded: LoadResult, g: Group) -> LoadResult:
    """One session group's share of a batch's accounting: its files' loads, skips and counts (a
    session never spans two groups, so this is what loading the group alone gives); its blocks
    are the batch's."""
    names = {path_str(f) for f in g.files}
    stats: Counter[str] = Counter()
    for n in names:
        stats.update(loaded.stats_by_file.get(n, {}))
    return LoadResult(empty_table(BLOCKS), [ld for ld in loaded.loads if ld.path in names],
                      [s for s in loaded.skipped if s.get("file") in names], dict(stats),
                      sum(loaded.threads_by_file.get(n, 0) for n in names))


def run_batch(index: int, groups: list[Group], env: Env) -> BatchResult:
    """Load, run the stages and replay one batch (see the module docstring)."""
    if not env.profile:
        return _run_batch(index, groups, env)
    with profile.counting():
        return _run_batch(index, groups, env)


def _run_batch(index: int, groups: list[Group], env: Env) -> BatchResult:
    from ctxreplay.pipeline.cost.cachesim import answer_times
    from ctxreplay.pipeline.cost.calibrate import recorded_facts

    say = env.progress or (lambda s: None)
    t0, c0 = time.perf_counter(), profile.collects()
    loaded, parts, sessions, blocks = load_batch(groups, say)
    if not any(ld.lines for ld in loaded.loads) and not loaded.quarantine:
        loaded.blocks = empty_table(BLOCKS)
        return BatchResult(index, loaded, None, _group_facts(parts, sessions, None))
    skeleton = call_skeleton(blocks)
    counts = call_counts(blocks)
    calls = CallMap.from_blocks(blocks, counts)
    t1, c1 = time.perf_counter(), profile.collects()
    counter = env.counter
    recorded = recorded_facts(blocks, counter.series_counter())
    # rows no call ever sees (compacted away before any call) leave the table now
    blocks = blocks.filter(pl.col("last_call").is_null() | (pl.col("last_call") > pl.col("first_call")))
    staged = _stages(blocks, env, calls, say)
    del blocks
    t2, c2 = time.perf_counter(), profile.collects()
    final = to_arrow(staged.blocks, BLOCKS, where="on write (blocks)")
    calls_df, violations, replay_stats = _replay(final, skeleton, env, counts, say)
    t3, c3 = time.perf_counter(), profile.collects()
    facts = recorded.join(answer_times(pl.from_arrow(final)),  # type: ignore[arg-type]
                          on=["session_id", "thread_id", "call"], how="left")
    applied = staged.applied
    messages, call_messages = replay_stats.pop("store_tables")
    loaded.blocks = empty_table(BLOCKS)
    if isinstance(counter, BatchCounter):
        counter.forget()
    out = BatchOutputs(
        {"blocks": final, "quarantine": quarantine_table(loaded), "decisions": applied.to_arrow(),
         "messages": messages, "call_messages": call_messages},
        calls_df, facts, [(o.new, o.name, o.stage.version, o.config_digest) for o in staged.outcomes],
        staged.spills, staged.stats(), list(staged.failures), violations, replay_stats, applied,
        {"load": t1 - t0, "stages": t2 - t1, "replay": t3 - t2})
    if env.profile:  # (the recorded facts are counted with the stages: they run between t1 and the stages)
        out.profile = {**staged.profile(), "passes": 1, "phases": {
            "load": {"seconds": t1 - t0, "collects": c1 - c0}, "stages": {"seconds": t2 - t1, "collects": c2 - c1},
            "replay": {"seconds": t3 - t2, "collects": c3 - c2}}}
    return BatchResult(index, loaded, out, _group_facts(parts, sessions, out))


def quarantine_table(loaded: LoadResult) -> pa.Table:
    return pa.Table.from_pylist(
        [{"file": q.file, "line": q.line, "raw": q.raw, "reason": q.reason, "code": q.code,
          "raw_base64": q.raw_base64, "line_bytes": q.line_bytes} for q in loaded.quarantine], schema=QUARANTINE)


def _group_facts(parts: list[LoadResult], sessions: list[list[str]], out: BatchOutputs | None) -> list[dict[str, Any]]:
    """What the manifest keeps of each group (pipeline/batch/manifest.py): its sessions, its accounting,
    its replayed threads and violations, and its decisions counted per stage as a re-run that
    reuses them all would count them. The batch's calls and decisions are counted per session
    once (a query per group and stage cost about 0.2 s of a cold run of the 190 MB tree)."""

    threads: Counter[str] = Counter()  # per session: its threads, their keys, its decisions counted
    keys: dict[str, set[str]] = {}
    decided: dict[str, list[tuple[Any, ...]]] = {}
    if out is not None:
        for sid, key in out.calls.select("session_id", "thread_key").unique().iter_rows():
            threads[sid] += 1
            keys.setdefault(sid, set()).add(key)
        counts = out.applied.group_by("session_id", "stage", "action", "reason").agg(
            n=pl.len(), prov=pl.col("is_provisional").sum())
        for sid, *rest in counts.iter_rows():
            decided.setdefault(sid, []).append(tuple(rest))
    return [_one_group(lr, mine, out, threads, keys, decided) for lr, mine in zip(parts, sessions, strict=True)]


def _one_group(lr: LoadResult, sessions: list[str], out: BatchOutputs | None, threads: Counter[str],
               keys: dict[str, set[str]], decided: dict[str, list[tuple[Any, ...]]]) -> dict[str, Any]:
    """One group's manifest facts (`_group_facts`), from its sessions' counts."""
    from ctxreplay.pipeline.batch.manifest import load_to_dict

    facts: dict[str, Any] = {"sessions": sessions, "loads": [load_to_dict(ld) for ld in lr.loads],
                             "skipped": lr.skipped, "stats": dict(lr.stats), "loaded_threads": lr.threads,
                             "threads": 0, "violations": [], "stage_stats": {}}
    if out is None or not sessions:
        return facts
    facts["threads"] = sum(threads[s] for s in sessions)
    mine = set().union(*(keys.get(s, ()) for s in sessions))
    facts["violations"] = [dataclasses.asdict(v) for v in out.violations if v.thread_key in mine]
    by_stage: dict[str, tuple[list[int], Counter[str]]] = {name: ([0, 0, 0], Counter()) for name in out.stage_stats}
    for s in sessions:
        for stage, action, reason, n, prov in decided.get(s, ()):
            if stage not in by_stage:
                continue
            tot, by_reason = by_stage[stage]
            tot[0] += n
            tot[1] += int(prov or 0)
            tot[2] += n if action == "conflict" else 0
            by_reason[f"{action}:{reason}"] += n
    for name, ((n, prov, conflicts), by_reason) in by_stage.items():
        facts["stage_stats"][name] = {"decisions": n, "new_decisions": 0, "reused_decisions": n - prov - conflicts,
                                      "provisional_decisions": prov, "conflicts": conflicts,
                                      "by_reason": dict(sorted(by_reason.items())), "seconds": 0.0}
    return facts


def _stages(blocks: pl.DataFrame, env: Env, calls: CallMap, say: Progress) -> Any:
    """Run the stages with the ledger's view of these sessions."""
    target = get_target(env.target)
    counter = env.counter
    # every target shipped today takes images; one that does not says so with `supports_images = False`
    ctx = StageContext(target=env.target, window_tokens=env.spec.window_tokens,
                       count_tokens=counter.series_counter(), token_counter_version=counter.name,
                       supports_images=bool(getattr(target, "supports_images", True)))
    sessions = sorted(blocks.get_column("session_id").unique().to_list())
    view = LedgerView.translate(env.earlier(sessions), calls)
    crashpoints.phase("stages")
    return run_stages(blocks, env.spec, view, ctx, say)


def _replay(final: pa.Table, skeleton: pl.DataFrame, env: Env, counts: dict[tuple[str, str], int],
            say: Progress) -> tuple[pl.DataFrame, list[Violation], dict[str, Any]]:
    say("replaying calls")
    crashpoints.phase("replay")
    try:
        with gc_paused():
            return replay_all(pl.from_arrow(final), skeleton, env.target, env.counter,  # type: ignore[arg-type]
                              all_calls=env.all_calls, validate=env.validate, out_dir=env.staging,
                              progress=env.progress, counts=counts)
    except OSError as exc:
        raise output_error(env.out_dir, exc) from exc
    except AssertionError as exc:  # an internal check of the replay failed: a bug, kept in a file
        raise internal_error(exc, "while replaying") from exc


def output_error(out_dir: Path, exc: OSError) -> OutputError:
    where = f" ({exc.filename})" if exc.filename else ""
    return OutputError(f"cannot write the outputs in {out_dir}: {exc.strerror or exc}{where}. The previous "
                       f"outputs are kept; free some space or pass an --out you can write to")


__all__ = [
    "BLOCK_ORDER",
    "DECISION_ORDER",
    "BatchCounter",
    "BatchOutputs",
    "BatchResult",
    "Env",
    "gc_paused",
    "load_batch",
    "output_error",
    "quarantine_table",
    "run_batch",
]
