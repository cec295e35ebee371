"""Without PATHS, every command reads the same transcript directories (issue 21, item 5):
`ctxreplay.pipeline.loaders.default_roots`, which `run` and `report` (and snapshot, diff,
compare) share; it honours CLAUDE_CONFIG_DIR and CODEX_HOME and imports nothing heavy."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest

from tests.cckit import CCSession
from tests.inspectkit import SAMPLES, cli

OTHER_SID = "0d9e8f7a-6b5c-4d3e-8f2a-1b0c9d8e7f6a"


def _tree(base: Path) -> dict[str, Path]:
    """A home directory with a transcript in each default place, and a CLAUDE_CONFIG_DIR beside it."""
    home = base / "home"
    shutil.copytree(SAMPLES / "claude-projects", home / ".claude" / "projects")  # a session and its subagent
    s = CCSession(OTHER_SID, datetime(2026, 2, 1, 9, 0, tzinfo=UTC))
    s.user("hello")
    s.answer(1, "hi")
    s.user("bye")
    s.write(home / ".config" / "claude" / "projects" / "-srv-app" / f"{OTHER_SID}.jsonl")
    oc = home / ".openclaw" / "agents" / "main" / "sessions"
    oc.mkdir(parents=True)
    shutil.copy(SAMPLES / "openclaw-sample.jsonl", oc / "7d3f9a2e-1b4c-4e8a-9f60-2c5d8e1a4b37.jsonl")
    cx = home / ".codex" / "sessions" / "2026" / "01" / "01"
    cx.mkdir(parents=True)
    shutil.copy(SAMPLES / "codex-sample.jsonl", cx / "rollout-2026-01-01T10-00-00-019a7c21.jsonl")
    cfg = base / "cfg"
    shutil.copytree(SAMPLES / "claude-projects", cfg / "projects")
    codex_home = base / "codex-home"
    shutil.copytree(home / ".codex" / "sessions", codex_home / "sessions")
    return {"home": home, "cfg": cfg, "codex_home": codex_home}


def _files_seen(tmp: Path) -> tuple[int, int]:
    """(files `run` read, files `report` read), both without PATHS."""
    r = cli("run", "--out", tmp / "out", "--json", "--fast-tokens", "-q")
    assert r.exit_code == 0, r.stderr
    rep = cli("report", "--json")
    assert rep.exit_code == 0, rep.stderr
    shutil.rmtree(tmp / "out")
    return json.loads(r.stdout)["files"], json.loads(rep.stdout)["files"]


def test_run_and_report_without_paths_read_the_same_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    t = _tree(tmp_path)
    monkeypatch.setenv("HOME", str(t["home"]))
    monkeypatch.delenv("CLAUDE_CONFIG_DIR", raising=False)
    monkeypatch.delenv("CODEX_HOME", raising=False)
    from ctxreplay.pipeline.loaders import default_roots

    home = t["home"]
    assert default_roots() == [home / ".claude" / "projects", home / ".config" / "claude" / "projects",
                               home / ".openclaw" / "agents", home / ".codex" / "sessions"]
    # Claude Code's session and subagent, the ~/.config one, OpenClaw's and Codex's
    assert _files_seen(tmp_path) == (5, 5)

    # CLAUDE_CONFIG_DIR replaces both Claude Code directories; CODEX_HOME the Codex one
    monkeypatch.setenv("CLAUDE_CONFIG_DIR", f"{t['cfg']}, {tmp_path / 'missing'}")
    monkeypatch.setenv("CODEX_HOME", str(t["codex_home"]))
    assert default_roots() == [t["cfg"] / "projects", home / ".openclaw" / "agents", t["codex_home"] / "sessions"]
    assert _files_seen(tmp_path) == (4, 4)


def test_no_paths_and_no_default_directory_is_one_paragraph(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("CLAUDE_CONFIG_DIR", raising=False)
    monkeypatch.delenv("CODEX_HOME", raising=False)
    from ctxreplay.pipeline.loaders import ROOTS_TEXT

    for cmd, example in [("run", "ctxreplay run data/samples"), ("report", "ctxreplay report data/samples")]:
        r = cli(cmd)
        assert r.exit_code == 2
        assert r.stderr == (f"ctxreplay: no PATHS given and none of {ROOTS_TEXT} exists; pass transcript files or "
                            f"directories, e.g. `{example}`\n")
    # --help says where they are, in the same words
    for cmd in ("run", "report"):
        assert ROOTS_TEXT in " ".join(cli(cmd, "--help").stdout.split())


def test_the_roots_import_nothing_heavy() -> None:
    code = ("import sys\nfrom ctxreplay.pipeline.loaders import default_roots\ndefault_roots()\n"
            "print([m for m in ('polars', 'pyarrow', 'duckdb') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
