"""The CLI contract: outputs, exit codes, one-paragraph errors, --json keys."""

from __future__ import annotations

import json
from pathlib import Path

import orjson
import polars as pl
import pytest
from click.testing import CliRunner

from ctxreplay.pipeline.commands.cli import main

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
    assert pl.read_parquet(out / "quarantine.parquet").columns == ["file", "line", "raw", "reason", "code", "raw_base64",
                                                                     "line_bytes"]
    assert json.loads((out / "summary.json").read_text())["pipeline_sha256"] == s["pipeline_sha256"]


def test_run_human_summary(tmp_path: Path) -> None:
    r = _run("run", CC_SAMPLE, "--out", tmp_path / "o", "--preset", "identity", "--fast-tokens")
    assert r.exit_code == 0
    assert "read 2 files, 27 lines: 22 message, 5 other, 0 quarantined" in r.stdout
    assert "1 session, 2 threads, 10 calls (8 recorded + 2 pending)" in r.stdout


def test_all_calls_and_request_command_agree(tmp_path: Path) -> None:
    out = tmp_path / "o"
    assert _run("run", CC_SAMPLE, "--out", out, "--all-calls", "-q", "--fast-tokens").exit_code == 0
    lines = [orjson.loads(x) for x in (out / "requests" / f"{SID}.jsonl").read_bytes().splitlines()]
    assert [x["call"] for x in lines] == list(range(7))
    calls = pl.read_parquet(out / "calls.parquet").filter(pl.col("thread_id") == "main").sort("call")
    import hashlib

    from ctxreplay.pipeline.core.blockops import canonical_json

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
    assert r.exit_code == 0 and set(json.loads(r.stdout)) == {"stages", "plugin_errors"}
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
    assert r.exit_code == 0 and r.stdout.startswith(f"{out / 'ledger.duckdb'}: 1 run, 0 frozen decisions, "
                                                    f"0 violations recorded\n")
    q = _run("ledger", out, "--quarantine", "--json")
    assert q.exit_code == 0 and json.loads(q.stdout) == {"count": 0, "rows": []}
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


# ---------------------------------------------------------------------------------------- issue 8


def _no_traceback(r: object) -> str:
    """The one paragraph a failed command printed (stderr), checked to be one line, no traceback."""
    assert "Traceback" not in r.output and "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ctxreplay: "), r.stderr
    return lines[0]


@pytest.mark.parametrize("strict", [False, True])
def test_nothing_to_do_is_exit_2_and_writes_nothing_8(tmp_path: Path, strict: bool) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    flags = ["--strict"] if strict else []
    r = _run("run", empty, "--out", tmp_path / "o", *flags)
    assert r.exit_code == 2
    assert _no_traceback(r) == (f"ctxreplay: no transcripts found under {empty}: no files there. Pass the files or "
                                f"directories that hold session transcripts (*.jsonl), e.g. ~/.claude/projects")
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "README.md").write_text("hello\n")
    (notes / "empty.jsonl").write_text("")
    r = _run("run", notes, "--out", tmp_path / "o", *flags)
    assert r.exit_code == 2
    assert _no_traceback(r).startswith(f"ctxreplay: no transcripts found under {notes}: 1 empty file, 1 file "
                                       f"skipped ({notes / 'README.md'}: not a transcript file name")
    assert not (tmp_path / "o").exists()


def test_skipped_files_are_listed_on_the_terminal_8(tmp_path: Path) -> None:
    import shutil

    src = tmp_path / "in"
    shutil.copytree(CC_SAMPLE, src)
    for i in range(7):
        (src / f"note{i}.md").write_text("not a transcript\n")
    r = _run("run", src, "--out", tmp_path / "o", "--preset", "identity", "--fast-tokens")
    assert r.exit_code == 0
    assert "  skipped 7 files:\n" in r.stdout
    assert (f"    {src / 'note0.md'}: not a transcript file name (*.jsonl, *.jsonl.deleted.*, *.jsonl.reset.*, *.json)"
            in r.stdout)
    assert f"    ... and 2 more (all in {tmp_path / 'o'}/summary.json)" in r.stdout
    assert len(json.loads((tmp_path / "o" / "summary.json").read_text())["skipped_files"]) == 7


def test_request_uses_the_runs_own_target_8(tmp_path: Path) -> None:
    import hashlib

    out = tmp_path / "o"
    assert _run("run", CC_SAMPLE, "--out", out, "--target", "openai-chat", "-q", "--fast-tokens").exit_code == 0
    calls = pl.read_parquet(out / "calls.parquet").filter(pl.col("thread_id") == "main").sort("call")
    r = _run("request", out, SID, "--call", "2")
    assert r.exit_code == 0
    from ctxreplay.pipeline.core.blockops import canonical_json

    req = json.loads(r.stdout)
    assert hashlib.sha256(canonical_json(req)).hexdigest() == calls["request_sha256"][2]
    assert "system" not in req  # openai-chat carries the system prompt as a message
    other = json.loads(_run("request", out, SID, "--call", "2", "--target", "anthropic").stdout)
    assert hashlib.sha256(canonical_json(other)).hexdigest() != calls["request_sha256"][2]


def _spec(tmp_path: Path, pipeline_lines: str) -> Path:
    p = tmp_path / "spec.toml"
    p.write_text(f'[pipeline]\nname = "t"\n{pipeline_lines}\n[[stage]]\nuse = "sanitize"\n')
    return p


def test_the_spec_target_is_used_and_a_different_flag_refused_8(tmp_path: Path) -> None:
    spec = _spec(tmp_path, 'target = "openai-chat"')
    s = json.loads(_run("run", CC_SAMPLE, "--pipeline", spec, "--out", tmp_path / "a", "--json",
                        "--fast-tokens").stdout)
    assert s["target"] == "openai-chat"
    same = _run("run", CC_SAMPLE, "--pipeline", spec, "--out", tmp_path / "b", "--json", "--fast-tokens",
                "--target", "openai-chat")
    assert same.exit_code == 0 and json.loads(same.stdout)["pipeline_sha256"] == s["pipeline_sha256"]
    clash = _run("run", CC_SAMPLE, "--pipeline", spec, "--out", tmp_path / "c", "--target", "gemini")
    assert clash.exit_code == 2
    assert _no_traceback(clash) == (f"ctxreplay: {spec} sets [pipeline] target = 'openai-chat', but --target is "
                                    f"'gemini': drop --target to use the spec's target, or change the spec")
    assert not (tmp_path / "c").exists()
    bad = _run("run", CC_SAMPLE, "--pipeline", _spec(tmp_path, 'target = "antropic"'), "--out", tmp_path / "d")
    assert bad.exit_code == 2 and "target must be one of anthropic, gemini, openai-chat, openai-responses; got " \
        "'antropic'. Did you mean 'anthropic'?" in _no_traceback(bad)


def test_a_target_other_than_the_default_gets_its_own_namespace_8(tmp_path: Path) -> None:
    """Stages decide per target (sanitize, pairing): decisions made for openai-chat must not be
    reused by an anthropic run of the same spec on the same ledger."""
    explained = json.loads(_run("explain", "--preset", "minimal", "--json").stdout)["sha256"]
    ledger = tmp_path / "l.duckdb"
    hashes = {}
    for target in ("anthropic", "openai-chat"):
        s = json.loads(_run("run", CC_SAMPLE, "--preset", "minimal", "--out", tmp_path / target, "--ledger", ledger,
                            "--target", target, "--json", "--fast-tokens").stdout)
        hashes[target] = s["pipeline_sha256"]
    assert hashes["anthropic"] == explained != hashes["openai-chat"]


@pytest.mark.parametrize("value", ['"big"', "-5", "0", "1.5", "true", "200_000.0"])
def test_bad_window_tokens_is_refused_before_any_data_is_read_8(tmp_path: Path, value: str) -> None:
    spec = _spec(tmp_path, f"window_tokens = {value}")
    r = _run("run", tmp_path / "does-not-exist", "--pipeline", spec, "--out", tmp_path / "o")
    assert r.exit_code == 2
    assert _no_traceback(r).startswith(f"ctxreplay: {spec} [pipeline]: window_tokens must be a positive whole "
                                       f"number of tokens (the model's context window, e.g. 200000); got ")
    assert not (tmp_path / "o").exists()
    ok = _spec(tmp_path, "window_tokens = 1000")
    assert _run("run", CC_SAMPLE, "--pipeline", ok, "--out", tmp_path / "o", "-q", "--fast-tokens").exit_code == 0


def _register(name: str, fn: object) -> None:
    import dataclasses

    from ctxreplay.pipeline.stageapi.registry import stage

    @dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
    class NoParams:
        pass

    stage(name, version=1, params=NoParams)(fn)  # type: ignore[arg-type]


@pytest.fixture
def plugin_stage(tmp_path: Path):
    """Register a third-party-like stage named `plugin_probe`; yields a function that sets its body."""
    from ctxreplay.pipeline.stageapi.registry import STAGES, StageResult

    body = {}

    def plugin_probe(blocks, params, ledger, ctx):  # the stage's module is this test module
        return body["fn"](blocks, ledger, StageResult)

    _register("plugin_probe", plugin_probe)
    spec = tmp_path / "plugin.toml"
    spec.write_text('[pipeline]\nname = "plugin"\n[[stage]]\nuse = "plugin_probe"\n')
    yield body, spec
    STAGES.pop("plugin_probe", None)


def _failures(r: object) -> list[dict]:
    import json

    assert "Traceback" not in r.output and "Traceback" not in r.stderr
    return json.loads(r.stdout)["stage_failures"]


def test_a_plugin_returning_a_wrong_column_is_quarantined_not_fatal_9(tmp_path: Path, plugin_stage) -> None:
    body, spec = plugin_stage
    body["fn"] = lambda blocks, ledger, SR: SR(blocks.with_columns(oops=pl.lit(1)), ledger)
    r = _run("run", CC_SAMPLE, "--pipeline", spec, "--out", tmp_path / "o", "--fast-tokens", "--json")
    assert r.exit_code == 0
    (f,) = _failures(r)
    assert f["stage"] == "plugin_probe" and f["kind"] == "schema" and f["owner"] == "tests"
    assert f["message"] == ("after stage 'plugin_probe' (#1): frame does not match schema 'blocks' / "
                            "unexpected columns: ['oops']")
    assert (tmp_path / "o" / "current" / "calls.parquet").is_file()  # the run went on without it
    body["fn"] = lambda blocks, ledger, SR: SR(blocks.with_columns(pl.col("block_pos").cast(pl.Int64)), ledger)
    r = _run("run", CC_SAMPLE, "--pipeline", spec, "--out", tmp_path / "o", "--fast-tokens", "--json", "--strict")
    assert r.exit_code == 1
    assert _failures(r)[0]["message"].endswith("wrong type: block_pos: expected Int32, got Int64")


def test_a_plugin_that_raises_is_named_with_its_traceback_file_and_the_run_goes_on_9(
        tmp_path: Path, plugin_stage, monkeypatch: pytest.MonkeyPatch) -> None:
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    body, spec = plugin_stage
    body["fn"] = lambda blocks, ledger, SR: SR(blocks.select(pl.col("no_such_column")), ledger)
    r = _run("run", CC_SAMPLE, "--pipeline", spec, "--out", tmp_path / "o", "--fast-tokens")
    assert r.exit_code == 0, r.output
    line = next(x for x in r.stdout.splitlines() if "plug-in stage" in x)
    assert line.startswith("  plug-in stage 'plugin_probe' (#1, tests) skipped for ")
    assert "(raised): stage 'plugin_probe' (#1, from tests.test_cli) failed with ColumnNotFoundError: " in line
    assert "it is not a built-in stage: report it to the authors of tests, or leave it out of the spec" in line
    tb = Path(line.split("the traceback was written to ")[1].rstrip(")"))
    assert tb.parent == tmp_path and "Traceback" in tb.read_text()
    r = _run("run", CC_SAMPLE, "--pipeline", spec, "--out", tmp_path / "o", "--fast-tokens", "--strict")
    assert r.exit_code == 1 and r.stderr.splitlines()[0].endswith(", 1 plug-in stage failure")
    body["fn"] = lambda blocks, ledger, SR: (blocks, ledger)
    r = _run("run", CC_SAMPLE, "--pipeline", spec, "--out", tmp_path / "o", "--fast-tokens", "--json")
    assert r.exit_code == 0
    expected = ("stage 'plugin_probe' (#1, from tests.test_cli) returned tuple, not a StageResult(blocks, "
                "decisions) of polars frames; fix the stage")
    assert {f["message"] for f in _failures(r)} == {expected}


def test_a_builtin_stage_that_fails_stops_the_run_as_a_bug_9(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import dataclasses
    import tempfile

    from ctxreplay.pipeline.stageapi.registry import STAGES, load_stages

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    st = load_stages()["sanitize"]

    def broken(blocks, params, ledger, ctx):
        raise ZeroDivisionError("division by zero")

    from ctxreplay.pipeline.stageapi.registry import Quiet

    def broken_check(blocks, params, ctx):
        raise ZeroDivisionError("division by zero")

    # the stage itself (its quick check off: on the sample it would hold, and the stage not run), then its check
    for fn, quiet in ((broken, None), (st.fn, Quiet(broken_check))):
        monkeypatch.setitem(STAGES, "sanitize", dataclasses.replace(st, fn=fn, quiet=quiet))
        r = _run("run", CC_SAMPLE, "--preset", "minimal", "--out", tmp_path / "o", "--fast-tokens")
        assert r.exit_code == 2
        assert _no_traceback(r).startswith("ctxreplay: stage 'sanitize' (#1, from ctxreplay.stages.sanitize) failed "
                                           "with ZeroDivisionError: division by zero. Nothing was written; this is a "
                                           "bug in ctxreplay; please report it")
        assert not (tmp_path / "o" / "current").exists()


def test_an_unexpected_exception_is_an_internal_error_with_a_traceback_file_8(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import tempfile

    import ctxreplay.pipeline.batch.batchrun as batchrun_mod

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    def broken(*a: object, **k: object) -> None:
        raise AssertionError("incremental request hash mismatch at call 3")

    monkeypatch.setattr(batchrun_mod, "replay_all", broken)
    r = _run("run", CC_SAMPLE, "--out", tmp_path / "o", "--fast-tokens")
    assert r.exit_code == 2
    line = _no_traceback(r)
    assert line.startswith("ctxreplay: internal error while replaying (AssertionError: incremental request hash "
                           "mismatch at call 3): this is a bug in ctxreplay; the traceback was written to ")
    tb = Path(line.split("written to ")[1].split(". Please report")[0])
    assert "broken" in tb.read_text()

    def crash(*a: object, **k: object) -> None:
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(batchrun_mod, "call_skeleton", crash)
    r = _run("run", CC_SAMPLE, "--out", tmp_path / "o", "--fast-tokens")
    assert r.exit_code == 2
    assert _no_traceback(r).startswith("ctxreplay: internal error (ZeroDivisionError: division by zero): this is a "
                                       "bug in ctxreplay; the traceback was written to ")

    def interrupted(*a: object, **k: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(batchrun_mod, "call_skeleton", interrupted)
    r = _run("run", CC_SAMPLE, "--out", tmp_path / "o", "--fast-tokens")
    assert r.exit_code == 130
    assert _no_traceback(r).startswith("ctxreplay: interrupted; the output directory still holds the last complete run")


def test_a_ledger_that_is_not_duckdb_is_exit_2_8(tmp_path: Path) -> None:
    bad = tmp_path / "ledger.duckdb"
    bad.write_text("not a database\n")
    r = _run("run", CC_SAMPLE, "--out", tmp_path / "o", "--ledger", bad, "--fast-tokens")
    assert r.exit_code == 2
    assert _no_traceback(r).startswith(f"ctxreplay: {bad} is not a DuckDB database, not a ctxreplay ledger")
    assert bad.read_text() == "not a database\n"
    assert not (tmp_path / "o" / "current").exists()
    r = _run("ledger", tmp_path / "o", "--ledger", bad)
    assert r.exit_code == 2 and "not a ctxreplay ledger" in _no_traceback(r)


def test_an_out_that_is_a_file_is_exit_2_8(tmp_path: Path) -> None:
    f = tmp_path / "out.txt"
    f.write_text("keep me\n")
    r = _run("run", CC_SAMPLE, "--out", f, "--fast-tokens")
    assert r.exit_code == 2
    assert _no_traceback(r) == (f"ctxreplay: --out {f} is a file, not a directory: pass a directory (it is created "
                                f"when missing); ctxreplay never overwrites a file it did not write")
    assert f.read_text() == "keep me\n"
    r = _run("run", CC_SAMPLE, "--out", f / "sub", "--fast-tokens")
    assert r.exit_code == 2 and _no_traceback(r).startswith(f"ctxreplay: --out {f / 'sub'}: {f} is a file")
    r = _run("request", f, SID)
    assert r.exit_code == 2 and _no_traceback(r) == f"ctxreplay: {f} is a file, not a ctxreplay output directory"


def test_an_unwritable_out_is_exit_2_8(tmp_path: Path) -> None:
    import os

    if os.geteuid() != 0:
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        out = ro / "o"
    else:  # root writes anywhere chmod allows: use a file system that refuses everyone
        if not Path("/sys/kernel").is_dir():
            pytest.skip("running as root without /sys to stand for an unwritable directory")
        out = Path("/sys/kernel/ctxreplay-test-out")
    r = _run("run", CC_SAMPLE, "--out", out, "--fast-tokens")
    assert r.exit_code == 2
    line = _no_traceback(r)
    assert line.startswith(f"ctxreplay: cannot create the output directory {out}: ")
    assert line.endswith("Pass an --out you can write to")
