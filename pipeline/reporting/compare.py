"""`ctxreplay compare`: the same sessions under several context policies, side by side.

Each pipeline runs through `ctxreplay.pipeline.batch.runner.run` into a directory of its own (a fresh ledger, so
no pipeline inherits another's frozen decisions), and the cache simulator (pipeline/cost/cachesim.py)
prices its requests with a fresh cache state. A pipeline is a spec file or a preset name, with
optional simulator settings after `@`:

    identity                 the sessions as recorded (no layers)
    default@ttl=1h           the default preset, every cache write with a 1-hour TTL
    my-spec.toml@ttl=5m      a spec file, 5-minute writes

`ttl` is `recorded` (each call's recorded 5m / 1h split, the default), `5m` or `1h`. Per session
and in total: calls, prompt tokens (calibrated to the provider's tokenizer), simulated cache read
and write, uncached input, cost, cache hit rate, breaks, and the difference of each from the
first pipeline. A simulated auto-compaction's own summarisation request (stage `auto_compact`) is
in the cost and counted under `summary_requests`.

The figures lead with the **anchored estimate**: per call and pipeline P,
`est = recorded + (sim under P − sim under identity)` for the cost and the cache read, cache write
and uncached input tokens, so that under identity the estimate is the recorded usage exactly and
only the simulated change is the simulator's; the identity run is one of the pipelines compared,
else an extra run. A call whose answer recorded no usage has no estimate (null) and is counted
under `no_usage_calls`. The raw simulation is kept beside it (`sim_cost_usd`, `sim_cache_*`; the
table shows it with `--raw`). The differences from the first pipeline are the same either way (the
anchor cancels). Each cost carries an interval (`cost_usd_low`, `cost_usd_high`;
`sim_cost_usd_low` / `_high` for the raw simulation) from the identity simulation's residuals
over the compared sessions: pipeline/cost/intervals.py says how.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import polars as pl

from ctxreplay.errors import CompareError
from ctxreplay.pipeline.cost.estimate import EST_COLUMNS, session_q, sim_cost, sim_write, with_estimate

TTLS = ("recorded", "5m", "1h")
METRICS = ("calls", "prompt_tokens", "cache_read_tokens", "cache_write_tokens", "input_tokens", "output_tokens",
           "cost_usd", "cache_hit_rate", "breaks", "summary_requests", "summary_cost_usd", "sim_cache_read_tokens",
           "sim_cache_write_tokens", "sim_input_tokens", "sim_cost_usd", "sim_cache_hit_rate")


@dataclass(frozen=True)
class Choice:
    """One pipeline of a comparison: its label (as given), its spec and the simulator's policy."""

    label: str
    spec: Any
    ttl: str = "recorded"


def parse_choice(text: str) -> Choice:
    """`NAME_OR_FILE[@key=value,...]` -> Choice; a file is taken when the path exists or ends in .toml."""
    from ctxreplay.pipeline.staging.spec import load_spec, preset_names

    name, _, opts = text.partition("@")
    if not name:
        raise CompareError(f"--pipeline {text!r}: give a preset name or a spec file before '@'")
    ttl = "recorded"
    for part in filter(None, opts.split(",")):
        key, eq, value = part.partition("=")
        if key != "ttl" or not eq:
            raise CompareError(f"--pipeline {text!r}: unknown setting {part!r}; the one setting is ttl=recorded|5m|1h "
                               f"(e.g. `--pipeline default@ttl=1h`)")
        if value not in TTLS:
            raise CompareError(f"--pipeline {text!r}: ttl must be one of {', '.join(TTLS)}, not {value!r}")
        ttl = value
    p = Path(name)
    if p.exists() or name.endswith(".toml"):
        spec = load_spec(p)
    elif name in preset_names():
        spec = load_spec(preset=name)
    else:
        raise CompareError(f"--pipeline {name!r}: neither a spec file nor a preset; presets: {', '.join(preset_names())}")
    return Choice(text, spec, ttl)


@dataclass
class Compared:
    """The comparison: per pipeline, its calls (calls.parquet's columns, cache simulation included)."""

    choices: list[Choice]
    calls: list[pl.DataFrame]
    prices: str | None = None
    warnings: list[str] = field(default_factory=list)
    anchor: pl.DataFrame | None = None
    """The calls under identity (the anchor of the estimates); None: the pipeline `identity` is
    one of `choices` (its calls are the anchor)."""

    def __post_init__(self) -> None:
        anchor = self.anchor
        if anchor is None:
            i = next((i for i, ch in enumerate(self.choices) if is_identity(ch)), None)
            anchor = self.calls[i] if i is not None else None
        self.calls = [with_estimate(c, anchor) for c in self.calls]
        self._q: dict[str, float] | None = None

    def session_q(self) -> dict[str, float]:
        """Per session: the interval's half-width q (pipeline/cost/intervals.py), from the other
        compared sessions' identity residuals, else the default."""
        if self._q is None:
            self._q = session_q(self.calls[0])
        return self._q

    def _table(self, by: list[str]) -> pl.DataFrame:
        from ctxreplay.pipeline.cost.intervals import DEFAULT_Q

        q = self.session_q()
        qs = pl.DataFrame({"session_id": list(q), "_q": list(q.values())},
                          schema={"session_id": pl.String, "_q": pl.Float64})
        parts = []
        for i, (ch, c) in enumerate(zip(self.choices, self.calls, strict=True)):
            per = _metrics(c, ["session_id"]).join(qs, on="session_id", how="left").with_columns(
                _q=pl.col("_q").fill_null(DEFAULT_Q))
            per = per.with_columns(
                cost_usd_low=pl.col("cost_usd") - pl.col("_q") * pl.col("_delta").abs(),
                cost_usd_high=pl.col("cost_usd") + pl.col("_q") * pl.col("_delta").abs(),
                sim_cost_usd_low=pl.col("sim_cost_usd") * (1 - pl.col("_q")),
                sim_cost_usd_high=pl.col("sim_cost_usd") * (1 + pl.col("_q")))
            if by:
                m = per
            else:   # a total's bounds: the sum of its sessions' (their errors taken as correlated)
                m = _metrics(c, []).with_columns(per.select(
                    *(pl.col(x).sum() for x in ("cost_usd_low", "cost_usd_high", "sim_cost_usd_low",
                                                "sim_cost_usd_high"))))
            parts.append(m.drop([x for x in ("_q", "_delta") if x in m.columns])
                         .with_columns(pipeline=pl.lit(ch.label), _i=pl.lit(i)))
        out = _with_diffs(pl.concat(parts, how="diagonal_relaxed"), by)
        return out.sort(*by, "_i") if by else out.sort("_i")

    def session_table(self) -> pl.DataFrame:
        """One row per (session, pipeline): the metrics, and their differences from the first pipeline."""
        return self._table(["session_id"])

    def total_table(self) -> pl.DataFrame:
        return self._table([])

    def breaks_by_cause(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for ch, c in zip(self.choices, self.calls, strict=True):
            g = c.filter(pl.col("sim_break_cause").is_not_null()).group_by("sim_break_cause").len().sort("sim_break_cause")
            out[ch.label] = dict(zip(g["sim_break_cause"].to_list(), g["len"].to_list(), strict=True))
        return out

    def to_json(self) -> dict[str, Any]:
        def rows(df: pl.DataFrame) -> list[dict[str, Any]]:
            return [{k: (round(v, 6) if isinstance(v, float) else v) for k, v in r.items() if not k.startswith("_")}
                    for r in df.to_dicts()]

        from ctxreplay.pipeline.cost.intervals import COVERAGE, DEFAULT_Q

        recorded = self.calls[0].filter(~pl.col("is_pending")).select(
            recorded_cost_usd=pl.col("recorded_cost_usd").sum(),
            recorded_cache_read_tokens=pl.col("recorded_cache_read_tokens").sum()).to_dicts()[0]
        q = self.session_q()
        return {
            "pipelines": [{"label": ch.label, "name": ch.spec.name, "source": ch.spec.source,
                           "spec_sha256": ch.spec.sha256, "ttl": ch.ttl} for ch in self.choices],
            "prices": self.prices,
            "sessions": rows(self.session_table()),
            "totals": rows(self.total_table()),
            "breaks_by_cause": self.breaks_by_cause(),
            "recorded": {k: (round(v, 6) if isinstance(v, float) else v) for k, v in recorded.items()},
            "interval": {"coverage": COVERAGE, "default_q": DEFAULT_Q,
                         "sessions_with_own_q": sum(v != DEFAULT_Q for v in q.values()),
                         "q": {k: round(v, 6) for k, v in sorted(q.items())}},
            "warnings": self.warnings,
        }


def is_identity(ch: Choice) -> bool:
    """The choice replays the sessions as recorded: no stage, the recorded TTLs."""
    return ch.ttl == "recorded" and not ch.spec.stages and ch.spec.target is None


def _metrics(calls: pl.DataFrame, by: list[str]) -> pl.DataFrame:
    from ctxreplay.pipeline.cost.breaks import has_usage

    c = calls.filter(~pl.col("is_pending"))
    est = pl.col("est_cost_usd").is_not_null()
    aggs = {
        "calls": pl.len(),
        "prompt_tokens": pl.col("calibrated_prompt_tokens").sum(),
        "cache_read_tokens": pl.col("est_cache_read_tokens").sum(),
        "cache_write_tokens": pl.col("est_cache_write_tokens").sum(),
        "input_tokens": pl.col("est_input_tokens").sum(),
        "output_tokens": pl.col("recorded_output_tokens").sum(),
        "cost_usd": pl.col("est_cost_usd").sum(),
        "sim_cache_read_tokens": pl.col("sim_cache_read_tokens").sum(),
        "sim_cache_write_tokens": sim_write().sum(),
        "sim_input_tokens": pl.col("sim_input_tokens").sum(),
        "sim_cost_usd": sim_cost().sum(),
        "breaks": pl.col("sim_break_cause").is_not_null().sum(),
        "summary_requests": pl.col("sim_summary_input_tokens").is_not_null().sum(),
        "summary_cost_usd": pl.col("sim_summary_cost_usd").sum(),
        "unpriced_calls": (pl.col("sim_cost_usd").is_null() & pl.col("sim_input_tokens").is_not_null()).sum(),
        "no_usage_calls": (pl.col("sim_input_tokens").is_not_null() & ~has_usage()).sum(),
        # the simulated change the estimate adds to the recorded cost (the interval's width scales with it)
        "_delta": pl.when(est).then(sim_cost() - pl.col("_sim_id_cost")).sum(),
    }
    g = c.group_by(by).agg(**aggs) if by else c.select(**aggs)
    est_prompt = pl.col("cache_read_tokens") + pl.col("cache_write_tokens") + pl.col("input_tokens")
    sim_prompt = pl.col("sim_cache_read_tokens") + pl.col("sim_cache_write_tokens") + pl.col("sim_input_tokens")
    return g.with_columns(
        cache_hit_rate=pl.when(est_prompt > 0).then(pl.col("cache_read_tokens") / est_prompt),
        sim_cache_hit_rate=pl.when(sim_prompt > 0).then(pl.col("sim_cache_read_tokens") / sim_prompt),
        calls=pl.col("calls").cast(pl.Int64), breaks=pl.col("breaks").cast(pl.Int64),
        summary_requests=pl.col("summary_requests").cast(pl.Int64), unpriced_calls=pl.col("unpriced_calls").cast(pl.Int64),
        no_usage_calls=pl.col("no_usage_calls").cast(pl.Int64))


def _with_diffs(df: pl.DataFrame, by: list[str]) -> pl.DataFrame:
    """Add `d_<metric>` (this pipeline minus the first) and `cost_change` (relative) per group."""
    first = df.filter(pl.col("_i") == 0).select(*by, *[pl.col(m).alias(f"_f_{m}") for m in METRICS])
    j = df.join(first, on=by, how="left") if by else df.join(first, how="cross")
    j = j.with_columns(**{f"d_{m}": pl.col(m) - pl.col(f"_f_{m}") for m in METRICS if m != "calls"}).with_columns(
        cost_change=pl.when(pl.col("_f_cost_usd") != 0).then(pl.col("cost_usd") / pl.col("_f_cost_usd") - 1.0),
        sim_cost_change=pl.when(pl.col("_f_sim_cost_usd") != 0).then(pl.col("sim_cost_usd") / pl.col("_f_sim_cost_usd")
                                                                   - 1.0))
    return j.drop([c for c in j.columns if c.startswith("_f_")])


def compare(paths: list[Path], choices: list[Choice], *, prices_file: Path | None = None,
            progress: Callable[[str], None] | None = None, keep: Path | None = None) -> Compared:
    """Run every pipeline over `paths` and simulate its cache. `keep`: a directory that keeps each
    pipeline's run (OUT/<index>-<name>); else a temporary one, removed afterwards."""
    from ctxreplay.pipeline.batch.runner import RunOptions, run

    if not choices:
        raise CompareError("give at least one --pipeline (a preset name or a spec file), e.g. "
                           "`--pipeline identity --pipeline default`")
    say = progress or (lambda s: None)
    book = None
    if prices_file is not None:
        from ctxreplay.pipeline.cost.prices import PriceBook

        book = PriceBook.load(prices_file)
    loaded: list[Any] = []
    out_calls: list[pl.DataFrame] = []
    warnings: list[str] = []
    prices_src: str | None = None
    with tempfile.TemporaryDirectory(prefix="ctxreplay-compare-") as tmp:
        root = keep if keep is not None else Path(tmp)
        for i, ch in enumerate(choices):
            out = root / run_dir_name(i, ch)
            say(f"running pipeline {ch.label} ({i + 1}/{len(choices)})")
            res = run(list(paths), ch.spec, RunOptions(out_dir=out))
            calls = res.calls
            sim = res.summary.get("cache_sim") or {}
            prices_src = prices_src or sim.get("prices")
            warnings.extend(f"{ch.label}: {w}" for w in sim.get("warnings", []))
            if ch.ttl != "recorded" or book is not None:
                calls, summary = _resimulate(paths, res, out, ch, book, loaded)
                prices_src = summary.get("prices") or prices_src
            if keep is not None:
                _write_atomic(calls, out / COMPARE_CALLS)
            out_calls.append(calls)
        anchor = None
        if not any(is_identity(ch) for ch in choices):
            # the estimates' anchor: the sessions as recorded, simulated with the same prices
            from ctxreplay.pipeline.staging.spec import load_spec

            ident = Choice("identity", load_spec(preset="identity"))
            out = root / f"{len(choices)}-identity-anchor"
            say("running identity, the anchor of the estimates")
            res = run(list(paths), ident.spec, RunOptions(out_dir=out))
            anchor = res.calls
            if book is not None:
                anchor, _ = _resimulate(paths, res, out, ident, book, loaded)
    return Compared(list(choices), out_calls, prices_src, warnings, anchor)


def _resimulate(paths: list[Path], res: Any, out: Path, ch: Choice, book: Any,
                loaded: list[Any]) -> tuple[pl.DataFrame, dict[str, Any]]:
    """Simulate a run's requests again with this choice's policy (and price book)."""
    from ctxreplay.pipeline.assembly.store import CALL_MESSAGES_FILE, MESSAGES_FILE, run_dir
    from ctxreplay.pipeline.core.tokens import TokenCounter
    from ctxreplay.pipeline.cost.cachesim import Policy, after_replay
    from ctxreplay.pipeline.loaders import load_paths

    if not loaded:
        loaded.append(load_paths(list(paths)).blocks)
    run = run_dir(out)
    store = (pl.read_parquet(run / MESSAGES_FILE), pl.read_parquet(run / CALL_MESSAGES_FILE))
    policy = Policy() if ch.ttl == "recorded" else replace(Policy(), ttl=ch.ttl)
    counter = TokenCounter()
    return after_replay(loaded[0], res.blocks, res.calls, store, res.decisions, counter.series_counter(),
                        prices=book if book is not None else "default", policy=policy)


# beside each kept run (--keep): its calls as the comparison simulated and priced them (the
# choice's @ttl and --prices; the run's own calls.parquet keeps the recorded TTLs and default prices)
COMPARE_CALLS = "compare-calls.parquet"


def _write_atomic(df: pl.DataFrame, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    df.write_parquet(tmp)
    os.replace(tmp, path)


def run_dir_name(index: int, ch: Choice) -> str:
    """The directory of the `index`-th pipeline (0-based) of a comparison, under `--keep DIR`:
    `<index>-<spec name>`, then `@ttl=<ttl>` when the choice sets a TTL other than `recorded`, so
    `identity@ttl=5m` and `identity@ttl=1h` given 5th and 6th are `4-identity@ttl=5m` and
    `5-identity@ttl=1h`. ASCII letters, digits and `-_.@=` only (anything else becomes `_`, the
    spec name is cut at 60 characters): a name that every file system takes and no shell needs
    quoted, the same for the same command line."""
    return f"{index}-{_safe(ch.spec.name)}" + (f"@ttl={ch.ttl}" if ch.ttl != "recorded" else "")


def _safe(name: str) -> str:
    return "".join(ch if ch.isascii() and (ch.isalnum() or ch in "-_.") else "_" for ch in name)[:60] or "pipeline"


__all__ = ["COMPARE_CALLS", "EST_COLUMNS", "Choice", "CompareError", "Compared", "compare", "is_identity", "parse_choice",
           "run_dir_name", "with_estimate"]
