"""Properties of layers 5-6 (result_budget, snip, tombstone) on generated threads.

- idempotence: a second pass decides nothing and changes nothing;
- every changed block has exactly one decision, whose before_sha256 matches what it replaced;
- prefix causality: a prefix of the thread gives the same requests for its calls as the whole;
- resume: the prefix's decisions as the ledger, then the whole thread == the whole thread fresh;
- cache epochs: between consecutive calls a request's earlier content changes only where a
  decision of that call with a new cache_epoch explains it.

Corpus-wide versions of these (every thread of ../shared/corpus under every preset) need the
runner; they live at the end of this file and skip until `ctxreplay.pipeline.batch.runner` exists.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ctxreplay.pipeline.core.blockops import empty_decisions
from ctxreplay.pipeline.stageapi.registry import StageContext, StageResult
from ctxreplay.testkit import make_blocks, run_stage

try:
    from tests.strategies import examples
except ModuleNotFoundError:  # the repo root is not on sys.path under --import-mode=importlib
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.strategies import examples

CONTENT = ["role", "block_type", "part_type", "text", "tool_use_id", "tool_name", "tool_input", "is_error",
           "image_data", "signature"]
KEY = ["entry_id", "block_pos", "part_pos"]


# ------------------------------------------------------------------ generated sessions


def gen_messages(seed: int, *, turns: int = 8, big: int = 3_000, idle_every: int = 4) -> list[dict[str, Any]]:
    """A thread of user turns, each with a few tool loops (some results large, some errors, some
    thinking), timestamps with an idle gap (> 1 h) now and then."""
    rng = random.Random(seed)
    msgs: list[dict[str, Any]] = [{"role": "system", "text": "You are a test agent.", "timestamp": 0}]
    t = 1
    n = 0
    for turn in range(turns):
        t += 4_000 if (turn and turn % idle_every == 0) else rng.randint(5, 120)
        msgs.append({"role": "user", "text": f"turn {turn}: " + "please do things " * rng.randint(1, 30),
                     "timestamp": t})
        for _ in range(rng.randint(0, 3)):
            t += rng.randint(1, 30)
            calls = []
            for _c in range(rng.randint(1, 2)):
                n += 1
                calls.append((f"toolu_{n:04d}", rng.choice(["Read", "Bash", "Grep", "mcp__x__fetch"])))
            blocks: list[dict[str, Any]] = []
            if rng.random() < 0.3:
                blocks.append({"type": "thinking", "text": "hmm " * rng.randint(5, 50), "signature": f"sig{n}"})
            blocks += [{"type": "tool_use", "tool_use_id": i, "tool_name": name, "tool_input": {"n": i}}
                       for i, name in calls]
            msgs.append({"role": "assistant", "blocks": blocks, "timestamp": t})
            t += rng.randint(1, 30)
            results = []
            for i, name in calls:
                size = rng.choice([20, 300, 1_500, big, big * 3])
                body = "\n".join(f"{i} line {k} " + "x" * 40 for k in range(size // 50 + 1))[:size]
                results.append({"type": "tool_result", "tool_use_id": i, "tool_name": name, "text": body,
                                "part_type": "string", "is_error": rng.random() < 0.1})
            msgs.append({"role": "user", "blocks": results, "timestamp": t})
        t += rng.randint(1, 30)
        msgs.append({"role": "assistant", "text": f"done with turn {turn} " + "ok " * rng.randint(1, 40),
                     "timestamp": t})
    return msgs


def assistant_cuts(msgs: list[dict[str, Any]]) -> list[int]:
    """Positions of assistant messages: a prefix cut right before one ends at a pending call that
    the whole thread also has."""
    return [i for i, m in enumerate(msgs) if m["role"] == "assistant" and i > 1]


# ------------------------------------------------------------------ checks


def per_call(blocks: pl.LazyFrame | pl.DataFrame) -> pl.DataFrame:
    """One row per (call, visible block version), calls counted per thread."""
    df = blocks.collect() if isinstance(blocks, pl.LazyFrame) else blocks
    n = pl.col("first_call").max().over("session_id", "thread_id") + 1
    return df.with_columns(
        call=pl.int_ranges("first_call", pl.min_horizontal(pl.coalesce("last_call", n), n), dtype=pl.Int32)
    ).explode("call").filter(pl.col("call").is_not_null())


def requests(blocks: pl.LazyFrame | pl.DataFrame) -> dict[int, list[tuple]]:
    """Each call's request content, in order (version bounds left out)."""
    v = per_call(blocks).sort(["call", "order_key", "block_pos", "part_pos", "entry_id"])
    out: dict[int, list[tuple]] = {}
    for (k,), part in v.group_by(["call"], maintain_order=True):
        out[int(k)] = list(part.select(*KEY, *CONTENT).iter_rows())  # type: ignore[arg-type]
    return out


def check_decisions_match(before: pl.LazyFrame, res: StageResult) -> None:
    """Every changed block version has one decision whose before_sha256 is what it replaced."""
    b = before.collect()
    a = res.blocks.collect()
    d = res.decisions.collect()
    assert d.filter(pl.col("action") == "conflict").height == 0
    vkey = ["entry_id", "block_pos", "part_pos", "first_call"]
    # versions in the output that were not in the input: each has a decision from its first call
    new = a.join(b.select(*vkey, "content_sha256"), on=[*vkey, "content_sha256"], how="anti")
    new = new.filter(pl.col("origin") != "snip")
    dec_at = d.select(*KEY, first_call="from_call", dsha="after_sha256", dcount=pl.lit(1))
    j = new.join(dec_at, on=vkey, how="left")
    assert j["dsha"].null_count() == 0, j.filter(pl.col("dsha").is_null()).select(*vkey, "text")
    assert (j["dsha"] == j["content_sha256"]).all()
    # one decision per (block, from_call)
    assert d.group_by([*KEY, "from_call"]).len()["len"].max() in (None, 1)
    # before_sha256 of replace-like decisions: the version visible right before from_call had it
    rep = d.filter(pl.col("before_sha256").is_not_null())
    vis = b.join(rep.select(*KEY, "from_call", "before_sha256"), on=KEY).filter(
        (pl.col("first_call") <= pl.col("from_call"))
        & (pl.col("last_call").is_null() | (pl.col("last_call") > pl.col("from_call"))))
    ins = rep.filter(pl.col("action").is_in(["insert", "replace"]) & pl.col("entry_id").is_in(
        a.filter(pl.col("origin") == "snip")["entry_id"].unique().to_list()))
    assert vis.height + ins.height >= rep.height
    assert (vis["content_sha256"] == vis["before_sha256"]).all()


def check_epochs_explain_breaks(out: pl.LazyFrame | pl.DataFrame, decisions: pl.DataFrame,
                                natural: pl.DataFrame | None = None) -> pl.DataFrame:
    """Between calls k-1 and k of a thread, content that k-1 sent and k changes or drops (or a row
    inserted before the end of k-1's request) must carry a decision at k with a cache epoch above
    every epoch seen at k-1. `natural` (THREAD + KEY + first_call + last_call of the blocks without
    any layer): starts and ends the transcript itself recorded (compactions and their summaries),
    which need no decision. Returns the unexplained breaks."""
    tk = ["session_id", "thread_id"]
    v = per_call(out).select(*tk, "call", *KEY, "content_sha256", "order_key", "cache_epoch")
    prev_stats = v.group_by(*tk, "call").agg(_max_epoch=pl.col("cache_epoch").max(), _end=pl.col("order_key").max()) \
        .with_columns(call=pl.col("call") + 1)
    last = v.group_by(tk).agg(_n=pl.col("call").max())
    shifted = v.with_columns(call=pl.col("call") + 1).join(last, on=tk).filter(pl.col("call") <= pl.col("_n")) \
        .drop("_n")
    gone = shifted.join(v, on=[*tk, "call", *KEY, "content_sha256"], how="anti")
    inserted = v.join(shifted, on=[*tk, "call", *KEY], how="anti").join(prev_stats, on=[*tk, "call"]).filter(
        pl.col("order_key") < pl.col("_end")).drop("_max_epoch", "_end")
    if natural is not None:
        gone = gone.join(natural.filter(pl.col("last_call").is_not_null()).select(*tk, *KEY, call="last_call"),
                         on=[*tk, "call", *KEY], how="anti")
        # a snip marker stands for rows a recorded compaction later ends: it ends with them
        cuts = natural.filter(pl.col("last_call").is_not_null()).select(*tk, call="last_call").unique()
        out_df = out.collect() if isinstance(out, pl.LazyFrame) else out
        markers = out_df.filter(pl.col("origin") == "snip").select(*tk, *KEY).unique()
        ended = gone.join(markers, on=[*tk, *KEY], how="semi").join(cuts, on=[*tk, "call"], how="semi")
        gone = gone.join(ended.select(*tk, "call", *KEY), on=[*tk, "call", *KEY], how="anti")
        inserted = inserted.join(natural.select(*tk, *KEY, call="first_call"), on=[*tk, "call", *KEY], how="anti")
    breaks = pl.concat([gone.select(*tk, "call", *KEY), inserted.select(*tk, "call", *KEY)]).unique()
    dec = decisions if "session_id" in decisions.columns else decisions.with_columns(
        session_id=pl.lit(v["session_id"][0]), thread_id=pl.lit(v["thread_id"][0]))
    checked = breaks.join(prev_stats, on=[*tk, "call"], how="left").join(
        dec.select(*tk, *KEY, call="from_call", _epoch="cache_epoch").group_by(*tk, *KEY, "call")
        .agg(pl.col("_epoch").max()), on=[*tk, "call", *KEY], how="left")
    return checked.filter(pl.col("_epoch").is_null() | (pl.col("_epoch") <= pl.col("_max_epoch")))


Runner = Callable[[pl.LazyFrame, pl.LazyFrame], StageResult]


def stage_runner(name: str, params: dict[str, Any], ctx: StageContext) -> Runner:
    return lambda blocks, ledger: run_stage(name, blocks, params, ledger=ledger, ctx=ctx)


def chain_runner(specs: list[tuple[str, dict[str, Any]]], ctx: StageContext) -> Runner:
    """result_budget → snip → tombstone as the runner will chain them; the ledger per stage is
    the decisions of that stage (tagged here with a `_stage` column kept outside the frame)."""

    def run(blocks: pl.LazyFrame, ledger: pl.LazyFrame) -> StageResult:
        led = ledger.collect()
        decisions = []
        for name, params in specs:
            mine = led.filter(pl.col("_stage") == name).drop("_stage") if "_stage" in led.columns else \
                empty_decisions().collect()
            res = run_stage(name, blocks, params, ledger=mine.lazy(), ctx=ctx)
            blocks = res.blocks
            decisions.append(res.decisions.collect().with_columns(_stage=pl.lit(name)))
        return StageResult(blocks, pl.concat(decisions).lazy())

    return run


def check_all(run: Runner, msgs: list[dict[str, Any]], cut: int, *, chained: bool = False) -> None:
    full_in = make_blocks(msgs)
    empty = empty_decisions()
    if chained:
        empty = empty.with_columns(_stage=pl.lit(None, pl.String))
    full = run(full_in, empty)
    full_blocks = full.blocks.collect()
    full_dec = full.decisions.collect()
    # idempotence
    again = run(full_blocks.lazy(), empty)
    assert again.decisions.collect().height == 0
    assert requests(again.blocks) == requests(full_blocks)
    if not chained:
        check_decisions_match(full_in, full)
    unexplained = check_epochs_explain_breaks(full_blocks, full_dec)
    assert unexplained.height == 0, unexplained
    # prefix causality
    pre = run(make_blocks(msgs[:cut]), empty)
    pre_req = requests(pre.blocks)
    full_req = requests(full_blocks)
    for k, req in pre_req.items():
        assert req == full_req[k], f"call {k} differs between the prefix and the whole thread"
    # resume: the prefix's decisions as the ledger, then the whole thread
    resumed = run(full_in, pre.decisions)
    assert requests(resumed.blocks) == full_req
    rd = resumed.decisions.collect()
    assert rd.filter(pl.col("action") == "conflict").height == 0
    cols = ["entry_id", "block_pos", "part_pos", "from_call", "action", "after_sha256", "cache_epoch"]
    assert sorted(rd.select(cols).iter_rows()) == sorted(full_dec.select(cols).iter_rows())


SMALL = StageContext(window_tokens=12_000)
CASES = {
    "result_budget": {"max_result_chars": 2_000, "aggregate_max_chars": 5_000},
    "result_budget_spill": {"max_result_chars": 2_000, "spill": True, "spill_preview_chars": 300},
    "snip": {"reserve_output_tokens": 2_000, "min_tail_turns": 2},
    "tombstone": {"trigger_tokens": 5_000, "clear_at_least_tokens": 1_000, "keep_recent": 2,
                  "min_result_chars": 100, "clear_tool_inputs": True, "clear_thinking_keep": 1},
}


def _runner(case: str) -> Runner:
    name = "result_budget" if case.startswith("result_budget") else case
    return stage_runner(name, CASES[case], SMALL)


@pytest.mark.parametrize("case", sorted(CASES))
@settings(max_examples=examples(4), deadline=None)
@given(seed=st.integers(0, 10_000), cut_at=st.floats(0.2, 0.9))
def test_stage_properties(case: str, seed: int, cut_at: float) -> None:
    msgs = gen_messages(seed)
    cuts = assistant_cuts(msgs)
    check_all(_runner(case), msgs, cuts[int(cut_at * (len(cuts) - 1))])


@settings(max_examples=examples(3), deadline=None)
@given(seed=st.integers(0, 10_000), cut_at=st.floats(0.2, 0.9))
def test_chain_properties(seed: int, cut_at: float) -> None:
    msgs = gen_messages(seed, turns=10)
    cuts = assistant_cuts(msgs)
    run = chain_runner([("result_budget", CASES["result_budget"]), ("snip", CASES["snip"]),
                        ("tombstone", CASES["tombstone"])], SMALL)
    check_all(run, msgs, cuts[int(cut_at * (len(cuts) - 1))], chained=True)


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10**6), cut_at=st.floats(0.05, 0.95), turns=st.integers(2, 20))
def test_stage_properties_many(case: str, seed: int, cut_at: float, turns: int) -> None:
    msgs = gen_messages(seed, turns=turns)
    cuts = assistant_cuts(msgs)
    if not cuts:
        return
    check_all(_runner(case), msgs, cuts[int(cut_at * (len(cuts) - 1))])


def test_every_cut_of_one_thread_resumes_identically() -> None:
    msgs = gen_messages(7, turns=10)
    run = chain_runner([("result_budget", CASES["result_budget"]), ("snip", CASES["snip"]),
                        ("tombstone", CASES["tombstone"])], SMALL)
    cuts = assistant_cuts(msgs)
    for cut in (cuts[1], cuts[len(cuts) // 2], cuts[-1]):
        check_all(run, msgs, cut, chained=True)


# ------------------------------------------------------------------ the corpus, through the runner

STRESS_SPEC = """
# layers 5-6 made to fire often on the corpus: a small window, low caps and triggers
[pipeline]
name = "stress-5-6"
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
trigger_tokens = 12000
clear_at_least_tokens = 2000
keep_recent = 3
trigger_idle_seconds = 600
clear_tool_inputs = true
clear_thinking_keep = 2
"""
# the stress spec makes all three layers fire on the corpus and runs by default; the shipped
# presets fire rarely on it and take ~7 s each: `pytest -m slow` runs them
PRESETS = [pytest.param(p, marks=pytest.mark.slow)
           for p in ("default", "claude-code", "openclaw", "context-editing", "minimal")]
PRESETS.append(pytest.param("stress"))


def _transcripts(corpus: Path) -> list[Path]:
    return [f for f in sorted(corpus.rglob("*")) if f.is_file() and (
        f.name.endswith(".jsonl") or ".jsonl.deleted." in f.name or ".jsonl.reset." in f.name)]


def _is_model_line(obj: Any) -> bool:
    """A transcript line that holds (part of) a model answer, in any of the corpus formats."""
    if not isinstance(obj, dict):
        return False
    msg = obj.get("message") if isinstance(obj.get("message"), dict) else {}
    payload = obj.get("payload") if isinstance(obj.get("payload"), dict) else {}
    return (obj.get("type") == "assistant" or msg.get("role") == "assistant" or obj.get("role") == "assistant"
            or payload.get("role") == "assistant"
            or payload.get("type") in ("reasoning", "function_call", "custom_tool_call"))


def _halves(corpus: Path, dst: Path) -> Path:
    """Every transcript cut right before the first model answer in its second half, in the same
    layout: the session as it stood while waiting for the model, so the pending request is the
    one the whole transcript sends next. (Cut mid-turn, the pending request is still growing, and
    what a layer decides for it is provisional: see the report on runner policy.)"""
    import json

    for src in _transcripts(corpus):
        out = dst / src.relative_to(corpus)
        out.parent.mkdir(parents=True, exist_ok=True)
        lines = src.read_bytes().split(b"\n")
        n = len([x for x in lines if x.strip()])
        keep: list[bytes] = []
        seen, prev_model, last_id = 0, False, None
        for x in lines:
            if x.strip():
                seen += 1
                try:
                    obj = json.loads(x)
                except ValueError:
                    obj = None
                model = _is_model_line(obj)
                msg = obj.get("message") if isinstance(obj, dict) and isinstance(obj.get("message"), dict) else {}
                mid = msg.get("id")
                # a new model answer: not the continuation of the previous one (Claude Code writes
                # one answer's blocks, and the results of its parallel calls, as separate lines)
                starts = model and not prev_model and (mid is None or mid != last_id)
                if seen > n // 2 and starts:
                    break
                prev_model = model
                if model and mid is not None:
                    last_id = mid
            keep.append(x)
        out.write_bytes(b"\n".join(keep) + b"\n")
    return dst


def _by_request(calls: pl.DataFrame) -> dict[tuple, str]:
    """request_sha256 of each recorded (non-pending) call, keyed by the recorded request it replays
    (a thread's name can change when a later rewind makes its path an abandoned branch)."""
    return {(r["session_id"], r["message_id"], r["request_id"], r["thread_id"] if r["message_id"] is None else "",
             r["call"] if r["message_id"] is None else -1): r["request_sha256"]
            for r in calls.filter(~pl.col("is_pending")).iter_rows(named=True)}


def _hashes(calls: pl.DataFrame) -> dict[tuple[str, str, int], str]:
    return {(r["session_id"], r["thread_id"], r["call"]): r["request_sha256"] for r in calls.iter_rows(named=True)}


def _spec(preset: str) -> Any:
    from ctxreplay.pipeline.staging.spec import load_spec, parse_spec

    return parse_spec(STRESS_SPEC, source="stress-5-6") if preset == "stress" else load_spec(preset=preset)


def _run(paths: list[Path], out: Path, preset: str, ledger: Path) -> Any:
    from ctxreplay.pipeline.batch.runner import RunOptions, run
    from ctxreplay.pipeline.core.tokens import CHARS4_COUNTER

    return run(paths, _spec(preset), RunOptions(out_dir=out, ledger_path=ledger, token_counter=CHARS4_COUNTER,
                                                   validate=False))


@pytest.fixture(scope="module")
def identity_bounds(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> pl.DataFrame:
    """Where the transcripts themselves start and end rows (compactions), from a run without layers."""
    pytest.importorskip("ctxreplay.pipeline.batch.runner", reason="the runner is not there yet")
    from ctxreplay.pipeline.batch.runner import RunOptions, run
    from ctxreplay.pipeline.core.tokens import CHARS4_COUNTER
    from ctxreplay.pipeline.staging.spec import load_spec

    tmp = tmp_path_factory.mktemp("identity")
    res = run([corpus], load_spec(preset="identity"),
              RunOptions(out_dir=tmp / "o", ledger_path=tmp / "l.duckdb", token_counter=CHARS4_COUNTER,
                         validate=False))
    return res.blocks.select("session_id", "thread_id", *KEY, "first_call", "last_call").unique()


@pytest.mark.corpus
@pytest.mark.parametrize("preset", PRESETS)
def test_corpus_prefix_resume_and_cache_epochs(preset: str, corpus: Path, tmp_path: Path,
                                               identity_bounds: pl.DataFrame) -> None:
    """On every thread of the corpus under this preset: the first half of every file replays its
    recorded calls as the whole file does; the half with a ledger, then the whole with the same
    ledger, equals a fresh whole run; every prefix break between consecutive calls is explained by
    a decision of that call with a new cache epoch."""
    from ctxreplay.pipeline.staging.ledger import Ledger

    full = _run([corpus], tmp_path / "full", preset, tmp_path / "full.duckdb")
    halves = _halves(corpus, tmp_path / "halves")
    half = _run([halves], tmp_path / "half", preset, tmp_path / "resume.duckdb")
    part, whole = _by_request(half.calls), _by_request(full.calls)
    differ = [k for k, v in part.items() if whole.get(k) != v]
    assert not differ, f"{len(differ)} of {len(part)} calls of the halves differ from the whole replay: {differ[:3]}"
    resumed = _run([corpus], tmp_path / "resumed", preset, tmp_path / "resume.duckdb")
    assert resumed.summary["conflicts"] == 0
    assert _hashes(resumed.calls) == _hashes(full.calls)

    # every decision the fresh run applied (pending-call ones are applied but not frozen in the ledger)
    decisions = full.decisions
    led = Ledger(tmp_path / "full.duckdb", read_only=True)
    try:
        frozen = led.decisions()
    finally:
        led.close()
    assert frozen.height == decisions.filter(~pl.col("is_provisional")).height
    unexplained = check_epochs_explain_breaks(full.blocks, decisions, identity_bounds)
    assert unexplained.height == 0, unexplained.head(10)
    if preset == "stress":  # the layers did fire
        fired = set(decisions["stage"].unique().to_list()) if "stage" in decisions.columns else set()
        assert {"result_budget", "snip", "tombstone"} <= fired
