"""What every loader produces, and the shared machinery: line reading, accounting, blocks building.

A loader turns files into `Thread`s (ordered `Message`s) plus a `FileLoad` per file that accounts
for every non-blank physical line: message line, other line (by kind), or quarantined line.
`threads_to_blocks` turns threads into the blocks table, with the call structure
(`is_call`, `first_call`, `last_call`) computed from message order and recorded compactions.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson
import polars as pl
import pyarrow as pa

from ctxreplay.pipeline.core.blockops import canonical_json, sha256_hex
from ctxreplay.pipeline.loaders.inputs import (  # noqa: F401 (the loaders' names)
    Lines,
    LongLine,
    path_str,
    read_file,
    read_lines,
    unreadable,
)
from ctxreplay.schemas.blocks import BLOCKS, CONTENT_COLUMNS
from ctxreplay.schemas.check import shared_strings

ORDER_STRIDE = 1024  # order_key = position * ORDER_STRIDE leaves room for inserted rows


@dataclass
class QuarantineRow:
    """One line nobody could understand: where, what (displayable), why, and the exact bytes when
    they are not UTF-8 (`raw` then shows each undecodable byte as a `\\xNN` escape)."""

    file: str
    line: int
    raw: str
    reason: str  # one readable sentence
    code: str  # stable short name of the reason (see QUARANTINE_CODES)
    raw_base64: str | None = None  # the line's exact bytes, only when they are not valid UTF-8
    line_bytes: int | None = None  # the line's length in bytes, when `raw` holds only its start (line_too_long)


# Stable names of quarantine reasons (the `code` column); the `reason` column says it in words.
QUARANTINE_CODES = {
    "invalid_utf8": "bytes that are not UTF-8 where JSON syntax was expected (the line cannot be parsed)",
    "truncated_json": "JSON that stops before its end (a line cut short, e.g. by a crash mid-write)",
    "invalid_json": "JSON syntax error",
    "too_deep": "JSON nested deeper than MAX_DEPTH (200) levels",
    "not_an_object": "a JSON value that is not an object",
    "no_type": "an object without a usable 'type' field",
    "no_message": "a message entry without its 'message' object",
    "bad_content": "a message whose content is neither a list nor a string",
    "no_role": "a message without a usable role",
    "no_payload": "a Codex rollout line without its 'payload' object",
    "unknown_format": "a file of no known transcript format",
    "not_a_request": "a request JSON document that is not a request",
    "unknown_record": "a Gemini CLI session line that is no record of its (header, message, $set, $rewindTo)",
    "line_too_long": "a line longer than --max-line-bytes (default 64 MiB), or a .json document bigger than it: "
                     "not read; `raw` holds its first 1024 bytes, `line_bytes` its length",
}


def bad(code: str, reason: str) -> str:
    """The line kind of an object that was not understood (for `FileLoad.account`)."""
    return f"!{code}|{reason}"


@dataclass
class FileLoad:
    """Accounting for one input file."""

    path: str
    format: str
    sha256: str = ""
    bytes: int = 0
    lines: int = 0  # non-blank physical lines
    message_lines: int = 0
    other_lines: Counter[str] = field(default_factory=Counter)  # by kind
    quarantine: list[QuarantineRow] = field(default_factory=list)
    recovered: list[dict[str, Any]] = field(default_factory=list)  # e.g. two objects on one line
    stats: Counter[str] = field(default_factory=Counter)  # loader counters (e.g. invalid_utf8_replaced)
    # digest of each non-blank line's bytes, by line number: finds copies of a session in other files
    digests: dict[int, bytes] = field(default_factory=dict, repr=False)

    @property
    def quarantined_lines(self) -> int:
        return len({q.line for q in self.quarantine})

    def check(self) -> None:
        total = self.message_lines + sum(self.other_lines.values()) + self.quarantined_lines
        if total != self.lines:
            from ctxreplay.errors import CheckFailed

            msg = (f"{self.path}: line accounting failed: {self.message_lines} message + "
                   f"{sum(self.other_lines.values())} other + {self.quarantined_lines} quarantined "
                   f"!= {self.lines} lines; this is a bug in ctxreplay's {self.format} loader")
            raise CheckFailed(msg)

    def account(self, line_no: int, raw: str, kinds: list[str]) -> None:
        """Count one physical line from the kinds of the objects on it.

        A kind starting with '!' is an object not understood (the rest is the reason). A line with
        no understood object is quarantined; otherwise it is a message line when any object on it
        is a message, else an other line of its first kind; objects lost beside understood ones
        are noted in `recovered`.
        """
        bad_ = [k for k in kinds if k.startswith("!")]
        good = [k for k in kinds if not k.startswith("!")]
        if not good:
            code, _, reason = (bad_[0][1:] if bad_ else "invalid_json|empty line").partition("|")
            self.quarantine.append(QuarantineRow(self.path, line_no, raw, reason, code))
            return
        if "message" in good:
            self.message_lines += 1
        else:
            self.other_lines[good[0]] += 1
        if bad_:
            self.recovered.append({"file": self.path, "line": line_no,
                                   "note": f"{len(bad_)} of {len(kinds)} objects on this line not understood: "
                                           f"{bad_[0][1:].partition('|')[2]}"})


@dataclass
class Block:
    """One content block (or one part of a tool_result's content)."""

    block_type: str  # text | thinking | redacted_thinking | tool_use | tool_result | image | document | ...
    text: str | None = None
    signature: str | None = None
    tool_use_id: str | None = None
    tool_name: str | None = None
    tool_input: str | None = None  # canonical JSON text
    is_error: bool | None = None
    part_type: str | None = None  # tool_result parts: string | text | image | tool_reference | empty
    part_pos: int = 0
    image_media_type: str | None = None
    image_data: str | None = None
    extra: dict[str, Any] | None = None  # other keys of the block, kept


@dataclass
class Message:
    """One logical message (all blocks of one model response, or one user/tool/system message)."""

    entry_id: str
    role: str  # system | user | assistant | tool
    blocks: list[Block]
    source_file: str
    source_line: int
    raw_line: str
    parent_id: str | None = None
    msg_key: str | None = None  # defaults to entry_id
    message_id: str | None = None
    request_id: str | None = None
    timestamp: datetime | None = None
    model: str | None = None
    provider: str | None = None
    api: str | None = None
    stop_reason: str | None = None
    # input, output, cache_read, cache_write, cache_write_5m, cache_write_1h (ints); miss_reason (str)
    # and missed_tokens: the provider's cache diagnosis recorded with the answer (Claude Code)
    usage: dict[str, Any] | None = None
    is_call: bool | None = None  # None: assistant messages are calls
    # a recorded request on this thread's path that an earlier thread reports (a branch's shared
    # history): a call of this thread for numbering and the stages' state, not reported here
    inherited: bool = False
    is_sidechain: bool = False
    is_meta: bool = False
    is_compact_summary: bool = False
    is_display_only: bool = False
    provenance: dict[str, str | None] | None = None  # kind, source_session, channel, tool
    visible_from: int | None = None  # position (in the thread) from which calls see it; default its own
    # per-block source lines when a message spans several physical lines (Claude Code split messages)
    block_lines: list[tuple[str, int, str, str]] | None = None  # (entry_id, line, raw, file) per block


@dataclass
class Compaction:
    """From the first call that starts after position `at`, messages before `keep_from` are gone."""

    at: int
    keep_from: int


@dataclass
class Thread:
    session_id: str
    thread_id: str
    source_format: str
    source_file: str
    messages: list[Message]
    compactions: list[Compaction] = field(default_factory=list)


# ---------------------------------------------------------------- line reading

# Deepest JSON nesting a line may hold. orjson refuses to parse beyond 1024 levels and to write
# beyond 255, and the targets wrap a tool input in about five more levels: 200 leaves room.
MAX_DEPTH = 200


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


_decoder = json.JSONDecoder(parse_constant=_reject_constant)
_SURROGATE = re.compile("[\ud800-\udfff]")


def nonblank(raw: bytes) -> bool:
    """Whether a physical line (its bytes) is not blank: blank is nothing but whitespace once
    decoded (a line holding bytes that are not UTF-8 never is)."""
    if not raw.strip():
        return False
    try:
        return bool(raw.decode("utf-8").strip())
    except UnicodeDecodeError:
        return True


def nonblank_lines(data: bytes) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, bytes without the `\\n`) of every physical line that is not blank."""
    start, n, i = 0, len(data), 1
    while start <= n:
        end = data.find(b"\n", start)
        if end < 0:
            end = n
        raw = data[start:end]
        if nonblank(raw):
            yield i, raw
        start, i = end + 1, i + 1


def decode_line(raw: bytes) -> tuple[str, int]:
    """A line's text (without a trailing `\\r`) and how many undecodable byte sequences it held.

    Valid UTF-8 decodes as it is; otherwise each undecodable sequence becomes U+FFFD (the caller
    keeps the bytes when the line cannot be used)."""
    try:
        return raw.decode("utf-8").rstrip("\r"), 0
    except UnicodeDecodeError:
        text = raw.decode("utf-8", "replace")
        return text.rstrip("\r"), text.count("\ufffd") - raw.count(b"\xef\xbf\xbd")


def displayable(raw: bytes) -> str:
    """A line's bytes as text for people: undecodable bytes as `\\xNN` escapes."""
    return raw.decode("utf-8", "backslashreplace").rstrip("\r")


def read_nonblank_lines(path: Path, data: bytes | None = None) -> tuple[bytes, list[tuple[int, str]]]:
    """A file's bytes (read unless given) and its non-blank physical lines as displayable text.

    Lines are (1-based line number, text without its line break); bytes that are not UTF-8 show
    as `\\xNN` escapes (never as lone surrogates, which nothing downstream can write)."""
    if data is None:
        data = read_file(path)
    return data, [(i, displayable(raw)) for i, raw in nonblank_lines(data)]


def file_load(path: Path, fmt: str, data: bytes | Lines, lines: int) -> FileLoad:
    """A file's accounting record, with its size and sha256 taken from its bytes (from `read_lines`:
    the whole file's, its lines over the limit counted and quarantined, `take_long_lines`)."""
    if isinstance(data, Lines):
        load = FileLoad(path_str(path), fmt, lines=lines)
        take_long_lines(load, data)
        return load
    return FileLoad(path_str(path), fmt, sha256=hashlib.sha256(data).hexdigest(), bytes=len(data), lines=lines)


def _text_prefix(b: bytes) -> str:
    """The first bytes of a line as text: a character cut at the end is dropped, other bytes that
    are not UTF-8 show as `\\xNN` escapes."""
    for k in range(min(3, len(b)) + 1):
        try:
            return b[:len(b) - k].decode("utf-8")
        except UnicodeDecodeError:
            continue
    return displayable(b)


def too_long_row(spath: str, line: int, length: int, prefix: bytes, limit: int, *, document: bool = False) -> QuarantineRow:
    """The quarantine row of a line (or a whole .json document) over the limit, not read."""
    what = ("a JSON document" if document else "a line") + f" of {length:,} bytes"
    why = (f"{what}, over the limit of {limit:,} bytes (--max-line-bytes"
           + ("; a .json file is read whole, as one line" if document else "") + "): not read; `raw` holds its "
           f"first {len(prefix):,} bytes")
    return QuarantineRow(spath, line, _text_prefix(prefix), why, "line_too_long", line_bytes=length)


def take_long_lines(load: FileLoad, src: Lines) -> None:
    """A file's size and sha256 from `read_lines`, and its lines over the limit (which it left out)
    counted and quarantined as `line_too_long`."""
    load.bytes, load.sha256 = src.size, src.sha256
    for ll in src.long:
        load.lines += 1
        load.stats["lines_too_long"] += 1
        load.quarantine.append(too_long_row(load.path, ll.line, ll.length, ll.prefix, src.limit))


def line_digest(raw: bytes) -> bytes:
    return hashlib.blake2b(raw.rstrip(b"\r"), digest_size=16).digest()


@dataclass
class ParsedLine:
    """What one physical line holds: its JSON values, or why none could be read."""

    objs: list[Any]
    error: tuple[str, str] | None = None  # (code, reason) when a value could not be read
    replaced: int = 0  # lone surrogates (JSON `\\ud800` escapes) replaced by U+FFFD
    too_deep: int = 0  # values left out for nesting deeper than MAX_DEPTH


_NUMBER_PREFIX = re.compile(r"-?[0-9]*(\.[0-9]*)?([eE][-+]?[0-9]*)?")
_ESCAPE_PREFIX = re.compile(r"u[0-9a-fA-F]{0,4}")
_NUMBER_TAIL = re.compile(r"(\.[0-9]*)?([eE][-+]?[0-9]*)?")


def _cut_short(exc: json.JSONDecodeError, text: str) -> bool:
    """Whether the JSON error is the end of the text coming too early (the text is a prefix of valid
    JSON: a line cut by a crash mid-write) rather than a wrong character."""
    if exc.msg.startswith("Unterminated string"):
        return True
    tail = text[exc.pos:].rstrip()
    if not tail:
        return True
    if exc.msg.startswith("Invalid \\uXXXX"):
        return _ESCAPE_PREFIX.fullmatch(tail) is not None
    if exc.msg == "Expecting value":
        return any(w.startswith(tail) for w in ("null", "true", "false")) or bool(_NUMBER_PREFIX.fullmatch(tail))
    if exc.msg.startswith("Expecting"):  # a number cut after its dot or exponent sign: `1.`, `1e`, `1E+`
        return bool(_NUMBER_TAIL.fullmatch(tail))
    return False


def _json_error(exc: json.JSONDecodeError, text: str) -> tuple[str, str]:
    reason = f"invalid JSON at column {exc.colno}: {exc.msg}"
    return ("truncated_json" if _cut_short(exc, text) else "invalid_json"), reason


def depth_exceeds(obj: Any, limit: int = MAX_DEPTH) -> bool:
    """Whether a parsed JSON value nests deeper than `limit` (iterative: any depth is safe)."""
    stack: list[tuple[Any, int]] = [(obj, 1)]
    while stack:
        o, d = stack.pop()
        if d > limit:
            return True
        if isinstance(o, dict):
            stack.extend((v, d + 1) for v in o.values() if isinstance(v, (dict, list)))
        elif isinstance(o, list):
            stack.extend((v, d + 1) for v in o if isinstance(v, (dict, list)))
    return False


def scrub(obj: Any) -> tuple[Any, int]:
    """A value parsed by the standard library made safe to write: lone surrogates → U+FFFD (counted),
    integers beyond 64 bits → float, NaN / infinities → null. Iterative."""
    count = 0

    def fix(v: Any) -> Any:
        nonlocal count
        if isinstance(v, str):
            if _SURROGATE.search(v):
                new, n = _SURROGATE.subn("\ufffd", v)
                count += n
                return new
            return v
        if isinstance(v, bool) or v is None:
            return v
        if isinstance(v, int):
            if -(2**63) <= v < 2**64:
                return v
            try:
                return float(v)
            except OverflowError:
                return None
        if isinstance(v, float) and not math.isfinite(v):
            return None
        return v

    root: list[Any] = [obj]
    stack: list[Any] = [root]
    while stack:
        c = stack.pop()
        if isinstance(c, dict):
            for k in list(c):
                v = c[k]
                k2 = fix(k)
                if k2 != k:
                    del c[k]
                    c[k2] = v
                if isinstance(v, (dict, list)):
                    stack.append(v)
                else:
                    c[k2] = fix(v)
        else:
            for i, v in enumerate(c):
                if isinstance(v, (dict, list)):
                    stack.append(v)
                else:
                    c[i] = fix(v)
    return root[0], count


def _check_depth(text: str, objs: list[Any], parsed: ParsedLine) -> None:
    if text.count("[") + text.count("{") <= MAX_DEPTH:
        return  # cannot nest deeper than its brackets
    keep = [o for o in objs if not depth_exceeds(o)]
    parsed.too_deep = len(objs) - len(keep)
    objs[:] = keep


def parse_json_line(text: str) -> ParsedLine:
    """The JSON values on one line of text, in order.

    A line holding several values back to back yields them all; a parsable head followed by
    garbage yields the head with the error; nothing parsable yields the error alone. Values are
    what orjson reads (no lone surrogates, no NaN); a value only the standard library reads because
    of a lone surrogate escape is kept with U+FFFD in its place. Values nested deeper than
    MAX_DEPTH are left out (counted in `too_deep`)."""
    too_deep = ("too_deep", f"JSON nested deeper than {MAX_DEPTH} levels")
    try:
        objs = [orjson.loads(text)]
        out = ParsedLine(objs)
        _check_depth(text, objs, out)
        if not objs:
            out.error = too_deep
        return out
    except orjson.JSONDecodeError as exc:
        if "depth" in str(exc) or "recursion" in str(exc).lower():
            return ParsedLine([], too_deep, too_deep=1)
    out = ParsedLine([])
    pos, n = 0, len(text)
    while pos < n:
        while pos < n and text[pos] in " \t\r":
            pos += 1
        if pos >= n:
            break
        try:
            obj, end = _decoder.raw_decode(text, pos)
        except json.JSONDecodeError as exc:
            out.error = _json_error(exc, text)
            break
        except RecursionError:
            out.error = too_deep
            out.too_deep += 1
            break
        except ValueError as exc:  # NaN / Infinity
            out.error = ("invalid_json", f"invalid JSON at column {pos + 1}: {exc}")
            break
        try:
            obj = orjson.loads(text[pos:end])
        except orjson.JSONDecodeError:
            # valid JSON orjson will not read (a lone surrogate escape, a number beyond a double)
            obj, k = scrub(obj)
            out.replaced += k
        out.objs.append(obj)
        pos = end
    _check_depth(text, out.objs, out)
    if not out.objs and out.error is None and out.too_deep:
        out.error = too_deep
    return out


def parse_document(data: bytes) -> tuple[Any, str, int]:
    """One whole JSON document (a request file, a sidecar): (value or None, its text, replacements).

    A UTF-8 byte order mark is skipped. Bytes that are not UTF-8 become U+FFFD (counted); the
    document parses only when they all sit inside strings. The text returned is what was parsed
    (BOM included, so offsets match the file's lines)."""
    try:
        text, bad_bytes = data.decode("utf-8"), 0
    except UnicodeDecodeError:
        text = data.decode("utf-8", "replace")
        bad_bytes = text.count("\ufffd") - data.count(b"\xef\xbf\xbd")
    body = text.removeprefix("\ufeff")
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        try:
            doc, end = _decoder.raw_decode(body, len(body) - len(body.lstrip()))
            if body[end:].strip():
                return None, text, bad_bytes
        except (ValueError, RecursionError):
            return None, text, bad_bytes
        doc, _ = scrub(doc)
    if depth_exceeds(doc):
        return None, text, bad_bytes
    return doc, text, bad_bytes


def iter_json_lines(path: Path, load: FileLoad, data: bytes | Lines | None = None,
                    ) -> Iterator[tuple[int, str, list[Any]]]:
    """Yield (line number, raw line, parsed objects) for every non-blank physical line.

    A line that holds several JSON values back to back yields them all (recorded in
    `load.recovered`). A line that cannot be parsed at all is quarantined and not yielded; a line
    with a parsable head and garbage after it yields the head and quarantines nothing but records
    the loss in `load.recovered`.

    Bytes that are not UTF-8: where they sit inside JSON strings, the line is read with each
    undecodable sequence replaced by U+FFFD (counted in `load.stats["invalid_utf8_replaced"]` and
    noted in `load.recovered`); where the line cannot be parsed, it is quarantined as
    `invalid_utf8` with its exact bytes in `raw_base64`. The raw line shown for such a line
    escapes the bad bytes as `\\xNN`.

    The file is read with `read_lines` unless `data` is given (its result, or the file's bytes): a
    line over the limit is counted and quarantined as `line_too_long`, never read.
    """
    if data is None:
        data = read_lines(path)
    if isinstance(data, Lines):
        take_long_lines(load, data)
        data = data.data
    else:
        load.bytes = len(data)
        load.sha256 = hashlib.sha256(data).hexdigest()
    for i, raw_b in nonblank_lines(data):
        load.lines += 1
        load.digests[i] = line_digest(raw_b)
        got = read_line(load, i, raw_b)
        if got is not None:
            yield i, got[0], got[1]


_BOM = b"\xef\xbb\xbf"


def line_text(raw_b: bytes) -> str:
    """The text of a line `read_line` read as it is (valid UTF-8, no byte order mark)."""
    return raw_b.decode("utf-8").rstrip("\r")


NOT_PLAIN = object()  # `plain_object`: the line takes `read_line`'s careful way


def plain_object(data: bytes, view: memoryview, s: int, e: int, first: bool) -> Any:
    """The object on the line data[s:e] (`view`: a memoryview of `data`) when the line is plain: one
    JSON value that orjson reads from its bytes as they are, not nested deeper than MAX_DEPTH, and,
    on a file's first line (`first`), no byte order mark. Else NOT_PLAIN: the line needs `read_line`'s
    careful way (bytes that are not UTF-8, a lone surrogate escape, several values, JSON orjson
    refuses, too deep). What `read_line` reads from a plain line is that object alone, with no note."""
    if first and data.startswith(_BOM, s, e):
        return NOT_PLAIN
    try:
        o = orjson.loads(view[s:e])
    except orjson.JSONDecodeError:
        return NOT_PLAIN
    # a line cannot nest deeper than its brackets
    if data.count(b"[", s, e) + data.count(b"{", s, e) <= MAX_DEPTH or not depth_exceeds(o):
        return o
    return NOT_PLAIN


def read_line(load: FileLoad, i: int, raw_b: bytes, *, text: bool = True,
              plain: bool = True) -> tuple[str | None, list[Any]] | None:
    """One non-blank physical line (its bytes without the `\\n`) read as `iter_json_lines` reads it:
    (raw line as displayable text, parsed objects), or None when the line is quarantined.

    Quarantine rows, notes in `load.recovered` and counters in `load.stats` are recorded exactly as
    `iter_json_lines` documents; the caller counts the line (`load.lines`) and its digest.

    A plain line (`plain_object`) is parsed once, and with `text=False` its text is not decoded (None
    in its place: `line_text` gives it); any other line is read the careful way. `plain=False`: the
    caller found the line not plain already."""
    if plain:
        o = plain_object(raw_b, memoryview(raw_b), 0, len(raw_b), i == 1)
        if o is not NOT_PLAIN:
            return (line_text(raw_b) if text else None), [o]
    spath = load.path
    text, bad_bytes = decode_line(raw_b)
    if i == 1 and text.startswith("\ufeff"):
        text = text[1:]  # a byte order mark (some Windows editors write one)
        load.stats["byte_order_marks"] += 1
    raw = displayable(raw_b) if bad_bytes else text
    parsed = parse_json_line(text)
    if bad_bytes and (parsed.error or not parsed.objs):
        load.quarantine.append(QuarantineRow(
            spath, i, raw, "bytes that are not UTF-8 where JSON was expected; the exact bytes are kept in "
            "raw_base64", "invalid_utf8",
            base64.b64encode(raw_b).decode("ascii")))
        return None
    if bad_bytes:
        load.stats["invalid_utf8_replaced"] += bad_bytes
        load.recovered.append({"file": spath, "line": i,
                               "note": f"{bad_bytes} byte sequence(s) that are not UTF-8 inside JSON strings "
                                       "replaced by U+FFFD"})
    if parsed.replaced:
        load.stats["lone_surrogates_replaced"] += parsed.replaced
        load.recovered.append({"file": spath, "line": i,
                               "note": f"{parsed.replaced} lone surrogate escape(s) (\\ud800-\\udfff) "
                                       "replaced by U+FFFD"})
    if parsed.too_deep:
        load.stats["values_too_deep"] += parsed.too_deep
    if not parsed.objs:
        code, reason = parsed.error or ("invalid_json", "invalid JSON")
        load.quarantine.append(QuarantineRow(spath, i, raw, reason, code))
        return None
    if len(parsed.objs) > 1 or parsed.error or parsed.too_deep:
        note: dict[str, Any] = {"file": spath, "line": i, "objects": len(parsed.objs)}
        if parsed.error:
            note["lost_tail"] = parsed.error[1]
        if parsed.too_deep:
            note["too_deep"] = parsed.too_deep
        load.recovered.append(note)
    return raw, parsed.objs


# ---------------------------------------------------------------- helpers for loaders

_UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
_UUID_ANY_CASE = re.compile(_UUID, re.IGNORECASE)
_UUID_LOWER = re.compile(_UUID)


def session_id_from_name(path: Path, *, lowercase_only: bool = False) -> str | None:
    """The last uuid in a file name, lowercased (`<uuid>.jsonl`, `owner__repo__<uuid>.jsonl.deleted.<ts>`, ...).

    `lowercase_only`: only uuids written in lowercase count (Claude Code's file names).
    """
    found = (_UUID_LOWER if lowercase_only else _UUID_ANY_CASE).findall(path.name)
    return found[-1].lower() if found else None


def num(v: Any) -> int | None:
    """A JSON number as an int (floats truncated); None for anything else (booleans, strings,
    NaN, infinities, numbers beyond a 64-bit integer)."""
    if type(v) is int:
        return v if -(2**63) <= v < 2**63 else None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    if isinstance(v, float) and not math.isfinite(v):
        return None
    i = int(v)
    return i if -(2**63) <= i < 2**63 else None


def parse_ts(value: Any) -> datetime | None:
    """ISO-8601 string or epoch milliseconds → aware UTC datetime (None when absent/invalid, or
    outside what a datetime can hold once moved to UTC)."""
    if value is None or value == "" or isinstance(value, bool):
        return None
    try:
        if isinstance(value, (int, float)):
            return datetime.fromtimestamp(value / 1000.0, tz=UTC)
        if isinstance(value, str):
            s = value.strip()
            if s.endswith("Z"):
                s = s[:-1] + "+00:00"
            dt = datetime.fromisoformat(s)
            return dt.astimezone(UTC) if dt.tzinfo else dt.replace(tzinfo=UTC)
    except (ValueError, OverflowError, OSError):
        return None
    return None


def one_of(value: Any, options: set[str] | frozenset[str]) -> bool:
    """`value in options` for a value read from JSON (a list or an object is in no set of names)."""
    return isinstance(value, str) and value in options


def arguments_json(args: Any) -> tuple[str, bool]:
    """Tool-call arguments sent as JSON text (Codex, OpenAI chat) → (canonical JSON of what they hold,
    True); text that is not JSON, or nests deeper than MAX_DEPTH, is kept as a JSON string (False)."""
    if not isinstance(args, str):
        return json_text(args), True
    try:
        parsed = orjson.loads(args)
    except orjson.JSONDecodeError:
        return json_text(args), False
    if depth_exceeds(parsed, MAX_DEPTH):
        return json_text(args), False
    return json_text(parsed), True


def json_text(obj: Any) -> str:
    """Canonical JSON text of a value (sorted keys; strings kept exactly)."""
    return canonical_json(obj).decode()


def content_items(content: Any) -> list[dict[str, Any] | Block]:
    """A message's content as a list: block objects as they are, anything else already a text Block.

    Every format stores content as a string on some lines and a list of blocks on others (and,
    rarely, a bare object or scalar); loaders map the dicts and keep the rest as text.
    """
    if content is None:
        return []
    if isinstance(content, str):
        return [Block("text", text=content)]
    if isinstance(content, dict):
        return [content]
    if not isinstance(content, list):
        return [Block("text", text=json_text(content))]
    return [c if isinstance(c, dict) else Block("text", text=c if isinstance(c, str) else json_text(c))
            for c in content]


def b64_decoded_len(data: str | None) -> int | None:
    if not isinstance(data, str):
        return None
    if not data:
        return 0 if data == "" else None
    n = len(data)
    pad = len(data) - len(data.rstrip("="))
    return max(0, (n * 3) // 4 - pad)


# ---------------------------------------------------------------- threads → blocks


def _row_base(t: Thread, m: Message, pos: int) -> dict[str, Any]:
    u = m.usage or {}
    p = m.provenance or {}
    return {
        "session_id": t.session_id,
        "thread_id": t.thread_id,
        "source_format": t.source_format,
        "source_file": m.source_file,
        "source_line": m.source_line,
        "raw_line": m.raw_line,
        "entry_order": pos,
        "order_key": pos * ORDER_STRIDE,
        "entry_id": m.entry_id,
        "parent_id": m.parent_id,
        "msg_key": m.msg_key or m.entry_id,
        "message_id": m.message_id,
        "request_id": m.request_id,
        "role": m.role,
        "timestamp": m.timestamp,
        "model": m.model,
        "provider": m.provider,
        "api": m.api,
        "stop_reason": m.stop_reason,
        "usage_input": u.get("input"),
        "usage_output": u.get("output"),
        "usage_cache_read": u.get("cache_read"),
        "usage_cache_write": u.get("cache_write"),
        "usage_cache_write_5m": u.get("cache_write_5m"),
        "usage_cache_write_1h": u.get("cache_write_1h"),
        "cache_miss_reason": u.get("miss_reason"),
        "cache_missed_tokens": u.get("missed_tokens"),
        "is_sidechain": m.is_sidechain,
        "is_meta": m.is_meta,
        "is_compact_summary": m.is_compact_summary,
        "is_display_only": m.is_display_only,
        "provenance_kind": p.get("kind"),
        "provenance_source_session": p.get("source_session"),
        "provenance_channel": p.get("channel"),
        "provenance_tool": p.get("tool"),
        "origin": "transcript",
        "cache_epoch": 0,
    }


def call_ranges(t: Thread) -> tuple[list[bool], list[int], list[int | None]]:
    """Per message: is it a call this thread reports, first call that sees it, first call that no
    longer does.

    Calls are numbered along the thread's whole path: an inherited message (a recorded request that
    another thread reports) starts a call like any other, so a branch numbers its calls as the path
    it shares did, and every layer decides the shared history exactly as it did there.
    """
    n = len(t.messages)
    is_call = [
        (m.is_call if m.is_call is not None else m.role == "assistant") and not m.inherited for m in t.messages
    ]
    starts = [i for i in range(n) if is_call[i] or t.messages[i].inherited]  # call k starts at starts[k]
    import bisect

    def calls_starting_at_or_before(p: int) -> int:
        return bisect.bisect_right(starts, p)

    first = []
    for i, m in enumerate(t.messages):
        p = m.visible_from if m.visible_from is not None else i
        first.append(calls_starting_at_or_before(p))
    last: list[int | None] = [None] * n
    for c in t.compactions:
        # calls that start after position `at` no longer see messages before keep_from
        cut = bisect.bisect_right(starts, c.at)
        for i in range(min(c.keep_from, n)):
            if last[i] is None or last[i] > cut:  # type: ignore[operator]
                last[i] = cut
    return is_call, first, last


def threads_to_blocks(threads: list[Thread], notes: list[dict[str, Any]] | None = None) -> pa.Table:
    """The blocks table of these threads (BLOCKS schema).

    A value of the wrong type (a number where a text was expected, a text where a flag was, a
    count beyond 64 bits) is made to fit its column rather than failing the batch: text columns
    take the value's JSON text, flags and numbers become null; each such change is appended to
    `notes` (file, line, note).
    """
    rows: list[dict[str, Any]] = []
    for t in threads:
        is_call, first, last = call_ranges(t)
        for pos, m in enumerate(t.messages):
            base = _row_base(t, m, pos)
            base["is_call"] = is_call[pos]
            base["first_call"] = first[pos]
            base["last_call"] = last[pos]
            # a message compacted away before any call saw it keeps its rows with an empty range
            # (last_call == first_call): it is still a call of its own; the runner drops such rows
            # after it has read the call structure
            block_pos = -1
            blocks = m.blocks
            if not blocks:
                # a message with no content still exists (and may be a call): one "empty" row
                blocks = [Block("empty")]
            for bi, b in enumerate(blocks):
                # parts of one tool_result share block_pos; a part_pos of 0 starts a new block
                if b.part_pos == 0 or block_pos < 0:
                    block_pos += 1
                r = dict(base)
                if m.block_lines and bi < len(m.block_lines):
                    eid, line, raw, f = m.block_lines[bi]
                    r["entry_id"], r["source_line"], r["raw_line"], r["source_file"] = eid, line, raw, f
                r.update(
                    block_pos=block_pos,
                    part_pos=b.part_pos,
                    block_type=b.block_type,
                    part_type=b.part_type,
                    text=b.text,
                    signature=b.signature,
                    tool_use_id=b.tool_use_id,
                    tool_name=b.tool_name,
                    tool_input=b.tool_input,
                    is_error=b.is_error,
                    image_media_type=b.image_media_type,
                    image_data=b.image_data,
                    image_bytes=b64_decoded_len(b.image_data) if b.image_data is not None else None,
                    image_width=None,
                    image_height=None,
                    extra_json=json_text(b.extra) if b.extra else None,
                )
                rows.append(r)
    return blocks_table({f.name: [r.get(f.name) for r in rows] for f in BLOCKS}, notes)


def blocks_table(cols: dict[str, list[Any]], notes: list[dict[str, Any]] | None = None) -> pa.Table:
    """The blocks table of these rows (a list of values per column of BLOCKS, content_sha256 aside,
    which is computed here), every loader's last step: a value that does not fit its column is made
    to fit, with a note (`threads_to_blocks`)."""
    try:
        cols["content_sha256"] = _content_shas(cols)
        return _blocks_table(cols)
    except (pa.ArrowException, pl.exceptions.PolarsError, TypeError, ValueError, OverflowError):
        pass
    for f in BLOCKS:
        if f.name != "content_sha256":
            _coerce_column(f, cols, notes)
    cols["content_sha256"] = _content_shas(cols)
    return _blocks_table(cols)


def _blocks_table(cols: dict[str, list[Any]]) -> pa.Table:
    # the blocks of one line share its raw_line (one str object): one copy of its bytes, not one per block
    raw = cols["raw_line"]
    if not all(type(v) is str for v in raw):
        raise TypeError("raw_line: a value that is not a str")
    return pa.Table.from_pydict({**cols, "raw_line": shared_strings(raw)}, schema=BLOCKS)


def _content_shas(cols: dict[str, list[Any]]) -> list[str]:
    """content_sha256 of every row (as `blockops.content_sha256` computes it for one row)."""
    return [sha256_hex(canonical_json({c: v for c, v in zip(CONTENT_COLUMNS, vals) if v is not None}))
            for vals in zip(*(cols[c] for c in CONTENT_COLUMNS))]


_INT_RANGE = {pa.int32(): 2**31, pa.int64(): 2**63}


def _fits(f: pa.Field, v: Any) -> bool:
    t = f.type
    if v is None:
        return f.nullable
    if pa.types.is_string(t) or pa.types.is_string_view(t):
        return type(v) is str and not _SURROGATE.search(v)
    if pa.types.is_boolean(t):
        return type(v) is bool
    if pa.types.is_integer(t):
        return type(v) is int and -_INT_RANGE[t] <= v < _INT_RANGE[t]
    if pa.types.is_timestamp(t):
        return isinstance(v, datetime)
    return True


def _coerce_column(f: pa.Field, cols: dict[str, list[Any]], notes: list[dict[str, Any]] | None) -> None:
    col = cols[f.name]
    for i, v in enumerate(col):
        if _fits(f, v):
            continue
        if pa.types.is_string(f.type) or pa.types.is_string_view(f.type):
            if isinstance(v, str):
                new: Any = _SURROGATE.sub("\ufffd", v)
            elif v is None:
                new = ""
            else:
                try:
                    new = json_text(v)
                except (TypeError, orjson.JSONEncodeError):
                    new = _SURROGATE.sub("\ufffd", repr(v))
            what = f"a {type(v).__name__} where text was expected; kept as its JSON text"
        else:
            new = False if not f.nullable else None
            what = f"a {type(v).__name__} value that does not fit ({f.type}); set to {new}"
        col[i] = new
        if notes is not None:
            notes.append({"file": cols["source_file"][i], "line": cols["source_line"][i],
                          "note": f"field {f.name}: {what}"})
