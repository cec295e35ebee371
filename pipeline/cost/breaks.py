"""Cache breaks: why a request read less from the cache than its predecessor had cached.

A call *breaks* the cache when its cache read falls short of the previous request's cached prefix
(`previous read + previous write`: with Claude Code almost every request reads exactly that and
writes only the new tail). The break's tokens are that shortfall, at most what the call cached
anew (its writes, or its uncached input where writes are free: the tokens written again instead
of read; after a compaction only the new summary is written),
and its cost what the call paid above the same call reading them
(`tokens × (write rate − read rate)`).

Recorded breaks (from the usage the transcript records) are attributed to the first cause that
holds, in this order:
- `model_switch`: the call asks another model than the previous one (caches are per model);
- `ttl_expiry`: the idle gap since the previous request exceeds the TTL it wrote with (its recorded
  5m / 1h split);
- `compaction`: a recorded compaction replaced the history (a new compaction segment starts here);
- `thinking_strip`: a user message that is not only tool results arrives while the turn before it
  holds thinking blocks: with extended thinking Anthropic strips them from the context, which
  changes the prefix from the first of them on (a documented provider rule; Anthropic models only;
  not in a thread that keeps its thinking, calibration `strips_thinking` false: Opus 4.5+ and
  Sonnet 4.6+ keep it by default);
- `preamble`: nothing above, and the read stops inside the preamble (before the first recorded
  message; at most the whole first request of its compaction segment): the system prompt or the
  tools changed, which only the usage shows (Anthropic);
- `eviction`: a step of the tool loop (no new user turn: the request only appends the answer and
  its tool results to the previous one) reads exactly what the previous request read: that
  request's own write was not kept (Anthropic; the server then says `previous_message_not_found`,
  typically after a request it diagnosed `unavailable`);
- `messages_change`: a new user turn (it only appends the last answer and the user's message)
  reads past the preamble but less than the previous request cached, and no strip holds: the
  agent sent an earlier message changed, which the transcript does not show (Anthropic; Claude
  Code drops a PostToolUse hook's additional context from the turn's tool results at the next
  turn; the server says `messages_changed`);
- `best_effort`: a provider with automatic caching (OpenAI, Gemini implicit, a router such as
  OpenRouter) missed: their caching is documented as best effort, with no guaranteed hit;
- `unexplained`: none of these.
That is our own inference (`recorded_break_inferred_cause`). Where the answer records the server's
own diagnosis (`recorded_miss_reason`: Anthropic's cache diagnostics, ../shared/docs/cost-and-cache.md §2.5),
it names the cause (`recorded_break_cause`): `system_changed` / `tools_changed` a `preamble` change
(the detail says which), `model_changed` a `model_switch`, `previous_message_not_found` an
`eviction` (a `ttl_expiry` when the idle gap exceeds the TTL), `messages_changed` the messages
cause we infer (compaction, thinking strip; `messages_change` when we infer none),
`unavailable` (the server could not compare) and a later type leave ours, an `unexplained` one
becoming `provider_miss`. `recorded_break_detail` gives the cause's own detail, the server's
diagnosis and missed tokens, our inferred cause where it differs, and the other causes that also
hold. Simulated breaks get their cause
from the simulator itself (pipeline/cost/cachesim.py): the same names, plus `layer` (a decision of the
run's context layers changed the prefix: `stage/action:reason@cache_epoch`), `lookback` (more
than 20 blocks after the last cached prefix) and `concurrent` (the prefix was written by a request
whose answer had not started yet).
"""

from __future__ import annotations

from typing import Any

import polars as pl

from ctxreplay.pipeline.core.constants import TTL_1H_S, TTL_5M_S
from ctxreplay.pipeline.cost.providers import OPENAI_MIN_TOKENS, min_cacheable_tokens, provider_of

CAUSES = ("model_switch", "ttl_expiry", "compaction", "layer", "thinking_strip", "preamble", "eviction",
          "messages_change", "provider_miss", "best_effort", "lookback", "concurrent", "unexplained")


def _recorded_ttl() -> pl.Expr:
    w5 = pl.col("recorded_cache_write_5m_tokens").fill_null(0)
    w1 = pl.col("recorded_cache_write_1h_tokens").fill_null(0)
    return pl.when((w1 > 0) & (w1 >= w5)).then(pl.lit(TTL_1H_S)).when(
        (w5 > 0) | (pl.col("recorded_cache_write_tokens").fill_null(0) > 0)).then(pl.lit(TTL_5M_S)).otherwise(None)


# the server's diagnosis (Anthropic `cache_miss_reason.type`, schemas/calls.py recorded_miss_reason)
# -> the family of causes it names (pipeline/cost/breaks.py diagnosis_agreement); `unavailable` and
# later types name none
SERVER_FAMILY = {"system_changed": "preamble", "tools_changed": "preamble", "model_changed": "model",
                 "previous_message_not_found": "gone", "messages_changed": "messages"}
CAUSE_FAMILY = {"preamble": "preamble", "model_switch": "model", "ttl_expiry": "gone", "eviction": "gone",
                "compaction": "messages", "thinking_strip": "messages", "layer": "messages", "lookback": "messages",
                "messages_change": "messages"}
# causes that are a change of the messages (what the server calls messages_changed)
_MESSAGE_CAUSES = [k for k, v in CAUSE_FAMILY.items() if v == "messages" and k != "messages_change"]


def _col(c: pl.DataFrame, name: str, dtype: Any, default: Any = None) -> pl.Expr:
    return pl.col(name) if name in c.columns else pl.lit(default, dtype).alias(name)


def recorded_breaks(c: pl.DataFrame, *, use_server: bool = True) -> pl.DataFrame:
    """Add recorded_break_cause / _detail / _tokens and recorded_break_inferred_cause to the calls
    (those with recorded usage, by thread in call order). Needs `segment`, `recorded_strip` and
    `preamble_tokens`; reads `recorded_turn` and the server's diagnosis (`recorded_miss_reason`,
    `recorded_missed_tokens`) where present. `use_server=False`: our own inference only (the cause
    is the inferred one on every call)."""
    from ctxreplay.pipeline.cost.calibrate import recorded_write

    r = c.with_columns(recorded_cache_write_tokens=recorded_write(),
                       _turn=_col(c, "recorded_turn", pl.Boolean, False).fill_null(False),
                       _reason=_col(c, "recorded_miss_reason", pl.String) if use_server else pl.lit(None, pl.String),
                       _missed=_col(c, "recorded_missed_tokens", pl.Int64))
    known = ~pl.col("is_pending") & pl.col("recorded_cache_read_tokens").is_not_null() \
        & pl.col("recorded_cache_write_tokens").is_not_null()
    # a call that neither read nor wrote (no breakpoint, below the minimum) is no break and leaves
    # the prefix to compare with as it was; with automatic caching (not Anthropic: writes are free
    # or not reported) a prompt of at least the model's minimum that read nothing missed
    prompt = pl.col("recorded_cache_read_tokens") + pl.col("recorded_cache_write_tokens") \
        + pl.col("recorded_input_tokens").fill_null(0)
    models = c.get_column("model").unique().to_list() if "model" in c.columns else []
    floor = pl.col("model").replace_strict(
        {m: min_cacheable_tokens(m, provider_of(m)) for m in models if m is not None},
        default=OPENAI_MIN_TOKENS, return_dtype=pl.Int64)
    automatic = ~pl.col("model").fill_null("").str.to_lowercase().str.contains("claude")
    active = ((pl.col("recorded_cache_read_tokens") + pl.col("recorded_cache_write_tokens")) > 0) \
        | (automatic & (prompt >= floor))
    r = r.filter(known & active).sort("thread_key", "call").with_columns(_rttl=_recorded_ttl())
    r = r.with_columns(_rttl=pl.col("_rttl").forward_fill().backward_fill().over("thread_key").fill_null(TTL_5M_S))
    prev = {
        "_p_cached": pl.col("recorded_cache_read_tokens") + pl.col("recorded_cache_write_tokens"),
        "_p_read": pl.col("recorded_cache_read_tokens"), "_p_write": pl.col("recorded_cache_write_tokens"),
        "_p_model": pl.col("model"), "_p_t": pl.col("timestamp"), "_p_ttl": pl.col("_rttl"),
        "_p_seg": pl.col("segment"),
    }
    r = r.with_columns(**{k: v.shift(1).over("thread_key") for k, v in prev.items()})
    # the preamble (system, tools, what the agent injects) is at most the whole first request of its
    # compaction segment: a read past that is inside the messages, whatever the fit's estimate says
    r = r.with_columns(_pre=pl.min_horizontal("preamble_tokens", prompt.first().over("thread_key", "segment")))
    read = pl.col("recorded_cache_read_tokens")
    brk = pl.col("_p_cached").is_not_null() & (read < pl.col("_p_cached"))
    anthropic = pl.col("model").fill_null("").str.to_lowercase().str.contains("claude")
    # what the call cached anew: its writes, or (free writes: OpenAI and the like) its uncached input
    fresh = pl.when(pl.col("recorded_cache_write_tokens") > 0).then(pl.col("recorded_cache_write_tokens")) \
        .otherwise(pl.col("recorded_input_tokens").fill_null(0))
    gap = (pl.col("timestamp") - pl.col("_p_t")).dt.total_milliseconds() / 1000.0
    expired = gap > pl.col("_p_ttl")
    idle = pl.format("idle {} s > TTL {}", gap.round(0).cast(pl.Int64),
                     pl.when(pl.col("_p_ttl") >= TTL_1H_S).then(pl.lit("1h")).otherwise(pl.lit("5m")))
    switch = pl.format("{} -> {}", pl.col("_p_model"), pl.col("model"))
    strip = pl.col("recorded_strip").fill_null(False) & anthropic & _col(c, "strips_thinking", pl.Boolean).fill_null(True)
    conds = [
        ("model_switch", pl.col("model").ne_missing(pl.col("_p_model")), switch),
        ("ttl_expiry", expired, idle),
        ("compaction", pl.col("segment") != pl.col("_p_seg"), pl.lit(None, pl.String)),
        # Anthropic's extended-thinking rule (Gemini CLI leaves every thought out of its history: a
        # new turn changes no prefix there)
        # (not in a thread whose calibration found that its new turns keep the cache: it keeps its
        # thinking, pipeline/cost/calibrate.py `strips_thinking`)
        ("thinking_strip", strip, pl.lit(None, pl.String)),
        ("preamble", (read <= pl.col("_pre")) & anthropic, pl.format("read {} <= preamble {}", read, pl.col("_pre"))),
        # a step of the tool loop only appends to the previous request; reading exactly what that
        # request read means its own write was not kept (Anthropic says previous_message_not_found)
        ("eviction", anthropic & ~pl.col("_turn") & (read == pl.col("_p_read")) & (pl.col("_p_write") > 0),
         pl.format("read {} = the previous request's read: its write was not kept", read)),
        # a new turn only appends the last answer and the user's message to the previous request;
        # reading less, inside the messages, where no thinking was stripped, means the agent sent an
        # earlier message changed: content it adds to a turn and drops at the next (a PostToolUse
        # hook's additional context, on the corpus), which the transcript does not hold
        ("messages_change", anthropic & pl.col("_turn") & ~strip & (read > pl.col("_pre")),
         pl.format("a new turn read {} of the {} cached: an earlier message was sent changed", read,
                   pl.col("_p_cached"))),
        ("best_effort", ~anthropic, pl.lit("automatic caching guarantees no hit")),
    ]
    cause = pl.lit("unexplained")
    detail: pl.Expr = pl.lit(None, pl.String)
    for name, cond, det in reversed(conds):
        cause = pl.when(cond.fill_null(False)).then(pl.lit(name)).otherwise(cause)
        detail = pl.when(cond.fill_null(False)).then(det).otherwise(detail)
    r = r.with_columns(_inferred=cause, _idetail=detail)
    # the server's diagnosis, where the answer records one, names the cause (cost-and-cache.md
    # §2.5): a system or tools change is a preamble change, a previous request it cannot find an
    # eviction unless the TTL expired; a messages change is the messages cause we infer, if any;
    # `unavailable` (and a later type) leaves ours, an unexplained one becoming the provider's miss
    reason, inferred = pl.col("_reason"), pl.col("_inferred")
    server_cause = (
        pl.when(reason.is_in(["system_changed", "tools_changed"])).then(pl.lit("preamble"))
        .when(reason == "model_changed").then(pl.lit("model_switch"))
        .when(reason == "previous_message_not_found").then(
            pl.when(expired.fill_null(False)).then(pl.lit("ttl_expiry")).otherwise(pl.lit("eviction")))
        .when(reason == "messages_changed").then(
            pl.when(inferred.is_in(_MESSAGE_CAUSES)).then(inferred).otherwise(pl.lit("messages_change")))
        .when((reason == "unavailable") & (inferred == "unexplained")).then(pl.lit("provider_miss"))
        .otherwise(inferred))
    r = r.with_columns(_cause=server_cause)
    which = (  # a preamble change: which part, as the server says
        pl.when(reason == "system_changed").then(pl.lit("system prompt changed"))
        .when(reason == "tools_changed").then(pl.lit("tools changed")))
    own = pl.concat_str([which, (
        pl.when(pl.col("_cause") == inferred).then(pl.col("_idetail"))
        .when(pl.col("_cause") == "model_switch").then(switch)
        .when(pl.col("_cause") == "ttl_expiry").then(idle)
        .when(pl.col("_cause") == "eviction").then(pl.lit("the previous request's cache entry is gone")))],
        separator="; ", ignore_nulls=True)
    own = pl.when(own != "").then(own)
    server = pl.when(reason.is_not_null()).then(pl.concat_str(
        [pl.lit("server: ") + reason,
         pl.when(pl.col("_missed").is_not_null()).then(pl.format("{} tokens missed", pl.col("_missed")))],
        separator=", ", ignore_nulls=True))
    # the other causes that also hold (in the order above), after the cause's own detail
    r = r.with_columns(_others=pl.concat_str(
        [pl.when(cond.fill_null(False) & (pl.col("_cause") != name) & (inferred != name)).then(pl.lit(name))
         for name, cond, _ in conds],
        separator=", ", ignore_nulls=True))
    r = r.with_columns(
        recorded_break_cause=pl.when(brk).then(pl.col("_cause")),
        recorded_break_inferred_cause=pl.when(brk).then(inferred),
        recorded_break_detail=pl.when(brk).then(pl.concat_str(
            [own, server, pl.when(pl.col("_cause") != inferred).then(pl.lit("inferred ") + inferred),
             pl.when(pl.col("_others") != "").then(pl.lit("also ") + pl.col("_others"))], separator="; ",
            ignore_nulls=True)),
        recorded_break_tokens=pl.when(brk).then((pl.min_horizontal(pl.col("_p_cached"), read + fresh) - read)
                                                .clip(0).cast(pl.Int64)),
    )
    r = r.with_columns(recorded_break_detail=pl.when(pl.col("recorded_break_detail") == "")
                       .then(None).otherwise(pl.col("recorded_break_detail")))
    return c.drop([x for x in RECORDED_BREAK_COLUMNS if x in c.columns]).join(
        r.select("thread_key", "call", *RECORDED_BREAK_COLUMNS), on=["thread_key", "call"], how="left")


RECORDED_BREAK_COLUMNS = ("recorded_break_cause", "recorded_break_inferred_cause", "recorded_break_detail",
                          "recorded_break_tokens")


def diagnosis_agreement(calls: pl.DataFrame) -> dict[str, Any]:
    """Our own inference against the server's diagnosis, on every recorded break whose answer
    carries one that names a cause (not `unavailable`, not a later type): per server family
    (`preamble`: system or tools changed, `model`, `gone`: previous message not found, `messages`),
    the breaks, how many our inference (recorded_break_inferred_cause) puts in the same family, and
    the disagreeing calls."""
    d = _with_diagnosis(calls).filter(pl.col("recorded_break_cause").is_not_null()
                     & pl.col("recorded_miss_reason").is_in(list(SERVER_FAMILY))).with_columns(
        server_family=pl.col("recorded_miss_reason").replace_strict(SERVER_FAMILY),
        inferred_family=pl.col("recorded_break_inferred_cause").replace_strict(CAUSE_FAMILY, default=None))
    d = d.with_columns(agree=(pl.col("server_family") == pl.col("inferred_family")).fill_null(False))
    fams = {f: {"breaks": int(g.height), "agree": int(g["agree"].sum())}
            for (f,), g in d.group_by("server_family", maintain_order=True)}
    off = d.filter(~pl.col("agree")).sort("thread_key", "call").select(
        "thread_key", "call", "recorded_miss_reason", "recorded_missed_tokens", "recorded_break_inferred_cause")
    return {"breaks": d.height, "agree": int(d["agree"].sum()), "families": dict(sorted(fams.items())),
            "disagree": off.to_dicts()}


def has_usage() -> pl.Expr:
    """The call's answer recorded usage: some input, output, cache read or write. A call without
    (its usage missing, or all zero: a model or proxy that reports none) has nothing to compare a
    simulation with, and no cost to price. (Claude Code's `<synthetic>` notices are no calls at all.)"""
    return pl.sum_horizontal([pl.col(c).fill_null(0) for c in (
        "recorded_input_tokens", "recorded_output_tokens", "recorded_cache_read_tokens",
        "recorded_cache_write_tokens")]) > 0


def _simulated() -> pl.Expr:
    return ~pl.col("is_pending") & pl.col("sim_cache_read_tokens").is_not_null()


def no_usage(calls: pl.DataFrame) -> pl.DataFrame:
    """Per session: the simulated calls whose answer recorded no usage (`no_usage`), left out of
    every recorded-vs-simulated figure."""
    return calls.filter(_simulated() & ~has_usage()).group_by("session_id").agg(no_usage=pl.len())


def classify(calls: pl.DataFrame) -> pl.DataFrame:
    """Per simulated call with recorded usage (see `has_usage`): `rec_class` and `sim_class`
    (`warm` / `cold` for a thread's first call: read something or not; later calls `hit` (read at
    least the previous request's cached prefix) or `break`) and `agree`."""
    from ctxreplay.pipeline.cost.calibrate import recorded_write

    known = _simulated() & pl.col("recorded_cache_read_tokens").is_not_null() & has_usage()
    c = calls.with_columns(recorded_cache_write_tokens=recorded_write()).filter(known).sort("thread_key", "call")
    rprev = (pl.col("recorded_cache_read_tokens") + pl.col("recorded_cache_write_tokens")).shift(1).over("thread_key")
    sprev = (pl.col("sim_cache_read_tokens") + pl.col("sim_cache_write_5m_tokens")
             + pl.col("sim_cache_write_1h_tokens")).shift(1).over("thread_key")

    def cls(read: str, prev: pl.Expr) -> pl.Expr:
        return pl.when(prev.is_null()).then(pl.when(pl.col(read) > 0).then(pl.lit("warm")).otherwise(pl.lit("cold"))) \
            .when(pl.col(read) >= prev).then(pl.lit("hit")).otherwise(pl.lit("break"))

    c = c.with_columns(rec_class=cls("recorded_cache_read_tokens", rprev), sim_class=cls("sim_cache_read_tokens", sprev))
    return c.with_columns(agree=pl.col("rec_class") == pl.col("sim_class"))


_SUMS = {
    "rec_read": "recorded_cache_read_tokens", "rec_write": "recorded_cache_write_tokens",
    "rec_input": "recorded_input_tokens", "rec_cost": "recorded_cost_usd",
    "sim_read": "sim_cache_read_tokens", "sim_input": "sim_input_tokens", "sim_cost": "sim_cost_usd",
    "rec_break_cost": "recorded_break_cost_usd", "sim_break_cost": "sim_break_cost_usd",
}


def sessions(calls: pl.DataFrame) -> pl.DataFrame:
    """Per session: recorded vs simulated cache read / write / input tokens and cost, their relative
    differences, per-call class agreement, breaks and the share of cost breaks caused."""
    c = classify(calls).with_columns(sim_write=pl.col("sim_cache_write_5m_tokens") + pl.col("sim_cache_write_1h_tokens"))
    g = c.group_by("session_id").agg(
        calls=pl.len(),
        **{k: pl.col(v).sum() for k, v in _SUMS.items()},
        sim_write=pl.col("sim_write").sum(),
        agree=pl.col("agree").sum(),
        rec_breaks=pl.col("recorded_break_cause").is_not_null().sum(),
        sim_breaks=pl.col("sim_break_cause").is_not_null().sum(),
        unpriced=(pl.col("recorded_cost_usd").is_null() | pl.col("sim_cost_usd").is_null()).sum(),
    )

    def rel(a: str, b: str) -> pl.Expr:
        return pl.when(pl.col(b) != 0).then(pl.col(a) / pl.col(b) - 1.0)

    # a session whose calls all recorded no usage is listed with no call compared
    g = g.join(no_usage(calls), on="session_id", how="full", coalesce=True).with_columns(
        *(pl.col(k).fill_null(0) for k in ("calls", "agree", "rec_breaks", "sim_breaks", "unpriced")),
        no_usage=pl.col("no_usage").fill_null(0).cast(pl.UInt32))
    g = g.with_columns(
        read_diff=rel("sim_read", "rec_read"), write_diff=rel("sim_write", "rec_write"), cost_diff=rel("sim_cost", "rec_cost"),
        agreement=pl.when(pl.col("calls") > 0).then(pl.col("agree") / pl.col("calls")),
        rec_break_share=pl.when(pl.col("rec_cost") > 0).then(pl.col("rec_break_cost") / pl.col("rec_cost")),
        sim_break_share=pl.when(pl.col("sim_cost") > 0).then(pl.col("sim_break_cost") / pl.col("sim_cost")),
    )
    return g.sort("session_id")


def break_rows(calls: pl.DataFrame) -> pl.DataFrame:
    """One row per break, recorded and simulated: source, session, thread, call, timestamp, model,
    cause, detail, tokens re-written, cost; for recorded breaks also the server's diagnosis
    (`server_reason`, `server_missed_tokens`) and our own inferred cause (`inferred_cause`)."""
    calls = _with_diagnosis(calls)
    base = ["session_id", "thread_id", "thread_key", "call", "timestamp", "model"]
    parts = []
    for src, p in (("recorded", "recorded_break"), ("sim", "sim_break")):
        rec = src == "recorded"
        parts.append(calls.filter(pl.col(f"{p}_cause").is_not_null()).select(
            pl.lit(src).alias("source"), *base, cause=pl.col(f"{p}_cause"), detail=pl.col(f"{p}_detail"),
            tokens=pl.col(f"{p}_tokens"), cost_usd=pl.col(f"{p}_cost_usd"),
            server_reason=pl.col("recorded_miss_reason") if rec else pl.lit(None, pl.String),
            server_missed_tokens=pl.col("recorded_missed_tokens") if rec else pl.lit(None, pl.Int64),
            inferred_cause=pl.col("recorded_break_inferred_cause") if rec else pl.lit(None, pl.String)))
    return pl.concat(parts).sort("session_id", "thread_id", "call", "source")


def _with_diagnosis(calls: pl.DataFrame) -> pl.DataFrame:
    """calls of a run made before the server's diagnosis was read: its columns, null (the inferred
    cause is then the recorded cause)."""
    add = {k: pl.lit(None, t) for k, t in (("recorded_miss_reason", pl.String), ("recorded_missed_tokens", pl.Int64))
           if k not in calls.columns}
    if "recorded_break_inferred_cause" not in calls.columns:
        add["recorded_break_inferred_cause"] = pl.col("recorded_break_cause")
    return calls.with_columns(**add) if add else calls


def by_cause(calls: pl.DataFrame) -> dict[str, dict[str, Any]]:
    """{source: {cause: {"breaks", "tokens", "cost_usd"}}, plus "unexplained_share" per source}."""
    rows = break_rows(calls)
    out: dict[str, dict[str, Any]] = {}
    for src in ("recorded", "sim"):
        r = rows.filter(pl.col("source") == src)
        agg = r.group_by("cause").agg(breaks=pl.len(), tokens=pl.col("tokens").sum(), cost_usd=pl.col("cost_usd").sum())
        d: dict[str, Any] = {row["cause"]: {"breaks": row["breaks"], "tokens": row["tokens"],
                                            "cost_usd": row["cost_usd"]} for row in agg.sort("cause").to_dicts()}
        n = r.height
        d["total"] = n
        d["unexplained_share"] = (r.filter(pl.col("cause") == "unexplained").height / n) if n else 0.0
        out[src] = d
    return out


def summary(calls: pl.DataFrame, calibration: Any, policy: Any, prices: Any) -> dict[str, Any]:
    """The `cache_sim` section of summary.json."""
    c = classify(calls)
    sim_w = (pl.col("sim_cache_write_5m_tokens") + pl.col("sim_cache_write_1h_tokens")).sum()
    t = c.select(
        calls=pl.len(), recorded_cache_read_tokens=pl.col("recorded_cache_read_tokens").sum(),
        recorded_cache_write_tokens=pl.col("recorded_cache_write_tokens").sum(),
        sim_cache_read_tokens=pl.col("sim_cache_read_tokens").sum(), sim_cache_write_tokens=sim_w,
        recorded_cost_usd=pl.col("recorded_cost_usd").sum(), sim_cost_usd=pl.col("sim_cost_usd").sum(),
        agreement=pl.col("agree").mean(),
    ).to_dicts()[0] if c.height else {"calls": 0}
    t["no_usage"] = int(no_usage(calls)["no_usage"].sum())
    # a model is unpriced when a call with usage to price got no cost (a call without usage has none)
    unpriced = sorted({m for m in calls.filter(
        ~pl.col("is_pending") & has_usage() & (pl.col("sim_cost_usd").is_null() | pl.col("recorded_cost_usd").is_null())
        & pl.col("sim_input_tokens").is_not_null()).get_column("model").drop_nulls().to_list()}) if prices else None
    from dataclasses import asdict

    return {
        "policy": asdict(policy),
        "prices": getattr(prices, "source", None),
        "totals": {k: (round(v, 6) if isinstance(v, float) else v) for k, v in t.items()},
        "breaks": by_cause(calls),
        "unpriced_models": unpriced,
        "calibration": calibration.summary(),
    }


# ---------------------------------------------------------------------------------------------
# views of a run's outputs (`ctxreplay report --sim OUT`, `ctxreplay report --breaks OUT`)


def load_run(out_dir: Any) -> tuple[pl.DataFrame, dict[str, Any], str]:
    """(calls.parquet, summary.json, the run directory) of the run OUT shows; an error that says
    what to do when the run predates the cache simulator."""
    from pathlib import Path

    from ctxreplay.errors import InputError
    from ctxreplay.pipeline.assembly.store import run_dir
    from ctxreplay.pipeline.core.outdir import read_summary

    out = Path(out_dir)
    if not out.exists():
        raise InputError(f"{out}: no such directory; pass the --out directory of a `ctxreplay run`")
    try:
        run = run_dir(out)
    except Exception as exc:
        raise InputError(f"{out}: not the output directory of a `ctxreplay run` ({exc}); pass the --out "
                         f"directory of a run") from exc
    path = run / "calls.parquet"
    if not path.is_file():
        raise InputError(f"{out}: no calls.parquet; pass the --out directory of a `ctxreplay run`")
    calls = pl.read_parquet(path)
    if "sim_cache_read_tokens" not in calls.columns:
        raise InputError(f"{out}: this run was made before the cache simulator (its calls.parquet has no sim_* "
                         f"columns); run `ctxreplay run ... --out {out}` again")
    return calls, read_summary(run), str(run)


def _num(v: Any) -> Any:
    return round(v, 6) if isinstance(v, float) else v


def sim_view(calls: pl.DataFrame, summary: dict[str, Any], *, per_call: bool = False) -> dict[str, Any]:
    """Recorded vs simulated, per session (and per call): the document `report --sim --json` prints."""
    sess = sessions(calls)
    cols = ["session_id", "calls", "rec_read", "sim_read", "read_diff", "rec_write", "sim_write", "write_diff",
            "rec_input", "sim_input", "rec_cost", "sim_cost", "cost_diff", "agreement", "rec_breaks", "sim_breaks",
            "rec_break_share", "sim_break_share", "unpriced", "no_usage"]
    rows = [{k: _num(v) for k, v in r.items()} for r in sess.select(cols).to_dicts()]
    c = classify(calls)
    tot = c.select(
        calls=pl.len(), rec_read=pl.col("recorded_cache_read_tokens").sum(),
        sim_read=pl.col("sim_cache_read_tokens").sum(), rec_write=pl.col("recorded_cache_write_tokens").sum(),
        sim_write=(pl.col("sim_cache_write_5m_tokens") + pl.col("sim_cache_write_1h_tokens")).sum(),
        rec_cost=pl.col("recorded_cost_usd").sum(), sim_cost=pl.col("sim_cost_usd").sum(),
        agreement=pl.col("agree").mean(), rec_breaks=pl.col("recorded_break_cause").is_not_null().sum(),
        sim_breaks=pl.col("sim_break_cause").is_not_null().sum(),
    ).to_dicts()[0] if c.height else {"calls": 0}
    for a, b, d in (("sim_read", "rec_read", "read_diff"), ("sim_write", "rec_write", "write_diff"),
                    ("sim_cost", "rec_cost", "cost_diff")):
        tot[d] = (tot[a] / tot[b] - 1.0) if tot.get(b) else None
    tot["no_usage"] = int(no_usage(calls)["no_usage"].sum())
    cs = summary.get("cache_sim", {})
    doc: dict[str, Any] = {"pipeline": summary.get("pipeline"), "target": summary.get("target"),
                           "prices": cs.get("prices"), "sessions": rows, "totals": {k: _num(v) for k, v in tot.items()},
                           "calibration": cs.get("calibration"), "policy": cs.get("policy"),
                           "unpriced_models": cs.get("unpriced_models") or []}
    if per_call:
        pc = c.select("session_id", "thread_id", "thread_key", "call", pl.col("timestamp").dt.strftime("%Y-%m-%dT%H:%M:%SZ"),
                      "model", "calibrated_prompt_tokens", "recorded_cache_read_tokens", "recorded_cache_write_tokens",
                      "recorded_input_tokens", "sim_cache_read_tokens",
                      sim_cache_write_tokens=pl.col("sim_cache_write_5m_tokens") + pl.col("sim_cache_write_1h_tokens"),
                      sim_input_tokens="sim_input_tokens", rec_class="rec_class", sim_class="sim_class",
                      recorded_break_cause="recorded_break_cause", sim_break_cause="sim_break_cause",
                      recorded_cost_usd="recorded_cost_usd", sim_cost_usd="sim_cost_usd").sort("session_id", "thread_id", "call")
        doc["calls"] = [{k: _num(v) for k, v in r.items()} for r in pc.to_dicts()]
    return doc


def breaks_view(calls: pl.DataFrame, summary: dict[str, Any]) -> dict[str, Any]:
    """Every break, recorded and simulated, by cause and per session: what `report --breaks --json` prints."""
    rows = break_rows(calls).with_columns(pl.col("timestamp").dt.strftime("%Y-%m-%dT%H:%M:%SZ"))
    sess = sessions(calls).select("session_id", "rec_cost", "sim_cost", "rec_breaks", "sim_breaks", "rec_break_cost",
                                  "sim_break_cost", "rec_break_share", "sim_break_share")
    cs = summary.get("cache_sim", {})
    return {"pipeline": summary.get("pipeline"), "prices": cs.get("prices"),
            "breaks": [{k: _num(v) for k, v in r.items()} for r in rows.to_dicts()],
            "by_cause": by_cause(calls),
            "diagnosis": diagnosis_agreement(calls),
            "sessions": [{k: _num(v) for k, v in r.items()} for r in sess.to_dicts()]}


__all__ = ["CAUSES", "CAUSE_FAMILY", "RECORDED_BREAK_COLUMNS", "SERVER_FAMILY", "break_rows", "breaks_view", "by_cause",
           "classify", "diagnosis_agreement", "has_usage", "load_run", "no_usage", "recorded_breaks", "sessions",
           "sim_view", "summary"]
