"""CallMap.extended: the call map of rows appended at the end of one thread, from the map before them
(the live engine's full pass after live steps), equal to CallMap.from_blocks over all the rows, or
None where that cannot be said from the map (then the engine makes it from the rows)."""

from __future__ import annotations

import polars as pl
import pytest

from ctxreplay.pipeline.assembly.replay import call_counts
from ctxreplay.pipeline.core.constants import POLARS_ENGINE
from ctxreplay.pipeline.staging.stagerun import CallMap
from ctxreplay.testkit import make_blocks

KEY = ["session_id", "thread_id", "call"]


def _session(turns: int, thread: str = "main", prefix: str = "e") -> pl.DataFrame:
    msgs: list[dict[str, object]] = []
    for i in range(turns):
        msgs += [{"role": "user", "text": f"u{i}", "entry_id": f"{prefix}{2 * i:04d}"},
                 {"role": "assistant", "text": f"a{i}", "entry_id": f"{prefix}{2 * i + 1:04d}"}]
    return make_blocks(msgs, thread_id=thread).collect(engine=POLARS_ENGINE)


def _same(a: CallMap, b: CallMap) -> None:
    assert a.keys.sort(KEY).equals(b.keys.sort(KEY))
    assert a.pending.sort(KEY[:2]).equals(b.pending.sort(KEY[:2]))


def _cut(blocks: pl.DataFrame, entries: int) -> tuple[pl.DataFrame, pl.DataFrame]:
    """The rows of the first `entries` entries of the main thread (every other thread's too), and the rest."""
    order = blocks.filter(pl.col("thread_id") == "main").get_column("order_key").unique().sort()
    last = order[entries - 1]
    early = (pl.col("thread_id") != "main") | (pl.col("order_key") <= last)
    return blocks.filter(early), blocks.filter(~early)


@pytest.mark.parametrize("entries", [1, 2, 3, 6, 9])
def test_extended_is_from_blocks_over_all_rows(entries: int) -> None:
    # another thread beside it (its own calls, untouched), the main thread cut after each entry count
    blocks = pl.concat([_session(5), _session(2, thread="side", prefix="x")])
    before, rows = _cut(blocks, entries)
    was = CallMap.from_blocks(before, call_counts(before))
    counts = call_counts(blocks)
    got = was.extended(before, rows, counts)
    assert got is not None
    _same(got, CallMap.from_blocks(blocks, counts))
    assert got.keys.filter(pl.col("thread_id") == "main").height == 5


def test_nothing_appended_keeps_the_keys_with_the_new_counts() -> None:
    blocks = _session(3)
    was = CallMap.from_blocks(blocks, call_counts(blocks))
    got = was.extended(blocks, blocks.head(0), call_counts(blocks))
    assert got is not None
    _same(got, was)


def test_rows_of_two_threads_are_not_said() -> None:
    blocks = pl.concat([_session(3), _session(2, thread="side", prefix="x")])
    before = blocks.filter(pl.col("order_key") < 2 * 1024)  # each thread's first two entries
    rows = blocks.filter(pl.col("order_key") >= 2 * 1024)
    assert CallMap.from_blocks(before, call_counts(before)).extended(before, rows, call_counts(blocks)) is None


def test_a_known_message_among_the_rows_is_not_said() -> None:
    blocks = _session(3)
    before, rows = _cut(blocks, 4)
    # the new rows continue the last message before them (same msg_key): not new messages
    rows = rows.with_columns(msg_key=pl.lit(before.get_column("msg_key")[-1]))
    assert CallMap.from_blocks(before, call_counts(before)).extended(before, rows, call_counts(blocks)) is None


def test_rows_before_the_threads_end_are_not_said() -> None:
    blocks = _session(3)
    before, rows = _cut(blocks, 4)
    rows = rows.with_columns(order_key=pl.col("order_key") - 3 * 1024)  # in the middle of the thread
    assert CallMap.from_blocks(before, call_counts(before)).extended(before, rows, call_counts(blocks)) is None


def test_a_thread_without_keys_before_is_not_said() -> None:
    blocks = _session(3)
    before, rows = _cut(blocks, 4)
    counts_before = {k: v + 1 for k, v in call_counts(before).items()}  # more calls than call messages: no keys
    was = CallMap.from_blocks(before, counts_before)
    assert was.keys.height == 0
    assert was.extended(before, rows, {k: v + 1 for k, v in call_counts(blocks).items()}) is None


def test_calls_that_do_not_add_up_are_not_said() -> None:
    blocks = _session(3)
    before, rows = _cut(blocks, 4)
    was = CallMap.from_blocks(before, call_counts(before))
    counts = call_counts(blocks)
    assert was.extended(before, rows, counts) is not None
    assert was.extended(before, rows, {k: v + 1 for k, v in counts.items()}) is None


def test_rows_of_a_branch_beside_the_thread_are_not_said() -> None:
    # a branch holding the same history (its messages under the same keys): rows of both threads,
    # whose new answer is one call message of the session, a call of each thread
    blocks = pl.concat([_session(3), _session(3, thread="side")])
    early = pl.col("order_key") <= 3 * 1024
    before, rows = blocks.filter(early), blocks.filter(~early)
    was = CallMap.from_blocks(before, call_counts(before))
    assert was.extended(before, rows, call_counts(blocks)) is None
    assert CallMap.from_blocks(blocks, call_counts(blocks)).keys.filter(pl.col("thread_id") == "side").height == 3


def test_a_thread_with_calls_but_no_keys_before_is_not_said() -> None:
    # one call message before, counted as two calls (no keys); then three answers, three calls in
    # all: the new answers alone add up to the count, but the thread's messages do not
    blocks = _session(4)
    before, rows = _cut(blocks, 2)
    was = CallMap.from_blocks(before, {("s1", "main"): 2})
    assert was.keys.height == 0
    counts = {("s1", "main"): 3}
    assert CallMap.from_blocks(blocks, counts).keys.height == 0
    assert was.extended(before, rows, counts) is None
