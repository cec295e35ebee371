"""The engine's replay state: one thread's pending request, kept between calls.

`ctxreplay.pipeline.assembly.replay.replay_thread` walks every call of a thread once; the engine needs only the
pending call, again after each ingest. `LiveThread` keeps what the replay keeps between two calls
(the visible rows, the logical and wire messages with their canonical bytes, the sha256 states of
the message list: `ctxreplay.pipeline.assembly.replay._Thread`) and applies to it the difference between the rows the
pending call saw last time and the rows it sees now: rows appended at the end (the usual case:
the new entries) and rows gone (a version a layer replaced, a compaction). The request hash
continues the kept hash states over the bytes after the first changed message. When a new row
sorts before rows kept from last time (a layer replaced a block deep in the history: a new
version at the old block's place), the state is built again from the visible rows: that costs one
shaping of the whole request, as often as such a decision is made.

The bytes are those of `replay_thread` by construction: the same `ThreadWalk` code makes them, from
the same rows in the same order; tests/test_engine_corpus.py checks every call of the corpus.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Any

import polars as pl

from ctxreplay.pipeline.assembly.replay import (
    MESSAGE_OVERHEAD_TOKENS,
    REQUEST_OVERHEAD_TOKENS,
    ROW_COLUMNS,
    MessageStore,
    ThreadWalk,
    finish_hash,
    first_diff,
    list_prefix,
    make_envelope,
    split_system_rows,
    stand_in_messages,
)
from ctxreplay.pipeline.core.tokens import TokenCounter, row_tokens
from ctxreplay.pipeline.targets import Target

# what identifies a visible row between two passes: its place and everything the request takes from it
IDENT_COLUMNS = ["order_key", "entry_id", *[c for c in ROW_COLUMNS if c not in ("first_call", "last_call")]]


@dataclass
class Pending:
    """The pending request: its canonical bytes, hash and measures."""

    request_json: bytes
    request_sha256: str
    prompt_tokens: int
    n_messages: int
    awaits_user: bool
    prefix_break_message: int | None
    rebuilt: bool  # the state was built again from all visible rows (not appended to)


class LiveThread:
    """The replay state of one thread of the engine (see the module docstring)."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.store = MessageStore()
        self.builds = 0
        self._reset()
        self.prev_ids: array | None = None  # type: ignore[type-arg]
        self.env_key: tuple[Any, ...] | None = None
        self.env_suffix = b"]}"
        self.env_tok = 0
        self.stand_ids: list[int] | None = None

    def _reset(self) -> None:
        self.builds = getattr(self, "builds", 0) + 1
        self.rows: list[dict[str, Any]] = []
        self.th = ThreadWalk(self.rows, self.target, self.store, None)
        self.index: dict[int, int] = {}  # ident of a visible row -> its index in rows
        self.idents = pl.Series("ident", [], dtype=pl.UInt64)  # the visible rows, in order
        self.system_rows: list[int] = []
        self.sys_version = 0

    def update(self, visible: pl.DataFrame, model: str | None, counter: TokenCounter, *,
               awaiting_user: bool = False) -> Pending:
        """The request from the rows the pending call sees (`visible`, sorted for replay). A
        trailing assistant message is left out when the target takes no prefill, as in the batch
        replay's recorded calls (the request is sent now), unless `awaiting_user`: then it is kept,
        as in the batch replay's pending call (the request waits for the user's next message)."""
        idents = visible.select(pl.struct(IDENT_COLUMNS).hash(7).alias("ident")).to_series()
        kept = idents.is_in(self.idents.implode()) if self.idents.len() else pl.Series([False] * len(idents),
                                                                                        dtype=pl.Boolean)
        n_kept = int(kept.sum())
        # appendable: the rows kept come first (their order is the old one), the new ones after them
        appendable = (bool(self.rows) and bool(kept.head(n_kept).all()) and idents.n_unique() == len(idents))
        rebuilt = not appendable
        if rebuilt:
            self._reset()
            gone: list[int] = []
            new = visible
            new_idents = idents.to_list()
        else:
            gone_idents = self.idents.filter(~self.idents.is_in(idents.implode())).to_list()
            gone = sorted(self.index.pop(g) for g in gone_idents)
            new = visible.slice(n_kept)
            new_idents = idents.slice(n_kept).to_list()
        start = len(self.rows)
        if new.height:
            dicts = new.select(ROW_COLUMNS).to_dicts()
            for r, t in zip(dicts, row_tokens(new, counter).to_list(), strict=True):
                r["_tok"] = t
            self.rows.extend(dicts)
        added = list(range(start, len(self.rows)))
        for i, g in zip(added, new_idents, strict=True):
            self.index[g] = i
        self.idents = idents
        return self._shape(added, gone, model, awaiting_user, rebuilt)

    def extend(self, new: pl.DataFrame, tokens: list[int], model: str | None, *,
               awaiting_user: bool = False) -> Pending:
        """`update` for rows that follow every row the state holds, none gone (the live path:
        ctxreplay.pipeline.engine.live): only the new rows are hashed and shaped. `tokens` are their row tokens."""
        idents = new.select(pl.struct(IDENT_COLUMNS).hash(7).alias("ident")).to_series()
        start = len(self.rows)
        dicts = new.select(ROW_COLUMNS).to_dicts()
        for r, t in zip(dicts, tokens, strict=True):
            r["_tok"] = t
        self.rows.extend(dicts)
        added = list(range(start, len(self.rows)))
        for i, g in zip(added, idents.to_list(), strict=True):
            self.index[g] = i
        self.idents = pl.concat([self.idents, idents])
        return self._shape(added, [], model, awaiting_user, False)

    def _shape(self, added: list[int], gone: list[int], model: str | None, awaiting_user: bool,
               rebuilt: bool) -> Pending:
        """Apply the rows added and gone to the thread state and shape the request."""
        target = self.target
        rows = self.rows
        if target.splits_system():
            added, gone, new_system = split_system_rows(rows, self.system_rows, added, gone, target)
            if new_system is not None:
                self.system_rows = new_system
                self.sys_version += 1
        self.th.k += 1
        self.th.apply(added, gone)
        if self.env_key != (model, self.sys_version, self.builds):
            self.env_key = (model, self.sys_version, self.builds)
            env_id, self.env_suffix = make_envelope(target, model, rows, self.system_rows, self.store)
            self.env_tok = self.store.tokens[env_id]
        th = self.th
        m = th.sent_length(keep_trailing=awaiting_user)
        if m:
            msg_tok, h, comma, rest, _ = th.request_parts(m, None)
            body = b",".join(th.wb[:m])
            ids = th.wid[:m]
        else:  # nothing before the first call: the target's stand-in turn
            if self.stand_ids is None:
                self.stand_ids = stand_in_messages(target, self.store)
            msg_tok, h, comma, rest, _ = th.request_parts(0, self.stand_ids)
            body = b",".join(rest)
            ids = array("i", self.stand_ids)
        length = len(ids)
        sha = finish_hash(h, comma, rest, self.env_suffix)
        # where it first differs from the last request (message ids are equal iff their bytes are)
        brk = None if self.prev_ids is None else first_diff(self.prev_ids, ids)
        self.prev_ids = array("i", ids)
        return Pending(
            request_json=list_prefix(target.list_key) + body + self.env_suffix,
            request_sha256=sha,
            prompt_tokens=REQUEST_OVERHEAD_TOKENS + self.env_tok + msg_tok + MESSAGE_OVERHEAD_TOKENS * length,
            n_messages=length,
            awaits_user=awaiting_user and bool(m) and th.wasst[m - 1],
            prefix_break_message=brk,
            rebuilt=rebuilt,
        )
