"""Long-context pricing per Claude model family, both sides of the 200k threshold: the provider's
rule by default, ccusage 20.0.24's under `report --compat ccusage` (issue 24)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ctxreplay.pipeline.cost.prices import PriceBook
from ctxreplay.pipeline.reporting.report import ReportOptions, build_report


@pytest.fixture(autouse=True)
def _price_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CTXREPLAY_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "price-cache"))


@pytest.fixture(scope="module")
def book() -> PriceBook:
    return PriceBook.load(cache_dir=None)


# one request each: (input, output, cache write 5m, cache write 1h, cache read)
CASES = {
    "input_200000": (200_000, 1000, 0, 0, 0),
    "input_200001": (200_001, 1000, 0, 0, 0),
    "input_300000": (300_000, 1000, 0, 0, 0),
    "read_200000": (0, 10, 0, 0, 200_000),
    "read_200001": (0, 10, 0, 0, 200_001),
    "mixed_300100": (100, 1000, 150_000, 0, 150_000),   # a long prompt, no category of it above 200k
    "write_1h_300000": (10, 0, 0, 300_000, 0),
    "output_250000": (10, 250_000, 0, 0, 0),            # output never counts toward the threshold
    "mixed_200000": (1, 250_000, 100_000, 0, 99_999),   # prompt exactly 200,000 (input + writes + reads)
    "mixed_200001": (1, 1000, 100_000, 1, 99_999),      # prompt 200,001, made of three categories
}

# standard rates, USD/MTok (input, output, 5m write, 1h write, read), from Anthropic's price list
OPUS_4 = (15.0, 75.0, 18.75, 30.0, 1.5)
OPUS_45 = (5.0, 25.0, 6.25, 10.0, 0.5)
SONNET = (3.0, 15.0, 3.75, 6.0, 0.3)
HAIKU_45 = (1.0, 5.0, 1.25, 2.0, 0.1)
HAIKU_35 = (0.8, 4.0, 1.0, 1.6, 0.08)
LONG = (2.0, 1.5, 2.0, 2.0, 2.0)   # the long-context tier: 2x input, writes and reads, 1.5x output

# (model as Claude Code writes it, day) → (standard rates, whether the provider bills a prompt above
# 200k at the long-context tier that day). Opus 4.6 / Sonnet 4.6 lost their tier on 2026-03-13.
FAMILIES = {
    ("claude-opus-4-20250514", "2026-02-20"): (OPUS_4, False),
    ("claude-opus-4-1-20250805", "2026-02-20"): (OPUS_4, False),
    ("claude-opus-4-5-20251101", "2026-02-20"): (OPUS_45, False),
    ("claude-opus-4-6", "2026-02-20"): (OPUS_45, True),
    ("claude-opus-4-6", "2026-03-13"): (OPUS_45, False),
    ("claude-opus-4-7", "2026-04-20"): (OPUS_45, False),
    ("claude-opus-4-8", "2026-06-01"): (OPUS_45, False),
    ("claude-sonnet-4-20250514", "2026-02-20"): (SONNET, True),
    ("claude-sonnet-4-5-20250929", "2026-02-20"): (SONNET, True),
    ("claude-sonnet-4-6", "2026-02-20"): (SONNET, True),
    ("claude-sonnet-4-6", "2026-04-01"): (SONNET, False),
    ("claude-haiku-4-5-20251001", "2026-02-20"): (HAIKU_45, False),
    ("claude-3-7-sonnet-20250219", "2025-06-01"): (SONNET, False),
    ("claude-3-5-haiku-20241022", "2025-06-01"): (HAIKU_35, False),
}

# What `ccusage session --json --offline` (20.0.24, TZ=UTC) printed for these one-request sessions,
# in CASES order up to output_250000 (the last two cases follow from the same rule, computed below).
# ccusage gives only Sonnet 4 and 4.5 a tier, on any date, and applies it to the part of each usage
# category above 200,000 tokens. Its figures do not depend on the date (the same at 2025-09-01,
# 2026-02-20 and 2026-04-01), so Opus 4.6's row serves both of its days.
CCUSAGE = {
    ("claude-opus-4-20250514", "2026-02-20"): (3.075, 3.075015, 4.575, 0.30075, 0.3007515, 3.114, 9.00015, 18.75015),
    ("claude-opus-4-1-20250805", "2026-02-20"): (3.075, 3.075015, 4.575, 0.30075, 0.3007515, 3.114, 9.00015,
                                                 18.75015),
    ("claude-opus-4-5-20251101", "2026-02-20"): (1.025, 1.025005, 1.525, 0.10025, 0.1002505, 1.038, 3.00005, 6.25005),
    ("claude-opus-4-6", "2026-02-20"): (1.025, 1.025005, 1.525, 0.10025, 0.1002505, 1.038, 3.00005, 6.25005),
    ("claude-opus-4-6", "2026-03-13"): (1.025, 1.025005, 1.525, 0.10025, 0.1002505, 1.038, 3.00005, 6.25005),
    ("claude-opus-4-7", "2026-04-20"): (1.025, 1.025005, 1.525, 0.10025, 0.1002505, 1.038, 3.00005, 6.25005),
    ("claude-opus-4-8", "2026-06-01"): (1.025, 1.025005, 1.525, 0.10025, 0.1002505, 1.038, 3.00005, 6.25005),
    ("claude-sonnet-4-20250514", "2026-02-20"): (0.615, 0.615006, 1.215, 0.06015, 0.0601506, 0.6228, 2.40003,
                                                 4.12503),
    ("claude-sonnet-4-5-20250929", "2026-02-20"): (0.615, 0.615006, 1.215, 0.06015, 0.0601506, 0.6228, 2.40003,
                                                   4.12503),
    ("claude-sonnet-4-6", "2026-02-20"): (0.615, 0.615003, 0.915, 0.06015, 0.0601503, 0.6228, 1.80003, 3.75003),
    ("claude-sonnet-4-6", "2026-04-01"): (0.615, 0.615003, 0.915, 0.06015, 0.0601503, 0.6228, 1.80003, 3.75003),
    ("claude-haiku-4-5-20251001", "2026-02-20"): (0.205, 0.205001, 0.305, 0.02005, 0.0200501, 0.2076, 0.60001,
                                                  1.25001),
    ("claude-3-7-sonnet-20250219", "2025-06-01"): (0.615, 0.615003, 0.915, 0.06015, 0.0601503, 0.6228, 1.80003,
                                                   3.75003),
    ("claude-3-5-haiku-20241022", "2025-06-01"): (0.164, 0.1640008, 0.244, 0.01604, 0.01604008, 0.16608, 0.480008,
                                                  1.000008),
}
CCUSAGE_TIERED = {"claude-sonnet-4-20250514", "claude-sonnet-4-5-20250929"}


def provider_usd(rates: tuple[float, ...], tiered: bool, counts: tuple[int, ...]) -> float:
    """The provider's rule: the prompt (input + cache writes + cache reads) above 200,000 tokens
    prices every count of the request, output included, at the long-context rates."""
    inp, _out, c5, c1, cr = counts
    above = tiered and inp + c5 + c1 + cr > 200_000
    return sum(n * r * (m if above else 1.0) for n, r, m in zip(counts, rates, LONG, strict=True)) / 1e6


def ccusage_usd(rates: tuple[float, ...], tiered: bool, counts: tuple[int, ...]) -> float:
    """ccusage's rule: each category's tokens above 200,000 at the long-context rate, the rest at base."""
    return sum((min(n, 200_000) * r + max(n - 200_000, 0) * r * (m if tiered else 1.0))
               for n, r, m in zip(counts, rates, LONG, strict=True)) / 1e6


def tree(root: Path) -> dict[str, tuple[tuple[str, str], str]]:
    """One Claude Code session per (family, case); returns session id → (family, case)."""
    proj = root / "projects" / "-tmp-p"
    proj.mkdir(parents=True)
    keys: dict[str, tuple[tuple[str, str], str]] = {}
    for i, ((model, day), case) in enumerate((f, c) for f in FAMILIES for c in CASES):
        sid = f"{i:08x}-0000-4000-8000-000000000000"
        inp, out, c5, c1, cr = CASES[case]
        line = {"parentUuid": None, "isSidechain": False, "type": "assistant", "sessionId": sid,
                "timestamp": f"{day}T10:00:00.000Z", "uuid": f"u{i}", "requestId": f"req_{i}",
                "message": {"id": f"msg_{i}", "model": model, "role": "assistant",
                            "content": [{"type": "text", "text": "ok"}],
                            "usage": {"input_tokens": inp, "output_tokens": out,
                                      "cache_creation_input_tokens": c5 + c1, "cache_read_input_tokens": cr,
                                      "cache_creation": {"ephemeral_5m_input_tokens": c5,
                                                         "ephemeral_1h_input_tokens": c1}}}}
        (proj / f"{sid}.jsonl").write_text(json.dumps(line, separators=(",", ":")) + "\n")
        keys[sid] = ((model, day), case)
    return keys


def session_costs(root: Path, book: PriceBook, keys: dict[str, tuple[tuple[str, str], str]],
                  compat: str | None) -> dict[tuple[tuple[str, str], str], float]:
    doc = build_report([root], book, ReportOptions(tz="UTC", compat=compat)).to_json()  # type: ignore[arg-type]
    assert doc["totals"]["unpriced_requests"] == 0
    return {keys[r["key"]]: r["cost_usd"] for r in doc["rows"]}


def test_ccusage_figures_follow_its_per_category_rule() -> None:
    # the recorded ccusage output is what `ccusage_usd` computes: the rule below is ccusage's
    for (model, day), figures in CCUSAGE.items():
        rates, _ = FAMILIES[(model, day)]
        for case, want in zip(CASES, figures, strict=False):
            assert ccusage_usd(rates, model in CCUSAGE_TIERED, CASES[case]) == pytest.approx(want, rel=1e-9), \
                (model, case)


@pytest.mark.parametrize("family", list(FAMILIES), ids=lambda f: f"{f[0]}@{f[1]}")
def test_provider_rule_per_family_on_both_sides_of_200k(book: PriceBook, family: tuple[str, str]) -> None:
    model, day = family
    rates, tiered = FAMILIES[family]
    for case, counts in CASES.items():
        p = book.price(model, f"{day}T10:00:00Z", *counts)
        assert p is not None, model
        assert p.total_usd == pytest.approx(provider_usd(rates, tiered, counts), rel=1e-12), (model, case)
        prompt = counts[0] + counts[2] + counts[3] + counts[4]
        assert p.tier_above == (200_000 if tiered and prompt > 200_000 else None), (model, case)


def test_sonnet_4_above_200k_is_billed_at_the_long_context_rate_like_sonnet_4_5(book: PriceBook) -> None:
    # issue 24: a 300k-token Sonnet 4 request was priced at the base rate, Sonnet 4.5's at the tier
    s4 = book.price("claude-sonnet-4-20250514", "2026-02-20T10:00:00Z", 300_000, 1000)
    s45 = book.price("claude-sonnet-4-5-20250929", "2026-02-20T10:00:00Z", 300_000, 1000)
    assert s4 is not None and s45 is not None
    assert s4.total_usd == pytest.approx(s45.total_usd) == pytest.approx((300_000 * 6 + 1000 * 22.5) / 1e6)
    # the same id through Bedrock and Vertex, and batch (half of the tier)
    for ref in ("anthropic.claude-sonnet-4-20250514-v1:0", "claude-sonnet-4@20250514"):
        p = book.price(ref, "2026-02-20T10:00:00Z", 300_000, 1000)
        assert p is not None and p.total_usd == pytest.approx(s4.total_usd), ref
    batch = book.price("claude-sonnet-4-20250514", "2026-02-20T10:00:00Z", 300_000, 1000,
                       modifiers=(("service_tier", "batch"),))
    assert batch is not None and batch.total_usd == pytest.approx(s4.total_usd / 2)


def test_vectorised_forms_carry_the_added_tier(book: PriceBook) -> None:
    import polars as pl

    df = pl.DataFrame({"model": ["claude-sonnet-4-20250514"] * 2, "timestamp": ["2026-02-20T10:00:00Z"] * 2,
                       "input_tokens": [200_000, 200_001], "output_tokens": [1000, 1000],
                       "cache_write_5m_tokens": [0, 0], "cache_write_1h_tokens": [0, 0], "cache_read_tokens": [0, 0]})
    got = book.price_frame(df)["cost_usd"].to_list()
    assert got == pytest.approx([(200_000 * 3 + 1000 * 15) / 1e6, (200_001 * 6 + 1000 * 22.5) / 1e6])


def test_report_default_follows_the_provider_per_family(tmp_path: Path, book: PriceBook) -> None:
    keys = tree(tmp_path)
    got = session_costs(tmp_path, book, keys, None)
    for (family, case), usd in got.items():
        rates, tiered = FAMILIES[family]
        assert usd == pytest.approx(provider_usd(rates, tiered, CASES[case]), rel=1e-12), (family, case)


def test_report_compat_ccusage_equals_ccusage_per_family(tmp_path: Path, book: PriceBook) -> None:
    keys = tree(tmp_path)
    got = session_costs(tmp_path, book, keys, "ccusage")
    for (family, case), usd in got.items():
        rates, _ = FAMILIES[family]
        i = list(CASES).index(case)
        figures = CCUSAGE[family]
        want = figures[i] if i < len(figures) else ccusage_usd(rates, family[0] in CCUSAGE_TIERED, CASES[case])
        assert usd == pytest.approx(want, rel=1e-9), (family, case)
    # the three figures of the issue: ccusage's, not the provider's
    assert got[(("claude-opus-4-6", "2026-02-20"), "input_300000")] == pytest.approx(1.525)
    assert got[(("claude-sonnet-4-6", "2026-02-20"), "input_300000")] == pytest.approx(0.915)
    assert got[(("claude-sonnet-4-20250514", "2026-02-20"), "input_300000")] == pytest.approx(1.215)


def test_compat_keeps_the_tiers_of_an_overrides_file(tmp_path: Path) -> None:
    prices = tmp_path / "prices.toml"
    prices.write_text('[models."claude-opus-4-6"]\ninput = 5.0\noutput = 25.0\n'
                      '[[models."claude-opus-4-6".tier]]\nabove = 200000\ninput = 10.0\n')
    b = PriceBook.load(prices, cache_dir=None)
    root = tmp_path / "t"
    proj = root / "projects" / "p"
    proj.mkdir(parents=True)
    line = {"type": "assistant", "sessionId": "s1", "timestamp": "2026-04-01T10:00:00.000Z", "requestId": "r1",
            "message": {"id": "m1", "model": "claude-opus-4-6", "role": "assistant", "content": [],
                        "usage": {"input_tokens": 300_000, "output_tokens": 0}}}
    (proj / "s1.jsonl").write_text(json.dumps(line, separators=(",", ":")) + "\n")
    doc = build_report([root], b, ReportOptions(tz="UTC", compat="ccusage")).to_json()
    # the user's own tier, split per category as ccusage does: 200k at 5, 100k at 10
    assert doc["totals"]["cost_usd"] == pytest.approx((200_000 * 5 + 100_000 * 10) / 1e6)


def test_a_price_cache_written_before_the_added_tier_is_not_reused(tmp_path: Path) -> None:
    import orjson

    from ctxreplay.pipeline.cost import prices

    b1 = PriceBook.load(cache_dir=tmp_path)
    assert b1.rates("claude-sonnet-4-20250514", "2026-02-20").tiers                  # type: ignore[union-attr]
    b1.save()
    f = next(tmp_path.glob("genai-prices-*.json"))
    doc = orjson.loads(f.read_bytes())
    # what ctxreplay before the tier cached: Sonnet 4 without it, in cache format 1
    for k, v in doc["rates"].items():
        if k.startswith("|claude-sonnet-4-20250514|") and v is not None:
            v["tiers"] = []
    doc["format"] = prices.CACHE_FORMAT - 1
    f.write_bytes(orjson.dumps(doc))
    assert PriceBook.load(cache_dir=tmp_path).rates("claude-sonnet-4-20250514", "2026-02-20").tiers  # type: ignore[union-attr]
    doc["format"] = prices.CACHE_FORMAT            # the same file in the current format is believed
    f.write_bytes(orjson.dumps(doc))
    assert not PriceBook.load(cache_dir=tmp_path).rates("claude-sonnet-4-20250514", "2026-02-20").tiers  # type: ignore[union-attr]
