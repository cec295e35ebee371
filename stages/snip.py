"""L5b snip: remove whole old turns when the request passes the high watermark (docs/layers.md).

Time in the blocks table: call k's request = the versions with first_call <= k < last_call. The
per-call quantities (request tokens, latest user row, request time) are built columnar from
first_call / last_call deltas (ctxreplay.pipeline.stageapi.calls); the watermark walk itself is a forward scan over
the calls of one thread (its state, the snip frontier, only moves forward), run inside
`map_batches`: linear in calls plus the rows it removes.
"""

from __future__ import annotations

import functools
import re
from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

import polars as pl

from ctxreplay.pipeline.core.blockops import (
    block_json_expr,
    block_schema,
    content_len_expr,
    decisions_from,
    empty_decisions,
    new_rows,
    rehash,
    sort_blocks,
    synthetic_id_expr,
)
from ctxreplay.pipeline.core.constants import (
    CHARS4_COUNTER,
    CLEARED_TEXT,
    MESSAGE_OVERHEAD_TOKENS,
    NO_CALL,
    PART_KEY,
    POLARS_ENGINE,
    SNIP_MARKER_RE,
    SNIP_MARKER_TEXT,
    THREAD,
    VERSION_KEY,
    chars4_tokens,
    polars_format,
)
from ctxreplay.pipeline.core.tokens import is_image_expr
from ctxreplay.pipeline.stageapi.calls import (
    BLOCK_KEY,
    call_grid,
    firing_epoch,
    forward_by_call,
    materialize,
    messages,
    open_max,
    request_tokens,
    row_tokens_expr,
    text_tokens,
    visible_at,
    walk_parts,
)
from ctxreplay.pipeline.stageapi.live import Live, LiveRows, LiveRule, LiveThread
from ctxreplay.pipeline.stageapi.marks import conflicted, finish, mark_drop, start_marks
from ctxreplay.pipeline.stageapi.quiet import ask, request_tokens_max
from ctxreplay.pipeline.stageapi.registry import Quiet, StageContext, StageResult, stage
from ctxreplay.schemas.blocks import BLOCKS as _BLOCKS_ARROW
from ctxreplay.schemas.check import conform

SNIP_TEMPLATE = SNIP_MARKER_TEXT
SNIP_RE = re.compile(SNIP_MARKER_RE)


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


@functools.cache
def _firing_schema() -> dict[str, Any]:
    return {"session_id": pl.String, "thread_id": pl.String, "call": pl.Int32, "frontier": pl.Int64,
            "n": pl.Int64, "t": pl.Int64, "epoch": pl.Int32}


@dataclass
class _Rows:
    """The snippable rows of one thread (and one message-overhead row per message), by turn."""

    turn: list[int]
    first: list[int]
    last: list[int]
    tok: list[int]
    is_msg: list[bool]

    @classmethod
    def of(cls, rows: pl.DataFrame) -> _Rows:
        return cls(rows["turn"].to_list(), rows["first"].to_list(), rows["last"].to_list(),
                   rows["tok"].to_list(), rows["is_msg"].to_list())


@dataclass
class _SnipWalk:
    """The forward walk over the calls of one thread.

    State: the frontier (the first turn not snipped; it only moves forward), the messages and tokens
    removed so far (the marker's numbers), the epoch of the last firing, the cost of the marker in
    force, and the tokens removed from each call's request (`removed`, exact per call through
    `delta`: a removed row may have left the request later anyway)."""

    calls: pl.DataFrame
    rows: _Rows
    head: int
    min_tail: int
    hi: float
    lo: float
    marker_cost: Callable[[str], int]
    frontier: int = 0
    n_tot: int = 0
    t_tot: int = 0
    last_epoch: int = 0
    cur_cost: int = 0
    removed: int = 0
    delta: list[int] = field(default_factory=list)
    firings: list[tuple[int, int, int, int, int]] = field(default_factory=list)  # call, frontier, n, t, epoch

    def __post_init__(self) -> None:
        c = self.calls
        self.n = c.height
        self.tokens = c["tokens"].to_list()  # (nulls filled: _snip_scan's walk_parts)
        self.cur_turn = c["cur_turn"].to_list()
        self.comp_turn = c["comp_turn"].to_list()
        self.ep = c["ep"].to_list()
        self.frontier = self.head + 1
        self.delta = [0] * (self.n + 1)

    def walk(self, frozen: list[tuple[Any, ...]]) -> None:
        """Replay the frozen versions of the marker at their calls, then decide the later calls."""
        start = int(frozen[-1][0]) + 1 if frozen else 0
        si = 0
        for k in range(self.n):
            self.removed += self.delta[k]
            if si < len(frozen) and int(frozen[si][0]) == k:
                self._replay(k, *frozen[si][1:])
                si += 1
            elif k >= start:
                self._decide(k)

    def _remove_turns(self, k: int, a: int, c: int) -> tuple[int, int]:
        """Rows a..c-1 leave the request from call k on; returns (messages, tokens) they held at k."""
        r = self.rows
        n_add = t_add = 0
        for x in range(a, c):
            f0, l0 = max(r.first[x], k), min(r.last[x], self.n)
            if f0 < l0:
                self.delta[f0] += r.tok[x]
                self.delta[l0] -= r.tok[x]
            if r.first[x] <= k < r.last[x]:
                t_add += r.tok[x]
                n_add += int(r.is_msg[x])
        self.removed += self.delta[k]
        self.delta[k] = 0
        return n_add, t_add

    def _set_marker(self, text: str) -> None:
        """The marker (or its new version) is in the request from this call on."""
        new_cost = self.marker_cost(text)
        self.removed -= new_cost - self.cur_cost
        self.cur_cost = new_cost

    def _replay(self, k: int, frontier: int, n: int, t: int, epoch: int, text: str) -> None:
        """A version of the marker already in the input (a re-run, or the ledger's snips re-applied)."""
        new_frontier = max(self.frontier, int(frontier))
        turn = self.rows.turn
        self._remove_turns(k, bisect_left(turn, self.frontier), bisect_left(turn, new_frontier))
        self._set_marker(str(text))
        self.frontier = new_frontier
        self.n_tot, self.t_tot, self.last_epoch = int(n), int(t), int(epoch)

    def _decide(self, k: int) -> None:
        """Over the high watermark at call k: snip whole turns, oldest first after the frontier and
        before the protected tail, until the request is at or under the low watermark."""
        total = self.tokens[k] - self.removed
        if total <= self.hi:
            return
        protect = min(self.cur_turn[k] - max(self.min_tail, 1) + 1, self.comp_turn[k])
        if protect <= self.frontier:
            return  # protected rows alone are over the budget: never snip into them
        r = self.rows
        a, b = bisect_left(r.turn, self.frontier), bisect_left(r.turn, protect)
        per_turn = [0] * (protect - self.frontier)
        for x in range(a, b):
            if r.first[x] <= k < r.last[x]:
                per_turn[r.turn[x] - self.frontier] += r.tok[x]
        if not any(per_turn):
            return
        guess = self.marker_cost(SNIP_TEMPLATE.format(n=self.n_tot + 99, t=self.t_tot + 99_999)) - self.cur_cost
        cum = list(accumulate(per_turn))
        j = min(bisect_left(cum, total + guess - self.lo), len(cum) - 1)
        new_frontier = self.frontier + j + 1
        n_add, t_add = self._remove_turns(k, a, bisect_left(r.turn, new_frontier, a, b))
        self.n_tot, self.t_tot = self.n_tot + n_add, self.t_tot + t_add
        self._set_marker(SNIP_TEMPLATE.format(n=self.n_tot, t=self.t_tot))
        epoch = firing_epoch(k, self.ep, self.last_epoch)
        self.firings.append((k, new_frontier, self.n_tot, self.t_tot, epoch))
        self.frontier, self.last_epoch = new_frontier, epoch


def _snip_scan(df: pl.DataFrame, *, head: int, min_tail: int, hi: float, lo: float,
               marker_cost: Callable[[str], int]) -> pl.DataFrame:
    """Walk the calls of each thread forward; one output row per firing: the call, the new
    frontier (first turn not snipped), cumulative messages / tokens removed, and the cache epoch.

    Input rows, by `kind`: `call` (call, tokens after the tombstone dry run, cur_turn, comp_turn,
    ep), `row` (a snippable block or message overhead: turn, first, last, tok, is_msg) and at most
    one `state` per marker version (the frozen snip already in the input: call, frontier, n, t,
    epoch, text). `marker_cost(text)`: tokens of a marker message with that text (the request counts it).
    Cost: O(calls) plus, per firing, the rows of the turns it looks at (bounded by the window).
    """
    out: dict[str, list[Any]] = {k: [] for k in _firing_schema()}
    calls_by = walk_parts(df, "call", ["call"], {"tokens": 0, "cur_turn": 0, "comp_turn": 2**40, "ep": 0})
    rows_by = walk_parts(df, "row", ["turn"], {"last": NO_CALL})
    states_by = walk_parts(df, "state", ["call"])
    no_rows = df.clear()
    for (sid, tid), calls in calls_by.items():
        if calls.height == 0:
            continue
        # the marker versions already in the input (one per earlier firing of the thread: a few
        # rows), replayed in call order: each moves the frontier the next call reads
        st = states_by.get((sid, tid))
        frozen = st.select("call", "frontier", "n", "t", "epoch", "text").rows() if st is not None else []
        w = _SnipWalk(calls, _Rows.of(rows_by.get((sid, tid), no_rows)), head, min_tail, hi, lo, marker_cost)
        w.walk(frozen)
        for firing in w.firings:
            for key, v in zip(_firing_schema(), (sid, tid, *firing)):
                out[key].append(v)
    return pl.DataFrame(out, schema=_firing_schema())


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


def plan(blocks: pl.LazyFrame, params: Snip, ctx: StageContext) -> StageResult:
    """The snip itself: measure each call's request (after a dry run of the pipeline's tombstone),
    walk the calls, remove the turns of each firing, keep one marker for the whole range."""
    budget = max(0, ctx.window_tokens - params.reserve_output_tokens)
    head = params.keep_head_turns
    blocks = materialize(blocks)
    msgs = materialize(messages(blocks))
    state, prior, cut = _frozen_state(blocks, msgs, head)
    base = materialize(_unsnipped(blocks, materialize(cut)))
    dry = tombstone_dry_run(base, ctx)

    def marker_cost(text: str) -> int:
        return text_tokens([text], ctx)[0] + MESSAGE_OVERHEAD_TOKENS

    scan_in = pl.concat([_per_call(blocks, msgs, base, dry, ctx), _token_rows(dry, base, msgs, head, ctx), state],
                        how="diagonal_relaxed")
    firings = materialize(scan_in.map_batches(
        lambda df: _snip_scan(df, head=head, min_tail=params.min_tail_turns, hi=params.high_watermark * budget,
                              lo=params.low_watermark * budget, marker_cost=marker_cost),
        schema=_firing_schema()))
    last_state = state.group_by(THREAD).agg(_f0=pl.col("frontier").max())
    firings = firings.sort([*THREAD, "call"]).with_columns(
        lo=pl.col("frontier").shift(1).over(THREAD, order_by="call")).join(
        last_state, on=THREAD, how="left").with_columns(
        lo=pl.coalesce("lo", "_f0", pl.lit(head + 1, pl.Int64))).drop("_f0")
    hit = materialize(_hit_rows(blocks, msgs, firings, head))
    w = start_marks(blocks.join(hit, on=VERSION_KEY, how="left", nulls_equal=True))
    w = mark_drop(w, pl.col("_call").is_not_null(), "watermark", from_call=pl.col("_call"), action="snip",
                  epoch=pl.col("_epoch"))
    cut_res = finish(w)
    out, marker_dec = _new_markers(blocks, cut_res.blocks, msgs, hit, firings, prior, head)
    return StageResult(materialize(out), materialize(pl.concat([cut_res.decisions, marker_dec])))


def tombstone_dry_run(base: pl.LazyFrame, ctx: StageContext) -> pl.LazyFrame:
    """The blocks as the pipeline's tombstone would leave them (no tombstone: as they are)."""
    ref = ctx.peer("tombstone")
    if ref is None:
        return base
    if ref.stage.quiet is not None and ask(base, [ref.stage.quiet.check(base, ref.params, ctx)])[0]:
        return materialize(sort_blocks(base))  # the dry run clears nothing: the blocks as its plan leaves them
    return materialize(ref.stage.fn(base, ref.params, empty_decisions(), ctx).blocks)


def _per_call(blocks: pl.LazyFrame, msgs: pl.LazyFrame, base: pl.LazyFrame, dry: pl.LazyFrame,
              ctx: StageContext) -> pl.LazyFrame:
    """Per call: request tokens after the dry run, the current turn, the latest compaction turn and
    the highest cache epoch so far."""
    grid = call_grid(blocks)
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
    return per_call.select(*THREAD, kind=pl.lit("call"), call="call", tokens="tokens", cur_turn="cur_turn",
                           comp_turn="comp_turn", ep="ep")


def _token_rows(dry: pl.LazyFrame, base: pl.LazyFrame, msgs: pl.LazyFrame, head: int,
                ctx: StageContext) -> pl.LazyFrame:
    """What removing each turn frees: its snippable rows (after the dry run) and one message
    overhead per message."""
    tok_rows = _snippable(dry, msgs, head).select(
        *THREAD, "turn", first="first_call", last="last_call", tok=row_tokens_expr(ctx), is_msg=pl.lit(False))
    msg_rows = messages(base).join(msgs.select(*THREAD, "msg_key", "turn"), on=[*THREAD, "msg_key"], suffix="_b") \
        .filter((pl.col("role") != "system") & (pl.col("turn") > head)) \
        .select(*THREAD, "turn", "first", "last", tok=pl.lit(MESSAGE_OVERHEAD_TOKENS, pl.Int64), is_msg=pl.lit(True))
    return pl.concat([tok_rows, msg_rows]).with_columns(kind=pl.lit("row"))


def _hit_rows(blocks: pl.LazyFrame, msgs: pl.LazyFrame, firings: pl.LazyFrame, head: int) -> pl.LazyFrame:
    """The version key of each row a firing removes (turns lo..frontier-1), with its call and epoch."""
    snippable = _snippable(blocks, msgs, head).select(*VERSION_KEY, "turn").with_columns(
        pl.col("turn").cast(pl.Int64)).sort("turn")
    return snippable.join_asof(
        firings.select(*THREAD, "lo", "frontier", _call="call", _epoch="epoch").sort("lo"),
        left_on="turn", right_on="lo", by=THREAD, strategy="backward", check_sortedness=False,
    ).filter(pl.col("turn") < pl.col("frontier")).select(*VERSION_KEY, "_call", "_epoch")


def _new_markers(blocks: pl.LazyFrame, out: pl.LazyFrame, msgs: pl.LazyFrame, hit: pl.LazyFrame,
                 firings: pl.LazyFrame, prior: pl.LazyFrame, head: int) -> tuple[pl.LazyFrame, pl.LazyFrame]:
    """The marker: one row, a new version per firing, placed before the first row removed (or where
    the marker already is); the version in force when the range grows again ends there (the new
    version's `replace` decision records the change)."""
    first_hit = hit.join(blocks.select(*VERSION_KEY, "order_key"), on=VERSION_KEY).group_by(THREAD).agg(
        pl.col(c).sort_by("order_key", "entry_id", "block_pos", "part_pos").first()
        for c in ("first_call", "entry_id", "block_pos", "part_pos"))
    existing = blocks.filter(pl.col("origin") == "snip").group_by(THREAD).agg(
        pl.all().sort_by("first_call").last())
    anchors_new = blocks.join(first_hit, on=[*THREAD, "entry_id", "block_pos", "part_pos", "first_call"], how="semi")
    anchors_new = anchors_new.join(existing.select(THREAD), on=THREAD, how="anti")
    anchors = pl.concat([anchors_new.select(block_schema().names()),
                         existing.select(block_schema().names()).with_columns(order_key=pl.col("order_key") + 1)])
    removed_end = _snippable(blocks, msgs, head).join(hit.select(*VERSION_KEY), on=VERSION_KEY, how="semi") \
        .group_by(THREAD).agg(_end=open_max("last_call"))
    versions = firings.with_columns(
        last_call=pl.col("call").shift(-1).over(THREAD, order_by="call"),
        text=pl.format(polars_format(SNIP_TEMPLATE), "n", "t"),
    ).join(removed_end, on=THREAD, how="left").with_columns(
        last_call=pl.coalesce("last_call", pl.when(pl.col("_end") > pl.col("call")).then(pl.col("_end")))
        .cast(pl.Int32),
    ).select(*THREAD, first_call="call", last_call="last_call", text="text", cache_epoch="epoch")
    new_markers = _marker_rows(anchors, versions)
    first_new = versions.group_by(THREAD).agg(_close=pl.col("first_call").min())
    closing = (pl.col("origin") == "snip") & pl.col("_close").is_not_null() & (pl.col("first_call") < pl.col("_close")) \
        & (pl.col("last_call").is_null() | (pl.col("last_call") > pl.col("_close")))
    out = out.join(first_new, on=THREAD, how="left").with_columns(
        last_call=pl.when(closing).then(pl.col("_close")).otherwise(pl.col("last_call"))).drop("_close")
    cols = list(block_schema().names())
    return pl.concat([out.select(cols), new_markers.select(cols)]), _marker_decisions(new_markers, prior)


def _ledger_markers(before: pl.LazyFrame, after: pl.LazyFrame, ledger: pl.LazyFrame) -> tuple[pl.LazyFrame, pl.LazyFrame]:
    """The `rebuild` hook: the marker versions this stage recorded in the ledger (insert / replace
    decisions), anchored at the first row its recorded snips removed (the runner has re-applied the
    snips themselves). Returns (blocks, marker decisions)."""
    led = ledger.filter(pl.col("action").is_in(["insert", "replace"]) & pl.col("replacement").is_not_null())
    snips = ledger.filter(pl.col("action") == "snip").select(*PART_KEY, "from_call")
    targets = before.join(snips, on=PART_KEY, how="inner").filter(visible_at("from_call"))
    anchors = targets.group_by(THREAD).agg(pl.all().sort_by("order_key", "entry_id", "block_pos", "part_pos").first()) \
        .select(block_schema().names())
    anchors = anchors.join(before.filter(pl.col("origin") == "snip").select(THREAD).unique(), on=THREAD, how="anti")
    end = targets.group_by(THREAD).agg(_end=open_max("last_call"))
    versions = led.sort("from_call").select(
        *THREAD, first_call="from_call", cache_epoch="cache_epoch",
        text=pl.col("replacement").str.json_decode(pl.Struct({"text": pl.String})).struct.field("text"),
    ).with_columns(last_call=pl.col("first_call").shift(-1).over(THREAD, order_by="first_call")).join(end, on=THREAD, how="left") \
        .with_columns(last_call=pl.coalesce("last_call", pl.when(pl.col("_end") > pl.col("first_call"))
                                            .then(pl.col("_end"))).cast(pl.Int32)).drop("_end")
    rows = _marker_rows(anchors, versions)
    cols = list(block_schema().names())
    return pl.concat([after.select(cols), rows.select(cols)]), _marker_decisions(rows)


def _resnip_conflicts(blocks: pl.LazyFrame, ledger: pl.LazyFrame) -> StageResult | None:
    """A recorded snip whose row changed under it (a `conflict` in the ledger view) is made afresh,
    from the same call, in the same epoch: a snip removes a position in the conversation, whatever
    it holds now."""
    redo = conflicted(ledger, "snip").rename({"reason": "_rr", "cache_epoch": "_re"}).collect(engine=POLARS_ENGINE)
    if not redo.height:
        return None
    targets = blocks.join(redo.lazy(), on=PART_KEY, how="inner").filter(visible_at("from_call")).select(
        *VERSION_KEY, _rf=pl.col("from_call").cast(pl.Int32), _rr="_rr", _re=pl.col("_re").cast(pl.Int32)) \
        .unique(VERSION_KEY, keep="first")
    w = start_marks(blocks.join(targets, on=VERSION_KEY, how="left", nulls_equal=True))
    w = mark_drop(w, pl.col("_rf").is_not_null(), pl.col("_rr"), from_call=pl.col("_rf"), action="snip",
                  epoch=pl.col("_re"))
    return finish(w)


# ---------------------------------------------------------------------------------------------
# the live rule (ctxreplay.pipeline.stageapi.live): no snip at the new calls of a live step


@dataclass(frozen=True, slots=True)
class LiveCarry:
    """What snip carries between live steps: the pending call's request tokens after its dry run of
    the pipeline's tombstone, and that peer's own live carry over the dry run's output (so that the
    peer's rule says whether the dry run clears at the new calls); or, with `bound`, the tokens
    before the dry run, which bound those after it while the dry run can only shorten requests."""

    tokens: int
    dry: Any = None
    why: str | None = None  # a full pass at the next step, and why
    bound: bool = False  # `tokens` are before the dry run (it can only shorten them: `_dry_run_shrinks`)


def live_start(thread: LiveThread, params: Snip, ctx: StageContext) -> LiveCarry | None:
    """While snip has not fired in the thread, the request it measures is its input after its dry
    run of tombstone: as long as no later position decided anything, this position's output (the
    dry run clears nothing more than the real stage did); else the dry run's output, or, when that
    dry run can only shorten requests, this position's output again as a bound (no dry run)."""
    if not params.enabled:
        return None
    if thread.own_decisions.height:
        return LiveCarry(0, why="snip decided in this thread already")
    ref = ctx.peer("tombstone")
    blocks = thread.blocks
    if ref is not None and thread.decisions.filter(pl.col("stage").is_in(thread.later_positions())).height:
        shrinks = _dry_run_shrinks(blocks.lazy(), ref.params, ctx)
        if shrinks is not None and bool(shrinks.collect(engine=POLARS_ENGINE).item()):
            return LiveCarry(thread.request_tokens(blocks), bound=True)
        out = tombstone_dry_run(blocks.lazy(), ctx).collect(engine=POLARS_ENGINE)
        assert isinstance(out, pl.DataFrame)
        blocks = out
    dry = None
    if ref is not None:
        if ref.stage.live is None:
            return LiveCarry(0, why=f"snip's dry run of {ref.stage.name}: that stage has no live rule")
        dry = ref.stage.live.start(thread.with_blocks(blocks), ref.params, ctx)
    return LiveCarry(thread.request_tokens(blocks), dry)


def live_step(carry: LiveCarry | None, new: LiveRows, p: Snip, ctx: StageContext) -> Live:
    """Quiet while the request stays at or under the high watermark and the dry run of tombstone
    clears nothing at the new calls (that stage's own rule says); with a bound (the tokens before
    the dry run), while the new rows hold no result the dry run could make longer."""
    if carry is None:
        return Live.quiet(None)
    if carry.why:
        return Live.full_pass(carry.why)
    tokens = carry.tokens + new.request_tokens
    if tokens > p.high_watermark * max(0, ctx.window_tokens - p.reserve_output_tokens):
        return Live.full_pass("the request passes snip's high watermark")
    ref = ctx.peer("tombstone")
    if carry.bound:
        if ref is not None and _lengthens(new, ref.params, ctx):
            return Live.full_pass(f"snip's dry run of {ref.stage.name}: a new result it may clear is shorter "
                                  f"than the placeholder")
        return Live.quiet(LiveCarry(tokens, bound=True))
    dry = None
    if ref is not None and ref.stage.live is not None:
        ans = ref.stage.live.step(carry.dry, new, ref.params, ctx)
        if not ans.is_quiet:
            return Live.full_pass(f"snip's dry run of {ref.stage.name}: {ans.reason}")
        dry = ans.carry
    return Live.quiet(LiveCarry(tokens, dry))


def _lengthens(new: LiveRows, tomb: Any, ctx: StageContext) -> bool:
    """Whether a new tool result could be made longer by the dry run of tombstone (params `tomb`):
    one it may clear (all its text at least min_result_chars, or an image) with a row under the
    placeholder's tokens (`_dry_run_shrinks` on the new rows)."""
    placeholder = text_tokens([CLEARED_TEXT], ctx)[0]
    blocks: dict[tuple[Any, Any], list[tuple[int, int, bool]]] = {}
    for r, tok in zip(new.rows, new.tokens, strict=True):
        if r["block_type"] == "tool_result":
            image = r["block_type"] == "image" or r["part_type"] == "image"
            blocks.setdefault((r["entry_id"], r["block_pos"]), []).append(
                (tok, len(r["text"]) if isinstance(r["text"], str) else 0, image))
    for parts in blocks.values():
        may_clear = sum(n for _, n, _ in parts) >= tomb.min_result_chars or any(img for _, _, img in parts)
        if may_clear and any(tok < placeholder for tok, _, _ in parts):
            return True
    return False


def quiet_check(blocks: pl.LazyFrame, params: Snip, ctx: StageContext) -> pl.Expr | pl.LazyFrame:
    """Nothing to do (ctxreplay.pipeline.stageapi.quiet): no snip marker yet, and every request of
    every thread (bounded: `request_tokens_max`) within the high watermark after the dry run of the
    pipeline's tombstone: either that stage is quiet too (its dry run leaves the blocks as they
    are), or its dry run can only make requests shorter (`_dry_run_shrinks`), so the bound before
    it holds after it."""
    if not params.enabled:
        return pl.lit(True)
    hi = params.high_watermark * max(0, ctx.window_tokens - params.reserve_output_tokens)
    own = pl.concat([
        blocks.select(_m=~(pl.col("origin") == "snip").fill_null(False).any()),
        request_tokens_max(blocks, ctx).select(_w=(pl.col("tokens") <= hi).all()),
    ], how="horizontal").select(_own=pl.col("_m") & pl.col("_w"))
    ref = ctx.peer("tombstone")
    if ref is None:
        return own
    shrinks = _dry_run_shrinks(blocks, ref.params, ctx)
    if ref.stage.quiet is None:
        return own if shrinks is None else pl.concat([own, shrinks], how="horizontal").select(pl.all_horizontal(pl.all()))
    peer = ref.stage.quiet.check(blocks, ref.params, ctx)
    peer_plan = blocks.select(_peer=peer.fill_null(False)) if isinstance(peer, pl.Expr) else \
        peer.select(_peer=pl.first().fill_null(False).all())
    parts = [own, peer_plan] if shrinks is None else [own, peer_plan, shrinks]
    # named columns: the plan's schema is not resolved to find them (~1 ms of every pass that asks)
    peer_or_shrinks = pl.col("_peer") if shrinks is None else (pl.col("_peer") | pl.col("_shrinks"))
    return pl.concat(parts, how="horizontal").select(pl.col("_own") & peer_or_shrinks)


def _dry_run_shrinks(blocks: pl.LazyFrame, tomb: Any, ctx: StageContext) -> pl.LazyFrame | None:
    """A one-row plan that holds when the pipeline's tombstone (params `tomb`), dry-run, can make no
    request longer; None when its params could whatever the rows (it clears tool inputs or
    thinking, whose replacements may be the longer). It only replaces a result's visible parts by
    the placeholder: longer only for a result it may clear (all its text at least
    min_result_chars, or an image) with a row under the placeholder's tokens."""
    if getattr(tomb, "clear_tool_inputs", True) or getattr(tomb, "clear_thinking_keep", None) != "all":
        return None
    exact = ctx.count_tokens is None or ctx.token_counter_version == CHARS4_COUNTER  # the fast estimate
    placeholder = chars4_tokens(len(CLEARED_TEXT)) if exact else text_tokens([CLEARED_TEXT], ctx)[0]
    # each row's tokens are taken before any filter, in one select that keeps no text: filtering the
    # text column copied every text kept (a 200 MB tool result twice, issue 23 item 6)
    results = blocks.select(
        *BLOCK_KEY, _res=pl.col("block_type") == "tool_result",
        _len=pl.col("text").str.len_chars().fill_null(0).cast(pl.Int64), _img=is_image_expr().fill_null(False),
        _tok=row_tokens_expr(StageContext() if exact else ctx)).filter("_res")
    # per result (one group_by: two windows over the block key cost twice as much)
    per_result = results.group_by(BLOCK_KEY).agg(
        may_clear=(pl.col("_len").sum() >= tomb.min_result_chars) | pl.col("_img").any(),
        short=(pl.col("_tok") < placeholder).fill_null(True).any())
    return per_result.select(_shrinks=~(pl.col("may_clear").fill_null(True) & pl.col("short")).any())


@stage("snip", version=1, params=Snip, requires=("pairing",), reads=("tombstone",), frozen=("snip",),
       rebuild=_ledger_markers, live=LiveRule(live_start, live_step), quiet=Quiet(quiet_check))
def snip(blocks: pl.LazyFrame, params: Snip, ledger: pl.LazyFrame, ctx: StageContext) -> StageResult:
    """Remove whole old middle turns when the request passes the high watermark.

    Judged per call on the estimated request tokens after a dry run of the pipeline's tombstone;
    removes turns oldest first (after the protected head, before the protected tail, the current
    tool loop and the latest compaction summary) until the request is at or under the low
    watermark. The removed rows get a `snip` decision from that call on; one user-role marker row
    (origin `snip`) stands for the whole range, a new version of it (`insert`, then `replace`) each
    time the range grows. Each firing takes a new cache epoch. Frozen: the runner re-applies the
    ledger's snips and rebuilds the marker first; a row changed under a recorded snip (a `conflict`)
    is still removed from that call; only later calls are decided afresh.
    """
    if not params.enabled:
        return StageResult(blocks, empty_decisions())
    redo = _resnip_conflicts(blocks, ledger)
    if redo is None:
        return plan(blocks, params, ctx)
    res = plan(materialize(redo.blocks), params, ctx)
    return StageResult(res.blocks, pl.concat([materialize(redo.decisions), res.decisions]))
