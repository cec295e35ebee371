"""Frozen loads: what `load_paths` gave for a set of inputs, kept as digests in
tests/fixtures/loader_digests.json, so the Claude Code loader is checked against its own past
output rather than against a second loader (issue 22, item 3).

A digest covers the whole `LoadResult`: the blocks table (its schema and every column, value by
value) and the accounting (per file: format, sha256, bytes, lines, message and other lines by kind,
quarantine rows, recovered notes, loader stats; skipped files; the load's stats and thread count).
Paths are written relative to the directory the case was built in, so a checkout elsewhere gives
the same digests. Each column has a short digest of its own, so a failure names the columns that
changed.

Cases: the samples and the loader fixtures, the hostile directory (without and, in corpus runs,
with corpus seeds), lines that are hard to read (`EDGE_LINES`), fixture files mutated with a fixed
seed each, and in corpus runs every Claude Code file, session directory and top folder of
../shared/corpus and ../shared/corpus-extra plus mutated windows of their lines.

    python tests/loaderkit.py            # rewrite the digests (say why in the commit message)
    python tests/loaderkit.py --check    # compare, print the cases that differ
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import orjson

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

SAMPLES = ROOT / "data" / "samples"
FIXTURES = ROOT / "tests" / "fixtures" / "loaders"
DIGESTS = ROOT / "tests" / "fixtures" / "loader_digests.json"
CORPUS = ROOT.parent / "shared" / "corpus"
CORPUS_EXTRA = ROOT.parent / "shared" / "corpus-extra"
SID = "c01c0000-0000-4000-8000-000000000001"
MUTATED_CASES = 150  # fixture files mutated, one fixed seed each
CORPUS_MUTATED_CASES = 40
COLUMN_HEX = 4  # per-column digest length: enough to name the columns that changed
ACCOUNTING = ("format", "sha256", "bytes", "lines", "message_lines", "other_lines", "quarantine", "recovered",
              "stats")


# ---------------------------------------------------------------- digests


def _norm(text: str, base: str) -> str:
    """Paths made relative: to the case's directory, the repository, the shared folder."""
    for prefix, label in ((base, "<base>"), (str(ROOT), "<repo>"), (str(CORPUS.parent), "<shared>")):
        text = text.replace(prefix, label)
    return text


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def digest(res: Any, base: Path) -> dict[str, Any]:
    """The digest of a LoadResult, paths relative to `base`."""
    b = str(base)
    tbl = res.blocks
    cols = []
    for f in tbl.schema:
        vals = tbl.column(f.name).to_pylist()
        cols.append(_sha(_norm(orjson.dumps(vals).decode(), b).encode()))
    loads = []
    for ld in res.loads:
        d: dict[str, Any] = {"path": ld.path}
        for k in ACCOUNTING:
            v = getattr(ld, k)
            if k in ("other_lines", "stats"):
                v = sorted(dict(v).items())
            elif k == "quarantine":
                v = [vars(q) for q in v]
            d[k] = v
        loads.append(d)
    acct = {"loads": loads, "skipped": res.skipped, "stats": sorted(res.stats.items()), "threads": res.threads}
    acct_json = _norm(json.dumps(acct, sort_keys=True, ensure_ascii=True, default=str), b)
    return {
        "rows": tbl.num_rows,
        "schema": _sha(tbl.schema.to_string(show_schema_metadata=True).encode())[:12],
        "table": _sha("".join(cols).encode())[:16],
        "columns": "".join(c[:COLUMN_HEX] for c in cols),  # in schema order
        "accounting": _sha(acct_json.encode())[:16],
        "quarantined": sum(ld.quarantined_lines for ld in res.loads),
        "recovered": sum(len(ld.recovered) for ld in res.loads),
    }


def differences(want: dict[str, Any], got: dict[str, Any]) -> list[str]:
    """What differs between two digests, in words."""
    out = []
    from ctxreplay.schemas.blocks import BLOCKS

    for k in ("rows", "schema", "table", "accounting", "quarantined", "recovered"):
        if want.get(k) != got.get(k):
            out.append(f"{k}: {want.get(k)} != {got.get(k)}")
    wc, gc, n = want.get("columns", ""), got.get("columns", ""), COLUMN_HEX
    changed = [f.name for i, f in enumerate(BLOCKS) if wc[i * n:(i + 1) * n] != gc[i * n:(i + 1) * n]]
    if changed:
        out.append("columns: " + ", ".join(changed))
    return out


# ---------------------------------------------------------------- cases


@dataclass
class Case:
    """One input: `build(dir)` writes it under `dir` (or returns repository paths) and gives the
    paths to load; `kwargs` go to `load_paths`."""

    name: str
    build: Callable[[Path], list[Path]]
    corpus: bool = False
    kwargs: dict[str, Any] | None = None


def session_file(d: Path, lines: list[bytes | str | dict[str, Any]], name: str = SID) -> Path:
    """A Claude Code session file of these lines (objects dumped as JSON, text as UTF-8)."""
    p = d / "proj" / f"{name}.jsonl"
    p.parent.mkdir(parents=True, exist_ok=True)
    out = b""
    for ln in lines:
        if isinstance(ln, dict):
            ln = json.dumps(ln, ensure_ascii=False)
        out += (ln.encode("utf-8", "surrogatepass") if isinstance(ln, str) else ln) + b"\n"
    p.write_bytes(out)
    return p


def user(uuid: str, parent: str | None, content: Any, **kw: Any) -> dict[str, Any]:
    return cc_entry(SID, uuid, parent, "user", content, **kw)


def answer(uuid: str, parent: str | None, content: Any, **kw: Any) -> dict[str, Any]:
    return cc_entry(SID, uuid, parent, "assistant", content, **kw)


def base_lines() -> list[dict[str, Any]]:
    return [user("u1", None, "hello"), answer("a1", "u1", [{"type": "text", "text": "hi"}])]


_u, _a = user, answer

# Lines that are hard to read exactly: JSON only some readers accept, duplicate keys (the agents'
# JavaScript keeps the last value, as orjson does), values of unexpected types, every block shape.
EDGE_LINES: dict[str, list[bytes | str]] = {
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
    "values of every type where text is read": [
        json.dumps(_a(f"v{i}", "a1" if i == 0 else f"v{i - 1}", [
            {"type": "text", "text": v}, {"type": "thinking", "thinking": v, "signature": v},
            {"type": "redacted_thinking", "data": v}, {"type": "tool_use", "id": v, "name": v, "input": v},
            {"type": "image", "source": {"type": "base64", "media_type": v, "data": v}},
            {"type": "tool_result", "tool_use_id": v, "is_error": v, "content": [
                {"type": "text", "text": v}, {"type": "tool_reference", "tool_name": v},
                {"type": "image", "source": {"type": "base64", "media_type": v, "data": v}}]}],
            mid=f"mv{i}", rid=f"rv{i}")).replace('"model": "claude-sonnet-4-5"', '"model": ' + json.dumps(v), 1)
        for i, v in enumerate([5, 2.5, True, None, [1, "a"], {"k": "v"}, "", "plain"])]
        + [json.dumps({"type": "user", "uuid": "v9", "parentUuid": "v7", "requestId": [1],
                       "message": {"role": 7, "content": "role is a number", "id": {"a": 1}}})],
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

CC_SEEDS = [s for s in seed_files() if s.fmt == "claude_code"]
NAMES = sorted(MUTATIONS)


def mutated_files(seeds: list[Any], rng: random.Random) -> list[tuple[str, list[Line]]]:
    """One to three seed files, each with one to four mutations drawn by `rng`."""
    out = []
    for _ in range(rng.randint(1, 3)):
        seed = rng.choice(seeds)
        out.append((seed.name, mutate(seed, [rng.choice(NAMES) for _ in range(rng.randint(1, 4))], rng)))
    return out


def write_files(d: Path, files: list[tuple[str, list[Line]]]) -> list[Path]:
    for k, (name, lines) in enumerate(files):
        p = d / f"f{k}" / name
        p.parent.mkdir(parents=True)
        p.write_bytes(render(lines))
    return [d]


def _corpus_cc_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.jsonl") if "claude" in p.relative_to(root).parts[0])


def cases(with_corpus: bool) -> Iterator[Case]:
    yield Case("samples", lambda d: [SAMPLES])
    for sub in sorted(p for p in FIXTURES.iterdir() if p.is_dir()):
        yield Case(f"fixtures/{sub.name}", lambda d, sub=sub: [sub])
    yield Case("fixtures", lambda d: [FIXTURES])

    def hostile(d: Path, part: str | None = None, corpus: Path | None = None) -> list[Path]:
        write_hostile_inputs(d / "h", huge_mb=0, corpus=corpus)
        return [d / "h" / part] if part else [d / "h"]

    yield Case("hostile", hostile)
    for part in ("copies", "deep", "fuzzed", "huge", "images", "names", "numbers", "truncated", "utf8"):
        yield Case(f"hostile/{part}", lambda d, part=part: hostile(d, part))
    for name in sorted(EDGE_LINES):
        yield Case(f"edge/{name}", lambda d, name=name: [session_file(d, [*base_lines(), *EDGE_LINES[name],
                                                                          user("z1", "a1", "after")])])
    for i in range(MUTATED_CASES):
        yield Case(f"mutated/{i}", lambda d, i=i: write_files(d, mutated_files(CC_SEEDS, random.Random(i))))
    if not with_corpus:
        return
    for root, label in ((CORPUS, "corpus"), (CORPUS_EXTRA, "corpus-extra")):
        yield Case(label, lambda d, root=root: [root], corpus=True)
        for sub in sorted(p for p in root.iterdir() if p.is_dir()):
            yield Case(f"{label}/{sub.name}", lambda d, sub=sub: [sub], corpus=True)
        projects = sorted({p.parent for p in _corpus_cc_files(root) if p.parent.parent.name == "projects"})
        for proj in projects:
            yield Case(f"{label}/project/{proj.name}", lambda d, proj=proj: [proj], corpus=True)
        for f in _corpus_cc_files(root):
            rel = f.relative_to(root)
            yield Case(f"{label}/file/{rel}", lambda d, f=f: [f], corpus=True)
        yield Case(f"{label}/open-sidechains", lambda d, root=root: [root], corpus=True,
                   kwargs={"open_sidechains": True})
    yield Case("corpus-hostile", lambda d: hostile(d, None, CORPUS), corpus=True)
    seeds = [s for s in corpus_seeds(CORPUS, random.Random(5), window=30) if s.fmt == "claude_code"]
    for i in range(CORPUS_MUTATED_CASES):
        yield Case(f"corpus-mutated/{i}", lambda d, i=i: write_files(d, mutated_files(seeds, random.Random(i))),
                   corpus=True)


def run_case(case: Case, **load_kwargs: Any) -> dict[str, Any]:
    """Build the case in a fresh directory and load it: its digest."""
    from ctxreplay.pipeline.loaders import load_paths

    with tempfile.TemporaryDirectory(prefix="loaderkit-") as tmp:
        d = Path(tmp)
        paths = case.build(d)
        res = load_paths(paths, **(case.kwargs or {}), **load_kwargs)
        return digest(res, d)


def frozen() -> dict[str, dict[str, Any]]:
    return json.loads(DIGESTS.read_text()) if DIGESTS.exists() else {}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="compare with the frozen digests, write nothing")
    ap.add_argument("--only", help="cases whose name starts with this")
    args = ap.parse_args(argv)
    have_corpus = CORPUS.is_dir() and CORPUS_EXTRA.is_dir()
    old = frozen()
    new: dict[str, dict[str, Any]] = {}
    bad = 0
    for case in cases(have_corpus):
        if args.only and not case.name.startswith(args.only):
            if case.name in old:
                new[case.name] = old[case.name]
            continue
        got = run_case(case)
        new[case.name] = got
        if args.check:
            diff = differences(old.get(case.name, {}), got)
            if diff:
                bad += 1
                print(f"DIFF {case.name}: {'; '.join(diff)}")
    if args.check:
        print(f"{len(new)} cases, {bad} differ")
        return 1 if bad else 0
    if not have_corpus:  # keep the corpus cases as they were
        new.update({k: v for k, v in old.items() if k not in new})
    DIGESTS.write_text(json.dumps(new, indent=0, sort_keys=True, separators=(",", ":")) + "\n")
    print(f"wrote {len(new)} cases to {DIGESTS.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
