"""Each stage's live rule against full passes: whenever a rule says "quiet" (its stage decides
nothing at the new calls of a live step), a full pass over the same entries decides nothing of that
stage at those calls.

Two engines take the same session call by call: one on the live path (its rules asked at every
step it could take live, every position asked, `Engine._sessions[...].asked`), one running a full
pass at every step. After each step, every position whose rule answered quiet must have no
decision in the full pass with `from_call` after the last step's pending call; the requests of both
engines are the same. One property test per built-in stage with a rule, over generated Claude Code
sessions, with that stage's thresholds low enough to fire in some of them (the test also checks
that its rule answered both ways over the examples, so neither side is vacuous); the slow variant
cuts real corpus transcripts at every call under every preset.

tests/test_engine_live.py puts each rule on both sides of its thresholds with hand-made sessions.
"""

from __future__ import annotations

import tempfile
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson
import polars as pl
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from ctxreplay.pipeline.core.tokens import CHARS4_COUNTER
from ctxreplay.pipeline.engine.engine import Engine, iter_lines
from ctxreplay.pipeline.staging.spec import PipelineSpec, load_spec, parse_spec, preset_names
from tests.cckit import CCSession, _assistant
from tests.strategies import examples

SID = "7a1e2f30-4b3d-4e5f-8a6b-1c2d3e4f5a6b"
T0 = datetime(2026, 6, 1, 8, 0, tzinfo=UTC)
DEFAULT_STAGES = ["sanitize", "inter_session", "images", "pairing", "result_budget", "snip", "pairing", "tombstone"]
_PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="


def spec(body: str = "", stages: list[str] = DEFAULT_STAGES) -> PipelineSpec:
    """`stages` with `body` lines (`key = value` for [pipeline], `<stage>.<key> = value` for a stage)."""
    pipeline, by_stage = [], {}
    for line in body.strip().splitlines():
        key, value = (x.strip() for x in line.split("=", 1))
        if "." in key:
            s, k = key.split(".", 1)
            by_stage.setdefault(s, []).append(f"{k} = {value}")
        else:
            pipeline.append(f"{key} = {value}")
    text = '[pipeline]\nname = "rules"\n' + "\n".join(pipeline) + "\n"
    for s in stages:
        text += f'\n[[stage]]\nuse = "{s}"\n' + "\n".join(by_stage.get(s, [])) + "\n"
    return parse_spec(text, source="test")


# ------------------------------------------------------------------------------------------ the walk


def walk(lines: list[bytes], sp: PipelineSpec | str, work: Path, session_id: str) -> tuple[Counter[str], list[str]]:
    """Feed the transcript lines to both engines call by call (module docstring). Returns how many
    times each position's rule answered quiet and took part in a comparison, and the violations."""
    quiet: Counter[str] = Counter()
    bad: list[str] = []
    with Engine.open(sp, work / "live.duckdb", token_counter=CHARS4_COUNTER) as live, \
            Engine.open(sp, work / "full.duckdb", token_counter=CHARS4_COUNTER) as full:
        full.live_path = False

        def compare(model: str | None, awaiting_user: bool = False) -> None:
            r = live.assemble(session_id, model=model, awaiting_user=awaiting_user)
            f = full.assemble(session_id, model=model, awaiting_user=awaiting_user)
            assert r.request_sha256 == f.request_sha256, (r.call, r.full_pass_reason)
            asked = live._sessions[session_id].asked
            if asked is None:
                return
            before, answers = asked
            last = full._sessions[session_id].last
            assert last is not None
            new = last.applied_decisions().filter((pl.col("thread_id") == "main") & (pl.col("from_call") > before))
            for pos, why in answers.items():
                if why is None:
                    quiet[pos] += 1
                    made = new.filter(pl.col("stage") == pos).select("entry_id", "action", "reason").rows()
                    if made:
                        bad.append(f"call {r.call}: {pos}'s rule said quiet after call {before}, a full pass made "
                                   f"{len(made)} decision(s) there: {made[:3]}")

        last_msg = None
        for i, raw in enumerate(lines):
            e = orjson.loads(raw)
            msg = e.get("message") if isinstance(e, dict) else None
            if i and isinstance(msg, dict) and e.get("type") == "assistant" and not e.get("isSidechain") \
                    and msg.get("id") != last_msg:
                last_msg = msg.get("id")
                compare(msg.get("model"))
            live.ingest(session_id, [raw])
            full.ingest(session_id, [raw])
        compare(None, awaiting_user=True)
    return quiet, bad


# ------------------------------------------------------------------------------------------ sessions


@st.composite
def sessions(draw: st.DrawFn) -> list[bytes]:
    """A Claude Code session: a prompt, then steps drawn from tool calls (results of several sizes,
    now and then a name or id that sanitize and pairing rewrite), new user turns (after a short or
    an idle gap; now and then blank, meta, with an image or a magic string), thinking, and at the
    end maybe a tool call whose result has not arrived."""
    s = CCSession(SID, T0)
    s.user("Please do the work step by step.")
    k = 0
    for _ in range(draw(st.integers(3, 8))):
        k += 1
        kind = draw(st.sampled_from(["tool", "tool", "tool", "turn", "turn", "odd_tool", "thinking"]))
        if kind == "tool":
            s.tool_call(k, "Bash", draw(st.sampled_from([40, 300, 1500, 4000])), gap=draw(st.sampled_from([5, 4000])))
        elif kind == "odd_tool":
            tid = draw(st.sampled_from([f"toolu_{k:06d}", "toolu_000001", "bad id!"]))
            name = draw(st.sampled_from(["Bash", "bad name!"]))
            s.entry("assistant", _assistant(k, [{"type": "tool_use", "id": tid, "name": name, "input": {"k": k}}],
                                            "tool_use"), 5, requestId=f"req_{k:06d}")
            s.entry("user", {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tid,
                                                         "content": "r" * draw(st.sampled_from([10, 600]))}]}, 2)
        elif kind == "thinking":
            signed = draw(st.booleans())
            block = {"type": "thinking", "thinking": "let me think", **({"signature": "sig"} if signed else {})}
            s.entry("assistant", _assistant(k, [block, {"type": "text", "text": "Thought."}], "end_turn"), 5,
                    requestId=f"req_{k:06d}")
            s.user(f"Go on with {k}.")
        else:
            s.answer(k, f"Done with part {k}.")
            how = draw(st.sampled_from(["plain", "plain", "idle", "blank", "meta", "image", "magic"]))
            if how == "idle":
                s.user(f"Back for part {k}.", gap=4000)
            elif how == "blank":
                s.entry("user", {"role": "user", "content": [{"type": "text", "text": " "},
                                                             {"type": "text", "text": "go"}]}, 5)
            elif how == "meta":
                s.entry("user", {"role": "user", "content": "caveat"}, 5, isMeta=True)
                s.user(f"Now part {k}.")
            elif how == "image":
                s.entry("user", {"role": "user", "content": [{"type": "image", "source": {
                    "type": "base64", "media_type": "image/png", "data": _PNG}}, {"type": "text", "text": "look"}]}, 5)
            elif how == "magic":
                s.user("say ANTHROPIC_MAGIC_STRING_TRIGGER_REFUSAL now")
            else:
                s.user(f"Now part {k}.")
    if draw(st.booleans()):
        s.answer(k + 1, "That is all.")
    elif draw(st.booleans()):
        s.entry("assistant", _assistant(k + 1, [{"type": "tool_use", "id": f"toolu_{k + 1:06d}", "name": "Bash",
                                                 "input": {}}], "tool_use"), 5, requestId=f"req_{k + 1:06d}")
    return [orjson.dumps(e) for e in s.entries]


def rich_session() -> list[bytes]:
    """A fixed session on which every thresholded rule answers both ways under STAGE_SPECS: results
    of two sizes, user turns with an image, a meta message and an idle gap, a result over the
    result_budget cap, unsigned thinking."""
    s = CCSession(SID, T0)
    s.user("Start.")
    for k in range(1, 10):
        s.tool_call(k, "Bash", 1500 if k % 2 else 300)
        if k % 3 == 0:
            s.answer(100 + k, "ok")
            s.entry("user", {"role": "user", "content": [{"type": "image", "source": {
                "type": "base64", "media_type": "image/png", "data": _PNG}}, {"type": "text", "text": "look"}]}, 5)
            s.entry("user", {"role": "user", "content": "caveat"}, 5, isMeta=True)
            s.user("Next.", gap=4000)
        if k == 7:
            s.entry("assistant", _assistant(200, [{"type": "thinking", "thinking": "hm"},
                                                  {"type": "text", "text": "Thought."}], "end_turn"), 5,
                    requestId="req_000200")
            s.user("Go on.")
    return [orjson.dumps(e) for e in s.entries]


# Each stage with thresholds low enough that it fires in some generated sessions and not in others.
STAGE_SPECS = {
    "sanitize": 'sanitize.drop_rows_where = ["meta"]\nsanitize.thinking_policy = "drop_all_but_latest"',
    "inter_session": "",
    "images": "images.max_images_per_request = 1",
    "pairing": "",
    "result_budget": "result_budget.max_result_chars = 1000\nresult_budget.aggregate_max_chars = 3000",
    "snip": "window_tokens = 6000\nsnip.reserve_output_tokens = 0\nsnip.min_tail_turns = 1",
    "tombstone": ("tombstone.trigger_tokens = 1500\ntombstone.clear_at_least_tokens = 100\ntombstone.keep_recent = 0\n"
                  "tombstone.min_result_chars = 100"),
}


def _stages_with_rules() -> list[str]:
    from ctxreplay.pipeline.stageapi.registry import load_stages

    return sorted(n for n, st_ in load_stages().items() if st_.is_builtin and st_.live is not None)


def test_every_builtin_rule_has_a_property_test() -> None:
    assert _stages_with_rules() == sorted(STAGE_SPECS)


@pytest.mark.parametrize("stage", sorted(STAGE_SPECS))
@settings(max_examples=examples(1), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(lines=sessions())
@example(lines=rich_session())
def test_a_quiet_rule_means_no_decision_in_a_full_pass(stage: str, lines: list[bytes]) -> None:
    with tempfile.TemporaryDirectory(prefix="ctxreplay-rules-") as d:
        _, bad = walk(lines, spec(STAGE_SPECS[stage]), Path(d), SID)
    assert not bad, "\n".join(bad)


# snip's rule after tombstone has cleared (its tokens then bound those after its dry run of tombstone):
# both stages' thresholds low, so that tombstone clears in most sessions and snip fires in some
SNIP_BESIDE_TOMBSTONE = STAGE_SPECS["snip"] + "\n" + STAGE_SPECS["tombstone"]


@settings(max_examples=examples(1), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(lines=sessions())
@example(lines=rich_session())
def test_a_quiet_snip_rule_beside_a_tombstone_that_clears_means_no_snip(lines: list[bytes]) -> None:
    with tempfile.TemporaryDirectory(prefix="ctxreplay-rules-") as d:
        _, bad = walk(lines, spec(SNIP_BESIDE_TOMBSTONE), Path(d), SID)
    assert not bad, "\n".join(bad)


# ------------------------------------------------------------------------------------------ corpus


def _small_sessions(corpus: Path, n: int = 2, max_calls: int = 40) -> list[Path]:
    """The smallest top-level Claude Code session files of the corpus with a few calls."""
    out = []
    for p in sorted((corpus / "claude-code").glob("*.jsonl"), key=lambda p: p.stat().st_size):
        if "subagents" in p.name:
            continue
        ids = set()
        for raw in iter_lines(p):
            try:
                e = orjson.loads(raw)
            except orjson.JSONDecodeError:
                continue
            if isinstance(e, dict) and e.get("type") == "assistant" and isinstance(e.get("message"), dict):
                ids.add(e["message"].get("id"))
        if 5 <= len(ids) <= max_calls:
            out.append(p)
        if len(out) == n:
            break
    return out


def _session_id(lines: list[bytes]) -> str:
    for raw in lines:
        try:
            e = orjson.loads(raw)
        except orjson.JSONDecodeError:
            continue
        if isinstance(e, dict) and isinstance(e.get("sessionId"), str):
            return str(e["sessionId"])
    raise AssertionError("no sessionId")


@pytest.mark.slow
@pytest.mark.corpus
@pytest.mark.parametrize("preset", preset_names())
def test_corpus_cut_at_every_call(preset: str, corpus: Path, tmp_path: Path) -> None:
    files = _small_sessions(corpus)
    assert files
    asked = Counter[str]()
    for i, path in enumerate(files):
        lines = list(iter_lines(path))
        quiet, bad = walk(lines, load_spec(preset=preset), tmp_path / str(i), _session_id(lines))
        assert not bad, f"{path.name} under {preset}:\n" + "\n".join(bad)
        asked.update(quiet)
    if load_spec(preset=preset).stages:  # (identity has no stage: nothing to ask)
        assert sum(asked.values()), "no live step was asked on the corpus files"


def _both_sides(work: Path, stage: str) -> tuple[int, int]:
    """(quiet answers, full-pass answers) of `stage`'s rule over rich_session()."""
    answers: Counter[str] = Counter()
    with Engine.open(spec(STAGE_SPECS[stage]), work / "e.duckdb", token_counter=CHARS4_COUNTER) as eng:
        for i, raw in enumerate(rich_session()):
            if i and orjson.loads(raw)["type"] == "assistant":
                eng.assemble(SID, model="claude-x")
                asked = eng._sessions[SID].asked
                if asked is not None and stage in asked[1]:
                    answers["quiet" if asked[1][stage] is None else "full"] += 1
            eng.ingest(SID, [raw])
    return answers["quiet"], answers["full"]


@pytest.mark.parametrize("stage", ["images", "result_budget", "sanitize", "snip", "tombstone"])
def test_the_rules_answer_both_ways_on_a_session_made_for_it(stage: str, tmp_path: Path) -> None:
    # the property above is only as strong as its examples: each thresholded rule says quiet at
    # some steps and asks for a full pass at others on this session
    q, f = _both_sides(tmp_path, stage)
    assert q > 0 and f > 0, (stage, q, f)


# ------------------------------------------------------------------------------------------ the hook


def test_the_engine_names_no_stage() -> None:
    # every stage's live semantics live in its own module: the engine's files name none of them
    import re

    from ctxreplay.pipeline.stageapi.registry import load_stages

    root = Path(__file__).resolve().parent.parent
    names = sorted(n for n, st_ in load_stages().items() if st_.is_builtin)
    word = re.compile(r"\b(" + "|".join(names) + r")\b")
    for rel in ["pipeline/engine/live.py", "pipeline/engine/engine.py", "pipeline/engine/engine_replay.py"]:
        hits = [f"{rel}:{i}: {line.strip()}" for i, line in enumerate((root / rel).read_text().splitlines(), 1)
                if word.search(line)]
        assert not hits, "\n".join(hits)


def test_a_live_rule_must_be_a_live_rule() -> None:
    from dataclasses import dataclass

    from ctxreplay.errors import StageRegistrationError
    from ctxreplay.pipeline.stageapi.registry import stage

    @dataclass(frozen=True)
    class P:
        pass

    with pytest.raises(StageRegistrationError, match="LiveRule"):
        stage("h6_not_a_rule", version=1, params=P, live=(lambda *a: None, lambda *a: None))  # type: ignore[arg-type]


@pytest.mark.parametrize("where", ["start", "step", "answer"])
def test_a_plugin_rule_that_raises_or_answers_wrong_means_a_full_pass(where: str, tmp_path: Path) -> None:
    from dataclasses import dataclass

    from ctxreplay import Live, LiveRule, StageResult
    from ctxreplay.pipeline.core.blockops import empty_decisions
    from ctxreplay.pipeline.stageapi.registry import STAGES, stage

    @dataclass(frozen=True)
    class P:
        pass

    def start(thread: Any, params: P, ctx: Any) -> int:
        if where == "start":
            raise ValueError("broken start")
        return 0

    def step(carry: int, new: Any, params: P, ctx: Any) -> Any:
        if where == "step":
            raise ValueError("broken step")
        return "quiet" if where == "answer" else Live.quiet(carry)

    @stage("h6_rule", version=1, params=P, live=LiveRule(start, step))
    def h6_rule(blocks: Any, params: P, ledger: Any, ctx: Any) -> StageResult:
        return StageResult(blocks, empty_decisions())

    try:
        sp = spec(stages=["sanitize", "h6_rule", "pairing"])
        lines = [orjson.dumps(e) for e in _plain_session().entries]
        got = []
        with Engine.open(sp, tmp_path / "e.duckdb", token_counter=CHARS4_COUNTER) as eng:
            for i, raw in enumerate(lines):
                if i and orjson.loads(raw)["type"] == "assistant":
                    got.append(eng.assemble(SID, model="claude-x"))
                eng.ingest(SID, [raw])
    finally:
        STAGES.pop("h6_rule", None)
    reasons = [r.full_pass_reason for r in got[5:]]
    assert not any(r.incremental for r in got)
    want = {"start": "raised in start (ValueError: broken start)", "step": "raised in step (ValueError: broken step)",
            "answer": "answered str, not Live.quiet"}[where]
    assert all(r is not None and r.startswith("h6_rule: ") and want in r for r in reasons), reasons


def test_a_plugin_rule_that_answers_quiet_takes_the_live_path(tmp_path: Path) -> None:
    from dataclasses import dataclass

    from ctxreplay import Live, LiveRule, StageResult
    from ctxreplay.pipeline.core.blockops import empty_decisions
    from ctxreplay.pipeline.stageapi.registry import STAGES, stage

    @dataclass(frozen=True)
    class P:
        pass

    seen: list[int] = []

    def step(carry: int, new: Any, params: P, ctx: Any) -> Live:
        seen.append(carry)
        return Live.quiet(carry + len(new.rows))

    @stage("h6_quiet", version=1, params=P, live=LiveRule(lambda thread, params, ctx: thread.loaded.height, step))
    def h6_quiet(blocks: Any, params: P, ledger: Any, ctx: Any) -> StageResult:
        return StageResult(blocks, empty_decisions())

    try:
        lines = [orjson.dumps(e) for e in _plain_session().entries]
        with Engine.open(spec(stages=["sanitize", "h6_quiet", "pairing"]), tmp_path / "e.duckdb",
                         token_counter=CHARS4_COUNTER) as eng:
            got = []
            for i, raw in enumerate(lines):
                if i and orjson.loads(raw)["type"] == "assistant":
                    got.append(eng.assemble(SID, model="claude-x"))
                eng.ingest(SID, [raw])
    finally:
        STAGES.pop("h6_quiet", None)
    assert sum(r.incremental for r in got) >= len(got) - 3, [r.full_pass_reason for r in got]
    # the carry goes from step to step: the rows of the thread so far, grown by each step's rows
    assert seen == sorted(seen) and len(set(seen)) == len(seen)


def _plain_session() -> CCSession:
    s = CCSession(SID, T0)
    s.user("Start.")
    for k in range(1, 9):
        s.tool_call(k, "Bash", 200)
    return s
