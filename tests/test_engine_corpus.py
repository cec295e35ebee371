"""The live engine against the batch replay on real transcripts (issue 14, acceptance 1).

Each corpus transcript file is fed to the engine one call at a time: before the first line of the
answer to call k, the entries so far are ingested and the thread whose last message is the one
that call k answers is assembled (with the model that answered it: the request names its model;
sent now, so a trailing assistant message is left out where the target takes no prefill).
Its `request_sha256` must be the batch replay's for call k (`ctxreplay run` over the same file,
fresh ledger); at the end, every thread's pending request (`awaiting_user=True`) must be the
batch run's too. A call whose
prefix has no thread ending where it starts (a rewind that re-answers a message already answered)
has no live request to compare and is counted as skipped. The live thread is the one of the same
name when the prefix has it at that call (thread names stay as a file grows), else the one whose
last entry is the message call k answers. Each file runs alone in both, so a
sub-agent file is its own session (as `ctxreplay run <file>` sees it).

The default suite runs the default preset on a few small threads; the slow variant runs every
transcript file of the corpus under every preset.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import polars as pl
import pytest

from ctxreplay.pipeline.batch.runner import RunOptions, run
from ctxreplay.pipeline.core.tokens import CHARS4_COUNTER
from ctxreplay.pipeline.engine.engine import Engine, iter_lines
from ctxreplay.pipeline.loaders import load_paths
from ctxreplay.pipeline.staging.spec import PipelineSpec, load_spec, preset_names

SMALL = [
    "claude-code/daaain__claude-code-log__-src-experiments-claude_p__29ccd257-68b1-427f-ae5f-6524b7cb6f20.jsonl",
    "openclaw/okbest2024__openclaw-backup__bbd5bce8-e1cc-4cd2-a160-758a0a14900e.jsonl.deleted.2026-03-25T00-29-45.957Z",
    "codex/lanegrid__agtrace__codex_session.jsonl",
]


@dataclass
class Outcome:
    matched: int = 0
    skipped: int = 0
    pending_matched: int = 0
    mismatches: list[str] = field(default_factory=list)


def _cuts(path: Path) -> list[tuple[int, str, int, str | None, str | None]]:
    """(first line of the answer, thread, call, entry id of the message before it, model) of every
    recorded call of the file, in line order."""
    b = pl.from_arrow(load_paths([path]).blocks)
    assert isinstance(b, pl.DataFrame)
    out = []
    for (_sid, tid), part in b.group_by(["session_id", "thread_id"]):
        part = part.sort("order_key", "block_pos", "part_pos")
        answers = part.filter(pl.col("is_call")).group_by("msg_key").agg(
            k=pl.col("first_call").min() - 1, line=pl.col("source_line").min(), order=pl.col("order_key").min(),
            model=pl.col("model").first())
        for k, line, order, model in answers.select("k", "line", "order", "model").iter_rows():
            before = part.filter(pl.col("order_key") < order)
            tip = before.get_column("entry_id")[-1] if before.height else None
            out.append((line, str(tid), k, tip, model))
    return sorted(out, key=lambda c: (c[0], c[1]))


def feed_call_by_call(path: Path, spec: PipelineSpec, work: Path, target: str = "anthropic",
                      max_assembles: int | None = None) -> Outcome:
    """Feed `path` to an engine call by call and compare with `ctxreplay run` (module docstring).
    `max_assembles`: on a longer file, assemble every k-th call only (and the last ten): the entries
    still arrive in order, a stretch of calls at a time, and each assembled call is compared."""
    batch = run([path], spec, RunOptions(out_dir=work / "out", token_counter=CHARS4_COUNTER, target=target)).calls
    expected = {(r["thread_id"], r["call"]): r["request_sha256"]
                for r in batch.select("thread_id", "call", "request_sha256").iter_rows(named=True)}
    pending = {r["thread_id"]: r["request_sha256"]
               for r in batch.filter(pl.col("is_pending")).select("thread_id", "request_sha256").iter_rows(named=True)}
    lines = list(iter_lines(path))
    got = Outcome()
    with Engine.open(spec, work / "engine.duckdb", target, token_counter=CHARS4_COUNTER) as eng:
        fed = 0
        cuts = _cuts(path)
        stride = max(1, -(-len(cuts) // max_assembles)) if max_assembles else 1
        for i, (line, tid, k, tip, model) in enumerate(cuts):
            if i % stride and i < len(cuts) - 10:
                continue
            if line - 1 > fed:
                eng.ingest("s", lines[fed:line - 1], file=path.name)
                fed = line - 1
            if fed == 0 or (tid, k) not in expected:
                got.skipped += 1  # nothing to send yet / a call the batch run does not report here
                continue
            threads = eng.threads("s")
            # the thread of the same name (names stay as the file grows), else the one ending where
            # this call starts (a path that is a branch in the whole file)
            live = [tid] if tid in threads else [t for t, e in threads.items() if e == tip]
            res = eng.assemble("s", live[0], model=model) if live else None
            if res is None or res.call != k:
                got.skipped += 1
                continue
            if res.request_sha256 == expected[(tid, k)]:
                got.matched += 1
            else:
                got.mismatches.append(f"{path.name} {tid} call {k} (live thread {live[0]}, call {res.call})")
        eng.ingest("s", lines[fed:], file=path.name)
        for tid, sha in pending.items():
            res = eng.assemble("s", tid, awaiting_user=True)  # as the batch's pending call
            if res.request_sha256 == sha:
                got.pending_matched += 1
            else:
                got.mismatches.append(f"{path.name} {tid} pending call {res.call}")
    return got


def _check(got: Outcome, expected_pending: int | None = None) -> None:
    assert not got.mismatches, got.mismatches[:5]
    assert got.pending_matched >= 1
    # a few rewinds are skipped; every other call is compared
    assert got.matched >= 1 and got.skipped <= max(2, got.matched // 10), (got.matched, got.skipped)


@pytest.mark.parametrize("name", SMALL, ids=lambda n: n.split("/")[0])
def test_engine_call_by_call_equals_the_batch_replay(corpus: Path, tmp_path: Path, name: str) -> None:
    _check(feed_call_by_call(corpus / name, load_spec(preset="default"), tmp_path))


@pytest.mark.parametrize("target", ["openai-chat", "openai-responses", "gemini"])
def test_engine_call_by_call_equals_the_batch_replay_for_other_targets(corpus: Path, tmp_path: Path,
                                                                       target: str) -> None:
    _check(feed_call_by_call(corpus / SMALL[1], load_spec(preset="default"), tmp_path, target))


def test_engine_call_by_call_equals_the_batch_replay_with_simulated_auto_compaction(corpus: Path,
                                                                                    tmp_path: Path) -> None:
    from ctxreplay.pipeline.batch.runner import run as batch_run
    from ctxreplay.pipeline.staging.spec import parse_spec

    spec = parse_spec('[pipeline]\nname = "ac"\n[[stage]]\nuse = "sanitize"\n[[stage]]\nuse = "pairing"\n'
                      '[[stage]]\nuse = "auto_compact"\nthreshold_tokens = 1500\nsummary_tokens = 200\n',
                      source="test")
    path = corpus / "claude-code" / ("daaain__claude-code-log__-Users-dain-workspace-danieldemmel-me-next__"
                                     "b25638d7-b104-4f06-a797-70ac33d069ed.jsonl")
    fired = batch_run([path], spec, RunOptions(out_dir=tmp_path / "fired", token_counter=CHARS4_COUNTER))
    assert fired.summary["decisions"]["auto_compact"] > 0  # it does fire on this thread
    _check(feed_call_by_call(path, spec, tmp_path))


def _all_files() -> list[str]:
    from tests.conftest import CORPUS

    if not CORPUS.is_dir():
        return []
    return sorted(str(p.relative_to(CORPUS)) for p in CORPUS.rglob("*")
                  if p.is_file() and ".jsonl" in p.name and "ccusage" not in str(p))


@pytest.mark.slow
@pytest.mark.parametrize("preset", preset_names())
@pytest.mark.parametrize("name", _all_files(), ids=lambda n: n.rsplit("/", 1)[-1][-48:])
def test_engine_every_corpus_thread_every_preset(corpus: Path, tmp_path: Path, name: str, preset: str) -> None:
    """Every call of files up to 150 calls; on the longer ones (the claude-projects sessions of
    500-1,000 calls, where each engine call re-runs the stages over the whole session: see
    docs/engine.md) about 150 calls spread over the file, and the last ten."""
    _check(feed_call_by_call(corpus / name, load_spec(preset=preset), tmp_path, max_assembles=150))
