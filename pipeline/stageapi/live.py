"""A stage's live rule: what it decides at the new calls of a live session, without a pass.

The live engine (docs/engine.md, "What a call costs") takes the usual step of an agent (the answer
to the last request and the tool results or user message that follow it, appended to the main
thread) without running the pipeline when no stage decides anything about it. Only the stage
knows that, so a stage says it itself, through the optional `live=` keyword of `@stage`:

```python
def live_start(thread: LiveThread, params, ctx) -> carry        # after every full pass
def live_step(carry, new: LiveRows, params, ctx) -> Live        # at every live step

@stage("mine", version=1, params=Mine, live=LiveRule(live_start, live_step))
```

- `start` gets the thread as the last full pass left it (`LiveThread`: its rows as loaded, as this
  stage's position left them, the decisions applied in it) and returns what the stage carries:
  any value, the figures its `step` needs (a count, a set of ids, a token total).
- `step` gets the carried value and the rows the step appends (`LiveRows`), and answers
  `Live.quiet(carry)`: it decides nothing at any of the new calls (`carry` is what the next step
  gets), or `Live.full_pass(reason)`: it may decide something, the engine runs a full pass (and
  calls `start` again after it).

A rule must be conservative: `quiet` only when a full pass over the same rows would decide
nothing at the new calls (tests/test_live_rules.py checks every built-in rule against full passes).
A stage without a rule means a full pass at every step; a rule that raises means a full pass too.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import polars as pl

from ctxreplay.pipeline.core.constants import MESSAGE_OVERHEAD_TOKENS
from ctxreplay.pipeline.core.tokens import row_tokens_expr


@dataclass(frozen=True, slots=True)
class Live:
    """A live rule's answer for one step: `quiet` (nothing to decide at the new calls, with what
    to carry to the next step) or `full_pass` (why the stage needs to see the whole session)."""

    carry: Any = None
    reason: str | None = None

    @classmethod
    def quiet(cls, carry: Any = None) -> Live:
        return cls(carry, None)

    @classmethod
    def full_pass(cls, reason: str) -> Live:
        return cls(None, reason or "a full pass")

    @property
    def is_quiet(self) -> bool:
        return self.reason is None


@dataclass(frozen=True)
class LiveThread:
    """The main thread of a session as the last full pass left it, for a rule's `start`.

    `loaded`: its rows as the loader gave them (before any stage); `blocks`: its rows as this
    stage's position left them (every version; `first_call`/`last_call` say which calls see one);
    `decisions`: every decision applied in the thread by any position of the pipeline
    (STAGE_DECISION columns, `stage` the position's name: `pairing#2` for a second use);
    `positions`: the pipeline's position names, in order; `position`: this stage's; `call`: the
    pending call (the request the engine assembles now)."""

    session_id: str
    thread_id: str
    call: int
    position: str
    positions: tuple[str, ...]
    loaded: pl.DataFrame
    blocks: pl.DataFrame
    decisions: pl.DataFrame
    count_tokens: Callable[[pl.Series], pl.Series] | None = field(default=None, repr=False)
    # what the rules measured on one frame, shared by the positions that see the same one (a
    # position that decided nothing leaves its input as it is): (name, id of the frame) -> (frame, value)
    _memo: dict[tuple[str, int], tuple[pl.DataFrame, Any]] = field(default_factory=dict, repr=False, compare=False)

    def measured(self, name: str, compute: Callable[[], Any], blocks: pl.DataFrame | None = None) -> Any:
        """`compute()`, a figure of `blocks` (default: this thread's), computed once per frame
        for all the positions that see it after one full pass (`name` says which figure)."""
        b = self.blocks if blocks is None else blocks
        key = (name, id(b))
        got = self._memo.get(key)
        if got is None or got[0] is not b:
            got = self._memo[key] = (b, compute())
        return got[1]

    @property
    def own_decisions(self) -> pl.DataFrame:
        """The decisions this position applied in the thread."""
        return self.decisions.filter(pl.col("stage") == self.position)

    def later_positions(self) -> tuple[str, ...]:
        """The positions after this one in the pipeline."""
        return self.positions[self.positions.index(self.position) + 1:]

    def with_blocks(self, blocks: pl.DataFrame, position: str | None = None) -> LiveThread:
        """The same thread seen through other rows (e.g. a peer's dry run), or as another position."""
        return replace(self, blocks=blocks, position=position or self.position)

    def row_tokens(self, blocks: pl.DataFrame | None = None) -> pl.Series:
        """Each row's tokens as the stages and the replay estimate them (ctx.count_tokens)."""
        b = self.blocks if blocks is None else blocks
        return self.measured("row_tokens", lambda: b.select(row_tokens_expr(self.count_tokens)).to_series()
                             .rename("tokens"), b)

    def visible(self, blocks: pl.DataFrame | None = None) -> pl.DataFrame:
        """The rows the pending call's request holds."""
        b = self.blocks if blocks is None else blocks
        return b.filter((pl.col("first_call") <= self.call)
                        & (pl.col("last_call").is_null() | (pl.col("last_call") > self.call)))

    def request_tokens(self, blocks: pl.DataFrame | None = None) -> int:
        """The pending call's request tokens, as ctxreplay.pipeline.stageapi.calls.request_tokens
        counts them: the rows it holds plus an overhead per message."""
        b = self.blocks if blocks is None else blocks

        def count() -> int:
            call = self.call
            seen = (pl.col("first_call") <= call) & (pl.col("last_call").is_null() | (pl.col("last_call") > call))
            t = b.select("msg_key", "first_call", "last_call", _t=self.row_tokens(b))
            rows = int(t.filter(seen).get_column("_t").sum() or 0)
            msgs = t.group_by("msg_key").agg(
                first=pl.col("first_call").min(),
                last=pl.when(pl.col("last_call").is_null().any()).then(None).otherwise(pl.col("last_call").max()))
            n = msgs.filter((pl.col("first") <= call) & (pl.col("last").is_null() | (pl.col("last") > call)))
            return rows + MESSAGE_OVERHEAD_TOKENS * n.height

        return int(self.measured(f"request_tokens@{self.call}", count, b))


@dataclass(frozen=True)
class LiveRows:
    """The rows a live step appends at the end of the main thread, in thread order (the BLOCKS
    columns), with what rules read of them: `rows` as dicts, each row's `tokens`, the rows grouped
    by message (`messages`), and `calls`, the pending call after them (the new calls are the ones
    after the last step's pending call, up to this one)."""

    frame: pl.DataFrame
    rows: list[dict[str, Any]]
    tokens: list[int]  # per row
    messages: list[list[dict[str, Any]]]  # rows grouped by message, in order
    calls: int  # the pending call after them

    @property
    def request_tokens(self) -> int:
        """What they add to a request that holds them all (rows + an overhead per message)."""
        return sum(self.tokens) + MESSAGE_OVERHEAD_TOKENS * len(self.messages)

    @functools.cached_property
    def first_call(self) -> int:
        """The first new call (the first call whose request holds these rows)."""
        return min(r["first_call"] for r in self.rows)


Start = Callable[[LiveThread, Any, Any], Any]
"""(thread after a full pass, params, ctx) -> what the stage carries."""
Step = Callable[[Any, LiveRows, Any, Any], Live]
"""(carried value, appended rows, params, ctx) -> Live.quiet(carry) or Live.full_pass(reason)."""


@dataclass(frozen=True, slots=True)
class LiveRule:
    """A stage's live rule (see the module docstring): `start` after a full pass, `step` per live step."""

    start: Start
    step: Step


_NONBLANK = re.compile(r"\S")  # Python's whitespace holds polars' (Rust's): \S here is non-blank there


def nonblank(v: Any) -> bool:
    """A string with a non-blank character, as polars' (Rust's) whitespace counts them."""
    return isinstance(v, str) and _NONBLANK.search(v) is not None


__all__ = ["Live", "LiveRows", "LiveRule", "LiveThread", "nonblank"]
