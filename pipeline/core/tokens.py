"""Token counting: tiktoken o200k_base loaded offline from data/tokenizer, cached by content hash.

The encoding file ships gzipped in data/tokenizer (byte-identical to OpenAI's once decompressed:
its sha256 is checked against the hash tiktoken itself pins). Counts go through
`encode_ordinary_batch` (plain `encode` raises on `<|endoftext|>`, which real transcripts hold)
and are cached in DuckDB by sha256 of the text, so a re-run never tokenizes a text twice.
"""

from __future__ import annotations

import codecs
import functools
import gzip
import hashlib
import math
import re
import struct
import threading
from collections.abc import Callable, Iterable, Iterator
from importlib.resources import files
from typing import Any

import numpy as np
import polars as pl

from ctxreplay.errors import CtxReplayError
from ctxreplay.pipeline.core.constants import CHARS4_COUNTER

# shipped inside the package (ctxreplay.data, the repository's data/): read through importlib.resources
O200K_FILE = files("ctxreplay.data") / "tokenizer" / "o200k_base.tiktoken.gz"
# the sha256 tiktoken pins for o200k_base.tiktoken (tiktoken_ext/openai_public.py)
O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"

TIKTOKEN_COUNTER = "tiktoken-o200k_base-v1"
# the seeds of the two polars hashes that key a text in a counter's memo (`series_counter`)
_SEEDS = (0x243F6A8885A308D3, 0x13198A2E03707344)
# up to this many texts a counter call maps them through a Python list (cheaper than the columnar path's calls)
_FEW = 64

_encoding: Any = None


def load_o200k() -> Any:
    """The o200k_base tiktoken Encoding, from the shipped file only (never the network)."""
    global _encoding
    if _encoding is not None:
        return _encoding
    import binascii

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
    # "<base64 token> <rank>" per line (the pinned hash vouches for the shape): split once, decoded in C
    fields = raw.split()
    ranks = dict(zip(map(binascii.a2b_base64, fields[0::2]), map(int, fields[1::2]), strict=True))
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
# a text of a column longer than this (bytes) is hashed and counted from its bytes where polars holds
# them, a piece of about PIECE_BYTES at a time (`count_utf8`), never copied whole into a Python str
# (issue 23, item 6: a 200 MB tool result had six copies of it alive while it was counted)
BIG_TEXT_BYTES = 1 << 20
PIECE_BYTES = 1 << 20
# where o200k_base's pre-tokenizer always ends a piece: after a line break followed by an ASCII letter
# or digit. Its pattern (tiktoken_ext.openai_public) puts a line break only in a run of whitespace
# ending in line breaks (`\s*[\r\n]+`) or at the end of a run of punctuation (`[\r\n/]*`), and
# neither goes on over a letter or a digit; every other alternative stops before a line break. So the
# count of a text cut there is the sum of the counts of its pieces (tests/test_tokens.py checks it).
_PIECE_END = re.compile(rb"\n(?=[A-Za-z0-9])")


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


def utf8_pieces(data: memoryview, size: int | None = None) -> Iterator[memoryview]:
    """`data` (UTF-8) cut where o200k_base always ends a piece (`_PIECE_END`), into parts of at least
    `size` bytes (default PIECE_BYTES; the last one shorter; a text with no such place is one part)."""
    size = PIECE_BYTES if size is None else size
    start, n = 0, len(data)
    while n - start > size:
        m = _PIECE_END.search(data, start + size - 1)
        if m is None:
            break
        yield data[start:m.end()]
        start = m.end()
    yield data[start:]


def count_utf8(data: memoryview, counter: str = TIKTOKEN_COUNTER, size: int | None = None) -> int:
    """What `tiktoken_counts` (or chars4) gives the text whose UTF-8 bytes are `data`, a part of about
    `size` bytes decoded at a time: the text is never held whole as a str."""
    if counter == CHARS4_COUNTER:
        chars = sum(len(codecs.decode(p, "utf-8")) for p in utf8_pieces(data, size))
        return math.ceil(chars / 4)
    enc = load_o200k()
    return sum(len(enc.encode_to_numpy(codecs.decode(p, "utf-8"), allowed_special=set(), disallowed_special=()))
               for p in utf8_pieces(data, size))


def text_bytes(s: pl.Series, i: int) -> memoryview:
    """The UTF-8 bytes of the text `s[i]` (not null) where polars holds them, without a copy (a
    string view's buffer); a copy only for a layout polars does not use today."""
    a = s.slice(i, 1).to_arrow(compat_level=pl.CompatLevel.newest())
    if str(a.type) == "string_view":
        length, _prefix, buf, offset = struct.unpack_from("<i4sii", a.buffers()[1], a.offset * 16)
        if length > 12:  # longer strings live in a data buffer; shorter ones inside the view
            return memoryview(a.buffers()[2 + buf])[offset:offset + length]
    return memoryview(str(s[i]).encode("utf-8"))


class TokenCounter:
    """Counts texts once: an in-memory map over a persistent DuckDB cache keyed by sha256."""

    def __init__(self, name: str = TIKTOKEN_COUNTER, cache: Any = None) -> None:
        self.name = name
        self.cache = cache  # ctxreplay.pipeline.staging.ledger.Ledger or None
        self.by_text: dict[str, int] = {}
        self.by_sha: dict[str, int] = {}  # counts of texts counted by their sha256 (`count_big`)
        # counts by a text's two hashes, sorted by the first (`series_counter`)
        self.by_key = (np.empty(0, np.uint64), np.empty(0, np.uint64), np.empty(0, np.int64))
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

    def count_big(self, data: memoryview) -> int:
        """The count of one text given as its UTF-8 bytes (a big text of a column: `text_bytes`),
        known by its sha256 (`text_sha`'s, in this process and in the cache) and counted from its bytes
        a piece at a time (`count_utf8`); no Python str of it is made or kept."""
        sha = hashlib.sha256(data).hexdigest()
        with self._lock:
            n = self.by_sha.get(sha)
            if n is not None:
                return n
            if self.cache is not None:
                found = self.cache.cached_tokens(self.name, [sha])
                if sha in found:
                    self.cache_hits += 1
                    self.by_sha[sha] = found[sha]
                    return found[sha]
            n = count_utf8(data, self.name)
            self.counted += 1
            self.by_sha[sha] = n
            if self.cache is not None:
                self.cache.store_tokens(self.name, {sha: n})
            return n

    def series_counter(self) -> Callable[[pl.Series], pl.Series]:
        """For StageContext.count_tokens: a Series of texts → a Series of counts (null: the empty text,
        0). A text over BIG_TEXT_BYTES is counted from its bytes where they lie (`count_big`). The
        same function at every call: the expressions made with it (row_tokens_expr) are made once."""
        made = self.__dict__.get("_series")
        if made is None:
            made = self._series = self._make_series_counter()
        return made

    def _make_series_counter(self) -> Callable[[pl.Series], pl.Series]:
        def count(s: pl.Series) -> pl.Series:
            if s.null_count():
                self.count_many([""])  # a null is the empty text (0 tokens), counted as one as it always was
            if s.dtype != pl.String:
                return count_small(s)
            # each text known by two 64-bit hashes of its bytes (polars', two seeds: no two texts of a
            # process share both): a text counted by an earlier call is found by them in the sorted
            # memo (`by_key`: numpy arrays, searched in a few numpy calls, where a polars call on a few
            # thousand rows paid ~0.3 ms of its own), never copied into Python again; only the texts
            # this counter has not seen (a null among them: 0) go the long way, each once
            ka = s.hash(_SEEDS[0]).to_numpy()
            kb = s.hash(_SEEDS[1]).to_numpy()
            ma, mb, mn = self.by_key
            if not len(ma):  # nothing counted yet: every text the long way
                n = count_texts(s)
                remember(ka, kb, n)
                return n
            at = np.searchsorted(ma, ka).clip(max=len(ma) - 1)
            hit = (ma[at] == ka) & (mb[at] == kb)
            got = mn[at]
            if hit.all():
                return pl.Series(got, dtype=pl.Int64)
            where = np.flatnonzero(~hit)
            new = count_texts(s.gather(where))
            remember(ka[where], kb[where], new)
            got[where] = new.to_numpy()
            return pl.Series(got, dtype=pl.Int64)

        def remember(ka: np.ndarray, kb: np.ndarray, n: pl.Series) -> None:
            order = np.lexsort((kb, ka))  # the new keys by the first hash, then the second
            a, b, v = ka[order], kb[order], n.cast(pl.Int64).to_numpy()[order]
            keep = np.ones(len(a), dtype=bool)  # each text once (the same text, the same count)
            keep[1:] = (a[1:] != a[:-1]) | (b[1:] != b[:-1])
            a, b, v = a[keep], b[keep], v[keep]
            with self._lock:
                ma, mb, mn = self.by_key
                at = np.searchsorted(ma, a)  # merged in order: one pass over the memo, not a sort of it
                self.by_key = (np.insert(ma, at, a), np.insert(mb, at, b), np.insert(mn, at, v))

        def count_texts(s: pl.Series) -> pl.Series:
            big = (s.str.len_bytes() > BIG_TEXT_BYTES).fill_null(False)
            if not big.any():
                return count_small(s)
            where = big.arg_true().to_list()
            rest = count_small(s.zip_with(~big, pl.Series([None], dtype=pl.String).new_from_index(0, len(s))))
            return rest.scatter(where, [self.count_big(text_bytes(s, i)) for i in where])

        def count_small(s: pl.Series) -> pl.Series:
            if len(s) <= _FEW:  # a few texts (a live step's new rows): their list, not half a dozen polars calls
                texts = s.to_list()
                memo = self.count_many(texts)
                return pl.Series([0 if t is None else memo[t] for t in texts], dtype=pl.Int64)
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


def _call_name() -> pl.Expr:
    is_call = pl.col("block_type").is_in(["tool_use", "tool_call", "function_call", "server_tool_use"])
    return pl.when(is_call).then(pl.col("tool_name"))


def _has_more_than_text() -> pl.Expr:
    """The row sends more than its text: a tool call's name, or a tool input."""
    return _call_name().is_not_null() | pl.col("tool_input").is_not_null()


def token_text_expr() -> pl.Expr:
    """What a block sends as text: its text, plus name and input for a tool call."""
    return pl.concat_str(
        [pl.col("text"), _call_name(), pl.col("tool_input")],
        separator=" ", ignore_nulls=True,
    ).fill_null("")


def per_token_text(f: Callable[[pl.Expr], pl.Expr]) -> pl.Expr:
    """`f` over what a block sends as text (`token_text_expr`, null where it is empty), without making
    a column of those texts: a row that sends only its text gives `f(text)` itself. concat_str,
    fill_null and when / then over the texts each copied every text, a 200 MB tool result included
    (issue 23, item 6); only the rows that send more than their text are joined here."""
    more = _has_more_than_text()
    joined = pl.concat_str([pl.when(more).then(pl.col("text")), _call_name(), pl.col("tool_input")],
                           separator=" ", ignore_nulls=True)
    return pl.when(more).then(f(joined)).otherwise(f(pl.col("text")))


def tokens_expr(text: pl.Expr, count: Callable[[pl.Series], pl.Series] | None) -> pl.Expr:
    """Tokens of a text column: the counter when given (StageContext.count_tokens), else ceil(chars/4)."""
    if count is None:
        return fast_token_estimate(text.fill_null("").str.len_chars())
    return text.fill_null("").map_batches(lambda s: count(s).cast(pl.Int64), return_dtype=pl.Int64, is_elementwise=True)


def is_image_expr() -> pl.Expr:
    """An image block, or an image part of a tool result."""
    return (pl.col("block_type") == "image") | (pl.col("part_type") == "image")


@functools.lru_cache(maxsize=16)
def row_tokens_expr(count: Callable[[pl.Series], pl.Series] | None) -> pl.Expr:
    """Estimated tokens of one block row, the one estimate the replay and the layers share: its
    text (with a tool call's name and input), or for an image min(1600, ceil(w*h/750)). Made once
    per counter (an expression is a value; making this one cost ~0.3 ms, a dozen times a pass)."""
    if count is None:
        per_text = per_token_text(lambda t: fast_token_estimate(t.str.len_chars().fill_null(0)))
    else:  # the counter counts a null as the empty text (`series_counter`)
        per_text = per_token_text(lambda t: t.map_batches(lambda s: count(s).cast(pl.Int64), return_dtype=pl.Int64,
                                                          is_elementwise=True))
    return pl.when(is_image_expr()).then(image_tokens_expr()).otherwise(per_text).cast(pl.Int64)


def row_tokens(blocks: pl.DataFrame, counter: TokenCounter) -> pl.Series:
    """row_tokens_expr over a frame with this counter (each distinct text tokenized once)."""
    return blocks.select(row_tokens_expr(counter.series_counter())).to_series().rename("tokens")
