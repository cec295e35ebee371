"""`ctxreplay diff`: what a pipeline (or ctxreplay, or input) change makes the model see differently.

`compare(golden, replay)` sets a fresh replay against a golden directory (pipeline/regress/snapshot.py):

- threads: changed (some call's request_sha256 or prompt_tokens differs), new (only in this run),
  vanished (only in the goldens);
- per changed thread: the first call whose request differs; at that call, the message where the
  two requests part (their message sha256 lists compared in request order) and the first block of
  it that differs, a unified diff of that block (long texts elided around the change), and the
  stage decision that explains it: a decision of this run or of the golden run, on this thread,
  applying from that call, that the other run did not make (the golden's decisions are in its
  decisions.jsonl, this run's in decisions.parquet);
- tokens and cost: prompt tokens over the session, golden against this run; the cost delta at the
  input-token price of each call's model (pipeline/cost/prices.py, every prompt token priced as
  uncached input), and the delta of `sim_cost_usd` (the cache simulator's cost) where both sides
  have it;
- inputs: files whose sha256 changed, new and removed files; a thread of a session one of whose
  files changed is reported as an input change, not a pipeline change.

`render_text`, `render_markdown` and `DiffReport.to_json` give the report: a one-screen summary
first, then one section per changed thread.
"""

from __future__ import annotations

import difflib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import polars as pl

from ctxreplay.pipeline.core.words import plural
from ctxreplay.pipeline.regress.snapshot import SIM_COST, Golden, GoldenError, Replay
from ctxreplay.version import __version__

MAX_DIFF_LINES = 40  # per block diff, after eliding
LINE_WIDTH = 160  # a longer line is elided around the change (or in its middle)
RUN_KEEP = (6, 2)  # a run of removed / added lines longer than their sum keeps its head and tail
SUMMARY_ROWS = 20  # threads listed in the summary table
MARKDOWN_LIMIT = 60_000  # a GitHub comment holds 65,536 characters


# ------------------------------------------------------------------------------------------ report


@dataclass
class CallDiff:
    """One differing call of a changed thread: where it differs and the decision that explains it."""

    call: int
    tokens: tuple[int | None, int | None] = (None, None)
    where: dict[str, Any] | None = None
    decision: dict[str, Any] | None = None
    other_decisions: int = 0
    explanation: str | None = None
    diff: list[str] = field(default_factory=list)
    same_as: int | None = None  # the difference is that of this earlier call (its diff is not repeated)

    def to_json(self) -> dict[str, Any]:
        return {"call": self.call, "prompt_tokens": {"golden": self.tokens[0], "new": self.tokens[1]},
                "where": self.where, "decision": self.decision, "other_decisions": self.other_decisions,
                "explanation": self.explanation, "diff": "\n".join(self.diff), "same_as": self.same_as}


@dataclass
class ThreadDiff:
    thread_key: str
    session_id: str
    thread_id: str
    status: str  # changed | new | vanished
    cause: str  # pipeline | input
    golden_key: str | None = None  # the thread's key in the goldens when it was renamed (its input file was)
    calls_golden: int = 0
    calls_new: int = 0
    calls_changed: int = 0
    first_call: int | None = None
    where: dict[str, Any] | None = None
    decision: dict[str, Any] | None = None
    other_decisions: int = 0
    explanation: str | None = None
    diff: list[str] = field(default_factory=list)
    tokens_golden: int = 0
    tokens_new: int = 0
    tokens_at_first: tuple[int | None, int | None] = (None, None)
    cost_usd_delta: float | None = None
    unpriced_calls: int = 0
    priced_calls: int = 0
    sim_cost_usd_delta: float | None = None
    differing_calls: list[int] = field(default_factory=list)
    call_diffs: list[CallDiff] = field(default_factory=list)  # every differing call, with --all
    _changes: list[dict[str, Any]] | None = field(default=None, repr=False)

    @property
    def tokens_delta(self) -> int:
        return self.tokens_new - self.tokens_golden

    @property
    def gkey(self) -> str:
        """The thread's key in the goldens."""
        return self.golden_key or self.thread_key

    def to_json(self) -> dict[str, Any]:
        return {
            "thread_key": self.thread_key, "session_id": self.session_id, "thread_id": self.thread_id,
            "status": self.status, "cause": self.cause,
            "calls": {"golden": self.calls_golden, "new": self.calls_new, "changed": self.calls_changed},
            "first_call": self.first_call, "where": self.where, "decision": self.decision,
            "other_decisions": self.other_decisions, "explanation": self.explanation, "diff": "\n".join(self.diff),
            "prompt_tokens": {"golden": self.tokens_golden, "new": self.tokens_new, "delta": self.tokens_delta,
                              "at_first_call": {"golden": self.tokens_at_first[0], "new": self.tokens_at_first[1]}},
            "cost_usd_delta": self.cost_usd_delta, "unpriced_calls": self.unpriced_calls,
            "sim_cost_usd_delta": self.sim_cost_usd_delta,
            "renamed_from": self.golden_key, "differing_calls": self.differing_calls,
            **({"call_diffs": [c.to_json() for c in self.call_diffs]} if self.call_diffs else {}),
        }


@dataclass
class DiffReport:
    golden_dir: str
    golden: dict[str, Any]  # what the goldens were made with
    run: dict[str, Any]  # what this run was made with
    threads: list[ThreadDiff]
    unchanged: int
    calls_total: int
    calls_changed: int
    tokens_golden: int
    tokens_new: int
    inputs: dict[str, list[str]]
    pipeline_changes: list[str]
    notes: list[str]
    cost_usd_delta: float | None
    unpriced_calls: int
    unpriced_models: list[str]
    sim_cost_usd_delta: float | None
    prices: str | None
    updated: bool = False
    seconds: dict[str, float] = field(default_factory=dict)
    renamed: list[dict[str, str]] = field(default_factory=list)  # threads matched across renamed inputs
    selection: dict[str, Any] | None = None  # --thread: the prefixes, the threads they select, of how many
    detail: str = "first"  # first | all | stat: what the text and markdown reports show per thread
    out_dir: str | None = None  # --out: where this run's outputs are kept (for `why`)
    kept_threads: int = 0  # --update --thread: goldens kept as they were
    selected: tuple[set[str], set[str]] | None = field(default=None, repr=False)  # --thread: golden, new keys

    @property
    def identical(self) -> bool:
        """Every request matches; inputs renamed (the same bytes under another name) do not count."""
        return not self.threads and not any(v for k, v in self.inputs.items() if k != "renamed")

    @property
    def exit_code(self) -> int:
        return 0 if self.identical or self.updated else 1

    def count(self, status: str, cause: str | None = None) -> int:
        return sum(1 for t in self.threads if t.status == status and (cause is None or t.cause == cause))

    def to_json(self) -> dict[str, Any]:
        return {
            "identical": self.identical, "exit_code": self.exit_code, "updated": self.updated,
            "golden_dir": self.golden_dir, "golden": self.golden, "run": self.run,
            "pipeline_changes": self.pipeline_changes, "notes": self.notes, "inputs": self.inputs,
            "renamed": self.renamed, "selection": self.selection, "kept_threads": self.kept_threads,
            "summary": {
                "threads": self.unchanged + len(self.threads) - self.count("vanished"),
                "threads_golden": self.unchanged + len(self.threads) - self.count("new"),
                "changed": self.count("changed"),
                "changed_by_pipeline": self.count("changed", "pipeline"),
                "changed_by_input": self.count("changed", "input"),
                "new": self.count("new"), "vanished": self.count("vanished"), "unchanged": self.unchanged,
                "calls": self.calls_total, "calls_changed": self.calls_changed,
                "prompt_tokens": {"golden": self.tokens_golden, "new": self.tokens_new,
                                  "delta": self.tokens_new - self.tokens_golden},
                "cost_usd_delta": self.cost_usd_delta, "unpriced_calls": self.unpriced_calls,
                "unpriced_models": self.unpriced_models, "sim_cost_usd_delta": self.sim_cost_usd_delta,
                "prices": self.prices,
            },
            "threads": [t.to_json() for t in self.threads],
            "seconds": {k: round(v, 3) for k, v in self.seconds.items()},
        }


# ---------------------------------------------------------------------------------------- compare


def compare(golden: Golden, rp: Replay, *, book: Any = None, threads: Sequence[str] | None = None,
            detail: str = "first") -> DiffReport:
    """Compare a replay with the goldens; `book` (a PriceBook) prices the token delta (None: no cost).
    `threads`: prefixes of thread keys (or SESSION/THREAD) that limit the comparison to the threads
    they name, and the input files to those of their sessions. `detail` "all" locates every
    differing call (else the first of each thread)."""
    t0 = time.perf_counter()
    man = golden.manifest
    gcalls = golden.calls_frame()
    ncalls = rp.calls.select(
        "thread_key", "call", "request_sha256", "prompt_tokens", "model",
        pl.col("timestamp").dt.strftime("%Y-%m-%dT%H:%M:%S%.3fZ"),
        (pl.col(SIM_COST).cast(pl.Float64) if SIM_COST in rp.calls.columns else pl.lit(None, pl.Float64)).alias(SIM_COST),
    )
    gthreads = golden.threads
    nthreads = {r[0]: (r[1], r[2]) for r in rp.calls.select("thread_key", "session_id", "thread_id").unique().rows()}
    inputs = _input_changes(man["inputs"]["files"], rp.inputs.files)
    # a renamed input (the same bytes under another name) can rename its threads: match them by content
    renamed_to = _renamed_threads(golden, rp, gcalls, ncalls, inputs, gthreads, nthreads)
    renamed_from = {n: g for g, n in renamed_to.items()}
    # whether the goldens have simulated costs: of all their calls (a selection may hold only unpriced ones)
    sim_both = SIM_COST in rp.calls.columns and gcalls.get_column(SIM_COST).null_count() < gcalls.height
    selection = None
    if threads:
        keep_g, keep_n = select_threads(threads, gthreads, nthreads, renamed_to, where=str(golden.path))
        selection = {"prefixes": list(threads),
                     "threads": len(keep_n | {renamed_to.get(k, k) for k in keep_g}),
                     "of": len(set(nthreads) | {renamed_to.get(k, k) for k in gthreads})}
        gthreads = {k: v for k, v in gthreads.items() if k in keep_g}
        nthreads = {k: v for k, v in nthreads.items() if k in keep_n}
        gcalls = gcalls.filter(pl.col("thread_key").is_in(list(keep_g)))
        ncalls = ncalls.filter(pl.col("thread_key").is_in(list(keep_n)))
        sessions = {v["session_id"] for v in gthreads.values()} | {v[0] for v in nthreads.values()}
        mine = {f for sid in sessions for f in (man.get("sessions", {}).get(sid, []) + rp.sessions.get(sid, []))}
        inputs = {k: ([x for x in v if x["from"] in mine or x["to"] in mine] if k == "renamed"
                      else [x for x in v if x in mine]) for k, v in inputs.items()}
    # the goldens' calls under this run's keys (a renamed thread's)
    gjoin = gcalls.with_columns(pl.col("thread_key").replace(renamed_to)) if renamed_to else gcalls
    joined = gjoin.join(ncalls, on=["thread_key", "call"], how="full", coalesce=True, suffix="_new")
    differs = joined.filter(
        pl.col("request_sha256").ne_missing(pl.col("request_sha256_new"))
        | pl.col("prompt_tokens").ne_missing(pl.col("prompt_tokens_new")))

    touched = set(inputs["changed"]) | set(inputs["added"]) | set(inputs["removed"])
    input_sessions = {sid for sid, files in man.get("sessions", {}).items() if touched & set(files)}
    input_sessions |= {sid for sid, files in rp.sessions.items() if touched & set(files)}

    gkeys = {renamed_to.get(k, k) for k in gthreads}  # the goldens' threads, under this run's keys
    changed_keys = sorted(set(differs.get_column("thread_key").unique().to_list()))
    costs = _costs(differs, book) if book is not None else None

    out: list[ThreadDiff] = []
    for key in changed_keys:
        part = joined.filter(pl.col("thread_key") == key)
        in_g, in_n = key in gkeys, key in nthreads
        gk = renamed_from.get(key, key)
        sid, tid = (gthreads[gk]["session_id"], gthreads[gk]["thread_id"]) if in_g and not in_n else nthreads[key]
        td = ThreadDiff(
            thread_key=key, session_id=sid, thread_id=tid,
            status="changed" if in_g and in_n else ("vanished" if in_g else "new"),
            cause="input" if sid in input_sessions or gthreads.get(gk, {}).get("session_id") in input_sessions
            else "pipeline",
            golden_key=gk if gk != key else None,
            calls_golden=part.get_column("request_sha256").count(),
            calls_new=part.get_column("request_sha256_new").count(),
            tokens_golden=int(part.get_column("prompt_tokens").sum()),
            tokens_new=int(part.get_column("prompt_tokens_new").sum()),
        )
        dpart = differs.filter(pl.col("thread_key") == key).sort("call")
        td.calls_changed = dpart.height
        td.differing_calls = [int(c) for c in dpart.get_column("call").to_list()]
        if costs is not None:
            td.cost_usd_delta, td.unpriced_calls, td.priced_calls = costs.get(key, (0.0, 0, 0))
            if td.unpriced_calls and not td.priced_calls:
                td.cost_usd_delta = None  # nothing of it could be priced: unknown, not 0
        if sim_both:
            # the pending call (and a model nobody prices) has no simulated cost: compare the calls
            # priced on both sides, when the same calls are priced on both
            g, n = part.get_column(SIM_COST), part.get_column(f"{SIM_COST}_new")
            if g.is_null().equals(n.is_null()) and g.null_count() < g.len():
                td.sim_cost_usd_delta = float(n.sum() - g.sum())
        if td.status == "changed":
            rows = list(dpart.iter_rows(named=True)) if detail == "all" else [dpart.row(0, named=True)]
            lists = _ListCache(golden, rp, td) if len(rows) > 1 else None
            for row in rows:
                cd = _locate(td, golden, rp, row, lists)
                if td.call_diffs or detail == "all":
                    prev = next((c for c in reversed(td.call_diffs) if c.same_as is None), None)
                    if prev is not None and _same_difference(prev, cd):
                        cd.same_as = prev.call
                    td.call_diffs.append(cd)
            first = td.call_diffs[0] if td.call_diffs else cd
            td.first_call, td.tokens_at_first = first.call, first.tokens
            td.where, td.decision, td.other_decisions = first.where, first.decision, first.other_decisions
            td.explanation, td.diff = first.explanation, first.diff
        out.append(td)
    order = {"changed": 0, "new": 1, "vanished": 2}
    out.sort(key=lambda t: (order[t.status], t.cause != "pipeline", t.thread_key))

    unpriced_models: list[str] = []
    if costs is not None:
        unpriced_models = sorted(costs.get("_unpriced_models", set()))  # type: ignore[arg-type]
    run_info = {"ctxreplay_version": __version__, "target": rp.target, "token_counter": rp.token_counter,
                "pipeline": {"name": rp.spec.name, "sha256": rp.spec.sha256}, "input_files": len(rp.inputs.files)}
    golden_info = {"ctxreplay_version": man.get("ctxreplay_version"), "target": man.get("target"),
                   "token_counter": man.get("token_counter"), "format_version": man.get("format_version"),
                   "pipeline": {k: man["pipeline"].get(k) for k in ("name", "sha256", "source")},
                   "input_files": len(man["inputs"]["files"])}
    notes = []
    if man.get("ctxreplay_version") != __version__:
        notes.append(f"the goldens were written by ctxreplay {man.get('ctxreplay_version')} and this is "
                     f"{__version__}: differences may come from the new version as well as from the pipeline")
    if sim_both is False and SIM_COST in rp.calls.columns:
        notes.append(f"this run has {SIM_COST} but the goldens do not: rewrite them with --update to compare "
                     f"simulated cache costs")
    with_sim = [t.sim_cost_usd_delta for t in out if t.sim_cost_usd_delta is not None]
    renamed = [{"from": g, "to": n} for g, n in sorted(renamed_to.items()) if g in gthreads and n in nthreads]
    report = DiffReport(
        golden_dir=str(golden.path), golden=golden_info, run=run_info, threads=out,
        unchanged=len(gkeys & set(nthreads)) - sum(1 for t in out if t.status == "changed"),
        calls_total=ncalls.height, calls_changed=differs.height,
        tokens_golden=int(gcalls.get_column("prompt_tokens").sum()), tokens_new=int(ncalls.get_column("prompt_tokens").sum()),
        inputs=inputs, pipeline_changes=spec_changes(man["pipeline"].get("resolved") or {}, rp.spec.resolved()),
        notes=notes,
        # None where every differing call is of an unpriced model: unknown, not 0
        cost_usd_delta=(sum(t.cost_usd_delta or 0.0 for t in out)
                        if costs is not None and (any(t.priced_calls for t in out) or not any(t.unpriced_calls for t in out))
                        else None),
        unpriced_calls=sum(t.unpriced_calls for t in out), unpriced_models=unpriced_models,
        # None where no changed thread could be priced on both sides: unknown, not 0
        sim_cost_usd_delta=(sum(with_sim) if with_sim else (None if out else 0.0)) if sim_both else None,
        prices=getattr(book, "source", None), renamed=renamed, selection=selection, detail=detail,
        selected=(set(gthreads), set(nthreads)) if threads else None,
    )
    report.seconds["compare"] = time.perf_counter() - t0
    return report


def _same_difference(a: CallDiff, b: CallDiff) -> bool:
    """Do two differing calls differ the same way (the same place, decision and block diff)?"""
    def body(c: CallDiff) -> list[str]:
        return [x for x in c.diff if not x.startswith(("--- ", "+++ "))]

    wa, wb = dict(a.where or {}), dict(b.where or {})
    for w in (wa, wb):
        w.pop("of_messages", None)
    return wa == wb and a.decision == b.decision and body(a) == body(b) and a.explanation == b.explanation


def _renamed_threads(golden: Golden, rp: Replay, gcalls: pl.DataFrame, ncalls: pl.DataFrame,
                     inputs: dict[str, Any], gthreads: dict[str, Any], nthreads: dict[str, tuple[str, str]]
                     ) -> dict[str, str]:
    """Golden thread key -> this run's, for threads whose input files were renamed (each a removed
    file and an added one with the same sha256, moved to inputs["renamed"]): a thread only in the
    goldens and one only in this run, of sessions whose files are the same but for those renames,
    are one thread when their calls are the same (request hashes and tokens), or when their ids
    are the same but for the file names."""
    before, after = golden.manifest["inputs"]["files"], rp.inputs.files
    by_sha: dict[str, list[str]] = {}
    for f in inputs["added"]:
        by_sha.setdefault(after[f]["sha256"], []).append(f)
    moves: dict[str, str] = {}
    for f in inputs["removed"]:
        cands = by_sha.get(before[f]["sha256"])
        if cands:
            moves[f] = cands.pop(0)
    inputs["renamed"] = [{"from": a, "to": b} for a, b in sorted(moves.items())]
    inputs["removed"] = [f for f in inputs["removed"] if f not in moves]
    inputs["added"] = [f for f in inputs["added"] if f not in set(moves.values())]
    if not moves:
        return {}
    g_only = [k for k in sorted(gthreads) if k not in nthreads]
    n_only = [k for k in sorted(nthreads) if k not in gthreads]
    if not g_only or not n_only:
        return {}
    g_sessions = golden.manifest.get("sessions", {})

    def calls_of(df: pl.DataFrame, key: str) -> list[tuple[Any, ...]]:
        return df.filter(pl.col("thread_key") == key).sort("call").select(
            "call", "request_sha256", "prompt_tokens").rows()

    stems = [(Path(a).name.split(".")[0], Path(b).name.split(".")[0]) for a, b in moves.items()]
    out: dict[str, str] = {}
    for g in g_only:
        sid_g = gthreads[g]["session_id"]
        mapped = {moves.get(f, f) for f in g_sessions.get(sid_g, [])}
        if not mapped or not mapped & set(moves.values()):
            continue
        cands = [n for n in n_only if n not in out.values() and set(rp.sessions.get(nthreads[n][0], [])) == mapped]
        if not cands:
            continue
        mine = calls_of(gcalls, g)
        hit = next((n for n in cands if calls_of(ncalls, n) == mine), None)
        if hit is None:
            tid_g = gthreads[g]["thread_id"]
            names = {tid_g} | {tid_g.replace(a, b) for a, b in stems if a and a in tid_g}
            hit = next((n for n in cands if nthreads[n][1] in names), None)
        if hit is not None:
            out[g] = hit
    return out


def select_threads(prefixes: Sequence[str], gthreads: dict[str, Any], nthreads: dict[str, tuple[str, str]],
                   renamed_to: dict[str, str], *, where: str) -> tuple[set[str], set[str]]:
    """(golden keys, this run's keys) that `--thread` prefixes name: a prefix of a thread key (a
    session's id, or a prefix of it, takes all its threads) or SESSION/THREAD with a prefix of
    each; a renamed thread is named by either key. A prefix that names no thread is refused."""
    from ctxreplay.errors import UnknownRef, did_you_mean

    ids = {k: (v["session_id"], v["thread_id"]) for k, v in gthreads.items()} | dict(nthreads)
    keep: set[str] = set()
    for ref in prefixes:
        if "/" in ref:
            s_ref, t_ref = ref.split("/", 1)
            hits = {k for k, (sid, tid) in ids.items() if sid.startswith(s_ref) and tid.startswith(t_ref)}
        else:
            hits = {k for k in ids if k.startswith(ref)}
        if not hits:
            shorts = sorted({f"{sid[:8]}/{tid}" for sid, tid in ids.values()})
            raise UnknownRef(f"--thread {ref}: no thread of the goldens in {where} or of this run starts with it."
                             f"{did_you_mean(ref, sorted(ids) + shorts)} Threads: "
                             f"{', '.join(shorts[:8])}{' ...' if len(shorts) > 8 else ''}")
        keep |= hits
    from_ = {n: g for g, n in renamed_to.items()}
    keep |= {renamed_to[k] for k in keep if k in renamed_to} | {from_[k] for k in keep if k in from_}
    return {k for k in keep if k in gthreads}, {k for k in keep if k in nthreads}


def _input_changes(before: dict[str, Any], after: dict[str, Any]) -> dict[str, list[str]]:
    return {
        "changed": sorted(k for k in before.keys() & after.keys() if before[k]["sha256"] != after[k]["sha256"]),
        "added": sorted(after.keys() - before.keys()),
        "removed": sorted(before.keys() - after.keys()),
        "renamed": [],  # [{"from", "to"}]: the same bytes under another name (filled in by _renamed_threads)
    }


def _costs(differs: pl.DataFrame, book: Any) -> dict[str, Any]:
    """Per thread: (USD delta, unpriced calls) at the input-token price of each differing call's model,
    every prompt token priced as uncached input on the day of the call (whole-request tiers)."""
    out: dict[str, Any] = {}
    unpriced: set[str] = set()
    cols = ["thread_key", "model", "model_new", "timestamp", "timestamp_new", "prompt_tokens", "prompt_tokens_new"]
    for key, m_g, m_n, ts_g, ts_n, tok_g, tok_n in differs.select(cols).iter_rows():
        usd, missing = 0.0, False
        for model, ts, tokens, sign in ((m_g, ts_g, tok_g, -1), (m_n, ts_n, tok_n, 1)):
            if tokens is None:
                continue
            rates = book.rates(model, ts) if model and ts else None
            if rates is None:
                missing = True
                # a price is per day: a call without a time stamp (a request file) cannot be priced
                unpriced.add(f"{model} (no time stamp)" if model and not ts else model or "(no model recorded)")
                continue
            usd += sign * tokens * rates.at(tokens).input / 1e6
        was = out.get(key, (0.0, 0, 0))
        # a call priced on one side only is left out whole: half a delta is no delta
        out[key] = (was[0] + (0.0 if missing else usd), was[1] + int(missing), was[2] + int(not missing))
    out["_unpriced_models"] = unpriced
    return out


def spec_changes(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """What changed between two resolved specs, one line per setting, stage or parameter."""
    lines: list[str] = []
    pb, pa_ = before.get("pipeline", {}), after.get("pipeline", {})
    for k in sorted(pb.keys() | pa_.keys()):
        if pb.get(k) != pa_.get(k):
            lines.append(f"[pipeline] {k}: {_short(pb.get(k))} → {_short(pa_.get(k))}")
    sb, sa = before.get("stage", []), after.get("stage", [])
    names_b, names_a = [s.get("use") for s in sb], [s.get("use") for s in sa]
    if names_b != names_a:
        lines.append(f"stages: {', '.join(map(str, names_b)) or '(none)'} → {', '.join(map(str, names_a)) or '(none)'}")
        return lines
    for i, (b, a) in enumerate(zip(sb, sa, strict=True), start=1):
        for k in sorted(b.keys() | a.keys()):
            if k != "use" and b.get(k) != a.get(k):
                lines.append(f"{b.get('use')} (#{i}) {k}: {_short(b.get(k))} → {_short(a.get(k))}")
    return lines


def _short(v: Any, width: int = 60) -> str:
    s = "(unset)" if v is None else orjson.dumps(v).decode() if not isinstance(v, str) else v
    return s if len(s) <= width else s[: width - 1] + "…"


# ------------------------------------------------------------------------------- where it differs


class _ListCache:
    """Each call's message lists of one thread, golden and new, computed once (--all asks for many)."""

    def __init__(self, golden: Golden, rp: Replay, td: ThreadDiff) -> None:
        from ctxreplay.pipeline.assembly.store import iter_call_lists

        self.golden = {k: (shas, env or None) for k, shas, env in golden.call_lists(td.gkey)}
        rows = rp.spans.filter(pl.col("thread_key") == td.thread_key)
        self.new = {k: (shas, env or None) for _, k, shas, env in iter_call_lists(rows)}


def _new_call_lists(rp: Replay, key: str, k: int) -> tuple[list[str], str | None]:
    rows = rp.spans.filter((pl.col("thread_key") == key) & (pl.col("first_call") <= k) & (pl.col("last_call") > k))
    msgs = rows.filter(pl.col("slot").is_not_null()).sort("slot").get_column("sha256").to_list()
    env = rows.filter(pl.col("slot").is_null()).get_column("sha256").to_list()
    return msgs, (env[0] if env else None)


def _locate(td: ThreadDiff, golden: Golden, rp: Replay, row: dict[str, Any], lists: _ListCache | None = None
            ) -> CallDiff:
    """Where the differing call `row` differs, the block diff and the explaining decision."""
    k, key, gkey = int(row["call"]), td.thread_key, td.gkey
    cd = CallDiff(call=k, tokens=(row["prompt_tokens"], row["prompt_tokens_new"]))
    if row["request_sha256"] is None or row["request_sha256_new"] is None:
        side = "this run" if row["request_sha256"] is None else "the goldens"
        cd.where = {"kind": "call_only_in_" + ("new" if row["request_sha256"] is None else "golden"),
                    "message": None, "block": None}
        cd.explanation = f"call {k} is only in {side}: the thread has {'more' if side == 'this run' else 'fewer'} calls"
        _explain(cd, td, golden, rp, None)
        return cd
    if lists is not None:
        (g_msgs, g_env), (n_msgs, n_env) = lists.golden.get(k, ([], None)), lists.new.get(k, ([], None))
    else:
        (g_msgs, g_env), (n_msgs, n_env) = golden.call_list(gkey, k), _new_call_lists(rp, key, k)
    if row["request_sha256"] == row["request_sha256_new"]:
        cd.where = {"kind": "tokens_only", "message": None, "block": None}
        cd.explanation = (f"call {k} sends the same bytes with another token count ({row['prompt_tokens']} → "
                          f"{row['prompt_tokens_new']}): the token counter differs")
        return cd
    sm = difflib.SequenceMatcher(None, g_msgs, n_msgs, autojunk=False)
    ops = [op for op in sm.get_opcodes() if op[0] != "equal"]
    g_data = {s: golden.message(s, gkey) for s in set(g_msgs) | ({g_env} if g_env else set())}
    missing = [s for s, v in g_data.items() if v is None]
    n_data = rp.messages([*n_msgs, *([n_env] if n_env else [])])
    if missing:
        cd.where = {"kind": "unknown", "message": None, "block": None}
        cd.explanation = (f"the goldens do not hold message {missing[0][:12]} of call {k}: the golden directory is "
                          f"damaged or was edited by hand; rewrite it with --update")
        return cd
    if not ops:  # the same messages: the envelope differs (system prompt, model, tools)
        gj = orjson.loads(g_data[g_env]) if g_env else {}
        nj = orjson.loads(n_data[n_env]) if n_env else {}
        keys = sorted(k2 for k2 in gj.keys() | nj.keys() if gj.get(k2) != nj.get(k2))
        cd.where = {"kind": "envelope", "message": None, "block": None, "keys": keys}
        cd.diff = block_diff(_lines({k2: gj.get(k2) for k2 in keys}), _lines({k2: nj.get(k2) for k2 in keys}),
                             f"golden call {k}, envelope", f"this run call {k}, envelope")
        _explain(cd, td, golden, rp, None)
        return cd
    tag, i1, i2, j1, j2 = ops[0]
    n_diff_msgs = sum(max(a2 - a1, b2 - b1) for _, a1, a2, b1, b2 in ops)
    g_msg = orjson.loads(g_data[g_msgs[i1]]) if i1 < i2 else None
    n_msg = orjson.loads(n_data[n_msgs[j1]]) if j1 < j2 else None
    g_blocks, n_blocks = message_blocks(g_msg), message_blocks(n_msg)
    b = 0
    while b < min(len(g_blocks), len(n_blocks)) and g_blocks[b] == n_blocks[b]:
        b += 1
    gb = g_blocks[b] if b < len(g_blocks) else None
    nb = n_blocks[b] if b < len(n_blocks) else None
    ref = nb if nb is not None else gb
    msg_for_id = n_msg if nb is not None else g_msg
    kind = {"replace": "changed", "delete": "removed", "insert": "inserted"}[tag]
    cd.where = {
        "kind": kind, "message": i1, "message_new": j1,
        "messages_removed": i2 - i1, "messages_added": j2 - j1, "messages_differing": n_diff_msgs,
        "of_messages": [len(g_msgs), len(n_msgs)],
        "role": _role(n_msg if tag == "insert" else g_msg), "block": b,
        "block_type": block_type(ref), "tool_use_id": tool_id(ref, msg_for_id),
    }
    label = f"call {k}, message {i1}" + (f" (this run: {j1})" if j1 != i1 else "") + f", block {b}"
    cd.diff = block_diff(_block_lines(gb), _block_lines(nb), f"golden {label}", f"this run {label}")
    _explain(cd, td, golden, rp, cd.where.get("tool_use_id"))
    return cd


def _role(msg: Any) -> str | None:
    """A wire message's role, or an OpenAI Responses item's type (items have no role)."""
    if not isinstance(msg, dict):
        return None
    return msg.get("role") or msg.get("type")


def _block_lines(b: Any) -> list[str]:
    if b is None:
        return []
    return _lines(b, "content") if isinstance(b, str) else _lines(b)


# ---------------------------------------------------------------------------------------- decisions

_DECISION_KEY = ("stage", "action", "reason", "entry_id", "block_pos", "part_pos", "from_call")


def _decision_changes(td: ThreadDiff, golden: Golden, rp: Replay) -> list[dict[str, Any]]:
    """The decisions one run made on the thread and the other did not, or made with another outcome."""
    if td._changes is not None:
        return td._changes
    gold = golden.decisions(td.gkey)
    new = rp.decisions.filter(pl.col("thread_key") == td.thread_key).select(
        "from_call", "stage", "action", "reason", "cache_epoch", "is_provisional", "entry_id", "block_pos",
        "part_pos", "tool_use_id", "before_sha256", "after_sha256").to_dicts()
    g_by = {tuple(d[c] for c in _DECISION_KEY): d for d in gold}
    n_by = {tuple(d[c] for c in _DECISION_KEY): d for d in new}
    changes: list[dict[str, Any]] = []
    for key in n_by.keys() - g_by.keys():
        changes.append({**n_by[key], "change": "new"})
    for key in g_by.keys() - n_by.keys():
        changes.append({**g_by[key], "change": "gone"})
    for key in n_by.keys() & g_by.keys():
        if n_by[key]["after_sha256"] != g_by[key]["after_sha256"] or n_by[key]["cache_epoch"] != g_by[key]["cache_epoch"]:
            changes.append({**n_by[key], "change": "changed"})
    td._changes = changes
    return changes


def _explain(cd: CallDiff, td: ThreadDiff, golden: Golden, rp: Replay, tool: str | None) -> None:
    """The decision that explains a differing call: one this run made and the golden run did not
    (or the reverse, or both with another outcome), applying from that call (else the latest
    before it); the one on the differing block's tool call when there is one."""
    k = cd.call
    changes = _decision_changes(td, golden, rp)
    at = [d for d in changes if d["from_call"] == k] or sorted(
        (d for d in changes if d["from_call"] < k), key=lambda d: -d["from_call"])
    if not at:
        if cd.explanation is None:
            cd.explanation = ("no stage decision differs at this call: the difference comes from the input transcript"
                              if td.cause == "input" else
                              "no stage decision differs at this call: the difference comes from the replay or the "
                              "target's shaping (ctxreplay's code, the target or the pipeline's settings)")
        return
    at.sort(key=lambda d: (tool is None or d.get("tool_use_id") != tool, d["from_call"] != k, d["change"] != "new",
                           str(d["stage"]), str(d["entry_id"]), d["block_pos"], d["part_pos"]))
    best = at[0]
    cd.decision = {c: best.get(c) for c in ("stage", "action", "reason", "from_call", "cache_epoch", "tool_use_id",
                                            "entry_id", "block_pos", "part_pos", "is_provisional", "change")}
    cd.other_decisions = sum(1 for d in at[1:] if d["from_call"] == best["from_call"])


def describe_decision(d: dict[str, Any]) -> str:
    where = {"new": "made by this run only", "gone": "made by the golden run only",
             "changed": "made by both, with another outcome"}[d["change"]]
    tool = f", tool call {d['tool_use_id']}" if d.get("tool_use_id") else ""
    prov = " (provisional: the pending call's, not frozen in the ledger)" if d.get("is_provisional") else ""
    return (f"{d['stage']}: {d['action']} ({d['reason']}) from call {d['from_call']}, cache_epoch {d['cache_epoch']}"
            f"{tool}; {where}{prov}")


# ---------------------------------------------------------------------------------------- blocks


def message_blocks(msg: Any) -> list[Any]:
    """A wire message's content blocks in order: its content (or Gemini parts) list, a string content
    as one block, then OpenAI chat tool calls; an item without content (OpenAI Responses) is one."""
    if msg is None:
        return []
    if not isinstance(msg, dict):
        return [msg]
    content = msg.get("content", msg.get("parts"))
    if isinstance(content, list):
        out = list(content)
    elif isinstance(content, str):
        out = [content] if content else []
    else:
        out = [] if "role" in msg else [msg]
    return out + list(msg.get("tool_calls") or ())


def block_type(b: Any) -> str | None:
    if b is None:
        return None
    if isinstance(b, str):
        return "text"
    if isinstance(b, dict):
        if "type" in b:
            return str(b["type"])
        for k in ("functionCall", "functionResponse", "text", "inlineData", "function"):
            if k in b:
                return k
    return type(b).__name__


def tool_id(b: Any, msg: Any = None) -> str | None:
    """The tool call id a block (or its message) carries, in any target's shape."""
    for obj in (b, msg):
        if not isinstance(obj, dict):
            continue
        for k in ("tool_use_id", "tool_call_id", "call_id", "id"):
            v = obj.get(k)
            if isinstance(v, str) and (k != "id" or obj.get("type") in ("tool_use", "function", "server_tool_use")):
                return v
        for k in ("functionCall", "functionResponse"):
            inner = obj.get(k)
            if isinstance(inner, dict) and isinstance(inner.get("id"), str):
                return str(inner["id"])
    return None


def _lines(value: Any, path: str = "") -> list[str]:
    """A JSON value as readable lines: `key: value`, nested keys dotted, a multi-line or long string
    as its own lines under `key: |` (so a diff shows the lines of a text that changed)."""
    label = f"{path}: " if path else ""
    if isinstance(value, dict):
        if not value:
            return [f"{label}{{}}"]
        out: list[str] = []
        for k in sorted(value):
            out += _lines(value[k], f"{path}.{k}" if path else str(k))
        return out
    if isinstance(value, list):
        if not value:
            return [f"{label}[]"]
        out = []
        for i, v in enumerate(value):
            out += _lines(v, f"{path}[{i}]")
        return out
    if isinstance(value, str):
        if "\n" in value:
            return [f"{path}: |" if path else "|", *(f"  {x}" for x in value.split("\n"))]
        return [f"{label}{value}"]
    return [f"{label}{orjson.dumps(value).decode()}"]


def _elide(line: str, width: int = LINE_WIDTH) -> str:
    if len(line) <= width:
        return line
    head, tail = width * 2 // 3, width // 4
    return f"{line[:head]}…[{len(line) - head - tail:,} chars]…{line[-tail:]}"


def _elide_pair(a: str, b: str, width: int = LINE_WIDTH) -> tuple[str, str]:
    """Two long lines that differ somewhere inside: keep the place where they part."""
    if len(a) <= width and len(b) <= width:
        return a, b
    p = 0
    while p < min(len(a), len(b)) and a[p] == b[p]:
        p += 1
    s = 0
    while s < min(len(a), len(b)) - p and a[-1 - s] == b[-1 - s]:
        s += 1
    lead = max(0, p - width // 3)

    def cut(x: str) -> str:
        end = len(x) - s
        mid = x[lead:end + 20]
        if len(mid) > width:
            mid = mid[: width // 2] + f"…[{len(mid) - width // 2 - 20:,} chars]…" + mid[-20:]
        return ("…" if lead else "") + mid + ("…" if end + 20 < len(x) else "")

    return cut(a), cut(b)


def block_diff(before: list[str], after: list[str], name_a: str, name_b: str, *, context: int = 3,
               max_lines: int = MAX_DIFF_LINES) -> list[str]:
    """A unified diff of two blocks' lines; long lines elided around the change, long runs of
    removed or added lines cut to their head and tail, at most `max_lines` lines."""
    raw = list(difflib.unified_diff(before, after, name_a, name_b, n=context, lineterm=""))
    if not raw:
        return []
    out: list[str] = raw[:2]
    body = raw[2:]
    i = 0
    while i < len(body):
        line = body[i]
        if line.startswith("@@") or line[:1] == " ":
            out.append(line if line.startswith("@@") else " " + _elide(line[1:]))
            i += 1
            continue
        sign = line[:1]
        j = i
        while j < len(body) and body[j][:1] == sign:
            j += 1
        run = body[i:j]
        # a single changed line followed by its replacement: elide both around where they part
        if sign == "-" and len(run) == 1 and j < len(body) and body[j][:1] == "+" and \
                (j + 1 == len(body) or body[j + 1][:1] != "+"):
            a, b = _elide_pair(run[0][1:], body[j][1:])
            out += ["-" + a, "+" + b]
            i = j + 1
            continue
        keep_head, keep_tail = RUN_KEEP
        if len(run) > keep_head + keep_tail + 1:
            run = run[:keep_head] + [f"{sign}[… {len(run) - keep_head - keep_tail:,} more lines …]"] + run[-keep_tail:]
        out += [sign + _elide(x[1:]) for x in run]
        i = j
    if len(out) > max_lines:
        out = out[:max_lines] + [f"[… {len(out) - max_lines:,} more diff lines …]"]
    return out


# ------------------------------------------------------------------------------------------ render


def _n(v: int) -> str:
    return f"{v:,}".replace("-", "−")


def _delta(v: int) -> str:
    return ("+" if v > 0 else "") + _n(v)


def _pct(a: int, b: int) -> str:
    return f", {(b - a) / a:+.1%}".replace("-", "−") if a else ""


def _usd(v: float | None) -> str:
    if v is None:
        return "n/a"
    s = f"{v:+,.6f}" if 0 < abs(v) < 0.01 else f"{v:+,.4f}"
    return s.replace("-", "−") + " USD"


def _where_text(td: ThreadDiff) -> str:
    return _where_text_of(td.where, td.explanation)


def _where_text_of(where: dict[str, Any] | None, explanation: str | None) -> str:
    w = where or {}
    kind = w.get("kind")
    if kind in (None, "unknown", "tokens_only") or kind.startswith("call_only"):
        return explanation or ""
    if kind == "envelope":
        return f"the envelope differs (keys: {', '.join(w.get('keys') or [])}); the messages are the same"
    what = {"changed": "differs", "removed": "is gone in this run", "inserted": "is new in this run"}[kind]
    msg_no = w["message"] if kind != "inserted" else w["message_new"]
    bt = w.get("block_type") or "?"
    tool = f" {w['tool_use_id']}" if w.get("tool_use_id") else ""
    extra = ""
    if w.get("messages_removed", 0) > 1 or w.get("messages_added", 0) > 1:
        extra = f"; {plural(w['messages_removed'], 'message')} replaced by {w['messages_added']}"
    n_g, n_n = w["of_messages"]
    return (f"message {msg_no} ({w.get('role') or '?'}) {what}, block {w['block']} ({bt}{tool}); "
            f"{w['messages_differing']} of {max(n_g, n_n)} messages differ at this call{extra}")


def _explained(td: ThreadDiff) -> str:
    if td.decision:
        d = td.decision
        return f"{d['stage']} {d['action']}/{d['reason']} from call {d['from_call']}"
    if td.status != "changed":
        return td.status
    return "input" if td.cause == "input" else "no decision"


def _head(r: DiffReport) -> str:
    sel = ""
    if r.selection:
        sel = (f" ({' '.join('--thread ' + x for x in r.selection['prefixes'])}: {r.selection['threads']} of "
               f"{plural(r.selection['of'], 'thread')})")
    if r.identical:
        ren = ""
        if r.inputs.get("renamed"):
            n = len(r.inputs["renamed"])
            ren = (f"; {plural(n, 'input file')} renamed ({'its' if n == 1 else 'their'} threads matched by "
                   f"content: {plural(len(r.renamed), 'thread')})")
        return (f"ctxreplay diff: identical: {plural(r.unchanged, 'thread')}, {plural(r.calls_total, 'call')} "
                f"{'matches' if r.calls_total == 1 else 'match'} the goldens in {r.golden_dir}{sel}{ren}")
    return (f"ctxreplay diff: {r.count('changed')} of {plural(r.unchanged + r.count('changed'), 'thread')} changed "
            f"({r.count('changed', 'pipeline')} by the pipeline, {r.count('changed', 'input')} by changed inputs), "
            f"{r.count('new')} new, {r.count('vanished')} vanished; goldens {r.golden_dir}{sel}")


def _summary_facts(r: DiffReport) -> list[tuple[str, str]]:
    """The summary after its first line, as (label, text) pairs."""
    g, n = r.golden, r.run
    facts = [
        ("goldens", (f"pipeline '{g['pipeline']['name']}' ({str(g['pipeline']['sha256'])[:12]}), ctxreplay "
                    f"{g['ctxreplay_version']}, target {g['target']}, {plural(g['input_files'], 'input file')}")),
        ("this run", (f"pipeline '{n['pipeline']['name']}' ({n['pipeline']['sha256'][:12]}), ctxreplay "
                     f"{n['ctxreplay_version']}, target {n['target']}, {plural(n['input_files'], 'input file')}")),
    ]
    if r.pipeline_changes:
        more = f" (+{len(r.pipeline_changes) - 6} more)" if len(r.pipeline_changes) > 6 else ""
        facts.append(("pipeline", "; ".join(r.pipeline_changes[:6]) + more))
    if not r.identical:
        facts.append(("requests", f"{_n(r.calls_changed)} of {_n(r.calls_total)} calls differ"))
        pct = _pct(r.tokens_golden, r.tokens_new)
        facts.append(("prompt tokens", (f"{_n(r.tokens_golden)} → {_n(r.tokens_new)} "
                                       f"({_delta(r.tokens_new - r.tokens_golden)}{pct}) "
                                       f"{'over the threads compared' if r.selection else 'over all sessions'}")))
        models = f"{', '.join(r.unpriced_models[:3])}{' ...' if len(r.unpriced_models) > 3 else ''}"
        if r.cost_usd_delta is None and r.unpriced_calls:
            # every differing call is of a model without a price: unknown, not +0
            facts.append(("cost", f"unknown at input-token prices (unpriced models: {models})"))
        elif r.cost_usd_delta is not None:
            un = ""
            if r.unpriced_calls:
                un = (f"; {plural(r.unpriced_calls, 'call')} of unpriced models left out "
                      f"({', '.join(r.unpriced_models[:3])}{' ...' if len(r.unpriced_models) > 3 else ''})")
            facts.append(("cost", f"{_usd(r.cost_usd_delta)} at input-token prices ({r.prices}){un}"))
        if r.sim_cost_usd_delta is not None:
            facts.append(("simulated cost", f"{_usd(r.sim_cost_usd_delta)} ({SIM_COST}, with prompt caching)"))
        inp = r.inputs
        if any(inp.get(k) for k in ("changed", "added", "removed")):
            parts = [f"{len(inp[k])} {k}" for k in ("changed", "added", "removed") if inp[k]]
            names = inp["changed"][:3] + inp["added"][:2] + inp["removed"][:2]
            more = " ..." if sum(len(inp[k]) for k in ("changed", "added", "removed")) > len(names) else ""
            facts.append(("input files", f"{', '.join(parts)}: {', '.join(names)}{more}"))
        elif not inp.get("renamed"):
            facts.append(("input files", "unchanged"))
    for x in (r.inputs.get("renamed") or [])[:6]:
        threads = [f"{t['from']} → {t['to']}" for t in r.renamed if _renamed_by(x, t)]
        facts.append(("renamed", f"{x['from']} → {x['to']} (the same bytes)"
                      + (f"; thread {', '.join(threads)}" if threads else "")))
    if len(r.inputs.get("renamed") or []) > 6:
        facts.append(("renamed", f"... and {len(r.inputs['renamed']) - 6} more input files"))
    facts += [("note", x) for x in r.notes]
    return facts


def _renamed_by(move: dict[str, str], t: dict[str, str]) -> bool:
    """Is thread rename `t` (golden key -> this run's) the doing of input rename `move`? (By name:
    the file's stem in the old key and the new stem in the new one, else any thread.)"""
    a, b = Path(move["from"]).name.split(".")[0], Path(move["to"]).name.split(".")[0]
    return (a in t["from"] and b in t["to"]) or t["from"].split("--")[0] != t["to"].split("--")[0]


def _summary_lines(r: DiffReport) -> list[str]:
    return [_head(r), *(f"  {label + ':':<16}{text}" for label, text in _summary_facts(r))]


def _table_rows(r: DiffReport) -> list[tuple[str, ...]]:
    rows = []
    for t in r.threads:
        first = str(t.first_call) if t.first_call is not None else "–"
        calls = f"{t.calls_changed}/{max(t.calls_golden, t.calls_new)}"
        cost = _usd(t.cost_usd_delta).replace(" USD", "") if t.cost_usd_delta is not None else \
            ("unpriced" if t.unpriced_calls else "–")
        rows.append((t.thread_key, t.status if t.status != "changed" else t.cause, first, calls,
                     _delta(t.tokens_delta), cost, _explained(t)))
    return rows


def render_text(r: DiffReport) -> str:
    """The report for a terminal: the summary and a table of the threads, then (unless --stat) a
    section per thread: its first differing call (--all: every one) with where and why."""
    lines = _summary_lines(r)
    if r.identical:
        return "\n".join(lines) + "\n"
    header = ("thread", "cause", "first call", "calls", "tokens Δ", "cost Δ USD", "explained by")
    rows = _table_rows(r)
    shown = rows if r.detail == "stat" else rows[:SUMMARY_ROWS]
    widths = [max(len(x[i]) for x in [header, *shown]) for i in range(len(header))]
    lines.append("")
    for row in [header, *shown]:
        cells = [row[i].ljust(widths[i]) if i in (0, 1, 6) else row[i].rjust(widths[i]) for i in range(len(row))]
        lines.append("  " + "  ".join(cells).rstrip())
    if len(rows) > len(shown):
        lines.append(f"  ... and {plural(len(rows) - SUMMARY_ROWS, 'more thread')} (all of them below)")
    if r.detail != "stat":
        for t in r.threads:
            lines += ["", f"== {t.thread_key} ({_status_words(t)})"]
            lines += [f"  {x}" for x in _thread_facts(t, each_call=r.detail == "all" and bool(t.call_diffs))]
            if r.detail == "all" and t.call_diffs:
                lines += _call_lines(t)
            else:
                lines += [f"  {x}" for x in t.diff]
                rest = t.differing_calls[1:]
                if rest:
                    listed = ", ".join(map(str, rest[:8])) + (f" and {len(rest) - 8} more" if len(rest) > 8 else "")
                    lines.append(f"  other differing calls: {listed} (`{_why_command(r, t, rest[0])}` shows one)")
    if any(r.inputs.get(k) for k in ("changed", "added", "removed")):
        lines += ["", ("== input files (an input change is not a pipeline regression: rewrite the goldens with "
                  "--update once the new inputs are the ones to keep)")]
        for k in ("changed", "added", "removed"):
            lines += [f"  {k}: {x}" for x in r.inputs[k]]
    lines += ["", *_hint(r)]
    return "\n".join(lines) + "\n"


def _why_command(r: DiffReport, t: ThreadDiff, k: int) -> str:
    return f"ctxreplay why {r.out_dir or 'OUT'} {t.thread_key} --call {k}"


def _hint(r: DiffReport) -> list[str]:
    """The last line: how to see what the report leaves out, and the `why` command for one call."""
    changed = [t for t in r.threads if t.status == "changed"]
    if not changed:
        return []
    t = next((x for x in changed if len(x.differing_calls) > 1), changed[0])
    k = t.differing_calls[1] if len(t.differing_calls) > 1 else t.differing_calls[0]
    out = "" if r.out_dir else " (OUT: keep this run's outputs with --out OUT)"
    more = {"first": "--all lists every differing call with its decision, --stat one line per thread",
            "all": "--stat gives one line per thread",
            "stat": "without --stat: where each thread differs; --all: every differing call with its decision"}
    hint = (f"more: {more[r.detail]}; `{_why_command(r, t, k)}` shows one call block by block, with the "
            f"decision behind every change{out}")
    return [hint]


def _call_lines(t: ThreadDiff) -> list[str]:
    """--all: each differing call of a thread, with where it differs and its decision; a call that
    differs as the one before it does says so instead of repeating the block diff."""
    out = [f"  calls that differ ({len(t.call_diffs)}):"]
    for c in t.call_diffs:
        a, b = c.tokens
        tok = f"{_n(a)} → {_n(b)} tokens" if a is not None and b is not None else \
            ("only in this run" if a is None else "only in the goldens")
        out.append(f"  - call {c.call} ({tok})")
        if c.same_as is not None:
            out.append(f"      the same difference as call {c.same_as}"
                       + (f" ({_explained_call(c)})" if c.decision else ""))
            continue
        where = _where_text_of(c.where, c.explanation)
        if where:
            out.append(f"      where: {where}")
        if c.decision:
            more = f" (and {plural(c.other_decisions, 'other decision')} from that call)" if c.other_decisions else ""
            out.append(f"      decision: {describe_decision(c.decision)}{more}")
        elif c.explanation and (c.where or {}).get("kind") not in ("unknown", "tokens_only") and \
                not str((c.where or {}).get("kind", "")).startswith("call_only"):
            out.append(f"      decision: none; {c.explanation}")
        out += [f"      {x}" for x in c.diff]
    return out


def _explained_call(c: CallDiff) -> str:
    d = c.decision or {}
    return f"{d.get('stage')} {d.get('action')}/{d.get('reason')} from call {d.get('from_call')}"


def _status_words(t: ThreadDiff) -> str:
    if t.status == "new":
        return "new thread: only in this run" + (" (from changed inputs)" if t.cause == "input" else "")
    if t.status == "vanished":
        return "vanished: only in the goldens" + (" (from changed inputs)" if t.cause == "input" else "")
    ren = f"; renamed from {t.golden_key}" if t.golden_key else ""
    return ("input change: a file of its session changed" if t.cause == "input" else "pipeline change") + ren


def _thread_facts(t: ThreadDiff, each_call: bool = False) -> list[str]:
    """A thread's facts; `each_call`: where and why are said per call after them (--all)."""
    out = []
    if t.status == "changed":
        out.append(f"first differing call: {t.first_call} ({t.calls_changed} of {max(t.calls_golden, t.calls_new)} "
                   f"calls differ)")
        where = _where_text(t)
        if where and not each_call:
            out.append(f"where: {where}")
        if each_call:
            pass
        elif t.decision:
            more = f" (and {plural(t.other_decisions, 'other decision')} from that call)" if t.other_decisions else ""
            out.append(f"decision: {describe_decision(t.decision)}{more}")
        elif t.explanation and (t.where or {}).get("kind") not in ("unknown", "tokens_only") and \
                not str((t.where or {}).get("kind", "")).startswith("call_only"):
            out.append(f"decision: none; {t.explanation}")
        a, b = t.tokens_at_first
        at = f"; at call {t.first_call}: {_n(a)} → {_n(b)} ({_delta(b - a)})" if a is not None and b is not None else ""
        out.append(f"prompt tokens over the session: {_n(t.tokens_golden)} → {_n(t.tokens_new)} "
                   f"({_delta(t.tokens_delta)}){at}")
    else:
        calls = t.calls_new or t.calls_golden
        out.append(f"{plural(calls, 'call')}, {plural(t.tokens_new or t.tokens_golden, 'prompt token')}")
    if t.cost_usd_delta is not None:
        un = f" ({plural(t.unpriced_calls, 'call')} of unpriced models left out)" if t.unpriced_calls else ""
        out.append(f"cost at input-token prices: {_usd(t.cost_usd_delta)}{un}")
    elif t.unpriced_calls:
        out.append(f"cost at input-token prices: unknown (no price for the model of its "
                   f"{plural(t.unpriced_calls, 'differing call')})")
    if t.sim_cost_usd_delta is not None:
        out.append(f"simulated cost ({SIM_COST}): {_usd(t.sim_cost_usd_delta)}")
    return out


def render_markdown(r: DiffReport, limit: int = MARKDOWN_LIMIT) -> str:
    """The report as GitHub-flavoured markdown for a pull-request comment: the summary and a table,
    then one collapsible <details> per thread; cut to `limit` characters."""
    title = "identical to the goldens" if r.identical else _head(r).removeprefix("ctxreplay diff: ")
    out = [f"### ctxreplay diff: {_md_escape(title)}", ""]
    out += ["| | pipeline | ctxreplay | target | input files |", "|---|---|---|---|---|"]
    for name, d in (("goldens", r.golden), ("this run", r.run)):
        out.append(f"| {name} | `{d['pipeline']['name']}` ({str(d['pipeline']['sha256'])[:12]}) | "
                   f"{d['ctxreplay_version']} | {d['target']} | {d['input_files']} |")
    out.append("")
    for label, text in _summary_facts(r)[2:]:
        if label == "pipeline":
            text = "; ".join(f"`{_md_code(x)}`" for x in r.pipeline_changes)
        else:
            text = _md_escape(text)
        out.append(f"- **{label}:** {text}")
    if not r.identical:
        out += ["", "| thread | cause | first call | calls | tokens Δ | cost Δ USD | explained by |",
                "|---|---|--:|--:|--:|--:|---|"]
        rows = _table_rows(r)
        n_rows = len(rows) if r.detail == "stat" else SUMMARY_ROWS
        for row in rows[:n_rows]:
            out.append("| " + " | ".join([f"`{row[0]}`", *(_md_escape(x) for x in row[1:])]) + " |")
        if len(rows) > n_rows:
            out.append(f"\n… and {plural(len(rows) - SUMMARY_ROWS, 'more thread')}, below.")
    out.append("")
    text = "\n".join(out)
    tail = []
    if any(r.inputs.get(k) for k in ("changed", "added", "removed")):
        tail = [("<details><summary>input files that changed (an input change is not a pipeline regression)"
                "</summary>"), ""]
        for k in ("changed", "added", "removed"):
            tail += [f"- {k}: `{_md_code(x)}`" for x in r.inputs[k]]
        tail += ["", "</details>", ""]
    sections = []
    for t in r.threads if r.detail != "stat" else []:
        sec = [f"<details><summary><code>{t.thread_key}</code>: {_md_escape(_status_words(t))}"
               + (f", call {t.first_call}" if t.first_call is not None else "")
               + (f" — {_md_escape(_explained(t))}" if t.decision else "") + "</summary>", ""]
        sec += [f"- {_md_escape(x)}" for x in _thread_facts(t, each_call=r.detail == "all" and bool(t.call_diffs))]
        if r.detail == "all" and t.call_diffs:
            body = _call_lines(t)
            fence = "````" if any("```" in x for x in body) else "```"
            sec += ["", fence, *body, fence]
        elif t.diff:
            fence = "````" if any("```" in x for x in t.diff) else "```"
            sec += ["", f"{fence}diff", *t.diff, fence]
        sec += ["", "</details>", ""]
        sections.append("\n".join(sec))
    if not r.identical:
        tail += [f"_{_md_escape(x)}_" for x in _hint(r)]
    body = text
    for i, sec in enumerate(sections):
        if len(body) + len(sec) + len("\n".join(tail)) > limit - 200:
            body += (f"\n… {plural(len(sections) - i, 'more thread')} left out to fit a comment: run `ctxreplay diff` "
                     f"with `--format text` or `--json` for all of them.\n")
            break
        body += "\n" + sec
    return body + ("\n" + "\n".join(tail) if tail else "")


def _md_escape(s: str) -> str:
    return s.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def _md_code(s: str) -> str:
    return s.replace("`", "'")


def render(r: DiffReport, fmt: str) -> str:
    if fmt == "json":
        return orjson.dumps(r.to_json()).decode() + "\n"
    if fmt == "markdown":
        return render_markdown(r)
    return render_text(r)


# ------------------------------------------------------------------------------------------ driver


def check_target(golden: Golden, spec: Any, target: str | None) -> str:
    """The target to replay for: --target, else the spec's, else the goldens'; refused when it is not
    the goldens' target (requests in two wire shapes have nothing to compare)."""
    chosen = (target or spec.target or golden.target).replace("_", "-")
    if chosen != golden.target:
        how = "--target" if target else f"the spec ({spec.source}) sets [pipeline] target ="
        raise GoldenError(f"the goldens in {golden.path} were written for target {golden.target}, but {how} "
                          f"{chosen}: requests in two wire shapes cannot be compared block by block. Pass --target "
                          f"{golden.target} to compare with them, or rewrite them for {chosen} with --update")
    return chosen


def run_diff(paths: Sequence[Path], spec: Any, golden_dir: Path, *, target: str | None = None,
             update: bool = False, out_dir: Path | None = None, prices: Path | None = None,
             token_counter: str | None = None, progress: Callable[[str], None] | None = None,
             threads: Sequence[str] | None = None, detail: str = "first") -> DiffReport | None:
    """Replay and compare with the goldens; with `update`, rewrite them afterwards (or write them when
    there are none, or they cannot be read: returns None then). `threads` (prefixes): compare those
    threads only, and with `update` rewrite only their goldens, keeping the others as they were.
    Raises GoldenError (exit 2) when the goldens cannot be compared with. `token_counter` is used
    only to write new goldens: a comparison counts with the goldens' counter."""
    from ctxreplay.pipeline.regress.snapshot import golden_lock

    args = (paths, spec, golden_dir, target, update, out_dir, prices, token_counter, progress, threads, detail)
    if not update:
        return _run_diff(*args)
    with golden_lock(golden_dir):  # --update writes the goldens: one writer at a time
        return _run_diff(*args)


def _run_diff(paths: Sequence[Path], spec: Any, golden_dir: Path, target: str | None, update: bool,
              out_dir: Path | None, prices: Path | None, token_counter: str | None,
              progress: Callable[[str], None] | None, threads: Sequence[str] | None, detail: str) -> DiffReport | None:
    from ctxreplay.pipeline.core.tokens import TIKTOKEN_COUNTER
    from ctxreplay.pipeline.regress.snapshot import check_golden_dir, replay, write_golden

    t0 = time.perf_counter()
    golden: Golden | None
    try:
        golden = Golden(golden_dir)
    except GoldenError:
        if not update or threads:  # --update --thread keeps the other threads' goldens: it needs them
            raise
        golden = None
        check_golden_dir(golden_dir)
    if golden is not None:
        # the goldens' token counter: another one would change every call's prompt_tokens
        counter = golden.manifest.get("token_counter") or TIKTOKEN_COUNTER
        chosen = check_target(golden, spec, target) if not update or threads else \
            (target or spec.target or golden.target).replace("_", "-")
    else:
        counter, chosen = token_counter or TIKTOKEN_COUNTER, target
    book = None
    if golden is not None:
        from ctxreplay.pipeline.cost.prices import PriceBook

        book = PriceBook.load(prices)
    with replay(paths, spec, target=chosen, token_counter=counter, out_dir=out_dir, progress=progress) as rp:
        t_run = time.perf_counter()
        report = None
        if golden is not None and rp.target == golden.target:
            report = compare(golden, rp, book=book, threads=threads, detail=detail)
            report.seconds["replay"] = rp.seconds
            report.out_dir = str(out_dir) if out_dir is not None else None
        if update:
            if threads and report is not None and report.selected is not None:
                g_keys, n_keys = report.selected
                stats = write_golden(rp, golden_dir, only=g_keys | n_keys, keep=golden)
                report.kept_threads = stats.kept_threads
            else:
                write_golden(rp, golden_dir)
            if report is not None:
                report.updated = True
    if book is not None:
        book.save()
    if report is not None:
        report.seconds["total"] = time.perf_counter() - t0
        report.seconds["after_replay"] = time.perf_counter() - t_run
    return report


__all__ = ["CallDiff", "DiffReport", "ThreadDiff", "block_diff", "compare", "message_blocks", "render",
           "render_markdown", "render_text", "run_diff", "select_threads", "spec_changes"]
