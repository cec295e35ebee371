"""The README and docs/: every command, stage and preset documented where its reference lives, the
README a front page that starts with the two commands, every link resolving, every Python block
accounted for, and the blocks that are not run counted (tests/test_docs_run.py runs the others)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from ctxreplay.pipeline.commands.cli import main
from ctxreplay.pipeline.stageapi.registry import load_stages, params_doc
from ctxreplay.pipeline.staging.spec import preset_names
from tests.doccheck import ELLIPSIS, blocks, doc_files

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
DOCS = ROOT / "docs"

# the page that holds each command's reference (a new command needs one)
COMMAND_PAGES = {
    "run": "running.md", "threads": "inspection.md", "why": "inspection.md", "request": "inspection.md",
    "ledger": "inspection.md", "stages": "pipelines.md", "init": "pipelines.md", "explain": "pipelines.md",
    "report": "report.md", "compare": "compare.md", "snapshot": "regression.md", "diff": "regression.md",
}

# blocks not run by the default suite, per page: `skip` (never run) and `corpus` (run by the slow
# pass, with the corpus). Adding one is a change to this table, and should stay rare.
NOT_RUN = {
    "README.md": {"skip": 2},              # the venv + install lines (.ci/run), the install block
    "docs/running.md": {"skip": 2, "corpus": 1},   # Ray (needs the extra), a second run's lock; hostile + corpus
    "docs/report.md": {"corpus": 1},
    "docs/cache-simulation.md": {"corpus": 1},
    "docs/compare.md": {"corpus": 2},
    "docs/writing-a-stage.md": {"skip": 2},        # pip install of the example; a plug-in timing out
    "docs/benchmarks.md": {"skip": 26},            # every bench: minutes each, figures of one machine
}


def _page(name: str) -> str:
    return (ROOT / name).read_text()


def _rel(p: Path) -> str:
    return str(p.relative_to(ROOT))


def test_every_command_has_help_and_a_reference_page() -> None:
    assert set(COMMAND_PAGES) == set(main.commands), "a command without a page in COMMAND_PAGES (or a page of a gone one)"
    for name, cmd in main.commands.items():
        assert f"ctxreplay {name}" in _page(f"docs/{COMMAND_PAGES[name]}"), name
        assert cmd.help and "Example:" in cmd.help, name
        assert CliRunner().invoke(main, [name, "--help"]).exit_code == 0


def test_every_stage_is_documented() -> None:
    layers = _page("docs/layers.md")
    for name, st in load_stages().items():
        if not st.is_builtin:
            continue
        assert f"| `{name}` |" in layers, name
        assert f"## {name}\n" in layers, name
        assert st.doc, f"stage {name} has no docstring"
        for p in params_doc(st.params):
            assert p["doc"], f"{name}.{p['name']} has no docstring line"


def test_every_preset_is_documented() -> None:
    pipelines = _page("docs/pipelines.md")
    for name in preset_names():
        assert f"`{name}`" in pipelines, name


def test_readme_starts_with_the_two_commands() -> None:
    lines = README.splitlines()
    block = lines[lines.index("```bash") + 1: lines.index("```bash") + 3]
    assert "ctxreplay run data/samples" in block[0]
    assert "pytest" in block[1]


def test_the_readme_is_a_front_page() -> None:
    assert len(README.splitlines()) <= 300
    for page in sorted(DOCS.glob("*.md")):
        assert f"](docs/{page.name})" in README, f"the README links no docs/{page.name}"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but `-` and `_` dropped, spaces to `-`."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(text: str) -> set[str]:
    out: set[str] = set()
    in_code = False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            in_code = not in_code
        elif not in_code and (m := re.match(r"#{1,6} (.+)$", line)):
            out.add(_slug(m.group(1)))
    return out


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


@pytest.mark.parametrize("page", doc_files(), ids=_rel)
def test_every_link_resolves(page: Path) -> None:
    text = page.read_text()
    prose = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
    for target in LINK.findall(prose):
        if re.match(r"[a-z]+:", target):          # https://, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        assert dest.exists(), f"{_rel(page)}: link to {target}: no such file"
        assert ROOT in dest.parents or dest == ROOT, f"{_rel(page)}: link to {target} leaves the repository"
        if anchor:
            assert dest.suffix == ".md", f"{_rel(page)}: {target}"
            assert anchor in _anchors(dest.read_text()), f"{_rel(page)}: link to {target}: no such heading"
    assert "shared/docs" not in text, f"{_rel(page)} points into ../shared/docs, which users do not have"


@pytest.mark.parametrize("page", doc_files(), ids=_rel)
def test_every_block_is_accounted_for(page: Path) -> None:
    """Console blocks parse; Python blocks run, or are files, excerpts or named fragments (and compile,
    but for fragments); an included file is the file; an excerpt's lines are in its file, in order;
    the blocks not run are as counted."""
    counts: dict[str, int] = {}
    for b in blocks(page):                      # raises on output before a block's first command
        where = f"{_rel(page)}:{b.line}"
        if b.directive in ("skip", "corpus"):
            assert b.commands or b.is_python, f"{where}: `{b.directive}` on a block with no command"
            assert len(b.argument or "") > 10, f"{where}: say why the block is not run"
            counts[b.directive] = counts.get(b.directive, 0) + 1
        if b.directive == "fragment":
            assert b.is_python, f"{where}: only Python blocks are fragments"
        elif b.is_python:
            ast.parse(b.text, filename=where)
        if b.directive == "include":
            assert b.text == (ROOT / (b.argument or "")).read_text(), f"{where}: the block is not {b.argument} as it is"
        if b.directive == "excerpt":
            source = (ROOT / (b.argument or "")).read_text().splitlines()
            i = 0
            for line in b.text.splitlines():
                if not line.strip() or line.strip() == ELLIPSIS:
                    continue
                while i < len(source) and source[i].rstrip() != line.rstrip():
                    i += 1
                assert i < len(source), f"{where}: {line.strip()!r} is not in {b.argument} (in this order)"
                i += 1
    assert counts == NOT_RUN.get(_rel(page), {}), f"{_rel(page)}: blocks not run changed: {counts}"


def test_the_docs_hold_commands_to_run() -> None:
    runnable = sum(len(b.commands) for p in doc_files() for b in blocks(p)
                   if b.directive is None and b.commands)
    assert runnable >= 50, runnable
