"""Plug-in isolation (issue 9): a third-party stage that raises, returns a frame off the schema or
runs past its time budget is quarantined for the sessions it fails on; the run goes on; the
summary and the terminal list it; --strict exits 1. Built-in names belong to the core."""

from __future__ import annotations

import importlib
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import polars as pl
import pytest
from click.testing import CliRunner

from ctxreplay.pipeline.commands.cli import main as cli
from ctxreplay.pipeline.stageapi.registry import (
    PLUGIN_ERRORS,
    STAGES,
    StageNameTaken,
    get_stage,
    reload_plugins,
    stage,
)

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "data" / "samples"
MODULE = "tests.plugins.misbehaving"


@pytest.fixture
def shout() -> Iterator[None]:
    """The `shout` test plug-in, registered by importing its module (and forgotten after)."""
    sys.modules.pop(MODULE, None)
    importlib.import_module(MODULE)
    yield
    STAGES.pop("shout", None)
    sys.modules.pop(MODULE, None)


def _spec(tmp_path: Path, **params: object) -> Path:
    lines = ['[pipeline]', 'name = "plugin"', '[[stage]]', 'use = "sanitize"', '[[stage]]', 'use = "shout"']
    lines += [f"{k} = {json.dumps(v)}" for k, v in params.items()]
    p = tmp_path / "spec.toml"
    p.write_text("\n".join(lines) + "\n")
    return p


def _run(tmp_path: Path, spec: Path, *extra: str) -> tuple[object, dict]:
    r = CliRunner().invoke(cli, ["run", str(SAMPLES), "--pipeline", str(spec), "--out", str(tmp_path / "o"),
                                 "--fast-tokens", "--json", *extra])
    assert "Traceback" not in r.output and "Traceback" not in r.stderr, r.output
    return r, json.loads(r.stdout)


def _user_texts(out: Path) -> pl.DataFrame:
    b = pl.read_parquet(out / "current" / "blocks.parquet")
    return b.filter((pl.col("role") == "user") & (pl.col("block_type") == "text") & pl.col("text").is_not_null()) \
        .with_columns(loud=pl.col("text") == pl.col("text").str.to_uppercase()).group_by("session_id") \
        .agg(pl.col("loud").all())


def test_a_plugin_runs_in_a_worker_process_and_its_effect_shows(tmp_path: Path, shout: None) -> None:
    from ctxreplay.pipeline.staging.isolation import sendable

    st = get_stage("shout")
    assert not st.is_builtin and st.owner == "tests" and sendable(st, st.params())
    r, s = _run(tmp_path, _spec(tmp_path))
    assert r.exit_code == 0 and s["stage_failures"] == []
    assert s["decisions"]["shout"] > 0
    assert _user_texts(tmp_path / "o")["loud"].all()


def test_a_plugin_failing_for_one_session_is_skipped_there_and_runs_for_the_others(tmp_path: Path,
                                                                                  shout: None) -> None:
    _run(tmp_path, _spec(tmp_path))
    sessions = sorted(_user_texts(tmp_path / "o")["session_id"].to_list())
    assert len(sessions) >= 2
    victim = sessions[0]
    r, s = _run(tmp_path, _spec(tmp_path, mode="raise", only_for=victim))
    assert r.exit_code == 0
    (f,) = s["stage_failures"]
    assert (f["stage"], f["kind"], f["sessions"]) == ("shout", "raised", [victim])
    assert f"failed with RuntimeError: shout cannot handle session {victim[:8]}" in f["message"]
    loud = dict(_user_texts(tmp_path / "o").iter_rows())
    assert loud[victim] is False and all(loud[x] for x in sessions[1:])
    dec = pl.read_parquet(tmp_path / "o" / "current" / "decisions.parquet")
    failed = dec.filter(pl.col("action") == "stage_failed")
    assert set(failed["session_id"]) == {victim} and set(failed["reason"]) == {"raised"}
    assert "RuntimeError" in json.loads(failed["replacement"][0])["message"]
    assert dec.filter((pl.col("stage") == "shout") & (pl.col("session_id") == victim)
                      & (pl.col("action") != "stage_failed")).height == 0
    r, _ = _run(tmp_path, _spec(tmp_path, mode="raise", only_for=victim), "--strict")
    assert r.exit_code == 1
    human = CliRunner().invoke(cli, ["run", str(SAMPLES), "--pipeline", str(_spec(tmp_path, mode="raise",
                                     only_for=victim)), "--out", str(tmp_path / "o"), "--fast-tokens"])
    assert f"  plug-in stage 'shout' (#2, tests) skipped for 1 session(s) (raised): stage 'shout' (#2, from " \
           f"{MODULE}) failed with RuntimeError" in human.stdout


def test_a_plugin_returning_a_frame_off_the_schema_is_quarantined(tmp_path: Path, shout: None) -> None:
    r, s = _run(tmp_path, _spec(tmp_path, mode="schema"))
    assert r.exit_code == 0
    kinds = {f["kind"] for f in s["stage_failures"]}
    assert kinds == {"schema"}
    assert all(f["message"].endswith("unexpected columns: ['loud']") for f in s["stage_failures"])
    assert not _user_texts(tmp_path / "o")["loud"].any()  # its effect is skipped everywhere
    r, s = _run(tmp_path, _spec(tmp_path, mode="tuple"))
    assert r.exit_code == 0 and {f["kind"] for f in s["stage_failures"]} == {"result"}


def test_a_plugin_past_its_time_budget_is_stopped_and_one_within_it_is_not(tmp_path: Path, shout: None) -> None:
    spec = _spec(tmp_path, mode="sleep", sleep_seconds=120, time_budget_seconds=2)
    t0 = time.perf_counter()
    r, s = _run(tmp_path, spec)
    took = time.perf_counter() - t0
    assert r.exit_code == 0
    assert took < 60, f"the sleeping plug-in was not stopped ({took:.0f} s)"
    assert {f["kind"] for f in s["stage_failures"]} == {"timeout"}
    assert any("ran past its time budget of 2 s and was stopped" in f["message"] for f in s["stage_failures"])
    # the other side of the budget: a stage that sleeps less than its budget keeps its effect
    r, s = _run(tmp_path, _spec(tmp_path, mode="sleep", sleep_seconds=0.5, time_budget_seconds=20))
    assert r.exit_code == 0 and s["stage_failures"] == [] and _user_texts(tmp_path / "o")["loud"].all()


def test_a_time_budget_on_a_builtin_stage_is_refused(tmp_path: Path) -> None:
    from ctxreplay.errors import SpecError
    from ctxreplay.pipeline.staging.spec import parse_spec

    with pytest.raises(SpecError, match=r"time_budget_seconds applies to plug-in stages only"):
        parse_spec('[[stage]]\nuse = "sanitize"\ntime_budget_seconds = 5\n', source="s.toml")


def test_a_plugin_cannot_take_a_core_stage_name() -> None:
    from tests.plugins import misbehaving

    with pytest.raises(StageNameTaken) as e:
        stage("sanitize", version=1, params=misbehaving.Shout)(misbehaving.shout)
    msg = str(e.value)
    assert msg.startswith("stage name 'sanitize' is taken: ctxreplay ")
    assert "(ctxreplay.stages.sanitize) holds it (a built-in stage of ctxreplay; built-in names belong to the core)" in msg
    assert f"so tests ({MODULE}) cannot register it" in msg
    assert get_stage("sanitize").module == "ctxreplay.stages.sanitize"
    STAGES.pop("shout", None)
    sys.modules.pop(MODULE, None)


def _install_entry_point(tmp_path: Path, dist: str, version: str, module: str, source: str, group_line: str) -> None:
    """A package 'installed' by putting it and a .dist-info with entry_points.txt on sys.path."""
    (tmp_path / f"{module}.py").write_text(source)
    info = tmp_path / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(f"[ctxreplay.stages]\n{group_line}\n")
    (info / "top_level.txt").write_text(f"{module}\n")
    sys.path.insert(0, str(tmp_path))


def test_an_entry_point_taking_a_core_name_is_refused_and_listed(tmp_path: Path) -> None:
    source = ("from dataclasses import dataclass\nfrom ctxreplay.pipeline.stageapi.registry import stage\n\n"
              "@dataclass(frozen=True)\nclass P:\n    pass\n\n"
              "@stage('tombstone', version=9, params=P)\ndef tombstone(blocks, params, ledger, ctx):\n"
              "    '''Not the real one.'''\n    return None\n")
    _install_entry_point(tmp_path, "evil-plugin", "6.6.6", "evil_plugin", source, "tombstone = evil_plugin")
    try:
        reload_plugins()
        (err,) = [e for e in PLUGIN_ERRORS if e.package == "evil-plugin"]
        assert err.stage == "tombstone" and "evil-plugin 6.6.6 (evil_plugin) cannot register it" in err.message
        assert get_stage("tombstone").module == "ctxreplay.stages.tombstone"
        r = CliRunner().invoke(cli, ["stages"])
        assert r.exit_code == 0
        assert "plug-in evil-plugin (entry point 'tombstone') was not loaded: StageNameTaken: stage name " \
               "'tombstone' is taken" in r.stdout
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("evil_plugin", None)
        reload_plugins()
    assert not PLUGIN_ERRORS


def test_an_in_process_plugin_past_its_budget_is_quarantined_when_it_returns(tmp_path: Path) -> None:
    """A stage a worker cannot import (defined in a function) runs in-process: it cannot be stopped,
    but past its budget its output is not used."""
    import dataclasses

    from ctxreplay.pipeline.stageapi.registry import StageResult

    @dataclasses.dataclass(frozen=True)
    class NoParams:
        pass

    def slow_probe(blocks, params, ledger, ctx):
        time.sleep(1.2)
        return StageResult(blocks, ledger)

    stage("slow_probe", version=1, params=NoParams)(slow_probe)
    try:
        spec = tmp_path / "slow.toml"
        spec.write_text('[[stage]]\nuse = "slow_probe"\ntime_budget_seconds = 1\n')
        r, s = _run(tmp_path, spec)
        assert r.exit_code == 0
        assert {f["kind"] for f in s["stage_failures"]} == {"timeout"}
        assert any("past its time budget of 1 s (it runs in-process, so it could not be stopped earlier)"
                   in f["message"] for f in s["stage_failures"])
    finally:
        STAGES.pop("slow_probe", None)
