"""`compare --keep DIR`: one directory per pipeline, named after the pipeline and its variant (issue 24)."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest
from click.testing import CliRunner

from ctxreplay.pipeline.commands.cli import main
from ctxreplay.pipeline.reporting.compare import COMPARE_CALLS, Choice, parse_choice, run_dir_name
from ctxreplay.pipeline.staging.spec import parse_spec
from tests.test_compare import write_reads


@pytest.fixture(autouse=True)
def _price_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CTXREPLAY_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "price-cache"))


def test_run_dir_name_keeps_the_ttl_variant_and_is_file_name_safe() -> None:
    assert run_dir_name(4, parse_choice("identity")) == "4-identity"
    assert run_dir_name(4, parse_choice("identity@ttl=recorded")) == "4-identity"   # the same pipeline
    assert run_dir_name(5, parse_choice("identity@ttl=5m")) == "5-identity@ttl=5m"
    assert run_dir_name(6, parse_choice("identity@ttl=1h")) == "6-identity@ttl=1h"
    spec = parse_spec('[pipeline]\nname = "my spec/ü:1"\n', source="x")
    assert run_dir_name(0, Choice("x.toml@ttl=1h", spec, "1h")) == "0-my_spec___1@ttl=1h"
    assert run_dir_name(1, Choice("x", parse_spec(f'[pipeline]\nname = "{"a" * 80}"\n', source="x"))) == \
        "1-" + "a" * 60


def test_keep_names_each_variant_apart(tmp_path: Path) -> None:
    sessions = tmp_path / "in"
    write_reads(sessions, reads=3)
    keep = tmp_path / "runs"
    r = CliRunner().invoke(main, ["compare", str(sessions), "--pipeline", "identity", "--pipeline",
                                  "identity@ttl=5m", "--pipeline", "identity@ttl=1h", "--json", "-q",
                                  "--keep", str(keep)])
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in keep.iterdir()) == ["0-identity", "1-identity@ttl=5m", "2-identity@ttl=1h"]
    tot = {x["pipeline"]: x for x in json.loads(r.stdout)["totals"]}
    # each directory holds its pipeline's run, and beside it the calls as the comparison simulated
    # them: the 1-hour variant's writes priced at the 1h rate
    for name, label in (("0-identity", "identity"), ("1-identity@ttl=5m", "identity@ttl=5m"),
                        ("2-identity@ttl=1h", "identity@ttl=1h")):
        calls = pl.read_parquet(keep / name / COMPARE_CALLS).filter(~pl.col("is_pending"))
        assert tot[label]["sim_cost_usd"] == pytest.approx(calls["sim_cost_usd"].sum(), abs=1e-6), name
        assert (keep / name / "calls.parquet").exists()
    assert tot["identity@ttl=1h"]["sim_cost_usd"] > tot["identity@ttl=5m"]["sim_cost_usd"]
    # the same command again into the same DIR: the same names, nothing refused
    again = CliRunner().invoke(main, ["compare", str(sessions), "--pipeline", "identity", "--pipeline",
                                      "identity@ttl=5m", "--pipeline", "identity@ttl=1h", "-q", "--keep", str(keep)])
    assert again.exit_code == 0, again.output
    assert sorted(p.name for p in keep.iterdir()) == ["0-identity", "1-identity@ttl=5m", "2-identity@ttl=1h"]
