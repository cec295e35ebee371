"""Resume on one ledger equals a fresh run, on every corpus file (issue 9, point 7).

The first half of each file is replayed with a ledger, then the whole file with the same ledger:
every call of every thread (the pending one included) gets the request a fresh run of the whole
file gives, and no conflict is reported. The ledger's decisions are keyed by the call they apply
from (the message that answers it), so a path that was the main thread in the half file and is a
branch in the whole file keeps its decisions, and the new main thread does not inherit them.
Generated rewinds: tests/test_branch_causality.py.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import polars as pl
import pytest

from ctxreplay.pipeline.batch.runner import RunOptions, run
from ctxreplay.pipeline.core.tokens import CHARS4_COUNTER
from ctxreplay.pipeline.staging.spec import load_spec, parse_spec
from tests.test_corpus_replay import _files, _half
from tests.test_properties_layers_5_6 import STRESS_SPEC

pytestmark = [pytest.mark.corpus, pytest.mark.slow]


def _spec(name: str):
    return parse_spec(STRESS_SPEC, source="stress-5-6") if name == "stress" else load_spec(preset=name)


def _requests(calls: pl.DataFrame) -> dict[tuple[str, str, int], tuple[str, int]]:
    return {(r["session_id"], r["thread_id"], r["call"]): (r["request_sha256"], r["prompt_tokens"])
            for r in calls.iter_rows(named=True)}


@pytest.mark.parametrize("pipeline", ["default", "stress"])
def test_half_then_whole_on_one_ledger_equals_a_fresh_run_every_file_9(corpus: Path, tmp_path: Path,
                                                                       pipeline: str) -> None:
    spec = _spec(pipeline)
    bad: list[str] = []
    for i, f in enumerate(_files(corpus)):
        whole = tmp_path / f"whole{i}"
        whole.mkdir()
        shutil.copy(f, whole / f.name)
        half = _half(f, tmp_path / f"half{i}")
        ledger = tmp_path / f"l{i}.duckdb"

        def go(path: Path, out: str, led: Path | None) -> object:
            return run([path], spec, RunOptions(out_dir=tmp_path / out, ledger_path=led, token_counter=CHARS4_COUNTER))

        go(half, f"h{i}", ledger)
        resumed = go(whole, f"r{i}", ledger)
        fresh = go(whole, f"f{i}", None)
        a, b = _requests(resumed.calls), _requests(fresh.calls)  # type: ignore[attr-defined]
        differ = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
        conflicts = resumed.summary["conflicts"]  # type: ignore[attr-defined]
        if differ or conflicts:
            bad.append(f"{f.name}: {len(differ)} of {len(b)} calls differ (first {differ[:2]}), {conflicts} conflicts")
    assert not bad, "\n".join(bad)
