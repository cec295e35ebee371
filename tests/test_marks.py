"""The block-edit API (ctxreplay.pipeline.stageapi.marks): drops, replacements in place and from a later call, inserts."""

from __future__ import annotations

import polars as pl

from ctxreplay.pipeline.stageapi.marks import (
    Insert,
    finish,
    mark_drop,
    mark_replace,
    mark_replace_from,
    start_marks,
    text_row,
)
from ctxreplay.testkit import make_blocks

MSGS = [
    {"role": "user", "text": "hello"},
    {"role": "assistant", "text": "one"},
    {"role": "user", "text": "again"},
    {"role": "assistant", "text": "two"},
    {"role": "user", "text": "last"},
]


def _blocks() -> pl.LazyFrame:
    return make_blocks(MSGS)


def _versions(res_blocks: pl.LazyFrame, entry: str) -> list[tuple[int, int | None, str]]:
    df = res_blocks.collect().filter(pl.col("entry_id") == entry).sort("first_call")
    return list(zip(df["first_call"].to_list(), df["last_call"].to_list(), df["text"].to_list()))


def test_replace_from_a_later_call_splits_the_version() -> None:
    w = start_marks(_blocks())
    w = mark_replace_from(w, pl.col("entry_id") == "e0000", {"text": pl.lit("HELLO"), "cache_epoch": pl.lit(3)},
                          "shout", pl.lit(2), action="tombstone")
    res = finish(w)
    assert _versions(res.blocks, "e0000") == [(0, 2, "hello"), (2, None, "HELLO")]
    d = res.decisions.collect()
    assert d.select("entry_id", "from_call", "action", "reason", "cache_epoch").rows() == [
        ("e0000", 2, "tombstone", "shout", 3)]
    epochs = res.blocks.collect().filter(pl.col("entry_id") == "e0000").sort("first_call")["cache_epoch"].to_list()
    assert epochs == [0, 3]


def test_replace_from_a_call_at_or_before_the_first_is_in_place() -> None:
    w = start_marks(_blocks())
    # e0002 (third message) is first seen by call 1
    w = mark_replace_from(w, pl.col("entry_id") == "e0002", {"text": pl.lit("AGAIN")}, "r", pl.lit(0))
    res = finish(w)
    assert _versions(res.blocks, "e0002") == [(1, None, "AGAIN")]
    assert res.decisions.collect().select("from_call", "action").rows() == [(1, "replace")]


def test_replace_from_after_the_version_ends_does_nothing() -> None:
    blocks = _blocks().with_columns(last_call=pl.when(pl.col("entry_id") == "e0000").then(pl.lit(1, pl.Int32))
                                    .otherwise(pl.col("last_call")))
    w = mark_replace_from(start_marks(blocks), pl.col("entry_id") == "e0000", {"text": pl.lit("X")}, "r", pl.lit(1))
    res = finish(w)
    assert _versions(res.blocks, "e0000") == [(0, 1, "hello")]
    assert res.decisions.collect().height == 0


def test_drop_with_action_and_epoch_and_the_earlier_drop_wins() -> None:
    w = start_marks(_blocks())
    w = mark_drop(w, pl.col("entry_id") == "e0000", "later", from_call=pl.lit(2), action="snip", epoch=pl.lit(7))
    w = mark_drop(w, pl.col("entry_id") == "e0000", "earlier", from_call=pl.lit(1))
    w = mark_drop(w, pl.col("entry_id") == "e0000", "latest", from_call=pl.lit(2))
    res = finish(w)
    assert _versions(res.blocks, "e0000") == [(0, 1, "hello")]
    assert res.decisions.collect().select("from_call", "action", "reason", "cache_epoch").rows() == [
        (1, "drop", "earlier", 0)]


def test_replace_in_place_then_drop_later_gives_two_decisions() -> None:
    w = start_marks(_blocks())
    w = mark_replace(w, pl.col("entry_id") == "e0000", {"text": pl.lit("HI")}, "a", action="truncate")
    w = mark_drop(w, pl.col("entry_id") == "e0000", "b", from_call=pl.lit(2), epoch=pl.lit(5))
    res = finish(w)
    assert _versions(res.blocks, "e0000") == [(0, 2, "HI")]
    d = res.decisions.collect().sort("from_call")
    assert d.select("from_call", "action", "reason", "cache_epoch").rows() == [(0, "truncate", "a", 0),
                                                                                (2, "drop", "b", 5)]
    # the drop's before_sha256 is the replaced content, the replacement's the original
    assert d["before_sha256"][1] == d["after_sha256"][0] != d["before_sha256"][0]


def test_insert_and_unchanged_replacement() -> None:
    w = start_marks(_blocks())
    w = mark_replace(w, pl.col("entry_id") == "e0001", {"text": pl.col("text")}, "noop")
    ins = Insert(when=pl.col("_is_first_row") & (pl.col("entry_id") == "e0004"),
                 values={**text_row("note", origin="test"), "block_pos": pl.lit(-1, pl.Int32)}, reason="added")
    res = finish(w, [ins])
    d = res.decisions.collect()
    assert d.select("entry_id", "block_pos", "action", "reason").rows() == [("e0004", -1, "insert", "added")]
    assert _versions(res.blocks, "e0004") == [(2, None, "note"), (2, None, "last")]


def test_unmarked_rows_leave_as_they_came_and_an_insert_marks_its_row() -> None:
    # finish passes the rows no mark touches straight through (not rehashed, not exploded); a row
    # whose only mark is an insert's condition is marked, so its inserted row and decision are made
    blocks = _blocks().with_columns(content_sha256=pl.when(pl.col("entry_id") == "e0003").then(pl.lit("stale"))
                                    .otherwise(pl.col("content_sha256")))
    w = start_marks(blocks)
    w = mark_drop(w, pl.col("entry_id") == "e0001", "gone")
    ins = Insert(when=pl.col("_is_first_row") & (pl.col("entry_id") == "e0002"),
                 values={**text_row("note", origin="test"), "block_pos": pl.lit(-1, pl.Int32)}, reason="added")
    res = finish(w, [ins])
    out = res.blocks.collect()
    before = blocks.collect()
    for entry in ("e0000", "e0003", "e0004"):  # untouched: every column as it came
        assert out.filter(pl.col("entry_id") == entry).equals(before.filter(pl.col("entry_id") == entry))
    assert out.filter(pl.col("entry_id") == "e0003")["content_sha256"].to_list() == ["stale"]
    assert _versions(res.blocks, "e0002") == [(1, None, "note"), (1, None, "again")]
    assert "e0001" not in out["entry_id"].to_list()
    assert res.decisions.collect().select("entry_id", "action", "reason").sort("entry_id").rows() == [
        ("e0001", "drop", "gone"), ("e0002", "insert", "added")]
    assert out.columns == before.columns
