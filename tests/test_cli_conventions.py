"""The CLI follows its own conventions (issue 13, point 4): the ledger's counts and prefixes,
choices from the registries in --help, `init`, `request --canonical`, `-q`, plurals, file modes,
and one JSON object per --json."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import polars as pl
import pytest

from ctxreplay.pipeline.stageapi.registry import load_stages, params_doc
from ctxreplay.pipeline.staging.spec import preset_names
from tests.inspectkit import SAMPLES, SYN_SID, cli, one_error_line, write_session

CC = SAMPLES / "claude-projects"
CC_SID = "5f0c1d2e-3a4b-4c5d-8e9f-0a1b2c3d4e5f"


@pytest.fixture(scope="module")
def syn_out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The small session (provisional decisions included) with the default preset."""
    base = tmp_path_factory.mktemp("conv")
    write_session(base / "src")
    assert cli("run", base / "src", "--out", base / "o", "-q", "--fast-tokens").exit_code == 0
    return base / "o"


# ---------------------------------------------------------------------------------------- ledger


def test_ledger_counts_equal_the_summary_with_provisional_labelled(syn_out: Path) -> None:
    summary = json.loads((syn_out / "summary.json").read_text())
    doc = json.loads(cli("ledger", syn_out, "--json", "--limit", "0").stdout)
    assert "len" not in json.dumps(doc["by_reason"])
    by_stage: dict[str, int] = {}
    for r in doc["by_reason"]:
        assert set(r) == {"stage", "action", "reason", "frozen", "provisional", "count"}
        assert r["frozen"] + r["provisional"] == r["count"]
        by_stage[r["stage"]] = by_stage.get(r["stage"], 0) + r["count"]
    assert by_stage == {k: v for k, v in summary["decisions"].items() if v}
    assert doc["decisions"] == sum(summary["decisions"].values()) == 8
    assert (doc["frozen"], doc["provisional"]) == (7, 1)
    assert doc["ledger_decisions"] == 7  # the ledger holds the frozen ones only
    assert doc["count"] == len(doc["rows"]) == 8
    prov = [r for r in doc["rows"] if r["is_provisional"]]
    assert [(r["stage"], r["reason"], r["from_call"], r["seq"]) for r in prov] == [("sanitize", "blank_text", 16, None)]
    assert all(isinstance(r["seq"], int) for r in doc["rows"] if not r["is_provisional"])
    text = cli("ledger", syn_out).stdout.splitlines()
    assert text[0] == f"{syn_out / 'ledger.duckdb'}: 1 run, 7 frozen decisions, 0 violations recorded"
    assert text[1].endswith(": 8 decisions applied = 7 frozen in the ledger + 1 provisional")
    assert text[2].split() == ["stage", "action", "reason", "frozen", "provisional", "total"]
    assert text[3].split() == ["sanitize", "drop", "blank_text", "1", "1", "2"]
    assert "  provisional sanitize drop blank_text  thread a0b1c2d3/main  " in "\n".join(text)
    assert text[-1].startswith("provisional: decided for a thread's pending call and applied to its request")


def test_ledger_filters_take_prefixes_and_say_when_nothing_matches(syn_out: Path) -> None:
    doc = json.loads(cli("ledger", syn_out, "--session", "a0b1", "--stage", "tombstone", "--json").stdout)
    assert doc["filters"] == {"stage": "tombstone", "session": SYN_SID, "thread": None} and doc["decisions"] == 3
    doc = json.loads(cli("ledger", syn_out, "--thread", "a0b1/main", "--json").stdout)
    assert doc["filters"]["thread"] == SYN_SID and doc["decisions"] == 8
    r = cli("ledger", syn_out, "--stage", "snip")
    assert r.exit_code == 0
    assert r.stderr.splitlines() == [(f"ctxreplay: no decision matches --stage snip in run "
                                     f"{json.loads((syn_out / 'summary.json').read_text())['run_id']}")]
    assert "0 decisions applied = 0 frozen in the ledger + 0 provisional" in r.stdout
    r = cli("ledger", syn_out, "--stage", "tombstones")
    assert r.exit_code == 2
    assert one_error_line(r) == ("ctxreplay: unknown stage 'tombstones'. Did you mean 'tombstone'? Stages: auto_compact, "
                                 "images, inter_session, pairing, pairing#2, result_budget, sanitize, snip, tombstone")
    r = cli("ledger", syn_out, "--session", "zz")
    assert r.exit_code == 2 and one_error_line(r) == f"ctxreplay: no session 'zz' in {syn_out}. Sessions: {SYN_SID}"
    # `pairing` takes its later uses too; `pairing#2` only that one
    both = json.loads(cli("ledger", syn_out, "--stage", "pairing", "--json").stdout)["decisions"]
    second = json.loads(cli("ledger", syn_out, "--stage", "pairing#2", "--json").stdout)["decisions"]
    assert (both, second) == (2, 0)


def test_ledger_without_a_run_shows_the_ledger(syn_out: Path, tmp_path: Path) -> None:
    r = cli("ledger", tmp_path / "nothing", "--ledger", syn_out / "ledger.duckdb")
    assert r.exit_code == 0
    lines = r.stdout.splitlines()
    assert lines[1] == ("no published run in this directory: the ledger's frozen decisions only (a run's provisional "
                        "decisions are in its decisions.parquet)")
    doc = json.loads(cli("ledger", tmp_path / "nothing", "--ledger", syn_out / "ledger.duckdb", "--json").stdout)
    assert doc["run"] is None and doc["decisions"] == 7 and doc["provisional"] is None


# ---------------------------------------------------------------------------------------- choices


def test_help_lists_targets_and_presets_from_the_registries() -> None:
    from ctxreplay.pipeline.targets import TARGETS, get_target, register

    presets = "|".join(preset_names())
    assert presets == "claude-code|context-editing|default|identity|minimal|openclaw"
    targets = "anthropic|gemini|openai-chat|openai-responses"
    run_help = cli("run", "-h").stdout
    assert f"--preset [{presets}]" in run_help and f"--target [{targets}]" in run_help
    assert f"--preset [{presets}]" in cli("explain", "-h").stdout
    assert f"--target [{targets}]" in cli("request", "-h").stdout
    assert f"[{presets}]" in "".join(cli("init", "-h").stdout.split())  # the usage line wraps

    class Probe:
        name = "probe-target"

    register(get_target("anthropic"))  # registering again changes nothing
    TARGETS["probe-target"] = Probe()  # type: ignore[assignment]
    try:
        assert f"--target [{targets}|probe-target]" in cli("run", "-h").stdout
    finally:
        TARGETS.pop("probe-target")


def test_unknown_choices_are_one_paragraph_with_a_hint(tmp_path: Path) -> None:
    r = cli("run", CC, "--out", tmp_path / "o", "--target", "antropic")
    assert r.exit_code == 2
    assert one_error_line(r) == ("ctxreplay: unknown target 'antropic'. Did you mean 'anthropic'? Targets: anthropic, "
                                 "gemini, openai-chat, openai-responses")
    r = cli("explain", "--preset", "minimall")
    assert r.exit_code == 2
    assert one_error_line(r) == ("ctxreplay: unknown preset 'minimall'. Did you mean 'minimal'? Presets: claude-code, "
                                 "context-editing, default, identity, minimal, openclaw")
    assert not (tmp_path / "o").exists()
    ok = cli("run", CC, "--out", tmp_path / "o", "--target", "openai_chat", "--json", "--fast-tokens")
    assert ok.exit_code == 0 and json.loads(ok.stdout)["target"] == "openai-chat"


# ---------------------------------------------------------------------------------------- init


def _explained(path_or_preset: list[str]) -> dict[str, Any]:
    r = cli("explain", *path_or_preset, "--json")
    assert r.exit_code == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.parametrize("preset", preset_names())
def test_init_writes_the_preset_with_every_parameter_commented(preset: str, tmp_path: Path) -> None:
    r = cli("init", preset)
    assert r.exit_code == 0 and r.stderr == ""
    text = r.stdout
    doc = tomllib.loads(text)  # valid TOML
    mine = tmp_path / "mine.toml"
    mine.write_text(text)
    assert _explained([str(mine)])["sha256"] == _explained(["--preset", preset])["sha256"]
    used = [s["use"] for s in doc.get("stage", [])]
    assert used == [s["use"] for s in _explained(["--preset", preset])["stage"]]
    lines = text.splitlines()
    for name, st in load_stages().items():
        prefix = "" if name in used else "# "
        assert f'{prefix}use = "{name}"' in lines, name
        for p in params_doc(st.params):
            assert any(ln.startswith((f"{prefix}{p['name']} = ", f"{prefix}# {p['name']} =")) for ln in lines), \
                (name, p["name"])
            assert any(ln.startswith(f"{prefix}# {p['doc']} (") for ln in lines), (name, p["name"])


def test_init_blocks_left_out_can_be_switched_on(tmp_path: Path) -> None:
    lines = cli("init", "minimal").stdout.splitlines()
    start = lines.index("# # snip (v1): Remove whole old middle turns when the request passes the high watermark.")
    end = next(i for i in range(start + 1, len(lines)) if lines[i] == "#")
    block = [ln[2:] for ln in lines[start:end]]
    spec = tmp_path / "with-snip.toml"
    spec.write_text("\n".join(lines[:start] + block) + "\n")
    doc = _explained([str(spec)])
    assert [s["use"] for s in doc["stage"]] == ["sanitize", "pairing", "snip"]
    assert doc["stage"][2]["reserve_output_tokens"] == 20000
    r = cli("init", "nope")
    assert r.exit_code == 2 and one_error_line(r).startswith("ctxreplay: unknown preset 'nope'. Presets: ")


def test_toml_values() -> None:
    from ctxreplay.pipeline.staging.spec_init import NotToml, toml_value

    assert [toml_value(v) for v in (True, 3, 0.3, 1.0, 1e20, "a\"b\n", [1, "x"], ("*",), {"allow": ["*"], "a b": 1})] == \
        ["true", "3", "0.3", "1.0", "1e+20", '"a\\"b\\n"', '[1, "x"]', '["*"]', '{ allow = ["*"], "a b" = 1 }']
    for v in (True, 3, 0.3, 1.0, 1e20, "a\"b\n\u0001é", [1, "x"], {"allow": ["*"], "a b": 1}):
        assert tomllib.loads(f"k = {toml_value(v)}")["k"] == v
    with pytest.raises(NotToml):
        toml_value([None])


# ---------------------------------------------------------------------------------------- request


def test_request_canonical_is_exactly_the_hashed_bytes(tmp_path: Path) -> None:
    out = tmp_path / "o"
    assert cli("run", SAMPLES, "--out", out, "-q", "--fast-tokens").exit_code == 0
    calls = pl.read_parquet(out / "calls.parquet")
    for r in calls.iter_rows(named=True):
        got = cli("request", out, r["thread_key"], "--call", r["call"], "--canonical")
        assert got.exit_code == 0
        assert hashlib.sha256(got.stdout_bytes).hexdigest() == r["request_sha256"], (r["thread_key"], r["call"])
        assert not got.stdout_bytes.endswith(b"\n")
    pretty = cli("request", out, CC_SID).stdout
    assert pretty.startswith("{\n  \"messages\": [\n") and pretty.endswith("}\n")
    assert hashlib.sha256(pretty.encode()).hexdigest() not in set(calls["request_sha256"])


# ---------------------------------------------------------------------------------------- output


def test_quiet_prints_nothing_but_errors(tmp_path: Path) -> None:
    r = cli("run", CC, "--out", tmp_path / "o", "-q", "--fast-tokens")
    assert r.exit_code == 0 and r.stdout == "" and r.stderr == ""
    r = cli("run", CC, "--out", tmp_path / "o", "-q", "--json", "--fast-tokens")
    assert r.exit_code == 0 and json.loads(r.stdout)["calls"] == 10 and r.stderr == ""
    bad = tmp_path / "bad.jsonl"
    bad.write_text((CC / "-home-dev-demo" / f"{CC_SID}.jsonl").read_text() + "{broken\n")
    r = cli("run", bad, "--out", tmp_path / "b", "-q", "--strict", "--fast-tokens")
    assert r.exit_code == 1 and r.stdout == ""
    assert r.stderr.splitlines()[0] == "--strict: 1 quarantined line, 0 violations, 0 ledger conflicts"
    r = cli("run", tmp_path / "missing", "--out", tmp_path / "c", "-q")
    assert r.exit_code == 2 and r.stdout == "" and one_error_line(r).startswith("ctxreplay: ")


def test_plurals(tmp_path: Path) -> None:
    one = CC / "-home-dev-demo" / f"{CC_SID}.jsonl"
    out = cli("run", one, "--out", tmp_path / "o", "--preset", "identity", "--fast-tokens").stdout
    assert "  read 1 file, 23 lines: " in out and "  1 session, 1 thread, 7 calls (6 recorded + 1 pending)" in out
    out = cli("run", SAMPLES, "--out", tmp_path / "p", "--fast-tokens").stdout
    assert "  recovered 1 line holding more than one JSON object" in out
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "a.md").write_text("x\n")
    r = cli("run", notes, one, "--out", tmp_path / "n", "--preset", "identity", "--fast-tokens")
    assert "  skipped 1 file:\n" in r.stdout
    assert "1 run, 0 frozen decisions, 0 violations recorded" in cli("ledger", tmp_path / "o").stdout
    assert cli("ledger", tmp_path / "o", "--quarantine").stdout.startswith("0 quarantined lines\n")


def test_plural_words() -> None:
    from ctxreplay.pipeline.core.words import plural

    assert [plural(n, "line") for n in (0, 1, 2, 1234)] == ["0 lines", "1 line", "2 lines", "1,234 lines"]
    assert plural(1, "match") == "1 match" and plural(2, "match") == "2 matches"


@pytest.fixture
def umask() -> Iterator[Any]:
    old = os.umask(0o022)
    os.umask(old)

    def set_to(mask: int) -> None:
        os.umask(mask)

    yield set_to
    os.umask(old)


@pytest.mark.parametrize("mask", [0o022, 0o027, 0o002])
def test_output_files_follow_the_umask(tmp_path: Path, umask: Any, mask: int) -> None:
    umask(mask)
    out = tmp_path / "o"
    assert cli("run", SAMPLES, "--out", out, "--all-calls", "-q", "--fast-tokens").exit_code == 0
    files, dirs = 0, 0
    for p in [out, *out.rglob("*")]:
        st = p.lstat()
        if stat.S_ISLNK(st.st_mode):
            continue
        want = (0o777 if stat.S_ISDIR(st.st_mode) else 0o666) & ~mask
        assert stat.S_IMODE(st.st_mode) == want, (p, oct(st.st_mode), oct(want))
        files += stat.S_ISREG(st.st_mode)
        dirs += stat.S_ISDIR(st.st_mode)
    # 6 parquet files (the request store too), the summary, 8 + 8 requests, the ledger and both lock files,
    # the manifest and call_facts.parquet (what a re-run reuses), the record of what is ours in OUT
    assert files == 6 + 1 + 16 + 1 + 2 + 2 + 1 and dirs == 4


@pytest.mark.parametrize("args", [
    ["run", CC, "--json", "--fast-tokens", "--preset", "identity"],
    ["explain", "--preset", "default", "--json"],
    ["ledger", "{out}", "--json"],
    ["ledger", "{out}", "--quarantine", "--json"],
    ["threads", "{out}", "--json"],
    ["why", "{out}", CC_SID, "--json"],
    ["report", CC, "--json", "--tz", "UTC"],
])
def test_every_json_output_is_one_object(tmp_path: Path, args: list[Any]) -> None:
    out = tmp_path / "o"
    assert cli("run", CC, "--out", out, "-q", "--fast-tokens").exit_code == 0
    if args[0] == "run":
        args = [*args, "--out", tmp_path / "o2"]
    r = cli(*[str(out) if a == "{out}" else a for a in args])
    assert r.exit_code == 0, r.stderr
    assert isinstance(json.loads(r.stdout), dict)
