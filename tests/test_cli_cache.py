"""`ctxreplay run` writes the cache-simulation columns; `ctxreplay report --sim / --breaks OUT` shows them."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest
from click.testing import CliRunner

from ctxreplay.pipeline.commands.cli import main
from ctxreplay.schemas.calls import CALLS

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "data" / "samples" / "claude-projects"


@pytest.fixture(autouse=True)
def _price_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CTXREPLAY_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "price-cache"))


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    o = tmp_path_factory.mktemp("cli-cache") / "o"
    res = CliRunner().invoke(main, ["run", str(SAMPLES), "--preset", "identity", "--out", str(o), "-q"])
    assert res.exit_code == 0, res.output
    return o


def test_run_writes_the_columns_and_the_summary(out: Path) -> None:
    calls = pl.read_parquet(out / "calls.parquet")
    assert calls.columns == CALLS.names
    done = calls.filter(~pl.col("is_pending"))
    assert done["sim_cache_read_tokens"].null_count() == 0 and done["calibrated_prompt_tokens"].null_count() == 0
    assert calls.filter(pl.col("is_pending"))["sim_cost_usd"].null_count() == calls["is_pending"].sum()
    s = json.loads((out / "summary.json").read_text())["cache_sim"]
    assert s["totals"]["calls"] == done.height
    assert s["prices"].startswith("genai-prices ")
    assert set(s["breaks"]) == {"recorded", "sim"}
    assert s["calibration"]["threads"] == calls["thread_key"].n_unique()
    assert s["policy"]["breakpoints"] == ["shared", "system", "last"]


def test_report_sim_table_and_json(out: Path) -> None:
    r = CliRunner().invoke(main, ["report", "--sim", str(out)])
    assert r.exit_code == 0, r.output
    assert r.output.startswith(f"ctxreplay report --sim {out}: 1 session(s)")
    assert "Cache read rec" in r.output and "Total" in r.output and "calibration claude-v3" in r.output
    j = CliRunner().invoke(main, ["report", "--sim", str(out), "--calls", "--json"])
    assert j.exit_code == 0, j.output
    doc = json.loads(j.output)
    assert {"sessions", "totals", "calls", "calibration", "policy", "prices", "unpriced_models"} <= set(doc)
    assert len(doc["calls"]) == doc["totals"]["calls"] == sum(x["calls"] for x in doc["sessions"])
    assert {"rec_class", "sim_class", "sim_cache_read_tokens", "recorded_cache_read_tokens"} <= set(doc["calls"][0])


def test_report_breaks(out: Path) -> None:
    r = CliRunner().invoke(main, ["report", "--breaks", str(out), "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert {"breaks", "by_cause", "sessions"} <= set(doc)
    for b in doc["breaks"]:
        assert b["source"] in ("recorded", "sim") and b["cause"] and b["tokens"] >= 0
    t = CliRunner().invoke(main, ["report", "--breaks", str(out)])
    assert t.exit_code == 0 and "Share of cost caused by breaks" in t.output
    assert "recorded:" in t.output and "unexplained" in t.output


def test_report_views_refuse_what_they_cannot_do(out: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    r = runner.invoke(main, ["report", str(SAMPLES), "--sim", str(out)])
    assert r.exit_code == 2 and "drop the PATHS" in r.output
    r = runner.invoke(main, ["report", "--sim", str(out), "--breaks", str(out)])
    assert r.exit_code == 2 and "one of --sim OUT and --breaks OUT" in r.output
    r = runner.invoke(main, ["report", str(SAMPLES), "--calls"])
    assert r.exit_code == 2 and "--calls goes with --sim OUT" in r.output
    r = runner.invoke(main, ["report", "--sim", str(tmp_path / "nope")])
    assert r.exit_code == 2 and "no such directory" in r.output
    # a run made before the simulator: its calls.parquet lacks the columns
    old = tmp_path / "old"
    old.mkdir()
    pl.read_parquet(out / "calls.parquet").select(CALLS.names[:20]).write_parquet(old / "calls.parquet")
    (old / "call_messages.parquet").write_bytes((out / "call_messages.parquet").read_bytes())
    r = runner.invoke(main, ["report", "--breaks", str(old)])
    assert r.exit_code == 2 and "before the cache simulator" in r.output
