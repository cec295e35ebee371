"""Gemini CLI sessions through the commands (issue 25): found under ~/.gemini/tmp/*/chats without
PATHS, replayed with the `gemini` target by default, priced by `report` from their recorded tokens
(checked against a computation of our own from the raw files, genai-prices' rates), simulated."""

from __future__ import annotations

import itertools
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import polars as pl
import pytest

from ctxreplay.pipeline.batch.runner import RunOptions, run
from ctxreplay.pipeline.cost.prices import PriceBook
from ctxreplay.pipeline.loaders import default_roots
from ctxreplay.pipeline.loaders.gemini_cli import native_target
from ctxreplay.pipeline.reporting.report import ReportOptions, build_report
from ctxreplay.pipeline.staging.spec import load_spec
from tests.geminikit import SID, GeminiSession, standard, tokens, write_json, write_jsonl


@pytest.fixture(autouse=True)
def _price_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CTXREPLAY_CACHE_DIR", str(tmp_path / "price-cache"))


def _home(tmp: Path) -> Path:
    """A home directory with two Gemini CLI projects: an older .json session and a newer .jsonl one
    (another session), plus what else the CLI keeps there (logs, not transcripts)."""
    home = tmp / "home"
    a = home / ".gemini" / "tmp" / "proj-a"
    write_json(a / "chats" / "session-2026-03-01T09-00-5e551000.json", standard().document())
    (a / "logs.json").write_text("[]")
    other = standard("5e551000-aaaa-4bbb-8ccc-000000000002")
    write_jsonl(home / ".gemini" / "tmp" / "proj-b" / "chats" / "session-2026-03-01T09-00-5e551002.jsonl",
                other.records())
    return home


def test_default_roots_are_the_chats_folders(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home = _home(tmp_path)
    monkeypatch.setenv("HOME", str(home))
    for var in ("CLAUDE_CONFIG_DIR", "CODEX_HOME", "GEMINI_CLI_HOME"):
        monkeypatch.delenv(var, raising=False)
    g = home / ".gemini" / "tmp"
    assert default_roots() == [g / "proj-a" / "chats", g / "proj-b" / "chats"]
    monkeypatch.setenv("GEMINI_CLI_HOME", str(tmp_path / "elsewhere"))
    assert default_roots() == []
    monkeypatch.setenv("GEMINI_CLI_HOME", str(home))  # the CLI's home: its .gemini folder is inside
    assert len(default_roots()) == 2


def test_run_replays_gemini_sessions_with_the_gemini_target(tmp_path: Path) -> None:
    home = _home(tmp_path)
    chats = sorted((home / ".gemini" / "tmp").glob("*/chats"))
    assert native_target(chats) == "gemini"
    res = run(chats, load_spec(preset="default"), RunOptions(out_dir=tmp_path / "out", all_calls=True))
    s = res.summary
    assert s["target"] == "gemini"
    assert s["calls"] == 12  # 5 answers in each session, and each session's pending call
    assert s["quarantined_lines"] == 0 and not res.violations  # every request validates, the pending ones too
    pending = json.loads((tmp_path / "out" / "requests" / f"{SID}.json").read_text())
    roles = [c["role"] for c in pending["contents"]]
    assert roles[0] == "user" and all(a != b for a, b in itertools.pairwise(roles))
    # the notices never reach a request; the cancelled call and its error response do
    text = json.dumps(pending)
    assert "F12" not in text and "Request cancelled." not in text
    assert "[Operation Cancelled]" in text
    # the recorded usage is each call's
    calls = res.calls.filter(~pl.col("is_pending")).sort("thread_key", "call")
    assert calls.height == 10 and calls["recorded_cache_write_tokens"].is_null().all()
    assert calls["recorded_cache_read_tokens"].to_list()[:5] == [0, 4800, 5300, 5500, 0]


def test_mixed_inputs_keep_the_default_target(tmp_path: Path) -> None:
    from tests.inspectkit import SAMPLES

    home = _home(tmp_path)
    assert native_target([home / ".gemini", SAMPLES / "codex-sample.jsonl"]) is None
    assert native_target([SAMPLES]) is None
    assert native_target([tmp_path / "nothing-here"]) is None


def test_identity_simulation_covers_gemini(tmp_path: Path) -> None:
    """Implicit caching: no write fee, nothing cached below the model's minimum (2,048 for 2.5)."""
    s = GeminiSession()
    s.user("a short question", 0)
    s.answer("short", 3, tokens(1200, 5))
    s.user("another", 10)
    s.answer("again", 13, tokens(1400, 5, 0))
    path = write_jsonl(tmp_path / "chats" / "session-x.jsonl", s.records())
    res = run([path], load_spec(preset="identity"), RunOptions(out_dir=tmp_path / "out"))
    c = res.calls.filter(~pl.col("is_pending"))
    assert c["sim_cache_write_5m_tokens"].sum() == 0 and c["sim_cache_write_1h_tokens"].sum() == 0
    assert c["sim_cache_read_tokens"].sum() == 0  # 1,200-1,400 tokens: under gemini-2.5's minimum
    assert c["recorded_cost_usd"].is_not_null().all()


def test_a_new_turn_after_thoughts_is_no_thinking_strip(tmp_path: Path) -> None:
    """Stripping the thinking of the turn before a new user message is Anthropic's rule; Gemini CLI
    leaves every thought out of its history, so a shorter read there is Gemini's best effort."""
    s = GeminiSession()
    s.user("first", 0)
    s.answer("one", 3, tokens(9000, 5, 0, 40), thoughts=[("Plan", "think first")])
    s.user("second", 20)
    s.answer("two", 23, tokens(9100, 5, 8000, 40), thoughts=[("Plan", "think again")])
    s.user("third", 40)
    s.answer("three", 43, tokens(9200, 5, 6000))
    path = write_jsonl(tmp_path / "chats" / "session-t.jsonl", s.records())
    res = run([path], load_spec(preset="identity"), RunOptions(out_dir=tmp_path / "out"))
    c = res.calls.filter(~pl.col("is_pending")).sort("call")
    assert c["recorded_break_cause"].to_list() == [None, None, "best_effort"]


# ---------------------------------------------------------------- report


def _independent(files: list[Path], book: PriceBook) -> dict[str, dict[str, Any]]:
    """Per session: tokens and cost from the raw files, by our own reading and arithmetic: every
    answer once (its latest version with tokens), uncached input = input - cached + tool, output =
    output + thoughts, genai-prices' rates per million tokens, the whole request at the long-context
    rate above the threshold."""
    out: dict[str, dict[str, Any]] = defaultdict(lambda: {"input": 0, "output": 0, "cache_read": 0, "cost": 0.0,
                                                         "requests": 0, "unpriced": set()})
    answers: dict[tuple[str, str], tuple[str, dict[str, Any]]] = {}
    for f in files:
        if f.suffix == ".json":
            doc = json.loads(f.read_text())
            sid, msgs = doc["sessionId"], doc["messages"]
        else:
            objs = [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
            sid = objs[0]["sessionId"]
            msgs = [o for o in objs if "id" in o]
        for m in msgs:
            if m.get("type") == "gemini" and m.get("tokens"):
                answers[(sid, m["id"])] = (sid, m)
    for sid, m in answers.values():
        t = m["tokens"]
        inp = t["input"] - t["cached"] + t.get("tool", 0)
        out_t = t["output"] + t.get("thoughts", 0)
        row = out[sid]
        row["input"] += inp
        row["output"] += out_t
        row["cache_read"] += t["cached"]
        row["requests"] += 1
        r = book.rates(m["model"], m["timestamp"], (), "google")
        if r is None:
            row["unpriced"].add(m["model"])
            continue
        rates = r.base
        for threshold, tier in r.tiers:
            if inp + t["cached"] > threshold:
                rates = tier
        row["cost"] += (inp * rates.input + t["cached"] * rates.cache_read + out_t * rates.output) / 1e6
    return out


def _check_report(paths: list[Path], files: list[Path]) -> dict[str, Any]:
    book = PriceBook.load()
    rep = build_report(paths, book, ReportOptions(by="session", tz="UTC"))
    want = _independent(files, book)
    got = {r["key"]: r for r in rep.rows}
    assert set(got) == set(want)
    for sid, w in want.items():
        g = got[sid]
        assert (g["input_tokens"], g["output_tokens"], g["cache_read_tokens"], g["requests"]) == \
            (w["input"], w["output"], w["cache_read"], w["requests"]), sid
        assert g["cache_write_5m_tokens"] == g["cache_write_1h_tokens"] == 0
        assert g["cost_usd"] == pytest.approx(w["cost"], rel=1e-9, abs=1e-12), sid
        assert set(g["unpriced_models"]) == w["unpriced"]
        assert g["source"] == "gemini-cli"
    return {"report": rep, "want": want}


def test_report_prices_both_formats_and_counts_a_resumed_copy_once(tmp_path: Path) -> None:
    home = _home(tmp_path)
    chats = home / ".gemini" / "tmp" / "proj-a" / "chats"
    # the CLI resumed the older session: a .jsonl beside the .json with every message again
    write_jsonl(chats / "session-2026-03-01T09-00-5e551000.jsonl", standard().records())
    files = sorted(home.rglob("session-*"))
    got = _check_report([home / ".gemini"], files)
    rep = got["report"]
    assert rep.files == 3 and rep.requests == 10
    assert {r["project"] for r in rep.rows} == {"proj-a", "proj-b"}
    by_model = build_report([home / ".gemini"], PriceBook.load(), ReportOptions(by="model", tz="UTC"))
    assert {r["key"] for r in by_model.rows} == {"gemini-2.5-pro", "gemini-2.5-flash"}
    by_day = build_report([home / ".gemini"], PriceBook.load(), ReportOptions(by="day", tz="UTC"))
    assert [r["key"] for r in by_day.rows] == ["2026-03-01"]
    assert by_day.totals["cost_usd"] == pytest.approx(rep.totals["cost_usd"])


def test_report_flags_an_unknown_gemini_model(tmp_path: Path) -> None:
    s = GeminiSession()
    s.user("hi", 0)
    s.answer("hello", 2, tokens(3000, 4, 1000), model="gemini-99-imaginary")
    path = write_jsonl(tmp_path / "session-u.jsonl", s.records())
    rep = build_report([path], PriceBook.load(), ReportOptions(tz="UTC"))
    [row] = rep.rows
    assert row["unpriced_models"] == ["gemini-99-imaginary"] and row["unpriced_requests"] == 1
    assert row["cost_usd"] == 0 and row["input_tokens"] == 2000


def test_report_keeps_the_answers_a_rewind_dropped(tmp_path: Path) -> None:
    """An answer a rewind took out of the list was billed all the same."""
    s = GeminiSession()
    s.user("q", 0)
    s.answer("a1", 2, tokens(3000, 4))
    u = s.user("q2", 5)
    s.answer("a2", 7, tokens(3100, 4, 2900))
    recs = [*s.records(), {"$rewindTo": u["id"]}]
    path = write_jsonl(tmp_path / "session-r.jsonl", recs)
    rep = build_report([path], PriceBook.load(), ReportOptions(tz="UTC"))
    assert rep.requests == 2


@pytest.mark.corpus
def test_corpus_report_totals_equal_the_raw_files_priced(corpus_extra: Path) -> None:
    d = corpus_extra / "gemini-cli"
    files = sorted(d.iterdir())
    got = _check_report([d], files)
    assert len(got["want"]) == 4 and not any(w["unpriced"] for w in got["want"].values())


@pytest.mark.corpus
def test_corpus_gemini_run_validates_and_simulates(corpus_extra: Path, tmp_path: Path) -> None:
    """Every recorded answer is a call; the pending request of each session validates for the
    gemini target (the default for these files); the identity run simulates every call with the
    Gemini rules and prices the recorded usage as `report` does."""
    d = corpus_extra / "gemini-cli"
    res = run([d], load_spec(preset="default"), RunOptions(out_dir=tmp_path / "out"))
    assert res.summary["target"] == "gemini" and not res.violations
    assert res.calls.filter(pl.col("is_pending")).height == 4
    assert res.calls.filter(~pl.col("is_pending")).height == 395
    ident = run([d], load_spec(preset="identity"), RunOptions(out_dir=tmp_path / "id"))
    c = ident.calls.filter(~pl.col("is_pending"))
    assert c["sim_cost_usd"].is_not_null().all() and c["sim_cache_write_5m_tokens"].sum() == 0
    assert "thinking_strip" not in c["recorded_break_cause"].drop_nulls().to_list()
    rep = build_report([d], PriceBook.load(), ReportOptions(tz="UTC"))
    assert c["recorded_cost_usd"].sum() == pytest.approx(rep.totals["cost_usd"], rel=1e-9)
