"""The columnar Claude Code loader (the default engine of `load_paths`) against the reference one.

`load_paths(..., engine="reference")` is the row-by-row loader this project shipped first
(`claude_code.load_session` + `threads_to_blocks`), kept as the specification. For every input
both must give the same blocks table (same rows in the same order, every column equal) and the
same accounting (per file: lines, message and other lines by kind, quarantine rows with their
codes and raw bytes, recovered notes, loader stats, in order; skipped files; thread count).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.make_hostile_inputs import (
    MUTATIONS,
    Line,
    cc_entry,
    corpus_seeds,
    mutate,
    render,
    seed_files,
    write_hostile_inputs,
)
from ctxreplay.pipeline.loaders import LoadResult, cc_columnar, load_paths
from tests.strategies import examples

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "data" / "samples"
FIXTURES = ROOT / "tests" / "fixtures" / "loaders"
SID = "c01c0000-0000-4000-8000-000000000001"
ACCOUNTING = ("path", "format", "sha256", "bytes", "lines", "message_lines", "other_lines", "quarantine",
              "recovered", "stats")


@pytest.fixture(autouse=True)
def _columnar_for_small_inputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The inputs here are small: without this, `load_paths` would load them with the reference
    loader (cc_columnar.SMALL_BATCH_BYTES) and these tests would compare it with itself."""
    monkeypatch.setattr(cc_columnar, "SMALL_BATCH_BYTES", 0)


def assert_same_load(ref: LoadResult, new: LoadResult, where: str = "") -> None:
    """Both engines' results are the same, table for table and line for line."""
    a, b = ref.blocks, new.blocks
    assert a.schema.equals(b.schema, check_metadata=True), where
    assert a.num_rows == b.num_rows, (where, a.num_rows, b.num_rows)
    for f in a.schema:
        x, y = a.column(f.name).combine_chunks(), b.column(f.name).combine_chunks()
        if not x.equals(y):
            xl, yl = x.to_pylist(), y.to_pylist()
            i = next(i for i in range(len(xl)) if xl[i] != yl[i])
            raise AssertionError(f"{where}: column {f.name} differs first at row {i}: {xl[i]!r} != {yl[i]!r}")
    assert [ld.path for ld in ref.loads] == [ld.path for ld in new.loads], where
    for la, lb in zip(ref.loads, new.loads, strict=True):
        for k in ACCOUNTING:
            va, vb = getattr(la, k), getattr(lb, k)
            if k in ("other_lines", "stats"):
                va, vb = dict(va), dict(vb)
            assert va == vb, (where, la.path, k, va, vb)
    assert ref.skipped == new.skipped, where
    assert ref.stats == new.stats, where
    assert ref.threads == new.threads, where


def both(paths: list[Path], where: str = "") -> LoadResult:
    new = load_paths(paths)
    assert_same_load(load_paths(paths, engine="reference"), new, where or str(paths))
    return new


def _columnar_only(paths: list[Path]) -> cc_columnar.SessionsLoad:
    """The columnar loader without the fallback (to prove it, not the reference, did the work)."""
    from ctxreplay.pipeline.loaders import _first_objects, discover
    from ctxreplay.pipeline.loaders.claude_code import group_sessions, sniff

    files, _ = discover(paths)
    first = {f: _first_objects(f) for f in files}
    cc_files = [f for f in files if sniff(first[f], f)]
    return cc_columnar.load_sessions(group_sessions(cc_files, first), [])


# ---------------------------------------------------------------- shipped inputs


def test_samples_and_fixtures_are_identical() -> None:
    both([SAMPLES], "samples")
    for d in sorted(p for p in FIXTURES.iterdir() if p.is_dir()):
        both([d], d.name)
    both([FIXTURES], "all fixtures together")


def test_the_fast_path_takes_the_sample_lines() -> None:
    """The columnar loader reads the sample's lines itself (none through the careful path), so the
    identity above is the columnar code's, not the fallback's."""
    res = _columnar_only([SAMPLES / "claude-projects"])
    assert not res.batch.slow_msgs
    assert res.blocks().num_rows == load_paths([SAMPLES / "claude-projects"], engine="reference").blocks.num_rows


@pytest.mark.corpus
def test_corpus_is_identical(corpus: Path) -> None:
    both([corpus], "corpus")
    for sub in sorted(p for p in corpus.iterdir() if p.is_dir()):
        both([sub], sub.name)


@pytest.mark.slow
@pytest.mark.corpus
def test_hostile_directory_is_identical(corpus: Path, tmp_path: Path) -> None:
    write_hostile_inputs(tmp_path / "h", huge_mb=0, corpus=corpus)
    both([tmp_path / "h"], "hostile directory")
    for part in sorted(p for p in (tmp_path / "h").iterdir() if p.is_dir()):
        both([part], part.name)


def test_hostile_directory_without_corpus_is_identical(tmp_path: Path) -> None:
    write_hostile_inputs(tmp_path / "h", huge_mb=0)
    both([tmp_path / "h"], "hostile directory")


# ---------------------------------------------------------------- lines the fast path must not take


def _session(tmp_path: Path, lines: list[bytes | str | dict[str, Any]], name: str = SID) -> Path:
    d = tmp_path / "proj"
    d.mkdir(exist_ok=True)
    p = d / f"{name}.jsonl"
    out = b""
    for ln in lines:
        if isinstance(ln, dict):
            ln = json.dumps(ln, ensure_ascii=False)
        out += (ln.encode("utf-8", "surrogatepass") if isinstance(ln, str) else ln) + b"\n"
    p.write_bytes(out)
    return p


def _u(uuid: str, parent: str | None, content: Any, **kw: Any) -> dict[str, Any]:
    return cc_entry(SID, uuid, parent, "user", content, **kw)


def _a(uuid: str, parent: str | None, content: Any, **kw: Any) -> dict[str, Any]:
    return cc_entry(SID, uuid, parent, "assistant", content, **kw)


def _base() -> list[dict[str, Any]]:
    return [_u("u1", None, "hello"), _a("a1", "u1", [{"type": "text", "text": "hi"}])]


EDGE_LINES: dict[str, list[bytes | str]] = {
    # the SQL JSON reader is lenient where orjson is not: these lines are quarantined by both engines
    "trailing comma": [(b'{"type":"user","uuid":"x1","parentUuid":"a1","message":{"role":"user","content":"a",},'
                        b'"timestamp":"2026-04-01T10:00:01.000Z"}')],
    "trailing comma in list": [(b'{"type":"user","uuid":"x1","parentUuid":"a1","message":{"role":"user","content":'
                                b'[{"type":"text","text":"a"},]}}')],
    "NaN": [b'{"type":"user","uuid":"x1","parentUuid":"a1","message":{"role":"user","content":"a"},"n":NaN}'],
    "Infinity": [b'{"type":"progress","uuid":"x1","parentUuid":"a1","data":{"type":"x","v":-Infinity}}'],
    "inf": [b'{"type":"progress","uuid":"x1","parentUuid":"a1","data":{"type":"x","v":inf}}'],
    "1e400 outside what is read": [(b'{"type":"user","uuid":"x1","parentUuid":"a1","message":{"role":"user",'
                                    b'"content":"a"},"toolUseResult":{"v":1e400}}')],
    "1e400 in usage": [json.dumps(_a("x1", "a1", [{"type": "text", "text": "b"}])).replace('"output_tokens": 7',
                                                                                          '"output_tokens": 1e400')],
    "1e400 in a tool input": [(b'{"type":"assistant","uuid":"x1","parentUuid":"a1","requestId":"r9","message":{"id":'
                               b'"m9","role":"assistant","content":[{"type":"tool_use","id":"t9","name":"Bash",'
                               b'"input":{"n":1e400}}]}}')],
    "big integers": [json.dumps(_a("x1", "a1", [{"type": "tool_use", "id": "t1", "name": "B",
                                                  "input": {"n": 2**70, "m": -(2**64)}}]))
                     .replace('"output_tokens": 7', '"output_tokens": 18446744073709551616')],
    # numbers the SQL reader takes and orjson does not (beyond a double): read as the reference reads them
    # (issue 23, item 7: a batch of 8 MiB, the columnar path, stopped on `"timestamp": 1e400`)
    "numbers beyond a double as timestamps": [
        json.dumps((_u if i % 2 else _a)(f"x{i}", "a1" if i == 0 else f"x{i - 1}", "t" if i % 2 else [
            {"type": "text", "text": "t"}], timestamp=0)).replace('"timestamp": 0', f'"timestamp": {v}')
        for i, v in enumerate(["1e400", "-1e400", "1e-400", "1" + "0" * 400, "2e308", "1" + "0" * 30 + "e300",
                               "1e400", "-0.0e999", "1.5e-320"])],
    "a number beyond a double in a message field": [
        json.dumps(_u("x1", "a1", "n")).replace('"isSidechain": false', '"isSidechain": false, "n": 1e400'),
        json.dumps(_a("x2", "x1", [{"type": "text", "text": "n", "n": 1e400}])).replace("Infinity", "1e400"),
        json.dumps(_a("x3", "x2", [{"type": "tool_use", "id": "t", "name": "B", "input": {}}])).replace(
            '"input": {}', '"input": {"a": 1e400, "b": -1e400}')],
    "floats in usage": [json.dumps(_a("x1", "a1", [{"type": "text", "text": "b"}])).replace(
        '"output_tokens": 7', '"output_tokens": 7.9')],
    "duplicate top-level key": [(b'{"type":"user","uuid":"x1","uuid":"x2","parentUuid":"a1","message":'
                                 b'{"role":"user","content":"a"}}')],
    "duplicate message key": [(b'{"type":"user","uuid":"x1","parentUuid":"a1","message":{"role":"user",'
                               b'"content":"a","content":"b"}}')],
    "duplicate block key": [(b'{"type":"user","uuid":"x1","parentUuid":"a1","message":{"role":"user",'
                             b'"content":[{"type":"text","text":"a","text":"b"}]}}')],
    "duplicate usage key": [json.dumps(_a("x1", "a1", [{"type": "text", "text": "b"}])).replace(
        '"output_tokens": 7', '"output_tokens": 7, "output_tokens": 9')],
    "duplicate data.type": [b'{"type":"progress","uuid":"x1","parentUuid":"a1","data":{"type":"a","type":"b"}}'],
    "duplicate key in a part": [json.dumps(_u("x1", "a1", [{"type": "tool_result", "tool_use_id": "t",
                                                             "content": [{"type": "text", "text": "a"}]}]))
                                .replace('"text": "a"', '"text": "a", "text": "z"')],
    "duplicate key in a tool input": [(b'{"type":"assistant","uuid":"x1","parentUuid":"a1","requestId":"r9",'
                                       b'"message":{"id":"m9","role":"assistant","content":[{"type":"tool_use",'
                                       b'"id":"t9","name":"B","input":{"k":1,"k":2}}]}}')],
    "lone surrogate escape": [(b'{"type":"user","uuid":"x1","parentUuid":"a1","message":{"role":"user",'
                               b'"content":"a\\ud800b"}}')],
    "escaped surrogate pair": [(b'{"type":"user","uuid":"x1","parentUuid":"a1","message":{"role":"user",'
                                b'"content":"a\\ud83d\\ude00b"}}')],
    "control characters": [json.dumps(_u("x1", "a1", "esc \x1b[1m bold \x0b\x1f \x7f end"))],
    "escaped slash and unicode": [(b'{"type":"user","uuid":"x1","parentUuid":"a1","message":{"role":"user",'
                                   b'"content":"a\\/b \\u00e9 \\u0000"}}')],
    "whitespace between tokens": [(b'{ "type" : "user" , "uuid" : "x1" , "parentUuid" : "a1" , "message" : '
                                   b'{ "role" : "user" , "content" : [ { "type" : "text" , "text" : "a" } ] } }')],
    "CRLF": [json.dumps(_u("x1", "a1", "crlf")).encode() + b"\r"],
    "non-string fields": [json.dumps(_u("x1", "a1", [{"type": "text", "text": 5}])),
                          json.dumps(_a("x2", "x1", [{"type": "thinking", "thinking": "t", "signature": 7}]))],
    "non-bool flags": [json.dumps(_u("x1", "a1", "flags", isSidechain="yes", isMeta=1))],
    "non-string ids": [json.dumps(_u("x1", "a1", "ids", requestId=5)),
                       json.dumps(_a("x2", "x1", [{"type": "text", "text": "b"}], mid=7))],
    "odd timestamps": [json.dumps(_u(f"x{i}", "a1" if i == 0 else f"x{i - 1}", "t", timestamp=ts))
                       for i, ts in enumerate(["2026-04-01T10:00:00Z", "2026-04-01T10:00:00.123456Z",
                                               "2026-02-30T10:00:00.000Z", "2026-04-01 10:00:00.000Z",
                                               "2026-04-01T10:00:00.000+02:00", 1775037600000, "", None, True,
                                               "0999-01-01T00:00:00.000Z", "2026-04-01T24:00:00.000Z"])],
    "unknown block types": [json.dumps(_a("x1", "a1", [{"type": "document", "source": {"type": "text"}},
                                                         {"type": "server_tool_use", "id": "s1", "name": "web"},
                                                         {"type": "redacted_thinking", "data": "xx", "k": [1]},
                                                         {"no_type": 1}, "a string block", 5, None]))],
    "images": [json.dumps(_u("x1", "a1", [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}},
        {"type": "image", "source": {"type": "url", "url": "https://x"}},
        {"type": "image", "source": "not an object"}, {"type": "image"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}},
        {"type": "tool_result", "tool_use_id": "t", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg", "data": "/9j/4AAQ"}},
            {"type": "tool_reference", "tool_name": "Grep"}, {"type": "other", "x": 1}, "plain", 3, None,
            {"type": "text", "text": "t"}]}]))],
    "tool results": [json.dumps(_u("x1", "a1", [{"type": "tool_result", "tool_use_id": "t1", "content": "s"},
                                                {"type": "tool_result", "tool_use_id": "t2", "content": []},
                                                {"type": "tool_result", "tool_use_id": "t3", "is_error": True},
                                                {"type": "tool_result", "tool_use_id": "", "content": {"a": 1}},
                                                {"type": "tool_result", "tool_use_id": 5, "content": 7}]))],
    # no `content` key at all, on a line the fast path takes (the case above goes the careful way)
    "tool result without content": [
        json.dumps(_a("c1", "a1", [{"type": "tool_use", "id": "t3", "name": "B", "input": {}},
                                   {"type": "tool_use", "id": "t4", "name": "B", "input": {}}])),
        json.dumps(_u("x1", "c1", [{"type": "tool_result", "tool_use_id": "t3", "is_error": False}])),
        json.dumps(_u("x2", "x1", [{"type": "tool_result", "tool_use_id": "t4"}, {"type": "text", "text": "and"}]))],
    "extra keys": [json.dumps(_a("x1", "a1", [{"type": "text", "text": "a", "citations": None, "cache_control": {
        "type": "ephemeral"}}, {"type": "tool_use", "id": "t1", "name": "B", "input": None, "caller": {
            "type": "direct"}}, {"type": "tool_use", "id": "t2", "name": "B"}]))],
    "message shapes": [json.dumps({"type": "user", "uuid": "x1", "parentUuid": "a1", "message": {}}),
                       json.dumps({"type": "user", "uuid": "x2", "parentUuid": "x1", "message": {"role": ""}}),
                       json.dumps({"type": "user", "uuid": "x3", "parentUuid": "x2", "message": {"content": None}}),
                       json.dumps({"type": "user", "uuid": "x4", "parentUuid": "x3", "message": {"content": {"t": 1}}}),
                       json.dumps({"type": "user", "uuid": "x5", "parentUuid": "x4", "message": "str"}),
                       json.dumps({"type": "assistant", "uuid": "x6", "parentUuid": "x5", "message": {"content": 5}}),
                       json.dumps({"type": "assistant", "uuid": "x7", "parentUuid": "x6",
                                   "message": {"role": "assistant", "content": [], "usage": {}}}),
                       json.dumps({"type": "assistant", "uuid": "x8", "parentUuid": "x7",
                                   "message": {"role": "assistant", "content": [], "usage": "x"}}),
                       json.dumps({"type": "user", "uuid": "x9", "parentUuid": "x8",
                                   "message": {"role": "assistant", "content": "role from the message"}})],
    "types": [json.dumps({"type": "system", "subtype": "x" * 101, "uuid": "x1", "parentUuid": "a1"}),
              json.dumps({"type": "t" * 150, "uuid": "x2", "parentUuid": "x1"}),
              json.dumps({"type": "attachment", "attachment": {"type": "é" * 100}, "uuid": "x3", "parentUuid": "x2"}),
              json.dumps({"type": "summary", "summary": "s", "leafUuid": "zz"}),
              json.dumps({"type": "file-history-snapshot", "messageId": "m", "snapshot": {}})],
    "split message usage copies": [
        json.dumps(_a("x1", "a1", [{"type": "text", "text": "p1"}], mid="mS", rid="rS")).replace(
            '"output_tokens": 7', '"output_tokens": 1'),
        json.dumps(_a("x2", "x1", [{"type": "tool_use", "id": "tS", "name": "B", "input": {}}], mid="mS", rid="rS")),
        json.dumps(_a("x3", "x2", [{"type": "text", "text": "p3"}], mid="mS", rid="rS")).replace(
            '"stop_reason": "end_turn"', '"stop_reason": ""')],
    # the server's cache diagnosis (Claude Code 2.1.140+), in every shape the two engines must read alike
    "cache diagnoses": [json.dumps(_a(f"x{i}", "a1" if i == 0 else f"x{i - 1}", [{"type": "text", "text": "d"}],
                                      mid=f"md{i}", rid=f"rd{i}")).replace('"message": {', '"message": {"diagnostics": '
                                                                           + d + ", ", 1)
                        for i, d in enumerate([
                            '{"cache_miss_reason": {"type": "system_changed", "cache_missed_input_tokens": 119127}}',
                            '{"cache_miss_reason": {"type": "unavailable"}}',
                            '{"cache_miss_reason": {"type": "a_later_type", "cache_missed_input_tokens": 3}}',
                            '{"cache_miss_reason": null}', "null", "[]", '"text"', '{"cache_miss_reason": "text"}',
                            '{"cache_miss_reason": {"type": 5, "cache_missed_input_tokens": "5"}}',
                            '{"cache_miss_reason": {"type": {"a": 1}, "cache_missed_input_tokens": true}}',
                            '{"cache_miss_reason": {"type": "tools_changed", "cache_missed_input_tokens": 12.7}}',
                            '{"cache_miss_reason": {"type": "tools_changed", "cache_missed_input_tokens": 1e400}}',
                            '{"cache_miss_reason": {"type": "x", "cache_missed_input_tokens": 18446744073709551616}}',
                            '{"cache_miss_reason": {"type": "a", "type": "b"}}',
                            '{"cache_miss_reason": {"type": "a"}, "cache_miss_reason": null}',
                            '{"cache_miss_reason": {"type": "t\\u00e9\\"q"}}'])],
    # Claude Code's own answers (model <synthetic>): no calls, a failed request's notice never sent
    "local notices": [
        json.dumps(_a("x1", "a1", [{"type": "text", "text": "limit"}], isApiErrorMessage=True, error="rate_limit")
                   ).replace('"claude-sonnet-4-5"', '"<synthetic>"'),
        json.dumps(_u("x2", "x1", "again")),
        json.dumps(_a("x3", "x2", "No response requested.")).replace('"claude-sonnet-4-5"', '"<synthetic>"'),
        json.dumps(_a("x4", "x3", [{"type": "text", "text": "flag"}], isApiErrorMessage="yes")).replace(
            '"claude-sonnet-4-5"', '"<synthetic>"'),
        json.dumps(_a("x5", "x4", [{"type": "text", "text": "p1"}], mid="mL", rid="rL",
                      isApiErrorMessage=True)).replace('"claude-sonnet-4-5"', '"<synthetic>"'),
        json.dumps(_a("x6", "x5", [{"type": "text", "text": "p2"}], mid="mL", rid="rL")),
        json.dumps(_a("x7", "x6", [{"type": "text", "text": "real model, error flag"}], isApiErrorMessage=True)),
        json.dumps(_u("x8", "x7", "a user entry naming the model", isApiErrorMessage=True)).replace(
            '"role": "user"', '"role": "user", "model": "<synthetic>"'),
        json.dumps({**_a("x9", "x8", [{"type": "text", "text": "role"}], isApiErrorMessage=True), "message": {
            "role": "user", "model": "<synthetic>", "content": [{"type": "text", "text": "role"}]}}),
        json.dumps(_a("y1", "a1", [{"type": "text", "text": "a notice alone on a branch"}],
                      isApiErrorMessage=True)).replace('"claude-sonnet-4-5"', '"<synthetic>"')],
    "repeated entries": [json.dumps(_u("x1", "a1", "same")), json.dumps(_u("x1", "a1", "same")),
                         json.dumps(_u("x1", "a1", "other")), json.dumps(_u("x1", "a1", "other")),
                         json.dumps({"type": "summary", "summary": "no uuid"}),
                         json.dumps({"type": "summary", "summary": "no uuid"})],
    "deep nesting": [json.dumps(_u("x1", "a1", [{"type": "text", "text": "[" * 300}])),
                     b'{"type":"user","uuid":"x2","parentUuid":"x1","message":{"role":"user","content":"d"},"d":'
                     + b"[" * 250 + b"]" * 250 + b"}",
                     b'{"type":"user","uuid":"x3","parentUuid":"x2","message":{"role":"user","content":"d"},"d":'
                     + b"[" * 150 + b"]" * 150 + b"}"],
    "glued and broken": [json.dumps(_u("x1", "a1", "g")) + json.dumps(_u("x2", "x1", "h")),
                         json.dumps(_u("x3", "x2", "cut"))[:40], "", "   ", "\u00a0", b"\xff\xfe", "[1,2]", "{}",
                         '{"type": null}'],
}


@pytest.mark.parametrize("case", sorted(EDGE_LINES))
def test_edge_lines_are_identical(case: str, tmp_path: Path) -> None:
    lines: list[Any] = [*_base(), *EDGE_LINES[case], _u("z1", "a1", "after")]
    p = _session(tmp_path, lines)
    both([p], case)


def test_the_fast_path_reads_the_cache_diagnosis(tmp_path: Path) -> None:
    """Well-formed diagnoses are read by the SQL path itself (not sent the careful way)."""
    lines = [*_base(), *EDGE_LINES["cache diagnoses"][:4]]
    p = _session(tmp_path, lines)
    res = _columnar_only([p])
    assert not res.batch.slow_msgs
    got = pa.table(res.blocks()).to_pydict()
    assert [r for r in got["cache_miss_reason"] if r] == ["system_changed", "unavailable", "a_later_type"]
    assert [n for n in got["cache_missed_tokens"] if n is not None] == [119127, 3]
    both([p], "cache diagnoses")


def test_a_bom_and_an_agent_file(tmp_path: Path) -> None:
    p = _session(tmp_path, _base())
    p.write_bytes(b"\xef\xbb\xbf" + p.read_bytes())
    sub = tmp_path / "proj" / SID / "subagents"
    sub.mkdir(parents=True)
    (sub / "agent-abc123.jsonl").write_text(
        json.dumps(_u("s1", None, "task", isSidechain=True, agentId="abc123")) + "\n"
        + json.dumps(_a("s2", "s1", [{"type": "text", "text": "done"}], isSidechain=True)) + "\n")
    both([tmp_path], "bom + agent")


def test_files_read_into_one_buffer_keep_their_own_lines(tmp_path: Path) -> None:
    """All files of a call are split into lines from one joined buffer: a file without a final
    newline, a blank one and one with CRLF line ends must keep their own lines, numbers and raw
    text (the last line of one file never runs into the next file)."""
    p = _session(tmp_path, _base())
    p.write_bytes(p.read_bytes().rstrip(b"\n"))  # no newline at the end of the main file
    sub = tmp_path / "proj" / SID / "subagents"
    sub.mkdir(parents=True)
    (sub / "agent-a1.jsonl").write_bytes(b"\n  \n")
    (sub / "agent-b2.jsonl").write_bytes(
        json.dumps(_u("s1", None, "task", isSidechain=True, agentId="b2")).encode() + b"\r\n"
        + json.dumps(_a("s2", "s1", [{"type": "text", "text": "done"}], isSidechain=True)).encode() + b"\r\n")
    (sub / "agent-c3.jsonl").write_bytes(json.dumps(_u("t1", None, "other", isSidechain=True, agentId="c3")).encode())
    res = both([tmp_path], "joined buffer")
    raw = res.blocks.column("raw_line").to_pylist()
    assert all(r.startswith("{") and r.endswith("}") for r in raw)
    assert sorted(set(res.blocks.column("entry_id").to_pylist())) == ["a1", "s1", "s2", "t1", "u1"]
    assert not _columnar_only([tmp_path]).batch.slow_msgs


def test_fast_path_sends_what_it_cannot_take_to_the_careful_path(tmp_path: Path) -> None:
    """Lines the columnar reader cannot take exactly (a duplicate key, a float where a count is read, a
    value JSON forbids) go through the reference loader's own line code; the clean lines around them
    do not. Values that need the reference loader's coercion send the whole call to it."""
    p = _session(tmp_path, [
        *_base(),
        b'{"type":"user","uuid":"d1","uuid":"d2","parentUuid":"a1","message":{"role":"user","content":"a"}}',
        json.dumps(_a("f1", "d2", [{"type": "text", "text": "b"}])).replace('"output_tokens": 7',
                                                                         '"output_tokens": 7.5'),
        b'{"type":"user","uuid":"n1","parentUuid":"f1","message":{"role":"user","content":"a"},"n":NaN}',
        json.dumps(_u("z1", "f1", "after"))])
    res = _columnar_only([p])
    assert {m.entry_id for m in res.batch.slow_msgs} == {"d2", "f1"}
    assert res.loads[0].quarantined_lines == 1  # the NaN line, as the reference loader quarantines it
    both([p], "careful lines")
    q = _session(tmp_path, [*_base(), json.dumps(_u("c1", "a1", [{"type": "text", "text": 5}]))], name=SID[:-1] + "2")
    with pytest.raises(cc_columnar.NeedsReference):
        _columnar_only([q]).blocks()
    res_q = both([q], "coerced text")
    assert res_q.stats.get("fields_coerced") == 1


# ---------------------------------------------------------------- hypothesis: mutated files


CC_SEEDS = [s for s in seed_files() if s.fmt == "claude_code"]
NAMES = sorted(MUTATIONS)


def _write_case(d: Path, files: list[tuple[str, list[Line]]]) -> None:
    for k, (name, lines) in enumerate(files):
        p = d / f"f{k}" / name
        p.parent.mkdir(parents=True)
        p.write_bytes(render(lines))


def _mutated(seeds: list[Any]) -> st.SearchStrategy[list[tuple[str, list[Line]]]]:
    @st.composite
    def case(draw: Any) -> list[tuple[str, list[Line]]]:
        rng = draw(st.randoms(use_true_random=False))
        out = []
        for _ in range(rng.randint(1, 3)):
            seed = rng.choice(seeds)
            out.append((seed.name, mutate(seed, [rng.choice(NAMES) for _ in range(rng.randint(1, 4))], rng)))
        return out
    return case()


@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                                 HealthCheck.function_scoped_fixture])
@given(_mutated(CC_SEEDS))
def test_mutated_fixture_files_are_identical(tmp_path_factory: pytest.TempPathFactory,
                                             files: list[tuple[str, list[Line]]]) -> None:
    d = tmp_path_factory.mktemp("mut")
    _write_case(d, files)
    both([d], "mutated fixture")


@pytest.mark.corpus
def test_mutated_corpus_windows_are_identical(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    seeds = [s for s in corpus_seeds(corpus, random.Random(5), window=30) if s.fmt == "claude_code"]

    @settings(max_examples=examples(30), deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                     HealthCheck.data_too_large])
    @given(_mutated(seeds))
    def inner(files: list[tuple[str, list[Line]]]) -> None:
        d = tmp_path_factory.mktemp("mutc")
        _write_case(d, files)
        both([d], "mutated corpus window")

    inner()


# ---------------------------------------------------------------- the reused DuckDB connection


def _left_in_connection() -> list[str]:
    """Tables and views the calling thread's reused connection holds (none between two loads)."""
    con = cc_columnar._LOCAL.con
    return [r[0] for r in con.execute("SELECT table_name FROM duckdb_tables() UNION ALL "
                                      "SELECT view_name FROM duckdb_views() WHERE NOT internal").fetchall()]


def test_the_connection_writes_nothing_to_the_terminal_or_the_current_directory() -> None:
    """DuckDB draws a progress bar on stdout for a query of more than 2 s (into `run --json`), and an
    in-memory database spills to `.tmp` in the current directory: neither, on the loader's connection."""
    import os
    import tempfile

    con = cc_columnar._connection()
    (bar, tmp), = con.execute("SELECT current_setting('enable_progress_bar'), current_setting('temp_directory')").fetchall()
    assert bar is False
    assert tmp == os.path.join(tempfile.gettempdir(), f"ctxreplay-duckdb-{os.getpid()}")


def test_reused_connection_keeps_nothing_between_loads(tmp_path: Path) -> None:
    # two different inputs in turn on the one connection: each load equals the reference, and no
    # table, view or registered input of a load is left behind for the next one
    other = tmp_path / "p" / f"{SID}.jsonl"
    other.parent.mkdir()
    ids = [f"00000000-0000-4000-8000-{i:012d}" for i in range(6)]
    other.write_bytes(b"\n".join(
        json.dumps(cc_entry(SID, u, ids[i - 1] if i else None, "user" if i % 2 == 0 else "assistant",
                            [{"type": "text", "text": f"turn {i}"}])).encode() for i, u in enumerate(ids)) + b"\n")
    first = both([SAMPLES], "samples, first")
    con = cc_columnar._LOCAL.con
    assert con is not None and _left_in_connection() == []
    both([tmp_path], "another input on the reused connection")
    assert cc_columnar._LOCAL.con is con, "the connection was not reused"
    assert _left_in_connection() == []
    assert load_paths([SAMPLES]).blocks.equals(first.blocks)


def test_connection_closed_after_a_big_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    # a batch of more than REUSE_MAX_BYTES of files closes the connection (the memory DuckDB holds
    # after it goes back); one of exactly that size keeps it
    size = sum(p.stat().st_size for p in (SAMPLES / "claude-projects").rglob("*.jsonl"))
    monkeypatch.setattr(cc_columnar, "REUSE_MAX_BYTES", size - 1)
    both([SAMPLES], "big batch")
    assert cc_columnar._LOCAL.con is None
    monkeypatch.setattr(cc_columnar, "REUSE_MAX_BYTES", size)
    both([SAMPLES], "batch at the limit")
    assert cc_columnar._LOCAL.con is not None


def test_failed_load_drops_the_connection(monkeypatch: pytest.MonkeyPatch) -> None:
    # a statement that fails leaves no half-made tables for the next call: the connection is dropped
    load_paths([SAMPLES])
    good = cc_columnar._SQL_ENTRIES
    monkeypatch.setattr(cc_columnar, "_SQL_ENTRIES", "SELECT * FROM no_such_table")
    with pytest.raises(Exception, match="no_such_table"):
        load_paths([SAMPLES])
    assert cc_columnar._LOCAL.con is None
    monkeypatch.setattr(cc_columnar, "_SQL_ENTRIES", good)
    both([SAMPLES], "after a failed load")


def test_threads_load_at_once() -> None:
    # each thread has its own connection: loads running at the same time give the same table
    from concurrent.futures import ThreadPoolExecutor

    want = load_paths([SAMPLES]).blocks
    with ThreadPoolExecutor(3) as ex:
        got = list(ex.map(lambda _: load_paths([SAMPLES]).blocks, range(6)))
    assert all(g.equals(want) for g in got)


def test_small_batches_take_the_reference_loader(monkeypatch: pytest.MonkeyPatch) -> None:
    # below SMALL_BATCH_BYTES of Claude Code files no columnar parse runs (and the result is the same)
    size = sum(p.stat().st_size for p in (SAMPLES / "claude-projects").rglob("*.jsonl"))
    ran: list[int] = []
    real = cc_columnar.load_sessions
    monkeypatch.setattr(cc_columnar, "load_sessions", lambda *a, **k: ran.append(1) or real(*a, **k))
    monkeypatch.setattr(cc_columnar, "SMALL_BATCH_BYTES", size + 1)
    small = load_paths([SAMPLES])
    assert ran == []
    monkeypatch.setattr(cc_columnar, "SMALL_BATCH_BYTES", size)
    assert_same_load(small, load_paths([SAMPLES]), "at the limit")
    assert ran == [1]


def test_engine_names() -> None:
    with pytest.raises(ValueError, match="engine"):
        load_paths([SAMPLES], engine="fast")
    assert isinstance(load_paths([SAMPLES], engine="reference").blocks, pa.Table)


# ---------------------------------------------------------------- the same inputs at both batch sizes (issue 23, item 7)


def _run_outputs(inp: Path, out: Path) -> tuple[dict[str, Any], list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    import polars as pl
    from click.testing import CliRunner

    from ctxreplay.pipeline.commands.cli import main

    r = CliRunner().invoke(main, ["run", str(inp), "--out", str(out), "--json", "--fast-tokens", "-q", "--jobs", "1"])
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout)
    calls = pl.read_parquet(out / "calls.parquet").select(
        "session_id", "thread_id", "call", "request_sha256", "prompt_tokens", "timestamp").sort(
        "session_id", "thread_id", "call").rows()
    q = pl.read_parquet(out / "quarantine.parquet").select("file", "line", "code").sort("file", "line").rows()
    return {k: s[k] for k in ("files", "lines", "message_lines", "other_lines", "quarantined_lines", "sessions",
                              "threads", "calls", "skipped_files", "loader_stats")}, calls, q


def test_a_run_of_the_hostile_set_is_the_same_in_small_and_big_batches(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Big batches (cc_columnar.SMALL_BATCH_BYTES, 8 MiB, and more of Claude Code files) take the columnar
    loader, smaller ones the reference one: a run of the hostile set, numbers beyond a double included
    (`"timestamp": 1e400` stopped the columnar path with an internal error), gives the same outputs."""
    write_hostile_inputs(tmp_path / "h", huge_mb=0)
    big = _run_outputs(tmp_path / "h", tmp_path / "big")  # SMALL_BATCH_BYTES = 0 (the fixture): columnar
    monkeypatch.setattr(cc_columnar, "SMALL_BATCH_BYTES", 1 << 60)  # every batch small: the reference loader
    small = _run_outputs(tmp_path / "h", tmp_path / "small")
    assert big[0] == small[0]
    assert big[1] == small[1]
    assert big[2] == small[2]
    assert any("number_beyond_double" in str(p) for p in (tmp_path / "h").rglob("*"))
