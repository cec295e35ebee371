"""Claude Code's own answers (model `<synthetic>`, issue 20 item 6) are no requests.

Claude Code writes an assistant entry of model `<synthetic>` when no provider answered: a failed
request's notice ("Prompt is too long", a rate limit, "Please run /login": `isApiErrorMessage`
true), and the "No response requested." it puts after a resumed session's last user message. None
is a call. A failed request's notice is left out of every later request (Claude Code drops such
messages before it sends: one `empty` block, display-only, that no target sends, under every
pipeline); the resume sentinel stays in the history it sends, as any assistant turn. A thread that
ends on a notice waits to send the request that failed again (its pending request ends with the
user's message). Odd shapes of such lines are among the loader's frozen cases (tests/loaderkit.py,
"local notices")."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import orjson
import polars as pl
import pytest
from click.testing import CliRunner

from ctxreplay.pipeline.batch.runner import RunOptions, run
from ctxreplay.pipeline.commands.cli import main
from ctxreplay.pipeline.core.tokens import CHARS4_COUNTER
from ctxreplay.pipeline.engine.engine import Engine
from ctxreplay.pipeline.loaders import load_paths
from ctxreplay.pipeline.staging.spec import load_spec
from tests.cckit import cc_entry
from tests.test_loader_paths import all_ways

SID = "10ca1000-0000-4000-8000-000000000001"
MODEL = "claude-sonnet-4-5"
LIMIT = "NOTICE-LIMIT: you have hit your limit"
LOGIN = "NOTICE-LOGIN: please run /login"
SENTINEL = "No response requested."


def _usage(read: int, write: int) -> dict[str, Any]:
    return {"input_tokens": 3, "output_tokens": 20, "cache_read_input_tokens": read,
            "cache_creation_input_tokens": write,
            "cache_creation": {"ephemeral_5m_input_tokens": write, "ephemeral_1h_input_tokens": 0}}


def _answer(uuid: str, parent: str, text: str, t: int, read: int, write: int) -> dict[str, Any]:
    return cc_entry(SID, uuid, parent, "assistant", [{"type": "text", "text": text}], t, model=MODEL,
                    usage=_usage(read, write))


def _notice(uuid: str, parent: str, text: str, t: int, *, api_error: bool, error: str | None = None) -> dict[str, Any]:
    e = cc_entry(SID, uuid, parent, "assistant", [{"type": "text", "text": text}], t, model="<synthetic>",
                 usage=_usage(0, 0) | {"input_tokens": 0, "output_tokens": 0})
    e["message"]["stop_reason"] = "stop_sequence"
    if api_error:
        e["isApiErrorMessage"] = True
        if error:
            e["error"] = error
    return e


def entries() -> list[dict[str, Any]]:
    """A rate-limit notice mid-thread (the user's next message is its child, as Claude Code writes
    it), a resume sentinel before a later answer, and a login notice at the end."""
    return [
        cc_entry(SID, "u0", None, "user", "first question " * 300, 0),
        _answer("a0", "u0", "answer zero", 5, 0, 1200),
        cc_entry(SID, "u1", "a0", "user", "second question", 20),
        _notice("n1", "u1", LIMIT, 21, api_error=True, error="rate_limit"),
        cc_entry(SID, "u2", "n1", "user", "try again", 40),
        _answer("a2", "u2", "answer two", 45, 1200, 30),
        cc_entry(SID, "u3", "a2", "user", "third", 60),
        _notice("s3", "u3", SENTINEL, 70, api_error=False),
        cc_entry(SID, "u4", "s3", "user", "fourth", 80),
        _answer("a4", "u4", "answer four", 85, 1230, 30),
        cc_entry(SID, "u5", "a4", "user", "fifth", 100),
        _notice("n5", "u5", LOGIN, 101, api_error=True, error="authentication_failed"),
    ]


def _write(d: Path, es: list[dict[str, Any]]) -> Path:
    p = d / "projects" / "p" / f"{SID}.jsonl"
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text("".join(json.dumps(e) + "\n" for e in es))
    return p


@pytest.fixture(autouse=True)
def _price_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CTXREPLAY_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "price-cache"))


def test_the_loader_makes_notices_no_calls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p = _write(tmp_path, entries())
    new = all_ways([p], monkeypatch, "notices")  # the careful way and the values' way agree
    b = pl.from_arrow(new.blocks)
    assert isinstance(b, pl.DataFrame)
    rows = {r["entry_id"]: r for r in b.iter_rows(named=True)}
    assert [e for e, r in rows.items() if r["is_call"]] == ["a0", "a2", "a4"]
    for eid in ("n1", "n5"):  # failed requests' notices: one empty block, display-only, the text kept aside
        r = rows[eid]
        assert (r["is_call"], r["is_display_only"], r["block_type"], r["text"]) == (False, True, "empty", None)
        assert orjson.loads(r["extra_json"])["content"][0]["text"] in (LIMIT, LOGIN)
    assert orjson.loads(rows["n1"]["extra_json"])["error"] == "rate_limit"
    s = rows["s3"]  # the resume sentinel: sent as it is, but no call
    assert (s["is_call"], s["is_display_only"], s["block_type"], s["text"]) == (False, False, "text", SENTINEL)
    # calls are numbered as if the notices were not there; each is seen from the next call on
    assert [rows[e]["first_call"] for e in ("a0", "n1", "a2", "s3", "a4", "n5")] == [1, 1, 2, 2, 3, 3]


def _requests(out: Path) -> dict[int, str]:
    r = CliRunner().invoke(main, ["request", str(out), SID[:8], "--call", "0"])
    assert r.exit_code == 0, r.output
    calls = pl.read_parquet(out / "calls.parquet").sort("call")
    got = {}
    for k in calls["call"].to_list():
        r = CliRunner().invoke(main, ["request", str(out), SID[:8], "--call", str(k)])
        assert r.exit_code == 0, r.output
        got[k] = r.stdout
    return got


@pytest.mark.parametrize("preset", ["identity", "default"])
def test_no_request_holds_a_failed_requests_notice(tmp_path: Path, preset: str) -> None:
    out = tmp_path / "out"
    _write(tmp_path, entries())
    r = CliRunner().invoke(main, ["run", str(tmp_path / "projects"), "--preset", preset, "--out", str(out), "-q"])
    assert r.exit_code == 0, r.output
    calls = pl.read_parquet(out / "calls.parquet").sort("call")
    assert calls["call"].to_list() == [0, 1, 2, 3] and calls["is_pending"].to_list() == [False] * 3 + [True]
    assert "<synthetic>" not in calls["model"].to_list()
    reqs = _requests(out)
    assert not any(LIMIT in q or LOGIN in q for q in reqs.values())
    assert SENTINEL not in reqs[1] and SENTINEL in reqs[2] and SENTINEL in reqs[3]
    # the thread ended on a notice: its pending request is the failed one sent again, to the real
    # model, ending with the user's message
    pend = json.loads(reqs[3])
    assert pend["model"] == MODEL and pend["messages"][-1]["role"] == "user"
    assert "fifth" in json.dumps(pend["messages"][-1])
    assert calls.filter(pl.col("is_pending"))["awaits_user"].to_list() == [False]
    # the call after a notice is compared with the call before it: the prefix is read, nothing breaks
    sim = calls.filter(~pl.col("is_pending"))
    assert sim["sim_break_cause"].to_list() == [None, None, None]
    assert sim["sim_cache_read_tokens"].to_list()[1] > 0


def test_a_branch_of_only_a_notice_is_no_thread(tmp_path: Path) -> None:
    """A notice off the main chain (a rewind after a failed request) holds no call: no thread."""
    es = entries()[:6]
    es.append(_notice("nb", "a0", LIMIT, 50, api_error=True))
    es.append(cc_entry(SID, "u9", "a2", "user", "later", 60))
    r = load_paths([_write(tmp_path, es)])
    assert r.threads == 1 and r.stats.get("branches_without_calls") == 1


def test_the_engine_assembles_the_batch_replays_requests_around_notices(tmp_path: Path) -> None:
    """Call by call through the engine (live steps where it can take them) and in one batch run:
    the same requests, a notice among the new entries taking a full pass."""
    es = entries()
    with Engine.open("default", tmp_path / "engine.duckdb", token_counter=CHARS4_COUNTER) as eng:
        got = []
        for i, e in enumerate(es):
            if e["type"] == "assistant" and e["message"]["model"] != "<synthetic>" and i:
                got.append(eng.assemble(SID, model=e["message"]["model"]))
            eng.ingest(SID, [e])
        got.append(eng.assemble(SID))
    path = _write(tmp_path / "batch", es)
    calls = run([path], load_spec(preset="default"),
                RunOptions(out_dir=tmp_path / "batch-out", token_counter=CHARS4_COUNTER)).calls
    want = dict(calls.select("call", "request_sha256").iter_rows())
    assert [(r.call, r.request_sha256) for r in got] == [(k, want[k]) for k in (0, 1, 2, 3)]
    assert got[-1].model == MODEL
    assert any("<synthetic>" in (r.full_pass_reason or "") for r in got)


def test_a_live_step_that_appends_a_notice_takes_a_full_pass() -> None:
    """`new_rows` never numbers a notice as a call: it asks for a full pass."""
    from ctxreplay.pipeline.engine.live import new_rows
    from ctxreplay.pipeline.loaders.claude_code import make_node

    e = _notice("n1", "u1", LIMIT, 21, api_error=True)
    node = make_node(e, "n1", 0, 1, json.dumps(e))
    facts: Any = type("F", (), {"source_file": "x.jsonl", "session_id": SID})()
    why = new_rows([node], facts, CHARS4_COUNTER)
    assert isinstance(why, str) and "<synthetic>" in why

