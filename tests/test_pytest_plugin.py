"""The pytest plugin (issue 12.3): `ctxreplay_golden.check(...)` in a test, run with pytester, the
plugin loaded through its `pytest11` entry point (and with `-p` where autoloading is off)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.goldenkit import POLICY

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "data" / "samples"


TEST_FILE = """
def test_policy(ctxreplay_golden):
    ctxreplay_golden.check("sessions/", pipeline="policy.toml", fast_tokens=True)
"""


@pytest.fixture
def project(pytester: pytest.Pytester, tmp_path_factory: pytest.TempPathFactory,
            monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    """A team's repository: recorded sessions, a policy and a test that checks it."""
    shutil.copytree(SAMPLES, pytester.path / "sessions")
    (pytester.path / "policy.toml").write_text(POLICY.format(keep_recent=2))
    pytester.makepyfile(test_agents=TEST_FILE)
    # the project's pytest settings must not leak into the inner runs; prices cached apart
    pytester.makeini("[pytest]\n")
    monkeypatch.setenv("CTXREPLAY_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "price-cache"))
    return pytester


GOLDEN = Path("__ctxreplay__") / "test_agents" / "test_policy"


def test_goldens_written_then_checked_then_a_change_fails_with_the_report(project: pytest.Pytester) -> None:
    # --ctxreplay-update writes them (the plugin comes from the entry point: no -p, no conftest)
    r = project.runpytest_subprocess("-q", "--ctxreplay-update")
    r.assert_outcomes(passed=1)
    r.stdout.fnmatch_lines(["*ctxreplay: wrote the goldens of 1 check: review them like code*",
                            f"*{project.path / GOLDEN}"])
    assert (project.path / GOLDEN / "manifest.json").is_file()
    # a policy change: the assertion message is the diff report, the one `ctxreplay diff` prints
    (project.path / "policy.toml").write_text(POLICY.format(keep_recent=1))
    r = project.runpytest_subprocess("-q")
    r.assert_outcomes(failed=1)
    r.stdout.fnmatch_lines([
        "E * AssertionError: ctxreplay diff: 3 of 8 threads changed (3 by the pipeline, 0 by changed inputs)*",
        "E * pipeline:       tombstone (#3) keep_recent: 2 → 1",
        "E * == 019a7c21-4d2e-7f10-b3a8-5e6f7a8b9c0d (pipeline change)",
        "E * first differing call: 3 (1 of 4 calls differ)",
        ("E * decision: tombstone: tombstone (token) from call 3, cache_epoch 4, tool call call_A1b2C3d4; made by "
        "this run only*"),
    ])
    # in a process of its own: pytester takes back the modules a test imports (polars, duckdb, ...)
    # when the test ends, and native extensions cannot be imported twice in one process
    cli = subprocess.run([sys.executable, "-m", "ctxreplay.pipeline.commands.cli", "diff", "sessions", "--pipeline", "policy.toml",
                          "--golden", str(project.path / GOLDEN), "-q"], cwd=project.path, capture_output=True,
                         text=True, check=False)
    assert cli.returncode == 1, cli.stderr
    prefix = "E       "  # pytest's margin of an exception message
    shown = [line[len(prefix):] if line.startswith(prefix) else ("" if line.rstrip() == "E" else None)
             for line in r.stdout.lines]
    report = cli.stdout.splitlines()
    start = shown.index("AssertionError: " + report[0])
    assert shown[start + 1:start + len(report)] == report[1:]


def test_plugin_loads_with_p_when_autoloading_is_off_and_not_with_no(project: pytest.Pytester,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    r = project.runpytest_subprocess("-q", "-p", "no:ctxreplay")
    r.assert_outcomes(errors=1)
    r.stdout.fnmatch_lines(["*fixture 'ctxreplay_golden' not found*"])
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    r = project.runpytest_subprocess("-q")
    r.assert_outcomes(errors=1)
    r = project.runpytest_subprocess("-q", "-p", "ctxreplay.pipeline.regress.pytest_plugin", "--ctxreplay-update")
    r.assert_outcomes(passed=1)


@pytest.mark.slow
def test_no_goldens_options_and_errors(project: pytest.Pytester) -> None:
    r = project.runpytest_subprocess("-q")
    r.assert_outcomes(failed=1)
    r.stdout.fnmatch_lines([f"*no goldens at {project.path / GOLDEN} yet: run pytest with --ctxreplay-update*"])
    project.makepyfile(test_more="""
        import pytest

        def test_two_checks(ctxreplay_golden):
            r = ctxreplay_golden.check(["sessions/codex-sample.jsonl"], preset="identity", fast_tokens=True)
            assert r is None or r.identical  # None: --ctxreplay-update wrote them afresh
            ctxreplay_golden.check("sessions/openclaw-sample.jsonl", preset="identity", fast_tokens=True,
                                   golden="goldens/openclaw")

        def test_bad_spec(ctxreplay_golden):
            ctxreplay_golden.check("sessions/", pipeline="missing.toml")
    """)
    r = project.runpytest_subprocess("-q", "test_more.py", "--ctxreplay-update")
    r.assert_outcomes(passed=1, failed=1)
    r.stdout.fnmatch_lines(["*ctxreplay could not run: *missing.toml: pipeline spec not found*"])
    assert "During handling" not in r.stdout.str()
    assert (project.path / "__ctxreplay__" / "test_more" / "test_two_checks" / "manifest.json").is_file()
    assert (project.path / "goldens" / "openclaw" / "manifest.json").is_file()
    r = project.runpytest_subprocess("-q", "test_more.py::test_two_checks")
    r.assert_outcomes(passed=1)


def test_plugin_module_imports_nothing_heavy() -> None:
    code = ("import sys, ctxreplay.pipeline.regress.pytest_plugin; heavy = [m for m in ('polars', 'pyarrow', 'duckdb', 'tiktoken') "
            "if m in sys.modules]; print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]"
