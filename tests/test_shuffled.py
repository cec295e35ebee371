"""The replay trusts keys, never row order (issue 9, "tests that bite").

Stages return frames in any row order (polars joins and group-bys keep none), and a run's
blocks.parquet is read back by `ctxreplay request`. Here the blocks reach the replay shuffled: by
`thread_rows` directly, by a last pipeline stage that shuffles its rows (a test stage, registered for
these tests only), and by a blocks.parquet rewritten in another row order. Each time the requests must
be byte-identical to those of the sorted blocks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import polars as pl
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from ctxreplay.pipeline.assembly.replay import thread_rows
from ctxreplay.pipeline.batch.runner import RunOptions, run
from ctxreplay.pipeline.commands.cli import main
from ctxreplay.pipeline.core.blockops import empty_decisions
from ctxreplay.pipeline.core.tokens import CHARS4_COUNTER
from ctxreplay.pipeline.stageapi.registry import STAGES, StageContext, StageResult, stage
from ctxreplay.pipeline.staging.spec import parse_spec
from ctxreplay.testkit import make_blocks

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "data" / "samples"
FIXTURES = Path(__file__).parent / "fixtures" / "failures"
SEEDS = (1, 2, 3)

CONVERSATION = [
    {"role": "system", "text": "be brief"},
    {"role": "user", "text": "hi"},
    {"role": "assistant", "blocks": [{"type": "thinking", "text": "hm", "signature": "s"},
                                     {"type": "tool_use", "tool_use_id": "t1", "tool_name": "Read", "tool_input": {}},
                                     {"type": "tool_use", "tool_use_id": "t2", "tool_name": "Read", "tool_input": {}}]},
    {"role": "tool", "blocks": [{"type": "tool_result", "tool_use_id": "t1", "text": "one", "part_type": "string"}]},
    {"role": "tool", "blocks": [{"type": "tool_result", "tool_use_id": "t2", "text": "a", "part_type": "text"},
                                {"type": "tool_result", "tool_use_id": "t2", "text": "b", "part_type": "text",
                                 "part_pos": 1}]},
    {"role": "user", "text": "and?"},
    {"role": "assistant", "text": "done"},
    {"role": "user", "text": "more"},
]


@dataclass(frozen=True, slots=True, kw_only=True)
class ShuffleRows:
    seed: int = 7
    """Seed of the (deterministic) row permutation."""


@pytest.fixture
def shuffle_stage():
    """A stage that returns its blocks unchanged in a shuffled row order (registered for one test)."""

    @stage("test_shuffle_rows", version=1, params=ShuffleRows)
    def test_shuffle_rows(blocks: pl.LazyFrame, params: ShuffleRows, ledger: pl.LazyFrame,
                          ctx: StageContext) -> StageResult:
        """Shuffle the rows of the blocks (a test stage)."""
        df = blocks.collect()
        return StageResult(df.sample(fraction=1.0, shuffle=True, seed=params.seed).lazy(), empty_decisions())

    yield "test_shuffle_rows"
    STAGES.pop("test_shuffle_rows", None)


def two_threads() -> pl.DataFrame:
    a = make_blocks(CONVERSATION).collect()
    b = make_blocks(CONVERSATION[:5], session_id="s0").collect()
    return pl.concat([a, b])


def test_thread_rows_gives_the_same_rows_whatever_the_input_order() -> None:
    blocks = two_threads()
    want = [(k, part) for k, part in thread_rows(blocks)]
    assert [k for k, _ in want] == [("s0", "main"), ("s1", "main")]
    for seed in SEEDS:
        shuffled = blocks.sample(fraction=1.0, shuffle=True, seed=seed)
        assert not shuffled.equals(blocks)  # really out of order
        got = list(thread_rows(shuffled))
        assert [k for k, _ in got] == [k for k, _ in want]
        for (_, g), (_, w) in zip(got, want, strict=True):
            assert g.equals(w), f"seed {seed}: thread rows depend on the input order"
        # replay order: by order_key, then block, part and version
        for _, part in got:
            keys = part.select("order_key", "block_pos", "part_pos", "first_call").rows()
            assert keys == sorted(keys)


def _spec(extra_stage: str | None) -> object:
    text = '[pipeline]\nname = "shuffled"\n\n[[stage]]\nuse = "sanitize"\n\n[[stage]]\nuse = "pairing"\n'
    if extra_stage:
        text += f'\n[[stage]]\nuse = "{extra_stage}"\n'
    return parse_spec(text, source="shuffled.toml")


def _requests(out: Path) -> dict[str, list[str]]:
    """Every call's request of every thread (requests/<key>.jsonl), as canonical text."""
    return {p.name: p.read_text().splitlines() for p in sorted((out / "requests").glob("*.jsonl"))}


@pytest.mark.parametrize("target", ["anthropic", "openai-responses", "gemini"])
def test_a_run_whose_last_stage_shuffles_rows_replays_the_same_requests(target: str, shuffle_stage: str,
                                                                       tmp_path: Path) -> None:
    paths = [SAMPLES, FIXTURES]
    sorted_run = run(paths, _spec(None), RunOptions(out_dir=tmp_path / "a", target=target, all_calls=True,
                                                     token_counter=CHARS4_COUNTER))
    shuffled_run = run(paths, _spec(shuffle_stage), RunOptions(out_dir=tmp_path / "b", target=target,
                                                                all_calls=True, token_counter=CHARS4_COUNTER))
    cols = ["session_id", "thread_id", "call", "request_sha256", "prompt_tokens", "n_messages"]
    a = sorted_run.calls.select(cols).sort(cols[:3])
    b = shuffled_run.calls.select(cols).sort(cols[:3])
    assert a.height > 20 and a.equals(b)
    assert _requests(tmp_path / "a") == _requests(tmp_path / "b")


def test_request_command_reads_a_shuffled_blocks_parquet(tmp_path: Path) -> None:
    # `request --target` shapes a call anew from the run's final blocks (blocks.parquet), whatever
    # order its rows are stored in; the run's own target comes from the request store
    out = tmp_path / "o"
    r = CliRunner().invoke(main, ["run", str(SAMPLES), "--out", str(out), "--all-calls", "-q", "--fast-tokens"],
                           catch_exceptions=False)
    assert r.exit_code == 0, r.stderr
    queries = []
    for jsonl in sorted((out / "requests").glob("*.jsonl")):
        key = jsonl.name.removesuffix(".jsonl")
        queries += [(key, json.loads(line)["call"]) for line in jsonl.read_text().splitlines()]
    assert len(queries) >= 10

    def requests() -> list[tuple[str, str]]:
        got = []
        for key, call in queries:
            for target in ("anthropic", "openai-chat", "gemini"):
                res = CliRunner().invoke(main, ["request", str(out), key, "--call", str(call), "--target", target,
                                                "--canonical"])
                assert res.exit_code == 0, res.stderr
                got.append((f"{key}/{call}/{target}", res.stdout))
        return got

    before = requests()
    path = (out / "blocks.parquet").resolve()
    table = pq.read_table(path)
    order = pl.from_arrow(table).with_row_index("_i").sample(fraction=1.0, shuffle=True, seed=5)["_i"].to_list()
    assert order != sorted(order)
    path.chmod(0o644)
    pq.write_table(table.take(order), path)
    assert requests() == before
