"""Write a directory of broken, fuzzed and hostile transcript files (and the mutations behind them).

    python bench/make_hostile_inputs.py DIR [--huge-mb 100] [--seed 0] [--corpus ../shared/corpus]

DIR gets (all invented or derived from tests/fixtures/loaders, plus corpus lines with --corpus):

- fuzzed/<format>/...      every seed file mutated by every mutation class (MUTATIONS below)
- utf8/                    `\\xff{}`, a `\\xff` inside a JSON string, a binary file named .jsonl,
                           request JSON with bad bytes (in a string, and outside), lone surrogate escapes
- truncated/               a session cut mid-line (a crash mid-write), a file without its last newline
- names/                   hostile file names (`...jsonl`, 250-byte name, leading dash, a newline,
                           bytes that are not UTF-8, terminal escapes) and hostile ids inside files
                           (session / agent / entry ids with `/`, `..`, NUL, 300 bytes, `.`, empty;
                           a session id and model name holding terminal escapes and a newline)
- copies/                  the same sessions again: exact copies, an older prefix, a copy with one
                           entry changed (Claude Code, OpenClaw, Codex)
- huge/                    one Claude Code line of --huge-mb MB and a sparse file of as many zeros
                           (0 leaves both out; over 64 MB both are over --max-line-bytes), a 0-byte file,
                           a file of blank lines
- images/                  a PNG claiming 100,000 x 100,000 pixels (a decompression bomb), text bytes
                           labelled image/png, an animated GIF
- deep/                    10,000 nested lists inside an entry, 250 levels, a deep tool input
- numbers/                 numbers beyond a double (`1e400`, 400 digits) as timestamps and inside
                           entries (the columnar and the reference loader must read them alike)

Not written into DIR (a copy of DIR must stay a plain tree): `special_inputs` makes what a command
must list but never read (issue 23, item 9: symbolic links out of the directory given, to
/proc/self/environ, /dev/zero, a file and a directory outside; a FIFO named *.jsonl; a dangling
link), and `vanish` what happens to a file after a run listed it (item 4: deleted, renamed as
OpenClaw does on a reset, replaced by a FIFO or a directory).

Not written into DIR (they are not transcripts): `foreign_out_dir` and `not_ledgers` make the
hostile `--out` directories and `--ledger` files of issue 23 (a directory of someone else's files,
a Parquet / SQLite / JSON file, a DuckDB database with tables of its own, a ledger cut in half),
which tests/test_foreign_outputs.py passes to `ctxreplay run` and `ctxreplay ledger`.

The mutation functions are importable (tests/test_fuzz_loaders.py drives them with hypothesis):
each takes the lines of a file and a `random.Random`, changes one place, and records on the lines
it touched what the loader must do with them (`expect`: a quarantine code, "kept", or None).
"""

from __future__ import annotations

import argparse
import base64
import copy
import io
import json
import os
import random
import re
import shutil
import struct
import sys
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SEEDS_DIR = ROOT / "tests" / "fixtures" / "loaders"

KEPT = "kept"  # the line is never quarantined
PARSED = "parsed"  # the line is read as JSON: quarantined, if at all, only for what it says (no_role, ...)


@dataclass
class Line:
    """One physical line of a file being mutated (bytes without the line break)."""

    data: bytes
    expect: str | None = None  # quarantine code it must get, KEPT, PARSED, or None (no claim)
    touched: bool = False


@dataclass
class Seed:
    name: str  # file name to write (carries the session id for formats that take it from the name)
    fmt: str  # claude_code | openclaw | pi_legacy | codex
    lines: list[bytes]


def seed_files(seeds_dir: Path = SEEDS_DIR) -> list[Seed]:
    """The JSONL seeds of tests/fixtures/loaders (the request JSON is a whole document: not a seed)."""
    fmts = {"claude-code": "claude_code", "openclaw": "openclaw", "pi-legacy": "pi_legacy", "codex": "codex"}
    out = []
    for sub, fmt in fmts.items():
        for p in sorted((seeds_dir / sub).glob("*.jsonl")):
            out.append(Seed(p.name, fmt, [ln for ln in p.read_bytes().split(b"\n") if ln.strip()]))
    return out


_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def session_uuid(seed: Seed) -> str | None:
    """The session uuid of a seed: the last one in its file name, else the first `sessionId`."""
    found = _UUID.findall(seed.name)
    if found:
        return found[-1]
    for d in seed.lines:
        m = re.search(rb'"sessionId":"([0-9a-f-]{36})"', d)
        if m:
            return m.group(1).decode()
    return None


def corpus_seeds(corpus: Path, rng: random.Random, window: int = 40) -> list[Seed]:
    """Seeds cut from real files at test time: each file's first line plus a random window of lines."""
    out = []
    for p in sorted(corpus.rglob("*")):
        n = p.name
        if not p.is_file() or not (n.endswith(".jsonl") or ".jsonl.deleted." in n or ".jsonl.reset." in n):
            continue
        lines = [ln for ln in p.read_bytes().split(b"\n") if ln.strip()]
        if not lines:
            continue
        start = rng.randrange(1, max(2, len(lines) - window + 1))
        fmt = ("codex" if "codex" in str(p) else "openclaw" if "openclaw" in str(p) else "claude_code")
        out.append(Seed(n, fmt, [lines[0], *lines[start:start + window]]))
    return out


# ---------------------------------------------------------------- JSON helpers


def obj(line: Line) -> Any:
    try:
        return json.loads(line.data)
    except (ValueError, RecursionError):
        return None


def dump(o: Any) -> bytes:
    return json.dumps(o, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "surrogatepass")


def paths_in(o: Any, limit: int = 400) -> list[tuple[Any, Any]]:
    """(container, key) of every value inside a JSON value, breadth first."""
    out: list[tuple[Any, Any]] = []
    todo = [o]
    while todo and len(out) < limit:
        c = todo.pop(0)
        items = c.items() if isinstance(c, dict) else enumerate(c) if isinstance(c, list) else ()
        for k, v in items:
            out.append((c, k))
            if isinstance(v, (dict, list)):
                todo.append(v)
    return out


def fresh(lines: list[Line], rng: random.Random, pred: Callable[[Line], bool] = lambda ln: True) -> int | None:
    """Index of a random line no mutation touched yet (and `pred` holds), or None."""
    idx = [i for i, ln in enumerate(lines) if not ln.touched and pred(ln)]
    return rng.choice(idx) if idx else None


def _is_dict_with(*keys: str) -> Callable[[Line], bool]:
    def pred(ln: Line) -> bool:
        o = obj(ln)
        return isinstance(o, dict) and all(k in o for k in keys)
    return pred


def _set(lines: list[Line], i: int, data: bytes, expect: str | None) -> None:
    lines[i] = Line(data, expect, True)


WEIRD_VALUES: list[Any] = [None, True, False, 0, -1, 1.5, 1e30, -1e30, 2**64, 10**30, "", "12", "x", [], [1, "a"],
                           {}, {"a": {"b": None}}, "\u0000", "../../etc/passwd", "é" * 3]
WEIRD_NUMBERS: list[Any] = [1e30, -1, "12", 1.5, True, False, None, 2**64, 10**30, -(2**70), 1e308, -0.0, [], {}]
WEIRD_TIMES: list[Any] = ["", "9999-12-31T23:59:59-05:00", "0001-01-01T00:00:00+05:00", "2999-01-01T00:00:00Z",
                          "garbage", "2026-13-45T99:99:99Z", 1e20, -1e20, 0, True, None, [], {},
                          "2026-01-01T00:00:00.123456789Z", 253402300800000]
HOSTILE_IDS: list[Any] = ["../../x", "a/b", "..", ".", "", "a\u0000b", "x" * 300, "-rf", "CON", "a b",
                          "\u202eevil", "main", "~", "a--b", "日本"]
BAD_BYTES = [b"\xff", b"\xfe\xff", b"\xc3", b"\xed\xa0\x80", b"\x80\x80", b"\xf8\x88\x80\x80\x80"]


# ---------------------------------------------------------------- mutations


def truncate(lines: list[Line], rng: random.Random) -> None:
    """A line cut short (a crash mid-write)."""
    i = fresh(lines, rng, lambda ln: len(ln.data) > 3)
    if i is None:
        return
    cut = lines[i].data[:rng.randrange(1, len(lines[i].data) - 1)]
    try:
        cut.decode("utf-8")
        expect = "truncated_json"
    except UnicodeDecodeError:
        expect = "invalid_utf8"  # the cut split a multi-byte character
    _set(lines, i, cut, expect)


def non_utf8_outside(lines: list[Line], rng: random.Random) -> None:
    """Bytes that are not UTF-8 where JSON syntax is expected."""
    i = fresh(lines, rng)
    if i is None:
        return
    d = lines[i].data
    at = rng.choice([0, 1, len(d)])
    _set(lines, i, d[:at] + rng.choice(BAD_BYTES) + d[at:], "invalid_utf8")


def _value_string_starts(d: bytes) -> list[int]:
    out, pos = [], 0
    while (pos := d.find(b'":"', pos)) >= 0:
        out.append(pos + 3)
        pos += 3
    return out


def non_utf8_in_string(lines: list[Line], rng: random.Random) -> None:
    """Bytes that are not UTF-8 inside a JSON string value: the line is read (U+FFFD in their place;
    a role or type so changed may still make the entry unusable)."""
    i = fresh(lines, rng, lambda ln: bool(_value_string_starts(ln.data)))
    if i is None:
        return
    d = lines[i].data
    at = rng.choice(_value_string_starts(d))
    _set(lines, i, d[:at] + rng.choice(BAD_BYTES) + d[at:], PARSED)


def surrogate_escape(lines: list[Line], rng: random.Random) -> None:
    """A lone surrogate escape (`\\ud800`) inside a string: valid JSON no UTF-8 writer accepts."""
    i = fresh(lines, rng, lambda ln: bool(_value_string_starts(ln.data)))
    if i is None:
        return
    d = lines[i].data
    at = rng.choice(_value_string_starts(d))
    _set(lines, i, d[:at] + rng.choice([b"\\ud800", b"\\udfff", b"\\udc80x", b"\\ud83d"]) + d[at:], PARSED)


def not_an_object(lines: list[Line], rng: random.Random) -> None:
    i = fresh(lines, rng)
    if i is not None:
        _set(lines, i, rng.choice([b"[1,2,3]", b'"text"', b"42", b"null", b"true", b"[]"]), "not_an_object")


def drop_type(lines: list[Line], rng: random.Random) -> None:
    i = fresh(lines, rng, _is_dict_with("type"))
    if i is not None:
        o = obj(lines[i])
        del o["type"]
        _set(lines, i, dump(o), "no_type")


def flip_type(lines: list[Line], rng: random.Random) -> None:
    i = fresh(lines, rng, _is_dict_with("type"))
    if i is not None:
        o = obj(lines[i])
        o["type"] = rng.choice([[1], {"a": 1}, 5, None, True, "", ["user"]])
        _set(lines, i, dump(o), "no_type")


def drop_message(lines: list[Line], rng: random.Random) -> None:
    """A message entry without its message (Claude Code, pi) or a rollout line without its payload."""
    i = fresh(lines, rng, lambda ln: isinstance(o := obj(ln), dict) and (
        o.get("type") in ("user", "assistant", "message") and "message" in o
        or "payload" in o and isinstance(o.get("type"), str) and o["type"] != ""))
    if i is None:
        return
    o = obj(lines[i])
    key = "payload" if "payload" in o else "message"
    if rng.random() < 0.5:
        del o[key]
    else:
        o[key] = rng.choice([5, "text", [1], None, True])
    _set(lines, i, dump(o), "no_payload" if key == "payload" else "no_message")


def drop_role(lines: list[Line], rng: random.Random) -> None:
    """A pi message without a role, or a Codex message item without a usable one."""
    def pred(ln: Line) -> bool:
        o = obj(ln)
        if not isinstance(o, dict):
            return False
        if o.get("type") == "message" and isinstance(o.get("message"), dict):
            return True
        p = o.get("payload")
        return o.get("type") == "response_item" and isinstance(p, dict) and p.get("type") == "message"

    i = fresh(lines, rng, pred)
    if i is None:
        return
    o = obj(lines[i])
    inner = o["message"] if "message" in o else o["payload"]
    if rng.random() < 0.5:
        inner.pop("role", None)
    else:
        inner["role"] = rng.choice([5, [], {}, None, ""] if "message" in o else ["robot", 5, None])
    _set(lines, i, dump(o), "no_role")


def bad_content(lines: list[Line], rng: random.Random) -> None:
    """A Claude Code assistant entry whose content is neither a list nor a string."""
    i = fresh(lines, rng, lambda ln: isinstance(o := obj(ln), dict) and o.get("type") == "assistant"
              and isinstance(o.get("message"), dict))
    if i is not None:
        o = obj(lines[i])
        o["message"]["content"] = rng.choice([5, None, {"type": "text"}, True])
        _set(lines, i, dump(o), "bad_content")


def nul_byte(lines: list[Line], rng: random.Random) -> None:
    """A raw NUL byte inside a string (JSON forbids raw control characters)."""
    i = fresh(lines, rng, lambda ln: bool(_value_string_starts(ln.data)))
    if i is not None:
        d = lines[i].data
        at = rng.choice(_value_string_starts(d))
        _set(lines, i, d[:at] + b"\x00" + d[at:], "invalid_json")


def flip_field(lines: list[Line], rng: random.Random) -> None:
    """Some value anywhere in an entry replaced by a value of another type."""
    i = fresh(lines, rng, lambda ln: bool(paths_in(obj(ln))))
    if i is None:
        return
    o = obj(lines[i])
    c, k = rng.choice(paths_in(o))
    c[k] = copy.deepcopy(rng.choice(WEIRD_VALUES))
    _set(lines, i, dump(o), None)


def drop_field(lines: list[Line], rng: random.Random) -> None:
    i = fresh(lines, rng, lambda ln: bool(paths_in(obj(ln))))
    if i is None:
        return
    o = obj(lines[i])
    c, k = rng.choice(paths_in(o))
    del c[k]
    _set(lines, i, dump(o), None)


def glue(lines: list[Line], rng: random.Random) -> None:
    """Two lines with the newline between them lost: both objects are read."""
    idx = [i for i in range(len(lines) - 1) if not lines[i].touched and not lines[i + 1].touched
           and isinstance(obj(lines[i]), dict) and isinstance(obj(lines[i + 1]), dict)]
    if idx:
        i = rng.choice(idx)
        lines[i:i + 2] = [Line(lines[i].data + lines[i + 1].data, None, True)]


def duplicate_line(lines: list[Line], rng: random.Random) -> None:
    """An entry written twice (identical)."""
    i = fresh(lines, rng, lambda ln: isinstance(obj(ln), dict))
    if i is not None:
        lines.insert(rng.randrange(i + 1, len(lines) + 1), Line(lines[i].data, None, True))


def conflicting_duplicate(lines: list[Line], rng: random.Random) -> None:
    """An entry written twice with the same id but other content."""
    i = fresh(lines, rng, lambda ln: isinstance(o := obj(ln), dict) and any(
        isinstance(v, str) for c, k in paths_in(o) for v in [c[k]]))
    if i is None:
        return
    o = obj(lines[i])
    strs = [(c, k) for c, k in paths_in(o) if isinstance(c[k], str) and k not in ("uuid", "id", "type")]
    if not strs:
        return
    c, k = rng.choice(strs)
    c[k] = c[k] + " (changed)"
    lines.insert(rng.randrange(i + 1, len(lines) + 1), Line(dump(o), None, True))


def parent_cycle(lines: list[Line], rng: random.Random) -> None:
    """Parent links that form a cycle (a → b → a), or an entry that is its own parent."""
    ids = []
    for i, ln in enumerate(lines):
        o = obj(ln)
        if isinstance(o, dict) and not ln.touched:
            key = "uuid" if "uuid" in o else "id" if "parentId" in o else None
            if key and isinstance(o.get(key), str):
                ids.append((i, key, o[key]))
    if not ids:
        return
    i, key, own = rng.choice(ids)
    _, _, other = rng.choice(ids)
    o = obj(lines[i])
    o["parentUuid" if key == "uuid" else "parentId"] = own if rng.random() < 0.3 else other
    _set(lines, i, dump(o), None)


def huge_string(lines: list[Line], rng: random.Random, size: int = 200_000) -> None:
    i = fresh(lines, rng, lambda ln: any(isinstance(c[k], str) for c, k in paths_in(obj(ln))))
    if i is None:
        return
    o = obj(lines[i])
    c, k = rng.choice([(c, k) for c, k in paths_in(o) if isinstance(c[k], str)])
    c[k] = rng.choice(["x", "é", "日", "🙂", "\\n"]) * size
    _set(lines, i, dump(o), None)


def _nested(depth: int, inner: Any = 1) -> bytes:
    return b"[" * depth + json.dumps(inner).encode() + b"]" * depth


def deep_nest(lines: list[Line], rng: random.Random) -> None:
    """A value nested deeper than any JSON writer allows (10,000 lists, or 250: past the 200 limit)."""
    i = fresh(lines, rng, lambda ln: bool(_value_string_starts(ln.data)))
    if i is None:
        return
    d = lines[i].data
    at = rng.choice(_value_string_starts(d)) - 1  # the opening quote of a string value
    end = at + 1
    while end < len(d) and not (d[end:end + 1] == b'"' and d[end - 1:end] != b"\\"):
        end += 1
    depth = rng.choice([10_000, 1_500, 250])
    _set(lines, i, d[:at] + _nested(depth) + d[end + 1:], "too_deep")


def _usage_dicts(o: Any) -> list[dict[str, Any]]:
    out = []
    for c, k in paths_in(o):
        v = c[k]
        if isinstance(v, dict) and k in ("usage", "last_token_usage", "total_token_usage", "cache_creation"):
            out.append(v)
    return out


def usage_out_of_range(lines: list[Line], rng: random.Random) -> None:
    """Usage counts of 1e30, -1, strings, floats, booleans, 2**64."""
    i = fresh(lines, rng, lambda ln: bool(_usage_dicts(obj(ln))))
    if i is None:
        return
    o = obj(lines[i])
    for u in _usage_dicts(o):
        for k in list(u):
            if rng.random() < 0.7:
                u[k] = rng.choice(WEIRD_NUMBERS)
    _set(lines, i, dump(o), KEPT)


def weird_timestamp(lines: list[Line], rng: random.Random) -> None:
    """Missing, unparsable, far-future and out-of-range timestamps."""
    i = fresh(lines, rng, lambda ln: any(k == "timestamp" for _, k in paths_in(obj(ln))))
    if i is None:
        return
    o = obj(lines[i])
    for c, k in paths_in(o):
        if k == "timestamp":
            if rng.random() < 0.2:
                del c[k]
            else:
                c[k] = rng.choice(WEIRD_TIMES)
    _set(lines, i, dump(o), None)


# numbers JSON allows that a double cannot hold: Python's json and DuckDB's reader take them (as inf, an
# int, 0.0), orjson refuses them (issue 23, item 7: `"timestamp": 1e400` stopped the columnar loader)
BEYOND_DOUBLE = ["1e400", "-1e400", "1e-400", "1" + "0" * 400, "2e308", "-0.0e999", "123456789012345678901e300"]
_NUMBER_HERE = "\u0001ctxreplay-number\u0001"


def number_beyond_double(lines: list[Line], rng: random.Random) -> None:
    """A number beyond a double (`1e400`, 400 digits): in the timestamp, most often, else anywhere."""
    i = fresh(lines, rng, lambda ln: bool(paths_in(obj(ln))))
    if i is None:
        return
    o = obj(lines[i])
    spots = paths_in(o)
    stamps = [(c, k) for c, k in spots if k == "timestamp"]
    c, k = rng.choice(stamps if stamps and rng.random() < 0.7 else spots)
    c[k] = _NUMBER_HERE
    data = dump(o).replace(dump(_NUMBER_HERE), rng.choice(BEYOND_DOUBLE).encode(), 1)
    _set(lines, i, data, None)


def tool_input_not_object(lines: list[Line], rng: random.Random) -> None:
    """Tool inputs that are not objects (Claude Code input, pi arguments, Codex arguments text)."""
    def targets(o: Any) -> list[tuple[Any, Any]]:
        return [(c, k) for c, k in paths_in(o) if isinstance(c, dict) and (
            k == "input" and c.get("type") == "tool_use" or k == "arguments")]

    i = fresh(lines, rng, lambda ln: bool(targets(obj(ln))))
    if i is None:
        return
    o = obj(lines[i])
    c, k = rng.choice(targets(o))
    c[k] = rng.choice(["a string", 5, [1, 2], None, "{not json", '{"a":' * 300 + "1" + "}" * 300,
                       "[" * 2000 + "]" * 2000, True, {"nested": {"deep": [[[[]]]]}}])
    _set(lines, i, dump(o), None)


def random_bytes(lines: list[Line], rng: random.Random) -> None:
    i = fresh(lines, rng)
    if i is not None:
        data = bytes(b for b in rng.randbytes(rng.randrange(1, 300)) if b != 10) or b"\x01"
        _set(lines, i, data, None)


def blank_lines(lines: list[Line], rng: random.Random) -> None:
    """Lines holding only whitespace (not counted as lines)."""
    first = 1 if lines and lines[0].data.startswith(b"\xef\xbb\xbf") else 0  # a BOM stays first
    for _ in range(rng.randrange(1, 4)):
        lines.insert(rng.randrange(first, len(lines) + 1),
                     Line(rng.choice([b"", b"   ", b"\t", b"\r", "\u00a0\u2003".encode()]), None, True))


def crlf(lines: list[Line], rng: random.Random) -> None:
    """Windows line endings on every line."""
    for ln in lines:
        if not ln.data.endswith(b"\r"):
            ln.data += b"\r"


def bom(lines: list[Line], rng: random.Random) -> None:
    """A UTF-8 byte order mark before the first line (written by some Windows editors)."""
    if lines and not lines[0].touched and not lines[0].data.startswith(b"\xef\xbb\xbf"):
        lines[0] = Line(b"\xef\xbb\xbf" + lines[0].data, KEPT if isinstance(obj(lines[0]), dict) else None, True)


def hostile_ids(lines: list[Line], rng: random.Random) -> None:
    """Session / entry / parent / agent ids with `/`, `..`, NUL, 300 bytes, `.`, empty."""
    keys = ("sessionId", "uuid", "parentUuid", "agentId", "id", "parentId", "call_id", "toolCallId",
            "tool_use_id", "requestId")
    i = fresh(lines, rng, lambda ln: any(k in keys for _, k in paths_in(obj(ln))))
    if i is None:
        return
    o = obj(lines[i])
    for c, k in paths_in(o):
        if k in keys and rng.random() < 0.6:
            c[k] = rng.choice(HOSTILE_IDS)
    _set(lines, i, dump(o), None)


# name → (mutation, the quarantine code it must give when it names one)
MUTATIONS: dict[str, Callable[[list[Line], random.Random], None]] = {
    "truncate": truncate,
    "non_utf8_outside": non_utf8_outside,
    "non_utf8_in_string": non_utf8_in_string,
    "surrogate_escape": surrogate_escape,
    "not_an_object": not_an_object,
    "drop_type": drop_type,
    "flip_type": flip_type,
    "drop_message": drop_message,
    "drop_role": drop_role,
    "bad_content": bad_content,
    "nul_byte": nul_byte,
    "deep_nest": deep_nest,
    "flip_field": flip_field,
    "drop_field": drop_field,
    "glue": glue,
    "duplicate_line": duplicate_line,
    "conflicting_duplicate": conflicting_duplicate,
    "parent_cycle": parent_cycle,
    "huge_string": huge_string,
    "usage_out_of_range": usage_out_of_range,
    "weird_timestamp": weird_timestamp,
    "tool_input_not_object": tool_input_not_object,
    "random_bytes": random_bytes,
    "blank_lines": blank_lines,
    "crlf": crlf,
    "bom": bom,
    "hostile_ids": hostile_ids,
    "number_beyond_double": number_beyond_double,
}

# the quarantine code each targeted mutation class produces (one code per class)
EXPECTED_CODE = {
    "truncate": "truncated_json",
    "non_utf8_outside": "invalid_utf8",
    "not_an_object": "not_an_object",
    "drop_type": "no_type",
    "drop_message": "no_message",
    "drop_role": "no_role",
    "bad_content": "bad_content",
    "nul_byte": "invalid_json",
    "deep_nest": "too_deep",
}


def render(lines: list[Line]) -> bytes:
    return b"\n".join(ln.data for ln in lines) + b"\n"


def mutate(seed: Seed, names: list[str], rng: random.Random) -> list[Line]:
    lines = [Line(d) for d in seed.lines]
    for n in names:
        MUTATIONS[n](lines, rng)
    return lines


# ---------------------------------------------------------------- hostile files


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def bomb_png(width: int = 100_000, height: int = 100_000) -> bytes:
    """A PNG whose header claims width x height pixels (its data is a few bytes: it never decodes)."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\x00" * 64)
    return b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", ihdr) + _png_chunk(b"IDAT", idat) + _png_chunk(b"IEND", b"")


def animated_gif() -> bytes:
    from PIL import Image

    frames = [Image.new("P", (24, 16), i * 40) for i in range(4)]
    buf = io.BytesIO()
    frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:], duration=80, loop=0)
    return buf.getvalue()


def cc_entry(sid: str, uuid: str, parent: str | None, role: str, content: Any, **kw: Any) -> dict[str, Any]:
    e: dict[str, Any] = {"parentUuid": parent, "isSidechain": False, "userType": "external", "cwd": "/h",
                         "sessionId": sid, "version": "2.1.40", "type": role, "uuid": uuid,
                         "timestamp": "2026-04-01T10:00:00.000Z",
                         "message": {"role": role, "content": content}}
    if role == "assistant":
        e["requestId"] = kw.pop("rid", f"req_{uuid[:8]}")
        e["message"].update(id=kw.pop("mid", f"msg_{uuid[:8]}"), type="message", model="claude-sonnet-4-5",
                            stop_reason="end_turn", usage={"input_tokens": 5, "output_tokens": 7,
                                                           "cache_read_input_tokens": 0,
                                                           "cache_creation_input_tokens": 0})
    e.update(kw)
    return e


def cc_session(sid: str, user_content: Any, answer: str = "ok", **kw: Any) -> bytes:
    u1, a1 = f"{sid[:8]}-u1", f"{sid[:8]}-a1"
    return b"".join(dump(e) + b"\n" for e in [
        cc_entry(sid, u1, None, "user", user_content, **kw),
        cc_entry(sid, a1, u1, "assistant", [{"type": "text", "text": answer}], **kw)])


# what a hostile id or name tries on a terminal: set the window title, ring the bell, clear the screen
TERMINAL_ESCAPES = "\x1b]0;PWNED\x07\x1b[2J"


def escapes_session(sid: str = f"esc{TERMINAL_ESCAPES}\nsession") -> bytes:
    """A Claude Code session whose session id, model name and text hold terminal escapes, a newline
    and rich markup (`[/x]`): every printer must show them escaped (issue 23, item 12)."""
    u = cc_entry(sid, "esc-u1", None, "user", f"text {TERMINAL_ESCAPES} end")
    a = cc_entry(sid, "esc-a1", "esc-u1", "assistant", [{"type": "text", "text": f"ok {TERMINAL_ESCAPES}"}])
    a["message"]["model"] = f"claude{TERMINAL_ESCAPES}[/x]\nmodel"
    return dump(u) + b"\n" + dump(a) + b"\n"


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def write_hostile_inputs(out: Path, *, huge_mb: float = 100, seed: int = 0, corpus: Path | None = None,
                         seeds_dir: Path = SEEDS_DIR) -> dict[str, int]:
    """Write the hostile directory (see the module docstring); returns file counts by part."""
    rng = random.Random(seed)
    out = Path(out)
    counts: dict[str, int] = {}

    def put(part: str, rel: str | bytes, data: bytes) -> None:
        p = out / part / (os.fsdecode(rel) if isinstance(rel, bytes) else rel)
        _write(p, data)
        counts[part] = counts.get(part, 0) + 1

    # fuzzed: every seed x every mutation class, plus a few random stacks of mutations; each file
    # its own session (the seed's session uuid replaced), so each is replayed (copies/ does the rest)
    seeds = seed_files(seeds_dir) + (corpus_seeds(corpus, rng) if corpus else [])
    n = 0
    for s_i, s in enumerate(seeds):
        variants = [[name] for name in MUTATIONS] + [rng.sample(sorted(MUTATIONS), 4) for _ in range(3)]
        for names in variants:
            n += 1
            sid = session_uuid(s)
            new = f"f0220000-0000-4000-8000-{n:012d}"
            lines = [Line(ln.data.replace(sid.encode(), new.encode()), ln.expect, ln.touched) if sid else ln
                     for ln in mutate(s, names, rng)]
            label = names[0] if len(names) == 1 else "stack"
            put("fuzzed", f"{s.fmt}/{label}/{s_i:02d}-{s.name.replace(sid, new) if sid else s.name}", render(lines))

    # bytes that are not UTF-8
    sid = "d1000000-0000-4000-8000-000000000001"
    put("utf8", "x.jsonl", b"\xff{}\n")
    good = cc_session(sid, "caf\xc3\xa9 is fine")
    put("utf8", f"{sid}.jsonl", good.replace("café".encode(), b"caf\xff\xfe"))
    put("utf8", "binary.jsonl", random.Random(seed + 1).randbytes(20_000))
    put("utf8", "d1000000-0000-4000-8000-000000000002.json",
        b'{"model":"claude-x","messages":[{"role":"user","content":"hi \xff there"},'
        b'{"role":"assistant","content":"hello"}]}\n')
    put("utf8", "d1000000-0000-4000-8000-000000000003.json", b'{"model":"claude-x",\xff"messages":[]}\n')
    put("utf8", "d1000000-0000-4000-8000-000000000004.jsonl",
        cc_session("d1000000-0000-4000-8000-000000000004", "lone <1> surrogate <2>")
        .replace(b"<1>", b"\\ud800").replace(b"<2>", b"\\udfff"))  # JSON escapes of lone surrogates
    put("utf8", "latin1.jsonl", "{\"type\":\"user\",\"text\":\"naïve\"}\n".encode("latin-1"))

    # truncated: a crash mid-write, no final newline, a BOM and CRLF line endings
    sid = "d2000000-0000-4000-8000-000000000001"
    full = cc_session(sid, "please finish") + dump(cc_entry(sid, "late-u2", f"{sid[:8]}-a1", "user", "more"))
    put("truncated", f"{sid}.jsonl", full[: len(full) - 25])
    sid = "d2000000-0000-4000-8000-000000000002"
    put("truncated", f"{sid}.jsonl", cc_session(sid, "no final newline").rstrip(b"\n"))
    sid = "d2000000-0000-4000-8000-000000000003"
    put("truncated", f"{sid}.jsonl", b"\xef\xbb\xbf" + cc_session(sid, "bom and crlf").replace(b"\n", b"\r\n"))

    # hostile names and ids
    sid = "d3000000-0000-4000-8000-000000000001"
    put("names", "...jsonl", cc_session(sid, "dots"))
    put("names", "-rf.jsonl", cc_session("d3000000-0000-4000-8000-000000000002", "dash"))
    put("names", "n" * 244 + ".jsonl", cc_session("d3000000-0000-4000-8000-000000000003", "long name"))
    put("names", "new\nline.jsonl", cc_session("d3000000-0000-4000-8000-000000000004", "newline in name"))
    put("names", b"bad-\xff\xfe-name.jsonl", cc_session("d3000000-0000-4000-8000-000000000005", "bytes in name"))
    put("names", "spaces and ünïcode ✓.jsonl", cc_session("d3000000-0000-4000-8000-000000000006", "unicode"))
    put("names", f"escapes{TERMINAL_ESCAPES}.jsonl", escapes_session())
    for k, hid in enumerate(["../../escape", "a/b/../../c", "..", ".", "", "nul\u0000id", "z" * 300,
                             "/etc/passwd", "UPPER", "a--b"]):
        put("names", f"ids-{k:02d}.jsonl", cc_session(hid, f"session id {hid[:20]!r}",
                                                      agentId="../../agent" if k % 2 else "ok"))
    oc = [{"type": "session", "version": 3, "id": "../../oc-escape", "timestamp": "2026-04-01T10:00:00Z"},
          {"type": "message", "id": "../x", "parentId": None, "timestamp": "2026-04-01T10:00:01Z",
           "message": {"role": "user", "content": "hi"}},
          {"type": "message", "id": "a/b", "parentId": "../x", "timestamp": "2026-04-01T10:00:02Z",
           "message": {"role": "assistant", "content": [{"type": "text", "text": "one"}], "provider": "p",
                       "model": "m", "usage": {"input": 1, "output": 1}}},
          {"type": "message", "id": "\u0000" + "q" * 300, "parentId": "../x", "timestamp": "2026-04-01T10:00:03Z",
           "message": {"role": "assistant", "content": [{"type": "text", "text": "branch"}], "provider": "p",
                       "model": "m", "usage": {"input": 1, "output": 1}}}]
    put("names", "openclaw-hostile.jsonl", b"".join(dump(o) + b"\n" for o in oc))
    put("names", "..json", json.dumps({"model": "claude-x", "messages": [
        {"role": "user", "content": "request file named ..json"}]}).encode())

    # copies of sessions: exact, an older prefix, one entry changed
    for sd in seed_files(seeds_dir):
        data = render([Line(d) for d in sd.lines])
        put("copies", f"original/{sd.name}", data)
        put("copies", f"backup/{sd.name}", data)
        put("copies", f"prefix/{sd.name}", render([Line(d) for d in sd.lines[: max(1, len(sd.lines) // 2)]]))
        changed = list(sd.lines)
        k = max(i for i, d in enumerate(changed) if b'"text":"' in d)
        changed[k] = changed[k].replace(b'"text":"', b'"text":"(edited) ', 1)  # same id, other content
        put("copies", f"changed/{sd.name}", render([Line(d) for d in changed]))

    # huge line, empty files
    if huge_mb > 0:
        sid = "d4000000-0000-4000-8000-000000000001"
        put("huge", f"{sid}.jsonl", cc_session(sid, "y" * int(huge_mb * 1024 * 1024), answer="that was long"))
        # `truncate -s`: a sparse file of zeros, one line without a line break (over --max-line-bytes, 64 MiB
        # by default, it is quarantined as line_too_long without being read into memory)
        put("huge", "zeros.jsonl", b"")
        with open(out / "huge" / "zeros.jsonl", "r+b") as fh:
            fh.truncate(int(huge_mb * 1024 * 1024))
    put("huge", "empty.jsonl", b"")
    put("huge", "blank.jsonl", b"\n  \n\t\n\r\n")
    put("huge", "empty.json", b"")

    # images
    sid = "d5000000-0000-4000-8000-000000000001"

    def img(data: bytes, mt: str) -> dict[str, Any]:
        return {"type": "image", "source": {"type": "base64", "media_type": mt,
                                            "data": base64.b64encode(data).decode()}}

    put("images", f"{sid}.jsonl", cc_session(sid, [
        {"type": "text", "text": "three images"},
        img(bomb_png(), "image/png"),
        img(b"this is not an image at all", "image/png"),
        img(animated_gif(), "image/gif"),
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "@@@not base64@@@"}},
    ]))

    # deep nesting
    sid = "d6000000-0000-4000-8000-000000000001"
    deep = dump(cc_entry(sid, "deep-u0", None, "user", "x"))
    put("deep", f"{sid}.jsonl",
        deep.replace(b'"content":"x"', b'"content":' + _nested(10_000)) + b"\n"
        + deep.replace(b'"content":"x"', b'"content":' + _nested(250)).replace(b"deep-u0", b"deep-u1") + b"\n"
        + cc_session(sid, "fine")
        + dump(cc_entry(sid, "deep-a9", f"{sid[:8]}-a1", "assistant", [
            {"type": "tool_use", "id": "toolu_deep", "name": "x", "input": json.loads(_nested(150))}])) + b"\n")

    # numbers beyond a double: every one as a timestamp of a message entry, and inside entries
    sid = "d7000000-0000-4000-8000-000000000001"
    lines, parent = [], None
    for k, num in enumerate(BEYOND_DOUBLE):
        role = "user" if k % 2 == 0 else "assistant"
        e = cc_entry(sid, f"num-{k}", parent, role, "n" if role == "user" else [{"type": "text", "text": "n"}],
                     timestamp=_NUMBER_HERE)
        if k == 3:
            e["message"]["content"] = [{"type": "tool_use", "id": "toolu_n", "name": "x", "input": {"n": _NUMBER_HERE}}]
        lines.append(dump(e).replace(dump(_NUMBER_HERE), num.encode()))
        parent = f"num-{k}"
    put("numbers", f"{sid}.jsonl", b"\n".join(lines) + b"\n")
    return counts


# ------------------------------------------------------------ files that are not regular files, links out


SECRET = b"aws_secret_access_key = not-for-ctxreplay\n"


def special_inputs(d: Path, outside: Path) -> dict[str, str]:
    """Write into `d` what a command must list and never read (issue 23, item 9), with `outside` a
    directory beside it holding a secret file and a session; returns name -> the words its
    `skipped_files` reason holds. Also `d/inside.jsonl`, a link to a session inside `d`: read."""
    outside.mkdir(parents=True, exist_ok=True)
    d.mkdir(parents=True, exist_ok=True)
    (outside / "credentials").write_bytes(SECRET)
    sid = "d9100000-0000-4000-8000-000000000001"
    (outside / f"{sid}.jsonl").write_bytes(cc_session(sid, "a session outside"))
    (d / "real").mkdir(exist_ok=True)
    sid = "d9100000-0000-4000-8000-000000000002"
    (d / "real" / f"{sid}.jsonl").write_bytes(cc_session(sid, "a session inside"))
    out = {}
    for name, target, what in (("secret.jsonl", outside / "credentials", "outside"),
                               ("environ.jsonl", Path("/proc/self/environ"), "outside"),
                               ("zero.jsonl", Path("/dev/zero"), "outside"),
                               ("elsewhere", outside, "outside"),
                               ("dangling.jsonl", d / "no-such-file.jsonl", "does not exist"),
                               ("inside.jsonl", Path("real") / f"{sid}.jsonl", "")):
        if target.is_absolute() and not target.exists() and what == "outside":
            continue  # no /proc here
        os.symlink(target, d / name)
        if what:
            out[name] = what
    os.mkfifo(d / "fifo.jsonl")
    out["fifo.jsonl"] = "a FIFO"
    (d / "loop").symlink_to(".")  # a link back up the tree: walked once, with --follow-links too
    return out


VANISH = ("deleted", "renamed", "fifo", "directory")


def vanish(path: Path, how: str) -> None:
    """What happens to a listed file before it is read (issue 23, item 4): deleted, renamed to
    `*.jsonl.deleted.<time>` (what OpenClaw does on every session reset), replaced by a FIFO or by a
    directory."""
    if how == "renamed":
        path.rename(path.with_name(path.name + ".deleted.2026-04-01T10-00-00.000Z"))
        return
    path.unlink()
    if how == "fifo":
        os.mkfifo(path)
    elif how == "directory":
        path.mkdir()
    elif how != "deleted":
        raise ValueError(f"vanish: {how!r}, one of {VANISH}")


# ------------------------------------------------------------ hostile --out directories and --ledger files


FOREIGN_OUT_FILES = {
    "summary.json": b'{"mine": true}\n',  # the name of an output, not written by ctxreplay
    "requests/important.txt": b"keep me\n",  # inside a directory with an output's name
    ".runs/keep/data.txt": b"keep me too\n",  # inside ctxreplay's staging area, not a run of it
    ".summary.json.bak": b"a backup\n",  # a name older versions took for their temp files
}


def foreign_out_dir(path: Path) -> dict[str, bytes]:
    """A directory that is not a ctxreplay output (a run must refuse it as --out and touch nothing
    in it); returns its files, relative path -> bytes."""
    for rel, data in FOREIGN_OUT_FILES.items():
        _write(path / rel, data)
    return dict(FOREIGN_OUT_FILES)


def not_ledgers(d: Path, *, ledger: Path | None = None) -> dict[str, Path]:
    """Files that are not ctxreplay ledgers, by kind: a Parquet file, a SQLite database, a JSON
    file, random bytes, a DuckDB database with its own `runs` and `decisions` tables; with
    `ledger` (a real one), that ledger cut to half its size. A run must refuse each as --ledger,
    and leave it as it was."""
    import sqlite3

    import duckdb
    import pyarrow as pa
    import pyarrow.parquet as pq

    d.mkdir(parents=True, exist_ok=True)
    out = {k: d / name for k, name in (("parquet", "data.parquet"), ("sqlite", "x.sqlite"), ("json", "l.json"),
                                        ("random", "random.bin"), ("duckdb", "theirs.duckdb"))}
    pq.write_table(pa.table({"run": [1, 2], "decision": ["a", "b"]}), out["parquet"])
    con = sqlite3.connect(out["sqlite"])
    con.execute("CREATE TABLE runs (id INTEGER)")
    con.commit()
    con.close()
    out["json"].write_bytes(b'{"decisions": []}\n')
    out["random"].write_bytes(random.Random(0).randbytes(4096))
    duck = duckdb.connect(str(out["duckdb"]))
    duck.execute("CREATE TABLE runs (id INTEGER, who VARCHAR); INSERT INTO runs VALUES (1, 'them'); "
                 "CREATE TABLE decisions (id INTEGER, what VARCHAR); INSERT INTO decisions VALUES (1, 'theirs')")
    duck.close()
    if ledger is not None:
        data = ledger.read_bytes()
        out["truncated"] = d / "truncated.duckdb"
        out["truncated"].write_bytes(data[:len(data) // 2])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", type=Path)
    ap.add_argument("--huge-mb", type=float, default=100, help="size of the single huge line (0: none)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--corpus", type=Path, default=None, help="also fuzz windows of these real files")
    ap.add_argument("--force", action="store_true", help="replace DIR when it exists")
    a = ap.parse_args()
    if a.dir.exists():
        if not a.force:
            sys.exit(f"{a.dir} exists; pass --force to replace it")
        shutil.rmtree(a.dir)
    counts = write_hostile_inputs(a.dir, huge_mb=a.huge_mb, seed=a.seed, corpus=a.corpus)
    total = sum(counts.values())
    print(f"wrote {total} files under {a.dir}: " + ", ".join(f"{k} {v}" for k, v in counts.items()))


if __name__ == "__main__":
    main()
