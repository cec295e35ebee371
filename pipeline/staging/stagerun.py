"""Running the stages of a pipeline over one batch of sessions: `run_stages(blocks, spec, view, ctx)`.

For each stage, in the spec's order:

1. **Re-apply** its frozen decisions from the ledger view (`RegisteredStage.frozen` actions), with
   the block-edit API, then let the stage rebuild the rows it inserted (`rebuild` hook). One policy
   for a mismatch: a decision is re-applied only to the version of its block seen at its
   `from_call` whose content hash equals its `before_sha256`. Otherwise it is not applied, and a
   `conflict` decision is recorded (reason `hash_mismatch`, or `missing_target` when no version is
   seen there); the stage gets the conflict rows in its ledger view and decides the block afresh.
   `--strict` runs fail on conflicts.
2. **Run** the stage (built-ins in-process; plug-ins in a worker process with a time budget, see
   pipeline/staging/isolation.py), check what it returns against the schemas. A stage with a quick
   check (`@stage(quiet=...)`, ctxreplay.pipeline.stageapi.quiet) and no earlier decision is asked
   it first; where it holds, its plan does not run and it decides nothing. The checks of
   consecutive positions are asked in one query over the same rows (`_ask_ahead`).
3. **Reconcile** its decisions with the ledger: decisions for a thread's pending call are
   provisional (applied, never frozen); the others are new (to write), already in the ledger
   (reused), or clash with the ledger's outcome for the same key (`conflict`, `ledger_mismatch`).

A plug-in that raises, returns a frame off the schema or runs past its budget is quarantined: it is
retried session by session, its effect is skipped for the sessions where it fails (for the rest of
the run), and a `stage_failed` decision records why. A built-in stage that fails is a bug in
ctxreplay and stops the run (`StageFailed`).

Nothing here does I/O or keeps global state: the runner reads the ledger view before and writes the
new decisions and spilled texts after, so this runs per batch, in any process.
"""

from __future__ import annotations

import functools
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
import polars as pl
import pyarrow as pa

from ctxreplay.errors import CtxReplayError, StageFailed
from ctxreplay.pipeline.core import crashpoints, profile
from ctxreplay.pipeline.core.blockops import append_sorted, block_schema, decision_schema, sort_blocks
from ctxreplay.pipeline.core.constants import PART_KEY, POLARS_ENGINE, THREAD, VERSION_KEY
from ctxreplay.pipeline.core.progress import Progress
from ctxreplay.pipeline.stageapi.marks import finish, mark_drop, mark_replace_from, start_marks
from ctxreplay.pipeline.stageapi.registry import RegisteredStage, StageContext, StageRef, StageResult
from ctxreplay.pipeline.staging.invoke import invoke_inline, stage_raised
from ctxreplay.schemas.blocks import BLOCKS, CONTENT_COLUMNS
from ctxreplay.schemas.check import SchemaMismatch, check_frame, conform
from ctxreplay.schemas.decisions import DECISION_KEY, STAGE_DECISION

_WITH_STAGE = pa.schema([*STAGE_DECISION, pa.field("stage", pa.string())])  # a LedgerView's decisions


# The frames and schemas below are made at their first use, not at import (a run that reuses every
# output imports no polars: ctxreplay/deferred.py); each is shared and never changed. A frame from
# a schema costs ~0.3 ms.
@functools.cache
def no_decisions() -> pl.DataFrame:
    return pl.DataFrame(schema=decision_schema())


@functools.cache
def _no_marked() -> pl.DataFrame:  # no decision applied
    return pl.DataFrame(schema={**decision_schema(), "is_provisional": pl.Boolean})


@functools.cache
def _no_keyed() -> pl.DataFrame:  # no decision to write
    return pl.DataFrame(schema={**decision_schema(), "call_key": pl.String})


@functools.cache
def _call_keys_schema() -> dict[str, Any]:
    return {"session_id": pl.String, "thread_id": pl.String, "call": pl.Int32, "call_key": pl.String}


@functools.cache
def _pending_schema() -> dict[str, Any]:
    return {"session_id": pl.String, "thread_id": pl.String, "pending_call": pl.Int32}


STAGE_FAILED = "stage_failed"


# ---------------------------------------------------------------------------------------------
# the calls of this run and the ledger as this run sees it


def _pending_frame(pending: dict[tuple[str, str], int]) -> pl.DataFrame:
    """CallMap.pending from the calls per (session, thread)."""
    return pl.DataFrame({"session_id": [s for s, _ in pending], "thread_id": [t for _, t in pending],
                         "pending_call": list(pending.values())}, schema=_pending_schema())


@dataclass(frozen=True)
class CallMap:
    """This run's calls. `pending`: each thread's pending call (its decisions are provisional).
    `keys`: each call's key, the `msg_key` of the assistant message that answers it: calls with the
    same key have the same history, whatever their thread is named in this run or was named in the
    run that decided for them (a rewind turns the main thread of a half-written file into a branch)."""

    keys: pl.DataFrame = field(default_factory=lambda: pl.DataFrame(schema=_call_keys_schema()))
    pending: pl.DataFrame = field(default_factory=lambda: pl.DataFrame(schema=_pending_schema()))

    @classmethod
    def from_blocks(cls, blocks: pl.DataFrame, pending: dict[tuple[str, str], int] | None = None) -> CallMap:
        """From the loaded blocks: call k of a thread starts at its k-th message (in order) that is a
        call of some thread of the session (its own, or history it shares with another thread).
        A thread whose count of such messages is not its number of calls gets no keys (its
        decisions are then keyed by thread name and call, as before call keys)."""
        b = blocks.lazy()
        if pending is None:
            n = b.group_by(THREAD).agg(pending_call=pl.col("first_call").max().cast(pl.Int32))
        else:
            n = _pending_frame(pending).lazy()
        call_msgs = b.filter(pl.col("is_call")).select("session_id", "msg_key").unique()
        starts = (
            b.group_by([*THREAD, "msg_key"]).agg(_order=pl.col("order_key").min())
            .join(call_msgs, on=["session_id", "msg_key"], how="semi")
            .sort([*THREAD, "_order", "msg_key"])
            .with_columns(call=pl.int_range(pl.len(), dtype=pl.Int32).over(THREAD))
        )
        complete = starts.group_by(THREAD).agg(_n=pl.len().cast(pl.Int32)).join(n, on=THREAD).filter(
            pl.col("_n") == pl.col("pending_call")).select(THREAD)
        keys = starts.join(complete, on=THREAD, how="semi").select(*THREAD, "call", call_key="msg_key")
        pend = n.select(list(_pending_schema())).cast(_pending_schema()) if pending is None else n  # type: ignore[arg-type]
        return cls(keys=keys.cast(_call_keys_schema()).collect(engine=POLARS_ENGINE),  # type: ignore[arg-type]
                   pending=pend.collect(engine=POLARS_ENGINE))

    def extended(self, before: pl.DataFrame, rows: pl.DataFrame, pending: dict[tuple[str, str], int]) -> CallMap | None:
        """The map of `before` + `rows` (from_blocks over both) where `rows` are new messages at the
        end of one thread: their msg_keys new to the session, every row after the thread's rows in
        order; the thread keyed before (its call messages as many as its calls) and after. Its new
        call messages are then its next calls, in order, and no other thread changes. None where
        that does not hold (from_blocks says). `pending`: the calls per thread of both."""
        pend = _pending_frame(pending)
        if not rows.height:
            return CallMap(self.keys, pend)
        threads = rows.select(THREAD).unique()
        if threads.height != 1:
            return None
        sid, tid = threads.row(0)
        old = pl.col("session_id") == sid
        mine = old & (pl.col("thread_id") == tid)
        # one query over the earlier rows: the thread's last order, and whether a new msg_key is known
        last, known = before.select(
            pl.col("order_key").filter(mine).max(),
            pl.col("msg_key").filter(old).is_in(rows.get_column("msg_key").unique().implode()).any()).row(0)
        had = self.keys.filter(mine).height
        was = self.pending.filter(mine).get_column("pending_call")
        new_calls = rows.filter(pl.col("is_call")).group_by("msg_key").agg(_order=pl.col("order_key").min()) \
            .sort("_order", "msg_key")
        if known or (last is not None and rows.get_column("order_key").min() <= last) \
                or had != (was.item() if was.len() == 1 else 0) or had + new_calls.height != pending.get((sid, tid)):
            return None
        added = new_calls.select(session_id=pl.lit(sid), thread_id=pl.lit(tid),
                                 call=pl.int_range(had, had + new_calls.height, dtype=pl.Int32), call_key="msg_key")
        return CallMap(pl.concat([self.keys, added.cast(_call_keys_schema())]), pend)  # type: ignore[arg-type]

    def with_keys(self, decisions: pl.DataFrame) -> pl.DataFrame:
        """`decisions` with the `call_key` of their (thread, from_call) (null where none)."""
        if not decisions.height:
            return decisions.with_columns(call_key=pl.lit(None, pl.String))
        return decisions.join(self.keys.rename({"call": "from_call"}), on=[*THREAD, "from_call"], how="left")


@dataclass(frozen=True)
class LedgerView:
    """The ledger's earlier decisions for the sessions of a batch, in this run's threads and calls.

    `decisions`: STAGE_DECISION columns plus `stage` (the stage's name in the run, `pairing#2` for
    a second use). A decision keyed by call (`call_key`) is translated to every thread of this run
    whose call has that key; one written before call keys keeps its thread name and call."""

    calls: CallMap = field(default_factory=CallMap)
    decisions: pl.DataFrame = field(default_factory=lambda: pl.DataFrame(schema={**decision_schema(),
                                                                                 "stage": pl.String}))
    # each position's rows (for_stage), split once per view: a filter and a collect per position
    # and pass cost ~1 ms each
    _by_stage: dict[str, pl.DataFrame] | None = field(default=None, compare=False, repr=False)

    @classmethod
    def translate(cls, raw: pl.DataFrame, calls: CallMap) -> LedgerView:
        """From the ledger's rows (STAGE_DECISION + stage, seq, call_key), in seq order."""
        cols = [*decision_schema().names(), "stage"]
        keyed = raw.filter(pl.col("call_key").is_not_null()).drop("thread_id", "from_call").join(
            calls.keys.rename({"call": "from_call"}), on=["session_id", "call_key"], how="inner")
        legacy = raw.filter(pl.col("call_key").is_null())
        both = pl.concat([keyed.select(*cols, "seq"), legacy.select(*cols, "seq")]).sort("seq")
        view = both.unique(["stage", *DECISION_KEY], keep="first", maintain_order=True).select(cols)
        return cls(calls, view)

    def for_stage(self, name: str) -> pl.DataFrame:
        if not self.decisions.height:  # no earlier decision at all (a first run): nothing to filter
            return no_decisions()
        parts = self._by_stage
        if parts is None:
            whole = conform(self.decisions, _WITH_STAGE).collect(engine=POLARS_ENGINE)
            parts = {k[0]: v for k, v in whole.partition_by("stage", as_dict=True, include_key=False,
                                                              maintain_order=True).items()}
            object.__setattr__(self, "_by_stage", parts)
        got = parts.get(name)
        return no_decisions() if got is None else got


# ---------------------------------------------------------------------------------------------
# results


@dataclass(frozen=True)
class StageStats:
    """Counts of one stage position in one run (summary.json's `decisions_by_stage`)."""

    decisions: int
    new_decisions: int
    reused_decisions: int
    provisional_decisions: int
    conflicts: int
    by_reason: dict[str, int]
    seconds: float
    failed_sessions: int = 0
    collects: int | None = None  # polars plans run at this position, when counted (pipeline/core/profile.py)
    quiet: bool = False  # its quick check held: its plan did not run

    def as_dict(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in ("decisions", "new_decisions", "reused_decisions",
                                              "provisional_decisions", "conflicts", "by_reason")}
        out["seconds"] = round(self.seconds, 3)
        if self.failed_sessions:
            out["failed_sessions"] = self.failed_sessions
        if self.collects is not None:
            out["collects"] = self.collects
        return out


@dataclass(frozen=True)
class StageFailure:
    """A plug-in quarantined for some sessions: what happened, where, and to which sessions."""

    stage: str
    position: int
    owner: str
    kind: str
    message: str
    sessions: tuple[str, ...]

    def as_dict(self) -> dict[str, Any]:
        return {"stage": self.stage, "position": self.position, "owner": self.owner, "kind": self.kind,
                "message": self.message, "sessions": list(self.sessions)}


@dataclass(frozen=True)
class StageOutcome:
    """One position of the pipeline: the decisions it applied and the ones new to the ledger."""

    name: str
    position: int
    stage: RegisteredStage
    config_digest: str
    applied: pl.DataFrame  # STAGE_DECISION + is_provisional
    new: pl.DataFrame  # STAGE_DECISION + call_key: to write to the ledger
    stats: StageStats


@dataclass(frozen=True)
class StagesResult:
    """What `run_stages` returns: the final blocks, one outcome per position, the plug-in failures
    and the texts to spill (sha256, text)."""

    blocks: pl.DataFrame
    outcomes: tuple[StageOutcome, ...]
    failures: tuple[StageFailure, ...]
    spills: pl.DataFrame
    # the quick checks asked ahead, several positions in one query (`_ask_ahead`): queries,
    # positions asked, seconds, and polars collects when counted; not in any position's figures
    checks: dict[str, Any] = field(default_factory=dict)

    @property
    def applied(self) -> pl.DataFrame:
        """Every decision this run applied (reused ones too), with `stage`, `stage_version` and
        `is_provisional` (decisions.parquet)."""
        parts = [o.applied.with_columns(stage=pl.lit(o.name), stage_version=pl.lit(o.stage.version, pl.Int32))
                 for o in self.outcomes]
        empty = pl.DataFrame(schema={**decision_schema(), "is_provisional": pl.Boolean, "stage": pl.String,
                                     "stage_version": pl.Int32})
        return pl.concat(parts) if parts else empty

    @property
    def conflicts(self) -> int:
        return sum(o.stats.conflicts for o in self.outcomes)

    def stats(self) -> dict[str, dict[str, Any]]:
        return {o.name: o.stats.as_dict() for o in self.outcomes}

    def profile(self) -> dict[str, Any]:
        """What `ctxreplay run --profile` shows of this pass: per position its seconds, polars
        collects (when counted) and whether its quick check held; the checks asked together."""
        return {"stages": {o.name: {"seconds": o.stats.seconds, "collects": o.stats.collects or 0,
                                    "quiet": int(o.stats.quiet)} for o in self.outcomes},
                "checks": {"queries": 0, "positions": 0, "seconds": 0.0, "collects": 0, **self.checks}}


# ---------------------------------------------------------------------------------------------
# 1. re-applying frozen decisions


@dataclass(frozen=True)
class Reapplied:
    """The blocks with a stage's frozen decisions re-applied, the decisions that did so (rebuilt
    inserts included), the conflicts, and the ledger view the stage itself gets."""

    blocks: pl.DataFrame
    decisions: pl.DataFrame
    conflicts: pl.DataFrame
    view: pl.DataFrame
    ordered: bool = False  # `blocks` in block order (sort_blocks)


def _replacement_struct() -> pl.DataType:
    return pl.Struct({c: block_schema()[c] for c in CONTENT_COLUMNS})


def _conflicts(targets: pl.LazyFrame, led: pl.LazyFrame) -> tuple[pl.LazyFrame, pl.LazyFrame]:
    """Split the targeted versions: those whose content matches the decision (to apply), and the
    conflict decisions for the others and for decisions whose target is seen by no version."""
    ok_hash = pl.col("content_sha256") == pl.col("_lb")
    bad = targets.filter(~ok_hash)
    missing = led.join(targets.select(*PART_KEY, "_lf"), on=[*PART_KEY, "_lf"], how="anti", nulls_equal=True)
    rows = pl.concat([
        bad.select(*PART_KEY, _lf="_lf", _reason=pl.lit("hash_mismatch"), _before="_lb", _after="content_sha256",
                   _epoch="cache_epoch"),
        missing.select(*PART_KEY, _lf="_lf", _reason=pl.lit("missing_target"), _before="_lb",
                       _after=pl.lit(None, pl.String), _epoch=pl.lit(0, pl.Int32)),
    ])
    conflicts = conform(rows.select(
        *PART_KEY, tool_use_id=pl.lit(None, pl.String), from_call="_lf", action=pl.lit("conflict"),
        reason="_reason", before_sha256="_before", after_sha256="_after", before_len=pl.lit(None, pl.Int64),
        after_len=pl.lit(None, pl.Int64), replacement=pl.lit(None, pl.String), cache_epoch="_epoch",
    ), STAGE_DECISION)
    return targets.filter(ok_hash), conflicts


@dataclass
class _Kept:
    """One position's re-application in the last pass: its ledger view, the hash of each input row,
    and what it gave."""

    earlier: pl.DataFrame
    hashes: pl.Series
    result: Reapplied


class ReapplyMemo:
    """What each position's re-application gave in the last pass over one session (the live
    engine keeps one per session). A pass whose input holds every row of the last one, unchanged,
    plus rows no frozen decision targets, and whose ledger view is the same, gets the same blocks
    with the new rows added, the same decisions and conflicts: re-applying is row by row, and a row
    no decision targets is left as it is."""

    def __init__(self) -> None:
        self._kept: dict[str, _Kept] = {}

    def reapply(self, name: str, stage: RegisteredStage, blocks: pl.DataFrame, earlier: pl.DataFrame) -> Reapplied:
        if stage.rebuild is not None or not earlier.height:  # a rebuild looks at every row
            self._kept.pop(name, None)
            return reapply(stage, blocks, earlier)
        hashes = blocks.hash_rows()
        kept = self._kept.get(name)
        if kept is not None and kept.earlier.equals(earlier):
            new = ~hashes.is_in(kept.hashes.implode())
            added = blocks.filter(new)
            if blocks.height - added.height == kept.hashes.len() and not _targeted(added, stage, earlier):
                r = kept.result
                if not added.height:
                    out = r.blocks
                elif r.ordered:  # the new rows after the kept ones, without sorting them all again
                    out = append_sorted(r.blocks, added)
                else:
                    out = sort_blocks(pl.concat([r.blocks.lazy(), added.lazy()])).collect(engine=POLARS_ENGINE)
                res = Reapplied(out, r.decisions, r.conflicts, r.view, ordered=r.ordered or bool(added.height))
                self._kept[name] = _Kept(earlier, hashes, res)
                return res
        res = reapply(stage, blocks, earlier)
        self._kept[name] = _Kept(earlier, hashes, res)
        return res


def _targeted(rows: pl.DataFrame, stage: RegisteredStage, earlier: pl.DataFrame) -> bool:
    """Some row is a version that one of the stage's frozen decisions (of `earlier`) targets."""
    if not rows.height:
        return False
    led = earlier.filter(pl.col("action").is_in(list(stage.frozen))).select(*PART_KEY, _lf=pl.col("from_call"))
    hit = rows.select(*VERSION_KEY, "last_call").join(led, on=PART_KEY, how="inner", nulls_equal=True).filter(
        (pl.col("first_call") <= pl.col("_lf")) & (pl.col("last_call").is_null() | (pl.col("last_call") > pl.col("_lf"))))
    return hit.height > 0


def reapply(stage: RegisteredStage, blocks: pl.DataFrame, earlier: pl.DataFrame) -> Reapplied:
    """Step 1 for one stage: its frozen decisions re-applied (see the module docstring's policy),
    its inserted rows rebuilt; the view the stage gets is `earlier` without old conflict rows,
    plus this run's conflicts."""
    if not earlier.height:  # nothing to re-apply, rebuild or conflict with
        return Reapplied(blocks, no_decisions(), no_decisions(), earlier)
    led = earlier.lazy().filter(pl.col("action").is_in(list(stage.frozen))).select(
        *PART_KEY, _lf=pl.col("from_call").cast(pl.Int32), _la="action", _lr="reason", _lb="before_sha256",
        _lafter="after_sha256", _lrep="replacement", _le=pl.col("cache_epoch").cast(pl.Int32),
    ).collect(engine=POLARS_ENGINE)
    if not led.height and (stage.rebuild is None or not earlier.height):
        return Reapplied(blocks, pl.DataFrame(schema=decision_schema()), pl.DataFrame(schema=decision_schema()),
                         earlier.filter(pl.col("action") != "conflict"))
    led_lazy = led.lazy()
    targets = blocks.lazy().select(*VERSION_KEY, "last_call", "content_sha256", "cache_epoch").join(
        led_lazy, on=PART_KEY, how="inner", nulls_equal=True,
    ).filter((pl.col("first_call") <= pl.col("_lf")) & (pl.col("last_call").is_null() | (pl.col("last_call") > pl.col("_lf"))))
    good, conflicts = _conflicts(targets, led_lazy)
    out = blocks
    decisions = pl.DataFrame(schema=decision_schema())
    ordered = False
    if stage.frozen:
        res = _apply(blocks.lazy(), good)
        out, decisions = res.blocks.collect(engine=POLARS_ENGINE), res.decisions.collect(engine=POLARS_ENGINE)
        ordered = True  # (_apply sorts)
    if stage.rebuild is not None:
        ordered = False
        rebuilt, rebuilt_dec = stage.rebuild(blocks.lazy(), out.lazy(), earlier.lazy())
        out = rebuilt.collect(engine=POLARS_ENGINE)
        decisions = pl.concat([decisions, conform(rebuilt_dec, STAGE_DECISION).collect(engine=POLARS_ENGINE)])
    conflicts_df = conflicts.collect(engine=POLARS_ENGINE)
    view = pl.concat([earlier.filter(pl.col("action") != "conflict"), conflicts_df])
    return Reapplied(out, decisions, conflicts_df, view, ordered=ordered)


def _apply(blocks: pl.LazyFrame, good: pl.LazyFrame) -> StageResult:
    """Re-apply matching decisions with the block-edit API: one replacement and one drop at most
    per version (the earliest of each), each from its recorded call with its recorded action,
    reason and cache epoch."""
    first = ["_lf"]
    reps = good.filter(pl.col("_lrep").is_not_null() & pl.col("_lafter").ne_missing(pl.col("content_sha256"))) \
        .sort(first).unique(VERSION_KEY, keep="first").select(
            *VERSION_KEY, _rf="_lf", _ra="_la", _rr="_lr", _rrep="_lrep", _re="_le")
    drops = good.filter(pl.col("_lrep").is_null()).sort(first).unique(VERSION_KEY, keep="first").select(
        *VERSION_KEY, _df="_lf", _da="_la", _dr="_lr", _de="_le")
    # only the versions a decision targets go through the marks: the others are left as they are
    # (what `finish` gives an unmarked row), and a long session's ledger targets a few of its rows
    targeted = pl.concat([reps.select(VERSION_KEY), drops.select(VERSION_KEY)]).unique()
    rest = blocks.join(targeted, on=VERSION_KEY, how="anti", nulls_equal=True)
    touched = blocks.join(targeted, on=VERSION_KEY, how="semi", nulls_equal=True)
    w = start_marks(touched.join(reps, on=VERSION_KEY, how="left", nulls_equal=True)
                    .join(drops, on=VERSION_KEY, how="left", nulls_equal=True))
    rep = pl.col("_rrep").str.json_decode(_replacement_struct())
    values = {c: rep.struct.field(c) for c in CONTENT_COLUMNS}
    values["cache_epoch"] = pl.col("_re")
    w = mark_replace_from(w, pl.col("_rf").is_not_null(), values, pl.col("_rr"), pl.col("_rf"), action=pl.col("_ra"))
    w = mark_drop(w, pl.col("_df").is_not_null(), pl.col("_dr"), from_call=pl.col("_df"), action=pl.col("_da"),
                  epoch=pl.col("_de"))
    res = finish(w)
    return StageResult(sort_blocks(pl.concat([rest.select(block_schema().names()), res.blocks])), res.decisions)


# ---------------------------------------------------------------------------------------------
# 2. reconciling with the ledger (running one stage and checking its result: pipeline/staging/invoke.py)


def mark_provisional(decisions: pl.DataFrame, pending: pl.DataFrame) -> pl.DataFrame:
    """`is_provisional`: the decision applies only from its thread's pending call on."""
    return decisions.join(pending, on=THREAD, how="left").with_columns(
        is_provisional=pl.col("pending_call").is_not_null() & (pl.col("from_call") >= pl.col("pending_call"))
    ).drop("pending_call")


def reconcile(marked: pl.DataFrame, earlier: pl.DataFrame) -> tuple[pl.DataFrame, int, int]:
    """(new rows to write, conflicts among them, reused decisions): frozen decisions the ledger does
    not hold are new; one it holds with another outcome is a `ledger_mismatch` conflict."""
    frozen = marked.filter(~pl.col("is_provisional")).drop("is_provisional")
    new = frozen.join(earlier.select(DECISION_KEY), on=DECISION_KEY, how="anti", nulls_equal=True)
    clash = frozen.join(earlier.select(*DECISION_KEY, pl.col("after_sha256").alias("_was")),
                        on=DECISION_KEY, how="inner", nulls_equal=True).filter(
        pl.col("after_sha256").ne_missing(pl.col("_was")))
    conflicts = clash.drop("_was").with_columns(action=pl.lit("conflict"), reason=pl.lit("ledger_mismatch"))
    out = pl.concat([new, conflicts.select(new.columns)]).sort(DECISION_KEY)
    return out, conflicts.height, frozen.height - new.height


# ---------------------------------------------------------------------------------------------
# the pipeline


@dataclass
class _Run:
    """The state of one `run_stages` call (local: nothing global)."""

    spec: Any
    view: LedgerView
    ctx: StageContext
    progress: Progress | None
    quarantined: dict[str, set[str]] = field(default_factory=dict)  # stage name -> sessions
    outcomes: list[StageOutcome] = field(default_factory=list)
    failures: list[StageFailure] = field(default_factory=list)
    spills: list[pl.DataFrame] = field(default_factory=list)
    checks: bool = True  # ask the stages' quick checks
    answers: dict[int, bool] = field(default_factory=dict)  # position -> its check's answer, asked ahead
    sorted_out: pl.DataFrame | None = None  # the blocks a quiet position left in block order
    ahead: bool = True  # ask the checks of the positions ahead too (the last position was quiet)
    # the checks asked ahead: queries, positions asked, seconds (and collects when counted)
    asked: dict[str, Any] = field(default_factory=lambda: {"queries": 0, "positions": 0, "seconds": 0.0})
    _earlier: dict[str, pl.DataFrame] = field(default_factory=dict)
    memo: ReapplyMemo | None = None  # the last pass's re-applications (the live engine's, per session)

    def earlier(self, name: str) -> pl.DataFrame:
        """The ledger view of one position (read once per pass)."""
        got = self._earlier.get(name)
        if got is None:
            got = self._earlier[name] = self.view.for_stage(name)
        return got


def run_stages(blocks: pl.DataFrame, spec: Any, view: LedgerView, ctx: StageContext,
               progress: Progress | None = None,
               observe: Callable[[str, pl.DataFrame], None] | None = None, checks: bool = True,
               memo: ReapplyMemo | None = None) -> StagesResult:
    """Run every stage of `spec` in order over `blocks` (see the module docstring). `observe`, when
    given, is called with each position's name and the blocks it leaves (the live engine measures
    what a stage saw and did). `checks=False`: no stage's quick check is asked (every plan runs;
    tests and benchmarks compare both). `memo`: the re-applications of the last pass over the same
    session, used where they still hold and updated (ReapplyMemo)."""
    state = _Run(spec, view, ctx, progress, checks=checks, memo=memo)
    names = position_names(spec.stages)
    n = len(spec.stages)
    for i, (rs, name) in enumerate(zip(spec.stages, names, strict=True), start=1):
        if progress:
            progress(f"stage {i}/{n}: {name}")
        crashpoints.point("stage")
        if checks and i not in state.answers:
            _ask_ahead(state, blocks, list(zip(spec.stages, names, strict=True))[i - 1:], i)
        blocks = _run_position(state, blocks, rs, name, i)
        if observe is not None:
            observe(name, blocks)
        crashpoints.point("stage")
    spills = pl.concat(state.spills).unique("sha256", maintain_order=True) if state.spills else \
        pl.DataFrame(schema={"sha256": pl.String, "text": pl.String})
    return StagesResult(blocks, tuple(state.outcomes), tuple(state.failures), spills, dict(state.asked))


def _ask_ahead(state: _Run, blocks: pl.DataFrame, ahead: list[tuple[Any, str]], first: int) -> None:
    """Ask, in one query over `blocks`, the quick checks of the positions from `first` on while
    each can be asked here: a built-in stage with a check and no earlier decision in its ledger
    view. A quiet position leaves the rows as they are, so the checks after it read the same rows;
    the run stops after a position whose quiet output is not its input (sanitize fills the usage
    columns). The answers after the first "not quiet" are dropped (its plan changes the rows), so
    after a position whose plan ran, only the next one is asked (a batch that needed one plan
    often needs the next: asking ahead there would ask most checks twice)."""
    from ctxreplay.pipeline.stageapi.quiet import ask

    t0, c0 = time.perf_counter(), profile.collects()  # (building a check may run a query: counted with them)
    todo: list[tuple[int, pl.Expr | pl.LazyFrame]] = []
    same: dict[int, int] = {}  # position -> the earlier position asked the same check (pairing#2)
    seen: dict[tuple[str, str, str], int] = {}
    lazy = blocks.lazy()
    for k, (rs, name) in enumerate(ahead, start=first):
        st: RegisteredStage = rs.stage
        if st.quiet is None or not st.is_builtin or state.earlier(name).height:
            break
        ctx = stage_context(state.ctx, rs, state.spec)
        key = (st.name, repr(rs.params), repr(ctx))
        if key in seen:
            same[k] = seen[key]
        else:
            seen[key] = k
            try:
                todo.append((k, st.quiet.check(lazy, rs.params, ctx)))
            except CtxReplayError:
                raise
            except Exception as exc:  # the check is the stage's code
                raise stage_raised(st, name, k, exc) from exc
        if st.quiet.blocks is not None or not state.ahead:
            break
    if not todo:
        return
    try:
        answers = ask(lazy, [c for _, c in todo])
    except Exception:  # noqa: BLE001  (one check fails to run: each position asks its own, and names itself)
        return
    asked = state.asked
    asked["queries"] += 1
    asked["positions"] += len(todo)
    asked["seconds"] += time.perf_counter() - t0
    if profile.active():
        asked["collects"] = asked.get("collects", 0) + profile.collects() - c0
    got = dict(zip((k for k, _ in todo), answers, strict=True))
    for k in sorted([*got, *same]):
        q = got[k] if k in got else got[same[k]]
        state.answers[k] = q
        if not q:
            break


def position_names(stages: Any) -> list[str]:
    """The names of a pipeline's stage positions, in order: a stage used twice (pairing runs before
    and after snip) keeps its decisions apart as `pairing#2`."""
    seen: Counter[str] = Counter()
    out = []
    for rs in stages:
        seen[rs.stage.name] += 1
        out.append(rs.stage.name if seen[rs.stage.name] == 1 else f"{rs.stage.name}#{seen[rs.stage.name]}")
    return out


def stage_context(ctx: StageContext, rs: Any, spec: Any) -> StageContext:
    """The context one stage gets: the run's, with the pipeline's stages it declared in `reads`."""
    import dataclasses

    peers = tuple(StageRef(s.stage, s.params) for s in spec.stages if s.stage.name in rs.stage.reads)
    return dataclasses.replace(ctx, peers=peers)


def _run_position(state: _Run, blocks: pl.DataFrame, rs: Any, name: str, position: int) -> pl.DataFrame:
    """One position: re-apply, run (isolated for plug-ins), reconcile; returns the new blocks."""
    from ctxreplay.pipeline.staging.isolation import run_isolated

    st: RegisteredStage = rs.stage
    t0, c0 = time.perf_counter(), profile.collects()
    earlier = state.earlier(name)
    ctx = stage_context(state.ctx, rs, state.spec)
    skip = state.quarantined.get(st.name, set())
    failed: dict[str, StageFailed] = {}
    known = state.answers.pop(position, None)
    if known is not True:  # its plan may change the rows: the answers asked ahead no longer hold
        state.answers.clear()
    if known is True and st.quiet is not None and st.quiet.blocks is None and blocks is state.sorted_out:
        out, decisions = blocks, no_decisions()  # quiet after a quiet position: already in block order
    elif st.is_builtin:
        out, decisions = reapply_and_run(st, blocks, rs.params, earlier, ctx, name, position,
                                         quiet=known if state.checks else False, memo=state.memo)
    else:
        out, decisions, failed = run_isolated(st, blocks, rs.params, earlier, ctx, name, position,
                                              budget=rs.time_budget_seconds, skip=skip,
                                              run=functools.partial(reapply_and_run,
                                                                    quiet=None if state.checks else False))
        _record_failures(state, st, name, position, failed, skip)
        decisions = pl.concat([decisions, _failed_decisions(blocks, failed | dict.fromkeys(skip))])
    if st.spilled_texts is not None and decisions.height and decisions.filter(pl.col("action") == "spill").height:
        state.spills.append(st.spilled_texts(blocks.lazy(), decisions.lazy()).select("sha256", "text").collect(engine=POLARS_ENGINE))
    if known is True and st.quiet is not None and (st.quiet.blocks is None or st.quiet.sorted):
        state.sorted_out = out
    state.ahead = known is True
    counted = profile.collects() - c0 if profile.active() else None
    if not decisions.height and not earlier.height:  # nothing decided, nothing in the ledger: nothing to reconcile
        stats = StageStats(0, 0, 0, 0, 0, {}, time.perf_counter() - t0, len(failed) + len(skip),
                           counted, known is True)
        state.outcomes.append(StageOutcome(name, position, st, rs.config_digest, _no_marked(), _no_keyed(), stats))
        return out
    marked = mark_provisional(decisions, state.view.calls.pending)
    new, conflicts, reused = reconcile(marked, earlier)
    by_reason = Counter(f"{a}:{r}" for a, r in decisions.select("action", "reason").iter_rows())
    stats = StageStats(decisions.height, new.height, reused, int(marked["is_provisional"].sum()),
                       conflicts + int((decisions["action"] == "conflict").sum()), dict(sorted(by_reason.items())),
                       time.perf_counter() - t0, len(failed) + len(skip), counted, known is True)
    state.outcomes.append(StageOutcome(name, position, st, rs.config_digest, marked,
                                       state.view.calls.with_keys(new), stats))
    return out


def reapply_and_run(st: RegisteredStage, blocks: pl.DataFrame, params: Any, earlier: pl.DataFrame,
                     ctx: StageContext, name: str, position: int,
                     invoke: Callable[..., tuple[pl.DataFrame, pl.DataFrame]] = invoke_inline,
                     quiet: bool | None = None, memo: ReapplyMemo | None = None) -> tuple[pl.DataFrame, pl.DataFrame]:
    """Re-apply the stage's frozen decisions, run it, and return (blocks, every decision applied).

    A stage with a quick check (`@stage(quiet=...)`) and no earlier decision is asked it first
    (`quiet`: None to ask here, or the answer asked already; False runs the plan): where it holds,
    the stage's plan does not run."""
    if st.quiet is not None and not earlier.height and quiet is not False:
        try:
            if quiet is None:
                from ctxreplay.pipeline.stageapi.quiet import ask

                quiet = ask(blocks.lazy(), [st.quiet.check(blocks.lazy(), params, ctx)])[0]
            if quiet:
                return _quiet_output(st, blocks, params, ctx, name, position), no_decisions()
        except CtxReplayError:
            raise
        except Exception as exc:  # the check is the stage's code
            raise stage_raised(st, name, position, exc) from exc
    try:
        re = reapply(st, blocks, earlier) if memo is None else memo.reapply(name, st, blocks, earlier)
    except CtxReplayError:
        raise
    except Exception as exc:  # the re-application of a plug-in's decisions counts as the plug-in's
        raise stage_raised(st, name, position, exc) from exc
    out, decisions = invoke(st, re.blocks, params, re.view, ctx, name, position)
    return out, pl.concat([re.decisions, re.conflicts, decisions.select(decision_schema().names())])


def _quiet_output(st: RegisteredStage, blocks: pl.DataFrame, params: Any, ctx: StageContext, name: str,
                  position: int) -> pl.DataFrame:
    """The blocks a stage returns where its check holds (sorted; sanitize fills the usage columns)."""
    from ctxreplay.pipeline.stageapi.quiet import quiet_blocks

    assert st.quiet is not None
    out = quiet_blocks(st.quiet, blocks.lazy(), params, ctx)
    if st.quiet.blocks is None:
        return out.collect(engine=POLARS_ENGINE)
    try:
        check_frame(out, BLOCKS, where=f"after stage '{name}' (#{position})")
    except SchemaMismatch as exc:
        raise StageFailed(name, position, exc, kind="schema", message=str(exc)) from exc
    return out.collect(engine=POLARS_ENGINE)


def _record_failures(state: _Run, st: RegisteredStage, name: str, position: int, failed: dict[str, StageFailed],
                     skipped: set[str]) -> None:
    """Quarantine the sessions a plug-in failed for (for the rest of the run) and list the failures."""
    by_kind: dict[tuple[str, str], list[str]] = {}
    for sid, f in sorted(failed.items()):
        by_kind.setdefault((f.kind, f.message), []).append(sid)
    for (kind, message), sessions in by_kind.items():
        state.failures.append(StageFailure(name, position, st.owner, kind, message, tuple(sessions)))
    if skipped:
        state.failures.append(StageFailure(name, position, st.owner, "quarantined",
                                           f"skipped: '{st.name}' failed earlier in this run for these sessions",
                                           tuple(sorted(skipped))))
    state.quarantined.setdefault(st.name, set()).update(failed)


def _failed_decisions(blocks: pl.DataFrame, failed: dict[str, StageFailed | None]) -> pl.DataFrame:
    """One `stage_failed` decision per thread of each failed session; `replacement` holds why."""
    if not failed:
        return pl.DataFrame(schema=decision_schema())
    why = pl.DataFrame({
        "session_id": list(failed),
        "reason": [f.kind if f is not None else "quarantined" for f in failed.values()],
        "replacement": [orjson.dumps({"message": f.message if f is not None else "skipped: failed earlier in the run"})
                        .decode() for f in failed.values()],
    })
    threads = blocks.select(THREAD).unique().join(why, on="session_id")
    return conform(threads.select(
        *THREAD, entry_id=pl.lit(""), block_pos=pl.lit(0, pl.Int32), part_pos=pl.lit(0, pl.Int32),
        tool_use_id=pl.lit(None, pl.String), from_call=pl.lit(0, pl.Int32), action=pl.lit(STAGE_FAILED),
        reason="reason", before_sha256=pl.lit(None, pl.String), after_sha256=pl.lit(None, pl.String),
        before_len=pl.lit(None, pl.Int64), after_len=pl.lit(None, pl.Int64), replacement="replacement",
        cache_epoch=pl.lit(0, pl.Int32),
    ).lazy(), STAGE_DECISION).collect(engine=POLARS_ENGINE).sort(DECISION_KEY)
