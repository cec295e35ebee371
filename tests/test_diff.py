"""`ctxreplay diff`: exit 0 when identical; exit 1 with a report naming, per changed thread, the
first differing call, message, block and the decision that explains it; input changes apart;
exit 2 when it cannot run (issue 12.2), and the README's CI job (issue 12.4)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import polars as pl
import pytest
from click.testing import CliRunner

from ctxreplay.pipeline.commands.cli import main
from ctxreplay.pipeline.core.tokens import CHARS4_COUNTER
from ctxreplay.pipeline.regress.diff import block_diff, compare, render_markdown, spec_changes
from ctxreplay.pipeline.regress.snapshot import SIM_COST, Golden, replay, write_golden
from ctxreplay.pipeline.staging.spec import load_spec, parse_spec
from tests.goldenkit import POLICY, write_policy

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "data" / "samples"
RECIPE = ROOT / "examples" / "github-actions.yml"
CODEX = "019a7c21-4d2e-7f10-b3a8-5e6f7a8b9c0d"
PI = "3b8e2f41-6c0d-4d7a-a1e5-8f2b9c4d6e10"
OPENCLAW = "7d3f9a2e-1b4c-4e8a-9f60-2c5d8e1a4b37"



@pytest.fixture(autouse=True)
def _price_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CTXREPLAY_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "price-cache"))


def _cli(*args: object) -> object:
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)




@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Goldens of the samples under keep_recent = 2, and the two policies, in one directory."""
    d = tmp_path_factory.mktemp("diff")
    for k in (1, 2, 3):
        write_policy(d, k)
    r = _cli("snapshot", SAMPLES, "--pipeline", d / "policy-2.toml", "--golden", d / "golden", "--fast-tokens", "-q")
    assert r.exit_code == 0, r.stderr
    return d


def _golden_copy(base: Path, tmp_path: Path) -> Path:
    g = tmp_path / "golden"
    shutil.copytree(base / "golden", g)
    return g


def _diff_json(*args: object) -> tuple[int, dict]:
    r = _cli("diff", *args, "--json")
    return r.exit_code, (json.loads(r.stdout) if r.stdout.strip() else {})


# ------------------------------------------------------------------------------------ outcomes


def test_same_pipeline_and_inputs_is_identical_exit_0(base: Path) -> None:
    r = _cli("diff", SAMPLES, "--pipeline", base / "policy-2.toml", "--golden", base / "golden")
    assert r.exit_code == 0, r.stdout + r.stderr
    assert r.stdout.startswith(f"ctxreplay diff: identical: 8 threads, 36 calls match the goldens in {base / 'golden'}")
    code, doc = _diff_json(SAMPLES, "--pipeline", base / "policy-2.toml", "--golden", base / "golden")
    assert code == 0 and doc["identical"] is True and doc["threads"] == [] and doc["pipeline_changes"] == []


def test_keep_recent_change_names_first_call_message_block_and_decision(base: Path) -> None:
    code, doc = _diff_json(SAMPLES, "--pipeline", base / "policy-1.toml", "--golden", base / "golden")
    assert code == 1 and doc["identical"] is False
    assert doc["pipeline_changes"] == ["tombstone (#3) keep_recent: 2 → 1"]
    s = doc["summary"]
    assert (s["changed"], s["changed_by_pipeline"], s["changed_by_input"], s["new"], s["vanished"]) == (3, 3, 0, 0, 0)
    assert s["calls_changed"] == 6 and s["calls"] == 36
    by = {t["thread_key"]: t for t in doc["threads"]}
    assert set(by) == {CODEX, PI, OPENCLAW}
    for key, tool in ((CODEX, "call_A1b2C3d4"), (PI, "toolu_01Notes"), (OPENCLAW, "call_read_01")):
        t = by[key]
        assert (t["status"], t["cause"], t["first_call"]) == ("changed", "pipeline", 3)
        w = t["where"]
        assert (w["kind"], w["message"], w["role"], w["block"], w["block_type"], w["tool_use_id"]) == \
            ("changed", 2, "user", 0, "tool_result", tool)
        d = t["decision"]
        assert (d["stage"], d["action"], d["reason"], d["from_call"], d["cache_epoch"], d["tool_use_id"], d["change"]) \
            == ("tombstone", "tombstone", "token", 3, 4, tool, "new")
        assert "+" + "content" in t["diff"] or "+content" in t["diff"]
        assert "[Old tool result content cleared]" in t["diff"]
    codex = by[CODEX]
    assert codex["prompt_tokens"] == {"golden": 646, "new": 629, "delta": -17,
                                      "at_first_call": {"golden": 231, "new": 214}}
    assert s["prompt_tokens"]["delta"] == sum(t["prompt_tokens"]["delta"] for t in doc["threads"])


def test_text_report_summary_first_then_each_thread(base: Path) -> None:
    r = _cli("diff", SAMPLES, "--pipeline", base / "policy-1.toml", "--golden", base / "golden")
    assert r.exit_code == 1
    lines = r.stdout.splitlines()
    assert lines[0] == ("ctxreplay diff: 3 of 8 threads changed (3 by the pipeline, 0 by changed inputs), 0 new, "
                        f"0 vanished; goldens {base / 'golden'}")
    assert lines[3] == "  pipeline:       tombstone (#3) keep_recent: 2 → 1"
    assert lines[4] == "  requests:       6 of 36 calls differ"
    first_section = lines.index(f"== {CODEX} (pipeline change)")
    assert first_section < 20  # the summary fits one screen
    sec = lines[first_section:first_section + 12]
    assert sec[1] == "  first differing call: 3 (1 of 4 calls differ)"
    assert sec[2] == ("  where: message 2 (user) differs, block 0 (tool_result call_A1b2C3d4); 1 of 7 messages differ "
                      "at this call")
    assert sec[3] == ("  decision: tombstone: tombstone (token) from call 3, cache_epoch 4, tool call call_A1b2C3d4; "
                      "made by this run only (provisional: the pending call's, not frozen in the ledger)")
    assert "  --- golden call 3, message 2, block 0" in lines
    assert "  +content: [Old tool result content cleared]" in lines
    assert "ctxreplay diff: took" in r.stderr


def test_a_decision_the_goldens_made_and_this_run_does_not(base: Path, tmp_path: Path) -> None:
    g = tmp_path / "g1"
    assert _cli("snapshot", SAMPLES, "--pipeline", base / "policy-1.toml", "--golden", g, "--fast-tokens",
                "-q").exit_code == 0
    code, doc = _diff_json(SAMPLES, "--pipeline", base / "policy-2.toml", "--golden", g)
    assert code == 1
    t = next(t for t in doc["threads"] if t["thread_key"] == CODEX)
    assert t["decision"]["change"] == "gone" and t["decision"]["stage"] == "tombstone"
    assert "-content: [Old tool result content cleared]" in t["diff"]


def test_a_param_that_changes_nothing_here_is_identical(base: Path) -> None:
    # keep_recent 3 keeps every result of the samples as keep_recent 2 does: the threshold's other side
    code, doc = _diff_json(SAMPLES, "--pipeline", base / "policy-3.toml", "--golden", base / "golden")
    assert code == 0 and doc["identical"] and doc["pipeline_changes"] == ["tombstone (#3) keep_recent: 2 → 3"]


def test_markdown_fits_a_pull_request_comment(base: Path) -> None:
    r = _cli("diff", SAMPLES, "--pipeline", base / "policy-1.toml", "--golden", base / "golden", "--format",
             "markdown")
    assert r.exit_code == 1
    md = r.stdout
    assert md.startswith("### ctxreplay diff: 3 of 8 threads changed")
    assert md.count("<details><summary>") == 3 and md.count("</details>") == 3
    assert md.count("```diff") == 3
    assert "| thread | cause | first call | calls | tokens Δ | cost Δ USD | explained by |" in md
    assert f"| `{CODEX}` | pipeline | 3 | 1/4 | −17 |" in md
    assert "- **pipeline:** `tombstone (#3) keep_recent: 2 → 1`" in md


def test_markdown_is_cut_to_the_limit_with_a_note(base: Path) -> None:
    with replay([SAMPLES], load_spec(base / "policy-1.toml"), target=None, token_counter=CHARS4_COUNTER) as rp:
        rep = compare(Golden(base / "golden"), rp)
    full = render_markdown(rep)
    cut = render_markdown(rep, limit=len(full) - 200)
    assert len(cut) < len(full) and re.search(r"more threads? left out to fit a comment", cut)
    assert "left out" not in full


@pytest.mark.parametrize(("target", "role", "block_type", "tool"), [
    ("openai-chat", "tool", "text", "call_A1b2C3d4"),
    ("openai-responses", "function_call_output", "function_call_output", "call_A1b2C3d4"),
    ("gemini", "user", "functionResponse", "callA1b2C3d4"),
])
def test_every_target_names_the_message_block_and_decision(base: Path, tmp_path: Path, target: str, role: str,
                                                           block_type: str, tool: str) -> None:
    codex = SAMPLES / "codex-sample.jsonl"
    g = tmp_path / "g"
    assert _cli("snapshot", codex, "--pipeline", base / "policy-2.toml", "--golden", g, "--target", target,
                "--fast-tokens", "-q").exit_code == 0
    code, doc = _diff_json(codex, "--pipeline", base / "policy-1.toml", "--golden", g)
    assert code == 1 and doc["run"]["target"] == target
    (t,) = doc["threads"]
    w = t["where"]
    assert (t["first_call"], w["kind"], w["role"], w["block_type"], w["tool_use_id"]) == \
        (3, "changed", role, block_type, tool)
    assert (t["decision"]["stage"], t["decision"]["tool_use_id"]) == ("tombstone", tool)
    assert "Exit code: 0" in t["diff"] and "[Old tool result content cleared]" in t["diff"]


# ------------------------------------------------------------------------------- inputs


def test_an_edited_input_is_an_input_change_not_a_pipeline_change(base: Path, tmp_path: Path) -> None:
    s = tmp_path / "s"
    shutil.copytree(SAMPLES, s)
    g = tmp_path / "g"
    assert _cli("snapshot", s, "--pipeline", base / "policy-2.toml", "--golden", g, "--fast-tokens", "-q").exit_code == 0
    f = s / "codex-sample.jsonl"
    f.write_text(f.read_text().replace("Also add a test for it.", "Also add two tests for it."))
    code, doc = _diff_json(s, "--pipeline", base / "policy-2.toml", "--golden", g)
    assert code == 1
    assert doc["inputs"] == {"changed": ["codex-sample.jsonl"], "added": [], "removed": [], "renamed": []}
    assert doc["pipeline_changes"] == []
    assert (doc["summary"]["changed_by_pipeline"], doc["summary"]["changed_by_input"]) == (0, 1)
    (t,) = doc["threads"]
    assert (t["thread_key"], t["cause"], t["first_call"], t["decision"]) == (CODEX, "input", 3, None)
    assert "+  ".strip() in t["diff"] and "Also add two tests for it." in t["diff"]
    r = _cli("diff", s, "--pipeline", base / "policy-2.toml", "--golden", g)
    assert "(0 by the pipeline, 1 by changed inputs)" in r.stdout.splitlines()[0]
    assert f"== {CODEX} (input change: a file of its session changed)" in r.stdout
    assert "  input files:    1 changed: codex-sample.jsonl" in r.stdout
    assert "  changed: codex-sample.jsonl" in r.stdout


def test_removed_and_added_inputs_give_vanished_and_new_threads(base: Path, tmp_path: Path) -> None:
    s = tmp_path / "s"
    shutil.copytree(SAMPLES, s)
    g = tmp_path / "g"
    assert _cli("snapshot", s, "--pipeline", base / "policy-2.toml", "--golden", g, "--fast-tokens", "-q").exit_code == 0
    (s / "pi-legacy-sample.jsonl").rename(tmp_path / "pi.jsonl")
    shutil.copy(SAMPLES / "anthropic-request.json", s / "second-request.json")
    code, doc = _diff_json(s, "--pipeline", base / "policy-2.toml", "--golden", g)
    assert code == 1
    assert doc["inputs"] == {"changed": [], "added": ["second-request.json"], "removed": ["pi-legacy-sample.jsonl"], "renamed": []}
    by = {t["thread_key"]: t for t in doc["threads"]}
    assert by[PI]["status"] == "vanished" and by[PI]["cause"] == "input"
    assert by["second-request"]["status"] == "new" and by["second-request"]["cause"] == "input"
    assert doc["summary"]["new"] == doc["summary"]["vanished"] == 1


def test_a_changed_system_prompt_is_an_envelope_difference(base: Path, tmp_path: Path) -> None:
    s = tmp_path / "s"
    s.mkdir()
    req = json.loads((SAMPLES / "anthropic-request.json").read_text())
    (s / "req.json").write_text(json.dumps(req))
    g = tmp_path / "g"
    assert _cli("snapshot", s, "--preset", "identity", "--golden", g, "--fast-tokens", "-q").exit_code == 0
    req["system"][0]["text"] += " Be brief."
    (s / "req.json").write_text(json.dumps(req))
    code, doc = _diff_json(s, "--preset", "identity", "--golden", g)
    (t,) = doc["threads"]
    assert code == 1 and t["first_call"] == 0 and t["where"]["kind"] == "envelope"
    assert t["where"]["keys"] == ["system"] and "Be brief." in t["diff"]


# ---------------------------------------------------------------------------- --update, exit 2


def test_update_rewrites_the_goldens_then_diff_is_identical(base: Path, tmp_path: Path) -> None:
    g = _golden_copy(base, tmp_path)
    r = _cli("diff", SAMPLES, "--pipeline", base / "policy-1.toml", "--golden", g, "--update")
    assert r.exit_code == 0
    assert "3 of 8 threads changed" in r.stdout  # what was accepted is still reported
    assert f"ctxreplay diff: goldens in {g} rewritten from this run" in r.stderr
    assert _cli("diff", SAMPLES, "--pipeline", base / "policy-1.toml", "--golden", g).exit_code == 0
    assert _cli("diff", SAMPLES, "--pipeline", base / "policy-2.toml", "--golden", g).exit_code == 1


def test_no_goldens_cannot_run_and_update_writes_them(base: Path, tmp_path: Path) -> None:
    g = tmp_path / "none"
    r = _cli("diff", SAMPLES / "codex-sample.jsonl", "--golden", g)
    assert r.exit_code == 2
    assert r.stderr == (f"ctxreplay: no goldens: {g} does not exist. Write them with `ctxreplay snapshot PATH ... "
                        f"--golden {g}` (or `ctxreplay diff PATH ... --golden {g} --update`)\n")
    r = _cli("diff", SAMPLES / "codex-sample.jsonl", "--golden", g, "--update")
    assert r.exit_code == 0 and "wrote them from this run" in r.stderr
    assert _cli("diff", SAMPLES / "codex-sample.jsonl", "--golden", g).exit_code == 0


def test_unreadable_input_cannot_run(base: Path, tmp_path: Path) -> None:
    r = _cli("diff", tmp_path / "missing", "--golden", base / "golden")
    assert r.exit_code == 2 and r.stderr.startswith(f"ctxreplay: {tmp_path / 'missing'}: no such file or directory")
    bad = tmp_path / "bad.toml"
    bad.write_text("[[stage]]\nuse = 'tombstone'\nkeep_recnt = 1\n")
    r = _cli("diff", SAMPLES, "--pipeline", bad, "--golden", base / "golden")
    assert r.exit_code == 2 and "Did you mean 'keep_recent'?" in r.stderr


def test_goldens_of_another_format_version_cannot_run(base: Path, tmp_path: Path) -> None:
    g = _golden_copy(base, tmp_path)
    m = json.loads((g / "manifest.json").read_text())
    m["format_version"], m["ctxreplay_version"] = 3, "9.0.0"
    (g / "manifest.json").write_text(json.dumps(m))
    r = _cli("diff", SAMPLES, "--pipeline", base / "policy-2.toml", "--golden", g)
    assert r.exit_code == 2
    assert r.stderr == (f"ctxreplay: {g} holds ctxreplay goldens of format 3 (written by ctxreplay 9.0.0); this "
                        f"ctxreplay (0.1.0) reads formats 1, 2. Re-snapshot: rewrite them with `ctxreplay diff PATH ... "
                        f"--golden {g} --update` (review the changes it reports first), or run the ctxreplay version "
                        f"that wrote them\n")
    # --update is the way out
    assert _cli("diff", SAMPLES, "--pipeline", base / "policy-2.toml", "--golden", g, "--update").exit_code == 0
    assert _cli("diff", SAMPLES, "--pipeline", base / "policy-2.toml", "--golden", g).exit_code == 0


def test_goldens_of_another_target_cannot_run(base: Path, tmp_path: Path) -> None:
    r = _cli("diff", SAMPLES, "--pipeline", base / "policy-2.toml", "--golden", base / "golden", "--target",
             "openai-chat")
    assert r.exit_code == 2
    assert r.stderr == (f"ctxreplay: the goldens in {base / 'golden'} were written for target anthropic, but --target "
                        f"openai-chat: requests in two wire shapes cannot be compared block by block. Pass --target "
                        f"anthropic to compare with them, or rewrite them for openai-chat with --update\n")
    spec = tmp_path / "oc.toml"
    spec.write_text(POLICY.format(keep_recent=2).replace('name = "policy"', 'name = "policy"\ntarget = "openai-chat"'))
    r = _cli("diff", SAMPLES, "--pipeline", spec, "--golden", base / "golden")
    assert r.exit_code == 2 and "but the spec (" in r.stderr and "target = openai-chat" in r.stderr
    # goldens written for openai-chat compare with no --target: the goldens' target is the default
    g = tmp_path / "g"
    assert _cli("diff", SAMPLES, "--pipeline", base / "policy-2.toml", "--golden", g, "--target", "openai-chat",
                "--update").exit_code == 0
    assert json.loads((g / "manifest.json").read_text())["target"] == "openai-chat"
    code, doc = _diff_json(SAMPLES, "--pipeline", base / "policy-2.toml", "--golden", g)
    assert code == 0 and doc["run"]["target"] == "openai-chat"


def test_goldens_of_another_ctxreplay_version_compare_with_a_note(base: Path, tmp_path: Path) -> None:
    g = _golden_copy(base, tmp_path)
    m = json.loads((g / "manifest.json").read_text())
    m["ctxreplay_version"] = "0.0.9"
    (g / "manifest.json").write_text(json.dumps(m))
    r = _cli("diff", SAMPLES, "--pipeline", base / "policy-2.toml", "--golden", g)
    assert r.exit_code == 0
    note = ("the goldens were written by ctxreplay 0.0.9 and this is 0.1.0: differences may come from the new "
            "version as well as from the pipeline")
    assert f"ctxreplay diff: note: {note}" in r.stderr
    assert f"  note:           {note}" in r.stdout
    assert "ctxreplay 0.0.9, target anthropic" in r.stdout


def test_a_hand_edited_golden_store_is_reported_not_a_crash(base: Path, tmp_path: Path) -> None:
    g = _golden_copy(base, tmp_path)
    (g / "messages.jsonl").write_text("")
    for p in (g / "threads").glob("*/pending.json"):
        p.write_text("{}")
    code, doc = _diff_json(SAMPLES, "--pipeline", base / "policy-1.toml", "--golden", g)
    assert code == 1
    assert all(t["where"]["kind"] == "unknown" and "damaged" in t["explanation"] for t in doc["threads"])


def test_out_keeps_this_runs_outputs(base: Path, tmp_path: Path) -> None:
    r = _cli("diff", SAMPLES, "--pipeline", base / "policy-2.toml", "--golden", base / "golden", "--out",
             tmp_path / "o", "-q")
    assert r.exit_code == 0 and r.stderr == ""
    assert (tmp_path / "o" / "calls.parquet").is_file() and (tmp_path / "o" / "call_messages.parquet").is_file()


# -------------------------------------------------------------------------------- cost


def test_cost_delta_prices_the_token_delta_at_the_input_rate(base: Path, tmp_path: Path) -> None:
    prices = tmp_path / "prices.toml"
    prices.write_text('[models."gpt-5-codex"]\ninput = 2.0\noutput = 8.0\n'
                      '[models."acme/"]\nmatch = "prefix"\ninput = 10.0\noutput = 30.0\n')
    code, doc = _diff_json(SAMPLES, "--pipeline", base / "policy-1.toml", "--golden", base / "golden", "--prices",
                           prices)
    assert code == 1
    by = {t["thread_key"]: t for t in doc["threads"]}
    assert by[CODEX]["cost_usd_delta"] == pytest.approx(-17 * 2.0 / 1e6)
    assert by[OPENCLAW]["cost_usd_delta"] == pytest.approx(by[OPENCLAW]["prompt_tokens"]["delta"] * 10.0 / 1e6)
    assert by[OPENCLAW]["unpriced_calls"] == 0
    assert doc["summary"]["cost_usd_delta"] == pytest.approx(sum(t["cost_usd_delta"] for t in by.values()))
    assert "overrides" in doc["summary"]["prices"]


def test_a_model_without_a_price_is_unknown_never_zero(base: Path) -> None:
    _code, doc = _diff_json(SAMPLES, "--pipeline", base / "policy-1.toml", "--golden", base / "golden")
    oc = next(t for t in doc["threads"] if t["thread_key"] == OPENCLAW)
    assert oc["cost_usd_delta"] is None and oc["unpriced_calls"] == 4
    assert "acme/coder-1" in doc["summary"]["unpriced_models"]


def test_simulated_cost_delta_when_both_runs_have_it(base: Path, tmp_path: Path) -> None:
    spec2, spec1 = load_spec(base / "policy-2.toml"), load_spec(base / "policy-1.toml")
    with replay([SAMPLES], spec2, target=None, token_counter=CHARS4_COUNTER) as rp:
        rp.calls = rp.calls.with_columns(sim_cost_usd=pl.col("prompt_tokens") * 1e-6)
        write_golden(rp, tmp_path / "g")
    golden = Golden(tmp_path / "g")
    assert '"sim_cost_usd"' in (tmp_path / "g" / "threads" / CODEX / "calls.jsonl").read_text().splitlines()[0]
    with replay([SAMPLES], spec1, target=None, token_counter=CHARS4_COUNTER) as rp:
        rp.calls = rp.calls.drop(SIM_COST, strict=False)  # a run without the cache simulation
        without = compare(golden, rp)
        rp.calls = rp.calls.with_columns(sim_cost_usd=pl.col("prompt_tokens") * 1e-6)
        rep = compare(golden, rp)
    assert without.sim_cost_usd_delta is None
    assert rep.sim_cost_usd_delta == pytest.approx((rep.tokens_new - rep.tokens_golden) * 1e-6)
    codex = next(t for t in rep.threads if t.thread_key == CODEX)
    assert codex.sim_cost_usd_delta == pytest.approx(-17e-6)


# ----------------------------------------------------------------------------- units


def test_block_diff_elides_long_runs_and_long_lines() -> None:
    before = [f"line {i}" for i in range(100)]
    out = block_diff(before, ["cleared"], "a", "b")
    assert out[:3] == ["--- a", "+++ b", "@@ -1,100 +1 @@"]
    assert "-[… 92 more lines …]" in out and "-line 0" in out and "-line 99" in out and "+cleared" in out
    # a run just short of the cut stays whole: the threshold's other side
    out = block_diff([f"line {i}" for i in range(9)], ["x"], "a", "b")
    assert not any("more lines" in x for x in out) and len([x for x in out if x.startswith("-l")]) == 9
    # one long line changed in its middle: both sides keep the place where they part
    a = "x" * 1000 + "OLD" + "y" * 1000
    b = "x" * 1000 + "NEW" + "y" * 1000
    out = block_diff([a], [b], "a", "b")
    minus = next(x for x in out if x.startswith("-") and not x.startswith("---"))
    plus = next(x for x in out if x.startswith("+") and not x.startswith("+++"))
    assert "OLD" in minus and "NEW" in plus and len(minus) < 300 and len(plus) < 300
    # a line of exactly the width is kept whole, one char more is elided
    w = 160
    assert block_diff(["a" * w], ["b"], "a", "b")[3] == "-" + "a" * w
    assert "chars]" in block_diff(["a" * (w + 1)], ["b"], "a", "b")[3]


def test_spec_changes_lists_settings_stages_and_params() -> None:
    a = parse_spec(POLICY.format(keep_recent=2), source="a").resolved()
    b = parse_spec(POLICY.format(keep_recent=1).replace('name = "policy"', 'name = "policy"\nwindow_tokens = 1000'),
                   source="b").resolved()
    assert spec_changes(a, b) == ["[pipeline] window_tokens: (unset) → 1000", "tombstone (#3) keep_recent: 2 → 1"]
    c = parse_spec('[[stage]]\nuse = "sanitize"\n', source="c").resolved()
    assert spec_changes(a, c) == ["[pipeline] name: policy → c", "stages: sanitize, pairing, tombstone → sanitize"]


# --------------------------------------------------------------------------- the CI job


def _yaml(text: str) -> Any:
    """The block YAML the recipe is written in: mappings, sequences of mappings, `|` literals, plain
    and quoted scalars, whole-line comments (PyYAML is not a dependency; no flow style, anchors or
    inline comments, which the recipe does not use)."""
    lines = text.splitlines()

    def skip(i: int) -> int:
        while i < len(lines) and (not lines[i].strip() or lines[i].lstrip().startswith("#")):
            i += 1
        return i

    def indent(line: str) -> int:
        return len(line) - len(line.lstrip(" "))

    def scalar(v: str) -> str:
        return v[1:-1] if len(v) >= 2 and v[0] == v[-1] and v[0] in "\"'" else v

    def block(i: int, ind: int) -> tuple[Any, int]:
        if not lines[i].lstrip().startswith("- "):
            return mapping(i, ind)
        items = []
        while (i := skip(i)) < len(lines) and indent(lines[i]) == ind and lines[i].lstrip().startswith("- "):
            lines[i] = " " * (ind + 2) + lines[i][ind + 2:]  # the item: a mapping whose first key follows "- "
            item, i = mapping(i, ind + 2)
            items.append(item)
        return items, i

    def mapping(i: int, ind: int) -> tuple[dict[str, Any], int]:
        out: dict[str, Any] = {}
        while (i := skip(i)) < len(lines) and indent(lines[i]) == ind and not lines[i].lstrip().startswith("- "):
            key, sep, rest = lines[i].strip().partition(":")
            assert sep and key not in out, f"line {i + 1}: {lines[i]!r}"
            rest = rest.strip()
            i += 1
            if rest == "|":  # literal: the lines below, their common indent removed, one newline at the end
                body: list[str] = []
                j = skip(i)
                at = indent(lines[j])
                while i < len(lines) and (not lines[i].strip() or indent(lines[i]) >= at):
                    body.append(lines[i][at:])
                    i += 1
                out[key] = "\n".join(body).rstrip("\n") + "\n"
            elif rest:
                out[key] = scalar(rest)
            elif (j := skip(i)) < len(lines) and indent(lines[j]) > ind:
                out[key], i = block(j, indent(lines[j]))
            else:
                out[key] = None
        return out, i

    doc, end = mapping(skip(0), 0)
    assert skip(end) == len(lines), f"line {end + 1} not read: {lines[end]!r}"
    return doc


def _the_recipe() -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """examples/github-actions.yml: its job, and its steps by name (or by `uses`)."""
    workflow = _yaml(RECIPE.read_text())
    assert workflow["on"] == "pull_request"
    (job,) = workflow["jobs"].values()
    return job, {s.get("name") or s["uses"]: s for s in job["steps"]}


def _run_step(step: dict[str, Any], cwd: Path, env: dict[str, str], values: dict[str, str],
              timeout: int = 300) -> subprocess.CompletedProcess:
    step_env = dict(env)
    for k, v in (step.get("env") or {}).items():
        step_env[k] = values.get(v, v)
    script = cwd / ".step.sh"
    script.write_text(step["run"])
    # GitHub runs `run:` scripts with `bash -e {0}` (`bash --noprofile --norc -eo pipefail {0}` with shell: bash)
    return subprocess.run(["bash", "--noprofile", "--norc", "-eo", "pipefail", str(script)], cwd=cwd, env=step_env,
                          capture_output=True, text=True, timeout=timeout, check=False)


def _tagged_copy_of_the_checkout(dest: Path, tag: str) -> Path:
    """A git repository holding the checkout's files as they are now (tracked and new ones, not what
    .gitignore leaves out), committed and tagged `tag`: what the recipe's URL names, here on disk."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, files):
        if (ROOT / name).is_file():  # (a file deleted but not yet committed is listed, and absent)
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    git = ["git", "-c", "user.name=ctxreplay tests", "-c", "user.email=tests@ctxreplay.invalid",
           "-c", "init.defaultBranch=main", "-c", "commit.gpgsign=false", "-c", "tag.gpgsign=false"]
    for cmd in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "the checkout"], ["tag", tag]):
        subprocess.run([*git, *cmd], cwd=dest, check=True, capture_output=True)
    return dest


@pytest.mark.slow
def test_the_readme_ci_job_runs_as_written(tmp_path: Path) -> None:
    """examples/github-actions.yml, the `run:` steps as GitHub runs them, the install included. Two
    things differ, for the runner: `actions/setup-python` is a fresh venv put first on PATH, and the
    git URL of CTXREPLAY_PACKAGE points at a tagged git copy of this checkout (its files as they are
    now, not a release on GitHub: the test checks this ctxreplay, offline from GitHub; pip fetches
    the dependencies from the package index). `gh` is a stub that records its arguments."""
    from ctxreplay.version import __version__

    job, steps = _the_recipe()
    assert {"actions/checkout@v4", "actions/setup-python@v5", "Install ctxreplay", "ctxreplay diff",
            "Upload the report", "Comment on the pull request", "Fail when the requests changed"} <= set(steps)
    assert list(steps).index("Install ctxreplay") < list(steps).index("ctxreplay diff")
    # the recipe installs this version, by the tag a release of it gets
    package = job["env"]["CTXREPLAY_PACKAGE"]
    url = "git+https://github.com/OWNER/ctxreplay"
    assert package == f"ctxreplay @ {url}@v{__version__}"
    clone = _tagged_copy_of_the_checkout(tmp_path / "ctxreplay-git", f"v{__version__}")
    # (file://localhost/...: pip's requirement parser takes no empty host in a git+file URL)
    values = {package: package.replace(url, f"git+file://localhost{clone.as_posix()}"),
              "${{ github.token }}": "token", "${{ github.event.pull_request.number }}": "7",
              "${{ github.repository }}": "acme/agents"}

    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copytree(SAMPLES, repo / "sessions")
    write_policy(repo, 2).rename(repo / "policy.toml")
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "gh").write_text('#!/bin/sh\necho "$@" >> "$GH_LOG"\n'
                             'while [ $# -gt 0 ]; do [ "$1" = --body-file ] && cat "$2" > "$GH_LOG.body"; shift; done\n')
    (fake / "gh").chmod(0o755)
    venv = tmp_path / "python"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update({"PATH": f"{fake}:{venv / 'bin'}:{os.environ['PATH']}", "GITHUB_OUTPUT": str(tmp_path / "gh-output"),
                "GH_LOG": str(tmp_path / "gh.log"), "CTXREPLAY_CACHE_DIR": str(tmp_path / "cache"),
                "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    for k, v in job["env"].items():
        env[k] = values.get(v, v)

    r = _run_step(steps["Install ctxreplay"], repo, env, values, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert shutil.which("ctxreplay", path=env["PATH"]) == str(venv / "bin" / "ctxreplay")
    # installed from the git URL into the venv (not the checkout's editable install)
    where = ("import ctxreplay, importlib.metadata as m; print(ctxreplay.__file__); "
             "print(m.distribution('ctxreplay').read_text('direct_url.json'))")
    installed = subprocess.run([str(venv / "bin" / "python"), "-c", where], cwd=repo, env=env, capture_output=True,
                               text=True, check=True).stdout
    assert installed.startswith(str(venv)) and '"vcs": "git"' in installed, installed
    assert f'"requested_revision": "v{__version__}"' in installed, installed
    # the goldens, as the recipe's comment says to write them
    setup = re.search(r"#\s+(ctxreplay snapshot sessions/ [^\n]+)", RECIPE.read_text())
    assert setup is not None
    subprocess.run(setup.group(1), shell=True, cwd=repo, env=env, check=True, capture_output=True)

    def diff_step() -> str:
        (tmp_path / "gh-output").write_text("")
        r = _run_step(steps["ctxreplay diff"], repo, env, values)
        assert r.returncode == 0, r.stderr  # the step itself never fails: the status goes to the output
        out = dict(x.split("=", 1) for x in (tmp_path / "gh-output").read_text().splitlines())
        values["${{ steps.diff.outputs.status }}"] = out["status"]
        return out["status"]

    def runs(name: str, status: str) -> bool:
        cond = steps[name]["if"]
        assert cond is not None and "steps.diff.outputs.status != '0'" in cond
        return status != "0"

    assert steps["Upload the report"]["if"] == "always()"
    assert diff_step() == "0"
    assert "identical" in (repo / "ctxreplay-report.md").read_text()
    assert not runs("Comment on the pull request", "0") and not runs("Fail when the requests changed", "0")

    (repo / "policy.toml").write_text(POLICY.format(keep_recent=1))
    status = diff_step()
    report = (repo / "ctxreplay-report.md").read_text()
    assert status == "1" and report.startswith("### ctxreplay diff: 3 of 8 threads changed")
    assert runs("Comment on the pull request", status)
    r = _run_step(steps["Comment on the pull request"], repo, env, values)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "gh.log").read_text() == "pr comment 7 --body-file ctxreplay-report.md\n"
    assert (tmp_path / "gh.log.body").read_text() == report
    assert _run_step(steps["Fail when the requests changed"], repo, env, values).returncode == 1

    shutil.rmtree(repo / "ctxreplay-golden")
    status = diff_step()
    report = (repo / "ctxreplay-report.md").read_text()
    assert status == "2" and "could not run" in report and "no goldens" in report


# ------------------------------------------------------------------------ the real corpus


@pytest.fixture(scope="module")
def corpus_subset(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Copies (never into the repo) of three corpus sessions whose tool results the tombstone layer clears."""
    d = tmp_path_factory.mktemp("corpus-subset")
    for rel in (("claude-code/daaain__claude-code-log__-Users-dain-workspace-danieldemmel-me-next__"
                "9e953218-585f-4692-89df-9e0747a31c68.jsonl"),
                "openclaw/okbest2024__openclaw-backup__00957d43-44a5-4c46-a7ef-29e8bafe0642.jsonl",
                "claude-code/lanegrid__agtrace__claude_session.jsonl"):
        shutil.copy(corpus / rel, d / Path(rel).name)
    return d


def _kr_spec(d: Path, keep_recent: int) -> Path:
    text = (ROOT / "data" / "pipelines" / "default.toml").read_text()
    p = d / f"kr{keep_recent}.toml"
    p.write_text(text.replace('use = "tombstone"', f'use = "tombstone"\nkeep_recent = {keep_recent}'))
    return p


@pytest.mark.slow
@pytest.mark.corpus
def test_corpus_subset_keep_recent_then_input_edit_then_update(corpus_subset: Path, tmp_path: Path) -> None:
    s = tmp_path / "s"
    shutil.copytree(corpus_subset, s)
    g = tmp_path / "g"
    kr5, kr2 = _kr_spec(tmp_path, 5), _kr_spec(tmp_path, 2)
    assert _cli("snapshot", s, "--pipeline", kr5, "--golden", g, "--fast-tokens", "-q").exit_code == 0
    assert _cli("diff", s, "--pipeline", kr5, "--golden", g).exit_code == 0
    code, doc = _diff_json(s, "--pipeline", kr2, "--golden", g)
    assert code == 1 and doc["pipeline_changes"] == ["tombstone (#8) keep_recent: 5 → 2"]
    changed = [t for t in doc["threads"] if t["status"] == "changed"]
    assert {t["session_id"] for t in changed} == {"9e953218-585f-4692-89df-9e0747a31c68",
                                                  "00957d43-44a5-4c46-a7ef-29e8bafe0642"}
    for t in changed:
        assert t["cause"] == "pipeline" and t["first_call"] is not None
        assert t["where"]["block_type"] == "tool_result" and t["where"]["tool_use_id"]
        assert t["decision"]["stage"] == "tombstone" and t["decision"]["from_call"] == t["first_call"]
        assert t["decision"]["tool_use_id"] == t["where"]["tool_use_id"]
    # an edited line of a copy of a corpus file: an input change, not a pipeline one
    f = s / "lanegrid__agtrace__claude_session.jsonl"
    lines = f.read_text().splitlines(keepends=True)
    n = next(i for i, x in enumerate(lines) if '"type":"user"' in x and '"content":"' in x)
    lines[n] = lines[n].replace('"content":"', '"content":"(edited) ', 1)
    f.write_text("".join(lines))
    code, doc = _diff_json(s, "--pipeline", kr5, "--golden", g)
    assert code == 1 and doc["inputs"]["changed"] == ["lanegrid__agtrace__claude_session.jsonl"]
    (t,) = doc["threads"]
    assert t["cause"] == "input" and doc["summary"]["changed_by_pipeline"] == 0 and t["decision"] is None
    assert "(edited) " in t["diff"]
    assert _cli("diff", s, "--pipeline", kr5, "--golden", g, "--update").exit_code == 0
    assert _cli("diff", s, "--pipeline", kr5, "--golden", g).exit_code == 0


@pytest.mark.corpus
@pytest.mark.slow
def test_corpus_keep_recent_change_names_call_block_and_decision_of_each_thread(corpus: Path, tmp_path: Path) -> None:
    g = tmp_path / "g"
    kr5, kr2 = _kr_spec(tmp_path, 5), _kr_spec(tmp_path, 2)
    assert _cli("snapshot", corpus, "--pipeline", kr5, "--golden", g, "-q").exit_code == 0
    assert _cli("diff", corpus, "--pipeline", kr5, "--golden", g, "-q").exit_code == 0
    r = _cli("diff", corpus, "--pipeline", kr2, "--golden", g, "--json", "--out", tmp_path / "o")
    assert r.exit_code == 1
    doc = orjson.loads(r.stdout)
    assert doc["pipeline_changes"] == ["tombstone (#8) keep_recent: 5 → 2"]
    assert doc["inputs"] == {"changed": [], "added": [], "removed": [], "renamed": []}
    assert doc["threads"] and all(t["status"] == "changed" and t["cause"] == "pipeline" for t in doc["threads"])
    # every thread whose requests differ has a tombstone decision of one run and not the other
    ledger = pl.read_parquet(tmp_path / "o" / "decisions.parquet").filter(pl.col("stage") == "tombstone")
    with_tomb = set(ledger.get_column("session_id").unique().to_list())
    for t in doc["threads"]:
        assert t["first_call"] is not None and t["where"]["message"] is not None and t["where"]["block"] is not None
        assert t["decision"]["stage"] == "tombstone", t["thread_key"]
        assert t["session_id"] in with_tomb
        assert t["diff"].startswith(f"--- golden call {t['first_call']}, message")
    r = _cli("diff", corpus, "--pipeline", kr2, "--golden", g, "--format", "markdown", "-q")
    assert r.exit_code == 1 and r.stdout.count("<details><summary>") == len(doc["threads"])
    assert len(r.stdout) < 65_536
    assert _cli("diff", corpus, "--pipeline", kr2, "--golden", g, "--update", "-q").exit_code == 0
    assert _cli("diff", corpus, "--pipeline", kr2, "--golden", g, "-q").exit_code == 0
