"""Calls without recorded usage (issue 20, item 6): a call whose answer recorded no usage is no
evidence that its model has no price, and it has nothing to compare the simulation with (counted
as `no_usage`, left out of the recorded-vs-simulated figures)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import polars as pl
import pytest
from click.testing import CliRunner

from ctxreplay.pipeline.commands.cli import main
from tests.cckit import cc_entry

SID = "0a5a0000-0000-4000-8000-000000000001"


@pytest.fixture(autouse=True)
def _price_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CTXREPLAY_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "price-cache"))


def _entry(uuid: str, parent: str | None, role: str, content: Any, t: int, **msg: Any) -> dict[str, Any]:
    if role == "assistant":
        msg = {**msg}
    return cc_entry(SID, uuid, parent, role, content, t, **msg)


def _usage(read: int, write: int) -> dict[str, Any]:
    return {"input_tokens": 3, "output_tokens": 40, "cache_read_input_tokens": read,
            "cache_creation_input_tokens": write,
            "cache_creation": {"ephemeral_5m_input_tokens": write, "ephemeral_1h_input_tokens": 0}}


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A priced model's session in which one answer recorded no usage, one a model that recorded
    none at all (zero usage on each of its calls), and a `<synthetic>` local notice (no call)."""
    tmp = tmp_path_factory.mktemp("usage-gaps")
    opus, other = "claude-opus-4-6", "claude-opus-4-6-no-usage-proxy"
    lines = [
        _entry("u0", None, "user", "first " * 400, 0),
        _entry("a0", "u0", "assistant", [{"type": "text", "text": "one"}], 5, model=opus, usage=_usage(17000, 9000)),
        _entry("u1", "a0", "user", "second", 20),
        _entry("a1", "u1", "assistant", [{"type": "text", "text": "two"}], 25, model=opus),   # no usage recorded
        _entry("u2", "a1", "user", "third", 40),
        _entry("a2", "u2", "assistant", [{"type": "text", "text": "three"}], 45, model=opus, usage=_usage(26000, 600)),
        _entry("u3", "a2", "user", "fourth", 60),
        _entry("a3", "u3", "assistant", [{"type": "text", "text": "four"}], 65, model=other, usage=_usage(0, 0) | {
            "input_tokens": 0, "output_tokens": 0}),
        _entry("u4", "a3", "user", "fifth", 80),
        _entry("a4", "u4", "assistant", [{"type": "text", "text": "five"}], 85, model=other, usage=_usage(0, 0) | {
            "input_tokens": 0, "output_tokens": 0}),
        _entry("u5", "a4", "user", "sixth", 100),
        _entry("a5", "u5", "assistant", [{"type": "text", "text": "No response requested."}], 101,
               model="<synthetic>", usage=_usage(0, 0) | {"input_tokens": 0, "output_tokens": 0}),
    ]
    proj = tmp / "projects" / "p"
    proj.mkdir(parents=True)
    (proj / f"{SID}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    o = tmp / "out"
    r = CliRunner().invoke(main, ["run", str(tmp / "projects"), "--preset", "identity", "--out", str(o), "-q"])
    assert r.exit_code == 0, r.output
    return o


def test_a_call_without_usage_does_not_make_its_model_unpriced(out: Path) -> None:
    """claude-opus-4-6 is priced: its call without usage (and the zero-usage calls of other names)
    must not put a model in `unpriced_models` nor warn 'no price for ...'."""
    r = CliRunner().invoke(main, ["report", "--sim", str(out), "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["unpriced_models"] == []
    assert "no price" not in r.stderr
    s = json.loads((out / "summary.json").read_text())["cache_sim"]
    assert s["unpriced_models"] == []
    assert [x["unpriced"] for x in doc["sessions"]] == [0]


def test_calls_without_usage_are_left_out_of_recorded_vs_simulated(out: Path) -> None:
    """Only the two calls that recorded usage are compared with the simulation; the three that
    recorded none are counted as no_usage. The local notice is no call at all."""
    calls = pl.read_parquet(out / "calls.parquet").filter(~pl.col("is_pending"))
    assert calls.height == 5 and "<synthetic>" not in calls["model"].to_list()
    r = CliRunner().invoke(main, ["report", "--sim", str(out), "--json", "--calls"])
    doc = json.loads(r.stdout)
    (sess,) = doc["sessions"]
    assert (sess["calls"], sess["no_usage"]) == (2, 3)
    assert (doc["totals"]["calls"], doc["totals"]["no_usage"]) == (2, 3)
    assert sess["rec_read"] == 17000 + 26000
    assert [c["call"] for c in doc["calls"]] == [0, 2]
    s = json.loads((out / "summary.json").read_text())["cache_sim"]
    assert (s["totals"]["calls"], s["totals"]["no_usage"]) == (2, 3)


def test_the_sim_table_says_how_many_calls_had_no_usage(out: Path) -> None:
    r = CliRunner().invoke(main, ["report", "--sim", str(out)])
    assert r.exit_code == 0, r.output
    assert "3 call(s) recorded no usage: left out of the comparison (no_usage)" in r.stdout
