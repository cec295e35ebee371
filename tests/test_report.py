"""`ctxreplay report`: dedupe, normalisation, grouping, pricing; equal to ccusage on the real tree."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from ctxreplay.pipeline.commands.cli import main
from ctxreplay.pipeline.cost.prices import PriceBook
from ctxreplay.pipeline.reporting.report import ReportOptions, build_report, hit_rate, scan_files

ROOT = Path(__file__).resolve().parent.parent
SID_A = "aaaaaaaa-0000-4000-8000-000000000001"
SID_B = "bbbbbbbb-0000-4000-8000-000000000002"


@pytest.fixture(autouse=True)
def _price_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    # the report's genai-prices cache goes to a temp dir, never ~/.cache
    monkeypatch.setenv("CTXREPLAY_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "price-cache"))


@pytest.fixture(scope="module")
def book() -> PriceBook:
    return PriceBook.load(cache_dir=None)


def cc_line(sid: str, mid: str | None, rid: str | None, out: int, ts: str, *, model: str = "claude-opus-4-6",
            sidechain: bool = False, inp: int = 3, cw5: int = 100, cw1: int = 0, cr: int = 1000,
            pretty: bool = False, **usage: Any) -> str:
    o: dict[str, Any] = {
        "parentUuid": None, "isSidechain": sidechain, "type": "assistant", "sessionId": sid, "timestamp": ts,
        "uuid": f"u-{mid}-{out}",
        "message": {"model": model, "role": "assistant", "content": [{"type": "text", "text": "ok"}],
                    "usage": {"input_tokens": inp, "output_tokens": out, "cache_creation_input_tokens": cw5 + cw1,
                              "cache_read_input_tokens": cr,
                              "cache_creation": {"ephemeral_5m_input_tokens": cw5, "ephemeral_1h_input_tokens": cw1},
                              **usage}}}
    if mid is not None:
        o["message"]["id"] = mid
    if rid is not None:
        o["requestId"] = rid
    return json.dumps(o) if pretty else json.dumps(o, separators=(",", ":"))


def progress_line(sid: str, mid: str, rid: str, out: int, ts: str, **kw: Any) -> str:
    inner = json.loads(cc_line(sid, mid, rid, out, ts, sidechain=True, **kw))
    return json.dumps({"type": "progress", "isSidechain": False, "sessionId": sid, "timestamp": ts, "uuid": "p-" + mid,
                       "data": {"type": "agent_progress", "agentId": "a1b2c3d", "message": inner}},
                      separators=(",", ":"))


def write(path: Path, lines: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def report(paths: list[Path], book: PriceBook, **kw: Any) -> dict[str, Any]:
    kw.setdefault("tz", "UTC")
    return build_report(paths, book, ReportOptions(**kw)).to_json()


def rows(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["key"]: r for r in doc["rows"]}


# ---------------------------------------------------------------------------------------------
# Claude Code: one copy per request


def test_split_lines_keep_the_largest_copy(tmp_path: Path, book: PriceBook) -> None:
    # one response written as three lines: output_tokens is final only on the last
    f = write(tmp_path / "p" / f"{SID_A}.jsonl", [
        cc_line(SID_A, "msg_1", "req_1", 1, "2026-02-10T10:00:00.000Z"),
        cc_line(SID_A, "msg_1", "req_1", 1, "2026-02-10T10:00:01.000Z"),
        cc_line(SID_A, "msg_1", "req_1", 780, "2026-02-10T10:00:02.000Z"),
        cc_line(SID_A, "msg_2", "req_2", 40, "2026-02-10T10:01:00.000Z"),
    ])
    doc = report([f], book)
    t = doc["totals"]
    assert (t["requests"], t["output_tokens"], t["input_tokens"], t["cache_read_tokens"]) == (2, 820, 6, 2000)


def test_first_copy_would_undercount_so_order_does_not_matter(tmp_path: Path, book: PriceBook) -> None:
    f = write(tmp_path / "p" / f"{SID_A}.jsonl", [
        cc_line(SID_A, "msg_1", "req_1", 780, "2026-02-10T10:00:02.000Z"),
        cc_line(SID_A, "msg_1", "req_1", 1, "2026-02-10T10:00:00.000Z"),
    ])
    assert report([f], book)["totals"]["output_tokens"] == 780


def test_same_message_id_with_another_request_id_is_another_request(tmp_path: Path, book: PriceBook) -> None:
    f = write(tmp_path / "p" / f"{SID_A}.jsonl", [
        cc_line(SID_A, "msg_1", "req_1", 5, "2026-02-10T10:00:00.000Z"),
        cc_line(SID_A, "msg_1", "req_2", 5, "2026-02-10T10:00:00.000Z"),
        cc_line(SID_A, None, None, 5, "2026-02-10T10:00:00.000Z"),       # no ids: never merged
        cc_line(SID_A, None, None, 5, "2026-02-10T10:00:00.000Z"),
    ])
    assert report([f], book)["totals"]["requests"] == 4


def test_non_sidechain_copy_beats_a_larger_sidechain_copy(tmp_path: Path, book: PriceBook) -> None:
    # a /btw-style sidechain replay of a main-thread request: the main copy is the request
    a = write(tmp_path / "p" / f"{SID_A}.jsonl", [cc_line(SID_A, "msg_1", "req_1", 9, "2026-02-10T10:00:00.000Z",
                                                          sidechain=True)])
    b = write(tmp_path / "p" / f"{SID_B}.jsonl", [cc_line(SID_B, "msg_1", "req_1", 5, "2026-02-11T10:00:00.000Z")])
    r = rows(report([a, b], book))
    assert list(r) == [SID_B] and r[SID_B]["output_tokens"] == 5


def test_equal_copies_in_two_sessions_go_to_the_first_file(tmp_path: Path, book: PriceBook) -> None:
    write(tmp_path / "p" / f"{SID_A}.jsonl", [cc_line(SID_A, "msg_1", "req_1", 5, "2026-02-12T10:00:00.000Z")])
    b = write(tmp_path / "p" / f"{SID_B}.jsonl", [cc_line(SID_B, "msg_1", "req_1", 5, "2026-02-10T10:00:00.000Z"),
                                                  cc_line(SID_B, "msg_2", "req_2", 5, "2026-02-10T10:00:00.000Z")])
    r = rows(report([tmp_path], book))
    assert (r[SID_A]["requests"], r[SID_B]["requests"]) == (1, 1)
    # a larger copy later in path order wins
    write(b, [cc_line(SID_B, "msg_1", "req_1", 50, "2026-02-10T10:00:00.000Z")])
    r = rows(report([tmp_path], book))
    assert list(r) == [SID_B] and r[SID_B]["output_tokens"] == 50


def test_subagent_and_compaction_files_belong_to_their_session(tmp_path: Path, book: PriceBook) -> None:
    proj = tmp_path / "projects" / "-home-me-proj"
    write(proj / f"{SID_A}.jsonl", [cc_line(SID_A, "msg_1", "req_1", 5, "2026-02-10T10:00:00.000Z")])
    write(proj / SID_A / "subagents" / "agent-a1b2c3d.jsonl",
          [cc_line(SID_A, "msg_2", "req_2", 5, "2026-02-10T10:01:00.000Z", sidechain=True,
                   model="claude-haiku-4-5-20251001")])
    # the session dir decides, whatever sessionId a line carries
    write(proj / SID_A / "subagents" / "agent-acompact-0f0f0f.jsonl",
          [cc_line(SID_B, "msg_3", "req_3", 5, "2026-02-10T10:02:00.000Z", sidechain=True)])
    doc = report([tmp_path], book)
    r = rows(doc)
    assert list(r) == [SID_A] and r[SID_A]["requests"] == 3 and r[SID_A]["project"] == "-home-me-proj"
    assert r[SID_A]["models"] == ["claude-haiku-4-5-20251001", "claude-opus-4-6"]
    assert rows(report([tmp_path], book, by="project"))["-home-me-proj"]["requests"] == 3


def test_flat_agent_file_joins_the_session_named_inside(tmp_path: Path, book: PriceBook) -> None:
    # Claude Code 2.0.x: agent-<8hex>.jsonl next to the session files, sessionId = the parent
    proj = tmp_path / "-home-me-proj"
    write(proj / f"{SID_A}.jsonl", [cc_line(SID_A, "msg_1", "req_1", 5, "2026-02-10T10:00:00.000Z")])
    write(proj / "agent-0a1b2c3d.jsonl", [cc_line(SID_A, "msg_2", "req_2", 5, "2026-02-10T10:00:00.000Z",
                                                  sidechain=True)])
    assert list(rows(report([tmp_path], book))) == [SID_A]


def test_agent_progress_copies(tmp_path: Path, book: PriceBook) -> None:
    proj = tmp_path / "-home-me-proj"
    write(proj / f"{SID_A}.jsonl", [
        cc_line(SID_A, "msg_1", "req_1", 5, "2026-02-10T10:00:00.000Z"),
        progress_line(SID_A, "msg_2", "req_2", 7, "2026-02-10T10:01:00.000Z"),     # also in the subagent file
        progress_line(SID_A, "msg_3", "req_3", 1, "2026-02-10T10:02:00.000Z"),     # only here (file missing)
        progress_line(SID_A, "msg_3", "req_3", 1, "2026-02-10T10:02:01.000Z"),
    ])
    write(proj / SID_A / "subagents" / "agent-a1b2c3d.jsonl",
          [cc_line(SID_A, "msg_2", "req_2", 7, "2026-02-10T10:01:00.000Z", sidechain=True)])
    default = report([tmp_path], book)
    assert default["totals"]["requests"] == 2
    po = default["progress_only"]
    assert (po["requests"], po["output_tokens"], po["counted"], po["sessions"]) == (1, 1, False, [SID_A])
    assert po["cost_usd"] > 0
    counted = report([tmp_path], book, count_progress_copies=True)
    assert counted["totals"]["requests"] == 3 and counted["progress_only"]["counted"]
    assert counted["totals"]["cost_usd"] == pytest.approx(default["totals"]["cost_usd"] + po["cost_usd"])
    # ccusage: its session report leaves them out, its daily report counts them
    assert report([tmp_path], book, compat="ccusage")["totals"]["requests"] == 2
    assert report([tmp_path], book, compat="ccusage", by="day")["totals"]["requests"] == 3


def test_pretty_printed_usage_counts_except_under_ccusage_compat(tmp_path: Path, book: PriceBook) -> None:
    f = write(tmp_path / "p" / f"{SID_A}.jsonl", [
        cc_line(SID_A, "msg_1", "req_1", 5, "2026-02-10T10:00:00.000Z"),
        cc_line(SID_A, "msg_2", "req_2", 5, "2026-02-10T10:00:00.000Z", pretty=True),     # "usage": {
    ])
    assert report([f], book)["totals"]["requests"] == 2
    assert report([f], book, compat="ccusage")["totals"]["requests"] == 1


def test_costusd_on_a_line_is_used_only_under_ccusage_compat(tmp_path: Path, book: PriceBook) -> None:
    o = json.loads(cc_line(SID_A, "msg_1", "req_1", 5, "2026-02-10T10:00:00.000Z"))
    o["costUSD"] = 1.5
    f = write(tmp_path / "p" / f"{SID_A}.jsonl", [json.dumps(o, separators=(",", ":"))])
    assert report([f], book, compat="ccusage")["totals"]["cost_usd"] == 1.5
    assert report([f], book)["totals"]["cost_usd"] < 0.01


def test_one_hour_writes_are_priced_at_the_one_hour_rate(tmp_path: Path, book: PriceBook) -> None:
    f = write(tmp_path / "p" / f"{SID_A}.jsonl", [
        cc_line(SID_A, "msg_1", "req_1", 0, "2026-03-20T10:00:00.000Z", inp=0, cw5=1000, cw1=0, cr=0),
        cc_line(SID_A, "msg_2", "req_2", 0, "2026-03-20T10:00:00.000Z", inp=0, cw5=0, cw1=1000, cr=0),
    ])
    t = report([f], book)["totals"]
    assert (t["cache_write_5m_tokens"], t["cache_write_1h_tokens"]) == (1000, 1000)
    assert t["cost_usd"] == pytest.approx((1000 * 6.25 + 1000 * 10) / 1e6)


def test_fast_mode_on_the_usage_is_priced(tmp_path: Path, book: PriceBook) -> None:
    f = write(tmp_path / "p" / f"{SID_A}.jsonl", [
        cc_line(SID_A, "msg_1", "req_1", 1000, "2026-03-20T10:00:00.000Z", inp=0, cw5=0, cr=0, speed="fast"),
        cc_line(SID_A, "msg_2", "req_2", 1000, "2026-03-20T10:00:00.000Z", inp=0, cw5=0, cr=0, speed="standard"),
    ])
    t = report([f], book)["totals"]
    assert t["cost_usd"] == pytest.approx(1000 * 25 * 6 / 1e6 + 1000 * 25 / 1e6)


def test_web_searches_are_priced_except_under_ccusage_compat(tmp_path: Path, book: PriceBook) -> None:
    f = write(tmp_path / "p" / f"{SID_A}.jsonl", [
        cc_line(SID_A, "msg_1", "req_1", 0, "2026-03-20T10:00:00.000Z", inp=0, cw5=0, cr=0,
                server_tool_use={"web_search_requests": 3})])
    assert report([f], book)["totals"]["cost_usd"] == pytest.approx(0.03)
    assert report([f], book, compat="ccusage")["totals"]["cost_usd"] == 0


def test_unpriced_model_is_listed_not_zeroed(tmp_path: Path) -> None:
    f = write(tmp_path / "p" / f"{SID_A}.jsonl", [
        cc_line(SID_A, "msg_1", "req_1", 5, "2026-02-10T10:00:00.000Z", model="claude-fake-model-9"),
        cc_line(SID_A, "msg_2", "req_2", 5, "2026-02-10T10:00:00.000Z"),
    ])
    res = CliRunner().invoke(main, ["report", str(f), "--json", "--tz", "UTC"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    r = doc["rows"][0]
    assert r["unpriced_models"] == ["claude-fake-model-9"] == doc["totals"]["unpriced_models"]
    assert r["models"] == ["claude-fake-model-9", "claude-opus-4-6"] and r["requests"] == 2
    assert r["unpriced_requests"] == 1 == doc["totals"]["unpriced_requests"]
    assert r["output_tokens"] == 10                            # its tokens are counted ...
    assert r["cost_usd"] == pytest.approx((3 * 5 + 5 * 25 + 100 * 6.25 + 1000 * 0.5) / 1e6)   # ... its cost is not 0
    assert "no price for claude-fake-model-9" in res.stderr and "--prices" in res.stderr
    # with a price for it, it is priced and the warning goes
    prices = tmp_path / "prices.toml"
    prices.write_text('[models."claude-fake-model-9"]\ninput = 100\noutput = 100\n')
    res2 = CliRunner().invoke(main, ["report", str(f), "--json", "--prices", str(prices)])
    doc2 = json.loads(res2.stdout)
    assert doc2["totals"]["unpriced_models"] == [] and "no price" not in res2.stderr
    assert doc2["totals"]["cost_usd"] > doc["totals"]["cost_usd"]


def test_zero_usage_lines_are_not_requests(tmp_path: Path, book: PriceBook) -> None:
    f = write(tmp_path / "p" / f"{SID_A}.jsonl", [
        cc_line(SID_A, "msg_1", "req_1", 0, "2026-02-10T10:00:00.000Z", model="<synthetic>", inp=0, cw5=0, cr=0)])
    t = report([f], book)["totals"]
    assert t["requests"] == 0 and t["unpriced_models"] == []


def test_bad_line_is_reported_and_two_objects_on_a_line_are_both_read(tmp_path: Path) -> None:
    good = cc_line(SID_A, "msg_1", "req_1", 5, "2026-02-10T10:00:00.000Z")
    f = write(tmp_path / "p" / f"{SID_A}.jsonl", [
        good[:-40],                                                                           # truncated
        cc_line(SID_A, "msg_2", "req_2", 5, "2026-02-10T10:00:00.000Z")
        + cc_line(SID_A, "msg_3", "req_3", 5, "2026-02-10T10:00:00.000Z"),                   # lost newline
    ])
    res = CliRunner().invoke(main, ["report", str(f), "--json"])
    assert res.exit_code == 0
    doc = json.loads(res.stdout)
    assert doc["totals"]["requests"] == 2
    assert [(b["file"], b["line"]) for b in doc["bad_lines"]] == [(str(f), 1)]
    assert "1 line(s) holding usage could not be read" in res.stderr and f"{f}:1" in res.stderr


# ---------------------------------------------------------------------------------------------
# OpenClaw / pi and Codex normalisation


OC_SID = "7d3f9a2e-1b4c-4e8a-9f60-2c5d8e1a4b37"


def oc_lines() -> list[str]:
    head = {"type": "session", "version": 3, "id": "0000aaaa-1b4c-4e8a-9f60-2c5d8e1a4b37",
            "timestamp": "2026-03-01T10:00:00.000Z", "cwd": "/home/me/shop"}

    def msg(i: int, usage: dict[str, Any], model: str = "claude-sonnet-4-5", provider: str = "anthropic") -> dict:
        return {"type": "message", "id": f"e{i}", "parentId": None, "timestamp": f"2026-03-01T10:0{i}:00.000Z",
                "message": {"role": "assistant", "content": [{"type": "text", "text": "ok"}], "api": "anthropic-messages",
                            "provider": provider, "model": model, "usage": usage, "stopReason": "stop",
                            "timestamp": 1772359200000 + i}}

    cost = {"input": 0, "output": 0, "cacheRead": 0, "cacheWrite": 0, "total": 0}
    return [json.dumps(x) for x in [
        head,
        {"type": "message", "id": "e0", "parentId": None, "timestamp": "2026-03-01T10:00:00.000Z",
         "message": {"role": "user", "content": [{"type": "text", "text": "hi"}], "timestamp": 1772359200000}},
        msg(1, {"input": 1000, "output": 50, "cacheRead": 20000, "cacheWrite": 3000, "totalTokens": 24050,
                "cost": cost}),
        msg(2, {"input": 10, "output": 5, "cacheRead": 23000, "cacheWrite": 100, "totalTokens": 23115, "cost": cost}),
        msg(3, {"input": 0, "output": 0, "cacheRead": 0, "cacheWrite": 0, "totalTokens": 0, "cost": cost},
            model="delivery-mirror", provider="openclaw"),
        msg(4, {"input": 500, "output": 20, "cacheRead": 0, "cacheWrite": 0, "totalTokens": 520, "cost": cost},
            model="acme/coder-1", provider="openrouter"),
    ]]


def test_openclaw_usage_is_normalised(tmp_path: Path, book: PriceBook) -> None:
    f = write(tmp_path / "agents" / "main" / "sessions" / f"{OC_SID}.jsonl.deleted.2026-03-02T00-00-00.000Z",
              oc_lines())
    doc = report([tmp_path], book)
    r = rows(doc)[OC_SID]                    # the file name is the session id, not the header id
    assert (r["input_tokens"], r["output_tokens"], r["cache_read_tokens"], r["cache_write_5m_tokens"],
            r["cache_write_1h_tokens"], r["requests"]) == (1510, 75, 43000, 3100, 0, 3)
    assert r["source"] == "openclaw" and r["project"] == "main"
    assert r["models"] == ["acme/coder-1", "claude-sonnet-4-5"] and r["unpriced_models"] == ["acme/coder-1"]
    want = book.price("claude-sonnet-4-5", "2026-03-01T10:01:00Z", 1000, 50, 3000, 0, 20000).total_usd \
        + book.price("claude-sonnet-4-5", "2026-03-01T10:02:00Z", 10, 5, 100, 0, 23000).total_usd  # type: ignore[union-attr]
    assert r["cost_usd"] == pytest.approx(want)
    assert r["cache_hit_rate"] == pytest.approx(43000 / (1510 + 3100 + 43000))
    assert f.exists()


def codex_lines() -> list[str]:
    def tc(ts: str, total: tuple[int, int, int], last: tuple[int, int, int] | None) -> dict:
        def u(t: tuple[int, int, int]) -> dict:
            return {"input_tokens": t[0], "cached_input_tokens": t[1], "output_tokens": t[2],
                    "reasoning_output_tokens": 0, "total_tokens": t[0] + t[2]}
        info = {"total_token_usage": u(total), "model_context_window": 272000}
        if last is not None:
            info["last_token_usage"] = u(last)
        return {"timestamp": ts, "type": "event_msg", "payload": {"type": "token_count", "info": info}}

    return [json.dumps(x) for x in [
        {"timestamp": "2026-01-01T10:00:00.000Z", "type": "session_meta",
         "payload": {"id": "019a7c21-4d2e-7f10-b3a8-5e6f7a8b9c0d", "cwd": "/home/me/app", "model_provider": "openai"}},
        {"timestamp": "2026-01-01T10:00:01.000Z", "type": "turn_context", "payload": {"model": "gpt-5-codex"}},
        {"timestamp": "2026-01-01T10:00:02.000Z", "type": "event_msg", "payload": {"type": "token_count", "info": None}},
        tc("2026-01-01T10:00:05.000Z", (3000, 2048, 100), (3000, 2048, 100)),
        tc("2026-01-01T10:00:06.000Z", (3000, 2048, 100), (3000, 2048, 100)),       # repeated event
        tc("2026-01-01T10:00:09.000Z", (7000, 5120, 150), (4000, 3072, 50)),
        {"timestamp": "2026-01-01T10:01:00.000Z", "type": "turn_context", "payload": {"model": "gpt-5.1-codex-max"}},
        tc("2026-01-01T10:01:05.000Z", (12000, 9216, 170), None),                   # no last: the difference
    ]]


def test_codex_cached_tokens_come_out_of_input(tmp_path: Path, book: PriceBook) -> None:
    f = write(tmp_path / "sessions" / "2026" / "01" / "01" / "rollout-2026-01-01T10-00-00-x.jsonl", codex_lines())
    doc = report([f], book)
    r = rows(doc)["019a7c21-4d2e-7f10-b3a8-5e6f7a8b9c0d"]
    # three requests: (3000, 2048, 100), (4000, 3072, 50), (5000, 4096, 20); uncached = input - cached
    assert (r["requests"], r["input_tokens"], r["cache_read_tokens"], r["output_tokens"]) == \
        (3, 952 + 928 + 904, 2048 + 3072 + 4096, 170)
    assert r["project"] == "/home/me/app" and r["source"] == "codex"
    assert r["models"] == ["gpt-5-codex", "gpt-5.1-codex-max"]
    want = sum(book.price(m, "2026-01-01T10:00:00Z", i - c, o, 0, 0, c).total_usd  # type: ignore[union-attr]
               for m, i, c, o in (("gpt-5-codex", 3000, 2048, 100), ("gpt-5-codex", 4000, 3072, 50),
                                  ("gpt-5.1-codex-max", 5000, 4096, 20)))
    assert r["cost_usd"] == pytest.approx(want)


def test_corpus_codex_and_openclaw_totals_match_the_files(corpus: Path, book: PriceBook) -> None:
    """Independent sums over the raw files: Codex's last cumulative total, OpenClaw's per-message usage."""
    codex = next((corpus / "codex").glob("*.jsonl"))
    last_total = None
    for line in codex.read_text().splitlines():
        o = json.loads(line)
        p = o.get("payload") or {}
        if p.get("type") == "token_count" and p.get("info"):
            last_total = p["info"]["total_token_usage"]
    assert last_total is not None
    t = report([codex], book)["totals"]
    assert (t["input_tokens"] + t["cache_read_tokens"], t["cache_read_tokens"], t["output_tokens"]) == \
        (last_total["input_tokens"], last_total["cached_input_tokens"], last_total["output_tokens"])
    assert t["unpriced_models"] == [] and t["cost_usd"] > 0
    want = {"input": 0, "output": 0, "cacheRead": 0, "cacheWrite": 0}
    n = 0
    for f in sorted((corpus / "openclaw").iterdir()):
        for line in f.read_text().splitlines():
            for part in line.replace("}{\"type\"", "}\n{\"type\"").splitlines():   # the line with two objects
                o = json.loads(part)
                m = o.get("message") or {}
                if o.get("type") == "message" and m.get("role") == "assistant" and isinstance(m.get("usage"), dict):
                    if sum(m["usage"].get(k, 0) for k in want):
                        n += 1
                    for k in want:
                        want[k] += m["usage"].get(k, 0)
    t = report([corpus / "openclaw"], book)["totals"]
    assert (t["input_tokens"], t["output_tokens"], t["cache_read_tokens"], t["cache_write_5m_tokens"]) == \
        (want["input"], want["output"], want["cacheRead"], want["cacheWrite"])
    assert t["requests"] == n
    # the free OpenRouter models are not in genai-prices: reported, not priced at 0
    assert "stepfun/step-3.5-flash:free" in t["unpriced_models"]
    assert "claude-opus-4-5" not in t["unpriced_models"]


# ---------------------------------------------------------------------------------------------
# grouping, filters, the command


def test_days_follow_tz_and_since_until_are_inclusive(tmp_path: Path, book: PriceBook) -> None:
    f = write(tmp_path / "p" / f"{SID_A}.jsonl", [
        cc_line(SID_A, "msg_1", "req_1", 1, "2026-02-10T22:30:00.000Z"),      # 23:30 in Paris: still the 10th
        cc_line(SID_A, "msg_2", "req_2", 2, "2026-02-10T23:30:00.000Z"),      # 00:30 on the 11th in Paris
        cc_line(SID_A, "msg_3", "req_3", 4, "2026-03-01T12:00:00.000Z"),
    ])
    utc = rows(report([f], book, by="day", tz="UTC"))
    paris = rows(report([f], book, by="day", tz="Europe/Paris"))
    assert {k: r["output_tokens"] for k, r in utc.items()} == {"2026-02-10": 3, "2026-03-01": 4}
    assert {k: r["output_tokens"] for k, r in paris.items()} == {"2026-02-10": 1, "2026-02-11": 2, "2026-03-01": 4}
    assert {k: r["output_tokens"] for k, r in rows(report([f], book, by="month")).items()} == \
        {"2026-02": 3, "2026-03": 4}
    from datetime import date

    def out(**kw: Any) -> int:
        return report([f], book, tz="Europe/Paris", **kw)["totals"]["output_tokens"]

    assert out(since=date(2026, 2, 11)) == 6 and out(since=date(2026, 2, 12)) == 4
    assert out(until=date(2026, 2, 10)) == 1 and out(until=date(2026, 2, 11)) == 3


def test_by_model_rows(tmp_path: Path, book: PriceBook) -> None:
    f = write(tmp_path / "p" / f"{SID_A}.jsonl", [
        cc_line(SID_A, "msg_1", "req_1", 1, "2026-02-10T10:00:00.000Z"),
        cc_line(SID_A, "msg_2", "req_2", 2, "2026-02-10T10:00:00.000Z", model="claude-haiku-4-5-20251001")])
    assert [r["key"] for r in report([f], book, by="model")["rows"]] == ["claude-opus-4-6", "claude-haiku-4-5-20251001"]


def test_cache_hit_rate_definition() -> None:
    assert hit_rate(2, 100, 50, 848) == pytest.approx(848 / 1000)
    assert hit_rate(0, 0, 0, 0) is None


def test_json_shape_and_table(tmp_path: Path) -> None:
    f = write(tmp_path / "p" / f"{SID_A}.jsonl", [cc_line(SID_A, "msg_1", "req_1", 5, "2026-02-10T10:00:00.000Z")])
    res = CliRunner().invoke(main, ["report", str(f), "--json", "--by", "day", "--tz", "UTC"])
    assert res.exit_code == 0
    doc = json.loads(res.stdout)
    keys = {"key", "input_tokens", "output_tokens", "cache_write_5m_tokens", "cache_write_1h_tokens",
            "cache_read_tokens", "cost_usd", "cache_hit_rate", "models", "unpriced_models"}
    assert keys <= set(doc["rows"][0]) and keys - {"key"} <= set(doc["totals"])
    assert doc["genai_prices_version"] == PriceBook.load(cache_dir=None).genai_prices_version
    assert doc["by"] == "day" and doc["tz"] == "UTC"
    # a wide terminal: the table is not narrowed (short session ids come at 100 columns, tested below)
    table = CliRunner().invoke(main, ["report", str(f), "--tz", "UTC"], env={"COLUMNS": "200"})
    assert table.exit_code == 0 and "Total" in table.stdout and SID_A in table.stdout
    assert "genai-prices" in table.stdout


@pytest.mark.parametrize(("args", "says"), [
    (["/nonexistent/dir"], "no such file or directory"),
    (["--tz", "Mars/Olympus"], "not a time zone name"),
    (["--since", "10/02/2026"], "write a date as YYYYMMDD"),
    (["--prices", "/nonexistent/prices.toml"], "cannot be read"),
])
def test_bad_arguments_exit_2_with_a_message(tmp_path: Path, args: list[str], says: str) -> None:
    f = write(tmp_path / "p" / f"{SID_A}.jsonl", [cc_line(SID_A, "msg_1", "req_1", 5, "2026-02-10T10:00:00.000Z")])
    full = ["report", *args] if args[0].startswith("/") else ["report", str(f), *args]
    res = CliRunner().invoke(main, full)
    assert res.exit_code == 2 and says in res.stderr


def test_no_paths_reads_claude_config_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write(tmp_path / "cfg" / "projects" / "-p" / f"{SID_A}.jsonl",
          [cc_line(SID_A, "msg_1", "req_1", 5, "2026-02-10T10:00:00.000Z")])
    monkeypatch.setenv("CLAUDE_CONFIG_DIR", str(tmp_path / "cfg"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    res = CliRunner().invoke(main, ["report", "--json"])
    assert res.exit_code == 0 and json.loads(res.stdout)["rows"][0]["key"] == SID_A
    monkeypatch.setenv("CLAUDE_CONFIG_DIR", str(tmp_path / "nothing"))
    res = CliRunner().invoke(main, ["report"])
    assert res.exit_code == 2 and "no PATHS given" in res.stderr


def test_report_command_imports_nothing_heavy(tmp_path: Path) -> None:
    f = write(tmp_path / "p" / f"{SID_A}.jsonl", [cc_line(SID_A, "msg_1", "req_1", 5, "2026-02-10T10:00:00.000Z")])
    code = ("import sys\nfrom ctxreplay.pipeline.commands.cli import main\n"
            "try:\n    main(['report', sys.argv[1], '--json'])\nexcept SystemExit:\n    pass\n"
            "heavy = [m for m in ('polars', 'pyarrow', 'duckdb', 'tiktoken', 'ctxreplay.stages', 'PIL', 'rich', 'genai_prices')"
            " if m in sys.modules]\nprint(heavy, file=sys.stderr)\n")
    env = {**os.environ, "CTXREPLAY_CACHE_DIR": str(tmp_path / "cache")}
    cmd = [sys.executable, "-c", code, str(f)]
    subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, check=True)   # warms the price cache
    warm = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, check=True)
    assert warm.stderr.strip().splitlines()[-1] == "[]"


# ---------------------------------------------------------------------------------------------
# the real tree and ccusage 20.0.24's figures


def _cc_tokens(s: dict[str, Any]) -> tuple[int, int, int, int]:
    return (s["inputTokens"], s["outputTokens"], s["cacheCreationTokens"], s["cacheReadTokens"])


def _our_tokens(r: dict[str, Any]) -> tuple[int, int, int, int]:
    return (r["input_tokens"], r["output_tokens"], r["cache_write_5m_tokens"] + r["cache_write_1h_tokens"],
            r["cache_read_tokens"])


@pytest.mark.corpus
def test_corpus_sessions_equal_ccusage_session_report(corpus: Path) -> None:
    res = CliRunner().invoke(main, ["report", str(corpus / "claude-projects"), "--by", "session", "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    want = json.loads((corpus / "ccusage-expected" / "real.session.json").read_text())
    got = rows(doc)
    assert set(got) == {s["period"] for s in want["session"]}
    for s in want["session"]:
        r = got[s["period"]]
        assert _our_tokens(r) == _cc_tokens(s), s["period"]
        assert round(r["cost_usd"], 2) == round(s["totalCost"], 2) and r["cost_usd"] == pytest.approx(s["totalCost"])
        assert sorted(r["models"]) == sorted(s["modelsUsed"]) and r["unpriced_models"] == []
    assert round(doc["totals"]["cost_usd"], 4) == 51.5794
    assert doc["totals"]["requests"] == 881
    assert (doc["totals"]["cache_write_5m_tokens"], doc["totals"]["cache_write_1h_tokens"]) == (1297908, 728329)


@pytest.mark.corpus
def test_corpus_days_and_the_0_0382_usd_difference_from_ccusage_daily(corpus: Path, book: PriceBook) -> None:
    """ccusage's daily report is 0.0382 USD above its session report: five Haiku requests of subagent
    afb92ff in session 491e126e, on 2026-02-10, whose subagent file is not in the tree; their only
    record is nine `agent_progress` copies in the session's main file. ccusage's daily report counts
    those copies, its session report does not; ctxreplay by default does not either (same total
    in every grouping) and reports them under `progress_only`."""
    tree = corpus / "claude-projects"
    daily = json.loads((corpus / "ccusage-expected" / "real.daily.json").read_text())
    ours = report([tree], book, by="day", tz="UTC")
    assert round(ours["totals"]["cost_usd"], 4) == 51.5794
    assert round(daily["totals"]["totalCost"] - ours["totals"]["cost_usd"], 4) == 0.0382
    po = ours["progress_only"]
    assert (po["requests"], po["sessions"], po["models"]) == (5, ["491e126e-1e71-469c-ade2-fcc8af567c74"],
                                                             ["claude-haiku-4-5-20251001"])
    assert (po["input_tokens"], po["output_tokens"], po["cache_write_5m_tokens"] + po["cache_write_1h_tokens"],
            po["cache_read_tokens"]) == (24, 7, 14285, 95343)
    assert po["cost_usd"] == pytest.approx(daily["totals"]["totalCost"] - ours["totals"]["cost_usd"])
    assert po["first_activity"].startswith("2026-02-10T21:58")
    got = rows(ours)
    for d in daily["daily"]:
        if d["period"] != "2026-02-10":
            assert _our_tokens(got[d["period"]]) == _cc_tokens(d) and got[d["period"]]["cost_usd"] == \
                pytest.approx(d["totalCost"])
    # --compat ccusage reproduces the daily and monthly reports; --count-progress-copies the same total
    for by, name, key in (("day", "real.daily.json", "daily"), ("month", "real.monthly.json", "monthly")):
        want = json.loads((corpus / "ccusage-expected" / name).read_text())
        compat = rows(report([tree], book, by=by, tz="UTC", compat="ccusage"))
        assert set(compat) == {d["period"] for d in want[key]}
        for d in want[key]:
            assert _our_tokens(compat[d["period"]]) == _cc_tokens(d)
            assert compat[d["period"]]["cost_usd"] == pytest.approx(d["totalCost"])
    counted = report([tree], book, by="day", tz="UTC", count_progress_copies=True)
    assert round(counted["totals"]["cost_usd"], 4) == 51.6176


@pytest.mark.corpus
def test_corpus_ccusage_compat_session_equals_default(corpus: Path, book: PriceBook) -> None:
    tree = corpus / "claude-projects"
    a = report([tree], book)
    b = report([tree], book, compat="ccusage")
    assert [(_our_tokens(r), round(r["cost_usd"], 9)) for r in a["rows"]] == \
        [(_our_tokens(r), round(r["cost_usd"], 9)) for r in b["rows"]]


@pytest.mark.corpus
def test_corpus_worker_processes_give_the_same_report(corpus: Path, book: PriceBook) -> None:
    tree = corpus / "claude-projects"
    one = report([tree], book, workers=1)
    two = report([tree], book, workers=2)
    assert one["rows"] == two["rows"] and one["totals"] == two["totals"]
    scans = scan_files(sorted(str(p) for p in tree.rglob("*.jsonl")), workers=2)
    assert sum(s.usage_lines for s in scans) == one["usage_lines"]


def test_price_lookups_made_in_a_worker_reach_the_disk_cache(tmp_path: Path) -> None:
    # two files, two models: with two processes one of them is priced in the forked worker
    write(tmp_path / "p" / f"{SID_A}.jsonl", [cc_line(SID_A, "msg_1", "req_1", 5, "2026-02-10T10:00:00.000Z")] * 3)
    write(tmp_path / "p" / f"{SID_B}.jsonl", [cc_line(SID_B, "msg_2", "req_2", 5, "2026-02-10T10:00:00.000Z",
                                                      model="claude-haiku-4-5-20251001")])
    cold = PriceBook.load(cache_dir=tmp_path / "cache")
    two = build_report([tmp_path / "p"], cold, ReportOptions(workers=2, tz="UTC")).to_json()
    assert two["totals"]["unpriced_models"] == [] and two["totals"]["requests"] == 2
    warm = PriceBook.load(cache_dir=tmp_path / "cache")
    assert {"|claude-opus-4-6", "|claude-haiku-4-5-20251001"} <= set(warm._lookups)
    one = build_report([tmp_path / "p"], warm, ReportOptions(workers=1, tz="UTC")).to_json()
    assert one["rows"] == two["rows"]


# ---------------------------------------------------------------------------------------------
# bench/gen_tree.py


def _ids(tree: Path) -> dict[str, set[str]]:
    import re

    out: dict[str, set[str]] = {"msg": set(), "req": set(), "uuid": set()}
    for f in tree.rglob("*.jsonl"):
        text = f.read_text()
        out["msg"] |= set(re.findall(r'"id":"(msg_[0-9A-Za-z]+)"', text))
        out["req"] |= set(re.findall(r'"requestId":"(req_[0-9A-Za-z]+)"', text))
        out["uuid"] |= set(re.findall(r'"uuid":"([0-9a-f-]{36})"', text))
    return out


@pytest.mark.corpus
def test_gen_tree_copies_have_fresh_consistent_ids(corpus: Path, tmp_path: Path, book: PriceBook) -> None:
    from bench.gen_tree import generate

    src = corpus / "claude-projects"
    st = generate(tmp_path / "t", copies=2, src=src, seed=7)
    assert st.copies == 2 and st.bytes == 2 * st.source_bytes and st.sessions == 16
    out = tmp_path / "t" / "projects"
    # valid JSON everywhere; subagent files still sit under their (renamed) session; parent links
    # resolve as often as in the source (some point into another file of the session, some nowhere)
    def dangling(tree: Path) -> int:
        uuids, parents = set(), []
        for f in tree.rglob("*.jsonl"):
            for line in f.read_text().splitlines():
                o = json.loads(line)
                uuids.add(o.get("uuid"))
                parents += [o[k] for k in ("parentUuid", "logicalParentUuid") if o.get(k)]
                if f.parent.name == "subagents":
                    assert o.get("sessionId") in (None, f.parent.parent.name)
                    aid = o.get("agentId")
                    assert aid is None or f.name == f"agent-{aid}.jsonl"
        return sum(p not in uuids for p in parents)

    assert dangling(out) == 2 * dangling(src)
    ids_src, ids_new = _ids(src), _ids(out)
    for k in ids_src:
        assert not ids_src[k] & ids_new[k], k           # nothing shared with the source
        assert len(ids_new[k]) == 2 * len(ids_src[k]), k  # nor between the two copies
    # usage and models are kept: the report of the copies is twice the source's
    a, b = report([src], book), report([out], book)
    assert len(b["rows"]) == 16 and b["totals"]["cost_usd"] == pytest.approx(2 * a["totals"]["cost_usd"])
    assert b["totals"]["output_tokens"] == 2 * a["totals"]["output_tokens"]
    # deterministic
    generate(tmp_path / "t2", copies=2, src=src, seed=7)
    for f in out.rglob("*"):
        if f.is_file():
            assert (tmp_path / "t2" / f.relative_to(tmp_path / "t")).read_bytes() == f.read_bytes()


def test_gen_tree_stops_at_the_size_and_refuses_a_used_folder(tmp_path: Path) -> None:
    from bench.gen_tree import generate, parse_size

    src = ROOT / "data" / "samples" / "claude-projects"
    size = sum(f.stat().st_size for f in src.rglob("*") if f.is_file())
    st = generate(tmp_path / "t", size=int(size * 2.5), src=src)
    assert st.copies == 3 and st.bytes >= size * 2.5 and st.bytes == 3 * size
    assert parse_size("190MB") == 190_000_000 and parse_size("0.8GB") == 800_000_000
    with pytest.raises(FileExistsError):
        generate(tmp_path / "t", copies=1, src=src)


# ---------------------------------------------------------------------------------------------
# the table fits the terminal (issue 24)


def _widths(text: str) -> int:
    from rich.cells import cell_len

    return max(cell_len(line) for line in text.splitlines())


def test_session_table_fits_columns_with_numbers_whole(tmp_path: Path) -> None:
    lines = [cc_line(SID_A, f"msg_{i}", f"req_{i}", 123_456, f"2026-02-1{i}T10:00:00.000Z", cr=98_765_432,
                     cw5=1_234_567, cw1=7_654_321, inp=3_456_789,
                     model="claude-opus-4-5-20251101" if i % 2 else "claude-haiku-4-5-20251001") for i in range(4)]
    f = write(tmp_path / "-home-me-a-long-project-name" / f"{SID_A}.jsonl", lines)
    wide = CliRunner().invoke(main, ["report", str(f), "--tz", "UTC", "--wide"], env={"COLUMNS": "100"})
    assert wide.exit_code == 0 and SID_A in wide.stdout and "claude-opus-4-5-20251101" in wide.stdout
    assert "Cache write 5m" in wide.stdout and _widths(wide.stdout) > 100
    for cols in (100, 140):
        res = CliRunner().invoke(main, ["report", str(f), "--tz", "UTC"], env={"COLUMNS": str(cols)})
        assert res.exit_code == 0, res.output
        assert _widths(res.stdout) <= cols, res.stdout
        assert "…" not in res.stdout
        assert SID_A[:8] in res.stdout and SID_A not in res.stdout
        assert "395,061,728" in res.stdout and "493,824" in res.stdout     # cache read and output totals, whole
        assert "--wide shows every column" in res.stderr
    res = CliRunner().invoke(main, ["report", str(f), "--tz", "UTC"], env={"COLUMNS": "140"})
    assert "opus-4-5" in res.stdout and "claude-opus" not in res.stdout      # short model names kept at 140
    doc = json.loads(CliRunner().invoke(main, ["report", str(f), "--json"], env={"COLUMNS": "60"}).stdout)
    assert doc["rows"][0]["key"] == SID_A and doc["rows"][0]["cache_write_1h_tokens"] == 4 * 7_654_321


def test_corpus_session_table_fits_100_columns(corpus: Path) -> None:
    res = CliRunner().invoke(main, ["report", str(corpus), "--tz", "UTC"], env={"COLUMNS": "100"})
    assert res.exit_code == 0
    assert _widths(res.stdout) <= 100 and "…" not in res.stdout
    assert "120,500,405" in res.stdout        # the cache-read total, whole


def test_empty_directory_says_no_transcripts_and_strict_exits_1(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    res = CliRunner().invoke(main, ["report", str(tmp_path / "empty")])
    assert res.exit_code == 0
    assert f"no transcripts found under {tmp_path / 'empty'}" in res.stderr and "┏" not in res.stdout
    res = CliRunner().invoke(main, ["report", str(tmp_path / "empty"), "--strict"])
    assert res.exit_code == 1 and "no transcripts found" in res.stderr
    res = CliRunner().invoke(main, ["report", str(tmp_path / "empty"), "--json"])
    assert res.exit_code == 0 and json.loads(res.stdout)["files"] == 0
    f = write(tmp_path / "p" / f"{SID_A}.jsonl", [cc_line(SID_A, "msg_1", "req_1", 5, "2026-02-10T10:00:00.000Z")])
    assert CliRunner().invoke(main, ["report", str(f), "--strict"]).exit_code == 0
    write(f, [cc_line(SID_A, "msg_1", "req_1", 5, "2026-02-10T10:00:00.000Z")[:-30]])
    res = CliRunner().invoke(main, ["report", str(f), "--strict"])
    assert res.exit_code == 1 and "--strict: 1 line(s) holding usage could not be read" in res.stderr


def test_broken_line_holding_usage_without_output_tokens_is_a_bad_line(tmp_path: Path) -> None:
    f = write(tmp_path / "p" / f"{SID_A}.jsonl", [
        cc_line(SID_A, "msg_1", "req_1", 5, "2026-02-10T10:00:00.000Z"),
        '{"type":"assistant","message":{"usage":{"input_tokens":5',
        '{"type":"user","message":{"content":"what is \\"usage\\"?"}}',
    ])
    res = CliRunner().invoke(main, ["report", str(f), "--json"])
    doc = json.loads(res.stdout)
    assert doc["totals"]["requests"] == 1
    assert [(b["file"], b["line"]) for b in doc["bad_lines"]] == [(str(f), 2)]
    assert "1 line(s) holding usage could not be read" in res.stderr


def test_by_week_starts_on_sunday_like_ccusage_or_on_the_day_given(tmp_path: Path, book: PriceBook) -> None:
    f = write(tmp_path / "p" / f"{SID_A}.jsonl", [
        cc_line(SID_A, "msg_1", "req_1", 1, "2026-02-07T10:00:00.000Z"),     # a Saturday
        cc_line(SID_A, "msg_2", "req_2", 2, "2026-02-08T10:00:00.000Z"),     # Sunday
        cc_line(SID_A, "msg_3", "req_3", 4, "2026-02-09T10:00:00.000Z"),     # Monday
    ])
    assert {k: r["output_tokens"] for k, r in rows(report([f], book, by="week")).items()} == \
        {"2026-02-01": 1, "2026-02-08": 6}
    assert {k: r["output_tokens"] for k, r in rows(report([f], book, by="week", start_of_week="monday")).items()} == \
        {"2026-02-02": 3, "2026-02-09": 4}
    res = CliRunner().invoke(main, ["report", str(f), "--by", "week", "--start-of-week", "monday", "--tz", "UTC"])
    assert res.exit_code == 0 and "Week" in res.stdout and "2026-02-09" in res.stdout


def test_breakdown_gives_per_model_rows_inside_each_row(tmp_path: Path, book: PriceBook) -> None:
    f = write(tmp_path / "p" / f"{SID_A}.jsonl", [
        cc_line(SID_A, "msg_1", "req_1", 1, "2026-02-07T10:00:00.000Z", model="claude-opus-4-6"),
        cc_line(SID_A, "msg_2", "req_2", 2, "2026-02-07T11:00:00.000Z", model="claude-haiku-4-5-20251001"),
        cc_line(SID_A, "msg_3", "req_3", 4, "2026-02-07T12:00:00.000Z", model="claude-opus-4-6"),
    ])
    doc = report([f], book, breakdown=True)
    row = doc["rows"][0]
    subs = {b["model"]: b for b in row["breakdown"]}
    assert set(subs) == {"claude-opus-4-6", "claude-haiku-4-5-20251001"}
    assert subs["claude-opus-4-6"]["output_tokens"] == 5 and subs["claude-opus-4-6"]["requests"] == 2
    assert sum(b["cost_usd"] for b in row["breakdown"]) == pytest.approx(row["cost_usd"])
    assert [b["model"] for b in row["breakdown"]] == ["claude-opus-4-6", "claude-haiku-4-5-20251001"]   # by cost
    assert "breakdown" not in report([f], book)["rows"][0]
    res = CliRunner().invoke(main, ["report", str(f), "--breakdown", "--tz", "UTC"], env={"COLUMNS": "140"})
    assert res.exit_code == 0 and "└ opus-4-6" in res.stdout and "└ haiku-4-5" in res.stdout
    res = CliRunner().invoke(main, ["report", str(f), "--breakdown", "--json"])
    assert len(json.loads(res.stdout)["rows"][0]["breakdown"]) == 2


def test_by_block_follows_ccusage_five_hour_blocks(tmp_path: Path, book: PriceBook) -> None:
    times = ["2026-02-10T10:15:00.000Z", "2026-02-10T12:00:00.000Z", "2026-02-10T15:00:00.000Z",   # 5 h exactly: in
             "2026-02-10T15:10:00.000Z", "2026-02-10T15:20:00.000Z",                                 # past 5 h: next
             "2026-02-11T01:00:00.000Z"]                                                             # a gap: next
    f = write(tmp_path / "p" / f"{SID_A}.jsonl", [cc_line(SID_A, f"m{i}", f"r{i}", 1, ts) for i, ts in enumerate(times)])
    g = write(tmp_path / "p" / f"{SID_B}.jsonl", [cc_line(SID_B, "mb", "rb", 1, "2026-02-10T11:00:00.000Z")])
    doc = report([f, g], book, by="block")
    assert [(r["key"], r["requests"], r["block_start"], r["block_end"], r["active"]) for r in doc["rows"]] == [
        ("2026-02-10 10:00", 4, "2026-02-10T10:00:00.000Z", "2026-02-10T15:00:00.000Z", False),
        ("2026-02-10 15:00", 2, "2026-02-10T15:00:00.000Z", "2026-02-10T20:00:00.000Z", False),
        ("2026-02-11 01:00", 1, "2026-02-11T01:00:00.000Z", "2026-02-11T06:00:00.000Z", False)]
    assert report([f, g], book, by="block", tz="Asia/Kolkata")["rows"][0]["key"] == "2026-02-10 15:30"
    res = CliRunner().invoke(main, ["report", str(f), "--by", "block", "--tz", "UTC"])
    assert res.exit_code == 0 and "Block" in res.stdout and "2026-02-10 15:00" in res.stdout


def test_since_mode_session_keeps_whole_sessions_by_last_activity(tmp_path: Path, book: PriceBook) -> None:
    f = write(tmp_path / "p" / f"{SID_A}.jsonl", [
        cc_line(SID_A, "m1", "r1", 1, "2026-02-09T10:00:00.000Z"),
        cc_line(SID_A, "m2", "r2", 2, "2026-02-10T10:00:00.000Z"),
        cc_line(SID_A, "m3", "r3", 4, "2026-02-11T10:00:00.000Z")])
    g = write(tmp_path / "p" / f"{SID_B}.jsonl", [cc_line(SID_B, "m4", "r4", 8, "2026-02-08T10:00:00.000Z")])
    from datetime import date

    def outs(**kw: Any) -> dict[str, int]:
        return {k: r["output_tokens"] for k, r in rows(report([f, g], book, **kw)).items()}

    assert outs(since=date(2026, 2, 10)) == {SID_A: 6}
    assert outs(since=date(2026, 2, 10), since_mode="session") == {SID_A: 7}
    assert outs(until=date(2026, 2, 10)) == {SID_A: 3, SID_B: 8}
    assert outs(until=date(2026, 2, 10), since_mode="session") == {SID_B: 8}
    res = CliRunner().invoke(main, ["report", str(f), "--since", "20260210", "--since-mode", "session", "--json"])
    assert res.exit_code == 0 and json.loads(res.stdout)["totals"]["output_tokens"] == 7
    assert "--since-mode" in CliRunner().invoke(main, ["report", "--help"]).stdout


# ---------------------------------------------------------------------------------------------
# --max-line-bytes (issue 23, item 6): a line that may hold usage and is over the limit is skipped
# and counted, never copied out of the file's map


def _long_cc_line(n: int) -> str:
    """An assistant line holding usage whose text makes it `n` bytes long."""
    base = cc_line(SID_A, "msg_2", "req_2", 7, "2026-02-10T10:01:00.000Z")
    o = json.loads(base)
    o["message"]["content"][0]["text"] = ""
    pad = n - len(json.dumps(o, separators=(",", ":")))
    o["message"]["content"][0]["text"] = "y" * pad
    line = json.dumps(o, separators=(",", ":"))
    assert len(line) == n
    return line


@pytest.mark.parametrize("over", [False, True])
def test_report_skips_and_counts_a_usage_line_over_max_line_bytes(tmp_path: Path, over: bool) -> None:
    """A line of 300,000 bytes holding usage: read at --max-line-bytes 300000, and at 299999 left out
    (its request not counted), listed in bad_lines with its line and length, counted in
    lines_too_long, said on stderr; --strict exits 1 then."""
    n = 300_000
    f = write(tmp_path / "p" / f"{SID_A}.jsonl", [cc_line(SID_A, "msg_1", "req_1", 5, "2026-02-10T10:00:00.000Z"),
                                                  _long_cc_line(n)])
    limit = str(n - 1 if over else n)
    res = CliRunner().invoke(main, ["report", str(f), "--json", "--max-line-bytes", limit, "--tz", "UTC"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["totals"]["requests"] == (1 if over else 2)
    assert doc["lines_too_long"] == (1 if over else 0) and doc["max_line_bytes"] == int(limit)
    if over:
        (b,) = doc["bad_lines"]
        assert (b["file"], b["line"]) == (str(f), 2)
        assert f"a line of {n:,} bytes, over the limit of {n - 1:,} bytes (--max-line-bytes): not read" in b["reason"]
        assert b["raw"].startswith('{"parentUuid"') and len(b["raw"]) == 200
        assert "longer than --max-line-bytes (299,999 bytes): not read" in res.stderr
    else:
        assert doc["bad_lines"] == [] and "max-line-bytes" not in res.stderr
    strict = CliRunner().invoke(main, ["report", str(f), "--strict", "--max-line-bytes", limit, "--tz", "UTC"])
    assert strict.exit_code == (1 if over else 0)


def test_report_line_limit_for_codex_openclaw_and_gemini_cli(tmp_path: Path, book: PriceBook) -> None:
    """Every scanner takes the limit: a Codex token_count event, an OpenClaw message and a Gemini CLI
    answer over it are not read (each counted once); the other lines are, as without a limit. A
    Gemini CLI .json document is read whole: over the limit it is one line too long."""
    from ctxreplay.pipeline.loaders.inputs import MAX_LINE_BYTES
    from tests.geminikit import standard, tokens, write_json, write_jsonl

    codex = codex_lines()
    big = json.loads(codex[-1])
    big["payload"]["info"]["pad"] = "z" * 5000
    codex[-1] = json.dumps(big)
    cf = write(tmp_path / "c" / "rollout-2026-01-01T10-00-00-x.jsonl", codex)
    oc = oc_lines()
    m4 = json.loads(oc[-1])
    m4["message"]["content"][0]["text"] = "z" * 5000
    oc[-1] = json.dumps(m4)
    of = write(tmp_path / "o" / f"{OC_SID}.jsonl", oc)
    gdir = tmp_path / "g" / ".gemini" / "tmp" / "proj" / "chats"
    g = standard()
    g.answer("z" * 5000, 100, tokens(10, 5))
    gj = write_jsonl(gdir / "session-2026-03-01T09-00-5e551001.jsonl", g.records())
    gd = write_json(gdir / "session-2026-03-01T09-00-5e551002.json", standard("00000000-2222-4222-8333-000000000009").document())
    whole = {p: report([p], book) for p in (cf, of, gj, gd)}
    longest = {p: max(len(x) for x in p.read_bytes().split(b"\n")) for p in (cf, of, gj)}
    token = MAX_LINE_BYTES.set(4096)
    try:
        cut = {p: report([p], book) for p in (cf, of, gj, gd)}
    finally:
        MAX_LINE_BYTES.reset(token)
    assert longest[cf] > 4096 and longest[of] > 4096
    assert whole[cf]["totals"]["requests"] == 3 and cut[cf]["totals"]["requests"] == 2
    assert whole[of]["totals"]["requests"] == 3 and cut[of]["totals"]["requests"] == 2
    for p in (cf, of):
        assert cut[p]["lines_too_long"] == 1 and [b["line"] for b in cut[p]["bad_lines"]] == [len(p.read_text().splitlines())]
    assert longest[gj] > 4096 and cut[gj]["lines_too_long"] == 1
    assert cut[gj]["totals"]["requests"] == whole[gj]["totals"]["requests"] - 1
    assert gd.stat().st_size > 4096 and whole[gd]["totals"]["requests"] > 0
    assert cut[gd]["totals"]["requests"] == 0 and cut[gd]["lines_too_long"] == 1
    assert cut[gd]["bad_lines"][0]["reason"].startswith(f"a JSON document of {gd.stat().st_size:,} bytes")
