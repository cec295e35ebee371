"""Prices per request: genai-prices' data, local overrides (TOML), and the modifiers usage carries.

Usage is normalised Anthropic-style before it is priced: `input` (uncached prompt tokens),
`output`, `cache_write_5m`, `cache_write_1h`, `cache_read`; the prompt of a request is
`input + cache_write_5m + cache_write_1h + cache_read` (OpenAI's `prompt_tokens` includes its
cached tokens: subtract them before calling). Rates are USD per million tokens.

```python
book = PriceBook.load(Path("prices.toml"))           # or PriceBook.load() for genai-prices only
p = book.price("claude-opus-4-6", "2026-02-10T21:58:17Z", 3, 780, 512, 0, 20480,
               modifiers=usage_modifiers(usage))      # speed / service_tier / inference_geo
p.total_usd if p else "unpriced"                      # None: the model has no price: never 0
book.rate_table(keys)  # one row of rates per (model, day, modifiers, provider): join it in DuckDB
book.price_frame(df)   # the same for a polars frame of calls: adds cost_usd
```

Where the rates come from, in order: an entry of the overrides file (`--prices FILE`) whose id
matches the model; genai-prices (its version is `book.genai_prices_version`). Modifiers:
- long-context tiers as genai-prices states them, plus LONG_CONTEXT_ADDED where it lacks one: the
  whole request is priced at the tier's rates once the prompt (input + cache writes + cache reads;
  output never counts) exceeds the threshold (`tier_rule="request"`, the provider's rule);
  `ccusage_long_context` swaps in ccusage 20's tiers and `tier_rule="category"` splits each usage
  category at the threshold separately, as ccusage does (`report --compat ccusage`);
- `speed = "fast"`: genai-prices' fast variant where it has one, else the multiplier in
  FAST_MULTIPLIERS (ccusage's overrides and Anthropic's docs: 6× for Opus 4.6 / 4.7), else the
  standard rates with a warning in `book.warnings`;
- `service_tier = "batch"`: genai-prices' batch variant, else half price (Batch API: -50 %);
  `priority` / `flex`: genai-prices' service-tier variants where present;
- `inference_geo = "us"`: ×1.1 on Anthropic models from Claude 4.6 on (US-only inference).

Lookups are cached per (provider, model, UTC day, modifiers) in memory and on disk
(`$CTXREPLAY_CACHE_DIR`, else `$XDG_CACHE_HOME/ctxreplay`, else `~/.cache/ctxreplay`; one file
per genai-prices version), so a warm run never imports genai-prices (which takes about 0.4 s).
Models whose genai-prices entry has time-of-day prices (DeepSeek's off-peak hours) are cached
per minute instead.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Iterable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, replace
from datetime import UTC, date, datetime
from pathlib import Path
from typing import Any, Literal

from ctxreplay.errors import PriceError

GENAI_PRICES = "genai-prices"
CACHE_FORMAT = 2   # 2: LONG_CONTEXT_ADDED (a format-1 cache holds Sonnet 4 without its tier)
TOKEN_KINDS = ("input", "output", "cache_write_5m", "cache_write_1h", "cache_read")

# speed = "fast" where genai-prices has no fast variant for the model (its ids). Sources: the
# facts page (../shared/docs/cost-and-cache.md §2.2): ccusage's overrides and the Opus docs.
FAST_MULTIPLIERS: dict[str, float] = {"claude-opus-4-6": 6.0, "claude-opus-4-7": 6.0}
BATCH_MULTIPLIER = 0.5

# Anthropic's long-context tier, by model family (genai-prices' ids). Sources: Anthropic's pricing
# page as quoted on the facts page (../shared/docs/cost-and-cache.md §1.6, §2.2): with the 1M
# context window, "if your request exceeds 200K input tokens, all tokens incur premium pricing",
# 2x input and 1.5x output, cache writes and reads scaled as input; the threshold counts input
# tokens "including cache reads and writes", output never. Anthropic's support article 8606395
# (before 2026-03-13) names the 1M models: Opus 4.6, Sonnet 4.5, Sonnet 4; the 1M window went GA
# at standard rates for Opus 4.6 and Sonnet 4.6 on 2026-03-13 (agentmastered.com/blog/1m-context-ga,
# claudecodecamp.com). genai-prices 0.2.3 states the tier for claude-sonnet-4-5 (always),
# claude-opus-4-6 and claude-sonnet-4-6 (until 2026-03-13: its StartDateConstraint), but not for
# claude-sonnet-4-0 (the 1M beta of 2025-08): ctxreplay adds that one. Opus 4 / 4.1 / 4.5 / 4.7 /
# 4.8, Haiku 4.5 and Claude 3.x have no long-context tier (a 200k window, or 1M at standard rates).
LONG_CONTEXT_THRESHOLD = 200_000
LONG_CONTEXT_MULTIPLIERS = (2.0, 1.5, 2.0, 2.0, 2.0)   # TOKEN_KINDS order
LONG_CONTEXT_ADDED: frozenset[str] = frozenset({"claude-sonnet-4-0"})
# ccusage 20.0.24 (run offline on one-request trees, each family at 200,000 / 200,001 / 300,000 of
# input, of cache reads, of 5m and 1h writes, and 250,000 output tokens, dated 2025-09, 2026-02 and
# 2026-04): only Sonnet 4 and Sonnet 4.5 have a tier (the same rates, above 200,000 tokens), on any
# date; every other Claude model, Opus 4.6 and Sonnet 4.6 included, is priced at base rates however
# large the request. It splits each usage category at the threshold (see `price_with`).
CCUSAGE_LONG_CONTEXT: frozenset[str] = frozenset({"claude-sonnet-4-0", "claude-sonnet-4-5"})
US_GEO_MULTIPLIER = 1.1
# Anthropic models priced before US-only inference existed (no ×1.1); every later one pays it.
_GEO_EXEMPT = re.compile(r"^claude-(?:2|v1|3|instant|opus-4-[015]$|opus-4-0|sonnet-4-[05]$|haiku-4-5$)")
_CLAUDE_CLOUD = re.compile(r"^(?:[a-z]{2,6}\.)?anthropic\.(claude-.+?)(?:-v\d+(?::\d+)?)?$")

Modifiers = tuple[tuple[str, str], ...]
TierRule = Literal["request", "category"]


@dataclass(frozen=True, slots=True)
class TokenRates:
    """USD per million tokens for the five usage categories."""

    input: float
    output: float
    cache_write_5m: float
    cache_write_1h: float
    cache_read: float

    def scaled(self, factor: float) -> TokenRates:
        return TokenRates(*(getattr(self, k) * factor for k in TOKEN_KINDS))

    def as_dict(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in TOKEN_KINDS}


@dataclass(frozen=True, slots=True)
class Rates:
    """Everything needed to price one model's requests on one day under one set of modifiers."""

    model_id: str
    """The id of the price entry (genai-prices' model id, or the overrides key)."""
    source: str
    """`genai-prices 0.2.3` or `overrides <file>`."""
    base: TokenRates
    tiers: tuple[tuple[int, TokenRates], ...] = ()
    """(threshold, rates), ascending: a request whose prompt exceeds the threshold uses the rates."""
    per_request: float = 0.0
    """USD per request."""
    web_search: float = 0.0
    """USD per web search request."""
    notes: tuple[str, ...] = ()
    """Modifiers applied on top of the source's rates (e.g. `fast ×6`)."""

    def at(self, prompt_tokens: int) -> TokenRates:
        """The rates of a request with this prompt size (the provider's whole-request rule)."""
        return tier_of(prompt_tokens, self.base, self.tiers)[0]

    def scaled(self, factor: float, note: str) -> Rates:
        return replace(self, base=self.base.scaled(factor),
                       tiers=tuple((a, r.scaled(factor)) for a, r in self.tiers), notes=self.notes + (note,))

    def to_json(self) -> dict[str, Any]:
        return {"model_id": self.model_id, "source": self.source, "base": list(_five(self.base)),
                "tiers": [[a, list(_five(r))] for a, r in self.tiers], "per_request": self.per_request,
                "web_search": self.web_search, "notes": list(self.notes)}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Rates:
        return cls(d["model_id"], d["source"], TokenRates(*d["base"]),
                   tuple((int(a), TokenRates(*r)) for a, r in d["tiers"]), float(d["per_request"]),
                   float(d["web_search"]), tuple(d["notes"]))


@dataclass(frozen=True, slots=True)
class Price:
    """The cost of one request, by usage category (USD)."""

    input_usd: float
    output_usd: float
    cache_write_5m_usd: float
    cache_write_1h_usd: float
    cache_read_usd: float
    other_usd: float
    """Per-request and web-search charges."""
    rates: Rates
    tier_above: int | None
    """The threshold of the tier used (whole-request rule), None for the base rates."""

    @property
    def total_usd(self) -> float:
        return (self.input_usd + self.output_usd + self.cache_write_5m_usd + self.cache_write_1h_usd
                + self.cache_read_usd + self.other_usd)


def _five(r: TokenRates) -> tuple[float, float, float, float, float]:
    return (r.input, r.output, r.cache_write_5m, r.cache_write_1h, r.cache_read)


def long_context_tier(base: TokenRates) -> tuple[int, TokenRates]:
    """Anthropic's long-context tier of a model whose standard rates are `base`: above
    LONG_CONTEXT_THRESHOLD prompt tokens, 2x input, cache writes and reads, 1.5x output."""
    return LONG_CONTEXT_THRESHOLD, TokenRates(*(v * m for v, m in zip(_five(base), LONG_CONTEXT_MULTIPLIERS,
                                                                        strict=True)))


def ccusage_long_context(r: Rates) -> Rates:
    """`r` with ccusage 20's long-context tiers in place of the provider's (CCUSAGE_LONG_CONTEXT):
    for genai-prices' Claude models only; an overrides entry, or another provider's model, keeps
    its own tiers. Price the result with `tier_rule="category"` to compute as ccusage does."""
    if not (r.source.startswith(GENAI_PRICES) and r.model_id.startswith("claude-")):
        return r
    tiers = (long_context_tier(r.base),) if r.model_id in CCUSAGE_LONG_CONTEXT else ()
    return r if tiers == r.tiers else replace(r, tiers=tiers)


# ---------------------------------------------------------------------------------------------
# the provider's whole-request rule, written once. It is evaluated in three forms: Python numbers
# (price_with, Rates.at, the report's per-record pricing), polars expressions (price_frame) and
# DuckDB SQL text (cost_sql). A form brings its values (the counts; the rates as a TokenRates whose
# fields hold the form's values) and its `pick(cond, then, otherwise)`; comparisons and arithmetic
# are the form's operators.

def _pick(cond: Any, then: Any, otherwise: Any) -> Any:
    return then if cond else otherwise


def tier_of(prompt: Any, base: Any, tiers: Iterable[tuple[Any, Any]],
            pick: Callable[[Any, Any, Any], Any] = _pick) -> tuple[Any, Any]:
    """(rates, threshold) of a request whose prompt is `prompt` tokens: those of the last tier
    (ascending) whose threshold the prompt exceeds, else `base` and None. In a vectorised form a
    null threshold (a model with fewer tiers than the widest) never picks its tier."""
    rates, used = base, None
    for above, tier in tiers:
        hit = prompt > above
        rates = pick(hit, tier, rates)
        used = pick(hit, above, used)
    return rates, used


def request_usd(counts: tuple[Any, Any, Any, Any, Any], base: Any, tiers: Iterable[tuple[Any, Any]],
                pick: Callable[[Any, Any, Any], Any] = _pick) -> tuple[Any, Any, Any, Any, Any, Any]:
    """The USD of one request's five counts (TOKEN_KINDS order) and the threshold of the tier used
    (None: the base rates): the prompt (input + cache writes + cache reads) picks the tier
    (`tier_of`), and every count is priced at that tier's rate (USD per million tokens)."""
    n_in, n_out, n_5m, n_1h, n_read = counts
    r, used = tier_of(n_in + n_5m + n_1h + n_read, base, tiers, pick)
    return (n_in * r.input / 1e6, n_out * r.output / 1e6, n_5m * r.cache_write_5m / 1e6,
            n_1h * r.cache_write_1h / 1e6, n_read * r.cache_read / 1e6, used)


class _Sql(str):
    """SQL text that `request_usd` can compute with (its operators write SQL)."""

    __slots__ = ()

    def __add__(self, other: object) -> _Sql:
        return _Sql(f"({self} + {other})")

    def __mul__(self, other: object) -> _Sql:  # type: ignore[override]
        return _Sql(f"{self} * {other}")

    def __truediv__(self, other: object) -> _Sql:
        return _Sql(f"{self} / {other}")

    def __gt__(self, other: object) -> _Sql:  # type: ignore[override]
        return _Sql(f"{self} > {other}")


def _sql_pick(cond: Any, then: Any, otherwise: Any) -> Any:
    if isinstance(then, TokenRates):
        return TokenRates(*(_sql_pick(cond, a, b) for a, b in zip(_five(then), _five(otherwise), strict=True)))
    return _Sql(f"CASE WHEN {cond} THEN {then} ELSE {'NULL' if otherwise is None else otherwise} END")


def _polars_pick(pl: Any) -> Callable[[Any, Any, Any], Any]:
    def pick(cond: Any, then: Any, otherwise: Any) -> Any:
        if isinstance(then, TokenRates):
            return TokenRates(*(pick(cond, a, b) for a, b in zip(_five(then), _five(otherwise), strict=True)))
        return pl.when(cond).then(then).otherwise(otherwise)
    return pick


def modifiers(*, speed: Any = None, service_tier: Any = None, inference_geo: Any = None) -> Modifiers:
    """The billing-relevant modifiers in canonical form; values that do not change a price are dropped."""
    out = []
    if isinstance(inference_geo, str) and inference_geo.lower() == "us":
        out.append(("inference_geo", "us"))
    if isinstance(service_tier, str) and service_tier.lower() in ("batch", "priority", "flex"):
        out.append(("service_tier", service_tier.lower()))
    if isinstance(speed, str) and speed.lower() == "fast":
        out.append(("speed", "fast"))
    return tuple(out)


def usage_modifiers(usage: Mapping[str, Any]) -> Modifiers:
    """Modifiers from an Anthropic usage object (`speed`, `service_tier`, `inference_geo`)."""
    return modifiers(speed=usage.get("speed"), service_tier=usage.get("service_tier"),
                     inference_geo=usage.get("inference_geo"))


def modifiers_key(mods: Modifiers) -> str:
    """`speed=fast;service_tier=batch`: the modifiers as one string column value ('' for none)."""
    return ";".join(f"{k}={v}" for k, v in mods)


def parse_modifiers_key(text: str | None) -> Modifiers:
    if not text:
        return ()
    return tuple(tuple(p.split("=", 1)) for p in text.split(";"))  # type: ignore[misc]


def _day_minute(when: str | date | datetime) -> tuple[str, str]:
    """(UTC day 'YYYY-MM-DD', UTC minute 'HH:MM') of a timestamp."""
    if isinstance(when, str):
        if len(when) >= 16 and when.endswith("Z") and when[10] == "T":
            return when[:10], when[11:16]
        if len(when) == 10:
            return when, "00:00"
        try:
            when = datetime.fromisoformat(when)
        except ValueError as exc:
            raise PriceError(f"timestamp {when!r} is not ISO-8601; pass e.g. 2026-02-10T21:58:17Z") from exc
    if isinstance(when, datetime):
        if when.tzinfo is not None:
            when = when.astimezone(UTC)
        return when.strftime("%Y-%m-%d"), when.strftime("%H:%M")
    return when.isoformat(), "00:00"


# ---------------------------------------------------------------------------------------------
# overrides file


@dataclass(frozen=True)
class _Override:
    key: str
    match: str               # "exact" | "prefix"
    since: date | None
    rates: Rates
    fast_multiplier: float | None
    batch_multiplier: float
    us_multiplier: float


_OVERRIDE_KEYS = {"input", "output", "cache_write_5m", "cache_write_1h", "cache_read", "match", "since",
                  "fast_multiplier", "batch_multiplier", "us_multiplier", "web_search", "per_request", "tier"}
_TIER_KEYS = {"above", "input", "output", "cache_write_5m", "cache_write_1h", "cache_read"}


def _num(path: Path, where: str, name: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
        raise PriceError(f"{path}: {where}: {name} must be a non-negative number (USD per million tokens); "
                         f"got {v!r}")
    return float(v)


def _token_rates(path: Path, where: str, d: Mapping[str, Any], fallback: TokenRates | None) -> TokenRates:
    if fallback is None:
        for req in ("input", "output"):
            if req not in d:
                raise PriceError(f"{path}: {where}: '{req}' is required (USD per million tokens); write e.g. "
                                 f"input = 3.0 and output = 15.0")
    base = fallback
    inp = _num(path, where, "input", d["input"]) if "input" in d else base.input  # type: ignore[union-attr]
    out = _num(path, where, "output", d["output"]) if "output" in d else base.output  # type: ignore[union-attr]
    # the genai-prices rule for a missing rate: a more specific unit falls back to the general one
    cw5 = (_num(path, where, "cache_write_5m", d["cache_write_5m"]) if "cache_write_5m" in d
           else base.cache_write_5m if base else inp)
    cw1 = (_num(path, where, "cache_write_1h", d["cache_write_1h"]) if "cache_write_1h" in d
           else base.cache_write_1h if base else cw5)
    cr = (_num(path, where, "cache_read", d["cache_read"]) if "cache_read" in d
          else base.cache_read if base else inp)
    return TokenRates(inp, out, cw5, cw1, cr)


def load_overrides(path: Path) -> list[_Override]:
    """Read a `--prices` TOML file (format in README.md, "Prices")."""
    import tomllib

    try:
        doc = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise PriceError(f"{path}: cannot be read: {exc.strerror}. Check the --prices path") from exc
    except tomllib.TOMLDecodeError as exc:
        raise PriceError(f"{path}: not valid TOML: {exc}") from exc
    extra = set(doc) - {"models"}
    if extra:
        raise PriceError(f"{path}: unknown top-level key(s) {sorted(extra)}; prices go in [models.\"<model id>\"] "
                         f"tables")
    models = doc.get("models", {})
    if not isinstance(models, dict):
        raise PriceError(f"{path}: 'models' must be a table of [models.\"<model id>\"] entries")
    out: list[_Override] = []
    for key, entries in models.items():
        for i, d in enumerate(entries if isinstance(entries, list) else [entries]):
            where = f'[models."{key}"]' + (f" #{i + 1}" if isinstance(entries, list) else "")
            if not isinstance(d, dict):
                raise PriceError(f"{path}: {where} must be a table of rates")
            unknown = set(d) - _OVERRIDE_KEYS
            if unknown:
                raise PriceError(f"{path}: {where}: unknown key(s) {sorted(unknown)}; allowed: "
                                 f"{', '.join(sorted(_OVERRIDE_KEYS))}")
            match = d.get("match", "exact")
            if match not in ("exact", "prefix"):
                raise PriceError(f"{path}: {where}: match must be 'exact' or 'prefix'; got {match!r}")
            since = d.get("since")
            if since is not None and not (isinstance(since, date) and not isinstance(since, datetime)):
                raise PriceError(f"{path}: {where}: since must be a TOML date such as 2026-03-13 (no quotes); "
                                 f"got {since!r}")
            base = _token_rates(path, where, d, None)
            tiers_raw = d.get("tier", [])
            tiers_raw = tiers_raw if isinstance(tiers_raw, list) else [tiers_raw]
            tiers = []
            for j, t in enumerate(tiers_raw):
                tw = f"{where} tier #{j + 1}"
                if not isinstance(t, dict) or "above" not in t:
                    raise PriceError(f"{path}: {tw}: a tier needs 'above' (prompt tokens) and the rates above it")
                bad = set(t) - _TIER_KEYS
                if bad:
                    raise PriceError(f"{path}: {tw}: unknown key(s) {sorted(bad)}")
                above = t["above"]
                if isinstance(above, bool) or not isinstance(above, int) or above < 0:
                    raise PriceError(f"{path}: {tw}: above must be a whole number of prompt tokens; got {above!r}")
                tiers.append((above, _token_rates(path, tw, t, base)))
            tiers.sort(key=lambda x: x[0])
            rates = Rates(key, f"overrides {path}", base, tuple(tiers),
                          per_request=_num(path, where, "per_request", d.get("per_request", 0.0)),
                          web_search=_num(path, where, "web_search", d.get("web_search", 0.0)) / 1000.0)
            fast = d.get("fast_multiplier")
            out.append(_Override(key.lower(), match, since, rates,
                                 None if fast is None else _num(path, where, "fast_multiplier", fast),
                                 _num(path, where, "batch_multiplier", d.get("batch_multiplier", BATCH_MULTIPLIER)),
                                 _num(path, where, "us_multiplier", d.get("us_multiplier", 1.0))))
    # exact before prefix, longer prefixes first, later `since` first
    out.sort(key=lambda o: (o.match != "exact", -len(o.key), -(o.since.toordinal() if o.since else 0)))
    return out


# ---------------------------------------------------------------------------------------------
# genai-prices, imported only on a cache miss


def _genai_dir() -> Path | None:
    import importlib.util

    spec = importlib.util.find_spec("genai_prices")
    if spec is None or not spec.origin:
        return None
    return Path(spec.origin).parent


def genai_prices_version() -> str:
    """The installed genai-prices version, read from its dist-info (importing it takes ~0.4 s)."""
    pkg = _genai_dir()
    if pkg is None:
        raise PriceError("genai-prices is not installed; install ctxreplay's dependencies "
                         "(pip install -e .) or pass --prices with every model you use")
    for d in pkg.parent.glob("genai_prices-*.dist-info"):
        return d.name[len("genai_prices-"):-len(".dist-info")]
    from importlib.metadata import version

    return version(GENAI_PRICES)


# the commands' --no-cache: no disk cache of prices for this command (neither read nor written)
NO_CACHE: ContextVar[bool] = ContextVar("ctxreplay_no_cache", default=False)


def default_cache_dir() -> Path | None:
    """Where prices are cached on disk: None (no disk cache) under --no-cache (NO_CACHE) or with
    CTXREPLAY_CACHE_DIR set empty; else $CTXREPLAY_CACHE_DIR, $XDG_CACHE_HOME/ctxreplay,
    ~/.cache/ctxreplay."""
    if NO_CACHE.get():
        return None
    env = os.environ.get("CTXREPLAY_CACHE_DIR")
    if env is not None:
        return Path(env) if env else None
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "ctxreplay"


class _Default:
    pass


_DEFAULT = _Default()


def _dec(v: Any) -> float:
    return float(v)


def _genai_rates(price: Any, model_id: str, source: str) -> Rates | None:
    """genai-prices' ModelPrice → Rates, following its leaf rules (a missing specific rate takes the
    general one: 5m/1h writes → cache writes → input; reads → input)."""
    from genai_prices.types import TieredPrices

    def get(k: str) -> Any:
        return getattr(price, k, None)

    inp, out = get("input_mtok"), get("output_mtok")
    if inp is None and out is None:
        return None
    zero = 0
    inp = zero if inp is None else inp
    out = zero if out is None else out
    cw = get("cache_write_mtok")
    cw5 = get("cache_write_5m_mtok")
    cw1 = get("cache_write_1h_mtok")
    cr = get("cache_read_mtok")
    values = [inp, out, cw5 if cw5 is not None else cw if cw is not None else inp,
              cw1 if cw1 is not None else cw if cw is not None else inp, cr if cr is not None else inp]

    def at(v: Any, threshold: int | None) -> float:
        if isinstance(v, TieredPrices):
            chosen = v.base
            if threshold is not None:
                for t in v.tiers:
                    if t.start <= threshold:
                        chosen = t.price
            return _dec(chosen)
        return _dec(v)

    thresholds = sorted({t.start for v in values if isinstance(v, TieredPrices) for t in v.tiers})
    base = TokenRates(*(at(v, None) for v in values))
    tiers = tuple((th, TokenRates(*(at(v, th) for v in values))) for th in thresholds)
    per_req = get("requests_kcount")
    web = get("web_searches_kcount")
    return Rates(model_id, source, base, tiers,
                 per_request=at(per_req, None) / 1000.0 if per_req is not None else 0.0,
                 web_search=at(web, None) / 1000.0 if web is not None else 0.0)


class PriceBook:
    """Rates per (model, day, modifiers, provider) from overrides and genai-prices, cached."""

    def __init__(self, overrides: list[_Override], overrides_path: Path | None, version: str,
                 cache_dir: Path | None):
        self.overrides = overrides
        self.overrides_path = overrides_path
        self.genai_prices_version = version
        self.cache_dir = cache_dir
        self.warnings: list[str] = []
        self._warned: set[str] = set()
        self._memo: dict[tuple[str, str, str, Modifiers], Rates | None] = {}
        self._lookups: dict[str, dict[str, Any]] = {}   # "provider|model" → {"id", "tod"}
        self._disk: dict[str, Any] = {}                 # "provider|model|day[ minute]|mods" → rates json | None
        self._dirty = False
        self._cache_file: Path | None = None
        self._genai: Any = None
        if cache_dir is not None:
            self._load_cache()

    # -- construction --------------------------------------------------------------------------
    @classmethod
    def load(cls, overrides: Path | None = None, *, cache_dir: Path | None | _Default = _DEFAULT) -> PriceBook:
        """genai-prices (+ the overrides file when given); `cache_dir=None` turns the disk cache off."""
        ov = load_overrides(overrides) if overrides is not None else []
        cd = default_cache_dir() if isinstance(cache_dir, _Default) else cache_dir
        return cls(ov, overrides, genai_prices_version(), cd)

    def _stamp(self) -> str:
        pkg = _genai_dir()
        try:
            st = (pkg / "data.py").stat() if pkg else None
        except OSError:
            st = None
        return f"{self.genai_prices_version}:{st.st_size}:{st.st_mtime_ns}" if st else self.genai_prices_version

    def _load_cache(self) -> None:
        import orjson

        assert self.cache_dir is not None
        self._cache_file = self.cache_dir / f"genai-prices-{self.genai_prices_version}.json"
        try:
            doc = orjson.loads(self._cache_file.read_bytes())
        except (OSError, orjson.JSONDecodeError):
            return
        if doc.get("format") == CACHE_FORMAT and doc.get("stamp") == self._stamp():
            self._lookups = doc.get("lookups", {})
            self._disk = doc.get("rates", {})

    def save(self) -> None:
        """Write new lookups to the disk cache (atomic; a cache that cannot be written is skipped)."""
        if not self._dirty or self._cache_file is None:
            return
        import orjson

        try:
            self._cache_file.parent.mkdir(parents=True, exist_ok=True)
            tmp = self._cache_file.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_bytes(orjson.dumps({"format": CACHE_FORMAT, "stamp": self._stamp(),
                                          "lookups": self._lookups, "rates": self._disk}))
            os.replace(tmp, self._cache_file)
            self._dirty = False
        except OSError:
            pass

    def export_lookups(self) -> dict[str, Any] | None:
        """What this book learned (genai-prices lookups and warnings), for `import_lookups` in another
        process: worker processes hand their lookups to the parent, which saves the disk cache."""
        if not self._dirty and not self.warnings:
            return None
        return {"lookups": self._lookups, "rates": self._disk, "warnings": self.warnings}

    def import_lookups(self, got: Mapping[str, Any]) -> None:
        new_lookups = {k: v for k, v in got["lookups"].items() if k not in self._lookups}
        new_rates = {k: v for k, v in got["rates"].items() if k not in self._disk}
        if new_lookups or new_rates:
            self._lookups.update(new_lookups)
            self._disk.update(new_rates)
            self._dirty = True
        for w in got["warnings"]:
            self._warn(w)

    def _warn(self, msg: str) -> None:
        if msg not in self._warned:
            self._warned.add(msg)
            self.warnings.append(msg)

    @property
    def source(self) -> str:
        s = f"{GENAI_PRICES} {self.genai_prices_version}"
        return s + (f" + overrides {self.overrides_path}" if self.overrides_path else "")

    # -- lookups -------------------------------------------------------------------------------
    def rates(self, model: str, when: str | date | datetime, mods: Modifiers = (),
              provider: str | None = None) -> Rates | None:
        """The rates for `model` at `when` (UTC) under `mods`; None when nobody prices the model."""
        day, minute = _day_minute(when)
        key = (model, provider or "", day, mods)
        got = self._memo.get(key, _DEFAULT)
        if got is not _DEFAULT:
            return got  # type: ignore[return-value]
        r = self._override_rates(model, day, mods)
        if r is None:
            r = self._genai_cached(model, provider, day, minute, mods)
        if r is None or not self.time_of_day(model, provider):
            self._memo[key] = r
        return r

    def time_of_day(self, model: str, provider: str | None = None) -> bool:
        """True when the model's genai-prices entry changes with the time of day (rates cached per minute)."""
        lk = self._lookups.get(f"{provider or ''}|{model.lower()}")
        return bool(lk and lk.get("tod"))

    def _override_rates(self, model: str, day: str, mods: Modifiers) -> Rates | None:
        if not self.overrides:
            return None
        m = model.lower()
        d = date.fromisoformat(day)
        for o in self.overrides:
            if (m == o.key if o.match == "exact" else m.startswith(o.key)) and (o.since is None or d >= o.since):
                r = o.rates
                md = dict(mods)
                if md.get("speed") == "fast":
                    if o.fast_multiplier is not None:
                        r = r.scaled(o.fast_multiplier, f"fast ×{o.fast_multiplier:g}")
                    else:
                        self._warn(f"{model}: usage says speed = fast but {o.rates.source} has no "
                                   f"fast_multiplier for '{o.key}'; priced at its standard rates")
                if md.get("service_tier") == "batch" and o.batch_multiplier != 1.0:
                    r = r.scaled(o.batch_multiplier, f"batch ×{o.batch_multiplier:g}")
                if md.get("inference_geo") == "us" and o.us_multiplier != 1.0:
                    r = r.scaled(o.us_multiplier, f"us ×{o.us_multiplier:g}")
                return r
        return None

    def _genai_cached(self, model: str, provider: str | None, day: str, minute: str, mods: Modifiers) -> Rates | None:
        pm = f"{provider or ''}|{model.lower()}"
        lk = self._lookups.get(pm)
        if lk is None:
            lk = self._genai_lookup(model, provider)
            self._lookups[pm] = lk
            self._dirty = True
        if lk["id"] is None:
            return None
        when = f"{day} {minute}" if lk.get("tod") else day
        dk = f"{pm}|{when}|{modifiers_key(mods)}"
        if dk in self._disk:
            d = self._disk[dk]
            return None if d is None else Rates.from_json(d)
        r = self._genai_compute(model, provider, day, minute, mods)
        self._disk[dk] = None if r is None else r.to_json()
        self._dirty = True
        return r

    def _snapshot(self) -> Any:
        if self._genai is None:
            from genai_prices.data_snapshot import get_snapshot

            self._genai = get_snapshot()
        return self._genai

    def _find(self, model: str, provider: str | None) -> tuple[Any, Any] | None:
        snap = self._snapshot()
        refs = [model]
        m = _CLAUDE_CLOUD.match(model.lower())
        if m:
            refs.append(m.group(1))
        tries = [(r, provider) for r in refs if provider] + [(r, None) for r in refs]
        for ref, prov in tries:
            try:
                return snap.find_provider_model(ref, None, prov, None)
            except LookupError:
                continue
        return None

    def _genai_lookup(self, model: str, provider: str | None) -> dict[str, Any]:
        from genai_prices.types import ConditionalPrice, TimeOfDateConstraint

        found = self._find(model, provider)
        if found is None:
            return {"id": None, "tod": False}
        _, info = found
        conds = info.prices if isinstance(info.prices, list) else []
        tod = any(isinstance(c, ConditionalPrice) and isinstance(c.constraint, TimeOfDateConstraint) for c in conds)
        tod = tod or any(isinstance(v.constraint, TimeOfDateConstraint) for v in (info.price_variants or []))
        return {"id": info.id, "tod": tod}

    def _genai_compute(self, model: str, provider: str | None, day: str, minute: str, mods: Modifiers) -> Rates | None:
        found = self._find(model, provider)
        if found is None:
            return None
        prov, info = found
        ts = datetime.fromisoformat(f"{day}T{minute}:00+00:00")
        md = dict(mods)
        context: dict[str, str] = {}
        if md.get("speed") == "fast":
            context["speed"] = "fast"
        tier = md.get("service_tier")
        if tier == "batch":
            context["processing"] = "batch"
        elif tier in ("priority", "flex"):
            context["service_tier"] = tier
        direct = any(info is m for m in prov.models)   # genai-prices applies variants to direct models only
        price = info.get_prices(ts, context if (context and direct) else None)
        source = f"{GENAI_PRICES} {self.genai_prices_version}"
        r = _genai_rates(price, info.id, source)
        if r is None:
            self._warn(f"{model}: genai-prices lists '{info.id}' without token prices; reported as unpriced")
            return None
        if not r.tiers and info.id in LONG_CONTEXT_ADDED:     # before the modifiers: they scale tiers too
            r = replace(r, tiers=(long_context_tier(r.base),), notes=r.notes + ("long-context tier (ctxreplay table)",))
        applied = set()
        if context and direct:
            for v in info.price_variants or ():
                if v.constraint is not None and not v.constraint.active(ts):
                    continue
                if all(context.get(k) == val for k, val in v.when.items()):
                    applied.update(v.when.items())
        if md.get("speed") == "fast" and ("speed", "fast") not in applied:
            mult = FAST_MULTIPLIERS.get(info.id)
            if mult is not None:
                r = r.scaled(mult, f"fast ×{mult:g} (ctxreplay table)")
            else:
                self._warn(f"{model}: usage says speed = fast but neither genai-prices nor ctxreplay has a fast "
                           f"price for '{info.id}'; priced at standard rates (add fast_multiplier in --prices)")
        if tier == "batch" and ("processing", "batch") not in applied:
            r = r.scaled(BATCH_MULTIPLIER, f"batch ×{BATCH_MULTIPLIER:g} (Batch API)")
        if md.get("inference_geo") == "us" and prov.id == "anthropic" and not _GEO_EXEMPT.match(info.id):
            r = r.scaled(US_GEO_MULTIPLIER, f"us ×{US_GEO_MULTIPLIER:g} (inference_geo)")
        return r

    # -- pricing -------------------------------------------------------------------------------
    def price(self, model: str, timestamp: str | date | datetime, input: int, output: int,
              cache_write_5m: int = 0, cache_write_1h: int = 0, cache_read: int = 0, *,
              modifiers: Modifiers = (), provider: str | None = None, web_search_requests: int = 0,
              tier_rule: TierRule = "request") -> Price | None:
        """The cost of one request; None when the model has no price (never a silent 0)."""
        r = self.rates(model, timestamp, modifiers, provider)
        if r is None:
            return None
        return price_with(r, input, output, cache_write_5m, cache_write_1h, cache_read,
                          web_search_requests=web_search_requests, tier_rule=tier_rule)

    # -- vectorised ----------------------------------------------------------------------------
    def rate_rows(self, keys: Iterable[tuple[str, Any, Modifiers | str, str | None]]) -> list[dict[str, Any]]:
        """One row per distinct (model, timestamp's UTC day, modifiers, provider) with flat rate columns.

        Columns: model, day, modifiers (as `modifiers_key`), provider, priced, model_id, source,
        the five base rates (`input`, …, USD/MTok), per_request, web_search (USD each), n_tiers,
        and for i = 1..max tiers `tier{i}_above` with the five `tier{i}_<kind>` rates (null
        where a model has fewer tiers).
        """
        seen: dict[tuple[str, str, str, str], dict[str, Any]] = {}
        for model, when, mods, provider in keys:
            mods_t = parse_modifiers_key(mods) if isinstance(mods, str) or mods is None else mods
            day, _ = _day_minute(when)
            k = (model, day, modifiers_key(mods_t), provider or "")
            if k in seen:
                continue
            r = self.rates(model, when, mods_t, provider)
            row: dict[str, Any] = {"model": model, "day": day, "modifiers": k[2], "provider": provider,
                                   "priced": r is not None, "model_id": r.model_id if r else None,
                                   "source": r.source if r else None}
            for kind in TOKEN_KINDS:
                row[kind] = getattr(r.base, kind) if r else None
            row["per_request"] = r.per_request if r else None
            row["web_search"] = r.web_search if r else None
            row["n_tiers"] = len(r.tiers) if r else 0
            row["_tiers"] = r.tiers if r else ()
            seen[k] = row
        rows = list(seen.values())
        width = max((row["n_tiers"] for row in rows), default=0)
        for row in rows:
            tiers = row.pop("_tiers")
            for i in range(width):
                above, tr = tiers[i] if i < len(tiers) else (None, None)
                row[f"tier{i + 1}_above"] = above
                for kind in TOKEN_KINDS:
                    row[f"tier{i + 1}_{kind}"] = getattr(tr, kind) if tr else None
        return rows

    def rate_table(self, keys: Iterable[tuple[str, Any, Modifiers | str, str | None]]) -> Any:
        """`rate_rows` as a pyarrow Table (register it in DuckDB and join on model, day, modifiers, provider)."""
        import pyarrow as pa

        rows = self.rate_rows(keys)
        if not rows:
            return pa.table({"model": pa.array([], pa.string())})
        return pa.Table.from_pylist(rows)

    def cost_sql(self, n_tiers: int, *, rates: str = "r", input: str = "input_tokens",
                 output: str = "output_tokens", cache_write_5m: str = "cache_write_5m_tokens",
                 cache_write_1h: str = "cache_write_1h_tokens", cache_read: str = "cache_read_tokens") -> str:
        """A SQL expression (DuckDB) for one request's cost in USD, given a joined `rate_table` row
        aliased `rates` with `n_tiers` tier columns (the table's `max(n_tiers)`); null when unpriced.

        ```sql
        SELECT c.*, {book.cost_sql(width)} AS cost_usd
        FROM calls c LEFT JOIN rates r ON r.model = c.model AND r.day = c.day AND r.modifiers = c.modifiers
        ```
        """
        def five(prefix: str) -> TokenRates:
            return TokenRates(*(_Sql(f"{rates}.{prefix}{k}") for k in TOKEN_KINDS))

        counts = (_Sql(input), _Sql(output), _Sql(cache_write_5m), _Sql(cache_write_1h), _Sql(cache_read))
        tiers = [(_Sql(f"{rates}.tier{i}_above"), five(f"tier{i}_")) for i in range(1, n_tiers + 1)]
        usd = request_usd(counts, five(""), tiers, _sql_pick)[:5]
        total = usd[0] + usd[1] + usd[2] + usd[3] + usd[4] + _Sql(f"{rates}.per_request")
        return f"CASE WHEN {rates}.priced THEN {total} ELSE NULL END"

    def price_frame(self, df: Any, *, model: str = "model", timestamp: str = "timestamp",
                    input: str = "input_tokens", output: str = "output_tokens",
                    cache_write_5m: str = "cache_write_5m_tokens", cache_write_1h: str = "cache_write_1h_tokens",
                    cache_read: str = "cache_read_tokens", modifiers: str | None = None,
                    provider: str | None = None, out: str = "cost_usd") -> Any:
        """Add `out` (USD, null when unpriced) to a polars DataFrame of requests, whole-request tier rule.

        `timestamp` is an ISO string or a datetime column; `modifiers` an optional column of
        `modifiers_key` strings; `provider` an optional column of provider ids.
        """
        import polars as pl

        ts = pl.col(timestamp)
        dtype = df.schema[timestamp]
        day_expr = (ts.str.slice(0, 10) if dtype == pl.String
                    else ts.dt.convert_time_zone("UTC").dt.strftime("%Y-%m-%d") if getattr(dtype, "time_zone", None)
                    else ts.dt.strftime("%Y-%m-%d"))
        keyed = df.with_columns(
            _pm=pl.col(model), _pday=day_expr,
            _pmods=pl.col(modifiers).fill_null("") if modifiers else pl.lit(""),
            _pprov=pl.col(provider) if provider else pl.lit(None, pl.String),
        )
        first = keyed.group_by("_pm", "_pday", "_pmods", "_pprov").agg(_pts=ts.first())
        keys = [(m, t, mk, p) for m, t, mk, p in zip(first["_pm"].to_list(), first["_pts"].to_list(),
                                                      first["_pmods"].to_list(), first["_pprov"].to_list(),
                                                      strict=True)]
        rows = self.rate_rows(keys)
        cols = sorted({c for r in rows for c in r}) if rows else ["model"]
        table = pl.DataFrame(rows, schema={c: _rate_dtype(pl, c) for c in cols}, orient="row") if rows else None
        if table is None:
            return df.with_columns(pl.lit(None, pl.Float64).alias(out))
        table = table.rename({"model": "_pm", "day": "_pday", "modifiers": "_pmods", "provider": "_pprov"})
        joined = keyed.join(table, on=["_pm", "_pday", "_pmods", "_pprov"], how="left", nulls_equal=True)
        def five(prefix: str) -> TokenRates:
            return TokenRates(*(pl.col(f"{prefix}{k}") for k in TOKEN_KINDS))

        counts = tuple(pl.col(c).cast(pl.Float64) for c in (input, output, cache_write_5m, cache_write_1h, cache_read))
        width = max((r["n_tiers"] for r in rows), default=0)
        tiers = [(pl.col(f"tier{i}_above"), five(f"tier{i}_")) for i in range(1, width + 1)]
        usd = request_usd(counts, five(""), tiers, _polars_pick(pl))
        total = usd[0] + usd[1] + usd[2] + usd[3] + usd[4] + pl.col("per_request")
        cost = pl.when(pl.col("priced")).then(total).otherwise(pl.lit(None, pl.Float64))
        return joined.with_columns(cost.alias(out)).select(*df.columns, out)


def _rate_dtype(pl: Any, col: str) -> Any:
    if col in ("model", "day", "modifiers", "provider", "model_id", "source"):
        return pl.String
    if col == "priced":
        return pl.Boolean
    if col == "n_tiers" or col.endswith("_above"):
        return pl.Int64
    return pl.Float64


def price_with(r: Rates, input: int, output: int, cache_write_5m: int = 0, cache_write_1h: int = 0,
               cache_read: int = 0, *, web_search_requests: int = 0, tier_rule: TierRule = "request") -> Price:
    """Price usage with known rates. `tier_rule="category"` is ccusage's per-category split."""
    counts = (input, output, cache_write_5m, cache_write_1h, cache_read)
    if tier_rule == "request" or not r.tiers:
        *usd, tier_above = request_usd(counts, r.base, r.tiers)
    else:
        usd, tier_above = [_split(n, i, r) for i, n in enumerate(counts)], None
    other = r.per_request + web_search_requests * r.web_search
    return Price(usd[0], usd[1], usd[2], usd[3], usd[4], other, r, tier_above)


def _split(n: int, kind: int, r: Rates) -> float:
    """ccusage's rule: the part of one category's count above each threshold at that tier's rate."""
    bounds = [0] + [a for a, _ in r.tiers]
    rates = [_five(r.base)[kind]] + [_five(tr)[kind] for _, tr in r.tiers]
    usd = 0.0
    for i, lo in enumerate(bounds):
        hi = bounds[i + 1] if i + 1 < len(bounds) else None
        part = (min(n, hi) if hi is not None else n) - lo
        if part > 0:
            usd += part * rates[i] / 1e6
    return usd


__all__ = ["CCUSAGE_LONG_CONTEXT", "FAST_MULTIPLIERS", "LONG_CONTEXT_ADDED", "Modifiers", "Price", "PriceBook",
           "PriceError", "Rates", "TokenRates", "ccusage_long_context", "load_overrides", "long_context_tier",
           "modifiers", "modifiers_key", "price_with", "request_usd", "tier_of", "usage_modifiers"]
