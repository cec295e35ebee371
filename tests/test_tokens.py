"""Tokens: o200k_base from the shipped file, special-token text counted, cache by sha256."""

from __future__ import annotations

import gzip
import hashlib
from pathlib import Path

import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ctxreplay.pipeline.core.tokens import (
    CHARS4_COUNTER,
    O200K_FILE,
    O200K_SHA256,
    TIKTOKEN_COUNTER,
    TokenCounter,
    image_tokens,
    load_o200k,
    tokens_expr,
)
from ctxreplay.pipeline.staging.ledger import Ledger


def test_shipped_encoding_is_byte_identical_to_openais() -> None:
    assert hashlib.sha256(gzip.decompress(O200K_FILE.read_bytes())).hexdigest() == O200K_SHA256


@pytest.mark.tiktoken
def test_o200k_counts_offline_and_survives_special_tokens() -> None:
    enc = load_o200k()
    assert enc.name == "o200k_base"
    assert enc.encode_ordinary("hello world") == [24912, 2375]
    c = TokenCounter(TIKTOKEN_COUNTER)
    counts = c.count_many(["hello world", "a <|endoftext|> b"])
    assert min(counts.values()) == 2 and len(counts) == 2


def test_texts_are_counted_once_and_cached_in_the_ledger(tmp_path: Path) -> None:
    led = Ledger(tmp_path / "l.duckdb")
    c = TokenCounter(CHARS4_COUNTER, cache=led)
    c.count_many(["abcd", "abcdefgh", "abcd"])
    assert c.counted == 2
    led.commit_run({"spec_sha256": "x"}, {})
    c2 = TokenCounter(CHARS4_COUNTER, cache=led)
    memo = c2.count_many(["abcd", "abcdefgh", "xyz"])
    assert (c2.counted, c2.cache_hits) == (1, 2)
    assert (memo["abcd"], memo["abcdefgh"], memo["xyz"]) == (1, 2, 1)
    led.close()


def test_counting_expressions_evaluated_at_once_share_the_ledger_cache(tmp_path: Path) -> None:
    """Polars' in-memory engine evaluates the token columns of one plan on several threads; each
    asks the ledger's cache, whose DuckDB connection refuses a second caller ("connection is
    busy"): the counter lets one count at a time (failed 20 times of 20 without its lock)."""
    led = Ledger(tmp_path / "l.duckdb")
    for i in range(5):
        count = TokenCounter(CHARS4_COUNTER, cache=led).series_counter()
        df = pl.DataFrame({f"c{j}": [f"text {i} {j} {k:03d}" for k in range(200)] for j in range(8)})
        out = df.lazy().with_columns([tokens_expr(pl.col(f"c{j}"), count).alias(f"t{j}") for j in range(8)]) \
            .collect(engine="in-memory")
        assert out.get_column("t7").to_list() == [3] * 200  # "text i 7 kkk": 12 characters
    led.close()


def test_image_tokens() -> None:
    assert image_tokens(None, None) == 1600
    assert image_tokens(100, 75) == 10
    assert image_tokens(4000, 4000) == 1600


# the characters o200k_base's pre-tokenizer treats apart: line breaks, whitespace of every kind,
# slashes (a punctuation run takes `[\r\n/]*` after it), letters of both cases, digits, contractions,
# marks, other scripts, a special token's text
_PIECES = ["\n", "\r\n", "\r", " ", "  ", "\t", "\u00a0", "\u2028", "/", "a", "Ab", "Z", "1", "1234", ".", ",",
           "'s", "'LL", "é", "e\u0301", "日本", "🙂", "x/", "--", "\n/", "\n ", "<|endoftext|>"]


@pytest.mark.tiktoken
@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(_PIECES), max_size=60).map("".join), st.integers(1, 9))
def test_a_text_cut_where_the_pre_tokenizer_ends_a_piece_counts_as_the_whole(text: str, size: int) -> None:
    """count_utf8 counts a big text a part at a time, cut after a line break followed by an ASCII letter
    or digit: the sum is encode_ordinary's count of the whole, wherever the cuts fall (parts of
    `size` bytes and more). Cut after any line break, '.\\n/x' and ' \\n x' would count otherwise."""
    from ctxreplay.pipeline.core.tokens import count_utf8, utf8_pieces

    data = memoryview(text.encode())
    assert b"".join(utf8_pieces(data, size)) == data
    assert count_utf8(data, size=size) == len(load_o200k().encode_ordinary(text))
    assert count_utf8(data, CHARS4_COUNTER, size) == -(-len(text) // 4)


_BIG_TEXTS = ["line of the big file\n" * 40, "é naïve 日本語 <|fim_prefix|>\n" * 30, "x" * 500, "line of the big file\n" * 40,
              "short", None, "", "another short one"]


@pytest.mark.tiktoken
@pytest.mark.parametrize("name", [TIKTOKEN_COUNTER, CHARS4_COUNTER])
def test_a_big_text_in_a_column_is_counted_from_its_bytes_as_a_small_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """A text over BIG_TEXT_BYTES is counted from its bytes where polars holds them, a piece at a
    time: the counts of the texts counted whole, each distinct text counted once, its count cached in
    the ledger by the text's sha256 (as a small text's), and no Python str of it kept."""
    from ctxreplay.pipeline.core import tokens

    s = pl.Series("t", _BIG_TEXTS, pl.String)
    whole = TokenCounter(name).series_counter()(s).to_list()
    monkeypatch.setattr(tokens, "BIG_TEXT_BYTES", 100)
    monkeypatch.setattr(tokens, "PIECE_BYTES", 16)
    led = Ledger(tmp_path / "l.duckdb")
    c = TokenCounter(name, cache=led)
    assert c.series_counter()(s).to_list() == whole
    assert c.counted == 6  # three big texts, one of them twice; three small ones, the empty one among them
    assert all(len(t) <= 100 for t in c.by_text)
    assert set(c.by_sha) == {tokens.text_sha(t) for t in _BIG_TEXTS if t and len(t.encode()) > 100}
    led.commit_run({"spec_sha256": "x"}, {})
    c2 = TokenCounter(name, cache=led)
    assert c2.series_counter()(s).to_list() == whole
    assert (c2.counted, c2.cache_hits) == (0, 6)
    led.close()


@pytest.mark.tiktoken
def test_counting_a_big_text_makes_no_python_copy_of_it() -> None:
    """A 20 MB text of a column is hashed and counted without a Python str or bytes of it: Python's
    allocations (tracemalloc: str, bytes, NumPy's token buffers) peak under 8 MB. Before, to_list, the
    hash's encode and tiktoken's input each made one (60 MB and more)."""
    import tracemalloc

    s = pl.Series("t", ["line of the big file\n" * 1_000_000, "small"])
    c = TokenCounter(TIKTOKEN_COUNTER)
    count = c.series_counter()
    load_o200k()
    tracemalloc.start()
    try:
        got = count(s).to_list()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert got == [6_000_000, 1]
    assert peak < 8 << 20, f"{peak / 2**20:.0f} MiB of Python allocations"


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.one_of(st.none(), st.sampled_from(["", "a", "bb", "ccc d", "é日本", "x" * 9, "y y y"]),
                                   st.text(max_size=12)), max_size=12), min_size=1, max_size=5))
def test_a_counter_called_again_finds_each_text_it_counted_by_its_hashes(batches: list[list[str | None]]) -> None:
    """Series after series through one counter (new texts beside ones counted before, repeats, nulls):
    each count is the one a fresh counter gives that series alone, and a text is counted once in
    the counter's life (the calls after the first find it in the hash-keyed memo). Both ways of
    counting the texts it has not seen: a few through a list, more through the columnar path."""
    from ctxreplay.pipeline.core import tokens

    few = tokens._FEW
    for limit in (few, 0):
        tokens._FEW = limit
        try:
            c = TokenCounter(CHARS4_COUNTER)
            count = c.series_counter()
            for texts in batches:
                s = pl.Series("t", texts, pl.String)
                got = count(s).to_list()
                assert got == TokenCounter(CHARS4_COUNTER).series_counter()(s).to_list()
                assert got == tokens.chars4([t or "" for t in texts])  # a null is the empty text
        finally:
            tokens._FEW = few
        distinct = {t for b in batches for t in b if t is not None} | ({""} if any(None in b for b in batches) else set())
        assert c.counted == len(distinct)
        first, second, counts = c.by_key
        assert len(first) == len(second) == len(counts) == len({t for b in batches for t in b})
        assert (first[1:] >= first[:-1]).all()
