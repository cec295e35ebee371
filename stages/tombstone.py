"""L6 tombstone: clear the content of old tool results, keep ids, names and positions (docs/layers.md).

Per thread, a forward walk over the calls (inside `map_batches`; O((calls + results) log results):
per-call deltas for the tokens already freed, a Fenwick tree over the visible, not yet cleared
results) decides when tombstoning fires: on the token trigger (estimated request tokens over
`trigger_tokens`, and only when the batch frees at least `clear_at_least_tokens`) or the idle
trigger (the request comes `trigger_idle_seconds` or more after the last assistant row, by
transcript timestamps). A firing at call k moves a monotone frontier over the eligible results
(oldest first) and takes a new cache epoch; every result below the frontier is cleared from call k on.
"""

from __future__ import annotations

import dataclasses
import functools
from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from itertools import accumulate
from typing import Any, Literal

import polars as pl

from ctxreplay.pipeline.core.blockops import block_schema, empty_decisions, null_columns, sort_blocks
from ctxreplay.pipeline.core.constants import (
    BLOCK_KEY,
    CACHE_EDIT_SUFFIX,
    MESSAGE_OVERHEAD_TOKENS,
    NO_CALL,
    PART_KEY,
    POLARS_ENGINE,
    THINKING_TYPES,
    THREAD,
    TOOL_CALL_TYPES,
)
from ctxreplay.pipeline.core.constants import CLEARED_TEXT as CLEARED
from ctxreplay.pipeline.core.constants import REASONING_OMITTED_TEXT as REASONING_OMITTED
from ctxreplay.pipeline.core.fenwick import Fenwick
from ctxreplay.pipeline.core.tokens import is_image_expr, tokens_expr
from ctxreplay.pipeline.stageapi.calls import (
    call_grid,
    firing_epoch,
    materialize,
    messages,
    open_max,
    row_tokens_expr,
    text_tokens,
    walk_parts,
)
from ctxreplay.pipeline.stageapi.live import Live, LiveRows, LiveRule, LiveThread
from ctxreplay.pipeline.stageapi.marks import conflicted, finish, mark_drop, mark_replace_from, start_marks
from ctxreplay.pipeline.stageapi.quiet import request_tokens_max
from ctxreplay.pipeline.stageapi.registry import Quiet, StageContext, StageResult, stage


def _default_tools() -> dict[str, tuple[str, ...]]:
    return {"allow": ("*",), "deny": ()}


@dataclass(frozen=True, slots=True, kw_only=True)
class Tombstone:
    trigger_tokens: int = 100_000
    """Fire when the estimated request exceeds this many tokens (0: no token trigger)."""
    trigger_idle_seconds: int = 3_600
    """Fire when the request comes this many seconds after the last assistant row (0: no idle trigger)."""
    keep_recent: int = 5
    """Newest eligible tool results left as they are."""
    min_result_chars: int = 256
    """Results shorter than this (characters of text) are never cleared."""
    clear_at_least_tokens: int = 20_000
    """The token trigger clears only when the batch frees at least this many tokens."""
    tools: dict[str, Any] = dataclasses.field(default_factory=_default_tools)
    """`allow` / `deny`: tool-name globs (`*`, case-insensitive); deny wins. Write `tools.deny = ["Read"]`."""
    clear_tool_inputs: bool = False
    """Also replace the input of each cleared result's tool call by `{}` (id and name kept)."""
    clear_thinking_keep: int | Literal["all"] = "all"
    """At each firing, remove thinking older than this many recent user turns (never in the current tool loop)."""
    mode: Literal["rewrite", "cache_edit"] = dataclasses.field(default="rewrite",
                                                               metadata={"digest_omit_default": True})
    """rewrite: the agent sends the cleared history (the cached prefix breaks); cache_edit: the provider clears it in its cache (context editing), the prefix stays cached."""

    def validate(self) -> None:
        unknown = set(self.tools) - {"allow", "deny"}
        if unknown:
            raise ValueError(f"tools has unknown key(s) {sorted(unknown)}; use tools.allow and tools.deny")
        for k, v in self.tools.items():
            if not isinstance(v, (list, tuple)) or not all(isinstance(x, str) for x in v):
                raise ValueError(f"tools.{k} must be a list of tool-name globs; got {v!r}")
        for name in ("trigger_tokens", "trigger_idle_seconds", "keep_recent", "min_result_chars",
                     "clear_at_least_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative; got {getattr(self, name)}")
        if isinstance(self.clear_thinking_keep, int) and self.clear_thinking_keep < 0:
            raise ValueError(f"clear_thinking_keep must be 'all' or >= 0; got {self.clear_thinking_keep}")
        if self.mode not in ("rewrite", "cache_edit"):
            raise ValueError(f"mode must be 'rewrite' or 'cache_edit'; got {self.mode!r}")

    @property
    def allow(self) -> tuple[str, ...]:
        return tuple(self.tools.get("allow", ("*",)))

    @property
    def deny(self) -> tuple[str, ...]:
        return tuple(self.tools.get("deny", ()))


def glob_regex(globs: tuple[str, ...]) -> str | None:
    """One case-insensitive anchored regex for tool-name globs (`*` any run, `?` one character)."""
    if not globs:
        return None
    parts = []
    for g in globs:
        out = []
        for ch in g:
            out.append(".*" if ch == "*" else "." if ch == "?" else "\\" + ch if not ch.isalnum() else ch)
        parts.append("".join(out))
    return "(?is)^(?:" + "|".join(parts) + ")$"


def tool_filter_expr(params: Tombstone) -> pl.Expr:
    name = pl.col("tool_name").fill_null("").str.strip_chars()
    allow, deny = glob_regex(params.allow), glob_regex(params.deny)
    ok = name.str.contains(allow) if allow else pl.lit(False)
    if deny:
        ok = ok & ~name.str.contains(deny)
    return ok


# ---------------------------------------------------------------------------------------------
# the walk over calls


@functools.cache
def _assign_schema() -> dict[str, Any]:
    return {"session_id": pl.String, "thread_id": pl.String, "kind": pl.String, "entry_id": pl.String,
            "block_pos": pl.Int32, "clear_call": pl.Int32, "epoch": pl.Int32, "reason": pl.String}


def _free_from(delta: list[int], k: int, v: int, end: int) -> int:
    """Count v tokens freed from call k (now) until call `end`; returns what applies at k."""
    if end <= k:
        return 0
    if end < len(delta) - 1:
        delta[end] -= v
    return v


@dataclass
class _Results:
    """The eligible tool results of one thread, in order (index i = position in that order)."""

    order: list[int]
    a: list[int]  # first call that sees it
    z: list[int]  # first call that no longer does (NO_CALL: open)
    done: list[bool]  # already cleared in the input (a re-run, or the ledger's clearings re-applied)
    native: list[bool]  # cleared in the transcript itself, not by this layer
    s: list[int]  # tokens its clearing frees, exactly: negative when the placeholder is the longer
    g: list[int]  # the same, at least 0: what the frontier's choice counts (a prefix sum that only grows)
    cnt: list[int]  # cnt[i]: results before i not done
    a_sorted: list[int]

    @classmethod
    def of(cls, res: pl.DataFrame) -> _Results:
        done = res["done"].to_list()
        a = res["a"].to_list()
        s = [0 if dn else int(x or 0) for x, dn in zip(res["s"].to_list(), done)]
        return cls(res["order"].to_list(), a, res["z"].to_list(), done, res["native"].to_list(),
                   s, [max(0, x) for x in s], [0, *accumulate(0 if dn else 1 for dn in done)], sorted(a))


@dataclass
class _Thinking:
    """The thinking blocks of one thread (clear_thinking_keep), in order; a prefix gets cleared."""

    order: list[int]
    a: list[int]
    turn: list[int]
    z: list[int]
    done: list[bool]
    s: list[int]
    a_sorted: list[int]
    turn_sorted: list[int]

    @classmethod
    def of(cls, th: pl.DataFrame, frozen_calls: set[int]) -> _Thinking:
        done = [lst is not None and int(lst) in frozen_calls for lst in th["last"].to_list()]
        a, turn = th["a"].to_list(), th["turn"].to_list()
        return cls(th["order"].to_list(), a, turn, th["z"].to_list(), done,
                   [0 if dn else int(x or 0) for x, dn in zip(th["s"].to_list(), done)], sorted(a), sorted(turn))


@functools.cache
def _no_thinking() -> dict[str, Any]:
    return {"entry_id": pl.String, "block_pos": pl.Int32, "order": pl.Int64, "a": pl.Int32, "turn": pl.Int32,
            "z": pl.Int32, "last": pl.Int32, "s": pl.Int64}


class _Walk:
    """The forward walk over the calls of one thread.

    State: the frontier `f` over the results (results before it are cleared, or wait to be when
    they first appear), the thinking frontier `hf`, the epoch of the last firing, the tokens freed so
    far (`saved`, exact per call through `delta`: a row can leave the request in the middle, by a
    snip or a compaction) and a Fenwick tree over the savings of the results visible now and not
    cleared, which answers "how much would clearing up to i free". Both frontiers only move forward.
    The thread's calls, results and thinking blocks come sorted, their nulls filled (`_scan`: walk_parts).
    """

    def __init__(self, calls: pl.DataFrame, res: pl.DataFrame, th: pl.DataFrame, p: Tombstone) -> None:
        self.p = p
        self.keep_n = None if p.clear_thinking_keep == "all" else int(p.clear_thinking_keep)
        self.n = calls.height
        self.tok = calls["tokens"].to_list()
        self.u = calls["u_order"].to_list()
        self.cur_turn = calls["cur_turn"].to_list()
        self.ep = calls["ep"].to_list()
        self.idle = calls["idle"].to_list()
        self.r = r = _Results.of(res)
        self.f = self.hf = self.start = self.last_epoch = 0
        frozen = [i for i, (dn, nat) in enumerate(zip(r.done, r.native)) if dn and not nat]
        frozen_calls: set[int] = set()
        if frozen:  # clearing already in the input (re-run or re-applied ledger): go on after it
            dc, de = res["done_call"].to_list(), res["done_epoch"].to_list()
            self.f = max(frozen) + 1
            frozen_calls = {int(dc[i]) for i in frozen}
            self.start = max(frozen_calls) + 1
            self.last_epoch = max(int(de[i]) for i in frozen)
        self.t = t = _Thinking.of(th, frozen_calls)
        if any(t.done):
            self.hf = max(i for i, dn in enumerate(t.done) if dn) + 1
        m = len(r.order)
        self.fen = Fenwick(m)
        self.appear = sorted((r.a[i], i) for i in range(m) if not r.done[i])
        self.leave = sorted((r.z[i], i) for i in range(m) if not r.done[i] and r.z[i] < NO_CALL)
        self.in_fen, self.cleared = [False] * m, [False] * m
        self.waiting: list[int] = []  # below the frontier but not yet in any request
        self.delta = [0] * (self.n + 1)  # changes of the tokens freed so far, per call
        self.saved = self.ai = self.li = 0
        self.fire_k: list[int] = []
        self.fire_f: list[int] = []
        self.fire_e: list[int] = []
        self.fire_r: list[str] = []

    def walk(self) -> None:
        r = self.r
        for k in range(self.n):
            self._advance(k)
            if k < self.start:
                continue
            seen = bisect_right(r.a_sorted, k)
            e = max(0, min(seen - self.p.keep_recent, bisect_left(r.order, self.u[k])))
            ready = [i for i in self.waiting if r.a[i] <= k]
            if (e <= self.f or r.cnt[e] == r.cnt[self.f]) and not ready:
                continue
            nf, reason = self._trigger(k, e)
            if nf == self.f or r.cnt[nf] == r.cnt[self.f]:
                continue
            self._fire(k, nf, reason, ready)

    def _advance(self, k: int) -> None:
        """Call k: results enter and leave the request; the tokens freed change as planned."""
        r, fen = self.r, self.fen
        self.saved += self.delta[k]
        while self.ai < len(self.appear) and self.appear[self.ai][0] <= k:
            i = self.appear[self.ai][1]
            self.ai += 1
            if r.z[i] > k and not self.cleared[i]:
                fen.add(i, r.g[i])
                self.in_fen[i] = True
        while self.li < len(self.leave) and self.leave[self.li][0] <= k:
            i = self.leave[self.li][1]
            self.li += 1
            if self.in_fen[i]:
                fen.add(i, -r.g[i])
                self.in_fen[i] = False

    def _trigger(self, k: int, e: int) -> tuple[int, str]:
        """The new frontier at call k (e: the end of the eligible results) and why; `f` when no
        trigger fires. Idle: everything eligible. Token: the oldest results until the request is
        back under `trigger_tokens`, only when that frees at least `clear_at_least_tokens`."""
        p, r, f = self.p, self.r, self.f
        if not (e > f and r.cnt[e] > r.cnt[f]):
            return f, ""
        if p.trigger_idle_seconds > 0 and self.idle[k]:
            return e, "idle"
        total = self.tok[k] - self.saved
        if p.trigger_tokens > 0 and total > p.trigger_tokens:
            base = self.fen.prefix(f)
            if self.fen.prefix(e) - base >= p.clear_at_least_tokens:
                need = max(p.clear_at_least_tokens, total - p.trigger_tokens)
                return min(max(self.fen.lower_bound(base + need), f + 1), e), "token"
        return f, ""

    def _fire(self, k: int, nf: int, reason: str, ready: list[int]) -> None:
        """A firing at call k: a new epoch; results up to the new frontier (and those waiting)
        cleared from k on, or as soon as they appear; old thinking cleared."""
        r = self.r
        epoch = firing_epoch(k, self.ep, self.last_epoch)
        self.fire_k.append(k), self.fire_f.append(nf), self.fire_e.append(epoch), self.fire_r.append(reason)
        for i in [*range(self.f, nf), *ready]:
            if r.done[i] or self.cleared[i]:
                continue
            if r.a[i] > k:
                self.waiting.append(i)
                continue
            self.cleared[i] = True
            if self.in_fen[i]:
                self.fen.add(i, -r.g[i])
                self.in_fen[i] = False
            self.saved += _free_from(self.delta, k, r.s[i], min(r.z[i], self.n))
        self.waiting = [i for i in self.waiting if not self.cleared[i]]
        if self.keep_n is not None:
            t = self.t
            new_hf = max(self.hf, min(bisect_right(t.turn_sorted, self.cur_turn[k] - self.keep_n),
                                      bisect_left(t.order, self.u[k]), bisect_right(t.a_sorted, k)))
            for x in range(self.hf, new_hf):
                if not t.done[x] and t.a[x] <= k:
                    self.saved += _free_from(self.delta, k, t.s[x], min(t.z[x], self.n))
            self.hf = new_hf
        self.f, self.last_epoch = nf, epoch

    def assignments(self, res: pl.DataFrame, th: pl.DataFrame) -> list[tuple[str, Any, Any, int, str]]:
        """(kind, entry_id, block_pos, firing index, reason) of every result and thinking block cleared:
        the first firing at or after its first appearance whose frontier passes it."""
        r, t, fk = self.r, self.t, self.fire_k
        found: list[tuple[str, Any, Any, int, str]] = []
        for i, (eid, bp) in enumerate(zip(res["entry_id"].to_list(), res["block_pos"].to_list())):
            if r.done[i]:
                continue
            j = max(bisect_left(fk, r.a[i]), bisect_right(self.fire_f, i))
            if j < len(fk) and fk[j] < r.z[i]:
                found.append(("result", eid, bp, j, self.fire_r[j]))
        if self.keep_n is None:
            return found
        turn_limit = [self.cur_turn[k] - self.keep_n for k in fk]
        u_at = [self.u[k] for k in fk]
        for x, (eid, bp) in enumerate(zip(th["entry_id"].to_list(), th["block_pos"].to_list())):
            if t.done[x]:
                continue
            j = max(bisect_left(fk, t.a[x]), bisect_left(turn_limit, t.turn[x]), bisect_right(u_at, t.order[x]))
            if j < len(fk) and fk[j] < t.z[x]:
                found.append(("think", eid, bp, j, "clear_thinking"))
        return found


def _scan(df: pl.DataFrame, p: Tombstone) -> pl.DataFrame:
    """Walk the calls of each thread; return the call, epoch and reason at which each result (and,
    with `clear_thinking_keep`, each thinking block) is cleared.

    Input rows by `kind`: `call` (tokens, u_order, cur_turn, ep, idle), `result` (order, a = first
    call, z = end, s = tokens freed, done / native / done_call / done_epoch) and `think` (order, a,
    z, turn, s, last). O((calls + results) log results): see `_Walk`.
    """
    out: dict[str, list[Any]] = {k: [] for k in _assign_schema()}
    calls_by = walk_parts(df, "call", ["call"], {"tokens": 0, "u_order": -(2**62), "cur_turn": 0, "ep": 0,
                                                 "idle": False})
    res_by = walk_parts(df, "result", ["order", "entry_id", "block_pos"], {"z": NO_CALL})
    th_by = walk_parts(df, "think", ["order", "entry_id", "block_pos"], {"z": NO_CALL}) if "turn" in df.columns else {}
    no_thinking = pl.DataFrame(schema=_no_thinking())  # no thinking rows were passed (clear_thinking_keep = "all")
    for (sid, tid), calls in calls_by.items():
        res = res_by.get((sid, tid))
        if res is None or calls.height == 0 or res.height == 0:
            continue
        th = th_by.get((sid, tid), no_thinking)
        w = _Walk(calls, res, th, p)
        w.walk()
        if not w.fire_k:
            continue
        for kind, eid, bp, j, reason in w.assignments(res, th):
            for key, v in zip(_assign_schema(), (sid, tid, kind, eid, bp, w.fire_k[j], w.fire_e[j], reason)):
                out[key].append(v)
    return pl.DataFrame(out, schema=_assign_schema())


# ---------------------------------------------------------------------------------------------
# plan and stage


def _call_owners(blocks: pl.LazyFrame, ctx: StageContext, inputs: bool) -> pl.LazyFrame:
    """For each tool result: its tool call block (the latest earlier call with that id), the call's
    tool name (results often carry none) and, with `inputs` (clear_tool_inputs), the tokens that
    clearing the call's input would free (else 0). `blocks` holds each row's tokens (`_tok`)."""
    results = blocks.filter((pl.col("block_type") == "tool_result") & pl.col("tool_use_id").is_not_null()) \
        .group_by(BLOCK_KEY).agg(pl.col("tool_use_id").first(), order_key=pl.col("order_key").min())
    calls = blocks.filter(pl.col("block_type").is_in(list(TOOL_CALL_TYPES)) & pl.col("tool_use_id").is_not_null())
    if inputs:
        after = tokens_expr(pl.concat_str([pl.col("tool_name"), pl.lit("{}")], separator=" ", ignore_nulls=True),
                            ctx.count_tokens)
        saved = pl.col("_tok").sort_by("first_call").first() - pl.col("_after").sort_by("first_call").first()
        calls = calls.with_columns(_after=after)
    else:
        saved = pl.lit(0, pl.Int64)
    calls = calls.group_by(BLOCK_KEY).agg(
        pl.col("tool_use_id").sort_by("first_call").first(), _use_order=pl.col("order_key").min(),
        _use_name=pl.col("tool_name").sort_by("first_call").first(), _in_saved=saved)
    return results.sort("order_key").join_asof(
        calls.select(*THREAD, "tool_use_id", "_use_order", "_in_saved", "_use_name", _use_entry="entry_id",
                     _use_pos="block_pos")
        .sort("_use_order"),
        left_on="order_key", right_on="_use_order", by=[*THREAD, "tool_use_id"], strategy="backward",
        check_sortedness=False,
    ).filter(pl.col("_use_entry").is_not_null()).select(*BLOCK_KEY, "_use_entry", "_use_pos", "_in_saved", "_use_name")


def plan(blocks: pl.LazyFrame, params: Tombstone, ctx: StageContext,
         forced: pl.LazyFrame | None = None) -> StageResult:
    """The tombstoning itself: per-call facts and per-result facts go into the walk; its
    assignments are applied. `forced`: clearings decided before (rows of the assignment schema),
    applied as they are."""
    blocks = materialize(blocks)
    msgs = materialize(messages(blocks))
    # each row's tokens (`_tok`) counted once, for the owners and the per-call, per-result and
    # per-thinking facts (each counted them again: a dozen ms of a live engine's full pass)
    counted = materialize(blocks.with_columns(_tok=row_tokens_expr(ctx)))
    owners = materialize(_call_owners(counted, ctx, params.clear_tool_inputs))
    cleared_tok, omitted_tok = text_tokens([CLEARED, REASONING_OMITTED], ctx)
    parts = [_per_call(counted, msgs, params, ctx), _per_result(counted, owners, params, ctx, cleared_tok)]
    if params.clear_thinking_keep != "all":
        parts.append(_per_thinking(counted, msgs, ctx, omitted_tok))
    assign = materialize(pl.concat(parts, how="diagonal_relaxed").map_batches(lambda df: _scan(df, params),
                                                                              schema=_assign_schema()))
    if forced is not None:
        forced = forced.select(list(_assign_schema())).cast(_assign_schema())  # type: ignore[arg-type]
        assign = materialize(pl.concat([assign.join(forced, on=BLOCK_KEY, how="anti"), forced]))
    if not assign.select(pl.len()).collect(engine=POLARS_ENGINE).item():  # nothing to clear: the rows as they are
        return StageResult(sort_blocks(blocks), empty_decisions())
    return _apply(blocks, assign, params, owners if params.clear_tool_inputs else None)


def _per_call(blocks: pl.LazyFrame, msgs: pl.LazyFrame, params: Tombstone, ctx: StageContext) -> pl.LazyFrame:
    """Per call: request tokens, the latest real user row (the current tool loop starts after it),
    its turn, the highest cache epoch so far and whether the idle trigger holds. `blocks` holds
    each row's tokens (`_tok`)."""
    grid = materialize(call_grid(blocks))
    # one group_by per call over every row a request counts (request_token_deltas' rows: +tokens at
    # a row's or message's first call, -tokens at its last), the rows that start at a call carrying
    # what starts there: the highest cache epoch of its rows; of its messages, the latest real user
    # message's order and turn, the last message's timestamp and the last answer's (null where the
    # call starts none of them). One group_by and one join instead of three of each.
    real, asst = pl.col("is_real_user"), pl.col("role") == "assistant"
    none_i32, none_i64 = pl.lit(None, pl.Int32), pl.lit(None, pl.Int64)
    none_ts = pl.lit(None, msgs.collect_schema()["timestamp"])
    starts = blocks.select(*THREAD, call=pl.col("first_call").cast(pl.Int32), _d=pl.col("_tok").cast(pl.Int64),
                           ep=pl.col("cache_epoch"), _a=pl.lit(False), _o=none_i64, _u=none_i64,
                           _ut=none_i32, _ts=none_ts)
    ends = blocks.filter(pl.col("last_call").is_not_null()).select(
        *THREAD, call=pl.col("last_call").cast(pl.Int32), _d=-pl.col("_tok").cast(pl.Int64))
    overhead = pl.lit(MESSAGE_OVERHEAD_TOKENS, pl.Int64)
    m_starts = msgs.select(*THREAD, call=pl.col("first").cast(pl.Int32), _d=overhead, _a=asst,
                           _o=pl.col("order").cast(pl.Int64),
                           _u=pl.when(real).then(pl.col("order")).cast(pl.Int64),
                           _ut=pl.when(real).then(pl.col("turn")).cast(pl.Int32), _ts=pl.col("timestamp"))
    m_ends = msgs.filter(pl.col("last").is_not_null()).select(*THREAD, call=pl.col("last").cast(pl.Int32),
                                                              _d=-overhead)
    key = [*THREAD, "call"]
    is_a = pl.col("_a").fill_null(False)
    events = pl.concat([starts, ends, m_starts, m_ends], how="diagonal").group_by(key).agg(
        _d=pl.col("_d").sum(), ep=pl.col("ep").max(), u_order=pl.col("_u").max(), cur_turn=pl.col("_ut").max(),
        t_req=pl.col("_ts").get(pl.col("_o").arg_max()),  # (_o: null but on the messages' rows)
        t_asst=pl.col("_ts").filter(is_a).get(pl.col("_o").filter(is_a).arg_max()))
    # every call of the grid with what starts there, then carried over the thread's calls in one
    # pass: the request tokens cumulated, the message facts carried forward (the user message's
    # order and turn, and the highest epoch, never going back)
    at = grid.join(events, on=key, how="left").sort(key)

    def carried(e: pl.Expr) -> pl.Expr:
        return e.over(THREAD, order_by="call")

    per_call = at.with_columns(
        carried(pl.col("_d").fill_null(0).cum_sum()).alias("tokens"),
        carried(pl.col("u_order").forward_fill().cum_max()),
        carried(pl.col("cur_turn").forward_fill().cum_max()),
        carried(pl.col("t_req").forward_fill()),
        carried(pl.col("t_asst").forward_fill()),
        carried(pl.col("ep").fill_null(0).cum_max()),
    ).with_columns(
        idle=((pl.col("t_req") - pl.col("t_asst")).dt.total_seconds() >= max(params.trigger_idle_seconds, 1))
        & (params.trigger_idle_seconds > 0),
    )
    return per_call.select(*THREAD, kind=pl.lit("call"), call="call", tokens="tokens", u_order="u_order",
                           cur_turn="cur_turn", ep="ep", idle="idle")


def _result_facts() -> dict[str, pl.Expr]:
    """Aggregates of one tool result's rows that the plan's walk and the live rule's measure both
    read: its order, first call, and where it holds the placeholder already (null: nowhere)."""
    placeholder = (pl.col("part_pos") == 0) & (pl.col("text") == CLEARED)
    return {
        "order": pl.col("order_key").min(),
        "a": pl.col("first_call").min(),
        "done_call": pl.col("first_call").filter(placeholder).min(),
        "done_epoch": pl.col("cache_epoch").filter(placeholder).sort_by(pl.col("first_call").filter(placeholder)).first(),
    }


def _native() -> pl.Expr:
    """Over `_result_facts`: cleared in the transcript itself (from its first call, epoch 0), not by this layer."""
    return pl.col("done_call").is_not_null() & (pl.col("done_call") == pl.col("a")) & (pl.col("done_epoch") == 0)


def _per_result(blocks: pl.LazyFrame, owners: pl.LazyFrame, params: Tombstone, ctx: StageContext,
                cleared_tok: int) -> pl.LazyFrame:
    """Per eligible tool result: first appearance, end, order, the tokens clearing it frees (its
    first version, and its call's input with `clear_tool_inputs`), and whether it is cleared already."""
    rows = blocks.filter(pl.col("block_type") == "tool_result").with_columns(
        _first=pl.col("first_call") == pl.col("first_call").min().over(PART_KEY))  # each part's first version
    first = pl.col("_first")
    res = rows.group_by(BLOCK_KEY).agg(
        **_result_facts(),
        z=open_max("last_call"),
        tool_name=pl.col("tool_name").drop_nulls().first(),
        pinned=pl.col("extra_json").fill_null("").str.contains('"pinned":true', literal=True).any(),
        # the first versions' size and tokens (every result has some: each part has a first version)
        size=(pl.when(is_image_expr()).then(pl.col("_tok") * 4)
              .otherwise(pl.col("text").str.len_chars().fill_null(0))).filter(first).sum(),
        tok=pl.col("_tok").filter(first).sum(),
    ).with_columns(
        done=pl.col("done_call").is_not_null(),
    )
    res = res.join(owners.select(*BLOCK_KEY, "_in_saved", "_use_name"), on=BLOCK_KEY, how="left").with_columns(
        tool_name=pl.coalesce(pl.col("tool_name").replace("", None), "_use_name"))
    in_saved = pl.col("_in_saved").fill_null(0) if params.clear_tool_inputs else pl.lit(0, pl.Int64)
    res = res.with_columns(
        native=_native(),
        # exact, even negative (a result shorter than the placeholder): the tokens freed so far must be
        # what the request lost, or a run that re-applies the ledger's clearings (whose request counts
        # them as they are) would see another total than the run that made them
        s=pl.when(pl.col("done")).then(0).otherwise(pl.col("tok") - cleared_tok + in_saved),
    ).filter(
        tool_filter_expr(params) & ~pl.col("pinned") & ((pl.col("size") >= params.min_result_chars) | pl.col("done"))
    )
    return res.select(*THREAD, "entry_id", "block_pos", "order", "a", "z", "s", "done", "native", "done_call",
                      "done_epoch", kind=pl.lit("result"))


def _per_thinking(blocks: pl.LazyFrame, msgs: pl.LazyFrame, ctx: StageContext, omitted_tok: int) -> pl.LazyFrame:
    """Per thinking block: order, first call, turn, end, and the tokens clearing it frees. `blocks`
    holds each row's tokens (`_tok`)."""
    think = _thinking(blocks, msgs).group_by(BLOCK_KEY).agg(
        order=pl.col("order_key").min(), a=pl.col("first_call").min(), turn=pl.col("turn").min(),
        z=open_max("last_call"),
        last=pl.col("last_call").max(),
        s=(pl.col("_tok").sort_by("first_call").first()
           - pl.when(pl.col("_only").first() & pl.col("_firstb").first()).then(omitted_tok).otherwise(0)),
    )
    return think.with_columns(kind=pl.lit("think"))


def _only_thinking() -> pl.Expr:
    """The row's message holds only thinking blocks."""
    return pl.col("block_type").is_in(list(THINKING_TYPES)).all().over([*THREAD, "msg_key"])


def _first_block() -> pl.Expr:
    """The row is (a part of) its message's first block."""
    return pl.col("block_pos") == pl.col("block_pos").min().over([*THREAD, "msg_key"])


def _thinking(blocks: pl.LazyFrame, msgs: pl.LazyFrame) -> pl.LazyFrame:
    """Thinking blocks of assistant messages, with their turn and whether the message holds only
    thinking (then its first block becomes `[assistant reasoning omitted]` instead of going)."""
    return blocks.filter(pl.col("role") == "assistant").with_columns(_only=_only_thinking(), _firstb=_first_block()) \
        .filter(pl.col("block_type").is_in(list(THINKING_TYPES))) \
        .join(msgs.select(*THREAD, "msg_key", "turn"), on=[*THREAD, "msg_key"], how="left")



def _why(reason: pl.Expr, params: Tombstone) -> pl.Expr:
    """A decision's reason: as it is (`rewrite`), or with `:cache_edit` (once) in cache-edit mode."""
    base = reason.str.strip_suffix(CACHE_EDIT_SUFFIX)
    return base + pl.lit(CACHE_EDIT_SUFFIX) if params.mode == "cache_edit" else base


def _apply(blocks: pl.LazyFrame, assign: pl.LazyFrame, params: Tombstone,
           owners: pl.LazyFrame | None) -> StageResult:
    """Clear what the walk assigned, each from its firing's call and in its epoch: a result's first
    part becomes CLEARED and its other parts go (`tombstone`); with `clear_tool_inputs` its call's
    input becomes `{}` (`clear_input`); cleared thinking goes, and a message of thinking only keeps
    one REASONING_OMITTED text block (`replace`)."""
    a = assign.select(*BLOCK_KEY, "kind", _call="clear_call", _epoch="epoch",
                      _reason=_why(pl.col("reason"), params))
    owner = None if owners is None else a.filter(pl.col("kind") == "result").join(owners, on=BLOCK_KEY) \
        .sort("_call").select(*THREAD, entry_id="_use_entry", block_pos="_use_pos", _in_call="_call",
                              _in_epoch="_epoch")
    # only the messages holding a block to clear go through the marks (whole messages: the thinking
    # rules look at a message's other blocks); the other rows are left as they are, what `finish`
    # gives an unmarked row
    keys = a.select(BLOCK_KEY) if owner is None else pl.concat([a.select(BLOCK_KEY), owner.select(BLOCK_KEY)])
    msg = [*THREAD, "msg_key"]
    hit_msgs = blocks.join(keys.unique(), on=BLOCK_KEY, how="semi").select(msg).unique()
    rest = blocks.join(hit_msgs, on=msg, how="anti", nulls_equal=True)
    blocks = blocks.join(hit_msgs, on=msg, how="semi", nulls_equal=True)
    marked = blocks.join(a.filter(pl.col("kind") == "result").drop("kind"), on=BLOCK_KEY, how="left")
    if owner is not None:
        marked = marked.join(owner.unique(subset=BLOCK_KEY, keep="first"), on=BLOCK_KEY, how="left")
    if params.clear_thinking_keep != "all":
        th = a.filter(pl.col("kind") == "think").select(*BLOCK_KEY, _th_call="_call", _th_epoch="_epoch")
        marked = marked.with_columns(_only=_only_thinking(), _firstb=_first_block()).join(th, on=BLOCK_KEY, how="left")
    w = start_marks(marked)
    hit = pl.col("_call").is_not_null() & (pl.col("block_type") == "tool_result")
    null = null_columns(("image_media_type", "image_data", "image_bytes", "image_width", "image_height", "signature"))
    unchanged = (pl.col("text") == CLEARED) & pl.col("part_type").is_in(["string", "text"]) \
        & pl.col("image_media_type").is_null() & pl.col("image_data").is_null() & pl.col("signature").is_null()
    w = mark_replace_from(
        w, hit & (pl.col("part_pos") == 0) & ~unchanged.fill_null(False),
        {"text": pl.lit(CLEARED), "cache_epoch": pl.col("_epoch"), **null,
         "part_type": pl.when(pl.col("part_type") == "string").then(pl.lit("string")).otherwise(pl.lit("text"))},
        pl.col("_reason"), pl.col("_call"), action="tombstone")
    w = mark_drop(w, hit & (pl.col("part_pos") > 0), pl.col("_reason"), from_call=pl.col("_call"), action="tombstone",
                  epoch=pl.col("_epoch"))
    if owners is not None:
        is_call = pl.col("_in_call").is_not_null() & pl.col("block_type").is_in(list(TOOL_CALL_TYPES))
        w = mark_replace_from(w, is_call & pl.col("tool_input").ne_missing(pl.lit("{}")),
                              {"tool_input": pl.lit("{}"), "cache_epoch": pl.col("_in_epoch")},
                              _why(pl.lit("tombstone"), params), pl.col("_in_call"), action="clear_input")
    if params.clear_thinking_keep != "all":
        think = pl.col("_th_call").is_not_null() & pl.col("block_type").is_in(list(THINKING_TYPES))
        # a message left with only thinking keeps one text block saying so (as layer 1 does)
        kept = think & pl.col("_only") & pl.col("_firstb")
        w = w.with_columns(_kept_block=kept.any().over(BLOCK_KEY))
        w = mark_replace_from(w, kept, {"block_type": pl.lit("text"), "text": pl.lit(REASONING_OMITTED),
                                        "signature": pl.lit(None, pl.String), "cache_epoch": pl.col("_th_epoch")},
                              _why(pl.lit("clear_thinking"), params), pl.col("_th_call"))
        w = mark_drop(w, think & ~pl.col("_kept_block"), _why(pl.lit("clear_thinking"), params),
                      from_call=pl.col("_th_call"),
                      epoch=pl.col("_th_epoch"))
    res = finish(w)
    return StageResult(sort_blocks(pl.concat([rest.select(block_schema().names()), res.blocks])), res.decisions)


# ---------------------------------------------------------------------------------------------
# the live rule (ctxreplay.pipeline.stageapi.live): no clearing at the new calls of a live step


@dataclass(frozen=True, slots=True)
class Measure:
    """What this stage sees at the pending call, measured on the blocks it left (its input with its
    clearings applied): the request's tokens, and the tool results it could still clear, counted
    before and after the latest real user message (the current tool loop is never cleared, so those
    after it become clearable only when a user message comes). "Could still clear": not cleared,
    and not before the last result it cleared (its frontier only moves forward; results cleared
    from their first appearance on are the transcript's own and do not move it). The counts and
    tokens are upper bounds: every such result long enough (min_result_chars) or holding an image,
    whatever its tool, pin or age, with all its rows' tokens (a clearing frees at most that)."""

    tokens: int
    u_order: int | None  # order_key of the latest real user message (None: none yet)
    before: tuple[int, int]  # (results, tokens) before it
    after: tuple[int, int]  # (results, tokens) after it

    def grown(self, new: LiveRows, min_chars: int) -> Measure:
        """The same after the appended rows."""
        users = [m[0]["order_key"] for m in new.messages if _real_user(m)]
        cands = _candidates(new, min_chars)
        tokens = self.tokens + new.request_tokens
        if not users:  # the current tool loop goes on: every new result is in it
            return Measure(tokens, self.u_order, self.before, _count(self.after, cands))
        u = users[-1]  # a new tool loop: what came before its user message is outside it
        before = _count((self.before[0] + self.after[0], self.before[1] + self.after[1]),
                        [c for c in cands if c[0] < u])
        return Measure(tokens, u, before, _count((0, 0), [c for c in cands if c[0] > u]))


def _count(acc: tuple[int, int], cands: list[tuple[int, int, int]]) -> tuple[int, int]:
    """(results, tokens) plus the candidates (order_key, tokens, size)."""
    return acc[0] + len(cands), acc[1] + sum(c[1] for c in cands)


def _real_user(msg: list[dict[str, Any]]) -> bool:
    return msg[0]["role"] == "user" and not any(r["block_type"] == "tool_result" for r in msg)


def _candidates(new: LiveRows, min_chars: int) -> list[tuple[int, int, int]]:
    """(order_key, tokens, size) of each new tool result this stage might clear."""
    out: dict[tuple[str, int], list[int]] = {}
    for r, tok in zip(new.rows, new.tokens, strict=True):
        if r["block_type"] != "tool_result":
            continue
        c = out.setdefault((r["entry_id"], r["block_pos"]), [r["order_key"], 0, 0])
        c[1] += tok
        c[2] += len(r["text"]) if isinstance(r["text"], str) else 0
    return [(o, t, n) for o, t, n in out.values() if n >= min_chars]


def measure(thread: LiveThread, min_chars: int) -> Measure:
    """The Measure of the thread's pending call over `thread.blocks`: tokens as
    ctxreplay.pipeline.stageapi.calls.request_tokens counts them, the latest real user message as
    ctxreplay.pipeline.stageapi.calls.messages finds it, what was cleared as the walk reads it
    (part 0 of a result replaced by the placeholder)."""
    t = thread.blocks.lazy().with_columns(_tok=thread.row_tokens())
    call = thread.call
    # one query: the latest real user message's order, the request's tokens (LiveThread.request_tokens:
    # its rows' and an overhead per message it holds), and the results still clearable
    seen = (pl.col("first_call") <= call) & (pl.col("last_call").is_null() | (pl.col("last_call") > call))
    held = (pl.col("first") <= call) & (pl.col("last").is_null() | (pl.col("last") > call))
    msgs = t.group_by("msg_key").agg(
        order=pl.col("order_key").min(), first=pl.col("first_call").min(), last=open_max("last_call"),
        real=(pl.col("role").first() == "user") & ~(pl.col("block_type") == "tool_result").any()
        & (pl.col("origin").first() != "snip"))
    u = pl.concat([
        msgs.select(u=pl.col("order").filter(pl.col("real") & (pl.col("first") <= call)).max(),
                    n=held.sum().cast(pl.Int64)),
        t.select(rows=pl.col("_tok").filter(seen).sum().cast(pl.Int64))], how="horizontal")
    # (every version of a result: its tokens and size are upper bounds of what clearing it frees)
    res = t.filter(pl.col("block_type") == "tool_result").group_by("entry_id", "block_pos").agg(
        **_result_facts(), tok=pl.col("_tok").sum(),
        size=pl.col("text").str.len_chars().fill_null(0).sum(), img=is_image_expr().fill_null(False).any(),
    ).with_columns(done=pl.col("done_call").is_not_null())
    own = pl.col("done") & ~_native()
    frontier = pl.col("order").filter(own).max()  # null: nothing cleared by this stage yet
    res = res.filter(~pl.col("done") & ((pl.col("size") >= min_chars) | pl.col("img"))
                     & (frontier.is_null() | (pl.col("order") >= frontier))).select("order", "tok")
    u_df, res_df = pl.collect_all([u, res], engine=POLARS_ENGINE)
    u_order, n_msgs, n_rows = u_df.row(0)
    tokens = int(n_rows or 0) + MESSAGE_OVERHEAD_TOKENS * int(n_msgs or 0)
    if u_order is None:  # no real user message yet: every clearable result is after it
        return Measure(tokens, None, (0, 0), (res_df.height, int(res_df.get_column("tok").sum())))
    u_order = int(u_order)
    early, late = pl.col("order") < u_order, pl.col("order") >= u_order
    n1, t1, n2, t2 = res_df.select(early.sum(), pl.col("tok").filter(early).sum().alias("t1"),
                                   late.sum().alias("n2"), pl.col("tok").filter(late).sum().alias("t2")).row(0)
    return Measure(tokens, u_order, (int(n1), int(t1)), (int(n2), int(t2)))


def _idle(p: Tombstone, new: LiveRows) -> str | None:
    """The idle trigger at the new calls: the last message of a call's new rows against the answer
    that starts the call (ms; quiet only below the threshold, whatever the rounding)."""
    if p.trigger_idle_seconds <= 0:
        return None
    limit_ms = max(p.trigger_idle_seconds, 1) * 1000
    by_call: dict[int, list[dict[str, Any]]] = {}
    for msg in new.messages:
        by_call.setdefault(msg[0]["first_call"], []).append(msg[0])
    for heads in by_call.values():
        asst = [m for m in heads if m["role"] == "assistant"]
        t_req, t_asst = heads[-1]["timestamp"], asst[-1]["timestamp"] if asst else None
        if t_req is None or t_asst is None:
            return "a message without timestamp (tombstone's idle trigger)"
        if (t_req - t_asst).total_seconds() * 1000 >= limit_ms:
            return "a request an idle period after the last answer (tombstone's idle trigger)"
    return None


def live_start(thread: LiveThread, params: Tombstone, ctx: StageContext) -> Measure:
    """The live rule carries the Measure of the pending call over the blocks this position left
    (measured once for snip's dry run and this position, when they see the same rows)."""
    return thread.measured(f"tombstone.measure@{params.min_result_chars}",
                           lambda: measure(thread, params.min_result_chars))


def live_step(m: Measure, new: LiveRows, p: Tombstone, ctx: StageContext) -> Live:
    """Quiet while no result is clearable outside the current tool loop; else unless the idle
    trigger fires, or the token trigger with enough to clear (clear_at_least_tokens)."""
    after = m.grown(new, p.min_result_chars)
    if after.before[0] == 0:
        return Live.quiet(after)  # no result outside the current tool loop: nothing to clear, no trigger fires
    idle = _idle(p, new)
    if idle:
        return Live.full_pass(idle)
    if p.trigger_tokens > 0 and after.tokens > p.trigger_tokens and (
            p.clear_tool_inputs or after.before[1] >= p.clear_at_least_tokens):
        return Live.full_pass("the request passes tombstone's trigger_tokens with enough to clear")
    return Live.quiet(after)


def forced(params: Tombstone) -> Tombstone:
    """A forced compaction (`Engine.compact(force=True)`): the triggers at their minimum, so that every
    eligible old tool result is cleared now."""
    return dataclasses.replace(params, trigger_tokens=1, clear_at_least_tokens=0)


def quiet_check(blocks: pl.LazyFrame, params: Tombstone, ctx: StageContext) -> pl.LazyFrame:
    """Nothing to do (ctxreplay.pipeline.stageapi.quiet): no result cleared already, and in every
    thread either no result could ever be eligible or no trigger can fire. A firing needs both.

    Eligible needs a result long enough (its text, all versions and parts, at least
    min_result_chars) or holding an image, outside the current tool loop: before the latest real
    user message (a user message without a tool result) that its call sees; so no such result
    before the thread's last user row means none is ever eligible. No trigger: every request
    within trigger_tokens (bounded: ctxreplay.pipeline.stageapi.quiet.request_tokens_max) and no
    two of its rows trigger_idle_seconds apart. A plan of one value per thread."""
    result = (pl.col("block_type") == "tool_result").fill_null(False)
    size = pl.when(result).then(pl.col("text").str.len_chars()).otherwise(0).fill_null(0).cast(pl.Int64).sum()
    image = (result & is_image_expr().fill_null(False)).any()
    # per row: a cleared result, a result that could be eligible (per block), a real user row (per message)
    rows = blocks.select(
        *THREAD, "order_key", "timestamp",
        _cleared=(result & (pl.col("part_pos") == 0) & (pl.col("text") == CLEARED)).fill_null(False),
        _cand=result & ((size.over(BLOCK_KEY) >= params.min_result_chars) | image.over(BLOCK_KEY)),
        _user=(pl.col("role") == "user").fill_null(False) & ~result.any().over([*THREAD, "msg_key"]))
    last_user = pl.when("_user").then(pl.col("order_key")).max()
    idle_calm = pl.lit(True)
    if params.trigger_idle_seconds > 0:
        span = (pl.col("timestamp").max() - pl.col("timestamp").min()).dt.total_seconds()
        idle_calm = (span < max(params.trigger_idle_seconds, 1)).fill_null(True)
    per = rows.group_by(THREAD).agg(
        _nd=~pl.col("_cleared").any(),
        _il=~(pl.col("_cand") & (pl.col("order_key") < last_user)).fill_null(False).any(),
        _ic=idle_calm)
    calm = pl.col("_ic")
    if params.trigger_tokens > 0:
        per = per.join(request_tokens_max(blocks, ctx), on=THREAD, how="left", nulls_equal=True)
        calm = calm & (pl.col("tokens") <= params.trigger_tokens).fill_null(False)
    return per.select(_q=pl.col("_nd") & (pl.col("_il") | calm))


@stage("tombstone", version=1, params=Tombstone, requires=("pairing",),
       frozen=("tombstone", "clear_input", "replace", "drop"), live=LiveRule(live_start, live_step), compact=forced,
       quiet=Quiet(quiet_check))
def tombstone(blocks: pl.LazyFrame, params: Tombstone, ledger: pl.LazyFrame, ctx: StageContext) -> StageResult:
    """Clear the content of old tool results; ids, names, positions and is_error stay.

    Fires on the token trigger (oldest first, only when the batch frees `clear_at_least_tokens`)
    or the idle trigger (transcript timestamps; clears every eligible result). Eligible: results
    whose tool passes `tools.allow` / `tools.deny`, not pinned, at least `min_result_chars`, not in
    the current tool loop, not among the `keep_recent` newest. A cleared result's content becomes
    one text block `[Old tool result content cleared]` from the firing's call on (decision
    `tombstone`, reason `token` or `idle`); optionally its call's input becomes `{}`
    (`clear_input`) and old thinking is removed. Each firing takes a new cache epoch. Frozen: the
    runner re-applies the ledger's decisions first; a result whose recorded clearing no longer
    matches its content (a `conflict` in the ledger view) is cleared afresh from the same call and
    in the same epoch (the position in time is what was decided); only later calls are decided.
    """
    redo = conflicted(ledger, "tombstone").filter(pl.col("part_pos") == 0).select(
        *THREAD, "entry_id", "block_pos", kind=pl.lit("result"), clear_call="from_call",
        epoch=pl.col("cache_epoch").cast(pl.Int32), reason="reason")
    return plan(blocks, params, ctx, forced=redo)
