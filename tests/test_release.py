"""What the wheel carries (issue 21): the package `ctxreplay` and nothing else, every module of the
repository's mapped folders, the files read at run time (tokenizer, presets), no samples, the version
of ctxreplay.version; and that it runs from the wheel's own files.

An editable install reads the checkout, so it hides every packaging mistake; these tests build the
wheel once per session from a copy of the source tree (nothing is written into the checkout): with
`python -m build` where it is installed (the `release` extra: the sdist, then the wheel from it, as
a release is built), else with `pip wheel` (the wheel only; the sdist checks skip). Both fetch
setuptools for an isolated build, from the package index or pip's cache. .ci/release-smoke does
the whole release check: the wheel installed in fresh venvs, every command run from elsewhere.
"""

from __future__ import annotations

import email.parser
import importlib.util
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from ctxreplay.version import __version__

ROOT = Path(__file__).resolve().parent.parent
# the repository's folders and the package each becomes (pyproject.toml, [tool.setuptools.package-dir])
MAPPED = {"ctxreplay": "ctxreplay", "pipeline": "ctxreplay/pipeline", "stages": "ctxreplay/stages",
          "schemas": "ctxreplay/schemas", "data": "ctxreplay/data"}
# what a build of the tree must not see: outputs of earlier builds and runs, caches, venvs
NOT_SOURCE = shutil.ignore_patterns(".git", ".venv", "venv", "build", "dist", "*.egg-info", "__pycache__",
                                    "*.pyc", ".pytest_cache", ".hypothesis", ".ruff_cache", "ctxreplay-out")


class Built:
    def __init__(self, out: Path) -> None:
        wheels = sorted(out.glob("*.whl"))
        assert len(wheels) == 1, wheels
        self.wheel = wheels[0]
        self.names = zipfile.ZipFile(self.wheel).namelist()
        sdists = sorted(out.glob("*.tar.gz"))
        self.sdist = sdists[0] if sdists else None

    def read(self, name: str) -> bytes:
        return zipfile.ZipFile(self.wheel).read(name)

    def dist_info(self, name: str) -> str:
        (path,) = [n for n in self.names if n.split("/")[0].endswith(".dist-info") and n.endswith("/" + name)]
        return self.read(path).decode()


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    base = tmp_path_factory.mktemp("release")
    src = base / "src"
    shutil.copytree(ROOT, src, ignore=NOT_SOURCE, symlinks=True)
    out = base / "dist"
    if importlib.util.find_spec("build") is not None:
        cmd = [sys.executable, "-m", "build", "--outdir", str(out), str(src)]
    else:
        cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--wheel-dir", str(out), str(src)]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PIP_REQUIRE_VIRTUALENV")}
    r = subprocess.run(cmd, cwd=base, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, f"{' '.join(cmd)} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return Built(out)


def test_one_top_level_package_ctxreplay(built: Built) -> None:
    tops = {n.split("/")[0] for n in built.names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"ctxreplay"}
    assert built.dist_info("top_level.txt").split() == ["ctxreplay"]


def test_every_module_of_the_mapped_folders_is_in_it(built: Built) -> None:
    # a subpackage missing from [tool.setuptools] packages would be left out without a word
    want = {f"{to}/{f.relative_to(ROOT / src).as_posix()}" for src, to in MAPPED.items()
            for f in (ROOT / src).rglob("*.py") if "__pycache__" not in f.parts}
    missing = sorted(want - set(built.names))
    assert not missing, f"not in the wheel (pyproject.toml, [tool.setuptools] packages): {missing}"


def test_the_files_read_at_run_time_are_in_it_as_in_the_checkout(built: Built) -> None:
    shipped = [ROOT / "data" / "tokenizer" / "o200k_base.tiktoken.gz",
               *sorted((ROOT / "data" / "pipelines").glob("*.toml"))]
    assert len(shipped) > 5
    for f in shipped:
        name = "ctxreplay/" + f.relative_to(ROOT).as_posix()
        assert name in built.names, f"{name} not in the wheel ([tool.setuptools.package-data])"
        assert built.read(name) == f.read_bytes(), name


def test_no_samples_tests_or_docs_in_it(built: Built) -> None:
    repo_only = {"samples", "tests", "docs", "examples", "bench"}
    leaked = [n for n in built.names if repo_only & set(n.split("/")[:-1])]
    assert not leaked


def test_its_version_and_entry_points(built: Built) -> None:
    assert built.wheel.name.startswith(f"ctxreplay-{__version__}-py3-none-any")
    meta = email.parser.Parser().parsestr(built.dist_info("METADATA"))
    assert (meta["Name"], meta["Version"]) == ("ctxreplay", __version__)
    eps = built.dist_info("entry_points.txt")
    assert "ctxreplay = ctxreplay.entry:main" in eps  # quiet Ctrl-C at start-up, then the CLI
    assert "ctxreplay = ctxreplay.pipeline.regress.pytest_plugin" in eps


def test_it_runs_from_its_own_files(built: Built, tmp_path: Path) -> None:
    """The unpacked wheel first on sys.path (its dependencies from this environment), from a directory
    outside the checkout: the presets and the tokenizer are found through importlib.resources."""
    site = tmp_path / "site"
    zipfile.ZipFile(built.wheel).extractall(site)
    code = (
        "import ctxreplay, sys\n"
        "from pathlib import Path\n"
        "assert Path(ctxreplay.__file__).is_relative_to(sys.argv[1]), ctxreplay.__file__\n"
        "from ctxreplay.pipeline.staging.spec import load_spec, preset_names\n"
        "from ctxreplay.pipeline.core.tokens import tiktoken_counts\n"
        "assert 'default' in preset_names(), preset_names()\n"
        "assert load_spec(preset='default').stages\n"
        "assert tiktoken_counts(['hello world']) == [2]\n"
        "from ctxreplay.pipeline.commands.cli import main\n"
        "main(['--version'])\n"
    )
    env = {**os.environ, "PYTHONPATH": str(site)}
    r = subprocess.run([sys.executable, "-c", code, str(site)], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"ctxreplay, version {__version__}"


def test_the_sdist_carries_what_a_build_and_the_tests_need(built: Built) -> None:
    if built.sdist is None:
        pytest.skip("`build` is not installed (pip install -e '.[release]'): pip wheel built no sdist")
    assert built.sdist.name == f"ctxreplay-{__version__}.tar.gz"
    with tarfile.open(built.sdist) as t:
        names = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    need = {"README.md", "pyproject.toml", "MANIFEST.in", "data/tokenizer/o200k_base.tiktoken.gz",
            "tests/conftest.py", "examples/engine_quickstart.py"}
    need |= {f.relative_to(ROOT).as_posix() for f in (ROOT / "data" / "pipelines").glob("*.toml")}
    need |= {f.relative_to(ROOT).as_posix() for f in (ROOT / "data" / "samples").rglob("*") if f.is_file()}
    assert not sorted(need - names)
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]
