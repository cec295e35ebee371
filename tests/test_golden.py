"""Golden cases: tests/golden/<stage>/<case>/ with input.jsonl (messages, one per line, in the
`ctxreplay.testkit.make_thread` form), params.toml (a comment says what the case shows),
expected_blocks.jsonl and expected_decisions.jsonl (sorted by key). `pytest --update-goldens`
rewrites the expected files; review the diff like code. Re-running the stage on its own output
must decide nothing (idempotence)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ctxreplay.testkit import check_golden

GOLDEN = Path(__file__).parent / "golden"
CASES = sorted(p for p in GOLDEN.glob("*/*") if (p / "input.jsonl").is_file())


def test_there_are_golden_cases() -> None:
    assert CASES, "no golden cases found under tests/golden"


@pytest.mark.parametrize("case", CASES, ids=[f"{c.parent.name}/{c.name}" for c in CASES])
def test_golden(case: Path, update_goldens: bool) -> None:
    check_golden(case, update=update_goldens)
