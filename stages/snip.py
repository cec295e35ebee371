"""L5b snip: remove whole old turns when the request passes the high watermark (layer-semantics §8).

Time in the blocks table: call k's request = the versions with first_call <= k < last_call. The
per-call quantities (request tokens, latest user row, request time) are built columnar from
first_call / last_call deltas (pipeline.calls); the watermark walk itself is a forward scan over
the calls of one thread (its state, the snip frontier, only moves forward), run inside
`map_batches`: linear in calls plus the rows it removes.
"""

from __future__ import annotations

import re
from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import polars as pl

from pipeline.blockops import (
    BLOCK_SCHEMA,
    block_json_expr,
    content_len_expr,
    decisions_from,
    drop_where,
    empty_decisions,
    new_rows,
    rehash,
    synthetic_id_expr,
)
from pipeline.calls import (
    MESSAGE_OVERHEAD_TOKENS,
    NO_CALL,
    PART_KEY,
    THREAD,
    VERSION_KEY,
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
    visible_at,
    with_epoch,
)
from pipeline.registry import StageContext, StageResult, stage
from schemas.blocks import BLOCKS as _BLOCKS_ARROW
from schemas.check import conform
from stages.tombstone import Tombstone
from stages.tombstone import plan as tombstone_plan

SNIP_TEMPLATE = "[Earlier conversation snipped: {n} messages (~{t} tokens) removed to fit the context budget]"
SNIP_RE = re.compile(r"^\[Earlier conversation snipped: (\d+) messages \(~(\d+) tokens\) removed to fit the context budget\]$")


def tombstone_params_from(ctx: StageContext) -> Tombstone | None:
    """The tombstone params snip dry-runs with: ctx.extra["tombstone"] (params, a dict, or None /
    false = no tombstone stage in the pipeline); absent: the documented defaults."""
    if "tombstone" not in ctx.extra:
        return Tombstone()
    value = ctx.extra["tombstone"]
    if value is None or value is False:
        return None
    if isinstance(value, Tombstone):
        return value
    return Tombstone(**dict(value))


# ---------------------------------------------------------------------------------------------
# the snip stage


@dataclass(frozen=True, slots=True, kw_only=True)
class Snip:
    enabled: bool = True
    """Turn the watermark snip on or off."""
    reserve_output_tokens: int = 20_000
    """Tokens kept free for the answer; the budget is window_tokens minus this."""
    high_watermark: float = 0.80
    """Snip when the estimated request (after a dry run of tombstone) exceeds this share of the budget."""
    low_watermark: float = 0.60
    """Snip whole turns, oldest first, until the request is at or under this share of the budget."""
    min_tail_turns: int = 4
    """The newest turns that are never snipped (the current tool loop is always kept)."""
    keep_head_turns: int = 1
    """The first turns that are never snipped (at least 1: the first user turn stays)."""

    def validate(self) -> None:
        if not 0 < self.low_watermark <= self.high_watermark <= 1:
            raise ValueError(f"need 0 < low_watermark <= high_watermark <= 1; got {self.low_watermark} "
                             f"and {self.high_watermark}")
        if self.keep_head_turns < 1:
            raise ValueError("keep_head_turns must be at least 1: the first user turn is never snipped")
        if self.min_tail_turns < 0 or self.reserve_output_tokens < 0:
            raise ValueError("min_tail_turns and reserve_output_tokens must not be negative")


_FIRING_SCHEMA = {"session_id": pl.String, "thread_id": pl.String, "call": pl.Int32, "frontier": pl.Int64,
                  "n": pl.Int64, "t": pl.Int64, "epoch": pl.Int32}


def _snip_scan(df: pl.DataFrame, *, head: int, min_tail: int, hi: float, lo: float,
               marker_cost: Callable[[str], int]) -> pl.DataFrame:
    """Walk the calls of each thread forward; one output row per firing: the call, the new
    frontier (first turn not snipped), cumulative messages / tokens removed, and the cache epoch.

    Input rows, by `kind`: `call` (call, tokens after the tombstone dry run, cur_turn, comp_turn,
    ep), `row` (a snippable block or message overhead: turn, first, last, tok, is_msg) and at most
    one `state` (the frozen snip already in the input: call, frontier, n, t, epoch, text).
    `marker_cost(text)`: tokens of a marker message with that text (the request counts it).
    Cost: O(calls) plus, per firing, the rows of the turns it looks at (bounded by the window).
    """
    out: dict[str, list[Any]] = {k: [] for k in _FIRING_SCHEMA}
    first_turn = head + 1
    for (sid, tid), part in df.partition_by(THREAD, as_dict=True).items():
        calls = part.filter(pl.col("kind") == "call").sort("call")
        rows = part.filter(pl.col("kind") == "row").sort("turn")
        st = part.filter(pl.col("kind") == "state")
        n_calls = calls.height
        if n_calls == 0:
            continue
        d = calls["tokens"].fill_null(0).to_list()
        cur_turn = calls["cur_turn"].fill_null(0).to_list()
        comp_turn = calls["comp_turn"].fill_null(2**40).to_list()
        ep = calls["ep"].fill_null(0).to_list()
        r_turn = rows["turn"].to_list()
        r_first = rows["first"].to_list()
        r_last = rows["last"].fill_null(NO_CALL).to_list()
        r_tok = rows["tok"].to_list()
        r_msg = rows["is_msg"].to_list()
        frontier, n_tot, t_tot, last_epoch, cur_cost = first_turn, 0, 0, 0, 0
        # a snip already in the input (re-run or re-applied ledger): its versions are replayed as
        # they were made, then the walk goes on after the last one
        frozen = st.sort("call").select("call", "frontier", "n", "t", "epoch", "text").rows() if st.height else []
        start = int(frozen[-1][0]) + 1 if frozen else 0
        si = 0
        delta = [0] * (n_calls + 1)  # changes of the removed tokens, per call (forward only)
        removed = 0
        for k in range(n_calls):
            removed += delta[k]
            if si < len(frozen) and int(frozen[si][0]) == k:
                _, fr_front, fr_n, fr_t, fr_epoch, fr_text = frozen[si]
                si += 1
                new_frontier = max(frontier, int(fr_front))
                a, c = bisect_left(r_turn, frontier), bisect_left(r_turn, new_frontier)
                for x in range(a, c):
                    f0, l0 = max(r_first[x], k), min(r_last[x], n_calls)
                    if f0 < l0:
                        delta[f0] += r_tok[x]
                        delta[l0] -= r_tok[x]
                removed += delta[k]
                delta[k] = 0
                new_cost = marker_cost(str(fr_text))
                removed -= new_cost - cur_cost
                cur_cost, frontier = new_cost, new_frontier
                n_tot, t_tot, last_epoch = int(fr_n), int(fr_t), int(fr_epoch)
                continue
            if k < start:
                continue
            total = d[k] - removed
            if total <= hi:
                continue
            protect = min(cur_turn[k] - max(min_tail, 1) + 1, comp_turn[k])
            if protect <= frontier:
                continue  # protected rows alone are over the budget: never snip into them
            a, b = bisect_left(r_turn, frontier), bisect_left(r_turn, protect)
            per_turn = [0] * (protect - frontier)
            for x in range(a, b):
                if r_first[x] <= k < r_last[x]:
                    per_turn[r_turn[x] - frontier] += r_tok[x]
            if not any(per_turn):
                continue
            guess = marker_cost(SNIP_TEMPLATE.format(n=n_tot + 99, t=t_tot + 99_999)) - cur_cost
            cum = list(accumulate(per_turn))
            j = min(bisect_left(cum, total + guess - lo), len(cum) - 1)
            new_frontier = frontier + j + 1
            c = bisect_left(r_turn, new_frontier, a, b)
            t_add = n_add = 0
            for x in range(a, c):
                f0, l0 = max(r_first[x], k), min(r_last[x], n_calls)
                if f0 < l0:  # from call k on, the rows of these turns are gone
                    delta[f0] += r_tok[x]
                    delta[l0] -= r_tok[x]
                if r_first[x] <= k < r_last[x]:
                    t_add += r_tok[x]
                    n_add += int(r_msg[x])
            removed += delta[k]
            delta[k] = 0
            n_tot, t_tot = n_tot + n_add, t_tot + t_add
            new_cost = marker_cost(SNIP_TEMPLATE.format(n=n_tot, t=t_tot))
            removed -= new_cost - cur_cost  # the marker (or its new version) is in the request from k on
            cur_cost = new_cost
            epoch = firing_epoch(k, ep, last_epoch)
            for key, v in zip(_FIRING_SCHEMA, (sid, tid, k, new_frontier, n_tot, t_tot, epoch)):
                out[key].append(v)
            frontier, last_epoch = new_frontier, epoch
    return pl.DataFrame(out, schema=_FIRING_SCHEMA)


def _marker_rows(anchors: pl.LazyFrame, versions: pl.LazyFrame) -> pl.LazyFrame:
    """Marker block versions: `anchors` = the first snipped row of each thread (a blocks row),
    `versions` = THREAD, first_call, last_call, text, cache_epoch."""
    a = anchors.drop("first_call", "last_call", "text", "cache_epoch")
    rows = a.join(versions, on=THREAD, how="inner").with_columns(
        _marker_id=synthetic_id_expr("snip", "marker", pl.col("thread_id"), 0))
    rows = new_rows(
        rows,
        keep=("session_id", "thread_id", "source_format", "source_file", "source_line", "entry_order", "first_call",
              "last_call", "text", "timestamp", "is_sidechain", "cache_epoch"),
        entry_id=pl.col("_marker_id"), msg_key=pl.col("_marker_id"), raw_line=pl.lit(""), role=pl.lit("user"),
        is_call=pl.lit(False), block_pos=pl.lit(0, pl.Int32), part_pos=pl.lit(0, pl.Int32), block_type=pl.lit("text"),
        is_meta=pl.lit(False), is_compact_summary=pl.lit(False), is_display_only=pl.lit(False),
        order_key=pl.col("order_key") - 1, origin=pl.lit("snip"), content_sha256=pl.lit(""),
    )
    return conform(rehash(rows), _BLOCKS_ARROW)


def _marker_decisions(rows: pl.LazyFrame, prior: pl.LazyFrame | None = None) -> pl.LazyFrame:
    """One decision per marker version: `insert` for the first, `replace` for each extension."""
    r = rows.sort([*THREAD, "first_call"]).with_columns(
        _prev=pl.col("content_sha256").shift(1).over(THREAD, order_by="first_call"),
        _prev_len=content_len_expr().shift(1).over(THREAD, order_by="first_call"),
    )
    if prior is not None:  # the open version of a marker already in the input precedes these
        r = r.join(prior, on=THREAD, how="left").with_columns(
            _prev=pl.coalesce("_prev", "_prior_sha"), _prev_len=pl.coalesce("_prev_len", "_prior_len"))
    return decisions_from(
        r, action=pl.when(pl.col("_prev").is_null()).then(pl.lit("insert")).otherwise(pl.lit("replace")),
        reason="watermark", before_sha256=pl.col("_prev"), after_sha256=pl.col("content_sha256"),
        before_len=pl.col("_prev_len"), after_len=content_len_expr(), replacement=block_json_expr(),
    )


def _snippable(blocks: pl.LazyFrame, msgs: pl.LazyFrame, head: int) -> pl.LazyFrame:
    """Rows that a snip may remove: not system, not a marker, after the protected head turns."""
    return blocks.join(msgs.select(*THREAD, "msg_key", "turn"), on=[*THREAD, "msg_key"], how="left").filter(
        (pl.col("role") != "system") & (pl.col("origin") != "snip") & (pl.col("turn") > head)
    )


def _frozen_state(blocks: pl.LazyFrame, msgs: pl.LazyFrame, head: int) -> tuple[pl.LazyFrame, pl.LazyFrame,
                                                                                pl.LazyFrame]:
    """The snip already in the input (a re-run, or the ledger's snips re-applied).

    Returns (state: one row per marker version: call, frontier = first turn not snipped from that
    call on, n, t, epoch, text; prior: the latest version's sha and length; cut: the version key
    of each row a marker version cut, with the call it was cut at).
    """
    markers = blocks.filter(pl.col("origin") == "snip")
    calls = markers.select(*THREAD, _mcall="first_call", _morder="order_key").unique()
    cut = _snippable(blocks, msgs, head).join(calls, on=THREAD, how="inner").filter(
        (pl.col("last_call") == pl.col("_mcall")) & (pl.col("order_key") > pl.col("_morder")))
    reach = cut.group_by([*THREAD, "_mcall"]).agg(_top=(pl.col("turn").max() + 1).cast(pl.Int64))
    versions = markers.select(*THREAD, call="first_call", text="text", epoch="cache_epoch").join(
        reach, left_on=[*THREAD, "call"], right_on=[*THREAD, "_mcall"], how="left",
    ).with_columns(
        frontier=pl.col("_top").fill_null(head + 1).cum_max().over(THREAD, order_by="call"),
        n=pl.col("text").str.extract(SNIP_RE.pattern, 1).cast(pl.Int64).fill_null(0),
        t=pl.col("text").str.extract(SNIP_RE.pattern, 2).cast(pl.Int64).fill_null(0),
    ).select(*THREAD, kind=pl.lit("state"), call=pl.col("call").cast(pl.Int32), frontier="frontier", n="n", t="t",
             epoch=pl.col("epoch").cast(pl.Int32), text="text")
    by_call = lambda c: pl.col(c).sort_by("first_call").last()
    prior = markers.group_by(THREAD).agg(
        _prior_sha=by_call("content_sha256"), _prior_len=by_call("text").str.len_bytes().cast(pl.Int64))
    return versions, prior, cut.select(*VERSION_KEY).unique()


def _unsnipped(blocks: pl.LazyFrame, cut: pl.LazyFrame) -> pl.LazyFrame:
    """The blocks as they were before any snip: no marker, the rows it cut visible again. The
    tombstone dry run and the token walk see this view, so a run that finds snips already made
    (a resumed or repeated run) measures exactly what a fresh run measured."""
    restored = blocks.join(cut.with_columns(_cut=pl.lit(True)), on=VERSION_KEY, how="left", nulls_equal=True)
    return restored.filter(pl.col("origin") != "snip").with_columns(
        last_call=pl.when(pl.col("_cut").fill_null(False)).then(pl.lit(None, pl.Int32)).otherwise(pl.col("last_call"))
    ).drop("_cut")


def plan(blocks: pl.LazyFrame, params: Snip, ctx: StageContext) -> tuple[pl.LazyFrame, pl.LazyFrame]:
    """The snip itself (no ledger): returns (blocks, decisions)."""
    budget = max(0, ctx.window_tokens - params.reserve_output_tokens)
    hi, lo = params.high_watermark * budget, params.low_watermark * budget
    head = params.keep_head_turns
    tparams = tombstone_params_from(ctx)
    grid = call_grid(blocks)
    msgs = materialize(messages(blocks))
    state, prior, cut = _frozen_state(blocks, msgs, head)
    base = materialize(_unsnipped(blocks, materialize(cut)))
    base_msgs = messages(base)
    dry = materialize(tombstone_plan(base, tparams, ctx)[0]) if tparams is not None else base
    tokens = request_tokens(dry, ctx, grid, messages(dry))

    real = msgs.filter("is_real_user")
    cur_turn = real.group_by([*THREAD, pl.col("first").alias("call")]).agg(cur_turn=pl.col("turn").max())
    comp = msgs.filter("is_compact_summary").group_by([*THREAD, pl.col("first").alias("call")]).agg(
        comp_turn=pl.col("turn").max())
    ep = base.group_by([*THREAD, pl.col("first_call").alias("call")]).agg(ep=pl.col("cache_epoch").max())
    per_call = forward_by_call(cur_turn, grid, ["cur_turn"]).join(
        comp, on=[*THREAD, "call"], how="left").join(ep, on=[*THREAD, "call"], how="left").sort([*THREAD, "call"])
    per_call = per_call.with_columns(
        pl.col("comp_turn").forward_fill().over(THREAD, order_by="call"),
        pl.col("ep").fill_null(0).cum_max().over(THREAD, order_by="call"),
        pl.col("cur_turn").cum_max().over(THREAD, order_by="call"),
    ).join(tokens, on=[*THREAD, "call"], how="left")

    tok_rows = _snippable(dry, msgs, head).select(
        *THREAD, "turn", first="first_call", last="last_call", tok=row_tokens_expr(ctx), is_msg=pl.lit(False))
    msg_rows = base_msgs.join(msgs.select(*THREAD, "msg_key", "turn"), on=[*THREAD, "msg_key"], suffix="_b") \
        .filter((pl.col("role") != "system") & (pl.col("turn") > head)) \
        .select(*THREAD, "turn", "first", "last", tok=pl.lit(MESSAGE_OVERHEAD_TOKENS, pl.Int64), is_msg=pl.lit(True))
    def marker_cost(text: str) -> int:
        return text_tokens([text], ctx)[0] + MESSAGE_OVERHEAD_TOKENS

    scan_in = pl.concat([
        per_call.select(*THREAD, kind=pl.lit("call"), call="call", tokens="tokens", cur_turn="cur_turn",
                        comp_turn="comp_turn", ep="ep"),
        pl.concat([tok_rows, msg_rows]).with_columns(kind=pl.lit("row")),
        state,
    ], how="diagonal_relaxed")
    firings = scan_in.map_batches(
        lambda df: _snip_scan(df, head=head, min_tail=params.min_tail_turns, hi=hi, lo=lo, marker_cost=marker_cost),
        schema=_FIRING_SCHEMA)
    firings = materialize(firings)
    last_state = state.group_by(THREAD).agg(_f0=pl.col("frontier").max())
    firings = firings.sort([*THREAD, "call"]).with_columns(
        lo=pl.col("frontier").shift(1).over(THREAD, order_by="call")).join(
        last_state, on=THREAD, how="left").with_columns(
        lo=pl.coalesce("lo", "_f0", pl.lit(head + 1, pl.Int64))).drop("_f0")

    # the rows each firing removes: turns lo..frontier-1, from the firing's call on
    snippable = _snippable(blocks, msgs, head).select(*VERSION_KEY, "turn").with_columns(
        pl.col("turn").cast(pl.Int64)).sort("turn")
    hit = snippable.join_asof(
        firings.select(*THREAD, "lo", "frontier", _call="call", _epoch="epoch").sort("lo"),
        left_on="turn", right_on="lo", by=THREAD, strategy="backward", check_sortedness=False,
    ).filter(pl.col("turn") < pl.col("frontier")).select(*VERSION_KEY, "_call", "_epoch")
    hit = materialize(hit)
    marked = blocks.join(hit, on=VERSION_KEY, how="left", nulls_equal=True)
    out, dropped = drop_where(marked, pl.col("_call").is_not_null(), reason="watermark", from_call=pl.col("_call"),
                              action="snip")
    out = materialize(out)
    epochs = hit.select(*PART_KEY, from_call=pl.max_horizontal("_call", "first_call").cast(pl.Int32), _epoch="_epoch")
    dropped = with_epoch(dropped, epochs)

    # the marker: one row, a new version per firing; closes the open version of an existing marker
    first_hit = hit.join(blocks.select(*VERSION_KEY, "order_key"), on=VERSION_KEY).group_by(THREAD).agg(
        pl.col(c).sort_by("order_key", "entry_id", "block_pos", "part_pos").first()
        for c in ("first_call", "entry_id", "block_pos", "part_pos"))
    existing = blocks.filter(pl.col("origin") == "snip").group_by(THREAD).agg(
        pl.all().sort_by("first_call").last())
    anchors_new = blocks.join(first_hit, on=[*THREAD, "entry_id", "block_pos", "part_pos", "first_call"], how="semi")
    anchors_new = anchors_new.join(existing.select(THREAD), on=THREAD, how="anti").with_columns(
        pl.col("order_key"))
    anchors = pl.concat([anchors_new.select(BLOCK_SCHEMA.names()),
                         existing.select(BLOCK_SCHEMA.names()).with_columns(order_key=pl.col("order_key") + 1)])
    removed_end = _snippable(blocks, msgs, head).join(hit.select(*VERSION_KEY), on=VERSION_KEY, how="semi") \
        .group_by(THREAD).agg(_end=open_max("last_call"))
    versions = firings.with_columns(
        last_call=pl.col("call").shift(-1).over(THREAD, order_by="call"),
        text=pl.format("[Earlier conversation snipped: {} messages (~{} tokens) removed to fit the context budget]",
                       "n", "t"),
    ).join(removed_end, on=THREAD, how="left").with_columns(
        last_call=pl.coalesce("last_call", pl.when(pl.col("_end") > pl.col("call")).then(pl.col("_end")))
        .cast(pl.Int32),
    ).select(*THREAD, first_call="call", last_call="last_call", text="text", cache_epoch="epoch")
    new_markers = _marker_rows(anchors, versions)
    marker_dec = _marker_decisions(new_markers, prior)
    first_new = versions.group_by(THREAD).agg(_close=pl.col("first_call").min())
    # the marker version in force when the range grows again ends there
    closing = (pl.col("origin") == "snip") & pl.col("_close").is_not_null() & (pl.col("first_call") < pl.col("_close")) \
        & (pl.col("last_call").is_null() | (pl.col("last_call") > pl.col("_close")))
    out = out.join(first_new, on=THREAD, how="left").with_columns(
        last_call=pl.when(closing).then(pl.col("_close")).otherwise(pl.col("last_call"))).drop("_close")
    cols = list(BLOCK_SCHEMA.names())
    out = pl.concat([out.select(cols), new_markers.select(cols)])
    return materialize(out), materialize(pl.concat([dropped, marker_dec]))


def _ledger_markers(before: pl.LazyFrame, after: pl.LazyFrame, ledger: pl.LazyFrame) -> tuple[pl.LazyFrame, pl.LazyFrame]:
    """Rebuild the marker versions this stage recorded in the ledger (insert / replace decisions),
    anchored at the first row its recorded snips removed. Returns (blocks, marker decisions)."""
    led = ledger.filter(pl.col("action").is_in(["insert", "replace"]) & pl.col("replacement").is_not_null())
    snips = ledger.filter(pl.col("action") == "snip").select(*PART_KEY, "from_call")
    targets = before.join(snips, on=PART_KEY, how="inner").filter(visible_at("from_call"))
    anchors = targets.group_by(THREAD).agg(pl.all().sort_by("order_key", "entry_id", "block_pos", "part_pos").first()) \
        .select(BLOCK_SCHEMA.names())
    anchors = anchors.join(before.filter(pl.col("origin") == "snip").select(THREAD).unique(), on=THREAD, how="anti")
    end = targets.group_by(THREAD).agg(_end=open_max("last_call"))
    versions = led.sort("from_call").select(
        *THREAD, first_call="from_call", cache_epoch="cache_epoch",
        text=pl.col("replacement").str.json_decode(pl.Struct({"text": pl.String})).struct.field("text"),
    ).with_columns(last_call=pl.col("first_call").shift(-1).over(THREAD, order_by="first_call")).join(end, on=THREAD, how="left") \
        .with_columns(last_call=pl.coalesce("last_call", pl.when(pl.col("_end") > pl.col("first_call"))
                                            .then(pl.col("_end"))).cast(pl.Int32)).drop("_end")
    rows = _marker_rows(anchors, versions)
    cols = list(BLOCK_SCHEMA.names())
    return pl.concat([after.select(cols), rows.select(cols)]), _marker_decisions(rows)


@stage("snip", version=1, params=Snip)
def snip(blocks: pl.LazyFrame, params: Snip, ledger: pl.LazyFrame, ctx: StageContext) -> StageResult:
    """Remove whole old middle turns when the request passes the high watermark.

    Judged per call on the estimated request tokens after a dry run of tombstone; removes turns
    oldest first (after the protected head, before the protected tail, the current tool loop and
    the latest compaction summary) until the request is at or under the low watermark. The removed
    rows get a `snip` decision from that call on; one user-role marker row (origin `snip`) stands
    for the whole range, a new version of it (`insert`, then `replace`) each time the range grows.
    Each firing takes a new cache epoch. Frozen: the ledger's snips are re-applied first (a changed
    row is still removed, and a `conflict` recorded); only later calls are decided afresh.
    """
    if not params.enabled:
        return StageResult(blocks, empty_decisions())
    blocks = before = materialize(blocks)
    blocks, reapplied = reapply_ledger(blocks, ledger, actions=("snip",), apply_on_mismatch=True)
    blocks, marker_dec = _ledger_markers(before, blocks, ledger)
    blocks = materialize(blocks)
    out, decisions = plan(blocks, params, ctx)
    return StageResult(out, pl.concat([reapplied, marker_dec, decisions]))
