"""Every command and every stage has help and an entry in the README."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from ctxreplay.pipeline.commands.cli import main
from ctxreplay.pipeline.stageapi.registry import load_stages, params_doc
from ctxreplay.pipeline.staging.spec import preset_names

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()


def test_every_command_is_in_the_readme_with_help() -> None:
    for name, cmd in main.commands.items():
        assert f"ctxreplay {name}" in README, name
        assert cmd.help and "Example:" in cmd.help, name
        assert CliRunner().invoke(main, [name, "--help"]).exit_code == 0


def test_every_stage_is_documented() -> None:
    for name, st in load_stages().items():
        assert f"| `{name}` |" in README, name
        assert st.doc, f"stage {name} has no docstring"
        for p in params_doc(st.params):
            assert p["doc"], f"{name}.{p['name']} has no docstring line"


def test_every_preset_is_in_the_readme() -> None:
    for name in preset_names():
        assert f"`{name}`" in README, name


def test_readme_starts_with_the_two_commands() -> None:
    lines = README.splitlines()
    block = lines[lines.index("```bash") + 1: lines.index("```bash") + 3]
    assert "ctxreplay run data/samples" in block[0]
    assert "pytest" in block[1]
