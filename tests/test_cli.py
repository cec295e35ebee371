"""The CLI contract: outputs, exit codes, one-paragraph errors, --json keys."""

from __future__ import annotations

import json
from pathlib import Path

import orjson
import polars as pl
import pytest
from click.testing import CliRunner

from pipeline.cli import main

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "data" / "samples"
CC_SAMPLE = SAMPLES / "claude-projects"
SID = "5f0c1d2e-3a4b-4c5d-8e9f-0a1b2c3d4e5f"
SUMMARY_KEYS = {"files", "lines", "message_lines", "other_lines", "quarantined_lines", "sessions", "threads", "calls",
                "decisions", "pipeline_sha256"}


def _run(*args: str) -> object:
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def test_run_json_summary_and_outputs(tmp_path: Path) -> None:
    out = tmp_path / "o"
    r = _run("run", CC_SAMPLE, "--out", out, "--json", "--preset", "identity", "--fast-tokens")
    assert r.exit_code == 0, r.stderr
    s = json.loads(r.stdout)
    assert SUMMARY_KEYS <= set(s)
    assert s["message_lines"] + s["other_lines"] + s["quarantined_lines"] == s["lines"] == 27
    assert (s["sessions"], s["threads"], s["calls"], s["recorded_calls"]) == (1, 2, 10, 8)
    calls = pl.read_parquet(out / "calls.parquet")
    assert {"session_id", "thread_id", "call", "is_pending", "timestamp", "model", "request_sha256", "n_messages",
            "prompt_tokens", "recorded_input_tokens", "recorded_output_tokens", "recorded_cache_read_tokens",
            "recorded_cache_write_tokens"} <= set(calls.columns)
    assert (out / "requests" / f"{SID}.json").is_file()
    assert (out / "requests" / f"{SID}--agent-a1b2c3d.json").is_file()
    assert pl.read_parquet(out / "quarantine.parquet").columns == ["file", "line", "raw", "reason", "code", "raw_base64"]
    assert json.loads((out / "summary.json").read_text())["pipeline_sha256"] == s["pipeline_sha256"]


def test_run_human_summary(tmp_path: Path) -> None:
    r = _run("run", CC_SAMPLE, "--out", tmp_path / "o", "--preset", "identity", "--fast-tokens")
    assert r.exit_code == 0
    assert "read 2 files, 27 lines: 22 message, 5 other, 0 quarantined" in r.stdout
    assert "1 sessions, 2 threads, 10 calls (8 recorded + 2 pending)" in r.stdout


def test_all_calls_and_request_command_agree(tmp_path: Path) -> None:
    out = tmp_path / "o"
    assert _run("run", CC_SAMPLE, "--out", out, "--all-calls", "-q", "--fast-tokens").exit_code == 0
    lines = [orjson.loads(x) for x in (out / "requests" / f"{SID}.jsonl").read_bytes().splitlines()]
    assert [x["call"] for x in lines] == list(range(7))
    calls = pl.read_parquet(out / "calls.parquet").filter(pl.col("thread_id") == "main").sort("call")
    import hashlib

    from pipeline.blockops import canonical_json

    assert [hashlib.sha256(canonical_json(x["request"])).hexdigest() for x in lines] == calls["request_sha256"].to_list()
    r = _run("request", out, SID, "--call", "2")
    assert r.exit_code == 0
    assert json.loads(r.stdout) == lines[2]["request"]
    pending = _run("request", out, SID)
    assert json.loads(pending.stdout) == json.loads((out / "requests" / f"{SID}.json").read_text())
    bad = _run("request", out, SID, "--call", "99")
    assert bad.exit_code == 2 and "has calls 0..6" in bad.stderr


def test_unknown_preset_is_exit_2_with_one_line(tmp_path: Path) -> None:
    r = _run("run", CC_SAMPLE, "--out", tmp_path / "o", "--preset", "defualt")
    assert r.exit_code == 2
    assert r.stderr.startswith("ctxreplay: unknown preset 'defualt'. Did you mean 'default'?")
    assert not (tmp_path / "o").exists()  # refused before any work


def test_missing_path_is_exit_2(tmp_path: Path) -> None:
    r = _run("run", tmp_path / "nope", "--out", tmp_path / "o")
    assert r.exit_code == 2 and "no such file or directory" in r.stderr


def test_strict_exits_1_on_quarantined_lines(tmp_path: Path) -> None:
    src = (CC_SAMPLE / "-home-dev-demo" / f"{SID}.jsonl").read_text().splitlines()
    f = tmp_path / "in" / f"{SID}.jsonl"
    f.parent.mkdir()
    f.write_text("\n".join(src[:5] + ["{broken"] + src[5:]) + "\n")
    r = _run("run", f, "--out", tmp_path / "o", "--strict", "--preset", "identity", "--fast-tokens")
    assert r.exit_code == 1
    assert "1 of 24 lines quarantined (invalid_json: 1)" in r.stdout
    q = pl.read_parquet(tmp_path / "o" / "quarantine.parquet")
    assert q.select("line", "raw").to_dicts() == [{"line": 6, "raw": "{broken"}]
    assert _run("run", f, "--out", tmp_path / "o2", "--preset", "identity", "--fast-tokens").exit_code == 0


def test_stages_and_explain(tmp_path: Path) -> None:
    r = _run("stages", "--json")
    assert r.exit_code == 0 and isinstance(json.loads(r.stdout), list)
    e = _run("explain", "--preset", "identity", "--json")
    doc = json.loads(e.stdout)
    assert doc["stage"] == [] and len(doc["sha256"]) == 64
    s = json.loads(_run("run", CC_SAMPLE, "--out", tmp_path / "o", "--json", "--preset", "identity",
                        "--fast-tokens").stdout)
    assert s["pipeline_sha256"] == doc["sha256"]
    assert _run("explain", ROOT / "data" / "pipelines" / "default.toml").stdout.startswith("# ")


@pytest.mark.parametrize("cmd", [[], ["run"], ["request"], ["stages"], ["explain"], ["ledger"]])
def test_every_command_has_help_with_an_example(cmd: list[str]) -> None:
    r = _run(*cmd, "-h")
    assert r.exit_code == 0 and "Usage:" in r.stdout
    if cmd:
        assert "Example:" in r.stdout


def test_ledger_command_lists_quarantine_and_runs(tmp_path: Path) -> None:
    out = tmp_path / "o"
    assert _run("run", CC_SAMPLE, "--out", out, "-q", "--preset", "identity", "--fast-tokens").exit_code == 0
    r = _run("ledger", out)
    assert r.exit_code == 0 and r.stdout.startswith(f"{out / 'ledger.duckdb'}: 1 run(s), 0 decision(s)")
    q = _run("ledger", out, "--quarantine", "--json")
    assert q.exit_code == 0 and json.loads(q.stdout) == []
    missing = _run("ledger", tmp_path / "nothing")
    assert missing.exit_code == 2 and "no ledger here" in missing.stderr


def test_default_pipeline_normalises_usage_without_touching_raw_usage(tmp_path: Path) -> None:
    out = tmp_path / "o"
    assert _run("run", CC_SAMPLE, "--out", out, "-q", "--fast-tokens").exit_code == 0
    b = pl.read_parquet(out / "blocks.parquet").filter(pl.col("thread_id") == "main")
    first = b.filter(pl.col("msg_key") == "msg_demo_01|req_demo_01")
    # the largest copy counts: 3 in + 61 out + 5200 cache write; raw columns as recorded
    assert first.select("u_input", "u_output", "u_cache_read", "u_cache_write", "u_total").unique().rows() == [
        (3, 61, 0, 5200, 5264)]
    assert first["usage_output"].unique().to_list() == [61]
    stale = b.filter(pl.col("role") == "assistant").group_by("msg_key").agg(pl.col("usage_stale").first())
    assert dict(stale.rows()) == {"msg_demo_01|req_demo_01": True, "msg_demo_02|req_demo_02": True,
                                  "msg_demo_03|req_demo_03": True, "msg_demo_05|req_demo_05": False,
                                  "msg_demo_06|req_demo_06": False}
