"""The engine's live path (pipeline/engine/live.py): a call appended without a pipeline pass.

Every test feeds a generated Claude Code session to the engine call by call and compares each
request with the batch replay (`ctxreplay run` on the same file). The threshold tests put each
live check on both sides of its threshold: on one side the step is taken without a pass
(`incremental`), on the other a full pass runs, for the reason the check names; the requests are
the batch replay's on both sides.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from ctxreplay.pipeline.batch.runner import RunOptions, run
from ctxreplay.pipeline.core.tokens import CHARS4_COUNTER
from ctxreplay.pipeline.engine.engine import AssembleResult, Engine
from ctxreplay.pipeline.staging.spec import PipelineSpec, load_spec, parse_spec
from tests.cckit import CCSession, _assistant, shout_plugin

SID = "5d1e2f30-4b3d-4e5f-8a6b-1c2d3e4f5a6b"
T0 = datetime(2026, 6, 1, 8, 0, tzinfo=UTC)


def spec(body: str = "") -> PipelineSpec:
    """The default pipeline's stages with `body` appended to the [pipeline] table or to a stage
    (`<stage>.<key> = value` lines)."""
    pipeline, stages = [], {}
    for line in body.strip().splitlines():
        key, value = (x.strip() for x in line.split("=", 1))
        if "." in key:
            st, k = key.split(".", 1)
            stages.setdefault(st, []).append(f"{k} = {value}")
        else:
            pipeline.append(f"{key} = {value}")
    text = '[pipeline]\nname = "live-test"\n' + "\n".join(pipeline) + "\n"
    for st in ["sanitize", "inter_session", "images", "pairing", "result_budget", "snip", "pairing", "tombstone"]:
        text += f'\n[[stage]]\nuse = "{st}"\n' + "\n".join(stages.get(st, [])) + "\n"
    return parse_spec(text, source="test")


def build(steps: int = 8, *, size: int = 300, turn_every: int = 3) -> CCSession:
    """A prompt, then tool calls with results of `size` characters; a new user turn every
    `turn_every` calls (so earlier results become clearable)."""
    s = CCSession(SID, T0)
    s.user("Please do the work step by step.")
    for k in range(steps):
        s.tool_call(k, "Bash", size)
        if k % turn_every == turn_every - 1:
            s.answer(1000 + k, f"Done with part {k}.")
            s.user(f"Now part {k + 1}, please.")
    return s


def call_with_result(s: CCSession, k: int, text: str) -> None:
    """A tool call (`toolu_<k>`) and its result holding exactly `text`."""
    tid = f"toolu_{k:06d}"
    s.entry("assistant", _assistant(k, [{"type": "tool_use", "id": tid, "name": "Bash", "input": {"k": k}}],
                                    "tool_use"), 5, requestId=f"req_{k:06d}")
    s.entry("user", {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tid, "content": text}]}, 2)


def feed(entries: list[dict[str, Any]], sp: PipelineSpec | str, work: Path, *, live: bool = True,
         name: str = "engine") -> list[AssembleResult]:
    """Assemble the request before each answer (with the answering model) and the pending one."""
    out = []
    with Engine.open(sp, work / f"{name}-{live}.duckdb", token_counter=CHARS4_COUNTER) as eng:
        eng.live_path = live
        for i, e in enumerate(entries):
            if e["type"] == "assistant" and i:
                out.append(eng.assemble(SID, model=e["message"]["model"]))
            eng.ingest(SID, [e])
        out.append(eng.assemble(SID, awaiting_user=True))  # the pending request, as the batch replay's
    return out


def batch(entries: list[dict[str, Any]], sp: PipelineSpec | str, work: Path) -> dict[int, str]:
    path = work / "batch" / f"{SID}.jsonl"
    s = CCSession(SID, T0)
    s.entries = entries
    s.write(path)
    calls = run([path], sp if isinstance(sp, PipelineSpec) else load_spec(preset=sp),
                RunOptions(out_dir=work / "batch-out", token_counter=CHARS4_COUNTER)).calls
    return {r["call"]: r["request_sha256"] for r in calls.filter(calls["thread_id"] == "main").iter_rows(named=True)}


def check(entries: list[dict[str, Any]], sp: PipelineSpec | str, work: Path) -> list[AssembleResult]:
    """Feed call by call; every request must be the batch replay's (and the full-pass engine's)."""
    work.mkdir(parents=True, exist_ok=True)
    got = feed(entries, sp, work)
    want = batch(entries, sp, work)
    assert [(r.call, r.request_sha256) for r in got] == [(r.call, want[r.call]) for r in got]
    return got


def at(results: list[AssembleResult], call: int) -> AssembleResult:
    return next(r for r in results if r.call == call)


def test_most_calls_take_the_live_path_and_equal_the_batch_replay_and_full_passes(tmp_path: Path) -> None:
    s = build(12)
    got = check(s.entries, "default", tmp_path)
    assert [r.request_sha256 for r in got] == [r.request_sha256 for r in feed(s.entries, "default", tmp_path,
                                                                              live=False)]
    live = [r.call for r in got if r.incremental]
    assert len(live) >= len(got) - 3, [(r.call, r.full_pass_reason) for r in got]
    assert all(r.full_pass_reason is None for r in got if r.incremental)
    assert all(r.full_pass_reason for r in got if not r.incremental)


def test_a_full_pass_after_live_steps_extends_the_kept_state(tmp_path: Path) -> None:
    s = build(8)
    s.entry("user", {"role": "user", "content": [{"type": "text", "text": "look"}, {
        "type": "image", "source": {"type": "base64", "media_type": "image/png", "data": _PNG}}]}, 5)
    s.answer(2000, "A small picture.")
    s.user("Thanks.")
    got = check(s.entries, "default", tmp_path)
    full = got[-2]  # the request that holds the image
    assert got[-3].incremental and not full.incremental and "image" in (full.full_pass_reason or "")
    assert not full.rebuilt  # the replay state of the live steps was extended, not built again
    assert got[-1].incremental  # and the next call is a live step again


@pytest.mark.parametrize("rules", [True, False])
def test_a_full_pass_after_lines_the_live_path_followed_loads_nothing_again(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch,
                                                                          rules: bool) -> None:
    # a step whose new lines only extend the main thread needs a full pass when a stage decides at
    # the new calls (tombstone's idle trigger at every user turn) or when no rule is asked: that
    # pass appends the rows the live path made to the kept rows, which are what a load gives
    import polars as pl

    import ctxreplay.pipeline.engine.engine as engine_module

    loads: list[int] = []
    real = engine_module.load_paths

    def counted(*a: Any, **k: Any) -> Any:
        loads.append(1)
        return real(*a, **k)

    monkeypatch.setattr(engine_module, "load_paths", counted)
    s = build(16, size=2000, turn_every=4)
    sp = spec("tombstone.trigger_tokens = 0\ntombstone.keep_recent = 0\ntombstone.trigger_idle_seconds = 20")
    key = ["thread_id", "order_key", "block_pos", "part_pos", "first_call", "entry_id"]
    full_without_load = 0
    with Engine.open(sp, tmp_path / "e.duckdb", token_counter=CHARS4_COUNTER) as eng:
        eng.ask_rules = rules
        for i, e in enumerate(s.entries):
            if e["type"] == "assistant" and i:
                before = len(loads)
                r = eng.assemble(SID, model=e["message"]["model"])
                sess = eng._sessions[SID]
                assert sess.last is not None
                (f,) = sess.files.values()  # every line ingested so far (a live step writes none to the spool)
                copy = tmp_path / "copy" / f.path.name
                copy.parent.mkdir(exist_ok=True)
                copy.write_bytes(b"".join(ln + b"\n" for ln in f.lines))
                fresh = pl.from_arrow(real([copy.parent], open_sidechains=True).blocks)
                assert isinstance(fresh, pl.DataFrame)
                kept = sess.last.rows.drop("source_file").sort(key)
                assert kept.equals(fresh.drop("source_file").sort(key)), r.call
                if r.call > 3:  # the format is sniffed from a file's first entries: until then it is loaded
                    assert len(loads) == before, (r.call, r.full_pass_reason)
                    full_without_load += not r.incremental
            eng.ingest(SID, [e])
    assert full_without_load >= (2 if rules else 10)
    got = check(s.entries, sp, tmp_path / "batch")  # and the requests are the batch replay's
    assert any(not r.incremental and "tombstone" in (r.full_pass_reason or "") for r in got)


# ------------------------------------------------------------------------------------- thresholds


def _measure(entries: list[dict[str, Any]], sp: PipelineSpec, call: int, work: Path) -> Any:
    """The live path's measure of snip's and tombstone's input at `call` (tokens, clearable results)."""
    with Engine.open(sp, work / "measure.duckdb", token_counter=CHARS4_COUNTER) as eng:
        for i, e in enumerate(entries):
            if e["type"] == "assistant" and i:
                r = eng.assemble(SID, model=e["message"]["model"])
                if r.call == call:
                    facts = eng._sessions[SID].facts
                    assert facts is not None and r.incremental
                    return facts.carried
            eng.ingest(SID, [e])
    raise AssertionError(f"no call {call}")


def test_snip_high_watermark_both_sides(tmp_path: Path) -> None:
    s = build(10, size=400, turn_every=100)
    base = "window_tokens = 1000000\nsnip.high_watermark = 1.0\nsnip.reserve_output_tokens = 0"
    t = _measure(s.entries, spec(base), 8, tmp_path)["snip"].tokens
    under = check(s.entries, spec(base.replace("1000000", str(t))), tmp_path / "under")
    over = check(s.entries, spec(base.replace("1000000", str(t - 1))), tmp_path / "over")
    assert at(under, 8).incremental
    assert not at(over, 8).incremental and "high watermark" in (at(over, 8).full_pass_reason or "")


@pytest.mark.parametrize("size", [24, 40])
def test_snip_after_tombstone_cleared_bounds_its_request_unless_a_new_result_could_grow(tmp_path: Path,
                                                                                       size: int) -> None:
    # once tombstone has cleared (idle trigger at each user turn), snip's rule measures its own
    # input (the tokens before its dry run of tombstone, which can only shorten the request) as
    # long as no new result the dry run may clear is shorter than the placeholder (9 tokens): a
    # 24-character result (6 tokens) is, a 40-character one (10 tokens) is not
    s = build(12, size=2000, turn_every=4)
    call_with_result(s, 50, "y" * size)
    call_with_result(s, 51, "z" * 200)
    sp = spec("tombstone.trigger_tokens = 0\ntombstone.keep_recent = 0\ntombstone.trigger_idle_seconds = 20\n"
              "tombstone.min_result_chars = 20")
    got = check(s.entries, sp, tmp_path)
    fired = [r.call for r in got if r.decisions.height and r.decisions["stage"].str.starts_with("tombstone").any()]
    assert fired
    with_short, after = got[-2], got[-1]  # the requests holding the new results (the second after the first)
    if size == 24:
        assert not with_short.incremental and "shorter than the placeholder" in (with_short.full_pass_reason or "")
    else:
        assert with_short.incremental, with_short.full_pass_reason
    assert after.incremental, after.full_pass_reason


def test_tombstone_token_trigger_both_sides(tmp_path: Path) -> None:
    s = build(9, size=2000, turn_every=4)  # a user turn ends at call 4 (its results become clearable)
    base = ("tombstone.trigger_tokens = 10000000\ntombstone.clear_at_least_tokens = 1\ntombstone.keep_recent = 0\n"
            "tombstone.trigger_idle_seconds = 0")
    m = _measure(s.entries, spec(base), 6, tmp_path)["tombstone"]
    assert m.before[0] > 0  # results outside the current tool loop
    under = check(s.entries, spec(base.replace("10000000", str(m.tokens))), tmp_path / "under")
    over = check(s.entries, spec(base.replace("10000000", str(m.tokens - 1))), tmp_path / "over")
    assert at(under, 6).incremental
    assert not at(over, 6).incremental and "trigger_tokens" in (at(over, 6).full_pass_reason or "")


def test_tombstone_clear_at_least_both_sides(tmp_path: Path) -> None:
    s = build(9, size=2000, turn_every=4)
    base = ("tombstone.trigger_tokens = 1\ntombstone.clear_at_least_tokens = 99999999\ntombstone.keep_recent = 0\n"
            "tombstone.trigger_idle_seconds = 0")
    m = _measure(s.entries, spec(base), 5, tmp_path)["tombstone"]  # the call after the user turn
    enough = m.before[1]
    under = check(s.entries, spec(base.replace("99999999", str(enough + 1))), tmp_path / "under")
    over = check(s.entries, spec(base.replace("99999999", str(enough))), tmp_path / "over")
    assert at(under, 5).incremental
    assert not at(over, 5).incremental and "trigger_tokens" in (at(over, 5).full_pass_reason or "")


def test_no_clearable_result_means_no_tombstone_trigger_whatever_the_tokens(tmp_path: Path) -> None:
    s = build(6, size=2000, turn_every=100)  # one tool loop: nothing outside the current loop
    got = check(s.entries, spec("tombstone.trigger_tokens = 1\ntombstone.clear_at_least_tokens = 0"), tmp_path)
    assert all(r.incremental for r in got[3:])


@pytest.mark.parametrize(("gap", "live"), [(59.999, True), (60.0, False)])
def test_tombstone_idle_trigger_both_sides(tmp_path: Path, gap: float, live: bool) -> None:
    s = build(5, size=400, turn_every=2)
    s.tool_call(50, "Bash", 400)
    s.entry("assistant", _assistant(51, [{"type": "text", "text": "Waiting."}], "end_turn"), 5, requestId="req_51")
    s.entry("user", {"role": "user", "content": "Back again."}, gap)
    s.tool_call(52, "Bash", 400)
    got = check(s.entries, spec("tombstone.trigger_idle_seconds = 60\ntombstone.keep_recent = 0"), tmp_path)
    last = got[-2]  # the call whose request holds the user's message after the gap
    assert last.incremental is live
    if not live:
        assert "idle" in (last.full_pass_reason or "")


@pytest.mark.parametrize(("extra", "live"), [(0, True), (1, False)])
def test_result_budget_cap_both_sides(tmp_path: Path, extra: int, live: bool) -> None:
    s = build(5, size=300)
    call_with_result(s, 60, "r" * (1000 + extra))
    s.answer(61, "ok")
    got = check(s.entries, spec("result_budget.max_result_chars = 1000"), tmp_path)
    assert got[-2].incremental is live
    if not live:
        assert "max_result_chars" in (got[-2].full_pass_reason or "")


@pytest.mark.parametrize(("limit", "live"), [(1000, True), (999, False)])
def test_result_budget_aggregate_both_sides(tmp_path: Path, limit: int, live: bool) -> None:
    s = build(5, size=300)
    call_with_result(s, 60, "r" * 1000)
    s.answer(61, "ok")
    got = check(s.entries, spec(f"result_budget.aggregate_max_chars = {limit}"), tmp_path)
    assert got[-2].incremental is live


@pytest.mark.parametrize(("limit", "live"), [(2, True), (1, False)])
def test_images_per_request_both_sides(tmp_path: Path, limit: int, live: bool) -> None:
    s = build(4, size=300)
    for k in range(2):
        s.entry("user", {"role": "user", "content": [{"type": "image", "source": {
            "type": "base64", "media_type": "image/png", "data": _PNG}}, {"type": "text", "text": f"pic {k}"}]}, 5)
        s.answer(70 + k, "seen")
    s.tool_call(80, "Bash", 300)
    s.answer(81, "done")
    got = check(s.entries, spec(f"images.max_images_per_request = {limit}"), tmp_path)
    assert got[-1].incremental is live


@pytest.mark.parametrize(("content", "reason"), [
    ("   ", "blank text"),
    ("say ANTHROPIC_MAGIC_STRING_TRIGGER_REFUSAL now", "magic string"),
])
def test_sanitize_rows_take_a_full_pass(tmp_path: Path, content: str, reason: str) -> None:
    s = build(5, size=300)
    s.answer(90, "fine")
    s.entry("user", {"role": "user", "content": [{"type": "text", "text": content}, {"type": "text", "text": "ok"}]}, 5)
    s.tool_call(91, "Bash", 300)
    s.tool_call(92, "Bash", 300)
    s.tool_call(93, "Bash", 300)
    got = check(s.entries, "default", tmp_path)
    assert not got[-4].incremental and reason in (got[-4].full_pass_reason or "")
    # sanitize decided for that call: the next call freezes the decision and is a live step again
    assert got[-3].incremental and got[-3].new_decisions >= 1
    assert got[-2].incremental and got[-1].incremental


@pytest.mark.parametrize(("filters", "live"), [('["assistant_display_only"]', True), ('["meta"]', False)])
def test_sanitize_row_filter_both_sides(tmp_path: Path, filters: str, live: bool) -> None:
    s = build(5, size=300)
    s.answer(90, "fine")
    s.entry("user", {"role": "user", "content": "caveat"}, 5, isMeta=True)
    s.tool_call(91, "Bash", 300)
    got = check(s.entries, spec(f"sanitize.drop_rows_where = {filters}"), tmp_path)
    assert got[-2].incremental is live


def test_a_tool_call_assembled_before_its_result_takes_a_full_pass(tmp_path: Path) -> None:
    s = build(5, size=300)
    s.tool_call(95, "Bash", 300)
    entries = s.entries[:-1]  # the call's answer, not its result
    got = feed(entries, "default", tmp_path)
    full = feed(entries, "default", tmp_path, live=False)
    assert [r.request_sha256 for r in got] == [r.request_sha256 for r in full]
    assert not got[-1].incremental and "result has not arrived" in (got[-1].full_pass_reason or "")


def test_a_reused_tool_id_takes_a_full_pass(tmp_path: Path) -> None:
    s = build(5, size=300)
    s.entry("assistant", _assistant(120, [{"type": "tool_use", "id": "toolu_000001", "name": "Bash",
                                           "input": {"k": 1}}], "tool_use"), 5, requestId="req_120")
    s.entry("user", {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_000001",
                                                  "content": "again"}]}, 2)
    s.answer(121, "ok")
    got = check(s.entries, "default", tmp_path)
    assert not got[-2].incremental and "tool id" in (got[-2].full_pass_reason or "")


def test_a_branch_takes_a_full_pass(tmp_path: Path) -> None:
    s = build(5, size=300)
    fork = s.entries[4]["uuid"]
    s.user("Let us go back.", parent=fork)
    s.answer(122, "Back.")
    s.user("And on.")
    s.tool_call(123, "Bash", 300)
    got = feed(s.entries, "default", tmp_path)
    full = feed(s.entries, "default", tmp_path, live=False)
    assert [r.request_sha256 for r in got] == [r.request_sha256 for r in full]
    assert "main thread" in (got[-3].full_pass_reason or "")
    assert got[-2].incremental and got[-1].incremental  # the new main thread goes on from there


def test_a_plugin_stage_means_a_full_pass_every_call(tmp_path: Path) -> None:
    with shout_plugin():
        sp = parse_spec('[pipeline]\nname = "p"\n[[stage]]\nuse = "sanitize"\n[[stage]]\nuse = "shout"\n'
                        'mode = "ok"\n', source="test")
        got = feed(build(4).entries, sp, tmp_path)
    assert not any(r.incremental for r in got)
    assert any("shout has no live rule" in (r.full_pass_reason or "") for r in got)


def test_a_builtin_stage_without_a_live_rule_means_a_full_pass(tmp_path: Path) -> None:
    sp = parse_spec('[pipeline]\nname = "p"\n[[stage]]\nuse = "sanitize"\n[[stage]]\nuse = "pairing"\n'
                    '[[stage]]\nuse = "auto_compact"\n', source="test")
    got = check(build(5).entries, sp, tmp_path)
    assert not any(r.incremental for r in got)
    assert "auto_compact has no live rule" in (got[-1].full_pass_reason or "")


def test_the_assembled_calls_decisions_are_frozen_by_the_next_live_step_as_a_full_pass_would(
        tmp_path: Path) -> None:
    # sanitize decides for a call (a blank text block), tombstone clears at each user turn: the next
    # call freezes those decisions without a pass, and the ledger ends up holding what the engine
    # with the live path off wrote, row for row
    import duckdb

    s = build(10, size=2000, turn_every=4)
    s.answer(3000, "fine")
    s.entry("user", {"role": "user", "content": [{"type": "text", "text": " "}, {"type": "text", "text": "go"}]}, 5)
    s.tool_call(3001, "Bash", 300)
    s.tool_call(3002, "Bash", 300)
    sp = spec("tombstone.trigger_tokens = 0\ntombstone.keep_recent = 0\ntombstone.trigger_idle_seconds = 20")
    got = check(s.entries, sp, tmp_path)
    feed(s.entries, sp, tmp_path, live=False)
    decided = [r.call for r in got if r.decisions.height]
    assert decided and all(at(got, c + 1).incremental and at(got, c + 1).new_decisions for c in decided
                           if c + 1 <= got[-1].call)

    def ledger(name: str) -> list[tuple[Any, ...]]:
        con = duckdb.connect(str(tmp_path / name), read_only=True)
        try:
            return con.sql("SELECT d.* EXCLUDE (seq), c.call_key FROM decisions d LEFT JOIN decision_calls c "
                           "USING (spec_sha256, seq) ORDER BY ALL").fetchall()
        finally:
            con.close()

    assert ledger("engine-True.duckdb") == ledger("engine-False.duckdb") != []


def test_calls_after_tombstone_fired_take_the_live_path_until_it_can_fire_again(tmp_path: Path) -> None:
    # the idle trigger clears at each new user turn (30 s after the last answer); in between, with
    # nothing new to clear, the calls take the live path, snip's dry run of tombstone included
    s = build(16, size=2000, turn_every=4)
    got = check(s.entries, spec("tombstone.trigger_tokens = 0\ntombstone.keep_recent = 0\n"
                                "tombstone.trigger_idle_seconds = 20"), tmp_path)
    fired = [r.call for r in got if r.decisions.height and r.decisions["stage"].str.starts_with("tombstone").any()]
    assert len(fired) >= 2
    between = [r for r in got if fired[0] < r.call < fired[1]]
    assert between and all(r.incremental for r in between), [(r.call, r.full_pass_reason) for r in between]


# a 1 x 1 PNG
_PNG = ("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg==")
