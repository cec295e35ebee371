"""The anchored estimate: what a pipeline's requests would have cost, as the recorded usage plus
the simulated change (issue 20, item 3).

Per call, under a pipeline P: `est = recorded + (sim under P − sim under identity)` for the cost
and for the cache read, cache write and uncached input tokens. The simulator's own error on the
sessions as recorded (its *residual*, what `identity` misses) then cancels: under identity the
estimate is the recorded usage exactly, and only the simulated change is the simulator's. A call
whose answer recorded no usage has no estimate (null; `no_usage`). The `sim_*` columns stay the
raw simulation.

Each estimate carries an interval from the identity simulation's residuals over the other
sessions (pipeline/cost/intervals.py): `est ± q × |sim_P − sim_identity|`; the raw simulation's
is `sim × [1 − q, 1 + q]`. A total's bounds are the sum of its sessions' bounds.

Used by `ctxreplay compare` (pipeline/reporting/compare.py) and `ctxreplay report --sim`
(pipeline/commands/cli_report.py, the anchor from pipeline/reporting/anchor.py).
"""

from __future__ import annotations

from typing import Any

import polars as pl

from ctxreplay.pipeline.cost import intervals
from ctxreplay.pipeline.cost.breaks import has_usage
from ctxreplay.pipeline.cost.calibrate import recorded_write

EST_COLUMNS = ("est_cost_usd", "est_cache_read_tokens", "est_cache_write_tokens", "est_input_tokens")
ANCHOR_COLUMNS = ("_sim_id_cost", "_sim_id_read", "_sim_id_write", "_sim_id_input")


def sim_write() -> pl.Expr:
    return pl.col("sim_cache_write_5m_tokens").fill_null(0) + pl.col("sim_cache_write_1h_tokens").fill_null(0)


def sim_cost() -> pl.Expr:
    """A call's simulated cost, a simulated compaction's summarisation request included (what the
    pipeline costs)."""
    return pl.col("sim_cost_usd") + pl.col("sim_summary_cost_usd").fill_null(0)


def with_estimate(calls: pl.DataFrame, anchor: pl.DataFrame | None) -> pl.DataFrame:
    """calls + the anchored estimate per call (EST_COLUMNS): recorded + (this simulation − the
    identity simulation `anchor` of the same call, matched by thread_key and call); null for a call
    without recorded usage (no estimate: `no_usage`) or without both simulations. Without an anchor
    the calls are taken as the identity run's own (their estimate is the recorded usage). The
    anchor's figures stay beside them (ANCHOR_COLUMNS, `_`-prefixed: not an output)."""
    if "sim_summary_cost_usd" not in calls.columns:      # a run made before auto_compact existed
        calls = calls.with_columns(sim_summary_cost_usd=pl.lit(None, pl.Float64),
                                   sim_summary_input_tokens=pl.lit(None, pl.Int64))
    a = anchor if anchor is not None else calls
    if "sim_summary_cost_usd" not in a.columns:
        a = a.with_columns(sim_summary_cost_usd=pl.lit(None, pl.Float64))
    a = a.filter(~pl.col("is_pending")).select(
        "thread_key", "call", _sim_id_cost=sim_cost(), _sim_id_read=pl.col("sim_cache_read_tokens"),
        _sim_id_write=sim_write(), _sim_id_input=pl.col("sim_input_tokens"))
    c = calls.drop([x for x in (*EST_COLUMNS, *ANCHOR_COLUMNS) if x in calls.columns]).join(
        a, on=["thread_key", "call"], how="left")
    ok = has_usage() & pl.col("sim_input_tokens").is_not_null() & pl.col("_sim_id_input").is_not_null()
    # recorded + (sim − sim under identity): the change first, so that an unchanged call's estimate is
    # the recorded figure exactly (no rounding of the recorded cost through the simulated one)
    return c.with_columns(
        est_cost_usd=pl.when(ok).then(pl.col("recorded_cost_usd") + (sim_cost() - pl.col("_sim_id_cost"))),
        est_cache_read_tokens=pl.when(ok).then(pl.col("recorded_cache_read_tokens").fill_null(0)
                                               + (pl.col("sim_cache_read_tokens") - pl.col("_sim_id_read"))),
        est_cache_write_tokens=pl.when(ok).then(recorded_write().fill_null(0)
                                                + (sim_write() - pl.col("_sim_id_write"))),
        est_input_tokens=pl.when(ok).then(pl.col("recorded_input_tokens").fill_null(0)
                                          + (pl.col("sim_input_tokens") - pl.col("_sim_id_input"))),
    )


def session_q(calls: pl.DataFrame) -> dict[str, float]:
    """Per session of `calls` (with_estimate's output): the interval's half-width q, from the other
    sessions' identity residuals (recorded cost against the anchor's simulated cost over the calls
    with an estimate), else intervals.DEFAULT_Q."""
    c = calls.filter(~pl.col("is_pending") & pl.col("est_cost_usd").is_not_null())
    g = c.group_by("session_id").agg(rec=pl.col("recorded_cost_usd").sum(), ident=pl.col("_sim_id_cost").sum())
    res = {r["session_id"]: intervals.residual(r["rec"], r["ident"]) for r in g.to_dicts()}
    return intervals.loo_q({k: v for k, v in res.items() if v is not None})


def _sums(c: pl.DataFrame, by: list[str]) -> pl.DataFrame:
    est = pl.col("est_input_tokens").is_not_null()   # a call with an estimate (its cost: when priced)

    def rec(col: str) -> pl.Expr:   # the recorded figure over the same calls as the estimate
        return pl.when(est).then(pl.col(col)).sum()

    aggs = {
        "est_calls": est.sum().cast(pl.Int64),
        "est_read": pl.col("est_cache_read_tokens").sum(), "est_write": pl.col("est_cache_write_tokens").sum(),
        "est_input": pl.col("est_input_tokens").sum(), "est_cost": pl.col("est_cost_usd").sum(),
        "_rec_read": rec("recorded_cache_read_tokens"), "_rec_write": rec("recorded_cache_write_tokens"),
        "_rec_cost": rec("recorded_cost_usd"),
        "_delta": pl.when(est).then(sim_cost() - pl.col("_sim_id_cost")).sum(),
        "_sim": pl.col("sim_cost_usd").sum(),
    }
    g = c.group_by(by).agg(**aggs) if by else c.select(**aggs)

    def rel(a: str, b: str) -> pl.Expr:
        return pl.when(pl.col(b) != 0).then(pl.col(a) / pl.col(b) - 1.0)

    return g.with_columns(est_read_diff=rel("est_read", "_rec_read"), est_write_diff=rel("est_write", "_rec_write"),
                          est_cost_diff=rel("est_cost", "_rec_cost"))


def estimate_figures(calls: pl.DataFrame) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, float]]:
    """(per session, the total, q per session) of with_estimate's output, over the calls whose
    answer recorded usage (the calls `report --sim` compares): the estimate's cache read, write,
    input and cost (`est_*`, over `est_calls` calls), their relative differences from the recorded
    figures of the same calls (`est_read_diff`, `est_write_diff`, `est_cost_diff`), its cost interval (`est_cost_low` / `est_cost_high`), the raw
    simulation's (`sim_cost_low` / `sim_cost_high`) and q (`q`)."""
    from ctxreplay.pipeline.cost.breaks import classify

    c = classify(calls)    # the calls with recorded usage, as the raw figures of `report --sim`
    q = session_q(calls)
    qs = pl.DataFrame({"session_id": list(q), "q": list(q.values())}, schema={"session_id": pl.String, "q": pl.Float64})
    per = _sums(c, ["session_id"]).join(qs, on="session_id", how="left").with_columns(
        q=pl.col("q").fill_null(intervals.DEFAULT_Q))
    per = per.with_columns(est_cost_low=pl.col("est_cost") - pl.col("q") * pl.col("_delta").abs(),
                           est_cost_high=pl.col("est_cost") + pl.col("q") * pl.col("_delta").abs(),
                           sim_cost_low=pl.col("_sim") * (1 - pl.col("q")),
                           sim_cost_high=pl.col("_sim") * (1 + pl.col("q"))).sort("session_id")
    bounds = ("est_cost_low", "est_cost_high", "sim_cost_low", "sim_cost_high")
    tot = _sums(c, []).with_columns(per.select(*(pl.col(x).sum() for x in bounds))) if c.height else None
    drop = ("_delta", "_sim", "_rec_read", "_rec_write", "_rec_cost")
    rows = [{k: _num(v) for k, v in r.items() if k not in drop} for r in per.to_dicts()]
    total = {k: _num(v) for k, v in tot.to_dicts()[0].items() if k not in drop} if tot is not None else {}
    return rows, total, q


def _num(v: Any) -> Any:
    return round(v, 6) if isinstance(v, float) else v


__all__ = ["ANCHOR_COLUMNS", "EST_COLUMNS", "estimate_figures", "session_q", "sim_cost", "sim_write", "with_estimate"]
