"""A file replayed as it grows, with one ledger, equals one fresh run of the whole file (issue 14).

`ctxreplay run` on successive prefixes of a transcript (each cut just before the first line of the
answer to some call, as an agent's session stands while it waits for the model), all against one
ledger, then on the whole file: every call's `request_sha256` is the one a fresh run of the whole
file gives, and no conflict is reported. The resumed run re-applies the frozen decisions and
decides the later calls from the requests as they are; the fresh run decides them all in one walk.

The defect this pins (found on the pi-mono session under `context-editing`): tombstone's token
trigger counted the tokens freed by a clearing as at least zero, while a result shorter than the
placeholder makes the request longer. The fresh walk's request estimate then ran a few tokens
below the request it had built, and a resumed run (which counts the re-applied request as it is)
crossed `trigger_tokens` one call earlier.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import polars as pl
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ctxreplay.pipeline.batch.runner import RunOptions, RunResult, run
from ctxreplay.pipeline.core.constants import CLEARED_TEXT
from ctxreplay.pipeline.core.tokens import CHARS4_COUNTER
from ctxreplay.pipeline.staging.spec import load_spec, parse_spec, preset_names
from tests.strategies import examples
from tests.test_branch_causality import SESSION, STRESS, Writer

# tombstone as in `context-editing` (token trigger only, every result eligible however short), with
# a trigger a small session reaches
TINY = """
[pipeline]
name = "resume-tiny-results"

[[stage]]
use = "sanitize"

[[stage]]
use = "pairing"

[[stage]]
use = "tombstone"
trigger_tokens = 1000
trigger_idle_seconds = 0
keep_recent = 1
min_result_chars = 0
clear_at_least_tokens = 0
"""

# (tool results of the turn as (tool, characters), words of the answer, words of the next prompt):
# short results (2 to 12 characters, shorter than the placeholder) among longer ones
TURNS: list[tuple[list[tuple[str, int]], int, int]] = [
    ([("Read", 5), ("Bash", 12), ("Bash", 12), ("Bash", 200)], 2, 5),
    ([("Bash", 2), ("Read", 200)], 3, 5),
    ([("Bash", 2), ("Read", 900)], 3, 4),
    ([("Bash", 12)], 3, 5),
    ([("Bash", 12), ("Bash", 2)], 5, 1),
    ([("Bash", 900)], 1, 5),
    ([("Bash", 2), ("Bash", 900), ("Read", 2), ("Read", 2)], 2, 5),
]

SPECS = ["tiny", "stress", *preset_names()]


def _spec(name: str) -> Any:
    if name == "tiny":
        return parse_spec(TINY, source="resume-tiny-results")
    if name == "stress":
        return parse_spec(STRESS, source="stress-branches")
    return load_spec(preset=name)


def session(turns: list[tuple[list[tuple[str, int]], int, int]]) -> Writer:
    """Claude Code entries: a prompt, then per turn its tool loop, an answer and the next prompt."""
    w = Writer()
    p = w.user(None, "start")
    for results, answer_words, prompt_words in turns:
        for tool, size in results:
            p = w.call(p, tool, size)
        p = w.answer(p, "done " * answer_words)
        p = w.user(p, "next " * prompt_words)
    return w


def answer_lines(w: Writer) -> list[int]:
    """Index of the first line of the answer to each call (call k: the k-th); a cut there leaves
    call k pending."""
    return [i for i, x in enumerate(w.lines) if x["type"] == "assistant"]


def _requests(calls: pl.DataFrame) -> dict[tuple[str, str, int], tuple[str, int]]:
    return {(r["session_id"], r["thread_id"], r["call"]): (r["request_sha256"], r["prompt_tokens"])
            for r in calls.iter_rows(named=True)}


def grow_and_compare(w: Writer, spec: Any, cuts: list[int], tmp: Path) -> tuple[RunResult, RunResult, list[Any]]:
    """Run the prefixes cut before the answers of `cuts` (call numbers, ascending) on one ledger,
    then the whole file; also one fresh run of it. Returns (resumed, fresh, calls that differ)."""
    shutil.rmtree(tmp, ignore_errors=True)
    ledger = tmp / "ledger.duckdb"
    lines = answer_lines(w)

    def go(path: Path, out: str, led: Path | None) -> RunResult:
        return run([path], spec, RunOptions(out_dir=tmp / out, ledger_path=led, token_counter=CHARS4_COUNTER))

    for j, k in enumerate(cuts):
        go(w.write(tmp / f"prefix{j}" / f"{SESSION}.jsonl", lines[k]), f"o{j}", ledger)
    whole = w.write(tmp / "whole" / f"{SESSION}.jsonl")
    resumed, fresh = go(whole, "resumed", ledger), go(whole, "fresh", None)
    a, b = _requests(resumed.calls), _requests(fresh.calls)
    return resumed, fresh, sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))


def test_a_resume_after_clearing_results_shorter_than_the_placeholder_equals_a_fresh_run(tmp_path: Path) -> None:
    """One resume is enough: the file up to call 21 (pending) with a ledger, then the whole file.
    Before the fix the resumed run fired at call 21 and the fresh one did not (calls 21 and 23
    differed)."""
    w = session(TURNS)
    resumed, fresh, differ = grow_and_compare(w, _spec("tiny"), [21], tmp_path)
    # the case is the one meant: before call 21 the fresh run cleared a result shorter than the
    # placeholder (its clearing made the request longer), and it fires again later
    tomb = fresh.decisions.filter(pl.col("action") == "tombstone")
    assert tomb.filter((pl.col("from_call") < 21) & (pl.col("before_len") < len(CLEARED_TEXT))).height > 0
    assert tomb.filter(pl.col("from_call") >= 21).height > 0
    assert resumed.summary["conflicts"] == 0
    assert not differ, f"calls that differ from a fresh run: {differ}"


@pytest.mark.parametrize("name", SPECS)
def test_successive_prefixes_on_one_ledger_equal_a_fresh_run_every_preset(tmp_path: Path, name: str) -> None:
    """A few resumes (calls 3, 9, 15 and 21 pending), every preset and two specs that fire layers
    5-6 on this small session."""
    resumed, fresh, differ = grow_and_compare(session(TURNS), _spec(name), [3, 9, 15, 21], tmp_path)
    assert resumed.summary["conflicts"] == 0
    assert fresh.calls.height == len(answer_lines(session(TURNS))) + 1  # every call and the pending one
    assert not differ, f"{name}: calls that differ from a fresh run: {differ}"


@pytest.mark.slow
@pytest.mark.parametrize("name", SPECS)
def test_a_run_after_every_call_on_one_ledger_equals_a_fresh_run(tmp_path: Path, name: str) -> None:
    """The strictest sequence: a run after every call (each call pending once), one ledger."""
    w = session(TURNS)
    resumed, _, differ = grow_and_compare(w, _spec(name), list(range(1, len(answer_lines(w)))), tmp_path)
    assert resumed.summary["conflicts"] == 0
    assert not differ, f"{name}: calls that differ from a fresh run: {differ}"


_turns = st.lists(
    st.tuples(st.lists(st.tuples(st.sampled_from(["Read", "Bash"]), st.sampled_from([2, 5, 12, 40, 200, 900, 1500])),
                       min_size=1, max_size=4),
              st.integers(1, 5), st.integers(1, 5)),
    min_size=2, max_size=6)


@pytest.mark.slow
@settings(max_examples=examples(8), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(turns=_turns, data=st.data(), name=st.sampled_from(["tiny", "stress", "context-editing"]))
def test_random_sessions_and_cut_sequences_resume_like_a_fresh_run(tmp_path: Path, turns: Any, data: Any,
                                                                   name: str) -> None:
    w = session(turns)
    n = len(answer_lines(w))
    cuts = sorted(data.draw(st.sets(st.integers(1, n - 1), min_size=1, max_size=3), label="cuts"))
    resumed, _, differ = grow_and_compare(w, _spec(name), cuts, tmp_path / "h")
    assert resumed.summary["conflicts"] == 0
    assert not differ, f"{name}, cuts {cuts}: calls that differ from a fresh run: {differ}"


PI_MONO = "openclaw/badlogic__pi-mono__session.jsonl"


@pytest.mark.slow
def test_pi_mono_grown_call_by_call_under_context_editing_equals_a_fresh_run(corpus: Path, tmp_path: Path) -> None:
    """The corpus case of issue 14: prefixes cut before the answers to calls 200, 206, 208, 210,
    211, 212 and 213, then the whole file, one ledger; call 213 differed (tombstone fired at 213 in
    the resumed run, at 214 in the fresh one). One resume (call 200) showed it too."""
    from tests.test_engine_corpus import _cuts

    path = corpus / PI_MONO
    first_line = {k: line for line, tid, k, _, _ in _cuts(path) if tid == "main"}
    lines = path.read_bytes().splitlines(keepends=True)
    spec = load_spec(preset="context-editing")
    ledger = tmp_path / "ledger.duckdb"

    def go(p: Path, out: str, led: Path | None) -> RunResult:
        return run([p], spec, RunOptions(out_dir=tmp_path / out, ledger_path=led, token_counter=CHARS4_COUNTER))

    for k in (200, 206, 208, 210, 211, 212, 213):
        prefix = tmp_path / f"p{k}" / path.name
        prefix.parent.mkdir()
        prefix.write_bytes(b"".join(lines[:first_line[k] - 1]))
        go(prefix, f"o{k}", ledger)
    resumed, fresh = go(path, "resumed", ledger), go(path, "fresh", None)
    a, b = _requests(resumed.calls), _requests(fresh.calls)
    assert resumed.summary["conflicts"] == 0
    assert a.keys() == b.keys()
    assert not [k for k in a if a[k] != b[k]]
