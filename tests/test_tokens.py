"""Tokens: o200k_base from the shipped file, special-token text counted, cache by sha256."""

from __future__ import annotations

import gzip
import hashlib
from pathlib import Path

import polars as pl
import pytest

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
