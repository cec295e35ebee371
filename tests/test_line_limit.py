"""Bounded memory per line (issue 23, item 6): a line longer than --max-line-bytes (default 64 MiB) is
never read whole but quarantined as `line_too_long` with its file, line number, length and first
1024 bytes; a .json document (read whole) is limited as one line; the Claude Code loader gives the
same whichever way it reads a line and makes its table (tests/test_loader_paths.py), and a run the
same in one batch and in many."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import polars as pl
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.make_hostile_inputs import MUTATIONS, Line, cc_entry, dump, mutate, render, seed_files
from ctxreplay.pipeline.commands.cli import main
from ctxreplay.pipeline.commands.clicommon import ByteSize
from ctxreplay.pipeline.loaders import load_paths
from ctxreplay.pipeline.loaders.inputs import (
    DEFAULT_MAX_LINE_BYTES,
    LONG_LINE_PREFIX,
    MAX_LINE_BYTES,
    raw_lines,
    read_lines,
)
from tests.strategies import examples
from tests.test_loader_paths import all_ways

SID = "e6000000-0000-4000-8000-000000000001"
ROOT = Path(__file__).resolve().parent.parent


@contextmanager
def line_limit(n: int) -> Iterator[None]:
    token = MAX_LINE_BYTES.set(n)
    try:
        yield
    finally:
        MAX_LINE_BYTES.reset(token)


def _line_of(n: int, sid: str = SID) -> bytes:
    """A Claude Code user line of exactly `n` bytes (without its line break)."""
    base = dump(cc_entry(sid, f"{sid[:8]}-u1", None, "user", ""))
    line = dump(cc_entry(sid, f"{sid[:8]}-u1", None, "user", "y" * (n - len(base))))
    assert len(line) == n
    return line


def _session(d: Path, n: int, sid: str = SID) -> Path:
    """A Claude Code session: a first line of `n` bytes (the long one), its answer, a second turn."""
    p = d / f"{sid}.jsonl"
    p.parent.mkdir(parents=True, exist_ok=True)
    a1 = dump(cc_entry(sid, f"{sid[:8]}-a1", f"{sid[:8]}-u1", "assistant", [{"type": "text", "text": "ok"}]))
    u2 = dump(cc_entry(sid, f"{sid[:8]}-u2", f"{sid[:8]}-a1", "user", "next"))
    a2 = dump(cc_entry(sid, f"{sid[:8]}-a2", f"{sid[:8]}-u2", "assistant", [{"type": "text", "text": "done"}]))
    p.write_bytes(b"\n".join([_line_of(n, sid), a1, u2, a2]) + b"\n")
    return p


def _both(paths: list[Path], monkeypatch: pytest.MonkeyPatch) -> Any:
    """load_paths, and the same with every line read the careful way and the table made as values."""
    return all_ways(paths, monkeypatch, str(paths))


# ---------------------------------------------------------------- the limit, both sides


@pytest.mark.parametrize("delta", [-1, 0, 1])
def test_a_line_at_the_limit_is_read_and_one_byte_more_is_quarantined(tmp_path: Path, delta: int,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    n = 5000
    p = _session(tmp_path, n)
    with line_limit(n - delta):  # the line is the limit + delta bytes long
        res = _both([p], monkeypatch)
    (ld,) = res.loads
    ld.check()
    assert ld.lines == 4 and ld.bytes == p.stat().st_size
    if delta <= 0:
        assert not res.quarantine
        assert ld.message_lines == 4
        assert pl.from_arrow(res.blocks)["text"].str.len_bytes().max() > 4000
        return
    (q,) = res.quarantine
    assert (q.file, q.line, q.code, q.line_bytes) == (str(p), 1, "line_too_long", n)
    assert q.raw.encode() == _line_of(n)[:LONG_LINE_PREFIX]  # a bounded prefix, not the line
    assert f"{n:,} bytes" in q.reason and f"limit of {n - 1:,} bytes" in q.reason and "--max-line-bytes" in q.reason
    assert ld.message_lines == 3 and res.stats["lines_too_long"] == 1
    # the rest of the session is replayed: the second turn is there
    assert "done" in pl.from_arrow(res.blocks)["text"].to_list()


def test_the_limit_counts_bytes_not_characters_and_a_line_break_is_not_part_of_it(tmp_path: Path) -> None:
    p = tmp_path / "x.jsonl"
    line = b"\xc3\xa9" * 10  # 20 bytes, 10 characters
    p.write_bytes(line + b"\r\n" + line + b"\n" + line + b"x")
    assert not read_lines(p, 21).long  # the \r counts (it is on the line), the \n does not
    got = read_lines(p, 20)
    assert [(ll.line, ll.length) for ll in got.long] == [(1, 21), (3, 21)]
    assert got.data == b"\n" + line + b"\n"


def test_long_lines_in_every_position_and_chunking(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """read_lines against the plain split, for random files and chunk sizes (the limit and the chunk
    boundaries fall anywhere in a line, at its \\n, at the end of a file without a final \\n)."""
    from ctxreplay.pipeline.loaders import inputs

    rng = random.Random(7)
    p = tmp_path / "f.jsonl"
    for _ in range(400):
        limit = rng.choice([1, 2, 5, 17, 64])
        monkeypatch.setattr(inputs, "CHUNK_BYTES", rng.choice([1, 3, 8, 1 << 20]))
        data = bytes(rng.choice(b"ab {}\r\n\n") for _ in range(rng.randint(0, 200)))
        p.write_bytes(data)
        got = read_lines(p, limit)
        lines = data.split(b"\n")
        want = [(i, len(ln), ln[:LONG_LINE_PREFIX]) for i, ln in enumerate(lines, 1) if len(ln) > limit and ln.strip()]
        assert [(ll.line, ll.length, ll.prefix) for ll in got.long] == want
        assert got.data == b"\n".join(b"" if len(ln) > limit else ln for ln in lines)
        assert got.size == len(data)
        with open(p, "rb") as fh:
            shown = list(raw_lines(fh, limit))
        whole = data.splitlines(keepends=True) if b"\r" not in data else [ln + b"\n" for ln in lines[:-1]] + (
            [lines[-1]] if lines[-1] else [])
        assert shown == [ln if len(ln.rstrip(b"\n")) <= limit else None for ln in whole]


def test_a_json_document_over_the_limit_is_quarantined_whole_unread(tmp_path: Path) -> None:
    req = {"model": "claude-x", "messages": [{"role": "user", "content": "z" * 3000}]}
    p = tmp_path / "e6000000-0000-4000-8000-000000000002.json"
    p.write_text(json.dumps(req, indent=1))  # many short lines: the limit is of the whole document
    size = p.stat().st_size
    with line_limit(size):
        assert not load_paths([p]).quarantine
    with line_limit(size - 1):
        res = load_paths([p])
    (q,) = res.quarantine
    assert (q.line, q.code, q.line_bytes) == (1, "line_too_long", size)
    assert "JSON document" in q.reason and ".json file is read whole" in q.reason
    assert q.raw == p.read_text()[:LONG_LINE_PREFIX]
    (ld,) = res.loads
    ld.check()


def test_a_gemini_cli_session_line_over_the_limit(tmp_path: Path) -> None:
    p = tmp_path / "session-2026-04-01T10-00-e6000000.jsonl"
    head = {"sessionId": "e6000000-0000-4000-8000-000000000003", "projectHash": "h", "startTime":
            "2026-04-01T10:00:00.000Z", "lastUpdated": "2026-04-01T10:00:00.000Z", "kind": "main"}
    msgs = [{"id": f"m{i}", "timestamp": "2026-04-01T10:00:01.000Z", "type": "user" if i % 2 == 0 else "gemini",
             "content": [{"text": ("w" * 4000) if i == 0 else f"t{i}"}]} for i in range(4)]
    p.write_text("\n".join(json.dumps(o) for o in [head, *msgs]) + "\n")
    with line_limit(1000):
        res = load_paths([p])
    assert [(q.line, q.code) for q in res.quarantine] == [(2, "line_too_long")]
    res.loads[0].check()


# ---------------------------------------------------------------- a huge line is never held whole


def peak_rss_run(args: list[str], cwd: Path = ROOT) -> dict[str, Any]:
    """`ctxreplay ARGS` in a fresh process: its exit status, output and peak RSS in MB, read with
    getrusage(RUSAGE_CHILDREN) in a wrapper process whose only child it is."""
    wrapper = ("import json, resource, subprocess, sys\n"
               "r = subprocess.run([sys.executable, '-m', 'ctxreplay.pipeline.commands.cli', *sys.argv[1:]],"
               " capture_output=True, text=True)\n"
               "print(json.dumps({'peak_mb': resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,"
               " 'rc': r.returncode, 'stdout': r.stdout, 'stderr': r.stderr}))\n")
    out = subprocess.run([sys.executable, "-c", wrapper, *args], capture_output=True, text=True, cwd=cwd,
                         timeout=600, check=True).stdout
    return json.loads(out)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a sparse file and ru_maxrss in KiB")
def test_a_1gb_file_of_zeros_is_quarantined_without_being_read_into_memory(tmp_path: Path) -> None:
    d = tmp_path / "in"
    d.mkdir()
    z = d / "zeros.jsonl"
    with open(z, "wb") as fh:
        fh.truncate(1 << 30)  # `truncate -s 1G`: sparse, no disk
    _session(d, 300)
    out = tmp_path / "o"
    r = peak_rss_run(["run", str(d), "--out", str(out), "--max-line-bytes", "1M", "--fast-tokens", "-q", "--json",
                      "--jobs", "1"])
    assert r["rc"] == 0, r["stderr"]
    s = json.loads(r["stdout"])
    assert s["quarantined_lines"] == 1 and s["lines"] == 5 and s["loader_stats"]["lines_too_long"] == 1
    q = pl.read_parquet(out / "quarantine.parquet")
    assert q.select("line", "code", "line_bytes").rows() == [(1, "line_too_long", 1 << 30)]
    assert q["raw"][0] == "\x00" * LONG_LINE_PREFIX
    assert Path(q["file"][0]).name == "zeros.jsonl"
    assert r["peak_mb"] < 900, f"peak RSS {r['peak_mb']:.0f} MB for a 1 GB line that is never read whole"


# ---------------------------------------------------------------- the commands' flag


def test_byte_sizes() -> None:
    size = ByteSize()
    assert [size.convert(v, None, None) for v in ("1", "4096", "64M", "64MiB", "1.5k", "2G", " 3 kb ", 7)] == [
        1, 4096, 64 << 20, 64 << 20, 1536, 2 << 30, 3072, 7]


@pytest.mark.parametrize(("value", "says"), [("0", "below 1 byte"), ("-5", "is not a size"), ("abc", "is not a size"),
                                             ("12X", "is not a size"), ("", "is not a size"), ("0.4", "below 1 byte")])
def test_a_bad_max_line_bytes_is_refused_with_a_clear_error(tmp_path: Path, value: str, says: str) -> None:
    for cmd in (["run", "--out", str(tmp_path / "o")], ["snapshot", "--golden", str(tmp_path / "g")],
                ["diff", "--golden", str(tmp_path / "g")], ["compare"]):
        r = CliRunner().invoke(main, [*cmd, str(tmp_path), "--max-line-bytes", value])
        assert r.exit_code == 2, (cmd, r.output)
        assert "--max-line-bytes" in r.output and says in r.output and "e.g. 64M" in r.output, r.output
        assert "Traceback" not in r.output
    assert not (tmp_path / "o").exists() and not (tmp_path / "g").exists()


def test_run_with_max_line_bytes_quarantines_and_the_default_reads(tmp_path: Path) -> None:
    _session(tmp_path / "in", 5000)
    r = CliRunner().invoke(main, ["run", str(tmp_path / "in"), "--out", str(tmp_path / "o"), "--fast-tokens", "-q",
                                  "--json", "--max-line-bytes", "4K"])
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout)
    assert (s["lines"], s["quarantined_lines"], s["loader_stats"]["lines_too_long"]) == (4, 1, 1)
    q = pl.read_parquet(tmp_path / "o" / "quarantine.parquet")
    assert q.select("line", "code", "line_bytes").rows() == [(1, "line_too_long", 5000)]
    assert MAX_LINE_BYTES.get() == DEFAULT_MAX_LINE_BYTES  # the command's setting does not leak
    # a re-run with another limit does not reuse the previous run's outputs
    r = CliRunner().invoke(main, ["run", str(tmp_path / "in"), "--out", str(tmp_path / "o"), "--fast-tokens", "-q",
                                  "--json"])
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout)
    assert s["quarantined_lines"] == 0 and "max_line_bytes" in s["groups"]["not_reused_because"]


def test_worker_processes_take_the_commands_limit(tmp_path: Path) -> None:
    for k in range(3):
        _session(tmp_path / "in" / f"s{k}", 5000, sid=f"e6000000-0000-4000-8000-00000000001{k}")
    r = CliRunner().invoke(main, ["run", str(tmp_path / "in"), "--out", str(tmp_path / "o"), "--fast-tokens", "-q",
                                  "--json", "--max-line-bytes", "4K", "--jobs", "2", "--batch-bytes", "1"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["quarantined_lines"] == 3


# ---------------------------------------------------------------- both loaders, hostile inputs, any limit


CC_SEEDS = [s for s in seed_files() if s.fmt == "claude_code"]


@settings(max_examples=examples(30), deadline=None, suppress_health_check=[
    HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture])
@given(st.randoms(use_true_random=False), st.integers(100, 4000))
def test_mutated_files_under_a_line_limit_load_the_same_every_way(
        tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch, rng: random.Random,
        limit: int) -> None:
    """The hostile mutations of the fixture sessions, under a limit that sends some of their lines over
    it (in any position: a message, its answer, a line cut short): the plain and the careful way, the
    gathered table and the one made as values agree, line for line."""
    d = tmp_path_factory.mktemp("lim")
    names = sorted(MUTATIONS)
    for k in range(rng.randint(1, 3)):
        seed = rng.choice(CC_SEEDS)
        lines: list[Line] = mutate(seed, [rng.choice(names) for _ in range(rng.randint(0, 3))], rng)
        p = d / f"f{k}" / seed.name
        p.parent.mkdir(parents=True)
        p.write_bytes(render(lines))
    with line_limit(limit):
        res = _both([d], monkeypatch)
    for ld in res.loads:
        ld.check()
        for q in ld.quarantine:
            if q.code == "line_too_long":
                assert q.line_bytes is not None and q.line_bytes > limit and len(q.raw.encode()) <= LONG_LINE_PREFIX


def test_the_hostile_set_with_a_line_limit_is_the_same_in_one_batch_and_in_many(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from bench.make_hostile_inputs import write_hostile_inputs

    write_hostile_inputs(tmp_path / "h", huge_mb=0.3)  # its huge line (0.3 MB) and a sparse file of zeros

    def run(out: Path, *extra: str) -> tuple[Any, ...]:
        r = CliRunner().invoke(main, ["run", str(tmp_path / "h"), "--out", str(out), "--json", "--fast-tokens", "-q",
                                      "--jobs", "1", "--max-line-bytes", "64K", *extra])
        assert r.exit_code == 0, r.output
        s = json.loads(r.stdout)
        q = pl.read_parquet(out / "quarantine.parquet").select("file", "line", "code", "line_bytes").sort("file", "line")
        calls = pl.read_parquet(out / "calls.parquet").select("session_id", "thread_id", "call", "request_sha256").sort(
            "session_id", "thread_id", "call")
        return ({k: s[k] for k in ("files", "lines", "message_lines", "other_lines", "quarantined_lines", "threads",
                                   "calls", "skipped_files", "loader_stats")}, q.rows(), calls.rows())

    big = run(tmp_path / "big", "--batch-bytes", str(1 << 30))
    small = run(tmp_path / "small", "--batch-bytes", "20000")
    assert big == small
    too_long = {(Path(f).name, n) for f, _, c, n in big[1] if c == "line_too_long"}
    assert ("zeros.jsonl", int(0.3 * 1024 * 1024)) in too_long
    assert any(n and n > 300_000 for _, n in too_long)


def test_memory_bench_cases() -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    import bench_memory

    assert [c.name for c in bench_memory.line_cases(quick=True)] == ["line 20 MB", "line 50 MB",
                                                                     "zeros 1 GB, no line break"]
    cases = {c.name: c for c in bench_memory.line_cases()}
    assert cases["line 200 MB"].bound_mb() == 4 * 200 + bench_memory.BATCH_BUDGET_MB
    assert cases["zeros 1 GB, no line break"].bound_mb() == bench_memory.BATCH_BUDGET_MB  # never read


def test_a_big_text_is_counted_as_a_small_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """Texts over tokens.BIG_TEXT_CHARS are counted into a NumPy array (no Python int per token): the
    same counts, special tokens read as text and lone surrogates replaced as before."""
    from ctxreplay.pipeline.core import tokens

    texts = ["hello <|endoftext|> world", "é naïve \ud800 日本語 <|fim_prefix|>", "line of the big file\n" * 5000, "", "x"]
    small = tokens.tiktoken_counts(texts)
    monkeypatch.setattr(tokens, "BIG_TEXT_CHARS", 0)
    assert tokens.tiktoken_counts(texts) == small
    assert small[0] == len(tokens.load_o200k().encode_ordinary(texts[0]))


@pytest.mark.parametrize("given", [None, "10"])
def test_the_command_line_makes_arrows_allocator_give_memory_back(given: str | None) -> None:
    """Importing the command line sets MIMALLOC_PURGE_DELAY=0 before pyarrow is imported (freed Arrow
    memory goes back to the system at once: a big line's run peaked up to 0.14 GB higher without it),
    unless the environment sets it already."""
    env = {k: v for k, v in os.environ.items() if k != "MIMALLOC_PURGE_DELAY"}
    if given is not None:
        env["MIMALLOC_PURGE_DELAY"] = given
    code = ("import sys, os, ctxreplay.pipeline.commands.cli; "
            "print(os.environ['MIMALLOC_PURGE_DELAY'], 'pyarrow' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert out.split() == [given or "0", "False"]


def test_outputs_keep_no_statistics_of_free_text_columns(tmp_path: Path) -> None:
    """Parquet min / max statistics are written for keys and numbers, not for free-text columns (a
    block's text, a line, a message's canonical JSON): computing them copied a 200 MB text twice
    more while it was written; nor a dictionary for the texts (dropped past 1 MB after a copy of a
    long text), but for raw_line, whose dictionary holds a line once. The values are the same."""
    from ctxreplay.pipeline.batch.batchout import NO_STATISTICS

    out = tmp_path / "o"
    r = CliRunner().invoke(main, ["run", str(ROOT / "data" / "samples"), "--out", str(out), "-q", "--fast-tokens"])
    assert r.exit_code == 0, r.output
    seen = set()
    for name in ("blocks", "messages", "quarantine", "decisions"):
        md = pq.ParquetFile(out / f"{name}.parquet").metadata
        if not md.num_row_groups:
            continue
        rg = md.row_group(0)
        for i in range(rg.num_columns):
            col = rg.column(i)
            top = col.path_in_schema.split(".")[0]
            assert col.is_stats_set == (top not in NO_STATISTICS), (name, top)
            if top in ("text", "canonical_json", "raw_line"):  # the shared line stays a dictionary, texts do not
                assert any("DICTIONARY" in e for e in col.encodings) == (top == "raw_line"), (name, top, col.encodings)
            seen.add(top)
    assert {"text", "raw_line", "canonical_json", "session_id", "first_call"} <= seen


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ru_maxrss in KiB")
def test_a_runs_peak_grows_by_few_copies_of_the_longest_line_read(tmp_path: Path) -> None:
    """Issue 23, item 6: a whole run's peak memory grows by at most 6 copies of the longest line it
    reads (the bound of bench/bench_memory.py is 4 copies + a batch's budget): runs reading a 20 MB and
    an 80 MB tool result (tiktoken, --jobs 1) differ by under 6 x 60 MB. Before, they took about 10 more
    copies per MB of line (a 50 MB line peaked at 0.89 GB, 200 MB at 2.4 GB); now about 5."""
    sys.path.insert(0, str(ROOT / "bench"))
    import bench_memory

    peaks = {}
    for mb in (20, 80):
        d = tmp_path / f"in{mb}"
        bench_memory.tool_result_session(d, mb)
        r = peak_rss_run(["run", str(d), "--out", str(tmp_path / f"o{mb}"), "--max-line-bytes", "128M", "-q",
                          "--jobs", "1"])
        assert r["rc"] == 0, r["stderr"]
        peaks[mb] = r["peak_mb"]
    per_mb = (peaks[80] - peaks[20]) / 60
    assert per_mb < 6, f"{per_mb:.1f} MB of peak per MB of line ({peaks})"
