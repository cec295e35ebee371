"""Token counting: tiktoken o200k_base loaded offline from data/tokenizer, cached by content hash.

The encoding file ships gzipped in data/tokenizer (byte-identical to OpenAI's once decompressed:
its sha256 is checked against the hash tiktoken itself pins). Counts go through
`encode_ordinary_batch` (plain `encode` raises on `<|endoftext|>`, which real transcripts hold)
and are cached in DuckDB by sha256 of the text, so a re-run never tokenizes a text twice.
"""

from __future__ import annotations

import gzip
import hashlib
import math
import threading
from collections.abc import Callable, Iterable
from importlib.resources import files
from typing import Any

import polars as pl

from ctxreplay.errors import CtxReplayError
from ctxreplay.pipeline.core.constants import CHARS4_COUNTER

# shipped inside the package (ctxreplay.data, the repository's data/): read through importlib.resources
O200K_FILE = files("ctxreplay.data") / "tokenizer" / "o200k_base.tiktoken.gz"
# the sha256 tiktoken pins for o200k_base.tiktoken (tiktoken_ext/openai_public.py)
O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"

TIKTOKEN_COUNTER = "tiktoken-o200k_base-v1"

_encoding: Any = None


def load_o200k() -> Any:
    """The o200k_base tiktoken Encoding, from the shipped file only (never the network)."""
    global _encoding
    if _encoding is not None:
        return _encoding
    import base64

    import tiktoken
    import tiktoken_ext.openai_public as public

    if not O200K_FILE.is_file():
        msg = f"tokenizer file missing: {O200K_FILE}. Reinstall ctxreplay: its wheel ships this file"
        raise CtxReplayError(msg)
    raw = gzip.decompress(O200K_FILE.read_bytes())
    digest = hashlib.sha256(raw).hexdigest()
    if digest != O200K_SHA256:
        msg = (f"tokenizer file {O200K_FILE} is corrupt: sha256 {digest}, expected {O200K_SHA256} "
               f"(the hash tiktoken pins for o200k_base). Reinstall ctxreplay")
        raise CtxReplayError(msg)
    ranks = {base64.b64decode(tok): int(rank) for tok, rank in (ln.split() for ln in raw.splitlines() if ln)}
    # borrow tiktoken's own constructor arguments (pattern, special tokens) without its download
    original = public.load_tiktoken_bpe
    public.load_tiktoken_bpe = lambda *a, **k: ranks  # type: ignore[assignment]
    try:
        spec = public.o200k_base()
    finally:
        public.load_tiktoken_bpe = original  # type: ignore[assignment]
    _encoding = tiktoken.Encoding(name=spec["name"], pat_str=spec["pat_str"],
                                  mergeable_ranks=spec["mergeable_ranks"], special_tokens=spec["special_tokens"])
    return _encoding


def text_sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def chars4(texts: Iterable[str]) -> list[int]:
    """The fast estimator: ceil(chars / 4)."""
    return [math.ceil(len(t) / 4) for t in texts]


# a text longer than this (characters) is counted on its own into a NumPy array of token ids: in a
# list, each id is a Python int (about 36 bytes a token: a 50 MB tool result took 700 MB more)
BIG_TEXT_CHARS = 1 << 20


def tiktoken_counts(texts: list[str], threads: int = 2) -> list[int]:
    enc = load_o200k()
    # lone surrogates replaced (an ASCII text holds none: no copy of it)
    safe = [t if t.isascii() else t.encode("utf-8", "replace").decode("utf-8") for t in texts]
    small = [i for i, t in enumerate(safe) if len(t) <= BIG_TEXT_CHARS]
    out = [0] * len(safe)
    for i, ids in zip(small, enc.encode_ordinary_batch([safe[i] for i in small], num_threads=threads), strict=True):
        out[i] = len(ids)
    for i, t in enumerate(safe):
        if len(t) > BIG_TEXT_CHARS:  # no special token recognised: what encode_ordinary counts
            out[i] = len(enc.encode_to_numpy(t, allowed_special=set(), disallowed_special=()))
    return out


class TokenCounter:
    """Counts texts once: an in-memory map over a persistent DuckDB cache keyed by sha256."""

    def __init__(self, name: str = TIKTOKEN_COUNTER, cache: Any = None) -> None:
        self.name = name
        self.cache = cache  # ctxreplay.pipeline.staging.ledger.Ledger or None
        self.by_text: dict[str, int] = {}
        self.counted = 0  # texts tokenized in this process
        self.cache_hits = 0
        # polars may evaluate several counting expressions of one plan at once (its in-memory
        # engine does, on its own threads), and the cache's DuckDB connection refuses a second
        # caller instead of waiting: one counting at a time
        self._lock = threading.Lock()

    def _count(self, texts: list[str]) -> list[int]:
        if self.name == CHARS4_COUNTER:
            return chars4(texts)
        return tiktoken_counts(texts)

    def count_many(self, texts: Iterable[str]) -> dict[str, int]:
        """text → tokens for these texts (each counted once per process, and once ever with a cache).
        Safe to call from several threads at once."""
        with self._lock:
            return self._count_many(texts)

    def _count_many(self, texts: Iterable[str]) -> dict[str, int]:
        memo = self.by_text
        todo = {t for t in texts if t is not None and t not in memo}
        if not todo:
            return memo
        by_sha = {text_sha(t): t for t in todo}
        if self.cache is not None:
            found = self.cache.cached_tokens(self.name, list(by_sha))
            self.cache_hits += len(found)
            for sha, n in found.items():
                memo[by_sha.pop(sha)] = n
        if by_sha:
            shas = list(by_sha)
            counts = self._count([by_sha[s] for s in shas])
            self.counted += len(shas)
            for sha, n in zip(shas, counts):
                memo[by_sha[sha]] = n
            if self.cache is not None:
                self.cache.store_tokens(self.name, dict(zip(shas, counts)))
        return memo

    def series_counter(self) -> Callable[[pl.Series], pl.Series]:
        """For StageContext.count_tokens: a Series of texts → a Series of counts (null → 0)."""

        def count(s: pl.Series) -> pl.Series:
            unique = s.drop_nulls().unique()
            distinct = unique.to_list()
            memo = self.count_many(distinct)
            counts = [memo[t] for t in distinct]
            hashes = unique.hash()
            if hashes.n_unique() == len(hashes):
                # mapped by each text's hash (no two distinct texts share one here), not by the texts:
                # replace_strict over texts copied each of them (a 50 MB tool result three times)
                return s.hash().replace_strict(hashes, counts, default=0, return_dtype=pl.Int64) \
                    .zip_with(s.is_not_null(), pl.Series([0], dtype=pl.Int64).new_from_index(0, len(s)))
            return s.replace_strict(distinct, counts, default=0, return_dtype=pl.Int64).fill_null(0)

        return count


IMAGE_MAX_TOKENS = 1600


def image_tokens(width: int | None, height: int | None) -> int:
    """min(1600, ceil(w*h/750)); unknown size = 1600 (layer-semantics §1)."""
    if not width or not height:
        return IMAGE_MAX_TOKENS
    return min(IMAGE_MAX_TOKENS, math.ceil(width * height / 750))


def image_tokens_expr() -> pl.Expr:
    """min(1600, ceil(w*h/750)); unknown size = 1600 (the columnar form of image_tokens)."""
    w, h = pl.col("image_width").cast(pl.Int64), pl.col("image_height").cast(pl.Int64)
    known = w.is_not_null() & h.is_not_null() & (w > 0) & (h > 0)
    return pl.when(known).then(pl.min_horizontal(pl.lit(IMAGE_MAX_TOKENS, pl.Int64), (w * h + 749) // 750)) \
        .otherwise(pl.lit(IMAGE_MAX_TOKENS, pl.Int64))


def fast_token_estimate(chars: pl.Expr) -> pl.Expr:
    """The fast estimator of layer-semantics §1: ceil(chars / 4)."""
    return (chars.cast(pl.Int64) + 3) // 4


def token_text_expr() -> pl.Expr:
    """What a block sends as text: its text, plus name and input for a tool call."""
    is_call = pl.col("block_type").is_in(["tool_use", "tool_call", "function_call", "server_tool_use"])
    return pl.concat_str(
        [pl.col("text"), pl.when(is_call).then(pl.col("tool_name")), pl.col("tool_input")],
        separator=" ", ignore_nulls=True,
    ).fill_null("")


def tokens_expr(text: pl.Expr, count: Callable[[pl.Series], pl.Series] | None) -> pl.Expr:
    """Tokens of a text column: the counter when given (StageContext.count_tokens), else ceil(chars/4)."""
    if count is None:
        return fast_token_estimate(text.fill_null("").str.len_chars())
    return text.fill_null("").map_batches(lambda s: count(s).cast(pl.Int64), return_dtype=pl.Int64)


def is_image_expr() -> pl.Expr:
    """An image block, or an image part of a tool result."""
    return (pl.col("block_type") == "image") | (pl.col("part_type") == "image")


def row_tokens_expr(count: Callable[[pl.Series], pl.Series] | None) -> pl.Expr:
    """Estimated tokens of one block row, the one estimate the replay and the layers share: its
    text (with a tool call's name and input), or for an image min(1600, ceil(w*h/750))."""
    return pl.when(is_image_expr()).then(image_tokens_expr()).otherwise(tokens_expr(token_text_expr(), count)).cast(pl.Int64)


def row_tokens(blocks: pl.DataFrame, counter: TokenCounter) -> pl.Series:
    """row_tokens_expr over a frame with this counter (each distinct text tokenized once)."""
    return blocks.select(row_tokens_expr(counter.series_counter())).to_series().rename("tokens")
