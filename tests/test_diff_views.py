"""`ctxreplay diff` shows every difference and survives renames (issue 24, snapshot / diff):
`--stat` (a line per thread), `--all` (every differing call with its decision), a last line naming
the `why` command; `--thread PREFIX` and `--update --thread PREFIX`; an input file renamed is
matched with its threads by content and said "renamed" (exit 0 when nothing else changed)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from ctxreplay.pipeline.commands.cli import main
from ctxreplay.pipeline.regress.snapshot import Golden
from tests.goldenkit import rebuild_every_call, write_policy
from tests.inspectkit import SYN_SID, write_session

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "data" / "samples"
CODEX = "019a7c21-4d2e-7f10-b3a8-5e6f7a8b9c0d"
PI = "3b8e2f41-6c0d-4d7a-a1e5-8f2b9c4d6e10"
OPENCLAW = "7d3f9a2e-1b4c-4e8a-9f60-2c5d8e1a4b37"
CC = "5f0c1d2e-3a4b-4c5d-8e9f-0a1b2c3d4e5f"


@pytest.fixture(autouse=True)
def _price_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CTXREPLAY_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "price-cache"))


def _cli(*args: object) -> object:
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Goldens of the samples under keep_recent = 2, and the policies with 1 and 2."""
    d = tmp_path_factory.mktemp("views")
    for k in (1, 2):
        write_policy(d, k)
    r = _cli("snapshot", SAMPLES, "--pipeline", d / "policy-2.toml", "--golden", d / "golden", "--fast-tokens", "-q")
    assert r.exit_code == 0, r.stderr
    return d


def _copy(base: Path, tmp_path: Path) -> Path:
    g = tmp_path / "golden"
    shutil.copytree(base / "golden", g)
    return g


# ------------------------------------------------------------------------------ --stat, --all, the hint


def test_stat_is_one_line_per_thread(base: Path) -> None:
    r = _cli("diff", SAMPLES, "--pipeline", base / "policy-1.toml", "--golden", base / "golden", "--stat", "-q")
    assert r.exit_code == 1
    lines = r.stdout.splitlines()
    at = lines.index(next(x for x in lines if x.startswith("  thread ")))
    assert lines[at].split() == ["thread", "cause", "first", "call", "calls", "tokens", "Δ", "cost", "Δ", "USD",
                                 "explained", "by"]
    rows = [x.split()[:5] for x in lines[at + 1:at + 4]]
    assert rows == [[CODEX, "pipeline", "3", "1/4", "−17"], [PI, "pipeline", "3", "1/6", "+8"],
                    [OPENCLAW, "pipeline", "3", "4/8", "−3,188"]]
    assert not [x for x in lines if x.startswith("== ")]  # no section per thread
    assert lines[-1].startswith("more: without --stat: where each thread differs; --all: every differing call")
    md = _cli("diff", SAMPLES, "--pipeline", base / "policy-1.toml", "--golden", base / "golden", "--stat",
              "--format", "markdown", "-q").stdout
    assert "<details><summary><code>" not in md and f"| `{OPENCLAW}` | pipeline | 3 | 4/8 |" in md


def test_all_lists_every_differing_call_with_its_decision(base: Path, tmp_path: Path) -> None:
    r = _cli("diff", SAMPLES, "--pipeline", base / "policy-1.toml", "--golden", base / "golden", "--all", "-q")
    assert r.exit_code == 1
    sec = r.stdout.split(f"== {OPENCLAW} (pipeline change)\n")[1].split("\n== ")[0]
    calls = [x for x in sec.splitlines() if x.startswith("  - call ")]
    assert [x.split()[2] for x in calls] == ["3", "4", "6", "7"]
    assert "  - call 4 (1,797 → 199 tokens)\n      the same difference as call 3 (tombstone tombstone/token from " \
           "call 3)\n" in sec
    assert "  - call 6 (285 → 289 tokens)\n      where: message 2 (user) differs, block 0 (tool_result " \
           "call_exec_02); 1 of 9 messages differ at this call\n      decision: tombstone: tombstone (token) from " \
           "call 6, cache_epoch 7, tool call call_exec_02; made by this run only\n" in sec
    assert "      +content[0].text: [Old tool result content cleared]" in sec
    doc = json.loads(_cli("diff", SAMPLES, "--pipeline", base / "policy-1.toml", "--golden", base / "golden",
                          "--all", "--json").stdout)
    t = next(x for x in doc["threads"] if x["thread_key"] == OPENCLAW)
    assert t["differing_calls"] == [3, 4, 6, 7]
    assert [(c["call"], c["decision"]["from_call"], c["same_as"]) for c in t["call_diffs"]] == \
        [(3, 3, None), (4, 3, 3), (6, 6, None), (7, 6, 6)]
    # without --all: the first call, the others listed, and the last line names `why` for them
    r = _cli("diff", SAMPLES, "--pipeline", base / "policy-1.toml", "--golden", base / "golden", "-q",
             "--out", tmp_path / "o")
    assert f"  other differing calls: 4, 6, 7 (`ctxreplay why {tmp_path / 'o'} {OPENCLAW} --call 4` shows one)\n" \
        in r.stdout
    last = r.stdout.splitlines()[-1]
    assert last == (f"more: --all lists every differing call with its decision, --stat one line per thread; "
                    f"`ctxreplay why {tmp_path / 'o'} {OPENCLAW} --call 4` shows one call block by block, with the "
                    f"decision behind every change")
    why = _cli("why", tmp_path / "o", OPENCLAW, "--call", 4, "--stage", "tombstone")
    assert why.exit_code == 0 and "tombstone: tombstone (token) · from call 3" in why.stdout
    plain = _cli("diff", SAMPLES, "--pipeline", base / "policy-1.toml", "--golden", base / "golden", "-q")
    assert plain.stdout.splitlines()[-1].endswith("(OUT: keep this run's outputs with --out OUT)")
    md = _cli("diff", SAMPLES, "--pipeline", base / "policy-1.toml", "--golden", base / "golden", "--all",
              "--format", "markdown", "-q").stdout
    section = md.split(f"<details><summary><code>{OPENCLAW}</code>")[1].split("</details>")[0]
    assert "  calls that differ (4):\n  - call 3 (" in section and "\n  - call 7 (" in section
    assert "      the same difference as call 6 (tombstone tombstone/token from call 6)" in section


# ------------------------------------------------------------------------------ --thread


def test_thread_prefix_limits_the_comparison(base: Path) -> None:
    args = ("diff", SAMPLES, "--pipeline", base / "policy-1.toml", "--golden", base / "golden", "-q")
    r = _cli(*args, "--thread", "019a")
    assert r.exit_code == 1
    assert r.stdout.splitlines()[0] == (f"ctxreplay diff: 1 of 1 thread changed (1 by the pipeline, 0 by changed "
                                        f"inputs), 0 new, 0 vanished; goldens {base / 'golden'} (--thread 019a: 1 of "
                                        f"8 threads)")
    doc = json.loads(_cli(*args, "--thread", "019a", "--thread", "7d3f9a2e/main", "--json").stdout)
    assert [t["thread_key"] for t in doc["threads"]] == [CODEX, OPENCLAW]
    assert doc["selection"] == {"prefixes": ["019a", "7d3f9a2e/main"], "threads": 2, "of": 8}
    assert doc["summary"]["calls"] == 4 + 8
    # threads that did not change: identical, exit 0
    same = _cli(*args, "--thread", "7d3f9a2e/branch", "--thread", CC[:4])
    assert same.exit_code == 0 and same.stdout.startswith("ctxreplay diff: identical: 3 threads, ")
    bad = _cli(*args, "--thread", "zz")
    assert bad.exit_code == 2 and bad.stderr.startswith("ctxreplay: --thread zz: no thread of the goldens in ")


def test_update_thread_rewrites_only_those_threads(base: Path, tmp_path: Path) -> None:
    g = _copy(base, tmp_path)
    before = {p.relative_to(g): p.read_bytes() for p in g.rglob("*") if p.is_file()}
    r = _cli("diff", SAMPLES, "--pipeline", base / "policy-1.toml", "--golden", g, "--update", "--thread", "019a")
    assert r.exit_code == 0
    assert f"ctxreplay diff: goldens in {g} rewritten from this run for 1 thread of --thread 019a; 7 other threads " \
           "kept as they were" in r.stderr
    after = {p.relative_to(g): p.read_bytes() for p in g.rglob("*") if p.is_file()}
    for name in before.keys() & after.keys():  # the other threads' files are as they were
        if name.parts[0] == "threads" and name.parts[1] != CODEX:
            assert before[name] == after[name], name
    assert rebuild_every_call(Golden(g)) == 36
    doc = json.loads(_cli("diff", SAMPLES, "--pipeline", base / "policy-1.toml", "--golden", g, "--json").stdout)
    assert sorted(t["thread_key"] for t in doc["threads"]) == [PI, OPENCLAW]
    doc = json.loads(_cli("diff", SAMPLES, "--pipeline", base / "policy-2.toml", "--golden", g, "--json").stdout)
    assert [t["thread_key"] for t in doc["threads"]] == [CODEX] and doc["inputs"]["changed"] == []
    # the rest, thread by thread, gives the goldens of the whole run
    for ref in (PI[:4], OPENCLAW[:4]):
        assert _cli("diff", SAMPLES, "--pipeline", base / "policy-1.toml", "--golden", g, "--update", "--thread",
                    ref, "-q").exit_code == 0
    assert _cli("diff", SAMPLES, "--pipeline", base / "policy-1.toml", "--golden", g).exit_code == 0
    whole = tmp_path / "whole"
    assert _cli("snapshot", SAMPLES, "--pipeline", base / "policy-1.toml", "--golden", whole, "--fast-tokens",
                "-q").exit_code == 0
    for p in whole.rglob("*"):
        if p.is_file() and p.name != "manifest.json":
            assert (g / p.relative_to(whole)).read_bytes() == p.read_bytes(), p
    # --update --thread needs goldens to keep
    r = _cli("diff", SAMPLES, "--pipeline", base / "policy-1.toml", "--golden", tmp_path / "none", "--update",
             "--thread", "019a")
    assert r.exit_code == 2 and "no goldens" in r.stderr


# ------------------------------------------------------------------------------ renamed inputs


def test_a_renamed_input_is_said_renamed_and_exit_0(base: Path, tmp_path: Path) -> None:
    s = tmp_path / "s"
    shutil.copytree(SAMPLES, s)
    g = tmp_path / "g"
    assert _cli("snapshot", s, "--pipeline", base / "policy-2.toml", "--golden", g, "--fast-tokens", "-q").exit_code == 0
    # a Claude Code file whose name is not its session id gets its file name as thread id
    demo = s / "claude-projects" / "-home-dev-demo"
    (demo / f"{CC}.jsonl").rename(demo / "demo-session.jsonl")
    (s / "codex-sample.jsonl").rename(s / "codex-renamed.jsonl")
    r = _cli("diff", s, "--pipeline", base / "policy-2.toml", "--golden", g, "-q")
    assert r.exit_code == 0, r.stdout
    lines = r.stdout.splitlines()
    assert lines[0] == (f"ctxreplay diff: identical: 8 threads, 36 calls match the goldens in {g}; 2 input files "
                        f"renamed (their threads matched by content: 1 thread)")
    assert lines[3] == (f"  renamed:        claude-projects/-home-dev-demo/{CC}.jsonl → claude-projects/-home-dev-demo/"
                        f"demo-session.jsonl (the same bytes); thread {CC} → {CC}--demo-session")
    assert lines[4] == "  renamed:        codex-sample.jsonl → codex-renamed.jsonl (the same bytes)"
    doc = json.loads(_cli("diff", s, "--pipeline", base / "policy-2.toml", "--golden", g, "--json").stdout)
    assert doc["identical"] is True and doc["exit_code"] == 0
    assert doc["renamed"] == [{"from": CC, "to": f"{CC}--demo-session"}]
    assert doc["inputs"]["renamed"] == [
        {"from": f"claude-projects/-home-dev-demo/{CC}.jsonl", "to": "claude-projects/-home-dev-demo/demo-session.jsonl"},
        {"from": "codex-sample.jsonl", "to": "codex-renamed.jsonl"}]
    assert doc["summary"]["new"] == doc["summary"]["vanished"] == 0
    # a pipeline change on top: the renamed threads compare as the same threads
    doc = json.loads(_cli("diff", s, "--pipeline", base / "policy-1.toml", "--golden", g, "--json").stdout)
    assert sorted(t["thread_key"] for t in doc["threads"]) == [CODEX, PI, OPENCLAW]
    assert doc["summary"]["calls_changed"] == 6
    # an edited file is not a rename
    (s / "codex-renamed.jsonl").write_bytes((s / "codex-renamed.jsonl").read_bytes() + b"\n")
    doc = json.loads(_cli("diff", s, "--pipeline", base / "policy-2.toml", "--golden", g, "--json").stdout)
    assert doc["inputs"]["added"] == ["codex-renamed.jsonl"] and doc["inputs"]["removed"] == ["codex-sample.jsonl"]


def test_a_renamed_thread_that_also_changed_is_one_changed_thread(base: Path, tmp_path: Path) -> None:
    """The synthetic session under a file name that is not its id (its thread is named after the
    file), renamed, under another policy: one changed thread, renamed, not one vanished and one new."""
    s = tmp_path / "s"
    path = write_session(s)
    named = path.with_name("my-notes.jsonl")
    path.rename(named)
    g = tmp_path / "g"
    assert _cli("snapshot", s, "--pipeline", base / "policy-2.toml", "--golden", g, "--fast-tokens", "-q").exit_code == 0
    key = next(iter(Golden(g).threads))
    assert key == f"{SYN_SID}--my-notes"
    named.rename(named.with_name("renamed-notes.jsonl"))
    doc = json.loads(_cli("diff", s, "--pipeline", base / "policy-1.toml", "--golden", g, "--json").stdout)
    assert doc["exit_code"] == 1
    (t,) = doc["threads"]
    assert (t["thread_key"], t["status"], t["renamed_from"]) == (f"{SYN_SID}--renamed-notes", "changed", key)
    assert t["decision"]["stage"] == "tombstone"
    assert doc["renamed"] == [{"from": key, "to": f"{SYN_SID}--renamed-notes"}]
    text = _cli("diff", s, "--pipeline", base / "policy-1.toml", "--golden", g, "-q").stdout
    assert f"== {SYN_SID}--renamed-notes (pipeline change; renamed from {key})" in text
