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


# ------------------------------------------------------------------------------ unused goldens (issue 24)

TWO_TESTS = """
def test_alpha(ctxreplay_golden):
    ctxreplay_golden.check("sessions/codex-sample.jsonl", preset="identity", fast_tokens=True)


def test_beta(ctxreplay_golden):
    ctxreplay_golden.check("sessions/codex-sample.jsonl", preset="identity", fast_tokens=True)
    ctxreplay_golden.check("sessions/codex-sample.jsonl", preset="minimal", fast_tokens=True)
"""


@pytest.fixture
def two(pytester: pytest.Pytester, tmp_path_factory: pytest.TempPathFactory,
        monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    """Two tests, three goldens (test_beta checks twice), written."""
    (pytester.path / "sessions").mkdir()
    shutil.copy(SAMPLES / "codex-sample.jsonl", pytester.path / "sessions")
    pytester.makepyfile(test_pair=TWO_TESTS)
    pytester.makeini("[pytest]\n")
    monkeypatch.setenv("CTXREPLAY_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "price-cache"))
    pytester.runpytest_subprocess("-q", "--ctxreplay-update").assert_outcomes(passed=2)
    assert _goldens(pytester) == ["test_alpha", "test_beta", "test_beta-2"]
    return pytester


def _goldens(p: pytest.Pytester, stem: str = "test_pair") -> list[str]:
    d = p.path / "__ctxreplay__" / stem
    return sorted(x.name for x in d.iterdir()) if d.is_dir() else []


def test_goldens_of_a_renamed_test_are_reported_then_deleted_with_update(two: pytest.Pytester) -> None:
    two.makepyfile(test_pair=TWO_TESTS.replace("def test_alpha(", "def test_gamma("))
    r = two.runpytest_subprocess("-q")
    r.assert_outcomes(passed=1, failed=1)  # test_gamma has no goldens yet
    r.stdout.fnmatch_lines([("*ctxreplay: 1 unused golden (no test checks it any more: a test renamed or removed); "
                             "pytest --ctxreplay-update deletes it:"),
                            "  __ctxreplay__/test_pair/test_alpha"])
    assert _goldens(two) == ["test_alpha", "test_beta", "test_beta-2"]  # reported, not deleted
    r = two.runpytest_subprocess("-q", "--ctxreplay-update")
    r.assert_outcomes(passed=2)
    r.stdout.fnmatch_lines(["*ctxreplay: deleted 1 unused golden (no test checks it any more):",
                            "  __ctxreplay__/test_pair/test_alpha"])
    assert _goldens(two) == ["test_beta", "test_beta-2", "test_gamma"]
    r = two.runpytest_subprocess("-q")
    r.assert_outcomes(passed=2)
    assert "unused golden" not in r.stdout.str()


def test_a_check_removed_from_a_test_leaves_its_golden_unused(two: pytest.Pytester) -> None:
    two.makepyfile(test_pair=TWO_TESTS.split("    ctxreplay_golden.check(\"sessions/codex-sample.jsonl\", "
                                             "preset=\"minimal\"")[0])
    r = two.runpytest_subprocess("-q", "-p", "no:xdist")
    r.assert_outcomes(passed=2)
    r.stdout.fnmatch_lines(["*ctxreplay: 1 unused golden*", "  __ctxreplay__/test_pair/test_beta-2"])


def test_goldens_of_deselected_failed_or_skipped_tests_are_not_reported(two: pytest.Pytester) -> None:
    r = two.runpytest_subprocess("-q", "-k", "alpha")
    r.assert_outcomes(passed=1)
    assert "unused golden" not in r.stdout.str()
    two.makepyfile(test_pair=TWO_TESTS.replace("def test_beta(ctxreplay_golden):\n",
                                               "def test_beta(ctxreplay_golden):\n    assert False\n"))
    r = two.runpytest_subprocess("-q")
    r.assert_outcomes(passed=1, failed=1)
    assert "unused golden" not in r.stdout.str()
    two.makepyfile(test_pair="import pytest\n" + TWO_TESTS.replace("def test_beta(",
                                                                   "@pytest.mark.skip\ndef test_beta("))
    r = two.runpytest_subprocess("-q")
    r.assert_outcomes(passed=1, skipped=1)
    assert "unused golden" not in r.stdout.str()


def test_goldens_of_a_removed_test_file_are_reported_with_xdist_too(two: pytest.Pytester) -> None:
    two.makepyfile(test_other="def test_other():\n    pass\n")
    (two.path / "test_pair.py").unlink()
    r = two.runpytest_subprocess("-q", "-n", "2")
    r.assert_outcomes(passed=1)
    r.stdout.fnmatch_lines([("*ctxreplay: 3 unused goldens (no test checks them any more: a test renamed or "
                             "removed); pytest --ctxreplay-update deletes them:"),
                            "  __ctxreplay__/test_pair/test_alpha", "  __ctxreplay__/test_pair/test_beta",
                            "  __ctxreplay__/test_pair/test_beta-2"])
    r = two.runpytest_subprocess("-q", "-n", "2", "--ctxreplay-update")
    r.stdout.fnmatch_lines(["*ctxreplay: deleted 3 unused goldens*"])
    assert not (two.path / "__ctxreplay__").exists()


def test_used_goldens_are_not_reported_with_xdist(two: pytest.Pytester) -> None:
    two.makepyfile(test_pair=TWO_TESTS.replace("def test_alpha(", "def test_gamma("))
    r = two.runpytest_subprocess("-q", "-n", "2")
    r.assert_outcomes(passed=1, failed=1)
    r.stdout.fnmatch_lines(["*ctxreplay: 1 unused golden*", "  __ctxreplay__/test_pair/test_alpha"])
    assert "test_beta" not in r.stdout.str().split("unused golden")[1]
    # --ctxreplay-update under xdist deletes that one only (a worker sees its own tests: it never decides)
    r = two.runpytest_subprocess("-q", "-n", "2", "--ctxreplay-update")
    r.assert_outcomes(passed=2)
    r.stdout.fnmatch_lines(["*ctxreplay: deleted 1 unused golden*", "  __ctxreplay__/test_pair/test_alpha"])
    assert _goldens(two) == ["test_beta", "test_beta-2", "test_gamma"]
