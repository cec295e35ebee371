"""Calibration: from our token estimate of a request to the prompt the provider counted.

A transcript holds neither the system prompt nor the tool schemas, nor what the agent injects
into the first user message (Claude Code's CLAUDE.md, environment and reminders), and tiktoken is
not Claude's tokenizer. The provider's own count of every recorded request is in its usage:
`prompt = input + cache_write + cache_read`. Per thread we fit

    prompt[k] ≈ preamble[thread, segment(k)] + ratio × tokens[k]

where `tokens[k]` is our estimate of call k's request (`prompt_tokens`), `segment(k)` counts the
recorded compactions before call k (a compaction replaces the first user message and what the
agent injects into it, so each segment has its own preamble) and `ratio` is the tokenizer ratio.
The ratio is fitted by least squares within segments, per thread (`ratio_thread`) and pooled over
every thread of a tokenizer family (`ratio_family`, with its spread over threads); the simulator
uses the thread's own ratio where it is well determined (>= MIN_FIT_CALLS calls, within a factor 2
of its family's), else its owner's (a compaction agent: its main thread's), else the family's (a
family ratio outside RATIO_BOUNDS falls back to DEFAULT_RATIO) (`Calibration.mode = "family"` always uses the family's).
Each preamble is the mean residual `prompt - ratio × tokens` of its segment's calls (least squares
given the ratio, so a segment's calibrated prompts sum to its recorded ones).

What the recorded usage also says about the preamble's structure (for the cache simulator):
- `shared_tokens`: what the thread's first request read from a cache it did not write itself
  (Claude Code's common system and tool prefix, cached by other sessions of the account: 17,842
  tokens on the corpus); 0 when it read nothing, or more than its preamble (a compaction agent
  reading its main thread's history);
- `system_tokens`: where a request of the thread falls back to after its messages stopped
  matching (a compaction, a thinking strip): the end of the system prompt, the last breakpoint
  before the messages (21.4k - 21.5k on the corpus). Threads without such evidence take their
  shared prefix plus the median gap seen on the others, else their whole preamble;
- `tail_tokens`: the median recorded `input_tokens`, the few tokens after the last breakpoint;
- `uses_cache`: False for a thread whose requests never read nor wrote the cache (an agent that
  sets no breakpoint);
- `strips_thinking`: whether a new user turn after a turn with thinking strips that thinking, so
  that the thread loses its cached prefix from the first thinking block on. Anthropic documents it
  per model (providers.keeps_thinking): Opus 4.5+ and Sonnet 4.6+ keep earlier thinking, older
  models strip it. The recorded new turns after thinking (same model and segment, within the
  TTL) are the evidence: one that read past the first thinking message of the turn before kept
  it; one that read no further lost it, though on a model that keeps thinking only a loss inside
  the messages counts (a fall into the preamble is as well a change of the system prompt). A
  model that keeps thinking strips only in a thread where no new turn kept it and one lost it
  inside the messages; another strips unless most of its thread's new turns kept it; a thread
  without such a turn takes its model's default, a compaction agent its main thread's.

Fitting on some sessions and applying to others (`fit(..., prior=...)`): what is pooled over
sessions — the tokenizer ratio of each family (used by threads whose own ratio is not well
determined) and the median gap between the shared prefix and the system prompt's end (used by
threads without a recorded fall-back read) — is taken from `prior`, a calibration fitted on other
sessions, instead of from the calls being fitted; what a thread's own recorded usage determines
(its ratio where well determined, its preambles, shared prefix, tail, cache use, thinking strip)
still comes from its own usage, as a user's run has it. Without `prior` (the default) everything
is fitted on the calls given. `bench/bench_cachesim.py` uses it for its leave-one-session-out and
across-corpora figures.

Causality: the calibration is a property of the recorded session. It is fitted on the recorded
session's own requests (the loaded blocks before any stage, `recorded_facts`) and the
recorded usage, never on a pipeline's requests, so every pipeline run over the same transcripts
gets the same calibration, applied to its own requests (`apply`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import polars as pl

from ctxreplay.errors import SimError
from ctxreplay.pipeline.core.constants import POLARS_ENGINE, TTL_1H_S, TTL_5M_S
from ctxreplay.pipeline.cost.providers import keeps_thinking
from ctxreplay.pipeline.stageapi.calls import messages, per_call_sum, request_tokens
from ctxreplay.pipeline.stageapi.registry import StageContext

THREAD = ["session_id", "thread_id"]
MIN_FIT_CALLS = 5
RATIO_BOUNDS = (0.5, 3.0)   # a fitted ratio outside is not a tokenizer ratio: the family's default is used
DEFAULT_RATIO = {"claude-v3": 1.2, "claude-v4.7": 1.35, "claude-v5": 1.5, "openai-o200k": 1.0,
                 "gemini": 1.05, "other": 1.0}

# tokenizer families (../shared/docs/cost-and-cache.md §3.1): Claude 3 - Opus 4.6 share one vocabulary,
# Opus 4.7 - 4.9 another, Opus 5 / Sonnet 5 (and later) the same vocabulary with another framing
_FAMILIES: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"claude-(?:opus|sonnet|haiku|fable|mythos)-(?:[5-9])"), "claude-v5"),
    (re.compile(r"claude-(?:opus|sonnet|haiku)-4-[7-9]"), "claude-v4.7"),
    (re.compile(r"claude"), "claude-v3"),
    (re.compile(r"^(?:openai/)?(?:gpt|o\d|chatgpt|codex)"), "openai-o200k"),
    (re.compile(r"gemini"), "gemini"),
]


def model_family(model: str | None) -> str:
    """The tokenizer family of a model id (`claude-v3`, `claude-v4.7`, `claude-v5`, `openai-o200k`,
    `gemini`, else `other`)."""
    m = (model or "").lower()
    for pat, fam in _FAMILIES:
        if pat.search(m):
            return fam
    return "other"


def with_family(df: pl.DataFrame, col: str = "model", out: str = "family") -> pl.DataFrame:
    """df + a column `out` = model_family(col) (one Python call per distinct model)."""
    models = df.get_column(col).fill_null("").unique().to_list()
    return df.with_columns(pl.col(col).fill_null("").replace_strict(
        models, [model_family(m) for m in models], return_dtype=pl.String).alias(out))


def owner_expr() -> pl.Expr:
    """Whose system prompt a thread sends (`owner_key`): a Claude Code subagent its own (its
    thread_key): a subagent file's thread (`agent-<id>`) or an inline sidechain (`sidechain-<id>`,
    Claude Code 1.0.x writes its Task subagents into the main file, each with a root of its own);
    a compaction agent or a branch of a session the main thread's (the session id)."""
    sub = (pl.col("thread_id").str.starts_with("agent-") & ~pl.col("thread_id").str.starts_with("agent-acompact")) \
        | pl.col("thread_id").str.starts_with("sidechain-")
    return pl.when(sub).then(pl.col("thread_key")).otherwise(pl.col("session_id"))


def recorded_facts(blocks: pl.DataFrame, count_tokens: object | None) -> pl.DataFrame:
    """Per call of every thread, facts of the recorded session itself (the blocks as loaded, before
    any stage): `rec_tokens` (our estimate of its request: every block visible at the call plus 3
    per message and 3 per request, as the replay counts), `segment` (recorded compactions at or
    before the call), `recorded_turn` (a user message without a tool result arrives at this call: a
    new turn, not a step of the tool loop, which only appends the answer and its tool results) and
    `recorded_strip` (such a new turn while the turn before it holds thinking blocks: with extended
    thinking Anthropic strips them, which changes the prefix).

    `blocks` are the loaded blocks (rows no call sees are dropped here); `count_tokens` the run's
    counter (`TokenCounter.series_counter()`), None for ceil(chars / 4).
    """
    b = blocks.filter(pl.col("last_call").is_null() | (pl.col("last_call") > pl.col("first_call"))).lazy()
    ctx = StageContext(count_tokens=count_tokens)  # type: ignore[arg-type]
    msgs = messages(b)
    toks = request_tokens(b, ctx, msgs=msgs)
    summaries = msgs.filter(pl.col("is_compact_summary")).select(
        *THREAD, first_call="first", last_call=pl.lit(None, pl.Int32), _one=pl.lit(1, pl.Int64))
    grid = toks.select(*THREAD, "call")
    seg = per_call_sum(summaries, "_one", grid).rename({"_one": "segment"})
    thinking = b.group_by(*THREAD, "msg_key").agg(
        _th=pl.col("block_type").is_in(["thinking", "redacted_thinking"]).any())
    # consecutive user messages go out as one wire message: a run of them opens a new turn only when
    # none of them carries a tool result (a tool result with text appended continues the tool loop)
    m = msgs.join(thinking, on=[*THREAD, "msg_key"], how="left").sort(*THREAD, "order", "msg_key")
    # (a tool result is a user message on the wire: role "tool" in the blocks)
    wrole = pl.when(pl.col("role") == "tool").then(pl.lit("user")).otherwise(pl.col("role"))
    m = m.with_columns(_wrole=wrole)
    m = m.with_columns(_run=(pl.col("_wrole") != pl.col("_wrole").shift(1).over(THREAD)).fill_null(True)
                       .cast(pl.Int32).cum_sum().over(THREAD))
    m = m.with_columns(_real=(pl.col("_wrole") == "user") & ~pl.col("has_result").any().over(*THREAD, "_run"),
                       _run_first=pl.col("first").min().over(*THREAD, "_run"),
                       _lead=pl.int_range(pl.len()).over(*THREAD, "_run") == 0)
    m = m.with_columns(_turn=(pl.col("_real") & pl.col("_lead")).cast(pl.Int32).cum_sum().over(THREAD))
    users = m.filter(pl.col("_real") & pl.col("_lead")).select(*THREAD, call="_run_first", turn=pl.col("_turn") - 1)
    think = m.filter(pl.col("_th") & (pl.col("role") == "assistant")).select(*THREAD, turn="_turn", first="first",
                                                                               last="last")
    # strip_from_call: the call whose request ends just before the first thinking message of the
    # turn before (a strip changes the prefix from there on: a request that reads past it kept it)
    strip = users.join(think, on=[*THREAD, "turn"], how="inner").filter(
        (pl.col("first") <= pl.col("call")) & (pl.col("last").is_null() | (pl.col("last") > pl.col("call")))
    ).group_by(*THREAD, pl.col("call").cast(pl.Int32)).agg(
        strip_from_call=(pl.col("first").min() - 1).cast(pl.Int32)).with_columns(recorded_strip=pl.lit(True))
    turns = users.select(*THREAD, pl.col("call").cast(pl.Int32), recorded_turn=pl.lit(True)).unique()
    out = toks.join(seg, on=[*THREAD, "call"], how="left").join(strip, on=[*THREAD, "call"], how="left") \
        .join(turns, on=[*THREAD, "call"], how="left").select(
        *THREAD, "call", rec_tokens=(pl.col("tokens") + 3).cast(pl.Int64),
        segment=pl.col("segment").fill_null(0).cast(pl.Int32),
        recorded_strip=pl.col("recorded_strip").fill_null(False) & (pl.col("call") > 0),
        strip_from_call=pl.when(pl.col("call") > 0).then(pl.col("strip_from_call")),
        recorded_turn=pl.col("recorded_turn").fill_null(False))
    return out.collect(engine=POLARS_ENGINE).sort(*THREAD, "call")


@dataclass
class Calibration:
    """The fitted calibration: `threads` (one row per thread), `segments` (preamble per thread and
    compaction segment), `families` (the pooled ratio per tokenizer family and its spread)."""

    threads: pl.DataFrame
    segments: pl.DataFrame
    families: pl.DataFrame
    mode: str = "thread"
    system_gap: float | None = None
    """The pooled median gap (tokens) between a shared prefix and the end of the system prompt
    (`_system_tokens`), None without evidence."""

    def summary(self) -> dict[str, object]:
        fam = {r["family"]: {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items() if k != "family"}
               for r in self.families.to_dicts()}
        if not self.threads.height:
            return {"mode": self.mode, "families": fam, "threads": 0}
        th = self.threads
        return {
            "mode": self.mode, "families": fam,
            "threads": th.height,
            "threads_with_own_ratio": int((th.get_column("ratio_source") == "thread").sum()) if th.height else 0,
            "preamble_tokens": _spread(self.segments.get_column("preamble_tokens")) if self.segments.height else None,
            "shared_tokens": sorted({int(v) for v in th.get_column("shared_tokens").to_list() if v}),
            "system_tokens": _spread(th.get_column("system_tokens")) if th.height else None,
        }


def fixed(threads: list[dict[str, object]], mode: str = "fixed") -> Calibration:
    """A calibration given outright (tests, what-if studies): one dict per thread with
    `thread_key`, `session_id`, `thread_id` and optionally `ratio` (1.0), `preamble_tokens` (0, or
    a list: one per compaction segment), `shared_tokens`, `system_tokens` (0), `tail_tokens` (0),
    `uses_cache` (True), `family` ("other")."""
    rows, segs = [], []
    for t in threads:
        pre = t.get("preamble_tokens", 0)
        pres = list(pre) if isinstance(pre, list | tuple) else [pre]
        for i, p in enumerate(pres):
            segs.append({"thread_key": t["thread_key"], "segment": i, "preamble_tokens": int(p),  # type: ignore[call-overload]
                         "fit_calls": 0})
        rows.append({"session_id": t["session_id"], "thread_id": t["thread_id"], "thread_key": t["thread_key"],
                     "family": t.get("family", "other"), "ratio": float(t.get("ratio", 1.0)),  # type: ignore[arg-type]
                     "ratio_source": "fixed", "shared_tokens": int(t.get("shared_tokens", 0)),  # type: ignore[call-overload]
                     "system_tokens": int(t.get("system_tokens", 0)), "tail_tokens": int(t.get("tail_tokens", 0)),  # type: ignore[call-overload]
                     "uses_cache": bool(t.get("uses_cache", True)), "strips_thinking": t.get("strips_thinking")})
    th = pl.DataFrame(rows, schema={"session_id": pl.String, "thread_id": pl.String, "thread_key": pl.String,
                                    "family": pl.String, "ratio": pl.Float64, "ratio_source": pl.String,
                                    "shared_tokens": pl.Int64, "system_tokens": pl.Int64, "tail_tokens": pl.Int64,
                                    "uses_cache": pl.Boolean, "strips_thinking": pl.Boolean})
    th = th.with_columns(owner_key=owner_expr())
    seg = pl.DataFrame(segs, schema={"thread_key": pl.String, "segment": pl.Int32, "preamble_tokens": pl.Int64,
                                     "fit_calls": pl.Int32})
    fam = pl.DataFrame(schema={"family": pl.String, "ratio_family": pl.Float64})
    return Calibration(th, seg, fam, mode)


def _spread(s: pl.Series) -> dict[str, float]:
    s = s.drop_nulls().cast(pl.Float64)
    if s.len() == 0:
        return {}
    return {"min": float(s.min()), "p10": float(s.quantile(0.1, "nearest")),  # type: ignore[arg-type]
            "median": float(s.median()), "p90": float(s.quantile(0.9, "nearest")),  # type: ignore[arg-type]
            "max": float(s.max())}  # type: ignore[arg-type]


_RECORDED = ["recorded_input_tokens", "recorded_cache_read_tokens", "recorded_cache_write_tokens"]


def recorded_write() -> pl.Expr:
    """recorded_cache_write_tokens, 0 where the usage has input and reads but no write field (OpenAI,
    Codex: no cache writes to report)."""
    w = pl.col("recorded_cache_write_tokens")
    known = pl.col("recorded_input_tokens").is_not_null() & pl.col("recorded_cache_read_tokens").is_not_null()
    return pl.when(known).then(w.fill_null(0)).otherwise(w)


def fit(calls: pl.DataFrame, rec: pl.DataFrame, *, mode: str = "thread", prior: Calibration | None = None) -> Calibration:
    """Fit the calibration of every thread of `calls` (calls.parquet's columns) from its recorded
    usage and `rec` (recorded_facts). Threads without recorded usage get the family's
    default ratio and a zero preamble. `prior`: a calibration fitted on other sessions whose
    pooled quantities (family ratios, the system gap) are used instead of those of `calls` (a
    family the prior does not know keeps the one fitted here)."""
    if mode not in ("thread", "family"):
        raise SimError(f"calibration mode {mode!r} is neither 'thread' (each thread's own tokenizer ratio where its "
                       f"calls determine it, the default) nor 'family' (the model family's ratio for every thread): "
                       f"pass mode='thread' or mode='family'")
    need = [*THREAD, "thread_key", "call", "is_pending", "model", *_RECORDED, "recorded_cache_write_5m_tokens",
            "recorded_cache_write_1h_tokens"]
    if "timestamp" in calls.columns:
        need.append("timestamp")
    else:
        calls = calls.with_columns(timestamp=pl.lit(None, pl.Datetime("ms", "UTC")))
        need.append("timestamp")
    rec = rec if "recorded_strip" in rec.columns else rec.with_columns(recorded_strip=pl.lit(False))
    rec = rec if "strip_from_call" in rec.columns else rec.with_columns(strip_from_call=pl.lit(None, pl.Int32))
    c = with_family(calls.select(need).join(rec, on=[*THREAD, "call"], how="left")).with_columns(
        segment=pl.col("segment").fill_null(0).cast(pl.Int32), recorded_cache_write_tokens=recorded_write())
    c = c.with_columns(
        y=pl.sum_horizontal(_RECORDED).cast(pl.Float64),
        x=pl.col("rec_tokens").cast(pl.Float64),
        usable=~pl.col("is_pending") & pl.all_horizontal([pl.col(k).is_not_null() for k in _RECORDED])
        & pl.col("rec_tokens").is_not_null() & (pl.sum_horizontal(_RECORDED) > 0),
    )
    u = c.filter(pl.col("usable"))
    seg_keys = ["thread_key", "family", "segment"]
    u = u.with_columns(xm=pl.col("x").mean().over(seg_keys), ym=pl.col("y").mean().over(seg_keys))
    u = u.with_columns(sxy=(pl.col("x") - pl.col("xm")) * (pl.col("y") - pl.col("ym")),
                       sxx=(pl.col("x") - pl.col("xm")) ** 2)
    per = u.group_by("thread_key", "family").agg(
        n_fit=pl.len(), sxy=pl.col("sxy").sum(), sxx=pl.col("sxx").sum())
    per = per.with_columns(ratio_thread=pl.when((pl.col("n_fit") >= 3) & (pl.col("sxx") > 0))
                           .then(pl.col("sxy") / pl.col("sxx")).otherwise(None))
    fam = per.group_by("family").agg(
        sxy=pl.col("sxy").sum(), sxx=pl.col("sxx").sum(), threads=pl.len(), calls=pl.col("n_fit").sum(),
        fitted_threads=pl.col("ratio_thread").is_not_null().sum(),
        thread_ratio_p10=pl.col("ratio_thread").quantile(0.1, "nearest"),
        thread_ratio_median=pl.col("ratio_thread").median(),
        thread_ratio_p90=pl.col("ratio_thread").quantile(0.9, "nearest"),
        thread_ratio_min=pl.col("ratio_thread").min(), thread_ratio_max=pl.col("ratio_thread").max(),
    ).with_columns(ratio_family=pl.when(pl.col("sxx") > 0).then(pl.col("sxy") / pl.col("sxx")))
    default = pl.col("family").replace_strict(DEFAULT_RATIO, default=1.0, return_dtype=pl.Float64)
    lo, hi = RATIO_BOUNDS
    fam = fam.with_columns(ratio_family=pl.when(pl.col("ratio_family").is_between(lo, hi)).then(pl.col("ratio_family"))
                           .otherwise(default)).drop("sxy", "sxx")
    if prior is not None and prior.families.height and "ratio_family" in prior.families.columns:
        pf = prior.families.select("family", _prior_ratio="ratio_family")
        fam = fam.join(pf, on="family", how="left").with_columns(
            ratio_family=pl.coalesce("_prior_ratio", "ratio_family")).drop("_prior_ratio")

    # one family per thread (the one most of its calls are in) and its ratio
    threads = c.group_by(*THREAD, "thread_key").agg(
        family=pl.col("family").mode().sort().first(), calls=pl.len())
    threads = threads.join(per.select("thread_key", "family", "n_fit", "ratio_thread"),
                           on=["thread_key", "family"], how="left") \
        .join(fam.select("family", "ratio_family"), on="family", how="left") \
        .with_columns(ratio_family=pl.col("ratio_family").fill_null(default), n_fit=pl.col("n_fit").fill_null(0))
    threads = threads.with_columns(owner_key=owner_expr())

    def usable(r: str, n: str) -> pl.Expr:
        return (pl.lit(mode == "thread") & pl.col(r).is_not_null() & (pl.col(n) >= MIN_FIT_CALLS)
                & (pl.col(r) >= 0.5 * pl.col("ratio_family")) & (pl.col(r) <= 2 * pl.col("ratio_family"))
                & pl.col(r).is_between(*RATIO_BOUNDS))

    # a thread with too few calls of its own that carries its owner's history (a compaction agent,
    # a branch) takes the owner's ratio: its messages are the owner's
    owners = threads.select(owner_key="thread_key", owner_family="family", owner_ratio="ratio_thread",
                            owner_n="n_fit")
    threads = threads.join(owners, on="owner_key", how="left")
    own, inherited = usable("ratio_thread", "n_fit"), usable("owner_ratio", "owner_n") & (
        pl.col("owner_key") != pl.col("thread_key")) & (pl.col("owner_family") == pl.col("family"))
    threads = threads.with_columns(
        ratio=pl.when(own).then(pl.col("ratio_thread")).when(inherited).then(pl.col("owner_ratio"))
        .otherwise(pl.col("ratio_family")),
        ratio_source=pl.when(own).then(pl.lit("thread")).when(inherited).then(pl.lit("owner"))
        .otherwise(pl.lit("family"))).drop("owner_family", "owner_ratio", "owner_n")

    # preambles per (thread, segment): the mean residual of its usable calls under the thread's ratio
    r_of = threads.select("thread_key", "ratio")
    u = u.join(r_of, on="thread_key").with_columns(res=pl.col("y") - pl.col("ratio") * pl.col("x"))
    seg = u.group_by("thread_key", "segment").agg(pre=pl.col("res").mean(), n=pl.len())
    all_segs = c.select("thread_key", "segment").unique()
    seg = all_segs.join(seg, on=["thread_key", "segment"], how="left").sort("thread_key", "segment")
    # a segment without usable calls takes the nearest earlier one's (else a later one's)
    seg = seg.with_columns(pre=pl.col("pre").forward_fill().backward_fill().over("thread_key"))
    segments = seg.select("thread_key", "segment", preamble_tokens=pl.col("pre").fill_null(0.0).clip(0.0).round(0)
                          .cast(pl.Int64), fit_calls=pl.col("n").fill_null(0).cast(pl.Int32))

    # residual spread per thread (relative error of the calibrated prompt)
    u = u.join(segments.select("thread_key", "segment", "preamble_tokens"), on=["thread_key", "segment"]) \
        .with_columns(rel=((pl.col("preamble_tokens") + pl.col("ratio") * pl.col("x")) / pl.col("y") - 1).abs())
    resid = u.group_by("thread_key").agg(fit_mape=pl.col("rel").median(), fit_max_ape=pl.col("rel").max())

    structure = _structure(c, segments)
    threads = threads.join(resid, on="thread_key", how="left").join(structure, on="thread_key", how="left")
    threads, gap = _system_tokens(threads, c, segments, prior.system_gap if prior is not None else None,
                                  prior is not None)
    # a thread that sends its owner's system prompt (a compaction agent, a branch) starts from the
    # owner's shared preamble too: their requests are one chain
    # (and strips its thinking as the owner does, where its own new turns say nothing: the same
    # messages, sent by the same agent)
    owner_shared = threads.select(owner_key="thread_key", _os="shared_tokens", _osys="system_tokens",
                                  _ostrip="strips_thinking")
    other = pl.col("owner_key") != pl.col("thread_key")
    threads = threads.join(owner_shared, on="owner_key", how="left").with_columns(
        shared_tokens=pl.when(other).then(pl.col("_os").fill_null(pl.col("shared_tokens"))).otherwise(pl.col("shared_tokens")),
        system_tokens=pl.when(other).then(pl.col("_osys").fill_null(
            pl.col("system_tokens"))).otherwise(pl.col("system_tokens")),
        strips_thinking=pl.when(other & (pl.col("strip_candidates") == 0)).then(
            pl.col("_ostrip").fill_null(pl.col("strips_thinking"))).otherwise(pl.col("strips_thinking")),
    ).drop("_os", "_osys", "_ostrip")
    fam_out = fam.join(u.group_by("family").agg(fit_mape=pl.col("rel").median(),
                                               fit_p90_ape=pl.col("rel").quantile(0.9, "nearest")),
                       on="family", how="left").sort("family")
    return Calibration(threads.sort("thread_key"), segments, fam_out, mode, gap)


def _structure(c: pl.DataFrame, segments: pl.DataFrame) -> pl.DataFrame:
    """Per thread: shared_tokens (first request's read from others' caches), tail_tokens,
    uses_cache, and the evidence of where its requests fall back to (break reads)."""
    rec = c.filter(pl.col("usable")).sort("thread_key", "call").join(
        segments.select("thread_key", "segment", "preamble_tokens"), on=["thread_key", "segment"], how="left")
    # evidence of stripping: a new turn after thinking that lost the prefix for no other reason
    # (same model and compaction segment, within the TTL written with; calls that neither read nor
    # wrote are left out, as in pipeline/cost/breaks.py)
    act = rec.filter((pl.col("recorded_cache_read_tokens") + pl.col("recorded_cache_write_tokens")) > 0)
    ttl = pl.when(pl.col("recorded_cache_write_1h_tokens").fill_null(0) > 0).then(TTL_1H_S).otherwise(TTL_5M_S)
    sh = {k: v.shift(1).over("thread_key") for k, v in {
        "_pc": pl.col("recorded_cache_read_tokens") + pl.col("recorded_cache_write_tokens"),
        "_pm": pl.col("model"), "_ps": pl.col("segment"), "_pt": pl.col("timestamp"), "_pttl": ttl}.items()}
    act = act.with_columns(**sh)
    gap = (pl.col("timestamp") - pl.col("_pt")).dt.total_milliseconds() / 1000.0
    act = act.with_columns(
        _cand=pl.col("recorded_strip").fill_null(False) & pl.col("_pc").is_not_null()
        & (pl.col("model") == pl.col("_pm")) & (pl.col("segment") == pl.col("_ps"))
        & (gap.fill_null(0.0) <= pl.col("_pttl")),
        _miss=pl.col("recorded_cache_read_tokens") < pl.col("_pc"))
    # a miss that still read past the first thinking message of the turn before kept that thinking
    # (a strip changes the prefix from there on): the prefix changed later, for another reason
    ends = act.select("thread_key", strip_from_call="call",
                      _from_end=pl.col("recorded_cache_read_tokens") + pl.col("recorded_cache_write_tokens"))
    act = act.join(ends, on=["thread_key", "strip_from_call"], how="left").with_columns(
        _past=(pl.col("recorded_cache_read_tokens") > pl.col("_from_end")).fill_null(False))
    # a miss that fell back inside the preamble (at most the whole first request of its segment) is
    # as well a change of the system prompt or the tools: no evidence against a model that keeps
    # its thinking by default (baeb5d66 call 41: the server says system_changed)
    prompt = pl.col("recorded_cache_read_tokens") + pl.col("recorded_cache_write_tokens") + pl.col(
        "recorded_input_tokens").fill_null(0)
    act = act.with_columns(_inpre=pl.col("recorded_cache_read_tokens") <= pl.min_horizontal(
        "preamble_tokens", prompt.sort_by("call").first().over("thread_key", "segment")))
    act = act.with_columns(_kept=pl.col("_cand") & (~pl.col("_miss") | pl.col("_past")),
                           _smiss=pl.col("_cand") & pl.col("_miss") & ~pl.col("_past"))
    act = act.with_columns(_smiss_msg=pl.col("_smiss") & ~pl.col("_inpre").fill_null(False))
    rec = rec.join(act.select("thread_key", "call", "_cand", "_kept", "_smiss", "_smiss_msg"),
                   on=["thread_key", "call"], how="left").with_columns(_cand=pl.col("_cand").fill_null(False))
    first = rec.group_by("thread_key").agg(
        r0=pl.col("recorded_cache_read_tokens").sort_by("call").first(),
        p0=pl.col("preamble_tokens").sort_by("call").first(),
        tail_tokens=pl.col("recorded_input_tokens").median().round(0).cast(pl.Int64),
        uses_cache=((pl.col("recorded_cache_read_tokens") + pl.col("recorded_cache_write_tokens")) > 0).any(),
        strip_candidates=pl.col("_cand").sum().cast(pl.Int32),
        strip_kept=pl.col("_kept").fill_null(False).sum().cast(pl.Int32),
        strip_misses=pl.col("_smiss").fill_null(False).sum().cast(pl.Int32),
        _smiss_msg=pl.col("_smiss_msg").fill_null(False).sum().cast(pl.Int32),
        _model=pl.col("model").drop_nulls().mode().sort().first(),
    )
    # whether a new user turn after thinking strips it: a model that keeps earlier thinking by
    # default (providers.keeps_thinking: Opus 4.5+, Sonnet 4.6+, ...) strips only in a thread where
    # no new turn ever kept it and some lost it (an agent that drops thinking itself); another model
    # (Sonnet 4.5, Haiku 4.5, ...) strips unless most of the thread's new turns kept it; a thread
    # without such a turn takes its model's default
    models = first.get_column("_model").drop_nulls().unique().to_list()
    keeps = pl.col("_model").replace_strict({m: keeps_thinking(m) for m in models}, default=False,
                                            return_dtype=pl.Boolean)
    first = first.with_columns(strips_thinking=pl.when(pl.col("strip_candidates") == 0).then(~keeps)
                               .when(keeps).then((pl.col("strip_kept") == 0) & (pl.col("_smiss_msg") > 0))
                               .otherwise(2 * pl.col("strip_misses") >= pl.col("strip_candidates"))).drop(
        "_model", "_smiss_msg")
    first = first.with_columns(shared_tokens=pl.when((pl.col("r0") > 0) & (pl.col("r0") <= pl.col("p0")))
                               .then(pl.col("r0")).otherwise(0).cast(pl.Int64)).drop("r0", "p0")
    all_threads = c.select("thread_key").unique()
    return all_threads.join(first, on="thread_key", how="left").with_columns(
        shared_tokens=pl.col("shared_tokens").fill_null(0), tail_tokens=pl.col("tail_tokens").fill_null(0),
        uses_cache=pl.col("uses_cache").fill_null(True), strip_candidates=pl.col("strip_candidates").fill_null(0),
        strip_kept=pl.col("strip_kept").fill_null(0), strip_misses=pl.col("strip_misses").fill_null(0))


def _system_tokens(threads: pl.DataFrame, c: pl.DataFrame, segments: pl.DataFrame, prior_gap: float | None = None,
                   use_prior: bool = False) -> tuple[pl.DataFrame, float | None]:
    """system_tokens per thread: the most frequent read of a request (not the thread's first) that
    fell back inside the preamble, over the threads of one owner; else shared + the median gap of
    the owners with evidence; else the thread's smallest preamble. Clamped to shared <= system <= preamble."""
    rec = c.filter(pl.col("usable")).sort("thread_key", "call").join(
        segments.select("thread_key", "segment", "preamble_tokens"), on=["thread_key", "segment"], how="left")
    rec = rec.join(threads.select("thread_key", "owner_key", "shared_tokens"), on="thread_key")
    rec = rec.with_columns(nth=pl.int_range(pl.len()).over("thread_key"))
    ev = rec.filter((pl.col("nth") > 0) & (pl.col("recorded_cache_read_tokens") > 0)
                    & (pl.col("recorded_cache_read_tokens") < pl.col("preamble_tokens"))
                    & (pl.col("recorded_cache_read_tokens") > pl.col("shared_tokens")))
    by_owner = ev.group_by("owner_key").agg(
        evidence=pl.col("recorded_cache_read_tokens").mode().sort().first(), n_evidence=pl.len())
    shared_of_owner = threads.filter(pl.col("shared_tokens") > 0).group_by("owner_key").agg(
        owner_shared=pl.col("shared_tokens").min())
    gaps = by_owner.join(shared_of_owner, on="owner_key").with_columns(gap=pl.col("evidence") - pl.col("owner_shared"))
    gap = gaps.get_column("gap").median() if gaps.height else None
    if use_prior:      # the pooled gap of the sessions the prior was fitted on
        gap = prior_gap
    pmin = segments.group_by("thread_key").agg(pmin=pl.col("preamble_tokens").min())
    t = threads.join(by_owner, on="owner_key", how="left").join(pmin, on="thread_key", how="left")
    fallback = (pl.col("shared_tokens") + pl.lit(int(gap))) if gap is not None and gap > 0 else pl.col("pmin")
    sys_ = pl.when(pl.col("evidence").is_not_null()).then(pl.col("evidence")) \
        .when(pl.col("shared_tokens") > 0).then(fallback).otherwise(pl.col("pmin"))
    t = t.with_columns(system_tokens=pl.min_horizontal(pl.max_horizontal(sys_, pl.col("shared_tokens")),
                                                       pl.col("pmin").fill_null(0)).fill_null(0).cast(pl.Int64),
                       system_source=pl.when(pl.col("evidence").is_not_null()).then(pl.lit("recorded_break"))
                       .when(pl.col("shared_tokens") > 0).then(pl.lit("shared_plus_median_gap"))
                       .otherwise(pl.lit("preamble")))
    t = t.with_columns(shared_tokens=pl.min_horizontal("shared_tokens", "system_tokens"))
    out = t.drop("evidence", "pmin").with_columns(n_evidence=pl.col("n_evidence").fill_null(0))
    return out, (float(gap) if gap is not None else None)  # type: ignore[arg-type]


def apply(calls: pl.DataFrame, calibration: Calibration, rec: pl.DataFrame) -> pl.DataFrame:
    """calls + `preamble_tokens` (of the call's thread and compaction segment) and
    `calibrated_prompt_tokens` = preamble + ratio × prompt_tokens, rounded."""
    seg = rec.select(*THREAD, "call", "segment")
    out = calls.drop([x for x in ("preamble_tokens", "calibrated_prompt_tokens", "segment") if x in calls.columns])
    out = out.join(seg, on=[*THREAD, "call"], how="left").with_columns(segment=pl.col("segment").fill_null(0))
    segs = calibration.segments.select("thread_key", pl.col("segment").cast(pl.Int32), "preamble_tokens").sort("segment")
    # a segment the calibration does not know (a compaction a pipeline simulates) takes the thread's
    # latest known preamble before it, else its first
    out = out.with_columns(segment=pl.col("segment").cast(pl.Int32), _i=pl.int_range(pl.len())).sort("segment")
    back = out.join_asof(segs, on="segment", by="thread_key", strategy="backward", check_sortedness=False).select("_i", _b="preamble_tokens")
    fwd = out.join_asof(segs, on="segment", by="thread_key", strategy="forward", check_sortedness=False).select("_i", _f="preamble_tokens")
    out = out.join(back, on="_i").join(fwd, on="_i").sort("_i").with_columns(
        preamble_tokens=pl.coalesce("_b", "_f")).drop("_i", "_b", "_f")
    out = out.join(calibration.threads.select("thread_key", "ratio"), on="thread_key", how="left")
    out = out.with_columns(preamble_tokens=pl.col("preamble_tokens").fill_null(0),
                           ratio=pl.col("ratio").fill_null(1.0))
    out = out.with_columns(calibrated_prompt_tokens=(pl.col("preamble_tokens")
                                                     + pl.col("ratio") * pl.col("prompt_tokens")).round(0).cast(pl.Int64))
    return out.drop("segment", "ratio")


__all__ = ["Calibration", "apply", "fit", "fixed", "model_family", "owner_expr", "recorded_facts", "recorded_write",
           "with_family"]
