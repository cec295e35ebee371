"""Corpus outputs stay what they were: every call's request hash and tokens, every decision and the
ledger, per preset and thread, against tests/golden/corpus_fingerprints.json.

A refactor must leave these unchanged. A change that means to alter outputs regenerates the file
(`python tests/corpus_fingerprint.py --only PRESET`) and says in its commit which threads changed
and why. The default preset runs in the default suite, the other pipelines under `-m slow`.
"""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from tests.corpus_fingerprint import GOLDEN, PRESETS, diff, fingerprint

pytestmark = pytest.mark.corpus

PARAMS = [pytest.param(p, marks=() if p == "default" else pytest.mark.slow) for p in PRESETS]


@pytest.mark.parametrize("preset", PARAMS)
def test_corpus_outputs_unchanged(preset: str, corpus: Path) -> None:
    golden = orjson.loads(GOLDEN.read_bytes())
    assert preset in golden, f"no fingerprint for {preset}: run python tests/corpus_fingerprint.py --only {preset}"
    changes = diff(golden[preset], fingerprint(preset, corpus))
    assert not changes, f"{preset}: corpus outputs changed:\n" + "\n".join(changes[:40])
