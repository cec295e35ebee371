"""Prefix causality across rewinds (issue 8, defect 7).

A rewind turns the path that was the main thread into an abandoned branch once the file grows. A
call's request may depend only on the transcript up to that call, so the recorded requests of that
path must replay to the same bytes in the half file (where the path is `main`) and in the whole file
(where it is a branch): a branch carries its whole path's call structure, numbered as on the path,
and reports only its own recorded requests.
"""

from __future__ import annotations

import json
import random
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import polars as pl
import pytest

from ctxreplay.pipeline.batch.runner import RunOptions, RunResult, run
from ctxreplay.pipeline.core.tokens import CHARS4_COUNTER
from ctxreplay.pipeline.staging.spec import load_spec, parse_spec
from tests.cckit import CCSession

SESSION = "6b1f9a4e-0c1d-4e2f-9a3b-5c6d7e8f9a0b"
T0 = datetime(2026, 3, 1, 9, 0, tzinfo=UTC)

# tombstone fires on its token trigger after a few big results; snip and result_budget fire too
STRESS = """
[pipeline]
name = "stress-branches"
window_tokens = 30000

[[stage]]
use = "sanitize"

[[stage]]
use = "pairing"

[[stage]]
use = "result_budget"
max_result_chars = 4000
aggregate_max_chars = 8000

[[stage]]
use = "snip"
reserve_output_tokens = 4000
min_tail_turns = 2

[[stage]]
use = "pairing"

[[stage]]
use = "tombstone"
trigger_tokens = 6000
clear_at_least_tokens = 1000
keep_recent = 2
trigger_idle_seconds = 600
"""


class Writer(CCSession):
    """Claude Code entries with explicit parents (a rewind names an older one); `lines` are the entries."""

    def __init__(self) -> None:
        super().__init__(SESSION, T0)
        self.lines = self.entries

    def user(self, parent: str | None, text: str, gap: float = 30) -> str:  # type: ignore[override]
        return super().user(text, gap, parent)

    def call(self, parent: str, name: str, size: int, gap: float = 5) -> str:
        """An assistant tool call and its (big) result; returns the result entry's uuid."""
        return self.tool_call(len(self.entries) + 1, name, size, gap, parent)

    def answer(self, parent: str, text: str, gap: float = 5) -> str:  # type: ignore[override]
        return super().answer(len(self.entries) + 1, text, gap, parent)


def rewind_session(seed: int) -> tuple[Writer, int]:
    """A few turns of tool loops (big results, now and then a gap of 15 minutes, an idle hour
    between some turns), then a rewind: a new prompt as a child of an earlier turn's answer, with a
    tool loop of its own. Returns the writer and the number of lines before the rewind."""
    rng = random.Random(seed)
    w = Writer()
    p = w.user(None, "start " * rng.randint(1, 20))
    answers = []
    for _turn in range(rng.randint(3, 6)):
        for _ in range(rng.randint(1, 4)):
            p = w.call(p, rng.choice(["Read", "Grep", "Bash"]), rng.choice([200, 1500, 3000, 6000]),
                       gap=rng.choice([5, 5, 5, 900]))
        p = w.answer(p, "done " * rng.randint(1, 10))
        answers.append(p)
        p = w.user(p, "next " * rng.randint(1, 10), gap=rng.choice([30, 30, 4000]))
    cut = len(w.lines)
    q = w.user(rng.choice(answers[:-1]), "rewind " * 3, gap=60)
    for _ in range(rng.randint(1, 3)):
        q = w.call(q, "Read", rng.choice([500, 3000]))
    w.answer(q, "ok")
    return w, cut


def _run(path: Path, out: Path, spec: Any) -> RunResult:
    return run([path], spec, RunOptions(out_dir=out, token_counter=CHARS4_COUNTER, all_calls=True))


def by_request(calls: pl.DataFrame) -> dict[tuple[str, str, str], tuple[str, int]]:
    """(request_sha256, n_messages) of each recorded request, keyed by what it replays."""
    rec = calls.filter(~pl.col("is_pending"))
    return {(r["session_id"], r["message_id"], r["request_id"]): (r["request_sha256"], r["n_messages"])
            for r in rec.iter_rows(named=True)}


def _spec(preset: str) -> Any:
    return parse_spec(STRESS, source="stress-branches") if preset == "stress" else load_spec(preset=preset)


@pytest.mark.parametrize(("preset", "seed"), [("stress", 1), ("stress", 0), ("stress", 3), ("default", 1),
                                              ("identity", 1)])
def test_rewind_keeps_the_requests_of_the_abandoned_path(tmp_path: Path, preset: str, seed: int) -> None:
    """The file before the rewind, then the whole file: every recorded request of the first replays to
    the same bytes in the second, though its path is no longer the main thread."""
    spec = _spec(preset)
    w, cut = rewind_session(seed)
    half = _run(w.write(tmp_path / "half" / f"{SESSION}.jsonl", cut), tmp_path / "oh", spec)
    whole = _run(w.write(tmp_path / "whole" / f"{SESSION}.jsonl"), tmp_path / "ow", spec)
    assert whole.calls["thread_id"].n_unique() == 2  # the path of the half is a branch now
    a, b = by_request(half.calls), by_request(whole.calls)
    assert a and set(a) <= set(b)
    differ = {k: (a[k], b[k]) for k in a if a[k] != b[k]}
    assert not differ, f"{len(differ)} of {len(a)} recorded requests differ: {list(differ)[:3]}"
    # every recorded request is reported by exactly one thread
    rec = whole.calls.filter(~pl.col("is_pending"))
    assert rec.height == rec["message_id"].n_unique() == sum(
        1 for x in w.lines if x["type"] == "assistant")


def test_the_regression_case_fires_tombstone_in_the_shared_history(tmp_path: Path) -> None:
    """Seed 1 is the case that failed before branches carried their path's calls: tombstone's idle
    trigger fires at a call of the history the branch shares (call 4, before the fork), which the
    branch used to see as one call-0 request with no firing."""
    w, _ = rewind_session(1)
    whole = _run(w.write(tmp_path / "whole" / f"{SESSION}.jsonl"), tmp_path / "ow", _spec("stress"))
    branch = next(t for t in whole.calls["thread_id"].unique().to_list() if t != "main")
    fired = whole.decisions.filter((pl.col("stage") == "tombstone") & (pl.col("thread_id") == branch))
    own = whole.calls.filter((pl.col("thread_id") == branch) & ~pl.col("is_pending"))["call"].to_list()
    assert own == [6, 7, 8, 9]  # numbered as on the path: calls 0..5 are main's (inherited)
    assert 4 in fired["from_call"].to_list()  # decided as on the path, at call 4 (before the fork)
    main = whole.calls.filter(pl.col("thread_id") == "main")["call"].to_list()
    assert main == list(range(10))


def test_a_branch_reports_only_its_own_calls_and_request_refuses_inherited_ones(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from ctxreplay.pipeline.commands.cli import main as cli

    w, _ = rewind_session(1)
    out = tmp_path / "o"
    whole = _run(w.write(tmp_path / "whole" / f"{SESSION}.jsonl"), out, _spec("default"))
    branch = whole.calls.filter(pl.col("thread_id") != "main")
    key = branch["thread_key"][0]
    jsonl = [json.loads(x) for x in (out / "requests" / f"{key}.jsonl").read_text().splitlines()]
    assert [x["call"] for x in jsonl] == branch["call"].to_list() == [6, 7, 8, 9, 10]
    r = CliRunner().invoke(cli, ["request", str(out), key, "--call", "7"])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(cli, ["request", str(out), key, "--call", "2"])
    assert r.exit_code == 2 and "is history it shares with thread" in r.output and "own calls are 6, 7, 8, 9 and 10" \
        in r.output


def _requests(calls: pl.DataFrame) -> dict[tuple[str, str, int], tuple[str, int, int]]:
    return {(r["session_id"], r["thread_id"], r["call"]): (r["request_sha256"], r["n_messages"], r["prompt_tokens"])
            for r in calls.iter_rows(named=True)}


@pytest.mark.parametrize(("preset", "seed"), [*[("stress", s) for s in range(8)], ("default", 1), ("default", 3)])
def test_resume_across_a_rewind_with_the_same_ledger_equals_a_fresh_run_9(tmp_path: Path, preset: str,
                                                                          seed: int) -> None:
    """Issue 8 defect 7, its resume half: the half file with a ledger, then the whole file with the
    same ledger, gives every call of every thread the request a fresh run gives, without conflicts.
    The ledger's decisions follow the history of the call they were made for (its call key), not the
    thread's name: the half file's `main` is a branch of the whole file."""
    spec = _spec(preset)
    w, cut = rewind_session(seed)
    ledger = tmp_path / "ledger.duckdb"
    half = w.write(tmp_path / "half" / f"{SESSION}.jsonl", cut)
    first = run([half], spec, RunOptions(out_dir=tmp_path / "o1", ledger_path=ledger, token_counter=CHARS4_COUNTER))
    whole = w.write(tmp_path / "whole" / f"{SESSION}.jsonl")
    resumed = run([whole], spec, RunOptions(out_dir=tmp_path / "o2", ledger_path=ledger,
                                            token_counter=CHARS4_COUNTER))
    fresh = run([whole], spec, RunOptions(out_dir=tmp_path / "o3", token_counter=CHARS4_COUNTER))
    if preset == "stress":  # the layers decided something in the half file that the whole file re-applies
        assert first.decisions.filter(~pl.col("is_provisional") & pl.col("stage").is_in(
            ["tombstone", "snip", "result_budget"])).height > 0
    assert resumed.summary["conflicts"] == 0
    a, b = _requests(resumed.calls), _requests(fresh.calls)
    assert a.keys() == b.keys()
    differ = sorted(k for k in a if a[k] != b[k])
    assert not differ, f"{len(differ)} of {len(a)} calls differ from a fresh run: {differ[:5]}"
