"""The loads of tests/loaderkit.py's cases against their frozen digests (tests/fixtures/loader_digests.json).

The digests were taken from the loaders as they were before the Claude Code loader became one
(issue 22, item 3), when two loaders gave the same result on every case; any change of a load's
blocks table or accounting shows here, naming the case and the columns. A change that is meant
is re-taken with `python tests/loaderkit.py` (and said in the commit message).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.loaderkit import CORPUS, CORPUS_EXTRA, Case, cases, differences, frozen, run_case

HAVE_CORPUS = CORPUS.is_dir() and CORPUS_EXTRA.is_dir()
ALL = list(cases(HAVE_CORPUS))
FROZEN = frozen()


def _check(case: Case) -> None:
    assert case.name in FROZEN, f"{case.name}: no frozen digest (python tests/loaderkit.py --only '{case.name}')"
    diff = differences(FROZEN[case.name], run_case(case))
    assert not diff, f"{case.name}: " + "; ".join(diff)


@pytest.mark.parametrize("case", [c for c in ALL if not c.corpus], ids=lambda c: c.name)
def test_load_is_the_frozen_one(case: Case) -> None:
    _check(case)


@pytest.mark.corpus
@pytest.mark.parametrize("case", [c for c in ALL if c.corpus] or [None], ids=lambda c: c.name if c else "absent")
def test_corpus_load_is_the_frozen_one(case: Case | None, corpus: Path, corpus_extra: Path) -> None:
    assert case is not None
    _check(case)


@pytest.mark.corpus
def test_every_case_has_a_digest_and_every_digest_a_case(corpus: Path, corpus_extra: Path) -> None:
    assert sorted(FROZEN) == sorted(c.name for c in ALL)


def test_a_changed_load_is_found(tmp_path: Path) -> None:
    """The digest sees one changed value, and names its column."""
    from ctxreplay.pipeline.loaders import load_paths
    from tests.loaderkit import SAMPLES, digest

    res = load_paths([SAMPLES])
    want = digest(res, tmp_path)
    i = res.blocks.schema.get_field_index("text")
    col = res.blocks.column(i).to_pylist()
    col[0] = (col[0] or "") + "!"
    import pyarrow as pa

    res.blocks = res.blocks.set_column(i, res.blocks.schema.field(i), pa.array(col, pa.string()))
    got = digest(res, tmp_path)
    assert differences(want, got) == [f"table: {want['table']} != {got['table']}", "columns: text"]
    res.loads[0].lines += 1
    assert any(d.startswith("accounting") for d in differences(want, digest(res, tmp_path)))
