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
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import polars as pl

from ctxreplay.errors import CompareError

TTLS = ("recorded", "5m", "1h")
METRICS = ("calls", "prompt_tokens", "cache_read_tokens", "cache_write_tokens", "input_tokens", "output_tokens",
           "cost_usd", "cache_hit_rate", "breaks", "summary_requests", "summary_cost_usd")


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

    def session_table(self) -> pl.DataFrame:
        """One row per (session, pipeline): the metrics, and their differences from the first pipeline."""
        parts = [_metrics(c, ["session_id"]).with_columns(pipeline=pl.lit(ch.label), _i=pl.lit(i))
                 for i, (ch, c) in enumerate(zip(self.choices, self.calls, strict=True))]
        return _with_diffs(pl.concat(parts, how="diagonal_relaxed"), ["session_id"]).sort("session_id", "_i")

    def total_table(self) -> pl.DataFrame:
        parts = [_metrics(c, []).with_columns(pipeline=pl.lit(ch.label), _i=pl.lit(i))
                 for i, (ch, c) in enumerate(zip(self.choices, self.calls, strict=True))]
        return _with_diffs(pl.concat(parts, how="diagonal_relaxed"), []).sort("_i")

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

        recorded = self.calls[0].filter(~pl.col("is_pending")).select(
            recorded_cost_usd=pl.col("recorded_cost_usd").sum(),
            recorded_cache_read_tokens=pl.col("recorded_cache_read_tokens").sum()).to_dicts()[0]
        return {
            "pipelines": [{"label": ch.label, "name": ch.spec.name, "source": ch.spec.source,
                           "spec_sha256": ch.spec.sha256, "ttl": ch.ttl} for ch in self.choices],
            "prices": self.prices,
            "sessions": rows(self.session_table()),
            "totals": rows(self.total_table()),
            "breaks_by_cause": self.breaks_by_cause(),
            "recorded": {k: (round(v, 6) if isinstance(v, float) else v) for k, v in recorded.items()},
            "warnings": self.warnings,
        }


def _metrics(calls: pl.DataFrame, by: list[str]) -> pl.DataFrame:
    c = calls.filter(~pl.col("is_pending"))
    if "sim_summary_cost_usd" not in c.columns:      # a run made before auto_compact existed
        c = c.with_columns(sim_summary_cost_usd=pl.lit(None, pl.Float64), sim_summary_input_tokens=pl.lit(None, pl.Int64))
    write = pl.col("sim_cache_write_5m_tokens").fill_null(0) + pl.col("sim_cache_write_1h_tokens").fill_null(0)
    aggs = {
        "calls": pl.len(),
        "prompt_tokens": pl.col("calibrated_prompt_tokens").sum(),
        "cache_read_tokens": pl.col("sim_cache_read_tokens").sum(),
        "cache_write_tokens": write.sum(),
        "input_tokens": pl.col("sim_input_tokens").sum(),
        "output_tokens": pl.col("recorded_output_tokens").sum(),
        # a simulated compaction's summarisation request is part of what the pipeline costs
        "cost_usd": (pl.col("sim_cost_usd") + pl.col("sim_summary_cost_usd").fill_null(0)).sum(),
        "breaks": pl.col("sim_break_cause").is_not_null().sum(),
        "summary_requests": pl.col("sim_summary_input_tokens").is_not_null().sum(),
        "summary_cost_usd": pl.col("sim_summary_cost_usd").sum(),
        "unpriced_calls": (pl.col("sim_cost_usd").is_null() & pl.col("sim_input_tokens").is_not_null()).sum(),
    }
    g = c.group_by(by).agg(**aggs) if by else c.select(**aggs)
    return g.with_columns(
        cache_hit_rate=pl.when(pl.col("prompt_tokens") > 0).then(pl.col("cache_read_tokens") / pl.col("prompt_tokens")),
        calls=pl.col("calls").cast(pl.Int64), breaks=pl.col("breaks").cast(pl.Int64),
        summary_requests=pl.col("summary_requests").cast(pl.Int64), unpriced_calls=pl.col("unpriced_calls").cast(pl.Int64))


def _with_diffs(df: pl.DataFrame, by: list[str]) -> pl.DataFrame:
    """Add `d_<metric>` (this pipeline minus the first) and `cost_change` (relative) per group."""
    first = df.filter(pl.col("_i") == 0).select(*by, *[pl.col(m).alias(f"_f_{m}") for m in METRICS])
    j = df.join(first, on=by, how="left") if by else df.join(first, how="cross")
    j = j.with_columns(**{f"d_{m}": pl.col(m) - pl.col(f"_f_{m}") for m in METRICS if m != "calls"}).with_columns(
        cost_change=pl.when(pl.col("_f_cost_usd") != 0).then(pl.col("cost_usd") / pl.col("_f_cost_usd") - 1.0))
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
            out = root / f"{i}-{_safe(ch.spec.name)}"
            say(f"running pipeline {ch.label} ({i + 1}/{len(choices)})")
            res = run(list(paths), ch.spec, RunOptions(out_dir=out))
            calls = res.calls
            sim = res.summary.get("cache_sim") or {}
            prices_src = prices_src or sim.get("prices")
            warnings.extend(f"{ch.label}: {w}" for w in sim.get("warnings", []))
            if ch.ttl != "recorded" or book is not None:
                calls, summary = _resimulate(paths, res, out, ch, book, loaded)
                prices_src = summary.get("prices") or prices_src
            out_calls.append(calls)
    return Compared(list(choices), out_calls, prices_src, warnings)


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


def _safe(name: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in name)[:60] or "pipeline"


__all__ = ["Choice", "CompareError", "Compared", "compare", "parse_choice"]
