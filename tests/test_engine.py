"""The live engine (issue 14): resume with identical requests, one engine per ledger, bad entries
quarantined, plug-in failures isolated, compact / after_turn / token_budget, the same requests as
the batch replay on a session whose layers fire."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import polars as pl
import pytest

from ctxreplay.errors import CtxReplayError, InputError, LockError
from ctxreplay.pipeline.batch.runner import RunOptions, run
from ctxreplay.pipeline.core.tokens import CHARS4_COUNTER
from ctxreplay.pipeline.engine.engine import Engine
from ctxreplay.pipeline.staging.ledger import Ledger
from ctxreplay.pipeline.staging.spec import parse_spec
from tests.cckit import CCSession, shout_plugin

SID = "7c2e9a10-4b3d-4e5f-8a6b-1c2d3e4f5a6b"
T0 = datetime(2026, 5, 1, 8, 0, tzinfo=UTC)

# tombstone fires on its token trigger after a few big results; result_budget cuts the biggest
SPEC = parse_spec("""
[pipeline]
name = "engine-test"
window_tokens = 30000

[[stage]]
use = "sanitize"

[[stage]]
use = "pairing"

[[stage]]
use = "result_budget"
max_result_chars = 4000

[[stage]]
use = "tombstone"
trigger_tokens = 5000
clear_at_least_tokens = 500
keep_recent = 2
trigger_idle_seconds = 0
""", source="test")


class Session(CCSession):
    """Claude Code entries: a prompt, then tool calls with big results, an answer now and then;
    `calls` holds the index of the first entry of each call's answer. Methods chain."""

    def __init__(self) -> None:
        super().__init__(SID, T0)
        self.calls: list[int] = []

    def user(self, text: str, gap: float = 30) -> Session:  # type: ignore[override]
        super().user(text, gap)
        return self

    def tool_turn(self, k: int, size: int) -> Session:
        self.calls.append(len(self.entries))
        self.tool_call(k, "Read", size)
        return self

    def answer(self, k: int, text: str, gap: float = 5, parent: Any = None) -> Session:  # type: ignore[override]
        self.calls.append(len(self.entries))
        super().answer(k, text, gap)
        return self


def session(turns: int = 12) -> Session:
    """Turns of three tool calls each (a user prompt between turns: old results leave the current
    tool loop and can be cleared)."""
    s = Session().user("refactor the parser")
    for k in range(turns):
        s.tool_turn(k, [600, 2500, 6000][k % 3])
        if k % 3 == 2:
            s.answer(1000 + k, "next step done")
            s.user(f"continue with part {k // 3 + 2}")
    s.answer(turns, "done")
    return s.user("thanks, now the tests")


def batch_hashes(s: Session, tmp: Path) -> list[str]:
    """request_sha256 of every call of the main thread (the pending one last), by `ctxreplay run`."""
    path = tmp / "batch" / f"{SID}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(e) + "\n" for e in s.entries))
    calls = run([path], SPEC, RunOptions(out_dir=tmp / "batch-out", token_counter=CHARS4_COUNTER)).calls
    return calls.filter(pl.col("thread_id") == "main").sort("call").get_column("request_sha256").to_list()


def live_hashes(eng: Engine, s: Session, upto: int | None = None) -> list[str]:
    """Ingest the session call by call (each answer's entries after its request was assembled);
    no pass may disagree with the ledger."""
    fed, out = 0, []
    for i in s.calls[:upto]:
        eng.ingest(SID, s.entries[fed:i])
        fed = i
        res = eng.assemble(SID, model="claude-x")
        assert res.conflicts == 0
        out.append(res.request_sha256)
    if upto is None:
        eng.ingest(SID, s.entries[fed:])
        res = eng.assemble(SID)
        assert res.conflicts == 0
        out.append(res.request_sha256)
    return out


def _open(tmp: Path, **kw: Any) -> Engine:
    return Engine.open(SPEC, tmp / "ledger.duckdb", token_counter=CHARS4_COUNTER, **kw)


def test_call_by_call_equals_the_batch_replay_while_tombstone_and_result_budget_fire(tmp_path: Path) -> None:
    s = session()
    expected = batch_hashes(s, tmp_path)
    with _open(tmp_path) as eng:
        assert live_hashes(eng, s) == expected
        res = eng.assemble(SID)
        # the layers did fire (otherwise this would test nothing): tombstones and truncations frozen
        led = eng.ledger.decisions()
    assert {"tombstone", "truncate"} <= set(led.get_column("action").to_list())
    assert res.cache_epoch > 0


def test_restart_and_resume_give_identical_requests(tmp_path: Path) -> None:
    s = session()
    half = len(s.calls) // 2
    with _open(tmp_path) as eng:
        first = live_hashes(eng, s, upto=half)
    n_decisions = Ledger(tmp_path / "ledger.duckdb", read_only=True)
    before = n_decisions.decisions().height
    n_decisions.close()
    assert before > 0  # decisions were frozen as they were made
    with _open(tmp_path) as eng:  # a new process: re-ingest the same entries, then go on
        again = live_hashes(eng, s)
        after = eng.ledger.decisions()
    assert again[:half] == first
    assert again == batch_hashes(s, tmp_path)
    # the calls already decided were not decided again: only later calls added decisions
    assert after.filter(pl.col("seq") < before).height == before


def test_token_counts_reach_the_ledger_by_close_and_a_restart_counts_nothing_again(tmp_path: Path) -> None:
    # the counts are a cache written with the next decisions, 5,000 at a time, or at close(): not
    # at every pass; a new engine on the ledger finds every text of the session counted
    s = session(4)
    with _open(tmp_path) as eng:
        live_hashes(eng, s)
        counted = eng.counter.counted
    assert counted > 0
    ledger = Ledger(tmp_path / "ledger.duckdb", read_only=True)
    stored = ledger.con.execute("SELECT count(*) FROM token_cache").fetchall()[0][0]
    ledger.close()
    assert stored == counted
    with _open(tmp_path) as eng:
        live_hashes(eng, s)
        assert eng.counter.counted == 0 and eng.counter.cache_hits == counted


def test_resume_in_one_go_after_a_restart_gives_the_same_pending_request(tmp_path: Path) -> None:
    s = session()
    with _open(tmp_path) as eng:
        live = live_hashes(eng, s)
    with _open(tmp_path) as eng:
        eng.ingest(SID, s.entries)  # everything at once
        assert eng.assemble(SID).request_sha256 == live[-1]


def test_a_batch_run_on_the_engines_ledger_reuses_its_decisions(tmp_path: Path) -> None:
    s = session()
    with _open(tmp_path) as eng:
        live = live_hashes(eng, s)
    path = tmp_path / "t" / f"{SID}.jsonl"
    path.parent.mkdir()
    path.write_text("".join(json.dumps(e) + "\n" for e in s.entries))
    res = run([path], SPEC, RunOptions(out_dir=tmp_path / "o", ledger_path=tmp_path / "ledger.duckdb",
                                       token_counter=CHARS4_COUNTER))
    main = res.calls.filter(pl.col("thread_id") == "main").sort("call")
    assert main.get_column("request_sha256").to_list() == live
    assert res.summary["conflicts"] == 0
    stats = res.summary["decisions_by_stage"]
    assert sum(v["new_decisions"] for v in stats.values()) == 0  # every frozen decision came from the engine
    assert sum(v["reused_decisions"] for v in stats.values()) > 0


def test_two_engines_on_one_ledger_are_refused(tmp_path: Path) -> None:
    s = session(2)
    eng = _open(tmp_path)
    try:
        with pytest.raises(LockError, match=r"cannot open an engine on .*ledger\.duckdb.*in use by another ctxreplay"):
            _open(tmp_path)
        with pytest.raises(CtxReplayError, match="in use by another ctxreplay run"):
            run([tmp_path], SPEC, RunOptions(out_dir=tmp_path / "o", ledger_path=tmp_path / "ledger.duckdb"))
        eng.ingest(SID, s.entries)
        eng.assemble(SID)  # the first engine still works
    finally:
        eng.close()
    with _open(tmp_path) as again:  # released on close
        again.ingest(SID, s.entries)
        assert again.assemble(SID).call == len(s.calls)


def test_another_ledger_is_not_refused(tmp_path: Path) -> None:
    with _open(tmp_path), Engine.open(SPEC, tmp_path / "other.duckdb", token_counter=CHARS4_COUNTER):
        pass


def test_a_bad_entry_is_quarantined_not_raised(tmp_path: Path) -> None:
    s = session(3)
    with _open(tmp_path) as eng:
        eng.ingest(SID, s.entries)
        clean = eng.assemble(SID)
        assert clean.quarantined == ()
    nan = {**s.entries[1], "uuid": "nan-entry", "costUSD": float("nan")}  # a batch run refuses NaN too
    bad: list[Any] = [*s.entries[:2], '{"type": "user", "message": ', [1, 2], {"weird": {1, 2}}, "a\nb", nan,
                      *s.entries[2:]]
    with Engine.open(SPEC, tmp_path / "bad.duckdb", token_counter=CHARS4_COUNTER) as eng:
        eng.ingest(SID, bad)
        res = eng.assemble(SID)
    assert res.request_sha256 == clean.request_sha256  # the good entries make the same request
    got = {(q.line, q.code) for q in res.quarantined}
    assert got == {(3, "truncated_json"), (4, "not_an_object"), (5, "not_json_line"), (6, "not_json_line"),
                   (7, "invalid_json")}
    assert all(q.file == f"{SID}.jsonl" for q in res.quarantined)
    unserialisable = next(q for q in res.quarantined if q.line == 5)
    assert "cannot be written as JSON" in unserialisable.reason


def test_a_session_of_bad_entries_only_still_assembles(tmp_path: Path) -> None:
    with _open(tmp_path) as eng:
        eng.ingest(SID, ["not json at all"])
        res = eng.assemble(SID)
    assert [q.code for q in res.quarantined] == ["invalid_json"]
    assert res.call == 0 and res.request["messages"]  # the target's stand-in first turn


def test_a_failing_plugin_is_isolated(tmp_path: Path) -> None:
    with shout_plugin():
        spec = parse_spec('[pipeline]\nname = "p"\n[[stage]]\nuse = "sanitize"\n[[stage]]\nuse = "shout"\n'
                          'mode = "raise"\n', source="test")
        ok = parse_spec('[pipeline]\nname = "p"\n[[stage]]\nuse = "sanitize"\n', source="test")
        s = session(2)
        with Engine.open(spec, tmp_path / "l.duckdb", token_counter=CHARS4_COUNTER) as eng:
            eng.ingest(SID, s.entries)
            res = eng.assemble(SID)
        with Engine.open(ok, tmp_path / "ok.duckdb", token_counter=CHARS4_COUNTER) as eng:
            eng.ingest(SID, s.entries)
            without = eng.assemble(SID)
    assert [(f.stage, f.kind) for f in res.stage_failures] == [("shout", "raised")]
    assert res.request_json == without.request_json  # the request without the failed stage's effect


def test_compact_force_clears_old_results_and_the_decision_survives_a_restart(tmp_path: Path) -> None:
    s = Session().user("go")
    for k in range(4):
        s.tool_turn(k, 600)  # small: tombstone's token trigger does not fire
    s.answer(99, "done").user("more")
    with _open(tmp_path) as eng:
        eng.ingest(SID, s.entries)
        before = eng.assemble(SID)
        nothing = eng.compact(SID)
        assert nothing.decisions.filter(pl.col("action") == "tombstone").height == 0 and not nothing.simulated
        done = eng.compact(SID, force=True)
        after = eng.assemble(SID)
    assert done.simulated and done.forced
    cleared = done.decisions.filter(pl.col("action") == "tombstone")
    assert cleared.height == 2  # 4 results, keep_recent = 2
    assert set(done.decisions.get_column("from_call").to_list()) == {before.call}  # never a call already sent
    assert after.request_sha256 == done.result.request_sha256 != before.request_sha256
    assert "[Old tool result content cleared]" in after.request_json.decode()
    with _open(tmp_path) as eng:  # frozen in the ledger: a re-opened engine sends the same
        eng.ingest(SID, s.entries)
        assert eng.assemble(SID).request_sha256 == after.request_sha256


def test_compact_force_clears_results_that_were_eligible_at_earlier_calls_too(tmp_path: Path) -> None:
    # two turns of three small results: the first turn's results leave the tool loop at call 4, when
    # the token trigger does not fire; a forced compaction at the pending call clears them now
    s = Session().user("go")
    for k in range(3):
        s.tool_turn(k, 600)
    s.answer(90, "half").user("go on")
    for k in range(3, 6):
        s.tool_turn(k, 600)
    s.answer(91, "done").user("more")
    with _open(tmp_path) as eng:
        eng.ingest(SID, s.entries)
        before = eng.assemble(SID)
        done = eng.compact(SID, force=True)
    cleared = done.decisions.filter(pl.col("action") == "tombstone")
    assert cleared.height == 4  # 6 results outside the current tool loop, keep_recent = 2
    assert set(cleared.get_column("from_call").to_list()) == {before.call}
    assert done.result.request_json.decode().count("[Old tool result content cleared]") == 4


def test_token_budget_says_when_the_request_does_not_fit(tmp_path: Path) -> None:
    s = session(3)
    with _open(tmp_path) as eng:
        eng.ingest(SID, s.entries)
        tokens = eng.assemble(SID).prompt_tokens
        assert not eng.assemble(SID, token_budget=tokens).over_budget
        over = eng.assemble(SID, token_budget=tokens - 1)
        assert over.over_budget and over.prompt_tokens == tokens  # checked, not enforced: same request
        assert not eng.assemble(SID).over_budget  # no budget: nothing to exceed
        with pytest.raises(InputError, match="token_budget"):
            eng.assemble(SID, token_budget=0)


def test_timings_split_the_last_pass_by_phase_and_by_stage(tmp_path: Path) -> None:
    s = session(3)
    with _open(tmp_path) as eng:
        eng.ingest(SID, s.entries[:5])
        assert eng.stage_timings(SID) == {}  # no pass yet
        eng.assemble(SID)
        t = eng.timings(SID)
        by_stage = eng.stage_timings(SID)
        assert set(t) == {"load", "stages", "commit", "shape"} and min(t.values()) >= 0
        assert list(by_stage) == ["sanitize", "pairing", "result_budget", "tombstone"]  # the spec's order
        assert min(by_stage.values()) >= 0 and sum(by_stage.values()) <= t["stages"] + 0.005
        eng.assemble(SID)  # nothing new: no pass, the same figures
        assert eng.stage_timings(SID) == by_stage
        eng.ingest(SID, s.entries[5:])
        eng.assemble(SID)
        assert list(eng.stage_timings(SID)) == list(by_stage)


def test_after_turn_records_usage_beside_the_estimate(tmp_path: Path) -> None:
    s = session(2)
    with _open(tmp_path) as eng:
        eng.ingest(SID, s.entries)
        with pytest.raises(InputError, match="assemble"):
            eng.after_turn(SID, {"input_tokens": 5})
        res = eng.assemble(SID)
        rec = eng.after_turn(SID, {"input_tokens": 100, "cache_read_input_tokens": 900, "output_tokens": 7})
        usage = eng.usage(SID)
    assert (rec.call, rec.recorded_prompt_tokens, rec.output_tokens) == (res.call, 1000, 7)
    assert rec.ratio == pytest.approx(1000 / res.prompt_tokens)
    assert usage.select("call", "request_sha256", "input_tokens").row(0) == (res.call, res.request_sha256, 100)


def test_a_trailing_answer_is_left_out_of_a_request_sent_now_and_kept_when_awaiting_the_user(tmp_path: Path) -> None:
    s = session(2)
    s.entries.pop()  # the session ends on the assistant's answer
    pending = batch_hashes(s, tmp_path)[-1]
    with _open(tmp_path) as eng:
        eng.ingest(SID, s.entries)
        now = eng.assemble(SID)
        waiting = eng.assemble(SID, awaiting_user=True)
    assert waiting.request_sha256 == pending and waiting.awaits_user
    assert waiting.request["messages"][-1]["role"] == "assistant"
    assert not now.awaits_user and now.n_messages == waiting.n_messages - 1
    assert now.request["messages"][-1]["role"] == "user" and now.prompt_tokens < waiting.prompt_tokens


def test_model_defaults_to_the_last_call_and_can_be_given(tmp_path: Path) -> None:
    s = session(2)
    with _open(tmp_path) as eng:
        eng.ingest(SID, s.entries)
        assert eng.assemble(SID).request["model"] == "claude-x"
        assert eng.assemble(SID, model="claude-y").request["model"] == "claude-y"


def test_ingest_batch_keeps_sessions_apart(tmp_path: Path) -> None:
    a, b = session(1), session(2)
    other = "0d9e8f7a-6b5c-4d3e-8f2a-1b0c9d8e7f6a"
    b_entries = [{**e, "sessionId": other} for e in b.entries]
    with _open(tmp_path) as eng:
        assert eng.ingest_batch({SID: a.entries, other: b_entries}) == len(a.entries) + len(b.entries)
        ra, rb = eng.assemble(SID), eng.assemble(other)
        assert eng.threads(SID) == {"main": a.entries[-1]["uuid"]}
    assert (ra.call, rb.call) == (len(a.calls), len(b.calls))


def test_unknown_session_thread_and_closed_engine_are_clear_errors(tmp_path: Path) -> None:
    eng = _open(tmp_path)
    with pytest.raises(InputError, match="has no entries in this engine"):
        eng.assemble("nope")
    eng.ingest(SID, session(1).entries)
    with pytest.raises(InputError, match="has no thread 'branch-x'; its threads: main"):
        eng.assemble(SID, "branch-x")
    with pytest.raises(InputError, match="relative path"):
        eng.ingest(SID, [], file="../escape.jsonl")
    eng.close()
    with pytest.raises(CtxReplayError, match="closed"):
        eng.assemble(SID)


@pytest.mark.parametrize("sample", ["openclaw-sample.jsonl", "codex-sample.jsonl", "pi-legacy-sample.jsonl"])
def test_dict_entries_of_other_formats_give_the_batch_requests(tmp_path: Path, sample: str) -> None:
    src = Path(__file__).resolve().parent.parent / "data" / "samples" / sample
    # the engine's target (a batch run of the codex sample alone would replay it as openai-responses)
    batch = run([src], SPEC, RunOptions(out_dir=tmp_path / "o", token_counter=CHARS4_COUNTER,
                                        target="anthropic")).calls
    entries: list[Any] = []
    for line in src.read_text().splitlines():
        try:
            entries.append(json.loads(line))
        except json.JSONDecodeError:  # the pi sample has a line with two objects: pass it as it is
            entries.append(line)
    with _open(tmp_path) as eng:
        eng.ingest("s", entries, file=src.name)  # the file name the loader reads a session id from
        for tid, sha in batch.filter(pl.col("is_pending")).select("thread_id", "request_sha256").iter_rows():
            assert eng.assemble("s", tid, awaiting_user=True).request_sha256 == sha



def test_the_docs_example_runs_and_agrees_with_the_batch_replay(capsys: pytest.CaptureFixture[str]) -> None:
    import runpy

    root = Path(__file__).resolve().parent.parent
    runpy.run_path(str(root / "examples" / "engine_quickstart.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "same requests as ctxreplay run: True" in out
    assert "resumed pending request identical: True" in out
    # the output docs/engine.md shows is the output the example prints
    doc = (root / "docs" / "engine.md").read_text()
    for line in out.splitlines():
        assert line in doc, line
