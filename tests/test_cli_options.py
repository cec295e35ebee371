"""Options several commands take are written once, in pipeline/commands/clicommon.py (issue 21,
item 5): `--pipeline FILE`, `--preset`, `--target`, `--json`; each command's --help shows the same
words for the same flag."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.inspectkit import cli

COMMANDS = Path(__file__).resolve().parents[1] / "pipeline" / "commands"
SHARED = {'"--json"', '"--target"', '"--preset"', '"--pipeline", "pipeline_file"'}


def test_shared_options_are_declared_once_in_clicommon() -> None:
    for f in sorted(COMMANDS.glob("*.py")):
        text = f.read_text(encoding="utf-8")
        found = {o for o in SHARED if o in text}
        if f.name == "clicommon.py":
            assert found == SHARED
        else:
            assert found == set(), f"{f.name} declares {found} itself; use clicommon's decorators"


def _help_of(cmd: str, flag: str) -> str:
    """The help text of `flag` in `ctxreplay CMD --help`, its wrapped lines joined."""
    lines = cli(cmd, "--help").stdout.splitlines()
    start = next(i for i, ln in enumerate(lines) if re.match(rf"\s+{re.escape(flag)}\b", ln))
    out = [lines[start]]
    for ln in lines[start + 1:]:
        if not ln.startswith(" " * 10) or ln.strip().startswith("-"):
            break
        out.append(ln)
    return " ".join(x.strip() for x in out)


@pytest.mark.parametrize("cmd", ["threads", "ledger", "stages", "explain", "report", "compare"])
def test_the_plain_json_flag_reads_the_same_everywhere(cmd: str) -> None:
    assert _help_of(cmd, "--json").endswith("Print one JSON document on stdout.")


def test_pipeline_preset_and_target_read_the_same_in_run_snapshot_and_diff() -> None:
    for cmd in ("run", "snapshot", "diff"):
        assert _help_of(cmd, "--pipeline").endswith("Pipeline spec (TOML).")
        assert _help_of(cmd, "--preset").endswith("A preset from data/pipelines (default: default).")
        target = _help_of(cmd, "--target")
        assert "Wire shape of the requests (default: the spec's [pipeline] target, else" in target
