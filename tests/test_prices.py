"""pipeline/cost/prices.py: genai-prices rates, overrides, modifiers, the disk cache, the vectorised forms."""

from __future__ import annotations

import random
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest

from ctxreplay.pipeline.cost.prices import (
    FAST_MULTIPLIERS,
    PriceBook,
    PriceError,
    modifiers,
    modifiers_key,
    price_with,
    usage_modifiers,
)


@pytest.fixture(scope="module")
def book() -> PriceBook:
    return PriceBook.load(cache_dir=None)


def _genai_total(model: str, when: datetime, inp: int, out: int, cw5: int, cw1: int, cr: int) -> float:
    import genai_prices
    from genai_prices import Usage

    usage = Usage(input_tokens=inp + cw5 + cw1 + cr, output_tokens=out, cache_write_tokens=cw5 + cw1,
                  cache_write_5m_tokens=cw5, cache_write_1h_tokens=cw1, cache_read_tokens=cr)
    return float(genai_prices.calc_price(usage, model, genai_request_timestamp=when).total_price)


MODELS = ["claude-opus-4-6", "claude-sonnet-4-5-20250929", "claude-haiku-4-5-20251001", "claude-haiku-5-5",
          "claude-opus-4-8", "gpt-5.1-codex-max", "gpt-4o", "gemini-2.5-pro", "kimi-k2.5", "deepseek-chat"]


def test_rates_reproduce_genai_prices_calc_price(book: PriceBook) -> None:
    # tiers (Opus 4.6 before 2026-03-13, Haiku 5.5 at 100k, Gemini 2.5 Pro), missing write rates
    # (OpenAI: writes at the input rate), time-of-day prices (DeepSeek), both TTLs
    rng = random.Random(11)
    for _ in range(300):
        model = rng.choice(MODELS)
        when = datetime(2026, rng.randint(1, 11), rng.randint(1, 28), rng.randint(0, 23), rng.randint(0, 59),
                        tzinfo=UTC)
        counts = (rng.randint(0, 5000), rng.randint(0, 9000), rng.randint(0, 60000), rng.randint(0, 60000),
                  rng.choice([0, rng.randint(0, 400000)]))
        p = book.price(model, when, *counts)
        assert p is not None, model
        assert p.total_usd == pytest.approx(_genai_total(model, when, *counts), rel=1e-12, abs=1e-12), (model, when)


def test_whole_request_tier_applies_only_above_the_threshold(book: PriceBook) -> None:
    # Opus 4.6 on 2026-02-10: genai-prices bills the whole request at the >200k rates (2x input)
    at = book.price("claude-opus-4-6", "2026-02-10T10:00:00Z", 0, 1000, 0, 0, 200_000)
    above = book.price("claude-opus-4-6", "2026-02-10T10:00:00Z", 1, 1000, 0, 0, 200_000)
    assert at is not None and above is not None
    assert at.tier_above is None and above.tier_above == 200_000
    assert at.cache_read_usd == pytest.approx(200_000 * 0.5 / 1e6)
    assert above.cache_read_usd == pytest.approx(200_000 * 1.0 / 1e6)
    assert above.output_usd == pytest.approx(1000 * 37.5 / 1e6)          # output too: the whole request
    # from 2026-03-13 the 1M window is at standard prices
    later = book.price("claude-opus-4-6", "2026-03-13T00:00:00Z", 1, 1000, 0, 0, 200_000)
    assert later is not None and later.tier_above is None


def test_category_rule_splits_each_category_at_the_threshold_like_ccusage(book: PriceBook) -> None:
    r = book.rates("claude-sonnet-4-5", "2026-02-10")
    assert r is not None
    p = price_with(r, 10, 100, 0, 0, 250_000, tier_rule="category")
    # only the 50k cache-read tokens above 200k pay the tier rate; input and output stay at base
    assert p.cache_read_usd == pytest.approx((200_000 * 0.3 + 50_000 * 0.6) / 1e6)
    assert p.input_usd == pytest.approx(10 * 3 / 1e6) and p.output_usd == pytest.approx(100 * 15 / 1e6)
    whole = price_with(r, 10, 100, 0, 0, 250_000)
    assert whole.input_usd == pytest.approx(10 * 6 / 1e6) and whole.output_usd == pytest.approx(100 * 22.5 / 1e6)
    under = price_with(r, 10, 100, 0, 0, 199_990, tier_rule="category")
    assert under.total_usd == pytest.approx(price_with(r, 10, 100, 0, 0, 199_990).total_usd)


def test_five_minute_and_one_hour_writes_are_priced_apart(book: PriceBook) -> None:
    p = book.price("claude-opus-4-6", "2026-03-20T00:00:00Z", 0, 0, 1000, 1000, 0)
    assert p is not None
    assert p.cache_write_5m_usd == pytest.approx(1000 * 6.25 / 1e6)
    assert p.cache_write_1h_usd == pytest.approx(1000 * 10 / 1e6)


def test_unknown_model_has_no_price_never_zero(book: PriceBook) -> None:
    assert book.price("claude-fake-model-9", "2026-02-10T00:00:00Z", 10, 10) is None
    assert book.rates("acme/nothing-like-it", "2026-02-10") is None
    assert book.price("claude-opus-4-6", "2026-02-10T00:00:00Z", 10, 10) is not None


def test_bedrock_and_vertex_claude_ids_find_the_anthropic_price(book: PriceBook) -> None:
    base = book.rates("claude-opus-4-6", "2026-03-20")
    assert book.rates("us.anthropic.claude-opus-4-6-v1:0", "2026-03-20") == base
    assert book.rates("claude-opus-4-6@20260101", "2026-03-20") == base


def test_modifiers_keep_only_what_changes_a_price() -> None:
    assert modifiers(speed="standard", service_tier="standard", inference_geo="global") == ()
    assert modifiers(speed="fast", service_tier="batch", inference_geo="us") == (
        ("inference_geo", "us"), ("service_tier", "batch"), ("speed", "fast"))
    assert usage_modifiers({"speed": "fast", "inference_geo": "not_available"}) == (("speed", "fast"),)
    assert modifiers_key(modifiers(speed="fast", service_tier="batch")) == "service_tier=batch;speed=fast"


def test_fast_mode_uses_genai_variant_then_the_multiplier_table(book: PriceBook) -> None:
    fast = (("speed", "fast"),)
    # Opus 4.8: genai-prices has a `speed: fast` variant ($10 / $50)
    r48 = book.rates("claude-opus-4-8", "2026-06-01", fast)
    assert r48 is not None and (r48.base.input, r48.base.output) == (10.0, 50.0)
    # Opus 4.6: no variant in genai-prices; the facts page's 6x
    std = book.rates("claude-opus-4-6", "2026-03-20")
    r46 = book.rates("claude-opus-4-6", "2026-03-20", fast)
    assert std is not None and r46 is not None
    assert r46.base.output == pytest.approx(std.base.output * FAST_MULTIPLIERS["claude-opus-4-6"])
    assert any("fast" in n for n in r46.notes)


def test_fast_mode_without_a_known_price_warns_and_keeps_standard_rates() -> None:
    b = PriceBook.load(cache_dir=None)
    std = b.rates("claude-haiku-4-5", "2026-03-20")
    fast = b.rates("claude-haiku-4-5", "2026-03-20", (("speed", "fast"),))
    assert std is not None and fast is not None and fast.base == std.base
    assert any("speed = fast" in w and "claude-haiku-4-5" in w for w in b.warnings)


def test_batch_halves_where_genai_prices_has_no_batch_variant_yet(book: PriceBook) -> None:
    batch = (("service_tier", "batch"),)
    before = book.rates("claude-opus-4-6", "2026-03-20", batch)     # genai's batch variant starts 2026-10-14
    after = book.rates("claude-opus-4-6", "2026-10-20", batch)
    std = book.rates("claude-opus-4-6", "2026-03-20")
    assert before is not None and after is not None and std is not None
    assert before.base.input == pytest.approx(std.base.input / 2) == after.base.input
    assert any("batch" in n for n in before.notes) and not after.notes


def test_us_only_inference_costs_ten_percent_more_from_claude_4_6(book: PriceBook) -> None:
    us = (("inference_geo", "us"),)
    for model, factor in (("claude-opus-4-6", 1.1), ("claude-opus-4-5", 1.0), ("claude-haiku-4-5", 1.0)):
        std, geo = book.rates(model, "2026-03-20"), book.rates(model, "2026-03-20", us)
        assert std is not None and geo is not None
        assert geo.base.input == pytest.approx(std.base.input * factor), model


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "prices.toml"
    p.write_text(text)
    return p


def test_overrides_add_a_model_and_win_over_genai_prices(tmp_path: Path) -> None:
    f = _write(tmp_path, """
[models."my-local-model"]
input = 1.0
output = 2.0

[models."claude-opus-4-6"]
input = 50
output = 250
cache_write_5m = 62.5
cache_write_1h = 100
cache_read = 5
fast_multiplier = 6
""")
    b = PriceBook.load(f, cache_dir=None)
    p = b.price("my-local-model", "2026-02-10T00:00:00Z", 1_000_000, 1_000_000, 1_000_000, 0, 1_000_000)
    assert p is not None
    # cache rates left out fall back as in genai-prices: writes and reads at the input rate
    assert (p.input_usd, p.output_usd, p.cache_write_5m_usd, p.cache_read_usd) == (1.0, 2.0, 1.0, 1.0)
    o = b.rates("claude-opus-4-6", "2026-02-10")
    assert o is not None and o.base.input == 50 and o.source == f"overrides {f}"
    fast = b.rates("claude-opus-4-6", "2026-02-10", (("speed", "fast"),))
    assert fast is not None and fast.base.input == 300
    assert "overrides" in b.source and b.genai_prices_version in b.source


def test_override_prefix_and_since_on_both_sides_of_the_date(tmp_path: Path) -> None:
    f = _write(tmp_path, """
[[models."acme/"]]
match = "prefix"
input = 1
output = 1

[[models."acme/"]]
match = "prefix"
since = 2026-03-01
input = 2
output = 2
""")
    b = PriceBook.load(f, cache_dir=None)
    assert b.rates("acme/coder-1", "2026-02-28").base.input == 1   # type: ignore[union-attr]
    assert b.rates("acme/coder-1", "2026-03-01").base.input == 2   # type: ignore[union-attr]
    assert b.rates("acmex", "2026-03-01") is None


def test_override_tier_is_whole_request(tmp_path: Path) -> None:
    f = _write(tmp_path, """
[models."big"]
input = 1
output = 10
[[models."big".tier]]
above = 1000
input = 2
""")
    b = PriceBook.load(f, cache_dir=None)
    lo = b.price("big", "2026-01-01", 1000, 1000)
    hi = b.price("big", "2026-01-01", 1001, 1000)
    assert lo is not None and hi is not None
    assert lo.input_usd == pytest.approx(1000 / 1e6) and hi.input_usd == pytest.approx(2 * 1001 / 1e6)
    assert hi.output_usd == pytest.approx(10 * 1000 / 1e6)        # a rate the tier leaves out stays


@pytest.mark.parametrize(("text", "says"), [
    ('[models."m"]\noutput = 1\n', "'input' is required"),
    ('[models."m"]\ninput = -1\noutput = 1\n', "input must be a non-negative number"),
    ('[models."m"]\ninput = 1\noutput = 1\ncache_rd = 1\n', "unknown key(s) ['cache_rd']"),
    ('[models."m"]\ninput = 1\noutput = 1\nsince = "2026-01-01"\n', "since must be a TOML date"),
    ('[models."m"]\ninput = 1\noutput = 1\nmatch = "regex"\n', "match must be 'exact' or 'prefix'"),
    ('[prices]\nx = 1\n', "unknown top-level key(s) ['prices']"),
    ('[models."m"\n', "not valid TOML"),
])
def test_bad_overrides_file_is_refused_with_the_place_and_the_fix(tmp_path: Path, text: str, says: str) -> None:
    f = _write(tmp_path, text)
    with pytest.raises(PriceError) as exc:
        PriceBook.load(f, cache_dir=None)
    assert says in str(exc.value) and str(f) in str(exc.value)


def test_missing_overrides_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(PriceError, match="cannot be read"):
        PriceBook.load(tmp_path / "nope.toml", cache_dir=None)


def test_disk_cache_answers_without_genai_prices(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    b1 = PriceBook.load(cache_dir=tmp_path)
    want = [b1.rates("claude-opus-4-6", "2026-02-10"), b1.rates("claude-fake-model-9", "2026-02-10"),
            b1.rates("claude-opus-4-6", "2026-02-10", (("speed", "fast"),))]
    b1.save()
    files = list(tmp_path.glob("genai-prices-*.json"))
    assert [f.name for f in files] == [f"genai-prices-{b1.genai_prices_version}.json"]
    b2 = PriceBook.load(cache_dir=tmp_path)

    def no_genai(self: PriceBook) -> None:
        raise AssertionError("genai-prices consulted on a warm cache")

    monkeypatch.setattr(PriceBook, "_snapshot", no_genai)
    got = [b2.rates("claude-opus-4-6", "2026-02-10"), b2.rates("claude-fake-model-9", "2026-02-10"),
           b2.rates("claude-opus-4-6", "2026-02-10", (("speed", "fast"),))]
    assert got == want and got[1] is None
    with pytest.raises(AssertionError):
        b2.rates("claude-opus-4-6", "2026-02-11")       # a day not cached yet does consult genai-prices


def test_disk_cache_of_another_genai_prices_build_is_ignored(tmp_path: Path) -> None:
    b1 = PriceBook.load(cache_dir=tmp_path)
    b1.rates("claude-opus-4-6", "2026-02-10")
    b1.save()
    f = next(tmp_path.glob("genai-prices-*.json"))
    f.write_text(f.read_text().replace('"stamp":"', '"stamp":"x'))
    b2 = PriceBook.load(cache_dir=tmp_path)
    assert b2._disk == {} and b2._lookups == {}


def test_rate_table_and_price_frame_match_price(book: PriceBook) -> None:
    pl = pytest.importorskip("polars")
    rows = [("claude-opus-4-6", "2026-02-10T10:00:00Z", 3, 700, 500, 100, 250_000, ""),
            ("claude-opus-4-6", "2026-02-10T11:00:00Z", 3, 700, 500, 100, 20_000, ""),
            ("claude-opus-4-6", "2026-03-20T11:00:00Z", 3, 700, 500, 100, 20_000, "speed=fast"),
            ("claude-haiku-4-5-20251001", "2026-02-10T10:00:00Z", 5, 10, 0, 0, 1000, ""),
            ("claude-fake-model-9", "2026-02-10T10:00:00Z", 5, 10, 0, 0, 1000, "")]
    df = pl.DataFrame(rows, schema=["model", "timestamp", "input_tokens", "output_tokens", "cache_write_5m_tokens",
                                    "cache_write_1h_tokens", "cache_read_tokens", "mods"], orient="row")
    out = book.price_frame(df, modifiers="mods")
    assert out.columns == [*df.columns, "cost_usd"]
    for r, cost in zip(rows, out["cost_usd"].to_list(), strict=True):
        from ctxreplay.pipeline.cost.prices import parse_modifiers_key

        want = book.price(r[0], r[1], *r[2:7], modifiers=parse_modifiers_key(r[7]))
        assert (cost is None) == (want is None)
        if want is not None:
            assert cost == pytest.approx(want.total_usd)
    table = book.rate_table([(r[0], r[1], r[7], None) for r in rows])
    assert {"model", "day", "modifiers", "priced", "input", "tier1_above", "tier1_cache_read"} <= set(table.column_names)
    assert table.num_rows == 5 - 1           # the two Opus rows of 2026-02-10 share one rate row


def test_importing_prices_pulls_nothing_heavy() -> None:
    import subprocess

    code = ("import sys, ctxreplay.pipeline.cost.prices; heavy = [m for m in ('genai_prices', 'pydantic', 'polars', 'pyarrow', "
            "'duckdb') if m in sys.modules]; print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parent.parent)
    assert out.stdout.strip() == "[]"


def test_rate_table_joins_in_duckdb(book: PriceBook) -> None:
    duckdb = pytest.importorskip("duckdb")
    calls = [("claude-opus-4-6", "2026-02-10", "", 3, 700, 500, 100, 250_000),
             ("claude-opus-4-6", "2026-02-10", "", 3, 700, 500, 100, 20_000),
             ("claude-opus-4-6", "2026-03-20", "speed=fast", 3, 700, 500, 100, 20_000),
             ("claude-fake-model-9", "2026-02-10", "", 3, 700, 0, 0, 0)]
    table = book.rate_table([(m, d, mods, None) for m, d, mods, *_ in calls])
    width = max(table.column("n_tiers").to_pylist())
    con = duckdb.connect()
    con.register("rates", table)
    con.execute("CREATE TABLE calls (model VARCHAR, day VARCHAR, modifiers VARCHAR, input_tokens BIGINT, "
                "output_tokens BIGINT, cache_write_5m_tokens BIGINT, cache_write_1h_tokens BIGINT, "
                "cache_read_tokens BIGINT)")
    con.executemany("INSERT INTO calls VALUES (?, ?, ?, ?, ?, ?, ?, ?)", calls)
    got = con.execute(f"SELECT {book.cost_sql(width)} FROM calls c LEFT JOIN rates r ON r.model = c.model "
                      f"AND r.day = c.day AND r.modifiers = c.modifiers ORDER BY c.cache_read_tokens DESC, "
                      f"c.day").fetchall()
    from ctxreplay.pipeline.cost.prices import parse_modifiers_key

    want = [book.price(m, d, *n, modifiers=parse_modifiers_key(mods)) for m, d, mods, *n in
            sorted(calls, key=lambda c: (-c[7], c[1]))]
    assert [g[0] for g in got] == pytest.approx([w.total_usd if w else None for w in want])
    assert got[-1][0] is None          # the unpriced model


def test_the_documented_prices_example_loads(tmp_path: Path) -> None:
    page = (Path(__file__).resolve().parent.parent / "docs" / "report.md").read_text()
    block = page.split("`--prices FILE` adds models or overrides genai-prices")[1].split("```toml\n")[1].split("```")[0]
    f = _write(tmp_path, block)
    b = PriceBook.load(f, cache_dir=None)
    assert b.rates("my-local-model", "2026-02-10").base.cache_read == 0.04          # type: ignore[union-attr]
    assert b.rates("acme/x", "2026-02-10").tiers[0][0] == 200000                     # type: ignore[union-attr]
    assert b.rates("claude-opus-4-6", "2027-01-01").base.input == 4.0               # type: ignore[union-attr]
    assert b.rates("claude-opus-4-6", "2026-12-31").base.input == 5.0               # type: ignore[union-attr]
