"""Shared fixtures: corpus location, hypothesis profile, --update-goldens."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT.parent / "shared" / "corpus"
CORPUS_EXTRA = ROOT.parent / "shared" / "corpus-extra"

# Hypothesis profiles: `dev` (the default: the whole default suite stays within a few minutes on two
# cores) and `ci` (set by .ci/run: four times the examples of every property test; tests that set
# their own count scale it with `tests.strategies.examples`). HYPOTHESIS_PROFILE picks one.
PROFILES = {"dev": 100, "ci": 400}
settings.register_profile("dev", max_examples=PROFILES["dev"], deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", max_examples=PROFILES["ci"], deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--update-goldens", action="store_true", default=False,
                     help="rewrite tests/golden/*/*/expected_*.jsonl from the current output")


@pytest.fixture
def update_goldens(request: pytest.FixtureRequest) -> bool:
    return bool(request.config.getoption("--update-goldens"))


@pytest.fixture(scope="session")
def corpus() -> Path:
    """../shared/corpus; skipped when absent, an error when CTXREPLAY_REQUIRE_CORPUS=1."""
    if not CORPUS.is_dir():
        if os.environ.get("CTXREPLAY_REQUIRE_CORPUS") == "1":
            pytest.fail(f"CTXREPLAY_REQUIRE_CORPUS=1 but the corpus is missing at {CORPUS}")
        pytest.skip(f"the shared corpus is not present at {CORPUS} (only beside the team's checkout)")
    return CORPUS


@pytest.fixture(scope="session")
def corpus_extra() -> Path:
    """../shared/corpus-extra (the second real corpus: Claude Code 2.1.140+ with the server's cache
    diagnoses, OpenClaw, Codex, Gemini CLI); skipped when absent, an error when CTXREPLAY_REQUIRE_CORPUS=1."""
    if not CORPUS_EXTRA.is_dir():
        if os.environ.get("CTXREPLAY_REQUIRE_CORPUS") == "1":
            pytest.fail(f"CTXREPLAY_REQUIRE_CORPUS=1 but the second corpus is missing at {CORPUS_EXTRA}")
        pytest.skip(f"the second shared corpus is not present at {CORPUS_EXTRA} (only beside the team's checkout)")
    return CORPUS_EXTRA
