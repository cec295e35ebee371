"""The live engine: the batch replay's stages and ledger, one session at a time, as an agent runs.

```python
from ctxreplay.pipeline.engine.engine import Engine

with Engine.open("default", "ctx/ledger.duckdb") as eng:      # a preset name, a spec file or a PipelineSpec
    eng.ingest("s1", entries)                                 # transcript lines (dicts, str or bytes)
    res = eng.assemble("s1")                                  # the request to send now
    send(res.request)                                         # == the batch replay's call, byte for byte
    eng.after_turn("s1", usage)                               # what the provider reported for it
```

How it stays identical to `ctxreplay run` (docs/engine.md has the details):

- **Entries** are kept as transcript lines, in a private spool directory (one file per transcript
  file of the session), and read by the batch loaders (`ctxreplay.pipeline.loaders.load_paths`): the engine
  has no parser of its own, so it cannot read a line differently from a batch run.
- **Stages** run through `ctxreplay.pipeline.staging.stagerun.run_stages` with the ledger's view of the session, the
  same call as the runner's: frozen decisions re-applied, plug-ins isolated (a failing one is
  quarantined for the session with a `stage_failed` decision), decisions for the pending call
  provisional, the others committed to the ledger before `assemble` returns.
- **The request** of the pending call is shaped by `ctxreplay.pipeline.assembly.replay.replay_thread` from the block
  versions that call sees, so its canonical bytes and sha256 are those of the batch replay.

Work per call: when the new entries only extend the main thread of a Claude Code session and no
stage decides anything about them (each stage's own live rule says: `@stage(live=...)`,
pipeline/engine/live.py), the live path
makes their rows and appends them to the kept replay state, with no pass; otherwise the stages run
over the whole session (columnar, with the ledger's frozen decisions: correct, not incremental),
over the kept rows and the live path's new ones when it could read the new lines, else over what
the loaders read from the spool again.
The replay shapes only the pending call, never the calls before it (their requests are frozen).
bench/bench_engine.py measures what a call costs on both paths.

One engine per ledger: `Engine.open` takes the ledger's lock (the runner's) and holds it until
`close()`; a second engine or a `ctxreplay run` on that ledger is refused with a `LockError`.

Errors: every method raises a `ctxreplay.errors.CtxReplayError` (one paragraph that names what and
the fix), as the CLI reports them; any other exception is a bug in ctxreplay and comes out as
`internal_error`'s CheckFailed, its traceback in a file (`_guarded`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import shutil
import tempfile
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, ParamSpec, Self, TypeVar

import orjson
import polars as pl

from ctxreplay.errors import CtxReplayError, InputError, LockError, OutputError, SpecError, internal_error
from ctxreplay.pipeline.assembly.replay import (
    call_counts,
    call_skeleton,
    thread_key,
)
from ctxreplay.pipeline.core.outdir import RunLock, ledger_lock_path
from ctxreplay.pipeline.core.tokens import TIKTOKEN_COUNTER, TokenCounter
from ctxreplay.pipeline.engine import live as livepath
from ctxreplay.pipeline.engine.engine_replay import LiveThread
from ctxreplay.pipeline.loaders import LoadResult, load_paths
from ctxreplay.pipeline.loaders.base import path_str
from ctxreplay.pipeline.stageapi.live import LiveRows
from ctxreplay.pipeline.stageapi.registry import StageContext, load_stages
from ctxreplay.pipeline.staging.ledger import Ledger
from ctxreplay.pipeline.staging.spec import DEFAULT_TARGET, PipelineSpec, load_spec, preset_names
from ctxreplay.pipeline.staging.stagerun import (
    CallMap,
    LedgerView,
    ReapplyMemo,
    StageFailure,
    StagesResult,
    position_names,
    run_stages,
    stage_context,
)
from ctxreplay.pipeline.targets import Violation, get_target
from ctxreplay.schemas.blocks import BLOCKS
from ctxreplay.schemas.check import check_frame, empty_table
from ctxreplay.schemas.decisions import DECISION_KEY

USAGE_DDL = """
CREATE TABLE IF NOT EXISTS engine_usage (
    spec_sha256 VARCHAR NOT NULL, session_id VARCHAR NOT NULL, thread_id VARCHAR NOT NULL,
    call INTEGER NOT NULL, request_sha256 VARCHAR, estimated_tokens BIGINT,
    input_tokens BIGINT, output_tokens BIGINT, cache_read_tokens BIGINT, cache_write_tokens BIGINT,
    usage_json VARCHAR NOT NULL, recorded_at VARCHAR NOT NULL
);
"""

Entry = Mapping[str, Any] | str | bytes
TOKEN_FLUSH = 5_000  # token counts waiting for a commit before one is made for them alone


@dataclass(frozen=True)
class QuarantinedEntry:
    """An entry the engine could not use: where it came from (the transcript file name given to
    `ingest`, its line number in that file, 1-based), what it was, and why."""

    file: str
    line: int
    raw: str
    reason: str
    code: str


@dataclass(frozen=True)
class AssembleResult:
    """The request the agent sends now (the thread's pending call) and what made it.

    `request` is in the target's wire shape; `request_json` its canonical bytes, whose sha256 is
    `request_sha256` (the batch replay's `request_sha256` for this call). `decisions` are the
    decisions that apply from this call on (STAGE_DECISION columns + `stage`, `stage_version`,
    `is_provisional`): those made for the pending call stay provisional until the next call is
    assembled. `quarantined` lists every entry of the session the engine could not use (never
    raised), `stage_failures` the plug-in stages quarantined for the session."""

    session_id: str
    thread_id: str
    call: int
    request_json: bytes
    request_sha256: str
    prompt_tokens: int
    n_messages: int
    cache_epoch: int
    awaits_user: bool
    prefix_break_message: int | None
    model: str | None
    decisions: pl.DataFrame
    new_decisions: int
    quarantined: tuple[QuarantinedEntry, ...]
    stage_failures: tuple[StageFailure, ...]
    token_budget: int | None = None
    target: str = DEFAULT_TARGET
    rebuilt: bool = False  # the replay state was built again from every visible row (not appended to)
    conflicts: int = 0  # decisions of the last pass that disagreed with the ledger (as in summary.json)
    incremental: bool = False  # made by the live path: the appended rows, no pipeline pass (docs/engine.md)
    full_pass_reason: str | None = None  # why the last pass over the session was a full one (None: live path)

    @functools.cached_property
    def request(self) -> dict[str, Any]:
        """The request, parsed from `request_json` (on first use)."""
        return dict(orjson.loads(self.request_json))

    @functools.cached_property
    def violations(self) -> tuple[Violation, ...]:
        """What the target's validator finds wrong with the request (checked on first use), as the
        batch run checks every pending request."""
        return tuple(get_target(self.target).validate(self.request, thread_key=thread_key(self.session_id,
                                                                                          self.thread_id),
                                                      call=self.call, awaits_user=self.awaits_user))

    @property
    def over_budget(self) -> bool:
        """True when a `token_budget` was given and the request's estimate exceeds it."""
        return self.token_budget is not None and self.prompt_tokens > self.token_budget


@dataclass(frozen=True)
class CompactResult:
    """What `compact` did: the decisions it made (frozen in the ledger), whether it was forced (a
    simulated compaction: the pipeline's stages that can compact, run with their triggers at their
    minimum, not an LLM summary), and the request after it."""

    session_id: str
    thread_id: str
    forced: bool
    simulated: bool
    decisions: pl.DataFrame
    result: AssembleResult


@dataclass(frozen=True)
class TurnUsage:
    """The usage recorded by `after_turn`, beside the engine's estimate for the same request."""

    session_id: str
    thread_id: str
    call: int
    estimated_tokens: int | None
    input_tokens: int | None
    output_tokens: int | None
    cache_read_tokens: int | None
    cache_write_tokens: int | None

    @property
    def recorded_prompt_tokens(self) -> int | None:
        parts = [self.input_tokens, self.cache_read_tokens, self.cache_write_tokens]
        return None if all(p is None for p in parts) else sum(p or 0 for p in parts)

    @property
    def ratio(self) -> float | None:
        """recorded / estimated prompt tokens (the calibration the reports use), when both are known."""
        rec = self.recorded_prompt_tokens
        if rec is None or not self.estimated_tokens:
            return None
        return rec / self.estimated_tokens


# ---------------------------------------------------------------------------------------------
# per-session state


@dataclass
class _File:
    path: Path
    lines: list[bytes] = field(default_factory=list)
    written: int = 0  # lines already appended to the spool file


@dataclass
class _Pass:
    """One run of load + stages over a session: what the replay and the results read."""

    loaded: LoadResult
    rows: pl.DataFrame  # the loader's rows of the spool (before any stage), live steps' rows appended
    blocks: pl.DataFrame  # the final block versions (sorted for replay)
    skeleton: pl.DataFrame
    counts: dict[tuple[str, str], int]
    staged: StagesResult
    new_decisions: int
    seconds: dict[str, float]
    written: pl.DataFrame  # the decisions this pass wrote to the ledger (+ `stage`)
    full_pass_reason: str | None = None  # why this session's last step was a full pass (None: the live path)
    applied: pl.DataFrame | None = None  # staged.applied, once read
    calls: CallMap | None = None  # the call map of the first `calls_rows` rows (the pass's; live steps append rows)
    calls_rows: int = 0

    def applied_decisions(self) -> pl.DataFrame:
        if self.applied is None:
            self.applied = self.staged.applied
        return self.applied


@dataclass
class _Session:
    session_id: str
    dir: Path
    files: dict[str, _File] = field(default_factory=dict)
    rejected: list[QuarantinedEntry] = field(default_factory=list)
    dirty: bool = True
    last: _Pass | None = None
    live: dict[str, LiveThread] = field(default_factory=dict)  # thread -> its replay state
    shaped: float = 0.0  # seconds the last assemble took to shape the request
    assembled: dict[str, AssembleResult] = field(default_factory=dict)  # thread -> last result
    scan: livepath.TailScan | None = None  # the live path's reading of the session's one file
    facts: livepath.ThreadFacts | None = None  # the main thread after the last step
    unshaped: list[LiveRows] = field(default_factory=list)  # live steps the main thread's state lacks
    # the last step's answers of the live rules: (the pending call before the step, position ->
    # None for quiet or the reason); None when the step was refused before the rules were asked
    asked: tuple[int, dict[str, str | None]] | None = None
    # the rows the live path made for the last step's lines when a stage still needed a full pass:
    # that pass appends them to the kept rows instead of loading the spool again
    follow: LiveRows | None = None
    # each position's re-application of its frozen decisions in the last pass (reused while it holds)
    memo: ReapplyMemo = field(default_factory=ReapplyMemo)


def _grow_calls(skeleton: pl.DataFrame, counts: dict[tuple[str, str], int], new: LiveRows) -> pl.DataFrame:
    """The call skeleton with the calls of a live step's rows added (they extend the main thread of
    their session), and `counts` set to that thread's calls after them (in place)."""
    counts[(str(new.rows[0]["session_id"]), livepath.MAIN)] = new.calls
    return pl.concat([skeleton, call_skeleton(new.frame)], how="diagonal_relaxed")


def _spec_of(spec: PipelineSpec | str | Path) -> PipelineSpec:
    if isinstance(spec, PipelineSpec):
        return spec
    text = str(spec)
    if isinstance(spec, str) and text in preset_names():
        return load_spec(preset=text)
    if Path(text).is_file():
        return load_spec(text)
    raise SpecError(f"{text}: neither a preset ({', '.join(preset_names())}) nor a pipeline spec file; "
                    f"pass a preset name, a TOML file or a PipelineSpec")


def _safe_name(name: str) -> str:
    """A transcript file name as given to `ingest`, checked: a relative path inside the spool."""
    p = Path(name)
    if not name or p.is_absolute() or any(part in ("", ".", "..") for part in p.parts):
        raise InputError(f"file={name!r}: the transcript file name must be a relative path without '..' "
                         f"(e.g. '<session-id>.jsonl' or '<session-id>/subagents/agent-1.jsonl')")
    return name


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _guarded(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """A public method of the engine: what it raises is a CtxReplayError (ctxreplay.errors), as in
    the CLI. An exception of another kind is a bug in ctxreplay (an internal invariant that did
    not hold): it is raised as `internal_error`'s CheckFailed, whose message names the file that
    holds its traceback (the original is its __cause__). KeyboardInterrupt passes through."""
    where = f"in Engine.{fn.__name__}"

    @functools.wraps(fn)
    def call(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return fn(*args, **kwargs)
        except CtxReplayError:
            raise
        except Exception as exc:
            raise internal_error(exc, where) from exc

    return call


class Engine:
    """The live engine over one ledger (see the module docstring). Not thread-safe: one caller."""

    def __init__(self, spec: PipelineSpec, ledger_path: Path, target: str, *, token_counter: str,
                 spill_dir: Path | None) -> None:
        self.spec = spec
        self.target = target
        self.ledger_path = ledger_path
        self.spill_dir = spill_dir if spill_dir is not None else ledger_path.parent / "spill"
        self._lock = RunLock(ledger_lock_path(ledger_path), f"the ledger {ledger_path}")
        try:
            self._lock.acquire()
        except LockError as exc:
            raise LockError(f"cannot open an engine on {ledger_path}: {exc}. For an engine: close() the one that "
                            f"holds it, or open this one on another ledger_path") from None
        try:
            self.ledger = Ledger(ledger_path)
            self.ledger.exclusive = True  # the lock held above: no other writer while the engine is open
            self.ledger.con.execute(USAGE_DDL)
        except BaseException:
            self._lock.release()
            raise
        self.counter = TokenCounter(token_counter, cache=self.ledger)
        self._resolved: dict[str, Any] | None = None  # spec.resolved(), what the ledger's commits write
        self._spool = Path(tempfile.mkdtemp(prefix="ctxreplay-engine-"))
        # an engine dropped without close() still leaves no spool behind
        self._cleanup = weakref.finalize(self, shutil.rmtree, str(self._spool), True)
        self._sessions: dict[str, _Session] = {}
        self._closed = False
        t = get_target(target)
        self._ctx = StageContext(target=target, window_tokens=spec.window_tokens,
                                 count_tokens=self.counter.series_counter(), token_counter_version=self.counter.name,
                                 supports_images=bool(getattr(t, "supports_images", True)))
        names = position_names(spec.stages)
        self._positions = tuple(livepath.Position(n, rs.stage, rs.params, stage_context(self._ctx, rs, spec))
                                for n, rs in zip(names, spec.stages, strict=True))
        self.live_path = True  # False: every step is a full pass, the spool loaded again (tests compare both)
        # False: no stage's live rule is asked, every step is a full pass over the rows the live path
        # made (what a step costs when a stage decides something; bench/bench_engine.py)
        self.ask_rules = True

    # ------------------------------------------------------------------ life cycle

    @classmethod
    @_guarded
    def open(cls, spec: PipelineSpec | str | Path, ledger_path: str | Path, target: str = DEFAULT_TARGET, *,
             token_counter: str = TIKTOKEN_COUNTER, spill_dir: str | Path | None = None) -> Engine:
        """An engine running `spec` (a PipelineSpec, a preset name or a spec file) for `target`,
        with its decisions in the DuckDB ledger at `ledger_path` (created if missing). The same
        spec, target and ledger as a `ctxreplay run` give the same requests. Raises LockError when
        another engine or run holds the ledger, SpecError for a bad spec, UnknownTarget for an unknown target."""
        resolved = _spec_of(spec)
        t = get_target(target)  # an unknown target fails here
        resolved = resolved.for_target(t.name)
        path = Path(ledger_path)
        if path.exists() and not path.is_file():
            raise OutputError(f"ledger {path} is a directory, not a file: pass a file path")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise OutputError(f"cannot create the ledger's directory {path.parent}: {exc.strerror}") from exc
        return cls(resolved, path, t.name, token_counter=token_counter,
                   spill_dir=Path(spill_dir) if spill_dir is not None else None)

    @_guarded
    def close(self) -> None:
        """Release the ledger (its lock too) and remove the spool. Decisions are already committed."""
        if self._closed:
            return
        self._closed = True
        try:
            try:
                if self.ledger.pending_tokens:  # the token counts not written yet (a cache: see _tokens_due)
                    self._commit()
            finally:
                self.ledger.close()
        finally:
            self._lock.release()
            self._cleanup()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise CtxReplayError("this engine is closed; open a new one with Engine.open(...)")

    # ------------------------------------------------------------------ ingest

    @_guarded
    def ingest(self, session_id: str, entries: Iterable[Entry], *, file: str | None = None) -> int:
        """Append transcript entries to a session, in order: the dicts of a transcript's lines (any
        supported format: Claude Code, OpenClaw / pi, Codex rollout), or the lines themselves as
        str / bytes. `file` names the transcript file they belong to (default
        `<session_id>.jsonl`); a Claude Code sub-agent's entries go to
        `<session_id>/subagents/agent-<id>.jsonl`, as on disk. Returns how many entries were taken;
        an entry that cannot be written as one JSON line is quarantined, never raised."""
        self._check_open()
        if not isinstance(session_id, str) or not session_id:
            raise InputError("session_id must be a non-empty string")
        if not isinstance(entries, Iterable):
            raise InputError(f"ingest({session_id!r}): entries must be an iterable of transcript lines (dicts, str "
                             f"or bytes), not {type(entries).__name__}; pass a list, e.g. [entry]")
        name = _safe_name(file if file is not None else f"{session_id}.jsonl")
        s = self._session(session_id)
        f = s.files.get(name)
        if f is None:
            f = s.files[name] = _File(s.dir / name)
        n = 0
        for e in entries:
            f.lines.append(self._line(s, name, len(f.lines) + 1, e))
            n += 1
        if n:
            s.dirty = True
        return n

    @_guarded
    def ingest_batch(self, batch: Mapping[str, Iterable[Entry]] | Iterable[tuple[str, Iterable[Entry]]]) -> int:
        """`ingest` for several sessions: a mapping (or pairs) session_id -> entries."""
        items = batch.items() if isinstance(batch, Mapping) else batch
        return sum(self.ingest(sid, entries) for sid, entries in items)

    def _session(self, session_id: str) -> _Session:
        s = self._sessions.get(session_id)
        if s is None:
            d = self._spool / hashlib.sha256(session_id.encode("utf-8", "surrogatepass")).hexdigest()[:24]
            d.mkdir()
            s = self._sessions[session_id] = _Session(session_id, d)
        return s

    @staticmethod
    def _line(s: _Session, file: str, line: int, e: Any) -> bytes:
        """One spool line for an entry. What cannot be one JSON line is quarantined by the engine
        and spooled as a JSON string (which the loader counts as a quarantined line too, so line
        numbers stay those of the caller's stream)."""
        why = None
        if isinstance(e, bytes | bytearray):
            raw = bytes(e).removesuffix(b"\n")
            if b"\n" in raw:
                why = "the entry holds a line break: pass one transcript line per entry"
            else:
                return raw
        elif isinstance(e, str):
            raw_s = e.removesuffix("\n")
            if "\n" in raw_s:
                why = "the entry holds a line break: pass one transcript line per entry"
            else:
                return raw_s.encode("utf-8", "surrogateescape")
        else:
            # the json module, not orjson: NaN and Infinity stay what they were in the line (the
            # loaders refuse them, as in a batch run) instead of becoming null; escapes keep lone
            # surrogates as the line had them
            try:
                return json.dumps(e, ensure_ascii=True, allow_nan=True, separators=(",", ":")).encode("ascii")
            except (TypeError, ValueError, RecursionError) as exc:
                why = f"the entry cannot be written as JSON ({exc}): pass the dict of a transcript line"
        shown = repr(e)[:2000]
        s.rejected.append(QuarantinedEntry(file, line, shown, why, "not_json_line"))
        return orjson.dumps(f"<entry quarantined by the engine: {why}>")

    # ------------------------------------------------------------------ the pipeline pass

    def _refresh(self, s: _Session, *, spec: PipelineSpec | None = None, freeze_pending: bool = False,
                 forced: frozenset[str] = frozenset()) -> _Pass:
        """Load the session, run the stages with the ledger's view, commit the new decisions.
        `spec`, `freeze_pending` and `forced` (the names of stages run with forced params): see
        `compact`."""
        if not s.dirty and s.last is not None and spec is None:
            return s.last
        t0 = time.perf_counter()
        reason = self._live_step(s, t0) if spec is None and not freeze_pending else "compact"
        if reason is None:
            assert s.last is not None
            return s.last
        follow = s.follow if spec is None and not freeze_pending else None
        s.follow = None
        new_lines = False
        for f in s.files.values():
            if f.written < len(f.lines):
                new_lines = True
                f.path.parent.mkdir(parents=True, exist_ok=True)
                with open(f.path, "ab") as fh:
                    fh.write(b"".join(ln + b"\n" for ln in f.lines[f.written:]))
                f.written = len(f.lines)
        kept = self._kept_rows(s.last, new_lines, follow)
        if kept is not None:
            loaded, blocks = kept
        else:
            # open_sidechains: an inline sidechain's first request can be assembled as soon as its first
            # user line is in, before its answer makes it a thread of the batch replay
            loaded = load_paths([s.dir], open_sidechains=True) if s.files else LoadResult(empty_table(BLOCKS), [])
            blocks = pl.from_arrow(loaded.blocks)
            assert isinstance(blocks, pl.DataFrame)
            check_frame(blocks, BLOCKS, where="on load")
        loaded_blocks = blocks
        skeleton, counts, calls = self._calls(s.last if kept is not None else None, blocks, follow)
        blocks = blocks.filter(pl.col("last_call").is_null() | (pl.col("last_call") > pl.col("first_call")))
        t1 = time.perf_counter()
        run_spec = spec or self.spec
        ctx = self._ctx
        sessions = sorted(blocks.get_column("session_id").unique().to_list())
        view = LedgerView.translate(self.ledger.earlier_all(self.spec.sha256, sessions), calls)
        if freeze_pending:  # compact: the pending call's decisions are frozen as made
            view = LedgerView(CallMap(calls.keys, calls.pending.with_columns(pending_call=pl.lit(1 << 30, pl.Int32))),
                              view.decisions)
        main_sid = self._main_session(s, sessions)
        if main_sid is not None and (main_sid, livepath.MAIN) not in counts:
            main_sid = None  # a sub-agent's file alone: no main thread to follow
        outs: dict[str, pl.DataFrame] = {}  # what each position left (its live rule starts from it)

        def observe(name: str, out: pl.DataFrame) -> None:
            outs[name] = out

        staged = run_stages(blocks, run_spec, view, ctx, observe=observe if spec is None and main_sid else None,
                            memo=s.memo if spec is None else None)
        t2 = time.perf_counter()
        new = 0
        written = []
        for o in staged.outcomes:
            rows = o.new
            if freeze_pending:  # a compaction decides for the pending call on, never for calls already sent
                rows = rows.join(calls.pending, on=["session_id", "thread_id"], how="left")
                if forced and o.name in forced:
                    # the forced stage fired at every call; the compaction happens now: what it would
                    # have changed at an earlier call (and still sees) changes from the pending call on
                    rows = rows.with_columns(from_call=pl.max_horizontal("from_call", "pending_call")).unique(
                        DECISION_KEY, keep="last", maintain_order=True)
                rows = rows.filter(pl.col("from_call") >= pl.col("pending_call")).drop("pending_call")
            new += self.ledger.stage(rows, spec_sha256=self.spec.sha256, stage=o.name,
                                     stage_version=o.stage.version, config_digest=o.config_digest)
            written.append(rows.drop("call_key", strict=False).with_columns(stage=pl.lit(o.name)))
        self._write_spills(staged.spills)
        if staged.failures or new or self._tokens_due():
            self._commit()
        final = staged.blocks.sort(["session_id", "thread_id", "order_key", "block_pos", "part_pos", "first_call",
                                    "entry_id"])
        p = _Pass(loaded, loaded_blocks, final, skeleton, counts, staged, new,
                  {"load": t1 - t0, "stages": t2 - t1, "commit": time.perf_counter() - t2},
                  pl.concat(written, how="diagonal_relaxed") if written else pl.DataFrame(), reason,
                  calls=calls, calls_rows=loaded_blocks.height)
        s.facts = None
        if main_sid is not None and spec is None:
            n_main = counts[(main_sid, livepath.MAIN)]
            keyed = calls.keys.filter((pl.col("session_id") == main_sid)
                                      & (pl.col("thread_id") == livepath.MAIN)).height == n_main
            if s.scan is not None and s.scan.thread == livepath.thread_entries(loaded_blocks, main_sid):
                s.facts = livepath.thread_facts(loaded_blocks, final, p.applied_decisions(), main_sid, n_main, keyed,
                                                self._positions, outs, self._ctx.count_tokens)
            # else the live path's reading of the file is not the loader's: no live step
        s.unshaped.clear()
        s.last, s.dirty = p, False
        return p

    @staticmethod
    def _calls(last: _Pass | None, rows: pl.DataFrame, follow: LiveRows | None
               ) -> tuple[pl.DataFrame, dict[tuple[str, str], int], CallMap]:
        """The calls of the loader's rows: the skeleton, the calls per thread and the call map.
        `last`: the pass whose rows these extend (_kept_rows), with the live path's rows for the new
        lines (`follow`) last. Those only add calls at the end of the main thread: the skeleton and
        counts grow as a live step grows them, and the call map as CallMap.extended says (where it
        cannot, from the rows); without `last`, all from the rows."""
        if last is not None and last.calls is not None:
            skeleton, counts = last.skeleton, dict(last.counts)
            if follow is not None:
                skeleton = _grow_calls(skeleton, counts, follow)
            calls = last.calls.extended(rows.head(last.calls_rows), rows.slice(last.calls_rows), counts)
            return skeleton, counts, calls if calls is not None else CallMap.from_blocks(rows, counts)
        counts = call_counts(rows)
        return call_skeleton(rows), counts, CallMap.from_blocks(rows, counts)

    @staticmethod
    def _kept_rows(last: _Pass | None, new_lines: bool, follow: LiveRows | None
                   ) -> tuple[LoadResult, pl.DataFrame] | None:
        """The loader's rows of the spool without loading it again (None: load it): the last pass's
        when no line came since (a compaction's second pass), or those with the rows the live path
        made for the new lines (it followed them: they only extend the main thread, read the way
        the loader reads them, and the loader gives every earlier row as before)."""
        if last is None or (new_lines and follow is None):
            return None
        rows = last.rows
        if follow is not None:
            add = follow.frame.select([c for c in rows.columns if c in follow.frame.columns])
            if add.schema != rows.schema:
                return None
            rows = pl.concat([rows, add])
        return last.loaded, rows

    def _commit_pending(self, p: _Pass, facts: livepath.ThreadFacts, new: LiveRows) -> int:
        """Freeze the decisions the last pass made for the call it left pending, as the next pass
        would: that call is answered now (the new rows start with its answer), so no row it sees can
        change any more. Written as that pass writes them: stage by stage, in key order, with the
        call's key (the msg_key of its answer) where the thread's calls have keys."""
        key = new.messages[0][0]["msg_key"] if facts.keyed else None
        mine = (pl.col("session_id") == facts.session_id) & (pl.col("thread_id") == livepath.MAIN)
        n = 0
        for o in p.staged.outcomes:
            rows = o.applied.filter(pl.col("is_provisional") & mine)
            if rows.height:
                rows = rows.drop("is_provisional").sort(DECISION_KEY).with_columns(call_key=pl.lit(key, pl.String))
                n += self.ledger.stage(rows, spec_sha256=self.spec.sha256, stage=o.name,
                                       stage_version=o.stage.version, config_digest=o.config_digest)
        if n or self._tokens_due():
            self._commit()
        return n

    def _tokens_due(self) -> bool:
        """Whether the token counts made since the last commit are many enough to write now. They
        are a cache (a text is counted again when its count is lost): written with the next
        decisions, when this many are waiting, or at close(), not at every pass."""
        return self.ledger.pending_tokens >= TOKEN_FLUSH

    def _commit(self) -> None:
        """Write what the ledger holds queued (decisions, token counts, the spec) in one transaction."""
        if self._resolved is None:
            self._resolved = self.spec.resolved()
        self.ledger.commit_run(None, self._resolved, spec_sha256=self.spec.sha256)

    def _main_session(self, s: _Session, sessions: list[str]) -> str | None:
        """The session whose main thread the live path follows: a session of one transcript file."""
        if len(s.files) != 1 or len(sessions) != 1:
            return None
        return sessions[0]

    def _live_step(self, s: _Session, t0: float) -> str | None:
        """The live path (ctxreplay.pipeline.engine.live): take the entries ingested since the last step without a
        pass when they only extend the main thread and no stage decides anything about them.
        Returns None when it did, else why a full pass is needed (the scan reads the new lines
        either way, so it stays level with the spool)."""
        s.asked = s.follow = None
        if len(s.files) != 1:
            return "a session of several transcript files"
        f = next(iter(s.files.values()))
        if s.scan is None or s.scan.path != f.path:
            s.scan = livepath.TailScan(f.path)
        nodes, why = s.scan.scan(f.lines)
        p, facts = s.last, s.facts
        if why is None and (p is None or facts is None):
            why = "no pass over the session yet" if p is None else "the session has no main thread to extend"
        if why is None and facts is not None and facts.source_file != path_str(f.path):
            why = "the main thread comes from another file"
        if why is None and not self.live_path:
            why = "the live path is off"
        if why is not None:
            return why
        assert p is not None and facts is not None
        new = livepath.new_rows(nodes, facts, self.counter)
        if isinstance(new, str):
            return new
        s.follow = new  # a full pass, if a stage needs one, appends these rows instead of loading again
        if not self.ask_rules:
            return "the live rules are off"
        t1 = time.perf_counter()
        why, carried = livepath.step_rules(self._positions, facts, new)
        s.asked = (facts.calls, dict(facts.answers))
        if why is not None:
            return why
        t2 = time.perf_counter()
        committed = self._commit_pending(p, facts, new) if facts.pending_decisions else 0
        try:
            p.blocks = pl.concat([p.blocks, new.frame.select(p.blocks.columns)])
        except (pl.exceptions.PolarsError, KeyError):
            p.blocks = pl.concat([p.blocks, new.frame], how="diagonal_relaxed")
        try:
            p.rows = pl.concat([p.rows, new.frame.select(p.rows.columns)])
        except (pl.exceptions.PolarsError, KeyError):
            p.rows = pl.concat([p.rows, new.frame], how="diagonal_relaxed")
        s.follow = None
        p.skeleton = _grow_calls(p.skeleton, p.counts, new)
        p.new_decisions, p.full_pass_reason = committed, None
        p.written = pl.DataFrame()
        facts.grow(new, carried)
        s.unshaped.append(new)
        p.seconds = {"load": t1 - t0, "stages": t2 - t1, "commit": time.perf_counter() - t2}
        s.dirty = False
        return None

    def _write_spills(self, spills: pl.DataFrame) -> None:
        if not spills.height:
            return
        try:
            self.spill_dir.mkdir(parents=True, exist_ok=True)
            for sha, text in zip(spills.get_column("sha256").to_list(), spills.get_column("text").to_list()):
                path = self.spill_dir / sha
                if not path.exists():
                    path.write_text(text, encoding="utf-8", errors="surrogatepass")
        except OSError as exc:
            raise OutputError(f"cannot write spilled tool results to {self.spill_dir}: {exc.strerror or exc}. "
                              f"Pass a spill_dir you can write to") from exc

    # ------------------------------------------------------------------ assemble

    @_guarded
    def threads(self, session_id: str) -> dict[str, str | None]:
        """The session's threads (after a pass over what was ingested): thread id -> the entry id of
        its last message."""
        self._check_open()
        s = self._known(session_id)
        p = self._refresh(s)
        sid = self._loaded_session(s, p)
        if sid is None:
            return {}
        tips = (p.blocks.filter(pl.col("session_id") == sid).sort("order_key")
                .group_by("thread_id", maintain_order=True).agg(pl.col("entry_id").last()))
        return dict(zip(tips.get_column("thread_id").to_list(), tips.get_column("entry_id").to_list()))

    @_guarded
    def assemble(self, session_id: str, thread: str = "main", token_budget: int | None = None, *,
                 model: str | None = None, awaiting_user: bool = False) -> AssembleResult:
        """The request the thread sends now (its pending call), in the target's wire shape.

        Runs the stages when entries were ingested since the last call, freezing in the ledger the
        decisions of every call before the pending one. `token_budget`, when given, is checked,
        not enforced: the result says whether the request's estimate fits (`over_budget`). The
        layers work to the spec's `window_tokens` (a budget that changed what they decide would
        also change calls already sent); to make room now, call `compact(session_id, force=True)`.

        `model`: the model the request goes to (part of the request). Default: the model of the
        thread's last recorded call, as in the batch replay's pending request; the batch replay's
        recorded call k carries the model that answered it, so pass the model you call to get its
        bytes after a model switch (or for the first call, which has no earlier model).

        `awaiting_user`: the request is sent now (default), so when the thread ends with an
        assistant message (every entry after it was dropped, e.g. an orphan tool result) and the
        target takes no prefill (Anthropic), that message is left out, as in the batch replay's
        recorded calls. With `awaiting_user=True` it is kept, as in the batch replay's pending call
        of a thread that ended on the assistant's answer (`awaits_user`): the request a resumed
        session carries until the user's next message is added."""
        self._check_open()
        s = self._known(session_id)
        if token_budget is not None and (not isinstance(token_budget, int) or token_budget <= 0):
            raise InputError(f"token_budget must be a positive number of tokens, not {token_budget!r}")
        return self._assemble(s, self._refresh(s), thread, token_budget, model, awaiting_user)

    def _known(self, session_id: str) -> _Session:
        s = self._sessions.get(session_id)
        if s is None:
            raise InputError(f"session {session_id!r} has no entries in this engine; ingest(session_id, entries) "
                             f"first (a re-opened engine starts empty: ingest the transcript again)")
        return s

    @staticmethod
    def _loaded_session(s: _Session, p: _Pass) -> str | None:
        """The session id the loader gave the entries (from their own ids, as a batch run does)."""
        ids = p.blocks.get_column("session_id").unique().sort().to_list()
        if not ids:
            return None
        if s.session_id in ids:
            return s.session_id
        return str(ids[0])

    def _assemble(self, s: _Session, p: _Pass, thread: str, token_budget: int | None,
                  model: str | None = None, awaiting_user: bool = False) -> AssembleResult:
        if s.unshaped and thread == livepath.MAIN:
            fast = self._assemble_appended(s, p, token_budget, model, awaiting_user)
            if fast is not None:
                return fast
        target = get_target(self.target)
        sid = self._loaded_session(s, p)
        part = p.blocks.filter((pl.col("session_id") == sid) & (pl.col("thread_id") == thread)) if sid else \
            p.blocks.clear()
        if sid is not None and not part.height:
            names = sorted(p.blocks.filter(pl.col("session_id") == sid).get_column("thread_id").unique().to_list())
            raise InputError(f"session {s.session_id!r} has no thread {thread!r}; its threads: {', '.join(names)}")
        lsid = sid or s.session_id
        n = p.counts.get((lsid, thread), 0)
        visible = part.filter((pl.col("first_call") <= n) & (pl.col("last_call").is_null() | (pl.col("last_call") > n)))
        if model is None:  # the last call's model, None for an inherited one (replay.thread_calls)
            last = p.skeleton.filter((pl.col("session_id") == lsid) & (pl.col("thread_id") == thread)
                                     & (pl.col("call") == n - 1)).get_column("model")
            model = last[0] if len(last) else None
        live = s.live.get(thread)
        if live is None:
            live = s.live[thread] = LiveThread(target)
        t0 = time.perf_counter()
        pend = live.update(visible, model, self.counter, awaiting_user=awaiting_user)
        s.shaped = time.perf_counter() - t0
        if thread == livepath.MAIN:
            s.unshaped.clear()  # the state now holds every row
        applied = p.applied_decisions()
        mine = applied.filter((pl.col("session_id") == lsid) & (pl.col("thread_id") == thread)
                              & (pl.col("from_call") == n))
        epoch = int(visible.get_column("cache_epoch").max() or 0) if visible.height else 0  # type: ignore[arg-type]
        return self._result(s, p, thread, n, pend, epoch, model, mine, token_budget, lsid)

    def _result(self, s: _Session, p: _Pass, thread: str, n: int, pend: Any, epoch: int, model: str | None,
                decisions: pl.DataFrame, token_budget: int | None, lsid: str) -> AssembleResult:
        live = p.full_pass_reason is None
        out = AssembleResult(
            session_id=s.session_id, thread_id=thread, call=n, request_json=pend.request_json,
            request_sha256=pend.request_sha256, prompt_tokens=pend.prompt_tokens, n_messages=pend.n_messages,
            cache_epoch=epoch, awaits_user=pend.awaits_user, prefix_break_message=pend.prefix_break_message,
            model=model, decisions=decisions, new_decisions=p.new_decisions, quarantined=self._quarantined(s, p),
            stage_failures=tuple(f for f in p.staged.failures if lsid in f.sessions), token_budget=token_budget,
            target=self.target, rebuilt=pend.rebuilt, conflicts=0 if live else p.staged.conflicts,
            incremental=live, full_pass_reason=p.full_pass_reason)
        s.assembled[thread] = out
        return out

    def _assemble_appended(self, s: _Session, p: _Pass, token_budget: int | None, model: str | None,
                           awaiting_user: bool) -> AssembleResult | None:
        """The main thread's request after live steps: the kept replay state extended by their rows
        (None: the state is not the one they extend; the caller shapes from the visible rows)."""
        live, last, facts = s.live.get(livepath.MAIN), s.assembled.get(livepath.MAIN), s.facts
        # the kept state is the one the first unshaped step extends: the call before its answer
        if live is None or last is None or facts is None or last.call != s.unshaped[0].rows[0]["first_call"] - 1:
            s.unshaped.clear()
            return None
        new = s.unshaped[0].frame if len(s.unshaped) == 1 else pl.concat([n.frame for n in s.unshaped])
        tokens = [t for n in s.unshaped for t in n.tokens]
        if model is None:
            model = next((m[0]["model"] for n in reversed(s.unshaped) for m in reversed(n.messages)
                          if m[0]["role"] == "assistant"), None)
        t0 = time.perf_counter()
        pend = live.extend(new, tokens, model, awaiting_user=awaiting_user)
        s.shaped = time.perf_counter() - t0
        s.unshaped.clear()
        return self._result(s, p, livepath.MAIN, facts.calls, pend, last.cache_epoch, model,
                            p.applied_decisions().clear(), token_budget, facts.session_id)

    def _quarantined(self, s: _Session, p: _Pass) -> tuple[QuarantinedEntry, ...]:
        mine = {(q.file, q.line) for q in s.rejected}
        out = list(s.rejected)
        root = str(s.dir)
        for q in p.loaded.quarantine:
            name = q.file[len(root) + 1:] if q.file.startswith(root + "/") else q.file
            if (name, q.line) not in mine:
                out.append(QuarantinedEntry(name, q.line, q.raw, q.reason, q.code))
        return tuple(sorted(out, key=lambda q: (q.file, q.line)))

    # ------------------------------------------------------------------ compact, after_turn

    @_guarded
    def compact(self, session_id: str, force: bool = False, thread: str = "main") -> CompactResult:
        """Run the time- and budget-based layers now and freeze what they decide.

        Without `force`: the pipeline as specified (its stages' triggers: idle time, tokens,
        watermarks, budgets), on what was ingested, with the pending call's decisions frozen in
        the ledger at once (a compaction is a decision the agent acts on). With `force`: a simulated
        compaction, marked `simulated`: the spec's stages that can compact (a `compact` hook in
        `@stage`) run with their triggers at their minimum (every eligible old tool result is
        cleared now). A compaction recorded in the
        transcript (a summary entry) needs nothing here: it is replayed from the entries. An LLM
        summary is out of scope."""
        self._check_open()
        s = self._known(session_id)
        spec, forced = self._forced_spec() if force else (None, frozenset[str]())
        self._refresh(s)
        s.dirty = True
        made = self._refresh(s, spec=spec, freeze_pending=True, forced=forced).written
        s.dirty = True  # the request comes from a pass of the spec as written, the new decisions re-applied
        res = self._assemble(s, self._refresh(s), thread, None)
        return CompactResult(s.session_id, thread, force, force, made, res)

    def _forced_spec(self) -> tuple[PipelineSpec, frozenset[str]]:
        """The spec of a forced compaction: each stage with a `compact` hook at the params it gives,
        and the names of those positions."""
        import dataclasses

        stages, forced = [], set()
        for name, rs in zip(position_names(self.spec.stages), self.spec.stages, strict=True):
            if rs.stage.compact is not None:
                forced.add(name)
                rs = dataclasses.replace(rs, params=rs.stage.compact(rs.params))
            stages.append(rs)
        if not forced:
            able = sorted(st.name for st in load_stages().values() if st.compact is not None)
            raise SpecError(f"compact(force=True) runs the pipeline's stages that can compact now (those with a "
                            f"compact hook: {', '.join(able) or 'none is registered'}), and {self.spec.source} has "
                            f"none: add one, e.g. [[stage]] use = \"{able[0] if able else '<stage>'}\"")
        return dataclasses.replace(self.spec, stages=tuple(stages)), frozenset(forced)

    @_guarded
    def after_turn(self, session_id: str, usage: Mapping[str, Any], thread: str = "main") -> TurnUsage:
        """Record the usage the provider reported for the request last assembled on this thread
        (Anthropic `usage` keys, or OpenAI `prompt_tokens` / `completion_tokens`), beside the
        engine's estimate, in the ledger's `engine_usage` table (calibration and cost)."""
        self._check_open()
        s = self._known(session_id)
        last = s.assembled.get(thread)
        if last is None:
            raise InputError(f"after_turn({session_id!r}): assemble() this thread first; the usage belongs to the "
                             f"request it returned")
        if not isinstance(usage, Mapping):
            raise InputError(f"after_turn: usage must be a mapping (the provider's usage object), not "
                             f"{type(usage).__name__}")

        def num(*keys: str) -> int | None:
            for k in keys:
                v = usage.get(k)
                if isinstance(v, int) and not isinstance(v, bool):
                    return v
            return None

        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, Mapping) else None
        inp = num("input_tokens")
        if inp is None and num("prompt_tokens") is not None:
            inp = num("prompt_tokens") - (cached if isinstance(cached, int) else 0)  # type: ignore[operator]
        rec = TurnUsage(s.session_id, thread, last.call, last.prompt_tokens, inp,
                        num("output_tokens", "completion_tokens"),
                        num("cache_read_input_tokens") if "cache_read_input_tokens" in usage else
                        (cached if isinstance(cached, int) else None),
                        num("cache_creation_input_tokens"))
        import datetime as _dt

        self.ledger.con.execute(
            "INSERT INTO engine_usage VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            [self.spec.sha256, s.session_id, thread, last.call, last.request_sha256, last.prompt_tokens,
             rec.input_tokens, rec.output_tokens, rec.cache_read_tokens, rec.cache_write_tokens,
             orjson.dumps(dict(usage), default=str).decode(),
             _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")])
        return rec

    @_guarded
    def usage(self, session_id: str | None = None) -> pl.DataFrame:
        """The usage recorded by `after_turn` in this ledger (all sessions, or one)."""
        self._check_open()
        q = "SELECT * FROM engine_usage" + (" WHERE session_id = $sid" if session_id else "") + \
            " ORDER BY session_id, call"
        rel = self.ledger.con.sql(q, params={"sid": session_id} if session_id else None)
        return pl.from_arrow(rel.to_arrow_table())  # type: ignore[return-value]

    @_guarded
    def timings(self, session_id: str) -> dict[str, float]:
        """Seconds of the last pass over the session (load, stages, commit) and of shaping the last
        request assembled (shape)."""
        s = self._known(session_id)
        return {**(s.last.seconds if s.last else {}), "shape": s.shaped}

    @_guarded
    def stage_timings(self, session_id: str) -> dict[str, float]:
        """Seconds each stage position took in the last full pass over the session (its frozen
        decisions re-applied, the stage run, its decisions reconciled with the ledger), by the
        stage's name in the run (`<stage>#2` for a second use); together about `timings()["stages"]`."""
        s = self._known(session_id)
        return {o.name: o.stats.seconds for o in s.last.staged.outcomes} if s.last else {}


def iter_lines(path: str | Path) -> Iterator[bytes]:
    """The physical lines of a transcript file, as `ingest` takes them (line breaks removed)."""
    with open(path, "rb") as fh:
        for raw in fh:
            yield raw.rstrip(b"\n")


__all__ = ["AssembleResult", "CompactResult", "Engine", "QuarantinedEntry", "TurnUsage", "iter_lines"]
