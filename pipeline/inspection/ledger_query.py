"""`ctxreplay ledger`: the decisions of the run OUT shows, counted as its summary counts them, and
the ledger's frozen decisions.

A run applies two kinds of decisions (stagerun.run_stages): frozen ones, written to (or reused from)
the ledger, and provisional ones, made for a thread's pending call and applied to its request but
not frozen (the transcript may still grow before that request is sent). The run's
decisions.parquet holds both, with `is_provisional`; the ledger only the frozen ones. So the run's
counts come from decisions.parquet (they equal summary.json's `decisions`), each split into
frozen and provisional, and listed rows carry their ledger `seq` when frozen.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl

from ctxreplay.errors import CtxReplayError
from ctxreplay.pipeline.assembly.replay import thread_key
from ctxreplay.pipeline.inspection.threads import (
    RunView,
    ThreadRef,
    known_stages,
    resolve_session,
    resolve_thread,
    session_prefixes,
    stage_rank,
)
from ctxreplay.pipeline.staging.ledger import Ledger
from ctxreplay.schemas.decisions import DECISION_KEY

VALIDATE_PREFIX = "validate:"


@dataclass
class LedgerQuery:
    stage: str | None = None
    session: str | None = None
    thread: str | None = None
    limit: int = 50


def _stage_filter(name: str | None, known: list[str]) -> pl.Expr:
    """`--stage pairing` takes pairing and its later uses (pairing#2); `pairing#2` that one only."""
    if not name:
        return pl.lit(True)
    base = sorted({k.split("#")[0] for k in known} | set(known))
    if name not in base:
        from ctxreplay.errors import did_you_mean

        raise CtxReplayError(f"unknown stage '{name}'.{did_you_mean(name, base)} Stages: {', '.join(base)}")
    if "#" in name:
        return pl.col("stage") == name
    return (pl.col("stage") == name) | pl.col("stage").str.starts_with(name + "#")


def query(out_dir: Path, ledger_path: Path | None, q: LedgerQuery) -> dict[str, Any]:
    path = ledger_path or out_dir / "ledger.duckdb"
    if not path.is_file():
        raise CtxReplayError(f"{path}: no ledger here; run `ctxreplay run ... --out {out_dir}` first or pass --ledger")
    try:
        view: RunView | None = RunView(out_dir)
        run_dec = view.decisions if (view.run_dir / "decisions.parquet").is_file() else None
    except CtxReplayError:
        view, run_dec = None, None
    led = Ledger(path, read_only=True)
    try:
        ledger_all = led.decisions(with_replacement=False)
        runs = led.runs()
    finally:
        led.close()
    known = known_stages(view, *ledger_all.get_column("stage").unique().to_list())
    stage_expr = _stage_filter(q.stage, known)

    # session and thread filters: prefixes, resolved against the run and the ledger
    led_threads = ledger_all.select("session_id", "thread_id").unique().sort("session_id", "thread_id")
    threads = {t.key: t for t in (view.threads if view is not None else [])}
    for sid, tid in led_threads.iter_rows():
        threads.setdefault(thread_key(sid, tid), ThreadRef(thread_key(sid, tid), sid, tid))
    sessions = sorted({t.session_id for t in threads.values()})
    where = str(out_dir)
    keep = pl.lit(True)
    session = thread = None
    if q.session:
        session = resolve_session(q.session, sessions, where=where)
        keep = keep & (pl.col("session_id") == session)
    if q.thread:
        thread = resolve_thread(q.thread, sorted(threads.values(), key=lambda t: t.key), where=where)
        keep = keep & (pl.col("session_id") == thread.session_id) & (pl.col("thread_id") == thread.thread_id)

    is_violation = pl.col("stage").str.starts_with(VALIDATE_PREFIX)
    in_ledger = ledger_all.filter(keep & stage_expr)
    doc: dict[str, Any] = {
        "ledger": str(path), "runs": runs.height,
        # what matches the filters (the whole ledger without them), and the whole ledger
        "ledger_decisions": in_ledger.filter(~is_violation).height,
        "ledger_namespaces": in_ledger.filter(~is_violation).get_column("spec_sha256").n_unique(),
        "violations": in_ledger.filter(is_violation).height,
        "ledger_totals": {"decisions": ledger_all.filter(~is_violation).height,
                          "namespaces": ledger_all.filter(~is_violation).get_column("spec_sha256").n_unique(),
                          "violations": ledger_all.filter(is_violation).height},
        "filters": {"stage": q.stage, "session": session, "thread": thread.key if thread else None},
    }
    prefixes = session_prefixes(sessions)
    doc["filter_text"] = " ".join(f"--{k} {v}" for k, v in (
        ("stage", q.stage), ("session", prefixes.get(session, session) if session else None),
        ("thread", f"{prefixes.get(thread.session_id, thread.session_id)}/{thread.thread_id}" if thread else None)) if v)
    short = pl.col("session_id").replace_strict(prefixes, default=pl.col("session_id")) + "/" + pl.col("thread_id")
    if run_dec is not None and view is not None:
        spec = view.summary.get("pipeline_sha256")
        order = stage_rank()
        mine = run_dec.filter(keep & stage_expr).with_columns(
            _rank=pl.col("stage").replace_strict(order, default=len(order), return_dtype=pl.Int64))
        by = (mine.group_by("stage", "action", "reason", "_rank")
              .agg(frozen=(~pl.col("is_provisional")).sum().cast(pl.Int64),
                   provisional=pl.col("is_provisional").sum().cast(pl.Int64), count=pl.len().cast(pl.Int64))
              .sort("_rank", "stage", "action", "reason").drop("_rank"))
        seqs = ledger_all.filter(pl.col("spec_sha256") == spec).select(*DECISION_KEY, "stage", "seq")
        listed = mine.sort("_rank", "session_id", "thread_id", "from_call", "entry_id", "block_pos", "part_pos", "action")
        if q.limit:
            listed = listed.head(q.limit)
        listed = (listed.join(seqs, on=[*DECISION_KEY, "stage"], how="left", nulls_equal=True)
                  .with_columns(thread=short)
                  .drop("_rank", "replacement"))
        doc["run"] = {"run_id": view.summary.get("run_id"), "pipeline": view.summary.get("pipeline"),
                      "pipeline_sha256": spec, "out_dir": str(out_dir)}
        doc["decisions"] = mine.height
        doc["frozen"] = int((~mine["is_provisional"]).sum())
        doc["provisional"] = int(mine["is_provisional"].sum())
        doc["by_reason"] = by.to_dicts()
        doc["rows"] = listed.to_dicts()
        doc["source"] = "run"
    else:
        mine = in_ledger.filter(~is_violation)
        by = (mine.group_by("spec_sha256", "stage", "action", "reason")
              .agg(frozen=pl.len().cast(pl.Int64), provisional=pl.lit(0, pl.Int64), count=pl.len().cast(pl.Int64))
              .sort("spec_sha256", "stage", "action", "reason"))
        listed = mine.head(q.limit) if q.limit else mine
        doc["run"] = None
        doc["decisions"] = mine.height
        doc["frozen"] = mine.height
        doc["provisional"] = None  # provisional decisions live in a run's decisions.parquet only
        doc["by_reason"] = by.to_dicts()
        doc["rows"] = listed.with_columns(thread=short, is_provisional=pl.lit(False)).to_dicts()
        doc["source"] = "ledger"
    doc["count"] = len(doc["rows"])
    return doc


def render(doc: dict[str, Any]) -> tuple[str, list[str]]:
    """(stdout text, notes for stderr). The first line counts the whole ledger (with filters, how
    many of its decisions match them); the second the run's decisions that match the filters."""
    from ctxreplay.pipeline.core.words import plural

    notes: list[str] = []
    f = doc["filters"]
    filtered = doc.get("filter_text") or " ".join(f"--{k} {v}" for k, v in f.items() if v)
    tot = doc.get("ledger_totals") or {"decisions": doc["ledger_decisions"], "namespaces": doc["ledger_namespaces"],
                                       "violations": doc["violations"]}
    first = (f"{doc['ledger']}: {plural(doc['runs'], 'run')}, {plural(tot['decisions'], 'frozen decision')}"
             + (f" in {plural(tot['namespaces'], 'namespace')}" if tot["namespaces"] > 1 else "")
             + f", {plural(tot['violations'], 'violation')} recorded")
    if filtered:  # the counts above are the whole ledger's; say so, and how much of it the filters keep
        n = doc["ledger_decisions"]
        first += f" (whole ledger); {n:,} of its frozen decisions {'matches' if n == 1 else 'match'} {filtered}"
    out = [first]
    run = doc["run"]
    if run:
        out.append(f"run {run['run_id']} (pipeline {run['pipeline']}, {str(run['pipeline_sha256'])[:12]})"
                   + (f", {filtered}" if filtered else "") + f": {plural(doc['decisions'], 'decision')} applied = "
                   f"{doc['frozen']:,} frozen in the ledger + {doc['provisional']:,} provisional")
    else:
        out.append("no published run in this directory: the ledger's frozen decisions only (a run's provisional "
                   "decisions are in its decisions.parquet)" + (f"; {filtered}" if filtered else ""))
    if doc["by_reason"]:
        rows = doc["by_reason"]
        cols = ["stage", "action", "reason"]
        w = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in cols}
        head = "  " + "  ".join(f"{c:<{w[c]}}" for c in cols) + f"  {'frozen':>7}  {'provisional':>11}  {'total':>7}"
        if not run:
            head = "  namespace     " + head[2:]
        out.append(head)
        for r in rows:
            ns = f"  {r['spec_sha256'][:12]}" if not run else ""
            prov = "-" if doc["provisional"] is None else f"{r['provisional']:,}"
            out.append(f"{ns}  " + "  ".join(f"{r[c]:<{w[c]}}" for c in cols) + f"  {r['frozen']:>7,}  "
                       f"{prov:>11}  {r['count']:>7,}")
    for r in doc["rows"]:
        seq = f"#{r['seq']}" if r.get("seq") is not None else ("provisional" if r.get("is_provisional") else "#?")
        out.append(f"  {seq} {r['stage']} {r['action']} {r['reason']}  thread {r['thread']}  entry "
                   f"{r['entry_id'][:12]}  block {r['block_pos']}.{r['part_pos']}  from call {r['from_call']}  "
                   f"cache_epoch {r['cache_epoch']}")
    more = doc["decisions"] - doc["count"]
    if more > 0:
        out.append(f"  ... and {more:,} more (--limit 0 lists them all)")
    if run and doc["provisional"]:
        out.append("provisional: decided for a thread's pending call and applied to its request, not frozen in the "
                   "ledger (the transcript may still grow before that request is sent)")
    if doc["decisions"] == 0 and filtered:
        where = f"run {run['run_id']}" if run else "the ledger"
        notes.append(f"no decision matches {filtered} in {where}")
    return "\n".join(out), notes
