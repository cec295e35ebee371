"""`ctxreplay report --sim OUT` leads with the anchored estimate (issue 20, item 3): recorded usage +
(the run's simulation − the identity simulation of the same calls), per session, in total and per
call, each cost with its interval; `--raw` shows the raw simulation. The anchor: the run itself
under identity (the estimate is then the recorded usage, exactly), `--anchor DIR` (an identity run
of the same inputs), else an identity run of the run's inputs made by the report
(pipeline/reporting/anchor.py). The figures are `compare`'s."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import polars as pl
import pytest
from click.testing import CliRunner

from ctxreplay.pipeline.commands.cli import main
from ctxreplay.pipeline.cost.estimate import with_estimate

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "data" / "samples"


@pytest.fixture(autouse=True)
def _price_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CTXREPLAY_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "price-cache"))


def _cli(*args: object, **kw: Any) -> Any:
    return CliRunner().invoke(main, [str(a) for a in args], **kw)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The samples (copied) under identity and default, and compare's figures for both (its runs kept)."""
    tmp = tmp_path_factory.mktemp("est")
    mp = pytest.MonkeyPatch()
    mp.setenv("CTXREPLAY_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "price-cache"))
    try:
        inp = tmp / "in"
        shutil.copytree(SAMPLES, inp)
        for p in ("identity", "default"):
            r = _cli("run", inp, "--preset", p, "--out", tmp / p, "-q")
            assert r.exit_code == 0, r.output
        r = _cli("compare", inp, "--pipeline", "identity", "--pipeline", "default", "--json", "-q", "--keep",
                 tmp / "kept")
        assert r.exit_code == 0, r.output
    finally:
        mp.undo()
    return {"tmp": tmp, "in": inp, "compare": json.loads(r.stdout)}


def _doc(*args: object) -> dict[str, Any]:
    r = _cli("report", "--sim", *args, "--json")
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_under_identity_the_estimate_is_the_recorded_usage_on_every_call(runs: dict[str, Any]) -> None:
    doc = _doc(runs["tmp"] / "identity", "--calls")
    assert doc["figures"] == "estimate" and doc["anchor"]["source"] == "self"
    assert doc["calls"]
    for c in doc["calls"]:     # every call with usage
        assert (c["est_cost_usd"], c["est_cache_read_tokens"], c["est_cache_write_tokens"], c["est_input_tokens"]) == (
            c["recorded_cost_usd"], c["recorded_cache_read_tokens"], c["recorded_cache_write_tokens"],
            c["recorded_input_tokens"]), c
    t = doc["totals"]
    assert (t["est_cost"], t["est_read"], t["est_write"]) == (t["rec_cost"], t["rec_read"], t["rec_write"])
    assert (t["est_cost_low"], t["est_cost_high"]) == (t["est_cost"], t["est_cost"])   # no change, no width
    # exactly, not to the printed digits: the change is added to the recorded cost, not the other way round
    calls = pl.read_parquet(runs["tmp"] / "identity" / "calls.parquet")
    e = with_estimate(calls, None).filter(pl.col("est_cost_usd").is_not_null())
    assert e.height > 10 and (e["est_cost_usd"] == e["recorded_cost_usd"]).all()


@pytest.mark.parametrize("anchor", ["made", "given"])
def test_another_pipelines_estimate_is_compares(runs: dict[str, Any], anchor: str) -> None:
    """Per session and in total, the estimate and its interval are what compare prints for the same
    pipeline; the anchor an identity run made by the report, or the one compare kept."""
    args: list[object] = [runs["tmp"] / "default"]
    if anchor == "given":
        args += ["--anchor", runs["tmp"] / "kept" / "0-identity"]
    doc = _doc(*args)
    assert doc["figures"] == "estimate" and doc["anchor"]["source"] == ("run" if anchor == "made" else "dir")
    cmp = runs["compare"]
    keys = {"est_cost": "cost_usd", "est_cost_low": "cost_usd_low", "est_cost_high": "cost_usd_high",
            "est_read": "cache_read_tokens", "est_write": "cache_write_tokens", "est_input": "input_tokens"}
    want = {r["session_id"]: r for r in cmp["sessions"] if r["pipeline"] == "default"}
    compared = [r for r in doc["sessions"] if r["calls"]]
    assert len(compared) >= 4
    for r in compared:
        assert {k: r[k] for k in keys} == {k: want[r["session_id"]][v] for k, v in keys.items()}, r["session_id"]
    total = next(r for r in cmp["totals"] if r["pipeline"] == "default")
    assert {k: doc["totals"][k] for k in keys} == {k: total[v] for k, v in keys.items()}
    # the pipeline changed something, and the estimate says so beside the raw simulation
    assert doc["totals"]["est_read"] < doc["totals"]["rec_read"]
    assert doc["totals"]["est_read"] != doc["totals"]["sim_read"]


def test_raw_shows_the_raw_simulation_without_an_anchor(runs: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    from ctxreplay.pipeline.reporting import anchor

    monkeypatch.setattr(anchor, "resolve", lambda *a, **k: pytest.fail("--raw needs no anchor"))
    out = runs["tmp"] / "default"
    doc = _doc(out, "--raw")
    assert doc["figures"] == "raw" and "est_cost" not in doc["totals"]
    r = _cli("report", "--sim", out, "--raw", "--calls")
    assert r.exit_code == 0, r.output
    assert "figures: the raw simulation (--raw)" in r.stdout and "Agree" in r.stdout and "Class rec/sim" in r.stdout
    assert "interval" not in r.stdout


def test_the_table_leads_with_the_estimate_and_fits(runs: dict[str, Any]) -> None:
    from rich.cells import cell_len

    r = _cli("report", "--sim", runs["tmp"] / "default", "--anchor", runs["tmp"] / "kept" / "0-identity", "--calls")
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert lines[1].startswith("figures: the anchored estimate: recorded usage + the simulated change from identity")
    assert "90% interval" in r.stdout and "Agree" not in r.stdout
    assert "Cost rec" in r.stdout and "Class rec/sim" not in r.stdout    # the per-call table: the estimate's too
    total = _doc(runs["tmp"] / "default", "--anchor", runs["tmp"] / "kept" / "0-identity")["totals"]
    foot = next(x for x in lines if x.startswith("│ Total"))
    assert f"{total['est_read']:,}" in foot and f"{total['est_cost_low']:,.4f}–{total['est_cost_high']:,.4f}" in foot
    table = [x for x in lines if x[:1] in "┏┃┡│├└"]
    assert len(table) > 20 and max(cell_len(x) for x in table) <= 200 and "…" not in r.stdout


def test_an_anchor_of_other_sessions_or_with_stages_is_refused(runs: dict[str, Any], tmp_path: Path) -> None:
    out = runs["tmp"] / "default"
    r = _cli("report", "--sim", out, "--anchor", runs["tmp"] / "kept" / "1-default")
    assert r.exit_code == 2 and "with stages" in r.stderr and "--preset identity" in r.stderr
    part = tmp_path / "part"
    shutil.copytree(runs["in"] / "claude-projects", part)
    assert _cli("run", part, "--preset", "identity", "--out", tmp_path / "id", "-q").exit_code == 0
    r = _cli("report", "--sim", out, "--anchor", tmp_path / "id")
    assert r.exit_code == 2 and "did not read the same input files" in r.stderr
    r = _cli("report", runs["in"], "--anchor", tmp_path / "id")
    assert r.exit_code == 2 and "--anchor goes with --sim OUT" in r.stderr
    r = _cli("report", "--sim", out, "--anchor", tmp_path / "id", "--raw")
    assert r.exit_code == 2 and "one of --raw and --anchor" in r.stderr


def test_inputs_changed_since_the_run_leave_no_anchor(runs: dict[str, Any], tmp_path: Path) -> None:
    inp = tmp_path / "in"
    shutil.copytree(runs["in"], inp)
    out = tmp_path / "out"
    assert _cli("run", inp, "--preset", "default", "--out", out, "-q").exit_code == 0
    f = min((inp / "claude-projects").rglob("*.jsonl"))
    f.write_text(f.read_text() + "\n")          # the same lines, one blank more: other bytes
    r = _cli("report", "--sim", out)
    assert r.exit_code == 0, r.output
    assert "figures: the raw simulation (no anchor: " in r.stdout and f"{f} changed since the run read it" in r.stdout
    assert "the raw simulation is shown" in r.stderr and "Agree" in r.stdout
    f.unlink()
    r = _cli("report", "--sim", out, "--json")
    doc = json.loads(r.stdout)
    assert doc["figures"] == "raw" and doc["anchor"]["source"] == "none" and "is gone" in doc["anchor"]["note"]


def test_compares_per_session_rows_carry_their_interval(runs: dict[str, Any]) -> None:
    """Issue 20, item 4: not only the total, every session's cost has its interval, whose bounds
    add up to the total's; under identity it has no width, under a pipeline that changed a
    session's requests it has."""
    cmp = runs["compare"]
    for label in ("identity", "default"):
        rows = [r for r in cmp["sessions"] if r["pipeline"] == label]
        assert len(rows) == 6
        for r in rows:
            assert r["cost_usd_low"] <= r["cost_usd"] <= r["cost_usd_high"], r
            assert r["sim_cost_usd_low"] <= r["sim_cost_usd"] <= r["sim_cost_usd_high"], r
        total = next(r for r in cmp["totals"] if r["pipeline"] == label)
        for k in ("cost_usd_low", "cost_usd_high"):
            assert sum(r[k] for r in rows) == pytest.approx(total[k], abs=1e-5)
        widths = [r["cost_usd_high"] - r["cost_usd_low"] for r in rows]
        assert (max(widths) > 0) == (label == "default"), widths
