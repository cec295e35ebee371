"""The package's architecture, checked: import-linter's contracts (pyproject.toml, [tool.importlinter]),
no private name imported across modules, and plug-ins that use only the stable API.

`lint-imports` reads the package from the files of its import name. An editable install maps
pipeline/, stages/ and schemas/ under `ctxreplay` without moving them, so the test lays the package
out as a wheel installs it (a copy of its .py files under tmp/ctxreplay/) and points lint-imports there.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# the repository's folders and where a wheel puts them (pyproject.toml, [tool.setuptools.package-dir])
LAYOUT = {"ctxreplay": "ctxreplay", "pipeline": "ctxreplay/pipeline", "stages": "ctxreplay/stages",
          "schemas": "ctxreplay/schemas", "data": "ctxreplay/data"}
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def _lay_out(root: Path, dest: Path) -> Path:
    for src, to in LAYOUT.items():
        for f in (root / src).rglob("*.py"):
            target = dest / to / f.relative_to(root / src)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, target)
    return dest


def _lint(tree: Path, config: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run([str(LINT_IMPORTS), "--no-cache", str(config)], capture_output=True, text=True,
                          env=env, cwd=tree, check=False)


@pytest.fixture(scope="module")
def laid_out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not LINT_IMPORTS.exists():
        pytest.fail(f"{LINT_IMPORTS} not found: install the test extra (pip install -e '.[test]')")
    return _lay_out(ROOT, tmp_path_factory.mktemp("wheel-layout"))


def test_the_import_contracts_hold(laid_out: Path) -> None:
    r = _lint(laid_out, ROOT / "pyproject.toml")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 broken" in r.stdout and " kept" in r.stdout
    # every module of the package was read (an empty analysis would keep every contract)
    n = sum(1 for _ in (laid_out / "ctxreplay").rglob("*.py"))
    assert f"Analyzed {n} files" in r.stdout, r.stdout


def test_a_lower_floor_importing_a_higher_one_breaks_the_contract(laid_out: Path, tmp_path: Path) -> None:
    tree = _lay_out(ROOT, tmp_path / "tree")
    words = tree / "ctxreplay" / "pipeline" / "core" / "words.py"
    words.write_text(words.read_text() + "\nfrom ctxreplay.pipeline.batch import runner  # noqa\n")
    r = _lint(tree, ROOT / "pyproject.toml")
    assert r.returncode != 0 and "ctxreplay.pipeline.core.words -> ctxreplay.pipeline.batch.runner" in r.stdout


def test_a_cycle_between_two_modules_of_one_package_breaks_the_contract(laid_out: Path, tmp_path: Path) -> None:
    tree = _lay_out(ROOT, tmp_path / "tree")
    iso = tree / "ctxreplay" / "pipeline" / "staging" / "isolation.py"
    iso.write_text(iso.read_text() + textwrap.dedent("""
        def _late():
            from ctxreplay.pipeline.staging import stagerun  # noqa
        """))
    r = _lint(tree, ROOT / "pyproject.toml")
    assert r.returncode != 0 and "No import cycle" in r.stdout and "BROKEN" in r.stdout


def _modules() -> dict[str, Path]:
    out = {}
    for src, to in LAYOUT.items():
        for f in (ROOT / src).rglob("*.py"):
            parts = (to.replace("/", "."), *f.relative_to(ROOT / src).with_suffix("").parts)
            out[".".join(p for p in parts if p != "__init__")] = f
    return out


def private_imports(modules: dict[str, Path]) -> list[str]:
    """`from M import _name` where M is another module of ctxreplay (a private name used outside its
    module: make it public there, with a docstring, or move the caller)."""
    bad = []
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ctxreplay"):
                for a in node.names:
                    if a.name.startswith("_") and not a.name.startswith("__") and node.module != name:
                        bad.append(f"{name} imports {node.module}.{a.name}")
    return bad


def test_no_private_name_is_imported_across_modules() -> None:
    assert private_imports(_modules()) == []


def test_the_private_import_check_finds_one(tmp_path: Path) -> None:
    f = tmp_path / "m.py"
    f.write_text("from ctxreplay.pipeline.core.words import _IRREGULAR\n")
    assert private_imports({"ctxreplay.x": f}) == ["ctxreplay.x imports ctxreplay.pipeline.core.words._IRREGULAR"]


def test_the_example_plugin_uses_only_the_stable_api() -> None:
    stable = {"ctxreplay", "ctxreplay.testkit", "ctxreplay.errors"}
    used = set()
    for f in (ROOT / "examples" / "redact-secrets").rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "ctxreplay":
                used.add(node.module)
            elif isinstance(node, ast.Import):
                used |= {a.name for a in node.names if a.name.split(".")[0] == "ctxreplay"}
    assert used and used <= stable, used - stable


def test_the_stable_api_names_resolve() -> None:
    import ctxreplay

    for name in ctxreplay.__all__:
        assert getattr(ctxreplay, name) is not None, name
    with pytest.raises(AttributeError):
        ctxreplay.no_such_name  # noqa: B018

