"""`ctxreplay run --profile`: what each pipeline pass cost, per stage position (time, polars
collects, quick checks), and the collect counter behind it (pipeline/core/profile.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import polars as pl
import pytest
from click.testing import CliRunner

from ctxreplay.pipeline.commands.cli import main
from ctxreplay.pipeline.core import profile

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "data" / "samples"
POSITIONS = ["sanitize", "inter_session", "images", "pairing", "result_budget", "snip", "pairing#2", "tombstone"]


def _run(*args: object) -> Any:
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def _summary(*args: object) -> dict[str, Any]:
    r = _run("run", *args, "--fast-tokens", "--json")
    assert r.exit_code == 0, r.stderr
    return json.loads(r.stdout)


def test_the_counter_counts_lazy_and_eager_plans_while_active_only() -> None:
    df = pl.DataFrame({"a": [1, 2, 3]})
    before = profile.collects()
    df.select(pl.col("a") + 1)
    assert profile.collects() == before and not profile.active()  # nothing counted outside
    with profile.counting():
        assert profile.active()
        c0 = profile.collects()
        df.lazy().filter(pl.col("a") > 1).collect()
        df.select(pl.col("a") * 2)
        with profile.counting():  # nested: one count
            df.sort("a")
        assert profile.collects() - c0 == 3
    assert not profile.active()
    df.join(df, on="a")
    assert profile.collects() == c0 + 3  # the engines' methods are as they were


def test_queries_polars_runs_on_its_threads_inside_another_are_not_counted_apart() -> None:
    """The eager operations in a Python function an expression maps (run on polars' threads or on
    this one) are part of the query that maps it (how many there are depends on polars' scheduling);
    another thread's queries are not this one's."""
    import threading

    df = pl.DataFrame({"a": [1, 2, 3]})
    inner: list[int] = []

    def mapped(s: pl.Series) -> pl.Series:
        inner.append(threading.get_ident())
        return s.to_frame().select(pl.col("a") + 1).to_series()  # an eager query of its own

    with profile.counting():
        c0 = profile.collects()
        out = df.select(pl.col("a").map_batches(mapped, return_dtype=pl.Int64))
        assert profile.collects() - c0 == 1  # the select; not the query inside the function
        df.select(pl.col("a").map_batches(mapped, return_dtype=pl.Int64),  # two, on polars' threads
                  b=pl.col("a").map_batches(mapped, return_dtype=pl.Int64))
        c0 += 1
        t = threading.Thread(target=lambda: df.select(pl.col("a") * 3))  # another thread's query
        t.start()
        t.join()
        assert profile.collects() - c0 == 1
        df.select(pl.col("a") * 3)  # this thread's: counted
        assert profile.collects() - c0 == 2
    assert out["a"].to_list() == [2, 3, 4] and inner


def test_a_position_whose_plan_runs_is_not_counted_quiet(tmp_path: Path) -> None:
    # a token trigger of one token: tombstone's check cannot hold, its plan runs
    spec = tmp_path / "p.toml"
    spec.write_text('[pipeline]\nname = "t"\n\n[[stage]]\nuse = "sanitize"\n\n[[stage]]\nuse = "pairing"\n\n[[stage]]\nuse = "tombstone"\n'
                    'trigger_tokens = 1\ntrigger_idle_seconds = 0\nkeep_recent = 0\nclear_at_least_tokens = 0\n'
                    'min_result_chars = 0\n')
    s = _summary(SAMPLES / "claude-projects", "--pipeline", spec, "--out", tmp_path / "o", "--profile")
    by = {v["position"]: v for v in s["profile"]["stages"]}
    assert by["pairing"]["quiet"] == 1 and by["pairing"]["collects"] == 0
    assert by["tombstone"]["quiet"] == 0 and by["tombstone"]["collects"] > 1


def test_profile_adds_up_and_names_every_position(tmp_path: Path) -> None:
    s = _summary(SAMPLES / "claude-projects", "--out", tmp_path / "o", "--profile")
    p = s["profile"]
    assert p["passes"] == 1
    assert [v["position"] for v in p["stages"]] == POSITIONS
    for v in p["stages"]:
        name = v["position"]
        assert v["quiet"] in (0, 1)
        assert v["seconds"] >= 0
        assert v["collects"] == s["decisions_by_stage"][name]["collects"]
        if not v["quiet"]:  # a stage that ran its plan ran polars plans
            assert v["collects"] > 1, name
    # on the sample every position's check holds (its compaction takes calls away with their results)
    assert [v["position"] for v in p["stages"] if not v["quiet"]] == []
    c = p["checks"]
    # every position answered by a check (pairing#2 takes pairing's answer: the same check over the same rows)
    assert c["queries"] >= 1 and c["positions"] >= len(POSITIONS) - 1 and c["collects"] == c["queries"]
    assert p["totals"]["collects"] == sum(v["collects"] for v in p["stages"]) + c["collects"]
    assert p["totals"]["seconds"] == pytest.approx(sum(v["seconds"] for v in p["stages"]) + c["seconds"], abs=1e-3)
    assert set(p["phases"]) == {"load", "stages", "replay"}
    assert p["phases"]["stages"]["collects"] >= p["totals"]["collects"]
    assert all(v["collects"] > 0 for v in p["phases"].values())


def test_without_profile_the_summary_is_as_before(tmp_path: Path) -> None:
    s = _summary(SAMPLES / "claude-projects", "--out", tmp_path / "o")
    assert "profile" not in s
    assert all("collects" not in v for v in s["decisions_by_stage"].values())


def test_profile_counts_the_passes_run_whatever_the_workers(tmp_path: Path) -> None:
    # three batches: three passes; the same figures from two worker processes (each counts its own)
    one = _summary(SAMPLES, "--out", tmp_path / "a", "--batch-bytes", "20000", "--profile", "--jobs", "1")["profile"]
    two = _summary(SAMPLES, "--out", tmp_path / "b", "--batch-bytes", "20000", "--profile", "--jobs", "2")["profile"]
    assert one["passes"] == two["passes"] == 3
    assert [(v["position"], v["collects"], v["quiet"]) for v in one["stages"]] == \
        [(v["position"], v["collects"], v["quiet"]) for v in two["stages"]]
    assert all(v["quiet"] <= 3 for v in one["stages"])
    # a re-run that reuses every group runs no pass
    again = _summary(SAMPLES, "--out", tmp_path / "a", "--batch-bytes", "20000", "--profile")["profile"]
    assert again["passes"] == 0 and again["stages"] == []


def test_profile_prints_a_table_after_the_summary(tmp_path: Path) -> None:
    r = _run("run", SAMPLES / "claude-projects", "--out", tmp_path / "o", "--fast-tokens", "--profile")
    assert r.exit_code == 0
    lines = r.stdout.splitlines()
    at = next(i for i, ln in enumerate(lines) if ln.startswith("profile: 1 pipeline pass (one per batch)"))
    assert "took" in lines[at - 1]
    rows = [ln.split()[0] for ln in lines[at + 2:at + 2 + len(POSITIONS)]]
    assert rows == POSITIONS
    assert lines[at + 2 + len(POSITIONS)].split()[:2] == ["quick", "checks"]
    assert lines[-1].startswith("  phases: load ")
    again = _run("run", SAMPLES / "claude-projects", "--out", tmp_path / "o", "--fast-tokens", "--profile")
    assert again.stdout.splitlines()[-1].startswith("profile: no pipeline pass")
