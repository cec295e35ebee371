"""How well the cache simulator reproduces recorded usage, on every real session of the shared
corpora, three ways (issue 20, item 5): `bench/bench_cachesim.py --accuracy`.

Every group (a corpus's Claude Code, OpenClaw or Codex folder) is replayed once under identity;
the recorded facts, the request store and the run's calls are then simulated again under three
calibrations (pipeline/cost/calibrate.py):

- in-sample: fitted on every session of both corpora at once;
- leave-one-session-out: for each session s, the pooled quantities (family ratios, the system
  gap) fitted on every other session, s's own threads fitted on s's usage with that prior
  (`fit(..., prior=...)`), as a user's run calibrates on the user's sessions;
- across corpora: the pooled quantities fitted on the other corpus only.

Per group, over its sessions with >= 10 compared calls (calls with recorded usage): the cost error
per session |sim / recorded − 1| (median / worst), the cache-write error (median; `–` where the
provider reports no writes), recorded-break recall / precision (a recorded break found when the
simulation breaks at the same call), and break / no-break agreement per call. Then the error bars'
leave-one-session-out coverage (pipeline/cost/intervals.py): for each session, whether its recorded
cost lies in sim × [1 − q, 1 + q], q the conformal quantile of the other sessions' residuals.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl

ROOT = Path(__file__).resolve().parent.parent
GROUPS = [("corpus", "claude-code", "Claude Code"), ("corpus", "claude-projects", "Claude Code"),
          ("corpus", "openclaw", "OpenClaw"), ("corpus", "codex", "Codex"),
          ("corpus-extra", "claude-projects", "Claude Code"), ("corpus-extra", "openclaw", "OpenClaw"),
          ("corpus-extra", "codex", "Codex"), ("corpus-extra", "gemini-cli", "Gemini CLI")]
MIN_CALLS = 10


@dataclass
class Group:
    corpus: str
    folder: str
    agent: str
    calls: pl.DataFrame
    rec: pl.DataFrame
    facts: pl.DataFrame
    store: Any
    decisions: pl.DataFrame | None

    @property
    def label(self) -> str:
        return f"{self.agent} ({self.corpus}/{self.folder})"


def load_group(shared: Path, corpus: str, folder: str, agent: str, tmp: Path) -> Group | None:
    from ctxreplay.pipeline.batch.runner import RunOptions, run
    from ctxreplay.pipeline.core.tokens import TokenCounter
    from ctxreplay.pipeline.cost import calibrate
    from ctxreplay.pipeline.cost.cachesim import SimStore, answer_times
    from ctxreplay.pipeline.loaders import load_paths
    from ctxreplay.pipeline.staging.spec import load_spec

    path = shared / corpus / folder
    if not path.is_dir():
        return None
    out = tmp / f"{corpus}-{folder}"
    res = run([path], load_spec(preset="identity"), RunOptions(out_dir=out))
    loaded = pl.from_arrow(load_paths([path]).blocks)
    assert isinstance(loaded, pl.DataFrame)
    rec = calibrate.recorded_facts(loaded, TokenCounter().series_counter())
    final = res.blocks if isinstance(res.blocks, pl.DataFrame) else pl.from_arrow(res.blocks)
    facts = rec.join(answer_times(final), on=["session_id", "thread_id", "call"], how="left")  # type: ignore[arg-type]
    return Group(corpus, folder, agent, res.calls, rec, facts, SimStore.from_dir(out), res.decisions)


def _combined(cals: list[Any], families: pl.DataFrame) -> Any:
    from ctxreplay.pipeline.cost.calibrate import Calibration

    return Calibration(pl.concat([c.threads for c in cals], how="diagonal_relaxed"),
                       pl.concat([c.segments for c in cals], how="diagonal_relaxed"), families)


def simulate(g: Group, cal: Any, book: Any) -> pl.DataFrame:
    from ctxreplay.pipeline.cost.cachesim import Prepared
    from ctxreplay.pipeline.cost.cachesim import simulate as sim

    return sim(g.calls, g.store, Prepared(cal, g.facts), decisions=g.decisions, prices=book).calls


def _fit(groups: list[Group], keep: Any = None, prior: Any = None) -> Any:
    from ctxreplay.pipeline.cost.calibrate import fit

    calls = pl.concat([g.calls for g in groups], how="diagonal_relaxed")
    rec = pl.concat([g.rec for g in groups], how="diagonal_relaxed")
    if keep is not None:
        calls = calls.filter(keep)
        rec = rec.filter(keep)
    return fit(calls, rec, prior=prior)


def measure(c: pl.DataFrame) -> dict[str, Any]:
    """Per session with >= MIN_CALLS compared calls: cost and write errors, breaks, agreement."""
    from ctxreplay.pipeline.cost import breaks as brk

    s = brk.sessions(c).filter(pl.col("calls") >= MIN_CALLS)
    keep = s.get_column("session_id").to_list()
    k = brk.classify(c).filter(pl.col("session_id").is_in(keep))
    rb, sb = pl.col("recorded_break_cause").is_not_null(), pl.col("sim_break_cause").is_not_null()
    both = k.select(rec=rb.sum(), sim=sb.sum(), both=(rb & sb).sum(), agree=pl.col("agree").sum(),
                    calls=pl.len()).to_dicts()[0]
    return {"sessions": {r["session_id"]: r for r in s.to_dicts()}, **both}


def row(label: str, m: dict[str, Any]) -> str:
    ss = list(m["sessions"].values())
    cost = [abs(r["cost_diff"]) for r in ss if r["cost_diff"] is not None]
    write = [abs(r["write_diff"]) for r in ss if r["write_diff"] is not None and r["rec_write"]]

    def pct(v: float | None) -> str:
        return "–" if v is None else f"{v:.1%}"

    med = statistics.median
    return (f"| {label} | {len(ss)} sessions, {m['calls']:,} calls | {pct(med(cost) if cost else None)} / "
            f"{pct(max(cost) if cost else None)} | {pct(med(write) if write else None)} | "
            f"{pct(m['both'] / m['rec'] if m['rec'] else None)} / {pct(m['both'] / m['sim'] if m['sim'] else None)} "
            f"({m['rec']} recorded) | {pct(m['agree'] / m['calls'] if m['calls'] else None)} |")


HEADER = ("| sessions | compared | cost error per session: median / worst | cache write: median | "
          "recorded breaks found (recall / precision) | break/no-break agreement per call |\n|---|---|---|---|---|---|")


def main(shared: Path, tmp: Path | None = None) -> int:
    from ctxreplay.pipeline.cost import intervals
    from ctxreplay.pipeline.cost.prices import PriceBook

    book = PriceBook.load()
    tmp = tmp or Path(tempfile.mkdtemp(prefix="bench-cachesim-acc-"))
    groups = [g for g in (load_group(shared, *x, tmp) for x in GROUPS) if g is not None]
    if not groups:
        print(f"no corpus under {shared}", file=sys.stderr)
        return 2
    full = _fit(groups)
    fams = full.families
    results: dict[str, dict[str, dict[str, Any]]] = {"in-sample": {}, "leave-one-session-out": {},
                                                      "across corpora": {}}
    sims: dict[str, dict[str, pl.DataFrame]] = {k: {} for k in results}
    by_corpus = {c: _fit([g for g in groups if g.corpus == c]) for c in {g.corpus for g in groups}}
    for g in groups:
        sims["in-sample"][g.label] = simulate(g, full, book)
        # leave one session out: the pooled part from every other session of both corpora
        cals = []
        for sid in g.calls.get_column("session_id").unique().sort().to_list():
            prior = _fit(groups, keep=pl.col("session_id") != sid)
            cals.append(_fit([g], keep=pl.col("session_id") == sid, prior=prior))
        sims["leave-one-session-out"][g.label] = simulate(g, _combined(cals, fams), book)
        other = [c for c in by_corpus if c != g.corpus]
        if other:
            sims["across corpora"][g.label] = simulate(g, _fit([g], prior=by_corpus[other[0]]), book)
    for way, per in sims.items():
        print(f"\n{way}\n\n{HEADER}")
        for label, c in per.items():
            results[way][label] = m = measure(c)
            print(row(label, m))
        if per:
            allc = pl.concat(list(per.values()), how="diagonal_relaxed")
            print(row("all", measure(allc)))
    # the error bars, leave one session out
    loo = {sid: r for m in results["leave-one-session-out"].values() for sid, r in m["sessions"].items()}
    res = {s: intervals.residual(r["rec_cost"], r["sim_cost"]) for s, r in loo.items()}
    res = {s: e for s, e in res.items() if e is not None}
    q = intervals.loo_q(res)
    hit = [s for s in res if intervals.covers(loo[s]["rec_cost"], loo[s]["sim_cost"], q[s])]
    print(f"\nerror bars, leave one session out: the interval sim × [1 − q, 1 + q] (q from the other sessions' "
          f"residuals, {intervals.COVERAGE:.0%} conformal) covers the recorded cost of {len(hit)} of {len(res)} "
          f"sessions ({len(hit) / max(len(res), 1):.1%}); q over all {len(res)} sessions: "
          f"{intervals.conformal_q(list(res.values())):.3f} (median q {statistics.median(q.values()):.3f})")
    for s in sorted(set(res) - set(hit)):
        print(f"  not covered: {s[:40]}  residual {res[s]:+.1%}, q {q[s]:.1%}")
    return 0
