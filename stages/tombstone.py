"""L6 tombstone: clear the content of old tool results, keep ids, names and positions (layer-semantics §9).

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
from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from itertools import accumulate
from typing import Any, Literal

import polars as pl

from pipeline.blockops import BLOCK_SCHEMA, drop_where, replace_where
from pipeline.calls import (
    BLOCK_KEY,
    NO_CALL,
    PART_KEY,
    THINKING_TYPES,
    THREAD,
    TOOL_CALL_TYPES,
    call_grid,
    firing_epoch,
    forward_by_call,
    materialize,
    messages,
    open_max,
    reapply_ledger,
    request_tokens,
    row_tokens_expr,
    text_tokens,
    with_epoch,
)
from pipeline.registry import StageContext, StageResult, stage
from pipeline.tokens import is_image_expr, tokens_expr

CLEARED = "[Old tool result content cleared]"
REASONING_OMITTED = "[assistant reasoning omitted]"


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

_ASSIGN_SCHEMA = {"session_id": pl.String, "thread_id": pl.String, "kind": pl.String, "entry_id": pl.String,
                  "block_pos": pl.Int32, "clear_call": pl.Int32, "epoch": pl.Int32, "reason": pl.String}


class _Fenwick:
    """Prefix sums with point updates (non-negative values), O(log n) each."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.tree = [0] * (n + 1)

    def add(self, i: int, v: int) -> None:
        i += 1
        while i <= self.n:
            self.tree[i] += v
            i += i & -i

    def prefix(self, i: int) -> int:
        """Sum of items 0..i-1."""
        total = 0
        while i > 0:
            total += self.tree[i]
            i -= i & -i
        return total

    def lower_bound(self, target: int) -> int:
        """The smallest i with prefix(i) >= target (n + 1 when there is none)."""
        if target <= 0:
            return 0
        pos, rem, step = 0, target, 1 << self.n.bit_length()
        while step:
            nxt = pos + step
            if nxt <= self.n and self.tree[nxt] < rem:
                pos, rem = nxt, rem - self.tree[nxt]
            step >>= 1
        return pos + 1


def _free_from(delta: list[int], k: int, v: int, end: int) -> int:
    """Count v tokens freed from call k (now) until call `end`; returns what applies at k."""
    if end <= k:
        return 0
    if end < len(delta) - 1:
        delta[end] -= v
    return v


def _scan(df: pl.DataFrame, p: Tombstone) -> pl.DataFrame:
    """Walk the calls of each thread; return the call, epoch and reason at which each result (and,
    with `clear_thinking_keep`, each thinking block) is cleared.

    Input rows by `kind`: `call` (tokens, u_order, cur_turn, ep, idle), `result` (order, a = first
    call, z = end, s = tokens freed, done / native / done_call / done_epoch) and `think` (order, a,
    z, turn, s, last). Results below the frontier and thinking below its own frontier are cleared;
    both frontiers only move forward. The tokens already freed are tracked exactly per call (a row
    can leave the request in the middle, by a snip or a compaction), and a Fenwick tree over the
    visible, not yet cleared results answers "how much would clearing up to i free".
    O((calls + results) log results).
    """
    out: dict[str, list[Any]] = {k: [] for k in _ASSIGN_SCHEMA}
    keep_n = None if p.clear_thinking_keep == "all" else int(p.clear_thinking_keep)

    for (sid, tid), part in df.partition_by(THREAD, as_dict=True).items():
        calls = part.filter(pl.col("kind") == "call").sort("call")
        res = part.filter(pl.col("kind") == "result").sort("order", "entry_id", "block_pos")
        th = part.filter(pl.col("kind") == "think").sort("order", "entry_id", "block_pos")
        if "turn" not in th.columns:  # no thinking rows were passed (clear_thinking_keep = "all")
            th = pl.DataFrame(schema={"entry_id": pl.String, "block_pos": pl.Int32, "order": pl.Int64, "a": pl.Int32,
                                      "turn": pl.Int32, "z": pl.Int32, "last": pl.Int32, "s": pl.Int64})
        n, m = calls.height, res.height
        if n == 0 or m == 0:
            continue
        tok = calls["tokens"].fill_null(0).to_list()
        u = calls["u_order"].fill_null(-(2**62)).to_list()
        cur_turn = calls["cur_turn"].fill_null(0).to_list()
        ep = calls["ep"].fill_null(0).to_list()
        idle = calls["idle"].fill_null(False).to_list()
        order = res["order"].to_list()
        a = res["a"].to_list()
        z = res["z"].fill_null(NO_CALL).to_list()
        done = res["done"].to_list()
        native = res["native"].to_list()
        s = [0 if dn else int(x or 0) for x, dn in zip(res["s"].to_list(), done)]
        cnt = [0, *accumulate(0 if dn else 1 for dn in done)]
        a_sorted = sorted(a)

        f, hf, start, last_epoch = 0, 0, 0, 0
        frozen = [i for i, (dn, nat) in enumerate(zip(done, native)) if dn and not nat]
        frozen_calls: set[int] = set()
        if frozen:  # clearing already in the input (re-run or re-applied ledger): go on after it
            dc, de = res["done_call"].to_list(), res["done_epoch"].to_list()
            f = max(frozen) + 1
            frozen_calls = {int(dc[i]) for i in frozen}
            start = max(frozen_calls) + 1
            last_epoch = max(int(de[i]) for i in frozen)
        # thinking: a prefix (in order) is cleared; turn and first call grow with order
        th_order, th_a, th_turn = th["order"].to_list(), th["a"].to_list(), th["turn"].to_list()
        th_z = th["z"].fill_null(NO_CALL).to_list()
        th_done = [lst is not None and int(lst) in frozen_calls for lst in th["last"].to_list()]
        th_s = [0 if dn else int(x or 0) for x, dn in zip(th["s"].to_list(), th_done)]
        th_a_sorted, th_turn_sorted = sorted(th_a), sorted(th_turn)
        if any(th_done):
            hf = max(i for i, dn in enumerate(th_done) if dn) + 1

        fen = _Fenwick(m)  # savings of the results visible now and not cleared
        appear = sorted((a[i], i) for i in range(m) if not done[i])
        leave = sorted((z[i], i) for i in range(m) if not done[i] and z[i] < NO_CALL)
        in_fen = [False] * m
        cleared = [False] * m
        waiting: list[int] = []  # below the frontier but not yet in any request
        delta = [0] * (n + 1)  # changes of the tokens freed so far, per call
        saved = ai = li = 0

        fire_k: list[int] = []
        fire_f: list[int] = []
        fire_e: list[int] = []
        fire_r: list[str] = []
        for k in range(n):
            saved += delta[k]
            while ai < len(appear) and appear[ai][0] <= k:
                i = appear[ai][1]
                ai += 1
                if z[i] > k and not cleared[i]:
                    fen.add(i, s[i])
                    in_fen[i] = True
            while li < len(leave) and leave[li][0] <= k:
                i = leave[li][1]
                li += 1
                if in_fen[i]:
                    fen.add(i, -s[i])
                    in_fen[i] = False
            if k < start:
                continue
            seen = bisect_right(a_sorted, k)
            e = max(0, min(seen - p.keep_recent, bisect_left(order, u[k])))
            ready = [i for i in waiting if a[i] <= k]
            if (e <= f or cnt[e] == cnt[f]) and not ready:
                continue
            nf = f
            if e > f and cnt[e] > cnt[f]:
                if p.trigger_idle_seconds > 0 and idle[k]:
                    nf, reason = e, "idle"
                elif p.trigger_tokens > 0 and tok[k] - saved > p.trigger_tokens:
                    total = tok[k] - saved
                    base = fen.prefix(f)
                    if fen.prefix(e) - base >= p.clear_at_least_tokens:
                        need = max(p.clear_at_least_tokens, total - p.trigger_tokens)
                        nf, reason = min(max(fen.lower_bound(base + need), f + 1), e), "token"
            if nf == f or cnt[nf] == cnt[f]:
                continue
            epoch = firing_epoch(k, ep, last_epoch)
            fire_k.append(k), fire_f.append(nf), fire_e.append(epoch), fire_r.append(reason)
            for i in [*range(f, nf), *ready]:
                if done[i] or cleared[i]:
                    continue
                if a[i] > k:
                    waiting.append(i)
                    continue
                cleared[i] = True
                if in_fen[i]:
                    fen.add(i, -s[i])
                    in_fen[i] = False
                saved += _free_from(delta, k, s[i], min(z[i], n))
            waiting = [i for i in waiting if not cleared[i]]
            if keep_n is not None:
                new_hf = max(hf, min(bisect_right(th_turn_sorted, cur_turn[k] - keep_n), bisect_left(th_order, u[k]),
                                     bisect_right(th_a_sorted, k)))
                for x in range(hf, new_hf):
                    if not th_done[x] and th_a[x] <= k:
                        saved += _free_from(delta, k, th_s[x], min(th_z[x], n))
                hf = new_hf
            f, last_epoch = nf, epoch
        if not fire_k:
            continue
        # each result: the first firing at or after its first appearance whose frontier passes it
        found: list[tuple[str, Any, Any, int, str]] = []
        eids, bpos = res["entry_id"].to_list(), res["block_pos"].to_list()
        for i in range(m):
            if done[i]:
                continue
            j = max(bisect_left(fire_k, a[i]), bisect_right(fire_f, i))
            if j < len(fire_k) and fire_k[j] < z[i]:
                found.append(("result", eids[i], bpos[i], j, fire_r[j]))
        turn_limit = [cur_turn[k] - (keep_n or 0) for k in fire_k]
        u_at = [u[k] for k in fire_k]
        for x, (eid, bp) in enumerate(zip(th["entry_id"].to_list(), th["block_pos"].to_list())):
            if th_done[x] or keep_n is None:
                continue
            j = max(bisect_left(fire_k, th_a[x]), bisect_left(turn_limit, th_turn[x]), bisect_right(u_at, th_order[x]))
            if j < len(fire_k) and fire_k[j] < th_z[x]:
                found.append(("think", eid, bp, j, "clear_thinking"))
        for kind, eid, bp, j, reason in found:
            for key, v in zip(_ASSIGN_SCHEMA, (sid, tid, kind, eid, bp, fire_k[j], fire_e[j], reason)):
                out[key].append(v)
    return pl.DataFrame(out, schema=_ASSIGN_SCHEMA)


# ---------------------------------------------------------------------------------------------
# plan and stage


def _call_owners(blocks: pl.LazyFrame, ctx: StageContext) -> pl.LazyFrame:
    """For each tool result: its tool call block (the latest earlier call with that id), the call's
    tool name (results often carry none) and the tokens that clearing the call's input would free."""
    results = blocks.filter((pl.col("block_type") == "tool_result") & pl.col("tool_use_id").is_not_null()) \
        .group_by(BLOCK_KEY).agg(pl.col("tool_use_id").first(), order_key=pl.col("order_key").min())
    calls = blocks.filter(pl.col("block_type").is_in(list(TOOL_CALL_TYPES)) & pl.col("tool_use_id").is_not_null()) \
        .with_columns(_tok=row_tokens_expr(ctx),
                      _after=tokens_expr(pl.concat_str([pl.col("tool_name"), pl.lit("{}")], separator=" ",
                                                       ignore_nulls=True), ctx.count_tokens)) \
        .group_by(BLOCK_KEY).agg(
            pl.col("tool_use_id").sort_by("first_call").first(), _use_order=pl.col("order_key").min(),
            _use_name=pl.col("tool_name").sort_by("first_call").first(),
            _in_saved=(pl.col("_tok").sort_by("first_call").first() - pl.col("_after").sort_by("first_call").first())
            .clip(lower_bound=0))
    return results.sort("order_key").join_asof(
        calls.select(*THREAD, "tool_use_id", "_use_order", "_in_saved", "_use_name", _use_entry="entry_id",
                     _use_pos="block_pos")
        .sort("_use_order"),
        left_on="order_key", right_on="_use_order", by=[*THREAD, "tool_use_id"], strategy="backward",
        check_sortedness=False,
    ).filter(pl.col("_use_entry").is_not_null()).select(*BLOCK_KEY, "_use_entry", "_use_pos", "_in_saved", "_use_name")


def plan(blocks: pl.LazyFrame, params: Tombstone, ctx: StageContext,
         forced: pl.LazyFrame | None = None) -> tuple[pl.LazyFrame, pl.LazyFrame]:
    """The tombstoning itself (no ledger): returns (blocks, decisions). Snip dry-runs it.
    `forced`: clearings decided before (rows of the assignment schema) applied as they are."""
    blocks = materialize(blocks)
    grid = materialize(call_grid(blocks))
    msgs = materialize(messages(blocks))
    tokens = request_tokens(blocks, ctx, grid, msgs)
    cleared_tok, omitted_tok = text_tokens([CLEARED, REASONING_OMITTED], ctx)

    # per call: latest real user row (the current tool loop starts after it), turn, epoch, idle gap
    real = msgs.filter("is_real_user").group_by([*THREAD, pl.col("first").alias("call")]).agg(
        u_order=pl.col("order").max(), cur_turn=pl.col("turn").max())
    req = msgs.group_by([*THREAD, pl.col("first").alias("call")]).agg(
        t_req=pl.col("timestamp").sort_by("order").last())
    asst = msgs.filter(pl.col("role") == "assistant").group_by([*THREAD, pl.col("first").alias("call")]).agg(
        t_asst=pl.col("timestamp").sort_by("order").last())
    ep = blocks.group_by([*THREAD, pl.col("first_call").alias("call")]).agg(ep=pl.col("cache_epoch").max())
    per_call = forward_by_call(real.join(req, on=[*THREAD, "call"], how="full", coalesce=True)
                               .join(asst, on=[*THREAD, "call"], how="full", coalesce=True),
                               grid, ["u_order", "cur_turn", "t_req", "t_asst"])
    per_call = per_call.join(ep, on=[*THREAD, "call"], how="left").join(tokens, on=[*THREAD, "call"], how="left") \
        .sort([*THREAD, "call"]).with_columns(
            pl.col("ep").fill_null(0).cum_max().over(THREAD, order_by="call"),
            pl.col("u_order").cum_max().over(THREAD, order_by="call"),
            pl.col("cur_turn").cum_max().over(THREAD, order_by="call"),
            idle=((pl.col("t_req") - pl.col("t_asst")).dt.total_seconds() >= max(params.trigger_idle_seconds, 1))
            & (params.trigger_idle_seconds > 0),
        )

    # per tool result: first appearance, end, order, size and savings of its first version, state
    rows = blocks.filter(pl.col("block_type") == "tool_result").with_columns(_tok=row_tokens_expr(ctx))
    first_version = rows.filter(pl.col("first_call") == pl.col("first_call").min().over(PART_KEY))
    size = first_version.group_by(BLOCK_KEY).agg(
        size=(pl.when(is_image_expr()).then(pl.col("_tok") * 4)
              .otherwise(pl.col("text").str.len_chars().fill_null(0))).sum(),
        tok=pl.col("_tok").sum(),
    )
    placeholder = rows.filter((pl.col("part_pos") == 0) & (pl.col("text") == CLEARED)).group_by(BLOCK_KEY).agg(
        done_call=pl.col("first_call").min(), done_epoch=pl.col("cache_epoch").sort_by("first_call").first())
    res = rows.group_by(BLOCK_KEY).agg(
        order=pl.col("order_key").min(),
        a=pl.col("first_call").min(),
        z=open_max("last_call"),
        tool_name=pl.col("tool_name").drop_nulls().first(),
        pinned=pl.col("extra_json").fill_null("").str.contains('"pinned":true', literal=True).any(),
    ).join(size, on=BLOCK_KEY, how="left").join(placeholder, on=BLOCK_KEY, how="left").with_columns(
        done=pl.col("done_call").is_not_null(),
    )
    owners = materialize(_call_owners(blocks, ctx))
    res = res.join(owners.select(*BLOCK_KEY, "_in_saved", "_use_name"), on=BLOCK_KEY, how="left").with_columns(
        tool_name=pl.coalesce(pl.col("tool_name").replace("", None), "_use_name"))
    in_saved = pl.col("_in_saved").fill_null(0) if params.clear_tool_inputs else pl.lit(0, pl.Int64)
    res = res.with_columns(
        native=pl.col("done") & (pl.col("done_call") == pl.col("a")) & (pl.col("done_epoch") == 0),
        s=pl.when(pl.col("done")).then(0).otherwise((pl.col("tok") - cleared_tok).clip(lower_bound=0) + in_saved),
    ).filter(
        tool_filter_expr(params) & ~pl.col("pinned") & ((pl.col("size") >= params.min_result_chars) | pl.col("done"))
    )
    parts = [
        per_call.select(*THREAD, kind=pl.lit("call"), call="call", tokens="tokens", u_order="u_order",
                        cur_turn="cur_turn", ep="ep", idle="idle"),
        res.select(*THREAD, "entry_id", "block_pos", "order", "a", "z", "s", "done", "native", "done_call",
                   "done_epoch", kind=pl.lit("result")),
    ]
    if params.clear_thinking_keep != "all":
        think = _thinking(blocks, msgs).with_columns(_tok=row_tokens_expr(ctx)).group_by(BLOCK_KEY).agg(
            order=pl.col("order_key").min(), a=pl.col("first_call").min(), turn=pl.col("turn").min(),
            z=open_max("last_call"),
            last=pl.col("last_call").max(),
            s=(pl.col("_tok").sort_by("first_call").first()
               - pl.when(pl.col("_only").first() & pl.col("_firstb").first()).then(omitted_tok).otherwise(0)),
        )
        parts.append(think.with_columns(kind=pl.lit("think")))
    assign = materialize(pl.concat(parts, how="diagonal_relaxed").map_batches(lambda df: _scan(df, params),
                                                                              schema=_ASSIGN_SCHEMA))
    if forced is not None:
        forced = forced.select(list(_ASSIGN_SCHEMA)).cast(_ASSIGN_SCHEMA)  # type: ignore[arg-type]
        assign = materialize(pl.concat([assign.join(forced, on=BLOCK_KEY, how="anti"), forced]))
    return _apply(blocks, assign, params, owners if params.clear_tool_inputs else None)


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


def _apply(blocks: pl.LazyFrame, assign: pl.LazyFrame, params: Tombstone,
           owners: pl.LazyFrame | None) -> tuple[pl.LazyFrame, pl.LazyFrame]:
    cols = list(BLOCK_SCHEMA.names())
    a = assign.select(*BLOCK_KEY, "kind", _call="clear_call", _epoch="epoch", _reason="reason")
    ra = a.filter(pl.col("kind") == "result").drop("kind")
    marked = blocks.join(ra, on=BLOCK_KEY, how="left")
    is_hit = pl.col("_call").is_not_null() & (pl.col("block_type") == "tool_result")

    def null(c: str) -> pl.Expr:
        return pl.lit(None, BLOCK_SCHEMA[c])

    out, d_clear = replace_where(
        marked, is_hit & (pl.col("part_pos") == 0),
        {"text": pl.lit(CLEARED),
         "part_type": pl.when(pl.col("part_type") == "string").then(pl.lit("string")).otherwise(pl.lit("text")),
         **{c: null(c) for c in ("image_media_type", "image_data", "image_bytes", "image_width", "image_height",
                                 "signature")},
         "cache_epoch": pl.col("_epoch")},
        action="tombstone", reason=pl.col("_reason"), from_call=pl.col("_call"),  # type: ignore[arg-type]
    )
    out = materialize(out).join(ra, on=BLOCK_KEY, how="left")
    out, d_parts = drop_where(out, is_hit & (pl.col("part_pos") > 0), reason=pl.col("_reason"),
                              from_call=pl.col("_call"), action="tombstone")  # type: ignore[arg-type]
    hits = marked.filter(is_hit).select(*PART_KEY, "first_call", "_call", "_epoch")
    epochs = hits.select(*PART_KEY, from_call=pl.max_horizontal("_call", "first_call").cast(pl.Int32), _epoch="_epoch")
    out = materialize(out)
    decisions = [d_clear, with_epoch(d_parts, epochs)]

    if owners is not None:
        owner = ra.join(owners, on=BLOCK_KEY).select(
            *THREAD, entry_id="_use_entry", block_pos="_use_pos", _call2="_call", _epoch2="_epoch")
        m2 = out.join(owner.unique(subset=BLOCK_KEY), on=BLOCK_KEY, how="left")
        out, d_input = replace_where(
            m2, pl.col("_call2").is_not_null() & pl.col("block_type").is_in(list(TOOL_CALL_TYPES)),
            {"tool_input": pl.lit("{}"), "cache_epoch": pl.col("_epoch2")},
            action="clear_input", reason="tombstone", from_call=pl.col("_call2"),
        )
        decisions.append(d_input)
        out = materialize(out)

    if params.clear_thinking_keep != "all":
        th = a.filter(pl.col("kind") == "think").drop("kind")
        hit = pl.col("_call").is_not_null() & pl.col("block_type").is_in(list(THINKING_TYPES))
        # a message left with only thinking keeps one text block saying so (as layer 1 does)
        m3 = out.with_columns(_only=_only_thinking(), _firstb=_first_block()).join(th, on=BLOCK_KEY, how="left")
        th_hits = m3.filter(hit).select(*PART_KEY, "first_call", "_call", "_epoch")
        out, d_t1 = replace_where(
            m3, hit & pl.col("_only") & pl.col("_firstb"),
            {"block_type": pl.lit("text"), "text": pl.lit(REASONING_OMITTED), "signature": null("signature"),
             "cache_epoch": pl.col("_epoch")},
            action="replace", reason="clear_thinking", from_call=pl.col("_call"),
        )
        m4 = materialize(out).join(th.join(m3.filter(hit & pl.col("_only") & pl.col("_firstb"))
                                             .select(BLOCK_KEY).unique(), on=BLOCK_KEY, how="anti"),
                                   on=BLOCK_KEY, how="left")
        out, d_t2 = drop_where(m4, hit, reason="clear_thinking", from_call=pl.col("_call"))
        decisions += [d_t1, with_epoch(d_t2, th_hits.select(
            *PART_KEY, from_call=pl.max_horizontal("_call", "first_call").cast(pl.Int32), _epoch="_epoch"))]
    return materialize(out.select(cols)), materialize(pl.concat(decisions))


@stage("tombstone", version=1, params=Tombstone)
def tombstone(blocks: pl.LazyFrame, params: Tombstone, ledger: pl.LazyFrame, ctx: StageContext) -> StageResult:
    """Clear the content of old tool results; ids, names, positions and is_error stay.

    Fires on the token trigger (oldest first, only when the batch frees `clear_at_least_tokens`)
    or the idle trigger (transcript timestamps; clears every eligible result). Eligible: results
    whose tool passes `tools.allow` / `tools.deny`, not pinned, at least `min_result_chars`, not in
    the current tool loop, not among the `keep_recent` newest. A cleared result's content becomes
    one text block `[Old tool result content cleared]` from the firing's call on (decision
    `tombstone`, reason `token` or `idle`); optionally its call's input becomes `{}`
    (`clear_input`) and old thinking is removed. Each firing takes a new cache epoch. Frozen: the
    ledger's decisions are re-applied first (hash mismatch: `conflict`, decided afresh); only
    calls after them are decided.
    """
    blocks, reapplied = reapply_ledger(materialize(blocks), ledger,
                                       actions=("tombstone", "clear_input", "replace", "drop"))
    # a result whose recorded clearing no longer matches its content is cleared afresh, from the
    # same call and in the same epoch (the position in time is what was decided)
    redo = reapplied.filter((pl.col("action") == "conflict") & (pl.col("reason") == "hash_mismatch")).join(
        ledger.filter(pl.col("action") == "tombstone").select(*PART_KEY, "from_call", _r="reason",
                                                             _e="cache_epoch"),
        on=[*PART_KEY, "from_call"]).filter(pl.col("part_pos") == 0).select(
        *THREAD, "entry_id", "block_pos", kind=pl.lit("result"), clear_call="from_call",
        epoch=pl.col("_e").cast(pl.Int32), reason="_r")
    out, decisions = plan(blocks, params, ctx, forced=redo)
    return StageResult(out, pl.concat([reapplied, decisions]))
