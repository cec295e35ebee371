"""Every command the README and docs/*.md show runs, and prints what the page shows
(tests/doccheck.py says how; docs/development.md, "Docs that run", is the short version). One test
per page; the blocks that need the project's corpus of real sessions run in the slow pass."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.doccheck import ROOT, blocks, doc_files, normalise, run_file


def _report(outcomes: list) -> str:
    out = []
    for o in outcomes:
        if o.ok:
            continue
        out.append(f"{o.where}: $ {o.cmd}   (exit {o.returncode})")
        if o.expected is not None:
            out.append("  the page shows:")
            out += [f"    | {ln}" for ln in normalise("\n".join(o.expected))]
        out.append("  it printed:")
        out += [f"    | {ln}" for ln in normalise(o.output)]
    return "\n".join(out)


@pytest.mark.parametrize("page", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_commands_of_the_page_print_what_it_shows(page: Path, tmp_path: Path) -> None:
    outcomes = run_file(page, tmp_path)
    failed = [o for o in outcomes if not o.ok]
    assert not failed, f"{len(failed)} of {len(outcomes)} commands differ from the page:\n" + _report(outcomes)


@pytest.mark.slow
@pytest.mark.corpus
@pytest.mark.parametrize("page", [p for p in doc_files() if any(b.directive == "corpus" for b in blocks(p))],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_the_corpus_examples_print_what_the_page_shows(page: Path, tmp_path: Path, corpus: Path) -> None:
    outcomes = run_file(page, tmp_path, corpus=True, timeout=1800)
    failed = [o for o in outcomes if not o.ok]
    assert not failed, f"{len(failed)} of {len(outcomes)} commands differ from the page:\n" + _report(outcomes)
