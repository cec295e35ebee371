"""Fuzzing the loaders: mutated transcript lines never make `load_paths` raise, every line is
accounted for, and each kind of damage gets its own quarantine code.

Seeds are the small files of tests/fixtures/loaders (written for these tests) and, in the
corpus-marked tests, windows of real lines read from ../shared/corpus at test time. The mutations
(bench/make_hostile_inputs.py) truncate lines, flip and drop fields, insert bytes that are not
UTF-8, glue lines, duplicate ids, make parent cycles, huge strings, deep nesting, usage numbers out
of range, odd timestamps and tool inputs that are not objects.

The long run: `CTXREPLAY_FUZZ_EXAMPLES=20000 pytest -m slow tests/test_fuzz_loaders.py -k long`
(counts to the file named by CTXREPLAY_FUZZ_REPORT, when set, every 500 examples and at the end;
CTXREPLAY_FUZZ_SECONDS bounds the wall-clock time, CTXREPLAY_FUZZ_CLI_EVERY how often the CLI runs).
"""

from __future__ import annotations

import base64
import copy
import json
import os
import random
import shutil
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import polars as pl
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.make_hostile_inputs import (
    EXPECTED_CODE,
    KEPT,
    MUTATIONS,
    PARSED,
    WEIRD_VALUES,
    Line,
    Seed,
    corpus_seeds,
    mutate,
    paths_in,
    render,
    seed_files,
)
from ctxreplay.pipeline.loaders import LoadResult, load_paths
from ctxreplay.pipeline.loaders.base import QUARANTINE_CODES
from ctxreplay.schemas.blocks import BLOCKS
from ctxreplay.schemas.check import check_frame

ROOT = Path(__file__).resolve().parent.parent
SEEDS = seed_files()
PARSE_CODES = {"invalid_utf8", "truncated_json", "invalid_json", "too_deep"}
NAMES = sorted(MUTATIONS)


def nonblank(data: bytes) -> int:
    """Lines the loaders must count: not blank once decoded (bytes that are not UTF-8 never are)."""
    lines = data.split(b"\n")
    if lines and lines[0].startswith(b"\xef\xbb\xbf"):
        lines[0] = lines[0][3:] or b" "  # a BOM alone: the loaders skip it; whitespace here
    return sum(1 for ln in lines if ln.decode("utf-8", "replace").strip())


def load_files(d: Path, files: list[tuple[str, list[Line]]]) -> tuple[LoadResult, dict[str, list[Line]]]:
    written: dict[str, list[Line]] = {}
    for k, (name, lines) in enumerate(files):
        p = d / f"f{k}" / name
        p.parent.mkdir(parents=True)
        p.write_bytes(render(lines))
        written[str(p)] = lines
    return load_paths([d]), written


def check(res: LoadResult, written: dict[str, list[Line]], counts: Counter[str] | None = None) -> None:
    """Invariants of any load, and the expectations the mutations recorded."""
    by_path = {ld.path: ld for ld in res.loads}
    for path, lines in written.items():
        ld = by_path.get(path)
        data = Path(path).read_bytes()
        if ld is None:  # a file no loader took: only a file of blank lines
            assert nonblank(data) == 0, path
            continue
        ld.check()  # message + other + quarantined == lines
        assert ld.lines == nonblank(data), (path, ld.lines, nonblank(data))
        q = {r.line: r for r in ld.quarantine}
        for r in ld.quarantine:
            assert r.code in QUARANTINE_CODES and r.reason, r
            assert r.raw.encode("utf-8")  # displayable (no lone surrogates)
            if r.raw_base64 is not None:
                assert r.code == "invalid_utf8"
                assert base64.b64decode(r.raw_base64) == data.split(b"\n")[r.line - 1]  # lossless
        if counts is not None:
            counts["lines"] += ld.lines
            counts["quarantined"] += ld.quarantined_lines
            counts.update(f"code:{r.code}" for r in ld.quarantine)
        if ld.format == "unknown":  # the damage hid what the file is: every line kept in quarantine
            assert set(q) == {i for i, ln in enumerate(lines, 1) if ln.data.decode("utf-8", "replace").strip()}
            assert {r.code for r in ld.quarantine} <= {"unknown_format", "invalid_utf8", "truncated_json",
                                                       "invalid_json", "too_deep"}
            continue
        dup_file = ld.other_lines.get("duplicate_entry", 0) == ld.lines - ld.quarantined_lines and ld.lines
        for i, ln in enumerate(lines, 1):
            if ln.expect == KEPT:
                assert i not in q, (path, i, q[i].code, q[i].reason)
            elif ln.expect == PARSED:
                assert i not in q or q[i].code not in PARSE_CODES, (path, i, q[i].code, q[i].reason)
            elif ln.expect is not None and not dup_file:
                assert i in q and q[i].code == ln.expect, (path, i, ln.expect, q.get(i))
    blocks = pl.from_arrow(res.blocks)
    assert isinstance(blocks, pl.DataFrame)
    check_frame(blocks, BLOCKS, where="fuzzed load")
    # two threads never share a name; usage stays a plain count
    ids = blocks.select("session_id", "thread_id", "entry_id", "block_pos", "part_pos").unique()
    assert ids.height == blocks.height
    for c in ("usage_input", "usage_output", "usage_cache_read", "usage_cache_write"):
        assert blocks.get_column(c).drop_nulls().abs().max() is None or blocks[c].abs().max() < 2**63  # type: ignore[operator]


def run_case(files: list[tuple[str, list[Line]]], counts: Counter[str] | None = None) -> LoadResult:
    with tempfile.TemporaryDirectory() as d:
        res, written = load_files(Path(d), files)
        check(res, written, counts)
        return res


# ---------------------------------------------------------------- one class at a time


def test_each_damage_class_gets_its_own_code() -> None:
    assert len(set(EXPECTED_CODE.values())) == len(EXPECTED_CODE)
    seen: dict[str, set[str]] = {name: set() for name in EXPECTED_CODE}
    for name, code in EXPECTED_CODE.items():
        for seed in SEEDS:
            for k in range(4):
                lines = mutate(seed, [name], random.Random(k))
                res = run_case([(seed.name, lines)])
                marked = [i for i, ln in enumerate(lines, 1) if ln.expect == code]
                got = {r.line: r.code for r in res.quarantine}
                seen[name].update(got[i] for i in marked if i in got)
    assert {name: sorted(codes) for name, codes in seen.items()} == {
        name: [code] for name, code in EXPECTED_CODE.items()}


@pytest.mark.parametrize("name", NAMES)
def test_every_mutation_class_loads_on_every_seed(name: str) -> None:
    for seed in SEEDS:
        for k in range(8):
            run_case([(seed.name, mutate(seed, [name], random.Random(k)))])


def test_kept_damage_is_counted() -> None:
    """Bytes that are not UTF-8 inside a string, and lone surrogate escapes: the entry is kept,
    with U+FFFD in place of the bad bytes, and the replacements are counted."""
    seed = next(s for s in SEEDS if s.fmt == "claude_code")
    for name, stat in (("non_utf8_in_string", "invalid_utf8_replaced"), ("surrogate_escape", "lone_surrogates_replaced")):
        lines = mutate(seed, [name], random.Random(3))
        res = run_case([(seed.name, lines)])
        assert res.stats.get(stat, 0) >= 1, (name, res.stats)
        assert not res.quarantine
        assert res.blocks.num_rows


# ---------------------------------------------------------------- hypothesis


MUTATED: Counter[str] = Counter()  # mutation classes applied by fuzz_files (for the long run's report)


def fuzz_files(seeds: list[Seed], max_files: int = 1) -> st.SearchStrategy[list[tuple[str, list[Line]]]]:
    """1..max_files files, each a seed with 1-4 mutations. Seeds and classes are drawn uniformly from
    a hypothesis-controlled random stream (hypothesis alone favours the first of a list)."""
    @st.composite
    def case(draw: Any) -> list[tuple[str, list[Line]]]:
        rng = draw(st.randoms(use_true_random=False))
        out: list[tuple[str, list[Line]]] = []
        for _ in range(rng.randint(1, max_files)):
            seed = rng.choice(seeds)
            names = [rng.choice(NAMES) for _ in range(rng.randint(1, 4))]
            MUTATED.update(names)
            out.append((seed.name, mutate(seed, names, rng)))
        return out
    return case()


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(fuzz_files(SEEDS))
def test_fuzz_fixture_lines(files: list[tuple[str, list[Line]]]) -> None:
    run_case(files)


REQUEST = json.loads((ROOT / "tests" / "fixtures" / "loaders" / "request" /
                      "7e8f9a0b-1c2d-4e3f-8a4b-5c6d7e8f9a0b.json").read_text())


@settings(deadline=None)
@given(st.randoms(use_true_random=False), st.sampled_from(["anthropic", "openai"]))
def test_fuzz_request_documents(rng: random.Random, flavour: str) -> None:
    """A request JSON document with values flipped, dropped or made hostile anywhere."""
    doc = json.loads(json.dumps(REQUEST))
    if flavour == "openai":
        doc = {"model": "gpt-5", "messages": [
            {"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "text", "text": "q"}]},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "r"}, {"role": "assistant", "content": "done"}]}
    for _ in range(rng.randint(1, 4)):
        spots = paths_in(doc)
        if not spots:
            break
        c, k = rng.choice(spots)
        if rng.random() < 0.3:
            del c[k]
        else:
            c[k] = copy.deepcopy(rng.choice([*WEIRD_VALUES, '{"a":' * 300 + "1" + "}" * 300, [[[[[[]]]]]]]))
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "7e8f9a0b-1c2d-4e3f-8a4b-5c6d7e8f9a0b.json"
        p.write_bytes(json.dumps(doc, ensure_ascii=False, indent=rng.choice([None, 2])).encode("utf-8", "surrogatepass"))
        res = load_paths([p])
        for ld in res.loads:
            ld.check()
        check_frame(pl.from_arrow(res.blocks), BLOCKS, where="fuzzed request")  # type: ignore[arg-type]


@pytest.mark.corpus
def test_fuzz_corpus_lines(corpus: Path) -> None:
    seeds = corpus_seeds(corpus, random.Random(7), window=25)

    @settings(max_examples=60, deadline=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(fuzz_files(seeds))
    def inner(files: list[tuple[str, list[Line]]]) -> None:
        run_case(files)

    inner()


# ---------------------------------------------------------------- the long run


@pytest.mark.slow
@pytest.mark.corpus
def test_fuzz_long(corpus: Path) -> None:
    """Many examples over fixture and corpus seeds, several files at once (copies of one session
    included); every CTXREPLAY_FUZZ_CLI_EVERY-th example (default 50) also runs `ctxreplay run`
    on the fuzzed files (its failures are collected and reported at the end, not shrunk)."""
    from click.testing import CliRunner

    from ctxreplay.pipeline.commands.cli import main

    examples = int(os.environ.get("CTXREPLAY_FUZZ_EXAMPLES", "2000"))
    cli_every = int(os.environ.get("CTXREPLAY_FUZZ_CLI_EVERY", "50"))
    # optional wall-clock budget: examples after it do nothing (hypothesis cannot stop early)
    deadline = time.monotonic() + float(os.environ.get("CTXREPLAY_FUZZ_SECONDS", "inf"))
    report_path = os.environ.get("CTXREPLAY_FUZZ_REPORT")
    seeds = SEEDS + corpus_seeds(corpus, random.Random(11), window=40)
    counts: Counter[str] = Counter()
    cli_failures: list[str] = []

    @settings(max_examples=examples, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(fuzz_files(seeds, max_files=3))
    def inner(files: list[tuple[str, list[Line]]]) -> None:
        if time.monotonic() > deadline:
            return
        counts["examples"] += 1
        if report_path and counts["examples"] % 500 == 0:  # a partial report, in case the run is cut
            Path(report_path).write_text(json.dumps({"partial": True, "counts": dict(sorted(counts.items())),
                                                     "cli_failures": cli_failures}, indent=1) + "\n")
        rng = random.Random(counts["examples"])  # not hypothesis's: drawing late can end an example
        counts["files"] += len(files)
        with tempfile.TemporaryDirectory() as d:
            res, written = load_files(Path(d), files)
            check(res, written, counts)
            counts.update(f"stat:{k}" for k, v in res.stats.items() if v)
            if cli_every and counts["examples"] % cli_every == 0:
                out = Path(d) / "out"
                args = ["run", str(Path(d)), "--out", str(out), "--fast-tokens", "-q",
                        "--preset", rng.choice(["identity", "default"]),
                        "--target", rng.choice(["anthropic", "openai-chat", "openai-responses", "gemini"])]
                r = CliRunner().invoke(main, args)
                counts["cli_runs"] += 1
                if r.exit_code not in (0, 1) or "Traceback" in r.output:
                    kept = Path(os.environ.get("CTXREPLAY_FUZZ_KEEP", tempfile.gettempdir())) / (
                        f"fuzz-cli-{len(cli_failures)}")
                    shutil.copytree(d, kept, dirs_exist_ok=True, ignore=shutil.ignore_patterns("out"))
                    cli_failures.append(f"{' '.join(args[3:])} -> exit {r.exit_code}: "
                                        f"{(r.output or repr(r.exception))[-300:]} (inputs kept in {kept})")

    MUTATED.clear()
    inner()
    counts.update({f"mutation:{k}": v for k, v in MUTATED.items()})
    counts["cli_failures"] = len(cli_failures)
    report = {"counts": dict(sorted(counts.items())), "cli_failures": cli_failures}
    print(json.dumps(report, indent=1))
    if report_path:
        Path(report_path).write_text(json.dumps(report, indent=1) + "\n")
    assert counts["examples"] >= min(examples, 100)
    assert not cli_failures, cli_failures[:5]
